"""Long polls and Server-Sent Events over HTTP: woken by posts, resumable,
exactly what a list shows; both drivers, single Redis and Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.protocol import FeedAppRunner
from feedsvc.app import create_app
from feedsvc.appkeys import LIVE
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.services import live as live_module
from feedsvc.services.live import Filters, LiveFeeds, Waiter
from feedsvc.storage.base import FeedStore, NewMessage
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
MESSAGES = "/v2/queues/q/messages"


async def post(http: Client, headers: Headers, *bodies: Any, queue: str = "q") -> list[str]:
    doc = {"messages": [{"body": b} for b in bodies]}
    response = await http.post(f"/v2/queues/{queue}/messages", json=doc, headers=headers)
    assert response.status == 201, await response.text()
    return [href.rsplit("/", 1)[1] for href in (await response.json())["resources"]]


def other_client(headers: Headers) -> Headers:
    return {**headers, "Client-ID": str(uuid.uuid4())}


async def post_soon(http: Client, headers: Headers, *bodies: Any) -> list[str]:
    await asyncio.sleep(0.2)
    return await post(http, other_client(headers), *bodies)


# -- long poll -------------------------------------------------------------------


async def test_a_long_poll_returns_as_soon_as_a_message_arrives(
    http: Client, headers: Headers
) -> None:
    poster = asyncio.create_task(post_soon(http, headers, {"n": 1}))
    response = await http.get(MESSAGES, params={"wait": "10"}, headers=headers)
    assert response.status == 200
    page = await response.json()
    assert [m["id"] for m in page["messages"]] == await poster
    assert page["messages"][0]["body"] == {"n": 1}
    # the next link leads past it: nothing more, at once
    [link] = page["links"]
    again = await http.get(link["href"], headers=headers)
    assert (await again.json())["messages"] == []


@pytest.mark.slow
async def test_a_long_poll_with_nothing_ends_empty_after_its_wait(
    http: Client, headers: Headers
) -> None:
    response = await http.get(MESSAGES, params={"wait": "0.3"}, headers=headers)
    assert response.status == 200
    assert await response.json() == {"messages": [], "links": []}


async def test_a_long_poll_from_a_marker_sees_only_what_follows(
    http: Client, headers: Headers
) -> None:
    first, second = await post(http, other_client(headers), 1, 2)
    page = await (await http.get(MESSAGES, params={"limit": "1"}, headers=headers)).json()
    marker = page["links"][0]["href"].split("marker=")[1].split("&")[0]
    response = await http.get(MESSAGES, params={"wait": "5", "marker": marker}, headers=headers)
    assert [m["id"] for m in (await response.json())["messages"]] == [second]
    assert first != second


@pytest.mark.slow
async def test_a_long_poll_is_not_woken_by_its_own_posts(http: Client, headers: Headers) -> None:
    async def own_post() -> None:
        await asyncio.sleep(0.1)
        await post(http, headers, "mine")

    poster = asyncio.create_task(own_post())
    response = await http.get(MESSAGES, params={"wait": "0.6"}, headers=headers)
    await poster
    assert (await response.json())["messages"] == []  # echo is off by default
    echoed = await http.get(MESSAGES, params={"wait": "1", "echo": "true"}, headers=headers)
    assert [m["body"] for m in (await echoed.json())["messages"]] == ["mine"]


@pytest.mark.parametrize("wait", ["-1", "20.5", "abc", "nan", "inf"])
async def test_a_bad_wait_is_400(http: Client, headers: Headers, wait: str) -> None:
    response = await http.get(MESSAGES, params={"wait": wait}, headers=headers)
    assert response.status == 400
    assert "wait" in (await response.json())["description"]
    claim = await http.post(
        "/v2/queues/q/claims", params={"wait": wait}, json={"ttl": 60, "grace": 60}, headers=headers
    )
    assert claim.status == 400


# int() and float() take these; a list, a claim and a stream refuse them alike
LOOSE_WAITS = ["1_0", "\u0663", "+1", " 1", "1 ", "0x1", "1e400", "\uff11"]


@pytest.mark.parametrize("wait", LOOSE_WAITS)
async def test_a_loosely_written_wait_is_400(http: Client, headers: Headers, wait: str) -> None:
    response = await http.get(MESSAGES, params={"wait": wait}, headers=headers)
    assert response.status == 400, await response.text()
    assert "wait" in (await response.json())["description"]
    claim = await http.post(
        "/v2/queues/q/claims", params={"wait": wait}, json={"ttl": 60, "grace": 60}, headers=headers
    )
    assert claim.status == 400


@pytest.mark.parametrize("wait", ["0.05", "1e-2", "0"])
async def test_a_wait_written_as_json_writes_numbers_is_taken(
    http: Client, headers: Headers, wait: str
) -> None:
    response = await http.get(MESSAGES, params={"wait": wait}, headers=headers)
    assert response.status == 200, await response.text()


async def test_a_long_poll_after_a_marker_past_the_last_message_is_400(
    http: Client, headers: Headers
) -> None:
    await post(http, other_client(headers), "x")
    for include_delayed in ("false", "true"):  # the tail's path and the store's
        params = {"wait": "10", "marker": "9" * 19, "include_delayed": include_delayed}
        response = await http.get(MESSAGES, params=params, headers=headers)
        assert response.status == 400, await response.text()
        assert (await response.json())["title"] == "Unknown marker"


@pytest.mark.slow
async def test_a_waiting_claim_takes_the_message_posted_meanwhile(
    http: Client, headers: Headers
) -> None:
    poster = asyncio.create_task(post_soon(http, headers, "work"))
    response = await http.post(
        "/v2/queues/q/claims", params={"wait": "10"}, json={"ttl": 60, "grace": 60}, headers=headers
    )
    assert response.status == 201, await response.text()
    assert [m["body"] for m in (await response.json())["messages"]] == ["work"]
    await poster
    nothing = await http.post(
        "/v2/queues/q/claims",
        params={"wait": "0.2"},
        json={"ttl": 60, "grace": 60},
        headers=headers,
    )
    assert nothing.status == 204


# -- event streams -----------------------------------------------------------------


async def open_stream(
    http: Client, headers: Headers, last_event_id: str | None = None, **params: str
) -> ClientResponse:
    extra = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        extra["Last-Event-ID"] = last_event_id
    response = await http.get(MESSAGES, params=params, headers={**headers, **extra})
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers["Cache-Control"] == "no-cache"
    return response


async def next_event(response: ClientResponse, seconds: float = 10) -> dict[str, str]:
    """The next event's fields (comments skipped)."""
    fields: dict[str, str] = {}
    async with asyncio.timeout(seconds):
        while True:
            line = (await response.content.readline()).decode()
            if line == "":
                raise EOFError("the stream ended")
            line = line.rstrip("\n")
            if line == "":
                if fields:
                    return fields
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


