"""``python -m loadtest compare``: the drivers (lua, watch, watch-naive) under the same Locust load.

For every cell (a producer count, a shape: every producer on one hot queue,
or spread over ``--queues`` queues, each post to one picked at random, as
zaqar-bench does; and a number of ``feedsvc serve --workers``) and every
driver, in turn, it starts a fresh Redis (``appendfsync no``) and a fresh
``feedsvc serve --driver X --workers W`` with identical settings, runs the
locustfile headless for a fixed time, and reads the service's ``/v2/health``
counters before and after (from every worker: each counts for itself). The
driver order rotates from one cell to the next (lua first, then watch
first, ...) so that a slow drift of the machine does not always favour the
same driver.

Per run it reports, over the steady-state window only (after every Locust
process finished spawning, plus a warm-up; see timings.py): successful
producer POSTs per second, mean / stdev / p50 / p99 / max POST latency from
every single request, HTTP and checker failures, WATCH retries, and the CPU
used by Locust, feedsvc, Redis and the whole machine (psutil), so a reader
can tell which of them was the ceiling.

Results go to ``--out`` (default ``results/``): ``compare.json``,
``compare.csv``, ``compare.md`` (the tables) and ``compare.png``
(throughput and p99 against producers, one line per driver), plus the
service and Locust logs of every run under ``logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.machine import CpuMeter, raise_open_files_limit, stop_process, wait_for_idle
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.testing import ServiceProcess
from loadtest import timings
from loadtest.common import (
    GET,
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

# -- processes and CPU -----------------------------------------------------------


def tcp_counters() -> dict[str, int]:
    """Machine-wide TCP trouble counters (Linux): accept-queue overflows and
    retransmitted segments. Many of either inflate latencies by whole RTOs."""
    wanted = {("TcpExt", "ListenOverflows"), ("Tcp", "RetransSegs")}
    found: dict[str, int] = {}
    for name in ("/proc/net/netstat", "/proc/net/snmp"):
        with contextlib.suppress(OSError):
            lines = Path(name).read_text().splitlines()
            for head, values in zip(lines[::2], lines[1::2], strict=False):
                prefix, *keys = head.split()
                for key, value in zip(keys, values.split()[1:], strict=False):
                    if (prefix.rstrip(":"), key) in wanted:
                        found[key] = int(value)
    return found


def process_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process: pid -> (command line, seconds)."""
    found = {}
    for proc in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        argv = proc.info["cmdline"] or [proc.info["name"] or "?"]
        command = " ".join([Path(argv[0]).name, *argv[1:]])  # no local paths in reports
        found[proc.pid] = (command[:80], times.user + times.system)
    return found


def busiest_others(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    ours: set[int],
    seconds: float,
) -> list[str]:
    """Other processes that used more than 5% of a core during a run."""
    rows = []
    for pid, (command, cpu) in after.items():
        if pid in ours:
            continue
        used = 100 * (cpu - before.get(pid, (command, 0.0))[1]) / seconds
        if used > 5:
            rows.append((used, f"{used:.0f}% {command}"))
    return [text for _, text in sorted(rows, reverse=True)[:4]]


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(Locust's CPUs, the service's CPUs) for --pin: the last CPU for Locust."""
    cpus = sorted(os.sched_getaffinity(0))
    return None if len(cpus) < 2 else ({cpus[-1]}, set(cpus[:-1]))


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Set the affinity of every thread of a running process."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.sched_setaffinity(int(task.name), cpus)


@contextlib.contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """Run the block (say, a Popen) on ``cpus``: children inherit it at fork."""
    if cpus is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


HEADERS = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "loadtest-compare"}


def health(base: str, patience: float = 30.0) -> dict[str, Any]:
    """GET /v2/health. Its counters come with a 503 too, which feedsvc answers
    while its Redis pool is busy, e.g. with the backlog a big run leaves
    behind (handlers go on after their clients left): wait up to
    ``patience`` s for a 200, then take the 503's body."""
    deadline = time.monotonic() + patience
    while True:
        request = urllib.request.Request(base + "/v2/health", headers=HEADERS)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                payload: dict[str, Any] = json.loads(response.read())
                return payload
        except urllib.error.HTTPError as exc:
            payload = json.loads(exc.read())
            if exc.code != 503 or time.monotonic() >= deadline:
                return payload
        time.sleep(0.25)


