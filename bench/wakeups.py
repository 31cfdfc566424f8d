"""How soon a waiter wakes for what becomes visible without a post, and what
an idle waiter costs Redis: ``python -m bench.wakeups [runs]``.

For each driver, against a private redis-server on a free port and the
service in this process (on the host's clock, claims down to 1 s):

- ``due``: a message posted with delay=1, then a long poll (``wait=5``);
  the answer's arrival minus (the time the post was sent + 1 s).
- ``stream due``: a caught-up stream, then one post of a visible message
  and a message delayed 1 s; the delayed message's event minus (post + 1 s).
- ``released``: a claim wait (``wait=5``) over a claimed message, whose
  claim is then released; the 201's arrival minus the time the DELETE was sent.
- ``one released`` (``1s``): as ``released``, but one message is released
  (``POST .../messages/{id}/release``) with delay 0 (1 s); the 201's arrival
  minus (the time the release was sent + the delay).
- ``claim expired``: a message claimed for 1 s, then a claim wait; the 201's
  arrival minus (the time the first claim was sent + 1 s).
- ``poll released`` / ``stream released``: a long poll (``wait=5``) or a
  caught-up stream over a claimed message (they pass it, as a list does),
  whose claim is then released; the message's arrival minus the time the
  DELETE was sent.
- ``poll expired`` / ``stream expired``: a message claimed for 1 s, then a
  long poll or a stream; its arrival minus (the claim was sent + 1 s).
- ``idle``: Redis commands (``INFO commandstats``, INFO itself left out)
  of a long poll and of a claim wait of 0.2 s and of 4 s on a queue with
  nothing visible (equal counts: waiting itself costs nothing): with
  nothing pending, and with a message delayed 900 s and one claimed for
  60 s (whose moments lie beyond the wait).

Each delay is the median of ``runs`` (default 5) in milliseconds; each is
an upper bound (it includes the request that made the message visible).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from feedsvc.app import create_app
from feedsvc.config import Settings
from feedsvc.embedded_redis.server import RedisServer

Client = TestClient[web.Request, web.Application]
CLAIM = {"ttl": 60, "grace": 60}


def headers() -> dict[str, str]:
    return {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "bench-wakeups"}


def queue() -> str:
    return f"/v2/queues/w{uuid.uuid4().hex[:12]}"


async def post(http: Client, q: str, *messages: dict[str, Any]) -> None:
    response = await http.post(f"{q}/messages", json={"messages": messages}, headers=headers())
    assert response.status == 201, await response.text()


async def due(http: Client) -> float:
    q = queue()
    sent = time.monotonic()
    await post(http, q, {"body": "later", "delay": 1})
    response = await http.get(f"{q}/messages", params={"wait": "5"}, headers=headers())
    arrived = time.monotonic()
    assert len((await response.json())["messages"]) == 1
    return arrived - sent - 1.0


async def stream_due(http: Client) -> float:
    q = queue()
    stream = await http.get(f"{q}/messages", headers={**headers(), "Accept": "text/event-stream"})
    try:
        await stream.content.readline()  # retry: caught up
        sent = time.monotonic()
        await post(http, q, {"body": "now"}, {"body": "later", "delay": 1})
        events = 0
        while events < 2:
            line = await asyncio.wait_for(stream.content.readline(), 5)
            events += line.startswith(b"data:")
        return time.monotonic() - sent - 1.0
    finally:
        stream.close()


async def released(http: Client) -> float:
    q = queue()
    await post(http, q, {"body": "work"})
    held = await http.post(f"{q}/claims", json=CLAIM, headers=headers())
    waiting = asyncio.create_task(
        http.post(f"{q}/claims", params={"wait": "5"}, json=CLAIM, headers=headers())
    )
    await asyncio.sleep(0.3)
    sent = time.monotonic()
    await http.delete(held.headers["Location"], headers=headers())
    response = await waiting
    arrived = time.monotonic()
    assert response.status == 201
    return arrived - sent


async def one_released(http: Client, delay: int) -> float:
    q = queue()
    await post(http, q, {"body": "work"})
    held = await http.post(f"{q}/claims", json=CLAIM, headers=headers())
    [message] = (await held.json())["messages"]
    claim_id = held.headers["Location"].rsplit("/", 1)[1]
    waiting = asyncio.create_task(
        http.post(f"{q}/claims", params={"wait": "5"}, json=CLAIM, headers=headers())
    )
    await asyncio.sleep(0.3)
    sent = time.monotonic()
    release = f"{q}/messages/{message['id']}/release"
    answer = await http.post(
        release, params={"claim_id": claim_id}, json={"delay": delay}, headers=headers()
    )
    assert answer.status == 204
    response = await waiting
    arrived = time.monotonic()
    assert response.status == 201
    return arrived - sent - delay


async def claim_expired(http: Client) -> float:
    q = queue()
    await post(http, q, {"body": "work"})
    sent = time.monotonic()
    held = await http.post(f"{q}/claims", json={"ttl": 1, "grace": 0}, headers=headers())
    assert held.status == 201
    response = await http.post(f"{q}/claims", params={"wait": "5"}, json=CLAIM, headers=headers())
    arrived = time.monotonic()
    assert response.status == 201
    return arrived - sent - 1.0


async def claimed(http: Client, q: str, ttl: int) -> tuple[str, float]:
    """A message claimed for ttl s: the claim's href and when it was sent."""
    await post(http, q, {"body": "work"})
    sent = time.monotonic()
    held = await http.post(f"{q}/claims", json={"ttl": ttl, "grace": 0}, headers=headers())
    assert held.status == 201
    return held.headers["Location"], sent


