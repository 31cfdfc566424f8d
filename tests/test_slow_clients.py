"""Slow request heads on keep-alive connections (issue 13 item 8).

``--client-timeout`` bounds the arrival of every request head on a
connection, not only the first: from the connection's start for the first
head, from its first byte (or from the end of the previous response, if it
began while that request was handled) for the next ones. A connection that
sends nothing after a response is an idle keep-alive connection, bounded by
``--keepalive-timeout`` only; a slow body is still a 408; a long poll or a
stream, whose head arrived, is never cut by the head clock.

The first tests run ``feedsvc serve`` with ``--client-timeout 1`` and
``--keepalive-timeout 60``; the others run :class:`FeedAppRunner` in this
process with handlers that take their time, as a long poll or an event
stream does. No test asserts a duration: the bounds only tell a closed
connection from one that was held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
import uvloop
from aiohttp import web

from feedsvc.api.protocol import FeedAppRunner, JsonErrorRequestHandler
from feedsvc.embedded_redis.server import RedisServer
from tests.test_faults import LiveService, report

CLIENT_TIMEOUT = 1.0
KEEPALIVE_TIMEOUT = 60.0
#: A connection the server must close is closed within this (it is well
#: below the keep-alive timeout, which would close it anyway).
CLOSE_BOUND = 20.0
#: How long a test waits for an answer that must come.
ANSWER_BOUND = 30.0
#: A trickling client sends this many bytes, this often.
STEP, EVERY = 2, 0.3
#: Every test here waits for a head's clock to run out (or not to) in real
#: time, 1-5 s each: make test runs them, the fast loop leaves them out.
pytestmark = pytest.mark.slow
HEADERS = "Client-ID: 3a1f2f5e-7d4c-4b8e-9a55-0d6c2d1e7f10\r\nX-Project-ID: slow\r\n"

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def endless_head(path: str = "/v2/ping") -> bytes:
    """The start of a request head longer than any test sends of it."""
    pad = "".join(f"X-Pad-{i}: {i}\r\n" for i in range(100))
    return f"GET {path} HTTP/1.1\r\nHost: slow\r\n{pad}".encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response (status, body); the body by Content-Length."""
    async with asyncio.timeout(ANSWER_BOUND):
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await reader.readexactly(length)


async def trickle(stream: Stream, data: bytes) -> float | None:
    """Send data STEP bytes every EVERY seconds until the server closes:
    seconds that took, None if it did not within CLOSE_BOUND."""
    reader, writer = stream
    loop = asyncio.get_running_loop()
    start = loop.time()
    # the server sends nothing here: a read ends only when it closes
    closed = asyncio.ensure_future(reader.read())
    try:
        for at in range(0, len(data), STEP):
            if loop.time() - start > CLOSE_BOUND:
                return None
            try:
                writer.write(data[at : at + STEP])
                await writer.drain()
            except ConnectionError:
                return loop.time() - start
            done, _ = await asyncio.wait({closed}, timeout=EVERY)
            if done:
                assert closed.exception() or closed.result() == b"", closed.result()
                return loop.time() - start
        raise AssertionError("ran out of bytes to trickle: make endless_head() longer")
    finally:
        closed.cancel()
        with contextlib.suppress(BaseException):
            await closed


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[Stream]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


# -- feedsvc serve ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveService]:
    log = tmp_path_factory.mktemp("slow-clients") / "serve.log"
    timeouts = ("--client-timeout", str(CLIENT_TIMEOUT), "--keepalive-timeout")
    with LiveService(redis_server.url, "lua", log, *timeouts, str(KEEPALIVE_TIMEOUT)) as svc:
        yield svc


@pytest.mark.process
@pytest.mark.timeout(60)
async def test_a_slowly_sent_second_head_is_cut(service: LiveService) -> None:
    async with connection(service.port) as (reader, writer):
        writer.write(b"GET /v2/ping HTTP/1.1\r\nHost: slow\r\n\r\n")
        assert (await read_response(reader))[0] == 204
        took = await trickle((reader, writer), endless_head())
    report("slow-second-head", client_timeout=CLIENT_TIMEOUT, closed_after_s=took)
    assert took is not None, (
        f"a second head sent {STEP} bytes every {EVERY} s held its connection "
        f"{CLOSE_BOUND} s (--client-timeout {CLIENT_TIMEOUT})"
    )


@pytest.mark.process
@pytest.mark.timeout(60)
async def test_a_slowly_sent_first_head_is_cut(service: LiveService) -> None:
    async with connection(service.port) as stream:
        took = await trickle(stream, endless_head())
    assert took is not None


