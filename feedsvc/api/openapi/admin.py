"""The operator's routes in the OpenAPI document (``feedsvc.api.admin``)."""

from __future__ import annotations

from typing import Any

from feedsvc.api import spec
from feedsvc.api.admin import MAX_RATE, MIN_RATE
from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import MAX_QUOTA, Settings

ADMIN_PREFIX = "/v2/admin/"
PROJECT = "/v2/admin/projects/{project}"


def _errors() -> dict[str, Schema]:
    error = shared.schema("Error")
    return {
        "400": shared.ref("responses", "BadRequest"),
        "403": shared.response("Not the admin token (or none given).", error),
        "404": shared.response(
            "The service has no admin API: no --admin-token is configured.", error
        ),
        "503": shared.ref("responses", "Unavailable"),
    }


def _limits(nullable: bool) -> Schema:
    def kind(base: str) -> Any:
        return [base, "null"] if nullable else base

    return {
        "max_messages": {
            "type": kind("integer"),
            "minimum": 0,
            "maximum": MAX_QUOTA,
            "description": "Live messages across the project's queues and topics (0: no limit).",
        },
        "max_queues": {
            "type": kind("integer"),
            "minimum": 0,
            "maximum": MAX_QUOTA,
            "description": "Queues and topics of the project (0: no limit).",
        },
        "rate": {
            "type": kind("number"),
            "minimum": MIN_RATE,
            "maximum": MAX_RATE,
            "description": "Requests a second (read by the rate limiter).",
        },
        "burst": {
            "type": kind("integer"),
            "minimum": 1,
            "maximum": MAX_RATE,
            "description": "Requests above the rate at once (read by the rate limiter).",
        },
    }


def _schemas() -> dict[str, Schema]:
    quotas = {k: v for k, v in _limits(False).items() if k.startswith("max_")}
    effective = {"type": "object", "required": list(quotas), "properties": quotas}
    return {
        "ProjectLimitsChange": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": False,
            "description": "The limits to set; null puts one back to the service's default; "
            "those not named stay as they are.",
            "properties": _limits(True),
        },
        "ProjectLimits": {
            "type": "object",
            "required": ["project", "limits", "defaults", "effective"],
            "properties": {
                "project": {"type": "string"},
                "limits": {
                    "type": "object",
                    "description": "The project's own limits (null: the default applies).",
                    "properties": _limits(True),
                },
                "defaults": {**effective, "description": "The service's (its flags)."},
                "effective": {**effective, "description": "What applies to the project."},
            },
        },
        "ProjectUsage": {
            "type": "object",
            "required": ["project", "messages", "queues", "topics", "in_flight", "limits"],
            "properties": {
                "project": {"type": "string"},
                "messages": {"type": "integer", "description": "Live messages now."},
                "queues": {"type": "integer"},
                "topics": {"type": "integer"},
                "in_flight": {
                    "type": "integer",
                    "description": "Messages of posts admitted and not yet indexed.",
                },
                "limits": {**effective, "description": "The quotas that apply."},
            },
        },
    }


def add(document: Document, s: Settings) -> None:
    """Add the admin paths and schemas to document."""
    components = document["components"]
    components["schemas"].update(_schemas())
    components.setdefault("securitySchemes", {})["admin"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "The admin token (--admin-token, --admin-token-file or "
        "FEEDSVC_ADMIN_TOKEN).",
    }
    project = {
        "name": "project",
        "in": "path",
        "required": True,
        "description": "The project (X-Project-ID of its requests).",
        "schema": {"type": "string", "minLength": 1, "maxLength": spec.MAX_PROJECT_LENGTH},
    }

    def operation(op_id: str, summary: str, ok: dict[str, Schema], body: bool = False) -> Schema:
        out: Schema = {
            "operationId": op_id,
            "summary": summary,
            "parameters": [project],
            "security": [{"admin": []}],
            "responses": {**ok, **_errors()},
        }
        if body:
            out["requestBody"] = shared.json_body("ProjectLimitsChange")
        return out

    limits = shared.response("The project's limits.", shared.schema("ProjectLimits"))
    document["paths"][PROJECT + "/limits"] = {
        "get": operation("getProjectLimits", "A project's quotas and limits", {"200": limits}),
        "put": operation(
            "setProjectLimits", "Set some of a project's limits", {"200": limits}, body=True
        ),
        "delete": operation(
            "resetProjectLimits",
            "Put all of a project's limits back to the service's defaults",
            {"204": shared.response("Done.")},
        ),
    }
    document["paths"][PROJECT + "/usage"] = {
        "get": operation(
            "getProjectUsage",
            "A project's live messages, queues and topics, and its quotas",
            {"200": shared.response("The usage.", shared.schema("ProjectUsage"))},
        )
    }
