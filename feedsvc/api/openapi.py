"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /v2/openapi.json``.

The document is built from the running service's :class:`~feedsvc.config.Settings`,
so every bound it states (page sizes, ttls, delays, post size, messages per
post) is the one the service enforces; with no flags these are the Settings
defaults, i.e. Zaqar's. Headers, names and ids are described with the same
patterns ``feedsvc.api.validation`` checks.

``tests/test_openapi.py`` keeps it true: every route of
``feedsvc.api.routes.ROUTES`` is described here and nothing else is, and the
live service is fuzzed against this document (no 5xx, every response as
described).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import orjson
from aiohttp import web

from feedsvc import __version__
from feedsvc.api import signed_urls
from feedsvc.api import validation as v
from feedsvc.api.openapi_admin import ADMIN_PREFIX, add_admin
from feedsvc.api.openapi_consumers import add_consumers
from feedsvc.api.openapi_redrive import add_redrive
from feedsvc.api.openapi_subscriptions import add_subscriptions
from feedsvc.appkeys import SETTINGS
from feedsvc.config import DRIVER_NAMES, MAX_QUOTA, Settings
from feedsvc.storage.base import RESERVED_FIELDS

OPENAPI_VERSION = "3.1.0"
JSON = "application/json"
# Zaqar's default claim limit, capped by the configured maximum (handlers.post_claim).
ZAQAR_DEFAULT_CLAIM_LIMIT = 10

Schema = dict[str, Any]


def _ref(kind: str, name: str) -> Schema:
    return {"$ref": f"#/components/{kind}/{name}"}


def _schema(name: str) -> Schema:
    return _ref("schemas", name)


