"""A follower is told what it missed, and may start at the tail (issue 31,
item 7): a list page, a long poll and an event stream that resume after
messages gone unseen (expired, deleted) say how many (``X-Gap``, ``event:
gap``); messages merely filtered out (echo, claimed) are no gap; and
``from=tail`` starts after the queue's last message. Both drivers; the
ManualClock expires messages."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from tests.test_live import next_event as stream_event

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
MESSAGES = "/v2/queues/g/messages"


def other_client(headers: Headers) -> Headers:
    return {**headers, "Client-ID": str(uuid.uuid4())}


async def post(http: Client, headers: Headers, *messages: dict[str, Any]) -> list[str]:
    response = await http.post(MESSAGES, json={"messages": list(messages)}, headers=headers)
    assert response.status == 201, await response.text()
    return [href.rsplit("/", 1)[1] for href in (await response.json())["resources"]]


async def page(http: Client, headers: Headers, **params: str) -> tuple[Any, ClientResponse]:
    response = await http.get(MESSAGES, params=params, headers=headers)
    assert response.status == 200, await response.text()
    return await response.json(), response


def marker_of(doc: Any) -> str:
    return str(doc["links"][0]["href"].split("marker=")[1].split("&")[0])


def gap_of(response: ClientResponse) -> dict[str, str] | None:
    """The X-Gap header's fields, None without one."""
    raw = response.headers.get("X-Gap")
    if raw is None:
        return None
    return dict(part.strip().split("=", 1) for part in raw.split(";"))


async def read_one_then_marker(http: Client, headers: Headers, reader: Headers) -> str:
    """Post six messages (ttl 60 s for the first four after the one read,
    600 s for the others), read the first: its marker."""
    await post(
        http,
        headers,
        {"body": 0, "ttl": 600},
        *({"body": n, "ttl": 60} for n in (1, 2, 3)),
        {"body": 4, "ttl": 600},
        {"body": 5, "ttl": 600},
    )
    doc, _ = await page(http, reader, limit="1")
    assert [m["body"] for m in doc["messages"]] == [0]
    return marker_of(doc)


# -- list pages ---------------------------------------------------------------------


