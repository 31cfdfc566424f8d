"""Claims on segment messages once they are made: claim_upkeep.py's side of
the segment layout (storage/segments.py).

A segment message's record never changes; what a claim does to it lives in
its claim state (``Q:cl``, :class:`~feedsvc.storage.segments.ClaimState`).
So claim upkeep (renew, release, a message's release) reads the records of
the messages it touches first, outside its transaction (they cannot change;
a message deleted meanwhile has lost its claim state too), then WATCHes
``Q:cl`` with the claim and reads the states in the transaction: a row of a
segment message is its record as read with its state as watched.

Writes: the message's new claim state, ``PEXPIREAT ... GT`` on its segment
when a claim extends its life (a segment lives as long as its
longest-lived message), and the queue's claimed index as for the older layout.
A message released with a delay keeps, in its state, no claim and the time
it is due (``ClaimState.due``): its record's due cannot change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from feedsvc.errors import TooMuchContention
from feedsvc.storage import groups, reviews
from feedsvc.storage import record as r
from feedsvc.storage import segments as s
from feedsvc.storage.base import Message
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.segment_pages import RECORD_READS, record_reads, segment_messages
from feedsvc.storage.transport import Transport


async def read_records(
    transport: Transport, keys: QueueKeys, ids: Sequence[str]
) -> dict[str, s.SegmentRecord]:
    """The records of the ids that name messages of the queue's segments
    (present, not gone); reads only. The records are read in a MULTI with
    their slot tables, and kept only if those tables put each record where
    it was read: a review rewriting a segment (its records move) or a post
    appending to it (the last record's end) between the two reads would
    cut a record wrong; then again, with the tables read last. A post
    appending after a record does not move it, so a hot queue's posts do
    not make its claim upkeep read again and again."""
    tag = s.id_tag(keys.prefix)
    seqs = {i: q for i in ids if (q := s.seq_of(tag, i)) is not None}
    if not seqs:
        return {}
    numbers = sorted({q // s.SLOTS for q in seqs.values()})
    table_reads: list[Command] = [s.table_read(keys.segment(k)) for k in numbers]
    new_start, *tables = await transport.call_checked(
        [("HGET", keys.meta, s.NEW_START), *table_reads], idempotent=True
    )
    if new_start is None:
        return {}
    for _ in range(RECORD_READS):
        wanted = _record_reads(keys, seqs, int(new_start), dict(zip(numbers, tables, strict=True)))
        if not wanted:
            return {}
        again = await transport.transaction([*table_reads, *(c for _, _, c in wanted)])
        tables = again[: len(numbers)]
        now = dict(zip(numbers, tables, strict=True))
        if _record_reads(keys, seqs, int(new_start), now) == wanted:
            raws = again[len(numbers) :]
            return {
                message_id: s.SegmentRecord.decode(seq, raw)
                for (message_id, seq, _), raw in zip(wanted, raws, strict=True)
                if raw
            }
    raise TooMuchContention(f"Gave up after {RECORD_READS} reads of moving segments; retry.")


def _record_reads(
    keys: QueueKeys, seqs: dict[str, int], new_start: int, tables: dict[int, bytes]
) -> list[tuple[str, int, Command]]:
    """(id, seq, the GETRANGE of its record) per present id (in segments:
    at or past new_start), given the slot tables (segment_pages.record_reads)."""
    id_of = {seq: message_id for message_id, seq in seqs.items() if seq >= new_start}
    return [(id_of[seq], seq, read) for seq, read in record_reads(keys, list(id_of), tables)]


async def in_segments(transport: Transport, keys: QueueKeys) -> bool:
    """Whether a queue writes its messages in segments (its NEW_START)."""
    [found] = await transport.call_checked([("HEXISTS", keys.meta, s.NEW_START)])
    return bool(found)


def segment_row(message_id: str, rec: s.SegmentRecord, state: s.ClaimState | None) -> r.Row:
    """A segment message as claim upkeep sees a record.py row."""
    group, headers = s.split_extras(rec.extras)
    expires, ttl, due = rec.expires, rec.ttl, rec.due
    claim, claim_expires, count = "", 0, 0
    if state is not None:
        count = state.count
        due = state.due(rec.due)
        if state.claim:
            claim, claim_expires = state.claim, state.claim_expires
        if state.expires > expires:
            expires = state.expires
            ttl = round((expires - rec.created) / 1000)
    return r.Row(
        message_id,
        rec.body,
        ttl,
        rec.created,
        expires,
        rec.seq,
        claim,
        claim_expires,
        count,
        s.author_text(rec.author).encode(),
        due,
        headers=headers or b"",
        group=group or "",
    )


@dataclass(slots=True)
class ClaimRows:
    """The rows of a claim transaction's messages in either layout: the
    older layout's as record.py reads them, the segments' from their
    records (read before, :func:`read_records`) and their watched states."""

    keys: QueueKeys
    records: dict[str, s.SegmentRecord]
    _segment_rows: set[str] = field(default_factory=set)

    def watch(self) -> list[str]:
        return [self.keys.claim_states] if self.records else []

    def reads(self) -> list[Command]:
        """The reads after record.py's read_commands of the same messages."""
        if not self.records:
            return []
        return [("HMGET", self.keys.claim_states, *(c.seq for c in self.records.values()))]

    def rows(self, ids: Sequence[str], replies: Sequence[Any]) -> list[r.Row | None]:
        """The rows of ids from read_commands(ids)'s replies, then reads()'s."""
        found = r.rows(ids, replies)
        if not self.records:
            return found
        raw = replies[2 * len(ids)]
        states = {
            rec.seq: s.ClaimState.decode(v)
            for rec, v in zip(self.records.values(), raw, strict=True)
            if v
        }
        out: list[r.Row | None] = []
        for message_id, row in zip(ids, found, strict=True):
            rec = self.records.get(message_id)
            if row is None and rec is not None:
                self._segment_rows.add(message_id)
                out.append(segment_row(message_id, rec, states.get(rec.seq)))
            else:
                out.append(row)
        return out

    def _state(self, row: r.Row, claim: str, claim_expires: int, count: int) -> list[Command]:
        rec = self.records[row.id]
        extended = row.expires if row.expires > rec.expires else 0
        state = s.ClaimState(claim, claim_expires, count, extended)
        out: list[Command] = [("HSET", self.keys.claim_states, rec.seq, state.encode())]
        if extended:
            k = rec.seq // s.SLOTS
            out.append(("PEXPIREAT", self.keys.segment(k), extended, "GT"))
        return out

    def extend(
        self, row: r.Row, claim_id: str, claim_expires: int, keep: int, ttl: int
    ) -> list[Command]:
        """record.extend_commands, in either layout."""
        if row.id not in self._segment_rows:
            return r.extend_commands(self.keys, row, claim_id, claim_expires, keep, ttl)
        longer = row if keep <= row.expires else dataclasses.replace(row, expires=keep)
        return [
            *self._state(longer, claim_id, claim_expires, row.count),
            ("ZADD", self.keys.claimed, claim_expires, row.id),
        ]

    def release(self, row: r.Row) -> list[Command]:
        """record.release_commands, in either layout."""
        if row.id not in self._segment_rows:
            return r.release_commands(self.keys, row)
        return [*self._state(row, "", 0, row.count), ("ZREM", self.keys.claimed, row.id)]

    def requeue(self, row: r.Row, due: int) -> list[Command]:
        """record.requeue_commands, in either layout (due: in the state)."""
        if row.id not in self._segment_rows:
            return r.requeue_commands(self.keys, row, due)
        return [*self._state(row, "", due, row.count), ("ZREM", self.keys.claimed, row.id)]

    def hold(self, row: r.Row, claim_id: str, claim_expires: int) -> list[Command]:
        """record.hold_commands, in either layout."""
        if row.id not in self._segment_rows:
            return r.hold_commands(self.keys, row, claim_id, claim_expires)
        state = self._state(row, claim_id, claim_expires, row.count)
        return [*state, ("ZADD", self.keys.claimed, claim_expires, row.id)]


def record_rest(row: r.Row) -> bytes:
    """What follows a record's fixed-width header for a row read otherwise
    (an older hash, a segment message): its author line, then its body."""
    return r.author_line(row.author.decode(), row.headers, row.group) + r.NEWLINE + row.body


async def segment_entries(
    transport: Transport, keys: QueueKeys, after: int, end: int, limit: int
) -> list[tuple[str, int]]:
    """(id, seq) of up to limit messages in the queue's segments with seqs
    past after, up to end, in order (present: gone ones are not; expired
    ones may be)."""
    [new_start] = await transport.call_checked([("HGET", keys.meta, s.NEW_START)])
    start = max(after + 1, int(new_start or end + 1))
    tag, out = s.id_tag(keys.prefix), list[tuple[str, int]]()
    k = start // s.SLOTS
    while len(out) < limit and start <= end:
        [found] = await transport.call_checked(
            [("ZRANGE", keys.directory, k, end // s.SLOTS, "BYSCORE", "LIMIT", 0, 4)]
        )
        if not found:
            break
        numbers = [int(n) for n in found]
        tables = await transport.call_checked([s.table_read(keys.segment(n)) for n in numbers])
        for n, table in zip(numbers, tables, strict=True):
            for j, value in enumerate(s.slot_offsets(table)):
                seq = n * s.SLOTS + j
                if start <= seq <= end and value and not value & s.GONE_BIT:
                    out.append((s.message_id(tag, seq), seq))
        k = numbers[-1] + 1
    return out[:limit]


def holder_commands(keys: QueueKeys, message_id: str) -> list[Command]:
    """record.holder_commands, then, for an id that may name a segment
    message, the reads of its holder and slot (for holder() and
    forget_commands): four replies, else two."""
    seq = s.seq_of(s.id_tag(keys.prefix), message_id)
    reads = r.holder_commands(keys, message_id)
    if seq is None:
        return reads
    k, slot = s.segment_of(seq)
    at = slot * s.SLOT_BYTES
    return [
        *reads,
        ("HGET", keys.claim_states, seq),
        ("GETRANGE", keys.segment(k), at, at + s.SLOT_BYTES - 1),
    ]


def holder_keys(keys: QueueKeys, message_id: str) -> list[str]:
    """The keys holder_commands reads (to WATCH)."""
    seq = s.seq_of(s.id_tag(keys.prefix), message_id)
    found = r.message_keys(keys, message_id)
    if seq is None:
        return found
    return [*found, keys.claim_states, keys.segment(seq // s.SLOTS)]


def holder(replies: Sequence[Any]) -> str:
    """The claim id holding a message ('' = none) from holder_commands'
    replies, in either layout."""
    found = r.holder(replies[0], replies[1])
    if found or len(replies) < 4 or replies[2] is None:
        return found
    return s.ClaimState.decode(replies[2]).claim


def forget_commands(
    keys: QueueKeys, message_id: str, replies: Sequence[Any], now: int
) -> list[Command]:
    """The writes that remove a message (given holder_commands' replies), in
    either layout: a segment message's slot is marked gone (_lib.lua's
    segment_gone writes the same; the caller notes the review this
    schedules: SweepSchedule.note_gone)."""
    out = r.forget_commands(keys, [message_id])
    seq = s.seq_of(s.id_tag(keys.prefix), message_id)
    if seq is None or len(replies) < 4 or len(replies[3]) != s.SLOT_BYTES:
        return out
    table = replies[3]
    [value] = s.slot_offsets(table)
    k, slot = s.segment_of(seq)
    out.append(("HDEL", keys.claim_states, seq))
    if value and not value & s.GONE_BIT:
        out += [
            (
                "SETRANGE",
                keys.segment(k),
                slot * s.SLOT_BYTES,
                (value | s.GONE_BIT).to_bytes(4, "big"),
            ),
            ("HINCRBY", keys.meta, s.GONE, 1),
            ("HINCRBY", keys.segment_counts, k, -1),
            ("ZADD", keys.reviews, "LT", now + reviews.DELETE_REVIEW_MS, k),
        ]
    return out


def forget_parked(
    keys: QueueKeys,
    parked: Sequence[r.Parked],
    holders: Sequence[Sequence[Command]],
    replies: Sequence[Any],
    claim_id: str,
    now: int,
) -> tuple[list[Command] | None, None]:
    """The dead letters' forget step (claim_upkeep.py): the parked messages
    still held by claim_id removed, in either layout, given the replies to
    their holder_commands (holders)."""
    held, writes = forget_held(keys, [m.id for m in parked], holders, replies, claim_id, now)
    if not held:
        return None, None
    kept = set(held)
    return writes + groups.forget_commands(
        keys, [(m.id, m.group) for m in parked if m.id in kept]
    ), None


def forget_held(
    keys: QueueKeys,
    ids: Sequence[str],
    holders: Sequence[Sequence[Command]],
    replies: Sequence[Any],
    claim_id: str,
    now: int,
) -> tuple[list[str], list[Command]]:
    """The ids still held by claim_id, given the replies to their
    holder_commands (holders), and the writes that remove them."""
    writes: list[Command] = []
    held = []
    at = 0
    for message_id, reads in zip(ids, holders, strict=True):
        mine = replies[at : at + len(reads)]
        at += len(reads)
        if holder(mine) == claim_id:
            held.append(message_id)
            writes += forget_commands(keys, message_id, mine, now)
    return held, writes


async def live_messages(
    transport: Transport, keys: QueueKeys, ids: Sequence[str], now: int
) -> list[Message | None]:
    """The live messages of ids in either layout (None: gone), as they are
    now (a claim's read)."""
    replies = await transport.call_checked(r.read_commands(keys, ids)) if ids else []
    found = r.live_messages(ids, replies, now)
    tag = s.id_tag(keys.prefix)
    seqs = {i: q for i, m in zip(ids, found, strict=True) if m is None and (q := s.seq_of(tag, i))}
    if seqs:
        # the segments' (a seq below them reads nothing there)
        more = await segment_messages(transport, keys, list(seqs.values()), now)
        found = [m or more.get(seqs.get(i, -1)) for i, m in zip(ids, found, strict=True)]
    return found
