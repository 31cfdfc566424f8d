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
restarted at. So if the page's slots and the next one (all of them written)
read the same before and after, the records between read at their offsets
then. A table that disagrees is kept as read, and the page is read as it
would have been without one (the caller's script or plain reads).

Claim states are read in the same round trip, as ``read_by_commands`` reads
them after the records: a claim that changes between the reads is one the
page could have met either way.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from feedsvc.storage import segments as s
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

    def __len__(self) -> int:
        return len(self._tables)


def table_read(key: str) -> tuple[str, str, int, int]:
    """The command that reads a segment's whole slot table."""
    return ("GETRANGE", key, 0, s.TABLE_BYTES - 1)


def seed_key(keys: QueueKeys, start: int | None, want: int) -> str | None:
    """The segment whose table a read from start (want seqs) should leave
    known for the page after it: the segment of the seq after the page's
    (the next one when this page ends a segment); None: start unknown."""
    if start is None:
        return None
    return keys.segment(s.segment_of(start + want)[0])


def _span(table: bytes, slot: int, want: int) -> list[int]:
    """The offsets (gone bit off) of want slots from slot on and the one after."""
    values = s.slot_offsets(table[slot * s.SLOT_BYTES : (slot + want + 1) * s.SLOT_BYTES])
    return [v & s.OFFSET_MASK for v in values]


async def read_known(
    transport: Transport, tables: KnownTables, keys: QueueKeys, start: int | None, want: int,
    legacy_read: bool, check: int | None,
) -> list[Any] | None:  # fmt: skip
    """read_segments.lua's reply for its common page (from a marker, within
    one segment, with the slot after the page written), read in one round
    trip of plain commands when the segment's table is known; None: read it
    the usual way (the table unknown, or changed: it is known anew)."""
    if start is None or legacy_read:
        return None
    k, slot = s.segment_of(start)
    if slot + want >= s.SLOTS or (check is not None and check > start + want):
        return None
    key = keys.segment(k)
    known = tables.get(key)
    if known is None:
        return None
    span = _span(known, slot, want)
    if not span[0] or not span[-1]:
        return None
    # every written slot's seq: its claim state, if it has one and still lives
    seqs = [start + j for j in range(want) if span[j]]
    commands: list[Any] = [("GETRANGE", key, span[0], span[-1] - 1), table_read(key)]
    commands.append(("HMGET", keys.claim_states, *seqs))
    records, fresh, states = await transport.call_checked(commands, idempotent=True)
    tables.note(key, fresh)
    if not fresh or _span(fresh, slot, want) != span:
        return None
    slots = fresh[slot * s.SLOT_BYTES : (slot + want) * s.SLOT_BYTES]
    # as the script answers it: the seq after the page stands for the counter
    # (given out: its slot is written); one segment read
    reply: list[Any] = [start + want, b"", b"", start + want, 1, start, slots, records]
    gone = {start + j for j, v in enumerate(s.slot_offsets(slots)) if v & s.GONE_BIT}
    for seq, state in zip(seqs, states, strict=True):
        if state is not None and seq not in gone:
            reply += [seq, state]
    return reply
