"""Subscriptions and their delivery state, in Redis, for queues (and, with
another key builder, topics).

Schema (``P`` = the parent's prefix, e.g. ``fs:{<project>/<queue>}``, so a
subscription shares its queue's hash tag and cluster slot)::

    key             type    contents
    --------------  ------  ---------------------------------------------------
    P:subs          zset    subscription id -> 0 (listed by id, as Zaqar does)
    P:subu          hash    subscriber URI -> subscription id (uniqueness)
    P:sg:<sha1>     string  the guard of one subscriber's P:subu entry: every
                            transaction that writes the entry WATCHes it and
                            sets and deletes it (so it never stays), so only
                            writes about the same subscriber contend
    P:s:<id>        hash    u = subscriber, t = ttl s, c = created ms,
                            e = expires ms, o = options (JSON), k = confirmed,
                            and the delivery state: p = position (seq of the
                            last message handled), a = failed attempts at the
                            next one, d = its next attempt's due ms,
                            n = delivered, f = given up, r = last error,
                            x = a confirmation request to send first;
                            PEXPIREAT e
    P:sl:<id>       string  the delivering worker's token; PX = its lease
    P:subx          zset    ids of subscriptions deleted with their queue (or
                            purged) whose P:s:<id> and P:sl:<id> are still to
                            be swept away, in bounded steps
    fs:subscribed   zset    JSON [kind, project, name] of every parent with
                            subscriptions, score 0: the workers' sweep list

The delivery state lives in the subscription's own hash, so it goes when the
subscription expires or is deleted, and a worker that takes over a lease
continues where the last one stopped (position, attempts, back-off).

Subscriptions change rarely and never contend with posts, so both drivers
write them with WATCH/MULTI/EXEC transactions (as queue metadata). A
subscription is live while its id is in ``P:subs`` and its ``e`` has not
passed: one whose ``e`` has passed is gone for every read, exactly, even
before Redis expires its key; its id is pruned from ``P:subs`` by the next
listing and its ``P:subu`` entry is taken over by the next create.

Deleting a queue (or purging its subscriptions) is one transaction whatever
their number: their ids move from ``P:subs`` to ``P:subx`` and ``P:subu``
goes, so at once none is live (a read, a create of the same subscriber, a
delivery's next write all see it gone) and a queue made again under the
name starts with none. The records are then deleted ``SWEEP_BATCH`` at a
time: up to ``PURGE_STEP`` in the request, the rest by the delivery
workers' sweep (the parent stays in ``fs:subscribed`` until ``P:subx`` is
empty), so the request's work is bounded and a restart loses no progress.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from feedsvc.clock import Clock
from feedsvc.errors import SubscriptionExists, SubscriptionNotFound
from feedsvc.storage.base import Delivery, NewSubscription, Parent, Subscription
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import SUBSCRIBED_KEY, QueueKeys, SubscriptionKeys
from feedsvc.storage.record import flat, text
from feedsvc.storage.transport import Transport

SUBSCRIBER = "u"
TTL = "t"
CREATED = "c"
EXPIRES = "e"
OPTIONS = "o"
CONFIRMED = "k"
POSITION = "p"
ATTEMPTS = "a"
DUE = "d"
DELIVERED = "n"
FAILURES = "f"
LAST_ERROR = "r"
CONTROL = "x"
ROW = (SUBSCRIBER, TTL, CREATED, EXPIRES, OPTIONS, CONFIRMED, POSITION, ATTEMPTS, DUE,
       DELIVERED, FAILURES, LAST_ERROR, CONTROL)  # fmt: skip
# Attempts of a transaction whose pre-read was overtaken before giving up (503).
PREREAD_ATTEMPTS = 20
# Records of deleted subscriptions removed per command, and at most per
# request that deleted them (the delivery sweep removes the rest).
SWEEP_BATCH = 200
PURGE_STEP = 1000

KeyBuilder = Callable[[str, str], QueueKeys]


def new_subscription_id() -> str:
    """A UUID, as Zaqar's ids are."""
    return str(uuid.UUID(bytes=os.urandom(16), version=4))


