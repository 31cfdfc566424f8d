"""Records appended to a queue's segments by a WATCH transaction: what a
process copies into a queue that writes segments (a redrive's copy), as
post_segments.lua appends a post's.

The counter (``Q:seq``) is read first, then, in the transaction, again with
the length of each segment the new seqs fall in: the records of one segment
go in one ``APPEND`` (a new segment: ``SET`` of its slot table and them, and
its entry in ``Q:dir``), their offsets in one ``SETRANGE`` of their
(consecutive) slots, the segment's expiry raised to the latest of them.
A segment is not copied to fit when it closes here (post_segments.lua does
that): at worst it keeps the slack its last ``APPEND`` left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from feedsvc.storage import record as r
from feedsvc.storage import segments as s
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.optimistic import Conflicted
from feedsvc.storage.transport import Transport

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Appending:
    """Where the next records of a queue go: after its counter ``top``,
    into segments whose lengths were read in the transaction."""

    keys: QueueKeys
    top: int
    lengths: dict[int, int]

    def commands(self, records: Sequence[tuple[bytes, int]]) -> list[Command]:
        """The writes of records, (record, expires ms) pairs, at seqs top + 1
        on, and of the counter after them."""
        keys = self.keys
        out: list[Command] = []
        by_segment: dict[int, list[tuple[int, bytes, int]]] = {}
        for n, (raw, expires) in enumerate(records):
            k, slot = s.segment_of(self.top + 1 + n)
            by_segment.setdefault(k, []).append((slot, raw, expires))
        for k, chunk in by_segment.items():
            key = keys.segment(k)
            data = b"".join(raw for _, raw, _ in chunk)
            latest = max(expires for _, _, expires in chunk)
            length = self.lengths.get(k, 0)
            if length == 0:
                base = s.TABLE_BYTES
                out += [
                    ("SET", key, bytes(s.TABLE_BYTES) + data),
                    ("PEXPIREAT", key, latest),
                    ("ZADD", keys.directory, k, k),
                ]
            else:
                base = length
                out += [("APPEND", key, data), ("PEXPIREAT", key, latest, "GT")]
            offsets, at = [], base
            for _, raw, _ in chunk:
                offsets.append(at.to_bytes(s.SLOT_BYTES, "big"))
                at += len(raw)
            out.append(("SETRANGE", key, chunk[0][0] * s.SLOT_BYTES, b"".join(offsets)))
        out.append(("SET", keys.seq, self.top + len(records)))
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
) -> T:
    """Run plan in a WATCH transaction over a queue in segments that appends
    at most count records (watch and reads: the caller's own, besides the
    counter and the segments)."""
    transactions = transport.transactions
    attempt = 0
    async with transactions.write_slot():
        while True:
            [raw] = await transport.call_checked([("GET", keys.seq)])
            top = r.parse_seq(raw) if raw is not None else 0
            numbers = sorted({(top + 1 + n) // s.SLOTS for n in range(max(count, 1))})
            segment_reads: list[Command] = [("STRLEN", keys.segment(k)) for k in numbers]

            def planned(
                replies: list[Any], top: int = top, numbers: list[int] = numbers
            ) -> tuple[list[Command] | None, T]:
                counter, *rest = replies
                if (r.parse_seq(counter) if counter is not None else 0) != top:
                    raise Conflicted
                lengths = rest[: len(numbers)]
                where = Appending(keys, top, dict(zip(numbers, map(int, lengths), strict=True)))
                return plan(where, rest[len(numbers) :])

            done, result = await transactions.attempt(
                [keys.seq, *(keys.segment(k) for k in numbers), *watch],
                [("GET", keys.seq), *segment_reads, *reads],
                planned,
            )
            if done:
                return result  # type: ignore[return-value]
            await transactions.backoff(attempt)
            attempt += 1
