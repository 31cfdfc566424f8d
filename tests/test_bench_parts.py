"""The tools of bench/capacity.py and bench/zaqar.py: wrk's report read
right, the CPU of a process tree and of wrk (a reaped child) counted
(bench/machine.py, shared with loadtest/), a process that ignores SIGTERM
stopped all the same, the
zaqar part skipped with a reason when Zaqar cannot be installed, and the
ladder's --bench-routes answering as the requests they stand for. Speed
itself is never asserted here."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson
import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

from bench import groups, storage, storage_layout, zaqar
from bench.machine import CpuMeter, CpuWindow, process_tree, stop_process
from bench.run import READER, Suite, bare_feed, bare_hello
from bench.service import PRODUCER, parse_wrk
from feedsvc.app import create_app
from feedsvc.embedded_redis.server import RedisServer
from tests.conftest import make_settings

WRK_REPORT = """\
Running 7s test @ http://127.0.0.1:4242/v2/queues/bpool/messages
  2 threads and 5000 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    12.51ms   40.20ms   1.20s    97.00%
    Req/Sec     1.02k   210.00     1.50k    70.00%
  Latency Distribution
     50%  645.00us
     75%    1.20ms
     90%    3.10ms
     99%    1.02s
  10234 requests in 7.01s, 2.10MB read
  Socket errors: connect 3, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 4
Requests/sec:   1459.98
Transfer/sec:    306.70KB
"""

BURN = "import time\nwhile time.process_time() < 0.3: pass\n"
# a parent with a child that sleeps (the test kills both)
SPAWN = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(60)
"""


def test_wrk_report_is_read_with_units_errors_and_its_own_duration() -> None:
    result = parse_wrk(WRK_REPORT)
    assert result.rps == 1459.98
    assert result.p50_ms == 0.645
    assert result.p99_ms == 1020.0
    assert result.requests == 10234
    assert result.seconds == 7.01  # the paced part divides by it, less the warm-up
    assert result.errors == 3 + 1 + 2 + 4


@pytest.mark.process
def test_the_cpu_of_a_reaped_child_and_of_a_process_tree_is_counted() -> None:
    window = CpuWindow({}, reaped="wrk")
    window.start()
    subprocess.run([sys.executable, "-c", BURN], check=True)  # reaped inside the window
    percent = window.stop()
    assert percent["wrk"] > 0
    assert set(percent) == {"wrk", "other"}

    parent = subprocess.Popen([sys.executable, "-c", SPAWN])
    try:
        deadline = time.monotonic() + 30
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        children = tree[1:]
    finally:
        parent.kill()
        parent.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    assert process_tree(parent.pid) == []
    assert process_tree(None) == []


