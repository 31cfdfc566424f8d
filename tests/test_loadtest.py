"""loadtest/: the no-miss checker on synthetic input, the timing summary, the
event-stream reader, and short headless Locust runs against a live
``feedsvc serve`` (for each driver; with followers; the read-mode runner),
in the layout pytest's ``--storage-layout`` names.

The smoke runs assert that every request succeeded and that the checker saw
messages and found nothing wrong; they assert nothing about speed.
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
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from feedsvc.testing import ServiceProcess
from loadtest import common, follow, timings
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
from loadtest.consumption import (
    ACK_ORDER,
    GROUP_SHARED,
    HANDED_EARLY,
    UNACKNOWLEDGED,
    ConsumptionChecker,
    ConsumptionFinding,
)
from loadtest.eventstream import ChunkedDecoder, Event, EventStreamParser, FramingError
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


def test_posted_stamps_round_trip() -> None:
    stamp = Stamp("p.1", 7, T0, T0 + 5.25)
    assert read_stamp(json.loads(json.dumps(stamp.body()))) == stamp
    grouped = Stamp("p.1", 7, T0, T0 + 5.25, "r", "g.0", 3)
    assert read_stamp(json.loads(json.dumps(grouped.body()))) == grouped
    assert read_stamp({"p": "a", "s": 1, "t": T0, "g": "g.0", "k": "3"}) == Stamp("a", 1, T0)
    assert read_stamp({"p": "a", "s": 1, "t": T0, "w": True}) == Stamp("a", 1, T0)


def test_only_this_runs_stamps_are_judged() -> None:
    """A queue may still hold an earlier run's streams, whose heads that run's
    consumers deleted: this run cannot know what happened to them (issue 28)."""
    stamp = Stamp("p.1", 7, T0, T0 + 1, run="r2")
    assert read_stamp(json.loads(json.dumps(stamp.body()))) == stamp
    checker = FeedChecker("q", run="r2")
    earlier = [Stamp("old.1", 5, T0, T0, run="r1"), Stamp("old.1", 5, T0), Stamp("old.1", 9, T0)]
    assert [checker.see(s, TTL, T0 + 10) for s in earlier] == [None, None, None]
    assert (checker.checked, checker.other_runs, checker.latest_posted) == (0, 3, None)
    assert checker.see(Stamp("p.1", 2, T0, run="r2"), TTL, T0 + 10) == Finding(
        GAP, "q", "p.1", 1, 1
    )
    assert checker.checked == 1


def seen_by(items: list[tuple[str, int, float]]) -> FeedChecker:
    checker = FeedChecker("q")
    for producer, seq, posted in items:
        assert checker.see(Stamp(producer, seq, T0, posted), TTL, T0 + 10) is None
    return checker


def test_missed_is_what_was_acknowledged_before_the_latest_seen_post() -> None:
    acks = {
        "a": [(T0 + 1.0, 1), (T0 + 2.0, 3), (T0 + 4.0, 4)],  # seq 2 and 3 in one batch
        "b": [(T0 + 1.5, 1), (T0 + 3.5, 2)],
    }
    # saw a's 1..3 and b's 1; the latest of them was sent at T0 + 3: b's 2
    # (acknowledged at 3.5) and a's 4 (at 4.0) may be still on their way
    checker = seen_by([("a", 1, T0 + 0.5), ("b", 1, T0 + 1.0), ("a", 2, T0 + 1.8)])
    checker.see(Stamp("a", 3, T0, T0 + 3.0), TTL, T0 + 10)
    assert checker.missed(acks) == []
    # a reader that saw b's 2 (sent at 3.4) must have seen a's 1..3 (acknowledged by 2.0)
    late = seen_by([("b", 1, T0 + 1.0), ("b", 2, T0 + 3.4)])
    assert late.missed(acks) == [Finding(LOST, "q", "a", 1, 3)]
    assert late.findings == 1
    # exactly at the ack time is not before it
    edge = seen_by([("b", 1, T0 + 2.0)])
    assert edge.missed(acks) == [Finding(LOST, "q", "a", 1, 1)]
    # deleted by a consumer: excused; no posted stamps: nothing to judge
    consumed = FeedChecker("q", lambda q, p, s: True)
    consumed.see(Stamp("b", 1, T0, T0 + 9.0), TTL, T0 + 10)
    assert consumed.missed(acks) == []
    assert FeedChecker("q").missed(acks) == []


def grouped(k: int, group: str = "g1") -> Stamp:
    """Producer a's seq k, group seq k of ``group``."""
    return Stamp("a", k, T0, T0, "r", group, k)


