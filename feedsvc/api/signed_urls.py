"""Pre-signed URLs, made and checked as Zaqar does (``zaqar/common/urls.py``).

``POST /v2/queues/{q}/share`` with ``{"paths", "methods", "expires"}``
answers ``{"paths", "methods", "project", "expires", "signature"}``: the
signature is HMAC-SHA256, keyed by ``--signed-url-key``, over the text
``<paths>\\n<methods>\\n<project>\\n<expires>`` (each list sorted and joined
by commas, the two characters backslash and n between the parts, expires
in UTC to the second, ``%Y-%m-%dT%H:%M:%S``). The text is Zaqar's byte for
byte, so a URL one of the two signed works on the other given the same key.

Whoever holds the answer sends it back as ``URL-Signature``, ``URL-Paths``,
``URL-Methods`` and ``URL-Expires``, with the project as ``X-Project-ID``
(and a Client-ID, as every /v2 request): such a request is served with no
bearer token, for those methods and for those paths and what lies below them
(a messages path covers each message), until it expires.

A request that carries any ``URL-*`` header is checked by
:func:`mark_signed` before anything else, and is 404 (as in Zaqar)
unless the signature holds for its method and path: a missing, wrong or
expired signature, another path or method, a service without a key, all the
same. It is never served as if it were unsigned.

A browser's ``EventSource`` sends no headers of its own, so a GET or HEAD
may carry the same parts in its query string under the same names
(``URL-Signature``, ``URL-Expires``, ``URL-Methods``, ``URL-Paths``,
``X-Project-ID``). That form is feedsvc's, not Zaqar's: it is refused with
a 403 that says why (any other method; parts that do not hold), and parts
in both the headers and the query are a 400. The access log never shows
their values (``feedsvc.api.query_secrets``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from feedsvc.api import handlers as h
from feedsvc.api import validation as v
from feedsvc.api.feeds import Feed
from feedsvc.appkeys import CLOCK, SETTINGS
from feedsvc.errors import BadRequest, FeedError, Forbidden, NotFound

#: The request headers of a pre-signed URL (any one of them makes a request signed).
SIGNED_HEADERS = ("URL-Signature", "URL-Expires", "URL-Methods", "URL-Paths")
#: The methods a pre-signed URL in the query string is honoured for: reads,
#: what an EventSource or a link does (a write sends headers).
QUERY_METHODS = ("GET", "HEAD")
#: What a URL may be made for, below its queue (Zaqar's list).
SHARE_PATHS = ("messages", "subscriptions", "claims")
#: The methods a URL may allow: those feedsvc's routes answer.
METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")
#: Zaqar's format of expires, in the signed text and in the answer.
DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"
#: How long a URL lasts when the request names no expiry (Zaqar's default).
DEFAULT_LIFETIME = dt.timedelta(days=1)
_SHARE_KEYS = frozenset(("paths", "methods", "expires"))


def signature(
    key: str, paths: Sequence[str], methods: Sequence[str], project: str, expires: str
) -> str:
    """The hex HMAC-SHA256 Zaqar's ``create_signed_url`` makes."""
    text = "\\n".join((",".join(sorted(paths)), ",".join(sorted(methods)), project, expires))
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def expiry(value: Any, now: dt.datetime) -> str:
    """An ISO 8601 time as it is signed: in UTC (a time without an offset is
    UTC), to the second. ValueError if it is no such time or not after now
    (a naive UTC datetime)."""
    if not isinstance(value, str):
        raise ValueError("`expires` must be a date and time, e.g. 2016-01-01T00:00:00.")
    try:
        int(value)
    except ValueError:
        pass
    else:  # Zaqar's check: a number of seconds is a common mistake
        raise ValueError(f"`expires` should be a date and time, not an integer: {value}")
    try:
        when = dt.datetime.fromisoformat(value)
        if when.tzinfo is not None:
            when = when.astimezone(dt.UTC).replace(tzinfo=None)
    except (ValueError, OverflowError):
        raise ValueError(
            f"`expires` must be a date and time, e.g. 2016-01-01T00:00:00, not {value[:40]!r}."
        ) from None
    if when <= now:
        raise ValueError("`expires` is lower than the current time.")
    return when.strftime(DATE_FORMAT)


def _now(request: web.Request) -> dt.datetime:
    """The app clock's now, as a naive UTC datetime (as Zaqar compares)."""
    seconds = request.app[CLOCK].now_ms() / 1000
    return dt.datetime.fromtimestamp(seconds, dt.UTC).replace(tzinfo=None)


def _covers(signed_path: str, path: str) -> bool:
    """A signed path covers itself and what lies below it. Zaqar matches it
    as a regular expression instead, where the dot of a queue name "a.b"
    also matches "aXb": another queue of the project."""
    return bool(signed_path) and (path == signed_path or path.startswith(signed_path + "/"))


