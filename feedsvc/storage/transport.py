"""Every conversation feedsvc has with Redis goes through one :class:`Transport`.

It owns:

* the client and its pools, one per process, built once from the URL: a
  plain server or a Redis Cluster is decided here, from
  ``Settings.redis_cluster()``, and nowhere else (``nodes.py`` holds the two
  routing strategies);
* the **gate**: a FIFO-fair limit of ``--pool-size`` conversations on pooled
  connections, waited for at most ``--pool-timeout`` (then 503); coalesced
  calls wait for room in their coalescer instead, as long at most;
* **error translation**: lost connections, timeouts, a loading or read-only
  server, a cluster reconfiguring all become :class:`StorageUnavailable`
  (503 with Retry-After); a real bug stays a 500;
* **exchanges**: commands written at once, replies read in order with error
  replies as values, routed per command to the node owning its slot, with
  MOVED followed a few times;
* the **WATCH engine** (``transactions``, an ``optimistic.py``
  :class:`~feedsvc.storage.optimistic.OptimisticTransactions` made from the
  transport's servers, slots and counters): optimistic transactions (WATCH +
  reads in one write, MULTI..EXEC in a second) with jittered, bounded
  retries that give the pool slot back while they sleep;
* the **memory-policy guard** (``memory_policy.py``): writes wait for a
  read of every primary's maxmemory-policy after a start, a reconnect or a
  failover, and are refused while Redis may evict; a ticker reads it again
  every second;
* the counters ``/metrics`` reads.

The drivers above it build commands (with ``record.py`` and ``keys.py``) and
never touch a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import redis.exceptions as rexc
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from feedsvc.clock import Clock
from feedsvc.config import RedisSettings
from feedsvc.errors import (
    NotReplicated,
    PoolExhausted,
    RedisOutOfMemory,
    StorageUnavailable,
    Unavailable,
)
from feedsvc.storage.base import StoreCounters
from feedsvc.storage.coalescer import Coalescer, CoalescerBusy, Command
from feedsvc.storage.gate import Gate
from feedsvc.storage.memory_policy import MemoryPolicyGuard
from feedsvc.storage.nodes import ClusterServers, Coalescing, Node, Servers, SingleServer
from feedsvc.storage.notifier import Notifier
from feedsvc.storage.optimistic import OptimisticTransactions
from feedsvc.storage.policy_reader import PolicyReader
from feedsvc.storage.sentinel import follow_sentinels

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
    rexc.RedisClusterException,  # no node reachable yet, slots not covered, ...
)
_LOST = (rexc.ConnectionError, rexc.TimeoutError, OSError)
# RuntimeError: uvloop's write() on a transport the peer has reset (Redis
# killed as redis-py connects); asyncio's would have let it pass. Only that
# one is trouble (_closed_transport); any other RuntimeError stays a bug.
_TROUBLE = (rexc.RedisError, rexc.RedisClusterException, OSError, RuntimeError)


def _out_of_memory(exc: BaseException) -> bool:
    """Redis's OOM reply: redis-py makes it an OutOfMemoryError and strips the
    "OOM" from its text, so the prefix test below would miss it; and a MULTI
    that Redis 7 refuses at EXEC for memory (EXECABORT, its reason OOM)."""
    if isinstance(exc, rexc.OutOfMemoryError):
        return True
    if isinstance(exc, rexc.ExecAbortError):
        return "because of: OOM" in str(exc)
    return isinstance(exc, rexc.ResponseError) and str(exc).startswith("OOM")


def _reads_only(commands: Sequence[Command], idempotent: bool | None) -> bool:
    """Whether a call only reads: its caller says so (idempotent), else every
    command is a plain read."""
    if idempotent is not None:
        return idempotent
    return all(str(c[0]).upper() in READS for c in commands)


def _closed_transport(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "handler is closed" in str(exc)


# Commands that only read: sent again once if their connection was found closed.
READ_ONLY = frozenset(
    {"PING", "GET", "EXISTS", "HGET", "HMGET", "ZCARD", "ZCOUNT", "ZRANGE", "ZRANGEBYSCORE",
     "ZRANGEBYLEX", "ZSCORE"}
)  # fmt: skip
# Commands that only read, for the memory-policy guard: calls of these alone
# go on while writes are refused (READ_ONLY is narrower: what may be resent).
READS = READ_ONLY | frozenset(
    {"GETRANGE", "MGET", "HGETALL", "HLEN", "HEXISTS", "HKEYS", "HRANDFIELD", "ZRANK",
     "ZMSCORE", "ZREVRANGE", "ZREVRANGEBYSCORE", "SMEMBERS", "SCARD", "STRLEN", "PTTL",
     "TTL", "TYPE", "INFO"}
)  # fmt: skip
# How many times a command answered MOVED is sent on to the slot's new owner.
MOVED_RESENDS = 3


def pool_slots(settings: RedisSettings) -> int:
    """Connections the pool may open: --pool-size, less the coalescer's own."""
    return settings.pool_size - 1 if settings.coalesce else settings.pool_size


