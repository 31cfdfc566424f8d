"""The URL map: every route the service answers, in one table, and the
action each one is for the scope check (``ACTIONS``, ``feedsvc.api.identity``)."""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.typedefs import Handler
from aiohttp.web_urldispatcher import AbstractRoute

from feedsvc.api import admin, console, metrics, openapi, redrive, signed_urls, streams
from feedsvc.api import handlers as h
from feedsvc.api import subscriptions as subs
from feedsvc.api.feeds import QUEUES, TOPICS, FeedHandler, Kind, on_feed, on_feeds
from feedsvc.appkeys import ROUTE_ACTIONS
from feedsvc.auth.access import ADMIN as ADMIN_ACTION

QUEUE = "/v2/queues/{queue}"
# A topic is a feed like a queue (the same handlers, on FeedStore.topics()),
# without claims or share, as in Zaqar.
TOPIC = "/v2/topics/{topic}"
#: A route: method, path, handler, and the action a token's scope must allow
#: to use it (``feedsvc.auth.access``; None: open to all, no stored data shown).
#: Below a queue or topic: read (list, get, stats, follow), post, claim
#: (claims, and deleting a claimed message: identity.WITH_CLAIM_ID), delete,
#: manage (the queue itself, purge, subscriptions, share).
Route = tuple[str, str, Handler, str | None]
#: A route below a queue or a topic: its handler takes the request's feed
#: (``feeds.on_feed`` binds it to the kind where the route is added).
FeedRoute = tuple[str, str, FeedHandler, str | None]

# The operator's routes (feedsvc.api.admin), behind the admin token (or
# admin:PROJECT_GLOB, checked by admin.py).
ADMIN = "/v2/admin/projects/{project}"

ADMIN_ROUTES: list[Route] = [
    ("GET", "/limits", admin.get_project_limits, ADMIN_ACTION),
    ("PUT", "/limits", admin.put_project_limits, ADMIN_ACTION),
    ("DELETE", "/limits", admin.delete_project_limits, ADMIN_ACTION),
    ("GET", "/usage", admin.get_project_usage, ADMIN_ACTION),
]

# What queues and topics both answer, below their own path.
# aiohttp finds a path's resource by trying, in the order they were added,
# every resource under its longest static prefix (/v2/queues for all of
# these): each one tried costs ≈ 0.25 µs. The message routes, which carry
# nearly all the traffic, come first (the whole-path lookup of a POST or a
# GET of messages: 3.3 → 1.7 µs). A path's methods stay together: aiohttp
# adds a method to the last resource only when the path is the same.
FEED: list[FeedRoute] = [
    ("POST", "/messages", h.post_messages, "post"),
    ("GET", "/messages", streams.get_messages, "read"),
    ("DELETE", "/messages", h.delete_messages, "delete"),
    ("GET", "/messages/{message_id}", h.get_message, "read"),
    ("DELETE", "/messages/{message_id}", h.delete_message, "delete"),
    ("PUT", "", h.create_queue, "manage"),
    ("GET", "", h.get_queue, "read"),
    ("PATCH", "", h.patch_queue, "manage"),
    ("DELETE", "", h.delete_queue, "manage"),
    ("POST", "/purge", h.purge_queue, "manage"),
    ("GET", "/stats", h.get_queue_stats, "read"),
    ("POST", "/subscriptions", subs.create_subscription, "manage"),
    ("GET", "/subscriptions", subs.list_subscriptions, "manage"),
    ("GET", "/subscriptions/{subscription_id}", subs.get_subscription, "manage"),
    ("PATCH", "/subscriptions/{subscription_id}", subs.patch_subscription, "manage"),
    ("DELETE", "/subscriptions/{subscription_id}", subs.delete_subscription, "manage"),
    ("PUT", "/subscriptions/{subscription_id}/confirm", subs.confirm_subscription, "manage"),
]


def below(kind: Kind, prefix: str, routes: list[FeedRoute]) -> list[Route]:
    """routes under prefix (a queue's or a topic's path), each handler bound
    to kind: it is handed the request's feed, resolved once (``feeds``)."""
    return [
        (method, prefix + path, on_feed(kind, handler), action)
        for method, path, handler, action in routes
    ]


