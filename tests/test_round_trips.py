"""Round trips to Redis per request, counted on the connection itself.

Every write to Redis goes through ``send_packed_command``; a round trip is
one such write followed by its replies. In steady state (connection open,
scripts cached) a lua-driver POST and a GET page cost one each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio.connection import AbstractConnection

from feedsvc.app import create_app
from tests.conftest import make_settings


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    count = [0]
    original = AbstractConnection.send_packed_command

    async def counting(self: AbstractConnection, *args: Any, **kwargs: Any) -> None:
        count[0] += 1
        await original(self, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    yield count


async def measure(
    client: TestClient[web.Request, web.Application],
    writes: list[int],
    method: str,
    path: str,
    headers: dict[str, str],
    **kwargs: Any,
) -> int:
    before = writes[0]
    response = await client.request(method, path, headers=headers, **kwargs)
    assert response.status < 300, await response.text()
    await response.read()
    return writes[0] - before


@pytest.mark.parametrize("batch", [1, 10])
async def test_lua_post_and_list_cost_one_round_trip_each(
    redis_url: str, headers: dict[str, str], writes: list[int], batch: int
) -> None:
    app = create_app(make_settings(redis_url, driver="lua"))
    body = {"messages": [{"body": {"n": i}, "ttl": 300} for i in range(batch)]}
    path = "/v2/queues/rt/messages"
    async with TestClient(TestServer(app)) as client:
        # warm up: open the connection, cache the scripts
        await measure(client, writes, "POST", path, headers, json=body)
        await measure(client, writes, "GET", path + "?echo=true", headers)

        assert await measure(client, writes, "POST", path, headers, json=body) == 1
        assert await measure(client, writes, "GET", path + "?echo=true&limit=10", headers) == 1


async def test_watch_post_costs_two_round_trips_without_conflict(
    redis_url: str, headers: dict[str, str], writes: list[int]
) -> None:
    """WATCH + reads in one write, MULTI..EXEC in a second: the protocol's minimum."""
    app = create_app(make_settings(redis_url, driver="watch"))
    body = {"messages": [{"body": 1}]}
    path = "/v2/queues/rt/messages"
    async with TestClient(TestServer(app)) as client:
        await measure(client, writes, "POST", path, headers, json=body)
        assert await measure(client, writes, "POST", path, headers, json=body) == 2