HEALTH_COUNTERS = ("watch_retries", "watch_conflicts_exhausted", "posts_combined")


def health_of_workers(base: str, workers: int, tries: int = 60) -> dict[int, dict[str, Any]]:
    """/v2/health of every worker, by pid: each request is a new connection,
    which the kernel hands to any worker, so ask until each has answered
    (at most ``tries`` times; a worker never reached is missing)."""
    found: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        doc = health(base)
        found[int(doc.get("pid", 0))] = doc
        if len(found) >= workers:
            break
    return found


def counted(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> dict[str, int]:
    """Each health counter summed over the workers, after minus before."""
    return {
        name: sum(
            int(doc.get(name, 0)) - int(before.get(pid, {}).get(name, 0))
            for pid, doc in after.items()
        )
        for name in HEALTH_COUNTERS
    }


@contextlib.contextmanager
def service(
    driver: str, workdir: Path, log: Path, serve_args: Sequence[str]
) -> Iterator[tuple[str, int, int | None]]:
    """A fresh Redis and a fresh ``feedsvc serve`` on free ports: (its URL,
    its pid, Redis's pid)."""
    log.unlink(missing_ok=True)  # the run's log only: it is read afterwards
    with (
        RedisServer(workdir / "redis", appendfsync="no") as redis,
        ServiceProcess(
            "--redis-url", redis.url, "--driver", driver, "--log-level", "WARNING", *serve_args,
            log_path=log,
        ) as feedsvc,
    ):  # fmt: skip
        try:
            yield feedsvc.url, feedsvc.pid, redis.pid
        finally:
            code = feedsvc.stop()
            if code not in (0, -signal.SIGTERM):
                with log.open("a") as out:
                    out.write(f"\n[compare] feedsvc exited with code {code}\n")


# -- one run ---------------------------------------------------------------------


SHAPES = ("hot", "spread")


@dataclass
class Config:
    steps: list[int]
    drivers: list[str]
    duration: float
    warmup: float
    observers: int
    shapes: list[str]
    queues: int
    batch: int
    message_size: int
    page_size: int
    processes: int
    spawn_rate: float
    workers: list[int] = field(default_factory=lambda: [1])
    pin: bool = False
    idle_wait: float = 120.0
    idle_below: float = 25.0
    serve_args: list[str] = field(default_factory=list)
    locust_args: list[str] = field(default_factory=list)
    storage_layout: str | None = None  # None: feedsvc serve's default

    @classmethod
    def from_saved(cls, settings: dict[str, Any]) -> Config:
        """The settings of a compare.json (one from before shapes: its --hot)."""
        settings = dict(settings)
        if "hot" in settings:
            settings["shapes"] = ["hot" if settings.pop("hot") else "spread"]
        return cls(**settings)

    def cells(self) -> list[tuple[int, str, int]]:
        """(producers, shape, workers) of every cell, in the order they run."""
        return [(n, s, w) for n in self.steps for s in self.shapes for w in self.workers]


@dataclass
class Row:
    producers: int
    driver: str
    post: timings.Summary
    get: timings.Summary
    failures: dict[str, int]
    checker: dict[str, int]
    audit: dict[str, Any]
    watch_retries: int
    watch_exhausted: int
    cpu: dict[str, float]
    idle_before: float
    others: list[str]
    tcp: dict[str, int]
    health_wait: float
    window: float
    locust_exit: int
    server_log_errors: int
    shape: str = "hot"
    workers: int = 1
    posts_combined: int = 0
    workers_seen: int = 1

    @property
    def cell(self) -> tuple[int, str, int]:
        return self.producers, self.shape, self.workers

    @property
    def failure_count(self) -> int:
        return sum(self.failures.values())

    @property
    def checker_failures(self) -> int:
        return int(self.checker.get("findings", 0)) + int(self.audit["findings"])

    def as_dict(self) -> dict[str, Any]:
        return {
            "producers": self.producers,
            "shape": self.shape,
            "workers": self.workers,
            "driver": self.driver,
            "post": self.post.as_dict(),
            "get": self.get.as_dict(),
            "failures": self.failures,
            "checker": self.checker,
            "audit": self.audit,
            "watch_retries": self.watch_retries,
            "watch_exhausted": self.watch_exhausted,
            "posts_combined": self.posts_combined,
            "workers_seen": self.workers_seen,
            "cpu_percent": self.cpu,
            "machine_busy_before_percent": self.idle_before,
            "other_processes": self.others,
            "tcp_counters": self.tcp,
            "health_wait_s": self.health_wait,
            "window_s": self.window,
            "locust_exit": self.locust_exit,
            "server_log_errors": self.server_log_errors,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        return cls(
            producers=d["producers"],
            driver=d["driver"],
            post=timings.Summary(**d["post"]),
            get=timings.Summary(**d["get"]),
            failures=d["failures"],
            checker=d["checker"],
            audit=d["audit"],
            watch_retries=d["watch_retries"],
            watch_exhausted=d["watch_exhausted"],
            cpu=d["cpu_percent"],
            idle_before=d["machine_busy_before_percent"],
            others=d["other_processes"],
            tcp=d.get("tcp_counters", {}),
            health_wait=d.get("health_wait_s", 0.0),
            window=d["window_s"],
            locust_exit=d["locust_exit"],
            server_log_errors=d["server_log_errors"],
            shape=d.get("shape", "hot"),
            workers=d.get("workers", 1),
            posts_combined=d.get("posts_combined", 0),
            workers_seen=d.get("workers_seen", 1),
        )


def locust_command(
    cfg: Config, producers: int, hot: bool, base: str, timings_dir: Path
) -> list[str]:
    users = producers + cfg.observers
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", str(users), "-r", str(min(float(users), cfg.spawn_rate)),
        "-t", f"{cfg.duration:g}s", "--host", base, "--loglevel", "INFO",
        "--queues", str(cfg.queues), "--batch", str(cfg.batch),
        "--message-size", str(cfg.message_size), "--page-size", str(cfg.page_size),
        "--observers", str(cfg.observers), "--project", PROJECT,
        "--queue-prefix", QUEUE_PREFIX,
        "--timings-dir", str(timings_dir),
    ]  # fmt: skip
    if hot:
        command.append("--hot")
    if cfg.processes > 1:
        command += ["--processes", str(cfg.processes)]
    command += cfg.locust_args
    classes = ["Producer", "Observer"] if cfg.observers else ["Producer"]
    return command + classes


def serve_flags(cfg: Config, workers: int) -> list[str]:
    """The flags of every ``feedsvc serve`` of a cell (besides Redis and driver)."""
    return [*layout_flags(cfg.storage_layout), *cfg.serve_args, "--workers", str(workers)]


def run_one(cfg: Config, cell: tuple[int, str, int], driver: str, logs: Path) -> Row:
    producers, shape, workers = cell
    hot = shape == "hot"
    tag = f"{driver}-{producers}-{shape}-w{workers}"
    idle = wait_for_idle(cfg.idle_wait, cfg.idle_below, say=say)
    serve_args = serve_flags(cfg, workers)
    with tempfile.TemporaryDirectory(prefix=f"loadtest-{tag}-") as tmp:
        work = Path(tmp)
        timings_dir = work / "timings"
        with service(driver, work, logs / f"feedsvc-{tag}.log", serve_args) as (
            base,
            serve_pid,
            redis_pid,
        ):
            before = health_of_workers(base, workers)
            meter = CpuMeter()
            everyone = process_cpu()
            tcp_before = tcp_counters()
            started = time.time()
            cpus = split_cpus() if cfg.pin else None
            if cpus is not None:
                for pid in (serve_pid, redis_pid or 0):
                    pin_threads(pid, cpus[1])
            with (
                (logs / f"locust-{tag}.log").open("wb") as out,
                affinity(None if cpus is None else cpus[0]),
            ):
                locust = subprocess.Popen(
                    locust_command(cfg, producers, hot, base, timings_dir),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            groups = {"locust": [locust.pid], "feedsvc": [serve_pid], "redis": [redis_pid or 0]}
            deadline = time.monotonic() + cfg.duration + 90
            while locust.poll() is None:
                meter.sample(groups)
                if time.monotonic() > deadline:
                    stop_process(locust)
                    raise RuntimeError(f"Locust did not finish; see {logs}/locust-{tag}.log")
                time.sleep(SAMPLE_EVERY)
            meter.sample(groups)
            others = busiest_others(
                everyone, process_cpu(), meter.members() | {os.getpid()}, time.time() - started
            )
            tcp = {k: v - tcp_before.get(k, 0) for k, v in tcp_counters().items()}
            stopped = time.monotonic()
            after = health_of_workers(base, workers)
            drained = time.monotonic() - stopped
            records = timings.load(timings_dir)
            acknowledged: dict[str, dict[str, int]] = {}
            for record in records:
                for queue, streams in record.meta["acknowledged"].items():
                    acknowledged.setdefault(queue, {}).update(streams)
            queues = [f"{QUEUE_PREFIX}{i}" for i in range(1 if hot else cfg.queues)]
            audited = audit(base, queues, acknowledged)
    start, end = timings.window(records, cfg.warmup)
    failures: dict[str, int] = {}
    checker: dict[str, int] = {}
    for record in records:
        for label, count in record.meta["failures"].items():
            failures[label] = failures.get(label, 0) + count
        for key, value in record.meta["checker"].items():
            checker[key] = checker.get(key, 0) + int(value)
    cpu = {name: meter.percent(series, start, end) for name, series in meter.groups.items()}
    cpu["machine"] = meter.percent(meter.system, start, end)
    cpu["other"] = cpu["machine"] - sum(cpu[k] for k in ("locust", "feedsvc", "redis"))
    server_log = (logs / f"feedsvc-{tag}.log").read_text(errors="replace")
    counts = counted(before, after)
    return Row(
        producers=producers,
        driver=driver,
        post=timings.summarize(records, POST, start, end),
        get=timings.summarize(records, GET, start, end),
        failures=failures,
        checker=checker,
        audit=audited,
        watch_retries=counts["watch_retries"],
        watch_exhausted=counts["watch_conflicts_exhausted"],
        posts_combined=counts["posts_combined"],
        workers_seen=len(after),
        shape=shape,
        workers=workers,
        cpu=cpu,
        idle_before=idle,
        others=others,
        tcp=tcp,
        health_wait=drained,
        window=end - start,
        locust_exit=locust.returncode,
        server_log_errors=sum(
            1 for line in server_log.splitlines() if " ERROR " in line or "Traceback" in line
        ),
    )


# -- reporting -------------------------------------------------------------------

COLUMNS = [
    "producers", "shape", "workers", "driver", "req/s", "mean ms", "stdev ms", "p50 ms",
    "p99 ms", "max ms", "p99 ok ms", "failures", "checker", "WATCH retries", "combined",
    "Locust CPU %", "feedsvc CPU %", "Redis CPU %", "other CPU %",
]  # fmt: skip
# the ratio rows under each cell: lua over each watch driver
BASELINE = "lua"


def shape_label(shape: str, queues: int) -> str:
    return "hot" if shape == "hot" else f"{queues} queues"


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def row_cells(row: Row, queues: int) -> list[str]:
    p = row.post
    workers = str(row.workers)
    if row.workers_seen < row.workers:  # a worker's counters are missing
        workers += f" ({row.workers_seen} counted)"
    return [
        str(row.producers), shape_label(row.shape, queues), workers, row.driver,
        _num(p.rps, 0), _num(p.mean), _num(p.stdev), _num(p.p50), _num(p.p99), _num(p.max),
        _num(p.p99_ok), str(row.failure_count), str(row.checker_failures),
        str(row.watch_retries), str(row.posts_combined),
        _num(row.cpu["locust"], 0), _num(row.cpu["feedsvc"], 0), _num(row.cpu["redis"], 0),
        _num(row.cpu["other"], 0),
    ]  # fmt: skip


def _ratio(a: float, b: float) -> str:
    return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def ratio_cells(base: Row, other: Row) -> list[str]:
    a, b = base.post, other.post
    cells = ["", "", "", f"{base.driver}/{other.driver}", _ratio(a.rps, b.rps),
             _ratio(a.mean, b.mean), _ratio(a.stdev, b.stdev), _ratio(a.p50, b.p50),
             _ratio(a.p99, b.p99), _ratio(a.max, b.max), _ratio(a.p99_ok, b.p99_ok)]  # fmt: skip
    return cells + [""] * (len(COLUMNS) - len(cells))


def cell_lines(rows: list[Row], drivers: Sequence[str], queues: int) -> list[list[str]]:
    """The rows of one cell in driver order, then lua over each other driver."""
    by_driver = {r.driver: r for r in rows}
    ordered = [by_driver[d] for d in drivers if d in by_driver]
    lines = [row_cells(r, queues) for r in ordered]
    base = by_driver.get(BASELINE)
    if base is not None:
        lines += [ratio_cells(base, r) for r in ordered if r is not base]
    return lines


def drivers_of(rows: list[Row]) -> list[str]:
    found = list(dict.fromkeys(r.driver for r in rows))
    known = [d for d in ("lua", "watch", "watch-naive") if d in found]
    return known + [d for d in found if d not in known]


def markdown(rows: list[Row], queues: int) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    drivers = drivers_of(rows)
    for cell in dict.fromkeys(r.cell for r in rows):
        mine = [r for r in rows if r.cell == cell]
        lines += ["| " + " | ".join(line) + " |" for line in cell_lines(mine, drivers, queues)]
    return "\n".join(lines) + "\n"


def print_step(rows: list[Row], drivers: Sequence[str], queues: int) -> None:
    table = [COLUMNS, *cell_lines(rows, drivers, queues)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    for line in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)), flush=True)
    for r in rows:
        if r.failures:
            print(f"  {r.driver} failures: {r.failures}", flush=True)
        print(f"  {r.driver} live checker: {r.checker}; audit: {r.audit}", flush=True)
        if r.others:
            print(f"  {r.driver} other busy processes: {r.others}", flush=True)
        print(f"  {r.driver} TCP (whole machine): {r.tcp}", flush=True)
        if r.health_wait > 1:
            print(f"  {r.driver} /v2/health answered 200 only {r.health_wait:.1f} s after the run")


