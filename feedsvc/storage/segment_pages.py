"""A page of a feed in the segment layout: the thin read, filtered here.

``read_segments.lua`` only reads (slots, records, claim states); this module
splits what it answers into messages and applies every filter exactly as
``list.lua`` does for the older layout (expiry against the request's clock,
echo, claims, delay), and computes ``next``, ``next_due``, ``claim_ends``,
``missed`` and ``passed`` the same way, so a page is the same whichever
layout its messages are in. When filters leave a page short it reads again
from where it stopped, up to the scan limit (a page is empty only at the end).

A queue that switched to segments (``segments.NEW_START``) has its older
messages below that seq: a page from a marker there is list.lua's over the
older part, continued here (list.lua answers ``more`` with its counts so
far when it reached the segments with room left on the page).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from feedsvc.errors import TooMuchContention
from feedsvc.storage import record as r
from feedsvc.storage import segments as s
from feedsvc.storage.base import ListQuery, Message, MessagePage, MessageSummary
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.known_tables import KnownTables, seed_key
from feedsvc.storage.transport import Transport

#: reads of records a read makes at most while their segments move
RECORD_READS = 8
#: read_segments.lua's answer to "the older layout first"
LEGACY = b"legacy"
#: list.lua's answer when it reached the segments with room left on the page
MORE = b"more"
AHEAD = b"ahead"

#: (from seq or None = the queue's first, seqs wanted, the older layout read,
#: marker to check or None) -> read_segments.lua's reply
SegmentRead = Callable[[int | None, int, bool, int | None], Awaitable[list[Any]]]


@dataclass(slots=True)
class PageScan:
    """What a page's scan has met so far (list.lua's locals, the same names)."""

    tag: str  # the feed's segments.id_tag
    query: ListQuery
    now: int
    scan_limit: int
    messages: list[Message] = field(default_factory=list)
    scanned: int = 0
    alive: int = 0
    alive_at_message: int = 0
    first_alive: int | None = None
    next_due: int | None = None
    claim_ends: int | None = None
    last: int | None = None  # the last seq looked at
    own: bytes = b""

    def __post_init__(self) -> None:
        self.own = s.author_bytes(self.query.client_id)

    @classmethod
    def after_legacy(
        cls, reply: list[Any], tag: str, query: ListQuery, now: int, limit: int
    ) -> PageScan:
        """list.lua's ``more``: {'more', scanned, last or '', alive, alive at
        the page's last message, first alive or '', next due or '', claim ends
        or '', then id, record...}."""
        scan = cls(tag, query, now, limit, r.listed(reply, 8, now, query.with_authors))
        scan.scanned = int(reply[1])
        scan.last = r.parse_seq(reply[2]) if reply[2] else None
        scan.alive, scan.alive_at_message = int(reply[3]), int(reply[4])
        scan.first_alive = r.parse_seq(reply[5]) if reply[5] else None
        scan.next_due = int(reply[6]) if reply[6] else None
        scan.claim_ends = int(reply[7]) if reply[7] else None
        return scan

    @property
    def full(self) -> bool:
        return len(self.messages) >= self.query.limit or self.scanned >= self.scan_limit

    def look(self, seq: int, raw: bytes | None, state: s.ClaimState | None) -> None:
        """One slot (raw: its record; None: gone), as list.lua looks at an
        index entry; a gone one counts towards the scan limit too (reading
        it was work)."""
        self.scanned += 1
        self.last = seq
        if raw is None:
            return
        now, query = self.now, self.query
        rec = s.SegmentRecord.decode(seq, raw)
        expires = state.expires if state is not None and state.expires else rec.expires
        if expires <= now:
            return
        self.alive += 1
        if self.first_alive is None:
            self.first_alive = seq
        if not query.echo and rec.author == self.own:
            return
        held = state is not None and state.held(now)
        if held:
            assert state is not None
            if self.claim_ends is None or state.claim_expires < self.claim_ends:
                self.claim_ends = state.claim_expires
            if not query.include_claimed:
                return
        due = rec.due if state is None else state.due(rec.due)
        if query.include_delayed or due <= now:
            count = 0 if state is None else state.count
            self.messages.append(
                message(self.tag, rec, expires, state if held else None, query.with_authors, count)
            )
            self.alive_at_message = self.alive
            self.next_due = None  # only those after the page's last message count
        elif due < expires and (self.next_due is None or due < self.next_due):
            self.next_due = due

    def skip_to(self, seq: int) -> None:
        """Seqs up to seq are gone (segments gone whole: no work to pass)."""
        if self.last is None or seq > self.last:
            self.last = seq

    def page(self, marker: int | None, base: int | None, top: int) -> MessagePage:
        """The page, as list.lua ends it."""
        count = len(self.messages)
        out = MessagePage(self.messages, None, None, self.claim_ends)
        upto, met = None, self.alive
        if self.next_due is not None and count > 0:
            upto, met = self.messages[-1].seq, self.alive_at_message
            out.next_marker, out.next_due = upto, self.next_due
        elif self.last is not None and (count > 0 or self.scanned >= self.scan_limit):
            upto = out.next_marker = self.last
        elif self.next_due is not None:
            out.next_due = self.next_due
        if upto is not None and marker is not None:
            start = marker
            if upto - start > met:
                if base is not None and base > start:
                    start = base
                out.missed = max(0, upto - start - met)
        elif (
            self.query.passing
            and marker is not None
            and count == 0
            and self.scanned < self.scan_limit
        ):
            start = max(marker, base) if base is not None else marker
            if self.first_alive is not None:
                passed = max(start, self.first_alive - 1)
            else:
                passed = max(start, top)
            out.missed, out.passed = passed - start, passed
        return out


def message(
    tag: str,
    rec: s.SegmentRecord,
    expires: int,
    held: s.ClaimState | None,
    with_author: bool,
    count: int,
) -> Message:
    """A segment message as read (held: its live claim, if any; count: how
    often it was claimed)."""
    group, headers = s.split_extras(rec.extras)
    created = rec.created
    ttl = rec.ttl if expires == rec.expires else round((expires - created) / 1000)
    return Message(
        s.message_id(tag, rec.seq),
        rec.seq,
        rec.body,
        ttl,
        created,
        held.claim if held is not None else None,
        count,
        s.author_text(rec.author) if with_author else None,
        headers,
        group,
    )


@dataclass(frozen=True, slots=True)
class ReadReply:
    """read_segments.lua's reply, split: every slot read, in seq order."""

    top: int  # the counter; or, not read, a seq at or below it (never below reached)
    base: int | None  # None: not read (the read started at a written seq)
    reached: int  # the first seq not read
    slots: list[tuple[int, bytes | None]]  # (seq, record; None: gone)
    states: dict[int, s.ClaimState]

    @classmethod
    def parse(cls, reply: list[Any]) -> ReadReply:
        slots: list[tuple[int, bytes | None]] = []
        at = 5
        for _ in range(int(reply[4])):
            slots += split_records(int(reply[at]), reply[at + 1], reply[at + 2])
            at += 3
        states = {
            int(reply[i]): s.ClaimState.decode(reply[i + 1]) for i in range(at, len(reply), 2)
        }
        return cls(int(reply[0]), int(reply[1]) if reply[1] else None, int(reply[3]), slots, states)


