"""A reader's next page in one round trip of plain reads: the slot tables this process read last.

A page from a marker within one segment needs the segment's slots for its
seqs and the slot after them, then the records those slots point to: two
reads, the second depending on the first, which is why ``read_segments.lua``
runs them in Redis. But a reader pages on from where it stopped, and the
slot table that told this process where the last page's records were
already says where the next page's are. So each segment's table is kept
here when it is read (``KnownTables``), and a page whose slots the table
knows is read with plain commands in one round trip (``read_known``): the
records where the known table says, the table anew, the claim states of
its seqs. Redis runs no script for it, which costs its single thread less
than the script does (docs/design-compact-storage.md, "Pages by plain
reads"); both drivers read this way.

Why a known table may be trusted when the fresh one read after the records
agrees with it (offsets compared without the gone bit): a table only ever
changes in these ways, and each one that moves a record changes the slots
compared. A post fills slots that were zero (past the page's next slot: not
compared; a written slot is never written again). A delete sets a slot's
gone bit and moves nothing. A review rewrites the segment without its
dropped records, each kept one at a lower offset if a record before it was
dropped, and a dropped one's slot zero; a rewrite never brings a record
back, so a table that differed once never agrees again. A segment gone
whole and made again by a later post has zero slots below the counter it
restarted at. So if the page's slots and the next one (all of them written
when the table was known: given out, a zero there stays zero) read the same
before and after, the records between read at their offsets then. A table
that disagrees is kept as read, and the page is read as it would have been
without one (the caller's script or plain reads).

A page that reaches its segment's end has no next slot there: its records
are read to the segment's end, which is final once the page's next seq (in
the next segment) was given out, as the next segment's known table says.
But a table known from while the segment was open has zeros past its
counter then, and those slots can be written, deleted and dropped by a
review since, reading zero again: a review between the records read and the
table read would pass the comparison with the dropped records' bytes read
at the end. So that segment's length is read after its table too, and the
page is trusted only if its records ended at that length (a rewrite only
shortens a segment, and nothing is appended to a closed one).

Claim states are read in the same round trip, as ``read_by_commands`` reads
them after the records: a claim that changes between the reads is one the
page could have met either way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from feedsvc.storage import segments as s
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.transport import Transport

#: segment tables one process keeps (≈ 0.5 KiB each with the key): a reader
#: paging through a backlog needs one at a time, so this many readers of
#: different segments page on without a script before the oldest is forgotten
KNOWN_TABLES = 4096


class KnownTables:
    """The slot tables of the segments this process read last, by segment
    key, least recently used forgotten first."""

    def __init__(self, most: int = KNOWN_TABLES) -> None:
        self._tables: OrderedDict[str, bytes] = OrderedDict()
        self._most = most

    def get(self, key: str) -> bytes | None:
        table = self._tables.get(key)
        if table is not None:
            self._tables.move_to_end(key)
        return table

    def note(self, key: str, table: Any) -> None:
        """A segment's whole slot table as just read (b"" or an error: the
        segment is gone, or the read failed; nothing is kept)."""
        if isinstance(table, bytes) and len(table) == s.TABLE_BYTES:
            self._tables[key] = table
            self._tables.move_to_end(key)
            if len(self._tables) > self._most:
                self._tables.popitem(last=False)
        else:
            self._tables.pop(key, None)


def seed_key(keys: QueueKeys, start: int | None, want: int) -> str | None:
    """The segment whose table a read from start (want seqs) should leave
    known for the page after it: the segment of the seq after the page's
    (the next one when this page ends a segment); None: start unknown."""
    if start is None:
        return None
    return keys.segment(s.segment_of(start + want)[0])


def _offsets(table: bytes, first: int, last: int) -> list[int]:
    """The offsets (gone bit off) of a table's slots first to last."""
    values = s.slot_offsets(table[first * s.SLOT_BYTES : (last + 1) * s.SLOT_BYTES])
    return [v & s.OFFSET_MASK for v in values]


@dataclass(frozen=True, slots=True)
class Part:
    """A page's seqs in one segment, its slots first to last (none when
    last < first), and the offsets it is checked by, as known: those slots'
    and, when the page's next seq is in the same segment, that one's."""

    key: str
    base: int  # the segment's first seq
    first: int
    last: int
    checked: list[int]

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def records_read(self) -> Command | None:
        """The read of its records: from its first written slot's offset to
        where the next written slot's record begins, or, with no slot of its
        own after them, to the segment's end (its segment is closed: a later
        seq was given out); None: none of its slots is written."""
        written = [o for o in self.checked[: self.count] if o]
        if not written:
            return None
        upto = self.checked[-1] - 1 if len(self.checked) > self.count else -1
        return ("GETRANGE", self.key, written[0], upto)

    def seqs(self) -> list[int]:
        """The seqs of its written slots."""
        return [self.base + self.first + j for j in range(self.count) if self.checked[j]]

    def slots(self, table: bytes) -> bytes:
        return table[self.first * s.SLOT_BYTES : (self.last + 1) * s.SLOT_BYTES]


