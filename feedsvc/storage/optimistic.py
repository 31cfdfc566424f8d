"""The WATCH engine: optimistic transactions, as arq's ``enqueue_job`` does
them, in the fewest round trips the protocol allows (WATCH and the reads in
one write, MULTI..EXEC in a second), retried after a jittered, growing,
bounded back-off that gives the pool slot back while it sleeps.

The transport holds one (``Transport.transactions``), made with what it
needs of the transport; the drivers call ``optimistic()`` or, for a loop of
their own, ``attempt()`` and ``backoff()`` inside ``write_slot()``.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.exceptions as rexc
from redis.asyncio.connection import AbstractConnection

from feedsvc.errors import TooMuchContention
from feedsvc.storage.base import StoreCounters
from feedsvc.storage.coalescer import Command
from feedsvc.storage.gate import Gate
from feedsvc.storage.memory_policy import MemoryPolicyGuard
from feedsvc.storage.nodes import Servers

BACKOFF_BASE = 0.0005
BACKOFF_CAP = 0.05

# A slot on the move: nothing was written, so it counts as a conflict.
_REDIRECTS = (rexc.AskError, rexc.TryAgainError)

T = TypeVar("T")
# A plan looks at the replies to the reads and returns the commands to run in
# MULTI/EXEC (None: write nothing) and the operation's result.
Plan = Callable[[list[Any]], tuple[list[Command] | None, T]]


class Conflicted(Exception):
    """Raised by a transaction plan whose reads show a concurrent writer."""


async def send(conn: AbstractConnection, *commands: Command) -> list[Any]:
    """Send commands in one write and read one reply each (an error reply raises)."""
    await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
    return [await conn.read_response() for _ in commands]


@dataclass(slots=True)
class OptimisticTransactions:
    """The WATCH engine of one transport: its servers, its pool slots and
    their gate, its counters and memory policy, ``retries`` attempts at most
    (``--watch-retries``), and ``wait`` (WAIT for replicas, with
    ``replicated`` to judge its reply) sent after every EXEC, if set."""

    servers: Servers
    slot: Callable[[], AbstractAsyncContextManager[None]]
    gate: Gate
    counters: StoreCounters
    memory_policy: MemoryPolicyGuard
    retries: int
    wait: Command | None
    replicated: Callable[[list[Any]], list[Any]]

    @asynccontextmanager
    async def write_slot(self) -> AsyncIterator[None]:
        """slot() for a loop of writes: first, writes must be allowed
        (``memory_policy.py``; checked before the slot is taken, as the
        check needs one of its own without coalescing)."""
        if self.memory_policy.attention:
            await self.memory_policy.admit_write()
        async with self.slot():
            yield

    async def optimistic(
        self,
        watch: Sequence[str],
        reads: Sequence[Command],
        plan: Plan[T],
        before: Sequence[Command] = (),
    ) -> T:
        """WATCH, read, plan, MULTI/EXEC; again after a backoff on conflict.

        ``before`` are writes that need no protection (idempotent ones, such
        as message bodies nothing indexes yet): they travel in the first
        attempt's first write, ahead of the WATCH, so they cost no round trip
        and stay out of the critical section; once an attempt has reached the
        server they are not sent again.
        """
        attempt = 0
        async with self.write_slot():
            while True:
                try:
                    done, result = await self._converse(watch, reads, plan, before)
                    before = ()
                except _REDIRECTS as redirect:
                    await self._redirected(redirect)
                    done, result = False, None
                if done:
                    return result  # type: ignore[return-value]
                await self.backoff(attempt)
                attempt += 1

    async def attempt(
        self, watch: Sequence[str], reads: Sequence[Command], plan: Plan[T]
    ) -> tuple[bool, T | None]:
        """One optimistic transaction: (True, result) if it ran, (False, None) on conflict.

        Call it inside write_slot(). A plan raises Conflicted when the reads show
        another writer got there first (the same as EXEC answering nil). The
        transaction runs on a connection to the server owning the watched
        keys' slot; if the slot has moved (MOVED, ASK, TRYAGAIN) nothing was
        written, so it counts as a conflict and is tried again on the new owner.
        """
        try:
            return await self._converse(watch, reads, plan)
        except _REDIRECTS as redirect:
            await self._redirected(redirect)
            return False, None

    async def _redirected(self, redirect: Exception) -> None:
        self.counters.cluster_redirects += 1
        if isinstance(redirect, rexc.AskError):
            await self.servers.redirected(redirect)

    async def _converse(
        self,
        watch: Sequence[str],
        reads: Sequence[Command],
        plan: Plan[T],
        before: Sequence[Command] = (),
    ) -> tuple[bool, T | None]:
        await self.servers.ready()
        async with self.servers.node_for(watch[0]).connection() as conn:
            replies = await send(conn, *before, ("WATCH", *watch), *reads)
            try:
                writes, result = plan(replies[len(before) + 1 :])
            except Conflicted:
                await send(conn, ("UNWATCH",))
                return False, None
            if writes is None:
                await send(conn, ("UNWATCH",))
                return True, result
            self.counters.watch_transactions += 1
            wait = [] if self.wait is None else [self.wait]
            done = await send(conn, ("MULTI",), *writes, ("EXEC",), *wait)
            executed = done[-1 - len(wait)]
            if executed is None:
                return False, None
            for reply in executed:
                if isinstance(reply, Exception):
                    raise reply
            if wait:
                self.replicated(done)
            return True, result

    async def backoff(self, attempt: int) -> None:
        """Count a conflict and wait a jittered, growing while; 503 when out of
        tries. The slot is given back while sleeping: a crowd of conflicting
        writers must not starve everyone else of connections."""
        self.counters.watch_retries += 1
        if attempt + 1 >= self.retries:
            self.counters.watch_conflicts_exhausted += 1
            raise TooMuchContention(f"Gave up after {self.retries} conflicting attempts; retry.")
        ceiling = min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)
        await self.gate.pause(random.uniform(0, ceiling))
