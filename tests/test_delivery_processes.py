"""Delivery across real ``feedsvc serve`` processes: one is killed with
SIGKILL in the middle of a backlog and another takes its subscription over.

The receiver (an aiohttp server in this test) must see every message, in
post order, at least once (a message in flight when the worker died may
come again), and never two deliveries of the subscription at
the same time.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.testing import ServiceProcess

pytestmark = pytest.mark.process

COUNT = 60
PATIENCE = 60.0


class SlowReceiver:
    def __init__(self) -> None:
        self.bodies: list[Any] = []
        #: the bodies being answered now, and each time one came while
        #: another was: (those in flight, the one that came)
        self.in_flight: list[Any] = []
        self.overlaps: list[tuple[list[Any], Any]] = []
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())["body"]
        if self.in_flight:
            self.overlaps.append((list(self.in_flight), body))
        self.in_flight.append(body)
        try:
            await asyncio.sleep(0.02)  # a backlog builds up
            self.bodies.append(body)
            self.arrived.set()
            return web.Response(status=200)
        finally:
            self.in_flight.remove(body)

    async def until(self, count: int) -> None:
        async with asyncio.timeout(PATIENCE):
            while len(set(self.bodies)) < count:
                self.arrived.clear()
                await self.arrived.wait()


def serve(redis: RedisServer, driver: str) -> ServiceProcess:
    return ServiceProcess(
        "--redis-url",
        redis.url,
        "--driver",
        driver,
        "--subscriber-allow",
        "127.0.0.0/8",
        "--delivery-lease",
        "5",
        "--delivery-timeout",
        "2",
        "--delivery-sweep",
        "0.3",
    )


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_a_killed_workers_deliveries_are_taken_over(
    redis_server: RedisServer, driver: str
) -> None:
    receiver = SlowReceiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "crash-" + uuid.uuid4().hex}
    queue = "/v2/queues/orders"
    async with TestServer(app, host="127.0.0.1") as hook, aiohttp.ClientSession() as http:
        with serve(redis_server, driver) as first, serve(redis_server, driver) as second:
            # the subscription is made (and its wake-ups followed) by the first
            # process only while the second is stopped... so the first holds the lease
            second.stop()
            resp = await http.post(
                first.url + queue + "/subscriptions",
                json={"subscriber": str(hook.make_url("/hook")), "ttl": 3600},
                headers=headers,
            )
            assert resp.status == 201, await resp.text()
            sid = (await resp.json())["subscription_id"]
            for i in range(COUNT):
                resp = await http.post(
                    first.url + queue + "/messages",
                    json={"messages": [{"body": i}]},
                    headers=headers,
                )
                assert resp.status == 201
            await receiver.until(10)
            second.start()
            first.kill()  # SIGKILL, mid-way through the backlog
            assert len(set(receiver.bodies)) < COUNT
            await receiver.until(COUNT)
            resp = await http.get(f"{second.url}{queue}/subscriptions/{sid}", headers=headers)
            doc = await resp.json()
    assert list(dict.fromkeys(receiver.bodies)) == list(range(COUNT))
    # in order: each arrival is the next message or the one just before it
    # again (sent again after a timeout, or by the worker that took over)
    highest = -1
    for body in receiver.bodies:
        assert highest - 1 <= body <= highest + 1, receiver.bodies
        highest = max(highest, body)
    assert not receiver.overlaps, (receiver.overlaps, doc["delivery"])
    assert doc["delivery"]["failures"] == 0
