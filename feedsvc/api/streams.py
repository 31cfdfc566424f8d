"""Live reads of a queue over plain HTTP: long polls (``wait=``) and
Server-Sent Events (``Accept: text/event-stream``), both followers of
``feedsvc.services.live``, woken through Redis.

An event is ``id: <marker>``, ``event: message``, ``data: <the message JSON
exactly as in a list page>``; its bytes are made once per batch and written
to every follower that may see it. A stream starts after ``Last-Event-ID``,
else after ``marker``, else at the head of the queue; it sends ``retry:``
first, a heartbeat comment every ``--stream-heartbeat`` seconds (no Redis
call), ``event: end`` when the queue is deleted, and ends after
``--stream-lifetime`` seconds (±10 %) so that deploys and load balancers see
ordinary churn, and the same way at once when the process begins to stop
(``feedsvc.drain_signal``; a long poll then answers what it has, at once); a
client too slow for its buffer is cut off and resumes from its last event
id, losing nothing (the messages are in Redis).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import orjson
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from feedsvc import tracing
from feedsvc.api import handlers as h
from feedsvc.api import spec
from feedsvc.api import validation as v
from feedsvc.api.feeds import Feed
from feedsvc.api.handlers import message_json
from feedsvc.api.middleware import REQUEST_ID, REQUEST_ID_HEADER
from feedsvc.api.protocol import on_hang_up
from feedsvc.api.traced import consumed
from feedsvc.appkeys import CLOCK, DRAINING, LIVE, SETTINGS, TOPIC_LIVE
from feedsvc.clock import Clock
from feedsvc.errors import BadRequest, MarkerNotGivenOut, TooManyFollowers, Unavailable
from feedsvc.services.live import PAGE, Batch, Filters, Follower, Rounds, Waiter
from feedsvc.storage.base import ListQuery, Message, MessagePage

EVENT_STREAM = "text/event-stream"


async def get_messages(request: web.Request, feed: Feed) -> web.StreamResponse:
    """GET .../messages: an event stream if asked for, a long poll with
    wait=, else the plain list (``handlers.get_messages``)."""
    rules = spec.rules(request.app[SETTINGS])
    query = request.query
    if wants_stream(request):
        # limit, wait and ids do not apply to a stream, but what a list
        # refuses a stream refuses too, through the same parsers
        list_query = h.list_query_of(request, feed.client)
        v.wait_seconds(query, rules.wait)
        v.id_list(query, rules.ids)
        tail = v.from_tail(query, rules.start, rules.message_marker)
        return await stream_messages(request, feed, list_query, tail)
    seconds = v.wait_seconds(query, rules.wait)
    if not seconds or rules.ids.name in query:
        return await h.get_messages(request, feed)
    list_query = h.list_query_of(request, feed.client)
    tail = v.from_tail(query, rules.start, rules.message_marker)
    _room_for_a_follower(request)
    if tail:
        marker = await feed.store.tail_marker(feed.project, feed.name)
        list_query = dataclasses.replace(list_query, marker=marker)
    page = await long_poll(request, feed, list_query, seconds)
    if tail and page.next_marker is None:  # nothing came: poll on from the tail
        page = MessagePage([], list_query.marker)
    return h.page_response(feed.path, page, list_query, request.app[CLOCK].now_ms())


def _room_for_a_follower(request: web.Request) -> None:
    """503 beyond --max-followers streams and long polls in this process."""
    followers = request.app[LIVE].followers + request.app[TOPIC_LIVE].followers
    if followers >= request.app[SETTINGS].max_followers:
        raise TooManyFollowers(
            f"This process follows {followers} streams and long polls already; retry."
        )


def wants_stream(request: web.Request) -> bool:
    """Whether Accept names text/event-stream, above q=0 and weighed at least
    as JSON (a wildcard alone asks for JSON, as a client that names nothing)."""
    return v.prefers(request.headers.get("Accept"), EVENT_STREAM, "application/json")


LAST_EVENT_ID_NOT_GIVEN_OUT = "Last-Event-ID is not an event id this service gave out."


def last_event_id(request: web.Request) -> int | None:
    """The Last-Event-ID header's marker, if any (the stream starts after it,
    rather than after ``marker``)."""
    raw = request.headers.get("Last-Event-ID")
    if raw is None or raw == "":
        return None
    if v.MARKER.fullmatch(raw) is None:
        raise BadRequest(LAST_EVENT_ID_NOT_GIVEN_OUT)
    return int(raw)


async def long_poll(
    request: web.Request, feed: Feed, query: ListQuery, seconds: float
) -> MessagePage:
    """A list page; if it would be empty, wait up to seconds for one that is
    not, or until the process begins to stop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    project, queue, store = feed.project, feed.name, feed.store
    draining = request.app[DRAINING]
    if query.include_delayed:  # the shared tail skips delayed messages: read alone
        async with store.follow(project, queue) as follow:
            rounds = Rounds(follow, seconds, draining)
            async for _ in rounds:
                page = await store.list_messages(project, queue, query)
                if page.messages or follow.ended:
                    break
                if page.claim_ends is not None:  # no post announces a claim's end
                    rounds.due(page.claim_ends)
            return page
    live = feed.kind.live(request.app)
    waiter = Waiter(query.marker, Filters(query.client_id, query.echo, query.include_claimed))
    async with live.follower(project, queue, waiter), _hung_up(request, waiter.hang_up):
        messages = await live.catch_up(project, queue, waiter, query.limit)
        if not messages:
            await waiter.finished(deadline - loop.time(), draining.future())
            messages = waiter.messages
            if not messages:
                return MessagePage([], None)
        if len(messages) > query.limit:
            messages = messages[: query.limit]
            return MessagePage(messages, messages[-1].seq, missed=waiter.missed)
        return MessagePage(messages, waiter.position, missed=waiter.missed)