def _client(settings: RedisSettings) -> tuple[Redis | RedisCluster, Sentinel | None]:
    """redis-py retries failed commands by default; a retried index script or
    transaction could write twice, so retries are off and a failure becomes a
    503 that the client may retry knowingly. (Scripts and transactions never
    go through redis-py's command retries anyway: see ``nodes.py``.)"""
    assert settings.redis_url is not None
    common: dict[str, Any] = {
        "max_connections": pool_slots(settings),
        "socket_timeout": settings.redis_timeout,
        "socket_connect_timeout": settings.redis_connect_timeout,
        "health_check_interval": 0,
    }
    if settings.redis_cluster():
        url = settings.redis_url.replace("+cluster://", "://", 1)
        return RedisCluster.from_url(url, **common), None
    sentinel = settings.redis_sentinel()
    if sentinel is not None:
        # Each new connection asks the sentinels for the master first: after a
        # failover the next connection reaches the new master (see demoted()).
        timeouts = {k: v for k, v in common.items() if k.startswith("socket")}
        manager = Sentinel(  # type: ignore[no-untyped-call]
            sentinel.sentinels, sentinel_kwargs={**timeouts, "ssl": sentinel.tls}, **timeouts
        )
        master: Redis = manager.master_for(
            sentinel.service,
            username=sentinel.username,
            password=sentinel.password,
            ssl=sentinel.tls,
            retry=Retry(NoBackoff(), 0),
            **common,
        )
        return master, manager
    pool = ConnectionPool.from_url(settings.redis_url, retry=Retry(NoBackoff(), 0), **common)
    return Redis(connection_pool=pool), None


def _whole_blocks(commands: Sequence[Command], moved: list[int]) -> list[int]:
    """The commands to send again for those answered MOVED: each one, or, if
    it stands in a MULTI block, every command from its MULTI to its EXEC."""
    again = set(moved)
    start = None
    for i, command in enumerate(commands):
        name = str(command[0]).upper()
        if name == "MULTI":
            start = i
        elif name == "EXEC" and start is not None:
            if any(start < m < i for m in moved):
                again.update(range(start, i + 1))
            start = None
    return sorted(again)


def raise_error_reply(replies: list[Any]) -> None:
    """Raise the first error reply among replies, if there is one."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


def replicated(replies: list[Any], wanted: int, counters: StoreCounters) -> list[Any]:
    """Replies to a batch that ended with WAIT, less its reply; NotReplicated
    if fewer than wanted replicas confirmed the batch's writes in time."""
    *replies, acks = replies
    if isinstance(acks, Exception):
        raise acks
    if int(acks) < wanted:
        counters.not_replicated += 1
        raise NotReplicated(
            f"The write reached {int(acks)} of {wanted} replicas in time; "
            "it may or may not be kept."
        )
    return replies


