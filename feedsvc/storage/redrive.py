"""Redrive: a dead-letter queue's messages moved back, paced, in bounded steps.

A redrive's progress is one hash under the dead-letter queue's tag,
``Q:rd`` (fields :data:`FIELDS`): its id, state (running, done,
cancelled), target (``to``, "" = each message's source), rate, start and
update times, the *window* it works through (dead letters whose seq is
past ``cursor`` and at most ``end``, the queue's counter when it started:
messages dead-lettered later wait for another redrive), the counts moved
and skipped, the pacing clock ``paced`` and the lease (``owner`` until
``lease`` ms). Where each dead letter came from is ``Q:dlo`` (id ->
source queue), written with its copy into the dead-letter queue
(``claim_upkeep.py``).

A step (:meth:`RedisRedrives.step`), run by the process holding the
lease, takes at most :data:`BATCH` dead letters, and no more than the rate
allows since the last step (a token bucket of one second's worth,
``paced``), through three transactions:

1. **park** (the dead-letter queue's slot, WATCH): take or renew the lease
   and hold each movable dead letter under :data:`PARK_ID` for
   :data:`PARK_MS`, so no consumer claims, pops or lists it meanwhile;
2. **copy** (each target's slot, WATCH): write the record under the same
   id, its header new (seq, fresh ttl, claim count 0), everything after
   the header (author, body, whatever the record carries) byte for byte,
   and the mark ``T:rdm:<id>``, unless the mark is there already;
3. **forget** (the dead-letter queue's slot, WATCH): delete the dead
   letters still parked there, and in the same transaction advance the
   cursor and the counts (only if nobody else advanced them first).

A stop between 2 and 3 leaves a dead letter parked and its copy marked:
the next step (this process's or, once the lease lapsed, another's) parks
it again, finds the mark and only forgets it. So a dead letter lands in its
target once and leaves the dead-letter queue once; see docs/design.md,
"Redrive", for the argument.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from feedsvc.clock import Clock
from feedsvc.config import MessageSettings
from feedsvc.errors import ProjectQueuesFull, QueueNotFound, RedriveRunning
from feedsvc.storage import groups, segments
from feedsvc.storage import record as r
from feedsvc.storage import segment_claims as sc
from feedsvc.storage.base import Redrive, new_id
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import REDRIVES_KEY, QueueKeys, registry_key
from feedsvc.storage.quotas import ProjectQuotas
from feedsvc.storage.segment_claims import in_segments
from feedsvc.storage.segment_writes import Appending, append_transaction
from feedsvc.storage.sweep_schedule import SweepSchedule
from feedsvc.storage.transport import Transport

RUNNING, DONE, CANCELLED = "running", "done", "cancelled"
#: The most dead letters one step moves (one transaction per slot).
BATCH = 100
#: How long a process's hold on a redrive lasts without a step renewing it.
LEASE_MS = 10_000
#: How long a dead letter stays parked for its move: past the lease, so a
#: successor reaches it before a consumer could.
PARK_MS = 3 * LEASE_MS
#: The claim id a dead letter is parked under (claim ids are hex: no claim has it).
PARK_ID = "redrive"
FIELDS = (
    "id",
    "state",
    "to",
    "rate",
    "started",
    "updated",
    "cursor",
    "end",
    "moved",
    "skipped",
    "paced",
    "owner",
    "lease",
)


def member(project: str, queue: str) -> str:
    return json.dumps([project, queue])


@dataclass(frozen=True, slots=True)
class State:
    """The redrive hash as read (HMGET FIELDS)."""

    id: str
    state: str
    to: str
    rate: int
    started: int
    updated: int
    cursor: int
    end: int
    moved: int
    skipped: int
    paced: int
    owner: str
    lease: int

    @classmethod
    def read(cls, reply: list[Any]) -> State | None:
        if reply[0] is None:
            return None
        t = ["" if x is None else r.text(x) for x in reply]
        rate, started, updated, cursor, end, moved, skipped, paced = (int(x or 0) for x in t[3:11])
        return cls(
            t[0],
            t[1],
            t[2],
            rate,
            started,
            updated,
            cursor,
            end,
            moved,
            skipped,
            paced,
            t[11],
            int(t[12] or 0),
        )

    def budget(self, now: int) -> int:
        """How many dead letters the rate allows now: one second's worth at most."""
        since = now - max(self.paced, now - 1000)
        return min(BATCH, self.rate * since // 1000)

    def paced_after(self, now: int, count: int) -> int:
        """The pacing clock once count more dead letters were taken."""
        return max(self.paced, now - 1000) + -(-count * 1000 // self.rate)

    def public(self, remaining: int) -> Redrive:
        return Redrive(
            self.state,
            self.moved,
            self.skipped,
            remaining,
            self.rate,
            self.to or None,
            self.started,
            self.updated,
        )


@dataclass(frozen=True, slots=True)
class Move:
    row: r.Row
    rest: bytes  # the record after its fixed-width header: author, body, the rest
    target: str


@dataclass(frozen=True, slots=True)
class Batch:
    moves: list[Move]
    skipped: int
    last: int  # the seq of the last dead letter taken: the new cursor


class RedisRedrives:
    """The redrives of one store's dead-letter queues (queues only: topics
    are not claimed, so nothing is dead-lettered from them)."""

    def __init__(
        self,
        transport: Transport,
        settings: MessageSettings,
        clock: Clock,
        quotas: ProjectQuotas,
        sweeps: SweepSchedule,
    ) -> None:
        self._transport = transport
        self._settings = settings
        self._clock = clock
        self._quotas = quotas
        self._sweeps = sweeps  # a redriven dead letter's record goes at its segment's review

    async def start(self, project: str, queue: str, max_per_second: int, to: str | None) -> Redrive:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()
        # listed first: a crash right after the start must not hide it
        await self._transport.call_checked([("SADD", REDRIVES_KEY, member(project, queue))])

        def plan(replies: list[Any]) -> tuple[list[Command] | None, str]:
            created, current, last = replies[0], State.read(replies[1]), replies[2]
            if created is None:
                return None, "missing"
            if current is not None and current.state == RUNNING:
                return None, "running"
            fields: dict[str, int | str] = dict.fromkeys(FIELDS, 0)
            fields.update(
                id=new_id(),
                state=RUNNING,
                to=to or "",
                rate=max_per_second,
                started=now,
                updated=now,
                end=0 if last is None else r.parse_seq(last),
                paced=now - 1000,
                owner="",
            )
            return [("DEL", keys.redrive), ("HSET", keys.redrive, *r.flat(fields))], "ok"

        reads: list[Command] = [
            ("HGET", keys.meta, r.CREATED),
            ("HMGET", keys.redrive, *FIELDS),
            ("GET", keys.seq),
        ]
        outcome = await self._transport.transactions.optimistic(
            [keys.meta, keys.redrive], reads, plan
        )
        if outcome == "missing":
            raise QueueNotFound(queue)
        if outcome == "running":
            raise RedriveRunning(queue)
        found = await self.get(project, queue)
        assert found is not None
        return found

    async def get(self, project: str, queue: str) -> Redrive | None:
        keys = QueueKeys.of(project, queue)
        [reply] = await self._transport.call_checked([("HMGET", keys.redrive, *FIELDS)])
        state = State.read(reply)
        if state is None:
            return None
        [left] = await self._transport.call_checked(
            [("ZCOUNT", keys.index, f"({state.cursor}", state.end)]
        )
        return state.public(int(left))

    async def cancel(self, project: str, queue: str) -> Redrive | None:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, None]:
            current = State.read(replies[0])
            if current is None or current.state != RUNNING:
                return None, None
            return [("HSET", keys.redrive, "state", CANCELLED, "updated", now)], None

        await self._transport.transactions.optimistic(
            [keys.redrive], [("HMGET", keys.redrive, *FIELDS)], plan
        )
        found = await self.get(project, queue)
        if found is not None:
            await self._transport.call_checked([("SREM", REDRIVES_KEY, member(project, queue))])
        return found

    async def running(self, limit: int) -> list[tuple[str, str]]:
        [found] = await self._transport.call_checked([("SRANDMEMBER", REDRIVES_KEY, limit)])
        out = []
        for raw in found or []:
            project, queue = json.loads(raw)
            out.append((str(project), str(queue)))
        return out

    async def step(self, project: str, queue: str, owner: str) -> int | None:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()
        transport = self._transport
        [reply] = await transport.call_checked([("HMGET", keys.redrive, *FIELDS)])
        state = State.read(reply)
        if state is None or state.state != RUNNING:
            await transport.call_checked([("SREM", REDRIVES_KEY, member(project, queue))])
            return None
        if state.owner != owner and state.lease > now:
            return 0  # another process's, and it is alive
        budget = state.budget(now)
        if budget <= 0:
            return 0
        [found] = await transport.call_checked(
            [
                (
                    "ZRANGEBYSCORE",
                    keys.index,
                    f"({state.cursor}",
                    state.end,
                    "WITHSCORES",
                    "LIMIT",
                    0,
                    budget,
                )
            ]
        )
        listed = r.pairs(found)
        if len(listed) < budget:  # then the segments (segment_claims.py)
            after = r.parse_seq(listed[-1][1]) if listed else state.cursor
            listed += await sc.segment_entries(
                transport, keys, after, state.end, budget - len(listed)
            )
        ids = [r.text(i) for i, _ in listed]
        last = r.parse_seq(listed[-1][1]) if listed else state.cursor
        batch = await self._park(keys, state, owner, ids, last, now)
        if batch is None:
            return 0
        if not ids:
            await transport.call_checked([("SREM", REDRIVES_KEY, member(project, queue))])
            return 0
        copied: list[str] = []
        targets = {m.target for m in batch.moves}
        for target in sorted(targets):
            moves = [m for m in batch.moves if m.target == target]
            copied += await self._copy(project, target, moves, now)
        moved = await self._forget(keys, state, batch, copied, len(ids), now)
        self._sweeps.note_gone("queue", project, queue, copied, now)
        return moved

    async def _park(
        self, keys: QueueKeys, state: State, owner: str, ids: list[str], last: int, now: int
    ) -> Batch | None:
        """Step 1: the lease, and the batch's movable dead letters parked."""

        def plan(replies: list[Any]) -> tuple[list[Command] | None, Batch | None]:
            current = State.read(replies[0])
            if current is None or current.id != state.id or current.cursor != state.cursor:
                return None, None  # another step got there first
            if current.state != RUNNING or (current.owner != owner and current.lease > now):
                return None, None
            writes: list[Command] = [
                ("HSET", keys.redrive, "owner", owner, "lease", now + LEASE_MS, "updated", now)
            ]
            if not ids:
                writes.append(("HSET", keys.redrive, "state", DONE))
                return writes, Batch([], 0, last)
            origins = replies[1]
            records = replies[2:]
            moves, skipped = [], 0
            for n, row in enumerate(view.rows(ids, records)):
                if row is None or not row.alive(now):
                    continue  # expired meanwhile: nothing to move
                if row.claimed(now) and row.claim != PARK_ID:
                    skipped += 1  # a consumer holds it
                    continue
                target = current.to or (r.text(origins[n]) if origins[n] else "")
                if not target:
                    skipped += 1  # dead-lettered before origins were kept
                    continue
                raw = records[2 * n]
                rest = raw[r.FIXED :] if raw is not None else sc.record_rest(row)
                writes += view.hold(row, PARK_ID, now + PARK_MS)
                moves.append(Move(row, rest, target))
            return writes, Batch(moves, skipped, last)

        view = sc.ClaimRows(keys, await sc.read_records(self._transport, keys, ids))
        watch = [keys.redrive, *(k for i in ids for k in r.message_keys(keys, i)), *view.watch()]
        reads: list[Command] = [("HMGET", keys.redrive, *FIELDS)]
        if ids:
            reads.append(("HMGET", keys.origins, *ids))
            reads += [*r.read_commands(keys, ids), *view.reads()]
        else:
            reads.append(("PING",))
        return await self._transport.transactions.optimistic(watch, reads, plan)

    async def _copy(self, project: str, target: str, moves: list[Move], now: int) -> list[str]:
        """Step 2: the parked dead letters written into their target, once."""
        to = QueueKeys.of(project, target)
        try:
            # a target not there (deleted since) is made again, as dead-lettering does
            await self._quotas.admit(project, "queue", target, 0)
        except ProjectQueuesFull:
            return []
        if await in_segments(self._transport, to):
            default_ttl = self._settings.default_message_ttl
            review = await copy_into_segments(self._transport, default_ttl, to, moves, now)
            if review is not None:
                self._sweeps.note_soon("queue", project, target, review)
            await self._transport.call_checked([("ZADD", registry_key(project), 0, target)])
            return [m.row.id for m in moves]
        default_ttl = self._settings.default_message_ttl

        def plan(replies: list[Any]) -> tuple[list[Command] | None, None]:
            last, (created, ttl_field, since_raw), *marked = replies
            seq = r.parse_seq(last) if last is not None else now * 1000
            since = groups.groups_since(since_raw)
            ttl = int(ttl_field) if ttl_field else default_ttl
            writes: list[Command] = []
            for move, have in zip(moves, marked, strict=True):
                if have:
                    continue  # copied by a step that stopped before forgetting
                seq += 1
                message_id = move.row.id
                header = r.posted(move.row.author.decode(), ttl, now, seq, delay=0)
                key = to.record(message_id)
                writes += [("SET", key, header.fixed() + move.rest)]
                writes += [("PEXPIREAT", key, header.expires)]
                writes += r.index_commands(to, message_id, header)
                # its group rides on in move.rest: claim-indexed there as a post is
                grouped, since = groups.index_commands(to, message_id, seq, move.row.group, since)
                writes += grouped
                mark_until = max(move.row.expires, now) + PARK_MS
                writes.append(("SET", to.redriven(message_id), 1, "PXAT", mark_until))
            if not writes:
                return None, None
            writes.append(("SET", to.seq, seq))
            if last is None:  # where the counter started (see list.lua's missed)
                writes.append(("HSET", to.meta, r.SEQ_BASE, now * 1000))
            if created is None:
                writes.append(("HSET", to.meta, r.CREATED, now, r.METADATA, "{}"))
            writes.append(("SPUBLISH", to.feed, r.notification(seq, 0)))
            return writes, None

        watch = [to.seq, to.meta, *(to.redriven(m.row.id) for m in moves)]
        reads: list[Command] = [
            ("GET", to.seq),
            ("HMGET", to.meta, r.CREATED, r.DEFAULT_TTL, r.GROUPS_SINCE),
            *(("EXISTS", to.redriven(m.row.id)) for m in moves),
        ]
        await self._transport.transactions.optimistic(watch, reads, plan)
        await self._transport.call_checked([("ZADD", registry_key(project), 0, target)])
        return [m.row.id for m in moves]

    async def _forget(
        self, keys: QueueKeys, state: State, batch: Batch, copied: list[str], taken: int, now: int
    ) -> int:
        """Step 3: the copied dead letters deleted, the progress advanced."""
        uncopied = len(batch.moves) - len(copied)
        holders = [sc.holder_commands(keys, i) for i in copied]
        group_of = {m.row.id: m.row.group for m in batch.moves}

        def plan(replies: list[Any]) -> tuple[list[Command] | None, int]:
            current = State.read(replies[0])
            held, writes = sc.forget_held(keys, copied, holders, replies[1:], PARK_ID, now)
            if held:
                writes += groups.forget_commands(keys, [(i, group_of[i]) for i in held])
                writes.append(("HDEL", keys.origins, *held))
            if current is not None and current.id == state.id and current.cursor == state.cursor:
                writes.append(
                    (
                        "HSET",
                        keys.redrive,
                        "cursor",
                        batch.last,
                        "updated",
                        now,
                        "paced",
                        state.paced_after(now, taken),
                    )
                )
                writes.append(("HINCRBY", keys.redrive, "moved", len(held)))
                writes.append(("HINCRBY", keys.redrive, "skipped", batch.skipped + uncopied))
            return writes or None, len(held)

        watch = [keys.redrive, *(k for i in copied for k in sc.holder_keys(keys, i))]
        reads: list[Command] = [("HMGET", keys.redrive, *FIELDS)]
        reads += [c for each in holders for c in each]
        moved: int = await self._transport.transactions.optimistic(watch, reads, plan)
        return moved


async def copy_into_segments(
    transport: Transport, default_ttl: int, to: QueueKeys, moves: list[Move], now: int
) -> int | None:
    """Step 2 into a queue that writes segments (storage/segment_writes.py):
    each copy a new record there, with a new id (its seq), marked as the
    older layout's copy is. Returns the segment review the copies scheduled
    (ms; None: none), for fs:sweep."""

    def plan(where: Appending, replies: list[Any]) -> tuple[list[Command] | None, None]:
        (created, ttl_field, since_raw), *marked = replies
        since = groups.groups_since(since_raw)
        ttl = int(ttl_field) if ttl_field else default_ttl
        fresh = [move for move, have in zip(moves, marked, strict=True) if not have]
        if not fresh:
            return None, None
        records: list[tuple[bytes, int]] = []
        writes: list[Command] = []
        expires = now + ttl * 1000
        for n, move in enumerate(fresh):
            seq, row = where.top + 1 + n, move.row
            author = segments.author_bytes(row.author.decode())
            extras = segments.extras(row.group or None, row.headers or None)
            records.append(
                (segments.encode_record(expires, 0, ttl, author, extras, row.body), expires)
            )
            grouped, since = groups.index_commands(
                to, segments.message_id(segments.id_tag(to.prefix), seq), seq, row.group, since
            )
            writes += grouped
            mark_until = max(row.expires, now) + PARK_MS
            writes.append(("SET", to.redriven(row.id), 1, "PXAT", mark_until))
        writes = where.commands(records) + writes
        if created is None:
            writes.append(("HSET", to.meta, r.CREATED, now, r.METADATA, "{}"))
        writes.append(("SPUBLISH", to.feed, r.notification(where.top + len(fresh), 0)))
        return writes, None

    watch = [to.meta, *(to.redriven(m.row.id) for m in moves)]
    reads: list[Command] = [
        ("HMGET", to.meta, r.CREATED, r.DEFAULT_TTL, r.GROUPS_SINCE),
        *(("EXISTS", to.redriven(m.row.id)) for m in moves),
    ]
    _, review = await append_transaction(transport, to, len(moves), watch, reads, plan)
    return review