@asynccontextmanager
async def _hung_up(request: web.Request, hang_up: Callable[[], None]) -> AsyncIterator[None]:
    with on_hang_up(request, hang_up):
        yield


def _event(prefix: str, message: Message, now: int) -> bytes:
    """One SSE event; prefix is the feed's path and ``/messages/`` (see message_json)."""
    data = orjson.dumps(message_json(prefix, message, now))
    return b"id: %d\nevent: message\ndata: %s\n\n" % (message.seq, data)


def _gap(follower: Follower, first: Message) -> bytes:
    """An ``event: gap`` if messages were gone unseen before first (then
    forgotten: told once); else nothing. No id: a client resumes from its
    last message."""
    if not follower.missed:
        return b""
    data = orjson.dumps({"missed": follower.missed, "first": str(first.seq)})
    follower.missed = 0
    return b"event: gap\ndata: %s\n\n" % data


HEARTBEAT = b": heartbeat\n\n"
END = b"event: end\ndata: {}\n\n"


class Stream(Follower):
    """An event stream's follower: once caught up, its tail's batches are
    written to its connection from the tail's task, without waiting (each
    event's bytes made once per batch for all the streams that may see it).
    A client that lets more than ``limit`` bytes pile up unsent is cut off
    (``dropped``); it resumes from its last event id."""

    __slots__ = (
        "_clock",
        "_limit",
        "_pending",
        "_prefix",
        "_queue",
        "_transport",
        "_writer",
        "dropped",
    )

    def __init__(
        self,
        position: int | None,
        filters: Filters,
        prefix: str,
        clock: Clock,
        limit: int,
        queue: str = "",
    ) -> None:
        super().__init__(position, filters)
        self._queue = queue  # the destination its tracing spans name
        self.dropped = False
        self._prefix = prefix  # the hrefs': the feed's path and /messages/
        self._clock = clock
        self._limit = limit
        self._writer: AbstractStreamWriter | None = None
        self._transport: asyncio.Transport | None = None
        self._pending: list[bytes] | None = None  # offered before the answer started

    async def start(self, writer: AbstractStreamWriter, transport: asyncio.Transport) -> None:
        self._writer, self._transport = writer, transport
        pending, self._pending = self._pending, None
        for data in pending or ():
            await self._send(data)

    async def offer(self, batch: Batch) -> bool:
        if self.done:
            return False
        visible = self.take(batch)
        if visible and tracing.ENABLED:
            with tracing.span("receive", self._queue) as span:
                consumed(span, visible)
                await self._send(_gap(self, visible[0]) + self._events(visible, batch))
        elif visible:  # a gap its catch-up passed without a message to show it before
            await self._send(_gap(self, visible[0]) + self._events(visible, batch))
        if batch.ended:
            await self._send(END)
            self.finish()
        return not self.done

    async def tick(self) -> None:
        await self._send(HEARTBEAT)

    def _events(self, visible: list[Message], batch: Batch) -> bytes:
        whole = len(visible) == len(batch.messages)
        if whole and None in batch.encoded:
            return batch.encoded[None]
        now = self._clock.now_ms()
        parts = []
        for message in visible:
            key = (message.id, message.claim_id)
            event = batch.encoded.get(key)
            if event is None:
                event = batch.encoded[key] = _event(self._prefix, message, now)
            parts.append(event)
        data = b"".join(parts)
        if whole:
            batch.encoded[None] = data
        return data

    async def _send(self, data: bytes) -> None:
        """Write without waiting; cut the stream off if its client lags too far."""
        if self.done:
            return
        transport, writer = self._transport, self._writer
        if transport is None or writer is None:
            if self._pending is None:
                self._pending = []
            self._pending.append(data)
            return
        if transport.is_closing():
            self.hang_up()
        elif transport.get_write_buffer_size() > self._limit:
            self.dropped = True
            self.finish()
        else:
            try:
                await writer.write(data, drain=False)  # type: ignore[call-arg]
            except ConnectionResetError:
                self.hang_up()


