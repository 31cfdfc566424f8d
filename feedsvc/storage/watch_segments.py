"""The watch drivers' side of the segment layout (storage/segments.py).

The same keys and records as the lua driver's (``post_segments.lua``,
``read_segments.lua``), written and read through WATCH / MULTI / EXEC and
plain reads, so a queue written by one driver is read by the other.

Post: a record's slot holds its offset in the segment string, which is the
string's length before the record is appended; a transaction cannot read
inside MULTI, so the length is read under WATCH beforehand. The WATCH
covers ``Q:seq`` (every post changes it), ``Q:q`` (every writer of a
segment's layout writes it, so a WATCH on it guards them) and the segment
strings the offsets are computed from. Which segments those are depends on
the counter, so the transaction WATCHes the segments of the seqs it
expects (the counter this process saw last, or read once first); if the
counter read under WATCH differs, the attempt is a conflict and the next
one WATCHes where the counter is now. Records are written in the
transaction by both drivers (the tuned one's bodies-ahead split needs a
key per body; a record's place is only known under WATCH); the tuned
driver still indexes a burst of posts to a queue in one transaction.

Read: ``read`` answers what ``read_segments.lua`` answers, from plain
reads (``segment_pages.read_by_commands``); ``segment_pages.py`` filters it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from feedsvc.clock import Clock
from feedsvc.config import StoreSettings
from feedsvc.errors import FeedError, PostTooLarge, QueueFull
from feedsvc.storage import record as r
from feedsvc.storage import reviews, segment_claims
from feedsvc.storage import segments as seg
from feedsvc.storage.base import ListQuery, MessagePage
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import GROUP_ENTRY, Kind, QueueKeys
from feedsvc.storage.known_tables import KnownTables, read_known
from feedsvc.storage.optimistic import Conflicted, Plan
from feedsvc.storage.sealing import MustSeal
from feedsvc.storage.segment_pages import PageScan, ReadReply, read_by_commands, scan_segments
from feedsvc.storage.segment_writes import SegmentAppend, append_commands
from feedsvc.storage.sweep_schedule import SweepSchedule
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_posting import Posting
from feedsvc.storage.watch_sweep import expired_unswept, soon_read, unswept_reads

log = logging.getLogger("feedsvc")

#: What a post comes to: its message ids, or the exception its request gets.
Outcome = list[str] | Exception
#: expired older-layout messages a post forgets on the way (as post.lua)
GC_BATCH = 100
#: segments a queue's deletion or purge drops a transaction (as drop_queue.lua)
DROP_SEGMENTS = 100
#: the queue hash fields a post reads, in this order
POST_FIELDS = (
    seg.NEW_START,
    r.ENCRYPTED,
    r.DEFAULT_TTL,
    r.DEFAULT_DELAY,
    r.MAX_POST_SIZE,
    r.MAX_MESSAGES,
    r.GROUPS_SINCE,
    r.CREATED,
    seg.GONE,
    reviews.REVIEW_FROM,
    seg.LEGACY_GONE,
)


def segment_keys(keys: QueueKeys) -> list[str]:
    """A queue's keys of the layout besides its segments (dropped with it)."""
    return [keys.directory, keys.claim_states, keys.reviews, keys.segment_counts]


@dataclass(frozen=True, slots=True)
class Expected:
    """The segments a post of `count` messages after the counter `top` writes
    to: the first one, read whole if the post fills it and goes on (it is
    closed, written anew at its size) else only its length; or, when the
    post starts a segment, the one before, read whole to close it."""

    counter: int | None  # Q:seq as expected (None: none yet)
    count: int
    now: int

    @property
    def top(self) -> int:
        """The seq the post's first message follows: the counter, or where
        the first post starts it (now in microseconds, as post.lua)."""
        return self.now * 1000 if self.counter is None else self.counter

    @property
    def first(self) -> tuple[int, int]:
        return seg.segment_of(self.top + 1)

    @property
    def last(self) -> int:
        return (self.top + self.count) // seg.SLOTS

    def reads(self, keys: QueueKeys) -> list[tuple[int, Command]]:
        k, slot = self.first
        if slot == 0:
            return [] if k == 0 else [(k - 1, ("GET", keys.segment(k - 1)))]
        if self.last > k:
            return [(k, ("GET", keys.segment(k)))]
        return [(k, ("STRLEN", keys.segment(k)))]