def _obj(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    """A JSON object with exactly these properties."""
    schema: Schema = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _int(low: int | None = None, high: int | None = None, default: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    if default is not None:
        schema["default"] = default
    return schema


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": schema,
        "description": description,
    }


def _flag(name: str, description: str) -> Schema:
    return _query(
        name,
        {"type": "boolean", "default": False},
        description + " Also accepted: 1/0, yes/no, on/off, y/n, t/f, in any case.",
    )


def _schemas(s: Settings) -> dict[str, Schema]:
    any_json: Schema = {
        "description": "Any JSON value, returned exactly as posted (integers of any size "
        f"too), nesting arrays and objects at most {v.MAX_JSON_DEPTH} levels deep."
    }
    metadata_path: Schema = {"type": "string", "pattern": "^/metadata/.+"}
    message_id: Schema = {"type": "string", "pattern": v.ID.pattern}
    link = _obj(
        {"rel": {"type": "string", "enum": ["next"]}, "href": {"type": "string"}},
        ["rel", "href"],
    )
    message = _obj(
        {
            "id": message_id,
            "href": {
                "type": "string",
                "description": "Relative; carries ?claim_id= while a live claim holds it.",
            },
            "ttl": _int(1),
            "age": _int(0),
            "body": any_json,
            "claim_count": {
                **_int(1),
                "description": "Only while a live claim holds it: how often it was claimed, "
                "this claim included (a feedsvc extension; Zaqar clients ignore it).",
            },
        },
        ["id", "href", "ttl", "age", "body"],
    )
    summary = _obj(
        {
            "id": message_id,
            "href": {"type": "string"},
            "age": _int(0),
            "created": {"type": "string", "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$"},
        },
        ["id", "href", "age", "created"],
    )
    return {
        "Error": _obj(
            {
                "title": {"type": "string", "minLength": 1},
                "description": {"type": "string", "minLength": 1},
            },
            ["title", "description"],
        ),
        "Link": link,
        "Message": message,
        "MessageList": _obj(
            {
                "messages": {"type": "array", "items": _schema("Message")},
                "links": {
                    "type": "array",
                    "items": _schema("Link"),
                    "maxItems": 1,
                    "description": "The next page (absent when listing by ids). An empty "
                    "page carries no link: poll again with the last marker.",
                },
            },
            ["messages"],
        ),
        "PoppedMessages": _obj(
            {
                "messages": {
                    "type": "array",
                    "maxItems": s.max_messages_per_claim_or_pop,
                    "items": _obj(
                        {"id": message_id, "ttl": _int(1), "age": _int(0), "body": any_json},
                        ["id", "ttl", "age", "body"],
                    ),
                }
            },
            ["messages"],
        ),
        "NewMessage": {
            "type": "object",
            "properties": {
                "body": any_json,
                "ttl": _int(s.min_message_ttl, s.max_message_ttl, s.default_message_ttl),
                "delay": _int(0, s.max_message_delay, 0),
            },
            "required": ["body"],
            "description": "ttl defaults to the queue's _default_message_ttl, else "
            f"{s.default_message_ttl} s; delay to the queue's _default_message_delay, else 0.",
        },
        "NewMessages": {
            "type": "object",
            "properties": {
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": s.max_messages_per_post,
                    "items": _schema("NewMessage"),
                }
            },
            "required": ["messages"],
        },
        "Resources": _obj(
            {
                "resources": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "string"},
                    "description": "The href of each new message, in the order posted.",
                }
            },
            ["resources"],
        ),
        "QueueMetadata": {
            "type": "object",
            "description": "User metadata plus the reserved settings (leading underscore); "
            f"at most {v.MAX_METADATA_SIZE} bytes of JSON, nesting arrays and objects at most "
            f"{v.MAX_JSON_DEPTH} levels deep (the object itself is one), integers within "
            "64 bits (-2**63 to 2**64-1).",
            "properties": {
                "_max_messages_post_size": _int(1, s.max_messages_post_size),
                "_default_message_ttl": _int(s.min_message_ttl, s.max_message_ttl),
                "_default_message_delay": _int(0, s.max_message_delay),
                "_dead_letter_queue": {
                    "type": ["string", "null"],
                    "pattern": v.QUEUE_NAME.pattern,
                },
                "_dead_letter_queue_messages_ttl": {
                    "type": ["integer", "null"],
                    "minimum": s.min_message_ttl,
                    "maximum": s.max_message_ttl,
                },
                "_max_claim_count": {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31},
                "_max_messages": {
                    "type": ["integer", "null"],
                    "minimum": 1,
                    "maximum": MAX_QUOTA,
                    "description": "The most live messages the queue may hold: a post "
                    "that would take it over is 403 (title 'Quota exceeded: "
                    "_max_messages') and stores nothing. Not shown unless set.",
                },
                "_retry_policy": {
                    "anyOf": [_schema("RetryPolicy"), {"type": "null"}],
                    "description": "The default retry policy of the queue's subscriptions.",
                },
                "_enable_encrypt_messages": {
                    "type": ["boolean", "null"],
                    **({} if s.message_encryption_key else {"enum": [False, None]}),
                    "description": "Bodies posted from now on are stored encrypted "
                    "(AES-256-GCM) and decrypted on every read. Only where the service "
                    "has a --message-encryption-key (else true is a 400); a service "
                    "without the key answers 500 for encrypted messages. A message that "
                    "cannot be decrypted (another key's, or altered) is a 500 when read by "
                    "id; lists, pop and claim pass over it, and never delete or claim it.",
                },
            },
        },
        "QueueMetadataShown": {
            "allOf": [_schema("QueueMetadata")],
            # _max_messages is shown only when set (Zaqar has no such field)
            "required": [name for name in RESERVED_FIELDS if name != "_max_messages"],
        },
        "QueueList": _obj(
            {
                "queues": {
                    "type": "array",
                    "maxItems": s.max_queues_per_page,
                    "items": _obj(
                        {
                            "name": {"type": "string", "pattern": v.QUEUE_NAME.pattern},
                            "href": {"type": "string"},
                            "metadata": _schema("QueueMetadataShown"),
                        },
                        ["name", "href"],
                    ),
                },
                "links": {"type": "array", "maxItems": 1, "items": _schema("Link")},
                "count": _int(0),
            },
            ["queues", "links"],
        ),
        "QueueStats": _obj(
            {
                "messages": _obj(
                    {
                        "claimed": _int(0),
                        "free": _int(0),
                        "total": _int(0),
                        "oldest": summary,
                        "newest": summary,
                    },
                    ["claimed", "free", "total"],
                )
            },
            ["messages"],
        ),
        "JsonPatch": {
            "type": "array",
            "minItems": 1,
            "items": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "op": {"type": "string", "enum": ["add", "replace"]},
                            "path": metadata_path,
                            "value": any_json,
                        },
                        "required": ["op", "path", "value"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "op": {"type": "string", "enum": ["remove"]},
                            "path": metadata_path,
                        },
                        "required": ["op", "path"],
                    },
                ]
            },
            "description": "add and replace need a value; replace or remove of a missing "
            "user key is 409.",
        },
        "Purge": {
            "type": "object",
            "properties": {
                "resource_types": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "string", "enum": ["messages", "subscriptions"]},
                }
            },
            "required": ["resource_types"],
        },
        "ClaimOptions": {
            "type": "object",
            "properties": {
                "ttl": _int(s.min_claim_ttl, s.max_claim_ttl, s.default_claim_ttl),
                "grace": _int(s.min_claim_grace, s.max_claim_grace, s.default_claim_grace),
            },
        },
        "ReleaseOptions": {
            "type": "object",
            "properties": {
                "delay": {
                    **_int(0, s.max_message_delay, 0),
                    "description": "Seconds before the message can be claimed again (0: at once).",
                },
            },
        },
        "ClaimedMessages": _obj(
            {
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": s.max_messages_per_claim_or_pop,
                    "items": _schema("Message"),
                }
            },
            ["messages"],
        ),
        "Claim": _obj(
            {
                "age": _int(0),
                "ttl": _int(1),
                "messages": {"type": "array", "items": _schema("Message")},
                "href": {"type": "string"},
            },
            ["age", "ttl", "messages", "href"],
        ),
        "Health": _obj(
            {
                "storage_reachable": {"type": "boolean"},
                "driver": {"type": "string", "enum": list(DRIVER_NAMES)},
                "pid": {
                    **_int(1),
                    "description": "The process that answered. The counters are its own: "
                    "with --workers N, each worker counts for itself.",
                },
                "watch_retries": _int(0),
                "watch_conflicts_exhausted": _int(0),
                "posts_combined": {
                    **_int(0),
                    "description": "watch driver: posts indexed in the same transaction "
                    "as an earlier post to their queue.",
                },
                "noscript_reloads": _int(0),
                "redis_eviction": {
                    **_obj(
                        {
                            "policies": {
                                "type": "object",
                                "additionalProperties": {"type": ["string", "null"]},
                            },
                            "may_evict": {"type": "boolean"},
                            "allowed": {"type": "boolean"},
                            "refusing_writes": {"type": "boolean"},
                            "checked": {"type": "boolean"},
                            "evicted_keys": {
                                "type": "object",
                                "additionalProperties": _int(0),
                            },
                        },
                        [
                            "policies",
                            "may_evict",
                            "allowed",
                            "refusing_writes",
                            "checked",
                            "evicted_keys",
                        ],
                    ),
                    "description": "Each Redis primary's maxmemory-policy, by address (null: "
                    "it could not be read), as last read. may_evict: some primary's policy "
                    "is not noeviction, so Redis may evict feedsvc's keys; allowed: "
                    "--allow-evicting-redis was given (writes go on); refusing_writes: "
                    "writes are answered 503 until the policy is noeviction; checked: false "
                    "until the policies were read (at start, after a reconnect); "
                    "evicted_keys: what each primary says it has evicted since it started "
                    "(a rise is logged at ERROR: messages may be lost).",
                },
                "embedded_redis": {
                    **_obj(
                        {
                            "running": {"type": "boolean"},
                            "pid": {"type": ["integer", "null"], "minimum": 1},
                            "server": {"type": "string"},
                            "restarts": _int(0),
                            "last_exit": {
                                "oneOf": [
                                    {"type": "null"},
                                    _obj(
                                        {
                                            "code": {"type": ["integer", "null"]},
                                            "signal": {"type": ["string", "null"]},
                                            "at": {"type": "string", "format": "date-time"},
                                        },
                                        ["code", "signal", "at"],
                                    ),
                                ]
                            },
                        },
                        ["running", "pid", "server", "restarts", "last_exit"],
                    ),
                    "description": "Only when the service started its own Redis (no "
                    "--redis-url): whether it runs, which server and version it is, how "
                    "often it was restarted after it died, and its last exit (code, or the "
                    "signal that killed it).",
                },
            },
            [
                "storage_reachable",
                "driver",
                "pid",
                "watch_retries",
                "watch_conflicts_exhausted",
                "posts_combined",
                "noscript_reloads",
                "redis_eviction",
            ],
        ),
        "Versions": _obj(
            {
                "versions": {
                    "type": "array",
                    "items": _obj(
                        {
                            "id": {"type": "string"},
                            "status": {"type": "string"},
                            "updated": {"type": "string"},
                            "media-types": {
                                "type": "array",
                                "items": _obj(
                                    {"base": {"type": "string"}, "type": {"type": "string"}},
                                    ["base", "type"],
                                ),
                            },
                            "links": {"type": "array", "items": _schema("VersionLink")},
                        },
                        ["id", "status", "updated", "media-types", "links"],
                    ),
                }
            },
            ["versions"],
        ),
        "VersionLink": _obj(
            {"href": {"type": "string"}, "rel": {"type": "string"}},
            ["href", "rel"],
        ),
        "HomeDocument": {
            "type": "object",
            "properties": {"resources": {"type": "object"}},
            "required": ["resources"],
        },
    }


