"""A redrive across real ``feedsvc serve`` processes: the one moving it is
killed with SIGKILL mid-way, another (started afterwards) takes its lease
over once it lapses and finishes: every dead letter back in its queue once,
in order, none left behind, none twice."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from feedsvc.config import DEFAULT_STORAGE_LAYOUT
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.testing import ServiceProcess

pytestmark = pytest.mark.process

COUNT = 40
PATIENCE = 90.0


async def call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, Any]:
    async with session.request(method, url, json=body) as response:
        raw = await response.read()
        return response.status, (await response.json() if raw else None)


async def listed(session: aiohttp.ClientSession, base: str, queue: str) -> list[str]:
    return [m["id"] for m in await listed_messages(session, base, queue)]


async def listed_messages(session: aiohttp.ClientSession, base: str, queue: str) -> list[Any]:
    out: list[Any] = []
    path = f"/v2/queues/{queue}/messages?echo=true&limit=20"
    while True:
        status, page = await call(session, "GET", base + path)
        assert status == 200
        if not page["messages"]:
            return out
        out += page["messages"]
        path = page["links"][0]["href"]


async def progress_when(session: aiohttp.ClientSession, base: str, done: Any) -> dict[str, Any]:
    async with asyncio.timeout(PATIENCE):
        while True:
            status, progress = await call(session, "GET", base + "/v2/queues/dlq/redrive")
            assert status == 200
            if done(progress):
                return dict(progress)
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_a_killed_movers_redrive_is_finished_by_another_process(
    redis_server: RedisServer, driver: str
) -> None:
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "p-" + uuid.uuid4().hex}
    args = ("--redis-url", redis_server.url, "--driver", driver)
    async with aiohttp.ClientSession(headers=headers) as session:
        with ServiceProcess(*args) as first:
            base = first.url
            meta = {"_max_claim_count": 1, "_dead_letter_queue": "dlq"}
            assert (await call(session, "PUT", base + "/v2/queues/q", meta))[0] == 201
            messages = [{"body": {"n": i}} for i in range(COUNT)]
            status, posted = await call(
                session, "POST", base + "/v2/queues/q/messages", {"messages": messages}
            )
            assert status == 201
            ids = [href.rsplit("/", 1)[1] for href in posted["resources"]]
            # each claim moves what the one before claimed and released
            claims = base + "/v2/queues/q/claims?limit=20"
            while (claimed := await call(session, "POST", claims, {"ttl": 60}))[0] == 201:
                claim_id = claimed[1]["messages"][0]["href"].rsplit("=", 1)[1]
                await call(session, "DELETE", f"{base}/v2/queues/q/claims/{claim_id}")
            assert await listed(session, base, "dlq") == ids
            status, _ = await call(
                session, "POST", base + "/v2/queues/dlq/redrive", {"max_per_second": 10}
            )
            assert status == 202
            await progress_when(session, base, lambda p: p["moved"] >= 5)
            first.kill()
        with ServiceProcess(*args) as second:
            base = second.url
            done = await progress_when(session, base, lambda p: p["state"] == "done")
            assert (done["moved"], done["skipped"], done["remaining"]) == (COUNT, 0, 0)
            back = await listed_messages(session, base, "q")
            assert [m["body"] for m in back] == [{"n": i} for i in range(COUNT)]
            if DEFAULT_STORAGE_LAYOUT == "records":
                assert [m["id"] for m in back] == ids
            else:  # a queue in segments gives them new ids (an id is a position)
                assert not {m["id"] for m in back} & set(ids)
            assert await listed(session, base, "dlq") == []
