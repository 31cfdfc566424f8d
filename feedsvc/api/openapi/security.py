"""Bearer tokens in the OpenAPI document: with authentication on, the data
routes need a token whose scope allows them (``feedsvc.api.identity``)."""

from __future__ import annotations

from typing import Any

from feedsvc.api.openapi import shared
from feedsvc.api.openapi.admin import ADMIN_PREFIX
from feedsvc.api.openapi.home import UNAUTHENTICATED
from feedsvc.api.openapi.shared import Document
from feedsvc.config import Settings


def add(document: Document, settings: Settings) -> None:
    """With authentication on: the data routes need a bearer token (else
    401) whose scope allows the route's action on its queue or topic (else
    403), and the project is the token's, so X-Project-ID is not needed there."""
    if not (
        settings.auth_token
        or settings.auth_token_file
        or settings.jwt_on()
        or settings.keystone_url
    ):
        return
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
    # the admin routes' own scheme (the admin part) stays
    components.setdefault("securitySchemes", {}).update(schemes)
    components["responses"]["Unauthorized"] = shared.response(
        "No bearer token, or one that does not hold (RFC 6750: "
        'WWW-Authenticate: Bearer error="invalid_token"; for a Keystone X-Auth-Token, '
        'Keystone uri="...").',
        shared.schema("Error"),
        headers={"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    )
    components["responses"]["InsufficientScope"] = shared.response(
        "The token's scope does not allow this action on this queue or topic "
        '(WWW-Authenticate: Bearer error="insufficient_scope").',
        shared.schema("Error"),
        headers={"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    )
    project = shared.ref("parameters", "ProjectId")
    for path, item in document["paths"].items():
        if path in UNAUTHENTICATED:
            continue
        if path.startswith(ADMIN_PREFIX):
            # the admin token, or a token whose scope holds admin:PROJECT_GLOB
            # (only the token file and JWTs carry scopes)
            if settings.auth_token_file or settings.jwt_on():
                for operation in item.values():
                    operation["security"] += [{n: []} for n in schemes if n != "keystone"]
                    operation["responses"]["401"] = shared.ref("responses", "Unauthorized")
            continue
        for operation in item.values():
            operation["security"] = [{name: []} for name in schemes]
            operation["responses"]["401"] = shared.ref("responses", "Unauthorized")
            operation["responses"].setdefault("403", shared.ref("responses", "InsufficientScope"))
            operation["parameters"] = [
                shared.ref("parameters", "ProjectIdFromToken") if p == project else p
                for p in operation["parameters"]
            ]
