"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /v2/openapi.json``.

The document is built from the running service's :class:`~feedsvc.config.Settings`
by the parts below, one module per route group, each adding its paths and
components: ``shared`` (what all use), ``home``, ``queues``, ``live`` (long
polls and event streams), ``messages``, ``claims``, ``subscriptions``,
``admin``, then the parts that change what came before: ``consumers``
(message headers on the message schemas), ``topics`` (the
queue operations on topics), ``redrive`` (a dead-letter queue's redrive,
queues only), ``signed`` (pre-signed URLs), ``security``
(bearer tokens), and last ``browser`` (what an EventSource may send instead
of headers: Client-ID optional on reads, credentials in the query), which
is given the routes' actions (``routes.ACTIONS``) to know which routes are
reads: the route table serves this document, so the document is handed its
actions rather than importing them. Every
query parameter and numeric body field is rendered
from ``feedsvc.api.spec``, the same objects validation reads them with, so
the bounds stated are the ones enforced.

A new part is a module with ``add(document, settings)`` that imports its
builders from ``shared`` and is listed in PARTS where it belongs: before
``topics`` if topics should have it too, before ``signed``, ``security`` and
``browser`` if those should apply to its operations.

``tests/test_openapi.py`` and ``tests/test_openapi_spec.py`` keep it true.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import orjson
from aiohttp import web

from feedsvc import __version__
from feedsvc.api.openapi import (
    admin,
    browser,
    claims,
    consumers,
    home,
    live,
    messages,
    queues,
    redrive,
    security,
    shared,
    signed,
    subscriptions,
    topics,
)
from feedsvc.api.openapi.browser import RouteActions
from feedsvc.api.openapi.home import UNAUTHENTICATED
from feedsvc.api.openapi.shared import JSON, Document
from feedsvc.appkeys import ROUTE_ACTIONS, SETTINGS
from feedsvc.config import Settings

__all__ = ["PARTS", "UNAUTHENTICATED", "RouteActions", "get_openapi", "openapi_document"]

OPENAPI_VERSION = "3.1.0"

#: The parts, in the order they add to the document (then ``browser``).
PARTS: list[Callable[[Document, Settings], None]] = [
    shared.add,
    home.add,
    queues.add,
    live.add,
    messages.add,
    claims.add,
    subscriptions.add,
    admin.add,
    consumers.add,
    topics.add,
    redrive.add,
    signed.add,
    security.add,
]


def openapi_document(settings: Settings, actions: RouteActions) -> Document:
    """The OpenAPI description of the service as configured by ``settings``,
    whose routes' actions are ``actions`` (``routes.ACTIONS``)."""
    document: Document = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "feedsvc",
            "version": __version__,
            "description": "A Zaqar-v2-compatible message feed on Redis. Every /v2 route "
            "except ping, health and this document needs the Client-ID and X-Project-ID "
            "headers (with --auth-token, a bearer token instead of X-Project-ID on the "
            "data routes). "
            "Errors are JSON {title, description}; every 503 carries Retry-After.",
        },
        "paths": {},
        "components": {"schemas": {}, "parameters": {}, "responses": {}},
    }
    for add in PARTS:
        add(document, settings)
    browser.add(document, settings, actions)
    return document


@cache
def _encoded(settings: Settings, actions: frozenset[tuple[tuple[str, str], str | None]]) -> bytes:
    return orjson.dumps(openapi_document(settings, dict(actions)))


async def get_openapi(request: web.Request) -> web.Response:
    """GET /v2/openapi.json: no headers needed. The app's table of its
    routes' actions is routes.ACTIONS's, by route."""
    actions = frozenset(
        ((route.method, route.resource.canonical), action)
        for route, action in request.app[ROUTE_ACTIONS].items()
        if route.resource is not None
    )
    return web.Response(body=_encoded(request.app[SETTINGS], actions), content_type=JSON)
