"""The sweep loop of one process: runs the segment reviews that are due in
queues nobody posts to or claims from (storage/reviews.py), so an idle
queue's expired messages give their memory back too; and ``fs:sweep``'s
reads and writes (:class:`SweepSchedule`, one per process).

Started and stopped with the store (the lua driver's ``open`` and
``close``). Every :data:`TICK` seconds while it finds work, every
:data:`IDLE_LOOK` seconds while it finds none, it takes up to
:data:`PER_TICK` due queues from ``fs:sweep`` (each leased for :data:`LEASE_MS`, so processes
share the work, and one that dies leaves its queues due again), runs at
most :data:`CALLS_PER_QUEUE` reviews of each, one segment a call (≤ 100
records: bounded work, Redis never blocks on it), and writes back when
each is due next; while reviews are left due it goes on at once (other
requests' calls take turns between two of its calls). Under a flood of
reviews it falls behind rather than block Redis: the lag (how late the
oldest due queue is) is the store's ``sweep_lag_seconds`` in /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from feedsvc.clock import Clock
from feedsvc.errors import FeedError
from feedsvc.storage.keys import SWEEP_KEY, Kind
from feedsvc.storage.reviews import parse_member, sweep_member
from feedsvc.storage.transport import Transport

log = logging.getLogger("feedsvc")

#: Seconds between two looks at fs:sweep while reviews come due.
TICK = 1.0
#: Seconds between two looks while none was due at the last (an idle service
#: costs Redis two commands a look a process; a review is that much later).
IDLE_LOOK = 5.0
#: Seconds between two looks at most while Redis is in trouble.
MAX_PAUSE = 30.0
#: Queues swept per tick, at most.
PER_TICK = 16
#: Reviews (one segment each) per queue per tick, at most.
CALLS_PER_QUEUE = 100
#: How long a process holds the queues it took (ms).
LEASE_MS = 60_000

#: take: up to ARGV[2] members due by ARGV[1], each leased until ARGV[3]
#: (another process passes over them meanwhile; a crashed one's come due
#: again then). settle ARGV[1] member, ARGV[2] its lease, ARGV[3] its next
#: due ('' = none): set unless a post noted an earlier one meanwhile.
_TAKE = """
local due = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, ARGV[2])
for _, m in ipairs(due) do redis.call('ZADD', KEYS[1], 'XX', ARGV[3], m) end
return due
"""
_SETTLE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) ~= tonumber(ARGV[2]) then
  if ARGV[3] ~= '' then redis.call('ZADD', KEYS[1], 'LT', ARGV[3], ARGV[1]) end
elseif ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"""


class SweepSchedule:
    """fs:sweep: the queues with a review due, and when (one per process)."""

    def __init__(self, transport: Transport, clock: Clock) -> None:
        self._transport, self._clock = transport, clock
        #: the oldest due entry's lateness at the last look (ms; 0 = none late)
        self.lag_ms = 0
        #: reviews noted and not yet written: member -> earliest when (ms)
        self._pending: dict[str, int] = {}
        self._writing: asyncio.Task[None] | None = None

    async def note(self, kind: Kind, project: str, queue: str, when: int) -> None:
        """A script scheduled a review of the queue at ``when`` (ms)."""
        self.note_soon(kind, project, queue, when)
        await self.noted()

    def note_soon(self, kind: Kind, project: str, queue: str, when: int) -> None:
        """:meth:`note`, written in the background: the request that made the
        review does not wait for it (a project quota's reservation, held until
        the request ends, would refuse others meanwhile)."""
        member = sweep_member(kind, project, queue)
        self._pending[member] = min(when, self._pending.get(member, when))
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._write(), name="segment reviews noted")

    async def noted(self) -> None:
        """Wait until every review noted so far is written (or given up)."""
        while self._writing is not None and not self._writing.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writing)

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, {}
            try:
                await self._transport.call_checked(
                    [("ZADD", SWEEP_KEY, "LT", when, m) for m, when in batch.items()]
                )
            except FeedError as exc:
                # the queue's next post (or claim) runs its due review itself
                log.warning("%d segment reviews wait for their queues' posts: %s", len(batch), exc)

    async def take(self, limit: int, lease_ms: int) -> tuple[list[str], int]:
        """Up to ``limit`` members due now, and the lease (ms) they are held
        until (settle names it); the lag (the oldest due entry's) is
        measured on the way."""
        now = self._clock.now_ms()
        lease = now + lease_ms
        oldest, due = await self._transport.call_checked(
            [
                ("ZRANGE", SWEEP_KEY, 0, 0, "WITHSCORES"),
                ("EVAL", _TAKE, 1, SWEEP_KEY, now, limit, lease),
            ]
        )
        if oldest:  # [member, score], or [[member, score]] (RESP3)
            first = oldest[0] if isinstance(oldest[0], list | tuple) else oldest
            self.lag_ms = max(0, now - int(float(first[1])))
        else:
            self.lag_ms = 0
        return [m.decode() if isinstance(m, bytes) else str(m) for m in due], lease

    async def settle(self, member: str, lease: int, next_due: int | None) -> None:
        """After the member's reviews: its next due, or none."""
        args = [member, lease, "" if next_due is None else next_due]
        await self._transport.call_checked([("EVAL", _SETTLE, 1, SWEEP_KEY, *args)])


#: (kind, project, queue, most reviews) -> (reviews run, next due ms or None)
SweepQueue = Callable[[Kind, str, str, int], Awaitable[tuple[int, int | None]]]


class Sweeper:
    def __init__(self, schedule: SweepSchedule, clock: Clock, sweep: SweepQueue) -> None:
        self._schedule, self._clock, self._sweep = schedule, clock, sweep
        self._task: asyncio.Task[None] | None = None
        #: the last tick left reviews due (a queue's bound, or PER_TICK queues)
        self.behind = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="segment sweep")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _run(self) -> None:
        failures, pause = 0, IDLE_LOOK
        while True:
            # waits first: a process stopped as soon as it started leaves Redis alone
            await asyncio.sleep(0 if self.behind else min(pause * 2**failures, MAX_PAUSE))
            try:
                pause = TICK if await self.tick() else IDLE_LOOK
            except FeedError as exc:  # Redis trouble: a later tick tries again
                self.behind = False
                if not failures:
                    log.warning("segment sweep waits: %s", exc)
                failures = min(failures + 1, 8)
            except Exception:  # a bug must not end the sweep for good
                self.behind = False
                log.exception("segment sweep failed")
                failures = min(failures + 1, 8)
            else:
                failures = 0

    async def tick(self) -> int:
        """Run the due reviews of up to PER_TICK queues; how many ran."""
        await self._schedule.noted()
        members, lease = await self._schedule.take(PER_TICK, LEASE_MS)
        self.behind = len(members) == PER_TICK
        total = 0
        trouble: FeedError | None = None
        for member in members:
            kind, project, queue = parse_member(member)
            try:
                ran, due = await self._sweep(kind, project, queue, CALLS_PER_QUEUE)
                total += ran
                self.behind = self.behind or ran >= CALLS_PER_QUEUE
                await self._schedule.settle(member, lease, due)
            except FeedError as exc:  # this queue's trouble (its slot's) is not the others'
                trouble = trouble or exc
        if trouble is not None:
            raise trouble
        return total
