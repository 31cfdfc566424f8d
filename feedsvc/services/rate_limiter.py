"""Each process's share of the projects' request rates (``--project-rate``).

The rate itself lives in Redis, one bucket per project
(``storage/rate_limits.py``, GCRA), so it holds across ``--workers`` and
hosts. Asking Redis on every request would cost a round trip each, far more
than the 5 % this feature may cost, so a process takes requests from the
bucket in chunks (a *lease*) and admits from that allowance locally, a dict
look-up and a clock read per request:

* a lease takes at most a tenth of the burst; it starts at one request and
  doubles each time one is used up, halves each time one expires unused;
* what a lease leaves unused after ``LEASE_MS`` is dropped, never handed
  back: tokens are only ever taken from the bucket, so over any interval
  ``t`` a project is admitted at most ``rate * t + burst`` requests plus
  what the processes held when it began, at most ``processes * burst / 10``;
  the price is that a process may refuse while another holds a few unused;
* one lease at a time per project and process: the requests that find the
  allowance empty wait for that one call;
* a refusal is remembered until the bucket holds a request again (at least
  ``MIN_REFUSAL_MS``), so a project hammering over its rate costs Redis
  little;
* Redis trouble lets the project's requests through for ``FAIL_OPEN_MS``
  (logged a line per interval): each request then meets the same Redis on
  its own and answers 503 if it needs it, so refusing here would add
  nothing but a second outage when only the limiter's slot is in trouble.

An override in the project's limits hash (``fields rate, burst``) is read by
the lease call itself, so it costs nothing per request and is in force on a
process from its next lease: within ``LEASE_MS``, or as soon as the current
allowance is used up.
"""

from __future__ import annotations

import asyncio
import math

from feedsvc.clock import Clock
from feedsvc.config import ClientSettings
from feedsvc.errors import RateLimited, Unavailable
from feedsvc.log_counter import LogCounter
from feedsvc.storage.base import RateLimitStore

#: ms after which what a lease left unused is dropped (and an override is read again).
LEASE_MS = 1000
#: A lease takes at most burst // CHUNK_SHARE requests (at least one).
CHUNK_SHARE = 10
#: ms a refusal is kept at least, whatever the bucket says.
MIN_REFUSAL_MS = 10
#: ms requests pass unchecked after the limiter met Redis trouble.
FAIL_OPEN_MS = 1000
#: Leases a request may wait for before it is refused (others took them all).
MAX_ROUNDS = 8
#: Projects whose allowance a process keeps; all dropped when full.
MAX_PROJECTS = 10000
#: An allowance that does not run out (no limit, or Redis trouble).
UNLIMITED = 1 << 62


class _Allowance:
    __slots__ = ("chunk", "expires_ms", "pending", "refused_until_ms", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.expires_ms = 0
        self.refused_until_ms = 0
        self.chunk = 1
        self.pending: asyncio.Future[None] | None = None


class ProjectRateLimiter:
    """Admits a project's requests within its rate, or raises RateLimited."""

    def __init__(
        self, limits: RateLimitStore, settings: ClientSettings, clock: Clock, trouble: LogCounter
    ) -> None:
        self._limits = limits
        self._rate = settings.project_rate
        self._burst = settings.project_burst
        self._clock = clock
        self._trouble = trouble
        self._allowances: dict[str, _Allowance] = {}

    def admit_now(self, project: str) -> bool:
        """Admit one request from the project's allowance in hand, if it has
        one: the path of nearly every request, with no await."""
        allowance = self._allowances.get(project)
        if allowance is None or allowance.tokens <= 0:
            return False
        if self._clock.now_ms() >= allowance.expires_ms:
            return False
        allowance.tokens -= 1
        return True

    async def admit(self, project: str) -> None:
        """Admit one request of the project, leasing from Redis if need be;
        RateLimited when the project is over its rate."""
        allowance = self._allowances.get(project)
        if allowance is None:
            if len(self._allowances) >= MAX_PROJECTS:
                self._allowances.clear()
            allowance = self._allowances[project] = _Allowance()
        for _ in range(MAX_ROUNDS):
            now = self._clock.now_ms()
            if allowance.tokens > 0 and now < allowance.expires_ms:
                allowance.tokens -= 1
                return
            if now < allowance.refused_until_ms:
                raise RateLimited(math.ceil((allowance.refused_until_ms - now) / 1000))
            if allowance.pending is not None:
                # another request is leasing: take from what it brings
                await asyncio.shield(allowance.pending)
                continue
            pending = allowance.pending = asyncio.get_running_loop().create_future()
            try:
                await self._lease(project, allowance, now)
            finally:
                allowance.pending = None
                pending.set_result(None)
        raise RateLimited(1)

    async def _lease(self, project: str, allowance: _Allowance, now: int) -> None:
        try:
            grant = await self._limits.take(project, allowance.chunk, now, self._rate, self._burst)
        except Unavailable as exc:
            self._trouble.count(f"{exc}")
            allowance.tokens, allowance.expires_ms = UNLIMITED, now + FAIL_OPEN_MS
            return
        if grant.rate <= 0:  # this project has no limit (its override says 0)
            allowance.tokens, allowance.expires_ms = UNLIMITED, now + LEASE_MS
            return
        if grant.granted < 1:
            allowance.tokens = 0
            allowance.refused_until_ms = now + max(MIN_REFUSAL_MS, grant.retry_after_ms)
            return
        used_up = allowance.tokens <= 0
        chunk = allowance.chunk * 2 if used_up else allowance.chunk // 2
        allowance.chunk = max(1, min(chunk, grant.burst // CHUNK_SHARE))
        allowance.tokens, allowance.expires_ms = grant.granted, now + LEASE_MS