async def test_a_list_resumed_after_expired_messages_says_how_many(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    reader = other_client(headers)
    marker = await read_one_then_marker(http, headers, reader)
    clock.advance(61)
    doc, response = await page(http, reader, marker=marker, limit="1")
    assert [m["body"] for m in doc["messages"]] == [4]
    assert gap_of(response) == {"missed": "3", "first": str(int(marker) + 4)}
    # the next page missed nothing
    doc, response = await page(http, reader, marker=marker_of(doc))
    assert [m["body"] for m in doc["messages"]] == [5]
    assert gap_of(response) is None


async def test_a_list_resumed_after_deleted_messages_says_how_many(
    http: Client, headers: Headers
) -> None:
    reader = other_client(headers)
    ids = await post(http, headers, *({"body": n} for n in range(5)))
    doc, _ = await page(http, reader, limit="1")
    marker = marker_of(doc)
    for gone in ids[1:3]:
        deleted = await http.delete(f"{MESSAGES}/{gone}", headers=headers)
        assert deleted.status == 204
    popped = await http.delete(MESSAGES, params={"pop": "1"}, headers=headers)
    assert popped.status == 200  # the oldest left: the first one, not after the marker
    doc, response = await page(http, reader, marker=marker)
    assert [m["body"] for m in doc["messages"]] == [3, 4]
    assert gap_of(response) == {"missed": "2", "first": str(int(marker) + 3)}


async def test_messages_filtered_out_are_no_gap(http: Client, headers: Headers) -> None:
    """Own messages (echo off) and claimed ones are passed over, not missed."""
    reader = other_client(headers)
    await post(http, headers, {"body": "first"})
    doc, _ = await page(http, reader)
    marker = marker_of(doc)
    await post(http, reader, {"body": "own"}, {"body": "own too"})
    await post(http, headers, {"body": "claimed"})
    claim = await http.post("/v2/queues/g/claims", json={"ttl": 60, "grace": 60}, headers=headers)
    assert claim.status == 201
    await post(http, headers, {"body": "seen"})
    doc, response = await page(http, reader, marker=marker)
    assert [m["body"] for m in doc["messages"]] == ["seen"]
    assert gap_of(response) is None


async def test_a_marker_of_a_deleted_queue_counts_from_its_successor(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    """A marker older than the queue (deleted and made again) misses only
    what the queue now had, not every microsecond since the marker."""
    reader = str(uuid.uuid4())
    await store.post_messages(project, "again", "poster", [NewMessage(b"1", ttl=60)])
    first = await store.list_messages(project, "again", ListQuery(reader))
    assert first.next_marker is not None
    await store.delete_queue(project, "again")
    clock.advance(5)
    await store.post_messages(
        project, "again", "poster", [NewMessage(b"2", ttl=60), NewMessage(b"3", ttl=600)]
    )
    clock.advance(61)
    after = await store.list_messages(project, "again", ListQuery(reader, first.next_marker))
    assert [m.body for m in after.messages] == [b"3"]
    assert after.missed == 1


# -- long polls and streams -----------------------------------------------------------


async def test_a_long_poll_resumed_after_a_gap_says_how_many(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    reader = other_client(headers)
    marker = await read_one_then_marker(http, headers, reader)
    clock.advance(61)
    doc, response = await page(http, reader, marker=marker, wait="5", limit="1")
    assert [m["body"] for m in doc["messages"]] == [4]
    assert gap_of(response) == {"missed": "3", "first": str(int(marker) + 4)}


async def open_stream(http: Client, headers: Headers, **params: str) -> ClientResponse:
    response = await http.get(
        MESSAGES, params=params, headers={**headers, "Accept": "text/event-stream"}
    )
    assert response.status == 200, await response.text()
    return response


async def next_event(response: ClientResponse, seconds: float = 10) -> dict[str, str]:
    """The next event's fields, the retry field's own block skipped."""
    while "retry" in (fields := await stream_event(response, seconds)):
        pass
    return fields


async def test_a_stream_resumed_after_a_gap_sends_a_gap_event_first(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    reader = other_client(headers)
    marker = await read_one_then_marker(http, headers, reader)
    clock.advance(61)
    stream = await open_stream(http, {**reader, "Last-Event-ID": marker})
    try:
        gap = await next_event(stream)
        assert gap["event"] == "gap"
        assert orjson.loads(gap["data"]) == {"missed": 3, "first": str(int(marker) + 4)}
        assert "id" not in gap  # a client resumes from its last message, not from a gap
        got = [orjson.loads((await next_event(stream))["data"])["body"] for _ in range(2)]
        assert got == [4, 5]
    finally:
        stream.close()


async def test_a_stream_resumed_past_filtered_messages_sends_no_gap(
    http: Client, headers: Headers
) -> None:
    reader = other_client(headers)
    await post(http, headers, {"body": "first"})
    doc, _ = await page(http, reader)
    await post(http, reader, {"body": "own"})
    await post(http, headers, {"body": "next"})
    stream = await open_stream(http, reader, marker=marker_of(doc))
    try:
        event = await next_event(stream)
        assert event["event"] == "message"
        assert orjson.loads(event["data"])["body"] == "next"
    finally:
        stream.close()


# -- from=tail ------------------------------------------------------------------------


async def test_a_stream_from_the_tail_sends_only_new_messages(
    http: Client, headers: Headers
) -> None:
    reader = other_client(headers)
    await post(http, headers, {"body": "old"}, {"body": "older"})
    stream = await open_stream(http, reader, **{"from": "tail"})
    try:
        await post(http, headers, {"body": "new"})
        event = await next_event(stream)
        assert (event["event"], orjson.loads(event["data"])["body"]) == ("message", "new")
    finally:
        stream.close()


async def test_a_stream_from_the_tail_resumes_after_last_event_id(
    http: Client, headers: Headers
) -> None:
    """An EventSource reconnects to the same URL, from=tail included, with
    Last-Event-ID: the id wins, so nothing posted meanwhile is lost."""
    reader = other_client(headers)
    await post(http, headers, {"body": "seen"})
    doc, _ = await page(http, reader)
    await post(http, headers, {"body": "meanwhile"})
    stream = await open_stream(
        http, {**reader, "Last-Event-ID": marker_of(doc)}, **{"from": "tail"}
    )
    try:
        assert orjson.loads((await next_event(stream))["data"])["body"] == "meanwhile"
    finally:
        stream.close()


async def test_a_long_poll_from_the_tail_waits_for_a_new_message(
    http: Client, headers: Headers
) -> None:
    reader = other_client(headers)
    await post(http, headers, {"body": "old"})

    async def post_soon() -> list[str]:
        await asyncio.sleep(0.2)
        return await post(http, headers, {"body": "new"})

    poster = asyncio.create_task(post_soon())
    doc, _ = await page(http, reader, wait="10", **{"from": "tail"})
    await poster
    assert [m["body"] for m in doc["messages"]] == ["new"]


async def test_a_long_poll_from_the_tail_that_times_out_links_to_the_tail(
    http: Client, headers: Headers
) -> None:
    reader = other_client(headers)
    await post(http, headers, {"body": "old"})
    doc, _ = await page(http, reader, wait="0.1", **{"from": "tail"})
    assert doc["messages"] == []
    await post(http, headers, {"body": "new"})
    nxt, _ = await page(http, reader, marker=marker_of(doc))
    assert [m["body"] for m in nxt["messages"]] == ["new"]


async def test_a_list_from_the_tail_is_empty_with_a_link_to_poll_from(
    http: Client, headers: Headers
) -> None:
    reader = other_client(headers)
    for queue_exists in (False, True):
        doc, _ = await page(http, reader, limit="5", **{"from": "tail"})
        assert doc["messages"] == []
        [link] = doc["links"]
        assert "limit=5" in link["href"]
        await post(http, headers, {"body": queue_exists})
        nxt, _ = await page(http, reader, marker=marker_of(doc))
        assert [m["body"] for m in nxt["messages"]] == [queue_exists]


@pytest.mark.parametrize("query", ["from=head", "from=TAIL", "from=1", "from=tail&marker=5"])
async def test_a_bad_from_is_400(http: Client, headers: Headers, query: str) -> None:
    await post(http, headers, {"body": 1})
    for extra in ({}, {"Accept": "text/event-stream"}):
        for wait in ("", "&wait=1"):
            response = await http.get(f"{MESSAGES}?{query}{wait}", headers={**headers, **extra})
            assert response.status == 400, await response.text()
            doc = await response.json()
            assert "from" in doc["description"] and doc["title"]


@pytest.fixture
async def scanning_two(settings: Settings, clock: ManualClock) -> AsyncIterator[Client]:
    """A service whose list scans at most two entries per request."""
    app = create_app(dataclasses.replace(settings, scan_limit=2), clock)
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_a_gap_passed_while_catching_up_is_told_before_the_next_live_message(
    scanning_two: Client, headers: Headers
) -> None:
    """The catch-up passes the gap on pages with nothing to show (the scan
    limit cuts them short, the rest are the reader's own): the stream says
    it before the first message it is handed live."""
    http, reader = scanning_two, other_client(headers)
    ids = await post(http, headers, *({"body": n} for n in range(4)))
    doc, _ = await page(http, reader, limit="1")
    for gone in ids[1:]:
        assert (await http.delete(f"{MESSAGES}/{gone}", headers=headers)).status == 204
    await post(http, reader, *({"body": "own"} for _ in range(3)))
    stream = await open_stream(http, {**reader, "Last-Event-ID": marker_of(doc)})
    try:
        await post(http, headers, {"body": "live"})
        gap = await next_event(stream)
        assert gap["event"] == "gap"
        assert orjson.loads(gap["data"])["missed"] == 3
        event = await next_event(stream)
        assert orjson.loads(event["data"])["body"] == "live"
        assert orjson.loads(gap["data"])["first"] == event["id"]
    finally:
        stream.close()


@pytest.mark.parametrize("others", [0, 1], ids=["alone", "beside-a-stream"])
async def test_a_stream_resumed_after_a_gap_at_the_end_says_it_before_the_next_post(
    http: Client, headers: Headers, clock: ManualClock, others: int
) -> None:
    """Everything after the marker expired and nothing is posted yet: the
    resume joins the live tail (a new one, or the one another stream of the
    queue runs) and says the gap before the first message posted later."""
    reader = other_client(headers)
    await post(http, headers, {"body": 0, "ttl": 600}, *({"body": n, "ttl": 60} for n in (1, 2)))
    doc, _ = await page(http, reader, limit="1")
    clock.advance(61)
    watchers = [await open_stream(http, other_client(headers)) for _ in range(others)]
    try:
        for watcher in watchers:  # caught up: the queue's tail runs
            assert orjson.loads((await next_event(watcher))["data"])["body"] == 0
        stream = await open_stream(http, {**reader, "Last-Event-ID": marker_of(doc)})
        try:
            await post(http, headers, {"body": "later"})
            gap = await next_event(stream)
            assert (gap["event"], orjson.loads(gap["data"])["missed"]) == ("gap", 2)
            event = await next_event(stream)
            assert orjson.loads(event["data"])["body"] == "later"
            assert orjson.loads(gap["data"])["first"] == event["id"]
        finally:
            stream.close()
    finally:
        for watcher in watchers:
            watcher.close()


async def test_a_long_poll_resumed_after_a_gap_at_the_end_says_it_with_the_next_post(
    http: Client, headers: Headers
) -> None:
    reader = other_client(headers)
    ids = await post(http, headers, *({"body": n} for n in range(3)))
    doc, _ = await page(http, reader, limit="1")
    for gone in ids[1:]:
        assert (await http.delete(f"{MESSAGES}/{gone}", headers=headers)).status == 204

    async def post_soon() -> list[str]:
        await asyncio.sleep(0.2)
        return await post(http, headers, {"body": "later"})

    poster = asyncio.create_task(post_soon())
    later, response = await page(http, reader, marker=marker_of(doc), wait="10")
    await poster
    assert [m["body"] for m in later["messages"]] == ["later"]
    assert gap_of(response) == {"missed": "2", "first": str(int(marker_of(doc)) + 3)}


async def test_a_topic_starts_at_its_own_tail(http: Client, headers: Headers) -> None:
    """from=tail reads the topic's counter, not a queue's of the same name."""
    topic = "/v2/topics/g/messages"
    await post(http, headers, *({"body": n} for n in range(3)))  # the queue g
    response = await http.post(topic, json={"messages": [{"body": "old"}]}, headers=headers)
    assert response.status == 201
    reader = other_client(headers)
    tail = await (await http.get(topic, params={"from": "tail"}, headers=reader)).json()
    response = await http.post(topic, json={"messages": [{"body": "new"}]}, headers=headers)
    assert response.status == 201
    after = await http.get(topic, params={"marker": marker_of(tail)}, headers=reader)
    assert [m["body"] for m in (await after.json())["messages"]] == ["new"]
