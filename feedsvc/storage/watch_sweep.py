"""The watch drivers' segment reviews (storage/reviews.py): ``sweep.lua``'s
work as optimistic transactions, one segment each (≤ 100 records).

A review reads the segment whole, its claim states and its count, the
counter and the queue hash under WATCH (every writer of a segment writes
one of them: a post the counter, a delete the segment), then writes what
``_lib.lua``'s ``review_segment`` writes: the expired and deleted records
dropped (slots kept), what went counted gone, the next review. A conflict
makes the next attempt read again; the rules are reviews.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from feedsvc.clock import Clock
from feedsvc.storage import record as r
from feedsvc.storage import reviews
from feedsvc.storage import segments as seg
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.optimistic import Plan
from feedsvc.storage.transport import Transport


def review_time(earliest: int, latest: int) -> int:
    """When a segment whose live records expire from earliest to latest is
    looked at next (_lib.lua's review_time)."""
    if latest - earliest <= reviews.SPREAD_MS:
        return latest
    return earliest + reviews.REVIEW_AFTER_MS


def segment_count(k: int, raw: Any, top: int) -> int:
    """Segment k's messages not yet counted gone, from its Q:sn entry."""
    if raw is None:
        return 0
    passed = min(seg.SLOTS, top - k * seg.SLOTS + 1)
    return int(raw) + max(0, passed)


@dataclass(slots=True)
class Survey:
    """What segment k holds at now (_lib.lua's survey_segment): its records'
    spans by slot, the live slots, the expired seqs, whether any record is
    to go, the survivors' earliest and latest expiry."""

    data: bytes | None
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    keep: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    drop: bool = False
    earliest: int = 0
    latest: int = 0

    @classmethod
    def of(cls, k: int, data: bytes | None, states: Sequence[Any], now: int) -> Survey:
        """states: Q:cl's entries of the segment's 100 seqs, in slot order."""
        out = cls(data)
        if not data:
            return out
        end = len(data)
        values = seg.slot_offsets(data[: seg.TABLE_BYTES])
        for j in range(seg.SLOTS - 1, -1, -1):
            value = values[j]
            if not value:
                continue
            at = value & seg.OFFSET_MASK
            out.spans[j] = (at, end)
            end = at
            if value & seg.GONE_BIT:
                out.drop = True
                continue
            expires = int(data[at : at + seg.EXPIRES_WIDTH])
            if states[j] is not None:
                expires = max(expires, seg.ClaimState.decode(states[j]).expires)
            if expires > now:
                out.keep.append(j)
                out.earliest = min(out.earliest or expires, expires)
                out.latest = max(out.latest, expires)
            else:
                out.dead.append(k * seg.SLOTS + j)
                out.drop = True
        out.keep.reverse()
        return out

    def rewritten(self) -> bytes:
        """The segment with the survivors only, each in its own slot."""
        assert self.data is not None
        table, records, at = bytearray(seg.TABLE_BYTES), [], seg.TABLE_BYTES
        for j in self.keep:
            start, end = self.spans[j]
            table[j * seg.SLOT_BYTES : (j + 1) * seg.SLOT_BYTES] = at.to_bytes(4, "big")
            records.append(self.data[start:end])
            at += end - start
        return bytes(table) + b"".join(records)


def review_reads(keys: QueueKeys, k: int) -> list[Command]:
    return [
        ("GET", keys.seq),
        ("GET", keys.segment(k)),
        ("HGET", keys.segment_counts, k),
        ("HMGET", keys.claim_states, *range(k * seg.SLOTS, (k + 1) * seg.SLOTS)),
    ]


def review_plan(keys: QueueKeys, k: int, now: int) -> Plan[bool]:
    """Review segment k (_lib.lua's review_segment), given review_reads';
    its result: whether the segment went whole."""

    def plan(replies: list[Any]) -> tuple[list[Command] | None, bool]:
        last, data, sn, states = replies
        top = 0 if last is None else int(last)
        count = segment_count(k, sn, top)
        s = Survey.of(k, data, states, now)
        is_open = top // seg.SLOTS == k
        out: list[Command] = []
        if count > len(s.keep):
            out.append(("HINCRBY", keys.meta, seg.GONE, count - len(s.keep)))
        if s.dead:
            out.append(("HDEL", keys.claim_states, *s.dead))
            tag = seg.id_tag(keys.prefix)
            dead_ids = [seg.message_id(tag, q) for q in s.dead]
            out.append(("ZREM", keys.claimed, *dead_ids))
            out.append(("ZREM", keys.claim_index, *dead_ids))
        if not s.keep:
            if data:
                out.append(("DEL", keys.segment(k)))
            out += [
                ("ZREM", keys.directory, k),
                ("ZREM", keys.reviews, k),
                ("HDEL", keys.segment_counts, k),
            ]
            if is_open:
                out.append(("HDEL", keys.meta, reviews.REVIEW_FROM))
            return out, True
        passed = min(seg.SLOTS, top - k * seg.SLOTS + 1)
        out.append(("HSET", keys.segment_counts, k, len(s.keep) - passed))
        if s.drop and s.latest > now + reviews.REVIEW_AFTER_MS:
            out.append(("SET", keys.segment(k), s.rewritten(), "PXAT", s.latest))
        out.append(("ZADD", keys.reviews, review_time(s.earliest, s.latest), k))
        if is_open:
            out.append(("HSET", keys.meta, reviews.REVIEW_FROM, s.earliest))
        return out, False

    return plan


#: a segment index written anew below this many entries (_lib.lua's compact_index)
COMPACT_BELOW = 64

#: segments a count reads of those reviewed soon (sweep.lua's SEG_COUNT_SEGMENTS)
COUNTED = reviews.COUNT_SEGMENTS


def soon_read(keys: QueueKeys, now: int) -> Command:
    """The segments reviewed within reviews.SPREAD_MS (up to COUNTED): every
    expired record not yet counted gone is in one of them (reviews.py)."""
    return ("ZRANGE", keys.reviews, "-inf", now + reviews.SPREAD_MS, "BYSCORE", "LIMIT", 0, COUNTED)


def unswept_reads(keys: QueueKeys, soon: Sequence[int]) -> list[Command]:
    """What expired_unswept surveys of the segments soon (soon_read's)."""
    return [c for k in soon for c in review_reads(keys, k)]


def expired_unswept(soon: Sequence[int], replies: Sequence[Any], now: int) -> int:
    """The expired records not yet counted gone in the segments soon, from
    unswept_reads' replies (_lib.lua's expired_unswept)."""
    expired = 0
    for n, k in enumerate(soon):
        last, data, sn, states = replies[4 * n : 4 * n + 4]
        count = segment_count(k, sn, 0 if last is None else int(last))
        expired += max(0, count - len(Survey.of(k, data, states, now).keep))
    return expired


class WatchSweep:
    """The reviews of one store's queues, and their exact live count."""

    def __init__(self, transport: Transport, clock: Clock) -> None:
        self._transport, self._clock = transport, clock

    async def review_one(self, keys: QueueKeys) -> bool:
        """Run the queue's first due review, if any."""
        now = self._clock.now_ms()
        [due] = await self._transport.call_checked(
            [("ZRANGE", keys.reviews, "-inf", now, "BYSCORE", "LIMIT", 0, 1)]
        )
        if not due:
            return False
        k = int(due[0])
        watch = [keys.seq, keys.meta, keys.segment(k), keys.claim_states, keys.segment_counts]
        reads = review_reads(keys, k)
        went = await self._transport.transactions.optimistic(
            watch, reads, review_plan(keys, k, now)
        )
        if went:
            for key in (keys.directory, keys.reviews, keys.segment_counts):
                await self._compact_index(key)
        return True

    async def _compact_index(self, key: str) -> None:
        """A zset or hash of the segments that grew past Redis's listpack
        size, written anew once small (_lib.lua's compact_index): a listpack
        again, and a drained queue gives its table back too."""
        [encoding] = await self._transport.call_checked([("OBJECT", "ENCODING", key)])
        if encoding not in (b"skiplist", b"hashtable"):
            return
        zset = encoding == b"skiplist"
        [size] = await self._transport.call_checked([("ZCARD" if zset else "HLEN", key)])
        if int(size) > COMPACT_BELOW:
            return
        read: Command = ("ZRANGE", key, 0, -1, "WITHSCORES") if zset else ("HGETALL", key)

        def plan(replies: list[Any]) -> tuple[list[Command] | None, None]:
            again, got = replies
            found = list(got.items()) if isinstance(got, dict) else r.pairs(got)  # RESP3 hashes
            if again != encoding or not found or len(found) > COMPACT_BELOW:
                return None, None
            if zset:
                refill: Command = ("ZADD", key, *(x for m, sc in found for x in (sc, m)))
            else:
                refill = ("HSET", key, *(x for pair in found for x in pair))
            return [("DEL", key), refill], None

        reads: list[Command] = [("OBJECT", "ENCODING", key), read]
        await self._transport.transactions.optimistic([key], reads, plan)

    async def sweep(self, keys: QueueKeys, most: int) -> tuple[int, int | None]:
        """Up to most due reviews; (reviews run, the next due ms or None)."""
        ran = 0
        while ran < most and await self.review_one(keys):
            ran += 1
        [first] = await self._transport.call_checked([("ZRANGE", keys.reviews, 0, 0, "WITHSCORES")])
        pairs = r.pairs(first)
        return ran, (int(float(pairs[0][1])) if pairs else None)

    async def live(self, keys: QueueKeys) -> int:
        """The queue's live messages (sweep.lua's count): after its due
        reviews, less those expired in segments reviewed soon."""
        await self.sweep(keys, reviews.STATS_REVIEWS)
        return await live_now(self._transport, keys, self._clock.now_ms())


async def live_now(transport: Transport, keys: QueueKeys, now: int) -> int:
    """A queue's live messages at now, with reads only (sweep.lua's count
    without its reviews): posted less gone, less those expired in segments
    reviewed soon (up to COUNTED of them; beyond, an expired message counts
    until its review)."""
    reads: list[Command] = [*seg.live_count_commands(keys, now), soon_read(keys, now)]
    *counts, due = await transport.call_checked(reads, idempotent=True)
    live, soon = seg.live_count(counts), [int(k) for k in due]
    if soon:
        replies = await transport.call_checked(unswept_reads(keys, soon), idempotent=True)
        live -= expired_unswept(soon, replies, now)
    return max(0, live)