def split_records(first: int, table: bytes, data: bytes) -> list[tuple[int, bytes | None]]:
    """(seq, record; None: gone) of each slot of a slot table read from seq
    first on, data being the records from the first non-empty slot's offset
    on (a record ends where the next non-empty slot's starts)."""
    values = s.slot_offsets(table)
    offsets = [v & s.OFFSET_MASK for v in values]
    start = next((o for o in offsets if o), 0)
    out: list[tuple[int, bytes | None]] = []
    for j, value in enumerate(values):
        if not value or value & s.GONE_BIT:
            out.append((first + j, None))
            continue
        end = next((o for o in offsets[j + 1 :] if o), None)
        out.append((first + j, data[offsets[j] - start : None if end is None else end - start]))
    return out


async def scan_segments(
    read: SegmentRead,
    scan: PageScan,
    marker: int | None,
    check: int | None,
    legacy_read: bool,
) -> MessagePage | None:
    """Fill scan's page from the segments after marker (or scan.last, where
    the older layout's part stopped): None if the older layout is to be read
    first (read_segments.lua's ``legacy``; never when legacy_read)."""
    start = marker if scan.last is None else max(scan.last, marker or 0)
    base: int | None = None
    top = 0
    # as many seqs as the page has room for: a page short of its limit (a
    # message gone, filtered out) asks again from where this one stopped
    want = scan.query.limit
    while True:
        reply = await read(None if start is None else start + 1, want, legacy_read, check)
        check = None
        if reply[0] == LEGACY:
            return None
        if reply[0] == AHEAD:
            raise MarkerAhead
        got = ReadReply.parse(reply)
        # a read from the marker's next seq, which is a segment message's,
        # may leave the seq base out: the marker is past it, so it changes
        # no count; a read that has it tells it for the rest of the page
        base, top = got.base if got.base is not None else base, got.top
        for seq, raw in got.slots:
            if scan.full:
                break
            scan.look(seq, raw, got.states.get(seq))
        if not scan.full and got.reached - 1 > (start or 0):
            scan.skip_to(got.reached - 1)
        if scan.full or got.reached > top:
            break
        start = got.reached - 1
        # filters left the page short: ask for more at once
        short = scan.query.limit - len(scan.messages)
        want = min(s.SLOTS, 4 * short + 2, max(1, scan.scan_limit - scan.scanned))
    return scan.page(marker, base, top)