def post(checker: ConsumptionChecker, stamp: Stamp, acknowledged: bool = True) -> None:
    checker.posting("q", stamp)
    checker.posted("q", stamp, acknowledged)


def consume(
    checker: ConsumptionChecker, claim: str, stamps: list[Stamp], at: float, ttl: float = 60
) -> None:
    """A claim sent at ``at`` and answered 0.1 s later."""
    checker.claimed("q", claim, stamps, at, at + 0.1, ttl)


def test_consumption_of_groups_in_order_with_releases_passes() -> None:
    checker = ConsumptionChecker()
    loose = Stamp("a", 4, T0, T0, "r")
    for stamp in [grouped(1), grouped(2), grouped(3), loose]:
        post(checker, stamp)
    assert checker.pending("q") == 4
    consume(checker, "c1", [grouped(1), grouped(2), loose], at=1.0)
    checker.deleted("q", "c1", grouped(1), 1.2, 1.3, 204)
    # releasing 2 also releases the claim's later messages of its group
    checker.released("q", "c1", grouped(2), 1.4, 204)
    checker.deleted("q", "c1", loose, 1.5, 1.6, 204)
    checker.claim_released("c1", 1.7, 204)
    consume(checker, "c2", [grouped(2), grouped(3)], at=2.0)
    checker.deleted("q", "c2", grouped(2), 2.2, 2.3, 204)
    checker.deleted("q", "c2", grouped(3), 2.4, 2.5, 204)
    assert checker.unreleased_claims() == {"c2"}
    checker.claim_released("c2", 2.6, 204)
    assert checker.finish() == []
    assert (checker.pending("q"), checker.releases, checker.redelivered) == (0, 1, 1)
    assert checker.unreleased_claims() == set()


def test_consumption_flags_an_out_of_order_group_acknowledgement() -> None:
    checker = ConsumptionChecker()
    for k in (1, 2):
        post(checker, grouped(k))
    consume(checker, "c1", [grouped(2)], at=1.0)  # 1 is free, yet 2 is handed out
    checker.deleted("q", "c1", grouped(2), 1.2, 1.3, 204)
    consume(checker, "c2", [grouped(1)], at=2.0)
    checker.deleted("q", "c2", grouped(1), 2.2, 2.3, 204)
    found = checker.finish()
    assert [f.kind for f in found] == [ACK_ORDER, HANDED_EARLY]
    assert checker.by_kind == {ACK_ORDER: 1, HANDED_EARLY: 1}
    assert "group seq 2 was deleted before the delete of group seq 1" in str(found[0])
    assert checker.findings == 2


def test_consumption_flags_a_lost_message_and_excuses_an_unanswered_delete() -> None:
    checker = ConsumptionChecker()
    for seq in range(1, 6):
        post(checker, Stamp("a", seq, T0, run="r"), acknowledged=seq != 5)
    consume(checker, "c1", [Stamp("a", s, T0, run="r") for s in (1, 3)], at=1.0)
    checker.deleted("q", "c1", Stamp("a", 1, T0, run="r"), 1.2, 1.3, 204)
    checker.deleted("q", "c1", Stamp("a", 3, T0, run="r"), 1.4, 16.4, 0)  # timed out
    checker.deleted("q", "c1", Stamp("a", 2, T0, run="r"), 1.5, 1.6, 400)  # not its claim
    # claimed and deleted before its producer read the 201: not lost
    early = Stamp("a", 6, T0, run="r")
    checker.posting("q", early)
    consume(checker, "c2", [early], at=2.0)
    checker.deleted("q", "c2", early, 2.2, 2.3, 204)
    checker.posted("q", early, acknowledged=True)
    assert checker.pending("q") == 3  # 2, 4 and 3 (its delete got no answer)
    # 2 and 4 were never deleted; 5 (no 201) is not judged
    assert checker.finish() == [
        ConsumptionFinding(UNACKNOWLEDGED, "q", "producer a seq 2: acknowledged, never deleted"),
        ConsumptionFinding(UNACKNOWLEDGED, "q", "producer a seq 4: acknowledged, never deleted"),
    ]
    assert checker.excused_unanswered == 1