async def trouble(
    exc: BaseException, servers: Servers, counters: StoreCounters, guard: MemoryPolicyGuard
) -> Unavailable | None:
    """The 503 that Redis trouble means, or None: not trouble, a bug. Also
    what the trouble tells: a lost server, a demoted master, a policy to
    read again."""
    if isinstance(exc, CoalescerBusy):  # Redis is slow, not gone
        return PoolExhausted(f"No room among the calls in flight to Redis: {exc}")
    if isinstance(exc, _LOST) or _closed_transport(exc):
        guard.stale()  # the server we reach next may be another
        await servers.lost()
        return StorageUnavailable(f"Redis is unavailable: {exc}")
    if isinstance(exc, _CLUSTER_TROUBLE):
        # a slot on the move, a failover, a cluster without quorum
        counters.cluster_redirects += 1
        guard.stale()
        await servers.lost()
        return StorageUnavailable(f"Redis Cluster is reconfiguring: {exc!r}")
    if _out_of_memory(exc):
        counters.out_of_memory += 1
        return RedisOutOfMemory(
            "Redis refused the write: it is at its maxmemory limit and evicts "
            "nothing. The request took no effect; retry once memory is freed."
        )
    if isinstance(exc, rexc.ReadOnlyError):
        # a master demoted to replica (a Sentinel failover): reconnect
        guard.stale()
        await servers.demoted()
    if isinstance(exc, rexc.ResponseError) and (
        # redis-py strips the code of the replies it has a class for
        # (READONLY, LOADING...) and keeps it in status_code
        str(exc).startswith(_TRANSIENT_PREFIXES)
        or getattr(exc, "status_code", None) in _TRANSIENT_PREFIXES
    ):
        return StorageUnavailable(f"Redis is unavailable: {exc}")
    return None


