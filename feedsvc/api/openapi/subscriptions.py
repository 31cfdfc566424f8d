"""The subscriptions' routes in the OpenAPI document, and Zaqar's retry
policy (``feedsvc.api.subscriptions``, ``feedsvc.delivery.retry``)."""

from __future__ import annotations

from feedsvc.api import subscription_rules as rules
from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.api.subscriptions import EXISTING_HEADER, SUBSCRIPTION_ID
from feedsvc.config import Settings
from feedsvc.delivery import retry, subscribers

QUEUE = "/v2/queues/{queue}"


def _created() -> Schema:
    out = shared.response("Created.", shared.schema("SubscriptionCreated"), headers=shared.LOCATION)
    out["headers"][EXISTING_HEADER] = {
        "required": False,
        "description": "On a repeated POST of an unconfirmed subscriber: the subscription "
        "existed and nothing was changed.",
        "schema": {"type": "string", "enum": ["true"]},
    }
    return out


def retry_policy_schema() -> Schema:
    """Zaqar's _retry_policy with feedsvc's bounds (``feedsvc.delivery.retry``)."""
    numbers: Schema = {
        key: {"type": "integer", "minimum": least, "maximum": most,
              "default": retry.DEFAULTS[key]}
        for key, (least, most) in retry.LIMITS.items()
    }  # fmt: skip
    return {
        "type": "object",
        "description": "After a failed attempt: retries_with_no_delay immediate retries, "
        "minimum_delay_retries at minimum_delay seconds, the back-off function's delays from "
        "minimum_delay towards maximum_delay (steps of "
        f"{retry.LINEAR_INTERVAL} s), maximum_delay_retries at maximum_delay; then the "
        "message is given up on. maximum_delay must exceed minimum_delay by at least "
        f"{2 * retry.LINEAR_INTERVAL}. A number out of bounds, or null, is a 400.",
        "properties": {
            **numbers,
            "retry_backoff_function": {"enum": list(retry.BACKOFF_FUNCTIONS)},
            "ignore_subscription_override": {"type": "boolean"},
        },
    }


def _schemas(s: Settings) -> dict[str, Schema]:
    subscriber: Schema = {
        "type": "string",
        "maxLength": subscribers.MAX_SUBSCRIBER_LENGTH,
        "pattern": r"^[^\x00-\x20\x7f]+$",
        "description": "http(s):// webhook (each message is POSTed to it as JSON) or "
        f"mailto: with 1 to {subscribers.MAX_MAIL_RECIPIENTS} comma-separated addresses "
        "(all are mailed). A webhook needs a valid host name or IP and a port from 1 to "
        "65535; spaces and control characters must be percent-encoded. A webhook may reach "
        "only public addresses unless the operator allows more (--subscriber-allow); a "
        "host that is an address (read as the HTTP client reads it, so Unicode digits "
        "count; legacy numeric forms such as 2130706433 are refused) is checked here, and "
        "every address at every delivery.",
    }
    ttl: Schema = {"type": "integer", "minimum": rules.MIN_SUBSCRIPTION_TTL}
    forbidden = ", ".join(sorted(subscribers.FORBIDDEN_HEADERS))
    options: Schema = {
        "type": "object",
        "description": "Free-form, kept with the subscription. Honoured: post_headers "
        "(extra webhook headers), post_data (a body template: the string "
        '"$zaqar_message$" is replaced by the notification), _retry_policy (Zaqar\'s, '
        "bounded), from and subject (mail: an address, one line).",
        "properties": {
            "post_headers": {
                "type": "object",
                "maxProperties": subscribers.MAX_POST_HEADERS,
                "propertyNames": {"pattern": subscribers.HEADER_NAME.pattern},
                "additionalProperties": {
                    "type": "string",
                    "pattern": subscribers.HEADER_VALUE.pattern,
                },
                "description": "Header names (HTTP tokens) to values (visible ASCII, inner "
                f"spaces), at most {subscribers.MAX_POST_HEADER_BYTES} bytes in all. Never "
                f"one the HTTP client owns: {forbidden} (400).",
            },
            "post_data": {"type": "string"},
            "_retry_policy": {"anyOf": [shared.schema("RetryPolicy"), {"type": "null"}]},
            "subject": {"type": "string", "maxLength": subscribers.MAX_SUBJECT_LENGTH},
            "from": {"type": "string"},
        },
    }
    return {
        "RetryPolicy": retry_policy_schema(),
        "NewSubscription": {
            "type": "object",
            "properties": {
                "subscriber": subscriber,
                "ttl": {**ttl, "default": s.default_subscription_ttl},
                "options": options,
            },
            "required": ["subscriber"],
        },
        "SubscriptionPatch": {
            "type": "object",
            "properties": {"subscriber": subscriber, "ttl": ttl, "options": options},
            "minProperties": 1,
        },
        "SubscriptionCreated": {
            "type": "object",
            "properties": {"subscription_id": {"type": "string", "format": "uuid"}},
            "required": ["subscription_id"],
            "additionalProperties": False,
        },
        "Confirmation": {
            "type": "object",
            "properties": {"confirmed": {"type": "boolean"}},
            "required": ["confirmed"],
        },
        "Subscription": {
            "type": "object",
            "additionalProperties": False,
            "required": [
                "id",
                "source",
                "subscriber",
                "ttl",
                "age",
                "options",
                "confirmed",
                "delivery",
            ],
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "source": {"type": "string", "description": "The queue."},
                "subscriber": {"type": "string"},
                "ttl": {"type": "integer"},
                "age": {"type": "integer", "minimum": 0},
                "options": {"type": "object"},
                "confirmed": {"type": "boolean"},
                "delivery": {
                    "type": "object",
                    "additionalProperties": False,
                    "description": "feedsvc's delivery state: messages delivered, "
                    "messages given up on after the retry policy ran out, failed attempts "
                    "at the current message, and the last error.",
                    "required": ["delivered", "failures", "retrying", "last_error"],
                    "properties": {
                        "delivered": {"type": "integer", "minimum": 0},
                        "failures": {"type": "integer", "minimum": 0},
                        "retrying": {"type": "integer", "minimum": 0},
                        "last_error": {"type": ["string", "null"]},
                    },
                },
            },
        },
        "SubscriptionList": {
            "type": "object",
            "additionalProperties": False,
            "required": ["subscriptions", "links"],
            "properties": {
                "subscriptions": {"type": "array", "items": shared.schema("Subscription")},
                "links": {"type": "array", "maxItems": 1, "items": {"type": "object"}},
            },
        },
    }


