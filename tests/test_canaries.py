"""Canaries: the private parts of aiohttp, redis-py and asyncio that feedsvc reads.

Each test checks one private attribute still exists and still means what the
code that reads it assumes. A new release that changes one fails here, with
the attribute and the file that reads it named, rather than somewhere deep in
a 503 or a drain that never ends. pyproject.toml caps aiohttp and redis below
their next major version; before raising a cap, run this file against the
new version. (asyncio's come with Python, which has no cap.)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import platform
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc
from aiohttp import web, web_app
from aiohttp.streams import StreamReader
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler

from feedsvc.api.protocol import FeedAppRunner, JsonErrorRequestHandler
from feedsvc.embedded_redis.server import RedisServer


@contextlib.contextmanager
def canary(private: str, read_by: str, package: str) -> Iterator[None]:
    """Turn any sign that `private` changed into one loud, plain failure."""
    try:
        yield
    except (AttributeError, ImportError, TypeError, AssertionError, TimeoutError) as exc:
        if package == "python":
            found, allow = platform.python_version(), "running on this Python"
        else:
            found, allow = version(package), "allowing this version in pyproject.toml"
        pytest.fail(
            f"{package} {found} changed {private}, which {read_by} reads "
            f"({type(exc).__name__}: {exc}). Update {read_by} (and this canary) "
            f"before {allow}.",
            pytrace=False,
        )


# -- redis-py ----------------------------------------------------------------------


async def test_redis_connection_streams(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    conn = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    try:
        await conn.connect()
        with canary(
            "AbstractConnection._reader and ._writer (the connected socket's streams)",
            "feedsvc/storage/coalescer.py (_streams)",
            "redis",
        ):
            assert isinstance(conn._reader, asyncio.StreamReader), conn._reader
            assert isinstance(conn._writer, asyncio.StreamWriter), conn._writer
            conn._writer.write(b"*1\r\n$4\r\nPING\r\n")
            assert await asyncio.wait_for(conn._reader.readline(), 10) == b"+PONG\r\n"
    finally:
        await conn.disconnect()
        await client.aclose()


def test_redis_parse_error() -> None:
    # Error replies the coalescer hands back as values; the storage layer tells
    # them apart by these classes (NOSCRIPT reload, MOVED, 503s).
    expected = {
        "NOSCRIPT No matching script. Please use EVAL.": rexc.NoScriptError,
        "MOVED 3999 127.0.0.1:6381": rexc.MovedError,
        "ASK 3999 127.0.0.1:6381": rexc.AskError,
        "TRYAGAIN Multiple keys request during rehashing of slot": rexc.TryAgainError,
        "CLUSTERDOWN The cluster is down": rexc.ClusterDownError,
        "LOADING Redis is loading the dataset in memory": rexc.BusyLoadingError,
        "READONLY You can't write against a read only replica.": rexc.ReadOnlyError,
        "WRONGTYPE Operation against a key holding the wrong kind of value": rexc.ResponseError,
    }
    with canary(
        "redis._parsers.base.BaseParser.parse_error (error reply -> exception class)",
        "feedsvc/storage/coalescer.py (_reply_error)",
        "redis",
    ):
        from redis._parsers.base import BaseParser

        for message, kind in expected.items():
            error = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
            assert type(error) is kind, f"{message!r} became {type(error).__name__}"
            assert message.split(" ", 1)[1] in str(error)


def test_redis_cluster_nodes_manager() -> None:
    # Not private by name, but undocumented: the only part of RedisCluster that
    # nodes.py drives (read the slot table, find a slot's primary, follow MOVED).
    with canary(
        "NodesManager.initialize / get_node_from_slot / move_slot",
        "feedsvc/storage/nodes.py",
        "redis",
    ):
        from redis.asyncio.cluster import NodesManager

        assert inspect.iscoroutinefunction(NodesManager.initialize)
        assert inspect.iscoroutinefunction(NodesManager.move_slot)
        assert list(inspect.signature(NodesManager.move_slot).parameters)[:2] == ["self", "e"]
        assert "slot" in inspect.signature(NodesManager.get_node_from_slot).parameters


# -- asyncio -----------------------------------------------------------------------


async def test_semaphore_value() -> None:
    gate = asyncio.Semaphore(3)
    await gate.acquire()
    with canary(
        "asyncio.Semaphore._value (free slots)",
        "feedsvc/storage/gate.py (stats: pool_in_use)",
        "python",
    ):
        assert gate._value == 2


async def test_semaphore_waiters() -> None:
    gate = asyncio.Semaphore(0)
    waiting = [asyncio.create_task(gate.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    try:
        with canary(
            "asyncio.Semaphore._waiters (tasks waiting for a slot)",
            "feedsvc/storage/gate.py (stats: pool_waiting)",
            "python",
        ):
            assert len(gate._waiters or ()) == 2
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


# -- aiohttp -----------------------------------------------------------------------


@dataclass
class Served:
    runner: web.AppRunner
    port: int
    entered: asyncio.Event  # the slow handler runs
    release: asyncio.Event  # lets it answer

    def handler(self) -> RequestHandler:
        server = self.runner.server
        assert server is not None
        [handler] = server.connections
        return handler

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """An aiohttp server in this process: GET / answers at once, GET /slow when released."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def fast(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", fast)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = int(runner.addresses[0][1])
    try:
        yield Served(runner, port, entered, release)
    finally:
        release.set()
        await runner.cleanup()