@dataclass(slots=True)
class Unswept:
    """The survey of a post near its queue's _max_messages: the segments
    reviewed within reviews.SPREAD_MS (watch_sweep.soon_read), read under
    the transaction's WATCH with what watch_sweep.expired_unswept counts
    (post_segments.lua's expired_unswept). soon: those segments as last
    read (None: not yet; wanted: a plan needs them)."""

    soon: list[int] | None = None
    wanted: bool = False

    def watch(self, keys: QueueKeys) -> list[str]:
        if self.soon is None:
            return []
        numbers = (keys.segment(k) for k in self.soon)
        return [keys.reviews, keys.claim_states, keys.segment_counts, *numbers]

    def reads(self, keys: QueueKeys, now: int) -> list[Command]:
        if self.soon is None:
            return []
        return [soon_read(keys, now), *unswept_reads(keys, self.soon)]

    def count(self, replies: Sequence[Any], now: int) -> int:
        """The expired messages not yet swept, from reads()' replies;
        Conflicted if they are not read, or the segments read moved."""
        if self.soon is None:
            self.wanted = True
            raise Conflicted
        soon = [int(k) for k in replies[0]]
        if soon != self.soon:
            self.soon = soon
            raise Conflicted
        return expired_unswept(soon, replies[1:], now)


