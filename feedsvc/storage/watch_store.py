"""The watch driver: WATCH / MULTI / EXEC with bounded, jittered retries.

No server-side scripting at all, so that it measures what the lua driver
buys. Each write is the classic optimistic transaction, done in the fewest
round trips the protocol allows: ``WATCH`` and the reads travel in one
write, ``MULTI ... EXEC`` in a second. A conflicting transaction makes EXEC
answer nil; the attempt is counted in ``counters.watch_retries`` and repeated
after a jittered backoff, at most ``watch_retries`` times, then the request
gets a 503. A transaction that was not executed wrote nothing, so retrying it
cannot write twice.

Transactions run on a connection taken from the pool directly; a connection
whose conversation was interrupted (error, timeout, cancelled request) is
closed, never returned with unread replies.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from redis.asyncio.connection import AbstractConnection

from feedsvc.errors import InvalidClaim, MessageIsClaimed, TooMuchContention
from feedsvc.storage.base import ListQuery, Message, MessagePage, NewMessage
from feedsvc.storage.keys import QueueKeys, registry_key
from feedsvc.storage.redis_store import (
    MESSAGE_FIELDS,
    RedisStore,
    message_from_fields,
    new_id,
    now_ms,
    text,
)

T = TypeVar("T")
Command = tuple[Any, ...]
# A plan looks at the replies to the reads and returns the commands to run in
# MULTI/EXEC (None: write nothing) and the operation's result.
Plan = Callable[[list[Any]], tuple[list[Command] | None, T]]

GC_BATCH = 100
DROP_BATCH = 500
BACKOFF_BASE = 0.0005
BACKOFF_CAP = 0.05


def gc_commands(keys: QueueKeys, dead: Sequence[bytes], now: int) -> list[Command]:
    """The writes that forget expired messages and claims (see _lib.lua)."""
    commands: list[Command] = []
    if dead:
        commands.append(("DEL", *(keys.message(text(i)) for i in dead)))
        commands.append(("ZREM", keys.index, *dead))
        commands.append(("ZREM", keys.expiry, *dead))
        commands.append(("ZREM", keys.claimed, *dead))
    commands.append(("ZREMRANGEBYSCORE", keys.claimed, "-inf", now))
    commands.append(("ZREMRANGEBYSCORE", keys.claims, "-inf", now))
    return commands


class WatchStore(RedisStore):
    name = "watch"

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[AbstractConnection]:
        pool = self._redis.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        finished = False
        try:
            yield conn
            finished = True
        finally:
            if not finished:
                await conn.disconnect(nowait=True)
            await pool.release(conn)

    @staticmethod
    async def _send(conn: AbstractConnection, *commands: Command) -> list[Any]:
        """Send commands in one write and read one reply each."""
        await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        return [await conn.read_response() for _ in commands]

    async def _optimistic(self, watch: Sequence[str], reads: Sequence[Command], plan: Plan[T]) -> T:
        settings = self._settings
        for attempt in range(settings.watch_retries):
            async with self._connection() as conn:
                replies = await self._send(conn, ("WATCH", *watch), *reads)
                writes, result = plan(replies[1:])
                if writes is None:
                    await self._send(conn, ("UNWATCH",))
                    return result
                done = await self._send(conn, ("MULTI",), *writes, ("EXEC",))
                executed = done[-1]
                if executed is not None:
                    for reply in executed:
                        if isinstance(reply, Exception):
                            raise reply
                    return result
            self.counters.watch_retries += 1
            ceiling = min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)
            await asyncio.sleep(random.uniform(0, ceiling))
        self.counters.watch_conflicts_exhausted += 1
        raise TooMuchContention(
            f"Gave up after {settings.watch_retries} conflicting attempts; retry."
        )

    async def create_queue(self, project: str, queue: str, metadata: dict[str, Any]) -> bool:
        keys = QueueKeys.of(project, queue)
        now = now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, bool]:
            if replies[1]:
                return None, False
            return [("HSET", keys.meta, "c", now, "m", orjson.dumps(metadata))], True

        async with self._slot():
            return await self._optimistic(
                [keys.meta],
                [("ZADD", registry_key(project), 0, queue), ("EXISTS", keys.meta)],
                plan,
            )

    async def delete_queue(self, project: str, queue: str) -> None:
        keys = QueueKeys.of(project, queue)
        async with self._slot():
            await self._redis.zrem(registry_key(project), queue)
            while True:
                ids: list[Any] = await self._redis.zrange(keys.index, 0, DROP_BATCH - 1)
                if not ids:
                    break
                pipe = self._redis.pipeline(transaction=True)
                pipe.delete(*(keys.message(text(i)) for i in ids))
                pipe.zrem(keys.index, *ids)
                pipe.zrem(keys.expiry, *ids)
                pipe.zrem(keys.claimed, *ids)
                await pipe.execute()
            while True:
                claims: list[Any] = await self._redis.zrange(keys.claims, 0, DROP_BATCH - 1)
                if not claims:
                    break
                pipe = self._redis.pipeline(transaction=True)
                pipe.delete(*(keys.claim(text(c)) for c in claims))
                pipe.zrem(keys.claims, *claims)
                await pipe.execute()
            await self._redis.delete(*keys.fixed())

    async def post_messages(
        self, project: str, queue: str, client_id: str, messages: list[NewMessage]
    ) -> list[str]:
        keys = QueueKeys.of(project, queue)
        ids = [new_id() for _ in messages]
        settings = self._settings
        now = now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, list[str]]:
            _, last, exists, (dttl, ddelay), dead = replies
            default_ttl = int(dttl or settings.default_message_ttl)
            default_delay = int(ddelay or 0)
            seq = int(last) if last is not None else now * 1000
            writes = gc_commands(keys, dead, now)
            if not exists:
                writes.append(("HSET", keys.meta, "c", now))
            for message_id, message in zip(ids, messages, strict=True):
                seq += 1
                ttl = default_ttl if message.ttl is None else message.ttl
                delay = default_delay if message.delay is None else message.delay
                expires = now + ttl * 1000
                due = now + delay * 1000 if delay > 0 else 0
                key = keys.message(message_id)
                writes.append(
                    ("HSET", key, "b", message.body, "u", client_id, "s", seq,
                     "t", ttl, "c", now, "e", expires, "d", due,
                     "k", "", "x", 0, "n", 0)
                )  # fmt: skip
                writes.append(("PEXPIREAT", key, expires))
                writes.append(("ZADD", keys.index, seq, message_id))
                writes.append(("ZADD", keys.expiry, expires, message_id))
            writes.append(("SET", keys.seq, seq))
            return writes, ids

        reads: list[Command] = [
            ("ZADD", registry_key(project), 0, queue),
            ("GET", keys.seq),
            ("EXISTS", keys.meta),
            ("HMGET", keys.meta, "dttl", "ddelay"),
            ("ZRANGEBYSCORE", keys.expiry, "-inf", now, "LIMIT", 0, GC_BATCH),
        ]
        async with self._slot():
            return await self._optimistic([keys.seq, keys.meta], reads, plan)

    async def list_messages(self, project: str, queue: str, query: ListQuery) -> MessagePage:
        keys = QueueKeys.of(project, queue)
        now = now_ms()
        scan_limit = self._settings.scan_limit
        found: list[Message] = []
        scanned = 0
        last: int | None = None
        start = "-inf" if query.marker is None else f"({query.marker}"
        chunk = query.limit + 2
        async with self._slot():
            while len(found) < query.limit and scanned < scan_limit:
                want = min(chunk, scan_limit - scanned)
                entries: list[Any] = await self._redis.zrangebyscore(
                    keys.index, start, "+inf", start=0, num=want, withscores=True
                )
                if not entries:
                    break
                pipe = self._redis.pipeline(transaction=False)
                for member, _ in entries:
                    pipe.hmget(keys.message(text(member)), [*MESSAGE_FIELDS, "u", "d"])
                rows = await pipe.execute()
                for (member, score), row in zip(entries, rows, strict=True):
                    scanned += 1
                    last = int(score)
                    message = message_from_fields(text(member), row[:-2], now)
                    if message is None:
                        continue
                    author, due = row[-2], int(row[-1] or 0)
                    if not query.echo and author is not None and text(author) == query.client_id:
                        continue
                    if not query.include_claimed and message.claim_id is not None:
                        continue
                    if not query.include_delayed and due > now:
                        continue
                    found.append(message)
                    if len(found) == query.limit:
                        break
                if len(entries) < want:
                    break
                start = f"({last}"
                chunk = min(chunk * 2, 512)
        next_marker = last if (found or scanned >= scan_limit) else None
        return MessagePage(found, next_marker)

    async def delete_message(
        self, project: str, queue: str, message_id: str, claim_id: str | None
    ) -> None:
        keys = QueueKeys.of(project, queue)
        key = keys.message(message_id)
        now = now_ms()

        def plan(replies: list[Any]) -> tuple[list[Command] | None, str]:
            holder, claim_expires, seq = replies[0]
            if seq is not None:
                claimed = bool(holder) and int(claim_expires or 0) > now
                if claim_id is None and claimed:
                    return None, "claimed"
                if claim_id is not None and (not claimed or text(holder) != claim_id):
                    return None, "badclaim"
            return [
                ("DEL", key),
                ("ZREM", keys.index, message_id),
                ("ZREM", keys.expiry, message_id),
                ("ZREM", keys.claimed, message_id),
            ], "ok"

        async with self._slot():
            outcome = await self._optimistic([key], [("HMGET", key, "k", "x", "s")], plan)
        if outcome == "claimed":
            raise MessageIsClaimed(
                f"Message {message_id} is claimed; give its claim_id to delete it."
            )
        if outcome == "badclaim":
            raise InvalidClaim(f"Claim {claim_id} does not hold message {message_id} (or expired).")

    async def delete_messages(self, project: str, queue: str, ids: list[str]) -> None:
        if not ids:
            return
        keys = QueueKeys.of(project, queue)
        unique = list(dict.fromkeys(ids))
        async with self._slot():
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(*(keys.message(i) for i in unique))
            pipe.zrem(keys.index, *unique)
            pipe.zrem(keys.expiry, *unique)
            pipe.zrem(keys.claimed, *unique)
            await pipe.execute()
