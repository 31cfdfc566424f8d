"""What both drivers share: the Redis client, the fair connection gate, error
translation, and the read paths that involve no write (so no choice between
Lua and WATCH): queue metadata, queue listing, stats, messages by id.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import orjson
import redis.exceptions as rexc
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from feedsvc.config import Settings
from feedsvc.errors import PoolExhausted, StorageUnavailable
from feedsvc.storage.base import (
    Message,
    MessageSummary,
    QueueInfo,
    QueueStats,
    StoreCounters,
)
from feedsvc.storage.keys import QueueKeys, registry_key

# Replies that mean "Redis cannot serve right now", not "feedsvc has a bug".
_TRANSIENT_PREFIXES = (
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "READONLY",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "NOREPLICAS",
    "OOM",
)

MESSAGE_FIELDS = ("b", "t", "c", "e", "s", "k", "x", "n")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_id() -> str:
    """A message or claim id: 96 random bits as 24 lowercase hex digits."""
    return os.urandom(12).hex()


def text(raw: Any) -> str:
    """A reply element as str (replies are bytes; decode_responses is off)."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def parse_seq(raw: bytes | str | int) -> int:
    # Redis may format a large zset score in exponent notation; every seq is
    # below 2**53, so the float round trip is exact.
    if isinstance(raw, int):
        return raw
    try:
        return int(raw)
    except ValueError:
        return int(float(raw))


def connect(settings: Settings, url: str) -> Redis:
    """One client (and pool) per process.

    redis-py retries failed commands by default; a retried index script or
    transaction could write twice, so retries are off and a failure becomes a
    503 that the client may retry knowingly.
    """
    pool = ConnectionPool.from_url(
        url,
        max_connections=settings.pool_size,
        socket_timeout=settings.redis_timeout,
        socket_connect_timeout=settings.redis_connect_timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    return Redis(connection_pool=pool)


def message_from_fields(message_id: str, fields: Sequence[Any], now: int) -> Message | None:
    """A live, indexed message from HMGET MESSAGE_FIELDS, or None."""
    body, ttl, created, expires, seq, claim, claim_expires, count = fields
    if body is None or seq is None or expires is None or int(expires) <= now:
        return None
    live_claim = bool(claim) and int(claim_expires or 0) > now
    return Message(
        id=message_id,
        seq=parse_seq(seq),
        body=body,
        ttl=int(ttl),
        created_ms=int(created),
        claim_id=text(claim) if live_claim else None,
        claim_count=int(count or 0),
    )


class RedisStore:
    """Base of both drivers. Subclasses implement the writes and listing."""

    name = "redis"

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        # FIFO-fair wait for a connection: redis-py's blocking pool is not
        # fair, and its plain pool fails at once when empty.
        self._gate = asyncio.Semaphore(settings.pool_size)
        self.counters = StoreCounters()

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """Hold one of pool_size slots; translate Redis trouble to 503s."""
        try:
            async with asyncio.timeout(self._settings.pool_timeout):
                await self._gate.acquire()
        except TimeoutError:
            raise PoolExhausted("No Redis connection became free in time.") from None
        try:
            yield
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            raise StorageUnavailable(f"Redis is unavailable: {exc}") from exc
        except rexc.ResponseError as exc:
            if str(exc).startswith(_TRANSIENT_PREFIXES):
                raise StorageUnavailable(f"Redis is unavailable: {exc}") from exc
            raise
        finally:
            self._gate.release()

    async def ping(self) -> None:
        async with self._slot():
            await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose(close_connection_pool=True)

    async def get_queue_metadata(self, project: str, queue: str) -> dict[str, Any] | None:
        async with self._slot():
            created, raw = await self._redis.hmget(QueueKeys.of(project, queue).meta, ["c", "m"])
        if created is None:
            return None
        metadata: dict[str, Any] = orjson.loads(raw) if raw else {}
        return metadata

    async def list_queues(
        self, project: str, marker: str | None, limit: int, detailed: bool
    ) -> list[QueueInfo]:
        start = "-" if marker is None else f"({marker}"
        async with self._slot():
            names: list[Any] = await self._redis.zrangebylex(
                registry_key(project), start, "+", 0, limit
            )
            if not names:
                return []
            pipe = self._redis.pipeline(transaction=False)
            for raw in names:
                pipe.hget(QueueKeys.of(project, text(raw)).meta, "c")
                pipe.hget(QueueKeys.of(project, text(raw)).meta, "m")
            found = await pipe.execute()
        out = []
        for i, raw in enumerate(names):
            created, meta = found[2 * i], found[2 * i + 1]
            if created is None:  # deleted after the registry was read
                continue
            metadata = orjson.loads(meta) if (detailed and meta) else {}
            out.append(QueueInfo(text(raw), metadata if detailed else None))
        return out

    async def count_queues(self, project: str) -> int:
        async with self._slot():
            return int(await self._redis.zcard(registry_key(project)))

    async def queue_stats(self, project: str, queue: str) -> QueueStats:
        keys = QueueKeys.of(project, queue)
        now = now_ms()
        async with self._slot():
            pipe = self._redis.pipeline(transaction=False)
            pipe.zcount(keys.expiry, f"({now}", "+inf")
            pipe.zcount(keys.claimed, f"({now}", "+inf")
            total, claimed = await pipe.execute()
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
            ids: list[Any] = await self._redis.zrange(
                keys.index, offset, offset + batch - 1, desc=reverse
            )
            if not ids:
                return None
            pipe = self._redis.pipeline(transaction=False)
            for raw in ids:
                pipe.hmget(keys.message(text(raw)), ["c", "e"])
            for raw, (created, expires) in zip(ids, await pipe.execute(), strict=True):
                if expires is not None and int(expires) > now:
                    return MessageSummary(text(raw), int(created))
            offset += batch
            batch = min(batch * 4, 1024)

    async def get_messages(self, project: str, queue: str, ids: list[str]) -> list[Message]:
        keys = QueueKeys.of(project, queue)
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return []
        now = now_ms()
        async with self._slot():
            pipe = self._redis.pipeline(transaction=False)
            for message_id in wanted:
                pipe.hmget(keys.message(message_id), list(MESSAGE_FIELDS))
            rows = await pipe.execute()
        found = (
            message_from_fields(message_id, row, now)
            for message_id, row in zip(wanted, rows, strict=True)
        )
        return [m for m in found if m is not None]
