"""``feedsvc serve --workers N``: supervision, crash restart, graceful stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from feedsvc.redis_server import pick_free_port

HEADERS = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "workers"}


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


@pytest.fixture
def supervised(
    redis_url: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    port, log = pick_free_port(), tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "feedsvc", "serve", "--port", str(port), "--redis-url",
             redis_url, "--workers", "2", "--shutdown-grace", "10"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: log.read_text().count("listening on") == 2, "two workers")
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in worker_pids(log).values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_crashed_worker_is_replaced(
    supervised: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    proc, port, log = supervised
    before = worker_pids(log)
    assert len(before) == 2 and all(alive(p) for p in before.values())
    os.kill(before[1], signal.SIGKILL)
    wait_for(lambda: worker_pids(log)[1] != before[1], "a new worker 1")
    wait_for(lambda: log.read_text().count("listening on") == 3, "the new worker listening")
    assert all(post(port) == 201 for _ in range(10))
    assert proc.poll() is None


def test_sigterm_stops_every_worker(
    supervised: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    proc, port, log = supervised
    workers = worker_pids(log)
    assert post(port) == 201
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    wait_for(lambda: not any(alive(p) for p in workers.values()), "workers to exit", 10)
    assert "starting another" not in log.read_text()
