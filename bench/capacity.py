"""How far one service goes: the ``workers``, ``batch`` and ``pool`` parts of
``python -m bench``.

``workers``: POST and GET with ``--workers 1`` and ``--workers 2`` (both
services up at once, measured alternately, ``rounds`` times; medians), the
ratio 2/1, and the cores taken during each run by the feedsvc processes
(the parent and its workers; ``split``: each worker's), redis-server and wrk. wrk runs with one
thread and 64 connections: one wrk thread sends well over what two workers
answer (hello alone is ≈17k req/s per process against ≈7k POSTs), so a
second thread would only take CPU from the two cores that wrk, Redis and
the workers share; 64 connections keep 32 requests in each worker.

``batch``: messages/s for POSTs of 1, 10, 100 and 1000 messages (64
connections). Every step starts from an empty Redis (``FLUSHDB``), so no
size pays for the data an earlier one left, and the sizes take turns,
``rounds`` times, in a rotating order; medians. Each row also says what a
message cost: CPU µs of feedsvc and of Redis per message, and the post
script's own µs per message inside Redis (``INFO commandstats``).

``pool``: 5,000 against 100 concurrent clients at the same offered load.
First the highest POST rate with 100 and with 5,000 connections (one
message to one of 1000 queues, default settings; sent as fast as answered,
after the same warm-up as below), then half of the lower of the two
offered by a paced wrk script (bench/wrk/paced.lua) with 100 and with 5,000
connections,
alternately, ``rounds`` times: the rate achieved (it must equal the rate
offered, else the service or wrk fell behind; the script drops the times
it missed rather than send a burst),
p50/p99, errors, the ratio of the p99s (medians), and the cores feedsvc,
wrk and the rest of the machine took. The same paced load on ``GET
/bench/hello`` (same process, no Redis) shows what wrk and the machine
themselves add with that many connections. The clients connect
``WARMUP_S`` before they send: accepting 5,000 connections at once costs
the service most of a second of CPU, which is not the steady load the
goal is about. Below saturation,
latency should not depend on how many clients share the load; at
saturation it grows with them (Little's law), hence half the maximum, and
the lower one: 5,000 connections cost the service (and wrk) more per
request than 100, so half of what 100 clients get through can be all that
5,000 do (on a 2-core machine, 4,900 against 4,900-5,500 req/s).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import redis

from bench.machine import process_tree, raise_open_files_limit
from bench.service import Service, WrkResult, WrkSuite, service, wrk

BATCH_SIZES = (1, 10, 100, 1000)
MANY_CLIENTS = 5000
FEW_CLIENTS = 100
#: Seconds the paced clients wait after connecting before they send (see post_paced.lua).
WARMUP_S = 2
CLIENTS = (FEW_CLIENTS, MANY_CLIENTS)


def _median_result(results: list[WrkResult], key: Callable[[WrkResult], float]) -> WrkResult:
    """The run whose ``key`` is the median (the lower one of an even count)."""
    ordered = sorted(results, key=key)
    return ordered[(len(ordered) - 1) // 2]


def _cores(results: list[WrkResult], name: str) -> float:
    return statistics.median((r.cores or {}).get(name, 0.0) for r in results)


# -- workers ---------------------------------------------------------------------


def part_workers(suite: WrkSuite) -> None:
    runs = (
        ("POST 1 message", "post.lua", "/v2/queues/bpost/messages"),
        ("GET page of 10", "get.lua", "/v2/queues/bget/messages?limit=10"),
    )
    redis_pids = [suite.redis.pid or 0]
    with (
        service(suite.redis.url, suite.workdir, "--workers", "1", log="feedsvc-w1.log") as one,
        service(suite.redis.url, suite.workdir, "--workers", "2", log="feedsvc-w2.log") as two,
    ):
        services = {1: one, 2: two}
        # the supervisor, and each worker apart: how evenly the kernel spread
        # the connections over the workers shows in their cores
        groups: dict[int, dict[str, list[int]]] = {}
        for n, svc in services.items():
            supervisor, *workers = process_tree(svc.pid)
            groups[n] = {"supervisor": [supervisor], "redis": redis_pids}
            groups[n].update({f"worker{i}": [pid] for i, pid in enumerate(workers)})
        for what, script, path in runs:
            results: dict[int, list[WrkResult]] = {1: [], 2: []}
            for r in range(suite.rounds):
                for n in (1, 2) if r % 2 == 0 else (2, 1):
                    results[n].append(
                        wrk(
                            services[n].url + path,
                            script,
                            suite.connections,
                            suite.duration,
                            cpu_of=groups[n],
                        )
                    )
            rps = {n: statistics.median(x.rps for x in results[n]) for n in (1, 2)}
            values: dict[str, object] = {"rps_1": rps[1], "rps_2": rps[2], "ratio": rps[2] / rps[1]}
            for n in (1, 2):
                mid = _median_result(results[n], lambda x: x.rps)
                values[f"p99_ms_{n}"] = mid.p99_ms
                names = sorted(k for k in groups[n] if k.startswith("worker"))
                parent = _cores(results[n], "supervisor")
                split = [_cores(results[n], k) for k in names] or [parent]  # it serves itself
                values[f"feedsvc_cores_{n}"] = parent + sum(split) if names else parent
                values[f"split_{n}"] = "/".join(f"{c:.2f}" for c in split)
                for name in ("redis", "wrk", "other"):
                    values[f"{name}_cores_{n}"] = _cores(results[n], name)
                values[f"errors_{n}"] = sum(x.errors for x in results[n])
            suite.add(f"{what}: workers 2/1", **values)


# -- batch -----------------------------------------------------------------------


@dataclass
class BatchStep:
    result: WrkResult
    feedsvc_us: float  # CPU µs of feedsvc per message
    redis_us: float  # CPU µs of redis-server per message
    script_us: float  # µs inside the post script per message (INFO commandstats)


def part_batch(suite: WrkSuite) -> None:
    client = redis.Redis.from_url(suite.redis.url)
    steps: dict[int, list[BatchStep]] = {size: [] for size in BATCH_SIZES}
    try:
        with Service(suite.redis.url, suite.workdir / "feedsvc-batch.log",
                     "--max-messages-per-post", "1000") as svc:  # fmt: skip
            groups = {"feedsvc": [svc.pid], "redis": [suite.redis.pid or 0]}
            for r in range(suite.rounds):
                shift = r % len(BATCH_SIZES)
                for size in BATCH_SIZES[shift:] + BATCH_SIZES[:shift]:
                    client.flushdb()
                    client.config_resetstat()
                    result = wrk(svc.url + "/v2/queues/bbatch/messages", "post_batch.lua",
                                 suite.connections, suite.duration, env={"BATCH": str(size)},
                                 cpu_of=groups)  # fmt: skip
                    script = client.info("commandstats").get("cmdstat_evalsha", {})
                    messages = max(1.0, result.rps * size)
                    cores = result.cores or {}
                    steps[size].append(
                        BatchStep(
                            result,
                            feedsvc_us=1e6 * cores.get("feedsvc", 0.0) / messages,
                            redis_us=1e6 * cores.get("redis", 0.0) / messages,
                            script_us=float(script.get("usec_per_call", 0.0)) / size,
                        )
                    )
        client.flushdb()
    finally:
        client.close()
    for size in BATCH_SIZES:
        done = steps[size]
        mid = _median_result([s.result for s in done], lambda x: x.rps)
        suite.add(
            f"POST batches of {size}",
            msgs_per_s=statistics.median(s.result.rps * size for s in done),
            rps=mid.rps,
            p50_ms=mid.p50_ms,
            p99_ms=mid.p99_ms,
            feedsvc_us_per_msg=statistics.median(s.feedsvc_us for s in done),
            redis_us_per_msg=statistics.median(s.redis_us for s in done),
            script_us_per_msg=statistics.median(s.script_us for s in done),
            feedsvc_cores=_cores([s.result for s in done], "feedsvc"),
            redis_cores=_cores([s.result for s in done], "redis"),
            other_cores=_cores([s.result for s in done], "other"),
            errors=sum(s.result.errors for s in done),
        )


# -- 5,000 clients ---------------------------------------------------------------


def part_pool(suite: WrkSuite) -> None:
    limit = raise_open_files_limit()
    if limit < MANY_CLIENTS + 500:
        suite.add(f"{MANY_CLIENTS} vs {FEW_CLIENTS} clients", skipped=f"open files limit {limit}")
        return
    path = "/v2/queues/bpool/messages"
    with Service(suite.redis.url, suite.workdir / "feedsvc-pool.log") as svc:
        groups = {"feedsvc": [svc.pid], "redis": [suite.redis.pid or 0]}
        highest = {}
        for clients in CLIENTS:
            # paced at a rate nobody reaches: flat out, after the same warm-up
            flat_out = {"RATE": "10000000", "THREADS": "2", "START_MS": str(WARMUP_S * 1000),
                        "KIND": "post"}  # fmt: skip
            top = wrk(svc.url + path, "paced.lua", clients, WARMUP_S + suite.duration,
                      threads=2, env=flat_out, cpu_of=groups)  # fmt: skip
            highest[clients] = top.requests / (top.seconds - WARMUP_S)
            suite.add(
                f"POST, {clients} clients flat out",
                rps=highest[clients],
                p99_ms=top.p99_ms,
                errors=top.errors,
                feedsvc_cores=(top.cores or {}).get("feedsvc", 0.0),
                wrk_cores=(top.cores or {}).get("wrk", 0.0),
            )
        # below saturation for both counts: many connections cost the
        # service (and wrk) more per request, so theirs is the lower maximum
        offered = min(highest.values()) / 2
        pace = {"RATE": f"{offered:.0f}", "THREADS": "2", "START_MS": str(WARMUP_S * 1000)}
        kinds = {"post": (path, {**pace, "KIND": "post"}), "hello": ("/bench/hello", pace)}
        results: dict[tuple[str, int], list[WrkResult]] = {}
        for r in range(suite.rounds):
            order = (FEW_CLIENTS, MANY_CLIENTS) if r % 2 == 0 else (MANY_CLIENTS, FEW_CLIENTS)
            for clients in order:
                for kind, (target, env) in kinds.items():
                    results.setdefault((kind, clients), []).append(
                        wrk(
                            svc.url + target,
                            "paced.lua",
                            clients,
                            WARMUP_S + suite.duration,
                            threads=2,
                            env=env,
                            cpu_of=groups,
                        )
                    )
    for kind in kinds:
        p99 = {c: statistics.median(x.p99_ms for x in results[kind, c]) for c in CLIENTS}
        values: dict[str, object] = {"offered_rps": offered}
        for clients in CLIENTS:
            done = results[kind, clients]
            # sent after the warm-up only
            achieved = statistics.median(x.requests / (x.seconds - WARMUP_S) for x in done)
            values[f"rps_{clients}"] = achieved
            # below ~0.97 the service (or wrk) fell behind: not the load asked for
            values[f"reached_{clients}"] = achieved / offered
            values[f"p50_ms_{clients}"] = statistics.median(x.p50_ms for x in done)
            values[f"p99_ms_{clients}"] = p99[clients]
            values[f"errors_{clients}"] = sum(x.errors for x in done)
            for name in ("feedsvc", "wrk", "other"):
                values[f"{name}_cores_{clients}"] = _cores(done, name)
        values["p99_ratio"] = p99[MANY_CLIENTS] / p99[FEW_CLIENTS]
        what = "POST" if kind == "post" else "hello"
        suite.add(f"{what}: {MANY_CLIENTS}/{FEW_CLIENTS} clients, half max", **values)
