"""``python -m loadtest compare``: the lua and watch drivers under the same Locust load.

For every step (a producer count) and every driver, in turn, it starts a fresh
Redis (``appendfsync no``) and a fresh ``feedsvc serve --driver X`` with
identical settings, runs the locustfile headless for a fixed time, and reads
the service's ``/v2/health`` counters before and after. Steps alternate the
driver order (lua first, then watch first, ...) so that a slow drift of the
machine does not always favour the same driver.

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

from feedsvc.redis_server import RedisServer
from feedsvc.testing import ServiceProcess
from loadtest import timings
from loadtest.common import (
    GET,
    LOCUSTFILE,
    POST,
    PROJECT,
    QUEUE_PREFIX,
    SAMPLE_EVERY,
    CpuMeter,
    audit,
    machine,
    raise_open_files_limit,
    stop_process,
    wait_for_idle,
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


@dataclass
class Config:
    steps: list[int]
    drivers: list[str]
    duration: float
    warmup: float
    observers: int
    hot: bool
    queues: int
    batch: int
    message_size: int
    page_size: int
    processes: int
    spawn_rate: float
    pin: bool = False
    idle_wait: float = 120.0
    idle_below: float = 25.0
    serve_args: list[str] = field(default_factory=list)
    locust_args: list[str] = field(default_factory=list)


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

    @property
    def failure_count(self) -> int:
        return sum(self.failures.values())

    @property
    def checker_failures(self) -> int:
        return int(self.checker.get("findings", 0)) + int(self.audit["findings"])

    def as_dict(self) -> dict[str, Any]:
        return {
            "producers": self.producers,
            "driver": self.driver,
            "post": self.post.as_dict(),
            "get": self.get.as_dict(),
            "failures": self.failures,
            "checker": self.checker,
            "audit": self.audit,
            "watch_retries": self.watch_retries,
            "watch_exhausted": self.watch_exhausted,
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
        )


def locust_command(cfg: Config, producers: int, base: str, timings_dir: Path) -> list[str]:
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
    if cfg.hot:
        command.append("--hot")
    if cfg.processes > 1:
        command += ["--processes", str(cfg.processes)]
    command += cfg.locust_args
    classes = ["Producer", "Observer"] if cfg.observers else ["Producer"]
    return command + classes


def run_one(cfg: Config, producers: int, driver: str, logs: Path) -> Row:
    tag = f"{driver}-{producers}"
    idle = wait_for_idle(cfg.idle_wait, cfg.idle_below)
    with tempfile.TemporaryDirectory(prefix=f"loadtest-{tag}-") as tmp:
        work = Path(tmp)
        timings_dir = work / "timings"
        with service(driver, work, logs / f"feedsvc-{tag}.log", cfg.serve_args) as (
            base,
            serve_pid,
            redis_pid,
        ):
            before = health(base)
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
                    locust_command(cfg, producers, base, timings_dir),
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
            after = health(base)
            drained = time.monotonic() - stopped
            records = timings.load(timings_dir)
            acknowledged: dict[str, dict[str, int]] = {}
            for record in records:
                for queue, streams in record.meta["acknowledged"].items():
                    acknowledged.setdefault(queue, {}).update(streams)
            queues = [f"{QUEUE_PREFIX}{i}" for i in range(1 if cfg.hot else cfg.queues)]
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
    return Row(
        producers=producers,
        driver=driver,
        post=timings.summarize(records, POST, start, end),
        get=timings.summarize(records, GET, start, end),
        failures=failures,
        checker=checker,
        audit=audited,
        watch_retries=after["watch_retries"] - before["watch_retries"],
        watch_exhausted=after["watch_conflicts_exhausted"] - before["watch_conflicts_exhausted"],
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
    "producers", "driver", "req/s", "mean ms", "stdev ms", "p50 ms", "p99 ms", "max ms",
    "p99 ok ms", "failures", "checker", "WATCH retries", "Locust CPU %", "feedsvc CPU %",
    "Redis CPU %", "other CPU %",
]  # fmt: skip


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def row_cells(row: Row) -> list[str]:
    p = row.post
    return [
        str(row.producers), row.driver, _num(p.rps, 0), _num(p.mean), _num(p.stdev),
        _num(p.p50), _num(p.p99), _num(p.max), _num(p.p99_ok), str(row.failure_count),
        str(row.checker_failures), str(row.watch_retries),
        _num(row.cpu["locust"], 0), _num(row.cpu["feedsvc"], 0), _num(row.cpu["redis"], 0),
        _num(row.cpu["other"], 0),
    ]  # fmt: skip


def _ratio(a: float, b: float) -> str:
    return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def ratio_cells(lua: Row, watch: Row) -> list[str]:
    a, b = lua.post, watch.post
    cells = ["", "lua/watch", _ratio(a.rps, b.rps), _ratio(a.mean, b.mean),
             _ratio(a.stdev, b.stdev), _ratio(a.p50, b.p50), _ratio(a.p99, b.p99),
             _ratio(a.max, b.max), _ratio(a.p99_ok, b.p99_ok)]  # fmt: skip
    return cells + [""] * (len(COLUMNS) - len(cells))


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for producers in dict.fromkeys(r.producers for r in rows):
        step = {r.driver: r for r in rows if r.producers == producers}
        for driver in ("lua", "watch"):
            if driver in step:
                lines.append("| " + " | ".join(row_cells(step[driver])) + " |")
        if "lua" in step and "watch" in step:
            lines.append("| " + " | ".join(ratio_cells(step["lua"], step["watch"])) + " |")
    return "\n".join(lines) + "\n"


def print_step(rows: list[Row]) -> None:
    table = [COLUMNS, *(row_cells(r) for r in rows)]
    by_driver = {r.driver: r for r in rows}
    if "lua" in by_driver and "watch" in by_driver:
        table.append(ratio_cells(by_driver["lua"], by_driver["watch"]))
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
        **{f"{k}_cpu": round(v) for k, v in r.cpu.items() if not math.isnan(v)},
        "get_rps": round(r.get.rps, 1),
        "get_p99_ms": round(r.get.p99, 3),
    }


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_fields(rows[0])), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(csv_fields(r) for r in rows)


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for driver, style in (("lua", "o-"), ("watch", "s--")):
        mine = sorted((r for r in rows if r.driver == driver), key=lambda r: r.producers)
        if not mine:
            continue
        xs = [r.producers for r in mine]
        left.plot(xs, [r.post.rps for r in mine], style, label=driver)
        right.plot(xs, [r.post.p99 for r in mine], style, label=driver)
    for ax, label in ((left, "POST req/s"), (right, "POST p99 latency, ms")):
        ax.set_xscale("log")
        ax.set_xlabel("producers (Locust users)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    right.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser(
        "compare",
        help="lua vs watch under the same Locust load",
        description="Run the locustfile against a fresh feedsvc + Redis per driver and "
        "producer count; print and save the comparison.",
    )
    c.add_argument("--users", default="10,100,1000,3000", help="producer counts, comma-separated")
    c.add_argument("--drivers", default="lua,watch", help="drivers, comma-separated")
    c.add_argument("--duration", type=float, default=40.0, help="seconds per run (with ramp-up)")
    c.add_argument("--warmup", type=float, default=5.0, help="seconds ignored after spawning")
    c.add_argument("--observers", type=int, default=2, help="checking observers per run")
    c.add_argument(
        "--hot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every producer on one queue (default); --no-hot spreads them over --queues",
    )
    c.add_argument("--queues", type=int, default=4, help="queues with --no-hot")
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
        help="extra flag for both feedsvc serve runs, e.g. --serve-arg=--pool-size=64",
    )
    c.add_argument(
        "--locust-arg", action="append", default=[], help="extra flag for every locust run"
    )
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
    for index, producers in enumerate(cfg.steps):
        order = cfg.drivers if index % 2 == 0 else cfg.drivers[::-1]
        step: list[Row] = []
        for driver in order:
            print(f"-- {producers} producers, driver {driver}", flush=True)
            row = run_one(cfg, producers, driver, logs)
            step.append(row)
        step.sort(key=lambda r: cfg.drivers.index(r.driver))
        print_step(step)
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
    (out / "compare.md").write_text(markdown(rows))
    where = "hot queue" if cfg.hot else f"{cfg.queues} queues"
    title = (
        f"feedsvc lua vs watch: producers on a {where}, {cfg.observers} observers, "
        f"Locust x{cfg.processes} process(es), {cfg.duration:g} s per run\n"
        f"{info['cpu']} ({info['cores']} cores)"
    )
    plot(rows, out / "compare.png", title)


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
        render(Config(**saved["settings"]), rows, saved["machine"], args.json.parent)
        print(markdown(rows), end="")
        return 0
    cfg = Config(
        steps=[int(x) for x in args.users.split(",") if x.strip()],
        drivers=[d.strip() for d in args.drivers.split(",") if d.strip()],
        duration=args.duration,
        warmup=args.warmup,
        observers=args.observers,
        hot=args.hot,
        queues=args.queues,
        batch=args.batch,
        message_size=args.message_size,
        page_size=args.page_size,
        processes=args.processes,
        spawn_rate=args.spawn_rate,
        pin=args.pin,
        idle_wait=args.idle_wait,
        idle_below=args.idle_below,
        serve_args=args.serve_arg,
        locust_args=args.locust_arg,
    )
    if importlib.util.find_spec("locust") is None:
        print("error: locust is not installed (pip install -e '.[test]')", file=sys.stderr)
        return 2
    rows = compare(cfg, args.out)
    print(f"\nwrote {args.out}/compare.{{json,csv,md,png}}")
    bad = [r for r in rows if r.checker_failures]
    return 1 if bad else 0
