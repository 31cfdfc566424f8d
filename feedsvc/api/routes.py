"""The URL map: every route the service answers, in one table."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from feedsvc.api import handlers as h

QUEUE = "/v2/queues/{queue}"

ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/", h.get_versions),
    ("GET", "/v2", h.get_home),
    ("GET", "/v2/", h.get_home),
    ("GET", "/v2/ping", h.ping),
    ("GET", "/v2/health", h.get_health),
    ("GET", "/v2/queues", h.list_queues),
    ("PUT", QUEUE, h.create_queue),
    ("GET", QUEUE, h.get_queue),
    ("DELETE", QUEUE, h.delete_queue),
    ("GET", QUEUE + "/stats", h.get_queue_stats),
    ("POST", QUEUE + "/messages", h.post_messages),
    ("GET", QUEUE + "/messages", h.get_messages),
    ("DELETE", QUEUE + "/messages", h.delete_messages),
    ("GET", QUEUE + "/messages/{message_id}", h.get_message),
    ("DELETE", QUEUE + "/messages/{message_id}", h.delete_message),
]


def add_routes(app: web.Application) -> None:
    # GET routes answer HEAD too (aiohttp adds it), which /v2/ping needs.
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