def read_subscription(sid: str, source: str, row: list[Any], now: int) -> Subscription | None:
    """The subscription in an HMGET of ROW, or None if absent or expired."""
    if row[0] is None or row[3] is None or int(row[3]) <= now:
        return None
    (subscriber, ttl, created, expires, options, confirmed, position, attempts, due,
     delivered, failures, error, control) = row  # fmt: skip
    return Subscription(
        id=sid,
        source=source,
        subscriber=text(subscriber),
        ttl=int(ttl),
        created_ms=int(created),
        expires_ms=int(expires),
        options=orjson.loads(options) if options else {},
        confirmed=confirmed is not None and int(confirmed) == 1,
        delivery=Delivery(
            position=int(position or 0),
            attempts=int(attempts or 0),
            due_ms=int(due or 0),
            delivered=int(delivered or 0),
            failures=int(failures or 0),
            last_error=text(error) if error else None,
            control=bytes(control) if control else None,
        ),
    )


def _touch(keys: SubscriptionKeys, subscriber: str) -> list[Command]:
    """The writes that make every transaction WATCHing subscriber's guard
    fail (each write to a key does), leaving no key behind."""
    guard = keys.guard(subscriber)
    return [("SET", guard, "1"), ("DEL", guard)]


async def sweep_buried(transport: Transport, keys: SubscriptionKeys, limit: int) -> int:
    """Delete the records (and leases) of up to about limit buried
    subscriptions; how many are left (0: none). Each step is idempotent, so
    sweepers may meet and a step cut short is done again by the next."""
    done = 0
    while done < limit:
        [ids] = await transport.call_checked([("ZRANGE", keys.buried, 0, SWEEP_BATCH - 1)])
        if not ids:
            return 0
        names = [text(i) for i in ids]
        await transport.call_checked(
            [
                ("DEL", *[keys.record(i) for i in names], *[keys.lease(i) for i in names]),
                ("ZREM", keys.buried, *names),
            ]
        )
        done += len(names)
    [left] = await transport.call_checked([("ZCARD", keys.buried)])
    return int(left)