def post_plan(
    postings: list[Posting],
    expected: Expected,
    now: int,
    settings: StoreSettings,
    may_switch: bool,
    grouping: bool,
    refusals: tuple[Callable[[str, bytes], PostTooLarge], Callable[[str, bytes], QueueFull]],
    learned: dict[str, int | None],
    unswept: Unswept,
) -> Plan[list[Outcome] | None]:
    """The transaction of postings to one queue in segments (replies to
    WatchSegments.post_reads), each checked on its own as post_segments.lua
    checks a post. None: the queue has no segments and may not start them.
    learned["counter"]: the counter as this attempt read it, or as it left it.
    Near the queue's _max_messages the expired messages not yet swept are
    counted out (unswept: their survey, read last)."""
    keys = postings[0].keys
    tag = seg.id_tag(keys.prefix)
    tokens = [p.token for p in postings if p.token is not None]
    too_large, full = refusals

    def plan(replies: list[Any]) -> tuple[list[Command] | None, list[Outcome] | None]:
        _, last, q, legacy_live, dead = replies[:5]
        ns, encrypted, dttl, ddelay, mps, most, groups_since, created, gone, tmin, lg = q
        if ns is None and not may_switch:
            return None, None
        counter = learned["counter"] = None if last is None else int(last)
        if counter != expected.counter:
            raise Conflicted  # the segments WATCHed may not be the ones written
        seen = dict(zip(tokens, replies[5 : 5 + len(tokens)], strict=True))
        forget: list[Any] = []
        if tokens:
            forget = [
                f for f, v in r.pairs(replies[5 + len(tokens)]) if int(r.text(v).split()[0]) <= now
            ]
        at = 5 + len(tokens) + (1 if tokens else 0)
        numbers = [k for k, _ in expected.reads(keys)]
        segment_reads = dict(zip(numbers, replies[at : at + len(numbers)], strict=True))
        surveyed = replies[at + len(numbers) :]
        counted_out = ns is None  # the first post in segments has none to count out
        top = expected.top
        live = seg.live_count([legacy_live, [ns, gone], last])
        default_ttl = int(dttl or settings.default_message_ttl)
        default_delay = int(ddelay or 0)
        writes: list[Command] = []
        # the older layout's messages and claims, while it may have any
        legacy_gone = lg is not None
        if not legacy_gone:
            writes += r.forget_commands(keys, dead[:GC_BATCH]) if dead else []
            writes.append(("ZREMRANGEBYSCORE", keys.claimed, "-inf", now))
            writes.append(("ZREMRANGEBYSCORE", keys.claims, "-inf", now))
            # Q:exp is empty once this batch goes (read one past it to know)
            legacy_gone = not int(legacy_live) and len(dead) <= GC_BATCH
        if counter is None:  # where the counter starts (see list.lua's missed)
            writes.append(("HSET", keys.meta, r.SEQ_BASE, top))
        if created is None:
            writes.append(("HSET", keys.meta, r.CREATED, now))
        gone_mark = (seg.LEGACY_GONE, "1") if legacy_gone and lg is None else ()
        if ns is None:  # from here on, the queue's messages are in segments
            writes.append(("HSET", keys.meta, seg.NEW_START, top + 1, *gone_mark))
        elif gone_mark:  # Q:exp never gains a member again: the post stops looking
            writes.append(("HSET", keys.meta, *gone_mark))
        author_of: dict[str, bytes] = {}
        outcomes: list[Outcome] = []
        this_batch: dict[str, list[str]] = {}
        segments: dict[int, SegmentAppend] = {}
        seq, first_due = top, 0
        since = None if groups_since is None else int(groups_since)
        for posting in postings:
            token = posting.token
            try:
                replay = posting.replay_or_refuse(encrypted, mps, too_large, this_batch, seen, now)
                if replay is not None:
                    outcomes.append(replay)
                    continue
                if most is not None and live + len(posting.messages) > int(most):
                    if not counted_out:  # near the limit: less the expired, unswept
                        live -= unswept.count(surveyed, now)
                        counted_out = True
                    if live + len(posting.messages) > int(most):
                        raise full(posting.queue, most)
            except (MustSeal, PostTooLarge, QueueFull) as refused:
                outcomes.append(refused)
                continue
            author = author_of.setdefault(posting.client_id, seg.author_bytes(posting.client_id))
            ids: list[str] = []
            for message in posting.messages:
                seq += 1
                ttl = default_ttl if message.ttl is None else message.ttl
                delay = default_delay if message.delay is None else message.delay
                expires = now + ttl * 1000
                due = now + delay * 1000 if delay > 0 else 0
                extras = seg.extras(message.group, message.headers)
                k, slot = seg.segment_of(seq)
                record = seg.encode_record(expires, due, ttl, author, extras, message.body)
                segments.setdefault(k, SegmentAppend(k, slot)).add(record, expires)
                message_id = seg.message_id(tag, seq)
                ids.append(message_id)
                group = message.group if grouping else ""
                if group:
                    if since is None:
                        since = seq
                        writes.append(("HSET", keys.meta, r.GROUPS_SINCE, seq))
                    writes.append(("ZADD", keys.group(group), seq, message_id))
                    writes.append(("ZADD", keys.claim_index, "NX", seq, GROUP_ENTRY + group))
                elif since is not None:
                    writes.append(("ZADD", keys.claim_index, seq, message_id))
                if due and (not first_due or due < first_due):
                    first_due = due
            if token is not None:
                until = now + settings.idempotency_window * 1000
                writes.append(("HSET", keys.idempotency, token, f"{until} {' '.join(ids)}"))
                this_batch[token] = ids
            outcomes.append(ids)
            live += len(ids)
        writes += [
            ("ZREM", p.held.key, p.held.member) for p in postings if p.held and p.held.in_script
        ]
        if forget:
            writes.append(("HDEL", keys.idempotency, *forget))
        if not segments:
            return writes, outcomes
        appended, review = append_commands(
            keys, segments, segment_reads, None if tmin is None else int(tmin)
        )
        writes += appended
        if review is not None:
            learned["review"] = review
        writes.append(("SET", keys.seq, seq))
        # in the transaction: followers hear of it exactly when it is visible
        writes.append(("SPUBLISH", keys.feed, r.notification(seq, first_due)))
        learned["counter"] = seq
        return writes, outcomes

    return plan