def csv_fields(r: Row) -> dict[str, object]:
    p = r.post
    return {
        "producers": r.producers,
        "shape": r.shape,
        "workers": r.workers,
        "driver": r.driver,
        "rps": round(p.rps, 1),
        "requests": p.requests,
        "failed": p.failed,
        **{f"{k}_ms": round(getattr(p, k), 3) for k in ("mean", "stdev", "p50", "p99", "max")},
        "p99_ok_ms": round(p.p99_ok, 3),
        "failures": r.failure_count,
        "checker_failures": r.checker_failures,
        "checked_live": r.checker.get("checked", 0),
        "audited": r.audit["read"],
        "watch_retries": r.watch_retries,
        "watch_exhausted": r.watch_exhausted,
        "posts_combined": r.posts_combined,
        **{f"{k}_cpu": round(v) for k, v in r.cpu.items() if not math.isnan(v)},
        "get_rps": round(r.get.rps, 1),
        "get_p99_ms": round(r.get.p99, 3),
    }


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_fields(rows[0])), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(csv_fields(r) for r in rows)


STYLES = {"lua": "o-", "watch": "s--", "watch-naive": "^:"}


def plot(rows: list[Row], path: Path, title: str, queues: int) -> None:
    """One column per (shape, workers): throughput above, p99 below, against
    producers, one line per driver."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(dict.fromkeys((r.shape, r.workers) for r in rows))
    fig, axes = plt.subplots(2, len(columns), figsize=(3.6 * len(columns) + 1, 6.4), squeeze=False)
    for col, (shape, workers) in enumerate(columns):
        top, bottom = axes[0][col], axes[1][col]
        for driver in drivers_of(rows):
            mine = sorted(
                (r for r in rows if (r.shape, r.workers, r.driver) == (shape, workers, driver)),
                key=lambda r: r.producers,
            )
            if not mine:
                continue
            xs = [r.producers for r in mine]
            style = STYLES.get(driver, "x-")
            top.plot(xs, [r.post.rps for r in mine], style, label=driver)
            bottom.plot(xs, [r.post.p99 for r in mine], style, label=driver)
        top.set_title(f"{shape_label(shape, queues)}, {workers} worker(s)", fontsize=9)
        for ax, label in ((top, "POST req/s"), (bottom, "POST p99 ms")):
            ax.set_xscale("log")
            ax.set_xlabel("producers (Locust users)")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        bottom.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser(
        "compare",
        help="lua, watch and watch-naive under the same Locust load",
        description="Run the locustfile against a fresh feedsvc + Redis per driver, "
        "producer count, shape and worker count; print and save the comparison.",
    )
    c.add_argument("--users", default="100,1000", help="producer counts, comma-separated")
    c.add_argument("--drivers", default="lua,watch,watch-naive", help="drivers, comma-separated")
    c.add_argument(
        "--shapes",
        default="hot,spread",
        help="hot: every producer on one queue; spread: each post to one of --queues "
        "queues at random (zaqar-bench's way); comma-separated",
    )
    c.add_argument(
        "--workers", default="1,2", help="feedsvc serve --workers counts, comma-separated"
    )
    c.add_argument("--duration", type=float, default=15.0, help="seconds per run (with ramp-up)")
    c.add_argument("--warmup", type=float, default=4.0, help="seconds ignored after spawning")
    c.add_argument("--observers", type=int, default=2, help="checking observers per run")
    c.add_argument(
        "--queues", type=int, default=4, help="queues of the spread shape (zaqar-bench: 4)"
    )
    c.add_argument("--batch", type=int, default=1, help="up to this many messages per POST")
    c.add_argument("--message-size", type=int, default=100, help="body padding, bytes")
    c.add_argument("--page-size", type=int, default=20, help="observer page size")
    c.add_argument("--processes", type=int, default=1, help="Locust processes (--processes)")
    c.add_argument("--spawn-rate", type=float, default=1000.0, help="users started per second")
    c.add_argument(
        "--pin",
        action="store_true",
        help="pin Locust to the last CPU and feedsvc + Redis to the others",
    )
    c.add_argument(
        "--idle-wait",
        type=float,
        default=120.0,
        help="before each run, wait at most this long for the machine to be idle",
    )
    c.add_argument(
        "--idle-below", type=float, default=25.0, help="idle means less than this %% busy"
    )
    c.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra flag for every feedsvc serve run, e.g. --serve-arg=--pool-size=64",
    )
    c.add_argument(
        "--locust-arg", action="append", default=[], help="extra flag for every locust run"
    )
    add_layout_flag(c)
    c.add_argument("--out", type=Path, default=Path("results"), help="results folder")
    r = commands.add_parser(
        "report",
        help="write the tables and plot again from a compare.json or follow.json",
        description="Re-render compare.{csv,md,png} (or follow.*) next to a saved JSON.",
    )
    r.add_argument("json", type=Path, help="a compare.json or follow.json")
    from loadtest import follow

    follow.add_parser(commands)
    return parser


def compare(cfg: Config, out: Path) -> list[Row]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    limit = raise_open_files_limit()
    info = machine()
    print(f"machine: {info}\nopen files limit: {limit}", flush=True)
    rows: list[Row] = []
    for index, cell in enumerate(cfg.cells()):
        # rotate: each driver runs first, second, ... equally often
        shift = index % len(cfg.drivers)
        order = cfg.drivers[shift:] + cfg.drivers[:shift]
        step: list[Row] = []
        for driver in order:
            producers, shape, workers = cell
            print(f"-- {producers} producers, {shape}, {workers} worker(s), {driver}", flush=True)
            step.append(run_one(cfg, cell, driver, logs))
        print_step(step, cfg.drivers, cfg.queues)
        rows += step
        save(cfg, rows, info, out)
    return rows


def save(cfg: Config, rows: list[Row], info: dict[str, Any], out: Path) -> None:
    (out / "compare.json").write_text(
        json.dumps(
            {"machine": info, "settings": vars(cfg), "rows": [r.as_dict() for r in rows]},
            indent=1,
        )
    )
    render(cfg, rows, info, out)


def render(cfg: Config, rows: list[Row], info: dict[str, Any], out: Path) -> None:
    write_csv(rows, out / "compare.csv")
    (out / "compare.md").write_text(markdown(rows, cfg.queues))
    layout = f", {cfg.storage_layout} layout" if cfg.storage_layout else ""
    title = (
        f"feedsvc drivers{layout}: POSTs, {cfg.observers} observers, "
        f"Locust x{cfg.processes} process(es), {cfg.duration:g} s per run\n"
        f"{info['cpu']} ({info['cores']} cores)"
    )
    plot(rows, out / "compare.png", title, cfg.queues)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds, so the finally blocks stop feedsvc and Redis


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.command == "follow":
        from loadtest import follow

        return follow.run(args)
    if args.command == "report":
        saved = json.loads(args.json.read_text())
        if saved.get("kind") == "follow":
            from loadtest import follow

            print(follow.rerender(saved, args.json.parent), end="")
            return 0
        rows = [Row.from_dict(d) for d in saved["rows"]]
        settings = Config.from_saved(saved["settings"])
        render(settings, rows, saved["machine"], args.json.parent)
        print(markdown(rows, settings.queues), end="")
        return 0
    cfg = Config(
        steps=[int(x) for x in args.users.split(",") if x.strip()],
        drivers=[d.strip() for d in args.drivers.split(",") if d.strip()],
        duration=args.duration,
        warmup=args.warmup,
        observers=args.observers,
        shapes=[x.strip() for x in args.shapes.split(",") if x.strip()],
        queues=args.queues,
        batch=args.batch,
        message_size=args.message_size,
        page_size=args.page_size,
        processes=args.processes,
        spawn_rate=args.spawn_rate,
        workers=[int(x) for x in args.workers.split(",") if x.strip()],
        pin=args.pin,
        idle_wait=args.idle_wait,
        idle_below=args.idle_below,
        serve_args=args.serve_arg,
        locust_args=args.locust_arg,
        storage_layout=args.storage_layout,
    )
    unknown = [x for x in cfg.shapes if x not in SHAPES]
    if unknown or not cfg.shapes or not cfg.workers or min(cfg.workers) < 1:
        print(f"error: --shapes takes {', '.join(SHAPES)}; --workers counts >= 1", file=sys.stderr)
        return 2
    if importlib.util.find_spec("locust") is None:
        print("error: locust is not installed (pip install -e '.[test]')", file=sys.stderr)
        return 2
    rows = compare(cfg, args.out)
    print(f"\nwrote {args.out}/compare.{{json,csv,md,png}}")
    bad = [r for r in rows if r.checker_failures]
    return 1 if bad else 0