class MarkerAhead(Exception):
    """The marker is past anything given out (read_segments.lua's ``ahead``)."""


def record_reads(
    keys: QueueKeys, seqs: list[int], tables: dict[int, bytes]
) -> list[tuple[int, Command]]:
    """(seq, the GETRANGE of its record) per seq whose slot is written and
    not gone, given its segment's slot table."""
    wanted: list[tuple[int, Command]] = []
    for seq in seqs:
        k, slot = s.segment_of(seq)
        values = s.slot_offsets(tables[k])
        if slot >= len(values) or not values[slot] or values[slot] & s.GONE_BIT:
            continue
        end = next((v & s.OFFSET_MASK for v in values[slot + 1 :] if v), 0)
        wanted.append((seq, ("GETRANGE", keys.segment(k), values[slot], end - 1)))
    return wanted


async def segment_messages(
    transport: Transport, keys: QueueKeys, seqs: list[int], now: int
) -> dict[int, Message]:
    """The live segment messages of these seqs (by id: GET .../messages/{id},
    ?ids=): each segment's slot table and their claim states, then their
    records and the tables again. Reads only (a full Redis serves them),
    two round trips: the records are kept if the tables read after them
    put each where it was read (a review rewriting a segment moves its
    records; only then is it read again, at most RECORD_READS times)."""
    numbers = sorted({seq // s.SLOTS for seq in seqs})
    table_reads: list[Command] = [s.table_read(keys.segment(k)) for k in numbers]
    replies = await transport.call_checked(
        [*table_reads, ("HMGET", keys.claim_states, *seqs)], idempotent=True
    )
    tables = dict(zip(numbers, replies, strict=False))
    states = {q: s.ClaimState.decode(v) for q, v in zip(seqs, replies[-1], strict=True) if v}
    for _ in range(RECORD_READS):
        wanted = record_reads(keys, seqs, tables)
        if not wanted:
            return {}
        got = await transport.call_checked([*(c for _, c in wanted), *table_reads], idempotent=True)
        records = got[: len(wanted)]
        tables = dict(zip(numbers, got[len(wanted) :], strict=True))
        # offsets only fall (a review drops records) and a post moves none:
        # the same reads after as before mean the same all along
        if record_reads(keys, seqs, tables) == wanted:
            break
    else:
        raise TooMuchContention(f"Gave up after {RECORD_READS} reads of moving segments; retry.")
    out = {}
    for (seq, _), raw in zip(wanted, records, strict=True):
        if not raw:
            continue  # the segment went meanwhile
        rec = s.SegmentRecord.decode(seq, raw)
        state = states.get(seq)
        expires = state.expires if state is not None and state.expires else rec.expires
        if expires > now:
            held = state if state is not None and state.held(now) else None
            count = state.count if state else 0
            out[seq] = message(s.id_tag(keys.prefix), rec, expires, held, True, count)
    return out


#: segments a stats read looks through for a live message at either end
END_SEGMENTS = 64


async def segment_end(
    transport: Transport, keys: QueueKeys, now: int, reverse: bool
) -> MessageSummary | None:
    """The first live segment message from the head (or the tail), looking
    through END_SEGMENTS segments at most (stats' oldest and newest)."""
    order = ("REV",) if reverse else ()
    for at in range(END_SEGMENTS):
        [found] = await transport.call_checked(
            [("ZRANGE", keys.directory, at, at, *order)], idempotent=True
        )
        if not found:
            return None
        k = int(found[0])
        [table] = await transport.call_checked([s.table_read(keys.segment(k))], idempotent=True)
        values = s.slot_offsets(table)
        live = [(k * s.SLOTS + j, v) for j, v in enumerate(values) if v and not v & s.GONE_BIT]
        if not live:
            continue
        if reverse:
            live.reverse()
        seqs = [seq for seq, _ in live]
        reads: list[Command] = [
            ("GETRANGE", keys.segment(k), v, v + s.AUTHOR_AT - 1) for _, v in live
        ]
        replies = await transport.call_checked(
            [*reads, ("HMGET", keys.claim_states, *seqs)], idempotent=True
        )
        for (seq, _), head, state in zip(live, replies[:-1], replies[-1], strict=True):
            if not head:
                continue
            expires = int(head[: s.EXPIRES_WIDTH])
            ttl = int(head[s.EXPIRES_WIDTH + s.DUE_WIDTH : s.AUTHOR_AT])
            extended = s.ClaimState.decode(state).expires if state else 0
            if (extended or expires) > now:
                return MessageSummary(
                    s.message_id(s.id_tag(keys.prefix), seq), expires - ttl * 1000
                )
    return None


#: attempts of read_by_commands at a segment rewritten between its reads
REREADS = 3


async def read_by_commands(
    transport: Transport, keys: QueueKeys, now: int, start: int | None, want: int,
    legacy_read: bool, check: int | None, tables: KnownTables | None = None,
) -> list[Any]:  # fmt: skip
    """read_segments.lua's reply, read with plain commands (where no script
    runs: deliveries, a driver without scripts), reads only (no MULTI: a
    full Redis refuses one, and a write refused for the memory policy
    would refuse it too). A segment's records are read, then its slot table
    again: a review that rewrote the segment since the first table read
    moved the records after a dropped one to lower offsets (a rewrite only
    ever drops records, and a segment's seqs are never given out again), so
    the table differs and it is read anew; one that dropped only later
    records left these bytes as they were. With tables, the tables read
    are kept there, and the one the page after this needs is read with
    the claim states (known_tables.py)."""
    (new_start, base), counter, legacy = await transport.call_checked(
        [("HMGET", keys.meta, s.NEW_START, r.SEQ_BASE), ("GET", keys.seq), ("EXISTS", keys.index)],
        idempotent=True,
    )
    top = None if counter is None else int(counter)
    if check is not None and check > (top if top is not None else now * 1000):
        return [AHEAD]
    ns = None if new_start is None else int(new_start)
    if not legacy_read and (ns is None or ((start is None or start < ns) and legacy)):
        return [LEGACY]
    out: list[Any] = [top or 0, base or b"", b"" if ns is None else ns, (top or 0) + 1, 0]
    if ns is None or top is None:
        return out
    at = ns if start is None or start < ns else start
    seqs: list[int] = []
    read: set[str] = set()  # the segments whose whole tables were read
    wanted, hops, rereads = want, 0, 0
    while want > 0 and at <= top and hops < 4 and rereads < REREADS:
        k, slot = s.segment_of(at)
        key = keys.segment(k)
        n = min(want, s.SLOTS - slot, top - at + 1)
        # the slots up to the counter's, as read_segments.lua reads them
        last = min(s.SLOTS - 1, slot + top - at)
        slots_read: Command = ("GETRANGE", key, slot * s.SLOT_BYTES, (last + 1) * s.SLOT_BYTES - 1)
        [table] = await transport.call_checked([slots_read], idempotent=True)
        if not table:
            hops += 1
            [after] = await transport.call_checked(
                [("ZRANGE", keys.directory, f"({k}", "+inf", "BYSCORE", "LIMIT", 0, 1)]
            )
            at = int(after[0]) * s.SLOTS if after else top + 1
            continue
        values = s.slot_offsets(table)
        first = next((v & s.OFFSET_MASK for v in values[:n] if v), None)
        records = b""
        if first is not None:
            upto = next((v & s.OFFSET_MASK for v in values[n:] if v), 0) - 1
            # the table again to its end: a post may have appended records
            # since (past the counter read), and the last one here ends
            # where the next slot's record starts, not at the string's end
            records, whole = await transport.call_checked(
                [("GETRANGE", key, first, upto), s.table_read(key)], idempotent=True
            )
            read.add(key)
            if tables is not None:
                tables.note(key, whole)
            again = whole[slot * s.SLOT_BYTES :]
            if again[: len(table)] != table:
                rereads += 1
                continue
            if upto < 0:
                after = s.slot_offsets(again[n * s.SLOT_BYTES :])
                end = next((v & s.OFFSET_MASK for v in after if v), None)
                records = records if end is None else records[: end - first]
        out += [at, table[: n * s.SLOT_BYTES], records]
        out[4] += 1
        seqs += [at + j for j, v in enumerate(values[:n]) if v and not v & s.GONE_BIT]
        want -= n
        at += n
    out[3] = min(at, top + 1)
    seed = None if tables is None else seed_key(keys, start, wanted)
    if seed is not None and seed in read:
        seed = None  # read above, and known already
    if seqs:
        reads: list[Command] = [("HMGET", keys.claim_states, *seqs)]
        replies = await transport.call_checked(
            reads + ([s.table_read(seed)] if seed is not None else []), idempotent=True
        )
        if tables is not None and seed is not None:
            tables.note(seed, replies[1])
        out += [x for seq, v in zip(seqs, replies[0], strict=True) if v for x in (seq, v)]
    return out


async def messages_from(
    transport: Transport, keys: QueueKeys, start: int, limit: int, now: int
) -> list[tuple[int, Message | None]]:
    """The segment messages from seq start on, up to limit seqs (a delivery's
    batch): (seq, the message; None: gone or expired), in seq order."""
    reply = await read_by_commands(transport, keys, now, start, limit, True, None)
    got, tag = ReadReply.parse(reply), s.id_tag(keys.prefix)
    out: list[tuple[int, Message | None]] = []
    for seq, raw in got.slots:
        if raw is None:
            out.append((seq, None))
            continue
        rec = s.SegmentRecord.decode(seq, raw)
        state = got.states.get(seq)
        expires = state.expires if state is not None and state.expires else rec.expires
        held = state if state is not None and state.held(now) else None
        count = 0 if state is None else state.count
        alive = expires > now
        out.append((seq, message(tag, rec, expires, held, True, count) if alive else None))
    return out
