"""Pre-signed URLs in the OpenAPI document: POST .../share, and the URL-*
headers of the operations a URL can allow (``feedsvc.api.signed_urls``)."""

from __future__ import annotations

from feedsvc.api import signed_urls
from feedsvc.api.openapi import shared
from feedsvc.api.openapi.shared import Document, Schema
from feedsvc.config import Settings

# Operations a pre-signed URL can allow: those below .../messages, .../claims
# and .../subscriptions (a confirmation request carries one for PUT .../confirm).
SIGNABLE = (
    "/v2/queues/{queue}/messages",
    "/v2/queues/{queue}/claims",
    "/v2/queues/{queue}/subscriptions",
)


def add(document: Document, s: Settings) -> None:
    """POST .../share, and the URL-* headers on the operations a URL can allow."""
    components = document["components"]
    signed_path: Schema = {"type": "string", "pattern": "^/v2/queues/[^/]+/[a-z]+$"}
    components["schemas"]["ShareOptions"] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "paths": {
                "type": "array",
                "items": {"enum": list(signed_urls.SHARE_PATHS)},
                "description": "What the URL allows below the queue (and below those: a "
                "message, a claim); default [messages].",
            },
            "methods": {
                "type": "array",
                "items": {"enum": list(signed_urls.METHODS)},
                "description": "The methods it allows; default [GET].",
            },
            "expires": {
                "type": "string",
                "description": "ISO 8601 date and time it stops working, UTC unless it "
                "has an offset, in the future; default in one day. Not a number.",
                "example": "2030-01-01T00:00:00",
            },
        },
    }
    components["schemas"]["SignedURL"] = shared.obj(
        {
            "paths": {
                "type": "array",
                "items": signed_path,
                "description": "Send back comma-joined as URL-Paths.",
            },
            "methods": {
                "type": "array",
                "items": {"enum": list(signed_urls.METHODS)},
                "description": "Send back comma-joined as URL-Methods.",
            },
            "project": {
                "type": "string",
                "description": "Send back as X-Project-ID.",
            },
            "expires": {
                "type": "string",
                "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$",
                "description": "UTC; send back as URL-Expires.",
            },
            "signature": {
                "type": "string",
                "pattern": "^[0-9a-f]{64}$",
                "description": "HMAC-SHA256 of the other fields (as Zaqar signs); send "
                "back as URL-Signature.",
            },
        },
        ["paths", "methods", "project", "expires", "signature"],
    )
    headers = {
        "UrlSignature": ("URL-Signature", "the signature"),
        "UrlExpires": ("URL-Expires", "its expires"),
        "UrlMethods": ("URL-Methods", "its methods, comma-separated"),
        "UrlPaths": ("URL-Paths", "its paths, comma-separated"),
    }
    for name, (header, what) in headers.items():
        components["parameters"][name] = {
            "name": header,
            "in": "header",
            "required": False,
            "description": f"A pre-signed URL's {what} (POST .../share answers them all). "
            "A request with any URL-* header is served only if the signature holds for "
            "its method and path, until it expires, in the project of X-Project-ID; with "
            "--auth-token it then needs no bearer token. Otherwise it is 404.",
            "schema": {"type": "string"},
        }
    components["responses"]["NotFoundOrNotSigned"] = shared.response(
        "No such resource (in this project and queue); or the request carries URL-* "
        "headers that do not allow it (another method or path, expired, a wrong "
        "signature, or the service has no --signed-url-key).",
        shared.schema("Error"),
    )
    signed_headers = [shared.ref("parameters", name) for name in headers]
    for prefix in SIGNABLE:
        for route, item in document["paths"].items():
            if route == prefix or route.startswith(prefix + "/"):
                for op in item.values():
                    op["parameters"] = [*op["parameters"], *signed_headers]
                    op["responses"]["404"] = shared.ref("responses", "NotFoundOrNotSigned")
    document["paths"]["/v2/queues/{queue}/share"] = {
        "post": shared.operation(
            "shareQueue",
            "Make a pre-signed URL: what a client holding it may do, without a token",
            shared.ok("The signed URL.", "SignedURL"),
            parameters=shared.common("Queue"),
            body=shared.json_body(
                "ShareOptions",
                description="{} takes the defaults. Without --signed-url-key the "
                "answer is 400, as in Zaqar.",
            ),
        )
    }