@pytest.mark.process
@pytest.mark.timeout(60)
async def test_a_keep_alive_client_with_idle_gaps_is_served(service: LiveService) -> None:
    """Gaps longer than --client-timeout (but not --keepalive-timeout) between
    requests, and a head in two parts, cut nothing."""
    request = b"GET /v2/ping HTTP/1.1\r\nHost: slow\r\n\r\n"
    async with connection(service.port) as (reader, writer):
        for _ in range(3):
            writer.write(request)
            assert (await read_response(reader))[0] == 204
            await asyncio.sleep(CLIENT_TIMEOUT * 1.5)
        writer.write(request[:10])
        await writer.drain()
        await asyncio.sleep(CLIENT_TIMEOUT / 10)
        writer.write(request[10:])
        assert (await read_response(reader))[0] == 204


@pytest.mark.process
@pytest.mark.timeout(60)
async def test_heads_in_time_back_to_back_are_never_cut(service: LiveService) -> None:
    """Requests one after another for several --client-timeouts, each head
    sent in two parts within the timeout: the clock of each head counts from
    its own first byte, however long ago the connection's timer was set
    (one timer per connection moves itself on), so none is cut."""
    request = b"GET /v2/ping HTTP/1.1\r\nHost: slow\r\n\r\n"
    pause = CLIENT_TIMEOUT * 0.3
    served = 0
    async with connection(service.port) as (reader, writer):
        for _ in range(round(4 * CLIENT_TIMEOUT / pause)):
            writer.write(request[:10])
            await writer.drain()
            await asyncio.sleep(pause)
            writer.write(request[10:])
            status, _ = await read_response(reader)
            assert status == 204
            served += 1
    assert served * pause >= 3 * CLIENT_TIMEOUT


class CountingHandler(JsonErrorRequestHandler):
    """Counts the runs of its head timer's check."""

    checks = 0

    def _head_check(self) -> None:
        self.checks += 1
        super()._head_check()


async def _never_called(request: web.BaseRequest) -> web.StreamResponse:
    raise AssertionError("no request reaches this handler")


async def _checks_for_one_deadline(head_timeout: float) -> int:
    """How often the timer checks a head whose clock was restarted once."""
    loop = asyncio.get_running_loop()
    server = web.Server(_never_called)
    handler = CountingHandler(server, loop=loop, head_timeout=head_timeout)
    handler._start_head_clock()
    await asyncio.sleep(head_timeout / 10)
    handler._start_head_clock()  # the timer, due sooner, must move on
    await asyncio.sleep(head_timeout * 1.5)
    handler._stop_head_clock()
    return handler.checks


def test_a_head_timer_that_moves_on_checks_once_more_not_in_a_loop() -> None:
    """uvloop keeps time in whole milliseconds: a timer rescheduled for a
    deadline less than a millisecond away ran again at once, hundreds of
    times, until the millisecond turned. (Served on uvloop, so tested on it.)"""
    counts = [uvloop.run(_checks_for_one_deadline(0.3)) for _ in range(5)]
    assert max(counts) <= 3, counts


