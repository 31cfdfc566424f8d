"""The queues' routes in the OpenAPI document: the list, a queue and its
metadata, purge and stats."""

from __future__ import annotations

from feedsvc.api import spec
from feedsvc.api import validation as v
from feedsvc.api.openapi.shared import (
    ANY_JSON,
    JSON,
    LOCATION,
    Document,
    Schema,
    common,
    done,
    errors,
    field,
    integer,
    obj,
    operation,
    parameter,
    ref,
    response,
    schema,
)
from feedsvc.config import Settings
from feedsvc.storage.base import RESERVED_FIELDS

QUEUES = "/v2/queues"
QUEUE = "/v2/queues/{queue}"
MAX_MESSAGES = (
    "The most live messages the queue may hold: a post that would take it over is 403 "
    "(title 'Quota exceeded: _max_messages') and stores nothing. Not shown unless set."
)


def _schemas(s: Settings) -> dict[str, Schema]:
    fields = {rule.name: field(rule, with_default=False) for rule in spec.rules(s).metadata}
    fields["_max_messages"]["description"] = MAX_MESSAGES
    summary = obj(
        {
            "id": {"type": "string", "pattern": spec.ID_PATTERN},
            "href": {"type": "string"},
            "age": integer(0),
            "created": {"type": "string", "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$"},
        },
        ["id", "href", "age", "created"],
    )
    metadata_path: Schema = {"type": "string", "pattern": "^/metadata/.+"}
    return {
        "QueueMetadata": {
            "type": "object",
            "description": "User metadata plus the reserved settings (leading underscore); "
            f"at most {v.MAX_METADATA_SIZE} bytes of JSON, nesting arrays and objects at most "
            f"{v.MAX_JSON_DEPTH} levels deep (the object itself is one), integers within "
            "64 bits (-2**63 to 2**64-1).",
            "properties": {
                **fields,
                "_dead_letter_queue": {
                    "type": ["string", "null"],
                    "pattern": spec.NAME_PATTERN,
                },
                "_retry_policy": {
                    "anyOf": [schema("RetryPolicy"), {"type": "null"}],
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
            "allOf": [schema("QueueMetadata")],
            # _max_messages is shown only when set (Zaqar has no such field)
            "required": [name for name in RESERVED_FIELDS if name != "_max_messages"],
        },
        "QueueList": obj(
            {
                "queues": {
                    "type": "array",
                    "maxItems": s.max_queues_per_page,
                    "items": obj(
                        {
                            "name": {"type": "string", "pattern": spec.NAME_PATTERN},
                            "href": {"type": "string"},
                            "metadata": schema("QueueMetadataShown"),
                        },
                        ["name", "href"],
                    ),
                },
                "links": {"type": "array", "maxItems": 1, "items": schema("Link")},
                "count": integer(0),
            },
            ["queues", "links"],
        ),
        "QueueStats": obj(
            {
                "messages": obj(
                    {
                        "claimed": integer(0),
                        "free": integer(0),
                        "total": integer(0),
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
                            "value": ANY_JSON,
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
    }


def _paths(s: Settings) -> dict[str, Schema]:
    query = [parameter(p) for p in spec.rules(s).query("GET", QUEUES)]
    queue = QUEUE
    return {
        "/v2/queues": {
            "get": operation(
                "listQueues",
                "The project's queues, by name",
                {
                    "200": response("A page of queues.", schema("QueueList")),
                    **errors(),
                },
                parameters=[
                    *common(),
                    *query,
                ],
            )
        },
        queue: {
            "put": operation(
                "createQueue",
                "Create a queue (an existing queue is left as it is)",
                {
                    "201": response("Created.", headers=LOCATION),
                    "204": response("It already existed.", headers=LOCATION),
                    "403": ref("responses", "OverQuota"),
                    **errors(),
                },
                parameters=common("Queue"),
                body={
                    "required": False,
                    "description": "Optional metadata.",
                    "content": {JSON: {"schema": schema("QueueMetadata")}},
                },
            ),
            "get": operation(
                "getQueue",
                "The queue's metadata (the defaults when it does not exist)",
                {"200": response("Metadata.", schema("QueueMetadataShown")), **errors()},
                parameters=common("Queue"),
            ),
            "patch": operation(
                "updateQueue",
                "Change the queue's metadata with a json-patch",
                {
                    "200": response("The new metadata.", schema("QueueMetadataShown")),
                    **errors("404", "409", "415"),
                },
                parameters=common("Queue"),
                body={
                    "required": True,
                    "content": {v.JSON_PATCH: {"schema": schema("JsonPatch")}},
                },
            ),
            "delete": operation(
                "deleteQueue",
                "Delete the queue with its messages, claims and subscriptions"
                " (all at once; their records are swept in the background)",
                {"204": done(), **errors()},
                parameters=common("Queue"),
            ),
        },
        queue + "/purge": {
            "post": operation(
                "purgeQueue",
                "Delete every message and claim; keep the queue",
                {"204": done(), **errors()},
                parameters=common("Queue"),
                body={
                    "required": False,
                    "description": "Without a body, messages are purged.",
                    "content": {JSON: {"schema": schema("Purge")}},
                },
            )
        },
        queue + "/stats": {
            "get": operation(
                "getQueueStats",
                "Live message counts",
                {"200": response("Counts.", schema("QueueStats")), **errors()},
                parameters=common("Queue"),
            )
        },
    }


def add(document: Document, s: Settings) -> None:
    document["components"]["schemas"] |= _schemas(s)
    document["paths"] |= _paths(s)
