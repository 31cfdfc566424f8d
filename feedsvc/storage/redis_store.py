"""What both drivers share: their lifecycle and the paths that involve no
choice between Lua and WATCH — queue metadata, queue listing, stats,
messages by id — plus claim upkeep (inherited from ``claim_upkeep.py``).

A driver is a :class:`RedisStore` subclass that adds the writes and the
listing (``lua_store.py``, ``watch_store.py``). It talks to Redis only
through its :class:`~feedsvc.storage.transport.Transport`, reads and writes
records only through ``record.py``, and takes the time from its clock.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import orjson

from feedsvc.clock import Clock
from feedsvc.config import Settings
from feedsvc.errors import QueueNotFound
from feedsvc.storage import record as r
from feedsvc.storage.base import (
    RESERVED_FIELDS,
    Follow,
    Message,
    MessageSummary,
    QueueInfo,
    QueueStats,
    StoreCounters,
    reserved_fields,
)
from feedsvc.storage.claim_upkeep import ClaimUpkeep
from feedsvc.storage.coalescer import Command
from feedsvc.storage.deliveries import RedisDeliveries
from feedsvc.storage.keys import QueueKeys, registry_key
from feedsvc.storage.subscriptions import RedisSubscriptions
from feedsvc.storage.transport import Transport

log = logging.getLogger("feedsvc")


def new_id() -> str:
    """A message or claim id: 96 random bits as 24 lowercase hex digits."""
    return os.urandom(12).hex()


def idempotency_token(client_id: str, key: str) -> str:
    """The field under which a client's Idempotency-Key is remembered."""
    return hashlib.sha1(f"{client_id}\n{key}".encode()).hexdigest()