def test_consumption_flags_two_claims_holding_a_group_at_once() -> None:
    checker = ConsumptionChecker()
    for k in (1, 2, 3):
        post(checker, grouped(k))
    consume(checker, "c1", [grouped(1)], at=1.0)
    consume(checker, "c2", [grouped(2)], at=2.0)  # while c1 holds 1
    checker.deleted("q", "c2", grouped(2), 2.2, 2.3, 204)
    checker.deleted("q", "c1", grouped(1), 3.0, 3.1, 204)
    kinds = [f.kind for f in checker.finish()]
    assert GROUP_SHARED in kinds and HANDED_EARLY in kinds
    # a hold ends for sure only until the claim may have expired
    expired = ConsumptionChecker()
    for k in (1, 2):
        post(expired, grouped(k))
    consume(expired, "c1", [grouped(1)], at=1.0, ttl=1)
    consume(expired, "c2", [grouped(1), grouped(2)], at=2.5)
    expired.deleted("q", "c1", grouped(1), 3.0, 3.1, 400)  # too late: c1 expired
    for k in (1, 2):
        expired.deleted("q", "c2", grouped(k), 3.0 + k, 3.1 + k, 204)
    assert expired.finish() == []


STREAM = (
    b"retry: 2000\n\n"
    b": heartbeat\n\n"
    b'id: 11\nevent: message\ndata: {"a": 1}\n\n'
    b"id: 12\r\ndata: two\r\ndata: lines\r\n\r\n"
    b"data: no id\rid: 13\r\r"
    b"event: end\ndata: {}\n\n"
    b"data: unfinished"
)
EVENTS = [
    Event("message", '{"a": 1}', "11"),
    Event("message", "two\nlines", "12"),
    Event("message", "no id", "13"),
    Event("end", "{}", "13"),
]


def chunked(body: bytes, size: int) -> bytes:
    out = b"".join(
        b"%x;ext=1\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    )
    return out + b"0\r\n\r\n"


def test_event_stream_parser_takes_any_cut() -> None:
    for cut in range(len(STREAM) + 1):
        parser = EventStreamParser()
        events = parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:])
        assert events == EVENTS, cut
        assert parser.retry_ms == 2000
    parser = EventStreamParser()
    assert [e for byte in STREAM for e in parser.feed(bytes([byte]))] == EVENTS
    bom = EventStreamParser()
    assert bom.feed("\ufeffdata: x\n\n".encode()) == [Event("message", "x", None)]


def test_chunked_decoder_takes_any_cut() -> None:
    framed = chunked(STREAM, 7)
    for cut in range(len(framed) + 1):
        decoder = ChunkedDecoder()
        body = decoder.feed(framed[:cut]) + decoder.feed(framed[cut:])
        assert body == STREAM, cut
        assert decoder.done
    decoder = ChunkedDecoder()
    assert b"".join(decoder.feed(bytes([b])) for b in framed) == STREAM
    for bad in (b"zz\r\n", b"3\r\nabcXY"):
        with pytest.raises(FramingError):
            ChunkedDecoder().feed(bad)