async def until(condition: Callable[[], bool]) -> None:
    """Wait for the server side to get there; the bound only stops a hang."""
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 - the state is aiohttp's, no event to wait on
            await asyncio.sleep(0.01)


async def send(writer: asyncio.StreamWriter, path: str) -> None:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: canary\r\n\r\n".encode())
    await writer.drain()


async def answer(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readuntil(b"ok"), 10)


def has_connection(served: Served) -> Callable[[], bool]:
    return lambda: served.runner.server is not None and len(served.runner.server.connections) == 1


async def test_aiohttp_request_count(served: Served) -> None:
    reader, writer = await served.connect()
    try:
        with canary(
            "RequestHandler._request_count (request heads received on a connection)",
            "feedsvc/api/protocol.py (JsonErrorRequestHandler.data_received: the head clock)",
            "aiohttp",
        ):
            await until(has_connection(served))
            handler = served.handler()
            assert handler._request_count == 0
            writer.write(b"GET / HTTP/1.1\r\nHost: canary\r\n")  # half a head
            await asyncio.sleep(0.05)
            assert handler._request_count == 0, "counted before the head was complete"
            writer.write(b"\r\n")
            await answer(reader)
            assert handler._request_count == 1
    finally:
        writer.close()


async def test_aiohttp_messages(served: Served) -> None:
    reader, writer = await served.connect()
    try:
        with canary(
            "RequestHandler._messages (parsed (message, payload) pairs, the last one "
            "appended as its head is parsed; the payload is at EOF once its body is in)",
            "feedsvc/api/protocol.py (JsonErrorRequestHandler.data_received: the head clock)",
            "aiohttp",
        ):
            await until(has_connection(served))
            handler = served.handler()
            await send(writer, "/slow")  # keeps the next request queued
            await asyncio.wait_for(served.entered.wait(), 10)
            writer.write(b"POST / HTTP/1.1\r\nHost: canary\r\nContent-Length: 3\r\n\r\na")
            await until(lambda: len(handler._messages) == 1)
            message, payload = handler._messages[-1]
            assert getattr(message, "path", None) == "/", message
            assert isinstance(payload, StreamReader), payload
            assert not payload.is_eof(), "a body at EOF before it was sent"
            writer.write(b"bc")
            await until(payload.is_eof)
            served.release.set()
            await answer(reader)
    finally:
        writer.close()


async def test_aiohttp_waiter(served: Served) -> None:
    reader, writer = await served.connect()
    try:
        with canary(
            "RequestHandler._waiter (set, not done, while waiting for a request head)",
            "feedsvc/process/drain.py (is_idle), feedsvc/api/protocol.py (_head_check)",
            "aiohttp",
        ):
            await until(has_connection(served))
            handler = served.handler()

            def idle() -> bool:
                waiter: Any = handler._waiter
                return waiter is not None and not waiter.done()

            await until(idle)
            await send(writer, "/slow")
            await asyncio.wait_for(served.entered.wait(), 10)
            assert not idle(), "looks idle while its request runs"
            served.release.set()
            await answer(reader)
            await until(idle)  # keep-alive: waiting for the next head again
    finally:
        writer.close()


async def test_aiohttp_request_in_progress(served: Served) -> None:
    reader, writer = await served.connect()
    try:
        with canary(
            "RequestHandler._request_in_progress (a request is being handled)",
            "feedsvc/process/drain.py (has_request)",
            "aiohttp",
        ):
            await until(has_connection(served))
            handler = served.handler()
            assert handler._request_in_progress is False
            await send(writer, "/slow")
            await asyncio.wait_for(served.entered.wait(), 10)
            assert handler._request_in_progress is True
            served.release.set()
            await answer(reader)
            await until(lambda: handler._request_in_progress is False)
    finally:
        writer.close()


