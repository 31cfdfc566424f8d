"""Live reads of a queue over plain HTTP: long polls (``wait=``) and
Server-Sent Events (``Accept: text/event-stream``), both followers of
``feedsvc.live``, woken through Redis.

An event is ``id: <marker>``, ``event: message``, ``data: <the message JSON
exactly as in a list page>``; its bytes are made once per batch and written
to every follower that may see it. A stream starts after ``Last-Event-ID``,
else after ``marker``, else at the head of the queue; it sends ``retry:``
first, a heartbeat comment every ``--stream-heartbeat`` seconds (no Redis
call), ``event: end`` when the queue is deleted, and ends after
``--stream-lifetime`` seconds (±10 %) so that deploys and load balancers see
ordinary churn; a client too slow for its buffer is cut off and resumes from
its last event id, losing nothing (the messages are in Redis).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import orjson
from aiohttp import web

from feedsvc.api import handlers as h
from feedsvc.api import validation as v
from feedsvc.api.handlers import message_json
from feedsvc.api.middleware import REQUEST_ID, REQUEST_ID_HEADER
from feedsvc.api.protocol import on_hang_up
from feedsvc.appkeys import CLOCK, LIVE, SETTINGS, TOPIC_LIVE
from feedsvc.errors import BadRequest, TooManyFollowers, Unavailable
from feedsvc.live import PAGE, Batch, Filters, LiveFeeds
from feedsvc.storage.base import ListQuery, Message, MessagePage

EVENT_STREAM = "text/event-stream"


async def get_messages(request: web.Request) -> web.StreamResponse:
    """GET .../messages: an event stream if asked for, a long poll with
    wait=, else the plain list (``handlers.get_messages``)."""
    if wants_stream(request):
        project, client = v.caller(request)
        return await stream_messages(request, project, client, v.queue_name(request))
    seconds = v.wait_seconds(request.query)
    if not seconds or "ids" in request.query:
        return await h.get_messages(request)
    project, client = v.caller(request)
    queue = v.queue_name(request)
    list_query = h.list_query_of(request, client)
    _room_for_a_follower(request)
    page = await long_poll(request, project, queue, list_query, seconds)
    feed = h.feed_path(request, queue)
    return h.page_response(feed, page, list_query, request.app[CLOCK].now_ms())


def _live(request: web.Request) -> LiveFeeds:
    """The live followers of queues, or of topics on a topic route."""
    return request.app[TOPIC_LIVE] if h.is_topic(request) else request.app[LIVE]


def _room_for_a_follower(request: web.Request) -> None:
    """503 beyond --max-followers streams and long polls in this process."""
    followers = request.app[LIVE].followers + request.app[TOPIC_LIVE].followers
    if followers >= request.app[SETTINGS].max_followers:
        raise TooManyFollowers(
            f"This process follows {followers} streams and long polls already; retry."
        )


def wants_stream(request: web.Request) -> bool:
    return EVENT_STREAM in request.headers.get("Accept", "")


def last_event_id(request: web.Request) -> int | None:
    """Where a stream starts: after Last-Event-ID, else after marker."""
    raw = request.headers.get("Last-Event-ID")
    if raw is None or raw == "":
        return v.message_marker(request.query)
    try:
        return v.message_marker({"marker": raw})
    except BadRequest:
        raise BadRequest("Last-Event-ID is not an event id this service gave out.") from None


async def long_poll(
    request: web.Request, project: str, queue: str, query: ListQuery, seconds: float
) -> MessagePage:
    """A list page; if it would be empty, wait up to seconds for one that is not."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    store = h.feed_store(request)
    if query.include_delayed:  # the shared tail skips delayed messages: read alone
        async with store.follow(project, queue) as follow:
            while True:
                token = follow.token()
                page = await store.list_messages(project, queue, query)
                remaining = deadline - loop.time()
                if page.messages or follow.ended or remaining <= 0:
                    return page
                await follow.wait(token, remaining)
    live = _live(request)
    filters = Filters(query.client_id, query.echo, query.include_claimed)
    async with (
        live.follower(project, queue, query.marker, filters) as follower,
        _hung_up(request, follower.hang_up),
    ):
        messages = await live.catch_up(project, queue, follower, query.limit)
        while not messages:
            remaining = deadline - loop.time()
            got = await follower.next(remaining) if remaining > 0 else None
            if got is None or got[1].ended or follower.gone:
                return MessagePage([], None)
            messages = got[0]
        if len(messages) > query.limit:
            messages = messages[: query.limit]
            return MessagePage(messages, messages[-1].seq)
        return MessagePage(messages, follower.position)


@asynccontextmanager
async def _hung_up(request: web.Request, hang_up: Callable[[], None]) -> AsyncIterator[None]:
    with on_hang_up(request, hang_up):
        yield


def _event(feed: str, message: Message, now: int, batch: Batch | None) -> bytes:
    key = (message.id, message.claim_id)
    if batch is not None and key in batch.encoded:
        return batch.encoded[key]
    data = orjson.dumps(message_json(feed, message, now))
    event = b"id: %d\nevent: message\ndata: %s\n\n" % (message.seq, data)
    if batch is not None:
        batch.encoded[key] = event
    return event


async def stream_messages(
    request: web.Request, project: str, client: str, queue: str
) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    live = _live(request)
    feed = h.feed_path(request, queue)
    clock = request.app[CLOCK]
    position = last_event_id(request)
    filters = Filters(
        client, v.flag(request.query, "echo"), v.flag(request.query, "include_claimed")
    )
    _room_for_a_follower(request)
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + settings.stream_lifetime * random.uniform(0.9, 1.1)
    async with (
        live.follower(project, queue, position, filters) as follower,
        _hung_up(request, follower.hang_up),
    ):
        # the first page is read before answering: Redis trouble is still a 503
        backlog = await live.catch_up(project, queue, follower, PAGE)
        response = web.StreamResponse(
            headers={
                "Content-Type": EVENT_STREAM,
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                REQUEST_ID_HEADER: request[REQUEST_ID],
            }
        )
        await response.prepare(request)
        await response.write(b"retry: %d\n\n" % settings.stream_retry)
        try:
            while backlog:
                now = clock.now_ms()
                await response.write(b"".join(_event(feed, m, now, None) for m in backlog))
                if loop.time() >= ends_at:
                    return response
                backlog = await live.catch_up(project, queue, follower, PAGE)
            while (remaining := ends_at - loop.time()) > 0:
                got = await follower.next(min(settings.stream_heartbeat, remaining))
                if got is None:
                    await response.write(b": heartbeat\n\n")
                    continue
                visible, batch = got
                if visible:
                    now = clock.now_ms()
                    await response.write(b"".join(_event(feed, m, now, batch) for m in visible))
                if batch.ended:
                    await response.write(b"event: end\ndata: {}\n\n")
                    break
                if follower.dropped or follower.gone:  # too slow (it reconnects), or gone
                    break
        except (ConnectionResetError, Unavailable):
            pass  # the client went away, or Redis did: it resumes from its last id
    return response