@dataclass(frozen=True, slots=True)
class Forgetting:
    """Deleting messages by id in either layout, in a transaction: the ids
    of segment messages (seqs) have their slots read under WATCH, and are
    marked gone as _lib.lua's segment_gone marks them."""

    keys: QueueKeys
    ids: list[str]
    seqs: dict[str, int]  # id -> seq of the segment messages among ids
    records: dict[str, seg.SegmentRecord]  # theirs, when read

    def watch(self) -> list[str]:
        if not self.seqs:
            return []
        numbers = dict.fromkeys(q // seg.SLOTS for q in self.seqs.values())
        return [self.keys.claim_states, *(self.keys.segment(k) for k in numbers)]

    def reads(self) -> list[Command]:
        """Per segment message its claim state and its slot."""
        out: list[Command] = []
        for seq in self.seqs.values():
            at = seq % seg.SLOTS * seg.SLOT_BYTES
            out.append(("HGET", self.keys.claim_states, seq))
            out.append(("GETRANGE", self.keys.segment(seq // seg.SLOTS), at, at + 3))
        return out

    def row(self, message_id: str, replies: Sequence[Any]) -> r.Row | None:
        """A segment message as claim upkeep sees it (None: not one, or gone)."""
        rec = self.records.get(message_id)
        if rec is None:
            return None
        n = list(self.seqs).index(message_id)
        state, slot = replies[2 * n], replies[2 * n + 1]
        [value] = seg.slot_offsets(slot) if len(slot) == seg.SLOT_BYTES else [0]
        if not value or value & seg.GONE_BIT:
            return None
        found = None if state is None else seg.ClaimState.decode(state)
        return segment_claims.segment_row(message_id, rec, found)

    def writes(self, replies: Sequence[Any], now: int) -> list[Command]:
        """The deletes, given reads()' replies."""
        older = [i for i in self.ids if i not in self.seqs]
        out = r.forget_commands(self.keys, older) if older else []
        for n, message_id in enumerate(self.seqs):
            held = [None, None, *replies[2 * n : 2 * n + 2]]
            out += segment_claims.forget_commands(self.keys, message_id, held, now)
        return out


class WatchSegments:
    """The segment layout through WATCH / MULTI / EXEC: posts, and the thin
    read of pages (one per store; the counters it expects per queue are
    what this process saw last)."""

    def __init__(
        self,
        transport: Transport,
        settings: StoreSettings,
        clock: Clock,
        refusals: tuple[Callable[[str, bytes], PostTooLarge], Callable[[str, bytes], QueueFull]],
        sweeps: SweepSchedule,
        kind: Kind,
    ) -> None:
        self._sweeps, self._kind = sweeps, kind
        self.transport, self._transport = transport, transport
        self._settings, self._clock = settings, clock
        self._refusals = refusals
        self._counters: dict[str, int | None] = {}
        self._tables = KnownTables()

    async def post(
        self, postings: list[Posting], registry: Command, may_switch: bool, grouping: bool
    ) -> list[Outcome] | None:
        """Index the postings (all to one queue) in segments, in one
        optimistic transaction; None: the queue has no segments and may not
        start them (nothing was done). registry: the first read (listing
        the queue in its project's registry, or a PING)."""
        keys = postings[0].keys
        transport = self._transport
        count = sum(len(p.messages) for p in postings)
        tokens = [p.token for p in postings if p.token is not None]
        if keys.prefix not in self._counters:
            [counter] = await transport.call_checked([("GET", keys.seq)])
            self._remember(keys, None if counter is None else int(counter))
        attempt, unswept = 0, Unswept()
        async with transport.transactions.write_slot():
            while True:
                now = self._clock.now_ms()
                expected = Expected(self._counters.get(keys.prefix), count, now)
                learned: dict[str, int | None] = {"counter": expected.counter}
                plan = post_plan(
                    postings, expected, now, self._settings, may_switch, grouping,
                    self._refusals, learned, unswept,
                )  # fmt: skip
                reads: list[Command] = [
                    registry,
                    ("GET", keys.seq),
                    ("HMGET", keys.meta, *POST_FIELDS),
                    ("ZCOUNT", keys.expiry, f"({now}", "+inf"),
                    ("ZRANGEBYSCORE", keys.expiry, "-inf", now, "LIMIT", 0, GC_BATCH + 1),
                ]
                watch = [keys.seq, keys.meta]
                if tokens:
                    reads += [("HGET", keys.idempotency, token) for token in tokens]
                    reads.append(("HRANDFIELD", keys.idempotency, 5, "WITHVALUES"))
                    watch.append(keys.idempotency)
                for k, read in expected.reads(keys):
                    reads.append(read)
                    watch.append(keys.segment(k))
                reads += unswept.reads(keys, now)
                watch += unswept.watch(keys)
                done, outcomes = await transport.transactions.attempt(watch, reads, plan)
                self._remember(keys, learned["counter"])
                if done:
                    if (when := learned.get("review")) is not None:
                        await self.note_review(postings[0].project, postings[0].queue, when)
                    return outcomes
                if unswept.wanted:  # near the limit: where the survey looks, then again
                    unswept.wanted = False
                    [soon] = await transport.call_checked([soon_read(keys, now)])
                    unswept.soon = [int(k) for k in soon]
                    continue
                await transport.transactions.backoff(attempt)
                attempt += 1

    async def forgetting(
        self, keys: QueueKeys, ids: list[str], with_records: bool = False
    ) -> Forgetting:
        """What deleting ids takes: those that name segment messages of the
        queue (segments.seq_of, from its NEW_START on), with their records
        if asked (to judge their claims). Reads nothing for ids of the
        older layout."""
        tag = seg.id_tag(keys.prefix)
        if not any(seg.seq_of(tag, i) is not None for i in ids):
            return Forgetting(keys, ids, {}, {})
        if with_records:
            records = await segment_claims.read_records(self._transport, keys, ids)
            return Forgetting(keys, ids, {i: rec.seq for i, rec in records.items()}, records)
        [ns] = await self._transport.call_checked([("HGET", keys.meta, seg.NEW_START)])
        seqs = {
            i: q
            for i in ids
            if ns is not None and (q := seg.seq_of(tag, i)) is not None and q >= int(ns)
        }
        return Forgetting(keys, ids, seqs, {})

    async def drop(self, keys: QueueKeys) -> None:
        """Delete a queue's segments, DROP_SEGMENTS at a time (as drop_queue.lua)."""
        transport = self._transport
        while True:
            [numbers] = await transport.call_checked(
                [("ZRANGE", keys.directory, 0, DROP_SEGMENTS - 1)]
            )
            if not numbers:
                return
            await transport.transaction(
                [
                    ("DEL", *(keys.segment(int(k)) for k in numbers)),
                    ("ZREM", keys.directory, *numbers),
                ]
            )

    async def purged(self, keys: QueueKeys) -> None:
        """A purged queue in segments stays in them: every seq so far is gone,
        and claims start past them (as drop_queue.lua)."""

        def plan(replies: list[Any]) -> tuple[list[Command] | None, None]:
            ns, top = replies[0], replies[1]
            if ns is None or top is None:
                return None, None
            gone = max(0, int(top) - int(ns) + 1)
            return [("HSET", keys.meta, seg.GONE, gone, seg.CLAIM_HEAD, int(top) + 1)], None

        reads: list[Command] = [("HGET", keys.meta, seg.NEW_START), ("GET", keys.seq)]
        await self._transport.transactions.optimistic([keys.meta, keys.seq], reads, plan)

    async def note_review(self, project: str, queue: str, when: int) -> None:
        """A write scheduled a review of the queue's segments (reviews.py):
        noted in fs:sweep (as LuaSegments.note_review). The write is done: a
        failure here only delays the review until the sweep finds it."""
        try:
            await self._sweeps.note(self._kind, project, queue, when)
        except FeedError as exc:
            log.warning("a segment review of %s/%s waits: %s", project, queue, exc)

    def _remember(self, keys: QueueKeys, counter: int | None) -> None:
        if len(self._counters) >= 10_000:
            self._counters.clear()
        self._counters[keys.prefix] = counter

    async def read(
        self, keys: QueueKeys, now: int, start: int | None, want: int, legacy_read: bool,
        check: int | None,
    ) -> list[Any]:  # fmt: skip
        """What read_segments.lua answers (segment_pages.SegmentRead), read
        with plain commands: in one round trip where the segment's slot
        table is known (known_tables.py), else segment_pages.read_by_commands."""
        known = await read_known(
            self._transport, self._tables, keys, start, want, legacy_read, check
        )
        if known is not None:
            return known
        return await read_by_commands(
            self._transport, keys, now, start, want, legacy_read, check, self._tables
        )

    async def page(self, keys: QueueKeys, query: ListQuery, now: int) -> MessagePage | None:
        """A page read from the segments; None: the older layout first."""
        read = functools.partial(self.read, keys, now)
        check = query.marker if query.check_marker else None
        scan = PageScan(seg.id_tag(keys.prefix), query, now, self._settings.scan_limit)
        return await scan_segments(read, scan, query.marker, check, False)

    async def carry_on(self, keys: QueueKeys, scan: PageScan, query: ListQuery) -> MessagePage:
        """A page begun in the older layout, carried on in the segments."""
        read = functools.partial(self.read, keys, scan.now)
        page = await scan_segments(read, scan, query.marker, None, True)
        assert page is not None
        return page


@dataclass(slots=True)
class Taking:
    """A claim's or a pop's transaction over candidates in either layout:
    the older layout's rows as record.py reads them, the segments' from
    their records (read while choosing) with their claim states and slots
    read under WATCH (a slot marked gone meanwhile makes the row None)."""

    keys: QueueKeys
    candidates: list[str]
    records: dict[str, seg.SegmentRecord]
    forgetting: Forgetting = field(init=False)
    view: segment_claims.ClaimRows = field(init=False)

    def __post_init__(self) -> None:
        seqs = {i: rec.seq for i, rec in self.records.items()}
        self.forgetting = Forgetting(self.keys, self.candidates, seqs, self.records)
        self.view = segment_claims.ClaimRows(self.keys, self.records)

    def watch(self) -> list[str]:
        older = (i for i in self.candidates if i not in self.records)
        return [*(k for i in older for k in r.message_keys(self.keys, i)), *self.forgetting.watch()]

    def reads(self) -> list[Command]:
        return [*r.read_commands(self.keys, self.candidates), *self.forgetting.reads()]

    def rows(self, replies: Sequence[Any]) -> list[r.Row | None]:
        """The candidates' rows from reads()' replies."""
        n = 2 * len(self.candidates)
        mine = replies[n:]
        states = [mine[2 * j] for j in range(len(self.records))]
        rows = self.view.rows(self.candidates, [*replies[:n], states])
        return [
            row if row is None or row.id not in self.records or self.forgetting.row(row.id, mine)
            else None
            for row in rows
        ]  # fmt: skip

    def extend(
        self, row: r.Row, claim_id: str, claim_expires: int, keep: int, ttl: int, count: int
    ) -> list[Command]:
        """record.extend_commands with a new claim count, in either layout."""
        if row.id not in self.records:
            return r.extend_commands(self.keys, row, claim_id, claim_expires, keep, ttl, count)
        counted = dataclasses.replace(row, count=count)
        return self.view.extend(counted, claim_id, claim_expires, keep, ttl)

    def hold(self, row: r.Row, claim_id: str, claim_expires: int) -> list[Command]:
        """record.hold_commands, in either layout."""
        if row.id not in self.records:
            return r.hold_commands(self.keys, row, claim_id, claim_expires)
        return self.view.extend(row, claim_id, claim_expires, row.expires, row.ttl)

    def forget(self, replies: Sequence[Any], now: int) -> list[Command]:
        """The candidates removed (a pop), given reads()' replies."""
        return self.forgetting.writes(replies[2 * len(self.candidates) :], now)


@dataclass(slots=True)
class Walk:
    """A claim's or a pop's walk of the segments, from the queue's claim
    head (segments.CLAIM_HEAD) on: rows in seq order, a batch a read."""

    low: int  # where it began
    head: int  # every seq before it is gone for good (deleted, popped, expired)
    dead: bool = True  # all walked so far is
    records: dict[str, seg.SegmentRecord] = field(default_factory=dict)

    def tidy(self, keys: QueueKeys) -> list[Command]:
        """The claim head moved on, if the walk found it could."""
        return [("HSET", keys.meta, seg.CLAIM_HEAD, self.head)] if self.head > self.low else []


async def walk_segments(
    segments: WatchSegments, keys: QueueKeys, now: int, want: int, high: int | None = None
) -> AsyncIterator[tuple[Walk, int, list[r.Row]]]:
    """(the walk, slots looked at, the present rows among them) a read at a
    time (want slots the first, then a segment), until the counter, or
    below high (None: no bound; _lib.lua's walk_segments)."""
    [(ns, head)] = await segments.transport.call_checked(
        [("HMGET", keys.meta, seg.NEW_START, seg.CLAIM_HEAD)], idempotent=True
    )
    if ns is None or (high is not None and high <= int(ns)):
        return
    low = max(int(ns), int(head or 0))
    if high is not None and low >= high:
        return
    tag = seg.id_tag(keys.prefix)
    walk = Walk(low, low)
    start = low
    while True:
        got = ReadReply.parse(await segments.read(keys, now, start, want, True, None))
        rows: list[r.Row] = []
        ends = got.reached > got.top
        for seq, raw in got.slots:
            if high is not None and seq >= high:
                ends = True
                break
            if raw is not None:
                rec = seg.SegmentRecord.decode(seq, raw)
                message_id = seg.message_id(tag, seq)
                row = segment_claims.segment_row(message_id, rec, got.states.get(seq))
                walk.records[row.id] = rec
                walk.dead = walk.dead and row.expires <= now
                rows.append(row)
            if walk.dead:
                walk.head = seq + 1
        if walk.dead:
            walk.head = max(walk.head, min(got.reached, got.top + 1, high or got.reached))
        yield walk, max(1, len(got.slots)), rows
        if ends or (high is not None and got.reached >= high):
            return
        start, want = got.reached, seg.SLOTS