async def stream_messages(
    request: web.Request, feed: Feed, query: ListQuery, tail: bool = False
) -> web.StreamResponse:
    """The stream of a queue after Last-Event-ID, else after query's marker,
    else (tail: from=tail) after its last message; query's echo and
    include_claimed filter it (its limit does not apply)."""
    settings = request.app[SETTINGS]
    draining = request.app[DRAINING]
    project, queue = feed.project, feed.name
    live = feed.kind.live(request.app)
    prefix = f"{feed.path}/messages/"  # what the events' hrefs name
    resumed = last_event_id(request)
    position = query.marker if resumed is None else resumed
    if tail and resumed is None:
        # an EventSource reconnects to the same URL with Last-Event-ID: that wins
        position = await feed.store.tail_marker(project, queue)
    filters = Filters(query.client_id, query.echo, query.include_claimed)
    _room_for_a_follower(request)
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + settings.stream_lifetime * random.uniform(0.9, 1.1)
    stream = Stream(
        position, filters, prefix, request.app[CLOCK], settings.stream_buffer_kib * 1024, queue
    )
    response = web.StreamResponse(
        headers={
            "Content-Type": EVENT_STREAM,
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            REQUEST_ID_HEADER: request[REQUEST_ID],
        }
    )
    async with live.follower(project, queue, stream), _hung_up(request, stream.hang_up):
        # the first page is read before answering: Redis trouble is still a
        # 503, and a position past anything given out a 400
        try:
            backlog = await live.catch_up(project, queue, stream, PAGE)
        except MarkerNotGivenOut:
            if resumed is None:
                raise
            raise MarkerNotGivenOut(
                f"Last-Event-ID {resumed} is past the last message of {queue}: "
                "this service did not give it out."
            ) from None
        writer = await response.prepare(request)
        transport = request.transport
        assert writer is not None and transport is not None
        try:
            await response.write(b"retry: %d\n\n" % settings.stream_retry)
            while backlog:
                now = request.app[CLOCK].now_ms()
                events = b"".join(_event(prefix, m, now) for m in backlog)
                if tracing.ENABLED:
                    with tracing.span("receive", queue) as span:
                        consumed(span, backlog)
                        await response.write(_gap(stream, backlog[0]) + events)
                else:
                    await response.write(_gap(stream, backlog[0]) + events)
                if loop.time() >= ends_at or draining.is_set():
                    return response
                backlog = await live.catch_up(project, queue, stream, PAGE)
            # caught up: the tail writes from now on
            await stream.start(writer, transport)
            # until its lifetime is over or the process stops: either way
            # returning ends it cleanly, and the client resumes from its last id
            await stream.finished(ends_at - loop.time(), draining.future())
        except (ConnectionResetError, Unavailable):
            return response  # the client went away, or Redis did: it resumes from its last id
    if stream.dropped:  # too slow: cut off now, not once it has read what piled up
        transport.abort()
    return response
