"""The OpenAPI document's part for browsers' reads (an ``EventSource``
sends no headers): Client-ID optional on GET and HEAD, a pre-signed URL's
parts in the query string (``feedsvc.api.signed_urls``), and, with
authentication on, a bearer token as ``access_token`` in the query of a
read (``feedsvc.api.identity``), declared as a security scheme too."""

from __future__ import annotations

from collections.abc import Mapping

from feedsvc.api.identity import ACCESS_TOKEN
from feedsvc.api.openapi.shared import Document, Schema, ref
from feedsvc.api.openapi.signed import SIGNABLE
from feedsvc.api.signed_urls import SIGNED_HEADERS
from feedsvc.config import Settings

#: The methods a query-string credential, and a read without Client-ID, are for.
READS = ("get", "head")
#: (method, path) -> the action a token's scope must allow (``routes.ACTIONS``,
#: the one table of them, or the app's copy of it: the document cannot import
#: the route table, which serves the document).
RouteActions = Mapping[tuple[str, str], str | None]
#: The security scheme of access_token.
SCHEME = "accessToken"


def _below(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def is_read(path: str, actions: RouteActions) -> bool:
    """Whether a GET of path is a ``read`` route, the routes whose GET takes
    an access_token (``feedsvc.api.identity``)."""
    return actions.get(("GET", path)) == "read"


def _operations(document: Document) -> list[tuple[str, Schema]]:
    return [
        (path, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if method in READS
    ]


def add(document: Document, settings: Settings, actions: RouteActions) -> None:
    """Run last: the operations' parameters and security are all there.
    actions says which routes are reads."""
    components = document["components"]
    parameters = components["parameters"]
    refused = ref("responses", "QueryCredentialRefused")
    components["responses"]["QueryCredentialRefused"] = {
        "description": "A credential in the query string that this request may not use "
        "(a pre-signed URL's parts that do not allow it, or on a method other than GET "
        "and HEAD; access_token on a route that is no read).",
        "content": {"application/json": {"schema": ref("schemas", "Error")}},
    }
    parameters["ClientIdOptional"] = {
        **parameters["ClientId"],
        "required": False,
        "description": "The client's UUID (with or without dashes). Optional on GET and "
        "HEAD (a browser's EventSource cannot send it): a reader without one sees every "
        "message, echo or not, since no message is its own.",
    }
    query_parts = {
        **{header: f"the pre-signed URL's {header} header" for header in SIGNED_HEADERS},
        "X-Project-ID": "the pre-signed URL's project (the X-Project-ID header)",
    }
    signed = []
    for name, what in query_parts.items():
        key = "Query" + name.replace("-", "")
        parameters[key] = {
            "name": name,
            "in": "query",
            "required": False,
            "description": f"As {what}, in the query string, for GET and HEAD only (an "
            "EventSource's URL). Refused with 403 if it does not hold; never logged.",
            "schema": {"type": "string"},
        }
        signed.append(ref("parameters", key))
    client_id = ref("parameters", "ClientId")
    optional = ref("parameters", "ClientIdOptional")
    tokens = bool(settings.auth_token or settings.auth_token_file or settings.jwt_on())
    if tokens:
        components["securitySchemes"][SCHEME] = {
            "type": "apiKey",
            "in": "query",
            "name": ACCESS_TOKEN,
            "description": "A bearer token (static or JWT) in the query string (RFC 6750 "
            "section 2.3), for an EventSource: accepted on GET and HEAD of read routes "
            "only (403 elsewhere), never together with an Authorization header (400), "
            "never logged.",
        }
        parameters["AccessToken"] = {
            "name": ACCESS_TOKEN,
            "in": "query",
            "required": False,
            "description": "The bearer token, for a client that cannot send headers "
            "(security scheme accessToken).",
            "schema": {"type": "string"},
        }
    for path, operation in _operations(document):
        given = operation.get("parameters", [])
        if client_id not in given:
            continue  # a route that takes no Client-ID (ping, health, admin)
        added = [optional if p == client_id else p for p in given]
        if _below(path, SIGNABLE):
            added += signed
            operation["responses"].setdefault("403", refused)
        if tokens and is_read(path, actions) and "security" in operation:
            added.append(ref("parameters", "AccessToken"))
            operation["security"] = [*operation["security"], {SCHEME: []}]
        operation["parameters"] = added