@pytest.mark.process
def test_a_meters_group_keeps_the_cpu_of_a_process_that_exited() -> None:
    meter = CpuMeter()
    proc = subprocess.Popen([sys.executable, "-c", BURN + "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip
    try:
        # BURN spends 0.3 s of CPU, then waits for its stdin (read in clock ticks)
        deadline = time.monotonic() + 60
        while not meter.groups.get("burn") or meter.groups["burn"][-1] < 0.25:
            assert time.monotonic() < deadline, meter.groups
            meter.sample({"burn": [proc.pid]})
            assert proc.poll() is None
            time.sleep(0.05)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    meter.sample({"burn": [proc.pid]})
    assert meter.groups["burn"][-1] == meter.groups["burn"][-2] >= 0.25
    assert meter.percent(meter.groups["burn"], meter.times[0], meter.times[-1]) > 0


@pytest.mark.process
def test_a_process_that_ignores_sigterm_is_killed() -> None:
    ignore = "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    ignore += "print(flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", ignore], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    with proc.stdout:
        proc.stdout.readline()  # SIGTERM is ignored from here on
        assert stop_process(proc, timeout=0.5) == -9
        assert stop_process(proc) == -9  # already stopped: nothing more happens


class FakeSuite:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.rows: list[tuple[str, dict[str, Any]]] = []

    def add(self, name: str, **values: object) -> None:
        self.rows.append((name, values))


def test_the_zaqar_part_is_skipped_with_a_reason_when_zaqar_cannot_be_installed(
    tmp_path: Path,
) -> None:
    home = tmp_path / "not-a-directory"
    home.write_text("")
    suite = FakeSuite(tmp_path)
    zaqar.part_zaqar(suite, home)  # type: ignore[arg-type]
    [(name, values)] = suite.rows
    assert name == "feedsvc vs Zaqar"
    assert "cannot install into" in str(values["skipped"])


@pytest.mark.parametrize("driver", ["lua"])
async def test_the_ladders_rungs_answer_as_the_requests_they_stand_for(
    redis_url: str, driver: str, headers: dict[str, str]
) -> None:
    """bench's ladder reads its rungs' costs as steps towards a real POST and
    GET: each must answer with no error, and the ceilings with what the
    real request sends (a post's 201 and Location; a page's size)."""
    settings = make_settings(redis_url, driver=driver, bench_routes=True)
    async with TestClient(TestServer(create_app(settings))) as http:
        queue_path = "/v2/queues/bget/messages"
        seed = {"messages": [{"body": {"n": i, "pad": "x" * 100}} for i in range(20)]}
        bget = {**headers, "X-Project-ID": "bench"}
        assert (await http.post(queue_path, json=seed, headers=bget)).status == 201
        reader = {**bget, "Client-ID": str(uuid.uuid4())}
        answers = {}
        for label, path, script in Suite.LADDER:
            method = "POST" if script == "post.lua" else "GET"
            body = {"messages": [{"ttl": 300, "body": {"event": "x"}}]}
            response = await http.request(
                method, path, json=body if method == "POST" else None, headers=reader
            )
            assert response.status < 300, (label, response.status, await response.text())
            answers[path] = (response, await response.read())
    ceiling, ceiling_body = answers["/bench/post"]
    [resource] = orjson.loads(ceiling_body)["resources"]
    assert ceiling.status == 201
    assert ceiling.headers["Location"] == "/bench/post?ids=" + resource.rsplit("/", 1)[1]
    page_body = answers["/bench/page"][1]
    real_page = answers["/v2/queues/bget/messages?limit=10"][1]
    assert len(orjson.loads(page_body)["messages"]) == len(orjson.loads(real_page)["messages"])
    assert abs(len(page_body) - len(real_page)) < len(real_page) // 10


@pytest.mark.process
@pytest.mark.parametrize("driver", ["lua"])
async def test_the_bare_hello_answers_what_feedsvcs_hello_answers(
    redis_url: str, driver: str
) -> None:
    """The post and get parts read bench/bare_hello.py against feedsvc's own
    /bench/hello as "what feedsvc's middlewares cost": that holds only while
    both send the same document with the same content type, and the bare one
    runs no middleware (an error shaped by feedsvc would be JSON)."""
    settings = make_settings(redis_url, driver=driver, bench_routes=True)
    async with TestClient(TestServer(create_app(settings))) as http:
        ours = await http.get("/bench/hello")
        ours_body = await ours.read()
    with bare_hello() as url:
        async with aiohttp.ClientSession(url) as session:
            async with session.get("/bench/hello") as bare:
                bare_body = await bare.read()
                bare_type = bare.content_type
            async with session.get("/v2/queues") as unknown:
                unknown_type = unknown.content_type
    assert bare_body == ours_body
    assert bare_type == ours.content_type == "application/json"
    assert unknown_type == "text/plain"  # aiohttp's own 404: nothing of feedsvc's in the way


def _ageless(page: dict[str, Any]) -> dict[str, Any]:
    return {**page, "messages": [{**m, "age": 0} for m in page["messages"]]}


@pytest.mark.process
@pytest.mark.parametrize("driver", ["lua"])
async def test_the_bare_feed_stores_and_answers_as_feedsvc_does(
    redis_url: str, driver: str
) -> None:
    """The floor part reads bench/bare_feed.py as "feedsvc's POST and GET
    with every feature switched off": that holds only while its POST stores
    what feedsvc's would (feedsvc reads it back) and both answer alike."""
    settings = make_settings(redis_url, driver=driver)
    post = {"messages": [{"ttl": 300, "body": {"event": i}} for i in range(3)]}
    producer = {"Client-ID": PRODUCER, "X-Project-ID": "bench"}
    reader = {"Client-ID": READER, "X-Project-ID": "bench"}
    with bare_feed(redis_url) as url:
        async with aiohttp.ClientSession(url) as session:
            async with session.post(
                "/v2/queues/bfloor/messages", json=post, headers=producer
            ) as posted:
                floor_status, floor_posted = posted.status, await posted.json()
            async with session.get("/v2/queues/bfloor/messages?limit=2", headers=reader) as got:
                floor_page = await got.json()
    async with TestClient(TestServer(create_app(settings))) as http:
        ours = await http.get("/v2/queues/bfloor/messages?limit=2", headers=reader)
        ours_page = await ours.json()
        rest = await http.get(ours_page["links"][0]["href"], headers=reader)
        rest_page = await rest.json()
    assert floor_status == 201
    hrefs = [m["href"] for m in ours_page["messages"] + rest_page["messages"]]
    assert floor_posted["resources"] == hrefs
    assert [m["body"] for m in ours_page["messages"]] == [{"event": 0}, {"event": 1}]
    assert _ageless(floor_page) == _ageless(ours_page)


@pytest.mark.process
def test_the_storage_part_runs_tiny_and_reports_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The storage part (issue 30) end to end on a Redis of its own (it
    flushes it), shortened: every row is there, every cost was read from
    the Redis it ran on (not zero, not NaN), the reader saw every message
    once, and the reclaim reports what became of the expired messages'
    memory. Nothing about speed is asserted."""
    short = {"SHORT_TTLS": (1, 2), "PLATEAU_S": 2.0, "RECLAIM_WAIT_S": 6.0,
             "RECLAIM_POSTS": 20, "PLATEAU_POSTS": 20, "POLL_S": 0.2,
             "WARM_WAIT_S": storage.WARM_LOOKS_S}  # fmt: skip
    for name, value in short.items():
        monkeypatch.setattr(storage, name, value)
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    try:
        suite = StorageFakeSuite(tmp_path, server)
        storage.part_storage(suite)
    finally:
        server.stop()
    rows = dict(suite.rows)
    variants = [f"{layout}_{driver}" for layout, driver in storage.VARIANTS]
    assert {v.split("_")[0] for v in variants} == {"records", "segments"}
    for label in ("Redis CPU per 1-message post, us",
                  "Redis CPU per 1-message post, one in flight, us",
                  "Redis CPU per batch of 100, us",
                  "Redis CPU per page of 10, us", "Redis CPU per worst page, us",
                  "Redis CPU per page of 10, against the stream paged over HTTP, us",
                  "hot-queue ceiling, messages/s"):  # fmt: skip
        row = rows[f"storage: {label}"]
        for key in ("stream", *variants, *(f"ratio_{v}" for v in variants)):
            assert float(row[key]) > 0, (label, key, row)
    # 200 messages in segments are ≈ 33 KB: the keyspace's own tables grow and
    # shrink by as much (a run saw -35 B a message), so memory is read, not judged
    row = rows["storage: memory per message (100 B body), bytes"]
    for key in ("stream", *variants, *(f"ratio_{v}" for v in variants)):
        assert math.isfinite(float(row[key])), (key, row)
    assert float(row["records_lua"]) > 0
    for variant in variants:
        run = rows[f"storage: run ({variant})"]
        assert run["errors"] == 0
        assert run["written_in"] in ("records", variant.split("_")[0])
        # one message the part posts first, then the 200 measured, each read once
        assert run["seen"] == 201
        assert run["pages"] == math.ceil(201 / 10) + 1  # and the empty page at the end
        stats = rows[f"storage: commandstats per post ({variant})"]
        # a script per post, or a transaction per few (the watch driver combines posts)
        assert float(stats.get("evalsha_calls", 0)) + float(stats.get("exec_calls", 0)) > 0
    assert rows["storage: run (segments_lua)"]["written_in"] == "segments"
    # the records layout indexes each message in two sorted sets
    assert float(rows["storage: commandstats per post (records_lua)"]["evalsha_calls"]) >= 1
    assert float(rows["storage: commandstats per post (records_watch)"]["zadd_calls"]) >= 2
    assert rows["storage: commandstats per XADD (stream)"]["xadd_calls"] == 1
    worst = rows["storage: Redis CPU per worst page, us"]
    for variant in variants:
        assert worst[f"shown_{variant}"] == 50 // 2 + 1  # the delayed half is passed over
    for size in ("1 KiB", "10 KiB"):
        row = rows[f"storage: memory per message ({size} body), bytes"]
        assert float(row["stream"]) > int(size.split()[0]) * 1024 * 0.9
        assert float(row["ratio_records"]) > 0 and float(row["ratio_segments"]) > 0
    assert float(rows["storage: seconds taken"]["total"]) > 0
    for layout in storage.LAYOUTS:
        reclaim = rows[f"storage: expiry reclaim ({layout}, lua)"]
        assert reclaim["messages"] == 200 and reclaim["errors"] == 0
        if layout == "records":
            # 200 records (≈ 150 KB) stand above Redis's own memory noise; 200
            # messages in segments (≈ 33 KB) do not (CI saw the peak 57 KB
            # below the start): reported, not judged at this size
            assert int(reclaim["peak_bytes"]) > int(reclaim["start_bytes"])
        # what share stays held is a measurement of the machine's allocator at
        # 200 messages (CI saw 62.6 % after posts against 52.0 % idle): reported,
        # not judged here
        assert {"end_held_pct", "idle_held_pct"} <= reclaim.keys()
        float(reclaim["end_held_pct"]), float(reclaim["idle_held_pct"])
        # the warm-up ran every command the run did before the start was read
        assert reclaim["unwarmed_commands"] == "none", reclaim
        assert float(reclaim["warm_up_s"]) >= storage.WARM_LOOKS_S


def test_the_reclaims_idle_wait_goes_on_while_memory_still_falls() -> None:
    """Any new low starts the plateau's span again: memory falling by a few
    bytes a reading never ends the wait; only a span with no new low does."""
    plateau = storage.Plateau(1_000_000, 0.0, 10.0)
    at, memory = 0.0, 1_000_000
    while at < 60:
        at, memory = at + 0.5, memory - 8
        assert not plateau.reached(memory, at)
    assert not plateau.reached(memory + 100, at + 9.5)  # noise above the low
    assert plateau.reached(memory, at + 10)
    assert not plateau.reached(memory - 1, at + 10.5)  # a new low: the span again


class StorageFakeSuite(FakeSuite):
    def __init__(self, workdir: Path, redis: RedisServer) -> None:
        super().__init__(workdir)
        self.redis = redis
        self.storage_messages = 200
        self.storage_reclaim = 200


@pytest.mark.process
@pytest.mark.parametrize("kind", [storage_layout.PackedLayout, storage_layout.Layout])
def test_the_proposed_layouts_prototype_reads_every_message_once(
    tmp_path: Path, kind: type[storage_layout.Layout]
) -> None:
    """bench/storage_layout.py's numbers stand for the proposal only while
    its scripts do the proposal's work: posts one by one and 100 at a time
    across segment boundaries, then a reader following the markers sees
    every message once, in post order (the packed layout's thin read too);
    with echo off it sees none of its own; a sweep after expiry keeps the
    live messages readable and drops the expired ones."""
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        ours = kind(client, "t")
        ours.post([storage_layout.messages(1, 100)], 1)
        ours.post([[m] for m in storage_layout.messages(149, 100)], 32)
        ours.post([storage_layout.messages(100, 100), storage_layout.messages(50, 100)], 2)
        assert ours.page_all() == (31, 300)  # 30 full pages, then an empty one
        if isinstance(ours, storage_layout.PackedLayout):
            assert ours.page_all_thin() == (31, 300)
        own = kind(client, "own")
        own.post([storage_layout.messages(30, 100)], 1, client=READER)
        assert own.page_all() == (1, 0)
        assert own.page_all(("1", "0", "0")) == (4, 30)
        mixed = kind(client, "mixed")
        short = [(1, 0, b'{"n":%d}' % i) for i in range(120)]
        long = [(3600, 0, b'{"n":%d}' % i) for i in range(120, 130)]
        mixed.post([short[:60], long, short[60:]], 1)
        time.sleep(1.2)
        while mixed.sweep()[0] not in (b"", ""):
            pass
        # the long-lived messages' reviews, due now rather than in 30 s
        reviews = cast("list[bytes]", client.zrange(mixed.keys[2], 0, -1))
        client.zadd(mixed.keys[2], dict.fromkeys(reviews, 0))
        while mixed.sweep()[0] not in (b"", ""):
            pass
        if isinstance(mixed, storage_layout.PackedLayout):  # the streams variant keeps no count
            assert int(client.hget(mixed.keys[0], "gone") or 0) == 120  # swept, not just hidden
        assert mixed.page_all() == (2, 10)
    finally:
        client.close()
        server.stop()


class WrkFakeSuite(FakeSuite):
    def __init__(self, workdir: Path, redis: RedisServer) -> None:
        super().__init__(workdir)
        self.redis = redis
        self.duration = 1.0
        self.rounds = 1
        self.connections = 2


@pytest.mark.process
def test_the_groups_part_runs_tiny_and_reports_both_ratios_for_both_drivers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The groups part (issue 32 point 4) end to end, a second a run: for
    each driver a row per comparison with its ratios, made of claims that
    returned messages (the claimers read the ids of what they claimed, so
    they could delete it) and no error; the lua driver keeps the probe off
    the held group. Nothing about speed is asserted."""
    short = {"CLAIMERS": 2, "WARM_UP_BACKLOG": 2000, "HOT_BACKLOG": 50, "GROUPS": 40,
             "HOT_OTHERS": 8}  # fmt: skip
    for name, value in short.items():
        monkeypatch.setattr(groups, name, value)
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    try:
        suite = WrkFakeSuite(tmp_path, server)
        groups.part_groups(suite)
    finally:
        server.stop()
    rows = dict(suite.rows)
    assert len(rows) == len(suite.rows) == 4
    for driver in ("lua", "watch"):
        for name in ("claims: 1,000 groups / ungrouped",
                     "claims: others of a held hot group / 1,000 groups"):  # fmt: skip
            row = rows[f"{name} ({driver})"]
            assert row["errors"] == 0, row
            if driver == "lua":  # the probe beside the held group reads the service right
                assert row["groups_honoured"] is True, row
            for key in ("ratio", "cpu_ratio", "cpu_us", "under_cpu_us"):
                assert 0 < float(row[key]) < math.inf, (key, row)
            for of in ("", "under_"):
                claims, claimed = float(row[f"{of}claims_s"]), float(row[f"{of}messages_s"])
                assert 0 < claimed / claims <= groups.LIMIT + 1e-9, row


def test_each_storage_variant_is_divided_by_the_stream_measured_beside_it() -> None:
    """A ratio uses the anchor measured just before and after its own
    variant, not one measured minutes earlier: drift stays out of it."""
    keys = storage.ANCHORED
    early, middle, late = ({k: v for k in keys} for v in (2.0, 4.0, 6.0))
    anchors = {"a": storage.beside(early, middle), "b": storage.beside(middle, late)}
    assert anchors["a"]["post_us"] == 3.0 and anchors["b"]["post_us"] == 5.0
    row = storage.side_by_side({"a": {"post_us": 30.0}, "b": {"post_us": 30.0}}, "post_us", anchors)
    assert row["ratio_a"] == 10.0 and row["ratio_b"] == 6.0
    assert row["stream"] == 4.0
