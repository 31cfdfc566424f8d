"""The redriver of one process: moves running redrives on, started and
stopped with the app.

Every serving process (each ``--workers`` worker too) runs one, as it runs
a delivery worker. Every :data:`TICK` seconds while redrives run, every
:data:`IDLE_LOOK` seconds while none does, and at once after one was
started here (``kick``), it reads up to :data:`PER_TICK` dead-letter queues
with a running redrive (``fs:redrives``) and gives each a few steps
(``RedriveStore.step``): a step moves one bounded batch if this process
holds the redrive's lease or may take it (the holder's lapsed: it crashed
or stopped), no more than the redrive's rate allows. So a redrive goes on
whichever process started it and whatever happens to that process; its
progress lives in Redis (``feedsvc.storage.redrive``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from feedsvc.errors import FeedError
from feedsvc.storage.base import FeedStore, checkpoint, new_id

log = logging.getLogger("feedsvc")

#: Seconds between two steps of the running redrives.
TICK = 0.5
#: Seconds between two looks for running redrives while none runs: one
#: started by another process, or left by one that died, is found that late
#: (one started here at once). An idle service costs Redis one command a
#: look a process.
IDLE_LOOK = 5.0
#: Seconds between two looks at most while Redis is in trouble.
MAX_PAUSE = 10.0
#: Redrives looked at per tick, at most.
PER_TICK = 16
#: Steps per redrive per tick, at most (a step is a bounded batch; the rate
#: allows one second's worth at a time).
STEPS_PER_TICK = 10


class Redriver:
    def __init__(self, store: FeedStore) -> None:
        self._store = store
        #: this process's name in the redrives' leases
        self.owner = new_id()
        self._task: asyncio.Task[None] | None = None
        self._kicked = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def kick(self) -> None:
        """Look now (a redrive was started here)."""
        self._kicked.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        # waits first: a process stopped as soon as it started (tests, a
        # failed rollout) leaves Redis alone
        failures, pause = 0, IDLE_LOOK
        while True:
            with contextlib.suppress(TimeoutError):
                # after failures, less often: a line per outage, not two a second
                async with asyncio.timeout(min(pause * 2**failures, MAX_PAUSE)):
                    await self._kicked.wait()
            self._kicked.clear()
            try:
                pause = TICK if await self.tick() is not None else IDLE_LOOK
            except FeedError as exc:  # Redis trouble: a later tick tries again
                if not failures:
                    log.warning("redrives wait: %s", exc)
                failures = min(failures + 1, 8)
            except Exception:  # a bug must not end redrives for good
                log.exception("redrive tick failed")
                failures = min(failures + 1, 8)
            else:
                if failures:
                    log.info("redrives go on")
                failures = 0
            checkpoint()

    async def tick(self) -> int | None:
        """Move every running redrive on as far as its rate allows now; how
        many dead letters moved (None: no redrive runs)."""
        redrives = self._store.redrives
        total = 0
        trouble: FeedError | None = None
        running = await redrives.running(PER_TICK)
        if not running:
            return None
        for project, queue in running:
            try:
                for _ in range(STEPS_PER_TICK):
                    moved = await redrives.step(project, queue, self.owner)
                    if not moved:
                        break
                    total += moved
            except FeedError as exc:  # this one's trouble (its slot's) is not the others'
                trouble = trouble or exc
        if trouble is not None:
            raise trouble
        return total
