"""Whether the Redis feedsvc writes to may evict its keys.

A Redis at its ``maxmemory`` with an evicting ``maxmemory-policy`` deletes
keys to make room, and feedsvc's message records are exactly what it picks:
every policy but ``noeviction`` may take them (the ``volatile-*`` ones
evict keys with a TTL, which every message record has; the ``allkeys-*``
ones anything). Acknowledged messages would vanish without a word, and
queue stats would still count them. So feedsvc needs ``noeviction``: a full
Redis then refuses writes (a 503 for memory, see ``transport.py``) and
loses nothing.

:class:`MemoryPolicyGuard` holds what each primary's policy was found to
be. It is read with ``INFO memory`` (which managed Redis services allow
where they disable ``CONFIG``), else ``CONFIG GET maxmemory-policy``.
``maxmemory 0`` (no limit) does not make another policy safe: maxmemory
can be set at runtime, so any policy but noeviction is refused whatever
the limit is now. A policy that cannot be read at all is refused too: it
may be anything.

When it is read:

* when ``feedsvc serve`` starts (``cli.py``): a Redis that may evict is
  refused, one line and exit 2, unless ``--allow-evicting-redis``;
* before the first write of each process, and again before the first write
  after a connection was lost, a Sentinel failover or a Cluster's slots
  moved (:meth:`MemoryPolicyGuard.stale`): writes wait for that one read
  (``INFO`` on each primary, shared by the writers waiting);
* every ``RECHECK_INTERVAL`` seconds while serving (``Transport``'s ticker),
  every ``REFUSING_RECHECK`` seconds while writes are refused, so that a
  fixed policy is noticed soon.

While a primary may evict, writes are answered 503 naming the policy
(:class:`~feedsvc.errors.RedisMayEvict`); reads go on. With
``--allow-evicting-redis`` writes go on and ``/v2/health``
(``redis_eviction``) and the ``feedsvc_redis_may_evict`` gauge say so,
and keys Redis evicts (its ``evicted_keys``, read with the policy) are
reported there (``feedsvc_redis_evicted_keys``) and logged at ERROR.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from feedsvc.errors import RedisMayEvict

log = logging.getLogger("feedsvc")

SAFE_POLICY = "noeviction"
#: Seconds between two reads of the policies while serving. Writes made
#: between a switch to an evicting policy and the next read are not
#: protected, and a full Redis evicts as much as they write: 30 s let a
#: fast producer lose everything (docs/RELIABILITY.md, round 3). One
#: ``INFO memory`` per primary per second per process costs Redis nothing
#: that shows.
RECHECK_INTERVAL = 1.0
#: The same while writes are refused (an operator may be fixing it).
REFUSING_RECHECK = 1.0
#: The same after a read failed (Redis unreachable).
FAILED_RECHECK = 1.0

#: Per primary (by name): its maxmemory-policy, or None and why it could not be read.
Policies = dict[str, tuple[str | None, str]]


def info_field(reply: Any, field: str) -> str | None:
    """A field of an ``INFO`` reply (bytes or text), or None."""
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return value.strip() or None
    return None


def policy_from_info(reply: Any) -> str | None:
    """maxmemory_policy from an ``INFO memory`` reply, or None."""
    return info_field(reply, "maxmemory_policy")


def policy_from_config(reply: Any) -> str | None:
    """The value from a ``CONFIG GET maxmemory-policy`` reply, or None."""
    if isinstance(reply, dict):
        items = list(reply.items())
    elif isinstance(reply, list | tuple):
        items = list(zip(reply[::2], reply[1::2], strict=False))
    else:
        return None
    for name, value in items:
        if _text(name) == "maxmemory-policy":
            return _text(value)
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def problem(name: str, policy: str | None, why: str) -> str:
    """One line: what is wrong with this primary, and the fix."""
    fix = (
        "set maxmemory-policy to noeviction (CONFIG SET maxmemory-policy noeviction, "
        "redis.conf, or the provider's parameter group), or start feedsvc with "
        "--allow-evicting-redis to serve anyway"
    )
    if policy is None:
        return (
            f"cannot read the maxmemory-policy of Redis at {name} ({why}), so it may "
            f"evict feedsvc's keys: allow INFO (or CONFIG GET) and {fix}"
        )
    return (
        f"Redis at {name} has maxmemory-policy {policy}, which may evict feedsvc's keys "
        f"and so lose acknowledged messages without a word: {fix}"
    )


class MemoryPolicyGuard:
    """What each primary's maxmemory-policy was last found to be, and
    whether writes may go on (module docstring).

    ``attention`` is a plain attribute, read on every call to Redis: true
    while writes must wait for a read of the policies (pending) or must be
    refused.
    """

    def __init__(self, read: Callable[[], Awaitable[Policies]], allow: bool) -> None:
        self._read = read
        self.allow = allow
        self.policies: Policies = {}
        self.pending = True
        self.refusal: str | None = None  # set while writes are refused
        self.attention = True
        self.log_changes = True  # off for the one read at start (cli.py says it)
        #: per primary: the keys Redis says it has evicted since it started
        self.evicted: dict[str, int] = {}
        self._reading: asyncio.Task[None] | None = None

    @property
    def evicting(self) -> bool:
        """Some primary may evict (or its policy could not be read)."""
        return any(policy != SAFE_POLICY for policy, _ in self.policies.values())

    def problems(self) -> list[str]:
        return [
            problem(name, policy, why)
            for name, (policy, why) in sorted(self.policies.items())
            if policy != SAFE_POLICY
        ]

    def stale(self) -> None:
        """The servers may have changed (a reconnect, a failover): the next
        write waits for a read of the policies."""
        self.pending = True
        self.attention = True

    async def check(self) -> None:
        """Read every primary's policy (one read shared by concurrent callers);
        Redis trouble raises (translated by the caller)."""
        reading = self._reading
        if reading is None:
            reading = self._reading = asyncio.create_task(self._check())
            reading.add_done_callback(self._checked)
        await asyncio.shield(reading)

    def _checked(self, reading: asyncio.Task[None]) -> None:
        self._reading = None
        if not reading.cancelled():
            reading.exception()  # the callers waiting got it

    def saw_evicted(self, name: str, count: int) -> None:
        """Primary name's evicted_keys as just read: an increase is logged
        at ERROR (allowed or not, an evicted key may have been a message)."""
        before = self.evicted.get(name)
        self.evicted[name] = count
        if before is not None and count > before:
            log.error(
                "Redis at %s evicted %d keys since feedsvc last looked: acknowledged "
                "messages may be lost (%d evicted since it started)",
                name,
                count - before,
                count,
            )

    def note(self, name: str, policy: str) -> str | None:
        """A new connection found primary name's policy. If it differs from
        what was known, every primary is read again before the next write;
        the refusal (one line) if this change makes writes refused, else None."""
        known = self.policies.get(name)
        if known is not None and known[0] == policy:
            return None
        refused = self.refusal
        self._apply({**self.policies, name: (policy, "")})
        self.stale()
        return self.refusal if self.refusal is not None and self.refusal != refused else None

    async def _check(self) -> None:
        self._apply(await self._read())
        self.pending = False
        self.attention = self.refusal is not None

    def _apply(self, policies: Policies) -> None:
        was = self.problems()
        self.policies = policies
        found = self.problems()
        if not self.log_changes:
            pass
        elif found and found != was:
            for line in found:
                if self.allow:
                    log.warning("serving anyway (--allow-evicting-redis): %s", line)
                else:
                    log.error("refusing writes: %s", line)
        elif was and not found:
            log.warning("Redis evicts nothing now (maxmemory-policy noeviction): writes go on")
        self.refusal = None if self.allow or not found else found[0]
        self.attention = self.pending or self.refusal is not None

    async def admit_write(self) -> None:
        """Return if a write may go on; RedisMayEvict if not (Redis trouble
        while reading the policies raises as it is)."""
        if self.pending:
            await self.check()
        if self.refusal is not None:
            raise RedisMayEvict(f"feedsvc refuses writes: {self.refusal}.")

    async def close(self) -> None:
        """End a read under way (the transport closes its connections next)."""
        reading = self._reading
        if reading is not None:
            reading.cancel()
            await asyncio.wait([reading])

    def next_check_in(self, failed: bool) -> float:
        if failed:
            return FAILED_RECHECK
        return REFUSING_RECHECK if self.refusal is not None else RECHECK_INTERVAL

    def report(self) -> dict[str, Any]:
        """For /v2/health: each primary's policy, and what feedsvc does about it."""
        return {
            "policies": {name: policy for name, (policy, _) in sorted(self.policies.items())},
            "may_evict": self.evicting,
            "allowed": self.allow,
            "refusing_writes": self.refusal is not None,
            "checked": not self.pending,
            "evicted_keys": dict(sorted(self.evicted.items())),
        }
