"""The machine that ``python -m bench`` and ``python -m loadtest`` measure on,
and the processes they start there: one module both import, so that a
figure of one means what the same figure of the other means.

- :func:`raise_open_files_limit`: thousands of streams are as many
  descriptors, in this process and in the children that inherit the limit;
- :func:`wait_for_idle`: someone else's job in the middle of a measurement
  says nothing about feedsvc, so a run first waits for a quiet machine;
- :func:`stop_process`: SIGTERM, then SIGKILL if it is still there;
- :class:`CpuMeter` (cumulative CPU seconds of process groups, sampled over
  a run, read between any two instants) and :class:`CpuWindow` (the same
  between a start() and a stop(), as % of a core), both with ``other``:
  the rest of the machine (the kernel, and on a shared machine someone
  else's work).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import resource
import subprocess
import time
from collections.abc import Callable

import psutil

from feedsvc.process import setup as process_setup


def raise_open_files_limit() -> int:
    """The soft open-files limit raised to the hard one (where the system
    lets us); children inherit it. The soft limit now in force."""
    process_setup.raise_open_files_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY and soft != hard:  # a soft limit cannot be unlimited
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def wait_for_idle(
    max_wait: float = 120.0, busy_below: float = 25.0, say: Callable[[str], None] | None = None
) -> float:
    """Wait (at most ``max_wait`` s) until the machine is less than
    ``busy_below`` % busy (100 = every core), so that someone else's job
    does not land in one measurement only; ``say`` hears once that it
    waits. The last reading."""
    deadline = time.monotonic() + max_wait
    busy = psutil.cpu_percent(interval=1.0)
    told = say is None
    while busy >= busy_below and time.monotonic() < deadline:
        if not told and say is not None:
            say(f"waiting for the machine to be idle (busy {busy:.0f}%)")
            told = True
        busy = psutil.cpu_percent(interval=1.0)
    return float(busy)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it is still there after ``timeout`` s; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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
    """Busy CPU seconds of the whole machine so far (guest time is already
    in user time on Linux: it is not counted twice)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return float(sum(t) - idle - guest)


class CpuMeter:
    """Cumulative CPU seconds of named process groups, read each time
    ``sample()`` is called, and of the whole machine (``system``). With
    ``descendants`` a group is its pids and all their children (Locust's
    workers, ``--workers``), else the pids alone. A process that exited
    keeps its last reading, so a group's total never goes down."""

    def __init__(self, descendants: bool = True) -> None:
        self.descendants = descendants
        self.times: list[float] = []
        self.groups: dict[str, list[float]] = {}
        self.system: list[float] = []
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
        except psutil.Error:
            pass
        return self._last.get(pid, 0.0)

    def sample(self, groups: dict[str, list[int]]) -> None:
        self.times.append(time.time())
        for name, roots in groups.items():
            members = self._members.setdefault(name, set())
            for root in roots:
                members.add(root)
                if self.descendants:
                    with contextlib.suppress(psutil.Error):
                        children = psutil.Process(root).children(recursive=True)
                        members.update(c.pid for c in children)
            self.groups.setdefault(name, []).append(sum(self._cpu(p) for p in members))
        self.system.append(machine_busy())

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


def _reaped_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuWindow:
    """CPU of some process groups (each the pids given, no descendants)
    between start() and stop(), as % of a core, and ``other``: the rest
    of the machine.

    ``reaped`` names the children this process starts *and waits for*
    within the window (wrk): their CPU comes from this process's rusage,
    since they are gone by the time stop() could look at them."""

    def __init__(self, groups: dict[str, list[int]], reaped: str | None = None) -> None:
        self.groups = groups
        self.reaped = reaped
        self._meter = CpuMeter(descendants=False)
        self._reaped0 = 0.0
        self.percent: dict[str, float] = {}

    def start(self) -> None:
        self._reaped0 = _reaped_seconds()
        self._meter.sample(self.groups)

    def stop(self) -> dict[str, float]:
        meter = self._meter
        meter.sample(self.groups)
        elapsed = meter.times[-1] - meter.times[0]

        def percent(series: list[float]) -> float:
            return 100 * (series[-1] - series[0]) / elapsed if elapsed > 0 else 0.0

        self.percent = {k: percent(v) for k, v in meter.groups.items()}
        if self.reaped is not None:
            reaped = _reaped_seconds() - self._reaped0
            self.percent[self.reaped] = 100 * reaped / elapsed if elapsed > 0 else 0.0
        self.percent["other"] = percent(meter.system) - sum(self.percent.values())
        return self.percent
