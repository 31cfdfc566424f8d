"""The queues' routes in the OpenAPI document: the list, a queue and its
metadata, purge and stats."""

from __future__ import annotations

from feedsvc.api import spec
from feedsvc.api import validation as v
from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import Settings
from feedsvc.storage.base import RESERVED_FIELDS

QUEUES = "/v2/queues"
QUEUE = "/v2/queues/{queue}"
MAX_MESSAGES = (
    "The most live messages the queue may hold: a post that would take it over is 403 "
    "(title 'Quota exceeded: _max_messages') and stores nothing. Not shown unless set."
)


def _schemas(s: Settings) -> dict[str, Schema]:
    fields = {rule.name: shared.field(rule, with_default=False) for rule in spec.rules(s).metadata}
    fields["_max_messages"]["description"] = MAX_MESSAGES
    summary = shared.obj(
        {
            "id": {"type": "string", "pattern": spec.ID_PATTERN},
            "href": {"type": "string"},
            "age": shared.integer(0),
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
                    "anyOf": [shared.schema("RetryPolicy"), {"type": "null"}],
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
            "allOf": [shared.schema("QueueMetadata")],
            # _max_messages is shown only when set (Zaqar has no such field)
            "required": [name for name in RESERVED_FIELDS if name != "_max_messages"],
        },
        "QueueList": shared.obj(
            {
                "queues": {
                    "type": "array",
                    "maxItems": s.max_queues_per_page,
                    "items": shared.obj(
                        {
                            "name": {"type": "string", "pattern": spec.NAME_PATTERN},
                            "href": {"type": "string"},
                            "metadata": shared.schema("QueueMetadataShown"),
                        },
                        ["name", "href"],
                    ),
                },
                "links": {"type": "array", "maxItems": 1, "items": shared.schema("Link")},
                "count": shared.integer(0),
            },
            ["queues", "links"],
        ),
        "QueueStats": shared.obj(
            {
                "messages": shared.obj(
                    {
                        "claimed": shared.integer(0),
                        "free": shared.integer(0),
                        "total": shared.integer(0),
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
                            "value": shared.ANY_JSON,
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
    query = [shared.parameter(p) for p in spec.rules(s).query("GET", QUEUES)]
    queue = QUEUE
    return {
        "/v2/queues": {
            "get": shared.operation(
                "listQueues",
                "The project's queues, by name",
                shared.ok("A page of queues.", "QueueList"),
                parameters=[
                    *shared.common(),
                    *query,
                ],
            )
        },
        queue: {
            "put": shared.operation(
                "createQueue",
                "Create a queue (an existing queue is left as it is)",
                {
                    "201": shared.response("Created.", headers=shared.LOCATION),
                    "204": shared.response("It already existed.", headers=shared.LOCATION),
                    "403": shared.ref("responses", "OverQuota"),
                    **shared.errors(),
                },
                parameters=shared.common("Queue"),
                body={
                    "required": False,
                    "description": "Optional metadata.",
                    "content": {shared.JSON: {"schema": shared.schema("QueueMetadata")}},
                },
            ),
            "get": shared.operation(
                "getQueue",
                "The queue's metadata (the defaults when it does not exist)",
                shared.ok("Metadata.", "QueueMetadataShown"),
                parameters=shared.common("Queue"),
            ),
            "patch": shared.operation(
                "updateQueue",
                "Change the queue's metadata with a json-patch",
                shared.ok("The new metadata.", "QueueMetadataShown", "404", "409", "415"),
                parameters=shared.common("Queue"),
                body={
                    "required": True,
                    "content": {v.JSON_PATCH: {"schema": shared.schema("JsonPatch")}},
                },
            ),
            "delete": shared.operation(
                "deleteQueue",
                "Delete the queue with its messages, claims and subscriptions"
                " (all at once; their records are swept in the background)",
                {"204": shared.done(), **shared.errors()},
                parameters=shared.common("Queue"),
            ),
        },
        queue + "/purge": {
            "post": shared.operation(
                "purgeQueue",
                "Delete every message and claim; keep the queue",
                {"204": shared.done(), **shared.errors()},
                parameters=shared.common("Queue"),
                body={
                    "required": False,
                    "description": "Without a body, messages are purged.",
                    "content": {shared.JSON: {"schema": shared.schema("Purge")}},
                },
            )
        },
        queue + "/stats": {
            "get": shared.operation(
                "getQueueStats",
                "Live message counts",
                shared.ok("Counts.", "QueueStats"),
                parameters=shared.common("Queue"),
            )
        },
    }


def add(document: Document, s: Settings) -> None:
    document["components"]["schemas"] |= _schemas(s)
    document["paths"] |= _paths(s)
