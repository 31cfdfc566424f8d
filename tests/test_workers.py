"""``feedsvc serve --workers N``: supervision, crash restart, graceful stop.

The drain tests hold requests in flight deterministically: writes on a Redis
of their own are paused (``CLIENT PAUSE ... WRITE``), so each POST, fully
sent, waits inside its handler, and Redis counts it as a blocked client.
Only then is SIGTERM sent; the writes resume once every process has logged
that it is draining.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.testing import ServiceProcess

pytestmark = pytest.mark.process  # feedsvc serve --workers, and a redis-server of its own

HEADERS = {
    "Client-ID": str(uuid.uuid4()),
    "X-Project-ID": "workers",
    # urllib sends a body as a form unless told otherwise, and a form is a 400
    "Content-Type": "application/json",
}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def worker_pids(log: Path) -> dict[int, int]:
    """worker number -> its latest pid, from the supervisor's log."""
    found = re.findall(r"worker (\d+) started \(pid (\d+)\)", log.read_text())
    return {int(n): int(p) for n, p in found}


def wait_for(predicate: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def post(port: int, body: bytes = b'{"messages": [{"body": 1}]}') -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/queues/w/messages", data=body, method="POST", headers=HEADERS
    )
    with urllib.request.urlopen(req, timeout=10) as response:
        return int(response.status)


def serving(redis_url: str, log: Path, *flags: str, workers: int = 2) -> ServiceProcess:
    """``feedsvc serve --workers N`` with its own log (a context manager): ready
    once every worker serves; it and its workers are gone after the block."""
    return ServiceProcess("--redis-url", redis_url, "--workers", str(workers), *flags, log_path=log)