def add(document: Document, s: Settings) -> None:
    """Add the subscription paths, schemas and parameters to document."""
    components = document["components"]
    components["schemas"].update(_schemas(s))
    components["parameters"]["SubscriptionId"] = {
        "name": "subscription_id",
        "in": "path",
        "required": True,
        "description": "A subscription id (a UUID); any other value is 404.",
        "schema": {"type": "string", "pattern": SUBSCRIPTION_ID.pattern},
    }
    item = shared.common("Queue", "SubscriptionId")
    subscriptions = QUEUE + "/subscriptions"
    document["paths"][subscriptions] = {
        "post": {
            "operationId": "createSubscription",
            "summary": "Subscribe a webhook or mail address to the queue's messages (the "
            "queue is made if missing). The same subscriber again: 201 with the same id "
            f"while it is unconfirmed (Zaqar's answer) and {EXISTING_HEADER}: true, the "
            "subscription left as it was (its ttl and options are changed by PATCH); 409 "
            "once confirmed.",
            "parameters": shared.common("Queue"),
            "requestBody": shared.json_body(
                "NewSubscription", description="The subscriber, ttl and options."
            ),
            "responses": {
                "201": _created(),
                **shared.errors("409"),
            },
        },
        "get": {
            "operationId": "listSubscriptions",
            "summary": "The queue's subscriptions by id",
            "parameters": [
                *shared.common("Queue"),
                *shared.query(document, s, "GET", subscriptions),
            ],
            "responses": {
                "200": shared.response("A page.", shared.schema("SubscriptionList")),
                **shared.errors(),
            },
        },
    }
    document["paths"][subscriptions + "/{subscription_id}"] = {
        "get": {
            "operationId": "getSubscription",
            "summary": "A live subscription and its delivery state",
            "parameters": item,
            "responses": {
                "200": shared.response("The subscription.", shared.schema("Subscription")),
                **shared.errors("404"),
            },
        },
        "patch": {
            "operationId": "updateSubscription",
            "summary": "Change the subscriber, ttl (restarted from now) or options",
            "parameters": item,
            "requestBody": shared.json_body("SubscriptionPatch", description="What to change."),
            "responses": {"204": shared.done(shared.LOCATION), **shared.errors("404", "409")},
        },
        "delete": {
            "operationId": "deleteSubscription",
            "summary": "Unsubscribe (no error if it is gone)",
            "parameters": item,
            "responses": {"204": shared.done(), **shared.errors()},
        },
    }
    document["paths"][subscriptions + "/{subscription_id}/confirm"] = {
        "put": {
            "operationId": "confirmSubscription",
            "summary": "Confirm (or revoke) a subscription. With --require-confirmation an "
            "unconfirmed subscriber is sent only its confirmation request, which carries a "
            "pre-signed URL for this call.",
            "parameters": item,
            "requestBody": shared.json_body(
                "Confirmation", description="confirmed: true or false."
            ),
            "responses": {"204": shared.done(shared.LOCATION), **shared.errors("404")},
        }
    }
