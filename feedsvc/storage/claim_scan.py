"""The watch drivers' claim and pop scan (lua/claim.lua and lua/pop.lua do
the same in a script, _lib.lua's choose_messages; docs/consumers.md,
"Ordered groups"): which messages a claim (or a pop) may take, read
without WATCH, ordered groups honoured (:class:`Scan`), and the upkeep of
the claim index it meets on the way (:class:`Found`). What posts write
into the claim index is storage/groups.py's.

A queue without ``gs`` (no grouped message was ever posted to it) is
scanned as it always was: ``Q:idx`` from the head, each message on its own.
A queue with ``gs``: first ``Q:idx`` below ``gs`` (the messages from before
groups), then the claim index ``Q:ci`` in order. An id entry there is an
ungrouped message, checked on its own; a group entry (``g:<G>``) stands
for group G, whose messages (``Q:g:<G>``) are taken only from its head
(its earliest live message), consecutively, stopping at the first one that
cannot be taken (claimed, not due, unopenable). So the claimed messages of
a group are always a prefix of its live messages, held by one claim: G is
locked exactly while its head is claimed, and a head not due blocks it.

Why the transaction that takes the candidates (``WatchStore._take``) need
not WATCH a group's zset: it WATCHes each candidate's record, so two claims
of one head conflict, and a candidate held meanwhile fails the plan's
check; and the front of a group only ever shrinks (a post appends at a
higher seq), by ids whose messages are gone or expired for good, so what
the scan read as "the head is the earliest live message" stays true while
the head's record is unchanged. Only removing a group's entry from
``Q:ci`` depends on its zset being empty: that transaction WATCHes the zset
and checks that it holds exactly the ids the scan saw (:meth:`Found.upkeep_reads`;
its size alone is not enough: another claim may drop a stale id and a post
add one between the scan and the transaction).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from feedsvc.storage import record as r
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import GROUP_ENTRY, QueueKeys
from feedsvc.storage.optimistic import Conflicted
from feedsvc.storage.transport import Transport

#: index entries read at a time
CHUNK = 100
#: a group's first ids read with the claim index entries naming it (more on demand)
FRONT = 4
#: ids a post's garbage collection looks at in the first groups' fronts
TIDY_BUDGET = 10

#: what a claim does with a free message: take it, park it for the dead-letter
#: queue (it does not count towards the limit), or leave it (a sealed body this
#: process cannot open)
Verdict = Literal["take", "park", "leave"]
Judge = Callable[[r.Row], Verdict]
#: the rows of ids in either layout (a record, or a segment message), in order
Reader = Callable[[list[str]], Awaitable[list[r.Row | None]]]
#: the segment messages not in the claim index, seqs below a bound (None: to
#: the counter), in order: (slots looked at, the present rows among them) a read
Walker = Callable[[int | None], AsyncIterator[tuple[int, list[r.Row]]]]


@dataclass(slots=True)
class Found:
    """What a scan found: the candidates in order, when the first message
    it looked at and could not take becomes free by itself, and the claim
    index's upkeep (written by the transaction that takes the candidates)."""

    ids: list[str] = field(default_factory=list)
    next_free: int | None = None
    counted: int = 0  # candidates taken, not parked
    #: a grouped candidate's group
    group_of: dict[str, str] = field(default_factory=dict)
    #: candidates to park -> their seq: a parked message leaves its group
    parked: dict[str, int] = field(default_factory=dict)
    #: group -> ids met at its front whose messages are gone or expired
    stale: dict[str, list[str]] = field(default_factory=dict)
    #: ungrouped ids met in the claim index whose messages are gone
    gone: list[str] = field(default_factory=list)
    #: group -> the seq of its head, where Q:ci's entry holds another
    heads: dict[str, int] = field(default_factory=dict)
    #: group -> the ids its zset held, all stale or parked: its entry goes
    emptied: dict[str, list[str]] = field(default_factory=dict)

    def note(self, at: int | None) -> None:
        if at is not None and (self.next_free is None or at < self.next_free):
            self.next_free = at

    def add(self, message_id: str, seq: int, verdict: Verdict, group: str = "") -> None:
        self.ids.append(message_id)
        if group:
            self.group_of[message_id] = group
        if verdict == "park":
            self.parked[message_id] = seq
        else:
            self.counted += 1

    @property
    def upkeep(self) -> bool:
        return bool(self.stale or self.gone or self.heads or self.emptied)

    def upkeep_watch(self, keys: QueueKeys) -> list[str]:
        """The keys a transaction writing the upkeep WATCHes."""
        return [keys.group(g) for g in self.emptied]

    def upkeep_reads(self, keys: QueueKeys) -> list[Command]:
        """Read last in that transaction (a group to drop: its ids, one more
        than the scan saw); the replies go to upkeep_writes."""
        return [("ZRANGE", keys.group(g), 0, len(ids)) for g, ids in self.emptied.items()]

    def upkeep_writes(self, keys: QueueKeys, fronts: list[Any]) -> list[Command]:
        """The claim index's upkeep; Conflicted if a group to drop is not
        (any more) exactly what the scan saw of it: the same ids, not merely
        as many (one dropped by another claim and one posted meanwhile)."""
        if [[r.text(i) for i in ids] for ids in fronts] != list(self.emptied.values()):
            raise Conflicted
        writes: list[Command] = []
        for group, ids in self.stale.items():
            writes.append(("ZREM", keys.group(group), *ids))
        if self.gone:
            writes.append(("ZREM", keys.claim_index, *self.gone))
        for message_id, seq in self.parked.items():
            # it leaves its group (whose next message is its head now), and
            # stays claimable alone until the dead-letter queue has its copy
            if group := self.group_of.get(message_id, ""):
                writes.append(("ZREM", keys.group(group), message_id))
                writes.append(("ZADD", keys.claim_index, seq, message_id))
        for group, seq in self.heads.items():
            writes.append(("ZADD", keys.claim_index, "XX", seq, GROUP_ENTRY + group))
        if self.emptied:
            writes.append(("ZREM", keys.claim_index, *(GROUP_ENTRY + g for g in self.emptied)))
        return writes


