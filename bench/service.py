"""What the parts of the speed suite (bench/run.py and the modules it calls)
share: the feedsvc process they measure, wrk, and the little of the suite a
part uses (the machine and its processes: bench/machine.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from bench.machine import CpuWindow, stop_process
from feedsvc.embedded_redis.server import RedisServer, pick_free_port
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

    def request(
        self, method: str, path: str, body: object = None, client: str = PRODUCER,
        project: str = "bench",
    ) -> bytes:  # fmt: skip
        data = None if body is None else json.dumps(body).encode()
        headers = {"Client-ID": client, "X-Project-ID": project, "Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as response:
            return bytes(response.read())


@contextlib.contextmanager
def service(
    redis_url: str, workdir: Path, *flags: str, log: str = "feedsvc.log"
) -> Iterator[Service]:
    """A Service whose queue ``bget`` holds 20 messages (the GET parts' page)."""
    with Service(redis_url, workdir / log, *flags) as svc:
        fill_bget(svc)
        yield svc


def fill_bget(svc: Service, project: str = "bench") -> None:
    """Queue ``bget`` of a project with 20 messages (the GET parts' page)."""
    svc.request("PUT", "/v2/queues/bget", project=project)
    svc.request(
        "POST",
        "/v2/queues/bget/messages",
        {"messages": [{"body": {"n": i, "pad": "x" * 100}} for i in range(20)]},
        project=project,
    )


_Round = TypeVar("_Round")


def median_round(rounds: list[_Round], ratio: Callable[[_Round], float]) -> tuple[_Round, float]:
    """The round whose ratio is the median (of an even count, the upper of
    the middle two), and the median ratio."""
    ordered = sorted(rounds, key=ratio)
    return ordered[len(ordered) // 2], statistics.median(ratio(r) for r in rounds)


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
    #: wrk's whole report (a script's done() may print figures of its own there)
    output: str = ""


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
    result.output = out
    if cpu_of is not None:
        result.cores = {k: v / 100 for k, v in percent.items()}
    return result


@contextlib.contextmanager
def serving(module: str, *args: str) -> Iterator[int]:
    """``python -m module PORT *args``, a server of the bench's own, until the
    block ends; yields the free port it listens on."""
    port = pick_free_port()
    server = subprocess.Popen([sys.executable, "-m", module, str(port), *args], cwd=HERE.parent)
    try:
        wait_port("127.0.0.1", port, server)
        yield port
    finally:
        stop_process(server)


def wait_port(host: str, port: int, server: subprocess.Popen[bytes] | None = None) -> None:
    """Until something listens on host:port (the server started for it, which
    must not have exited meanwhile)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"{server.args!r} exited with {server.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((host, port), 1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port}")