class RedisStore(ClaimUpkeep):
    """Base of both drivers. Subclasses implement the writes and listing."""

    name = "redis"

    def __init__(self, transport: Transport, settings: Settings, clock: Clock) -> None:
        self._transport = transport
        self._settings = settings
        self._clock = clock
        # subscriptions hang off queues; a topic store passes its own key builder
        self._subscriptions = RedisSubscriptions(transport, clock, "queue", QueueKeys.of)
        self._deliveries = RedisDeliveries(transport, clock, {"queue": QueueKeys.of})

    @property
    def subscriptions(self) -> RedisSubscriptions:
        return self._subscriptions

    @property
    def deliveries(self) -> RedisDeliveries:
        return self._deliveries

    @property
    def counters(self) -> StoreCounters:
        return self._transport.counters

    async def open(self) -> None:
        self._transport.open()

    def follow(self, project: str, queue: str) -> AbstractAsyncContextManager[Follow]:
        return self._transport.notifier.follow(QueueKeys.of(project, queue).feed)

    async def ping(self) -> None:
        await self._transport.ping()

    def stats(self) -> dict[str, float]:
        return self._transport.stats()

    async def close(self) -> None:
        await self._transport.close()

    def _claim_scan_limit(self) -> int:
        """How many index entries a claim or pop may look at to find free messages."""
        return self._settings.scan_limit * 10

    async def _registry_add(self, project: str, queue: str) -> Command:
        """List the queue in its project's registry, as the first read of a
        transaction on the queue's slot: on one server the ZADD rides along
        with those reads; on a cluster the registry lives in another slot, so
        it is sent by itself first and a PING keeps its place among the reads.
        """
        add: Command = ("ZADD", registry_key(project), 0, queue)
        if not self._transport.cluster:
            return add
        await self._transport.call_checked([add])
        return ("PING",)

    async def get_queue_metadata(self, project: str, queue: str) -> dict[str, Any] | None:
        meta = QueueKeys.of(project, queue).meta
        [(created, raw)] = await self._transport.call_checked(
            [("HMGET", meta, r.CREATED, r.METADATA)]
        )
        if created is None:
            return None
        metadata: dict[str, Any] = orjson.loads(raw) if raw else {}
        return metadata

    async def list_queues(
        self, project: str, marker: str | None, limit: int, detailed: bool
    ) -> list[QueueInfo]:
        """A page of the project's queues by name, skipping registry entries
        whose queue is gone (deleted meanwhile), so a page is short only at the end."""
        out: list[QueueInfo] = []
        start = "-" if marker is None else f"({marker}"
        while len(out) < limit:
            want = limit - len(out)
            [names] = await self._transport.call_checked(
                [("ZRANGEBYLEX", registry_key(project), start, "+", "LIMIT", 0, want)]
            )
            if not names:
                break
            rows = await self._transport.call_checked(
                [
                    ("HMGET", QueueKeys.of(project, r.text(raw)).meta, r.CREATED, r.METADATA)
                    for raw in names
                ]
            )
            for raw, (created, meta) in zip(names, rows, strict=True):
                if created is None:
                    continue
                metadata = (orjson.loads(meta) if meta else {}) if detailed else None
                out.append(QueueInfo(r.text(raw), metadata))
            if len(names) < want:
                break
            start = f"({r.text(names[-1])}"
        return out

    async def count_queues(self, project: str) -> int:
        [count] = await self._transport.call_checked([("ZCARD", registry_key(project))])
        return int(count)

    async def queue_stats(self, project: str, queue: str) -> QueueStats:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()
        total, claimed = await self._transport.call_checked(
            [
                ("ZCOUNT", keys.expiry, f"({now}", "+inf"),
                ("ZCOUNT", keys.claimed, f"({now}", "+inf"),
            ]
        )
        oldest = newest = None
        if total:
            oldest = await self._live_end(keys, now, reverse=False)
            newest = await self._live_end(keys, now, reverse=True)
        return QueueStats(
            claimed=int(claimed),
            free=max(0, int(total) - int(claimed)),
            total=int(total),
            oldest=oldest,
            newest=newest,
        )

    async def _live_end(self, keys: QueueKeys, now: int, reverse: bool) -> MessageSummary | None:
        """The first live message from the head (or the tail) of the index."""
        offset, batch = 0, 16
        while True:
            order = ("REV",) if reverse else ()
            [ids] = await self._transport.call_checked(
                [("ZRANGE", keys.index, offset, offset + batch - 1, *order)]
            )
            if not ids:
                return None
            rows = await self._transport.call_checked(
                [("HMGET", keys.message(r.text(i)), r.CREATED, r.EXPIRES) for i in ids]
            )
            for raw, (created, expires) in zip(ids, rows, strict=True):
                if expires is not None and int(expires) > now:
                    return MessageSummary(r.text(raw), int(created))
            offset += batch
            batch = min(batch * 4, 1024)

    async def get_messages(self, project: str, queue: str, ids: list[str]) -> list[Message]:
        keys = QueueKeys.of(project, queue)
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return []
        now = self._clock.now_ms()
        rows = await self._transport.call_checked(
            [("HMGET", keys.message(i), *r.ROW) for i in wanted]
        )
        found = (r.live_message(i, row, now) for i, row in zip(wanted, rows, strict=True))
        return [m for m in found if m is not None]

    # Queue metadata changes are rare, uncontended writes: both drivers run
    # them as WATCH/MULTI transactions, which are correct against the lua
    # driver's scripts too (a script touching a watched key aborts the
    # transaction).
    async def update_queue_metadata(
        self,
        project: str,
        queue: str,
        change: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> dict[str, Any]:
        keys = QueueKeys.of(project, queue)

        def plan(replies: list[Any]) -> tuple[list[Command] | None, dict[str, Any] | None]:
            created, raw = replies[0]
            if created is None:
                return None, None
            updated = change(orjson.loads(raw) if raw else {})
            fields = reserved_fields(updated)
            writes: list[Command] = [
                ("HSET", keys.meta, r.METADATA, orjson.dumps(updated), *r.flat(fields))
            ]
            stale = [f for f in RESERVED_FIELDS.values() if f not in fields]
            if stale:
                writes.append(("HDEL", keys.meta, *stale))
            return writes, updated

        reads: list[Command] = [("HMGET", keys.meta, r.CREATED, r.METADATA)]
        result = await self._transport.optimistic([keys.meta], reads, plan)
        if result is None:
            raise QueueNotFound(queue)
        return result
