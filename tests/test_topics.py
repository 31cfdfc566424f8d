"""Topics (Zaqar's /v2/topics): feeds with a queue's records and guarantees,
in a namespace of their own, on both drivers, one server and a Cluster."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient

from feedsvc.clock import ManualClock
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.keys import QueueKeys
from tests.conftest import direct_client
from tests.stored import is_stored

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
WRITER = str(uuid.uuid4())
READER = str(uuid.uuid4())
TOPIC_DEFAULTS = {
    "_max_messages_post_size": 262144,
    "_default_message_ttl": 3600,
    "_default_message_delay": 0,
}


def body(value: Any) -> NewMessage:
    return NewMessage(orjson.dumps(value), 300)


async def ok(resp: ClientResponse, status: int = 200) -> Any:
    assert resp.status == status, await resp.text()
    return await resp.json() if resp.content_type == "application/json" else None


# -- storage ---------------------------------------------------------------------


async def test_a_topic_and_a_queue_of_one_name_share_nothing(
    store: FeedStore, project: str, redis_url: str
) -> None:
    topics = store.topics()
    assert await topics.create_queue(project, "news", {"kind": "topic"})
    assert await store.create_queue(project, "news", {"kind": "queue"})
    [in_topic] = await topics.post_messages(project, "news", WRITER, [body("to topic")])
    [in_queue] = await store.post_messages(project, "news", WRITER, [body("to queue")])
    assert (await topics.get_queue_metadata(project, "news")) == {"kind": "topic"}
    assert (await store.get_queue_metadata(project, "news")) == {"kind": "queue"}
    read = ListQuery(READER, limit=10)
    assert [m.body for m in (await topics.list_messages(project, "news", read)).messages] == [
        b'"to topic"'
    ]
    assert [m.body for m in (await store.list_messages(project, "news", read)).messages] == [
        b'"to queue"'
    ]
    # ids are reachable only through the feed they were posted to
    assert await topics.get_messages(project, "news", [in_queue]) == []
    assert await store.get_messages(project, "news", [in_topic]) == []
    assert [q.name for q in await topics.list_queues(project, None, 10, False)] == ["news"]
    assert await topics.count_queues(project) == 1
    assert await store.count_queues(project) == 1
    # the topic's keys are its own
    topic_keys = QueueKeys.of(project, "news", "topic")
    assert topic_keys.prefix != QueueKeys.of(project, "news").prefix
    client = direct_client(redis_url)
    try:
        assert await is_stored(client, topic_keys, in_topic)
        assert not await is_stored(client, QueueKeys.of(project, "news"), in_topic)
        assert await is_stored(client, QueueKeys.of(project, "news"), in_queue)
    finally:
        await client.aclose()
    # deleting one leaves the other whole
    await topics.delete_queue(project, "news")
    assert await topics.get_queue_metadata(project, "news") is None
    assert (await topics.queue_stats(project, "news")).total == 0
    assert await topics.list_queues(project, None, 10, False) == []
    assert (await store.queue_stats(project, "news")).total == 1
    assert [q.name for q in await store.list_queues(project, None, 10, False)] == ["news"]


async def test_a_topic_feed_is_read_after_a_marker_like_a_queue(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    topics = store.topics()
    ids = []
    for i in range(7):
        ids += await topics.post_messages(project, "t", WRITER, [body(i)])
    await topics.delete_messages(project, "t", [ids[2]])
    seen: list[str] = []
    marker = None
    while True:
        page = await topics.list_messages(project, "t", ListQuery(READER, marker=marker, limit=2))
        if not page.messages:
            assert page.next_marker is None
            break
        seen += [m.id for m in page.messages]
        marker = page.next_marker
    assert seen == [i for i in ids if i != ids[2]]
    # expiry is exact on topics too
    [short] = await topics.post_messages(project, "t", WRITER, [NewMessage(b"1", 60)])
    clock.advance(61)
    assert await topics.get_messages(project, "t", [short]) == []


async def test_a_topic_follower_is_woken_by_a_post_to_its_topic(
    store: FeedStore, project: str
) -> None:
    topics = store.topics()
    async with topics.follow(project, "t") as follow:
        token = follow.token()
        await topics.post_messages(project, "t", WRITER, [body("to the topic")])
        assert await follow.wait(token, 30)
    # what a follower then reads is the topic's alone: see the long-poll test below


# -- HTTP ------------------------------------------------------------------------


async def test_topic_lifecycle_as_zaqar_answers_it(http: Client, headers: Headers) -> None:
    stats = await ok(await http.get("/v2/topics/mars/stats", headers=headers))
    assert stats == {"messages": {"claimed": 0, "free": 0, "total": 0}}
    resp = await http.put("/v2/topics/mars", json={"messages": {"ttl": 600}}, headers=headers)
    await ok(resp, 201)
    assert resp.headers["Location"] == "/v2/topics/mars"
    await ok(await http.put("/v2/topics/mars", headers=headers), 204)
    shown = await ok(await http.get("/v2/topics/mars", headers=headers))
    assert shown == {"messages": {"ttl": 600}} | TOPIC_DEFAULTS
    # the queue of the same name does not exist
    assert (await ok(await http.get("/v2/queues", headers=headers)))["queues"] == []
    patch_headers = {**headers, "Content-Type": "application/openstack-messaging-v2.0-json-patch"}
    patch = [{"op": "add", "path": "/metadata/key1", "value": 1}]
    patched = await ok(await http.patch("/v2/topics/mars", json=patch, headers=patch_headers))
    assert patched == {"messages": {"ttl": 600}, "key1": 1} | TOPIC_DEFAULTS
    missing = [{"op": "replace", "path": "/metadata/key3", "value": 2}]
    resp = await http.patch("/v2/topics/mars", json=missing, headers=patch_headers)
    assert resp.status == 409
    resp = await http.patch("/v2/topics/venus", json=patch, headers=patch_headers)
    assert resp.status == 404
    assert (await resp.json())["description"] == "Topic venus does not exist."
    listed = await ok(await http.get("/v2/topics?detailed=true", headers=headers))
    assert listed["topics"] == [
        {"name": "mars", "href": "/v2/topics/mars", "metadata": patched},
    ]
    [link] = listed["links"]
    assert link["href"].startswith("/v2/topics?")
    await ok(await http.delete("/v2/topics/mars", headers=headers), 204)
    assert (await ok(await http.get("/v2/topics", headers=headers)))["topics"] == []


@pytest.mark.parametrize("name", ["Nice-Bo@t", "_" + "niceboat" * 8, "non-ascii-n\u0153me"])
async def test_bad_topic_names_are_400(http: Client, headers: Headers, name: str) -> None:
    resp = await http.put(f"/v2/topics/{name}", headers=headers)
    assert resp.status == 400
    assert "Topic names" in (await resp.json())["description"]
    assert (await ok(await http.get("/v2/topics", headers=headers)))["topics"] == []


@pytest.mark.parametrize("document", [b"{", b"[]", b".", b"  "])
async def test_bad_topic_metadata_is_400(http: Client, headers: Headers, document: bytes) -> None:
    resp = await http.put(
        "/v2/topics/venus",
        data=document,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert resp.status == 400
    assert (await ok(await http.get("/v2/topics", headers=headers)))["topics"] == []


async def test_topic_messages_over_http(http: Client, headers: Headers) -> None:
    resp = await http.post(
        "/v2/topics/t/messages",
        json={"messages": [{"body": {"n": 1}}, {"body": {"n": 2}}, {"body": {"n": 3}}]},
        headers=headers,
    )
    hrefs = (await ok(resp, 201))["resources"]
    assert all(h.startswith("/v2/topics/t/messages/") for h in hrefs)
    assert resp.headers["Location"].startswith("/v2/topics/t/messages?ids=")
    page = await ok(await http.get("/v2/topics/t/messages?echo=true&limit=2", headers=headers))
    assert [m["body"] for m in page["messages"]] == [{"n": 1}, {"n": 2}]
    assert [m["href"] for m in page["messages"]] == hrefs[:2]
    [link] = page["links"]
    assert link["href"].startswith("/v2/topics/t/messages?")
    rest = await ok(await http.get(link["href"], headers=headers))
    assert [m["body"] for m in rest["messages"]] == [{"n": 3}]
    one = await ok(await http.get(hrefs[0], headers=headers))
    assert one["body"] == {"n": 1}
    # the queue "t" has none of them
    assert (await ok(await http.get("/v2/queues/t/stats", headers=headers)))["messages"][
        "total"
    ] == 0
    resp = await http.get(hrefs[0].replace("/topics/", "/queues/"), headers=headers)
    assert resp.status == 404
    stats = await ok(await http.get("/v2/topics/t/stats", headers=headers))
    assert stats["messages"]["total"] == 3
    assert stats["messages"]["oldest"]["href"] == hrefs[0]
    await ok(await http.delete(hrefs[0], headers=headers), 204)
    ids = ",".join(h.rsplit("/", 1)[1] for h in hrefs[1:])
    got = await ok(await http.get(f"/v2/topics/t/messages?ids={ids}", headers=headers))
    assert [m["body"] for m in got["messages"]] == [{"n": 2}, {"n": 3}]
    purge = {"resource_types": ["messages"]}
    await ok(await http.post("/v2/topics/t/purge", json=purge, headers=headers), 204)
    stats = await ok(await http.get("/v2/topics/t/stats", headers=headers))
    assert stats["messages"]["total"] == 0
    # topics are not claimed (as in Zaqar: no such route)
    resp = await http.post("/v2/topics/t/claims", json={"ttl": 60}, headers=headers)
    assert resp.status == 404


async def test_a_topic_long_poll_sees_its_topic_only(http: Client, headers: Headers) -> None:
    await ok(await http.put("/v2/topics/live", headers=headers), 201)
    poll = asyncio.create_task(
        http.get("/v2/topics/live/messages?wait=20&echo=true", headers=headers)
    )
    await asyncio.sleep(0)
    await ok(
        await http.post(
            "/v2/queues/live/messages", json={"messages": [{"body": "queue"}]}, headers=headers
        ),
        201,
    )
    await ok(
        await http.post(
            "/v2/topics/live/messages", json={"messages": [{"body": "topic"}]}, headers=headers
        ),
        201,
    )
    page = await ok(await poll)
    assert [m["body"] for m in page["messages"]] == ["topic"]
    assert page["messages"][0]["href"].startswith("/v2/topics/live/messages/")
