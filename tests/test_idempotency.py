"""Idempotency-Key: a retried POST returns the first result and writes nothing,
atomically, in both drivers."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient

from feedsvc.clock import ManualClock
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import escape_project
from tests.conftest import make_settings

WRITER = str(uuid.uuid4())
READER = str(uuid.uuid4())


def batch(*bodies: object) -> list[NewMessage]:
    return [NewMessage(orjson.dumps(b)) for b in bodies]


async def message_keys(redis_url: str, project: str) -> list[bytes]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return [k async for k in client.scan_iter(match=f"*{escape_project(project)}*:r:*")]
    finally:
        await client.aclose()


@pytest.mark.parametrize("storage_layout", ["records"], indirect=True)  # looks at its keys
async def test_retry_returns_the_first_ids_and_writes_nothing(
    store: FeedStore, project: str, redis_url: str
) -> None:
    first = await store.post_messages(project, "q", WRITER, batch(1, 2), 0, "key-1")
    again = await store.post_messages(project, "q", WRITER, batch(1, 2), 0, "key-1")
    assert again == first
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == first
    assert len(await message_keys(redis_url, project)) == 2, "the retry left bodies behind"
    other_client = await store.post_messages(project, "q", READER, batch(3), 0, "key-1")
    other_key = await store.post_messages(project, "q", WRITER, batch(4), 0, "key-2")
    assert first not in (other_client, other_key)
    assert (await store.queue_stats(project, "q")).total == 4


async def test_concurrent_retries_post_once(store: FeedStore, project: str) -> None:
    results = await asyncio.gather(
        *(store.post_messages(project, "q", WRITER, batch(n), 0, "same") for n in range(12))
    )
    assert all(r == results[0] for r in results)
    page = await store.list_messages(project, "q", ListQuery(READER, limit=20))
    assert [m.id for m in page.messages] == results[0]


async def test_the_window_ends(
    redis_url: str, driver: str, project: str, clock: ManualClock
) -> None:
    store = make_store(make_settings(redis_url, driver=driver, idempotency_window=1), clock)
    await store.open()
    try:
        first = await store.post_messages(project, "q", WRITER, batch(1), 0, "k")
        clock.advance(0.9)
        again = await store.post_messages(project, "q", WRITER, batch(1), 0, "k")
        assert again == first, "the window ended early"
        clock.advance(0.2)
        later = await store.post_messages(project, "q", WRITER, batch(1), 0, "k")
        assert later != first
        assert (await store.queue_stats(project, "q")).total == 2
    finally:
        await store.close()


async def test_delete_queue_forgets_keys(store: FeedStore, project: str, redis_url: str) -> None:
    await store.post_messages(project, "q", WRITER, batch(1), 0, "k")
    await store.delete_queue(project, "q")
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert [k async for k in client.scan_iter(match=f"*{escape_project(project)}*")] == []
    finally:
        await client.aclose()


async def test_http_retry_gets_the_same_answer(
    http: TestClient[web.Request, web.Application], headers: dict[str, str]
) -> None:
    body = {"messages": [{"body": "once"}]}
    keyed = headers | {"Idempotency-Key": "order-42"}
    first = await http.post("/v2/queues/q/messages", json=body, headers=keyed)
    second = await http.post("/v2/queues/q/messages", json=body, headers=keyed)
    assert first.status == second.status == 201
    assert first.headers["Location"] == second.headers["Location"]
    assert await first.json() == await second.json()
    reader = headers | {"Client-ID": READER}
    listed = await (await http.get("/v2/queues/q/messages", headers=reader)).json()
    assert [m["body"] for m in listed["messages"]] == ["once"]
    bad = await http.post(
        "/v2/queues/q/messages", json=body, headers=headers | {"Idempotency-Key": "x" * 256}
    )
    assert bad.status == 400
