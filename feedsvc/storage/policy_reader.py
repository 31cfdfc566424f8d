"""Reads each primary's maxmemory-policy for the guard (``memory_policy.py``):
every primary at once (INFO memory, else CONFIG GET), each new connection
before anything is sent on it, and again every ``RECHECK_INTERVAL`` seconds.

The transport owns the connections and hands this its servers and its
exchange; this owns when and how the policy is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import redis.exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection

from feedsvc.config import RedisSettings
from feedsvc.errors import Unavailable
from feedsvc.storage.memory_policy import (
    MemoryPolicyGuard,
    Policies,
    info_field,
    policy_from_config,
    policy_from_info,
)
from feedsvc.storage.nodes import Node, Servers

log = logging.getLogger("feedsvc")

Exchange = Callable[..., Awaitable[list[list[Any]]]]


class PolicyReader:
    """The guard's eyes: reads the policies and feeds them to the guard."""

    def __init__(
        self,
        client: Redis | RedisCluster,
        servers: Servers,
        exchange: Exchange,
        errors: Callable[[], AbstractAsyncContextManager[None]],
        settings: RedisSettings,
    ) -> None:
        self._redis = client
        self._servers = servers
        self._exchange = exchange
        self._errors = errors
        self._settings = settings
        self._cluster = servers.cluster
        self.guard = MemoryPolicyGuard(self.read_policies, settings.allow_evicting_redis)
        self._ticker: asyncio.Task[None] | None = None
        # a Cluster's slots moved: its primaries may be others
        servers.on_new_routes(self.guard.stale)

    def open(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._watch_memory_policy())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self.guard.close()

    async def read_policies(self) -> Policies:
        """Each primary's maxmemory-policy: from INFO memory, else CONFIG GET
        (managed services may disable either); None and why if neither answers."""
        async with self._errors():
            await self._servers.ready()
        policies: Policies = {}
        for node in self._servers.primaries():
            [[info, stats]] = await self._exchange(
                [(node, [("INFO", "memory"), ("INFO", "stats")])], idempotent=True
            )
            policy = None if isinstance(info, Exception) else policy_from_info(info)
            evicted = None if isinstance(stats, Exception) else info_field(stats, "evicted_keys")
            if evicted is not None and evicted.isdigit():
                self.guard.saw_evicted(self._node_label(node), int(evicted))
            why = ""
            if policy is None:
                [[config]] = await self._exchange(
                    [(node, [("CONFIG", "GET", "maxmemory-policy")])], idempotent=True
                )
                if not isinstance(config, Exception):
                    policy = policy_from_config(config)
                why = f"INFO memory: {_said(info)}; CONFIG GET: {_said(config)}"
            policies[self._node_label(node)] = (policy, why)
        return policies

    async def connected(self, conn: AbstractConnection) -> None:
        """Every new connection (at start, after a reconnect, to a new master
        or primary) reads its server's policy before anything is sent on it.
        A change into one that refuses writes fails the connection once (its
        calls get a 503, none is written): calls admitted before the change
        was known must not reach it. Calls after that are admitted knowing."""
        await conn.send_command("INFO", "memory", check_health=False)
        try:
            policy = policy_from_info(await conn.read_response())
        except rexc.ResponseError:
            policy = None  # INFO refused: the full check falls back to CONFIG GET
        if policy is None:
            self.guard.stale()
            return
        address = f"{getattr(conn, 'host', '')}:{getattr(conn, 'port', '')}"
        name = address if self._cluster else self._single_label()
        refusal = self.guard.note(name, policy)
        if refusal is not None:
            raise rexc.ConnectionError(f"feedsvc refuses writes: {refusal}")

    def _node_label(self, node: Node) -> str:
        """A primary as an operator knows it: its address."""
        if self._cluster:
            return node.name
        return self._single_label()

    def _single_label(self) -> str:
        sentinel = self._settings.redis_sentinel()
        if sentinel is not None:
            return f"the master of Sentinel service {sentinel.service}"
        assert not isinstance(self._redis, RedisCluster)
        kwargs = self._redis.connection_pool.connection_kwargs
        if "path" in kwargs:
            return str(kwargs["path"])
        return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"

    async def _watch_memory_policy(self) -> None:
        """Read the policies now, then every RECHECK_INTERVAL seconds (more
        often while writes are refused or Redis cannot be reached)."""
        guard = self.guard
        while True:
            failed = False
            try:
                await guard.check()
            except Unavailable:
                failed = True
            except Exception:  # a bug must not end the checks for good
                log.exception("reading Redis's maxmemory-policy failed")
                failed = True
            await asyncio.sleep(guard.next_check_in(failed))


def _said(reply: Any) -> str:
    """A reply, briefly, for a message."""
    return str(reply)[:80] if isinstance(reply, Exception) else "no maxmemory_policy field"