def test_value_at_interpolates_a_cumulative_series() -> None:
    times, series = [10.0, 11.0, 13.0], [0.0, 100.0, 300.0]
    assert follow.value_at(times, series, 10.5) == 50.0
    assert follow.value_at(times, series, 12.0) == 200.0
    assert (follow.value_at(times, series, 0), follow.value_at(times, series, 99)) == (0.0, 300.0)


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
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": common.PROJECT}
    body = {"messages": [{"body": Stamp("p.1", s, time.time()).body()} for s in range(1, 7)]}
    posted = await http.post(f"/v2/queues/{queue}/messages", json=body, headers=headers)
    assert posted.status == 201
    hrefs = (await posted.json())["resources"]
    assert (await http.delete(hrefs[2], headers=headers)).status == 204  # seq 3
    base = str(http.make_url("")).rstrip("/")
    # the audit client is blocking: run it off the loop that serves the app
    result = await asyncio.to_thread(common.audit, base, [queue], {queue: {"p.1": 8}})
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
def test_locust_smoke_run(redis_url: str, driver: str, storage_layout: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDSVC_", "LOCUST_"))}
    flags = ("--redis-url", redis_url, "--driver", driver, "--log-level", "WARNING",
             "--storage-layout", storage_layout)  # fmt: skip
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


@pytest.mark.process
def test_a_second_run_against_the_same_queues_judges_only_its_own_messages(
    redis_url: str, storage_layout: str, tmp_path: Path
) -> None:
    """The first run's consumers delete the heads of its streams and leave
    their tails; the second run's readers, starting at the head, must not
    call that a gap (issue 28: 130 false "no-miss: gap" on a second run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDSVC_", "LOCUST_"))}
    project = f"again-{uuid.uuid4().hex}"
    flags = ("--redis-url", redis_url, "--log-level", "WARNING", "--storage-layout", storage_layout)
    locustfile = str(REPO_ROOT / "loadtest" / "locustfile.py")
    results = []
    with ServiceProcess(*flags, log_path=tmp_path / "serve.log") as serve:
        for run in (1, 2):
            result = subprocess.run(
                [sys.executable, "-m", "locust", "-f", locustfile, "--headless",
                 "--only-summary", "-u", "6", "-r", "6", "-t", "4s",
                 "--host", serve.url, "--project", project, "--queue-prefix", "same",
                 "--queues", "1", "--observers", "1", "--poll-interval", "0.05",
                 "--timings-dir", str(tmp_path / f"timings{run}"),
                 "Producer", "Consumer", "Observer"],
                capture_output=True, text=True, timeout=60, check=False, env=env, cwd=REPO_ROOT,
            )  # fmt: skip
            results.append(result)
        serve.stop(signal.SIGTERM)
    first, second = (timings.load(tmp_path / f"timings{run}")[0].meta["checker"] for run in (1, 2))
    for result, checker in zip(results, (first, second), strict=True):
        assert result.returncode == 0, result.stdout + result.stderr
        assert checker["findings"] == 0 and checker["checked"] > 0, checker
    # the first run left messages of its own behind, which the second saw and did not judge
    assert second["other_runs"] > 0, second


@pytest.mark.process
def test_locust_consumers_with_groups_and_releases_pass_the_consumption_checker(
    redis_url: str, driver: str, storage_layout: str, tmp_path: Path
) -> None:
    """Consumers release a third of what they claim (after a second) and
    delete the rest; each claim holds up to 10 messages of 2 queues x 3
    groups: every acknowledged message is deleted by the end of the drain, in
    its group's order, and no two claims hold a group at once (issue 32). An
    observer beside them misses nothing but what was deleted or released
    with a delay."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDSVC_", "LOCUST_"))}
    flags = ("--redis-url", redis_url, "--driver", driver, "--log-level", "WARNING",
             "--storage-layout", storage_layout)  # fmt: skip
    with ServiceProcess(*flags, log_path=tmp_path / "serve.log") as serve:
        result = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "locustfile.py"),
             "--headless", "--only-summary", "-u", "7", "-r", "7", "-t", "5s", "--host", serve.url,
             "--project", f"groups-{uuid.uuid4().hex}", "--queues", "2", "--batch", "3",
             "--groups", "3", "--release-ratio", "0.3", "--release-delay", "1",
             "--producer-weight", "4", "--consumer-weight", "3", "--producer-wait", "0.05",
             "--poll-interval", "0.05", "--observers", "1",
             "--timings-dir", str(tmp_path / "timings"),
             "Producer", "Consumer", "Observer"],
            capture_output=True, text=True, timeout=120, check=False, env=env, cwd=REPO_ROOT,
        )  # fmt: skip
        serve.stop(signal.SIGTERM)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    # the timings, written in the stop handler after the checkers' verdicts
    # (once, on a loaded machine, Locust's CSV had no "POST messages" row after a
    # run that exited 0)
    [record] = timings.load(tmp_path / "timings")
    assert record.meta["failures"] == {}, record.meta["failures"]
    for name in ("POST messages", "POST claims", "DELETE message", "POST release",
                 "DELETE released message"):  # fmt: skip
        assert len(record.samples.get(name, ())) > 0, (name, output[-5000:])
    assert record.meta["checker"]["findings"] == 0 and record.meta["checker"]["checked"] > 0
    consumption = record.meta["checker"]["consumption"]
    assert consumption["findings"] == 0, consumption
    # consumers released messages that were claimed again, and deleted some
    # (the drain the rest): every acknowledged message was deleted in the end
    assert consumption["releases"] > 0 and consumption["redelivered"] > 0, consumption
    assert consumption["deletes"] > consumption["drained"], consumption
    assert consumption["acknowledged"] > 0 and consumption["drain_unknown_claims"] == 0


