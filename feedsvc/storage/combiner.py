"""Group commit per key: concurrent writes to one queue become one transaction.

The tuned watch driver posts through a :class:`Combiner` keyed by queue.
Posts to a queue that arrive while that queue's transaction is in flight
wait and then go together, in arrival order, in the next one; so one
process has at most one transaction per queue in flight and never
conflicts with itself (only other processes can make its EXEC fail), and a
burst of N posts costs one WATCH/MULTI/EXEC instead of N.

Why a combiner rather than a per-queue lock: a lock also ends the
self-conflicts, but it makes the posts to a hot queue wait for each
other's two round trips one by one, so the queue's throughput would be one
post per transaction latency. The combiner pays that latency once per
batch. It is the WATCH analogue of what the coalescer (auto-pipelining)
gives the lua driver: concurrent requests share round trips.

The lua driver posts to a queue in segments through one as well
(``lua_segments.py``): there a batch is one call of ``post_segments.lua``,
which it bounds by messages and bytes as well as posts (``cut``).

A waiter that is cancelled stops waiting; its item may still be written
(as with any request cut off after it was sent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

# flush(key, items) -> one result (or the exception to raise) per item, in order
Flush = Callable[[str, list[Item]], Awaitable[list[Result | Exception]]]
# cut(items) -> how many of the first items (at most max_items) the next batch
# takes: at least one, so an item over every bound still goes, alone
Cut = Callable[[list[Item]], int]


class Combiner(Generic[Item, Result]):
    def __init__(
        self, flush: Flush[Item, Result], max_items: int, cut: Cut[Item] | None = None
    ) -> None:
        self._flush = flush
        self._max_items = max_items
        self._cut = cut
        self._pending: dict[str, list[tuple[Item, asyncio.Future[Result]]]] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}

    async def submit(self, key: str, item: Item) -> Result:
        """Write item with whatever else is pending for key; its result."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append((item, future))
        if key not in self._drains:
            self._drains[key] = asyncio.create_task(self._drain(key), name=f"combiner {key}")
        return await future

    async def _drain(self, key: str) -> None:
        """Flush key's pending items, a batch at a time, until none are left."""
        batch: list[tuple[Item, asyncio.Future[Result]]] = []
        try:
            while True:
                pending = self._pending.get(key)
                if not pending:
                    break
                batch = pending[: self._max_items]
                del pending[: self._max_items]
                live = [(item, f) for item, f in batch if not f.done()]
                if self._cut is not None and len(live) > 1:
                    # the items past the cut go first in the next batch
                    keep = max(1, self._cut([item for item, _ in live]))
                    pending[:0] = live[keep:]
                    batch = live = live[:keep]
                if not live:
                    continue
                try:
                    results = await self._flush(key, [item for item, _ in live])
                except Exception as exc:  # the whole batch failed: each waiter hears it
                    results = [exc] * len(live)
                for (_, future), result in zip(live, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
                batch = []
        finally:
            # cancelled (close()): nobody is left waiting for ever
            left = batch + self._pending.pop(key, [])
            for _, future in left:
                future.cancel()
            del self._drains[key]

    async def close(self) -> None:
        """Stop every drain (their waiters are cancelled)."""
        drains = list(self._drains.values())
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
