"""A serving process set up for many clients (:mod:`feedsvc.process.setup`).

Its soft open files limit is raised to the hard one, so a service started
with a low one (1,024 is common) still serves more clients than that.

Many connections do not make the cycle collector walk the whole heap:
aiohttp keeps a connection's last request and response (and the objects
they hold) alive until its next request arrives. With thousands of
keep-alive clients each request so leaves a few dozen objects that outlive
the collector's young generations; Python's default thresholds then make it
collect the oldest generation, every object of the process, every few
thousand requests: pauses of tens to hundreds of milliseconds that stopped
every request at once (see :mod:`feedsvc.process.setup`). The test holds many
connections, sends requests round them and reads, from ``/metrics``, how
often the oldest generation was collected meanwhile: never, with feedsvc's
thresholds; several times with Python's.

A burst of clients connecting at once all get in at the first try: the
listening socket's backlog is the one feedsvc asks for, not the event loop's
default of 128 (which create_server() set again on the bound socket).
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import selectors
import signal
import socket
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from feedsvc.process.setup import YOUNG_EVERY, YOUNG_EVERY_IDLE, YoungCollections
from feedsvc.testing import ServiceProcess
from tests.test_metrics import sample

#: Keep-alive clients held open: each keeps its last request's objects alive.
CLIENTS = 1000
#: Requests sent round the clients (CLIENTS at a time).
ROUNDS = 20


#: A soft open files limit the service is started with, below CLIENTS.
LOW_LIMIT = 256


def metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sample(text, name, **labels)


def full_collections(url: str) -> float:
    return metric(url, "python_gc_collections_total", generation="2")


def allow_clients() -> None:
    """This process (the clients' side) may open CLIENTS connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < CLIENTS + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, CLIENTS + 200), hard))


async def _post(stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], n: int) -> int:
    reader, writer = stream
    body = b'{"messages":[{"ttl":300,"body":{"n":1}}]}'
    writer.write(
        f"POST /v2/queues/heap{n % 50}/messages HTTP/1.1\r\nHost: t\r\n"
        f"Client-ID: {uuid.UUID(int=n)}\r\nX-Project-ID: heap\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def _load(host: str, port: int, rounds: int) -> list[int]:
    """The statuses of rounds x CLIENTS posts, CLIENTS connections at a time."""
    streams = [await asyncio.open_connection(host, port) for _ in range(CLIENTS)]
    try:
        statuses: list[int] = []
        for _ in range(rounds):
            async with asyncio.timeout(60):  # a refused client fails, not hangs
                statuses += await asyncio.gather(*(_post(s, i) for i, s in enumerate(streams)))
        return statuses
    finally:
        for _, writer in streams:
            writer.close()


@pytest.mark.process
def test_a_low_open_files_limit_is_raised_to_serve_more_clients(
    redis_url: str, tmp_path: Path
) -> None:
    allow_clients()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < CLIENTS + 200:
        pytest.skip(f"the hard open files limit here is {hard}")
    # python -m feedsvc serve, started with a soft limit of LOW_LIMIT
    low_start = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({LOW_LIMIT}, {hard})); "
        "sys.argv = ['feedsvc', *sys.argv[1:]]; "
        "runpy.run_module('feedsvc', run_name='__main__')"
    )
    command = [sys.executable, "-c", low_start, "serve"]
    with ServiceProcess(
        "--redis-url", redis_url, command=command, log_path=tmp_path / "serve.log"
    ) as svc:
        assert metric(svc.url, "process_max_fds") == hard
        statuses = asyncio.run(_load(svc.host, svc.port, rounds=1))
    assert statuses == [201] * CLIENTS


@pytest.mark.process
def test_many_keep_alive_clients_cause_no_full_collection(redis_url: str, tmp_path: Path) -> None:
    allow_clients()
    with ServiceProcess("--redis-url", redis_url, log_path=tmp_path / "serve.log") as svc:
        before = full_collections(svc.url)
        statuses = asyncio.run(_load(svc.host, svc.port, ROUNDS))
        after = full_collections(svc.url)
    assert statuses == [201] * (CLIENTS * ROUNDS)
    assert after - before == 0


#: Clients that connect at once (a restart, a load balancer's reconnects).
BURST = 1000


def _handshakes_done(clients: list[socket.socket]) -> list[socket.socket]:
    """The clients whose connect completed within half a second: a
    handshake on loopback takes microseconds, a dropped SYN is sent again
    only after one second."""
    done: list[socket.socket] = []
    with selectors.DefaultSelector() as selector:
        for client in clients:
            selector.register(client, selectors.EVENT_WRITE)
        deadline = time.monotonic() + 0.5
        while len(done) < len(clients) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                selector.unregister(key.fileobj)
                done.append(key.fileobj)  # type: ignore[arg-type]
    return done


@pytest.mark.process
def test_a_burst_of_clients_connecting_while_the_service_is_busy_all_get_in(
    redis_url: str, tmp_path: Path
) -> None:
    """The kernel completes handshakes and queues them until the service
    accepts, as many as the listening socket's backlog; a client beyond it
    has its SYN dropped and tries again after a second, then three. The
    service is stopped while BURST clients connect (as a busy event loop
    accepts nothing); every one of them must complete its handshake at the
    first attempt, well before the kernel's first retry."""
    allow_clients()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if somaxconn < BURST:
        pytest.skip(f"net.core.somaxconn is {somaxconn} here")
    with ServiceProcess("--redis-url", redis_url, log_path=tmp_path / "serve.log") as svc:
        os.kill(svc.pid, signal.SIGSTOP)
        clients: list[socket.socket] = []
        try:
            for _ in range(BURST):
                client = socket.socket()
                client.setblocking(False)
                client.connect_ex((svc.host, svc.port))
                clients.append(client)
            connected = _handshakes_done(clients)
            refused = [c for c in connected if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)]
        finally:
            os.kill(svc.pid, signal.SIGCONT)
            for client in clients:
                client.close()
    assert (len(connected), refused) == (BURST, [])


