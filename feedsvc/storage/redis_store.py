"""What both drivers share: the Redis client, the fair connection gate, error
translation, and the read paths that involve no write (so no choice between
Lua and WATCH): queue metadata, queue listing, stats, messages by id.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import redis.exceptions as rexc
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from feedsvc.clock import SYSTEM_CLOCK, Clock
from feedsvc.config import Settings
from feedsvc.errors import (
    ClaimNotFound,
    PoolExhausted,
    QueueNotFound,
    StorageUnavailable,
    TooMuchContention,
    Unavailable,
)
from feedsvc.storage.base import (
    RESERVED_FIELDS,
    Claim,
    Message,
    MessageSummary,
    QueueInfo,
    QueueStats,
    StoreCounters,
    reserved_fields,
)
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys, registry_key
from feedsvc.storage.nodes import ClusterServers, Node, Servers, SingleServer, command_key

log = logging.getLogger("feedsvc")

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

# Cluster replies and client errors that mean "the topology is changing".
_CLUSTER_TROUBLE = (
    rexc.AskError,  # and MovedError
    rexc.TryAgainError,
    rexc.ClusterError,
    rexc.SlotNotCoveredError,
)
# How many times a command answered MOVED is sent on to the slot's new owner.
MOVED_RESENDS = 3

MESSAGE_FIELDS = ("b", "t", "c", "e", "s", "k", "x", "n")

T = TypeVar("T")
# A plan looks at the replies to the reads and returns the commands to run in
# MULTI/EXEC (None: write nothing) and the operation's result.
Plan = Callable[[list[Any]], tuple[list[Command] | None, T]]


@dataclass(frozen=True, slots=True)
class Parked:
    """A message a claim set aside for the dead-letter queue (see _dead_letter)."""

    id: str
    body: bytes
    author: bytes
    ttl: int  # its ttl in the dead-letter queue
    count: int  # how often it was claimed


class _Lease:
    """Whether the current task holds its pool slot (see _slot and _backoff)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = True


_LEASE: ContextVar[_Lease | None] = ContextVar("feedsvc_pool_lease", default=None)


class Conflicted(Exception):
    """Raised by a transaction plan whose reads show a concurrent writer."""


BACKOFF_BASE = 0.0005
BACKOFF_CAP = 0.05


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_id() -> str:
    """A message or claim id: 96 random bits as 24 lowercase hex digits."""
    return os.urandom(12).hex()


def idempotency_token(client_id: str, key: str) -> str:
    """The field under which a client's Idempotency-Key is remembered."""
    return hashlib.sha1(f"{client_id}\n{key}".encode()).hexdigest()


def text(raw: Any) -> str:
    """A reply element as str (replies are bytes; decode_responses is off)."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def parse_seq(raw: bytes | str | int | float) -> int:
    # Redis may format a large zset score in exponent notation (and RESP3
    # sends it as a double); every seq is below 2**53, so the float round
    # trip is exact.
    if isinstance(raw, int | float):
        return int(raw)
    try:
        return int(raw)
    except ValueError:
        return int(float(raw))


def pool_slots(settings: Settings) -> int:
    """Connections the pool may open: --pool-size, less the coalescer's own."""
    return settings.pool_size - 1 if settings.coalesce else settings.pool_size


