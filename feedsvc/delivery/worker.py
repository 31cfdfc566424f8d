"""The delivery worker of one process: started and stopped with the app.

Every serving process (each ``--workers`` worker too) runs one. They share
the work through Redis alone, with no coordinator:

* **Wake-ups**: for each queue that has subscriptions, the worker follows
  the queue's feed (``FeedStore.follow``, the live-following notifications:
  one shard-channel subscription per queue, nothing polled). A post wakes
  every process; each tries to take the lease of each of the queue's
  subscriptions that it is not already delivering; one wins per subscription.
* **The sweep**, every ``--delivery-sweep`` seconds: it reads the list of
  parents with subscriptions (``fs:subscribed``), starts following new ones
  and tries the lease of every subscription with no live runner here. That
  is how a crashed worker's subscriptions are taken over (its leases expire)
  and how retries due later resume. It also deletes, a bounded step per
  parent each time, the records of subscriptions deleted with their queue.
* **Runners** (``runner.py``): one task per subscription whose lease this
  process holds.

Stopping (SIGTERM, app cleanup) cancels the runners and lets their leases go,
so another process continues at once; what was in flight is sent again
(at least once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from feedsvc.clock import Clock
from feedsvc.config.subscriptions import SubscriptionSettings
from feedsvc.delivery.runner import DeliveryCounters, Runner
from feedsvc.delivery.senders import Senders
from feedsvc.errors import FeedError
from feedsvc.services.live import Rounds
from feedsvc.storage.base import FeedStore, Parent, checkpoint, feed_of

log = logging.getLogger("feedsvc")

#: Seconds close() waits for the delivery tasks to end.
CLOSE_PATIENCE = 10.0
#: Seconds after the start before the first sweep (unless kicked).
FIRST_SWEEP = 1.0
#: Records of deleted subscriptions each sweep removes, at most, per parent.
SWEEP_STEP = 2000


class Deliverer:
    def __init__(self, store: FeedStore, settings: SubscriptionSettings, clock: Clock) -> None:
        self._store = store
        self._settings = settings
        self._clock = clock
        self.counters = DeliveryCounters()
        self._senders = Senders(settings)
        self._runners: dict[tuple[Parent, str], asyncio.Task[None]] = {}
        self._followers: dict[Parent, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._kicked = asyncio.Event()
        self._closing = False  # no runner or follower starts once set

    @property
    def running(self) -> int:
        return len(self._runners)

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    def kick(self) -> None:
        """Sweep now (a subscription was created or confirmed here)."""
        self._kicked.set()

    async def close(self) -> None:
        """Stop the sweep and the wake-ups (which start runners), then the
        runners, each letting its lease go; nothing starts meanwhile."""
        self._closing = True
        await _stop([t for t in (self._sweeper, *self._followers.values()) if t is not None])
        await _stop(list(self._runners.values()))
        await self._senders.close()

    async def _sweep_forever(self) -> None:
        # The first sweep waits a moment (or a kick): a process that is stopped
        # as soon as it started (tests, a failed rollout) leaves Redis alone.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(self._settings.delivery_sweep, FIRST_SWEEP)):
                await self._kicked.wait()
        while not self._closing:
            try:
                await self.sweep()
            except FeedError as exc:
                log.warning("delivery sweep: %s", exc)
            except Exception:  # a bug must not end delivery for good
                log.exception("delivery sweep failed")
            self._kicked.clear()
            checkpoint()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.delivery_sweep):
                    await self._kicked.wait()

    async def sweep(self) -> None:
        state = self._store.deliveries
        for parent in await state.parents():
            # what a queue's deletion left, a bounded step per sweep
            await state.sweep_buried(parent, SWEEP_STEP)
            ids = await state.subscription_ids(parent)
            if not ids:
                await state.forget_if_empty(parent)
                follower = self._followers.pop(parent, None)
                if follower is not None:
                    follower.cancel()
                continue
            if self._closing:
                return
            if parent not in self._followers:
                self._followers[parent] = asyncio.create_task(self._follow(parent))
            await self._try(parent, ids)

    async def _try(self, parent: Parent, ids: list[str]) -> None:
        """Start a runner for each of ids with work, no runner here and a free lease."""
        idle = [sid for sid in ids if (parent, sid) not in self._runners]
        confirming = self._settings.require_confirmation
        for sid in await self._store.deliveries.with_work(parent, idle, confirming):
            if self._closing:
                return
            if (parent, sid) in self._runners:
                continue
            runner = Runner(
                self._store,
                self._senders,
                self._settings,
                self._clock,
                self.counters,
                parent,
                sid,
            )
            if not await runner.acquire():
                continue
            if self._closing:  # stopped while the lease was taken
                await runner.let_go()
                return
            key = (parent, sid)

            def done(key: tuple[Parent, str] = key) -> None:
                self._runners.pop(key, None)

            self._runners[key] = asyncio.create_task(runner.run(done))

    async def _follow(self, parent: Parent) -> None:
        """Try the parent's subscriptions after every post to it."""
        feed = feed_of(self._store, parent)
        while not self._closing:
            try:
                async with feed.follow(parent.project, parent.name) as follow:
                    # the sweep that started this has just tried them: the
                    # first round waits before it reads
                    longest = self._settings.delivery_sweep * 10
                    async for round_ in Rounds(follow, longest=longest):
                        if round_:
                            ids = await self._store.deliveries.subscription_ids(parent)
                            await self._try(parent, ids)
            except FeedError as exc:
                log.warning("delivery wake-ups of %s: %s", parent.name, exc)
                checkpoint()
                await asyncio.sleep(self._settings.delivery_sweep)
            except Exception:
                log.exception("delivery wake-ups of %s failed", parent.name)
                checkpoint()
                await asyncio.sleep(self._settings.delivery_sweep)


async def _stop(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel tasks and wait until each has ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
