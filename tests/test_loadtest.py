"""loadtest/: the no-miss checker on synthetic input, the timing summary, and a
short headless Locust run against a live ``feedsvc serve`` for each driver.

The smoke run asserts that every request succeeded and that the checker saw
messages and found nothing wrong; it asserts nothing about speed.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from feedsvc.testing import ServiceProcess
from loadtest import compare, timings
from loadtest.checker import (
    DUPLICATE,
    GAP,
    LOST,
    REORDER,
    FeedChecker,
    Finding,
    Stamp,
    read_stamp,
)
from tests.conftest import REPO_ROOT

T0 = 1_000_000.0
TTL = 3600


def feed(checker: FeedChecker, items: list[tuple[str, int]], now: float = T0 + 10) -> list[Finding]:
    found = []
    for producer, seq in items:
        finding = checker.see(Stamp(producer, seq, T0), TTL, now)
        if finding is not None:
            found.append(finding)
    return found


def test_interleaved_streams_in_order_pass() -> None:
    checker = FeedChecker("q")
    items = [(p, s) for s in range(1, 6) for p in ("a", "b")]
    assert feed(checker, items) == []
    assert checker.checked == 10
    assert checker.findings == 0


def test_skipped_message_is_a_gap() -> None:
    checker = FeedChecker("q")
    found = feed(checker, [("a", 1), ("b", 1), ("a", 2), ("a", 5), ("b", 2)])
    assert found == [Finding(GAP, "q", "a", 3, 4)]
    assert "skipped" in str(found[0]) and "seq 3..4" in str(found[0])


def test_missing_first_message_is_a_gap() -> None:
    # observers read from the head: seq 1 must be seen first
    assert feed(FeedChecker("q"), [("a", 2)]) == [Finding(GAP, "q", "a", 1, 1)]


def test_repeat_is_a_duplicate() -> None:
    found = feed(FeedChecker("q"), [("a", 1), ("a", 2), ("a", 2), ("a", 3), ("a", 1)])
    assert found == [Finding(DUPLICATE, "q", "a", 2, 2), Finding(DUPLICATE, "q", "a", 1, 1)]


def test_late_message_is_a_gap_then_a_reorder() -> None:
    found = feed(FeedChecker("q"), [("a", 1), ("a", 3), ("a", 2), ("a", 4), ("a", 2)])
    assert found == [
        Finding(GAP, "q", "a", 2, 2),
        Finding(REORDER, "q", "a", 2, 2),
        Finding(DUPLICATE, "q", "a", 2, 2),
    ]


def test_gap_of_consumed_messages_is_excused_only_if_all_were_consumed() -> None:
    consumed = {("q", "a", 2), ("q", "a", 3), ("q", "a", 6)}
    checker = FeedChecker("q", lambda q, p, s: (q, p, s) in consumed)
    found = feed(checker, [("a", 1), ("a", 4), ("a", 5), ("a", 8)])
    assert found == [Finding(GAP, "q", "a", 6, 7)]
    assert checker.excused_consumed == 2


def test_consumed_message_seen_again_is_still_a_failure() -> None:
    checker = FeedChecker("q", lambda q, p, s: True)
    found = feed(checker, [("a", 1), ("a", 3), ("a", 3), ("a", 2)])
    assert [f.kind for f in found] == [DUPLICATE, REORDER]


def test_gap_is_excused_only_when_the_messages_may_have_expired() -> None:
    young = FeedChecker("q")
    assert young.see(Stamp("a", 3, T0), 60, T0 + 30) == Finding(GAP, "q", "a", 1, 2)
    old = FeedChecker("q")
    assert old.see(Stamp("a", 3, T0), 60, T0 + 61) is None
    assert old.excused_expired == 2


def test_lost_reports_the_unseen_acknowledged_tail() -> None:
    checker = FeedChecker("q")
    feed(checker, [("a", 1), ("a", 2), ("b", 1)])
    assert checker.lost({"a": 4, "b": 1, "c": 2}) == [
        Finding(LOST, "q", "a", 3, 4),
        Finding(LOST, "q", "c", 1, 2),
    ]
    assert checker.findings == 2


def test_stamps_round_trip_and_foreign_bodies_are_ignored() -> None:
    stamp = Stamp("p.1", 7, T0)
    assert read_stamp(json.loads(json.dumps(stamp.body("xx")))) == stamp
    for body in [None, "text", [1], {"p": "a", "s": "1", "t": T0}, {"p": "a", "s": True, "t": 1}]:
        assert read_stamp(body) is None


def test_timings_summary_of_the_steady_window(tmp_path: Path) -> None:
    recorder = timings.Recorder(spawned_at=100.0, stopping_at=110.0)
    recorder.record("POST messages", 100.5, 999.0, True)  # warm-up: ignored
    inside = [1.0, 2.0, 3.0, 4.0, 50.0]
    for i, ms in enumerate(inside):
        recorder.record("POST messages", 103.0 + i, ms, i != 4)
    recorder.record("POST messages", 110.5, 999.0, True)  # while stopping: ignored
    recorder.record("POST messages", 104.5, 3000.0, True)  # began in the warm-up: rps only
    recorder.dump(tmp_path, {"checker": {}})
    records = timings.load(tmp_path)
    start, end = timings.window(records, warmup=2.0)
    assert (start, end) == (102.0, 110.0)
    summary = timings.summarize(records, "POST messages", start, end)
    assert summary.requests == 5
    assert summary.failed == 1
    assert summary.rps == 5 / 8
    assert summary.mean == statistics.mean(inside)
    assert math.isclose(summary.stdev, statistics.stdev(inside))
    assert (summary.p50, summary.p99, summary.max) == (3.0, 50.0, 50.0)
    assert summary.p99_ok == 4.0  # the 50 ms request failed


async def test_audit_reports_skipped_and_lost_messages(
    http: TestClient[web.Request, web.Application],
) -> None:
    queue = f"audit-{uuid.uuid4().hex[:8]}"
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": compare.PROJECT}
    body = {"messages": [{"body": Stamp("p.1", s, time.time()).body()} for s in range(1, 7)]}
    posted = await http.post(f"/v2/queues/{queue}/messages", json=body, headers=headers)
    assert posted.status == 201
    hrefs = (await posted.json())["resources"]
    assert (await http.delete(hrefs[2], headers=headers)).status == 204  # seq 3
    base = str(http.make_url("")).rstrip("/")
    # the audit client is blocking: run it off the loop that serves the app
    result = await asyncio.to_thread(compare.audit, base, [queue], {queue: {"p.1": 8}})
    assert result["read"] == 5
    assert result["findings"] == 2
    assert result["examples"] == [
        str(Finding(GAP, queue, "p.1", 3, 3)),
        str(Finding(LOST, queue, "p.1", 7, 8)),
    ]


KEEP_ALIVE_PROBE = """
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
import loadtest.locustfile  # locust monkey-patches, then the locustfile mends the pool
import gevent, gevent.socket
from geventhttpclient.connectionpool import ConnectionPool
alive = ConnectionPool._is_socket_alive
server = gevent.socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(8)
filler = [os.dup(0) for _ in range(min(1100, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64))]
def pair():
    client = gevent.socket.create_connection(server.getsockname())
    return client, server.accept()[0]
