"""Records appended to a queue's segments by a WATCH transaction, the one
way the watch drivers and the process append there: a post's records
(watch_segments.post_plan), and the copies a redrive or dead-lettering
makes (append_transaction), as post_segments.lua appends a post's.

Each segment's share of an append (:class:`SegmentAppend`) goes in one
``APPEND`` after the segment's length as read (a new segment: ``SET`` of its
slot table and them, and its entry in ``Q:dir``), their offsets in one
``SETRANGE`` of their (consecutive) slots, the segment's expiry raised to
the latest of them. :func:`append_commands` adds what expiry needs
(reviews.py): an opened segment's count entry, and a review when a segment
opens or gains a message expiring before the open segment's earliest. The
caller notes that review in fs:sweep (SweepSchedule.note_soon) once its
transaction is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from feedsvc.storage import record as r
from feedsvc.storage import reviews
from feedsvc.storage import segments as s
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.optimistic import Conflicted
from feedsvc.storage.transport import Transport

T = TypeVar("T")


@dataclass(slots=True)
class SegmentAppend:
    """One segment's share of an append: its records, from its slot
    first_slot on, and their latest and earliest expiries (ms)."""

    number: int
    first_slot: int
    records: list[bytes] = field(default_factory=list)
    latest: int = 0
    earliest: int = 0

    def add(self, record: bytes, expires: int) -> None:
        self.records.append(record)
        self.latest = max(self.latest, expires)
        self.earliest = min(self.earliest or expires, expires)

    def offsets(self, at: int) -> bytes:
        """The slots of the records appended at offset at."""
        out, offset = [], at
        for record in self.records:
            out.append(offset.to_bytes(s.SLOT_BYTES, "big"))
            offset += len(record)
        return b"".join(out)

    def opens(self, read: Any) -> bool:
        """Whether the append opens the segment (new, or gone whole), as read."""
        return not read

    def writes(self, keys: QueueKeys, read: Any) -> list[Command]:
        """Append the records to the segment as read (its length, or its
        content; None, 0 or empty: a new segment, or one gone whole)."""
        key, data = keys.segment(self.number), b"".join(self.records)
        start = self.first_slot * s.SLOT_BYTES
        if isinstance(read, bytes) and read:
            slots = self.offsets(len(read))
            content = read[:start] + slots + read[start + len(slots) : s.TABLE_BYTES]
            # closed: written anew at its size (APPEND leaves room to grow)
            content += read[s.TABLE_BYTES :] + data
            return [("SET", key, content, "KEEPTTL"), ("PEXPIREAT", key, self.latest, "GT")]
        if isinstance(read, int) and read:
            return [
                ("APPEND", key, data),
                ("SETRANGE", key, start, self.offsets(read)),
                ("PEXPIREAT", key, self.latest, "GT"),
            ]
        table = bytearray(s.TABLE_BYTES)
        slots = self.offsets(s.TABLE_BYTES)
        table[start : start + len(slots)] = slots
        return [
            ("SET", key, bytes(table) + data),
            ("PEXPIREAT", key, self.latest),
            ("ZADD", keys.directory, self.number, self.number),
        ]


def append_commands(
    keys: QueueKeys,
    parts: dict[int, SegmentAppend],
    reads: dict[int, Any],
    review_from: int | None,
) -> tuple[list[Command], int | None]:
    """The writes of parts (segment number -> its share, in seq order), each
    segment as read (SegmentAppend.writes; a closed segment before a part
    that starts its segment, read whole, is written anew at its size), and
    what their expiry needs (reviews.py): an opened segment's count entry
    in ``Q:sn``, and a review at the earliest expiry + REVIEW_AFTER_MS of a
    segment opened, or given a message that expires before review_from (the
    queue hash's REVIEW_FROM). Returns them and the earliest review they
    schedule (ms; None: none), for the caller to note in fs:sweep."""
    writes: list[Command] = []
    review = None
    for k, part in parts.items():
        read = reads.get(k)
        writes += part.writes(keys, read)
        if part.opens(read):
            # its count starts at minus the seqs of its range before it
            writes.append(("HSETNX", keys.segment_counts, k, -part.first_slot))
        if part.opens(read) or not review_from or part.earliest < review_from:
            # reviewed at its earliest expiry + REVIEW_AFTER_MS (reviews.py)
            review_from = part.earliest
            when = part.earliest + reviews.REVIEW_AFTER_MS
            writes.append(("ZADD", keys.reviews, "LT", when, k))
            writes.append(("HSET", keys.meta, reviews.REVIEW_FROM, part.earliest))
            review = min(review or when, when)
        before = reads.get(k - 1)
        if part.first_slot == 0 and k - 1 not in parts and isinstance(before, bytes):
            writes.append(("SET", keys.segment(k - 1), before, "KEEPTTL"))
    return writes, review


@dataclass(slots=True)
class Appending:
    """Where the next records of a queue go: after its counter ``top``, into
    segments whose lengths were read in the transaction, the open one's
    earliest expiry ``review_from``; ``review``: the review commands() made."""

    keys: QueueKeys
    top: int
    lengths: dict[int, int]
    review_from: int | None
    review: int | None = None

    def commands(self, records: Sequence[tuple[bytes, int]]) -> list[Command]:
        """The writes of records, (record, expires ms) pairs, at seqs top + 1
        on, and of the counter after them."""
        parts: dict[int, SegmentAppend] = {}
        for n, (raw, expires) in enumerate(records):
            k, slot = s.segment_of(self.top + 1 + n)
            parts.setdefault(k, SegmentAppend(k, slot)).add(raw, expires)
        out, self.review = append_commands(self.keys, parts, dict(self.lengths), self.review_from)
        out.append(("SET", self.keys.seq, self.top + len(records)))
        return out


#: (where the records go, the replies to the caller's reads) -> the plan's answer
AppendPlan = Callable[[Appending, list[Any]], tuple[list[Command] | None, T]]


async def append_transaction(
    transport: Transport,
    keys: QueueKeys,
    count: int,
    watch: Sequence[str],
    reads: Sequence[Command],
    plan: AppendPlan[T],
) -> tuple[T, int | None]:
    """Run plan in a WATCH transaction over a queue in segments that appends
    at most count records (watch and reads: the caller's own, besides the
    counter and the segments). Returns its answer and the segment review
    its writes scheduled (ms; None: none): the caller notes it in fs:sweep."""
    transactions = transport.transactions
    attempt = 0
    async with transactions.write_slot():
        while True:
            [raw] = await transport.call_checked([("GET", keys.seq)])
            top = r.parse_seq(raw) if raw is not None else 0
            numbers = sorted({(top + 1 + n) // s.SLOTS for n in range(max(count, 1))})
            segment_reads: list[Command] = [("STRLEN", keys.segment(k)) for k in numbers]
            made: list[Appending] = []

            def planned(
                replies: list[Any],
                top: int = top,
                numbers: list[int] = numbers,
                made: list[Appending] = made,
            ) -> tuple[list[Command] | None, T]:
                counter, tmin, *rest = replies
                if (r.parse_seq(counter) if counter is not None else 0) != top:
                    raise Conflicted
                lengths = dict(zip(numbers, map(int, rest[: len(numbers)]), strict=True))
                where = Appending(keys, top, lengths, None if tmin is None else int(tmin))
                made.append(where)
                return plan(where, rest[len(numbers) :])

            done, result = await transactions.attempt(
                [keys.seq, *(keys.segment(k) for k in numbers), *watch],
                [
                    ("GET", keys.seq),
                    ("HGET", keys.meta, reviews.REVIEW_FROM),
                    *segment_reads,
                    *reads,
                ],
                planned,
            )
            if done:
                return result, made[-1].review if made else None  # type: ignore[return-value]
            await transactions.backoff(attempt)
            attempt += 1
