"""The one signal that this process has begun to stop: every waiter selects
on it together with its own wake-up.

An event stream, a long poll (``wait=``) and a claim wait may wait for
something that does not come for a long while. When the process drains
(SIGTERM, :mod:`feedsvc.process.drain`) they must not hold the grace period and then
be cut off: on the signal a stream ends as it does at ``--stream-lifetime``
(its final chunk; the client resumes with ``Last-Event-ID``), a long poll
answers the empty page and a claim wait its 204, at once, so a process with
only waiters in flight exits at once.

Set once, never cleared. A future rather than an ``asyncio.Event``: a
waiter that already waits on a future (a follower's end) adds this one to
the same ``asyncio.wait`` at no cost, with no task of its own.

This module imports nothing of feedsvc's: every layer may use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class DrainSignal:
    """Set when this process begins to drain; made before any loop runs
    (``create_app``), its future on the loop that first asks for it."""

    __slots__ = ("_future", "_set")

    def __init__(self) -> None:
        self._set = False
        self._future: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def is_set(self) -> bool:
        return self._set

    def future(self) -> asyncio.Future[None]:
        """Done once set: to wait on beside a waiter's own wake-up."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self._set:
                self._future.set_result(None)
        return self._future

    async def unless_set(self, waiting: Coroutine[Any, Any, T]) -> T | None:
        """waiting's result, or None if the signal comes first (or came
        before): waiting is then cancelled."""
        if self._set:
            waiting.close()
            return None
        task = asyncio.ensure_future(waiting)
        try:
            await asyncio.wait((task, self.future()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()  # it only waits; it ends on the loop's next turn
        return task.result() if task.done() else None
