"""Round trips to Redis per request, counted on the connection itself.

A small TCP proxy in front of the test Redis counts what the service sends.
In steady state (connection open, scripts cached) a lua-driver POST and a
GET page cost one round trip each. The subscription delivery worker is off
(``deliver=False``): its sweeps are background work of the process, not
part of a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.embedded_redis.server import RedisServer
from tests.conftest import make_settings


class CountingProxy:
    """A TCP proxy in front of Redis that counts what the client sends.

    Requests in these tests are sent one at a time, so each chunk the client
    writes is one round trip (a pipeline is one write on loopback).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.writes = 0
        self.server: asyncio.Server | None = None
        self.streams: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.streams += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    if count:
                        self.writes += 1
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for stream in self.streams:
                stream.close()
            await self.server.wait_closed()


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[CountingProxy]:
    counting = CountingProxy(redis_server.port)
    yield counting
    await counting.stop()


async def measure(
    client: TestClient[web.Request, web.Application],
    proxy: CountingProxy,
    method: str,
    path: str,
    headers: dict[str, str],
    **kwargs: Any,
) -> int:
    before = proxy.writes
    response = await client.request(method, path, headers=headers, **kwargs)
    assert response.status < 300, await response.text()
    await response.read()
    await asyncio.sleep(0.01)  # let the proxy's counter see every chunk
    return proxy.writes - before


@pytest.mark.parametrize("batch", [1, 10])
async def test_lua_post_and_list_cost_one_round_trip_each(
    proxy: CountingProxy, headers: dict[str, str], batch: int
) -> None:
    app = create_app(make_settings(await proxy.start(), driver="lua", deliver=False))
    body = {"messages": [{"body": {"n": i}, "ttl": 300} for i in range(batch)]}
    path = "/v2/queues/rt/messages"
    async with TestClient(TestServer(app)) as client:
        # warm up: open the connection, cache the scripts
        await measure(client, proxy, "POST", path, headers, json=body)
        await measure(client, proxy, "GET", path + "?echo=true", headers)

        assert await measure(client, proxy, "POST", path, headers, json=body) == 1
        assert await measure(client, proxy, "GET", path + "?echo=true&limit=10", headers) == 1


async def test_watch_post_costs_two_round_trips_without_conflict(
    proxy: CountingProxy, headers: dict[str, str]
) -> None:
    """WATCH + reads in one write, MULTI..EXEC in a second: the protocol's minimum."""
    app = create_app(make_settings(await proxy.start(), driver="watch", deliver=False))
    body = {"messages": [{"body": 1}]}
    path = "/v2/queues/rt/messages"
    async with TestClient(TestServer(app)) as client:
        await measure(client, proxy, "POST", path, headers, json=body)
        assert await measure(client, proxy, "POST", path, headers, json=body) == 2


async def test_a_lua_post_under_project_quotas_costs_one_more_round_trip(
    proxy: CountingProxy, headers: dict[str, str]
) -> None:
    """The admission (admit.lua) and the post: two, once the process knows the
    project's queues; a queue's own _max_messages costs none."""
    settings = make_settings(
        await proxy.start(), driver="lua", deliver=False, project_max_messages=1000
    )
    body = {"messages": [{"body": 1}]}
    path = "/v2/queues/rt/messages"
    async with TestClient(TestServer(create_app(settings))) as client:
        await measure(client, proxy, "PUT", "/v2/queues/rt", headers, json={"_max_messages": 100})
        await measure(client, proxy, "POST", path, headers, json=body)
        assert await measure(client, proxy, "POST", path, headers, json=body) == 2
