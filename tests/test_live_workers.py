"""Live following with --workers: each worker process holds its own
subscription, and a post wakes the followers of every worker."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from feedsvc.storage.keys import QueueKeys
from feedsvc.testing import ServiceProcess

pytestmark = pytest.mark.process

PROJECT = "workers-" + uuid.uuid4().hex
HEADERS = {"X-Project-ID": PROJECT}


async def read_event(response: aiohttp.ClientResponse) -> dict[str, str]:
    fields: dict[str, str] = {}
    async with asyncio.timeout(10):
        while True:
            line = (await response.content.readline()).decode().rstrip("\n")
            if line == "" and fields:
                return fields
            if line and not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")


async def shard_subscribers(redis: aioredis.Redis, channel: str) -> int:
    """How many connections subscribe to a shard channel (one per process here)."""
    reply = await redis.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
    if isinstance(reply, dict):
        return int(next(iter(reply.values())))
    return int(reply[1])


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_followers_on_every_worker_see_every_post(driver: str) -> None:
    with ServiceProcess("--workers", "2", "--driver", driver) as service:
        channel = QueueKeys.of(PROJECT, "q").feed
        redis = aioredis.Redis.from_url(str(service.redis_url))
        streams: list[aiohttp.ClientResponse] = []
        async with aiohttp.ClientSession(service.url) as http:
            try:
                # open streams until both workers follow the queue (one
                # subscription each, whatever their number of followers)
                for _ in range(40):
                    reader = {**HEADERS, "Client-ID": str(uuid.uuid4())}
                    response = await http.get(
                        "/v2/queues/q/messages",
                        headers={**reader, "Accept": "text/event-stream"},
                    )
                    assert response.status == 200
                    streams.append(response)
                    await read_event(response)  # retry: the stream is up
                    subscribers = await shard_subscribers(redis, channel)
                    if subscribers == 2:
                        break
                assert subscribers == 2, "both workers should follow the queue"
                writer = {**HEADERS, "Client-ID": str(uuid.uuid4())}
                ids = []
                for n in range(3):
                    posted = await http.post(
                        "/v2/queues/q/messages",
                        json={"messages": [{"body": n}]},
                        headers=writer,
                    )
                    ids += [h.rsplit("/", 1)[1] for h in (await posted.json())["resources"]]
                for stream in streams:
                    got = [orjson.loads((await read_event(stream))["data"])["id"] for _ in ids]
                    assert got == ids
            finally:
                for stream in streams:
                    stream.close()
                await redis.aclose()
