"""Following Redis Sentinel's announcements of a new master.

redis-py asks the sentinels for the master only when it opens a connection,
so without this an old master that stays up (a manual failover, a network
partition) would keep taking writes on the connections already open, writes
that are lost when it is demoted. :func:`follow_sentinels` listens to one
sentinel at a time for ``+switch-master`` and calls ``switched`` on each
announcement for the service, and also after every (re)subscription, since
an announcement may have been missed meanwhile. Reconnecting is cheap and
safe: new connections ask the sentinels where the master is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.exceptions as rexc
from redis.asyncio.sentinel import Sentinel

log = logging.getLogger("feedsvc")

# Seconds between attempts to subscribe to a sentinel's announcements.
SENTINEL_RETRY = 1.0


async def follow_sentinels(
    manager: Sentinel, service: str, switched: Callable[[bool], Awaitable[None]]
) -> None:
    """Run until cancelled; switched(announced) on a new master (announced)
    or a new subscription (not announced)."""
    turn = 0
    while True:
        client = manager.sentinels[turn % len(manager.sentinels)]
        turn += 1
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe("+switch-master")
                await switched(False)
                async for message in pubsub.listen():
                    data = message.get("data")
                    if message.get("type") != "message" or not isinstance(data, bytes):
                        continue
                    if data.split()[0].decode() == service:
                        log.warning("Sentinel: a new master: %s", data.decode())
                        await switched(True)
        except (rexc.RedisError, OSError) as exc:
            log.debug("Sentinel subscription lost (%s); trying the next sentinel", exc)
            await asyncio.sleep(SENTINEL_RETRY)