class RedisSubscriptions:
    """:class:`~feedsvc.storage.base.SubscriptionStore` on Redis, for one
    kind of parent: ``keys`` builds a parent's keys from (project, name)."""

    def __init__(self, transport: Transport, clock: Clock, kind: str, keys: KeyBuilder) -> None:
        self._transport = transport
        self._clock = clock
        self._kind = kind
        self._keys = keys

    def _subs(self, parent: Parent) -> SubscriptionKeys:
        return self._keys(parent.project, parent.name).subscriptions()

    async def register(self, parent: Parent) -> None:
        """List the parent in the workers' sweep list (idempotent; its own slot)."""
        member = orjson.dumps([parent.kind, parent.project, parent.name])
        await self._transport.call_checked([("ZADD", SUBSCRIBED_KEY, 0, member)])

    async def _live_id(self, keys: SubscriptionKeys, subscriber: str) -> tuple[Any, bool]:
        """(what P:subu holds for subscriber, whether it names a live subscription)."""
        [sid] = await self._transport.call_checked([("HGET", keys.subscribers, subscriber)])
        if sid is None:
            return None, False
        expires, member = await self._transport.call_checked(
            [("HGET", keys.record(text(sid)), EXPIRES), ("ZSCORE", keys.index, sid)]
        )
        live = member is not None and expires is not None and int(expires) > self._clock.now_ms()
        return sid, live

    async def create(
        self, parent: Parent, subscriber: str, ttl: int, options: dict[str, Any]
    ) -> NewSubscription:
        keys = self._subs(parent)
        parent_keys = self._keys(parent.project, parent.name)
        # listed before and after: a sweep that drops an empty parent between
        # the two sees this subscription when it checks again (see forget_if_empty)
        await self.register(parent)
        for _ in range(PREREAD_ATTEMPTS):
            seen, live = await self._live_id(keys, subscriber)
            if live:
                sid = text(seen)
                [confirmed] = await self._transport.call_checked(
                    [("HGET", keys.record(sid), CONFIRMED)]
                )
                return NewSubscription(sid, False, confirmed is not None and int(confirmed) == 1)
            now = self._clock.now_ms()
            sid = new_subscription_id()
            expires = now + ttl * 1000

            def plan(
                replies: list[Any],
                seen: Any = seen,
                sid: str = sid,
                now: int = now,
                expires: int = expires,
            ) -> Any:
                current, last_seq = replies
                if current != seen:
                    return None, None  # overtaken: read again
                fields = {SUBSCRIBER: subscriber, TTL: ttl, CREATED: now, EXPIRES: expires,
                          OPTIONS: orjson.dumps(options), CONFIRMED: 0,
                          POSITION: int(last_seq or 0)}  # fmt: skip
                writes: list[Command] = [
                    ("HSET", keys.record(sid), *flat(fields)),
                    ("PEXPIREAT", keys.record(sid), expires),
                    ("ZADD", keys.index, 0, sid),
                    ("HSET", keys.subscribers, subscriber, sid),
                    *_touch(keys, subscriber),
                ]
                if seen is not None:
                    writes += [("DEL", keys.record(text(seen))), ("ZREM", keys.index, seen)]
                return writes, sid

            made = await self._transport.transactions.optimistic(
                [keys.guard(subscriber)],
                [("HGET", keys.subscribers, subscriber), ("GET", parent_keys.seq)],
                plan,
            )
            if made is not None:
                await self.register(parent)
                return NewSubscription(made, True, False)
        raise SubscriptionExists()

    async def get(self, parent: Parent, subscription_id: str) -> Subscription:
        keys = self._subs(parent)
        row, member = await self._transport.call_checked(
            [("HMGET", keys.record(subscription_id), *ROW), ("ZSCORE", keys.index, subscription_id)]
        )
        found = read_subscription(subscription_id, parent.name, row, self._clock.now_ms())
        if found is None or member is None:
            raise SubscriptionNotFound(subscription_id)
        return found

    async def list(self, parent: Parent, marker: str | None, limit: int) -> list[Subscription]:
        """A page by id after marker, skipping (and pruning) expired entries."""
        keys = self._subs(parent)
        out: list[Subscription] = []
        start = "-" if marker is None else f"({marker}"
        while len(out) < limit:
            want = limit - len(out)
            [ids] = await self._transport.call_checked(
                [("ZRANGEBYLEX", keys.index, start, "+", "LIMIT", 0, want)]
            )
            if not ids:
                break
            rows = await self._transport.call_checked(
                [("HMGET", keys.record(text(i)), *ROW) for i in ids]
            )
            now = self._clock.now_ms()
            dead = []
            for raw, row in zip(ids, rows, strict=True):
                found = read_subscription(text(raw), parent.name, row, now)
                if found is None:
                    dead.append(raw)
                else:
                    out.append(found)
            if dead:
                # an id never comes back, so removing a dead one is always right
                await self._transport.call_checked([("ZREM", keys.index, *dead)])
            if len(ids) < want:
                break
            start = f"({text(ids[-1])}"
        return out

    async def update(
        self,
        parent: Parent,
        subscription_id: str,
        subscriber: str | None,
        ttl: int | None,
        options: dict[str, Any] | None,
    ) -> None:
        keys = self._subs(parent)
        record = keys.record(subscription_id)
        for _ in range(PREREAD_ATTEMPTS):
            seen, live = (None, False)
            if subscriber is not None:
                seen, live = await self._live_id(keys, subscriber)
                if live and text(seen) != subscription_id:
                    raise SubscriptionExists()
            now = self._clock.now_ms()
            reads: list[Command] = [
                ("HMGET", record, SUBSCRIBER, EXPIRES),
                ("ZSCORE", keys.index, subscription_id),
            ]
            if subscriber is not None:
                reads.append(("HGET", keys.subscribers, subscriber))

            def plan(replies: list[Any], seen: Any = seen, now: int = now) -> Any:
                (old, expires), member, *mapped = replies
                if old is None or expires is None or int(expires) <= now or member is None:
                    return None, "missing"
                if mapped and mapped[0] != seen:
                    return None, "again"
                fields: dict[str, Any] = {}
                writes: list[Command] = []
                if subscriber is not None and subscriber != text(old):
                    fields[SUBSCRIBER] = subscriber
                    writes += [
                        ("HDEL", keys.subscribers, old),
                        ("HSET", keys.subscribers, subscriber, subscription_id),
                        *_touch(keys, text(old)),
                        *_touch(keys, subscriber),
                    ]
                if options is not None:
                    fields[OPTIONS] = orjson.dumps(options)
                if ttl is not None:
                    fields[TTL] = ttl
                    fields[EXPIRES] = now + ttl * 1000
                    writes.append(("PEXPIREAT", record, now + ttl * 1000))
                if not fields:
                    return None, "done"
                return [("HSET", record, *flat(fields)), *writes], "done"

            watch = [record] if subscriber is None else [record, keys.guard(subscriber)]
            outcome = await self._transport.transactions.optimistic(watch, reads, plan)
            if outcome == "missing":
                raise SubscriptionNotFound(subscription_id)
            if outcome == "done":
                return
        raise SubscriptionExists()

    async def delete(self, parent: Parent, subscription_id: str) -> None:
        keys = self._subs(parent)
        record = keys.record(subscription_id)
        for _ in range(PREREAD_ATTEMPTS):
            [subscriber] = await self._transport.call_checked([("HGET", record, SUBSCRIBER)])
            reads: list[Command] = [("HGET", record, SUBSCRIBER)]
            if subscriber is not None:
                reads.append(("HGET", keys.subscribers, subscriber))

            def plan(replies: list[Any], subscriber: Any = subscriber) -> Any:
                if replies[0] != subscriber:
                    return None, False
                writes: list[Command] = [
                    ("DEL", record, keys.lease(subscription_id)),
                    ("ZREM", keys.index, subscription_id),
                ]
                if (
                    len(replies) > 1
                    and replies[1] is not None
                    and (text(replies[1]) == subscription_id)
                ):
                    writes += [
                        ("HDEL", keys.subscribers, subscriber),
                        *_touch(keys, text(subscriber)),
                    ]
                return writes, True

            watch = [record] if subscriber is None else [record, keys.guard(text(subscriber))]
            if await self._transport.transactions.optimistic(watch, reads, plan):
                return

    async def _set_if_live(self, parent: Parent, subscription_id: str, fields: Any) -> None:
        """HSET fields (a function of the current row) on a live subscription."""
        record = self._subs(parent).record(subscription_id)
        now = self._clock.now_ms()

        def plan(replies: list[Any]) -> Any:
            row, member = replies
            found = read_subscription(subscription_id, parent.name, row, now)
            if found is None or member is None:
                return None, False
            return [("HSET", record, *flat(fields(found)))], True

        reads: list[Command] = [
            ("HMGET", record, *ROW),
            ("ZSCORE", self._subs(parent).index, subscription_id),
        ]
        if not await self._transport.transactions.optimistic([record], reads, plan):
            raise SubscriptionNotFound(subscription_id)

    async def confirm(
        self, parent: Parent, subscription_id: str, confirmed: bool, control: bytes | None
    ) -> None:
        [last_seq] = await self._transport.call_checked(
            [("GET", self._keys(parent.project, parent.name).seq)]
        )

        def fields(found: Subscription) -> dict[str, Any]:
            out: dict[str, Any] = {CONFIRMED: int(confirmed)}
            if confirmed and not found.confirmed:
                # as Zaqar: what was posted before the confirmation is not sent
                out.update({POSITION: int(last_seq or 0), ATTEMPTS: 0, DUE: 0})
            if control is not None:
                out[CONTROL] = control
            return out

        await self._set_if_live(parent, subscription_id, fields)

    async def request_confirmation(
        self, parent: Parent, subscription_id: str, control: bytes
    ) -> None:
        await self._set_if_live(parent, subscription_id, lambda _found: {CONTROL: control})

    async def purge(self, parent: Parent) -> None:
        """Delete every subscription of the parent at once, whatever their
        number (see the module docstring): bounded work here, the rest swept."""
        keys = self._subs(parent)
        [count] = await self._transport.call_checked([("ZCARD", keys.index)])
        if int(count):
            await self.register(parent)  # first: the sweep must find what is left
        await self._transport.transaction(
            [
                ("ZUNIONSTORE", keys.buried, 2, keys.buried, keys.index),
                ("DEL", keys.index, keys.subscribers),
            ]
        )
        await sweep_buried(self._transport, keys, PURGE_STEP)
