"""The watch drivers: WATCH / MULTI / EXEC with bounded, jittered retries.

No server-side scripting at all, so that they measure what the lua driver
buys. Each write is the classic optimistic transaction, done in the fewest
round trips the protocol allows: ``WATCH`` and the reads travel in one
write, ``MULTI ... EXEC`` in a second. A conflicting transaction makes EXEC
answer nil; the attempt is counted in ``counters.watch_retries`` and repeated
after a jittered backoff that gives the pool slot back, at most
``watch_retries`` times, then the request gets a 503. A transaction that was
not executed wrote nothing, so retrying it cannot write twice. The engine
for all this is ``Transport.optimistic``.

Two drivers differ only in how a POST is indexed:

``watch`` (:class:`WatchStore`) is what a careful engineer would write
without scripting. Posts to one queue in one process go through a
:class:`~feedsvc.storage.combiner.Combiner`: the posts that arrive while the
queue's transaction is in flight are indexed together by the next one, so a
process never conflicts with itself and a burst costs one transaction. The
bodies are written ahead of the WATCH, in the same write (no extra round
trip, and never again on a retry), so the critical section holds only the
seq counter, the index and expiry entries and the indexing fields; this is
the same split as the lua driver's (pipeline, then script). Orphans: a body
whose transaction never ran (a crash, a 503 after too many conflicts) has no
seq and no index entry, so no read path returns it (``Row.alive``), and its
key expires by itself (EXPIRE at the latest time the message could have
lived); a post refused in the transaction (encrypted queue, too large,
idempotent replay) deletes its bodies there.

``watch-naive`` (:class:`NaiveWatchStore`) is the 2014 Zaqar-style version:
every request its own transaction, bodies written inside MULTI, no
serialisation inside the process, so the process's own requests race each
other for the queue's counter.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from feedsvc.config import StoreSettings
from feedsvc.errors import (
    InvalidClaim,
    MessageIsClaimed,
    PostTooLarge,
    QueueFull,
    StorageUnavailable,
    TooMuchContention,
    Unavailable,
)
from feedsvc.storage import groups
from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage.base import (
    Claim,
    ListQuery,
    Message,
    MessagePage,
    NewMessage,
    Unclaimable,
    new_id,
    reserved_fields,
)
from feedsvc.storage.claim_scan import tidy_groups
from feedsvc.storage.coalescer import Command
from feedsvc.storage.combiner import Combiner
from feedsvc.storage.keys import GROUP_ENTRY, QueueKeys
from feedsvc.storage.optimistic import Conflicted, Plan
from feedsvc.storage.quotas import Reservation
from feedsvc.storage.redis_store import (
    RedisStore,
    marker_not_given_out,
    queue_full,
    read_tail_marker,
)
from feedsvc.storage.sealing import MustSeal
from feedsvc.storage.segment_pages import MarkerAhead, PageScan
from feedsvc.storage.watch_forget import delete_by_ids
from feedsvc.storage.watch_list import scan_page
from feedsvc.storage.watch_posting import Posting
from feedsvc.storage.watch_segments import (
    Taking,
    WatchSegments,
    segment_keys,
)
from feedsvc.storage.watch_sweep import WatchSweep
from feedsvc.storage.watch_take import Taker

GC_BATCH = 100
DROP_BATCH = 500
# Posts indexed by one transaction at most (a burst beyond waits for the next).
MAX_COMBINED_POSTS = 64
# A claim transaction's result: the claim (None: nothing claimed), the
# messages parked for the dead-letter queue, and that queue.
Taken = tuple[Claim | None, list[r.Parked], str | None]
# What a post comes to: its message ids, or the exception its request gets.
Outcome = list[str] | Exception
#: _post_plan's answer when the queue is in segments (segments.NEW_START): nothing done
IN_SEGMENTS: list[Outcome] = []


def _body_commands(posting: Posting, settings: StoreSettings) -> list[Command]:
    """The bodies of a posting, written ahead of its transaction. Until the
    transaction sets the exact expiry, a body that never gets indexed (a
    crash, a 503 after too many conflicts) expires by itself, at the
    latest when the message would have (as the lua driver's)."""
    commands: list[Command] = []
    for message_id, message in zip(posting.ids, posting.messages, strict=True):
        orphan_ttl = (message.ttl or settings.max_message_ttl) + settings.max_message_delay
        commands += r.body_commands(
            posting.keys,
            message_id,
            posting.client_id,
            message.body,
            orphan_ttl,
            message.headers,
            message.group,
        )
    return commands


def _post_plan(
    postings: list[Posting],
    tokens: list[str],
    now: int,
    settings: StoreSettings,
    inside: bool,
    too_large: Callable[[str, bytes], PostTooLarge],
    full: Callable[[str, bytes], QueueFull],
    tidy: list[bool],
) -> Plan[list[Outcome]]:
    """The indexing transaction of postings to one queue (see WatchStore._index),
    each checked on its own: a refused one does not stop the others. tidy
    is set to [True] when it collects garbage in a queue with groups."""
    keys = postings[0].keys

    def plan(replies: list[Any]) -> tuple[list[Command] | None, list[Outcome]]:
        _, last, exists, (dttl, ddelay, mps, encrypted, most), dead, live, (since, ns) = replies[:7]
        if ns is not None:
            return None, IN_SEGMENTS  # every post to the queue goes there (ns wins)
        seen = dict(zip(tokens, replies[7 : 7 + len(tokens)], strict=True))
        forget: list[Any] = []
        if tokens:
            forget = [
                field
                for field, value in r.pairs(replies[7 + len(tokens)])
                if int(r.text(value).split()[0]) <= now
            ]
        if not inside and replies[-1] != sum(len(p.ids) for p in postings):
            # the bodies written ahead are gone (Redis lost data): index none
            raise StorageUnavailable("Redis lost a message body before indexing it.")
        default_ttl = int(dttl or settings.default_message_ttl)
        default_delay = int(ddelay or 0)
        seq = int(last) if last is not None else now * 1000
        # from the first grouped message on, every post is claim-indexed
        grouped = groups.groups_since(since)
        tidy[:] = [bool(dead) and since is not None]
        writes = gc_commands(keys, dead, now, since is not None)
        if last is None:  # where the counter starts (see list.lua's missed)
            writes.append(("HSET", keys.meta, r.SEQ_BASE, seq))
        if not exists:
            writes.append(("HSET", keys.meta, r.CREATED, now))
        outcomes: list[Outcome] = []
        unused: list[str] = []  # bodies written ahead that nothing will index
        this_batch: dict[str, list[str]] = {}
        first_due = 0
        for posting in postings:
            token = posting.token
            try:
                replay = posting.replay_or_refuse(encrypted, mps, too_large, this_batch, seen, now)
                if replay is not None:
                    outcomes.append(replay)
                    unused += posting.ids
                    continue
                # live counts only live messages (the read is ZCOUNT from now)
                if most is not None and live + len(posting.ids) > int(most):
                    raise full(posting.queue, most)
            except (MustSeal, PostTooLarge, QueueFull) as refused:
                outcomes.append(refused)
                unused += posting.ids
                continue
            for message_id, message in zip(posting.ids, posting.messages, strict=True):
                seq += 1
                ttl = default_ttl if message.ttl is None else message.ttl
                delay = default_delay if message.delay is None else message.delay
                header = r.posted(
                    posting.client_id, ttl, now, seq, delay, 0, message.headers, message.group
                )
                if inside:
                    writes += r.post_commands(keys, message_id, header, message.body)
                else:
                    writes += r.header_commands(keys, message_id, header)
                writes += r.index_commands(keys, message_id, header)
                if posting.kind == "queue":  # a topic has no claims to order
                    claim_indexed, grouped = groups.index_commands(
                        keys, message_id, seq, message.group, grouped
                    )
                    writes += claim_indexed
                due = header.due
                first_due = due if due and (not first_due or due < first_due) else first_due
            if token is not None:
                until = now + settings.idempotency_window * 1000
                writes.append(("HSET", keys.idempotency, token, f"{until} {' '.join(posting.ids)}"))
                this_batch[token] = posting.ids
            outcomes.append(posting.ids)
            live += len(posting.ids)
        indexed = any(o is p.ids for o, p in zip(outcomes, postings, strict=True))
        if not indexed and not (unused and not inside):
            return None, outcomes  # nothing to index, nothing to take back
        if indexed:
            writes.append(("SET", keys.seq, seq))
            # in the transaction: followers hear of it exactly when it is visible
            writes.append(("SPUBLISH", keys.feed, r.notification(seq, first_due)))
        # the room the postings held under their project's quota: what was
        # indexed now counts as live, what was refused not at all
        writes += [
            ("ZREM", p.held.key, p.held.member) for p in postings if p.held and p.held.in_script
        ]
        if forget:
            writes.append(("HDEL", keys.idempotency, *forget))
        if unused and not inside:
            writes.append(("DEL", *(keys.record(i) for i in unused)))
        return writes, outcomes

    return plan


def gc_commands(keys: QueueKeys, dead: Sequence[bytes], now: int, grouped: bool) -> list[Command]:
    """The writes that forget expired messages and claims (see _lib.lua);
    grouped: the queue has ordered groups (the claim index's entries go too;
    a group's zset keeps them until its front is tidied, WatchStore._tidy)."""
    commands = r.forget_commands(keys, dead) if dead else []
    if dead and grouped:
        commands.append(("ZREM", keys.claim_index, *dead))
    commands.append(("ZREMRANGEBYSCORE", keys.claimed, "-inf", now))
    commands.append(("ZREMRANGEBYSCORE", keys.claims, "-inf", now))
    return commands


class WatchStore(RedisStore):
    name = "watch"
    # where a post's bodies are written: ahead of the transaction (tuned) or in it
    bodies_in_transaction = False

    def _share(self, queues: RedisStore | None) -> None:
        """One combiner per process: a topic view's posts join the queue store's."""
        self._combiner: Combiner[Posting, list[str]] = (
            queues._combiner
            if isinstance(queues, WatchStore)
            else Combiner(self._index_combined, MAX_COMBINED_POSTS)
        )
        refusals = (self._too_large, functools.partial(queue_full, self._noun))
        self.segments = WatchSegments(
            self._transport, self._settings, self._clock, refusals, self.parts.sweeps, self._kind
        )
        self.reviews = WatchSweep(self._transport, self._clock)
        self._taker = Taker(
            self._transport, self._clock, self._opener, self.segments, self._noun,
            self._claim_scan_limit(),
        )  # fmt: skip

    async def _sweep(self, keys: QueueKeys, most: int) -> tuple[int, int | None]:
        return await self.reviews.sweep(keys, most)  # watch_sweep.py

    async def _live_swept(self, keys: QueueKeys) -> int | None:
        return await self.reviews.live(keys)

    async def close(self) -> None:
        await self._combiner.close()
        await super().close()

    async def create_queue(self, project: str, queue: str, metadata: dict[str, Any]) -> bool:
        keys = self._keys(project, queue)
        await self.quotas.admit(project, self._kind, queue, 0)
        now = self._clock.now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, bool]:
            if replies[1]:
                return None, False
            fields = r.flat(reserved_fields(metadata))
            meta = orjson.dumps(metadata)
            return [("HSET", keys.meta, r.CREATED, now, r.METADATA, meta, *fields)], True

        registry = await self._registry_add(project, queue)
        reads: list[Command] = [registry, ("EXISTS", keys.meta)]
        return await self._transport.transactions.optimistic([keys.meta], reads, plan)

    async def delete_queue(self, project: str, queue: str) -> None:
        await self._transport.call_checked([("ZREM", self._registry(project), queue)])
        await self._drop(self._keys(project, queue), keep_queue=False)

    async def purge_queue(self, project: str, queue: str) -> None:
        await self._drop(self._keys(project, queue), keep_queue=True)

    async def _drop(self, keys: QueueKeys, keep_queue: bool) -> None:
        """Delete messages and claims in batches, then the queue's own keys."""
        transport = self._transport
        while True:
            [ids] = await transport.call_checked([("ZRANGE", keys.index, 0, DROP_BATCH - 1)])
            if not ids:
                break
            await transport.transaction(r.forget_commands(keys, ids))
        while True:  # the claim index: every group's zset, named by its entry
            [entries] = await transport.call_checked(
                [("ZRANGE", keys.claim_index, 0, DROP_BATCH - 1)]
            )
            if not entries:
                break
            names = [r.text(e) for e in entries]
            groups = [keys.group(n[len(GROUP_ENTRY) :]) for n in names if n.startswith(GROUP_ENTRY)]
            dropped: list[Command] = [("DEL", *groups)] if groups else []
            await transport.transaction([*dropped, ("ZREM", keys.claim_index, *entries)])
        await self.segments.drop(keys)
        while True:
            [claims] = await transport.call_checked([("ZRANGE", keys.claims, 0, DROP_BATCH - 1)])
            if not claims:
                break
            await transport.transaction(
                [("DEL", *(keys.claim(r.text(c)) for c in claims)), ("ZREM", keys.claims, *claims)]
            )
        kept = {keys.meta, keys.seq, keys.idempotency, keys.redrive} if keep_queue else set()
        # with a dead-letter queue's redrive and origins (storage/redrive.py)
        everything = [*keys.fixed(), keys.idempotency, keys.redrive, keys.origins]
        everything += segment_keys(keys)
        deleted: list[Command] = [("DEL", *(k for k in everything if k not in kept))]
        if keep_queue:  # a purged queue claims as one that never had a group
            deleted.append(("HDEL", keys.meta, r.GROUPS_SINCE))
        if not keep_queue:
            deleted.append(("SPUBLISH", keys.feed, r.ENDED))
        await transport.call_checked(deleted)
        if keep_queue:
            await self.segments.purged(keys)

    async def _post(
        self,
        keys: QueueKeys,
        project: str,
        queue: str,
        client_id: str,
        messages: list[NewMessage],
        request_size: int,
        idempotency_key: str | None,
        sealed: bool,
        held: Reservation | None = None,
    ) -> list[str]:
        given = (keys, project, queue, client_id, messages, request_size, idempotency_key)
        return await self._post_one(Posting.make(*given, sealed, held, self._kind))

    async def _post_one(self, posting: Posting) -> list[str]:
        """Index a posting with the other posts to its queue in this process."""
        return await self._combiner.submit(posting.keys.prefix, posting)

    async def _index_combined(self, prefix: str, postings: list[Posting]) -> list[Outcome]:
        self.counters.posts_combined += len(postings) - 1
        return await self._index(postings)

    async def _index(self, postings: list[Posting]) -> list[Outcome]:
        """Index the postings (all to one queue) in one optimistic transaction:
        per posting its ids, or the exception its request gets (MustSeal,
        PostTooLarge). Bodies go in the transaction when
        ``bodies_in_transaction``, else ahead of it (see _body_commands)."""
        first = postings[0]
        registry = await self._registry_add(first.project, first.queue, first.kind)
        # a topic stores a message's group but has no claims to order by it
        grouping = first.kind == "queue"
        if self._settings.storage_layout == "segments":
            outcomes = await self.segments.post(postings, registry, True, grouping)
            if outcomes is not None:
                return outcomes
        outcomes = await self._index_records(postings, registry)
        if outcomes is IN_SEGMENTS:
            outcomes = await self.segments.post(postings, registry, False, grouping)
            if outcomes is None:  # the queue went meanwhile: made again in records
                outcomes = await self._index_records(postings, registry)
        return outcomes or []

    async def _index_records(self, postings: list[Posting], registry: Command) -> list[Outcome]:
        """_index in the older layout (IN_SEGMENTS: the queue is in segments)."""
        first = postings[0]
        keys = first.keys
        settings = self._settings
        now = self._clock.now_ms()
        inside = self.bodies_in_transaction
        before = [] if inside else [c for p in postings for c in _body_commands(p, settings)]
        tokens = [p.token for p in postings if p.token is not None]

        full = functools.partial(queue_full, self._noun)
        tidy: list[bool] = []
        plan = _post_plan(postings, tokens, now, settings, inside, self._too_large, full, tidy)

        reads: list[Command] = [
            registry,
            ("GET", keys.seq),
            ("EXISTS", keys.meta),
            ("HMGET", keys.meta, *r.POST_SETTINGS),
            ("ZRANGEBYSCORE", keys.expiry, "-inf", now, "LIMIT", 0, GC_BATCH),
            # the queue's live messages (its _max_messages): every post changes
            # keys.seq, which is watched, so the count cannot change unseen but
            # downwards (a delete, a pop: then a refusal is merely cautious)
            ("ZCOUNT", keys.expiry, f"({now}", "+inf"),
            ("HMGET", keys.meta, r.GROUPS_SINCE, seg.NEW_START),
        ]
        watch = [keys.seq, keys.meta]
        if tokens:
            reads += [("HGET", keys.idempotency, token) for token in tokens]
            reads.append(("HRANDFIELD", keys.idempotency, 5, "WITHVALUES"))
            watch.append(keys.idempotency)
        if before:  # the bodies written ahead, counted (the plan's last reply)
            reads.append(("EXISTS", *(keys.record(i) for p in postings for i in p.ids)))
        try:
            outcomes = await self._transport.transactions.optimistic(watch, reads, plan, before)
            if tidy == [True] and outcomes is not IN_SEGMENTS:
                await tidy_groups(self._transport, keys, self._clock.now_ms())
        except TooMuchContention:
            if before:  # a courtesy: they would expire anyway, unseen
                with contextlib.suppress(Unavailable):
                    dropped = [keys.record(i) for p in postings for i in p.ids]
                    await self._transport.call([("DEL", *dropped)])
            raise
        if outcomes is IN_SEGMENTS and before:
            await self._transport.call_checked(
                [("DEL", *(keys.record(i) for p in postings for i in p.ids))]
            )
        return outcomes

    async def tail_marker(self, project: str, queue: str) -> int:
        return await read_tail_marker(self._transport, self._keys(project, queue))

    async def list_messages(self, project: str, queue: str, query: ListQuery) -> MessagePage:
        keys = self._keys(project, queue)
        now, scan_limit = self._clock.now_ms(), self._settings.scan_limit
        try:
            page = None
            if self._settings.storage_layout == "segments":
                page = await self.segments.page(keys, query, now)
            if page is None:
                scanned = await scan_page(self._transport, keys, queue, query, now, scan_limit)
                if isinstance(scanned, PageScan):  # on in the segments
                    scanned = await self.segments.carry_on(keys, scanned, query)
                page = scanned
        except MarkerAhead:
            assert query.marker is not None
            raise marker_not_given_out(queue, query.marker) from None
        return self._opener.page(page, self._noun, project, queue)

    async def delete_message(
        self, project: str, queue: str, message_id: str, claim_id: str | None
    ) -> None:
        keys = self._keys(project, queue)
        now = self._clock.now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, str]:
            [row] = r.rows([message_id], replies)
            if row is None:  # in the segments, if anywhere (segments.py's id rule)
                row = forgetting.row(message_id, replies[2:])
            if row is not None and row.seq is not None:
                claimed = row.claimed(now)
                if claim_id is None and claimed:
                    return None, "claimed"
                if claim_id is not None and (not claimed or row.claim != claim_id):
                    return None, "badclaim"
            writes = forgetting.writes(replies[2:], now)
            if row is not None:  # out of the claim index and its group too
                writes += groups.forget_commands(keys, [(row.id, row.group)])
                # a group's head claimed or not due blocked its group: the next may be free now
                if row.group and not row.free(now):
                    writes.append(("SPUBLISH", keys.feed, r.FREED))
            return writes, "ok"

        forgetting = await self.segments.forgetting(keys, [message_id], with_records=True)
        reads = [*r.read_commands(keys, [message_id]), *forgetting.reads()]
        watch = [*r.message_keys(keys, message_id), *forgetting.watch()]
        outcome = await self._transport.transactions.optimistic(watch, reads, plan)
        if outcome == "claimed":
            raise MessageIsClaimed(
                f"Message {message_id} is claimed; give its claim_id to delete it."
            )
        if outcome == "badclaim":
            raise InvalidClaim(f"Claim {claim_id} does not hold message {message_id} (or expired).")
        self.parts.sweeps.note_gone(self._kind, project, queue, [message_id], now)

    async def delete_messages(self, project: str, queue: str, ids: list[str]) -> None:
        if not ids:
            return
        keys = self._keys(project, queue)
        forgetting = await self.segments.forgetting(keys, list(dict.fromkeys(ids)), True)
        now = self._clock.now_ms()
        await delete_by_ids(self._transport, forgetting, now)
        self.parts.sweeps.note_gone(self._kind, project, queue, ids, now)

    async def try_claim(
        self, project: str, queue: str, ttl: int, grace: int, limit: int
    ) -> Claim | Unclaimable:
        keys = self._keys(project, queue)
        claim_id = new_id()

        def plan_for(now: int, meta: list[Any]) -> tuple[Any, int | None]:
            # a queue that names itself as its dead-letter queue keeps its messages
            dlq = r.text(meta[1]) if meta[0] and meta[1] and r.text(meta[1]) != queue else None
            max_claims = int(meta[0]) if dlq is not None else None

            def plan(taking: Taking) -> Plan[Taken]:
                return _claim_plan(claim_id, now, ttl, grace, taking, meta, dlq)

            return plan, max_claims

        taken = await self._taker.take(keys, limit, plan_for, ("a claim", project, queue))
        if isinstance(taken, Unclaimable):
            return taken
        claim, parked, dlq = taken
        if dlq is not None:
            await self.claims.dead_letter(project, queue, dlq, claim_id, parked)
        return self._opener.claim(Unclaimable(None) if claim is None else claim)  # None: all parked

    async def pop_messages(self, project: str, queue: str, limit: int) -> list[Message]:
        keys = self._keys(project, queue)

        def plan_for(now: int, meta: list[Any]) -> tuple[Any, None]:
            def plan(taking: Taking) -> Plan[list[Message]]:
                def run(replies: list[Any]) -> tuple[list[Command] | None, list[Message]]:
                    rows = [row for row in taking.rows(replies[1:]) if row is not None]
                    if len(rows) < len(taking.candidates) or not all(row.free(now) for row in rows):
                        raise Conflicted
                    if replies[0] != meta:  # its gs came meanwhile: scan again, by group
                        raise Conflicted
                    popped = [row.message(now) for row in rows]
                    gone = groups.forget_commands(keys, [(row.id, row.group) for row in rows])
                    return [*taking.forget(replies[1:], now), *gone], popped

                return run

            return plan, None

        popped = await self._taker.take(keys, limit, plan_for, ("a pop", project, queue))
        if isinstance(popped, Unclaimable):
            return []
        now = self._clock.now_ms()
        self.parts.sweeps.note_gone(self._kind, project, queue, [m.id for m in popped], now)
        return self._opener.reveal(popped)


