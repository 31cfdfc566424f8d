"""``python -m loadtest follow``: the three ways to read a queue live, side by side.

For every read mode (``poll``: an ``Observer`` polling every second once
drained; ``long-poll``: a ``LongPoller`` with ``wait=20``; ``sse``: a
``Streamer``) and every driver, in turn, it starts a fresh Redis and a fresh
``feedsvc serve`` (as ``compare`` does), runs the locustfile headless with
``--producers`` producers posting one message every ``--producer-wait`` s
each to one hot queue and ``--followers`` readers of that mode, and reports
over the steady-state window (see timings.py):

* deliveries per second (every follower counts each message it got) and the
  post-to-delivery latency p50 / p99 / max, from the time the producer sent
  the POST (stamped in the body) to the time the reader had parsed the
  message;
* Redis commands per delivered message: the sum of ``calls`` in ``INFO
  commandstats`` (sampled every half second; the sampler's own ``info``
  calls left out; commands a Lua script runs are counted by Redis too), in
  all and for the readers alone: before Locust starts, 200 posts to another
  queue, with nobody reading, measure what one post costs, and the posts'
  share is taken off;
* feedsvc CPU (psutil, the service process) per delivered message (the
  posts' handling included), and the CPU of feedsvc, Redis, Locust and the
  rest of the machine (on a shared machine, someone else's work);
* the checker: every reader saw every message once and in order, and when
  the test stopped had not missed anything acknowledged before the latest
  message it saw was sent (checker.py); an audit then reads the queue whole.

Results go next to ``compare``'s: ``follow.{json,csv,md,png}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import csv
import http.client
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.machine import CpuMeter, raise_open_files_limit, stop_process, wait_for_idle
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.testing import ServiceProcess
from loadtest import timings
from loadtest.common import (
    LOCUSTFILE,
    POST,
    PROJECT,
    QUEUE_PREFIX,
    SAMPLE_EVERY,
    add_layout_flag,
    audit,
    layout_flags,
    machine,
    say,
)

MODES = {"poll": "Observer", "long-poll": "LongPoller", "sse": "Streamer"}
COUNT_FLAG = {"poll": "--observers", "long-poll": "--long-pollers", "sse": "--streamers"}


@dataclass
class FollowConfig:
    drivers: list[str]
    modes: list[str]
    producers: int
    producer_wait: float
    followers: int
    poll_interval: float
    duration: float
    warmup: float
    message_size: int
    idle_wait: float = 120.0
    idle_below: float = 25.0
    serve_args: list[str] = field(default_factory=list)
    locust_args: list[str] = field(default_factory=list)
    storage_layout: str | None = None  # None: feedsvc serve's default


@dataclass
class FollowRow:
    driver: str
    mode: str
    followers: int
    posts_per_s: float
    deliveries_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    redis_commands: int  # in the window
    commands_per_delivery: float
    commands_per_post: float
    post_cost: float  # commands per post with nobody reading
    reader_commands_per_delivery: float
    feedsvc_cpu_us_per_delivery: float
    cpu: dict[str, float]
    failures: dict[str, int]
    checker: dict[str, Any]
    audit: dict[str, Any]
    top_commands: dict[str, int]
    window_s: float
    locust_exit: int

    @property
    def checker_failures(self) -> int:
        return int(self.checker.get("findings", 0)) + int(self.audit["findings"])

    @property
    def failure_count(self) -> int:
        return sum(self.failures.values())


def value_at(times: list[float], series: list[float], t: float) -> float:
    """A cumulative series sampled at ``times``, linearly interpolated at ``t``."""
    i = bisect.bisect_left(times, t)
    if i <= 0:
        return series[0]
    if i >= len(times):
        return series[-1]
    t0, t1 = times[i - 1], times[i]
    return series[i - 1] + (series[i] - series[i - 1]) * (t - t0) / (t1 - t0)


class CommandMeter:
    """Cumulative ``INFO commandstats`` calls of a Redis, sampled over time
    (the meter's own ``info`` calls are not counted)."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url, socket_timeout=5)
        self.times: list[float] = []
        self.totals: list[float] = []
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        stats: dict[str, Any] = self._client.info("commandstats")
        calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
        calls.pop("info", None)
        return calls

    def sample(self) -> None:
        calls = self.read()
        if not self.times:
            self.first = calls
        self.last = calls
        self.times.append(time.time())
        self.totals.append(float(sum(calls.values())))

    def between(self, start: float, end: float) -> float:
        """Commands between two instants (linear between samples)."""
        return value_at(self.times, self.totals, end) - value_at(self.times, self.totals, start)

    def busiest(self, top: int = 8) -> dict[str, int]:
        """The commands run most over the whole run."""
        delta = {k: v - self.first.get(k, 0) for k, v in self.last.items()}
        return dict(sorted(delta.items(), key=lambda kv: -kv[1])[:top])

    def close(self) -> None:
        self._client.close()


@contextlib.contextmanager
def fresh_service(
    driver: str, workdir: Path, log: Path, serve_args: Sequence[str]
) -> Iterator[tuple[ServiceProcess, RedisServer]]:
    log.unlink(missing_ok=True)
    with (
        RedisServer(workdir / "redis", appendfsync="no") as server,
        ServiceProcess(
            "--redis-url", server.url, "--driver", driver, "--log-level", "WARNING",
            *serve_args, log_path=log,
        ) as service,
    ):  # fmt: skip
        try:
            yield service, server
        finally:
            code = service.stop()
            if code not in (0, -signal.SIGTERM):
                with log.open("a") as out:
                    out.write(f"\n[follow] feedsvc exited with code {code}\n")


def locust_command(cfg: FollowConfig, mode: str, base: str, timings_dir: Path) -> list[str]:
    users = cfg.producers + cfg.followers
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", str(users), "-r", str(users), "-t", f"{cfg.duration:g}s", "--host", base,
        "--loglevel", "INFO", "--hot", "--project", PROJECT, "--queue-prefix", QUEUE_PREFIX,
        "--message-size", str(cfg.message_size), "--producer-wait", f"{cfg.producer_wait:g}",
        "--poll-interval", f"{cfg.poll_interval:g}", COUNT_FLAG[mode], str(cfg.followers),
        "--timings-dir", str(timings_dir), *cfg.locust_args, "Producer", MODES[mode],
    ]  # fmt: skip