class Transport:
    def __init__(self, settings: RedisSettings, clock: Clock) -> None:
        self._settings = settings
        self._redis, self._sentinel = _client(settings)
        self._follower: asyncio.Task[None] | None = None
        slots = pool_slots(settings)
        self._gate = Gate(slots, settings.pool_timeout)
        coalescing: Coalescing | None = None
        if settings.coalesce:
            coalescing = functools.partial(
                Coalescer, reply_timeout=settings.redis_timeout, room_timeout=settings.pool_timeout
            )
        self._servers: Servers = (
            ClusterServers(self._redis, coalescing, slots, self._connected)
            if isinstance(self._redis, RedisCluster)
            else SingleServer(self._redis, coalescing, self._connected)
        )
        self.cluster = self._servers.cluster
        self._policy = PolicyReader(
            self._redis, self._servers, self._exchange, self.errors, settings
        )
        self.memory_policy = self._policy.guard
        self.notifier = Notifier(self._servers, clock)
        # the hot path's shortcut: one server, coalescing, no WAIT to add
        self._direct: Coalescer | None = None
        self.counters = StoreCounters()
        # sent after every write, on its connection, when --min-replicas-ack is set
        self._wait: Command | None = None
        if settings.min_replicas_ack:
            timeout_ms = max(1, round(settings.replica_ack_timeout * 1000))
            self._wait = ("WAIT", settings.min_replicas_ack, timeout_ms)
        elif not self.cluster:
            self._direct = self._servers.default_node().coalescer
        self.transactions = OptimisticTransactions(
            self._servers,
            self.slot,
            self._gate,
            self.counters,
            self.memory_policy,
            settings.watch_retries,
            self._wait,
            self._replicated,
        )

    def open(self) -> None:
        """Start reading the memory policy now and then, and, behind
        Sentinel, following the sentinels' announcements."""
        self._policy.open()
        sentinel = self._settings.redis_sentinel()
        if self._sentinel is not None and sentinel is not None and self._follower is None:
            self._follower = asyncio.create_task(
                follow_sentinels(self._sentinel, sentinel.service, self._master_switched)
            )

    async def _master_switched(self, announced: bool) -> None:
        if announced:
            self.counters.master_switches += 1
        self.memory_policy.stale()
        await self._servers.demoted()
        await self.notifier.reset()

    @asynccontextmanager
    async def errors(self) -> AsyncIterator[None]:
        """Translate Redis trouble into 503s."""
        try:
            yield
        except _TROUBLE as exc:
            unavailable = await self._unavailable(exc)
            if unavailable is None:
                raise
            raise unavailable from exc

    async def _unavailable(self, exc: BaseException) -> Unavailable | None:
        return await trouble(exc, self._servers, self.counters, self.memory_policy)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one gate slot (unless this task holds one already) and
        translate Redis trouble to 503s; counts the call."""
        async with self._gate.hold(), self._counted():
            yield

    @asynccontextmanager
    async def _counted(self) -> AsyncIterator[None]:
        """Translate Redis trouble to 503s; count the call and its time."""
        started = time.perf_counter()
        try:
            async with self.errors():
                yield
        finally:
            self.counters.redis_calls += 1
            self.counters.redis_seconds += time.perf_counter() - started

    async def call(self, commands: Sequence[Command], idempotent: bool | None = None) -> list[Any]:
        """Commands in one round trip per server (shared with concurrent
        callers when coalescing); replies in order, error replies as values.

        On a cluster the commands are split by the node owning each one's
        slot and the groups run side by side. A command answered MOVED was
        not executed: the slot table is updated and just those commands are
        sent again to the new owner, in their order (a few times, then the
        MOVED reply stands and becomes a 503); a MOVED inside a MULTI block
        means the block was discarded (EXECABORT), so the whole block goes
        again, never its commands alone. ASK and TRYAGAIN (a slot halfway
        through a migration) are left as replies: 503, retry.

        idempotent says whether the commands may be sent twice (see
        _exchange); by default, when every one of them only reads.
        """
        if self.memory_policy.attention and not _reads_only(commands, idempotent):
            await self.memory_policy.admit_write()
        if self._direct is not None:
            return await self._call_direct(self._direct, commands, idempotent)
        if idempotent is None:
            idempotent = all(str(c[0]).upper() in READ_ONLY for c in commands)
        servers = self._servers
        if not self.cluster:
            batch = [(servers.default_node(), list(commands))]
            return (await self._exchange(batch, idempotent))[0]
        async with self.errors():
            await servers.ready()
        replies: list[Any] = [None] * len(commands)
        todo = list(range(len(commands)))
        for _ in range(MOVED_RESENDS):
            groups = servers.route([commands[i] for i in todo])
            batches = [(node, [commands[todo[j]] for j in idx]) for node, idx in groups]
            done = await self._exchange(batches, idempotent)
            moved: list[int] = []
            for (_node, idx), got in zip(groups, done, strict=True):
                for j, reply in zip(idx, got, strict=True):
                    replies[todo[j]] = reply
                    if isinstance(reply, rexc.MovedError):
                        self.counters.cluster_redirects += 1
                        moved.append(todo[j])
                        await servers.redirected(reply)
            if not moved:
                break
            todo = _whole_blocks(commands, moved)
        return replies

    async def _call_direct(
        self, coalescer: Coalescer, commands: Sequence[Command], idempotent: bool | None
    ) -> list[Any]:
        """call() on the hot path (one server, coalescing, no WAIT): what
        _exchange does, with _counted() and _resending_reads() written out
        inline (each context-manager layer costs on every request)."""
        started = time.perf_counter()
        try:
            try:
                return await coalescer.submit(commands)
            except rexc.ConnectionError as exc:
                self.memory_policy.stale()
                if idempotent is None:
                    idempotent = all(str(c[0]).upper() in READ_ONLY for c in commands)
                if not idempotent or isinstance(exc, CoalescerBusy):
                    raise
                self.counters.read_retries += 1
                return await coalescer.submit(commands)
        except _TROUBLE as exc:
            unavailable = await self._unavailable(exc)
            if unavailable is None:
                raise
            raise unavailable from exc
        finally:
            self.counters.redis_calls += 1
            self.counters.redis_seconds += time.perf_counter() - started

    async def _exchange(
        self, batches: Sequence[tuple[Node, list[Command]]], idempotent: bool = False
    ) -> list[list[Any]]:
        """Each batch on its node; Redis trouble becomes a 503.

        Pooled exchanges hold a gate slot. Coalesced ones do not: a
        coalescer bounds its own work in flight and makes a caller wait for
        room as a slot would (at most --pool-timeout, then 503), so this,
        the hot path, costs no more than it must.

        A connection found closed means the server restarted (or a proxy cut
        it), so every idle connection to that server is suspect: they are
        dropped and, for commands that only read, the exchange is tried once
        more on fresh connections. A write is never sent twice.
        """
        wait = None if idempotent else self._wait
        if wait is not None:
            batches = [(node, [*batch, wait]) for node, batch in batches]
        if not self._settings.coalesce:
            async with self.slot():
                done = await self._resending_reads(batches, idempotent)
            return done if wait is None else [self._replicated(got) for got in done]
        async with self._counted():
            done = await self._resending_reads(batches, idempotent)
        return done if wait is None else [self._replicated(got) for got in done]

    def _replicated(self, replies: list[Any]) -> list[Any]:
        return replicated(replies, self._settings.min_replicas_ack, self.counters)

    async def _resending_reads(
        self, batches: Sequence[tuple[Node, list[Command]]], idempotent: bool
    ) -> list[list[Any]]:
        try:
            return await self._send(batches)
        except rexc.ConnectionError:
            self.memory_policy.stale()
            for node, _ in batches:
                await node.drop_idle()
            if not idempotent:
                raise
            self.counters.read_retries += 1
        return await self._send(batches)

    async def _send(self, batches: Sequence[tuple[Node, list[Command]]]) -> list[list[Any]]:
        """Coalesced batches side by side; pooled ones one after another
        (holding a pooled connection while waiting for a second could deadlock)."""
        if not self._settings.coalesce:
            return [await node.exchange(batch) for node, batch in batches]
        futures = []
        for node, batch in batches:
            assert node.coalescer is not None
            futures.append(node.coalescer.submit(batch))
        try:
            return [await future for future in futures]
        finally:
            for future in futures:  # a failed or cancelled wait leaves nothing behind
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()

    async def call_checked(
        self, commands: Sequence[Command], idempotent: bool | None = None
    ) -> list[Any]:
        """Like call, but an error reply raises (translated like any other)."""
        replies = await self.call(commands, idempotent)
        async with self.errors():
            raise_error_reply(replies)
        return replies

    async def transaction(self, commands: Sequence[Command]) -> list[Any]:
        """Commands in MULTI/EXEC (keys of one slot), in one exchange; their replies."""
        replies = await self.call_checked([("MULTI",), *commands, ("EXEC",)])
        executed: list[Any] = replies[-1]
        async with self.errors():
            raise_error_reply(executed)
        return executed

    async def ping(self) -> None:
        """PING the server, or every primary of a cluster: one that cannot
        answer leaves its slots unserved, so the whole is not healthy.
        Through the coalescer when it is on: a busy pool is not an outage."""
        if self.cluster:
            await self.on_every_primary([("PING",)])
        else:
            await self.call_checked([("PING",)])

    async def on_every_primary(self, commands: Sequence[Command]) -> None:
        """Run commands on each primary (e.g. SCRIPT LOAD); an error reply raises."""
        async with self.errors():
            await self._servers.ready()
        for node in self._servers.primaries():
            [replies] = await self._exchange([(node, list(commands))])
            async with self.errors():
                raise_error_reply(replies)

    async def _connected(self, conn: AbstractConnection) -> None:
        await self._policy.connected(conn)  # see PolicyReader.connected

    # -- the rest -------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            **dataclasses.asdict(self.counters),
            "pool_size": self._settings.pool_size,
            "pool_in_use": self._gate.in_use,
            "pool_waiting": self._gate.waiting,
            "coalesced_batches": 0,
            "coalesced_calls": 0,
            "redis_may_evict": 1.0 if self.memory_policy.evicting else 0.0,
            "redis_evicted_keys": float(sum(self.memory_policy.evicted.values())),
        }
        for node in self._servers.primaries():
            if node.coalescer is not None:
                out["coalesced_batches"] += node.coalescer.batches
                out["coalesced_calls"] += node.coalescer.calls
                out["pool_waiting"] += node.coalescer.waiting_for_room
        return out

    async def close(self) -> None:
        await self._policy.close()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        await self.notifier.close()
        await self._servers.close()
        if isinstance(self._redis, RedisCluster):
            await self._redis.aclose()
        else:
            await self._redis.aclose(close_connection_pool=True)
        if self._sentinel is not None:
            await self._sentinel.aclose()