@pytest.mark.process
def test_locust_followers_check_every_message(
    redis_url: str, storage_layout: str, tmp_path: Path
) -> None:
    """Long pollers, SSE streamers and pollers each check every message and
    record its post-to-delivery latency; nothing is missed at the stop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEEDSVC_", "LOCUST_"))}
    flags = ("--redis-url", redis_url, "--log-level", "WARNING", "--stream-lifetime", "2",
             "--stream-retry", "100", "--storage-layout", storage_layout)  # fmt: skip
    with ServiceProcess(*flags, log_path=tmp_path / "serve.log") as serve:
        result = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadtest" / "locustfile.py"),
             "--headless", "--only-summary", "-u", "9", "-r", "9", "-t", "5s", "--host", serve.url,
             "--project", f"smoke-{uuid.uuid4().hex}", "--queues", "2", "--observers", "2",
             "--long-pollers", "2", "--streamers", "2", "--producer-wait", "0.05",
             "--poll-interval", "0.3", "--long-poll-wait", "2", "--csv", str(tmp_path / "locust"),
             "--timings-dir", str(tmp_path / "timings"),
             "Producer", "Observer", "LongPoller", "Streamer"],
            capture_output=True, text=True, timeout=60, check=False, env=env, cwd=REPO_ROOT,
        )  # fmt: skip
        serve.stop(signal.SIGTERM)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    with (tmp_path / "locust_stats.csv").open() as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    # streams live 2 s (+-10 %), retry after 0.1 s: each streamer reconnected
    # with Last-Event-ID at least once in the 5 s
    assert int(stats["GET stream"]["Request Count"]) >= 4, output
    assert int(stats["GET messages wait"]["Request Count"]) > 0, output
    assert int(stats["Aggregated"]["Failure Count"]) == 0, output
    [record] = timings.load(tmp_path / "timings")
    checker = record.meta["checker"]
    assert checker["readers"] == 2 * 2 + 2 + 2  # an observer reads both queues
    assert checker["findings"] == 0 and checker["missed_at_stop"] == 0, checker
    posts = len(record.samples["POST messages"]) // 3
    for mode in ("poll", "long-poll", "sse"):
        # two readers of the mode, each on one of the two queues (observers: both)
        delivered = len(record.samples[f"deliver {mode}"]) // 3
        assert 0 < delivered <= 2 * posts, (mode, delivered, posts)


@pytest.mark.process
def test_follow_runner_reports_a_read_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "loadtest", "follow", "--drivers", "lua", "--modes", "sse",
         "--producers", "2", "--producer-wait", "0.05", "--followers", "3", "--duration", "5",
         "--warmup", "1", "--idle-wait", "0", "--storage-layout", "segments", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = json.loads((out / "follow.json").read_text())
    assert saved["settings"]["storage_layout"] == "segments"
    [row] = saved["rows"]
    assert (row["driver"], row["mode"], row["followers"]) == ("lua", "sse", 3)
    assert row["deliveries_per_s"] > 0 and row["p99_ms"] > 0
    assert row["post_cost"] > 1  # an EVALSHA and the commands its script runs
    assert row["redis_commands"] > 0
    assert row["checker"]["findings"] == 0 and row["audit"]["findings"] == 0
    assert {"follow.md", "follow.csv", "follow.png"} <= {p.name for p in out.iterdir()}
    again = subprocess.run(
        [sys.executable, "-m", "loadtest", "report", str(out / "follow.json")],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    assert again.returncode == 0 and "| sse | lua | 3 |" in again.stdout, again.stderr


@pytest.fixture
def keep_sigterm() -> Iterator[None]:
    """loadtest's main() installs a SIGTERM handler: not in the test process."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _compare_row(producers: int, shape: str, workers: int, driver: str, rps: float) -> dict:  # type: ignore[type-arg]
    post = timings.Summary(100, 0, rps, 1.0, 0.5, 1.0, 2.0, 3.0, 2.0)
    return {
        "producers": producers, "shape": shape, "workers": workers, "driver": driver,
        "post": post.as_dict(), "get": post.as_dict(), "failures": {}, "checker": {},
        "audit": {"read": 100, "findings": 0}, "watch_retries": 7, "watch_exhausted": 0,
        "posts_combined": 3, "workers_seen": workers,
        "cpu_percent": {"locust": 1.0, "feedsvc": 2.0, "redis": 3.0, "machine": 9.0, "other": 3.0},
        "machine_busy_before_percent": 0.0, "other_processes": [], "window_s": 10.0,
        "locust_exit": 0, "server_log_errors": 0,
    }  # fmt: skip


