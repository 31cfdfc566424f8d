"""What the parts of the speed suite (bench/run.py and the modules it calls)
share: the feedsvc process they measure, wrk, the CPU each process group
takes, and the little of the suite a part uses."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from feedsvc.redis_server import RedisServer
from feedsvc.testing import ServiceProcess

HERE = Path(__file__).resolve().parent
WRK_DIR = HERE / "wrk"
PRODUCER = "3381af92-2b9e-11e3-b191-71861300734c"


class Service(ServiceProcess):
    """A feedsvc serve process (with /bench/hello) against a given Redis."""

    def __init__(self, redis_url: str, log: Path, *flags: str) -> None:
        super().__init__(
            "--redis-url", redis_url, "--bench-routes", "--log-level", "WARNING", *flags,
            log_path=log,
        )  # fmt: skip

    def request(self, method: str, path: str, body: object = None, client: str = PRODUCER) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Client-ID": client, "X-Project-ID": "bench", "Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as response:
            return bytes(response.read())


@contextlib.contextmanager
def service(
    redis_url: str, workdir: Path, *flags: str, log: str = "feedsvc.log"
) -> Iterator[Service]:
    """A Service whose queue ``bget`` holds 20 messages (the GET parts' page)."""
    with Service(redis_url, workdir / log, *flags) as svc:
        svc.request("PUT", "/v2/queues/bget")
        svc.request(
            "POST",
            "/v2/queues/bget/messages",
            {"messages": [{"body": {"n": i, "pad": "x" * 100}} for i in range(20)]},
        )
        yield svc


class SuiteLike(Protocol):
    """What a part in a module of its own uses of bench.run.Suite."""

    workdir: Path
    redis: RedisServer

    def add(self, name: str, **values: object) -> None: ...


class WrkSuite(SuiteLike, Protocol):
    """... and what the parts that drive wrk also use (bench/capacity.py, bench/zaqar.py)."""

    duration: float
    rounds: int
    connections: int


# -- wrk -------------------------------------------------------------------------


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    seconds: float = 0.0
    #: CPU of each process group during the run, in cores (``wrk`` and
    #: ``other`` included); only from :func:`wrk` called with ``cpu_of``
    cores: dict[str, float] | None = None


def _ms(text: str) -> float:
    number = float(re.sub(r"[a-z]+$", "", text))
    if text.endswith("us"):
        return number / 1000
    if text.endswith("ms"):
        return number
    if text.endswith("s"):
        return number * 1000
    return number


def parse_wrk(out: str) -> WrkResult:
    """The figures of wrk's ``--latency`` report."""
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    found = re.search(r"(\d+) requests in ([\d.]+)(m?s|m)", out)
    assert found is not None, out
    seconds = float(found.group(2)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[found.group(3)]
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    return WrkResult(rps, p50, p99, errors, int(found.group(1)), seconds)


def wrk(
    url: str,
    script: str | None,
    connections: int,
    duration: float,
    threads: int = 1,
    env: dict[str, str] | None = None,
    cpu_of: dict[str, list[int]] | None = None,
) -> WrkResult:
    """One wrk run (bench/wrk/``script``). With ``cpu_of`` (name -> pids),
    the result also says how many cores each group, wrk itself and the rest
    of the machine took meanwhile."""
    args = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{round(duration)}s",
        "--latency",
        "--timeout",
        "10s",
    ]
    if script:
        args += ["-s", str(WRK_DIR / script)]
    window = CpuWindow(cpu_of or {}, reaped="wrk")
    window.start()
    out = subprocess.run(
        [*args, url],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
        timeout=duration + 60,
    ).stdout
    percent = window.stop()
    result = parse_wrk(out)
    if cpu_of is not None:
        result.cores = {k: v / 100 for k, v in percent.items()}
    return result


# -- CPU -------------------------------------------------------------------------


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server the bench started: SIGTERM, then SIGKILL if it is still
    there after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def process_tree(pid: int | None) -> list[int]:
    """pid and its descendants (a ``--workers`` parent and its workers)."""
    if pid is None:
        return []
    try:
        parent = psutil.Process(pid)
        return [pid, *(p.pid for p in parent.children(recursive=True))]
    except psutil.Error:
        return []


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def _reaped_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuWindow:
    """CPU seconds of some processes between start() and stop(), as % of a
    core; ``other`` is the rest of the machine (this process, the kernel,
    and whatever else ran: on a shared machine, someone else's work).

    ``reaped`` names the children this process starts *and waits for*
    within the window (wrk): their CPU comes from this process's rusage,
    since they are gone by the time stop() could look at them."""

    def __init__(self, groups: dict[str, list[int]], reaped: str | None = None) -> None:
        self.groups = groups
        self.reaped = reaped
        self._start: dict[str, float] = {}
        self._reaped0 = 0.0
        self._t0 = 0.0
        self._busy0 = 0.0
        self.percent: dict[str, float] = {}

    @staticmethod
    def _seconds(pids: list[int]) -> float:
        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
        return total

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._busy0 = machine_busy()
        self._reaped0 = _reaped_seconds()
        self._start = {k: self._seconds(v) for k, v in self.groups.items()}

    def stop(self) -> dict[str, float]:
        elapsed = time.monotonic() - self._t0
        self.percent = {
            k: 100 * (self._seconds(v) - self._start[k]) / elapsed for k, v in self.groups.items()
        }
        if self.reaped is not None:
            self.percent[self.reaped] = 100 * (_reaped_seconds() - self._reaped0) / elapsed
        machine = 100 * (machine_busy() - self._busy0) / elapsed
        self.percent["other"] = machine - sum(self.percent.values())
        return self.percent