async def test_a_stream_sends_the_backlog_then_live_messages(
    http: Client, headers: Headers
) -> None:
    backlog = await post(http, other_client(headers), "a", "b")
    stream = await open_stream(http, headers)
    try:
        assert "retry" in await next_event(stream)
        seen = [await next_event(stream) for _ in backlog]
        assert [orjson.loads(e["data"])["id"] for e in seen] == backlog
        assert {e["event"] for e in seen} == {"message"}
        live = await post(http, other_client(headers), "c")
        event = await next_event(stream)
        message = orjson.loads(event["data"])
        assert (message["id"], message["body"]) == (live[0], "c")
        # the data is the message exactly as a list page shows it
        listed = await (await http.get(MESSAGES, headers=headers)).json()
        as_listed = {m["id"]: m for m in listed["messages"]}[message["id"]]
        assert message.keys() == as_listed.keys()
        assert message["href"] == as_listed["href"]
        # ids are markers: listing after one gives what follows it
        after = await http.get(MESSAGES, params={"marker": seen[0]["id"]}, headers=headers)
        assert [m["id"] for m in (await after.json())["messages"]] == [backlog[1], live[0]]
    finally:
        stream.close()


async def test_a_stream_resumes_after_last_event_id_without_gap_or_repeat(
    http: Client, headers: Headers
) -> None:
    ids = await post(http, other_client(headers), 1, 2, 3)
    stream = await open_stream(http, headers)
    await next_event(stream)  # retry
    first = await next_event(stream)
    stream.close()
    more = await post(http, other_client(headers), 4)
    again = await open_stream(http, headers, last_event_id=first["id"])
    try:
        await next_event(again)
        got = [orjson.loads((await next_event(again))["data"])["id"] for _ in range(3)]
        assert got == [ids[1], ids[2], more[0]]
    finally:
        again.close()


async def test_a_stream_ends_when_its_queue_is_deleted(http: Client, headers: Headers) -> None:
    await post(http, other_client(headers), "x")
    stream = await open_stream(http, headers)
    try:
        await next_event(stream)
        await next_event(stream)
        deleted = await http.delete("/v2/queues/q", headers=headers)
        assert deleted.status == 204
        assert (await next_event(stream))["event"] == "end"
    finally:
        stream.close()


async def test_a_stream_with_a_bad_last_event_id_is_400(http: Client, headers: Headers) -> None:
    response = await http.get(
        MESSAGES, headers={**headers, "Accept": "text/event-stream", "Last-Event-ID": "x1"}
    )
    assert response.status == 400
    assert "Last-Event-ID" in (await response.json())["description"]


async def stream_answer(http: Client, headers: Headers, **params: str) -> ClientResponse:
    """The answer to a stream request, its body left unread (a stream never ends)."""
    response = await http.get(MESSAGES, params=params, headers=headers)
    response.close()
    return response