# -- the young generations on a clock (process_setup.YoungCollections) ----------

#: Keep-alive connections simulated: each keeps its last request's objects.
HELD = 2000


def _young() -> int:
    return len(gc.get_objects(0))


#: Objects (the collector tracks) a request makes and its connection keeps.
MADE = 11


def _requests(held: list[list[list[int]]], count: int) -> None:
    """count requests round the held connections: each makes its MADE
    objects and frees the previous request's, as aiohttp's connections do."""
    for n in range(count):
        held[n % HELD] = [[n] for _ in range(MADE - 1)]


@pytest.fixture
def held() -> Iterator[list[list[list[int]]]]:
    """HELD connections' objects, made and moved out of the young generations."""
    objects: list[list[list[int]]] = [[] for _ in range(HELD)]
    _requests(objects, HELD)
    gc.collect()
    yield objects
    gc.collect()


@pytest.fixture
def clock() -> Iterator[YoungCollections]:
    """A clock of young collections (ticked by hand here)."""
    loop = asyncio.new_event_loop()
    yield YoungCollections(loop, lambda: 0)
    loop.close()


def test_requests_that_free_as_much_as_they_make_grow_the_young_generation_uncollected(
    held: list[list[list[int]]],
) -> None:
    """Why the clock: Python's count is net, so it never fires here."""
    before = sum(s["collections"] for s in gc.get_stats())
    _requests(held, 10 * HELD)
    assert sum(s["collections"] for s in gc.get_stats()) == before
    # every held object is young: made since, and never collected
    assert _young() >= HELD * MADE


def test_a_tick_collects_the_young_generation_python_left(
    held: list[list[list[int]]], clock: YoungCollections
) -> None:
    _requests(held, 10 * HELD)
    clock.collect()
    assert _young() < HELD


def test_a_tick_after_a_collection_of_pythons_own_collects_nothing(
    held: list[list[list[int]]], clock: YoungCollections
) -> None:
    gc.collect(0)  # Python collected since the last tick
    _requests(held, HELD)
    clock.collect()
    assert _young() >= HELD * MADE
    clock.collect()  # and the next tick does
    assert _young() < HELD


def test_a_tick_collects_the_middle_generation_when_python_would(
    held: list[list[list[int]]], clock: YoungCollections
) -> None:
    middle = gc.get_threshold()[1]
    collected = gc.get_stats()[1]["collections"]
    ticks = 0
    while gc.get_stats()[1]["collections"] == collected and ticks < middle + 2:
        _requests(held, 100)
        clock.collect()
        ticks += 1
    # as Python: once the youngest was collected more than `middle` times
    assert (ticks, gc.get_stats()[1]["collections"]) == (middle + 2, collected + 1)


def test_the_clock_slows_down_while_nothing_is_served_and_not_while_requests_arrive() -> None:
    served = [0]
    loop = asyncio.new_event_loop()
    try:
        clock = YoungCollections(loop, lambda: served[0])
        idle = [clock.tick() for _ in range(10)]
        served[0] += 1
        busy = [clock.tick()]
        served[0] += 1
        busy.append(clock.tick())
    finally:
        loop.close()
    assert idle == [0.02, 0.04, 0.08] + [YOUNG_EVERY_IDLE] * 7
    assert busy == [YOUNG_EVERY, YOUNG_EVERY]


def test_a_tick_collects_the_oldest_generation_once_its_count_is_due(
    held: list[list[list[int]]], clock: YoungCollections
) -> None:
    """Python weighs the oldest generation only at collections of its own,
    which the clock's leave few occasions for: the clock does it too."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], 1, 1)  # the oldest after 2 of the middle
    try:
        collected = gc.get_stats()[2]["collections"]
        ticks = 0
        while gc.get_stats()[2]["collections"] == collected and ticks < 10:
            _requests(held, 100)
            clock.collect()
            ticks += 1
    finally:
        gc.set_threshold(*thresholds)
    # young, young, middle, young, young, middle, then the oldest
    assert (ticks, gc.get_stats()[2]["collections"]) == (7, collected + 1)


@pytest.mark.process
def test_a_serving_process_collects_its_young_generation_on_a_clock(
    redis_url: str, tmp_path: Path
) -> None:
    """Requests that free what they make: Python's count seldom fires, the
    clock's ticks do (with the clock not started, these 1,000 pings made no
    collection at all when this test was written)."""
    with ServiceProcess("--redis-url", redis_url, log_path=tmp_path / "serve.log") as svc:
        first = metric(svc.url, "python_gc_collections_total", generation="0")
        probes = 0
        while probes < 1000:
            for _ in range(20):
                with urllib.request.urlopen(f"{svc.url}/v2/ping", timeout=30):
                    probes += 1
                time.sleep(0.005)
            young = metric(svc.url, "python_gc_collections_total", generation="0")
            if young >= first + 30:
                break
    assert young >= first + 30