def _claim_plan(
    claim_id: str,
    now: int,
    ttl: int,
    grace: int,
    taking: Taking,
    meta: list[Any],
    dlq: str | None,
) -> Plan[Taken]:
    """The claim transaction; its result is (the claim, the messages parked
    for the dead-letter queue, that queue: see ClaimUpkeep.dead_letter)."""
    claim_expires = now + ttl * 1000
    keys, candidates = taking.keys, taking.candidates

    def plan(replies: list[Any]) -> tuple[list[Command] | None, Taken]:
        if replies[0] != meta:
            raise Conflicted
        writes: list[Command] = []
        claimed: list[Message] = []
        parked: list[r.Parked] = []
        for message_id, row in zip(candidates, taking.rows(replies[1:]), strict=True):
            if row is None or not row.free(now):
                raise Conflicted
            if dlq is not None and row.count >= int(meta[0]):
                # claimed too often: hold it under this claim id, unlisted,
                # until it is copied to the dead-letter queue
                dttl = int(meta[2]) if meta[2] else row.ttl
                parked.append(
                    r.Parked(
                        message_id, row.body, row.author, dttl, row.count, row.headers, row.group
                    )
                )
                writes += taking.hold(row, claim_id, claim_expires)
                continue
            keep, new_ttl = r.claim_extension(row.expires, row.created, claim_expires, grace)
            writes += taking.extend(row, claim_id, claim_expires, keep, new_ttl, row.count + 1)
            assert row.seq is not None
            claimed.append(
                Message(
                    message_id,
                    row.seq,
                    row.body,
                    new_ttl,
                    row.created,
                    claim_id,
                    row.count + 1,
                    headers=row.headers or None,
                    group=row.group or None,
                )
            )
        if not claimed:
            return writes or None, (None, parked, dlq)
        ckey = keys.claim(claim_id)
        ids = [m.id for m in claimed]
        writes.append(("HSET", ckey, *r.claim_record(ttl, grace, now, claim_expires, ids)))
        writes.append(("PEXPIREAT", ckey, claim_expires))
        writes.append(("ZADD", keys.claims, claim_expires, claim_id))
        return writes, (Claim(claim_id, ttl, grace, now, claimed), parked, dlq)

    return plan


class NaiveWatchStore(WatchStore):
    """The 2014 Zaqar-style post: one transaction per request, bodies inside
    MULTI, no serialisation in the process (everything else as WatchStore)."""

    name = "watch-naive"
    bodies_in_transaction = True

    async def _post_one(self, posting: Posting) -> list[str]:
        """Index a posting in a transaction of its own."""
        [outcome] = await self._index([posting])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
