"""The OpenAPI description of what issue 32 gave consumers: message headers
and ordered groups.

A part of the document (``feedsvc.api.openapi``) that changes the message
parts before it: the ``MessageHeaders`` schema, and a
``headers`` property on every message schema a client posts or reads
(``NewMessage``, ``Message``, a popped message), the ``MessageGroup``
schema and a ``group`` property on the same schemas, plus the W3C
``traceparent`` / ``tracestate`` request headers of a post
(docs/consumers.md#message-headers, #tracing).
"""

from __future__ import annotations

from feedsvc.api.message_groups import GROUP_PATTERN, MAX_GROUP_LENGTH
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import Settings
from feedsvc.message_headers import (
    MAX_HEADERS,
    MAX_HEADERS_SIZE,
    NAME,
    TRACEPARENT_PATTERN,
    TRACESTATE_PATTERN,
)

NO_CONTROLS = "^[^\\u0000-\\u001f\\u007f]*$"


def headers_schema(stored: bool) -> Schema:
    """The headers as posted (names in any case) or as returned (lower case)."""
    name = NAME.pattern if not stored else NAME.pattern.replace("A-Za-z", "a-z")
    return {
        "type": "object",
        "description": (
            "A feedsvc extension: the message's headers, strings by name. "
            f"At most {MAX_HEADERS}, {MAX_HEADERS_SIZE} bytes as JSON; names are "
            "case-insensitive and stored lower-cased (two that differ only in case "
            "are a 400); values hold no control characters; traceparent and "
            "tracestate follow W3C Trace Context. Present only when the message has "
            "headers. They are not encrypted, even in an encrypted queue."
        ),
        "maxProperties": MAX_HEADERS,
        "propertyNames": {"pattern": f"^{name}$"},
        "properties": {
            "traceparent": {"type": "string", "pattern": f"^{TRACEPARENT_PATTERN}$"},
            "tracestate": {"type": "string", "pattern": f"^{TRACESTATE_PATTERN}$"},
        },
        "additionalProperties": {"type": "string", "pattern": NO_CONTROLS},
    }


def group_schema() -> Schema:
    """A message's ordered group, as posted and as returned."""
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_GROUP_LENGTH,
        "pattern": f"^{GROUP_PATTERN}$",
        "description": (
            "A feedsvc extension: the message's ordered group, 1 to "
            f"{MAX_GROUP_LENGTH} printable ASCII characters other than the space. "
            "Messages of one group are claimed and popped in post order, and at most "
            "one claim at a time holds messages of a group (docs/consumers.md, "
            "Ordered groups). Present only when the message has one; kept by "
            "dead-lettering and redrive. Topics store and return it (they have no claims)."
        ),
    }


def add(document: Document, s: Settings) -> None:
    """Add the headers schemas to document's message schemas and the trace
    context headers to the post of messages."""
    components = document["components"]
    schemas = components["schemas"]
    schemas["MessageHeaders"] = headers_schema(stored=False)
    schemas["StoredMessageHeaders"] = headers_schema(stored=True)
    posted = {"$ref": "#/components/schemas/MessageHeaders"}
    stored = {"$ref": "#/components/schemas/StoredMessageHeaders"}
    schemas["NewMessage"]["properties"]["headers"] = posted
    schemas["Message"]["properties"]["headers"] = stored
    popped = schemas["PoppedMessages"]["properties"]["messages"]["items"]["properties"]
    popped["headers"] = stored
    schemas["MessageGroup"] = group_schema()
    group = {"$ref": "#/components/schemas/MessageGroup"}
    for shown in (schemas["NewMessage"], schemas["Message"]):
        shown["properties"]["group"] = group
    popped["group"] = group
    trace = [
        {
            "name": "traceparent",
            "in": "header",
            "required": False,
            "description": "W3C Trace Context. With tracing on, the publish span's "
            "parent, and its context is stored in the headers of each posted message "
            "that has no traceparent of its own, so consumers can link to the producer; "
            "ignored if malformed, and not read with tracing off.",
            "schema": {"type": "string"},
        },
        {
            "name": "tracestate",
            "in": "header",
            "required": False,
            "description": "W3C Trace Context, stored with the traceparent above.",
            "schema": {"type": "string"},
        },
    ]
    for path, item in document["paths"].items():
        operation = item.get("post")
        if path.endswith("/messages") and operation is not None:
            operation.setdefault("parameters", []).extend(trace)