REQUEST_ID_HEADER: Schema = {
    "description": "Unique id of this request (also in the service log).",
    "required": True,
    "schema": {"type": "string", "pattern": "^req-"},
}
RETRY_AFTER_HEADER: Schema = {
    "description": "Seconds to wait before trying again.",
    "required": True,
    "schema": {"type": "integer", "minimum": 1},
}
RETRY_AFTER = {"Retry-After": RETRY_AFTER_HEADER}
LOCATION = {"Location": {"required": True, "schema": {"type": "string"}}}


def _response(
    description: str,
    schema: Schema | None = None,
    media_type: str = JSON,
    headers: dict[str, Schema] | None = None,
) -> Schema:
    response: Schema = {
        "description": description,
        "headers": {"X-Openstack-Request-Id": REQUEST_ID_HEADER, **(headers or {})},
    }
    if schema is not None:
        response["content"] = {media_type: {"schema": schema}}
    return response


def _responses(s: Settings) -> dict[str, Schema]:
    def error(description: str, headers: dict[str, Schema] | None = None) -> Schema:
        return _response(description, _schema("Error"), headers=headers)

    return {
        "BadRequest": error(
            "Malformed or out-of-range input: a missing or malformed Client-ID or "
            "X-Project-ID header, a bad queue name, parameter or body."
        ),
        "Forbidden": error("The message is claimed and no claim_id was given."),
        "OverQuota": error(
            "The post (or the queue's creation) would take the queue or its project over "
            "a quota; nothing of it is stored. The title names the quota: 'Quota "
            "exceeded: _max_messages' (the queue's live messages), 'Quota exceeded: "
            "max_messages' (the project's live messages across its queues and topics) "
            "or 'Quota exceeded: max_queues' (the project's queues and topics)."
        ),
        "NotFound": error("No such resource (in this project and queue)."),
        "Conflict": error("The json-patch replaces or removes a key that does not exist."),
        "UnsupportedMediaType": error("The body is not of the media type this route takes."),
        "TooManyRequests": error(
            "The project is over its request rate (--project-rate, or its own in the "
            "operator's limits): nothing was done; try again after Retry-After seconds.",
            headers=RETRY_AFTER,
        ),
        "Unavailable": error(
            "Redis is unreachable, timed out, or too contended; or, for a write, Redis is "
            "out of memory (title 'Redis is out of memory') or may evict data (title "
            "'Redis may evict data': its maxmemory-policy is not noeviction): try again "
            "later.",
            headers=RETRY_AFTER,
        ),
        "UnavailableOrTooManyFollowers": error(
            "Redis is unreachable, timed out, or too contended (or, for a write, out of "
            "memory or may evict data); or, for a long poll "
            "(wait > 0) or an event stream, this process already serves "
            f"--max-followers ({s.max_followers}) of them: try again later.",
            headers=RETRY_AFTER,
        ),
    }


