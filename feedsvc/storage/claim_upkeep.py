"""Claim upkeep both drivers share: reading, renewing and releasing a claim,
and moving messages claimed too often to the dead-letter queue.

Making a claim differs per driver (``try_claim``: a script, or a WATCH
transaction); what happens to a claim afterwards is rare and uncontended, so both drivers run
it as WATCH/MULTI transactions, which are correct against the lua driver's
scripts too (a script touching a watched key aborts the transaction).

A store holds one :class:`ClaimUpkeep` for its kind of feed (``store.claims``)
and answers ``FeedStore``'s claim calls through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from feedsvc.clock import Clock
from feedsvc.config import MessageSettings
from feedsvc.errors import (
    ClaimDoesNotHold,
    ClaimNotFound,
    MessageNotFound,
    ProjectQueuesFull,
    Unavailable,
)
from feedsvc.storage import groups, segment_claims
from feedsvc.storage import record as r
from feedsvc.storage.base import Claim
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import FeedSpace, Kind, QueueKeys
from feedsvc.storage.optimistic import Conflicted, Plan
from feedsvc.storage.quotas import ProjectQuotas
from feedsvc.storage.sealing import BodyOpener
from feedsvc.storage.segment_claims import ClaimRows, read_records
from feedsvc.storage.segment_dead_letters import copy_dead_letters
from feedsvc.storage.sweep_schedule import SweepSchedule
from feedsvc.storage.transport import Transport

log = logging.getLogger("feedsvc")
T = TypeVar("T")


class ClaimUpkeep(FeedSpace):
    """Everything a claim of one kind of feed needs after it was made: the
    transport to Redis, the claim limits (how long a dead letter may be
    stretched), the clock, the opener of sealed bodies, the project
    quotas (a dead-letter queue made here is a new queue) and the sweep
    schedule (a dead letter's record goes at its segment's review)."""

    def __init__(
        self,
        kind: Kind,
        transport: Transport,
        settings: MessageSettings,
        clock: Clock,
        opener: BodyOpener,
        quotas: ProjectQuotas,
        sweeps: SweepSchedule,
    ) -> None:
        super().__init__(kind)
        self._transport, self._settings, self._clock = transport, settings, clock
        self._opener, self._quotas, self._sweeps = opener, quotas, sweeps

    async def get_claim(self, project: str, queue: str, claim_id: str) -> Claim:
        keys = self._keys(project, queue)
        now = self._clock.now_ms()
        fields = (r.TTL, r.GRACE, r.CREATED, r.CLAIM_EXPIRES, r.HELD)
        [row] = await self._transport.call_checked([("HMGET", keys.claim(claim_id), *fields)])
        ttl, grace, created, expires, ids = row
        if expires is None or int(expires) <= now:
            raise ClaimNotFound(claim_id)
        held = r.text(ids).split() if ids else []
        found = await segment_claims.live_messages(self._transport, keys, held, now)
        messages = [m for m in found if m is not None and m.claim_id == claim_id]
        opened = self._opener.readable(messages, "a claim's read", self._noun, project, queue)
        return Claim(claim_id, int(ttl), int(grace), int(created), opened)

    async def _claim_transaction(
        self,
        keys: QueueKeys,
        claim_id: str,
        plan_for: Callable[[list[str], ClaimRows], Plan[T]],
        also: str | None = None,
    ) -> T:
        """Run a transaction over a claim and the messages it lists (and
        message also, read after them if the claim does not list it), in
        either layout (segment_claims.py: their records read first)."""
        transport = self._transport
        claim_key = keys.claim(claim_id)
        attempt = 0
        async with transport.transactions.write_slot():
            while True:
                [raw] = await transport.call_checked([("HGET", claim_key, r.HELD)])
                held = r.text(raw).split() if raw else []
                read = held if also is None or also in held else [*held, also]
                view = ClaimRows(keys, await read_records(transport, keys, read))
                watch = [claim_key, *(k for i in read for k in r.message_keys(keys, i))]
                reads: list[Command] = [("HMGET", claim_key, r.CLAIM_EXPIRES, r.HELD)]
                reads += [*r.read_commands(keys, read), *view.reads()]
                watch += view.watch()
                plan = plan_for(held, view)
                done, result = await transport.transactions.attempt(watch, reads, plan)
                if done:
                    return result  # type: ignore[return-value]
                await transport.transactions.backoff(attempt)
                attempt += 1

    async def renew_claim(
        self, project: str, queue: str, claim_id: str, ttl: int, grace: int
    ) -> None:
        keys = self._keys(project, queue)
        now = self._clock.now_ms()
        claim_expires = now + ttl * 1000

        def plan_for(held: list[str], view: ClaimRows) -> Plan[bool]:
            def plan(replies: list[Any]) -> tuple[list[Command] | None, bool]:
                expires, ids = replies[0]
                if expires is None or int(expires) <= now:
                    return None, False
                if (r.text(ids).split() if ids else []) != held:
                    raise Conflicted
                writes: list[Command] = []
                for row in view.rows(held, replies[1:]):
                    if row is None or row.claim != claim_id:
                        continue
                    # never shorten a message's life, only extend it
                    keep, new_ttl = r.claim_extension(
                        row.expires, row.created, claim_expires, grace
                    )
                    writes += view.extend(row, claim_id, claim_expires, keep, new_ttl)
                claim_key = keys.claim(claim_id)
                writes.append(
                    ("HSET", claim_key, r.TTL, ttl, r.GRACE, grace, r.CLAIM_EXPIRES, claim_expires)
                )
                writes.append(("PEXPIREAT", claim_key, claim_expires))
                writes.append(("ZADD", keys.claims, claim_expires, claim_id))
                return writes, True

            return plan

        if not await self._claim_transaction(keys, claim_id, plan_for):
            raise ClaimNotFound(claim_id)

    async def release_claim(self, project: str, queue: str, claim_id: str) -> None:
        keys = self._keys(project, queue)

        def plan_for(held: list[str], view: ClaimRows) -> Plan[None]:
            def plan(replies: list[Any]) -> tuple[list[Command] | None, None]:
                _, ids = replies[0]
                if (r.text(ids).split() if ids else []) != held:
                    raise Conflicted
                writes: list[Command] = []
                for row in view.rows(held, replies[1:]):
                    if row is not None and row.claim == claim_id:
                        writes += view.release(row)
                writes.append(("DEL", keys.claim(claim_id)))
                writes.append(("ZREM", keys.claims, claim_id))
                if len(writes) > 2:  # it freed messages: wake the queue's waiters
                    writes.append(("SPUBLISH", keys.feed, r.FREED))
                return writes, None

            return plan

        await self._claim_transaction(keys, claim_id, plan_for)

    async def release_message(
        self, project: str, queue: str, message_id: str, claim_id: str, delay: int
    ) -> None:
        """Free one message of a claim, hidden until delay has passed; a
        message of an ordered group takes the claim's later messages of its
        group with it (docs/consumers.md#ordered-groups): they may not be
        handed out before it, and a group's claimed messages stay a prefix
        of its messages, held by one claim."""
        # The claim and its messages in one transaction, as release_claim: a
        # consumer's failure path, rare beside claims and posts.
        keys = self._keys(project, queue)
        now = self._clock.now_ms()
        due = now + delay * 1000 if delay > 0 else 0

        def plan_for(held: list[str], view: ClaimRows) -> Plan[str]:
            def plan(replies: list[Any]) -> tuple[list[Command] | None, str]:
                expires, ids = replies[0]
                if (r.text(ids).split() if ids else []) != held:
                    raise Conflicted
                read = held if message_id in held else [*held, message_id]
                rows = dict(zip(read, view.rows(read, replies[1:]), strict=True))
                row = rows[message_id]
                if row is None or not row.alive(now):
                    return None, "gone"
                # a message parked for the dead-letter queue carries the claim
                # id but is not listed in the claim: it is not the consumer's
                alive = expires is not None and int(expires) > now
                if not (
                    alive and row.claim == claim_id and row.claimed(now) and message_id in held
                ):
                    return None, "notheld"
                freed = [row]
                if row.group:
                    freed += [
                        later
                        for later in rows.values()
                        if later is not None
                        and later.group == row.group
                        and (later.seq or 0) > (row.seq or 0)
                        and later.claim == claim_id
                    ]
                writes: list[Command] = []
                for each in freed:
                    writes += view.requeue(each, due)
                gone = {each.id for each in freed}
                rest = " ".join(i for i in held if i not in gone)
                writes.append(("HSET", keys.claim(claim_id), r.HELD, rest))
                # free now: wake the queue's waiters; later: they set a timer
                writes.append(("SPUBLISH", keys.feed, r.notification(0, due)))
                return writes, "ok"

            return plan

        outcome = await self._claim_transaction(keys, claim_id, plan_for, also=message_id)
        if outcome == "gone":
            raise MessageNotFound(message_id)
        if outcome == "notheld":
            raise ClaimDoesNotHold(
                f"Claim {claim_id} does not hold message {message_id} (any more): "
                "it expired, was released, or is another claim's."
            )

    async def dead_letter(
        self, project: str, queue: str, dlq: str, claim_id: str, parked: Sequence[r.Parked]
    ) -> None:
        """Move parked messages to the dead-letter queue (steps 2 and 3).

        Step 1 happened in the claim, atomically on the queue's slot: each
        message claimed too often was *parked*, held by the new claim id but
        not listed in the claim. The dead-letter queue may live in another
        slot (on a cluster, on another server), so the move is two
        transactions, copy first, then forget:

        2. copy each parked message into the dead-letter queue under its own
           id, unless a copy with that id is already there;
        3. forget the originals still held by this claim id.

        If the service stops between the steps, the parked messages are freed
        when the claim's ttl runs out and a later claim moves them again; the
        copy step then finds them already copied. So a message is never lost
        and, unless its first copy was already consumed from the dead-letter
        queue, never doubled. A failure here is logged, not raised: the claim
        itself was made.
        """
        if not parked:
            return
        source, target = self._keys(project, queue), self._keys(project, dlq)
        now = self._clock.now_ms()

        def copy(replies: list[Any]) -> tuple[list[Command] | None, None]:
            last, exists, origins_ttl, since_raw, *seqs = replies
            seq = r.parse_seq(last) if last is not None else now * 1000
            since = groups.groups_since(since_raw)
            writes: list[Command] = []
            latest = 0
            for message, have in zip(parked, seqs, strict=True):
                if have:
                    continue
                seq += 1
                author = message.author.decode()
                header = r.posted(
                    author, message.ttl, now, seq, 0, message.count, message.headers, message.group
                )
                writes += r.post_commands(target, message.id, header, message.body)
                writes.append(("ZADD", target.index, seq, message.id))
                writes.append(("ZADD", target.expiry, header.expires, message.id))
                # its group is kept: claim-indexed there as a post is
                grouped, since = groups.index_commands(
                    target, message.id, seq, message.group, since
                )
                writes += grouped
                # where it came from, for a redrive (storage/redrive.py)
                writes.append(("HSET", target.origins, message.id, queue))
                latest = max(latest, header.expires)
            if not writes:
                return None, None
            # kept while any dead letter may be (a claim can stretch one's life)
            keep = latest + (self._settings.max_claim_ttl + self._settings.max_claim_grace) * 1000
            if int(origins_ttl) < 0 or now + int(origins_ttl) < keep:
                writes.append(("PEXPIREAT", target.origins, keep))
            writes.append(("SET", target.seq, seq))
            if last is None:  # where the counter started (see list.lua's missed)
                writes.append(("HSET", target.meta, r.SEQ_BASE, now * 1000))
            if not exists:
                writes.append(("HSET", target.meta, r.CREATED, now, r.METADATA, "{}"))
            # visible there as a post's messages are: wake its followers alike
            writes.append(("SPUBLISH", target.feed, r.notification(seq, 0)))
            return writes, None

        holders = [segment_claims.holder_commands(source, m.id) for m in parked]

        def forget(replies: list[Any]) -> tuple[list[Command] | None, None]:
            return segment_claims.forget_parked(source, parked, holders, replies, claim_id, now)

        transport = self._transport
        keep_after = (self._settings.max_claim_ttl + self._settings.max_claim_grace) * 1000
        try:
            # a dead-letter queue not made yet is a new queue: listed first,
            # under the project's max_queues (over it, the messages stay)
            await self._quotas.admit(project, "queue", dlq, 0)
            if await segment_claims.in_segments(transport, target):
                review = await copy_dead_letters(transport, queue, target, parked, now, keep_after)
                if review is not None:
                    self._sweeps.note_soon(self._kind, project, dlq, review)
            else:
                await transport.transactions.optimistic(
                    [
                        target.seq,
                        target.meta,
                        target.origins,
                        *(k for m in parked for k in r.message_keys(target, m.id)),
                    ],
                    [
                        ("GET", target.seq),
                        ("EXISTS", target.meta),
                        ("PTTL", target.origins),
                        ("HGET", target.meta, r.GROUPS_SINCE),
                        *(("EXISTS", *r.message_keys(target, m.id)) for m in parked),
                    ],
                    copy,
                )
            await transport.transactions.optimistic(
                [k for m in parked for k in segment_claims.holder_keys(source, m.id)],
                [c for reads in holders for c in reads],
                forget,
            )
            self._sweeps.note_gone(self._kind, project, queue, [m.id for m in parked], now)
            await transport.call_checked([("ZADD", self._registry(project), 0, dlq)])
        except (Unavailable, ProjectQueuesFull) as exc:
            log.warning(
                "dead-lettering %d message(s) of %s to %s is left for a later claim: %s",
                len(parked),
                queue,
                dlq,
                exc,
            )
