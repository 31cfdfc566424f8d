"""Live following of a queue (long polls and event streams), sharing reads.

A :class:`Follower` keeps its own position (the marker of the last message it
was given) and filters (its client id with ``echo``, ``include_claimed``),
exactly those of a list request, so it sees exactly what following the list's
``next`` links would show. It first reads its own backlog, page by page, like
a list reader. Once a read comes back empty it has *caught up* and joins its
queue's :class:`Tail`: one task per followed queue and process, which waits
for the queue's wake-ups (``FeedStore.follow``: through Redis, nothing read
while idle) and then reads what is new **once** for all of them, unfiltered
(echo on, claimed included), and hands the batch to every caught-up follower
(``Follower.offer``), which filters it for itself. A thousand followers of a
queue cost one read per wake-up, not a thousand.

Handing over wakes nobody: ``offer`` runs in the tail's task and never
waits. A long poll (:class:`Waiter`) keeps the first messages it may see and
finishes; an event stream (``feedsvc.api.streams``) writes them to its
connection there and then, and is cut off (it reconnects and resumes from
its last event id: the messages are in Redis) when its client is too slow to
take them. One timer per process, not one per follower, calls ``tick`` on
every caught-up follower (a stream sends its heartbeat).

Joining without a gap or a repeat: the follower notes the tail's position
before its last (empty) read. Entries up to that position existed before the
read, so none of them is visible to this follower: it may take that position
as its own. It joins only if the tail has read nothing since (no await
between the check and the join); otherwise it reads again. Batches carry
what lies after the tail's previous position, and a follower drops whatever
is not after its own.

A lost wake-up costs latency only: the tail re-reads from its position on the
next one, and the store wakes everyone after a lost subscription.

What becomes visible with time alone (a delayed message falling due) is
announced by no post: the tail's read that comes back empty says when the
first delayed message after its position falls due (``MessagePage.next_due``),
and the tail asks its wake-ups for a local timer then (``Follow.due``). An
idle tail whose queue holds no delayed message still costs Redis nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from feedsvc.errors import Unavailable
from feedsvc.storage.base import FeedStore, ListQuery, Message, checkpoint

log = logging.getLogger("feedsvc")

# Messages a tail or a catching-up follower reads per page, and pages per wake-up.
PAGE = 20
PAGES_PER_READ = 50
# Seconds a tail waits before reading again after Redis trouble.
RETRY_AFTER_TROUBLE = 1.0


@dataclass(slots=True)
class Batch:
    """What a tail read: messages after ``after`` up to ``upto``, in order."""

    messages: list[Message]
    after: int
    upto: int
    ended: bool = False  # the queue was deleted
    # what followers make of it once for all of them (the api's event bytes)
    encoded: dict[Any, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Filters:
    client_id: str
    echo: bool = False
    include_claimed: bool = False

    def query(
        self,
        marker: int | None,
        limit: int = PAGE,
        with_authors: bool = False,
        check_marker: bool = False,
        passing: bool = False,
    ) -> ListQuery:
        return ListQuery(
            self.client_id,
            marker=marker,
            limit=limit,
            echo=self.echo,
            include_claimed=self.include_claimed,
            with_authors=with_authors,
            check_marker=check_marker,
            passing=passing,
        )


class Follower:
    """One long poll or event stream: a position and filters; once caught up,
    its tail hands it every batch (``offer``), in the tail's own task."""

    __slots__ = ("_done", "filters", "given", "gone", "missed", "position")

    def __init__(self, position: int | None, filters: Filters) -> None:
        self.position = position
        # the position is still the client's marker: its first read checks
        # it against the queue's counter (MarkerNotGivenOut)
        self.given = position is not None
        self.filters = filters
        self.gone = False  # its client went away
        # messages after its position gone unseen while it caught up
        # (MessagePage.missed), until the caller tells its client
        self.missed = 0
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def offer(self, batch: Batch) -> bool:
        """Take a batch, without waiting for anything; False to leave the tail."""
        raise NotImplementedError

    async def tick(self) -> None:
        """Called every ``tick`` seconds while caught up (a stream's heartbeat)."""

    def take(self, batch: Batch) -> list[Message]:
        """The batch's messages this follower has not had and may see; moves on."""
        after = self.position or 0
        f = self.filters
        visible = [
            m
            for m in batch.messages
            if m.seq > after
            and (f.echo or m.author != f.client_id)
            and (f.include_claimed or m.claim_id is None)
        ]
        self.position = max(after, batch.upto)
        return visible

    @property
    def done(self) -> bool:
        return self._done.done()

    def finish(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def hang_up(self) -> None:
        """Its client went away: finish now, not at its next write."""
        self.gone = True
        self.finish()

    async def finished(self, seconds: float, drained: asyncio.Future[None] | None = None) -> bool:
        """Wait until it finished, at most seconds, and no longer than until
        ``drained`` is done (the process stops: ``feedsvc.drain_signal``);
        whether it has finished."""
        if not self._done.done() and seconds > 0:
            waits = (self._done,) if drained is None else (self._done, drained)
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        return self._done.done()


class Waiter(Follower):
    """A long poll: the first batch with something it may see ends the wait."""

    __slots__ = ("ended", "messages")

    def __init__(self, position: int | None, filters: Filters) -> None:
        super().__init__(position, filters)
        self.messages: list[Message] = []
        self.ended = False  # the queue was deleted

    async def offer(self, batch: Batch) -> bool:
        if self.done:  # it has its messages: its position must not move on
            return False
        self.messages = self.take(batch)
        self.ended = batch.ended
        if self.messages or batch.ended:
            self.finish()
        return not self.done


class Tail:
    """The shared reader of one queue in this process."""

    def __init__(
        self,
        store: FeedStore,
        project: str,
        queue: str,
        position: int,
        existed: bool,
        scan_limit: int,
    ) -> None:
        self._store = store
        self._scan_limit = scan_limit
        self._project, self._queue = project, queue
        self.position = position
        # whether the queue existed when its first follower caught up: if it
        # is gone once the subscription stands, it was deleted in between
        # and its end was announced before anyone here listened
        self._existed = existed
        self.ended = False  # the queue was deleted: a new follower starts a new tail
        self.followers: set[Follower] = set()
        self.reads = 0
        # when the first delayed message after the position falls due, as the
        # last read found it (None: none is waiting)
        self.next_due: int | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def hand_out(self, batch: Batch) -> None:
        for follower in list(self.followers):
            if not await follower.offer(batch):
                self.followers.discard(follower)

    async def _run(self) -> None:
        async with self._store.follow(self._project, self._queue) as follow:
            deleted = self._existed and await self._gone()
            while not deleted:
                checkpoint()  # a stop swallowed by a read (see checkpoint)
                token = follow.token()
                try:
                    batch = await self._read()
                except Unavailable as exc:
                    log.debug("tail of %s: %s; reading again later", self._queue, exc)
                    await follow.wait(token, RETRY_AFTER_TROUBLE)
                    continue
                if batch is not None:
                    await self.hand_out(batch)
                if follow.ended:
                    break
                if self.next_due is not None:
                    # nobody announces a message falling due: a local timer
                    # wakes this tail then (no Redis command meanwhile)
                    follow.due(self.next_due)
                if batch is None or len(batch.messages) < PAGE * PAGES_PER_READ:
                    await follow.wait(token, 3600.0)
            self.ended = True
            await self.hand_out(Batch([], self.position, self.position, ended=True))

    async def _gone(self) -> bool:
        try:
            return await self._store.get_queue_metadata(self._project, self._queue) is None
        except Unavailable:
            return False  # unknown: the announcement or a later read will tell

    async def _read(self) -> Batch | None:
        """Everything new after the position, unfiltered; None if nothing."""
        everything = Filters("", echo=True, include_claimed=True)
        messages: list[Message] = []
        marker = after = self.position
        for _ in range(PAGES_PER_READ):
            page = await self._store.list_messages(
                self._project, self._queue, everything.query(marker, with_authors=True)
            )
            self.reads += 1
            messages += page.messages
            self.next_due = page.next_due  # the last page read tells
            if page.next_marker is None:
                break
            scanned_at_most = page.next_marker - (marker or 0)  # seqs are consecutive
            marker = page.next_marker
            if (
                len(page.messages) < PAGE
                and page.messages  # (none: all passed over, e.g. unreadable)
                and marker == page.messages[-1].seq
                and scanned_at_most < self._scan_limit
            ):
                # A short page, ending on its last message, that cannot have
                # met the scan limit: its scan reached the end of the feed,
                # so no empty read is needed to learn it.
                break
        if marker == after:
            return None
        assert marker is not None
        self.position = marker
        return Batch(messages, after, marker)


class LiveFeeds:
    """The tails of this process, one per followed queue, and the one timer
    that ticks their followers every ``tick`` seconds."""

    def __init__(self, store: FeedStore, scan_limit: int, tick: float) -> None:
        self._store = store
        self._scan_limit = scan_limit  # the list's (see Tail._read)
        self._tick = tick
        self._tails: dict[tuple[str, str], Tail] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.followers = 0  # long polls and streams now
        self._following: dict[tuple[str, str], int] = {}  # the same per queue

    @property
    def tails(self) -> int:
        return len(self._tails)

    def followers_of(self, project: str, queue: str) -> int:
        """Long polls and streams of this queue in this process now."""
        return self._following.get((project, queue), 0)

    @asynccontextmanager
    async def follower(self, project: str, queue: str, follower: Follower) -> AsyncIterator[None]:
        """Follow with ``follower`` (not yet caught up: call ``catch_up`` until it returns [])."""
        key = (project, queue)
        self.followers += 1
        self._following[key] = self._following.get(key, 0) + 1
        try:
            yield
        finally:
            self.followers -= 1
            left = self._following[key] - 1
            if left:
                self._following[key] = left
            else:
                del self._following[key]
            await self._leave(project, queue, follower)

    async def catch_up(
        self, project: str, queue: str, follower: Follower, limit: int = PAGE
    ) -> list[Message]:
        """Its next page of backlog; [] once it has caught up and joined the tail."""
        key = (project, queue)
        while True:
            tail = self._tails.get(key)
            if tail is not None and tail.ended:
                del self._tails[key]
                tail = None
            before = tail.position if tail is not None else None
            page = await self._store.list_messages(
                project,
                queue,
                follower.filters.query(
                    follower.position, limit, check_marker=follower.given, passing=True
                ),
            )
            follower.given = False
            follower.missed += page.missed
            if page.messages:
                follower.position = page.messages[-1].seq
                return page.messages
            if page.next_marker is not None:  # a scan that stopped early
                follower.position = page.next_marker
                continue
            # Caught up. What the tail had read before this read is invisible to us.
            if page.passed is not None and page.passed > (follower.position or 0):
                follower.position = page.passed  # past what is gone (counted in missed)
            if before is not None and before > (follower.position or 0):
                follower.position = before
            tail = self._tails.get(key)
            if tail is not None and tail.ended:
                del self._tails[key]
                tail = None
            if tail is None:
                existed = await self._store.get_queue_metadata(project, queue) is not None
                if key in self._tails:  # another follower started it meanwhile
                    continue
                position = follower.position or 0
                tail = Tail(self._store, project, queue, position, existed, self._scan_limit)
                self._tails[key] = tail
                tail.followers.add(follower)
                tail.start()
                self._start_ticking()
                return []
            mine = follower.position or 0
            if tail.position == before or (before is None and tail.position <= mine):
                tail.followers.add(follower)
                return []
            # the tail read more meanwhile: read again from our position

    def _start_ticking(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._ticking())

    async def _ticking(self) -> None:
        while self._tails:
            await asyncio.sleep(self._tick)
            for tail in list(self._tails.values()):
                for follower in list(tail.followers):
                    await follower.tick()

    async def _leave(self, project: str, queue: str, follower: Follower) -> None:
        key = (project, queue)
        tail = self._tails.get(key)
        if tail is None:
            return
        tail.followers.discard(follower)  # if the tail has not let it go already
        if not tail.followers:
            del self._tails[key]
            await tail.stop()

    async def close(self) -> None:
        tails, self._tails = self._tails, {}
        for tail in tails.values():
            await tail.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
