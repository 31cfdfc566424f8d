"""The sweep loop of one process: runs the segment reviews that are due in
queues nobody posts to or claims from (storage/reviews.py), so an idle
queue's expired messages give their memory back too; and ``fs:sweep``'s
reads and writes (:class:`SweepSchedule`, one per process).

Started and stopped with the store (:func:`start_sweeper`, from each
driver's ``open`` and ``close``), unless its ``sweep_interval`` is 0. Every
:data:`TICK` seconds while it finds work, every ``sweep_interval`` seconds
(:data:`IDLE_LOOK` by default) while it finds none, it takes up to
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
from feedsvc.storage.keys import Kind
from feedsvc.storage.reviews import parse_member
from feedsvc.storage.sweep_schedule import SweepSchedule

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

#: (kind, project, queue, most reviews) -> (reviews run, next due ms or None)
SweepQueue = Callable[[Kind, str, str, int], Awaitable[tuple[int, int | None]]]


def start_sweeper(
    kind: Kind, interval: float, schedule: SweepSchedule, clock: Clock, sweep: SweepQueue
) -> Sweeper | None:
    """The process's sweep loop, started by its queue store (the topic view
    shares it: one a process); None for a topic view, or with interval 0."""
    if kind != "queue" or interval <= 0:
        return None
    sweeper = Sweeper(schedule, clock, sweep, interval)
    sweeper.start()
    return sweeper


class Sweeper:
    def __init__(
        self, schedule: SweepSchedule, clock: Clock, sweep: SweepQueue, idle: float = IDLE_LOOK
    ) -> None:
        self._schedule, self._clock, self._sweep = schedule, clock, sweep
        self._idle = idle
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
        failures, pause = 0, self._idle
        while True:
            # waits first: a process stopped as soon as it started leaves Redis alone
            await asyncio.sleep(0 if self.behind else min(pause * 2**failures, MAX_PAUSE))
            try:
                pause = TICK if await self.tick() else self._idle
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
