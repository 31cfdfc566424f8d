"""The URL map: every route the service answers, in one table."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from feedsvc.api import console, metrics, openapi, signed_urls, streams
from feedsvc.api import handlers as h
from feedsvc.api import subscriptions as subs

QUEUE = "/v2/queues/{queue}"
# A topic is a feed like a queue (the same handlers, on FeedStore.topics()),
# without claims, as in Zaqar. Its subscriptions come with queues' ones.
TOPIC = "/v2/topics/{topic}"

ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/", h.get_versions),
    ("GET", "/v2", h.get_home),
    ("GET", "/v2/", h.get_home),
    ("GET", "/v2/ping", h.ping),
    ("GET", "/v2/health", h.get_health),
    ("GET", "/v2/openapi.json", openapi.get_openapi),
    ("GET", "/v2/queues", h.list_queues),
    ("PUT", QUEUE, h.create_queue),
    ("GET", QUEUE, h.get_queue),
    ("PATCH", QUEUE, h.patch_queue),
    ("DELETE", QUEUE, h.delete_queue),
    ("POST", QUEUE + "/purge", h.purge_queue),
    ("POST", QUEUE + "/share", signed_urls.share_queue),
    ("GET", QUEUE + "/stats", h.get_queue_stats),
    ("POST", QUEUE + "/messages", h.post_messages),
    ("GET", QUEUE + "/messages", streams.get_messages),
    ("DELETE", QUEUE + "/messages", h.delete_messages),
    ("GET", QUEUE + "/messages/{message_id}", h.get_message),
    ("DELETE", QUEUE + "/messages/{message_id}", h.delete_message),
    ("POST", QUEUE + "/claims", h.post_claim),
    ("GET", QUEUE + "/claims/{claim_id}", h.get_claim),
    ("PATCH", QUEUE + "/claims/{claim_id}", h.patch_claim),
    ("DELETE", QUEUE + "/claims/{claim_id}", h.delete_claim),
    ("GET", "/v2/topics", h.list_queues),
    ("PUT", TOPIC, h.create_queue),
    ("GET", TOPIC, h.get_queue),
    ("PATCH", TOPIC, h.patch_queue),
    ("DELETE", TOPIC, h.delete_queue),
    ("POST", TOPIC + "/purge", h.purge_queue),
    ("GET", TOPIC + "/stats", h.get_queue_stats),
    ("POST", TOPIC + "/messages", h.post_messages),
    ("GET", TOPIC + "/messages", streams.get_messages),
    ("DELETE", TOPIC + "/messages", h.delete_messages),
    ("GET", TOPIC + "/messages/{message_id}", h.get_message),
    ("DELETE", TOPIC + "/messages/{message_id}", h.delete_message),
    ("POST", QUEUE + "/subscriptions", subs.create_subscription),
    ("GET", QUEUE + "/subscriptions", subs.list_subscriptions),
    ("GET", QUEUE + "/subscriptions/{subscription_id}", subs.get_subscription),
    ("PATCH", QUEUE + "/subscriptions/{subscription_id}", subs.patch_subscription),
    ("DELETE", QUEUE + "/subscriptions/{subscription_id}", subs.delete_subscription),
    ("PUT", QUEUE + "/subscriptions/{subscription_id}/confirm", subs.confirm_subscription),
    ("POST", TOPIC + "/subscriptions", subs.create_subscription),
    ("GET", TOPIC + "/subscriptions", subs.list_subscriptions),
    ("GET", TOPIC + "/subscriptions/{subscription_id}", subs.get_subscription),
    ("PATCH", TOPIC + "/subscriptions/{subscription_id}", subs.patch_subscription),
    ("DELETE", TOPIC + "/subscriptions/{subscription_id}", subs.delete_subscription),
    ("PUT", TOPIC + "/subscriptions/{subscription_id}/confirm", subs.confirm_subscription),
]


def add_routes(app: web.Application, bench_routes: bool = False) -> None:
    for method, path, handler in ROUTES:
        if method == "GET":
            # GET routes answer HEAD too (HEAD /v2/ping is a health probe)
            app.router.add_get(path, handler)
        else:
            app.router.add_route(method, path, handler)
    # operations: not part of the Zaqar API, no headers needed
    app.router.add_get("/metrics", metrics.get_metrics)
    # the browser console: static files; the page sends /v2 requests itself
    app.router.add_get("/console", console.get_console)
    app.router.add_get("/console/{asset}", console.get_console_asset)
    if bench_routes:
        app.router.add_get("/bench/hello", h.bench_hello)
