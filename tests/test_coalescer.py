"""The coalescer (auto-pipelining) against a real Redis: every caller gets its
own replies, errors stay with their caller, order is kept, and callers that
give up break nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from feedsvc.redis_server import RedisServer
from feedsvc.storage.coalescer import Coalescer


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(redis_url, max_connections=8)
    yield redis
    await redis.aclose()


@pytest.fixture
async def coalescer(client: aioredis.Redis) -> AsyncIterator[Coalescer]:
    made = Coalescer(client.connection_pool.make_connection, 5.0)
    yield made
    await made.close()


def prefix() -> str:
    return "coalesce-test:" + uuid.uuid4().hex + ":"


async def test_each_caller_gets_its_own_replies(coalescer: Coalescer) -> None:
    p = prefix()

    async def call(i: int) -> list[object]:
        return await coalescer.execute([("INCRBY", f"{p}{i}", i), ("GET", f"{p}{i}")])

    results = await asyncio.gather(*(call(i) for i in range(600)))
    assert results == [[i, str(i).encode()] for i in range(600)]
    assert coalescer.calls == 600
    assert coalescer.batches < 600, "concurrent calls were not coalesced"


async def test_error_replies_stay_with_their_caller(
    client: aioredis.Redis, coalescer: Coalescer
) -> None:
    p = prefix()
    await client.set(p + "string", "x")
    good = [coalescer.execute([("SET", f"{p}{i}", i), ("GET", f"{p}{i}")]) for i in range(20)]
    bad = coalescer.execute([("HSET", p + "string", "f", "v"), ("GET", p + "string")])
    unknown = coalescer.execute([("EVALSHA", "0" * 40, 0)])
    *oks, wrong, noscript = await asyncio.gather(*good, bad, unknown)
    assert oks == [[b"OK", str(i).encode()] for i in range(20)]
    assert isinstance(wrong[0], ResponseError) and wrong[1] == b"x"
    assert isinstance(noscript[0], ResponseError)


async def test_order_is_kept(client: aioredis.Redis, coalescer: Coalescer) -> None:
    # one connection: batches in the order formed, calls within a batch in call order
    key = prefix() + "list"
    await asyncio.gather(*(coalescer.execute([("RPUSH", key, i)]) for i in range(300)))
    assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(300)]

    # a caller that awaits each call sees its calls applied in order, whatever
    # else is in flight
    wide = coalescer
    ordered = prefix() + "ordered"

    async def sequential() -> None:
        for i in range(100):
            await wide.execute([("RPUSH", ordered, i)])

    async def noise(n: int) -> None:
        for i in range(100):
            await wide.execute([("SET", f"{ordered}:{n}", i)])

    await asyncio.gather(sequential(), *(noise(n) for n in range(10)))
    assert await client.lrange(ordered, 0, -1) == [str(i).encode() for i in range(100)]


async def test_cancelled_callers_break_nothing(coalescer: Coalescer) -> None:
    p = prefix()
    tasks = [
        asyncio.create_task(coalescer.execute([("SET", f"{p}{i}", i), ("GET", f"{p}{i}")]))
        for i in range(300)
    ]
    for i, task in enumerate(tasks):
        if i % 3 == 0:
            task.cancel()
    await asyncio.sleep(0)
    for i, task in enumerate(tasks):
        if i % 3 == 1:
            task.cancel()  # some of these were already sent
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(done):
        if i % 3 == 2:
            assert result == [b"OK", str(i).encode()]
        else:
            assert isinstance(result, asyncio.CancelledError | list)
    # the coalescer still works and its replies are still in step
    assert await coalescer.execute([("PING",), ("GET", f"{p}2")]) == [b"PONG", b"2"]


async def test_connection_failure_fails_the_batch_then_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    redis = aioredis.Redis.from_url(server.url, socket_connect_timeout=1, socket_timeout=2)
    try:
        coalescer = Coalescer(redis.connection_pool.make_connection, 2.0)
        assert await coalescer.execute([("SET", "k", 1)]) == [b"OK"]
        server.stop()
        outcomes = await asyncio.gather(
            *(coalescer.execute([("GET", "k")]) for _ in range(20)), return_exceptions=True
        )
        assert all(isinstance(o, RedisConnectionError | OSError) for o in outcomes), outcomes
        server.start()
        assert await coalescer.execute([("SET", "k", 2), ("GET", "k")]) == [b"OK", b"2"]
        await coalescer.close()
    finally:
        await redis.aclose()
        server.stop()
