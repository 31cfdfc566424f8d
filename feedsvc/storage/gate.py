"""The gate: a FIFO-fair limit on conversations over pooled Redis connections.

redis-py's blocking pool is not fair and its plain pool fails at once when
empty, so feedsvc queues for a slot here, at most ``--pool-timeout``
(then :class:`PoolExhausted`, a 503). A task holds at most one slot: a
nested ``hold()`` in the same task takes none (a task started inside
``hold()`` inherits the context variable, not the slot: the lease names its
task). ``pause()`` gives the slot back while a task sleeps, so a crowd of
writers backing off after WATCH conflicts cannot starve everyone else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

from feedsvc.errors import PoolExhausted


class _Lease:
    __slots__ = ("held", "task")

    def __init__(self) -> None:
        self.held = True
        self.task = asyncio.current_task()

    def ours(self) -> bool:
        return self.held and self.task is asyncio.current_task()


_LEASE: ContextVar[_Lease | None] = ContextVar("feedsvc_pool_lease", default=None)


class Gate:
    def __init__(self, slots: int, timeout: float) -> None:
        self.slots = slots
        self._timeout = timeout
        self._semaphore = asyncio.Semaphore(slots)

    async def _acquire(self) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await self._semaphore.acquire()
        except TimeoutError:
            raise PoolExhausted("No Redis connection became free in time.") from None

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """One slot for this task (none more if it holds one already)."""
        outer = _LEASE.get()
        if outer is not None and outer.ours():
            yield
            return
        await self._acquire()
        lease = _Lease()
        token = _LEASE.set(lease)
        try:
            yield
        finally:
            _LEASE.reset(token)
            if lease.held:
                self._semaphore.release()

    async def pause(self, seconds: float) -> None:
        """Sleep, without this task's slot meanwhile."""
        lease = _LEASE.get()
        if lease is None or not lease.ours():
            await asyncio.sleep(seconds)
            return
        self._semaphore.release()
        lease.held = False
        await asyncio.sleep(seconds)
        await self._acquire()
        lease.held = True

    @property
    def in_use(self) -> int:
        return self.slots - self._semaphore._value

    @property
    def waiting(self) -> int:
        return len(getattr(self._semaphore, "_waiters", None) or ())