async def test_a_stream_after_an_id_past_the_last_message_is_400(
    http: Client, headers: Headers
) -> None:
    """Taken, such an id would hide every message posted until the queue's
    counter passed it: the stream would show nothing, silently (issue 28)."""
    await post(http, other_client(headers), "x")
    stream = {**headers, "Accept": "text/event-stream"}
    last = await open_stream(http, headers)
    try:
        await next_event(last)  # retry
        last_id = int((await next_event(last))["id"])
    finally:
        last.close()
    for bad in (str(last_id + 1), "9999999999999999999"):
        response = await http.get(MESSAGES, headers={**stream, "Last-Event-ID": bad})
        assert response.status == 400, response.headers
        doc = await response.json()
        assert doc["title"] == "Unknown marker"
        assert "Last-Event-ID" in doc["description"]
        response = await stream_answer(http, stream, marker=bad)
        assert response.status == 400, response.headers
    # the last id given out still resumes, and sees what follows
    again = await open_stream(http, headers, last_event_id=str(last_id))
    try:
        await next_event(again)
        more = await post(http, other_client(headers), "y")
        assert orjson.loads((await next_event(again))["data"])["id"] == more[0]
    finally:
        again.close()


@pytest.mark.parametrize(
    "params",
    [{"limit": "0"}, {"limit": "21"}, {"limit": "1_0"}, {"limit": "\u0663"}, {"wait": "abc"},
     {"wait": "21"}, {"wait": "1_0"}, {"wait": "\u0663"}, {"echo": "maybe"},
     {"ids": ",".join(["0" * 24] * 21)}],
)  # fmt: skip
async def test_a_stream_refuses_what_a_list_refuses(
    http: Client, headers: Headers, params: dict[str, str]
) -> None:
    listed = await http.get(MESSAGES, params=params, headers=headers)
    assert listed.status == 400
    response = await stream_answer(http, {**headers, "Accept": "text/event-stream"}, **params)
    assert response.status == 400, response.headers
    assert response.content_type == "application/json"


@pytest.mark.parametrize(
    ("accept", "streams"),
    [
        ("text/event-stream", True),
        ("text/event-stream;q=0, application/json", False),
        ("application/json, text/event-stream;q=0.5", False),
        ("text/event-stream;q=0.5, */*", False),
        ("application/json;q=0.5, text/event-stream", True),
        ("TEXT/Event-Stream ; q=1.0", True),
        ("text/event-stream;q=0.000", False),
        ("text/event-stream;q=2", False),  # malformed weight: as if not sent
        ("text/*, application/json;q=0.1", False),  # a wildcard never opts in
        ("*/*", False),
    ],
)
async def test_a_stream_is_sent_only_to_a_client_that_prefers_one(
    http: Client, headers: Headers, accept: str, streams: bool
) -> None:
    response = await stream_answer(http, {**headers, "Accept": accept})
    assert response.status == 200
    assert response.content_type == ("text/event-stream" if streams else "application/json")


async def test_a_stream_sees_nothing_of_another_project(http: Client, headers: Headers) -> None:
    stream = await open_stream(http, headers)
    try:
        await next_event(stream)
        stranger = {**other_client(headers), "X-Project-ID": "other-" + uuid.uuid4().hex}
        await post(http, stranger, "not yours")
        mine = await post(http, other_client(headers), "yours")
        event = await next_event(stream)
        assert orjson.loads(event["data"])["id"] == mine[0]
    finally:
        stream.close()


async def test_many_streams_of_a_queue_share_one_tail(http: Client, headers: Headers) -> None:
    """Fifty caught-up followers each see every message once, in order, and the
    process reads the queue once per wake-up, not once per follower."""
    streams = [await open_stream(http, headers) for _ in range(50)]
    try:
        for stream in streams:
            await next_event(stream)
        live = http.app[LIVE]
        assert live.tails == 1
        [tail] = live._tails.values()
        reads_before = tail.reads
        ids: list[str] = []
        for n in range(5):
            ids += await post(http, other_client(headers), n)
        for stream in streams:
            got = [orjson.loads((await next_event(stream))["data"])["id"] for _ in ids]
            assert got == ids
        assert tail.reads - reads_before <= 2 * len(ids), "reads multiplied with followers"
    finally:
        for stream in streams:
            stream.close()


async def test_followers_beyond_the_limit_get_503(settings: Settings, headers: Headers) -> None:
    app = create_app(settings.replace(max_followers=1))
    async with TestClient(TestServer(app)) as http:
        first = await open_stream(http, headers)
        try:
            response = await http.get(MESSAGES, headers={**headers, "Accept": "text/event-stream"})
            assert response.status == 503
            assert response.headers["Retry-After"]
            poll = await http.get(MESSAGES, params={"wait": "1"}, headers=headers)
            assert poll.status == 503
        finally:
            first.close()


