"""HTTP handlers: parse and validate, call the store, shape Zaqar v2 JSON.

Handlers catch nothing: errors go to ``feedsvc.api.middleware``. Message
bodies come back from Redis as the JSON the service stored and are spliced
into responses with ``orjson.Fragment``, never decoded.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import orjson
from aiohttp import web

from feedsvc import tracing
from feedsvc.api import spec
from feedsvc.api import validation as v
from feedsvc.api.feeds import TOPICS, Feed, Feeds
from feedsvc.api.home import HOME_DOCUMENT
from feedsvc.api.traced import carriers, consumed, request_context, stamp
from feedsvc.appkeys import CLOCK, DRAINING, EMBEDDED_REDIS, SETTINGS, STORE
from feedsvc.config import Settings
from feedsvc.drain_signal import DrainSignal
from feedsvc.errors import (
    BadRequest,
    ClaimDoesNotHold,
    ClaimNotFound,
    FeedError,
    MessageNotFound,
    NotFound,
    RequestTimeout,
    Unavailable,
)
from feedsvc.services.live import Rounds
from feedsvc.storage.base import (
    Claim,
    ListQuery,
    Message,
    MessagePage,
    MessageSummary,
    new_id,
)

API_VERSION = "2"
UPDATED = "2014-09-24T04:06:47Z"
MEDIA_TYPES = [{"base": "application/json", "type": "application/vnd.openstack.messaging-v2+json"}]


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


async def read_body(
    request: web.Request, too_large: Callable[[], FeedError] | None = None
) -> bytes:
    """The request body, which must arrive within --client-timeout (else 408).

    A body over the size the service reads is refused while it streams in:
    with ``too_large()`` if given, else aiohttp's 413. A body that arrived
    whole with its head (most do) is read without setting up the timer.
    """
    try:
        if request.content.is_eof():
            return await request.read()
        async with asyncio.timeout(request.app[SETTINGS].client_timeout):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout("The request body did not arrive in time.") from None
    except web.HTTPRequestEntityTooLarge:
        if too_large is None:
            raise
        raise too_large() from None


def _settings(request: web.Request) -> Settings:
    return request.app[SETTINGS]


def _rules(request: web.Request) -> spec.Rules:
    return spec.rules(request.app[SETTINGS])


def _now(request: web.Request) -> int:
    """Milliseconds since the epoch, from the app's clock (the one the store uses)."""
    return request.app[CLOCK].now_ms()


def message_json(prefix: str, message: Message, now: int) -> dict[str, Any]:
    """A message as lists show it; prefix is its feed's path and
    ``/messages/`` (built once per page, not once per message)."""
    href = prefix + message.id
    if message.claim_id is not None:
        href += "?claim_id=" + message.claim_id
    age = (now - message.created_ms) // 1000
    shown = {
        "id": message.id,
        "href": href,
        "ttl": message.ttl,
        "age": age if age > 0 else 0,
        "body": orjson.Fragment(message.body),
    }
    if message.claim_id is not None:
        # how often it was claimed, this claim included (a feedsvc extension)
        shown["claim_count"] = message.claim_count
    if message.headers is not None:  # a feedsvc extension: only when it has some
        shown["headers"] = orjson.Fragment(message.headers)
    if message.group is not None:  # a feedsvc extension: only when it has one
        shown["group"] = message.group
    return shown


def popped_json(message: Message, now: int) -> dict[str, Any]:
    """A popped message as Zaqar shows it (no href: it is gone), with its
    headers and group."""
    shown = {
        "id": message.id,
        "ttl": message.ttl,
        "age": message.age(now),
        "body": orjson.Fragment(message.body),
    }
    if message.headers is not None:
        shown["headers"] = orjson.Fragment(message.headers)
    if message.group is not None:
        shown["group"] = message.group
    return shown


def _with_defaults(
    settings: Settings, metadata: dict[str, Any], topic: bool = False
) -> dict[str, Any]:
    """A queue's metadata as GET shows it: the reserved settings filled in
    (for a topic, only the three Zaqar shows: topics have no claims)."""
    defaults: dict[str, Any] = {
        "_max_messages_post_size": settings.max_messages_post_size,
        "_default_message_ttl": settings.default_message_ttl,
        "_default_message_delay": 0,
    }
    if not topic:
        defaults |= {
            "_dead_letter_queue": None,
            "_dead_letter_queue_messages_ttl": None,
            "_max_claim_count": None,
            "_enable_encrypt_messages": False,
        }
    return metadata | {k: d for k, d in defaults.items() if metadata.get(k) is None}


