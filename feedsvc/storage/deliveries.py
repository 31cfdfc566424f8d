"""The delivery workers' view of Redis: leases, positions, messages to send.

A worker delivers a subscription only while it holds the subscription's
lease (``P:sl:<id>``, ``SET NX PX`` with a random token, renewed while it
works); every change of the delivery state is a transaction that checks the
token first, so a worker that lost its lease (paused, cut off) can no longer
move the position. A crashed worker's lease expires and the next sweep of
any worker takes the subscription over from the position stored in Redis.
Delivery is at least once: the position moves only after the subscriber
answered, so a crash in between means the message is sent again.

The schema is in ``feedsvc.storage.subscriptions``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from feedsvc.clock import Clock
from feedsvc.storage import record as r
from feedsvc.storage import segments as seg
from feedsvc.storage import subscriptions as s
from feedsvc.storage.base import Delivery, Message, Parent, Unreadable
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import SUBSCRIBED_KEY
from feedsvc.storage.segment_pages import messages_from
from feedsvc.storage.transport import Transport


class RedisDeliveries:
    """:class:`~feedsvc.storage.base.DeliveryState` on Redis; ``keys`` maps
    a parent's kind to its key builder (queues and topics share the layout)."""

    def __init__(
        self,
        transport: Transport,
        clock: Clock,
        keys: dict[str, s.KeyBuilder],
        reveal: Callable[[list[Message], Parent], list[Message | Unreadable]],
    ) -> None:
        self._transport = transport
        self._clock = clock
        self._keys = keys
        self._reveal = reveal  # opens the bodies of encrypted feeds (or says it cannot)

    def _parent_keys(self, parent: Parent) -> Any:
        return self._keys[parent.kind](parent.project, parent.name)

    async def parents(self) -> list[Parent]:
        [members] = await self._transport.call_checked([("ZRANGE", SUBSCRIBED_KEY, 0, -1)])
        out = []
        for member in members:
            try:
                kind, project, name = orjson.loads(member)
            except (ValueError, TypeError):
                continue
            if kind in self._keys:
                out.append(Parent(kind, project, name))
        return out

    async def forget_if_empty(self, parent: Parent) -> None:
        """Drop the parent from the sweep list if it has no subscriptions; a
        create lists its parent again after writing, so removing first and
        checking after cannot lose one that arrives meanwhile."""
        subs = self._parent_keys(parent).subscriptions()
        member = orjson.dumps([parent.kind, parent.project, parent.name])
        counts: list[Command] = [("ZCARD", subs.index), ("ZCARD", subs.buried)]
        if any(int(n) for n in await self._transport.call_checked(counts)):
            return
        await self._transport.call_checked([("ZREM", SUBSCRIBED_KEY, member)])
        if any(int(n) for n in await self._transport.call_checked(counts)):
            await self._transport.call_checked([("ZADD", SUBSCRIBED_KEY, 0, member)])

    async def sweep_buried(self, parent: Parent, limit: int) -> int:
        return await s.sweep_buried(
            self._transport, self._parent_keys(parent).subscriptions(), limit
        )

    async def subscription_ids(self, parent: Parent) -> list[str]:
        subs = self._parent_keys(parent).subscriptions()
        [ids] = await self._transport.call_checked([("ZRANGE", subs.index, 0, -1)])
        return [r.text(i) for i in ids]

    async def with_work(self, parent: Parent, ids: list[str], confirmed_only: bool) -> list[str]:
        if not ids:
            return []
        keys = self._parent_keys(parent)
        subs = keys.subscriptions()
        fields = (s.EXPIRES, s.POSITION, s.CONTROL, s.CONFIRMED)
        *rows, last = await self._transport.call_checked(
            [*[("HMGET", subs.record(i), *fields) for i in ids], ("GET", keys.seq)]
        )
        seq, now = int(last or 0), self._clock.now_ms()
        out = []
        for sid, (expires, position, control, confirmed) in zip(ids, rows, strict=True):
            if expires is None or int(expires) <= now:
                continue
            may_send = not confirmed_only or (confirmed is not None and int(confirmed) == 1)
            if control is not None or (int(position or 0) < seq and may_send):
                out.append(sid)
        return out

    async def acquire(self, parent: Parent, subscription_id: str, token: str, ms: int) -> bool:
        lease = self._parent_keys(parent).subscriptions().lease(subscription_id)
        [ok] = await self._transport.call_checked([("SET", lease, token, "NX", "PX", ms)])
        return ok is not None and ok is not False

    async def _if_holder(
        self,
        parent: Parent,
        subscription_id: str,
        token: str,
        writes: list[Command],
        record: str | None = None,
    ) -> bool:
        """Run writes if token holds the lease (and record, if named, exists)."""
        subs = self._parent_keys(parent).subscriptions()
        lease = subs.lease(subscription_id)
        watch = [lease] if record is None else [lease, record]
        reads: list[Command] = [("GET", lease)]
        if record is not None:
            # and still listed: a deleted queue's subscriptions leave P:subs
            # at once, their records only when swept (not watched: creates
            # write P:subs; a delete that overtakes this write costs at most
            # this one, the next finds it gone)
            reads += [("EXISTS", record), ("ZSCORE", subs.index, subscription_id)]

        def plan(replies: list[Any]) -> Any:
            if replies[0] is None or r.text(replies[0]) != token:
                return None, False
            if record is not None and (not int(replies[1]) or replies[2] is None):
                return None, False
            return writes, True

        result: bool = await self._transport.transactions.optimistic(watch, reads, plan)
        return result

    async def renew(self, parent: Parent, subscription_id: str, token: str, ms: int) -> bool:
        lease = self._parent_keys(parent).subscriptions().lease(subscription_id)
        return await self._if_holder(parent, subscription_id, token, [("PEXPIRE", lease, ms)])

    async def release(self, parent: Parent, subscription_id: str, token: str) -> None:
        lease = self._parent_keys(parent).subscriptions().lease(subscription_id)
        await self._if_holder(parent, subscription_id, token, [("DEL", lease)])

    async def last_seq(self, parent: Parent) -> int:
        [seq] = await self._transport.call_checked([("GET", self._parent_keys(parent).seq)])
        return int(seq or 0)

    async def parent_metadata(self, parent: Parent) -> dict[str, Any]:
        [raw] = await self._transport.call_checked(
            [("HGET", self._parent_keys(parent).meta, r.METADATA)]
        )
        metadata: dict[str, Any] = orjson.loads(raw) if raw else {}
        return metadata

    async def messages_after(
        self, parent: Parent, position: int, limit: int
    ) -> list[tuple[int, Message | Unreadable | None]]:
        keys = self._parent_keys(parent)
        entries, new_start = await self._transport.call_checked(
            [("ZRANGEBYSCORE", keys.index, f"({position}", "+inf", "WITHSCORES",
              "LIMIT", 0, limit), ("HGET", keys.meta, seg.NEW_START)]
        )  # fmt: skip
        pairs = [(r.text(i), r.parse_seq(seq)) for i, seq in r.pairs(entries)]
        now = self._clock.now_ms()
        found: list[tuple[int, Message | None]]
        if pairs:
            ids = [i for i, _ in pairs]
            replies = await self._transport.call_checked(r.read_commands(keys, ids))
            messages = r.live_messages(ids, replies, now)
            found = [(seq, m) for (_, seq), m in zip(pairs, messages, strict=True)]
        elif new_start is not None:
            # past the older layout's messages: the queue's segments (segments.py)
            start = max(position + 1, int(new_start))
            found = await messages_from(self._transport, keys, start, limit, now)
        else:
            return []
        opened = iter(self._reveal([m for _, m in found if m is not None], parent))
        return [(seq, None if m is None else next(opened)) for seq, m in found]

    async def settle(
        self,
        parent: Parent,
        subscription_id: str,
        token: str,
        delivery: Delivery,
        outcome: str,
        clear_control: bool = False,
    ) -> bool:
        record = self._parent_keys(parent).subscriptions().record(subscription_id)
        fields: dict[str, Any] = {
            s.POSITION: delivery.position,
            s.ATTEMPTS: delivery.attempts,
            s.DUE: delivery.due_ms,
        }
        if delivery.last_error is not None:
            fields[s.LAST_ERROR] = delivery.last_error[:500]
        writes: list[Command] = []
        if clear_control:
            writes.append(("HDEL", record, s.CONTROL))
        # only on a subscription that still exists: never resurrect a deleted one
        writes = [("HSET", record, *r.flat(fields)), *writes]
        if outcome == "delivered":
            writes.append(("HINCRBY", record, s.DELIVERED, 1))
        elif outcome == "failed":
            writes.append(("HINCRBY", record, s.FAILURES, 1))
        return await self._if_holder(parent, subscription_id, token, writes, record)

    async def note_failure(
        self, parent: Parent, subscription_id: str, token: str, error: str, due_ms: int
    ) -> bool:
        record = self._parent_keys(parent).subscriptions().record(subscription_id)
        writes: list[Command] = [
            ("HSET", record, s.LAST_ERROR, error[:500], s.DUE, due_ms),
            ("HINCRBY", record, s.ATTEMPTS, 1),
        ]
        return await self._if_holder(parent, subscription_id, token, writes, record)
