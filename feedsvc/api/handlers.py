"""HTTP handlers: parse and validate, call the store, shape Zaqar v2 JSON.

Handlers catch nothing: errors go to ``feedsvc.api.middleware``. Message
bodies come back from Redis as the JSON the service stored and are spliced
into responses with ``orjson.Fragment``, never decoded.
"""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import urlencode

import orjson
from aiohttp import web

from feedsvc.api import validation as v
from feedsvc.api.home import HOME_DOCUMENT
from feedsvc.config import Settings
from feedsvc.errors import BadRequest, MessageNotFound, NotFound, Unavailable
from feedsvc.storage.base import FeedStore, ListQuery, Message, MessageSummary
from feedsvc.storage.redis_store import now_ms

STORE = web.AppKey("store", FeedStore)
SETTINGS = web.AppKey("settings", Settings)

API_VERSION = "2"
UPDATED = "2014-09-24T04:06:47Z"
MEDIA_TYPES = [{"base": "application/json", "type": "application/vnd.openstack.messaging-v2+json"}]


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _store(request: web.Request) -> FeedStore:
    return request.app[STORE]


def _settings(request: web.Request) -> Settings:
    return request.app[SETTINGS]


def _queue_href(queue: str) -> str:
    return f"/v2/queues/{queue}"


def _message_json(queue: str, message: Message, now: int) -> dict[str, Any]:
    href = f"/v2/queues/{queue}/messages/{message.id}"
    if message.claim_id is not None:
        href += f"?claim_id={message.claim_id}"
    return {
        "id": message.id,
        "href": href,
        "ttl": message.ttl,
        "age": message.age(now),
        "body": orjson.Fragment(message.body),
    }


