"""The speed suite: start Redis and feedsvc, drive them with wrk, print ratios.

Every number is a ratio measured side by side in one run: each target is
measured right after the hello-JSON baseline (``GET /bench/hello``, same
process, same event loop, no Redis), several times, and the median of the
pairwise ratios is reported. Absolute req/s on a shared 2-core machine are
noise; ratios are what to read.

    python -m bench                      # every part
    python -m bench post get             # some parts
    python -m bench --duration 3 --rounds 1 post

Parts: post, get, floor (a POST and a GET with every feature switched
off, bench/bare_feed.py, beside the bare hello and feedsvc), ladder (what a
POST and a GET cost above hello, rung by rung), loop, workers
(``--workers 2`` against 1), zaqar (real Zaqar side by side;
bench/zaqar.py), pool (5,000 against 100 clients at half the highest
rate), batch (messages/s at 1 to 1000 per POST; these
three in bench/capacity.py), coalesce, drivers, cluster (a local 3-primary
Redis Cluster), rtt (needs root: network namespace + tc netem), idle and
fanout (live followers over SSE; bench/live.py), wake (a long poll woken
by a post), webhook (a subscription's webhook deliveries;
bench/webhook.py), auth (POST and GET with a JWT against none;
bench/auth.py), ratelimit (POST and GET with --project-rate against
without, side by side), tracing (POST and GET with OpenTelemetry spans
exported against tracing off; bench/tracing.py), storage (what a message
costs Redis in memory and CPU in each storage layout against a Redis Stream
entry, the expiry reclaim and the hot-queue ceiling; bench/storage.py), groups (claims
over 1,000 ordered groups against an ungrouped queue, and beside a held hot
group; bench/groups.py). Needs ``wrk`` on PATH
(Debian: apt install wrk).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from bench.service import Service, WrkResult, median_round, service, serving, wait_port, wrk
from bench.zaqar import DEFAULT_HOME as DEFAULT_ZAQAR_HOME
from feedsvc.embedded_redis.server import RedisServer

HERE = Path(__file__).resolve().parent
READER = "d1d3e5c2-86a6-4a5e-9c7b-3c8a4d1f0b11"
NETNS = "feedsvc-bench"
#: --project-rate of the ratelimit part: above what one machine serves
RATE_LIMIT_BENCH = 100000


@dataclass
class Row:
    name: str
    values: dict[str, str] = field(default_factory=dict)


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.duration: float = args.duration
        self.rounds: int = args.rounds
        self.connections: int = args.connections
        self.zaqar_home: Path = args.zaqar_home
        self.storage_messages: int = args.storage_messages
        self.storage_reclaim: int = args.storage_reclaim
        self.workdir = Path(tempfile.mkdtemp(prefix="feedsvc-bench-"))
        self.redis = RedisServer(self.workdir / "redis", appendonly=False)
        self.rows: list[Row] = []

    def paired(
        self, svc: Service, script: str | None, path: str, connections: int | None = None
    ) -> tuple[WrkResult, WrkResult, float]:
        """Median over rounds of target/hello, measured back to back."""
        c = connections or self.connections
        rounds = []
        for _ in range(self.rounds):
            hello = wrk(svc.url + "/bench/hello", None, c, self.duration)
            rounds.append((hello, wrk(svc.url + path, script, c, self.duration)))
        (hello, target), ratio = median_round(rounds, lambda r: r[1].rps / r[0].rps)
        return hello, target, ratio

    def paired_with_bare(
        self, svc: Service, bare_url: str, script: str, path: str
    ) -> tuple[WrkResult, WrkResult, float, WrkResult, float]:
        """paired(), with the bare hello (bench/bare_hello.py) measured in each
        round too: (hello, target, median target/hello, bare hello, median
        target/bare hello). hello and target are the runs of the round whose
        target/hello is the median, bare hello that of the round whose
        target/bare is: they may be different rounds."""
        c = self.connections
        rounds: list[tuple[WrkResult, WrkResult, WrkResult]] = []
        for _ in range(self.rounds):
            bare = wrk(bare_url + "/bench/hello", None, c, self.duration)
            hello = wrk(svc.url + "/bench/hello", None, c, self.duration)
            target = wrk(svc.url + path, script, c, self.duration)
            rounds.append((bare, hello, target))
        (_, hello, target), ratio = median_round(rounds, lambda r: r[2].rps / r[1].rps)
        (bare, _, _), ratio_bare = median_round(rounds, lambda r: r[2].rps / r[0].rps)
        return hello, target, ratio, bare, ratio_bare

    def add(self, name: str, **values: object) -> None:
        row = Row(
            name, {k: (f"{v:.2f}" if isinstance(v, float) else str(v)) for k, v in values.items()}
        )
        self.rows.append(row)
        print(f"{name:<34} " + "  ".join(f"{k}={v}" for k, v in row.values.items()), flush=True)

    # -- parts ---------------------------------------------------------------

    def part_post(self) -> None:
        with bare_hello() as bare_url, service(self.redis.url, self.workdir) as svc:
            hello, post, ratio, bare, ratio_bare = self.paired_with_bare(
                svc, bare_url, "post.lua", "/v2/queues/bpost/messages"
            )
            self.add(
                "POST 1 message (lua)",
                rps=post.rps,
                hello_rps=hello.rps,
                ratio=ratio,
                bare_hello_rps=bare.rps,
                ratio_bare=ratio_bare,
                p50_ms=post.p50_ms,
                p99_ms=post.p99_ms,
                errors=post.errors,
            )

    def part_get(self) -> None:
        with bare_hello() as bare_url, service(self.redis.url, self.workdir) as svc:
            path = "/v2/queues/bget/messages?limit=10"
            hello, get, ratio, bare, ratio_bare = self.paired_with_bare(
                svc, bare_url, "get.lua", path
            )
            redis_us, cpu_us = self.get_costs(svc, path)
            self.add(
                "GET 10-message page (lua)",
                rps=get.rps,
                hello_rps=hello.rps,
                ratio=ratio,
                bare_hello_rps=bare.rps,
                ratio_bare=ratio_bare,
                p50_ms=get.p50_ms,
                p99_ms=get.p99_ms,
                errors=get.errors,
                redis_us_per_list=redis_us,
                feedsvc_cpu_us_per_get=cpu_us,
            )

    def part_floor(self) -> None:
        """What a POST and a GET could reach if every feature were free:
        bench/bare_feed.py (feedsvc's store and answers in a bare aiohttp
        application) beside the bare hello and feedsvc itself, one after
        the other in each round, against the queues the post and get parts
        use."""
        targets = [
            ("POST", "post.lua", "/v2/queues/bpost/messages"),
            ("GET", "get.lua", "/v2/queues/bget/messages?limit=10"),
        ]
        c, d = self.connections, self.duration
        with (
            bare_hello() as bare_url,
            bare_feed(self.redis.url) as floor_url,
            service(self.redis.url, self.workdir) as svc,
        ):
            rounds: list[dict[str, WrkResult]] = []
            for _ in range(self.rounds):
                runs = {"bare": wrk(bare_url + "/bench/hello", None, c, d)}
                for name, script, path in targets:
                    runs["floor " + name] = wrk(floor_url + path, script, c, d)
                    runs[name] = wrk(svc.url + path, script, c, d)
                rounds.append(runs)
        for name, _, _ in targets:
            floor, ratio_bare = median_round(rounds, _rps_ratio("floor " + name, "bare"))
            ours, ours_bare = median_round(rounds, _rps_ratio(name, "bare"))
            _, kept = median_round(rounds, _rps_ratio(name, "floor " + name))
            self.add(
                f"{name} floor, no features (lua)",
                rps=floor["floor " + name].rps,
                bare_hello_rps=floor["bare"].rps,
                ratio_bare=ratio_bare,
                feedsvc_rps=ours[name].rps,
                feedsvc_ratio_bare=ours_bare,
                feedsvc_of_floor=kept,
                errors=floor["floor " + name].errors,
            )

    def get_costs(self, svc: Service, path: str) -> tuple[float, float]:
        """What one GET of a page costs, over one more wrk run: Redis's time
        in the list script (INFO commandstats: the run's only EVALSHA) and
        the feedsvc process's CPU time, in µs per call."""
        client = redis.Redis.from_url(self.redis.url)
        try:
            client.config_resetstat()
            _, cpu_us = self.wrk_with_cpu(psutil.Process(svc.pid), svc.url + path, "get.lua")
            stats = client.info("commandstats").get("cmdstat_evalsha", {})
        finally:
            client.close()
        return float(stats.get("usec_per_call", 0.0)), cpu_us

    def wrk_with_cpu(
        self, proc: psutil.Process, url: str, script: str | None
    ) -> tuple[WrkResult, float]:
        """One wrk run, and proc's CPU time in µs per request it served."""
        before = proc.cpu_times()
        run = wrk(url, script, self.connections, self.duration)
        after = proc.cpu_times()
        cpu = (after.user + after.system) - (before.user + before.system)
        return run, cpu * 1e6 / max(run.requests, 1)

    #: The ladder's rungs: (label, path, wrk script), each one step nearer a
    #: real request than the one before it (handlers.bench_* say what each is)
    LADDER = (
        ("ladder: hello", "/bench/hello", None),
        ("ladder: hello + Redis PING", "/bench/ping", None),
        ("ladder: POST body, no Redis", "/bench/post", "post.lua"),
        ("ladder: POST 1 message", "/v2/queues/bpost/messages", "post.lua"),
        ("ladder: a page, no Redis", "/bench/page", None),
        ("ladder: GET 10-message page", "/v2/queues/bget/messages?limit=10", "get.lua"),
    )

    def part_ladder(self) -> None:
        """Where a POST's and a GET's cost above hello goes: each rung of
        LADDER in turn, every round, with the feedsvc process's CPU time per
        request; medians over rounds, ratios to the same round's hello."""
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in self.LADDER}
        with service(self.redis.url, self.workdir) as svc:
            proc = psutil.Process(svc.pid)
            for _ in range(self.rounds):
                hello_rps = 0.0
                for label, path, script in self.LADDER:
                    run, cpu_us = self.wrk_with_cpu(proc, svc.url + path, script)
                    assert run.errors == 0, f"{label}: {run.errors} errors"
                    hello_rps = hello_rps or run.rps
                    runs[label].append((run.rps / hello_rps, cpu_us))
        for label, measured in runs.items():
            self.add(
                label,
                ratio=statistics.median(r for r, _ in measured),
                cpu_us_per_request=statistics.median(c for _, c in measured),
            )

    def part_loop(self) -> None:
        results = {}
        for loop in ("uvloop", "asyncio"):
            with service(self.redis.url, self.workdir, "--loop", loop) as svc:
                results[loop] = [
                    wrk(
                        svc.url + "/v2/queues/bpost/messages",
                        "post.lua",
                        self.connections,
                        self.duration,
                    ).rps
                    for _ in range(self.rounds)
                ]
        uv, aio = statistics.median(results["uvloop"]), statistics.median(results["asyncio"])
        self.add("POST: uvloop vs asyncio", uvloop_rps=uv, asyncio_rps=aio, ratio=uv / aio)

    def part_ratelimit(self) -> None:
        """POST and GET with --project-rate against without, two services side
        by side (which goes first alternates by round). The rate is set above
        the load, so every request is checked and none refused: the cost of
        the check, not of refusals. Beside req/s (noisy on a shared machine),
        each service's CPU µs and Redis calls per request."""
        flags = ("--project-rate", str(RATE_LIMIT_BENCH))
        with (
            service(self.redis.url, self.workdir) as off,
            service(self.redis.url, self.workdir, *flags, log="feedsvc-rate.log") as on,
        ):
            for name, script, path in (
                ("POST 1 message", "post.lua", "/v2/queues/bpost/messages"),
                ("GET 10-message page", "get.lua", "/v2/queues/bget/messages?limit=10"),
            ):
                rounds = []
                for i in range(self.rounds):
                    runs = {}
                    for svc in (off, on) if i % 2 == 0 else (on, off):
                        calls = _redis_calls(svc)
                        run, cpu_us = self.wrk_with_cpu(
                            psutil.Process(svc.pid), svc.url + path, script
                        )
                        runs[svc.url] = (
                            run,
                            cpu_us,
                            (_redis_calls(svc) - calls) / max(run.requests, 1),
                        )
                    rounds.append((runs[off.url], runs[on.url]))
                (without, limited), ratio = median_round(
                    rounds, lambda r: r[1][0].rps / r[0][0].rps
                )
                self.add(
                    f"{name}: --project-rate / off",
                    rps_on=limited[0].rps,
                    rps_off=without[0].rps,
                    ratio=ratio,
                    cpu_us_on=statistics.median(r[1][1] for r in rounds),
                    cpu_us_off=statistics.median(r[0][1] for r in rounds),
                    redis_calls_on=statistics.median(r[1][2] for r in rounds),
                    redis_calls_off=statistics.median(r[0][2] for r in rounds),
                    errors_on=limited[0].errors,
                )

    def part_coalesce(self) -> None:
        for flag in ("--coalesce", "--no-coalesce"):
            with service(self.redis.url, self.workdir, flag) as svc:
                _, post, ratio = self.paired(svc, "post.lua", "/v2/queues/bco/messages")
                self.add(f"POST {flag}", rps=post.rps, ratio=ratio, p99_ms=post.p99_ms)

    def part_drivers(self, redis_url: str | None = None, label: str = "") -> None:
        url = redis_url or self.redis.url
        rps = {}
        for driver in ("lua", "watch", "watch-naive"):
            with service(url, self.workdir, "--driver", driver) as svc:
                result = wrk(
                    svc.url + "/v2/queues/bhot/messages",
                    "post.lua",
                    self.connections,
                    self.duration,
                )
                rps[driver] = result
                self.add(
                    f"POST hot queue {driver}{label}",
                    rps=result.rps,
                    p50_ms=result.p50_ms,
                    p99_ms=result.p99_ms,
                    errors=result.errors,
                )
        for other in ("watch", "watch-naive"):
            self.add(
                f"lua/{other}{label}",
                rps_ratio=rps["lua"].rps / rps[other].rps,
                p99_ratio=rps[other].p99_ms / rps["lua"].p99_ms,
            )

    def part_quotas(self) -> None:
        """POST with a project quota set (every post admitted by admit.lua:
        one more round trip) against the same service without, both on one
        Redis, run alternately in each round; the project has a few queues."""
        c, d = self.connections, self.duration
        path = "/v2/queues/bquota/messages"
        quota = ("--project-max-messages", "1000000000", "--project-max-queues", "100")
        with (
            service(self.redis.url, self.workdir) as off,
            service(self.redis.url, self.workdir, *quota, log="feedsvc-quota.log") as on,
        ):
            rounds: list[dict[str, WrkResult]] = []
            for _ in range(self.rounds):
                rounds.append(
                    {
                        "off": wrk(off.url + path, "post.lua", c, d),
                        "on": wrk(on.url + path, "post.lua", c, d),
                    }
                )
        runs, ratio = median_round(rounds, _rps_ratio("on", "off"))
        self.add(
            "POST with project quotas (lua)",
            rps=runs["on"].rps,
            off_rps=runs["off"].rps,
            ratio=ratio,
            p99_ms=runs["on"].p99_ms,
            off_p99_ms=runs["off"].p99_ms,
            errors=runs["on"].errors,
        )

    def part_cluster(self) -> None:
        """POST and GET on a local 3-primary Redis Cluster against the single
        server, each as a ratio to hello, both drivers. All processes share
        the machine's cores, so this shows the cluster path's overhead, not
        the capacity a cluster of real machines adds."""
        from feedsvc.testing.cluster import LocalCluster

        cluster = LocalCluster(self.workdir / "cluster")
        cluster.start()
        try:
            for driver in ("lua", "watch"):
                for path, script, what in (
                    ("/v2/queues/bpost/messages", "post.lua", "POST"),
                    ("/v2/queues/bget/messages?limit=10", "get.lua", "GET page"),
                ):
                    ratios, errors = {}, 0
                    for label, url in (("single", self.redis.url), ("cluster", cluster.url)):
                        with service(url, self.workdir, "--driver", driver) as svc:
                            _, result, ratios[label] = self.paired(svc, script, path)
                            errors += result.errors
                    self.add(
                        f"{what} {driver}: cluster vs single",
                        single_ratio=ratios["single"],
                        cluster_ratio=ratios["cluster"],
                        cluster_over_single=ratios["cluster"] / ratios["single"],
                        errors=errors,
                    )
        finally:
            cluster.stop()

    def part_rtt(self) -> None:
        """Redis behind 0.25 ms of round-trip time (tc netem in a network namespace)."""
        with service(self.redis.url, self.workdir) as svc:
            near = wrk(svc.url + "/v2/queues/brtt/messages", "post.lua", 1, self.duration)
            self.add(
                "POST, 1 client, local Redis (lua)",
                rps=near.rps,
                p50_ms=near.p50_ms,
                p99_ms=near.p99_ms,
            )
        with remote_redis(self.workdir) as url:
            with service(url, self.workdir) as svc:
                one = wrk(svc.url + "/v2/queues/brtt/messages", "post.lua", 1, self.duration)
                self.add(
                    "POST, 1 client, RTT 0.25 ms (lua)",
                    rps=one.rps,
                    p50_ms=one.p50_ms,
                    p99_ms=one.p99_ms,
                )
            self.part_drivers(url, label=" (RTT 0.25 ms)")

    def part_pool(self) -> None:
        from bench.capacity import part_pool

        part_pool(self)

    def part_batch(self) -> None:
        from bench.capacity import part_batch

        part_batch(self)

    def part_workers(self) -> None:
        from bench.capacity import part_workers

        part_workers(self)

    def part_zaqar(self) -> None:
        from bench.zaqar import part_zaqar

        part_zaqar(self, self.zaqar_home)

    def part_idle(self) -> None:
        from bench.live import part_idle

        part_idle(self)

    def part_fanout(self) -> None:
        from bench.live import part_fanout

        part_fanout(self)

    def part_wake(self) -> None:
        from bench.live import part_wake

        part_wake(self)

    def part_auth(self) -> None:
        from bench.auth import part_auth

        part_auth(self)

    def part_tracing(self) -> None:
        from bench.tracing import part_tracing

        part_tracing(self)

    def part_storage(self) -> None:
        from bench.storage import part_storage

        part_storage(self)

    def part_groups(self) -> None:
        from bench.groups import part_groups

        part_groups(self)

    def part_webhook(self) -> None:
        from bench.webhook import part_webhook

        part_webhook(self)

    def run(self, parts: Sequence[str]) -> None:
        self.redis.start()
        try:
            for part in parts:
                getattr(self, f"part_{part}")()
        finally:
            self.redis.stop()
        out = HERE / "results" / "latest.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps([{"name": r.name, **r.values} for r in self.rows], indent=1))
        print(f"\nwrote {out}")