async def next_message(stream: Any) -> None:
    while not (await asyncio.wait_for(stream.content.readline(), 5)).startswith(b"data:"):
        pass


async def poll_released(http: Client) -> float:
    q = queue()
    claim, _ = await claimed(http, q, 60)
    waiting = asyncio.create_task(
        http.get(f"{q}/messages", params={"wait": "5"}, headers=headers())
    )
    await asyncio.sleep(0.3)
    sent = time.monotonic()
    await http.delete(claim, headers=headers())
    response = await waiting
    arrived = time.monotonic()
    assert len((await response.json())["messages"]) == 1
    return arrived - sent


async def stream_released(http: Client) -> float:
    q = queue()
    claim, _ = await claimed(http, q, 60)
    stream = await http.get(f"{q}/messages", headers={**headers(), "Accept": "text/event-stream"})
    try:
        await stream.content.readline()  # retry: caught up
        await asyncio.sleep(0.3)
        sent = time.monotonic()
        await http.delete(claim, headers=headers())
        await next_message(stream)
        return time.monotonic() - sent
    finally:
        stream.close()


async def poll_expired(http: Client) -> float:
    q = queue()
    _, sent = await claimed(http, q, 1)
    response = await http.get(f"{q}/messages", params={"wait": "5"}, headers=headers())
    arrived = time.monotonic()
    assert len((await response.json())["messages"]) == 1
    return arrived - sent - 1.0


async def stream_expired(http: Client) -> float:
    q = queue()
    _, sent = await claimed(http, q, 1)
    stream = await http.get(f"{q}/messages", headers={**headers(), "Accept": "text/event-stream"})
    try:
        await next_message(stream)
        return time.monotonic() - sent - 1.0
    finally:
        stream.close()


async def commands(redis: Redis) -> int:
    await asyncio.sleep(0.3)  # what a request leaves to do (unsubscribing) is done
    stats = await redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


async def idle_cost(http: Client, redis: Redis, pending: bool, claim_wait: bool) -> str:
    """Redis commands of a waiting request of 0.2 s and of 4 s (the fewest
    of three each: the service's own background sweeps land in some windows)."""
    spent = []
    for wait in ("0.2", "4"):
        counts = []
        for _ in range(3):
            q = queue()
            if pending:
                await post(http, q, {"body": "much later", "delay": 900}, {"body": "held"})
                await http.post(f"{q}/claims", json=CLAIM, headers=headers())
            before = await commands(redis)
            if claim_wait:
                answer = await http.post(
                    f"{q}/claims", params={"wait": wait}, json=CLAIM, headers=headers()
                )
                assert answer.status == 204
            else:
                answer = await http.get(f"{q}/messages", params={"wait": wait}, headers=headers())
                assert (await answer.json())["messages"] == []
            counts.append(await commands(redis) - before)
        spent.append(min(counts))
    return f"{spent[0]} commands for 0.2 s, {spent[1]} for 4 s"


async def median_ms(runs: int, measure: Callable[[], Awaitable[float]]) -> str:
    """The median of runs measures, in ms, and each of them."""
    values = [await measure() for _ in range(runs)]
    each = ", ".join(f"{v * 1000:.0f}" for v in values)
    return f"{statistics.median(values) * 1000:.1f} ms (of {each})"


async def bench(redis_url: str, driver: str, runs: int) -> None:
    settings = Settings(
        redis_url=redis_url, driver=driver, min_claim_ttl=1, min_claim_grace=0, log_level="WARNING"
    )
    redis = Redis.from_url(redis_url)
    try:
        async with TestClient(TestServer(create_app(settings))) as http:
            for name, measure in (
                ("due", due),
                ("stream due", stream_due),
                ("released", released),
                ("one released", partial(one_released, delay=0)),
                ("one released 1s", partial(one_released, delay=1)),
                ("claim expired", claim_expired),
                ("poll released", poll_released),
                ("stream released", stream_released),
                ("poll expired", poll_expired),
                ("stream expired", stream_expired),
            ):
                print(f"{driver:6} {name:16} {await median_ms(runs, partial(measure, http))}")
            for pending in (False, True):
                for claim_wait in (False, True):
                    what = "claim wait" if claim_wait else "long poll"
                    state = "pending" if pending else "nothing pending"
                    cost = await idle_cost(http, redis, pending, claim_wait)
                    print(f"{driver:6} idle {what:10} {state:16} {cost}")
    finally:
        await redis.aclose()


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with tempfile.TemporaryDirectory() as data:
        server = RedisServer(Path(data), appendonly=False)
        server.start()
        try:
            for driver in ("lua", "watch"):
                asyncio.run(bench(server.url, driver, runs))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
