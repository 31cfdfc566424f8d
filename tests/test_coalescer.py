"""The coalescer (auto-pipelining) against a real Redis: every caller gets its
own replies, errors stay with their caller, order is kept, and callers that
give up break nothing."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.storage.coalescer import (
    EARLY_CALLS,
    EARLY_WRITE,
    MIN_EARLY_CALLS,
    BatchCap,
    Coalescer,
    CoalescerBusy,
)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(redis_url, max_connections=8)
    yield redis
    await redis.aclose()


@pytest.fixture
async def coalescer(client: aioredis.Redis) -> AsyncIterator[Coalescer]:
    # the batch cap held at EARLY_CALLS: the early-write tests count on it
    # (BatchCap's own tests are below)
    made = Coalescer(client.connection_pool.make_connection, 5.0, cap_window=math.inf)
    yield made
    await made.close()


def prefix() -> str:
    return "coalesce-test:" + uuid.uuid4().hex + ":"


async def test_each_caller_gets_its_own_replies(coalescer: Coalescer) -> None:
    p = prefix()

    async def call(i: int) -> list[object]:
        return await coalescer.submit([("INCRBY", f"{p}{i}", i), ("GET", f"{p}{i}")])

    results = await asyncio.gather(*(call(i) for i in range(600)))
    assert results == [[i, str(i).encode()] for i in range(600)]
    assert coalescer.calls == 600
    assert coalescer.batches < 600, "concurrent calls were not coalesced"


async def test_a_large_call_is_written_at_once_with_what_came_before_it(
    coalescer: Coalescer,
) -> None:
    """A call of EARLY_WRITE commands or more (a big post) is written when it
    is submitted, with the calls of the same loop turn before it, in order:
    Redis starts on it while the loop is still busy (parsing the next big
    body) instead of after the turn. Small calls still wait for the turn."""
    p = prefix()
    await coalescer.submit([("PING",)])  # connected
    written = coalescer.batches
    small = coalescer.submit([("SET", p + "k", "before")])
    assert coalescer.batches == written  # a small call waits for the turn
    big = coalescer.submit([("APPEND", p + "k", "+")] * EARLY_WRITE)
    assert coalescer.batches == written + 1  # written with the small one, no await between
    after = coalescer.submit([("GET", p + "k")])
    assert await small == [b"OK"]
    assert (await big)[-1] == len("before") + EARLY_WRITE
    assert await after == [b"before" + b"+" * EARLY_WRITE]


async def test_a_full_batch_is_written_without_waiting_for_the_turn(
    client: aioredis.Redis, coalescer: Coalescer
) -> None:
    """Once EARLY_CALLS calls are pending they are written at once (Redis
    starts on them while the loop still handles the turn's other requests);
    the turn's later calls make the next batch, written after them, so every
    caller still gets its own replies in order."""
    key = prefix() + "list"
    await coalescer.submit([("PING",)])  # connected
    written = coalescer.batches
    first = [coalescer.submit([("RPUSH", key, i)]) for i in range(EARLY_CALLS - 1)]
    assert coalescer.batches == written  # not yet: fewer than EARLY_CALLS pending
    first.append(coalescer.submit([("RPUSH", key, EARLY_CALLS - 1)]))
    assert coalescer.batches == written + 1  # written within the turn, no await between
    rest = [coalescer.submit([("RPUSH", key, i)]) for i in range(EARLY_CALLS, EARLY_CALLS + 5)]
    assert coalescer.batches == written + 1  # the rest wait for the end of the turn
    replies = await asyncio.gather(*first, *rest)
    assert coalescer.batches == written + 2
    assert replies == [[i + 1] for i in range(EARLY_CALLS + 5)]
    assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(EARLY_CALLS + 5)]


def test_the_batch_cap_is_half_the_most_calls_in_flight_lately() -> None:
    """BatchCap: half the most calls in flight over the last window, within
    MIN_EARLY_CALLS..EARLY_CALLS; each window starts from nothing, a rise
    raises the cap at once, and a quiet spell forgets what came before it."""
    cap = BatchCap(1.0)
    assert cap.calls == EARLY_CALLS  # until the first call
    now = 5000.0  # loop time counts from boot, not from 0
    cap.observe(0, now)  # the first call, with nothing in flight
    assert cap.calls == MIN_EARLY_CALLS
    cap.observe(63, now + 0.5)
    assert cap.calls == 32  # a rise is followed at once, within the window
    cap.observe(0, now + 1.0)  # the first window ends: 63 at most
    assert cap.calls == 32
    for in_flight in (5, 31, 12):
        cap.observe(in_flight, now + 1.5)
    assert cap.calls == 32  # a window lasts its second
    cap.observe(0, now + 2.0)
    assert cap.calls == 16  # the 63 of the window before is forgotten
    cap.observe(3, now + 3.0)
    assert cap.calls == MIN_EARLY_CALLS  # (not 2)
    cap.observe(40, now + 3.2)
    assert cap.calls == 20
    cap.observe(900, now + 4.0)  # ends the window begun at +3.0, which it belongs to
    assert cap.calls == EARLY_CALLS  # (not 450)
    cap.observe(60, now + 4.5)
    cap.observe(1, now + 60.0)  # after a quiet minute: the 60 says nothing
    assert cap.calls == MIN_EARLY_CALLS
    held = BatchCap(math.inf)
    for in_flight, at in ((0, now), (2, now + 1e9)):
        held.observe(in_flight, at)
        assert held.calls == EARLY_CALLS


async def test_with_few_calls_in_flight_a_smaller_batch_is_written_early(
    client: aioredis.Redis,
) -> None:
    """With 16 calls in flight (16 clients, say), the cap is 8: a turn's
    first 8 calls go to Redis while the process handles the next 8, instead
    of all 16 at the end of the turn (the cap of EARLY_CALLS would wait)."""
    key = prefix() + "list"
    coalescer = Coalescer(client.connection_pool.make_connection, 5.0, cap_window=0.0)
    try:
        await coalescer.submit([("PING",)])  # connected
        written = coalescer.batches
        first = [coalescer.submit([("RPUSH", key, i)]) for i in range(MIN_EARLY_CALLS - 1)]
        assert coalescer.batches == written
        first.append(coalescer.submit([("RPUSH", key, MIN_EARLY_CALLS - 1)]))
        assert coalescer.batches == written + 1  # 8 pending of 8 in flight: written
        rest = [coalescer.submit([("RPUSH", key, i)]) for i in range(MIN_EARLY_CALLS, 16)]
        assert coalescer.batches == written + 2  # and the next 8, within the turn
        replies = await asyncio.gather(*first, *rest)
        assert replies == [[i + 1] for i in range(16)]
        assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(16)]
    finally:
        await coalescer.close()


async def test_error_replies_stay_with_their_caller(
    client: aioredis.Redis, coalescer: Coalescer
) -> None:
    p = prefix()
    await client.set(p + "string", "x")
    good = [coalescer.submit([("SET", f"{p}{i}", i), ("GET", f"{p}{i}")]) for i in range(20)]
    bad = coalescer.submit([("HSET", p + "string", "f", "v"), ("GET", p + "string")])
    unknown = coalescer.submit([("EVALSHA", "0" * 40, 0)])
    *oks, wrong, noscript = await asyncio.gather(*good, bad, unknown)
    assert oks == [[b"OK", str(i).encode()] for i in range(20)]
    assert isinstance(wrong[0], ResponseError) and wrong[1] == b"x"
    assert isinstance(noscript[0], ResponseError)


async def test_a_command_that_cannot_be_encoded_fails_only_its_caller(
    coalescer: Coalescer,
) -> None:
    """An argument Redis cannot take (a bug of the caller's) is that caller's
    error at once: the calls batched with it, before and after, get their
    replies, and the connection goes on."""
    p = prefix()
    before = [coalescer.submit([("SET", f"{p}{i}", i)]) for i in range(5)]
    bad = coalescer.submit([("SET", p + "bad", object())])
    after = [coalescer.submit([("GET", f"{p}{i}")]) for i in range(5)]
    async with asyncio.timeout(5):
        assert await asyncio.gather(*before) == [[b"OK"]] * 5
        with pytest.raises(TypeError):
            await bad
        assert await asyncio.gather(*after) == [[str(i).encode()] for i in range(5)]
        assert await coalescer.submit([("PING",)]) == [b"PONG"]


async def test_order_is_kept(client: aioredis.Redis, coalescer: Coalescer) -> None:
    # one connection: batches in the order formed, calls within a batch in call order
    key = prefix() + "list"
    await asyncio.gather(*(coalescer.submit([("RPUSH", key, i)]) for i in range(300)))
    assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(300)]

    # a caller that awaits each call sees its calls applied in order, whatever
    # else is in flight
    wide = coalescer
    ordered = prefix() + "ordered"

    async def sequential() -> None:
        for i in range(100):
            await wide.submit([("RPUSH", ordered, i)])

    async def noise(n: int) -> None:
        for i in range(100):
            await wide.submit([("SET", f"{ordered}:{n}", i)])

    await asyncio.gather(sequential(), *(noise(n) for n in range(10)))
    assert await client.lrange(ordered, 0, -1) == [str(i).encode() for i in range(100)]


async def test_cancelled_callers_break_nothing(coalescer: Coalescer) -> None:
    p = prefix()
    tasks = [coalescer.submit([("SET", f"{p}{i}", i), ("GET", f"{p}{i}")]) for i in range(300)]
    for i, task in enumerate(tasks):
        if i % 3 == 0:
            task.cancel()
    await asyncio.sleep(0)
    for i, task in enumerate(tasks):
        if i % 3 == 1:
            task.cancel()  # some of these were already sent
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(done):
        if i % 3 == 2:
            assert result == [b"OK", str(i).encode()]
        else:
            assert isinstance(result, asyncio.CancelledError | list)
    # the coalescer still works and its replies are still in step
    assert await coalescer.submit([("PING",), ("GET", f"{p}2")]) == [b"PONG", b"2"]


@pytest.mark.process  # a redis-server of its own
async def test_connection_failure_fails_the_batch_then_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    redis = aioredis.Redis.from_url(server.url, socket_connect_timeout=1, socket_timeout=2)
    try:
        coalescer = Coalescer(redis.connection_pool.make_connection, 2.0)
        assert await coalescer.submit([("SET", "k", 1)]) == [b"OK"]
        server.stop()
        outcomes = await asyncio.gather(
            *(coalescer.submit([("GET", "k")]) for _ in range(20)), return_exceptions=True
        )
        assert all(isinstance(o, RedisConnectionError | OSError) for o in outcomes), outcomes
        server.start()
        assert await coalescer.submit([("SET", "k", 2), ("GET", "k")]) == [b"OK", b"2"]
        await coalescer.close()
    finally:
        await redis.aclose()
        server.stop()


# -- bounded work, back-pressure and the reply deadline -------------------------------


async def wait_until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Poll until condition holds; the bound only keeps a broken test from hanging."""
    async with asyncio.timeout(10):
        while not await condition():  # noqa: ASYNC110 - the state is in Redis
            await asyncio.sleep(0.01)


async def blocked_clients(client: aioredis.Redis) -> int:
    return int((await client.info("clients"))["blocked_clients"])


async def test_calls_beyond_the_bound_wait_for_room(client: aioredis.Redis) -> None:
    p = prefix()
    coalescer = Coalescer(client.connection_pool.make_connection, 30.0, max_in_flight=3)
    try:
        # BLPOP holds the connection: Redis runs nothing behind it until the list gets an item
        blocking = coalescer.submit([("BLPOP", p + "gate", 0)])
        behind = [coalescer.submit([("INCR", p + "n")]) for _ in range(2)]
        extra = coalescer.submit([("INCR", p + "n")])
        assert (coalescer.in_flight, coalescer.waiting_for_room) == (3, 1)

        async def blocked() -> bool:
            return await blocked_clients(client) > 0

        await wait_until(blocked)
        assert coalescer.calls == 3, "the call beyond the bound was written"
        assert not extra.done()

        await client.lpush(p + "gate", "go")
        assert await blocking == [[(p + "gate").encode(), b"go"]]
        assert [await f for f in behind] == [[1], [2]]
        assert await extra == [3]
        assert coalescer.calls == 4
        assert (coalescer.in_flight, coalescer.waiting_for_room) == (0, 0)
    finally:
        await coalescer.close()


async def test_no_room_in_time_is_coalescer_busy(client: aioredis.Redis) -> None:
    p = prefix()
    make = client.connection_pool.make_connection
    coalescer = Coalescer(make, 30.0, max_in_flight=1, room_timeout=0.1)
    try:
        blocking = coalescer.submit([("BLPOP", p + "gate", 0)])
        refused = coalescer.submit([("SET", p + "refused", 1)])
        with pytest.raises(CoalescerBusy) as busy:
            await asyncio.wait_for(refused, 10)
        # a ConnectionError, so the store's translation makes it a 503 with Retry-After
        assert isinstance(busy.value, RedisConnectionError)
        assert coalescer.refused == 1
        assert not blocking.done()
        assert (coalescer.in_flight, coalescer.waiting_for_room) == (1, 0)

        await client.lpush(p + "gate", "go")
        assert await blocking == [[(p + "gate").encode(), b"go"]]
        assert await coalescer.submit([("EXISTS", p + "refused")]) == [0]
        assert coalescer.calls == 2
    finally:
        await coalescer.close()


async def test_a_caller_that_gives_up_waiting_for_room_is_never_sent(
    client: aioredis.Redis,
) -> None:
    p = prefix()
    coalescer = Coalescer(client.connection_pool.make_connection, 30.0, max_in_flight=1)
    try:
        blocking = coalescer.submit([("BLPOP", p + "gate", 0)])
        gone = coalescer.submit([("SET", p + "gone", 1)])
        kept = coalescer.submit([("SET", p + "kept", 1)])
        gone.cancel()
        assert coalescer.waiting_for_room == 1
        await client.lpush(p + "gate", "go")
        await blocking
        assert await kept == [b"OK"]
        assert await client.exists(p + "gone", p + "kept") == 1
        assert coalescer.calls == 2
        assert coalescer.in_flight == 0
    finally:
        await coalescer.close()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, which it may stop (SIGSTOP) and resume."""
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    try:
        yield server
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def freeze(server: RedisServer) -> None:
    """Stop the server's process: it accepts TCP connections (the kernel does) and
    buffers what it is sent, but reads and answers nothing until thaw()."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)


def thaw(server: RedisServer) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def connected(server: RedisServer) -> AsyncIterator[tuple[Coalescer, aioredis.Redis]]:
    """A coalescer connected to server, which the test may freeze, and a
    client of the server; at the end the server is thawed, both closed."""
    redis = aioredis.Redis.from_url(server.url)
    coalescer = Coalescer(redis.connection_pool.make_connection, 60.0, cap_window=math.inf)
    try:
        assert await coalescer.submit([("PING",)]) == [b"PONG"]
        yield coalescer, redis
    finally:
        thaw(server)
        await coalescer.close()
        await redis.aclose()


@pytest.mark.process  # a redis-server of its own
async def test_a_slow_redis_pushes_back_on_writes(own_server: RedisServer) -> None:
    value = b"x" * (1 << 20)
    count = 64  # 64 MiB: far more than the kernel's socket buffers hold
    async with connected(own_server) as (coalescer, redis):
        freeze(own_server)
        futures = []
        for i in range(count):
            futures.append(coalescer.submit([("SET", f"big:{i}", value)]))
            await asyncio.sleep(0)  # let the flusher write what it will between calls
        assert coalescer.drain_waits >= 1
        written = coalescer.calls - 1
        assert written < count, "every call was written into the buffer of a stalled Redis"
        assert coalescer.in_flight == count
        thaw(own_server)
        async with asyncio.timeout(30):
            assert [await f for f in futures] == [[b"OK"]] * count
        assert coalescer.calls == count + 1
        assert await redis.dbsize() == count


@pytest.mark.process  # a redis-server of its own
async def test_nothing_is_written_early_while_the_flusher_waits_for_the_buffer(
    own_server: RedisServer,
) -> None:
    """While the flusher waits for the write buffer to drain, a full batch
    (EARLY_CALLS calls) waits too: written at once, batches could keep the
    buffer from ever draining and the flusher would give up on the
    connection. The high-water mark is raised once the flusher waits, so
    that the buffer is below it and only the wait holds the batch back."""
    value = b"x" * (1 << 20)
    async with connected(own_server) as (coalescer, _):
        freeze(own_server)
        futures: list[asyncio.Future[list[object]]] = []
        while coalescer.drain_waits == 0:
            futures.append(coalescer.submit([("SET", f"big:{len(futures)}", value)]))
            await asyncio.sleep(0)
            assert len(futures) < 256, "the flusher never waited for the buffer"
        transport = coalescer._writer.transport  # type: ignore[union-attr]
        transport.set_write_buffer_limits(high=transport.get_write_buffer_size() + (1 << 30))
        written = coalescer.calls
        small = [coalescer.submit([("INCR", "small")]) for _ in range(EARLY_CALLS)]
        await asyncio.sleep(0)
        assert coalescer.calls == written, "a batch was written while the flusher waited"
        thaw(own_server)
        async with asyncio.timeout(30):
            assert [await f for f in futures] == [[b"OK"]] * len(futures)
            assert [await f for f in small] == [[i + 1] for i in range(EARLY_CALLS)]
        assert coalescer.in_flight == 0


def on_uvloop(redis_url: str, scenario: Callable[[Coalescer], Awaitable[None]]) -> None:
    """Run scenario with a connected coalescer on uvloop, as the service runs
    (its write() raises on a closed transport, where asyncio's lets it pass)."""

    async def main() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        coalescer = Coalescer(redis.connection_pool.make_connection, 5.0, cap_window=math.inf)
        try:
            assert await coalescer.submit([("PING",)]) == [b"PONG"]
            await scenario(coalescer)
        finally:
            await coalescer.close()
            await redis.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def test_a_call_pending_when_the_connection_is_lost_goes_on_the_next_one(
    redis_url: str,
) -> None:
    """The flusher does not write on a connection lost since the call was
    submitted (the flusher would die with the call unanswered): it waits
    for the reader to let go of it, and connects anew."""

    async def scenario(coalescer: Coalescer) -> None:
        future = coalescer.submit([("ECHO", "after")])
        coalescer.drop_connection()  # in the same turn, before the flusher runs
        async with asyncio.timeout(10):
            assert await future == [b"after"]
        assert coalescer.in_flight == 0

    on_uvloop(redis_url, scenario)


def test_a_full_batch_after_a_lost_connection_waits_for_the_next_one(redis_url: str) -> None:
    """A full batch submitted after the connection was lost and before its
    reader noticed goes on the next connection: it does not raise out of
    submit() nor leave calls counted in flight."""

    async def scenario(coalescer: Coalescer) -> None:
        coalescer.drop_connection()  # as a failover does (Node.reconnect)
        await asyncio.sleep(0)
        futures = [coalescer.submit([("ECHO", i)]) for i in range(EARLY_CALLS)]
        async with asyncio.timeout(10):
            replies = await asyncio.gather(*futures)
        assert replies == [[str(i).encode()] for i in range(EARLY_CALLS)]
        assert coalescer.in_flight == 0

    on_uvloop(redis_url, scenario)


@pytest.mark.process  # a redis-server of its own
async def test_a_full_batch_waits_while_the_write_buffer_is_above_its_mark(
    own_server: RedisServer,
) -> None:
    """A batch full early is not written while the write buffer is above its
    high-water mark, even before the flusher has started to wait for it."""
    value = b"x" * (1 << 20)
    async with connected(own_server) as (coalescer, _):
        freeze(own_server)
        # 32 MiB in one early write: far more than the kernel's socket buffers take
        big = [coalescer.submit([("SET", f"big:{i}", value)]) for i in range(EARLY_CALLS)]
        written = coalescer.calls
        assert written == 1 + EARLY_CALLS
        small = [coalescer.submit([("INCR", "small")]) for _ in range(EARLY_CALLS)]
        assert coalescer.calls == written, "a batch was written above the high-water mark"
        thaw(own_server)
        async with asyncio.timeout(30):
            assert [await f for f in big] == [[b"OK"]] * EARLY_CALLS
            assert [await f for f in small] == [[i + 1] for i in range(EARLY_CALLS)]
        assert coalescer.in_flight == 0


@pytest.mark.process  # a redis-server of its own
async def test_time_spent_connecting_counts_against_the_reply_timeout(
    own_server: RedisServer,
) -> None:
    # redis-py's own timeouts far beyond the coalescer's: its deadline must cut the connect short
    redis = aioredis.Redis.from_url(own_server.url, socket_connect_timeout=60, socket_timeout=60)
    coalescer = Coalescer(redis.connection_pool.make_connection, 0.5)
    try:
        freeze(own_server)  # the connection opens, but its handshake gets no answer
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(coalescer.submit([("SET", "k", 1)]), 10)
        assert coalescer.calls == 0, "a call was written after its time ran out"
        assert coalescer.in_flight == 0
        thaw(own_server)
        assert await coalescer.submit([("SET", "k", 2), ("GET", "k")]) == [b"OK", b"2"]
    finally:
        thaw(own_server)
        await coalescer.close()
        await redis.aclose()


@pytest.mark.process  # a redis-server of its own
async def test_overdue_replies_fail_in_the_order_the_calls_were_made(
    own_server: RedisServer,
) -> None:
    """Each call's time counts from its own submit, whatever the reader did before.

    The earlier reader waited in windows of reply_timeout, a new one after
    every chunk it read (or every empty window), and failed a call only at
    the end of a window in which it had waited the whole timeout: a call
    written late in a window waited up to twice the timeout (a lua POST got
    its 503 after 8.6 s under --redis-timeout 5). Here ``later`` is written
    0.7 of a window after its connection's last reply and ``earlier`` 0.1
    after its own, so with that bug ``later`` failed first, though made last.
    """
    redis = aioredis.Redis.from_url(own_server.url)
    first = Coalescer(redis.connection_pool.make_connection, 1.0)
    second = Coalescer(redis.connection_pool.make_connection, 1.0)
    order: list[str] = []
    try:
        assert await first.submit([("PING",)]) == [b"PONG"]
        await asyncio.sleep(0.6)
        assert await second.submit([("PING",)]) == [b"PONG"]
        await asyncio.sleep(0.1)
        freeze(own_server)
        earlier = second.submit([("PING",)])
        earlier.add_done_callback(lambda _: order.append("earlier"))
        await asyncio.sleep(0.01)
        later = first.submit([("PING",)])
        later.add_done_callback(lambda _: order.append("later"))
        for future in (earlier, later):
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(future, 10)
        assert order == ["earlier", "later"]
        assert (first.in_flight, second.in_flight) == (0, 0)
        thaw(own_server)
        assert await first.submit([("PING",)]) == [b"PONG"]
        assert await second.submit([("PING",)]) == [b"PONG"]
    finally:
        thaw(own_server)
        await first.close()
        await second.close()
        await redis.aclose()
