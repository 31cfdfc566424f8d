"""The redrive routes' part of the OpenAPI document (``feedsvc.api.redrive``):
moving a dead-letter queue's messages back. Listed after ``topics`` in
PARTS: topics have no claims, so no dead letters."""

from __future__ import annotations

from feedsvc.api.openapi.shared import (
    JSON,
    LOCATION,
    Document,
    Schema,
    common,
    errors,
    operation,
    ref,
    response,
    schema,
)
from feedsvc.config import Settings
from feedsvc.storage.base import MAX_REDRIVE_RATE

PATH = "/v2/queues/{queue}/redrive"


def _schemas() -> dict[str, Schema]:
    time = {
        "type": "string",
        "format": "date-time",
        "description": "UTC to the second, as Zaqar writes message times: 2026-11-27T08:05:07Z.",
    }
    count = {"type": "integer", "minimum": 0}
    rate = {"type": "integer", "minimum": 1, "maximum": MAX_REDRIVE_RATE}
    return {
        "RedriveOptions": {
            "type": "object",
            "required": ["max_per_second"],
            "additionalProperties": False,
            "properties": {
                "max_per_second": {**rate, "description": "Dead letters moved a second, at most."},
                "to": {
                    "type": "string",
                    "pattern": r"^(?!\.\.?$)[a-zA-Z0-9_.-]{1,64}$",
                    "description": "Move every dead letter to this queue (made if missing) "
                    "instead of the queue it came from; needs post on it.",
                },
            },
        },
        "Redrive": {
            "type": "object",
            "required": [
                "state",
                "moved",
                "skipped",
                "remaining",
                "max_per_second",
                "to",
                "started_at",
                "updated_at",
            ],
            "properties": {
                "state": {"type": "string", "enum": ["running", "done", "cancelled"]},
                "moved": {**count, "description": "Dead letters moved out so far."},
                "skipped": {
                    **count,
                    "description": "Left in the queue: held by a consumer's claim, or "
                    "dead-lettered before their source was recorded and no to given.",
                },
                "remaining": {
                    **count,
                    "description": "Dead letters of the redrive's window still to consider.",
                },
                "max_per_second": rate,
                "to": {"type": ["string", "null"], "description": "null: each to its source."},
                "started_at": time,
                "updated_at": time,
            },
        },
    }


def add(document: Document, settings: Settings) -> None:
    """The redrive path and its schemas."""
    document["components"]["schemas"].update(_schemas())
    progress = schema("Redrive")
    document["paths"][PATH] = {
        "post": operation(
            "startRedrive",
            "Move the dead-letter queue's messages back, oldest first, paced",
            {
                "202": response("Started: its progress.", progress, headers=LOCATION),
                **errors("404", "409"),
            },
            common("Queue"),
            {"required": True, "content": {JSON: {"schema": ref("schemas", "RedriveOptions")}}},
        )
        | {
            "description": "A feedsvc extension. Each dead letter goes back to the queue it "
            "was dead-lettered from (or to `to`) with its body and headers, a fresh ttl "
            "(the target's default) and a claim count of 0, at most max_per_second a "
            "second; the dead letters there when it starts are moved. Any feedsvc process "
            "carries it on. Needs manage on the queue (and post on `to`). 404: no such "
            "queue; 409: a redrive of it is running."
        },
        "get": operation(
            "getRedrive",
            "The progress of the queue's redrive (the last one); 404 if none",
            {"200": response("Its progress.", progress), **errors("404")},
            common("Queue"),
        ),
        "delete": operation(
            "cancelRedrive",
            "Cancel the queue's running redrive: moving stops, what moved stays",
            {"200": response("Its progress.", progress), **errors("404")},
            common("Queue"),
        ),
    }