def connect(settings: Settings, url: str) -> Redis | RedisCluster:
    """One client (and pool) per process: a Redis, or a RedisCluster for a
    ``redis+cluster://`` URL.

    redis-py retries failed commands by default; a retried index script or
    transaction could write twice, so retries are off and a failure becomes a
    503 that the client may retry knowingly. (Scripts and transactions never
    go through redis-py's command retries anyway: see ``nodes.py``. On a
    cluster redis-py keeps its retries for the plain reads and idempotent
    registry writes it carries, which is how it follows MOVED.)
    """
    if settings.redis_cluster():
        return RedisCluster.from_url(
            url.replace("+cluster://", "://", 1),
            max_connections=pool_slots(settings),
            socket_timeout=settings.redis_timeout,
            socket_connect_timeout=settings.redis_connect_timeout,
            health_check_interval=0,
        )
    pool = ConnectionPool.from_url(
        url,
        max_connections=pool_slots(settings),
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

    def __init__(
        self, redis: Redis | RedisCluster, settings: Settings, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._redis = redis
        self._settings = settings
        self._clock = clock
        # FIFO-fair wait for a connection: redis-py's blocking pool is not
        # fair, and its plain pool fails at once when empty.
        self._gate = asyncio.Semaphore(pool_slots(settings))
        self._servers: Servers = (
            ClusterServers(redis, settings.coalesce, settings.redis_timeout, pool_slots(settings))
            if isinstance(redis, RedisCluster)
            else SingleServer(redis, settings.coalesce, settings.redis_timeout)
        )
        self.counters = StoreCounters()

    @asynccontextmanager
    async def _errors(self) -> AsyncIterator[None]:
        """Translate Redis trouble into 503s."""
        try:
            yield
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            await self._servers.lost()
            raise StorageUnavailable(f"Redis is unavailable: {exc}") from exc
        except _CLUSTER_TROUBLE as exc:
            # a slot on the move, a failover, a cluster without quorum
            self.counters.cluster_redirects += 1
            await self._servers.lost()
            raise StorageUnavailable(f"Redis Cluster is reconfiguring: {exc!r}") from exc
        except rexc.ResponseError as exc:
            if str(exc).startswith(_TRANSIENT_PREFIXES):
                raise StorageUnavailable(f"Redis is unavailable: {exc}") from exc
            raise

    async def _acquire_slot(self) -> None:
        try:
            async with asyncio.timeout(self._settings.pool_timeout):
                await self._gate.acquire()
        except TimeoutError:
            raise PoolExhausted("No Redis connection became free in time.") from None

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """Hold one of pool_size connection slots; translate Redis trouble to 503s."""
        await self._acquire_slot()
        lease = _Lease()
        token = _LEASE.set(lease)
        started = time.perf_counter()
        try:
            async with self._errors():
                yield
        finally:
            _LEASE.reset(token)
            if lease.held:
                self._gate.release()
            self.counters.redis_calls += 1
            self.counters.redis_seconds += time.perf_counter() - started

    async def _call(self, commands: Sequence[Command]) -> list[Any]:
        """Run commands in one round trip per server (shared with concurrent
        callers when coalescing); replies in order, error replies as values.

        On a cluster the commands are split by the node owning each one's
        slot (a keyless command goes with its keyed neighbours) and the
        groups run side by side. A command answered MOVED was not executed;
        the slot table is updated and just those commands are sent again to
        the new owner, in their order (at most a few times, then the MOVED
        reply stands and becomes a 503). ASK and TRYAGAIN (a slot halfway
        through a migration) are left as replies: 503, retry.
        """
        servers = self._servers
        if not servers.cluster:
            return await self._exchange(servers.default_node(), commands)
        await servers.ready()
        replies: list[Any] = [None] * len(commands)
        todo = list(range(len(commands)))
        for _ in range(MOVED_RESENDS):
            groups = self._route([commands[i] for i in todo])
            batches = [(node, [commands[todo[j]] for j in idx]) for node, idx in groups]
            if len(batches) == 1:
                done = [await self._exchange(*batches[0])]
            elif self._settings.coalesce:
                done = await self._fan_out(batches)
            else:  # one pool slot at a time: holding one while waiting for another could deadlock
                done = [await self._exchange(node, batch) for node, batch in batches]
            moved: list[int] = []
            for (_node, idx), got in zip(groups, done, strict=True):
                for j, reply in zip(idx, got, strict=True):
                    replies[todo[j]] = reply
                    if isinstance(reply, rexc.MovedError):
                        self.counters.cluster_redirects += 1
                        moved.append(todo[j])
                        await self._servers.redirected(reply)
            if not moved:
                break
            todo = sorted(moved)
        return replies

    def _route(self, commands: Sequence[Command]) -> list[tuple[Node, list[int]]]:
        """Commands grouped by the node that serves them, order kept in each group."""
        servers = self._servers
        keys = [command_key(c) for c in commands]
        nodes: list[Node | None] = [None if k is None else servers.node_for(k) for k in keys]
        following: Node | None = None
        for i in reversed(range(len(nodes))):  # keyless: the next keyed command's node
            following = nodes[i] = nodes[i] or following
        previous: Node | None = None
        for i, node in enumerate(nodes):  # ... or the previous one's
            previous = nodes[i] = node or previous
        groups: dict[str, tuple[Node, list[int]]] = {}
        for i, found in enumerate(nodes):
            node = found or servers.default_node()
            groups.setdefault(node.name, (node, []))[1].append(i)
        return list(groups.values())

    async def _fan_out(self, batches: Sequence[tuple[Node, list[Command]]]) -> list[list[Any]]:
        """Put each batch on its node's coalescer, then wait for them all."""
        started = time.perf_counter()
        futures = []
        for node, batch in batches:
            assert node.coalescer is not None
            futures.append(node.coalescer.submit(batch))
        try:
            return [await future for future in futures]
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            await self._servers.lost()
            raise StorageUnavailable(f"Redis is unavailable: {exc}") from exc
        finally:
            for future in futures:  # a failed or cancelled wait leaves nothing behind
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()
            self.counters.redis_calls += 1
            self.counters.redis_seconds += time.perf_counter() - started

    async def _exchange(self, node: Node, commands: Sequence[Command]) -> list[Any]:
        if node.coalescer is not None:
            started = time.perf_counter()
            try:
                return await node.coalescer.execute(commands)
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
                await self._servers.lost()
                raise StorageUnavailable(f"Redis is unavailable: {exc}") from exc
            finally:
                self.counters.redis_calls += 1
                self.counters.redis_seconds += time.perf_counter() - started
        async with self._slot():
            return await node.exchange(commands)

    def stats(self) -> dict[str, float]:
        counters = self.counters
        waiters = getattr(self._gate, "_waiters", None) or ()
        out = {
            "watch_retries": counters.watch_retries,
            "watch_conflicts_exhausted": counters.watch_conflicts_exhausted,
            "noscript_reloads": counters.noscript_reloads,
            "cluster_redirects": counters.cluster_redirects,
            "redis_calls": counters.redis_calls,
            "redis_seconds": counters.redis_seconds,
            "pool_size": self._settings.pool_size,
            "pool_in_use": pool_slots(self._settings) - self._gate._value,
            "pool_waiting": len(waiters),
            "coalesced_batches": 0,
            "coalesced_calls": 0,
        }
        for node in self._servers.primaries():
            if node.coalescer is not None:
                out["coalesced_batches"] += node.coalescer.batches
                out["coalesced_calls"] += node.coalescer.calls
        return out

    async def _call_checked(self, commands: Sequence[Command]) -> list[Any]:
        """Like _call, but an error reply raises (translated like any other)."""
        replies = await self._call(commands)
        async with self._errors():
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    async def _transaction(self, commands: Sequence[Command]) -> list[Any]:
        """Commands in MULTI/EXEC (keys of one slot), in one exchange; their replies."""
        replies = await self._call_checked([("MULTI",), *commands, ("EXEC",)])
        executed: list[Any] = replies[-1]
        async with self._errors():
            for reply in executed:
                if isinstance(reply, Exception):
                    raise reply
        return executed

    async def _registry_add(self, project: str, queue: str) -> Command:
        """List the queue in its project's registry, as the first read of a
        transaction on the queue's slot: on one server the ZADD rides along
        with those reads; on a cluster the registry lives in another slot, so
        it is sent by itself first and a PING keeps its place among the reads.
        """
        add: Command = ("ZADD", registry_key(project), 0, queue)
        if not self._servers.cluster:
            return add
        await self._call_checked([add])
        return ("PING",)

    @staticmethod
    async def _send(conn: AbstractConnection, *commands: Command) -> list[Any]:
        """Send commands in one write and read one reply each (an error reply raises)."""
        await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        return [await conn.read_response() for _ in commands]

    async def _attempt(
        self, watch: Sequence[str], reads: Sequence[Command], plan: Plan[T]
    ) -> tuple[bool, T | None]:
        """One optimistic transaction: (True, result) if it ran, (False, None) on conflict.

        A plan raises Conflicted when the reads show another writer got there
        first (the same as EXEC answering nil). The transaction runs on a
        connection to the server owning the watched keys' slot; if the slot
        has moved (MOVED, ASK, TRYAGAIN) nothing was written, so it counts as
        a conflict and is tried again on the slot's new owner.
        """
        await self._servers.ready()
        try:
            return await self._converse(watch, reads, plan)
        except (rexc.AskError, rexc.TryAgainError) as redirect:
            self.counters.cluster_redirects += 1
            if isinstance(redirect, rexc.AskError):
                await self._servers.redirected(redirect)
            return False, None

    async def _converse(
        self, watch: Sequence[str], reads: Sequence[Command], plan: Plan[T]
    ) -> tuple[bool, T | None]:
        async with self._servers.node_for(watch[0]).connection() as conn:
            replies = await self._send(conn, ("WATCH", *watch), *reads)
            try:
                writes, result = plan(replies[1:])
            except Conflicted:
                await self._send(conn, ("UNWATCH",))
                return False, None
            if writes is None:
                await self._send(conn, ("UNWATCH",))
                return True, result
            done = await self._send(conn, ("MULTI",), *writes, ("EXEC",))
            executed = done[-1]
            if executed is None:
                return False, None
            for reply in executed:
                if isinstance(reply, Exception):
                    raise reply
            return True, result

    async def _backoff(self, attempt: int) -> None:
        """Count a conflict and wait a jittered, growing while; 503 when out of tries."""
        self.counters.watch_retries += 1
        if attempt + 1 >= self._settings.watch_retries:
            self.counters.watch_conflicts_exhausted += 1
            raise TooMuchContention(
                f"Gave up after {self._settings.watch_retries} conflicting attempts; retry."
            )
        ceiling = min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)
        # give the slot back while sleeping: a crowd of conflicting writers
        # must not starve everyone else of connections
        lease = _LEASE.get()
        if lease is not None and lease.held:
            self._gate.release()
            lease.held = False
        await asyncio.sleep(random.uniform(0, ceiling))
        if lease is not None:
            await self._acquire_slot()
            lease.held = True

    async def _optimistic(self, watch: Sequence[str], reads: Sequence[Command], plan: Plan[T]) -> T:
        attempt = 0
        while True:
            done, result = await self._attempt(watch, reads, plan)
            if done:
                return result  # type: ignore[return-value]
            await self._backoff(attempt)
            attempt += 1

    def _claim_scan_limit(self) -> int:
        """How many index entries a claim or pop may look at to find free messages."""
        return self._settings.scan_limit * 10

    async def open(self) -> None:
        return None

    async def ping(self) -> None:
        # through the coalescer when it is on: a busy pool is not a Redis outage
        replies = await self._call([("PING",)])
        if isinstance(replies[0], Exception):
            async with self._errors():
                raise replies[0]

    async def close(self) -> None:
        await self._servers.close()
        if isinstance(self._redis, RedisCluster):
            await self._redis.aclose()
        else:
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
        """A page of the project's queues by name, skipping registry entries
        whose queue is gone (deleted meanwhile), so a page is short only at the end."""
        out: list[QueueInfo] = []
        start = "-" if marker is None else f"({marker}"
        async with self._slot():
            while len(out) < limit:
                want = limit - len(out)
                names: list[Any] = await self._redis.zrangebylex(
                    registry_key(project), start, "+", 0, want
                )
                if not names:
                    break
                pipe = self._redis.pipeline(transaction=False)
                for raw in names:
                    pipe.hmget(QueueKeys.of(project, text(raw)).meta, ["c", "m"])
                for raw, (created, meta) in zip(names, await pipe.execute(), strict=True):
                    if created is None:
                        continue
                    metadata = (orjson.loads(meta) if meta else {}) if detailed else None
                    out.append(QueueInfo(text(raw), metadata))
                if len(names) < want:
                    break
                start = f"({text(names[-1])}"
        return out

    async def count_queues(self, project: str) -> int:
        async with self._slot():
            return int(await self._redis.zcard(registry_key(project)))

    async def queue_stats(self, project: str, queue: str) -> QueueStats:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()
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
        now = self._clock.now_ms()
        rows = await self._call_checked(
            [("HMGET", keys.message(i), *MESSAGE_FIELDS) for i in wanted]
        )
        found = (
            message_from_fields(message_id, row, now)
            for message_id, row in zip(wanted, rows, strict=True)
        )
        return [m for m in found if m is not None]

    # -- shared by both drivers: queue metadata and claim upkeep -------------
    # These are rare, uncontended writes: both drivers run them as WATCH/MULTI
    # transactions, which are correct against the lua driver's scripts too
    # (a script touching a watched key aborts the transaction).

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
                ("HSET", keys.meta, "m", orjson.dumps(updated), *_flat(fields))
            ]
            stale = [f for f in RESERVED_FIELDS.values() if f not in fields]
            if stale:
                writes.append(("HDEL", keys.meta, *stale))
            return writes, updated

        async with self._slot():
            result = await self._optimistic([keys.meta], [("HMGET", keys.meta, "c", "m")], plan)
        if result is None:
            raise QueueNotFound(queue)
        return result

    async def _dead_letter(
        self, project: str, queue: str, dlq: str, claim_id: str, parked: Sequence[Parked]
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
        source, target = QueueKeys.of(project, queue), QueueKeys.of(project, dlq)
        now = self._clock.now_ms()

        def copy(replies: list[Any]) -> tuple[list[Command] | None, None]:
            last, exists, *seqs = replies
            seq = parse_seq(last) if last is not None else now * 1000
            writes: list[Command] = []
            for message, have in zip(parked, seqs, strict=True):
                if have is not None:
                    continue
                seq += 1
                expires = now + message.ttl * 1000
                key = target.message(message.id)
                writes.append(
                    ("HSET", key, "b", message.body, "u", message.author, "s", seq,
                     "t", message.ttl, "c", now, "e", expires, "d", 0, "k", "", "x", 0,
                     "n", message.count)
                )  # fmt: skip
                writes.append(("PEXPIREAT", key, expires))
                writes.append(("ZADD", target.index, seq, message.id))
                writes.append(("ZADD", target.expiry, expires, message.id))
            if not writes:
                return None, None
            writes.append(("SET", target.seq, seq))
            if not exists:
                writes.append(("HSET", target.meta, "c", now, "m", "{}"))
            return writes, None

        def forget(replies: list[Any]) -> tuple[list[Command] | None, None]:
            held = [
                m.id
                for m, holder in zip(parked, replies, strict=True)
                if holder is not None and text(holder) == claim_id
            ]
            return (forget_commands(source, held) if held else None), None

        try:
            async with self._slot():
                await self._optimistic(
                    [target.seq, target.meta, *(target.message(m.id) for m in parked)],
                    [
                        ("GET", target.seq),
                        ("EXISTS", target.meta),
                        *(("HGET", target.message(m.id), "s") for m in parked),
                    ],
                    copy,
                )
                await self._optimistic(
                    [source.message(m.id) for m in parked],
                    [("HGET", source.message(m.id), "k") for m in parked],
                    forget,
                )
            await self._call_checked([("ZADD", registry_key(project), 0, dlq)])
        except Unavailable as exc:
            log.warning(
                "dead-lettering %d message(s) of %s to %s is left for a later claim: %s",
                len(parked),
                queue,
                dlq,
                exc,
            )

    async def get_claim(self, project: str, queue: str, claim_id: str) -> Claim:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()
        async with self._slot():
            row: list[Any] = await self._redis.hmget(
                keys.claim(claim_id), ["t", "g", "c", "x", "ids"]
            )
            ttl, grace, created, expires, ids = row
            if expires is None or int(expires) <= now:
                raise ClaimNotFound(claim_id)
            held = text(ids).split() if ids else []
            pipe = self._redis.pipeline(transaction=False)
            for message_id in held:
                pipe.hmget(keys.message(message_id), list(MESSAGE_FIELDS))
            rows = await pipe.execute() if held else []
        messages = [
            m
            for m in (message_from_fields(i, row, now) for i, row in zip(held, rows, strict=True))
            if m is not None and m.claim_id == claim_id
        ]
        return Claim(claim_id, int(ttl), int(grace), int(created), messages)

    async def _claim_transaction(
        self,
        keys: QueueKeys,
        claim_id: str,
        plan_for: Callable[[list[str]], Plan[T]],
    ) -> T:
        """Run a transaction over a claim and the messages it lists."""
        attempt = 0
        while True:
            raw = await self._redis.hget(keys.claim(claim_id), "ids")
            held = text(raw).split() if raw else []
            watch = [keys.claim(claim_id), *(keys.message(i) for i in held)]
            reads: list[Command] = [("HMGET", keys.claim(claim_id), "x", "ids")]
            reads += [("HMGET", keys.message(i), "k", "e", "c") for i in held]
            done, result = await self._attempt(watch, reads, plan_for(held))
            if done:
                return result  # type: ignore[return-value]
            await self._backoff(attempt)
            attempt += 1

    async def renew_claim(
        self, project: str, queue: str, claim_id: str, ttl: int, grace: int
    ) -> None:
        keys = QueueKeys.of(project, queue)
        now = self._clock.now_ms()
        claim_expires = now + ttl * 1000

        def plan_for(held: list[str]) -> Plan[bool]:
            def plan(replies: list[Any]) -> tuple[list[Command] | None, bool]:
                expires, ids = replies[0]
                if expires is None or int(expires) <= now:
                    return None, False
                if (text(ids).split() if ids else []) != held:
                    raise Conflicted
                writes: list[Command] = []
                for message_id, (holder, msg_expires, created) in zip(
                    held, replies[1:], strict=True
                ):
                    if holder is None or text(holder) != claim_id or msg_expires is None:
                        continue
                    key = keys.message(message_id)
                    # never shorten a message's life, only extend it
                    keep = max(int(msg_expires), claim_expires + grace * 1000)
                    new_ttl = round((keep - int(created)) / 1000)
                    writes.append(("HSET", key, "x", claim_expires, "e", keep, "t", new_ttl))
                    writes.append(("PEXPIREAT", key, keep))
                    writes.append(("ZADD", keys.expiry, keep, message_id))
                    writes.append(("ZADD", keys.claimed, claim_expires, message_id))
                claim_key = keys.claim(claim_id)
                writes.append(("HSET", claim_key, "t", ttl, "g", grace, "x", claim_expires))
                writes.append(("PEXPIREAT", claim_key, claim_expires))
                writes.append(("ZADD", keys.claims, claim_expires, claim_id))
                return writes, True

            return plan

        async with self._slot():
            renewed = await self._claim_transaction(keys, claim_id, plan_for)
        if not renewed:
            raise ClaimNotFound(claim_id)

    async def release_claim(self, project: str, queue: str, claim_id: str) -> None:
        keys = QueueKeys.of(project, queue)

        def plan_for(held: list[str]) -> Plan[None]:
            def plan(replies: list[Any]) -> tuple[list[Command] | None, None]:
                _, ids = replies[0]
                if (text(ids).split() if ids else []) != held:
                    raise Conflicted
                writes: list[Command] = []
                for message_id, (holder, msg_expires, _c) in zip(held, replies[1:], strict=True):
                    if holder is not None and text(holder) == claim_id and msg_expires:
                        writes.append(("HSET", keys.message(message_id), "k", "", "x", 0))
                        writes.append(("ZREM", keys.claimed, message_id))
                writes.append(("DEL", keys.claim(claim_id)))
                writes.append(("ZREM", keys.claims, claim_id))
                return writes, None

            return plan

        async with self._slot():
            await self._claim_transaction(keys, claim_id, plan_for)


def forget_commands(keys: QueueKeys, ids: Sequence[Any]) -> list[Command]:
    """The writes that remove messages and their index entries (see _lib.lua's forget)."""
    return [
        ("DEL", *(keys.message(text(i)) for i in ids)),
        ("ZREM", keys.index, *ids),
        ("ZREM", keys.expiry, *ids),
        ("ZREM", keys.claimed, *ids),
    ]


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]
