"""What ``python -m loadtest compare`` (loadtest/compare.py) and ``python -m
loadtest follow`` (loadtest/follow.py) share: names, process CPU metering,
the open-files limit, waiting for an idle machine, stopping a process, the
final audit of the queues and the description of the machine."""

from __future__ import annotations

import bisect
import contextlib
import http.client
import json
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from feedsvc import __version__ as feedsvc_version
from feedsvc.redis_server import find_redis_server
from loadtest.checker import FeedChecker, read_stamp

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
POST = "POST messages"
GET = "GET messages"
SAMPLE_EVERY = 0.5
QUEUE_PREFIX = "lt"
PROJECT = "compare"


# -- processes and CPU -----------------------------------------------------------


class CpuMeter:
    """Cumulative CPU seconds of named process groups (a root and all its
    descendants), read each time ``sample()`` is called; a process that
    exited keeps its last reading, so a group's total never goes down."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.groups: dict[str, list[float]] = {}
        self.system: list[float] = []  # busy CPU seconds of the whole machine
        self._last: dict[int, float] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._members: dict[str, set[int]] = {}

    def _cpu(self, pid: int) -> float:
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            t = proc.cpu_times()
            self._last[pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
        return self._last.get(pid, 0.0)

    def sample(self, groups: dict[str, list[int]]) -> None:
        self.times.append(time.time())
        for name, roots in groups.items():
            members = self._members.setdefault(name, set())
            for root in roots:
                members.add(root)
                with contextlib.suppress(psutil.Error):
                    members.update(c.pid for c in psutil.Process(root).children(recursive=True))
            self.groups.setdefault(name, []).append(sum(self._cpu(p) for p in members))
        t = psutil.cpu_times()
        self.system.append(sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
                           - getattr(t, "guest_nice", 0.0))  # fmt: skip

    def members(self) -> set[int]:
        return set().union(*self._members.values())

    def percent(self, series: list[float], start: float, end: float) -> float:
        """CPU % (100 = one core) of a cumulative series between two instants."""
        if len(self.times) < 2 or end <= start:
            return math.nan
        return 100 * (self._at(series, end) - self._at(series, start)) / (end - start)

    def _at(self, series: list[float], t: float) -> float:
        i = bisect.bisect_left(self.times, t)
        if i <= 0:
            return series[0]
        if i >= len(self.times):
            return series[-1]
        t0, t1 = self.times[i - 1], self.times[i]
        v0, v1 = series[i - 1], series[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def raise_open_files_limit() -> int:
    """Lift the soft open-files limit to the hard one (3000 users = 3000 sockets
    in Locust and as many in feedsvc); children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def wait_for_idle(max_wait: float, busy_below: float) -> float:
    """Wait (at most ``max_wait`` s) until the machine is less than
    ``busy_below`` % busy (100 = every core), so that someone else's job does
    not land in one driver's run only; returns the last reading."""
    deadline = time.monotonic() + max_wait
    busy = psutil.cpu_percent(interval=1.0)
    told = False
    while busy >= busy_below and time.monotonic() < deadline:
        if not told:
            print(f"   waiting for the machine to be idle (busy {busy:.0f}%)", flush=True)
            told = True
        busy = psutil.cpu_percent(interval=1.0)
    return float(busy)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def audit(base: str, queues: list[str], acknowledged: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Read every queue from its head once the producers have stopped, through
    the same checker, then ask it for acknowledged messages never seen."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": PROJECT}
    read, findings = 0, []
    try:
        for queue in queues:
            checker = FeedChecker(queue)
            url = f"/v2/queues/{queue}/messages?limit=20&echo=true&include_claimed=true"
            while True:
                conn.request("GET", url, headers=headers)
                response = conn.getresponse()
                body = response.read()
                if response.status != 200:
                    raise RuntimeError(f"audit: GET {url} -> {response.status} {body[:200]!r}")
                payload = json.loads(body)
                now = time.time()
                for message in payload["messages"]:
                    stamp = read_stamp(message["body"])
                    if stamp is not None:
                        finding = checker.see(stamp, message["ttl"], now)
                        if finding is not None:
                            findings.append(str(finding))
                links = [link["href"] for link in payload["links"] if link["rel"] == "next"]
                if not links:
                    break
                url = links[0]
            findings += [str(f) for f in checker.lost(acknowledged.get(queue, {}))]
            read += checker.checked
    finally:
        conn.close()
    return {"read": read, "findings": len(findings), "examples": findings[:5]}


def _output(*command: str) -> str:
    """stdout of a short command, or "" when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    from importlib.metadata import version

    source = Path(sys.modules["feedsvc"].__file__ or ".").resolve().parent.parent
    commit = _output("git", "-C", str(source), "rev-parse", "--short", "HEAD")
    if not commit:
        commit = "not a git checkout"
    elif _output("git", "-C", str(source), "status", "--porcelain", "feedsvc", "lua"):
        commit += " + local changes"
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "feedsvc": f"{feedsvc_version} ({commit})",
        "locust": version("locust"),
        "redis_server": _output(find_redis_server(), "--version"),
    }
