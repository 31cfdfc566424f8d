"""Request validation: headers, names, query parameters and bodies.

Every function either returns a clean value or raises ``BadRequest`` with a
message that says what was wrong; nothing here touches storage.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web
from multidict import MultiMapping

from feedsvc.config import Settings
from feedsvc.errors import BadRequest
from feedsvc.storage.base import NewMessage

QUEUE_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
# Ids are made by the service (24 lowercase hex digits); anything else cannot
# exist, which also keeps every id from forming another key.
ID = re.compile(r"^[0-9a-f]{24}$")
MAX_PROJECT_LENGTH = 256

_TRUE = frozenset(("true", "1", "yes", "on", "y", "t"))
_FALSE = frozenset(("false", "0", "no", "off", "n", "f"))


def project_id(request: web.Request) -> str:
    project = request.headers.get("X-Project-ID")
    if project is None or project == "":
        raise BadRequest("The header X-Project-ID is required.")
    if len(project) > MAX_PROJECT_LENGTH:
        raise BadRequest(f"X-Project-ID must be at most {MAX_PROJECT_LENGTH} characters long.")
    if not project.isprintable():
        raise BadRequest("X-Project-ID must contain printable characters only.")
    return project


def client_id(request: web.Request) -> str:
    raw = request.headers.get("Client-ID")
    if not raw:
        raise BadRequest("The header Client-ID is required.")
    try:
        return str(uuid.UUID(raw))
    except ValueError:
        raise BadRequest("Malformed hexadecimal UUID in Client-ID.") from None


def caller(request: web.Request) -> tuple[str, str]:
    """(project, client id) of a /v2 request; Client-ID is checked first, as Zaqar does."""
    client = client_id(request)
    return project_id(request), client


def queue_name(request: web.Request) -> str:
    name = request.match_info["queue"]
    if not QUEUE_NAME.match(name):
        raise BadRequest(
            "Queue names may not be more than 64 characters long and may only "
            "contain ASCII letters, digits, underscores, dots and dashes."
        )
    return name


def is_id(value: str) -> bool:
    return ID.match(value) is not None


def flag(query: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise BadRequest(f"The value of {name} must be true or false.")


def bounded_int(query: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"The value of {name} must be an integer.") from None
    if not low <= value <= high:
        raise BadRequest(f"The value of {name} must be at least {low} and at most {high}.")
    return value


def message_marker(query: Mapping[str, str]) -> int | None:
    raw = query.get("marker")
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or len(raw) > 19:
        raise BadRequest("The marker is not one this service gave out.")
    return int(raw)


def queue_marker(query: Mapping[str, str]) -> str | None:
    raw = query.get("marker")
    if raw is None or raw == "":
        return None
    if not QUEUE_NAME.match(raw):
        raise BadRequest("The marker must be a queue name.")
    return raw


def id_list(query: MultiMapping[str], name: str, most: int) -> list[str] | None:
    """Ids given as ``?ids=a,b`` or ``?ids=a&ids=b`` (python-zaqarclient's way).

    Malformed ids are kept: they match nothing.
    """
    values = query.getall(name, [])
    if not values:
        return None
    ids = [part for raw in values for part in raw.split(",") if part]
    if not ids:
        raise BadRequest(f"The value of {name} must list at least one id.")
    if len(ids) > most:
        raise BadRequest(f"The value of {name} may list at most {most} ids.")
    return ids


def json_document(raw: bytes) -> Any:
    if not raw:
        raise BadRequest("The request body is empty; a JSON document is required.")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("The request body is not valid JSON.") from None


def _int_field(entry: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    if name not in entry:
        return None
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"The message {name} must be an integer.")
    if not low <= value <= high:
        raise BadRequest(f"The message {name} must be at least {low} and at most {high} seconds.")
    return value


def new_messages(document: Any, settings: Settings) -> list[NewMessage]:
    """The messages of a POST body ``{"messages": [{"body", "ttl", "delay"}]}``."""
    entries = document.get("messages") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise BadRequest('The request body must be an object with a "messages" list.')
    if not entries:
        raise BadRequest("No messages were found in the request body.")
    if len(entries) > settings.max_messages_per_post:
        raise BadRequest(
            f"No more than {settings.max_messages_per_post} messages may be posted at once."
        )
    out = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise BadRequest("Each message must be a JSON object.")
        if "body" not in entry:
            raise BadRequest('Each message must have a "body".')
        ttl = _int_field(entry, "ttl", settings.min_message_ttl, settings.max_message_ttl)
        delay = _int_field(entry, "delay", 0, settings.max_message_delay)
        out.append(NewMessage(orjson.dumps(entry["body"]), ttl, delay))
    return out


MAX_METADATA_SIZE = 65536


def queue_metadata(raw: bytes) -> dict[str, Any]:
    """The metadata of a queue PUT; an empty body means none."""
    if not raw.strip():
        return {}
    if len(raw) > MAX_METADATA_SIZE:
        raise BadRequest(f"Queue metadata is too large. Max size: {MAX_METADATA_SIZE}")
    document = json_document(raw)
    if not isinstance(document, dict):
        raise BadRequest("Queue metadata must be a JSON object.")
    return document