def verified_project(
    request: web.Request,
    parts: Mapping[str, str] | None = None,
    refused: type[FeedError] = NotFound,
) -> str:
    """The project of a request whose URL-* parts (its headers, or parts: its
    query) allow it; else refused (404 for headers, as in Zaqar). In the
    query, a URL signed for GET covers HEAD too (what a browser's link
    checker or a probe sends)."""
    method = request.method
    if parts is None:
        parts = request.headers
    elif method == "HEAD":
        method = "GET"
    key = request.app[SETTINGS].signed_url_key
    given = parts.get("URL-Signature", "")
    project = parts.get("X-Project-ID", request.headers.get("X-Project-ID"))
    methods = parts.get("URL-Methods", "").split(",")
    paths = parts.get("URL-Paths", "").split(",")
    if key is None:
        raise refused("Pre-signed URLs are off here: the service has no --signed-url-key.")
    if method not in methods or not any(_covers(p, request.path) for p in paths):
        raise refused(f"The pre-signed URL does not allow {request.method} {request.path}.")
    try:
        expires = expiry(parts.get("URL-Expires"), _now(request))
    except ValueError:
        raise refused("The pre-signed URL has expired, or its URL-Expires is malformed.") from None
    if not given or project is None:
        raise refused("A pre-signed URL needs URL-Signature and X-Project-ID.")
    expected = signature(key, paths, methods, project, expires)
    if not hmac.compare_digest(given.encode(errors="surrogateescape"), expected.encode()):
        raise refused("The pre-signed URL's signature does not match.")
    return project


def signed_in_query(query: Mapping[str, str]) -> bool:
    """Whether a query string carries any part of a pre-signed URL."""
    return (
        "URL-Signature" in query
        or "URL-Paths" in query
        or "URL-Methods" in query
        or "URL-Expires" in query
    )


def mark_signed(request: web.Request) -> None:
    """Checks a signed request before its handler runs (404 unless it holds;
    403 for the query-string form), and marks it for ``validation.caller``
    (which then asks for no bearer token). Run by ``feedsvc.api.middleware``
    on every request."""
    headers = request.headers
    # spelt out: cheaper than a loop, on every request
    in_headers = (
        "URL-Signature" in headers
        or "URL-Paths" in headers
        or "URL-Methods" in headers
        or "URL-Expires" in headers
    )
    # the query is looked into only when its raw text names a URL-* part
    # (however its '-' is encoded): most queries do not, and this costs
    # one substring search
    in_query = "URL" in request.rel_url.raw_query_string and signed_in_query(request.query)
    if in_headers and in_query:
        raise BadRequest(
            "A pre-signed URL's parts come either as headers or in the query string, not both."
        )
    if in_headers:
        request[v.SIGNED_PROJECT] = verified_project(request)
    elif in_query:
        if request.method not in QUERY_METHODS:
            raise Forbidden(
                "A pre-signed URL in the query string is accepted for GET and HEAD only; "
                "send its parts as URL-* headers."
            )
        request[v.SIGNED_PROJECT] = verified_project(request, request.query, Forbidden)
    else:
        # always set: validation.caller reads it as request[...], and a
        # request.get() of a missing key raises (and catches) a KeyError
        request[v.SIGNED_PROJECT] = ""  # no project is empty


def _string_list(document: dict[str, Any], name: str, allowed: Sequence[str]) -> list[str] | None:
    """The list document[name] (None when absent or empty), each item one of allowed."""
    value = document.get(name)
    if not value:
        return None
    if not isinstance(value, list) or not all(isinstance(i, str) and i in allowed for i in value):
        raise BadRequest(f"`{name}` must be a list of {', '.join(allowed)}.")
    return value


async def share_queue(request: web.Request, feed: Feed) -> web.Response:
    """POST .../share: a pre-signed URL for the queue's messages (or the
    paths named), in the caller's project."""
    project = feed.project
    document = v.json_document(await h.read_body(request))
    if not isinstance(document, dict):
        raise BadRequest("The request body must be a JSON object.")
    unknown = set(document) - _SHARE_KEYS
    if unknown:
        raise BadRequest(f"Unknown keys: {', '.join(sorted(unknown))}.")
    names = _string_list(document, "paths", SHARE_PATHS) or ["messages"]
    methods = _string_list(document, "methods", METHODS) or ["GET"]
    now = _now(request)
    try:
        raw = document.get("expires")
        expires = (
            (now + DEFAULT_LIFETIME).strftime(DATE_FORMAT) if raw is None else expiry(raw, now)
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    key = request.app[SETTINGS].signed_url_key
    if key is None:
        # Zaqar's status too ("The `key` can't be None")
        raise BadRequest("Pre-signed URLs are off here: the service has no --signed-url-key.")
    paths = sorted(f"{feed.path}/{name}" for name in names)
    return h.json_response(
        {
            "paths": paths,
            "methods": sorted(methods),
            "project": project,
            "expires": expires,
            "signature": signature(key, paths, methods, project, expires),
        }
    )
