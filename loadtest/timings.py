"""Per-request timings: recorded inside each Locust process, summarised by the runner.

Locust's own statistics round response times into buckets and report no
standard deviation, and they include the ramp-up. So every Locust process
(the single local one, or each ``--processes`` worker) keeps the end time,
response time and outcome of every request it made, and at the end of the
test writes them to ``<dir>/locust-<pid>.json`` (metadata) and
``locust-<pid>.f64`` (the samples, native float64 triples). The runner then
summarises only the steady-state window: from the moment the last process
had spawned all its users (plus a warm-up) to the moment the first one began
stopping.

No Locust import here: the locustfile writes, the runner reads.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Recorder:
    """Samples of one process: per request name, (end, ms, ok) triples."""

    samples: dict[str, array[float]] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    spawned_at: float | None = None
    stopping_at: float | None = None

    def record(self, name: str, end: float, ms: float, ok: bool) -> None:
        series = self.samples.get(name)
        if series is None:
            series = self.samples[name] = array("d")
        series.extend((end, ms, 1.0 if ok else 0.0))

    def fail(self, label: str) -> None:
        self.failures[label] += 1

    def dump(self, directory: Path, extra: dict[str, Any]) -> Path:
        """Write this process's samples and ``extra`` (checker counters, ...)."""
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / f"locust-{os.getpid()}"
        names = sorted(self.samples)
        offsets: dict[str, list[int]] = {}
        position = 0
        with open(stem.with_suffix(".f64"), "wb") as out:
            for name in names:
                series = self.samples[name]
                series.tofile(out)
                offsets[name] = [position, len(series)]
                position += len(series)
        meta = {
            "pid": os.getpid(),
            "spawned_at": self.spawned_at,
            "stopping_at": self.stopping_at,
            "series": offsets,
            "failures": dict(self.failures),
            **extra,
        }
        meta_path = stem.with_suffix(".json")
        meta_path.write_text(json.dumps(meta, indent=1))
        return meta_path


@dataclass(frozen=True)
class ProcessRecord:
    meta: dict[str, Any]
    samples: dict[str, array[float]]


def load(directory: Path) -> list[ProcessRecord]:
    """Every process's record in ``directory``."""
    records = []
    for meta_path in sorted(directory.glob("locust-*.json")):
        meta = json.loads(meta_path.read_text())
        data = array("d")
        raw = meta_path.with_suffix(".f64").read_bytes()
        data.frombytes(raw)
        samples = {
            name: data[start : start + length] for name, (start, length) in meta["series"].items()
        }
        records.append(ProcessRecord(meta, samples))
    return records


def window(records: list[ProcessRecord], warmup: float) -> tuple[float, float]:
    """The steady-state window (start, end) shared by all processes."""
    spawned = [r.meta["spawned_at"] for r in records if r.meta["spawned_at"] is not None]
    stopping = [r.meta["stopping_at"] for r in records if r.meta["stopping_at"] is not None]
    if not spawned or not stopping:
        raise ValueError("no process reported spawning complete and stopping times")
    start, end = max(spawned) + warmup, min(stopping)
    if end <= start:
        raise ValueError(f"the run is shorter than the warm-up ({end - start:.1f} s of window)")
    return start, end


@dataclass(frozen=True)
class Summary:
    """One request name in one window. ``rps`` counts the successful requests
    that ended in the window. The latencies (ms) are over every request that
    both began and ended in it, so that a request stuck since the ramp-up
    (its user's first connection, say) does not count; ``requests`` and
    ``failed`` count those. Successful or not, as Locust counts, except
    ``p99_ok`` over the successful ones only: a driver that sheds load with
    quick 503s has a low p99 and a high p99_ok."""

    requests: int
    failed: int
    rps: float
    mean: float
    stdev: float
    p50: float
    p99: float
    max: float
    p99_ok: float = math.nan

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(records: list[ProcessRecord], name: str, start: float, end: float) -> Summary:
    times: list[float] = []
    ok_times: list[float] = []
    completed = 0
    for record in records:
        series = record.samples.get(name)
        if series is None:
            continue
        for i in range(0, len(series), 3):
            ended, ms, ok = series[i], series[i + 1], series[i + 2] == 1.0
            if not start <= ended < end:
                continue
            completed += ok
            if ended - ms / 1000 >= start:
                times.append(ms)
                if ok:
                    ok_times.append(ms)
    if not times:
        return Summary(0, 0, 0.0, *(math.nan,) * 5)
    times.sort()
    ok_times.sort()
    count = len(times)
    mean = math.fsum(times) / count
    var = math.fsum((t - mean) ** 2 for t in times) / (count - 1) if count > 1 else 0.0
    return Summary(
        requests=count,
        failed=count - len(ok_times),
        rps=completed / (end - start),
        mean=mean,
        stdev=math.sqrt(var),
        p50=percentile(times, 50),
        p99=percentile(times, 99),
        max=times[-1],
        p99_ok=percentile(ok_times, 99),
    )