def iso8601_from_ms(ms: int) -> str:
    """A time in the API's JSON (a message's ``created``, a redrive's
    ``started_at``): UTC to the second, cut not rounded, as Zaqar writes
    message and claim times (oslo's ``iso8601_from_timestamp``):
    ``2026-11-27T08:05:07Z``."""
    return dt.datetime.fromtimestamp(ms // 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _summary_json(feed: str, summary: MessageSummary, now: int) -> dict[str, Any]:
    return {
        "id": summary.id,
        "href": f"{feed}/messages/{summary.id}",
        "age": max(0, (now - summary.created_ms) // 1000),
        "created": iso8601_from_ms(summary.created_ms),
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
    v.caller(request, authenticate=False)
    return web.Response(
        body=HOME_DOCUMENT,
        content_type="application/json-home",
        headers={"Cache-Control": "max-age=86400"},
    )


async def ping(request: web.Request) -> web.Response:
    """204 if Redis answers, else 503.

    Ping and health are probes, so unlike Zaqar they need no Client-ID or
    X-Project-ID (and ignore them): load balancers and uptime checkers often
    cannot send headers, and the answer is the same for every caller.
    """
    try:
        await request.app[STORE].ping()
    except Unavailable:
        return web.Response(status=503, headers={"Retry-After": "1"})
    return web.Response(status=204)


async def get_health(request: web.Request) -> web.Response:
    store = request.app[STORE]
    try:
        await store.ping()
        reachable = True
    except Unavailable:
        reachable = False
    payload = {
        "storage_reachable": reachable,
        "driver": store.name,
        "pid": os.getpid(),
        "watch_retries": store.counters.watch_retries,
        "watch_conflicts_exhausted": store.counters.watch_conflicts_exhausted,
        "posts_combined": store.counters.posts_combined,
        "noscript_reloads": store.counters.noscript_reloads,
        "redis_eviction": store.eviction_report(),
    }
    embedded_redis = request.app.get(EMBEDDED_REDIS)
    if embedded_redis is not None:
        payload["embedded_redis"] = embedded_redis()
    response = json_response(payload, status=200 if reachable else 503)
    if not reachable:
        response.headers["Retry-After"] = "1"
    return response


async def bench_hello(request: web.Request) -> web.Response:
    """The benchmarks' baseline: aiohttp + orjson, no Redis (--bench-routes)."""
    return json_response({"hello": "world"})


#: What bench_page answers: the size and shape of a page of 10 messages of
#: ``{"n": i, "pad": "x" * 100}``, as the bench's GET reads (≈ 2 KB).
_BENCH_PAGE = orjson.dumps(
    {
        "messages": [
            {
                "id": f"{i:024x}",
                "href": f"/v2/queues/bget/messages/{i:024x}",
                "ttl": 3600,
                "age": 0,
                "body": {"n": i, "pad": "x" * 100},
            }
            for i in range(10)
        ],
        "links": [{"rel": "next", "href": "/v2/queues/bget/messages?marker=10&limit=10"}],
    }
)


async def bench_post(request: web.Request) -> web.Response:
    """The ceiling of a POST without Redis (--bench-routes): the body read and
    parsed, one id made, a 201 answered as a post's, with nothing checked,
    stored or published. What a POST costs above hello that this does not is
    feedsvc's own work."""
    document = orjson.loads(await request.read())
    ids = [new_id() for _ in document["messages"]]
    return posted_response(request.path, ids)


async def bench_ping(request: web.Request) -> web.Response:
    """Hello after one round trip to Redis (--bench-routes): a PING through
    the store's transport, coalesced with other requests' calls as theirs are.
    What it costs above hello is what any request pays to wait on Redis."""
    await request.app[STORE].ping()
    return json_response({"hello": "world"})


async def bench_page(request: web.Request) -> web.Response:
    """The ceiling of a GET without Redis (--bench-routes): a page of 10
    messages' worth of JSON, built once, sent as is."""
    return web.Response(body=_BENCH_PAGE, content_type="application/json")


# -- queues ------------------------------------------------------------------


async def list_queues(request: web.Request, feeds: Feeds) -> web.Response:
    settings = _settings(request)
    rules = spec.rules(settings)
    query = request.query
    marker = v.queue_marker(query, rules.queue_marker)
    limit = v.integer(query, rules.queue_limit)
    detailed = v.flag(query, rules.detailed)
    with_count = v.flag(query, rules.with_count)
    kind, store = feeds.kind, feeds.store
    topic = kind is TOPICS
    queues = await store.list_queues(feeds.project, marker, limit, detailed)
    payload: dict[str, Any] = {
        kind.plural: [
            {"name": q.name, "href": f"{kind.path}/{q.name}"}
            | ({"metadata": _with_defaults(settings, q.metadata or {}, topic)} if detailed else {})
            for q in queues
        ],
        "links": [],
    }
    if queues:
        params = {"marker": queues[-1].name, "limit": limit}
        if detailed:
            params["detailed"] = "true"
        if with_count:
            params["with_count"] = "true"
        payload["links"] = [{"rel": "next", "href": f"{kind.path}?{urlencode(params)}"}]
    if with_count:
        payload["count"] = await store.count_queues(feeds.project)
    return json_response(payload)


async def create_queue(request: web.Request, feed: Feed) -> web.Response:
    v.metadata_length(request)
    metadata = v.queue_metadata(await read_body(request), _settings(request))
    created = await feed.store.create_queue(feed.project, feed.name, metadata)
    # Like Zaqar, a PUT on an existing queue changes nothing (use PATCH).
    return web.Response(status=201 if created else 204, headers={"Location": feed.path})


async def get_queue(request: web.Request, feed: Feed) -> web.Response:
    # Like Zaqar, a queue that does not exist shows the defaults (200).
    metadata = await feed.store.get_queue_metadata(feed.project, feed.name) or {}
    return json_response(_with_defaults(_settings(request), metadata, feed.is_topic))


async def patch_queue(request: web.Request, feed: Feed) -> web.Response:
    settings = _settings(request)
    v.metadata_length(request)
    patch = v.metadata_patch(request, await read_body(request))

    def change(current: dict[str, Any]) -> dict[str, Any]:
        return v.checked_metadata(v.apply_patch(current, patch), settings)

    updated = await feed.store.update_queue_metadata(feed.project, feed.name, change)
    return json_response(_with_defaults(settings, updated, feed.is_topic))


async def purge_queue(request: web.Request, feed: Feed) -> web.Response:
    types = v.purge_types(await read_body(request))
    if "messages" in types:
        await feed.store.purge_queue(feed.project, feed.name)
    if "subscriptions" in types:
        await feed.store.subscriptions.purge(feed.parent)
    return web.Response(status=204)


async def delete_queue(request: web.Request, feed: Feed) -> web.Response:
    # its subscriptions go with it (a deliberate difference from Zaqar's
    # Redis driver, which leaves them behind: see docs/zaqar-differences.md)
    await feed.store.subscriptions.purge(feed.parent)
    await feed.store.delete_queue(feed.project, feed.name)
    return web.Response(status=204)


async def get_queue_stats(request: web.Request, feed: Feed) -> web.Response:
    stats = await feed.store.queue_stats(feed.project, feed.name)
    now = _now(request)
    messages: dict[str, Any] = {
        "claimed": stats.claimed,
        "free": stats.free,
        "total": stats.total,
    }
    if stats.oldest is not None:
        messages["oldest"] = _summary_json(feed.path, stats.oldest, now)
    if stats.newest is not None:
        messages["newest"] = _summary_json(feed.path, stats.newest, now)
    return json_response({"messages": messages})


# -- messages ----------------------------------------------------------------


async def post_messages(request: web.Request, feed: Feed) -> web.Response:
    settings = _settings(request)
    idempotency_key = v.idempotency_key(request)
    v.post_length(request, settings)
    raw = await read_body(request, lambda: v.post_too_large(settings))
    messages = v.new_messages(v.json_document(raw), settings)
    store, project, queue = feed.store, feed.project, feed.name
    if tracing.ENABLED:
        # the request's W3C context parents the publish span, whose context
        # then goes into the messages that carry none (consumers link to it)
        context = request_context(request)
        with tracing.span(
            "publish", queue, producer=True, parent=context, links=carriers(messages)
        ) as span:
            if context:
                stamp(messages, tracing.carrier_of(span))
            ids = await store.post_messages(
                project, queue, feed.client, messages, len(raw), idempotency_key
            )
            tracing.message_ids(span, ids)
    else:
        ids = await store.post_messages(
            project, queue, feed.client, messages, len(raw), idempotency_key
        )
    return posted_response(f"{feed.path}/messages", ids)


def posted_response(base: str, ids: list[str]) -> web.Response:
    """201 for posted messages: their hrefs under base (a feed's messages
    path), and a Location naming them all."""
    body = orjson.dumps({"resources": [f"{base}/{i}" for i in ids]})
    return web.Response(
        status=201,
        body=body,
        content_type="application/json",
        headers={"Location": f"{base}?ids={','.join(ids)}"},
    )


async def get_messages(request: web.Request, feed: Feed) -> web.Response:
    """GET .../messages: a page after a marker, or the messages named by ?ids=."""
    rules = _rules(request)
    project, queue, store = feed.project, feed.name, feed.store
    query = request.query
    ids = v.id_list(query, rules.ids)
    tail = v.from_tail(query, rules.start, rules.message_marker)
    now = _now(request)
    if ids is not None:
        found = await store.get_messages(project, queue, [i for i in ids if v.is_id(i)])
        if not found:
            raise NotFound(f"No messages with ids {', '.join(ids)} in {feed.kind.name} {queue}.")
        prefix = f"{feed.path}/messages/"
        return json_response({"messages": [message_json(prefix, m, now) for m in found]})

    list_query = list_query_of(request, feed.client)
    if tail:  # nothing yet: a next link to poll from (docs/live-following.md)
        page = MessagePage([], await store.tail_marker(project, queue))
    else:
        page = await store.list_messages(project, queue, list_query)
    return page_response(feed.path, page, list_query, now)


def list_query_of(request: web.Request, client: str) -> ListQuery:
    """A list request's marker, limit and filters."""
    rules = _rules(request)
    query = request.query
    return ListQuery(
        client_id=client,
        marker=v.message_marker(query, rules.message_marker),
        limit=v.integer(query, rules.message_limit),
        echo=v.flag(query, rules.echo),
        include_claimed=v.flag(query, rules.include_claimed),
        include_delayed=v.flag(query, rules.include_delayed),
        check_marker=True,
    )


def page_response(feed: str, page: MessagePage, list_query: ListQuery, now: int) -> web.Response:
    """A page of messages, with its next link (none when the page is empty);
    feed is the queue's (or topic's) path."""
    links = []
    if page.next_marker is not None:
        # spelt out rather than urlencode()d (3 µs on every page): the marker
        # and the limit are digits, the flags "true", nothing needs quoting
        href = f"{feed}/messages?marker={page.next_marker}&limit={list_query.limit}"
        if list_query.echo:
            href += "&echo=true"
        if list_query.include_claimed:
            href += "&include_claimed=true"
        if list_query.include_delayed:
            href += "&include_delayed=true"
        links.append({"rel": "next", "href": href})
    prefix = f"{feed}/messages/"
    payload = {
        "messages": [message_json(prefix, m, now) for m in page.messages],
        "links": links,
    }
    response = json_response(payload)
    if page.missed:
        response.headers[GAP_HEADER] = gap_header(page)
    return response


#: Says that messages after the request's marker are gone unseen (docs/live-following.md).
GAP_HEADER = "X-Gap"


def gap_header(page: MessagePage) -> str:
    """``missed=N``, and ``; first=<marker>``, the first message's, if the page has one."""
    first = f"; first={page.messages[0].seq}" if page.messages else ""
    return f"missed={page.missed}{first}"


async def get_message(request: web.Request, feed: Feed) -> web.Response:
    message_id = request.match_info["message_id"]
    found = []
    if v.is_id(message_id):
        found = await feed.store.get_messages(feed.project, feed.name, [message_id])
    if not found:
        raise MessageNotFound(message_id)
    return json_response(message_json(f"{feed.path}/messages/", found[0], _now(request)))


async def delete_message(request: web.Request, feed: Feed) -> web.Response:
    message_id = request.match_info["message_id"]
    # A malformed claim_id is passed on: it holds no message, so deleting an
    # existing message with it is a 400 and deleting a missing one a 204.
    claim_id = v.text(request.query, _rules(request).claim_id)
    if v.is_id(message_id):
        await feed.store.delete_message(feed.project, feed.name, message_id, claim_id)
    return web.Response(status=204)


async def release_message(request: web.Request, feed: Feed) -> web.Response:
    """Take one message out of its claim, claimable again after a delay (a
    feedsvc extension: a consumer that failed on one message gives it back
    without waiting for the claim to expire, nor giving back the others)."""
    message_id = request.match_info["message_id"]
    claim_id = v.text(request.query, _rules(request).release_claim_id)
    if claim_id is None:
        raise BadRequest("Give the claim_id of the claim that holds the message.")
    delay = v.release_delay(await read_body(request), _settings(request))
    if not v.is_id(message_id):
        raise MessageNotFound(message_id)
    if not v.is_id(claim_id):
        raise ClaimDoesNotHold(f"Claim {claim_id} does not hold message {message_id}.")
    await feed.store.release_message(feed.project, feed.name, message_id, claim_id, delay)
    return web.Response(status=204)


async def delete_messages(request: web.Request, feed: Feed) -> web.Response:
    rules = _rules(request)
    ids = v.id_list(request.query, rules.ids)
    pop = request.query.get(rules.pop.name)
    if ids is not None and pop is not None:
        raise BadRequest("pop and ids cannot be given together.")
    if pop is not None:
        limit = v.integer(request.query, rules.pop)
        if tracing.ENABLED:
            with tracing.span("receive", feed.name) as span:
                popped = await feed.store.pop_messages(feed.project, feed.name, limit)
                consumed(span, popped)
        else:
            popped = await feed.store.pop_messages(feed.project, feed.name, limit)
        now = _now(request)
        return json_response({"messages": [popped_json(m, now) for m in popped]})
    if ids is None:
        raise BadRequest('Either "ids" or "pop" must be given to delete messages.')
    await feed.store.delete_messages(feed.project, feed.name, [i for i in ids if v.is_id(i)])
    return web.Response(status=204)


# -- claims ------------------------------------------------------------------


def _claim_href(feed: Feed, claim_id: str) -> str:
    return f"{feed.path}/claims/{claim_id}"


async def post_claim(request: web.Request, feed: Feed) -> web.Response:
    settings = _settings(request)
    rules = _rules(request)
    limit = v.integer(request.query, rules.claim_limit)
    seconds = v.wait_seconds(request.query, rules.claim_wait)
    ttl, grace = v.claim_options(await read_body(request), settings)
    terms = (ttl, grace, limit)
    if tracing.ENABLED:
        with tracing.span("receive", feed.name) as span:
            claim = await _claim_now_or_later(feed, terms, seconds, request)
            if claim is not None:
                consumed(span, claim.messages)
    else:
        claim = await _claim_now_or_later(feed, terms, seconds, request)
    if claim is None:
        return web.Response(status=204)
    now = _now(request)
    prefix = f"{feed.path}/messages/"
    body = orjson.dumps({"messages": [message_json(prefix, m, now) for m in claim.messages]})
    return web.Response(
        status=201,
        body=body,
        content_type="application/json",
        headers={"Location": _claim_href(feed, claim.id)},
    )


async def _claim_now_or_later(
    feed: Feed, terms: tuple[int, int, int], seconds: float, request: web.Request
) -> Claim | None:
    """A claim at once, else (with wait=) once something is claimable."""
    ttl, grace, limit = terms
    claim = await feed.store.claim_messages(feed.project, feed.name, ttl, grace, limit)
    if claim is None and seconds:
        claim = await _claim_waiting(feed, terms, seconds, request.app[DRAINING])
    return claim


async def _claim_waiting(
    feed: Feed, terms: tuple[int, int, int], seconds: float, draining: DrainSignal
) -> Claim | None:
    """Claim as soon as something is claimable, however it became so: a
    post or a release (each announced), a delayed message falling due or a
    claim expiring (the fruitless claim says when: a local timer, no Redis
    command meanwhile), or give up after seconds or once the process begins
    to stop (then 204 at once: the client claims elsewhere)."""
    ttl, grace, limit = terms
    async with feed.store.follow(feed.project, feed.name) as follow:
        rounds = Rounds(follow, seconds, draining, read_at_deadline=False)
        async for _ in rounds:
            claim = await feed.store.try_claim(feed.project, feed.name, ttl, grace, limit)
            if isinstance(claim, Claim):
                return claim
            if follow.ended:
                return None
            if claim.free_at is not None:
                rounds.due(claim.free_at)
    return None


def _claim_id(request: web.Request) -> str:
    claim_id = request.match_info["claim_id"]
    if not v.is_id(claim_id):
        raise ClaimNotFound(claim_id)
    return claim_id


async def get_claim(request: web.Request, feed: Feed) -> web.Response:
    claim = await feed.store.get_claim(feed.project, feed.name, _claim_id(request))
    now = _now(request)
    prefix = f"{feed.path}/messages/"
    return json_response(
        {
            "age": claim.age(now),
            "ttl": claim.ttl,
            "messages": [message_json(prefix, m, now) for m in claim.messages],
            "href": _claim_href(feed, claim.id),
        }
    )


async def patch_claim(request: web.Request, feed: Feed) -> web.Response:
    settings = _settings(request)
    claim_id = _claim_id(request)
    raw = await read_body(request)
    if not raw.strip():
        raise BadRequest("Request body can not be empty")
    ttl, grace = v.claim_options(raw, settings)
    await feed.store.renew_claim(feed.project, feed.name, claim_id, ttl, grace)
    return web.Response(status=204)


async def delete_claim(request: web.Request, feed: Feed) -> web.Response:
    claim_id = request.match_info["claim_id"]
    if v.is_id(claim_id):
        await feed.store.release_claim(feed.project, feed.name, claim_id)
    return web.Response(status=204)
