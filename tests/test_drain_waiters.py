"""SIGTERM ends every waiter at once and cleanly, single process and --workers.

Event streams, long polls (``wait=``) and claim waits wait for something
that may not come for a long while; a stopping process must not hold them
for the whole ``--shutdown-grace`` and then cut them off. On SIGTERM a
stream ends with its final chunk (as at ``--stream-lifetime``: the client
resumes with ``Last-Event-ID``), a long poll answers its empty page and a
claim wait its 204, and the process exits 0.

A waiter is known to be waiting when its queue's shard channel has a
subscriber (each long poll and claim wait follows a queue of its own); a
stream, once it has sent ``retry:``. Only then is SIGTERM sent, so no
request can still be on its way in (a head not yet read counts as an idle
connection and is closed).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.storage.keys import QueueKeys
from feedsvc.testing import ServiceProcess

pytestmark = pytest.mark.process  # feedsvc serve (--workers), and its followers

STREAMS, LONG_POLLS, CLAIM_WAITS = 20, 5, 5
#: Longer than any wait here: the old drain cut everything off only after it.
GRACE = "10"


async def shard_subscribers(redis: aioredis.Redis, channel: str) -> int:
    reply = await redis.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
    if isinstance(reply, dict):
        return int(next(iter(reply.values())))
    return int(reply[1])


async def wait_until_followed(redis: aioredis.Redis, channels: list[str]) -> None:
    async with asyncio.timeout(30):
        for channel in channels:
            while await shard_subscribers(redis, channel) < 1:  # noqa: ASYNC110 (in Redis)
                await asyncio.sleep(0.02)


async def open_stream(
    http: aiohttp.ClientSession, headers: dict[str, str]
) -> aiohttp.ClientResponse:
    response = await http.get(
        "/v2/queues/s/messages", headers={**headers, "Accept": "text/event-stream"}
    )
    assert response.status == 200
    async with asyncio.timeout(10):
        assert await response.content.readuntil(b"\n\n") == b"retry: 2000\n\n"
    return response


async def read_to_end(response: aiohttp.ClientResponse) -> bytes:
    """The rest of the stream; raises ClientPayloadError if it was cut off
    without its final chunk."""
    try:
        return await response.content.read()
    finally:
        response.release()


async def long_poll(http: aiohttp.ClientSession, headers: dict[str, str], queue: str) -> object:
    # the first waits alone (include_delayed), the others through the shared tail
    alone = "&include_delayed=true" if queue.endswith("-0") else ""
    url = f"/v2/queues/{queue}/messages?wait=20{alone}"
    async with http.get(url, headers=headers) as response:
        return response.status, await response.json()


async def claim_wait(http: aiohttp.ClientSession, headers: dict[str, str], queue: str) -> object:
    body = {"ttl": 60, "grace": 60}
    async with http.post(f"/v2/queues/{queue}/claims?wait=20", json=body, headers=headers) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_ends_streams_long_polls_and_claim_waits_at_once(
    workers: int, redis_server: RedisServer, tmp_path: Path
) -> None:
    project = "drain-" + uuid.uuid4().hex
    headers = {"X-Project-ID": project, "Client-ID": str(uuid.uuid4())}
    log = tmp_path / "serve.log"
    flags = ("--workers", str(workers), "--shutdown-grace", GRACE)
    redis = aioredis.Redis.from_url(redis_server.url)
    timeout = aiohttp.ClientTimeout(total=60)
    with ServiceProcess("--redis-url", redis_server.url, *flags, log_path=log) as svc:
        connector = aiohttp.TCPConnector(limit=0)  # a connection per waiter, however many
        async with aiohttp.ClientSession(svc.url, timeout=timeout, connector=connector) as http:
            polled = [f"lp-{n}" for n in range(LONG_POLLS)]
            claimed = [f"cw-{n}" for n in range(CLAIM_WAITS)]
            for queue in ["s", *polled, *claimed]:
                async with http.put(f"/v2/queues/{queue}", headers=headers) as r:
                    assert r.status == 201
            # one message the streams have had: where they would resume
            async with http.post(
                "/v2/queues/s/messages", json={"messages": [{"body": 1}]}, headers=headers
            ) as r:
                assert r.status == 201
            reader = {**headers, "Client-ID": str(uuid.uuid4())}
            streams = [await open_stream(http, reader) for _ in range(STREAMS)]
            polls = [asyncio.create_task(long_poll(http, headers, q)) for q in polled]
            claims = [asyncio.create_task(claim_wait(http, headers, q)) for q in claimed]
            await wait_until_followed(
                redis, [QueueKeys.of(project, q).feed for q in polled + claimed]
            )
            assert not any(task.done() for task in polls + claims)

            sent = time.monotonic()
            svc.process.send_signal(signal.SIGTERM)
            ends = await asyncio.gather(*(read_to_end(s) for s in streams), return_exceptions=True)
            answers = await asyncio.gather(*polls, *claims, return_exceptions=True)
            code = await asyncio.to_thread(svc.process.wait, 30)
            print(
                f"drain of {STREAMS + LONG_POLLS + CLAIM_WAITS} waiters, {workers} workers: "
                f"exited {time.monotonic() - sent:.3f} s after SIGTERM"
            )
    await redis.aclose()

    # every stream ended with its final chunk: its event, then a clean end
    for end in ends:
        assert isinstance(end, bytes), end
        assert end.startswith(b"id: ") and b"event: message" in end
    assert answers[:LONG_POLLS] == [(200, {"messages": [], "links": []})] * LONG_POLLS
    assert answers[LONG_POLLS:] == [(204, b"")] * CLAIM_WAITS
    assert code == 0
    text = log.read_text()
    assert "cutting off" not in text
    assert text.count("drained: no requests in flight") == workers