# a process test: matplotlib runs fc-list while its font cache is not yet built
@pytest.mark.process
@pytest.mark.usefixtures("keep_sigterm")
def test_compare_report_puts_the_three_drivers_side_by_side_per_cell(tmp_path: Path) -> None:
    """python -m loadtest report: each (producers, shape, workers) cell lists
    lua, watch and watch-naive, then lua's ratio over each of the others."""
    from loadtest import compare

    rows = [
        _compare_row(100, shape, workers, driver, rps)
        for shape in ("hot", "spread")
        for workers in (1, 2)
        for driver, rps in (("watch-naive", 100.0), ("lua", 400.0), ("watch", 200.0))
    ]
    settings = {
        "steps": [100], "drivers": ["lua", "watch", "watch-naive"], "duration": 5.0,
        "warmup": 1.0, "observers": 2, "shapes": ["hot", "spread"], "queues": 4, "batch": 1,
        "message_size": 100, "page_size": 20, "processes": 1, "spawn_rate": 100.0,
        "workers": [1, 2],
    }  # fmt: skip
    machine = {"cpu": "test", "cores": 2}
    saved = tmp_path / "compare.json"
    saved.write_text(json.dumps({"machine": machine, "settings": settings, "rows": rows}))
    assert compare.main(["report", str(saved)]) == 0
    table = (tmp_path / "compare.md").read_text().splitlines()[2:]
    assert len(table) == 4 * 5  # four cells: three drivers and two ratios each
    first = [line.split("|")[1:6] for line in table[:5]]
    assert [c[3].strip() for c in first] == ["lua", "watch", "watch-naive", "lua/watch",
                                              "lua/watch-naive"]  # fmt: skip
    assert [c[4].strip() for c in first[3:]] == ["2.00x", "4.00x"]
    assert "4 queues" in table[-1 - 4] and "| 2 |" in table[-1 - 4]
    assert (tmp_path / "compare.png").stat().st_size > 0
    with (tmp_path / "compare.csv").open() as f:
        assert {(r["shape"], r["workers"]) for r in csv.DictReader(f)} == {
            ("hot", "1"),
            ("hot", "2"),
            ("spread", "1"),
            ("spread", "2"),
        }


def test_compare_report_reads_a_saved_run_from_before_shapes(tmp_path: Path) -> None:
    from loadtest import compare

    old = {"steps": [10], "drivers": ["lua", "watch"], "duration": 5.0, "warmup": 1.0,
           "observers": 2, "hot": False, "queues": 4, "batch": 1, "message_size": 100,
           "page_size": 20, "processes": 1, "spawn_rate": 100.0}  # fmt: skip
    assert compare.Config.from_saved(old).shapes == ["spread"]


@pytest.mark.usefixtures("keep_sigterm")
def test_compare_refuses_an_unknown_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest import compare

    assert compare.main(["compare", "--shapes", "lukewarm", "--out", "unused"]) == 2
    assert "--shapes" in capsys.readouterr().err


@pytest.mark.usefixtures("keep_sigterm")
def test_the_runners_start_every_service_on_the_storage_layout_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--storage-layout reaches every feedsvc serve of compare and follow (after
    it, --serve-arg still wins); without it the service's default is used."""
    from loadtest import compare

    parser = compare.build_parser()
    for command in ("compare", "follow"):
        args = parser.parse_args([command, "--storage-layout", "segments"])
        assert args.storage_layout == "segments"
        assert parser.parse_args([command]).storage_layout is None
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--storage-layout", "stream"])
        assert "--storage-layout" in capsys.readouterr().err
    cfg = compare.Config(
        steps=[1], drivers=["lua"], duration=1.0, warmup=0.0, observers=0, shapes=["hot"],
        queues=1, batch=1, message_size=1, page_size=1, processes=1, spawn_rate=1.0,
        serve_args=["--pool-size=8"], storage_layout="segments",
    )  # fmt: skip
    assert compare.serve_flags(cfg, 2) == [
        "--storage-layout", "segments", "--pool-size=8", "--workers", "2",
    ]  # fmt: skip
    cfg.storage_layout = None
    assert "--storage-layout" not in compare.serve_flags(cfg, 1)
    fcfg = follow.FollowConfig(
        drivers=["lua"], modes=["sse"], producers=1, producer_wait=0.1, followers=1,
        poll_interval=1.0, duration=1.0, warmup=0.0, message_size=1,
        storage_layout="records",
    )  # fmt: skip
    assert follow.serve_flags(fcfg) == ["--storage-layout", "records"]
    fcfg.storage_layout = None
    assert follow.serve_flags(fcfg) == []
