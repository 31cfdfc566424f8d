"""The storage drivers by name: the one place that knows the concrete classes.

Everything outside ``feedsvc.storage`` asks :func:`make_store` for a
:class:`~feedsvc.storage.base.FeedStore` and never names a driver class, as
saq's ``Queue.from_url`` does. A new driver is a class implementing
``FeedStore`` plus one entry in :data:`DRIVERS` (and its name in
``feedsvc.config.DRIVER_NAMES``, which ``--driver`` accepts).
"""

from __future__ import annotations

from collections.abc import Callable

from feedsvc.clock import SYSTEM_CLOCK, Clock
from feedsvc.config import DRIVER_NAMES, RedisSettings, StoreSettings
from feedsvc.errors import Unavailable
from feedsvc.storage.base import FeedStore
from feedsvc.storage.lua_store import LuaStore
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_store import NaiveWatchStore, WatchStore

DRIVERS: dict[str, Callable[..., FeedStore]] = {
    "lua": LuaStore,
    "watch": WatchStore,
    "watch-naive": NaiveWatchStore,
}
assert tuple(DRIVERS) == DRIVER_NAMES, "feedsvc.config.DRIVER_NAMES must list every driver"


def make_store(settings: StoreSettings, clock: Clock = SYSTEM_CLOCK) -> FeedStore:
    """The driver settings.driver names, on settings.redis_url; call open() next."""
    if settings.redis_url is None:
        raise ValueError("make_store needs settings.redis_url")
    return DRIVERS[settings.driver](Transport(settings, clock), settings, clock)


async def eviction_problems(settings: RedisSettings) -> list[str] | None:
    """What ``feedsvc serve`` checks before serving: one line per Redis
    primary whose maxmemory-policy may evict feedsvc's keys (empty: none
    may), or None if Redis cannot be reached yet (then each process reads
    the policies before its first write). See ``memory_policy.py``."""
    transport = Transport(settings, SYSTEM_CLOCK)
    transport.memory_policy.log_changes = False
    try:
        await transport.memory_policy.check()
    except Unavailable:
        return None
    finally:
        await transport.close()
    return transport.memory_policy.problems()