def _parameters(s: Settings) -> dict[str, Schema]:
    return {
        "ClientId": {
            "name": "Client-ID",
            "in": "header",
            "required": True,
            "description": "The client's UUID (with or without dashes); a client does not "
            "see its own messages in listings unless echo=true.",
            "schema": {"type": "string", "format": "uuid"},
        },
        "ProjectId": {
            "name": "X-Project-ID",
            "in": "header",
            "required": True,
            "description": "The project (tenant) every queue, message and claim belongs to; "
            f"1 to {v.MAX_PROJECT_LENGTH} printable characters.",
            "schema": {"type": "string", "minLength": 1, "maxLength": v.MAX_PROJECT_LENGTH},
        },
        "ProjectIdFromToken": {
            "name": "X-Project-ID",
            "in": "header",
            "required": False,
            "description": "Ignored here: with authentication on the project is the "
            "bearer token's.",
            "schema": {"type": "string"},
        },
        "IdempotencyKey": {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "description": "Repeating a POST with the same key (and Client-ID) within "
            f"{s.idempotency_window} s returns the first post's ids and posts nothing; "
            "1 to 255 printable characters.",
            "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        },
        "Queue": {
            "name": "queue",
            "in": "path",
            "required": True,
            "description": "Queue name: ASCII letters, digits, '_', '.' and '-', 1 to 64; "
            "not '.' or '..'.",
            "schema": {
                "type": "string",
                "minLength": 1,
                "maxLength": 64,
                "pattern": v.QUEUE_NAME.pattern,
            },
        },
        "MessageId": {
            "name": "message_id",
            "in": "path",
            "required": True,
            "description": "A message id (24 lowercase hex digits); any other value is 404.",
            "schema": {"type": "string", "pattern": v.ID.pattern},
        },
        "ClaimId": {
            "name": "claim_id",
            "in": "path",
            "required": True,
            "description": "A claim id (24 lowercase hex digits); any other value is 404.",
            "schema": {"type": "string", "pattern": v.ID.pattern},
        },
        "MessageLimit": _query(
            "limit",
            _int(1, s.max_messages_per_page, s.default_messages_per_page),
            "Messages per page.",
        ),
        "MessageMarker": _query(
            "marker",
            {"type": "string", "pattern": "^[0-9]{1,19}$"},
            "Opaque position from a `next` link: the page starts after it. A marker this "
            "service did not give out is 400, and so is one past the queue's last message "
            "(title `Unknown marker`): taken, it would hide what is posted next.",
        ),
        "Wait": _query(
            "wait",
            {"type": "number", "minimum": 0, "maximum": v.MAX_WAIT, "default": 0},
            "Long poll: seconds (decimals allowed) to hold the request while its answer "
            "would be empty, answering as soon as there is something (0: answer at once). "
            "Written as JSON writes a number, unsigned (`2`, `2.5`, `25e-1`); other "
            "spellings (`1_0`, `+1`, other scripts' digits) are 400.",
        ),
        "From": _query(
            "from",
            {"type": "string", "enum": ["tail"]},
            "`tail`: start after the queue's last message, so that a stream or a long "
            "poll gives only messages posted from now on; a plain list answers an empty "
            "page whose next link carries the queue's last marker, to poll from. No other "
            "value, and not with marker (400); Last-Event-ID wins over it.",
        ),
        "LastEventId": {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": "Event stream only (Accept: text/event-stream): start after this "
            "event id, i.e. the marker of the last message received (what EventSource sends "
            "when it reconnects); it takes precedence over marker. An id this service did "
            "not give out is 400, one past the queue's last message too. Ignored by a "
            "plain list.",
            "schema": {"type": "string", "pattern": "^[0-9]{1,19}$"},
        },
        "Ids": {
            "name": "ids",
            "in": "query",
            "required": False,
            "style": "form",
            "explode": False,
            "description": f"Up to {s.max_messages_per_page} message ids, comma-separated.",
            "schema": {
                "type": "array",
                "minItems": 1,
                "maxItems": s.max_messages_per_page,
                "items": {"type": "string", "pattern": v.ID.pattern},
            },
        },
    }


EVENT_STREAM = "text/event-stream"


def _message_list_or_stream(s: Settings) -> Schema:
    """200 of the message list: a JSON page, or (Accept: text/event-stream) a stream."""
    response = _response("Messages.", _schema("MessageList"))
    response["content"][EVENT_STREAM] = {
        "schema": {
            "type": "string",
            "description": "Server-Sent Events, UTF-8, one event per message, oldest first: "
            "`id: <marker>`, `event: message`, `data: <the message as a list page shows it "
            "(schema Message), one line of JSON>`, then a blank line. The stream starts "
            "after Last-Event-ID, else after marker, else at the head of the queue: the "
            "backlog first, then each message as it is posted, never an expired one or "
            "(without include_claimed) a claimed one; echo filters as on the list. It "
            f"opens with `retry: {s.stream_retry}` (milliseconds before a reconnect), "
            f"sends a `: heartbeat` comment after {s.stream_heartbeat:g} s without events, "
            "sends `event: end` with `data: {}` and closes if the queue is deleted, and "
            f"closes after about {s.stream_lifetime:g} s (+-10 %), at once when the "
            "service begins to stop, or when the client reads too slowly; reconnecting "
            "with the last id as Last-Event-ID loses and repeats nothing. If messages "
            "after the position it resumed from are gone unseen (expired, deleted), an "
            '`event: gap` with `data: {"missed": N, "first": "<marker>"}` comes just '
            "before the event whose id is that marker (messages filtered out are no "
            "gap). Redis "
            "trouble or too many followers before the stream starts are a JSON 503.",
            "example": "retry: 2000\n\nid: 1784124000000000001\nevent: message\n"
            'data: {"id":"...","href":"...","ttl":3600,"age":0,"body":"hi"}\n\n',
        }
    }
    response["headers"]["Cache-Control"] = {
        "required": False,
        "description": "no-cache on an event stream.",
        "schema": {"type": "string"},
    }
    response["headers"]["X-Gap"] = {
        "required": False,
        "description": "A list page or long poll after a marker: `missed=N; first=<marker>`, "
        "N messages between the marker and the page's next marker are gone unseen "
        "(expired, deleted; messages filtered out are no gap), and the marker of the "
        "page's first message, if it has one. Absent when nothing was missed.",
        "schema": {"type": "string", "pattern": "^missed=[0-9]+(; first=[0-9]+)?$"},
    }
    return response


def _common(*extra: str) -> list[Schema]:
    return [_ref("parameters", "ClientId"), _ref("parameters", "ProjectId")] + [
        _ref("parameters", name) for name in extra
    ]


def _errors(*statuses: str) -> dict[str, Schema]:
    names = {
        "400": "BadRequest",
        "403": "Forbidden",
        "404": "NotFound",
        "409": "Conflict",
        "415": "UnsupportedMediaType",
        "429": "TooManyRequests",
        "503": "Unavailable",
    }
    # every route of a project counts against its rate (--project-rate)
    statuses = ("400", *statuses, "429", "503")
    return {status: _ref("responses", names[status]) for status in statuses}


def _operation(
    operation_id: str,
    summary: str,
    responses: dict[str, Schema],
    parameters: list[Schema] | None = None,
    body: Schema | None = None,
) -> Schema:
    operation: Schema = {
        "operationId": operation_id,
        "summary": summary,
        "parameters": _common() if parameters is None else parameters,
        "responses": responses,
    }
    if body is not None:
        operation["requestBody"] = body
    return operation


def _paths(s: Settings) -> dict[str, Schema]:
    queue = "/v2/queues/{queue}"
    no_content = _response("Done.")
    claim_limit = min(ZAQAR_DEFAULT_CLAIM_LIMIT, s.max_messages_per_claim_or_pop)
    home = _operation(
        "getHome",
        "The JSON-home document of the v2 API",
        {
            "200": _response(
                "The home document.",
                _schema("HomeDocument"),
                "application/json-home",
                headers={"Cache-Control": {"schema": {"type": "string"}}},
            ),
            "400": _ref("responses", "BadRequest"),
        },
    )
    return {
        "/": {
            "get": _operation(
                "getVersions",
                "The API versions (no headers needed)",
                {"300": _response("The versions.", _schema("Versions"))},
                parameters=[],
            )
        },
        "/v2": {"get": home},
        "/v2/": {"get": {**home, "operationId": "getHomeSlash"}},
        "/v2/openapi.json": {
            "get": _operation(
                "getOpenapi",
                "This document (no headers needed)",
                {
                    "200": _response(
                        "The OpenAPI description of this service, with its configured limits.",
                        {"type": "object", "required": ["openapi", "info", "paths"]},
                    )
                },
                parameters=[],
            )
        },
        "/v2/ping": {
            "get": _operation(
                "ping",
                "Is Redis reachable? (HEAD works too; no headers needed)",
                {
                    "204": _response("Redis answered."),
                    "503": _response("Redis is unreachable (no body).", headers=RETRY_AFTER),
                },
                parameters=[],
            )
        },
        "/v2/health": {
            "get": _operation(
                "getHealth",
                "Storage reachability and driver counters (no headers needed)",
                {
                    "200": _response("Redis is reachable.", _schema("Health")),
                    "503": _response(
                        "Redis is unreachable.",
                        _schema("Health"),
                        headers=RETRY_AFTER,
                    ),
                },
                parameters=[],
            )
        },
        "/v2/queues": {
            "get": _operation(
                "listQueues",
                "The project's queues, by name",
                {
                    "200": _response("A page of queues.", _schema("QueueList")),
                    **_errors(),
                },
                parameters=[
                    *_common(),
                    _query(
                        "marker",
                        {"type": "string", "pattern": v.QUEUE_MARKER.pattern},
                        "List the queues after this name.",
                    ),
                    _query(
                        "limit",
                        _int(1, s.max_queues_per_page, s.default_queues_per_page),
                        "Queues per page.",
                    ),
                    _flag("detailed", "Include each queue's metadata."),
                    _flag("with_count", "Include the number of queues of the project."),
                ],
            )
        },
        queue: {
            "put": _operation(
                "createQueue",
                "Create a queue (an existing queue is left as it is)",
                {
                    "201": _response("Created.", headers=LOCATION),
                    "204": _response("It already existed.", headers=LOCATION),
                    "403": _ref("responses", "OverQuota"),
                    **_errors(),
                },
                parameters=_common("Queue"),
                body={
                    "required": False,
                    "description": "Optional metadata.",
                    "content": {JSON: {"schema": _schema("QueueMetadata")}},
                },
            ),
            "get": _operation(
                "getQueue",
                "The queue's metadata (the defaults when it does not exist)",
                {"200": _response("Metadata.", _schema("QueueMetadataShown")), **_errors()},
                parameters=_common("Queue"),
            ),
            "patch": _operation(
                "updateQueue",
                "Change the queue's metadata with a json-patch",
                {
                    "200": _response("The new metadata.", _schema("QueueMetadataShown")),
                    **_errors("404", "409", "415"),
                },
                parameters=_common("Queue"),
                body={
                    "required": True,
                    "content": {v.JSON_PATCH: {"schema": _schema("JsonPatch")}},
                },
            ),
            "delete": _operation(
                "deleteQueue",
                "Delete the queue with its messages, claims and subscriptions"
                " (all at once; their records are swept in the background)",
                {"204": no_content, **_errors()},
                parameters=_common("Queue"),
            ),
        },
        queue + "/purge": {
            "post": _operation(
                "purgeQueue",
                "Delete every message and claim; keep the queue",
                {"204": no_content, **_errors()},
                parameters=_common("Queue"),
                body={
                    "required": False,
                    "description": "Without a body, messages are purged.",
                    "content": {JSON: {"schema": _schema("Purge")}},
                },
            )
        },
        queue + "/stats": {
            "get": _operation(
                "getQueueStats",
                "Live message counts",
                {"200": _response("Counts.", _schema("QueueStats")), **_errors()},
                parameters=_common("Queue"),
            )
        },
        queue + "/messages": {
            "post": _operation(
                "postMessages",
                "Post messages (the queue is created on first post)",
                {
                    "201": _response("Stored and indexed.", _schema("Resources"), headers=LOCATION),
                    "403": _ref("responses", "OverQuota"),
                    **_errors(),
                },
                parameters=_common("Queue", "IdempotencyKey"),
                body={
                    "required": True,
                    "description": f"At most {s.max_messages_post_size} bytes "
                    "and at most the queue's _max_messages_post_size: 400 otherwise, "
                    "as in Zaqar (refused from Content-Length, or while a chunked "
                    "body streams in).",
                    "content": {JSON: {"schema": _schema("NewMessages")}},
                },
            ),
            "get": {
                **_operation(
                    "listMessages",
                    "A page of messages after a marker, or the messages named by ids; "
                    "with wait, a long poll; with Accept: text/event-stream, a live stream",
                    {
                        "200": _message_list_or_stream(s),
                        **_errors("404"),
                        "503": _ref("responses", "UnavailableOrTooManyFollowers"),
                    },
                    parameters=[
                        *_common("Queue", "MessageMarker", "MessageLimit", "Wait", "From"),
                        _flag("echo", "Include this client's own messages."),
                        _flag("include_claimed", "Include claimed messages."),
                        _flag("include_delayed", "Include messages whose delay has not passed."),
                        _ref("parameters", "Ids"),
                        _ref("parameters", "LastEventId"),
                    ],
                ),
                "description": "A plain list answers at once. With wait=S a page that would "
                "be empty is held until a message is visible after the marker (then that "
                "page at once) or S seconds pass or the service begins to stop (then the "
                "empty page); wait is ignored "
                "with ids. A request whose Accept names text/event-stream (with a weight "
                "above 0 and at least that of application/json; a wildcard alone does not "
                "ask for it) gets a stream of the queue instead (see the 200 response); "
                "limit, ids and wait do not apply to it, though a value a list refuses is "
                "400 there too, and include_delayed is ignored (a delayed message appears "
                "once due).",
            },
            "delete": _operation(
                "deleteMessages",
                "Delete the messages named by ids, or pop some",
                {
                    "200": _response("The popped messages.", _schema("PoppedMessages")),
                    "204": no_content,
                    **_errors(),
                },
                parameters=[
                    *_common("Queue", "Ids"),
                    _query(
                        "pop",
                        _int(1, s.max_messages_per_claim_or_pop),
                        "Remove and return up to this many free messages, atomically.",
                    ),
                ],
            ),
        },
        queue + "/messages/{message_id}": {
            "get": _operation(
                "getMessage",
                "One message",
                {"200": _response("The message.", _schema("Message")), **_errors("404")},
                parameters=_common("Queue", "MessageId"),
            ),
            "delete": _operation(
                "deleteMessage",
                "Delete one message (a claimed one needs its claim_id)",
                {"204": no_content, **_errors("403")},
                parameters=[
                    *_common("Queue", "MessageId"),
                    _query(
                        "claim_id",
                        {"type": "string"},
                        "The claim that holds the message; a claim that does not hold it is 400.",
                    ),
                ],
            ),
        },
        queue + "/messages/{message_id}/release": {
            "post": {
                **_operation(
                    "releaseMessage",
                    "Take one message out of its claim, claimable again after a delay",
                    {"204": no_content, **_errors("404")},
                    parameters=[
                        *_common("Queue", "MessageId"),
                        {
                            **_query(
                                "claim_id",
                                {"type": "string"},
                                "The claim that holds the message. A claim that does not "
                                "hold it now (expired, released, another claim's) is 400 "
                                "and changes nothing.",
                            ),
                            "required": True,
                        },
                    ],
                    body={
                        "required": False,
                        "content": {JSON: {"schema": _schema("ReleaseOptions")}},
                    },
                ),
                "description": "A feedsvc extension. The rest of the claim is untouched; "
                "the message keeps its claim count (it counts towards _max_claim_count "
                "and dead-lettering) and the life the claim gave it. No body: delay 0.",
            },
        },
        queue + "/claims": {
            "post": _operation(
                "claimMessages",
                "Claim free messages",
                {
                    "201": _response("Claimed.", _schema("ClaimedMessages"), headers=LOCATION),
                    "204": _response("Nothing to claim."),
                    **_errors(),
                },
                parameters=[
                    *_common("Queue"),
                    _query(
                        "limit",
                        _int(1, s.max_messages_per_claim_or_pop, claim_limit),
                        "Most messages to claim.",
                    ),
                    _query(
                        "wait",
                        {"type": "number", "minimum": 0, "maximum": v.MAX_WAIT, "default": 0},
                        "Seconds (decimals allowed) to wait for something claimable when "
                        "nothing is now: the claim is made as soon as a message can be "
                        "claimed, else 204 after the wait, or at once when the service "
                        "begins to stop (0: answer at once).",
                    ),
                ],
                body={
                    "required": False,
                    "content": {JSON: {"schema": _schema("ClaimOptions")}},
                },
            )
        },
        queue + "/claims/{claim_id}": {
            "get": _operation(
                "getClaim",
                "A live claim and the messages it holds",
                {"200": _response("The claim.", _schema("Claim")), **_errors("404")},
                parameters=_common("Queue", "ClaimId"),
            ),
            "patch": _operation(
                "renewClaim",
                "Restart the claim's ttl from now",
                {"204": no_content, **_errors("404")},
                parameters=_common("Queue", "ClaimId"),
                body={
                    "required": True,
                    "content": {JSON: {"schema": _schema("ClaimOptions")}},
                },
            ),
            "delete": _operation(
                "releaseClaim",
                "Release the claim's messages",
                {"204": no_content, **_errors()},
                parameters=_common("Queue", "ClaimId"),
            ),
        },
    }


# Routes that show no stored data: never behind a bearer token.
UNAUTHENTICATED = {"/", "/v2", "/v2/", "/v2/ping", "/v2/health", "/v2/openapi.json"}


def _require_tokens(document: dict[str, Any], settings: Settings) -> None:
    """With authentication on: the data routes need a bearer token (else
    401) whose scope allows the route's action on its queue or topic (else
    403), and the project is the token's, so X-Project-ID is not needed there."""
    components = document["components"]
    schemes: dict[str, Any] = {}
    if settings.auth_token or settings.auth_token_file:
        schemes["bearer"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "A static token (--auth-token, --auth-token-file); it names the "
            "project and its scopes.",
        }
    if settings.jwt_on():
        schemes["jwt"] = {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "JWT",
            "description": f"An OIDC / OAuth2 access token from {settings.jwt_issuer}: its "
            f"{settings.jwt_project_claim!r} claim names the project, its scope claim holds "
            "ACTION:NAME_GLOB items (ACTION read, post, claim, delete, manage or *; "
            "admin:PROJECT_GLOB for the admin API).",
        }
    if settings.keystone_url:
        schemes["keystone"] = {
            "type": "apiKey",
            "in": "header",
            "name": "X-Auth-Token",
            "description": f"An OpenStack Keystone token, validated against "
            f"{settings.keystone_url} (and cached up to --keystone-cache seconds): the project "
            "is its project scope's id, its roles give the scopes (--keystone-roles). Missing "
            'or invalid: 401 with WWW-Authenticate: Keystone uri="..."; Keystone unreachable '
            "for a token not cached: 503.",
        }
    # the admin routes' own scheme (openapi_admin.py) stays
    components.setdefault("securitySchemes", {}).update(schemes)
    components["responses"]["Unauthorized"] = _response(
        "No bearer token, or one that does not hold (RFC 6750: "
        'WWW-Authenticate: Bearer error="invalid_token"; for a Keystone X-Auth-Token, '
        'Keystone uri="...").',
        _schema("Error"),
        headers={"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    )
    components["responses"]["InsufficientScope"] = _response(
        "The token's scope does not allow this action on this queue or topic "
        '(WWW-Authenticate: Bearer error="insufficient_scope").',
        _schema("Error"),
        headers={"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    )
    project = _ref("parameters", "ProjectId")
    for path, item in document["paths"].items():
        if path in UNAUTHENTICATED:
            continue
        if path.startswith(ADMIN_PREFIX):
            # the admin token, or a token whose scope holds admin:PROJECT_GLOB
            # (only the token file and JWTs carry scopes)
            if settings.auth_token_file or settings.jwt_on():
                for operation in item.values():
                    operation["security"] += [{n: []} for n in schemes if n != "keystone"]
                    operation["responses"]["401"] = _ref("responses", "Unauthorized")
            continue
        for operation in item.values():
            operation["security"] = [{name: []} for name in schemes]
            operation["responses"]["401"] = _ref("responses", "Unauthorized")
            operation["responses"].setdefault("403", _ref("responses", "InsufficientScope"))
            operation["parameters"] = [
                _ref("parameters", "ProjectIdFromToken") if p == project else p
                for p in operation["parameters"]
            ]


# Operations a pre-signed URL can allow: those below .../messages, .../claims
# and .../subscriptions (a confirmation request carries one for PUT .../confirm).
SIGNABLE = (
    "/v2/queues/{queue}/messages",
    "/v2/queues/{queue}/claims",
    "/v2/queues/{queue}/subscriptions",
)


def _signed_urls(document: dict[str, Any]) -> None:
    """POST .../share, and the URL-* headers on the operations a URL can allow."""
    components = document["components"]
    path: Schema = {"type": "string", "pattern": "^/v2/queues/[^/]+/[a-z]+$"}
    components["schemas"]["ShareOptions"] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "paths": {
                "type": "array",
                "items": {"enum": list(signed_urls.SHARE_PATHS)},
                "description": "What the URL allows below the queue (and below those: a "
                "message, a claim); default [messages].",
            },
            "methods": {
                "type": "array",
                "items": {"enum": list(signed_urls.METHODS)},
                "description": "The methods it allows; default [GET].",
            },
            "expires": {
                "type": "string",
                "description": "ISO 8601 date and time it stops working, UTC unless it "
                "has an offset, in the future; default in one day. Not a number.",
                "example": "2030-01-01T00:00:00",
            },
        },
    }
    components["schemas"]["SignedURL"] = _obj(
        {
            "paths": {
                "type": "array",
                "items": path,
                "description": "Send back comma-joined as URL-Paths.",
            },
            "methods": {
                "type": "array",
                "items": {"enum": list(signed_urls.METHODS)},
                "description": "Send back comma-joined as URL-Methods.",
            },
            "project": {
                "type": "string",
                "description": "Send back as X-Project-ID.",
            },
            "expires": {
                "type": "string",
                "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$",
                "description": "UTC; send back as URL-Expires.",
            },
            "signature": {
                "type": "string",
                "pattern": "^[0-9a-f]{64}$",
                "description": "HMAC-SHA256 of the other fields (as Zaqar signs); send "
                "back as URL-Signature.",
            },
        },
        ["paths", "methods", "project", "expires", "signature"],
    )
    headers = {
        "UrlSignature": ("URL-Signature", "the signature"),
        "UrlExpires": ("URL-Expires", "its expires"),
        "UrlMethods": ("URL-Methods", "its methods, comma-separated"),
        "UrlPaths": ("URL-Paths", "its paths, comma-separated"),
    }
    for name, (header, what) in headers.items():
        components["parameters"][name] = {
            "name": header,
            "in": "header",
            "required": False,
            "description": f"A pre-signed URL's {what} (POST .../share answers them all). "
            "A request with any URL-* header is served only if the signature holds for "
            "its method and path, until it expires, in the project of X-Project-ID; with "
            "--auth-token it then needs no bearer token. Otherwise it is 404.",
            "schema": {"type": "string"},
        }
    components["responses"]["NotFoundOrNotSigned"] = _response(
        "No such resource (in this project and queue); or the request carries URL-* "
        "headers that do not allow it (another method or path, expired, a wrong "
        "signature, or the service has no --signed-url-key).",
        _schema("Error"),
    )
    signed_headers = [_ref("parameters", name) for name in headers]
    for prefix in SIGNABLE:
        for route, item in document["paths"].items():
            if route == prefix or route.startswith(prefix + "/"):
                for operation in item.values():
                    operation["parameters"] = [*operation["parameters"], *signed_headers]
                    operation["responses"]["404"] = _ref("responses", "NotFoundOrNotSigned")
    document["paths"]["/v2/queues/{queue}/share"] = {
        "post": _operation(
            "shareQueue",
            "Make a pre-signed URL: what a client holding it may do, without a token",
            {
                "200": _response("The signed URL.", _schema("SignedURL")),
                **_errors(),
            },
            parameters=_common("Queue"),
            body={
                "required": True,
                "description": "{} takes the defaults. Without --signed-url-key the "
                "answer is 400, as in Zaqar.",
                "content": {JSON: {"schema": _schema("ShareOptions")}},
            },
        )
    }


# What topic operations show instead of a queue's: topics have their own
# names, their own list key, and only three reserved settings (no claims).
TOPIC_REFS = {
    "#/components/parameters/Queue": "#/components/parameters/Topic",
    "#/components/schemas/QueueMetadataShown": "#/components/schemas/TopicMetadataShown",
    "#/components/schemas/QueueList": "#/components/schemas/TopicList",
}
TOPIC_RESERVED = ("_max_messages_post_size", "_default_message_ttl", "_default_message_delay")


def _as_topic(node: Any) -> Any:
    """A queue operation's description, made a topic's."""
    if isinstance(node, dict):
        out = {k: _as_topic(value) for k, value in node.items()}
        if isinstance(out.get("$ref"), str):
            out["$ref"] = TOPIC_REFS.get(out["$ref"], out["$ref"])
        operation_id = out.get("operationId")
        if isinstance(operation_id, str):
            topical = operation_id.replace("Queue", "Topic")
            out["operationId"] = topical if topical != operation_id else operation_id + "InTopic"
        for text in ("summary", "description"):
            if isinstance(out.get(text), str):
                out[text] = out[text].replace("queue", "topic").replace("Queue", "Topic")
        return out
    if isinstance(node, list):
        return [_as_topic(item) for item in node]
    return node


def _topics(document: dict[str, Any]) -> None:
    """/v2/topics: the queue operations on topics, without claims (or share)."""
    components = document["components"]
    topic = dict(components["parameters"]["Queue"])
    topic |= {"name": "topic", "description": topic["description"].replace("Queue", "Topic")}
    components["parameters"]["Topic"] = topic
    components["schemas"]["TopicMetadataShown"] = {
        "allOf": [_schema("QueueMetadata")],
        "required": list(TOPIC_RESERVED),
    }
    components["schemas"]["TopicList"] = _as_topic(components["schemas"]["QueueList"])
    listed = components["schemas"]["TopicList"]
    listed["properties"]["topics"] = listed["properties"].pop("queues")
    listed["required"] = ["topics" if r == "queues" else r for r in listed["required"]]
    for path, item in list(document["paths"].items()):
        if path == "/v2/queues" or (
            path.startswith("/v2/queues/{queue}")
            and "/claims" not in path
            and not path.endswith("/release")  # a claim's too
        ):
            topical = path.replace("/v2/queues/{queue}", "/v2/topics/{topic}")
            document["paths"][topical.replace("/v2/queues", "/v2/topics")] = _as_topic(item)


def openapi_document(settings: Settings) -> dict[str, Any]:
    """The OpenAPI description of the service as configured by ``settings``."""
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "feedsvc",
            "version": __version__,
            "description": "A Zaqar-v2-compatible message feed on Redis. Every /v2 route "
            "except ping, health and this document needs the Client-ID and X-Project-ID "
            "headers (with --auth-token, a bearer token instead of X-Project-ID on the "
            "data routes). "
            "Errors are JSON {title, description}; every 503 carries Retry-After.",
        },
        "paths": _paths(settings),
        "components": {
            "schemas": _schemas(settings),
            "parameters": _parameters(settings),
            "responses": _responses(settings),
        },
    }
    add_subscriptions(document, settings)
    add_admin(document)
    add_consumers(document)
    _topics(document)  # the queue paths so far, subscriptions included, on topics
    add_redrive(document)  # queues only
    _signed_urls(document)
    if (
        settings.auth_token
        or settings.auth_token_file
        or settings.jwt_on()
        or settings.keystone_url
    ):
        _require_tokens(document, settings)
    return document


@cache
def _encoded(settings: Settings) -> bytes:
    return orjson.dumps(openapi_document(settings))


async def get_openapi(request: web.Request) -> web.Response:
    """GET /v2/openapi.json: no headers needed."""
    return web.Response(body=_encoded(request.app[SETTINGS]), content_type=JSON)