idle, _ = pair()
dirty, peer = pair()
peer.sendall(b"x")
closed, peer2 = pair()
peer2.close()
gevent.sleep(0.1)
print(idle.fileno(), alive(None, idle), alive(None, dirty), alive(None, closed))
"""


@pytest.mark.process
def test_pooled_connections_past_fd_1023_are_kept_alive() -> None:
    # geventhttpclient's select() check called every socket >= fd 1024 dead,
    # so Locust reconnected on each request of most of 3,000 users.
    result = subprocess.run(
        [sys.executable, "-c", KEEP_ALIVE_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    fd, idle, dirty, closed = result.stdout.split()
    assert (idle, dirty, closed) == ("True", "False", "False"), result.stdout
    assert int(fd) >= 1024 or resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200


# -- a live run ----------------------------------------------------------------


def health_status(base: str) -> int:
    request = urllib.request.Request(
        base + "/v2/health", headers={"Client-ID": str(uuid.uuid4()), "X-Project-ID": "smoke"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


@pytest.mark.process
def test_locust_smoke_run(redis_url: str, driver: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDSVC_", "LOCUST_"))}
    flags = ("--redis-url", redis_url, "--driver", driver, "--log-level", "WARNING")
    with ServiceProcess(*flags, log_path=tmp_path / "serve.log") as serve:
        base = serve.url
        assert health_status(base) == 200, serve.log_text()
        result = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "locustfile.py"),
             "--headless", "--only-summary", "-u", "8", "-r", "8", "-t", "4s", "--host", base,
             "--project", f"smoke-{uuid.uuid4().hex}", "--queues", "2", "--batch", "3",
             "--observers", "2", "--poll-interval", "0.05", "--csv", str(tmp_path / "locust"),
             "--timings-dir", str(tmp_path / "timings")],
            capture_output=True, text=True, timeout=60, check=False, env=env, cwd=REPO_ROOT,
        )  # fmt: skip
        serve.stop(signal.SIGTERM)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    with (tmp_path / "locust_stats.csv").open() as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("POST messages", "GET messages", "POST claims", "Aggregated"):
        assert int(stats[name]["Request Count"]) > 0, output
    assert int(stats["Aggregated"]["Failure Count"]) == 0, output
    records = timings.load(tmp_path / "timings")
    checker = records[0].meta["checker"]
    assert checker["checked"] > 0, checker
    assert checker["findings"] == 0, checker
