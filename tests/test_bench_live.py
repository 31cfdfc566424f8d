"""bench/live.py's tools: the many-stream client reads feedsvc's and the bare
loop's events, and checks gaps and repeats; it asserts nothing about speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench import fanout_server, live, sse_client
from feedsvc.embedded_redis.server import pick_free_port
from tests.conftest import REPO_ROOT

FEEDSVC_EVENT = (
    b'id: 1763980000123000\nevent: message\ndata: {"id":"0123456789abcdef01234567",'
    b'"href":"/v2/queues/q/messages/0123456789abcdef01234567","ttl":3600,"age":0,'
    b'"body":{"n":%d,"t":%.6f,"x":""}}\n\n'
)


def client() -> sse_client.Client:
    args = argparse.Namespace(host="127.0.0.1", port=1, path="/", header=[], connections=1)
    return sse_client.Client(args)


async def test_the_client_reads_events_cut_anywhere_and_counts_gaps_and_repeats() -> None:
    now = time.time()
    events = [FEEDSVC_EVENT % (n, now) for n in (1, 2, 4, 4, 3)]
    body = b"retry: 2000\n\n: heartbeat\n\n" + b"".join(events[:2])
    # chunked framing around each write, as aiohttp sends it
    raw = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in [body, *events[2:]])
    for cut in range(0, len(raw), 7):
        c = client()
        stream = sse_client.Stream(c, 0)
        stream.scan(raw[:cut])
        stream.scan(raw[cut:])
        assert len(c.recorder.latencies) == 5, cut
        assert (c.recorder.gaps, c.recorder.repeats) == (1, 2), cut
        assert stream.last_n == 4
        assert stream.last_id == b"1763980000123000"
        assert all(0 <= latency < 60 for latency in c.recorder.latencies)


async def test_the_bare_loops_events_are_what_the_client_reads() -> None:
    event = fanout_server.event(7, 200)
    assert len(event) == 200
    c = client()
    sse_client.Stream(c, 0).scan(event)
    assert len(c.recorder.latencies) == 1


@pytest.mark.process
def test_the_client_follows_the_bare_loop(tmp_path: Path) -> None:
    with live.bare_server(tmp_path) as (port, _), live.clients(port, "/stream", 4) as group:
        ok, failed, _ = group.ready(30)
        assert (ok, failed) == (4, 0)
        paced = fire(port, "seconds=0.3&rate=20")  # about 6 events
        t0 = time.time()
        fired = fire(port, "seconds=0.3&size=200")  # as many as it can
        t1 = time.time()
        for _ in range(100):  # the last events may be on their way
            got = group.report(t0, t1, tmp_path)
            if got["events"] >= fired["writes"]:
                break
            time.sleep(0.1)
        totals = group.stop()
    assert 3 <= paced["events"] <= 8
    assert fired["writes"] == 4 * fired["events"] > 0
    assert got["events"] == fired["writes"]
    assert got["latencies"].size == got["events"]
    # the events' numbers go on from one fire to the next
    assert (totals["gaps"], totals["repeats"], totals["reconnects"]) == (0, 0, 0)
    assert totals["last_n"] == [paced["events"] + fired["events"]] * 4


def fire(port: int, query: str) -> dict[str, int]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/fire?{query}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, int] = json.loads(response.read())
    return answer


@pytest.mark.process
def test_the_client_stops_when_its_stdin_ends_and_says_what_failed() -> None:
    port = pick_free_port()  # nothing listens: every stream fails
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sse_client", "--port", str(port), "--path", "/",
         "--connections", "2", "--max-seconds", "30"],
        input="", capture_output=True, text=True, timeout=30, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    ready, totals = (json.loads(line) for line in proc.stdout.splitlines())
    assert (ready["ready"], ready["failed"]) == (0, 2)
    assert totals["failures"] == 2