def _parts(known: dict[str, bytes], keys: QueueKeys, start: int, want: int) -> list[Part]:
    """The parts of the page of want seqs from start, as the tables in known
    lay them out: its segment's, or, when it reaches that one's end, also the
    next segment's (up to the slot of the seq after the page)."""
    k, slot = s.segment_of(start)
    k_after, slot_after = s.segment_of(start + want)
    key, key_after = keys.segment(k), keys.segment(k_after)
    if k_after == k:
        return [Part(key, k * s.SLOTS, slot, slot_after - 1,
                     _offsets(known[key], slot, slot_after))]  # fmt: skip
    return [
        Part(key, k * s.SLOTS, slot, s.SLOTS - 1, _offsets(known[key], slot, s.SLOTS - 1)),
        Part(key_after, k_after * s.SLOTS, 0, slot_after - 1,
             _offsets(known[key_after], 0, slot_after)),
    ]  # fmt: skip


async def read_known(
    transport: Transport, tables: KnownTables, keys: QueueKeys, start: int | None, want: int,
    legacy_read: bool, check: int | None,
) -> list[Any] | None:  # fmt: skip
    """read_segments.lua's reply for its common page (from a marker, with the
    seq after the page written: in the page's segment or, when the page
    reaches that one's end, in the next), read in one round trip of plain
    commands when the tables of the segments it reads are known; None: read
    it the usual way (a table unknown, or changed: it is known anew). The
    round trip also reads the table the page after this one will need, if it
    is not known yet."""
    if start is None or legacy_read or want > s.SLOTS:
        return None
    if check is not None and check > start + want:
        return None
    known: dict[str, bytes] = {}
    for seq in (start, start + want):
        key = keys.segment(s.segment_of(seq)[0])
        table = tables.get(key)
        if table is None:
            return None
        known[key] = table
    parts = _parts(known, keys, start, want)
    if not parts[0].checked[0] or not parts[-1].checked[-1]:
        return None
    reads = [part.records_read() for part in parts]
    seqs = [seq for part in parts for seq in part.seqs()]
    ahead = keys.segment(s.segment_of(start + 2 * want)[0])
    fresh_keys = [*known, *([ahead] if tables.get(ahead) is None else [])]
    sent = [read for read in reads if read is not None]
    # a part read to its segment's end: that segment's length after its
    # table, to see that the end read was still the end (module docstring)
    ends = [i for i, read in enumerate(sent) if read[3] == -1]
    commands: list[Command] = [*sent, *(s.table_read(key) for key in fresh_keys)]
    commands += [("STRLEN", sent[i][1]) for i in ends]
    if seqs:
        commands.append(("HMGET", keys.claim_states, *seqs))
    replies = iter(await transport.call_checked(commands, idempotent=True))
    got = [next(replies) for _ in sent]
    fresh = {key: next(replies) for key in fresh_keys}
    lengths = [next(replies) for _ in ends]
    states = next(replies) if seqs else []
    for key, table in fresh.items():
        tables.note(key, table)
    if not all(fresh[key] for key in known) or _parts(fresh, keys, start, want) != parts:
        return None
    for i, length in zip(ends, lengths, strict=True):
        if sent[i][2] + len(got[i]) != length:
            return None  # rewritten since its records were read
    records = iter(got)
    # as the script answers it: the seq after the page stands for the
    # counter (given out: its slot is written)
    reply: list[Any] = [start + want, b"", b"", start + want, 0]
    gone: set[int] = set()
    for part, read in zip(parts, reads, strict=True):
        if part.count == 0:
            continue  # the page ends where its segment does
        slots, first = part.slots(fresh[part.key]), part.base + part.first
        reply += [first, slots, b"" if read is None else next(records)]
        reply[4] += 1
        gone |= {first + j for j, v in enumerate(s.slot_offsets(slots)) if v & s.GONE_BIT}
    for seq, state in zip(seqs, states, strict=True):
        if state is not None and seq not in gone:
            reply += [seq, state]
    return reply
