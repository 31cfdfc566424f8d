"""The messages' routes in the OpenAPI document: post, list (and follow:
``live``), get, delete, pop, release."""

from __future__ import annotations

from feedsvc.api import spec
from feedsvc.api.openapi import shared
from feedsvc.api.openapi.live import message_list_or_stream
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import Settings

QUEUE = "/v2/queues/{queue}"


def _schemas(rules: spec.Rules, s: Settings) -> dict[str, Schema]:
    message_id: Schema = {"type": "string", "pattern": spec.ID_PATTERN}
    message = shared.obj(
        {
            "id": message_id,
            "href": {
                "type": "string",
                "description": "Relative; carries ?claim_id= while a live claim holds it.",
            },
            "ttl": shared.integer(1),
            "age": shared.integer(0),
            "body": shared.ANY_JSON,
            "claim_count": {
                **shared.integer(1),
                "description": "Only while a live claim holds it: how often it was claimed, "
                "this claim included (a feedsvc extension; Zaqar clients ignore it).",
            },
        },
        ["id", "href", "ttl", "age", "body"],
    )
    return {
        "Message": message,
        "MessageList": shared.obj(
            {
                "messages": {"type": "array", "items": shared.schema("Message")},
                "links": {
                    "type": "array",
                    "items": shared.schema("Link"),
                    "maxItems": 1,
                    "description": "The next page (absent when listing by ids). An empty "
                    "page carries no link: poll again with the last marker.",
                },
            },
            ["messages"],
        ),
        "PoppedMessages": shared.obj(
            {
                "messages": {
                    "type": "array",
                    "maxItems": s.max_messages_per_claim_or_pop,
                    "items": shared.obj(
                        {
                            "id": message_id,
                            "ttl": shared.integer(1),
                            "age": shared.integer(0),
                            "body": shared.ANY_JSON,
                        },
                        ["id", "ttl", "age", "body"],
                    ),
                }
            },
            ["messages"],
        ),
        "NewMessage": {
            "type": "object",
            "properties": {
                "body": shared.ANY_JSON,
                "ttl": shared.field(rules.message_ttl),
                "delay": shared.field(rules.message_delay),
            },
            "required": ["body"],
            "description": "ttl defaults to the queue's _default_message_ttl, else "
            f"{rules.message_ttl.default} s; delay to the queue's _default_message_delay, else 0.",
        },
        "NewMessages": {
            "type": "object",
            "properties": {
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": rules.messages_per_post,
                    "items": shared.schema("NewMessage"),
                }
            },
            "required": ["messages"],
        },
        "Resources": shared.obj(
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
    }


def _paths(document: Document, s: Settings) -> dict[str, Schema]:
    rules = spec.rules(s)
    messages = QUEUE + "/messages"
    message = messages + "/{message_id}"
    return {
        messages: {
            "post": shared.operation(
                "postMessages",
                "Post messages (the queue is created on first post)",
                {
                    "201": shared.response(
                        "Stored and indexed.", shared.schema("Resources"), headers=shared.LOCATION
                    ),
                    "403": shared.ref("responses", "OverQuota"),
                    **shared.errors(),
                },
                parameters=shared.common("Queue", "IdempotencyKey"),
                body={
                    "required": True,
                    "description": f"At most {rules.post_size} bytes "
                    "and at most the queue's _max_messages_post_size: 400 otherwise, "
                    "as in Zaqar (refused from Content-Length, or while a chunked "
                    "body streams in).",
                    "content": {shared.JSON: {"schema": shared.schema("NewMessages")}},
                },
            ),
            "get": {
                **shared.operation(
                    "listMessages",
                    "A page of messages after a marker, or the messages named by ids; "
                    "with wait, a long poll; with Accept: text/event-stream, a live stream",
                    {
                        "200": message_list_or_stream(s),
                        **shared.errors("404"),
                        "503": shared.ref("responses", "UnavailableOrTooManyFollowers"),
                    },
                    parameters=[
                        *shared.common("Queue"),
                        *shared.query(document, s, "GET", messages),
                        shared.ref("parameters", "LastEventId"),
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
            "delete": shared.operation(
                "deleteMessages",
                "Delete the messages named by ids, or pop some",
                {
                    "200": shared.response("The popped messages.", shared.schema("PoppedMessages")),
                    "204": shared.done(),
                    **shared.errors(),
                },
                parameters=[
                    *shared.common("Queue"),
                    *shared.query(document, s, "DELETE", messages),
                ],
            ),
        },
        message: {
            "get": shared.operation(
                "getMessage",
                "One message",
                shared.ok("The message.", "Message", "404"),
                parameters=shared.common("Queue", "MessageId"),
            ),
            "delete": shared.operation(
                "deleteMessage",
                "Delete one message (a claimed one needs its claim_id)",
                {"204": shared.done(), **shared.errors("403")},
                parameters=[
                    *shared.common("Queue", "MessageId"),
                    *shared.query(document, s, "DELETE", message),
                ],
            ),
        },
        message + "/release": {
            "post": {
                **shared.operation(
                    "releaseMessage",
                    "Take one message out of its claim, claimable again after a delay",
                    {"204": shared.done(), **shared.errors("404")},
                    parameters=[
                        *shared.common("Queue", "MessageId"),
                        *shared.query(document, s, "POST", message + "/release"),
                    ],
                    body=shared.json_body("ReleaseOptions", required=False),
                ),
                "description": "A feedsvc extension. The rest of the claim is untouched, "
                "but for an ordered group's message: the claim's later messages of the "
                "same group are released with it, with the same delay (they may not be "
                "handed out before it). The message keeps its claim count (it counts "
                "towards _max_claim_count and dead-lettering) and the life the claim "
                "gave it. No body: delay 0.",
            },
        },
    }


def add(document: Document, s: Settings) -> None:
    rules = spec.rules(s)
    components = document["components"]
    components["schemas"] |= _schemas(rules, s)
    components["parameters"] |= {
        "MessageLimit": shared.parameter(rules.message_limit),
        "MessageMarker": shared.parameter(rules.message_marker),
        "Ids": shared.parameter(rules.ids),
    }
    document["paths"] |= _paths(document, s)
