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

Every loop that waits for a queue's wake-ups (the tail here, a long poll
that reads alone, a claim that waits, the delivery worker's wake-ups) goes
round through :class:`Rounds`, the one owner of the order that loses none.

A lost wake-up costs latency only: the tail re-reads from its position on the
next one, and the store wakes everyone after a lost subscription.

What becomes visible with time alone (a delayed message falling due) is
announced by no post: the tail's read that comes back empty says when the
first delayed message after its position falls due (``MessagePage.next_due``),
and the tail asks its wake-ups for a local timer then (``Follow.due``). An
idle tail whose queue holds no delayed message still costs Redis nothing.

A follower without ``include_claimed`` passes claimed messages, as a list
does; while it has been given nothing after one, it is *held* there
(``Follower.held``): a list from its marker returns the message once its
claim ends, so the follower must get it then. The tail keeps a timer for
the first claim end it read (``MessagePage.claim_ends``) while anyone is
held, and after any wake-up that may have freed a message (``Follow.frees``:
a release, a timer, a lost subscription) reads once from the lowest held
position for everyone (``Tail._hand_out_again``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from feedsvc.drain_signal import DrainSignal
from feedsvc.errors import Unavailable
from feedsvc.storage.base import FeedStore, Follow, ListQuery, Message, checkpoint

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
    claim_ends: int | None = None  # the pages' (MessagePage.claim_ends)
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

    __slots__ = ("_done", "filters", "given", "gone", "held", "missed", "position")

    def __init__(self, position: int | None, filters: Filters) -> None:
        self.position = position
        # the position is still the client's marker: its first read checks
        # it against the queue's counter (MarkerNotGivenOut)
        self.given = position is not None
        self.filters = filters
        self.gone = False  # its client went away
        # Where it passed a claimed message (without include_claimed) and has
        # been given nothing since: a list from here returns the message once
        # its claim ends, so this follower must get it then (None: nothing so).
        self.held: int | None = None
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
        """The batch's messages this follower has not had and may see; moves on.

        A held follower takes what follows ``held`` (a tail's re-read offers
        what it passed again: what it was not given stays unseen but for a
        message whose claim ended). It stays held while a claimed message
        lies after the last one it was given."""
        seen = self.position or 0
        since = seen if self.held is None else self.held
        f = self.filters
        visible = []
        claimed = 0  # the last claimed message passed
        for m in batch.messages:
            if m.seq <= since or not (f.echo or m.author != f.client_id):
                continue
            if m.claim_id is not None and not f.include_claimed:
                claimed = m.seq
                continue
            visible.append(m)
        last = visible[-1].seq if visible else since
        if claimed > last:
            self.held = last
        elif batch.after <= last and batch.upto >= seen:
            self.held = None  # all it passed after `last` is in the batch, none claimed
        elif visible:
            self.held = last  # a cut re-read: what it passed after upto is unknown
        self.position = max(seen, batch.upto)
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


class Rounds:
    """The one owner of "take the wake-up token, then read, then wait": the
    rounds of a loop that reads a queue and waits for its wake-ups
    (``FeedStore.follow``). Each round takes the token before the caller
    reads, so a wake-up between the read and the wait ends the wait at once;
    none is lost::

        async with store.follow(project, queue) as follow:
            rounds = Rounds(follow, seconds, draining)
            async for _ in rounds:  # the token is taken: read now
                page = await store.list_messages(project, queue, query)
                if page.messages or follow.ended:
                    break  # what the caller waited for
                rounds.due(page.claim_ends)  # a moment no post announces

    Between two rounds it waits, at most ``longest`` seconds (or what
    ``pause`` says for one round), for a wake-up; it stops once seconds
    (None: never) have passed since it began, or ``draining`` is set (the
    process stops; the wait ends at once then). With ``read_at_deadline``
    (a long poll: it answers with a last read) a round still follows a wait
    that ran out the time; without (a claim wait), no read starts once the
    time is up. ``due`` asks for a timer (``Follow.due``) that is set only
    if it goes round again; ``again`` skips one wait (a read cut short).
    Before each wait or re-read it calls ``checkpoint``, so a stop swallowed
    by a read is not lost. It yields the round's number, from 0.
    """

    __slots__ = (
        "_again",
        "_deadline",
        "_draining",
        "_dues",
        "_follow",
        "_longest",
        "_loop",
        "_pause",
        "_read_at_deadline",
        "_round",
        "_token",
    )

    def __init__(
        self,
        follow: Follow,
        seconds: float | None = None,
        draining: DrainSignal | None = None,
        *,
        longest: float = 3600.0,
        read_at_deadline: bool = True,
    ) -> None:
        self._follow = follow
        self._loop = asyncio.get_running_loop()
        self._deadline = math.inf if seconds is None else self._loop.time() + seconds
        self._draining = draining
        self._longest = longest
        self._read_at_deadline = read_at_deadline
        self._round = 0
        self._token: asyncio.Event | None = None
        self._dues: list[int] = []
        self._pause: float | None = None
        self._again = False

    def due(self, at_ms: int | None) -> None:
        """Wake at at_ms (the store's clock) too, if it waits again."""
        if at_ms is not None:
            self._dues.append(at_ms)

    def again(self) -> None:
        """Go round again at once, without waiting."""
        self._again = True

    def pause(self, seconds: float) -> None:
        """Wait at most seconds before the next round (Redis trouble)."""
        self._pause = seconds

    def __aiter__(self) -> Rounds:
        return self

    async def __anext__(self) -> int:
        checkpoint()
        if self._round and not await self._waited():
            raise StopAsyncIteration
        if not self._read_at_deadline and self._loop.time() >= self._deadline:
            raise StopAsyncIteration
        self._token = self._follow.token()
        self._round += 1
        return self._round - 1

    async def _waited(self) -> bool:
        """Wait for a wake-up with the round's token; False: stop instead."""
        remaining = self._deadline - self._loop.time()
        draining = self._draining
        if remaining <= 0 or (draining is not None and draining.is_set()):
            return False
        follow = self._follow
        for at_ms in self._dues:
            follow.due(at_ms)
        self._dues.clear()
        if self._again:
            self._again = False
            return True
        seconds = min(remaining, self._longest if self._pause is None else self._pause)
        self._pause = None
        assert self._token is not None
        if draining is None:
            await follow.wait(self._token, seconds)
        else:
            await draining.unless_set(follow.wait(self._token, seconds))
        return True


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
        # while a follower is held (Follower.held): when the first claim on a
        # message after the lowest held position ends (None: no follower held)
        self.claim_ends: int | None = None
        # the follow's frees when the last read began (-1: the first read is
        # one, so a follower held when it started is covered)
        self.frees = -1
        self.idle = asyncio.Event()  # set while no read is under way
        self.idle.set()
        self._follow: Follow | None = None
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

    def hold(self, claim_ends: int | None) -> None:
        """A follower joins held (``Follower.held``): wake at claim_ends too."""
        if claim_ends is not None:
            self.claim_ends = _earliest(self.claim_ends, claim_ends)
            if self._follow is not None:
                self._follow.due(claim_ends)

    def _held_from(self) -> int | None:
        return min((f.held for f in self.followers if f.held is not None), default=None)

    async def _run(self) -> None:
        async with self._store.follow(self._project, self._queue) as follow:
            self._follow = follow
            deleted = self._existed and await self._gone()
            rounds = Rounds(follow)
            async for _ in rounds:
                if deleted:
                    break
                # A claim may have ended (released, expired) since the last
                # read: read again from the lowest held follower's position.
                held = self._held_from() if follow.frees != self.frees else None
                self.frees = follow.frees
                self.idle.clear()  # a follower that would join held waits
                try:
                    batch = await self._read(self.position if held is None else held)
                except Unavailable as exc:
                    log.debug("tail of %s: %s; reading again later", self._queue, exc)
                    self.frees = -1  # whatever it was to read again, it reads again
                    rounds.pause(RETRY_AFTER_TROUBLE)
                    continue
                finally:
                    self.idle.set()
                if held is not None:
                    await self._hand_out_again(held, batch)
                elif batch is not None:
                    await self.hand_out(batch)
                    self._note_claims(batch.claim_ends)
                if follow.ended:
                    break
                # nobody announces a message falling due: a local timer
                # wakes this tail then (no Redis command meanwhile)
                rounds.due(self.next_due)
                rounds.due(self.claim_ends)  # nor a claim's end
                if batch is not None and len(batch.messages) >= PAGE * PAGES_PER_READ:
                    rounds.again()  # a read cut short: the rest at once
            self.ended = True
            await self.hand_out(Batch([], self.position, self.position, ended=True))

    async def _hand_out_again(self, held: int, batch: Batch | None) -> None:
        """Hand out a read from the lowest held position: held followers
        take what they passed and may see now, the others what is new.
        Those held further than the read got (it reads PAGES_PER_READ pages
        at most) are let go: a stream ends and resumes from its last event
        id, a long poll answers empty; either reads what it passed itself."""
        if batch is None:  # nothing at all after held
            batch = Batch([], held, self.position)
        await self.hand_out(batch)
        for follower in list(self.followers):
            if follower.held is not None and (follower.position or 0) > batch.upto:
                follower.finish()
                self.followers.discard(follower)
        # the read saw every claim after the lowest held position
        self.claim_ends = batch.claim_ends if self._held_from() is not None else None

    def _note_claims(self, claim_ends: int | None) -> None:
        if self._held_from() is None:
            self.claim_ends = None
        elif claim_ends is not None:
            self.claim_ends = _earliest(self.claim_ends, claim_ends)

    async def _gone(self) -> bool:
        try:
            return await self._store.get_queue_metadata(self._project, self._queue) is None
        except Unavailable:
            return False  # unknown: the announcement or a later read will tell

    async def _read(self, start: int) -> Batch | None:
        """Everything after start (the position, or a held follower's),
        unfiltered; None if nothing."""
        everything = Filters("", echo=True, include_claimed=True)
        messages: list[Message] = []
        marker = after = start
        claim_ends: int | None = None
        for _ in range(PAGES_PER_READ):
            page = await self._store.list_messages(
                self._project, self._queue, everything.query(marker, with_authors=True)
            )
            self.reads += 1
            messages += page.messages
            self.next_due = page.next_due  # the last page read tells
            if page.claim_ends is not None:
                claim_ends = _earliest(claim_ends, page.claim_ends)
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
        self.position = max(self.position, marker)
        return Batch(messages, after, marker, claim_ends=claim_ends)


def _earliest(a: int | None, b: int) -> int:
    return b if a is None or b < a else a


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
        # where it passed a claimed message since its last message (Follower.held)
        held: int | None = None
        claim_ends: int | None = None
        while True:
            tail = self._tails.get(key)
            if tail is not None and tail.ended:
                del self._tails[key]
                tail = None
            before = tail.position if tail is not None else None
            frees = tail.frees if tail is not None else None
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
            if page.claim_ends is not None and not follower.filters.include_claimed:
                if held is None:
                    held = follower.position or 0
                claim_ends = _earliest(claim_ends, page.claim_ends)
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
                self._join(tail, follower, held, claim_ends)
                tail.start()  # its first read is from the held position
                self._start_ticking()
                return []
            if held is not None:
                # Held, it joins only a tail that has begun no read since
                # its own: a claim that ended meanwhile is then read again
                # with it among the held (Tail._run). Otherwise it reads
                # again from where it is held.
                if tail.idle.is_set() and tail.frees == frees and tail.position == before:
                    self._join(tail, follower, held, claim_ends)
                    return []
                await tail.idle.wait()
                follower.position = held or None
                held = claim_ends = None
                continue
            mine = follower.position or 0
            if tail.position == before or (before is None and tail.position <= mine):
                self._join(tail, follower, held, claim_ends)
                return []
            # the tail read more meanwhile: read again from our position

    @staticmethod
    def _join(tail: Tail, follower: Follower, held: int | None, claim_ends: int | None) -> None:
        follower.held = held
        tail.followers.add(follower)
        if held is not None:
            tail.hold(claim_ends)

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