CALIBRATION_POSTS = 200


def post_cost(base: str, commands: CommandMeter, message_size: int) -> float:
    """Redis commands one POST of one message costs with nobody reading."""
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": PROJECT}
    body = json.dumps({"messages": [{"body": {"p": "calibration", "x": "x" * message_size}}]})
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for _ in range(3):  # the queue's creation is no steady-state post
            conn.request("POST", "/v2/queues/calibration/messages", body, headers)
            conn.getresponse().read()
        before = sum(commands.read().values())
        for _ in range(CALIBRATION_POSTS):
            conn.request("POST", "/v2/queues/calibration/messages", body, headers)
            response = conn.getresponse()
            response.read()
            if response.status != 201:
                raise RuntimeError(f"calibration post: {response.status}")
        return (sum(commands.read().values()) - before) / CALIBRATION_POSTS
    finally:
        conn.close()


def _per(amount: float, count: float) -> float:
    return amount / count if count else math.nan


def serve_flags(cfg: FollowConfig) -> list[str]:
    """The flags of every ``feedsvc serve`` of the runs (besides Redis and driver)."""
    return [*layout_flags(cfg.storage_layout), *cfg.serve_args]


def run_one(cfg: FollowConfig, driver: str, mode: str, logs: Path) -> FollowRow:
    tag = f"{driver}-{mode}"
    wait_for_idle(cfg.idle_wait, cfg.idle_below, say=say)
    with tempfile.TemporaryDirectory(prefix=f"loadtest-{tag}-") as tmp:
        work = Path(tmp)
        timings_dir = work / "timings"
        log = logs / f"feedsvc-{tag}.log"
        with fresh_service(driver, work, log, serve_flags(cfg)) as (svc, server):
            meter = CpuMeter()
            commands = CommandMeter(server.url)
            try:
                cost = post_cost(svc.url, commands, cfg.message_size)
                with (logs / f"locust-{tag}.log").open("wb") as out:
                    locust = subprocess.Popen(
                        locust_command(cfg, mode, svc.url, timings_dir),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                groups = {"locust": [locust.pid], "feedsvc": [svc.pid], "redis": [server.pid or 0]}
                deadline = time.monotonic() + cfg.duration + 90
                while locust.poll() is None:
                    meter.sample(groups)
                    commands.sample()
                    if time.monotonic() > deadline:
                        stop_process(locust)
                        raise RuntimeError(f"Locust did not finish; see {logs}/locust-{tag}.log")
                    time.sleep(SAMPLE_EVERY)
                meter.sample(groups)
                commands.sample()
                records = timings.load(timings_dir)
                acknowledged: dict[str, dict[str, int]] = {}
                for record in records:
                    for queue, streams in record.meta["acknowledged"].items():
                        acknowledged.setdefault(queue, {}).update(streams)
                audited = audit(svc.url, [f"{QUEUE_PREFIX}0"], acknowledged)
            finally:
                commands.close()
    start, end = timings.window(records, cfg.warmup)
    delivered = timings.summarize(records, f"deliver {mode}", start, end)
    posts = timings.summarize(records, POST, start, end)
    failures: dict[str, int] = {}
    checker: dict[str, Any] = {}
    for record in records:
        for label, count in record.meta["failures"].items():
            failures[label] = failures.get(label, 0) + count
        for key, value in record.meta["checker"].items():
            checker[key] = checker.get(key, 0) + int(value)
    window = end - start
    deliveries = delivered.rps * window
    issued = commands.between(start, end)
    by_readers = issued - cost * posts.rps * window
    cpu = {name: meter.percent(series, start, end) for name, series in meter.groups.items()}
    cpu["machine"] = meter.percent(meter.system, start, end)
    cpu["other"] = cpu["machine"] - sum(cpu[k] for k in ("locust", "feedsvc", "redis"))
    feedsvc_seconds = cpu["feedsvc"] / 100 * window
    return FollowRow(
        driver=driver,
        mode=mode,
        followers=cfg.followers,
        posts_per_s=posts.rps,
        deliveries_per_s=delivered.rps,
        p50_ms=delivered.p50,
        p99_ms=delivered.p99,
        max_ms=delivered.max,
        redis_commands=round(issued),
        commands_per_delivery=_per(issued, deliveries),
        commands_per_post=_per(issued, posts.rps * window),
        post_cost=cost,
        reader_commands_per_delivery=_per(by_readers, deliveries),
        feedsvc_cpu_us_per_delivery=_per(feedsvc_seconds * 1e6, deliveries),
        cpu=cpu,
        failures=failures,
        checker=checker,
        audit=audited,
        top_commands=commands.busiest(),
        window_s=window,
        locust_exit=locust.returncode,
    )


# -- reporting -------------------------------------------------------------------

COLUMNS = [
    "mode", "driver", "followers", "posts/s", "deliveries/s", "p50 ms", "p99 ms", "max ms",
    "Redis cmds / delivery", "readers' Redis cmds / delivery", "Redis cmds / post",
    "feedsvc CPU µs / delivery",
    "feedsvc CPU %", "Redis CPU %", "Locust CPU %", "other CPU %", "failures", "checker",
]  # fmt: skip


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def row_cells(r: FollowRow) -> list[str]:
    return [
        r.mode, r.driver, str(r.followers), _num(r.posts_per_s, 0), _num(r.deliveries_per_s, 0),
        _num(r.p50_ms), _num(r.p99_ms), _num(r.max_ms), _num(r.commands_per_delivery, 2),
        _num(r.reader_commands_per_delivery, 3), _num(r.commands_per_post, 1),
        _num(r.feedsvc_cpu_us_per_delivery, 0),
        _num(r.cpu["feedsvc"], 0), _num(r.cpu["redis"], 0), _num(r.cpu["locust"], 0),
        _num(r.cpu.get("other", math.nan), 0), str(r.failure_count), str(r.checker_failures),
    ]  # fmt: skip


def markdown(rows: list[FollowRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def print_row(row: FollowRow) -> None:
    for name, cell in zip(COLUMNS, row_cells(row), strict=True):
        print(f"   {name}: {cell}", flush=True)
    print(f"   checker: {row.checker}; audit: {row.audit}", flush=True)
    print(f"   busiest Redis commands: {row.top_commands}", flush=True)
    if row.failures:
        print(f"   failures: {row.failures}", flush=True)


def write_csv(rows: list[FollowRow], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(row_cells(r) for r in rows)


def plot(rows: list[FollowRow], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in rows))
    drivers = list(dict.fromkeys(r.driver for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = [
        ("post → delivery latency, ms (bar p50, tick p99)", "p50_ms", "p99_ms", True),
        (
            "readers' Redis commands per delivered message",
            "reader_commands_per_delivery",
            None,
            True,
        ),
        ("feedsvc CPU µs per delivered message", "feedsvc_cpu_us_per_delivery", None, False),
    ]
    width = 0.8 / max(1, len(drivers))
    for ax, (label, key, tick, log) in zip(axes, panels, strict=True):
        for d, driver in enumerate(drivers):
            xs, values, ticks = [], [], []
            for m, mode in enumerate(modes):
                for r in rows:
                    if r.mode == mode and r.driver == driver:
                        xs.append(m + (d - (len(drivers) - 1) / 2) * width)
                        values.append(getattr(r, key))
                        ticks.append(getattr(r, tick) if tick else math.nan)
            ax.bar(xs, values, width, label=driver)
            if tick:
                ax.scatter(xs, ticks, marker="_", s=300, color="black", zorder=3)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_title(label, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(cfg: FollowConfig, rows: list[FollowRow], info: dict[str, Any], out: Path) -> None:
    write_csv(rows, out / "follow.csv")
    (out / "follow.md").write_text(markdown(rows))
    rate = cfg.producers / cfg.producer_wait if cfg.producer_wait else math.inf
    layout = f", {cfg.storage_layout} layout" if cfg.storage_layout else ""
    title = (
        f"feedsvc read modes{layout}: {cfg.followers} followers of one queue, "
        f"{cfg.producers} producers (≈{rate:g} messages/s), {cfg.duration:g} s per run\n"
        f"{info['cpu']} ({info['cores']} cores)"
    )
    plot(rows, out / "follow.png", title)


def save(cfg: FollowConfig, rows: list[FollowRow], info: dict[str, Any], out: Path) -> None:
    document = {
        "kind": "follow",
        "machine": info,
        "settings": asdict(cfg),
        "rows": [asdict(r) for r in rows],
    }
    (out / "follow.json").write_text(json.dumps(document, indent=1))
    render(cfg, rows, info, out)


def rerender(saved: dict[str, Any], out: Path) -> str:
    rows = [FollowRow(**d) for d in saved["rows"]]
    render(FollowConfig(**saved["settings"]), rows, saved["machine"], out)
    return markdown(rows)


# -- command line ----------------------------------------------------------------


def add_parser(commands: Any) -> None:
    f = commands.add_parser(
        "follow",
        help="poll vs long poll vs SSE: latency, Redis and CPU per delivered message",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    f.add_argument("--drivers", default="lua,watch", help="drivers, comma-separated")
    f.add_argument("--modes", default=",".join(MODES), help="read modes: poll,long-poll,sse")
    f.add_argument("--producers", type=int, default=10, help="producers on the hot queue")
    f.add_argument(
        "--producer-wait", type=float, default=0.1, help="each producer's wait between posts, s"
    )
    f.add_argument("--followers", type=int, default=50, help="readers of the mode per run")
    f.add_argument(
        "--poll-interval", type=float, default=1.0, help="poll mode: wait when drained, s"
    )
    f.add_argument("--duration", type=float, default=30.0, help="seconds per run")
    f.add_argument("--warmup", type=float, default=5.0, help="seconds ignored after spawning")
    f.add_argument("--message-size", type=int, default=100, help="body padding, bytes")
    f.add_argument("--idle-wait", type=float, default=120.0, help="wait for an idle machine, s")
    f.add_argument("--idle-below", type=float, default=25.0, help="idle: below this %% busy")
    f.add_argument("--serve-arg", action="append", default=[], help="extra feedsvc serve flag")
    f.add_argument("--locust-arg", action="append", default=[], help="extra locust flag")
    add_layout_flag(f)
    f.add_argument("--out", type=Path, default=Path("results"), help="results folder")


def run(args: argparse.Namespace) -> int:
    cfg = FollowConfig(
        drivers=[d.strip() for d in args.drivers.split(",") if d.strip()],
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        producers=args.producers,
        producer_wait=args.producer_wait,
        followers=args.followers,
        poll_interval=args.poll_interval,
        duration=args.duration,
        warmup=args.warmup,
        message_size=args.message_size,
        idle_wait=args.idle_wait,
        idle_below=args.idle_below,
        serve_args=args.serve_arg,
        locust_args=args.locust_arg,
        storage_layout=args.storage_layout,
    )
    unknown = set(cfg.modes) - set(MODES)
    if unknown:
        print(f"error: unknown modes {sorted(unknown)}; choose from {list(MODES)}", file=sys.stderr)
        return 2
    out: Path = args.out
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    raise_open_files_limit()
    info = machine()
    print(f"machine: {info}", flush=True)
    rows: list[FollowRow] = []
    for index, mode in enumerate(cfg.modes):
        order = cfg.drivers if index % 2 == 0 else cfg.drivers[::-1]
        for driver in order:
            print(f"-- {mode}, driver {driver}", flush=True)
            row = run_one(cfg, driver, mode, logs)
            print_row(row)
            rows.append(row)
        rows.sort(key=lambda r: (cfg.modes.index(r.mode), cfg.drivers.index(r.driver)))
        save(cfg, rows, info, out)
    print("\n" + markdown(rows), end="")
    print(f"\nwrote {out}/follow.{{json,csv,md,png}}")
    return 1 if any(r.checker_failures for r in rows) else 0
