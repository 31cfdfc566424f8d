"""``fs:sweep``, the queues with a segment review due (reviews.py says the
rules; this module is the schedule's reads and writes): one key written
only outside the queue scripts, read by every process's sweep loop
(``sweeper.py``). Apart from reviews.py so that the segment layout's rules
(``segments.py``, which the record module imports) need no transport."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from feedsvc.clock import Clock
from feedsvc.errors import FeedError
from feedsvc.storage import segments as seg
from feedsvc.storage.keys import SWEEP_KEY, Kind, QueueKeys
from feedsvc.storage.reviews import DELETE_REVIEW_MS, sweep_member
from feedsvc.storage.transport import Transport

log = logging.getLogger("feedsvc")

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

    def note_gone(self, kind: Kind, project: str, queue: str, ids: Sequence[str], now: int) -> None:
        """ids went from the queue (deleted, popped, dead-lettered) by a
        transaction of the process's own: if any is a segment message, its
        segment's review is due by ``now`` + DELETE_REVIEW_MS (the
        transaction scheduled it in the queue's ``Q:sx``: segment_claims.
        forget_commands), noted here. A review noted for an id gone already
        finds nothing due, and settles the queue's next."""
        tag = seg.id_tag(QueueKeys.of(project, queue, kind).prefix)
        if any(seg.seq_of(tag, i) is not None for i in ids):
            self.note_soon(kind, project, queue, now + DELETE_REVIEW_MS)

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