async def test_aiohttp_current_request(served: Served) -> None:
    reader, writer = await served.connect()
    try:
        with canary(
            "RequestHandler._current_request (the request being handled, if any)",
            "feedsvc/api/protocol.py (connection_lost: on_hang_up)",
            "aiohttp",
        ):
            await until(has_connection(served))
            handler = served.handler()
            assert handler._current_request is None
            await send(writer, "/slow")
            await asyncio.wait_for(served.entered.wait(), 10)
            assert isinstance(handler._current_request, web.BaseRequest)
            assert handler._current_request.path == "/slow"
            served.release.set()
            await answer(reader)
            await until(lambda: handler._current_request is None)
    finally:
        writer.close()


async def test_aiohttp_request_handler_class() -> None:
    app = web.Application()
    runner = FeedAppRunner(app, handle_signals=False, keepalive_timeout=12.5)
    try:
        with canary(
            "AppRunner._make_server, Server._loop and ._kwargs (which make each connection's "
            "RequestHandler), RequestHandler.handle_error (which answers a request that "
            "could not be parsed) and .finish_response (which sends each response)",
            "feedsvc/api/protocol.py (FeedAppRunner, JsonErrorRequestHandler)",
            "aiohttp",
        ):
            # FeedAppRunner rebuilds the server from exactly these
            assert list(inspect.signature(web.Server.__init__).parameters) == [
                "self", "handler", "request_factory", "handler_cancellation", "loop", "kwargs"
            ]  # fmt: skip
            assert list(inspect.signature(RequestHandler.handle_error).parameters) == [
                "self", "request", "status", "exc", "message"
            ]  # fmt: skip
            # the head clock restarts when a response has been sent
            assert inspect.iscoroutinefunction(RequestHandler.finish_response)
            assert list(inspect.signature(RequestHandler.finish_response).parameters) == [
                "self", "request", "resp", "start_time"
            ]  # fmt: skip
            await runner.setup()
            server = runner.server
            assert server is not None
            assert server._kwargs["keepalive_timeout"] == 12.5
            assert isinstance(server._loop, asyncio.AbstractEventLoop)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
            try:
                await until(lambda: len(server.connections) == 1)
                [handler] = server.connections
                writer.write(b"FOO / HTTP/1.1\r\nHost: canary\r\n\r\n")
                assert isinstance(handler, JsonErrorRequestHandler), type(handler)
                answer = await asyncio.wait_for(reader.read(), 10)
            finally:
                writer.close()
            assert answer.startswith(b"HTTP/1.0 400 "), answer
            assert b"Content-Type: application/json" in answer, answer
    finally:
        await runner.cleanup()


async def test_aiohttp_stream_writer_write_without_drain() -> None:
    """The writer prepare() returns takes drain=False and then never waits,
    even past its 64 KiB drain mark with the transport paused: the tail
    writes caught-up streams' events from its own task with it."""
    events: list[str] = []

    class Paused(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.written = 0

        def write(self, data: Any) -> None:
            self.written += len(data)

        def is_closing(self) -> bool:
            return False

    class Protocol:
        transport = Paused()
        _paused = True  # a drain would wait forever

        async def _drain_helper(self) -> None:
            events.append("drained")
            await asyncio.Event().wait()

    with canary(
        "StreamWriter.write(drain=False) (write without waiting for the client)",
        "feedsvc/api/streams.py (Stream._send)",
        "aiohttp",
    ):
        from aiohttp.http_writer import StreamWriter

        writer = StreamWriter(Protocol(), asyncio.get_running_loop())  # type: ignore[arg-type]
        async with asyncio.timeout(5):
            for _ in range(40):
                await writer.write(b"x" * 4096, drain=False)
        assert events == [], "write(drain=False) drained"
        assert Protocol.transport.written == 40 * 4096


async def test_aiohttp_middleware_handler_cache() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def passing(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request)

    app = web.Application(middlewares=[passing])
    app.router.add_get("/", ok)
    with canary(
        "web_app._cached_build_middleware (an lru_cache of each handler wrapped in its "
        "app's middlewares, keyed by the handler and the apps, so it keeps them alive)",
        "tests/conftest.py (pytest_runtest_teardown empties it after every test)",
        "aiohttp",
    ):
        cached = web_app._cached_build_middleware
        cached.cache_clear()
        async with TestClient(TestServer(app)) as client:
            assert (await client.get("/")).status == 200
        assert cached.cache_info().currsize == 1
        cached.cache_clear()
        assert cached.cache_info().currsize == 0