class Scan:
    """One scan of a queue for up to limit messages (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        keys: QueueKeys,
        now: int,
        limit: int,
        budget: int,
        judge: Judge,
        reader: Reader | None = None,
        walker: Walker | None = None,
    ) -> None:
        self._transport = transport
        self._reader = reader
        self._walker = walker
        self._keys = keys
        self._now = now
        self._limit = limit
        self._budget = budget
        self._judge = judge
        self._scanned = 0
        self.found = Found()

    @property
    def _front(self) -> int:
        """How many of a group's first ids to read with its entry: the head
        and what this scan may take after it."""
        return min(FRONT, self._limit)

    @property
    def _more(self) -> bool:
        return self.found.counted < self._limit and self._scanned < self._budget

    async def run(self, since: int | None) -> Found:
        await self._index(since)
        await self._segments(since)
        if since is not None:
            await self._claim_index()
        return self.found

    async def _read(self, ids: list[str]) -> list[r.Row | None]:
        if not ids:
            return []
        if self._reader is not None:
            return await self._reader(ids)
        return r.rows(ids, await self._transport.call_checked(r.read_commands(self._keys, ids)))

    async def _index(self, since: int | None) -> None:
        """Q:idx from the head (below since, if given), each message on its own."""
        offset = 0
        while self._more:
            [raw] = await self._transport.call_checked(
                [("ZRANGE", self._keys.index, offset, offset + CHUNK - 1, "WITHSCORES")]
            )
            entries = r.pairs(raw)
            offset += len(entries)
            before = [r.text(m) for m, s in entries if since is None or r.parse_seq(s) < since]
            for row in await self._read(before):
                self._single(row)
                if not self._more:
                    return
            if len(before) < CHUNK:
                return

    async def _segments(self, high: int | None) -> None:
        """The segment messages not in the claim index (below high, where
        groups began), each on its own (_lib.lua's choose_messages)."""
        if self._walker is None or not self._more:
            return
        async for slots, rows in self._walker(high):
            self._scanned += max(0, slots - len(rows))
            for row in rows:
                self._single(row)
                if not self._more:
                    return

    def _single(self, row: r.Row | None, indexed: str = "") -> None:
        """An ungrouped message: taken if free (and takeable); indexed: its
        id, met in the claim index (gone: it leaves it)."""
        self._scanned += 1
        if row is None:
            if indexed:
                self.found.gone.append(indexed)
            return
        self.found.note(row.free_at(self._now))
        if row.free(self._now) and (verdict := self._judge(row)) != "leave":
            assert row.seq is not None  # free: indexed
            self.found.add(row.id, row.seq, verdict)

    async def _claim_index(self) -> None:
        """Q:ci in order: ungrouped ids, and groups from their heads."""
        keys, after, met = self._keys, "-inf", set[str]()
        # a group gives up to limit messages: a few entries first, more as needed
        chunk = min(CHUNK, self._limit + 1)
        while self._more:
            # by score, not offset: entries leave as others scan (scores are seqs: unique)
            by_score = ("BYSCORE", "LIMIT", 0, chunk, "WITHSCORES")
            [raw] = await self._transport.call_checked(
                [("ZRANGE", keys.claim_index, after, "+inf", *by_score)]
            )
            page = [(r.text(m), r.parse_seq(s)) for m, s in r.pairs(raw)]
            if not page:
                return
            after = f"({page[-1][1]}"
            # an entry another claim moved on (a group's new head) may come again
            entries = [(m, s) for m, s in page if m not in met]
            met.update(m for m, _ in entries)
            await self._entries(entries)
            if len(page) < chunk:
                return
            chunk = min(CHUNK, chunk * 4)

    async def tidy(self, entries: list[tuple[str, int]]) -> Found:
        """Only the upkeep of these claim index entries' groups (judge: leave
        every message), for the garbage collection."""
        await self._entries([(m, s) for m, s in entries if m.startswith(GROUP_ENTRY)])
        return self.found

    async def _entries(self, entries: list[tuple[str, int]]) -> None:
        """Claim index entries, (member, score), in order: each id's record
        and each group's front read in one round trip, the fronts' records
        in a second."""
        if not entries:
            return
        keys = self._keys
        ids = [m for m, _ in entries if not m.startswith(GROUP_ENTRY)]
        groups = [m[len(GROUP_ENTRY) :] for m, _ in entries if m.startswith(GROUP_ENTRY)]
        fronts: dict[str, list[tuple[str, int]]] = {}
        if self._reader is None:  # the older layout: ids' records with the fronts
            reads = r.read_commands(keys, ids)
            reads += [("ZRANGE", keys.group(g), 0, self._front - 1, "WITHSCORES") for g in groups]
            replies = await self._transport.call_checked(reads)
            rows = dict(zip(ids, r.rows(ids, replies), strict=True))
            raw_fronts = replies[2 * len(ids) :]
        else:  # either layout: the fronts first, then every message through the reader
            reads = [("ZRANGE", keys.group(g), 0, self._front - 1, "WITHSCORES") for g in groups]
            raw_fronts = await self._transport.call_checked(reads) if reads else []
            rows = {}
        for g, reply in zip(groups, raw_fronts, strict=True):
            fronts[g] = [(r.text(m), r.parse_seq(s)) for m, s in r.pairs(reply)]
        front_ids = [i for front in fronts.values() for i, _ in front]
        wanted = [i for i in ids if i not in rows] + front_ids
        rows.update(zip(wanted, await self._read(wanted), strict=True))
        for member, score in entries:
            if not self._more:
                return
            if member.startswith(GROUP_ENTRY):
                group = member[len(GROUP_ENTRY) :]
                await self._group(group, score, fronts[group], rows)
            else:
                self._single(rows[member], member)

    async def _group(
        self,
        group: str,
        score: int,
        front: list[tuple[str, int]],
        rows: dict[str, r.Row | None],
    ) -> None:
        """Group G from its head: its messages taken while each is free,
        due and takeable; stale ids dropped; its entry's score kept at its
        head's seq, the entry dropped once the group is empty."""
        found, now = self.found, self._now
        stale: list[str] = []
        head: int | None = None
        seen: list[str] = []
        asked, last = self._front, 0
        while True:
            for message_id, seq in front:
                seen.append(message_id)
                last = seq
                self._scanned += 1
                row = rows.get(message_id)
                if row is None or not row.alive(now):
                    stale.append(message_id)
                    continue
                verdict = self._judge(row) if row.free(now) else "leave"
                if verdict == "park":  # it leaves the group: the next one is the head
                    found.add(message_id, seq, verdict, group)
                    continue
                head = seq if head is None else head
                if verdict == "leave":  # claimed, not due, unopenable: G stops here
                    found.note(row.free_at(now))
                    break
                found.add(message_id, seq, verdict, group)
                if not self._more:
                    break
            else:
                if len(front) == asked and self._more:  # the group goes on: read on
                    asked = max(FRONT, self._limit - found.counted + 1)
                    # by score: ids leave the front as others scan it
                    more: Command = (
                        "ZRANGE", self._keys.group(group), f"({last}", "+inf", "BYSCORE",
                        "LIMIT", 0, asked, "WITHSCORES",
                    )  # fmt: skip
                    [raw] = await self._transport.call_checked([more])
                    front = [(r.text(m), r.parse_seq(s)) for m, s in r.pairs(raw)]
                    ids = [i for i, _ in front]
                    rows = dict(zip(ids, await self._read(ids), strict=True))
                    continue
                if len(front) < asked and head is None:  # nothing live is left in it
                    found.emptied[group] = seen
            break
        if stale:
            found.stale[group] = stale
        if head is not None and head != score:
            found.heads[group] = head


async def tidy_groups(transport: Transport, keys: QueueKeys, now: int) -> None:
    """The garbage collection's share of the ordered groups, after a watch
    driver's post collected expired messages (_lib.lua's collect_garbage
    does it in the script): expiry cannot tell which group an expired id was
    in (its record is gone), so the first two groups of the claim index lose
    the stale ids at their fronts, and their entries follow (Found); groups
    further on are tidied by the claims that walk them. Once: a conflict
    leaves it to the next."""
    [raw] = await transport.call_checked([("ZRANGE", keys.claim_index, 0, 1, "WITHSCORES")])
    entries = [(r.text(m), r.parse_seq(s)) for m, s in r.pairs(raw)]
    found = await Scan(transport, keys, now, 1, TIDY_BUDGET, _leave).tidy(entries)
    if not found.upkeep:
        return

    def plan(replies: list[Any]) -> tuple[list[Command] | None, None]:
        return found.upkeep_writes(keys, replies), None

    watch = [keys.meta, *found.upkeep_watch(keys)]  # the first names the slot
    async with transport.transactions.write_slot():
        await transport.transactions.attempt(watch, found.upkeep_reads(keys), plan)


def _leave(row: r.Row) -> Verdict:
    """A tidy takes nothing."""
    return "leave"