@pytest.fixture
def supervised(redis_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    with serving(redis_url, tmp_path / "serve.log", "--shutdown-grace", "10") as svc:
        yield svc


def test_a_crashed_worker_is_replaced(supervised: ServiceProcess) -> None:
    svc, log = supervised, supervised.log_path
    before = worker_pids(log)
    assert len(before) == 2 and all(alive(p) for p in before.values())
    os.kill(before[1], signal.SIGKILL)
    wait_for(lambda: worker_pids(log)[1] != before[1], "a new worker 1")
    wait_for(lambda: log.read_text().count("listening on") == 3, "the new worker listening")
    assert all(post(svc.port) == 201 for _ in range(10))
    assert svc.returncode is None


def test_sigterm_stops_every_worker(supervised: ServiceProcess) -> None:
    svc, log = supervised, supervised.log_path
    workers = worker_pids(log)
    assert post(svc.port) == 201
    assert svc.stop(signal.SIGTERM, timeout=20) == 0
    wait_for(lambda: not any(alive(p) for p in workers.values()), "workers to exit", 10)
    assert "starting another" not in log.read_text()


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis for the drain tests alone: pausing the session's would stall other tests."""
    server = RedisServer(tmp_path_factory.mktemp("drain-redis"), appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def admin(own_redis: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(own_redis.url)
    yield client
    client.client_unpause()  # whatever the test did
    client.close()


Reply = tuple[int, str | None, Any]


def post_body(port: int, queue: str, n: int) -> Reply:
    """POST one message {"n": n}: status, Connection header, decoded reply."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            f"/v2/queues/{queue}/messages",
            body=json.dumps({"messages": [{"body": {"n": n}}]}),
            headers=HEADERS,
        )
        response = conn.getresponse()
        return response.status, response.getheader("Connection"), json.loads(response.read())
    finally:
        conn.close()


def hold_posts(
    pool: ThreadPoolExecutor, admin: redis.Redis, port: int, queue: str, count: int
) -> list[Future[Reply]]:
    """Send count POSTs that all wait inside their handler for paused Redis
    writes, each to a queue of its own (queue-<n>): posts to one queue would
    share one script call (the lua driver combines them in segments)."""
    admin.client_pause(120_000, all=False)  # WRITE: the POSTs' writes wait
    posts = [pool.submit(post_body, port, f"{queue}-{n}", n) for n in range(count)]
    # --no-coalesce: each waiting POST holds a Redis connection of its own
    wait_for(lambda: admin.info("clients")["blocked_clients"] == count, "POSTs waiting on Redis")
    return posts


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_drains_requests_in_flight(
    workers: int, own_redis: RedisServer, admin: redis.Redis, tmp_path: Path
) -> None:
    log, queue, count = tmp_path / "serve.log", f"drain-{workers}", 6
    flags = ("--shutdown-grace", "60", "--no-coalesce", "--redis-timeout", "120")
    # the service is stopped first, so a failing test does not wait for its POSTs
    with (
        ThreadPoolExecutor(count) as pool,
        serving(own_redis.url, log, *flags, workers=workers) as svc,
    ):
        proc, port = svc.process, svc.port
        idle = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        idle.request("GET", "/v2/ping", headers=HEADERS)
        assert idle.getresponse().status == 204  # and the connection stays open
        pids = list(worker_pids(log).values())
        posts = hold_posts(pool, admin, port, queue, count)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: log.read_text().count("draining:") == workers, "every process draining")

        # Nothing listens any more: a new connection is refused, not queued.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        assert idle.sock is not None
        assert idle.sock.recv(1) == b""  # the idle keep-alive connection was closed
        idle.close()
        assert proc.poll() is None  # still waiting for the POSTs

        admin.client_unpause()
        replies = [post.result(timeout=60) for post in posts]
        assert proc.wait(timeout=60) == 0
    assert [(status, connection) for status, connection, _ in replies] == [(201, "close")] * count
    wait_for(lambda: not any(alive(p) for p in pids), "workers to exit", 10)
    assert "cutting off" not in log.read_text()

    # Every 201 is really stored: read the messages back through a fresh service.
    stored = []
    with serving(own_redis.url, tmp_path / "reader.log", workers=1) as reader:
        for _, _, body in replies:
            request = urllib.request.Request(reader.url + body["resources"][0], headers=HEADERS)
            with urllib.request.urlopen(request, timeout=10) as response:
                stored.append(json.loads(response.read()))
    assert sorted(m["body"]["n"] for m in stored) == list(range(count))


def test_a_request_outliving_the_grace_period_is_cut_off(
    own_redis: RedisServer, admin: redis.Redis, tmp_path: Path
) -> None:
    log, count = tmp_path / "serve.log", 4
    flags = ("--shutdown-grace", "1", "--no-coalesce", "--redis-timeout", "120")
    with ThreadPoolExecutor(count) as pool, serving(own_redis.url, log, *flags) as svc:
        proc = svc.process
        pids = list(worker_pids(log).values())
        posts = hold_posts(pool, admin, svc.port, "cut-off", count)
        proc.send_signal(signal.SIGTERM)  # and Redis stays paused
        # 0: each worker cut its requests off itself; none had to be killed
        assert proc.wait(timeout=60) == 0
        for post in posts:
            with pytest.raises(ConnectionError):  # closed without a response
                post.result(timeout=60)
    wait_for(lambda: not any(alive(p) for p in pids), "workers to exit", 10)
    # whichever worker holds them (the kernel may give one worker all four)
    cut_off = re.findall(r"cutting off (\d+) requests", log.read_text())
    assert sum(int(n) for n in cut_off) == count


def test_a_body_still_arriving_when_the_drain_starts_is_read(
    redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    body = json.dumps({"messages": [{"body": "late"}]}).encode()
    head = (
        "POST /v2/queues/late/messages HTTP/1.1\r\nHost: feedsvc\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in HEADERS.items())
        + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    )
    with (
        serving(redis_url, log, "--shutdown-grace", "10", workers=1) as svc,
        socket.create_connection(("127.0.0.1", svc.port), timeout=30) as sock,
    ):
        proc = svc.process
        sock.sendall(head.encode())
        interim = b""
        while not interim.endswith(b"\r\n\r\n") and (chunk := sock.recv(1)):
            interim += chunk
        # the head is parsed and the handler waits for the body
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining:" in log.read_text(), "the drain to start")
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):  # the server closes after the response
            reply += chunk
        assert proc.wait(timeout=60) == 0
    assert reply.startswith(b"HTTP/1.1 201 ")
    assert b"\r\nConnection: close\r\n" in reply
