"""Live followers under load: the ``idle`` and ``fanout`` parts of ``python -m bench``.

``idle``: 10,000 Server-Sent Event followers of one queue, held open by two
client processes (bench/sse_client.py) against one ``feedsvc serve``
process, with heartbeats every 2 s so that the window sees them: the
service's RSS per follower (psutil, RSS after minus before, divided by the
followers) and the Redis commands per second while they wait (``INFO
commandstats`` over 10 s). The same 10,000 streams against the bare aiohttp
loop (bench/fanout_server.py) give the RSS of an idle bare stream, side by
side.

``fanout``: 1,000 followers of one queue and one producer posting one
message per POST, in order (stamped with its counter and the time it was
sent), at 20 messages/s (20,000 deliveries/s), then at rates raised by half
each step while delivery keeps up and the producer reaches its rate. A step
is *sustained* when the followers got (within a second of the step's end)
at least 99 % of the events posted in its window (posts x followers), the
p99 post-to-delivery latency is under 1 s and no stream was cut off for
being too slow; a producer that cannot reach 90 % of the rate asked means
the service is saturated (its POSTs wait behind the fan-out). Per step:
deliveries/s, latency p50/p99, the list reads the service made per posted
message (``INFO commandstats``: EVALSHA calls minus the posts' own,
measured first with nobody following), gaps and repeats (checked per
stream by the client). Then the same 1,000 streams against the bare loop,
paced at 20 events/s (the latency the clients and the machine add at that
load) and writing as fast as it can: the ceiling, and the ratio of the
highest sustained rate to it.

Everything (service, Redis, clients, the bare server, the producer) shares
the machine's cores; each row says how much CPU each used, and ``other``
the rest of the machine. Each part first waits (up to 2 minutes) for the
machine to be idle.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import redis

from bench.machine import CpuWindow, raise_open_files_limit, stop_process, wait_for_idle
from bench.service import Service, SuiteLike
from feedsvc.embedded_redis.server import pick_free_port

HERE = Path(__file__).resolve().parent
CLIENT_ID = "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d"
PRODUCER_ID = "1b9d6bcd-bbfd-4b2d-9b5d-ab8dfbbd4bed"
PROJECT = "bench-live"
IDLE_FOLLOWERS = 10_000
IDLE_WINDOW_S = 10.0
FANOUT_FOLLOWERS = 1_000
CLIENT_PROCESSES = 2
FIRST_RATE = 20.0
RATE_STEP = 1.5
MAX_RATE = 2_000.0
SETTLE_S = 1.0
MEASURE_S = 5.0
GRACE_S = 1.0


# -- processes -------------------------------------------------------------------


class Clients:
    """sse_client processes sharing ``total`` streams of one URL path."""

    def __init__(self, port: int, path: str, total: int, processes: int = CLIENT_PROCESSES) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        headers = [f"Client-ID: {CLIENT_ID}", f"X-Project-ID: {PROJECT}"]
        share = [total // processes + (i < total % processes) for i in range(processes)]
        for count in share:
            command = [
                sys.executable,
                "-m",
                "bench.sse_client",
                "--port",
                str(port),
                "--path",
                path,
                "--connections",
                str(count),
                "--max-seconds",
                "900",
            ]
            command += [a for h in headers for a in ("--header", h)]  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    command,
                    cwd=HERE.parent,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _answer(self, proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"sse_client {proc.pid} did not answer in {timeout:g} s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sse_client {proc.pid} exited ({proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _ask(self, command: str, timeout: float) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return [self._answer(proc, timeout) for proc in self.procs]

    def ready(self, timeout: float = 120.0) -> tuple[int, int, list[str]]:
        answers = [self._answer(p, timeout) for p in self.procs]
        examples = [e for a in answers for e in a["failure_examples"]]
        return sum(a["ready"] for a in answers), sum(a["failed"] for a in answers), examples

    def report(self, t0: float, t1: float, workdir: Path) -> dict[str, Any]:
        paths = [workdir / f"latencies-{p.pid}.f64" for p in self.procs]
        answers = [
            self._ask_one(p, f"report {t0!r} {t1!r} {path}")
            for p, path in zip(self.procs, paths, strict=True)
        ]
        latencies = np.concatenate([np.fromfile(path, dtype=np.float64) for path in paths])
        for path in paths:
            path.unlink()
        total = {k: sum(a[k] for a in answers) for k in answers[0]}
        return {**total, "latencies": latencies}

    def _ask_one(self, proc: subprocess.Popen[str], command: str) -> dict[str, Any]:
        assert proc.stdin is not None
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        return self._answer(proc, 60)

    def stop(self) -> dict[str, Any]:
        answers = self._ask("stop", 60)
        for proc in self.procs:
            proc.wait(timeout=30)
        last = [n for a in answers for n in a["last_n"]]
        counts = ("events", "gaps", "repeats", "reconnects", "heartbeats", "failures")
        summed = {k: sum(a[k] for a in answers) for k in counts}
        return {**summed, "last_n": last}

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


@contextlib.contextmanager
def clients(port: int, path: str, total: int) -> Iterator[Clients]:
    group = Clients(port, path, total)
    try:
        yield group
    finally:
        group.kill()


@contextlib.contextmanager
def bare_server(workdir: Path) -> Iterator[tuple[int, int]]:
    """bench/fanout_server.py on a free port: (port, pid)."""
    with bench_server(workdir, "fanout_server", "/streams") as started:
        yield started


@contextlib.contextmanager
def bench_server(workdir: Path, module: str, probe: str) -> Iterator[tuple[int, int]]:
    """``python -m bench.<module> PORT`` on a free port of 127.0.0.1, ready
    once GET probe answers: (port, pid). Stopped on exit."""
    port = pick_free_port()
    with (workdir / f"{module}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"bench.{module}", str(port)],
            cwd=HERE.parent,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                get_json(f"http://127.0.0.1:{port}{probe}")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"bench.{module} did not start") from None
                time.sleep(0.05)
        yield port, proc.pid
    finally:
        stop_process(proc)


def get_json(url: str, method: str = "GET", timeout: float = 10) -> Any:
    request = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


# -- measuring -------------------------------------------------------------------


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def commandstats(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    calls.pop("info", None)  # ours
    return calls


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def ms(latencies: np.ndarray[Any, Any], q: float) -> float:
    if latencies.size == 0:
        return float("nan")
    return float(np.percentile(latencies, q) * 1000)


class Producer:
    """One producer posting one stamped message per POST, in order, on one connection."""

    def __init__(self, port: int, queue: str, pad: int = 0) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.path = f"/v2/queues/{queue}/messages"
        self.headers = {"Client-ID": PRODUCER_ID, "X-Project-ID": PROJECT,
                        "Content-Type": "application/json"}  # fmt: skip
        self.pad = "x" * pad
        self.n = 0
        self.failures = 0

    def post(self) -> bool:
        self.n += 1
        body = json.dumps({"messages": [{"body": {"n": self.n, "t": time.time(), "x": self.pad}}]})
        self.conn.request("POST", self.path, body, self.headers)
        response = self.conn.getresponse()
        response.read()
        if response.status != 201:
            self.failures += 1
            self.n -= 1  # not stored (503s only; a timeout would raise): the counter stays dense
            return False
        return True

    def run(self, rate: float, seconds: float, took: list[float] | None = None) -> list[float]:
        """Post at ``rate`` (``inf``: back to back) for ``seconds`` (back to
        back if the service is slower); the send time of every acknowledged
        post. ``took`` gets the seconds each acknowledged POST took."""
        sent: list[float] = []
        interval = 1.0 / rate
        start = time.perf_counter()
        due = start
        while (now := time.perf_counter()) < start + seconds:
            if now < due:
                time.sleep(due - now)
            at = time.time()
            began = time.perf_counter()
            if self.post():
                sent.append(at)
                if took is not None:
                    took.append(time.perf_counter() - began)
            due += interval
        return sent

    def close(self) -> None:
        self.conn.close()


@dataclass
class Step:
    rate: float
    posted_per_s: float
    deliveries_per_s: float
    delivered_fraction: float
    p50_ms: float
    p99_ms: float
    reads_per_post: float
    gaps: int
    repeats: int
    reconnects: int
    cpu: dict[str, float]

    @property
    def sustained(self) -> bool:
        """Delivery kept up with what was posted: nearly all of it delivered,
        promptly, and no stream cut off for being too slow."""
        return self.delivered_fraction >= 0.99 and self.p99_ms < 1000 and self.reconnects == 0

    @property
    def rate_reached(self) -> bool:
        """The producer posted at 90 % of the rate asked (else the service,
        busy, answered its POSTs too slowly: it is saturated)."""
        return self.posted_per_s >= 0.9 * self.rate


# -- the parts -------------------------------------------------------------------


def part_idle(suite: SuiteLike) -> None:
    limit = raise_open_files_limit()
    wait_for_idle()
    followers = IDLE_FOLLOWERS
    if limit < followers + 500:
        suite.add("idle SSE followers", skipped=f"open files limit {limit} < {followers + 500}")
        return
    workdir = suite.workdir
    path = "/v2/queues/idle/messages"
    redis_client = redis.Redis.from_url(suite.redis.url)
    # a closed stream is noticed at its next write: room for the warm-up's
    flags = ("--stream-heartbeat", "2", "--max-followers", str(followers + 100))
    with Service(suite.redis.url, workdir / "feedsvc-idle.log", *flags) as svc:
        with clients(svc.port, path, 1) as warm:  # the first stream's one-off costs
            warm.ready()
            warm.stop()
        time.sleep(1)
        before = rss(svc.pid)
        with clients(svc.port, path, followers) as group:
            ok, failed, examples = group.ready()
            time.sleep(5)  # settle
            cpu = CpuWindow({"feedsvc": [svc.pid], "redis": [suite.redis.pid or 0],
                             "clients": group.pids})  # fmt: skip
            stats0 = commandstats(redis_client)
            beats0 = group.report(0, 0, workdir)["heartbeats"]
            cpu.start()
            time.sleep(IDLE_WINDOW_S)
            seconds = cpu.stop()
            beats = group.report(0, 0, workdir)["heartbeats"] - beats0
            idle_commands = delta(commandstats(redis_client), stats0)
            after = rss(svc.pid)
            group.stop()
    redis_client.close()
    with bare_server(workdir) as (port, pid):
        with clients(port, "/stream", 1) as warm:
            warm.ready()
            warm.stop()
        time.sleep(1)
        bare_before = rss(pid)
        with clients(port, "/stream", followers) as group:
            bare_ok, bare_failed, _ = group.ready()
            time.sleep(5)
            bare_after = rss(pid)
            group.stop()
    per_follower = (after - before) / max(1, ok) / 1024
    per_bare = (bare_after - bare_before) / max(1, bare_ok) / 1024
    suite.add(
        "idle SSE followers (feedsvc)",
        followers=ok,
        failed=failed,
        rss_before_mib=before / 2**20,
        rss_after_mib=after / 2**20,
        kib_per_follower=per_follower,
        redis_cmds_per_s=sum(idle_commands.values()) / IDLE_WINDOW_S,
        redis_cmds=json.dumps(idle_commands) if idle_commands else "none",
        heartbeats_per_s=beats / IDLE_WINDOW_S,
        feedsvc_cpu_pct=seconds["feedsvc"],
        redis_cpu_pct=seconds["redis"],
        other_cpu_pct=seconds["other"],
    )
    suite.add(
        "idle SSE streams (bare aiohttp)",
        streams=bare_ok,
        failed=bare_failed,
        kib_per_stream=per_bare,
        feedsvc_over_bare=per_follower / per_bare if per_bare else float("nan"),
    )
    if examples:
        print(f"   failures: {examples}", flush=True)


@dataclass
class Fanout:
    """The feedsvc side of a fan-out run: the clients, the producer, the counters."""

    group: Clients
    producer: Producer
    redis: redis.Redis
    per_post: dict[str, float]
    streams: int
    groups: dict[str, list[int]]
    workdir: Path
    seen: dict[str, int]

    def step(self, rate: float) -> Step:
        """Post at ``rate`` (a settling second, then the measured window) and judge it."""
        self.producer.run(rate, SETTLE_S)
        cpu = CpuWindow(self.groups)
        stats0 = commandstats(self.redis)
        cpu.start()
        t0 = time.time()
        sent = self.producer.run(rate, MEASURE_S)
        t1 = time.time()
        stats1 = commandstats(self.redis)
        percent = cpu.stop()
        time.sleep(GRACE_S)
        got = self.group.report(t0, t1, self.workdir)
        posted = len(sent)
        lists = delta(stats1, stats0).get("evalsha", 0) - posted * self.per_post["evalsha"]
        counts = {k: got[k] - self.seen.get(k, 0) for k in ("gaps", "repeats", "reconnects")}
        self.seen.update({k: got[k] for k in counts})
        return Step(
            rate=rate,
            posted_per_s=posted / (t1 - t0),
            deliveries_per_s=got["events"] / (t1 - t0),
            delivered_fraction=got["events"] / max(1, posted * self.streams),
            p50_ms=ms(got["latencies"], 50),
            p99_ms=ms(got["latencies"], 99),
            reads_per_post=lists / max(1, posted),
            gaps=counts["gaps"],
            repeats=counts["repeats"],
            reconnects=counts["reconnects"],
            cpu=percent,
        )


def rates_until_behind(run: Callable[[float], Step]) -> list[Step]:
    """FIRST_RATE, then half as much again each step while delivery keeps up
    and the producer reaches its rate. A step that did not keep up is tried
    once more midway between the last good rate and it."""
    steps: list[Step] = []
    rate = FIRST_RATE
    while rate <= MAX_RATE:
        step = run(rate)
        steps.append(step)
        if not step.sustained:
            good = [s.rate for s in steps if s.sustained]
            if good and rate / good[-1] > 1.2:
                steps.append(run(round((good[-1] + rate) / 2)))
            break
        if not step.rate_reached:
            break
        rate = round(rate * RATE_STEP)
    return steps


def part_fanout(suite: SuiteLike) -> None:
    raise_open_files_limit()
    wait_for_idle()
    followers = FANOUT_FOLLOWERS
    queue = "fan-" + uuid.uuid4().hex[:8]
    redis_client = redis.Redis.from_url(suite.redis.url)
    with Service(suite.redis.url, suite.workdir / "feedsvc-fanout.log") as svc:
        per_post = post_cost(svc.port, redis_client)
        producer = Producer(svc.port, queue)
        with clients(svc.port, f"/v2/queues/{queue}/messages?echo=true", followers) as group:
            ok, failed, examples = group.ready()
            if failed:
                print(f"   {failed} streams failed: {examples}", flush=True)
            groups = {"feedsvc": [svc.pid], "redis": [suite.redis.pid or 0],
                      "clients": group.pids}  # fmt: skip
            fanout = Fanout(group, producer, redis_client, per_post, ok, groups, suite.workdir, {})

            def run(rate: float) -> Step:
                step = fanout.step(rate)
                suite.add(
                    f"fan-out {followers} x {rate:g} msg/s",
                    posted_per_s=step.posted_per_s,
                    deliveries_per_s=step.deliveries_per_s,
                    delivered=step.delivered_fraction,
                    p50_ms=step.p50_ms,
                    p99_ms=step.p99_ms,
                    reads_per_post=step.reads_per_post,
                    gaps=step.gaps,
                    repeats=step.repeats,
                    reconnects=step.reconnects,
                    sustained=step.sustained,
                    rate_reached=step.rate_reached,
                    feedsvc_cpu=step.cpu["feedsvc"],
                    redis_cpu=step.cpu["redis"],
                    clients_cpu=step.cpu["clients"],
                    other_cpu=step.cpu["other"],
                )
                return step

            steps = rates_until_behind(run)
            time.sleep(GRACE_S)
            totals = group.stop()
        producer.close()
    redis_client.close()
    behind = sum(1 for n in totals["last_n"] if n < producer.n)
    paced, flat_out = bare_fanout(suite, followers)
    sustained = [s for s in steps if s.sustained]
    best = max((s.deliveries_per_s for s in sustained), default=0.0)
    peak = max((s.deliveries_per_s for s in steps), default=0.0)
    first = steps[0] if steps else None
    ceiling = flat_out["deliveries_per_s"]
    suite.add(
        f"fan-out {followers} followers: summary",
        p99_ms_at_20=first.p99_ms if first else float("nan"),
        bare_p99_ms_at_20=paced["p99_ms"],
        reads_per_post_at_20=first.reads_per_post if first else float("nan"),
        highest_sustained_per_s=best,
        peak_delivered_per_s=peak,
        bare_per_s=ceiling,
        ratio=best / ceiling if ceiling else float("nan"),
        gaps=totals["gaps"],
        repeats=totals["repeats"],
        reconnects=totals["reconnects"],
        streams_behind_at_end=behind,
        post_failures=producer.failures,
    )


def bare_fanout(suite: SuiteLike, streams: int) -> tuple[dict[str, float], dict[str, float]]:
    """The bare loop to the same number of streams: paced at FIRST_RATE
    events/s (latency at the same load), then as fast as it goes (the ceiling)."""
    rows = []
    wait_for_idle()
    with (
        bare_server(suite.workdir) as (port, pid),
        clients(port, "/stream", streams) as group,
    ):
        ok, _, _ = group.ready()
        for label, rate in (("20/s", FIRST_RATE), ("flat out", 0.0)):
            cpu = CpuWindow({"bare": [pid], "clients": group.pids})
            cpu.start()
            t0 = time.time()
            url = f"http://127.0.0.1:{port}/fire?seconds={MEASURE_S}&rate={rate}"
            fired = get_json(url, "POST", 60)
            t1 = time.time()
            percent = cpu.stop()
            time.sleep(GRACE_S)
            got = group.report(t0, t1, suite.workdir)
            row = {
                "deliveries_per_s": got["arrived"] / (t1 - t0),
                "delivered": got["events"] / max(1, fired["writes"]),
                "p50_ms": ms(got["latencies"], 50),
                "p99_ms": ms(got["latencies"], 99),
                "gaps": got["gaps"],
                "repeats": got["repeats"],
                "bare_cpu": percent["bare"],
                "clients_cpu": percent["clients"],
                "other_cpu": percent["other"],
            }
            suite.add(f"bare loop {ok} streams, {label}", **row,
                      event_bytes=fired["event_bytes"])  # fmt: skip
            rows.append(row)
        group.stop()
    return rows[0], rows[1]


def post_cost(port: int, client: redis.Redis, posts: int = 100) -> dict[str, float]:
    """Redis commands of one POST with nobody following (to take off later)."""
    producer = Producer(port, "calibration-" + uuid.uuid4().hex[:8])
    try:
        producer.post()  # creates the queue
        before = commandstats(client)
        for _ in range(posts):
            producer.post()
        used = delta(commandstats(client), before)
    finally:
        producer.close()
    return {k: used.get(k, 0) / posts for k in ("evalsha", "zrangebyscore")}


WAKE_ROUNDS = 300


def part_wake(suite: SuiteLike) -> None:
    """A long poll's wake-up: a waiter holds ``GET ...?wait=10`` (on its own
    connection, in a thread) while the producer posts one message; per
    round, the post's own latency (sent → 201) and the waiter's (sent → its
    page). "Beyond the post" is the waiter's answer after the post's,
    per round (negative when the page came first); the goal is its p50."""
    import threading

    wait_for_idle()
    queue = "wake"
    with Service(suite.redis.url, suite.workdir / "feedsvc-wake.log") as svc:
        producer = Producer(svc.port, queue)
        poller = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=30)
        headers = {"Client-ID": CLIENT_ID, "X-Project-ID": PROJECT}
        producer.post()  # the queue exists; the waiter starts after this message
        marker: str | None = None
        path = f"/v2/queues/{queue}/messages?limit=1"
        first = json.loads(_get(poller, path, headers))
        marker = first["links"][0]["href"].rsplit("marker=", 1)[1].split("&")[0]
        post_ms: list[float] = []
        page_ms: list[float] = []
        beyond_ms: list[float] = []
        empty = 0
        for _ in range(WAKE_ROUNDS):
            got: dict[str, Any] = {}

            def wait(m: str | None = marker, got: dict[str, Any] = got) -> None:
                got["page"] = json.loads(_get(poller, f"{path}&wait=10&marker={m}", headers))
                got["at"] = time.perf_counter()

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.02)  # the waiter is waiting (if not, its first read finds the post)
            sent = time.perf_counter()
            producer.post()
            posted = time.perf_counter()
            waiter.join(15)
            page = got.get("page") or {}
            if not page.get("messages"):
                empty += 1
                continue
            marker = page["links"][0]["href"].rsplit("marker=", 1)[1].split("&")[0]
            post_ms.append((posted - sent) * 1000)
            page_ms.append((got["at"] - sent) * 1000)
            beyond_ms.append((got["at"] - posted) * 1000)
        producer.close()
        poller.close()
    post, page, beyond = (np.array(x) / 1000 for x in (post_ms, page_ms, beyond_ms))
    suite.add(
        "long poll woken by a post",
        rounds=len(post_ms),
        empty=empty,
        post_p50_ms=ms(post, 50),
        post_p99_ms=ms(post, 99),
        woken_p50_ms=ms(page, 50),
        woken_p99_ms=ms(page, 99),
        beyond_post_p50_ms=ms(beyond, 50),
        beyond_post_p99_ms=ms(beyond, 99),
    )


def _get(conn: http.client.HTTPConnection, path: str, headers: dict[str, str]) -> bytes:
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    return response.read()
