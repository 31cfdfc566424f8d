"""The messages' routes in the OpenAPI document: post, list (and follow:
``live``), get, delete, pop, release."""

from __future__ import annotations

from feedsvc.api import spec
from feedsvc.api.openapi.live import message_list_or_stream
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
    query,
    ref,
    response,
    schema,
)
from feedsvc.config import Settings

QUEUE = "/v2/queues/{queue}"


def _schemas(rules: spec.Rules, s: Settings) -> dict[str, Schema]:
    message_id: Schema = {"type": "string", "pattern": spec.ID_PATTERN}
    message = obj(
        {
            "id": message_id,
            "href": {
                "type": "string",
                "description": "Relative; carries ?claim_id= while a live claim holds it.",
            },
            "ttl": integer(1),
            "age": integer(0),
            "body": ANY_JSON,
            "claim_count": {
                **integer(1),
                "description": "Only while a live claim holds it: how often it was claimed, "
                "this claim included (a feedsvc extension; Zaqar clients ignore it).",
            },
        },
        ["id", "href", "ttl", "age", "body"],
    )
    return {
        "Message": message,
        "MessageList": obj(
            {
                "messages": {"type": "array", "items": schema("Message")},
                "links": {
                    "type": "array",
                    "items": schema("Link"),
                    "maxItems": 1,
                    "description": "The next page (absent when listing by ids). An empty "
                    "page carries no link: poll again with the last marker.",
                },
            },
            ["messages"],
        ),
        "PoppedMessages": obj(
            {
                "messages": {
                    "type": "array",
                    "maxItems": s.max_messages_per_claim_or_pop,
                    "items": obj(
                        {"id": message_id, "ttl": integer(1), "age": integer(0), "body": ANY_JSON},
                        ["id", "ttl", "age", "body"],
                    ),
                }
            },
            ["messages"],
        ),
        "NewMessage": {
            "type": "object",
            "properties": {
                "body": ANY_JSON,
                "ttl": field(rules.message_ttl),
                "delay": field(rules.message_delay),
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
                    "items": schema("NewMessage"),
                }
            },
            "required": ["messages"],
        },
        "Resources": obj(
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
            "post": operation(
                "postMessages",
                "Post messages (the queue is created on first post)",
                {
                    "201": response("Stored and indexed.", schema("Resources"), headers=LOCATION),
                    "403": ref("responses", "OverQuota"),
                    **errors(),
                },
                parameters=common("Queue", "IdempotencyKey"),
                body={
                    "required": True,
                    "description": f"At most {rules.post_size} bytes "
                    "and at most the queue's _max_messages_post_size: 400 otherwise, "
                    "as in Zaqar (refused from Content-Length, or while a chunked "
                    "body streams in).",
                    "content": {JSON: {"schema": schema("NewMessages")}},
                },
            ),
            "get": {
                **operation(
                    "listMessages",
                    "A page of messages after a marker, or the messages named by ids; "
                    "with wait, a long poll; with Accept: text/event-stream, a live stream",
                    {
                        "200": message_list_or_stream(s),
                        **errors("404"),
                        "503": ref("responses", "UnavailableOrTooManyFollowers"),
                    },
                    parameters=[
                        *common("Queue"),
                        *query(document, s, "GET", messages),
                        ref("parameters", "LastEventId"),
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
            "delete": operation(
                "deleteMessages",
                "Delete the messages named by ids, or pop some",
                {
                    "200": response("The popped messages.", schema("PoppedMessages")),
                    "204": done(),
                    **errors(),
                },
                parameters=[*common("Queue"), *query(document, s, "DELETE", messages)],
            ),
        },
        message: {
            "get": operation(
                "getMessage",
                "One message",
                {"200": response("The message.", schema("Message")), **errors("404")},
                parameters=common("Queue", "MessageId"),
            ),
            "delete": operation(
                "deleteMessage",
                "Delete one message (a claimed one needs its claim_id)",
                {"204": done(), **errors("403")},
                parameters=[
                    *common("Queue", "MessageId"),
                    *query(document, s, "DELETE", message),
                ],
            ),
        },
        message + "/release": {
            "post": {
                **operation(
                    "releaseMessage",
                    "Take one message out of its claim, claimable again after a delay",
                    {"204": done(), **errors("404")},
                    parameters=[
                        *common("Queue", "MessageId"),
                        *query(document, s, "POST", message + "/release"),
                    ],
                    body={
                        "required": False,
                        "content": {JSON: {"schema": schema("ReleaseOptions")}},
                    },
                ),
                "description": "A feedsvc extension. The rest of the claim is untouched; "
                "the message keeps its claim count (it counts towards _max_claim_count "
                "and dead-lettering) and the life the claim gave it. No body: delay 0.",
            },
        },
    }


def add(document: Document, s: Settings) -> None:
    rules = spec.rules(s)
    components = document["components"]
    components["schemas"] |= _schemas(rules, s)
    components["parameters"] |= {
        "MessageLimit": parameter(rules.message_limit),
        "MessageMarker": parameter(rules.message_marker),
        "Ids": parameter(rules.ids),
    }
    document["paths"] |= _paths(document, s)