def reserved_defaults(settings: Settings, metadata: dict[str, Any]) -> dict[str, Any]:
    """The reserved queue settings a GET shows when the queue does not set them."""
    defaults: dict[str, Any] = {
        "_max_messages_post_size": settings.max_messages_post_size,
        "_default_message_ttl": settings.default_message_ttl,
        "_default_message_delay": 0,
        "_dead_letter_queue": None,
        "_dead_letter_queue_messages_ttl": None,
        "_max_claim_count": None,
    }
    return {k: v for k, v in defaults.items() if metadata.get(k) is None}


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _summary_json(queue: str, summary: MessageSummary, now: int) -> dict[str, Any]:
    return {
        "id": summary.id,
        "href": f"/v2/queues/{queue}/messages/{summary.id}",
        "age": max(0, (now - summary.created_ms) // 1000),
        "created": _iso(summary.created_ms),
    }


# -- service -----------------------------------------------------------------


async def get_versions(request: web.Request) -> web.Response:
    return json_response(
        {
            "versions": [
                {
                    "id": API_VERSION,
                    "status": "CURRENT",
                    "updated": UPDATED,
                    "media-types": MEDIA_TYPES,
                    "links": [{"href": "/v2/", "rel": "self"}],
                }
            ]
        },
        status=300,
    )


async def get_home(request: web.Request) -> web.Response:
    v.caller(request)
    return web.Response(
        body=HOME_DOCUMENT,
        content_type="application/json-home",
        headers={"Cache-Control": "max-age=86400"},
    )


async def ping(request: web.Request) -> web.Response:
    v.caller(request)
    try:
        await _store(request).ping()
    except Unavailable:
        return web.Response(status=503, headers={"Retry-After": "1"})
    return web.Response(status=204)


async def get_health(request: web.Request) -> web.Response:
    v.caller(request)
    store = _store(request)
    try:
        await store.ping()
        reachable = True
    except Unavailable:
        reachable = False
    payload = {
        "storage_reachable": reachable,
        "driver": store.name,
        "watch_retries": store.counters.watch_retries,
        "watch_conflicts_exhausted": store.counters.watch_conflicts_exhausted,
        "noscript_reloads": store.counters.noscript_reloads,
    }
    return json_response(payload, status=200 if reachable else 503)


# -- queues ------------------------------------------------------------------


async def list_queues(request: web.Request) -> web.Response:
    settings = _settings(request)
    project, _ = v.caller(request)
    query = request.query
    marker = v.queue_marker(query)
    limit = v.bounded_int(
        query, "limit", settings.default_queues_per_page, 1, settings.max_queues_per_page
    )
    detailed = v.flag(query, "detailed")
    with_count = v.flag(query, "with_count")
    store = _store(request)
    queues = await store.list_queues(project, marker, limit, detailed)
    payload: dict[str, Any] = {
        "queues": [
            {"name": q.name, "href": _queue_href(q.name)}
            | ({"metadata": q.metadata} if detailed else {})
            for q in queues
        ],
        "links": [],
    }
    if queues:
        params = {"marker": queues[-1].name, "limit": limit}
        if detailed:
            params["detailed"] = "true"
        payload["links"] = [{"rel": "next", "href": "/v2/queues?" + urlencode(params)}]
    if with_count:
        payload["count"] = await store.count_queues(project)
    return json_response(payload)


async def create_queue(request: web.Request) -> web.Response:
    project, _ = v.caller(request)
    queue = v.queue_name(request)
    metadata = v.queue_metadata(await request.read())
    created = await _store(request).create_queue(project, queue, metadata)
    # Like Zaqar, a PUT on an existing queue changes nothing (use PATCH).
    return web.Response(status=201 if created else 204, headers={"Location": _queue_href(queue)})


async def get_queue(request: web.Request) -> web.Response:
    project, _ = v.caller(request)
    queue = v.queue_name(request)
    # Like Zaqar, a queue that does not exist shows the defaults (200).
    metadata = await _store(request).get_queue_metadata(project, queue) or {}
    return json_response(metadata | reserved_defaults(_settings(request), metadata))


async def delete_queue(request: web.Request) -> web.Response:
    project, _ = v.caller(request)
    queue = v.queue_name(request)
    await _store(request).delete_queue(project, queue)
    return web.Response(status=204)


async def get_queue_stats(request: web.Request) -> web.Response:
    project, _ = v.caller(request)
    queue = v.queue_name(request)
    stats = await _store(request).queue_stats(project, queue)
    now = now_ms()
    messages: dict[str, Any] = {
        "claimed": stats.claimed,
        "free": stats.free,
        "total": stats.total,
    }
    if stats.oldest is not None:
        messages["oldest"] = _summary_json(queue, stats.oldest, now)
    if stats.newest is not None:
        messages["newest"] = _summary_json(queue, stats.newest, now)
    return json_response({"messages": messages})


# -- messages ----------------------------------------------------------------


async def post_messages(request: web.Request) -> web.Response:
    settings = _settings(request)
    project, client = v.caller(request)
    queue = v.queue_name(request)
    messages = v.new_messages(v.json_document(await request.read()), settings)
    ids = await _store(request).post_messages(project, queue, client, messages)
    base = f"/v2/queues/{queue}/messages"
    body = orjson.dumps({"resources": [f"{base}/{i}" for i in ids]})
    return web.Response(
        status=201,
        body=body,
        content_type="application/json",
        headers={"Location": f"{base}?ids={','.join(ids)}"},
    )


async def get_messages(request: web.Request) -> web.Response:
    """GET .../messages: a page after a marker, or the messages named by ?ids=."""
    settings = _settings(request)
    project, client = v.caller(request)
    queue = v.queue_name(request)
    query = request.query
    store = _store(request)
    ids = v.id_list(query, "ids", settings.max_messages_per_page)
    now = now_ms()
    if ids is not None:
        found = await store.get_messages(project, queue, [i for i in ids if v.is_id(i)])
        if not found:
            raise NotFound(f"No messages with ids {', '.join(ids)} in queue {queue}.")
        return json_response({"messages": [_message_json(queue, m, now) for m in found]})

    list_query = ListQuery(
        client_id=client,
        marker=v.message_marker(query),
        limit=v.bounded_int(
            query,
            "limit",
            settings.default_messages_per_page,
            1,
            settings.max_messages_per_page,
        ),
        echo=v.flag(query, "echo"),
        include_claimed=v.flag(query, "include_claimed"),
        include_delayed=v.flag(query, "include_delayed"),
    )
    page = await store.list_messages(project, queue, list_query)
    links = []
    if page.next_marker is not None:
        params = {"marker": str(page.next_marker), "limit": str(list_query.limit)}
        for name in ("echo", "include_claimed", "include_delayed"):
            if getattr(list_query, name):
                params[name] = "true"
        href = f"/v2/queues/{queue}/messages?{urlencode(params)}"
        links.append({"rel": "next", "href": href})
    payload = {
        "messages": [_message_json(queue, m, now) for m in page.messages],
        "links": links,
    }
    return json_response(payload)


async def get_message(request: web.Request) -> web.Response:
    project, _ = v.caller(request)
    queue = v.queue_name(request)
    message_id = request.match_info["message_id"]
    found = []
    if v.is_id(message_id):
        found = await _store(request).get_messages(project, queue, [message_id])
    if not found:
        raise MessageNotFound(message_id)
    return json_response(_message_json(queue, found[0], now_ms()))


async def delete_message(request: web.Request) -> web.Response:
    project, _ = v.caller(request)
    queue = v.queue_name(request)
    message_id = request.match_info["message_id"]
    # A malformed claim_id is passed on: it holds no message, so deleting an
    # existing message with it is a 400 and deleting a missing one a 204.
    claim_id = request.query.get("claim_id") or None
    if v.is_id(message_id):
        await _store(request).delete_message(project, queue, message_id, claim_id)
    return web.Response(status=204)


async def delete_messages(request: web.Request) -> web.Response:
    settings = _settings(request)
    project, _ = v.caller(request)
    queue = v.queue_name(request)
    ids = v.id_list(request.query, "ids", settings.max_messages_per_page)
    if ids is None:
        raise BadRequest("Either ids or pop must be given.")
    await _store(request).delete_messages(project, queue, [i for i in ids if v.is_id(i)])
    return web.Response(status=204)