def _redis_calls(svc: Service) -> float:
    """The service's Redis operations so far (``feedsvc_redis_calls_total``)."""
    with urllib.request.urlopen(svc.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(r"^feedsvc_redis_calls_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _rps_ratio(top: str, under: str) -> Callable[[dict[str, WrkResult]], float]:
    """A round's req/s of the run named top over that of the run named under."""
    return lambda runs: runs[top].rps / runs[under].rps


@contextlib.contextmanager
def bare_hello() -> Iterator[str]:
    """The URL of bench/bare_hello.py, running in a process of its own."""
    with serving("bench.bare_hello") as port:
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def bare_feed(redis_url: str) -> Iterator[str]:
    """The URL of bench/bare_feed.py on redis_url, running in a process of its own."""
    with serving("bench.bare_feed", redis_url) as port:
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def remote_redis(workdir: Path) -> Iterator[str]:
    """Redis behind 0.125 ms each way: tc netem on a veth pair into a network
    namespace when the kernel has netem, else bench/delay_proxy.py."""
    if os.geteuid() == 0 and _has_netem():
        with _netns_redis(workdir) as url:
            yield url
        return
    server = RedisServer(workdir / "far-redis", appendonly=False)
    server.start()
    try:
        with serving("bench.delay_proxy", str(server.port), "125") as port:
            yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.stop()


def _has_netem() -> bool:
    if not shutil.which("tc"):
        return False
    subprocess.run(
        ["ip", "link", "add", "fsbt0", "type", "veth", "peer", "name", "fsbt1"],
        capture_output=True,
        check=False,
    )
    ok = (
        subprocess.run(
            ["tc", "qdisc", "add", "dev", "fsbt0", "root", "netem", "delay", "1ms"],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    subprocess.run(["ip", "link", "del", "fsbt0"], capture_output=True, check=False)
    return ok


@contextlib.contextmanager
def _netns_redis(workdir: Path) -> Iterator[str]:
    sh = ["ip", "netns"]
    subprocess.run([*sh, "del", NETNS], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", "fsb0"], capture_output=True, check=False)
    steps = [
        [*sh, "add", NETNS],
        ["ip", "link", "add", "fsb0", "type", "veth", "peer", "name", "fsb1"],
        ["ip", "link", "set", "fsb1", "netns", NETNS],
        ["ip", "addr", "add", "10.231.0.1/24", "dev", "fsb0"],
        ["ip", "link", "set", "fsb0", "up"],
        [*sh, "exec", NETNS, "ip", "addr", "add", "10.231.0.2/24", "dev", "fsb1"],
        [*sh, "exec", NETNS, "ip", "link", "set", "fsb1", "up"],
        [*sh, "exec", NETNS, "ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "add", "dev", "fsb0", "root", "netem", "delay", "125us"],
        [
            *sh,
            "exec",
            NETNS,
            "tc",
            "qdisc",
            "add",
            "dev",
            "fsb1",
            "root",
            "netem",
            "delay",
            "125us",
        ],
    ]
    proc = None
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        data = workdir / "remote-redis"
        data.mkdir(exist_ok=True)
        proc = subprocess.Popen(
            [
                *sh,
                "exec",
                NETNS,
                shutil.which("redis-server") or "redis-server",
                "--bind",
                "10.231.0.2",
                "--port",
                "6400",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--dir",
                str(data),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port("10.231.0.2", 6400)
        yield "redis://10.231.0.2:6400/0"
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        subprocess.run([*sh, "del", NETNS], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", "fsb0"], capture_output=True, check=False)


PARTS = [
    "post", "get", "floor", "ladder", "loop", "workers", "zaqar", "pool", "batch", "coalesce",
    "drivers", "cluster", "rtt", "idle", "fanout", "wake", "webhook", "auth", "ratelimit",
    "quotas", "tracing", "storage", "groups",
]  # fmt: skip


def _count(text: str) -> int:
    """A message count of the storage part: 1..10,000,000."""
    value = int(text)
    if not 1 <= value <= 10_000_000:
        raise argparse.ArgumentTypeError(f"{text} is not within 1..10000000")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("parts", nargs="*", metavar="part", help=", ".join(PARTS))
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="hello/target pairs per ratio")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections")
    parser.add_argument(
        "--zaqar-home",
        type=Path,
        default=DEFAULT_ZAQAR_HOME,
        help="where the zaqar part installs Zaqar once (default: %(default)s)",
    )
    parser.add_argument(
        "--storage-messages",
        type=_count,
        default=20000,
        help="single-message posts the storage part makes per layout and driver "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--storage-reclaim",
        "--reclaim",
        type=_count,
        default=20000,
        help="messages the storage part lets expire per layout (default: %(default)s; "
        "the issue's: 1000000)",
    )
    args = parser.parse_args(argv)
    if not shutil.which("wrk"):
        print("bench: wrk is not on PATH (Debian: apt install wrk)", file=sys.stderr)
        return 2
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    Suite(args).run(args.parts or PARTS)
    return 0