ROUTES: list[Route] = [
    ("GET", "/", h.get_versions, None),
    ("GET", "/v2", h.get_home, None),
    ("GET", "/v2/", h.get_home, None),
    ("GET", "/v2/ping", h.ping, None),
    ("GET", "/v2/health", h.get_health, None),
    ("GET", "/v2/openapi.json", openapi.get_openapi, None),
    *below(QUEUES, QUEUE, FEED),
    ("GET", "/v2/queues", on_feeds(QUEUES, h.list_queues), "read"),  # after: see FEED
    # what only queues answer (topics have no claims and no share)
    ("POST", QUEUE + "/share", on_feed(QUEUES, signed_urls.share_queue), "manage"),
    ("POST", QUEUE + "/claims", on_feed(QUEUES, h.post_claim), "claim"),
    ("GET", QUEUE + "/claims/{claim_id}", on_feed(QUEUES, h.get_claim), "claim"),
    ("PATCH", QUEUE + "/claims/{claim_id}", on_feed(QUEUES, h.patch_claim), "claim"),
    ("DELETE", QUEUE + "/claims/{claim_id}", on_feed(QUEUES, h.delete_claim), "claim"),
    ("POST", QUEUE + "/messages/{message_id}/release", on_feed(QUEUES, h.release_message), "claim"),
    # a dead-letter queue's redrive; "to" another queue needs post there too
    ("POST", QUEUE + "/redrive", on_feed(QUEUES, redrive.start_redrive), "manage"),
    ("GET", QUEUE + "/redrive", on_feed(QUEUES, redrive.get_redrive), "manage"),
    ("DELETE", QUEUE + "/redrive", on_feed(QUEUES, redrive.cancel_redrive), "manage"),
    *below(TOPICS, TOPIC, FEED),
    ("GET", "/v2/topics", on_feeds(TOPICS, h.list_queues), "read"),
    *[(method, ADMIN + path, handler, action) for method, path, handler, action in ADMIN_ROUTES],
]


#: (method, path) -> the action a token's scope must allow; None: open to all
#: (no stored data shown). A GET's entry covers its HEAD. add_routes refuses
#: to add a route that is not here.
ACTIONS: dict[tuple[str, str], str | None] = {
    **{(method, path): action for method, path, _, action in ROUTES},
    ("GET", "/metrics"): None,
    ("GET", "/console"): None,
    ("GET", "/console/{asset}"): None,
    ("GET", "/bench/hello"): None,
    ("POST", "/bench/post"): None,
    ("GET", "/bench/page"): None,
    ("GET", "/bench/ping"): None,
}


def route_actions(app: web.Application) -> dict[AbstractRoute, str | None]:
    """Each route of app -> its action (ACTIONS); RuntimeError for a route
    with none, so a route cannot be added without saying who may use it."""
    table: dict[AbstractRoute, str | None] = {}
    for route in app.router.routes():
        method = "GET" if route.method == "HEAD" else route.method
        canonical = route.resource.canonical if route.resource is not None else ""
        if (method, canonical) not in ACTIONS:
            raise RuntimeError(f"{method} {canonical} has no action in routes.ACTIONS")
        table[route] = ACTIONS[method, canonical]
    return table


async def expect_continue(request: web.Request) -> None:
    """What an ``Expect`` header gets before the handler runs: "100
    Continue" for ``100-continue`` (as aiohttp's default), and any other
    expectation is ignored (RFC 9110 lets a server ignore one) instead of
    aiohttp's plain-text 417, which no operation of the API documents."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version == HttpVersion11 and expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started


def add_routes(app: web.Application, bench_routes: bool = False) -> None:
    for method, path, handler, _ in ROUTES:
        if method == "GET":
            # GET routes answer HEAD too (HEAD /v2/ping is a health probe)
            app.router.add_get(path, handler, expect_handler=expect_continue)
        else:
            app.router.add_route(method, path, handler, expect_handler=expect_continue)
    # operations: not part of the Zaqar API, no headers needed
    app.router.add_get("/metrics", metrics.get_metrics, expect_handler=expect_continue)
    # the browser console: static files; the page sends /v2 requests itself
    app.router.add_get("/console", console.get_console, expect_handler=expect_continue)
    app.router.add_get(
        "/console/{asset}", console.get_console_asset, expect_handler=expect_continue
    )
    if bench_routes:
        app.router.add_get("/bench/hello", h.bench_hello)
        app.router.add_post("/bench/post", h.bench_post)
        app.router.add_get("/bench/page", h.bench_page)
        app.router.add_get("/bench/ping", h.bench_ping)
    app[ROUTE_ACTIONS] = route_actions(app)
