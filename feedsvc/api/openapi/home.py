"""The service's own routes in the OpenAPI document: versions, the home
document, this document, ping and health."""

from __future__ import annotations

from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import DRIVER_NAMES, Settings

#: Routes that show no stored data: never behind a bearer token.
UNAUTHENTICATED = {"/", "/v2", "/v2/", "/v2/ping", "/v2/health", "/v2/openapi.json"}


def _schemas() -> dict[str, Schema]:
    return {
        "Health": shared.obj(
            {
                "storage_reachable": {"type": "boolean"},
                "driver": {"type": "string", "enum": list(DRIVER_NAMES)},
                "pid": {
                    **shared.integer(1),
                    "description": "The process that answered. The counters are its own: "
                    "with --workers N, each worker counts for itself.",
                },
                "watch_retries": shared.integer(0),
                "watch_conflicts_exhausted": shared.integer(0),
                "posts_combined": {
                    **shared.integer(0),
                    "description": "posts indexed in the same transaction (watch "
                    "driver) or script call (lua driver, segments) as an earlier post to "
                    "their queue.",
                },
                "noscript_reloads": shared.integer(0),
                "redis_eviction": {
                    **shared.obj(
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
                                "additionalProperties": shared.integer(0),
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
                    **shared.obj(
                        {
                            "running": {"type": "boolean"},
                            "pid": {"type": ["integer", "null"], "minimum": 1},
                            "server": {"type": "string"},
                            "restarts": shared.integer(0),
                            "last_exit": {
                                "oneOf": [
                                    {"type": "null"},
                                    shared.obj(
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
        "Versions": shared.obj(
            {
                "versions": {
                    "type": "array",
                    "items": shared.obj(
                        {
                            "id": {"type": "string"},
                            "status": {"type": "string"},
                            "updated": {"type": "string"},
                            "media-types": {
                                "type": "array",
                                "items": shared.obj(
                                    {"base": {"type": "string"}, "type": {"type": "string"}},
                                    ["base", "type"],
                                ),
                            },
                            "links": {"type": "array", "items": shared.schema("VersionLink")},
                        },
                        ["id", "status", "updated", "media-types", "links"],
                    ),
                }
            },
            ["versions"],
        ),
        "VersionLink": shared.obj(
            {"href": {"type": "string"}, "rel": {"type": "string"}},
            ["href", "rel"],
        ),
        "HomeDocument": {
            "type": "object",
            "properties": {"resources": {"type": "object"}},
            "required": ["resources"],
        },
    }


def _paths() -> dict[str, Schema]:
    home = shared.operation(
        "getHome",
        "The JSON-home document of the v2 API",
        {
            "200": shared.response(
                "The home document.",
                shared.schema("HomeDocument"),
                "application/json-home",
                headers={"Cache-Control": {"schema": {"type": "string"}}},
            ),
            "400": shared.ref("responses", "BadRequest"),
        },
    )
    return {
        "/": {
            "get": shared.operation(
                "getVersions",
                "The API versions (no headers needed)",
                {"300": shared.response("The versions.", shared.schema("Versions"))},
                parameters=[],
            )
        },
        "/v2": {"get": home},
        "/v2/": {"get": {**home, "operationId": "getHomeSlash"}},
        "/v2/openapi.json": {
            "get": shared.operation(
                "getOpenapi",
                "This document (no headers needed)",
                {
                    "200": shared.response(
                        "The OpenAPI description of this service, with its configured limits.",
                        {"type": "object", "required": ["openapi", "info", "paths"]},
                    )
                },
                parameters=[],
            )
        },
        "/v2/ping": {
            "get": shared.operation(
                "ping",
                "Is Redis reachable? (HEAD works too; no headers needed)",
                {
                    "204": shared.response("Redis answered."),
                    "503": shared.response(
                        "Redis is unreachable (no body).", headers=shared.RETRY_AFTER
                    ),
                },
                parameters=[],
            )
        },
        "/v2/health": {
            "get": shared.operation(
                "getHealth",
                "Storage reachability and driver counters (no headers needed)",
                {
                    "200": shared.response("Redis is reachable.", shared.schema("Health")),
                    "503": shared.response(
                        "Redis is unreachable.",
                        shared.schema("Health"),
                        headers=shared.RETRY_AFTER,
                    ),
                },
                parameters=[],
            )
        },
    }


def add(document: Document, s: Settings) -> None:
    document["components"]["schemas"] |= _schemas()
    document["paths"] |= _paths()
