"""Request validation: headers, names, query parameters and bodies.

Every function either returns a clean value or raises ``BadRequest`` with a
message that says what was wrong; nothing here touches storage.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any, cast

import orjson
from aiohttp import web
from multidict import MultiMapping

from feedsvc.api import spec
from feedsvc.api.message_groups import message_group
from feedsvc.api.spec import Field, Param
from feedsvc.appkeys import AUTHENTICATOR
from feedsvc.auth.access import Identity
from feedsvc.config import Settings
from feedsvc.delivery import retry
from feedsvc.errors import (
    BadRequest,
    Conflict,
    InvalidContentType,
    PostTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from feedsvc.message_headers import message_headers
from feedsvc.storage.base import ENCRYPT_MESSAGES, NewMessage

# The patterns and limits of feedsvc.api.spec, compiled once.
QUEUE_NAME = re.compile(spec.NAME_PATTERN)
QUEUE_MARKER = re.compile(spec.QUEUE_MARKER_PATTERN)
ID = re.compile(spec.ID_PATTERN)
MAX_PROJECT_LENGTH = spec.MAX_PROJECT_LENGTH

_TRUE = frozenset(spec.TRUE)
_FALSE = frozenset(spec.FALSE)


def project_id(request: web.Request) -> str:
    project = request.headers.get("X-Project-ID")
    if project is None or project == "":
        raise BadRequest("The header X-Project-ID is required.")
    if len(project) > MAX_PROJECT_LENGTH:
        raise BadRequest(f"X-Project-ID must be at most {MAX_PROJECT_LENGTH} characters long.")
    if not project.isprintable():
        raise BadRequest("X-Project-ID must contain printable characters only.")
    return project


# Client-IDs seen lately -> their canonical form: a client sends the same one
# on every request, and parsing a UUID costs more than the rest of the
# header checks together. Bounded: emptied when full.
_CLIENT_IDS: dict[str, str] = {}
_CLIENT_IDS_KEPT = 4096


def client_id(request: web.Request) -> str:
    raw = request.headers.get("Client-ID")
    if not raw:
        raise BadRequest("The header Client-ID is required.")
    known = _CLIENT_IDS.get(raw)
    if known is not None:
        return known
    try:
        canonical = str(uuid.UUID(raw))
    except ValueError:
        raise BadRequest("Malformed hexadecimal UUID in Client-ID.") from None
    if len(_CLIENT_IDS) >= _CLIENT_IDS_KEPT:
        _CLIENT_IDS.clear()
    _CLIENT_IDS[raw] = canonical
    return canonical


FORM = "application/x-www-form-urlencoded"


def refuse_form_body(request: web.Request) -> None:
    """A body sent as a form is a 400, whatever it holds: what ``curl -d``
    sends unless told otherwise, and Zaqar's answer to it (its bug 1547100).

    Any other content type is read as JSON, as Zaqar does. A request without
    a body passes. Unlike Zaqar, which compares the whole header, parameters
    (``; charset=utf-8``) do not make a form something else.
    """
    raw = request.headers.get("Content-Type")
    if raw is not None and request.body_exists and raw.partition(";")[0].strip().lower() == FORM:
        raise InvalidContentType(
            f"Endpoint does not accept `{FORM}` content; currently supported media "
            "type is `application/json`; specify proper client-side media type with the "
            '"Content-Type" header.'
        )


#: The project of a request whose pre-signed URL headers were verified
#: (``feedsvc.api.signed_urls``); "" on every other request.
SIGNED_PROJECT = web.RequestKey("signed_project", str)


#: Who the request's bearer token speaks for (``feedsvc.api.identity``); None
#: when authentication is off, or the route is open or pre-signed.
IDENTITY: web.RequestKey[Identity | None] = web.RequestKey("identity")


#: The methods that may leave Client-ID out: reads (an EventSource cannot
#: send it). A write's Client-ID is its messages' author, so it stays required.
CLIENT_ID_OPTIONAL = ("GET", "HEAD")
#: The client id of a read without Client-ID: no message's author (every
#: post has one), so ``echo`` has nothing to hide from it.
NO_CLIENT = ""


def caller(request: web.Request, authenticate: bool = True) -> tuple[str, str]:
    """(project, client id) of a /v2 request; a form body is refused first,
    then Client-ID is checked, as Zaqar does. A GET or HEAD may leave
    Client-ID out (client id :data:`NO_CLIENT`: it sees every message, echo
    or not); one it sends must be well formed.

    With authentication on (``feedsvc.api.identity``), the project is the
    bearer token's, whatever X-Project-ID says, unless the request's
    pre-signed URL was verified: then it is the project signed for. The home
    document, which shows no data, passes authenticate=False (ping and
    health do not ask for a caller at all).
    """
    refuse_form_body(request)
    if request.method in CLIENT_ID_OPTIONAL and "Client-ID" not in request.headers:
        client = NO_CLIENT
    else:
        client = client_id(request)
    signed = request[SIGNED_PROJECT]
    if signed:
        return signed, client
    identity = request[IDENTITY]
    if identity is not None:
        return identity.project, client
    if authenticate and request.app[AUTHENTICATOR].on:  # a route the table leaves open
        raise Unauthorized("A valid 'Authorization: Bearer <token>' header is required.")
    return project_id(request), client


def rate_limited_project(request: web.Request) -> str | None:
    """The project a request counts against (``--project-rate``), as
    :func:`caller` will find it (after ``identity.authorize``); None when it
    names none it could be served for (a missing or bad X-Project-ID, no
    token where one is needed): those are answered 400 or 401 without a
    Redis call, so they need no rate."""
    signed = request[SIGNED_PROJECT]
    if signed:
        return signed
    identity = request[IDENTITY]
    if identity is not None:
        return identity.project
    if request.app[AUTHENTICATOR].on:
        return None
    project = request.headers.get("X-Project-ID")
    if not project or len(project) > MAX_PROJECT_LENGTH:
        return None
    return project


def idempotency_key(request: web.Request) -> str | None:
    """The optional Idempotency-Key header (1..255 printable characters)."""
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable():
        raise BadRequest("Idempotency-Key must be 1 to 255 printable characters.")
    return key


def feed_name(name: str, kind: str) -> str:
    """A queue's (or, kind "topic", a topic's) name: the same rule."""
    if not QUEUE_NAME.match(name):
        raise BadRequest(
            f"{kind.capitalize()} names may not be more than 64 characters long and may "
            "only contain ASCII letters, digits, underscores, dots and dashes; "
            f'"." and ".." are not {kind} names.'
        )
    return name


def text(query: Mapping[str, str], param: Param) -> str | None:
    """A string parameter as given; None when absent or empty."""
    return query.get(param.name) or None


def is_id(value: str) -> bool:
    return ID.match(value) is not None


def flag(query: Mapping[str, str], param: Param) -> bool:
    raw = query.get(param.name)
    if raw is None or raw == "":
        return param.default is True
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise BadRequest(f"The value of {param.name} must be true or false.")


# Numbers in a query are ASCII digits only: int() and float() also take
# "1_0", " 5", "+5" and other scripts' digits ("٣"), which no client means.
_WHOLE = re.compile(r"[0-9]{1,19}")
# A number of seconds as JSON writes it, unsigned ("0.5", "1e-05": what a
# client's float becomes in a URL); bounded in length before float() reads it.
_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?(?:[eE][+-]?[0-9]{1,3})?")


def integer(query: Mapping[str, str], param: Param) -> int:
    """An integer within param's bounds, in ASCII digits; its default if
    absent or empty."""
    raw = query.get(param.name)
    if raw is None or raw == "":
        return cast(int, param.default)
    low, high = cast(int, param.minimum), cast(int, param.maximum)
    if _WHOLE.fullmatch(raw) is None or not low <= (value := int(raw)) <= high:
        raise BadRequest(
            f"The value of {param.name} must be an integer (ASCII digits) from {low} to {high}."
        )
    return value


MAX_WAIT = spec.MAX_WAIT


def wait_seconds(query: Mapping[str, str], param: Param) -> float:
    """``wait``: 0 (default, no waiting) to MAX_WAIT seconds, decimals allowed."""
    raw = query.get(param.name)
    if raw is None or raw == "":
        return 0.0
    high = cast(float, param.maximum)
    if _SECONDS.fullmatch(raw) is None or not 0 <= (seconds := float(raw)) <= high:
        raise BadRequest(
            f"The value of {param.name} must be a number of seconds from 0 to {high:g}, "
            'in ASCII digits with an optional decimal point (e.g. "2.5").'
        )
    return seconds


#: What a message marker looks like (a sequence number); one given out is
#: also at most the queue's counter, which the store checks as it reads.
MARKER = re.compile(spec.MARKER_PATTERN)


def message_marker(query: Mapping[str, str], param: Param) -> int | None:
    raw = query.get(param.name)
    if raw is None or raw == "":
        return None
    if MARKER.fullmatch(raw) is None:
        raise BadRequest("The marker is not one this service gave out.")
    return int(raw)


def from_tail(query: Mapping[str, str], param: Param, marker: Param) -> bool:
    """Whether ``from=tail`` asks to start after the queue's last message
    (new messages only); from takes no other value, and no marker with it:
    both say where to start."""
    raw = query.get(param.name)
    if raw is None or raw == "":
        return False
    if raw not in (param.enum or ()):
        raise BadRequest("The value of from must be tail (new messages only).")
    if query.get(marker.name):
        raise BadRequest("Give from=tail or a marker, not both: each says where to start.")
    return True


# -- content negotiation -----------------------------------------------------------

# One media range of an Accept header and its parameters (RFC 9110 12.5.1);
# a weight is "q=" 0 to 1 with at most three decimals.
_WEIGHT = re.compile(r"(?:0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?)")


def accepted(header: str) -> dict[str, float]:
    """The media ranges of an Accept header ("text/event-stream", "*/*", ...,
    lower case) and their weights. A range whose weight is malformed is left
    out, as one the client did not send; if a range is listed twice, the
    first counts."""
    ranges: dict[str, float] = {}
    for item in header.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        media = media.lower()
        if "/" not in media:
            continue
        weight: float | None = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                value = value.strip()
                weight = float(value) if _WEIGHT.fullmatch(value) else None
                break
        if weight is not None:
            ranges.setdefault(media, weight)
    return ranges


def prefers(header: str | None, wanted: str, default: str) -> bool:
    """Whether a request with this Accept header asks for ``wanted``, which it
    must name itself (no wildcard opts in) with a weight above 0 and at least
    that of ``default`` (which ranges such as ``*/*`` may match)."""
    if not header:
        return False
    ranges = accepted(header)
    weight = ranges.get(wanted, 0.0)
    if weight <= 0:
        return False
    kind = default.split("/", maxsplit=1)[0]
    for media in (default, f"{kind}/*", "*/*"):  # the most specific range counts
        if media in ranges:
            return weight >= ranges[media]
    return True


def queue_marker(query: Mapping[str, str], param: Param) -> str | None:
    raw = query.get(param.name)
    if raw is None or raw == "":
        return None
    if not QUEUE_MARKER.match(raw):
        raise BadRequest("The marker must be a queue name.")
    return raw


def id_list(query: MultiMapping[str], param: Param) -> list[str] | None:
    """Ids given as ``?ids=a,b`` or ``?ids=a&ids=b`` (python-zaqarclient's way),
    at most param's maximum.

    Malformed ids are kept: they match nothing.
    """
    name, most = param.name, cast(int, param.maximum)
    if name not in query:  # nearly every request: skip getall()'s list
        return None
    values = [raw for raw in query.getall(name) if raw]
    if not values:
        return None
    ids = [part for raw in values for part in raw.split(",") if part]
    if not ids:
        raise BadRequest(f"The value of {name} must list at least one id.")
    if len(ids) > most:
        raise BadRequest(f"The value of {name} may list at most {most} ids.")
    return ids


# -- JSON documents --------------------------------------------------------------
#
# Two limits of orjson shape what a client's JSON may be:
#
# * It encodes at most ORJSON_MAX_DEPTH nested arrays and objects. A message
#   body or queue metadata may nest MAX_JSON_DEPTH levels, fewer than that, so
#   that a response that shows metadata inside other objects (the detailed
#   queue list, three levels down) can still be encoded. A value that could
#   be that deep (enough bytes and brackets) is encoded again wrapped in the
#   difference, so that orjson's own limit enforces ours.
# * It reads integers only within 64 bits (-2**63 .. 2**64-1): longer ones
#   become floats, and those beyond a double's range are refused. Zaqar keeps
#   them, and so do we in message bodies: a document that may hold one (it
#   has a run of 19 digits) is read by the stdlib instead, which keeps
#   integers exactly, and such a body is encoded by the stdlib too. Queue
#   metadata is re-encoded by the store with orjson, so there they are a 400.

ORJSON_MAX_DEPTH = 254
MAX_JSON_DEPTH = 250
_DEPTH_PADDING = ORJSON_MAX_DEPTH - MAX_JSON_DEPTH
# Each digit becomes "0" and every other byte a space: a run of 19 digits is
# the only way to write an integer beyond 64 bits (also matched: such runs in
# strings and floats, which merely take the slower, exact path).
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19
_LONG_DIGIT_RUNS = re.compile(rb"[0-9]{19,}")


def _may_hold_long_integers(raw: bytes) -> bool:
    return _LONG_RUN in raw.translate(_DIGITS_ONLY)


def _too_deep(what: str) -> BadRequest:
    return BadRequest(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.")


def _not_json(exc: ValueError) -> BadRequest:
    if "depth" in str(exc):  # orjson reads at most 1024 levels
        return _too_deep("The request body")
    return BadRequest("The request body is not valid JSON.")


def json_document(raw: bytes) -> Any:
    if not raw:
        raise BadRequest("The request body is empty; a JSON document is required.")
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if not _may_hold_long_integers(raw):
            raise _not_json(exc) from None
    else:
        if not _may_hold_long_integers(raw):
            return document
    return _read_exactly(raw)


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BadRequest(f"The number {text[:40]} is out of range.")
    return value


def _read_exactly(raw: bytes) -> Any:
    """A document read by the stdlib, integers of any size kept exactly."""
    try:
        # The stdlib is looser than orjson (it takes NaN, lone surrogates,
        # UTF-16, a byte order mark): orjson judges the syntax, on the text
        # with each long digit run shortened to one digit.
        orjson.loads(_LONG_DIGIT_RUNS.sub(b"0", raw))
        return json.loads(raw.decode(), parse_float=_finite)
    except ValueError as exc:  # either parser's JSONDecodeError (e.g. "007" to the stdlib)
        raise _not_json(exc) from None
    except RecursionError:
        raise _too_deep("The request body") from None


def json_depth(value: Any) -> int:
    """How many arrays and objects nest in value (0 for a scalar)."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (list, dict))]:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _encoded(value: Any, what: str) -> bytes | None:
    """value as compact JSON; None if it holds an integer beyond 64 bits.

    BadRequest if it nests deeper than MAX_JSON_DEPTH.
    """
    try:
        encoded = orjson.dumps(value)
    except orjson.JSONEncodeError:
        # deeper than orjson goes, or an integer beyond its 64 bits
        if json_depth(value) > MAX_JSON_DEPTH:
            raise _too_deep(what) from None
        return None
    # n levels take 2n bytes and n opening brackets: most values are too
    # small to be too deep, and need no second look
    if (
        len(encoded) > 2 * MAX_JSON_DEPTH
        and encoded.count(b"[") + encoded.count(b"{") > MAX_JSON_DEPTH
        and _deeper_than_allowed(value)
    ):
        raise _too_deep(what)
    return encoded


def _deeper_than_allowed(value: Any) -> bool:
    """Whether a value orjson encodes nests deeper than MAX_JSON_DEPTH.

    Wrapped in the difference, it makes orjson's own limit ours.
    """
    wrapped = value
    for _ in range(_DEPTH_PADDING):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        return True
    return False


def message_body(value: Any) -> bytes:
    """A message body as the JSON to store: exactly its value, big integers too."""
    encoded = _encoded(value, "A message body")
    if encoded is None:
        encoded = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    return encoded


def _int_field(entry: Mapping[str, Any], field: Field) -> int | None:
    name = field.name
    if name not in entry:
        return None
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"The {field.owner} {name} must be an integer.")
    if not field.minimum <= value <= field.maximum:
        raise BadRequest(
            f"The {field.owner} {name} must be at least {field.minimum} "
            f"and at most {field.maximum} seconds."
        )
    return value


def new_messages(document: Any, settings: Settings) -> list[NewMessage]:
    """The messages of a POST body ``{"messages": [{"body", "ttl", "delay",
    "headers", "group"}]}``; any message that breaks a rule fails the whole post."""
    entries = document.get("messages") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise BadRequest('The request body must be an object with a "messages" list.')
    if not entries:
        raise BadRequest("No messages were found in the request body.")
    rules = spec.rules(settings)
    if len(entries) > rules.messages_per_post:
        raise BadRequest(f"No more than {rules.messages_per_post} messages may be posted at once.")
    out = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise BadRequest("Each message must be a JSON object.")
        if "body" not in entry:
            raise BadRequest('Each message must have a "body".')
        ttl = _int_field(entry, rules.message_ttl)
        delay = _int_field(entry, rules.message_delay)
        headers = message_headers(entry["headers"]) if "headers" in entry else b""
        group = message_group(entry["group"]) if "group" in entry else ""
        out.append(NewMessage(message_body(entry["body"]), ttl, delay, headers, group))
    return out


def post_too_large(settings: Settings) -> PostTooLarge:
    """A message post over the service's size limit, in Zaqar's words."""
    limit = spec.rules(settings).post_size
    return PostTooLarge(f"Message collection size is too large. Max size: {limit}")


def post_length(request: web.Request, settings: Settings) -> None:
    """A message post's declared length, checked before its body is read
    (a chunked body is measured while it streams in: see ``read_body``)."""
    if request.content_length is not None and (
        request.content_length > spec.rules(settings).post_size
    ):
        raise post_too_large(settings)


MAX_METADATA_SIZE = 65536
JSON_PATCH = "application/openstack-messaging-v2.0-json-patch"


def _metadata_size(size: int) -> None:
    if size > MAX_METADATA_SIZE:
        raise BadRequest(f"Queue metadata is too large. Max size: {MAX_METADATA_SIZE}")


def metadata_length(request: web.Request) -> None:
    """A queue PUT's or PATCH's declared length, checked before the body is
    read, as Zaqar does: over the metadata limit is a 400 however large the
    body (not the 413 of a body over the post size limit)."""
    if request.content_length is not None:
        _metadata_size(request.content_length)


def queue_metadata(raw: bytes, settings: Settings) -> dict[str, Any]:
    """The metadata of a queue PUT; an empty body means none.

    As in Zaqar, the size limit applies to the body as sent, whitespace
    included, and a body of whitespace alone is not JSON (a 400).
    """
    _metadata_size(len(raw))
    if not raw:
        return {}
    document = json_document(raw)
    if not isinstance(document, dict):
        raise BadRequest("Queue metadata must be a JSON object.")
    return checked_metadata(document, settings, size=len(raw))


def _reserved_int(metadata: Mapping[str, Any], field: Field) -> None:
    value = metadata.get(field.name)
    if value is None:
        return
    low, high = field.minimum, field.maximum
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{field.name} must be an integer from {low} to {high}.")


def checked_metadata(
    metadata: dict[str, Any], settings: Settings, size: int | None = None
) -> dict[str, Any]:
    """Validate depth, integers, size and the reserved settings that feedsvc honours.

    size is the bytes the client sent (a PUT body); metadata a PATCH made is
    measured as stored, compact, so that patches cannot grow it without bound.
    """
    encoded = _encoded(metadata, "Queue metadata")
    if encoded is None:
        raise BadRequest(
            "Queue metadata may hold integers from -2**63 to 2**64-1 only (64 bits); "
            "write larger ones as strings."
        )
    _metadata_size(len(encoded) if size is None else size)
    for field in spec.rules(settings).metadata:
        _reserved_int(metadata, field)
    dlq = metadata.get("_dead_letter_queue")
    if dlq is not None and (not isinstance(dlq, str) or not QUEUE_NAME.match(dlq)):
        raise BadRequest("_dead_letter_queue must be a queue name.")
    encrypt = metadata.get(ENCRYPT_MESSAGES)
    if encrypt is not None and not isinstance(encrypt, bool):
        raise BadRequest(f"{ENCRYPT_MESSAGES} must be boolean.")
    if encrypt and settings.message_encryption_key is None:
        # Zaqar would encrypt under its default key ("AES256"): a promise of
        # secrecy it cannot keep. Say so instead.
        raise BadRequest(
            f"This service has no message encryption key: {ENCRYPT_MESSAGES} "
            "cannot be true (the operator sets --message-encryption-key)."
        )
    retry.parse(metadata)  # the subscriptions' default (Zaqar checks it here too)
    return metadata


def metadata_patch(request: web.Request, raw: bytes) -> list[dict[str, Any]]:
    """A json-patch document of add/remove/replace operations on /metadata/<key>.

    Its body is held to the metadata size limit first, as Zaqar does.
    """
    _metadata_size(len(raw))
    if request.content_type != JSON_PATCH:
        raise UnsupportedMediaType(f"Accepted media type for PATCH: {JSON_PATCH}.")
    if not raw.strip():
        raise BadRequest("PATCH body could not be empty for update.")
    document = json_document(raw)
    if not isinstance(document, list):
        raise BadRequest("A json-patch body must be a list of operations.")
    for op in document:
        if not isinstance(op, dict) or op.get("op") not in ("add", "remove", "replace"):
            raise BadRequest("Each operation must be add, remove or replace.")
        path = op.get("path")
        if not isinstance(path, str) or not path.startswith("/metadata/") or path == "/metadata/":
            raise BadRequest(f"Invalid JSON pointer for this resource: {path!r}, e.g /metadata/key")
        if op["op"] != "remove" and "value" not in op:
            raise BadRequest(f'Operation "{op["op"]}" requires a member named "value".')
    return document


def apply_patch(metadata: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply a validated metadata patch; Conflict on replace/remove of a missing key.

    Reserved keys (leading underscore) may be removed or replaced when unset:
    python-zaqarclient removes every key it was shown, defaults included.
    """
    updated = dict(metadata)
    for op in patch:
        key = op["path"][len("/metadata/") :]
        if op["op"] in ("remove", "replace") and key not in updated and not key.startswith("_"):
            raise Conflict(f"Can't {op['op']} non-existent object {key}.")
        if op["op"] == "remove":
            updated.pop(key, None)
        else:
            updated[key] = op["value"]
    return updated


def claim_options(raw: bytes, settings: Settings) -> tuple[int, int]:
    """(ttl, grace) of a claim POST or PATCH; missing fields take the defaults."""
    document = json_document(raw) if raw.strip() else {}
    if not isinstance(document, dict):
        raise BadRequest("A claim body must be a JSON object.")
    rules = spec.rules(settings)
    ttl = _int_field(document, rules.claim_ttl)
    grace = _int_field(document, rules.claim_grace)
    return (
        cast(int, rules.claim_ttl.default) if ttl is None else ttl,
        cast(int, rules.claim_grace.default) if grace is None else grace,
    )


def release_delay(raw: bytes, settings: Settings) -> int:
    """The delay of a release of one message, ``{"delay": S}``: 0 (claimable
    again at once) when the body or the field is missing."""
    document = json_document(raw) if raw.strip() else {}
    if not isinstance(document, dict):
        raise BadRequest("A release body must be a JSON object.")
    field = spec.rules(settings).release_delay
    delay = _int_field(document, field)
    return cast(int, field.default) if delay is None else delay


PURGE_TYPES = ("messages", "subscriptions")


def purge_types(raw: bytes) -> list[str]:
    """The resource types a purge names; an empty body means all of them."""
    if not raw.strip():
        return list(PURGE_TYPES)
    document = json_document(raw)
    types = document.get("resource_types") if isinstance(document, dict) else None
    if not isinstance(types, list) or not types:
        raise BadRequest('Post body must contain key "resource_types".')
    if not all(isinstance(t, str) and t in PURGE_TYPES for t in types):
        raise BadRequest('resource_types may list only "messages" and "subscriptions".')
    return types