@pytest.mark.process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", [False, True], ids=["first-request", "second-request"])
async def test_a_slow_body_is_a_408(service: LiveService, second: bool) -> None:
    body = b'{"messages": [{"body": "sent slowly"}]}'
    head = (
        f"POST /v2/queues/slow/messages HTTP/1.1\r\nHost: slow\r\n{HEADERS}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    async with connection(service.port) as (reader, writer):
        if second:
            writer.write(b"GET /v2/ping HTTP/1.1\r\nHost: slow\r\n\r\n")
            assert (await read_response(reader))[0] == 204
        writer.write(head + body[:5])
        answer = asyncio.ensure_future(read_response(reader))
        for at in range(5, len(body) - 1):  # never the last byte
            if answer.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(body[at : at + 1])
            await asyncio.wait({answer}, timeout=EVERY)
        status, text = await answer
    assert status == 408, text


# -- requests that take their time after their head ------------------------------------


HEAD_TIMEOUT = 0.5


#: An answer larger than loopback's socket buffers: its writing waits for
#: the client to read.
BIG = 64 * 1024 * 1024


class Slow:
    """An app whose /slow answers after some head timeouts and whose /stream
    sends an event every EVERY seconds for as long; / answers at once, and
    /big with BIG bytes."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/", self.fast)
        self.app.router.add_get("/slow", self.slow)
        self.app.router.add_get("/stream", self.stream)
        self.app.router.add_get("/big", self.big)

    async def fast(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"x" * BIG)

    async def slow(self, request: web.Request) -> web.Response:
        self.entered.set()
        await asyncio.sleep(HEAD_TIMEOUT * 4)
        return web.Response(text="ok")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.entered.set()
        for n in range(int(HEAD_TIMEOUT * 4 / EVERY) + 1):
            await response.write(f"data: {n}\n\n".encode())
            await asyncio.sleep(EVERY)
        await response.write_eof()
        return response


@pytest.fixture
async def slow() -> AsyncIterator[tuple[Slow, int]]:
    served = Slow()
    runner = FeedAppRunner(
        served.app, handle_signals=False, head_timeout=HEAD_TIMEOUT, keepalive_timeout=60
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield served, int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def test_a_long_request_is_not_cut(slow: tuple[Slow, int]) -> None:
    _, port = slow
    async with connection(port) as (reader, writer):
        for _ in range(2):  # also once the connection has been kept alive
            writer.write(b"GET /slow HTTP/1.1\r\nHost: slow\r\n\r\n")
            assert await read_response(reader) == (200, b"ok")


async def test_a_stream_is_not_cut(slow: tuple[Slow, int]) -> None:
    _, port = slow
    async with connection(port) as (reader, writer):
        writer.write(b"GET / HTTP/1.1\r\nHost: slow\r\n\r\n")
        assert await read_response(reader) == (200, b"ok")
        writer.write(b"GET /stream HTTP/1.1\r\nHost: slow\r\n\r\n")
        async with asyncio.timeout(ANSWER_BOUND):
            received = await reader.readuntil(b"0\r\n\r\n")  # the last chunk
    events = received.count(b"data: ")
    assert events == int(HEAD_TIMEOUT * 4 / EVERY) + 1, received


async def test_a_head_begun_during_a_long_request_is_timed_from_its_response(
    slow: tuple[Slow, int],
) -> None:
    """The next head's first bytes arrive while /slow runs: not cut then,
    completed right after the answer it is served; left unfinished, the
    connection is closed without waiting for the keep-alive timeout."""
    served, port = slow
    request = b"GET / HTTP/1.1\r\nHost: slow\r\n\r\n"
    async with connection(port) as (reader, writer):
        writer.write(b"GET /slow HTTP/1.1\r\nHost: slow\r\n\r\n")
        await asyncio.wait_for(served.entered.wait(), ANSWER_BOUND)
        writer.write(request[:5])
        assert await read_response(reader) == (200, b"ok")
        writer.write(request[5:])
        assert await read_response(reader) == (200, b"ok")

        served.entered.clear()
        writer.write(b"GET /slow HTTP/1.1\r\nHost: slow\r\n\r\n")
        await asyncio.wait_for(served.entered.wait(), ANSWER_BOUND)
        writer.write(request[:5])
        assert await read_response(reader) == (200, b"ok")
        async with asyncio.timeout(CLOSE_BOUND):
            assert await reader.read() == b"", "answered half a head"


async def test_a_silent_connection_is_cut(slow: tuple[Slow, int]) -> None:
    _, port = slow
    async with connection(port) as (reader, _), asyncio.timeout(CLOSE_BOUND):
        assert await reader.read() == b""


async def test_a_head_behind_a_declined_upgrade_leaves_the_connection_idle_not_timed(
    slow: tuple[Slow, int],
) -> None:
    """A request asking for an Upgrade that the handler declines: bytes sent
    behind it wait, unparsed, until its answer, and aiohttp parses them then
    (not in data_received). The head they hold is whole: once it is served,
    the connection is an idle keep-alive one, not one whose next head is
    late."""
    served, port = slow
    upgrade = (
        b"GET /slow HTTP/1.1\r\nHost: slow\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    request = b"GET / HTTP/1.1\r\nHost: slow\r\n\r\n"
    async with connection(port) as (reader, writer):
        writer.write(upgrade)
        await asyncio.wait_for(served.entered.wait(), ANSWER_BOUND)
        writer.write(request)  # behind the upgrade, in a packet of its own
        assert await read_response(reader) == (200, b"ok")
        assert await read_response(reader) == (200, b"ok")
        # idle for several head timeouts (the keep-alive timeout is 60 s) ...
        closed = asyncio.ensure_future(reader.read())
        done, _ = await asyncio.wait({closed}, timeout=HEAD_TIMEOUT * 6)
        closed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closed
        assert not done, "an idle keep-alive connection was cut by the head clock"
        # ... and still served
        writer.write(request)
        assert await read_response(reader) == (200, b"ok")


async def test_a_head_begun_while_an_answer_waits_for_the_client_to_read_is_timed(
    slow: tuple[Slow, int],
) -> None:
    """A whole head, then the start of another, arrive while a large answer
    waits for the client to read it: the whole one is served, and the
    unfinished one is cut, not held until the keep-alive timeout."""
    _, port = slow
    request = b"GET / HTTP/1.1\r\nHost: slow\r\n\r\n"
    async with connection(port) as (reader, writer):
        writer.write(b"GET /big HTTP/1.1\r\nHost: slow\r\n\r\n")
        await reader.readexactly(1)  # the answer has begun ...
        await asyncio.sleep(HEAD_TIMEOUT)  # ... and filled the buffers
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(HEAD_TIMEOUT / 5)
        writer.write(request[:5])
        await writer.drain()
        async with asyncio.timeout(ANSWER_BOUND):
            head = await reader.readuntil(b"\r\n\r\n")
            assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == BIG
            await reader.readexactly(BIG)
        assert await read_response(reader) == (200, b"ok")
        async with asyncio.timeout(CLOSE_BOUND):
            assert await reader.read() == b"", "answered half a head"