async def test_a_stream_carries_a_request_id_like_every_answer(
    http: Client, headers: Headers
) -> None:
    # the error middleware set it after the handler returned: too late for a
    # stream, whose head is sent when it starts
    listed = await http.get(MESSAGES, headers=headers)
    assert listed.headers["X-Openstack-Request-Id"].startswith("req-")
    stream = await open_stream(http, headers)
    try:
        assert stream.headers["X-Openstack-Request-Id"].startswith("req-")
        assert stream.headers["X-Openstack-Request-Id"] != listed.headers["X-Openstack-Request-Id"]
    finally:
        stream.close()


@pytest.mark.parametrize("kind", ["long poll", "stream"])
async def test_a_follower_whose_client_goes_away_is_freed_at_once(
    settings: Settings, headers: Headers, kind: str
) -> None:
    """Not at its next write (a heartbeat, 15 s on) or the end of its wait (20 s)."""
    app = create_app(settings)
    runner = FeedAppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = int(runner.addresses[0][1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        query = "?wait=20" if kind == "long poll" else ""
        accept = "text/event-stream" if kind == "stream" else "application/json"
        lines = [f"GET {MESSAGES}{query} HTTP/1.1", "Host: feedsvc", f"Accept: {accept}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        live = app[LIVE]
        for _ in range(200):
            if live.followers == 1:
                break
            await asyncio.sleep(0.025)
        assert live.followers == 1, await asyncio.wait_for(reader.read(300), 1)
        writer.close()
        for _ in range(200):  # at most 5 s
            if live.followers == 0:
                break
            await asyncio.sleep(0.025)
        assert live.followers == 0, f"the {kind} outlived its client"
        assert live.tails == 0
        del reader
    finally:
        await runner.cleanup()


async def test_a_queue_deleted_while_its_tail_subscribes_still_ends_it(
    store: FeedStore, project: str
) -> None:
    """The deletion's announcement may go out before the new tail listens:
    the tail then finds the queue gone and ends its followers all the same."""
    await store.post_messages(project, "q", "writer", [NewMessage(b"1")])
    live = LiveFeeds(store, scan_limit=1000, tick=15)
    try:
        follower = Waiter(None, Filters("reader"))
        async with live.follower(project, "q", follower):
            assert len(await live.catch_up(project, "q", follower)) == 1
            assert await live.catch_up(project, "q", follower) == []  # joined: tail starts
            await store.delete_queue(project, "q")  # before or while it subscribes
            assert await follower.finished(10)
            assert follower.ended, "the deleted queue's followers were not ended"
        # the queue made again is followed by a new tail, not the ended one
        again = Waiter(None, Filters("reader"))
        async with live.follower(project, "q", again):
            assert await live.catch_up(project, "q", again) == []
            await store.post_messages(project, "q", "writer", [NewMessage(b"2")])
            assert await again.finished(10)
            assert [m.body for m in again.messages] == [b"2"]
    finally:
        await live.close()


@pytest.mark.slow
async def test_a_caught_up_tail_reads_once_per_post(
    http: Client, headers: Headers, redis_url: str
) -> None:
    counted = reads_are_counted(redis_url)
    stream = await open_stream(http, headers)
    try:
        await next_event(stream)  # retry: caught up, following
        [tail] = http.app[LIVE]._tails.values()
        # A tail that starts at the head of its queue cannot bound its first
        # scan, so its first post may cost a second, empty read; from then on:
        await post(http, other_client(headers), "first")
        await next_event(stream)
        await asyncio.sleep(0.3)  # whatever that wake-up reads, it has read
        for n in range(3):
            before = tail.reads
            await post(http, other_client(headers), n)
            await next_event(stream)
            await asyncio.sleep(0.2)  # whatever else this wake-up reads, it reads now
            assert not counted or tail.reads - before == 1
    finally:
        stream.close()


async def test_a_caught_up_stream_gets_heartbeats(settings: Settings, headers: Headers) -> None:
    """Sent by the process's one timer, not by Redis or a timer per stream."""
    app = create_app(settings.replace(stream_heartbeat=0.2))
    async with TestClient(TestServer(app)) as http:
        stream = await open_stream(http, headers)
        try:
            lines: list[bytes] = []
            async with asyncio.timeout(10):
                while b": heartbeat\n" not in lines:
                    lines.append(await stream.content.readline())
            await post(http, other_client(headers), "after the heartbeats")
            assert orjson.loads((await next_event(stream))["data"])["body"] == (
                "after the heartbeats"
            )
        finally:
            stream.close()


@pytest.mark.slow
async def test_a_stream_ends_after_its_lifetime(settings: Settings, headers: Headers) -> None:
    app = create_app(settings.replace(stream_lifetime=1.0))
    async with TestClient(TestServer(app)) as http:
        stream = await open_stream(http, headers)
        with pytest.raises(EOFError):
            while True:
                await next_event(stream, seconds=10)  # retry:, then the end
        assert http.app[LIVE].followers == 0


async def test_a_stream_too_slow_for_its_buffer_is_cut_off_and_resumes_losing_nothing(
    settings: Settings, headers: Headers
) -> None:
    """A client that reads nothing: once more than --stream-buffer-kib piles
    up unsent, its stream is cut off (not the tail, not the other streams);
    reconnecting from the last event it got whole, it gets the rest, once."""
    import socket

    app = create_app(settings.replace(stream_buffer_kib=1))
    runner = FeedAppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = int(runner.addresses[0][1])
        base = f"http://127.0.0.1:{port}"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader's window
        sock.connect(("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        lines = [f"GET {MESSAGES} HTTP/1.1", "Host: feedsvc", "Accept: text/event-stream"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        async with TestClient(TestServer(create_app(settings))) as poster:
            live = app[LIVE]
            for _ in range(200):
                if live.tails == 1:
                    break
                await asyncio.sleep(0.025)
            assert live.tails == 1
            bodies: list[str] = []
            for n in range(300):  # at most 60 MB: far beyond any socket's buffers
                batch = [f"{n}-{i}-" + "x" * 20_000 for i in range(10)]
                await post(poster, other_client(headers), *batch)
                bodies += batch
                if live.followers == 0:
                    break
            assert live.followers == 0, "the slow stream was never cut off"
            received = b""
            with contextlib.suppress(ConnectionError):
                async with asyncio.timeout(30):
                    while chunk := await reader.read(1 << 20):
                        received += chunk
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            whole = received.split(b"\n\n")[:-1]  # what follows the last blank line is cut
            events = [e for e in whole if b"\nevent: message\ndata: " in e]
            got = [orjson.loads(e.split(b"\ndata: ", 1)[1].split(b"\r\n", 1)[0]) for e in events]
            seen = [m["body"] for m in got]
            assert seen == bodies[: len(seen)]
            last = events[-1].split(b"id: ", 1)[1].split(b"\n", 1)[0].decode() if events else None
            extra = {"Accept": "text/event-stream"}
            if last is not None:
                extra["Last-Event-ID"] = last
            async with (
                aiohttp.ClientSession() as session,
                session.get(base + MESSAGES, headers={**headers, **extra}) as again,
            ):
                while len(seen) < len(bodies):
                    event = await next_event(again)
                    if event.get("event") == "message":
                        seen.append(orjson.loads(event["data"])["body"])
            assert seen == bodies
    finally:
        await runner.cleanup()


# -- waking without a post (DESIGN.md rule 12) ------------------------------------


@pytest.fixture
async def realtime(redis_url: str, driver: str) -> AsyncIterator[Client]:
    """A service on the host's clock whose claims may last 1 s: what falls
    due or expires here does so in real time."""
    settings = make_settings(redis_url, driver=driver, min_claim_ttl=1, min_claim_grace=0)
    async with TestClient(TestServer(create_app(settings))) as client:
        yield client


def reads_are_counted(redis_url: str) -> bool:
    """Whether a test may count a tail's reads exactly: not on a Redis
    Cluster, where each node confirms a follower's shard subscription on its
    own connection, and a confirmation that comes late (a loaded machine:
    both CI runs of 2026-11-27 saw 2-3 reads where 1 was due) wakes the
    tail once more, as designed (storage/notifier.py: a confirmation wakes
    the follower, as anything may have been posted before it). How often a
    tail reads is its own logic, the same on every topology: counted on a
    single Redis; on a cluster the test checks what arrives."""
    return not redis_url.startswith("redis+cluster://")


async def post_delayed(http: Client, headers: Headers, delay: int) -> str:
    doc = {"messages": [{"body": "later", "delay": delay}]}
    response = await http.post(MESSAGES, json=doc, headers=other_client(headers))
    assert response.status == 201, await response.text()
    return str((await response.json())["resources"][0].rsplit("/", 1)[1])


async def claim_waiting(http: Client, headers: Headers, wait: str) -> ClientResponse:
    return await http.post(
        "/v2/queues/q/claims", params={"wait": wait}, json={"ttl": 60, "grace": 60}, headers=headers
    )


@pytest.mark.slow
async def test_a_long_poll_returns_a_message_that_falls_due_meanwhile(
    realtime: Client, headers: Headers
) -> None:
    """Posted before the poll began, so no post will wake it: the poll's own
    read tells it when the message falls due."""
    later = await post_delayed(realtime, headers, 1)
    response = await realtime.get(MESSAGES, params={"wait": "6"}, headers=headers)
    assert [m["id"] for m in (await response.json())["messages"]] == [later]


@pytest.mark.slow
async def test_a_stream_gets_a_message_that_falls_due_without_another_post(
    realtime: Client, headers: Headers
) -> None:
    later = await post_delayed(realtime, headers, 1)
    stream = await open_stream(realtime, headers)
    try:
        assert "retry" in await next_event(stream)
        event = await next_event(stream, seconds=6)
        assert event["event"] == "message"
        assert orjson.loads(event["data"])["id"] == later
    finally:
        stream.close()


async def test_a_waiting_claim_takes_a_message_released_meanwhile(
    http: Client, headers: Headers
) -> None:
    [mid] = await post(http, other_client(headers), "work")
    held = await http.post("/v2/queues/q/claims", json={"ttl": 60, "grace": 60}, headers=headers)
    assert held.status == 201
    waiting = asyncio.create_task(claim_waiting(http, headers, "10"))
    await asyncio.sleep(0.2)
    released = await http.delete(held.headers["Location"], headers=headers)
    assert released.status == 204
    response = await waiting
    assert response.status == 201, await response.text()
    assert [m["id"] for m in (await response.json())["messages"]] == [mid]


async def test_a_waiting_claim_takes_one_message_released_meanwhile(
    http: Client, headers: Headers
) -> None:
    [mid] = await post(http, other_client(headers), "work")
    held = await http.post("/v2/queues/q/claims", json={"ttl": 60, "grace": 60}, headers=headers)
    assert held.status == 201
    claim_id = held.headers["Location"].rsplit("/", 1)[1]
    waiting = asyncio.create_task(claim_waiting(http, headers, "10"))
    await asyncio.sleep(0.2)
    url = f"{MESSAGES}/{mid}/release?claim_id={claim_id}"
    released = await http.post(url, json={"delay": 0}, headers=headers)
    assert released.status == 204
    response = await waiting
    assert response.status == 201, await response.text()
    assert [m["id"] for m in (await response.json())["messages"]] == [mid]


@pytest.mark.slow
async def test_a_waiting_claim_takes_a_message_released_with_a_delay(
    realtime: Client, headers: Headers
) -> None:
    """The waiter slept until the claim's expiry (60 s); the release tells it
    when the message falls due."""
    [mid] = await post(realtime, other_client(headers), "work")
    held = await realtime.post(
        "/v2/queues/q/claims", json={"ttl": 60, "grace": 60}, headers=headers
    )
    claim_id = held.headers["Location"].rsplit("/", 1)[1]
    waiting = asyncio.create_task(claim_waiting(realtime, headers, "6"))
    await asyncio.sleep(0.2)
    url = f"{MESSAGES}/{mid}/release?claim_id={claim_id}"
    released = await realtime.post(url, json={"delay": 1}, headers=headers)
    assert released.status == 204
    response = await waiting
    assert response.status == 201, await response.text()
    assert [(m["id"], m["claim_count"]) for m in (await response.json())["messages"]] == [(mid, 2)]


@pytest.mark.slow
async def test_a_waiting_claim_takes_a_message_whose_claim_expires_meanwhile(
    realtime: Client, headers: Headers
) -> None:
    [mid] = await post(realtime, other_client(headers), "work")
    held = await realtime.post("/v2/queues/q/claims", json={"ttl": 1, "grace": 0}, headers=headers)
    assert held.status == 201
    response = await claim_waiting(realtime, headers, "6")
    assert response.status == 201, await response.text()
    assert [m["id"] for m in (await response.json())["messages"]] == [mid]


@pytest.mark.slow
async def test_a_waiting_claim_takes_a_message_that_falls_due_meanwhile(
    realtime: Client, headers: Headers
) -> None:
    later = await post_delayed(realtime, headers, 1)
    response = await claim_waiting(realtime, headers, "6")
    assert response.status == 201, await response.text()
    assert [m["id"] for m in (await response.json())["messages"]] == [later]


@pytest.mark.slow
async def test_a_stream_gets_a_delayed_message_posted_with_a_visible_one(
    realtime: Client, headers: Headers
) -> None:
    """Read together, the visible message does not carry the stream past
    the delayed one: it comes once due, without another post."""
    stream = await open_stream(realtime, headers)
    try:
        assert "retry" in await next_event(stream)
        doc = {"messages": [{"body": "now"}, {"body": "later", "delay": 1}]}
        response = await realtime.post(MESSAGES, json=doc, headers=other_client(headers))
        assert response.status == 201
        hrefs = (await response.json())["resources"]
        for href in hrefs:
            event = await next_event(stream, seconds=6)
            assert orjson.loads(event["data"])["href"] == href
    finally:
        stream.close()


@pytest.mark.slow
async def test_a_tail_reads_once_more_when_a_delayed_message_falls_due(
    realtime: Client, headers: Headers, redis_url: str
) -> None:
    """What waiting for a due message costs: one read at its moment, none before."""
    counted = reads_are_counted(redis_url)
    stream = await open_stream(realtime, headers)
    try:
        assert "retry" in await next_event(stream)
        [tail] = realtime.app[LIVE]._tails.values()
        # a tail at the head of its queue cannot bound its first scan (see
        # test_a_caught_up_tail_reads_once_per_post): move it on first
        await post(realtime, other_client(headers), "first")
        await next_event(stream)
        later = await post_delayed(realtime, headers, 1)
        await asyncio.sleep(0.5)  # the post's wake-up has been read: nothing visible yet
        before = tail.reads
        event = await next_event(stream, seconds=6)
        assert orjson.loads(event["data"])["id"] == later
        assert not counted or tail.reads - before == 1
        await asyncio.sleep(1)  # and nothing more while nothing else is pending
        assert not counted or tail.reads - before == 1
    finally:
        stream.close()


# -- a follower that passed a claimed message (DESIGN.md rules 8 and 12) ---------
#
# A follower without include_claimed passes a claimed message, as a list
# does. While it has been given nothing after it, a list from its marker
# (a long poll's, a stream's last event id) returns the message once its
# claim ends: the follower must then get it too, once, in order.


async def claim_one(http: Client, headers: Headers, ttl: int = 60) -> str:
    """Claim the queue's first free message; the claim's href."""
    held = await http.post(
        "/v2/queues/q/claims",
        params={"limit": "1"},
        json={"ttl": ttl, "grace": 0 if ttl < 60 else 60},
        headers=headers,
    )
    assert held.status == 201, await held.text()
    return str(held.headers["Location"])


async def release(http: Client, headers: Headers, claim: str) -> None:
    released = await http.delete(claim, headers=headers)
    assert released.status == 204


@pytest.mark.slow
async def test_a_long_poll_returns_a_message_released_meanwhile(
    http: Client, headers: Headers
) -> None:
    [mid] = await post(http, other_client(headers), "work")
    claim = await claim_one(http, headers)
    polling = asyncio.create_task(http.get(MESSAGES, params={"wait": "10"}, headers=headers))
    await asyncio.sleep(0.3)  # caught up, waiting
    await release(http, headers, claim)
    response = await polling
    assert [m["id"] for m in (await response.json())["messages"]] == [mid]


@pytest.mark.slow
async def test_a_stream_gets_a_message_released_meanwhile(http: Client, headers: Headers) -> None:
    [first] = await post(http, other_client(headers), "seen")
    listed = await (await http.get(MESSAGES, headers=headers)).json()
    marker = listed["links"][0]["href"].split("marker=")[1].split("&")[0]
    await http.delete(f"{MESSAGES}/{first}", headers=headers)  # the marker's message may go
    [mid] = await post(http, other_client(headers), "work")
    claim = await claim_one(http, headers)
    stream = await open_stream(http, headers, marker=marker)
    try:
        assert "retry" in await next_event(stream)
        await asyncio.sleep(0.3)  # caught up, following
        await release(http, headers, claim)
        event = await next_event(stream)
        assert orjson.loads(event["data"])["id"] == mid
        [later] = await post(http, other_client(headers), "later")
        assert orjson.loads((await next_event(stream))["data"])["id"] == later  # no repeat
    finally:
        stream.close()


async def a_claimed_message_read_by_the_tail(
    http: Client, headers: Headers, clock: ManualClock
) -> tuple[str, str]:
    """Make the queue's tail read a message while it is claimed: posted
    delayed (the tail waits for it), due on the store's clock without the
    tail knowing, claimed, then read by the tail with a message of the
    follower's own (which it does not see) that wakes it. The message's id
    and its claim's href."""
    later = await post_delayed(http, headers, 60)
    await asyncio.sleep(0.3)  # the tail has read the post: nothing visible yet
    clock.advance(60)
    claim = await claim_one(http, headers)
    await post(http, headers, "mine")  # echo off: the follower's own, unseen
    await asyncio.sleep(0.3)  # the tail has read both
    return later, claim


@pytest.mark.slow
async def test_a_long_poll_gets_a_message_the_tail_read_claimed_once_released(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    polling = asyncio.create_task(http.get(MESSAGES, params={"wait": "10"}, headers=headers))
    await asyncio.sleep(0.3)  # caught up, waiting
    later, claim = await a_claimed_message_read_by_the_tail(http, headers, clock)
    assert not polling.done()
    await release(http, headers, claim)
    response = await polling
    assert [m["id"] for m in (await response.json())["messages"]] == [later]


@pytest.mark.slow
async def test_a_stream_gets_a_message_the_tail_read_claimed_once_released(
    http: Client, headers: Headers, clock: ManualClock, redis_url: str
) -> None:
    counted = reads_are_counted(redis_url)
    [before] = await post(http, other_client(headers), "before")
    stream = await open_stream(http, headers)
    try:
        assert "retry" in await next_event(stream)
        assert orjson.loads((await next_event(stream))["data"])["id"] == before
        await http.delete(f"{MESSAGES}/{before}", headers=headers)  # not the one claimed
        later, claim = await a_claimed_message_read_by_the_tail(http, headers, clock)
        [tail] = http.app[LIVE]._tails.values()
        reads = tail.reads
        await release(http, headers, claim)
        assert orjson.loads((await next_event(stream))["data"])["id"] == later
        await asyncio.sleep(0.3)
        assert not counted or tail.reads - reads == 1  # one read for the release, shared
        [after] = await post(http, other_client(headers), "after")
        assert orjson.loads((await next_event(stream))["data"])["id"] == after  # no repeat
    finally:
        stream.close()


async def test_a_stream_past_a_claimed_message_does_not_get_it_back(
    http: Client, headers: Headers
) -> None:
    """Given a message after the claimed one, the stream's last event id is
    past it: a list from there does not return it once released, nor does
    the stream."""
    await post(http, other_client(headers), "work")
    claim = await claim_one(http, headers)
    [after] = await post(http, other_client(headers), "after")
    stream = await open_stream(http, headers)
    try:
        assert "retry" in await next_event(stream)
        event = await next_event(stream)
        assert orjson.loads(event["data"])["id"] == after
        await release(http, headers, claim)
        listed = await http.get(MESSAGES, params={"marker": event["id"]}, headers=headers)
        assert (await listed.json())["messages"] == []
        [later] = await post(http, other_client(headers), "later")
        assert orjson.loads((await next_event(stream))["data"])["id"] == later
    finally:
        stream.close()


@pytest.mark.slow
async def test_a_long_poll_returns_a_message_whose_claim_expires_meanwhile(
    realtime: Client, headers: Headers
) -> None:
    [mid] = await post(realtime, other_client(headers), "work")
    await claim_one(realtime, headers, ttl=1)
    response = await realtime.get(MESSAGES, params={"wait": "6"}, headers=headers)
    assert [m["id"] for m in (await response.json())["messages"]] == [mid]


@pytest.mark.slow
async def test_a_stream_gets_a_message_whose_claim_expires_meanwhile(
    realtime: Client, headers: Headers
) -> None:
    [mid] = await post(realtime, other_client(headers), "work")
    await claim_one(realtime, headers, ttl=1)
    stream = await open_stream(realtime, headers)
    try:
        assert "retry" in await next_event(stream)
        event = await next_event(stream, seconds=6)
        assert orjson.loads(event["data"])["id"] == mid
    finally:
        stream.close()


@pytest.mark.slow
async def test_a_long_poll_with_delayed_messages_returns_one_whose_claim_expires(
    realtime: Client, headers: Headers
) -> None:
    """include_delayed long polls read alone, not through the tail: their
    own read says when a claim ends too."""
    [mid] = await post(realtime, other_client(headers), "work")
    await claim_one(realtime, headers, ttl=1)

    async def delete_later() -> None:  # a poll still waiting then ends empty
        await asyncio.sleep(3.5)
        await realtime.delete(f"{MESSAGES}/{mid}", headers=headers)

    deleting = asyncio.create_task(delete_later())
    params = {"wait": "7", "include_delayed": "true"}
    response = await realtime.get(MESSAGES, params=params, headers=headers)
    assert [m["id"] for m in (await response.json())["messages"]] == [mid]
    await deleting


@pytest.mark.slow
async def test_a_follower_held_further_back_than_one_read_is_let_go(
    store: FeedStore, project: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tail reads a bounded number of pages from the lowest held position:
    a follower whose claimed messages lie beyond that is let go (a long poll
    answers empty), and its client's next poll from its marker gets them."""
    monkeypatch.setattr(live_module, "PAGES_PER_READ", 1)  # one page of 20
    # a canonical UUID, as the API lets through: the segment layout keeps an
    # author as its 16 bytes, so only such an id reads back as itself (echo)
    reader = str(uuid.uuid4())
    live = LiveFeeds(store, scan_limit=1000, tick=15)
    try:
        waiter = Waiter(None, Filters(reader))
        async with live.follower(project, "q", waiter):
            assert await live.catch_up(project, "q", waiter) == []  # the tail starts
            later = [NewMessage(b"%d" % n, delay=60) for n in range(30)]
            await store.post_messages(project, "q", "writer", later)
            await asyncio.sleep(0.3)  # the tail has read the post: nothing visible yet
            clock.advance(60)
            for limit in (20, 5):
                assert await store.claim_messages(project, "q", 60, 60, limit) is not None
            last = await store.claim_messages(project, "q", 60, 60, 5)
            assert last is not None
            await store.post_messages(project, "q", reader, [NewMessage(b"mine")])  # a wake-up
            await asyncio.sleep(0.3)  # the tail has read all 31, claimed or its own
            assert not waiter.done
            await store.release_claim(project, "q", last.id)
            assert await waiter.finished(10)
            assert waiter.messages == []
        again = Waiter(None, Filters(reader))
        async with live.follower(project, "q", again):
            got = await live.catch_up(project, "q", again)
            assert [m.id for m in got] == [m.id for m in last.messages]
    finally:
        await live.close()
