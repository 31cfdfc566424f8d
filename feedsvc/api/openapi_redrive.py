"""The redrive routes' part of the OpenAPI document (``feedsvc.api.redrive``)."""

from __future__ import annotations

from typing import Any

from feedsvc.storage.base import MAX_REDRIVE_RATE

Schema = dict[str, Any]
JSON = "application/json"
PATH = "/v2/queues/{queue}/redrive"


def _ref(kind: str, name: str) -> Schema:
    return {"$ref": f"#/components/{kind}/{name}"}


def _response(description: str, schema: Schema | None = None) -> Schema:
    response: Schema = {
        "description": description,
        "headers": {"X-Openstack-Request-Id": {"$ref": "#/components/headers/RequestId"}},
    }
    if schema is not None:
        response["content"] = {JSON: {"schema": schema}}
    return response


def _errors(*statuses: str) -> dict[str, Schema]:
    out = {"400": _ref("responses", "BadRequest")}
    out.update({s: _ref("responses", "NotFound" if s == "404" else "Conflict") for s in statuses})
    out["429"] = _ref("responses", "TooManyRequests")
    out["503"] = _ref("responses", "Unavailable")
    return out


def _schemas() -> dict[str, Schema]:
    time = {"type": "string", "format": "date-time"}
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


def add_redrive(document: dict[str, Any]) -> None:
    """Add the redrive path and its schemas to document (after the topic
    paths were derived: topics have no claims, so no dead letters)."""
    document["components"]["schemas"].update(_schemas())
    common = [_ref("parameters", n) for n in ("ClientId", "ProjectId", "Queue")]
    progress = _ref("schemas", "Redrive")
    document["paths"][PATH] = {
        "post": {
            "operationId": "startRedrive",
            "summary": "Move the dead-letter queue's messages back, oldest first, paced",
            "description": "A feedsvc extension. Each dead letter goes back to the queue it "
            "was dead-lettered from (or to `to`) with its body and headers, a fresh ttl "
            "(the target's default) and a claim count of 0, at most max_per_second a "
            "second; the dead letters there when it starts are moved. Any feedsvc process "
            "carries it on. Needs manage on the queue (and post on `to`). 404: no such "
            "queue; 409: a redrive of it is running.",
            "parameters": common,
            "requestBody": {
                "required": True,
                "content": {JSON: {"schema": _ref("schemas", "RedriveOptions")}},
            },
            "responses": {
                "202": {
                    **_response("Started: its progress.", progress),
                    "headers": {
                        "X-Openstack-Request-Id": {"$ref": "#/components/headers/RequestId"},
                        "Location": {"required": True, "schema": {"type": "string"}},
                    },
                },
                **_errors("404", "409"),
            },
        },
        "get": {
            "operationId": "getRedrive",
            "summary": "The progress of the queue's redrive (the last one); 404 if none",
            "parameters": common,
            "responses": {"200": _response("Its progress.", progress), **_errors("404")},
        },
        "delete": {
            "operationId": "cancelRedrive",
            "summary": "Cancel the queue's running redrive: moving stops, what moved stays",
            "parameters": common,
            "responses": {"200": _response("Its progress.", progress), **_errors("404")},
        },
    }
