"""Where a command goes: the one Redis server, or the primary that owns the
command's slot in a Redis Cluster.

The stores talk to Redis in two ways besides redis-py's own commands:

* **exchanges** — a few commands written at once and their replies read in
  order, error replies as values (through a node's coalescer when coalescing
  is on, else on a connection of its own);
* **conversations** — a WATCH/MULTI/EXEC transaction on one connection.

Both need a connection to one particular server. :class:`SingleServer` has
one; :class:`ClusterServers` keeps a :class:`Node` per cluster primary and
finds a key's owner from redis-py's slot table (``RedisCluster``'s
``nodes_manager``), which is the only part of ``RedisCluster`` used here:
its pipelines refuse EVALSHA-by-SHA reloads and its transactions block the
event loop, so feedsvc drives each node's connections itself.

Every script and transaction names keys of one queue only, which share one
hash tag and so one slot; the only cross-slot writes (a project's queue
registry, dead-lettering into another queue) are separate exchanges, see
``feedsvc.storage.claim_upkeep``. Which of the two a URL names is decided
once, in ``transport.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import redis.exceptions as rexc
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from feedsvc.storage.coalescer import Coalescer, Command

# Makes a node's coalescer from its connection factory (None: no coalescing).
Coalescing = Callable[[Callable[[], AbstractConnection]], Coalescer]
# Run on every new connection once it is up, before anything else is sent on it.
OnConnect = Callable[[AbstractConnection], Awaitable[None]]

# Commands that name no key: they go where the keyed commands next to them go.
# A subscription's TCP keep-alive: probe after 10 s of silence, every 5 s,
# give up after 3 unanswered (about 25 s to find a silent peer gone).
SUBSCRIBER_KEEPALIVE: dict[int, int] = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)  # Linux has all three
}
KEYLESS = frozenset({"PING", "MULTI", "EXEC", "DISCARD", "UNWATCH", "SCRIPT", "ASKING"})
#: commands that name their key after a subcommand (OBJECT ENCODING key)
KEY_AFTER_SUBCOMMAND = frozenset({"OBJECT", "MEMORY", "XINFO"})


def command_key(command: Command) -> Any:
    """The first key a command touches, or None."""
    name = str(command[0]).upper()
    if name in KEYLESS:
        return None
    if name in ("EVALSHA", "EVAL"):
        return command[3] if int(command[2]) > 0 else None
    if name in KEY_AFTER_SUBCOMMAND:
        return command[2] if len(command) > 2 else None
    return command[1]


async def exchange(conn: AbstractConnection, commands: Sequence[Command]) -> list[Any]:
    """Write commands at once, read one reply each; error replies as values."""
    await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await conn.read_response())
        except rexc.ResponseError as error:
            replies.append(error)
    return replies


class Node:
    """One Redis server: a pool of connections to it and, when coalescing,
    its coalescer."""

    def __init__(
        self,
        name: str,
        pool: ConnectionPool,
        coalescing: Coalescing | None,
        owned: bool,
        on_connect: OnConnect | None = None,
    ) -> None:
        self.name = name
        self._pool = pool
        self._owned = owned  # close the pool with the node
        if on_connect is not None:
            # the pool's connections and the coalescer's are all made here
            make = pool.make_connection

            def make_connection() -> AbstractConnection:
                conn: AbstractConnection = make()  # type: ignore[no-untyped-call]
                conn.register_connect_callback(on_connect)  # type: ignore[no-untyped-call]
                return conn

            pool.make_connection = make_connection  # type: ignore[method-assign]
        self.coalescer = None if coalescing is None else coalescing(pool.make_connection)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AbstractConnection]:
        """A connection of this node's pool; closed, not reused, if the
        conversation on it was cut short (error, timeout, cancellation)."""
        conn: AbstractConnection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        finished = False
        try:
            yield conn
            finished = True
        finally:
            if not finished:
                await conn.disconnect(nowait=True)
            await self._pool.release(conn)

    async def exchange(self, commands: Sequence[Command]) -> list[Any]:
        """Commands in one round trip on a pool connection (no coalescing)."""
        async with self.connection() as conn:
            return await exchange(conn, commands)

    def subscriber_connection(self) -> AbstractConnection:
        """A new connection, outside the pool, for a subscription: it waits
        for messages indefinitely. Over TCP the kernel's keep-alive probes
        (not Redis commands: an idle subscription costs Redis nothing) find
        a peer that is gone without a word (a host down, a partition)."""
        kwargs = {**self._pool.connection_kwargs, "socket_timeout": None}
        if issubclass(self._pool.connection_class, Connection):  # TCP, with or without TLS
            kwargs["socket_keepalive"] = True
            kwargs["socket_keepalive_options"] = SUBSCRIBER_KEEPALIVE
        conn: AbstractConnection = self._pool.connection_class(**kwargs)
        return conn

    async def drop_idle(self) -> None:
        """Close the idle pooled connections (the coalescer reconnects by itself)."""
        await self._pool.disconnect(inuse_connections=False)

    async def reconnect(self) -> None:
        """Drop every connection, in use or idle, and the coalescer's: the
        server they reach is no longer the one to talk to (a conversation
        cut short fails with a 503; it would have been lost anyway)."""
        await self._pool.disconnect(inuse_connections=True)
        if self.coalescer is not None:
            self.coalescer.drop_connection()

    async def close(self) -> None:
        if self.coalescer is not None:
            await self.coalescer.close()
        if self._owned:
            await self._pool.disconnect()


class Servers(Protocol):
    cluster: bool

    async def ready(self) -> None: ...

    def node_for(self, key: Any) -> Node: ...

    def default_node(self) -> Node: ...

    def primaries(self) -> list[Node]: ...

    def route(self, commands: Sequence[Command]) -> list[tuple[Node, list[int]]]:
        """Commands grouped by the node that serves them, order kept in each group."""
        ...

    async def redirected(self, error: rexc.AskError) -> None: ...

    async def lost(self) -> None: ...

    def on_new_routes(self, changed: Callable[[], None]) -> None:
        """Call changed() whenever keys may have moved to other nodes."""
        ...

    async def demoted(self) -> None:
        """A server answered READONLY: it is a replica now."""
        ...

    async def close(self) -> None: ...


class SingleServer:
    """A plain Redis server: every key lives on the one node."""

    cluster = False

    def __init__(
        self, redis: Redis, coalescing: Coalescing | None, on_connect: OnConnect | None = None
    ) -> None:
        # the client's own pool: the client closes it
        self._node = Node("redis", redis.connection_pool, coalescing, False, on_connect)

    async def ready(self) -> None:
        return None

    def node_for(self, key: Any) -> Node:
        return self._node

    def default_node(self) -> Node:
        return self._node

    def primaries(self) -> list[Node]:
        return [self._node]

    def route(self, commands: Sequence[Command]) -> list[tuple[Node, list[int]]]:
        return [(self._node, list(range(len(commands))))]

    async def redirected(self, error: rexc.AskError) -> None:
        return None

    async def lost(self) -> None:
        return None

    def on_new_routes(self, changed: Callable[[], None]) -> None:
        return None  # every key lives on the one node

    async def demoted(self) -> None:
        # behind Sentinel, new connections find the new master
        await self._node.reconnect()

    async def close(self) -> None:
        await self._node.close()


class ClusterServers:
    """A Redis Cluster: a Node per primary, found through redis-py's slot table.

    A MOVED reply updates the table for that slot (redis-py's ``move_slot``);
    lost connections make the next call re-read the whole table, since a
    primary may have failed over.
    """

    cluster = True

    def __init__(
        self,
        redis: RedisCluster,
        coalescing: Coalescing | None,
        max_connections: int,
        on_connect: OnConnect | None = None,
    ) -> None:
        self._redis = redis
        self._coalescing = coalescing
        self._on_connect = on_connect
        self._max_connections = max_connections
        self._nodes: dict[str, Node] = {}
        self._started = False
        self._stale = True
        self._closed = False
        self._reading: asyncio.Task[None] | None = None
        self._route_changes: list[Callable[[], None]] = []

    async def ready(self) -> None:
        """The slot table, read again if it may be stale.

        The reading runs in a task of its own that the callers share and
        only wait for: a caller cancelled meanwhile (a request given up, the
        app stopping) leaves it alone. redis-py writes with asyncio.wait_for,
        which on Python 3.11 swallows a cancellation that lands just as a
        write completes, so a caller cancelled inside the reading itself
        could carry on as if never cancelled. close() ends the reading
        before the client's connections are closed, and none starts after.
        A closed client refuses every call: reading the table again, or a
        node's pool connecting again, would leave what nothing closes.
        """
        if self._closed:
            raise rexc.ConnectionError("The Redis Cluster client is closed")
        if not self._stale:
            return
        reading = self._reading
        if reading is None:
            reading = self._reading = asyncio.create_task(self._read_slots())
            reading.add_done_callback(self._slots_read)
        await asyncio.shield(reading)

    async def _read_slots(self) -> None:
        if not self._started:
            await self._redis.initialize()  # the slot table and command parser
            self._started = True
        else:
            await self._redis.nodes_manager.initialize()
            self._routes_changed()
        self._stale = False

    def _slots_read(self, reading: asyncio.Task[None]) -> None:
        self._reading = None
        if not reading.cancelled():
            reading.exception()  # the callers waiting got it; none may be left

    def on_new_routes(self, changed: Callable[[], None]) -> None:
        self._route_changes.append(changed)

    def _routes_changed(self) -> None:
        for changed in self._route_changes:
            changed()

    def _node(self, server: ClusterNode) -> Node:
        """The Node for a server, kept by address. Its pool is feedsvc's own,
        not the ClusterNode's: redis-py disconnects a ClusterNode's
        connections whenever it rebuilds its slot table (after a failover or
        a slot move), which would cut conversations off in mid-flight."""
        node = self._nodes.get(server.name)
        if node is None:
            pool = ConnectionPool(
                connection_class=server.connection_class,
                max_connections=self._max_connections,
                **{**server.connection_kwargs, "retry": Retry(NoBackoff(), 0)},
            )
            node = Node(server.name, pool, self._coalescing, True, self._on_connect)
            self._nodes[server.name] = node
        return node

    def node_for(self, key: Any) -> Node:
        raw = key if isinstance(key, bytes) else str(key).encode()
        server = self._redis.nodes_manager.get_node_from_slot(key_slot(raw))
        return self._node(server)

    def default_node(self) -> Node:
        return self._node(self._redis.get_default_node())

    def primaries(self) -> list[Node]:
        return [self._node(server) for server in self._redis.get_primaries()]

    def route(self, commands: Sequence[Command]) -> list[tuple[Node, list[int]]]:
        """By each command's key slot; a keyless command goes with its keyed
        neighbours (the next one, else the previous one)."""
        keys = [command_key(c) for c in commands]
        nodes: list[Node | None] = [None if k is None else self.node_for(k) for k in keys]
        following: Node | None = None
        for i in reversed(range(len(nodes))):
            following = nodes[i] = nodes[i] or following
        previous: Node | None = None
        for i, node in enumerate(nodes):
            previous = nodes[i] = node or previous
        groups: dict[str, tuple[Node, list[int]]] = {}
        for i, found in enumerate(nodes):
            node = found or self.default_node()
            groups.setdefault(node.name, (node, []))[1].append(i)
        return list(groups.values())

    async def redirected(self, error: rexc.AskError) -> None:
        if isinstance(error, rexc.MovedError):
            await self._redis.nodes_manager.move_slot(error)
            self._routes_changed()

    async def lost(self) -> None:
        self._stale = True

    async def demoted(self) -> None:
        self._stale = True

    async def close(self) -> None:
        self._closed = True
        reading = self._reading
        if reading is not None:
            reading.cancel()
            await asyncio.wait([reading])
        for node in self._nodes.values():
            with contextlib.suppress(Exception):
                await node.close()
