"""Each process's count of a queue's followers, shared through Redis.

Long polls and event streams live in the memory of the process that serves
them, while a scrape of ``/metrics`` reaches one process (one worker of
``--workers``, one pod of several). So each process reports its followers
of the queues ``--metrics-queues`` names to ``Q:fol`` (a hash under the
queue's tag: field = the process's token, value = ``"<count> <valid until
ms>"``), and a reader adds up the reports that still hold. A report lapses
unless renewed, so a process killed without withdrawing its own stops
counting; the key itself expires (PEXPIRE) once nobody reports.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from feedsvc.clock import Clock
from feedsvc.storage.coalescer import Command
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.transport import Transport


class RedisFollowerCounts:
    """``FeedStore.follower_counts`` of both drivers (queues only)."""

    def __init__(self, transport: Transport, clock: Clock) -> None:
        self._transport = transport
        self._clock = clock
        self._process = uuid.uuid4().hex  # this process's field in every report

    async def report(self, counts: dict[tuple[str, str], int], ttl_ms: int) -> None:
        until = self._clock.now_ms() + ttl_ms
        commands: list[Command] = []
        for (project, queue), count in counts.items():
            key = QueueKeys.of(project, queue).followers
            if count:
                commands.append(("HSET", key, self._process, f"{count} {until}"))
                commands.append(("PEXPIRE", key, ttl_ms))
            else:
                commands.append(("HDEL", key, self._process))
        if commands:
            await self._transport.call_checked(commands)

    async def count(self, project: str, queue: str) -> int:
        key = QueueKeys.of(project, queue).followers
        now = self._clock.now_ms()
        [reports] = await self._transport.call_checked([("HGETALL", key)], idempotent=True)
        total, lapsed = 0, []
        for process, report in _pairs(reports):
            count, _, until = report.partition(b" ")
            if int(until) > now:
                total += int(count)
            else:  # its process stopped reporting (it died) while others went on
                lapsed.append(process)
        if lapsed:
            await self._transport.call_checked([("HDEL", key, *lapsed)])
        return total


def _pairs(reply: dict[bytes, bytes] | list[bytes]) -> Iterator[tuple[bytes, bytes]]:
    """A hash's fields and values, as RESP3 (a map) or RESP2 (a flat list) gives them."""
    if isinstance(reply, dict):
        yield from reply.items()
    else:
        yield from zip(reply[::2], reply[1::2], strict=True)
