"""Projects' request-rate buckets in Redis: one GCRA per project
(``lua/rate_limit.lua``), shared by every process and host on that Redis.

A caller takes requests in chunks (:meth:`RedisRateLimits.take`), so Redis
sees one call per chunk, not one per request (``feedsvc.services.rate_limiter`` keeps
each process's chunk). Both drivers use this one script: the limiter is not
part of the lua-vs-watch comparison, and a WATCH version would need two
round trips where the script needs one.
"""

from __future__ import annotations

from redis.exceptions import NoScriptError

from feedsvc.errors import StorageUnavailable
from feedsvc.storage.base import RateGrant
from feedsvc.storage.keys import project_limits_key, rate_bucket_key
from feedsvc.storage.scripts import load_script
from feedsvc.storage.transport import Transport


class RedisRateLimits:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._script = load_script("rate_limit")

    async def take(
        self, project: str, want: int, now_ms: int, rate: float, burst: int
    ) -> RateGrant:
        """Up to want requests of the project's bucket at now_ms; rate and
        burst are the defaults, which the project's limits hash overrides.
        Raises StorageUnavailable on Redis trouble."""
        script = self._script
        keys = (rate_bucket_key(project), project_limits_key(project))
        call = ("EVALSHA", script.sha, 2, *keys, now_ms, repr(rate), burst, want)
        # not idempotent: a call sent twice takes twice, which errs on the safe side
        [reply] = await self._transport.call([call], idempotent=False)
        if isinstance(reply, NoScriptError):
            self._transport.counters.noscript_reloads += 1
            loaded, reply = await self._transport.call(
                [("SCRIPT", "LOAD", script.source), call], idempotent=False
            )
            if isinstance(loaded, Exception):
                async with self._transport.errors():
                    raise loaded
        if isinstance(reply, Exception):
            async with self._transport.errors():
                raise reply
        try:
            granted, retry_ms, rate_in_force, burst_in_force = reply
            return RateGrant(int(granted), int(retry_ms), float(rate_in_force), int(burst_in_force))
        except (TypeError, ValueError):
            raise StorageUnavailable(f"rate_limit.lua answered {reply!r}") from None
