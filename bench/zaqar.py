"""feedsvc against real OpenStack Zaqar: the ``zaqar`` part of ``python -m bench``.

Zaqar 23.0.1 with its Redis driver runs under gunicorn (2 workers x 8
gthread threads) against a Redis server of its own, next to one ``feedsvc
serve`` process (default settings) and one ``feedsvc serve --workers 2``
(as many processes as gunicorn's) on the suite's Redis. All are driven
by the same wrk scripts: POST one message (bench/wrk/post.lua), and GET a
page of 10 with ``echo=true`` from a queue holding 20 messages
(bench/wrk/get.lua), with ``wrk -t2 -c32`` (Zaqar serves 16 requests at
once; 32 connections keep each thread busy with one more queued). They
take turns, ``rounds`` times; the rows give the medians, the ratios
feedsvc/Zaqar (``ratio`` for one process, ``ratio_workers`` for two), and
the cores each side took during its own runs (the
service's processes and its Redis), wrk's and the rest of the machine's, so
that the reader sees who was the ceiling.

Zaqar is installed once into a virtualenv of its own under ``--zaqar-home``
(default ``~/.cache/feedsvc-bench/zaqar``; about a minute, from the package
index). If that fails, the part says so in one line and is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.machine import process_tree
from bench.service import PRODUCER, WrkResult, WrkSuite, service, wrk
from feedsvc.embedded_redis.server import RedisServer, pick_free_port

DEFAULT_HOME = Path.home() / ".cache" / "feedsvc-bench" / "zaqar"
REQUIREMENTS = ("zaqar[redis]==23.0.1", "gunicorn")
WORKERS, THREADS = 2, 8
CONNECTIONS, WRK_THREADS = 32, 2
GET_PATH = "/v2/queues/bget/messages?echo=true&limit=10"

CONFIG = """\
[DEFAULT]
# empty: no authentication (no keystone middleware)
auth_strategy =
pooling = false
admin_mode = false
debug = false
log_file = {log}

[drivers]
transport = wsgi
message_store = redis
management_store = redis

[drivers:transport:wsgi]
bind = 127.0.0.1
port = {port}

[drivers:message_store:redis]
uri = {redis}

[drivers:management_store:redis]
uri = {redis}

[profiler]
enabled = false
"""


class ZaqarUnavailable(RuntimeError):
    """Zaqar could not be installed or started; the message says why."""


def installed(home: Path) -> Path:
    """The virtualenv's bin directory, installing Zaqar and gunicorn there first if needed."""
    venv = home / "venv"
    bin_dir = venv / "bin"
    probe = [str(bin_dir / "python"), "-c", "import zaqar, redis, gunicorn"]
    if (bin_dir / "gunicorn").exists() and _runs(probe):
        return bin_dir
    print(f"   installing Zaqar into {venv} (once)", flush=True)
    log = home / "install.log"
    try:
        home.mkdir(parents=True, exist_ok=True)
        out = log.open("wb")
    except OSError as exc:
        raise ZaqarUnavailable(f"cannot install into {home}: {exc.strerror}") from None
    with out:
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(bin_dir / "pip"), "install", "--quiet", *REQUIREMENTS],
        ]
        for step in steps:
            try:
                code = subprocess.run(
                    step, check=False, stdout=out, stderr=subprocess.STDOUT, timeout=900
                ).returncode
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ZaqarUnavailable(f"{step[0]}: {exc}") from None
            if code != 0:
                raise ZaqarUnavailable(f"{' '.join(step[:3])} failed (exit {code}); see {log}")
    if not _runs(probe):
        raise ZaqarUnavailable(f"zaqar does not import after installing; see {log}")
    return bin_dir


def _runs(command: list[str]) -> bool:
    return subprocess.run(command, check=False, capture_output=True).returncode == 0


@contextlib.contextmanager
def zaqar(home: Path, workdir: Path) -> Iterator[tuple[str, int, int]]:
    """Zaqar under gunicorn on a free port with a Redis of its own:
    (url, gunicorn's pid, its Redis's pid)."""
    bin_dir = installed(home)
    run = workdir / "zaqar"
    run.mkdir(exist_ok=True)
    store = RedisServer(workdir / "zaqar-redis", appendonly=False)
    store.start()
    proc = None
    try:
        port = pick_free_port()
        # The WSGI app reads only oslo.config's default paths, ~/zaqar.conf among them.
        config = CONFIG.format(log=run / "zaqar.log", port=port, redis=store.url)
        (run / "zaqar.conf").write_text(config)
        command = [
            str(bin_dir / "gunicorn"), "-b", f"127.0.0.1:{port}", "-w", str(WORKERS),
            "-k", "gthread", "--threads", str(THREADS), "--log-file", str(run / "gunicorn.log"),
            "zaqar.transport.wsgi.app:app",
        ]  # fmt: skip
        env = {**os.environ, "HOME": str(run)}
        proc = subprocess.Popen(
            command, cwd=run, env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        yield url, proc.pid, store.pid or 0
    finally:
        if proc is not None:
            _stop_group(proc)
        store.stop()


def _request(url: str, method: str = "GET", body: bytes | None = None) -> int:
    headers = {"Client-ID": PRODUCER, "X-Project-ID": "bench", "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as response:
        response.read()
        return int(response.status)


def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            _request(url + "/v2/ping")
            return
        except (OSError, urllib.error.HTTPError):
            if proc.poll() is not None:
                raise ZaqarUnavailable(f"gunicorn exited ({proc.returncode})") from None
            if time.monotonic() > deadline:
                raise ZaqarUnavailable("Zaqar did not answer /v2/ping in 60 s") from None
            time.sleep(0.2)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM gunicorn's process group, SIGKILL what is left after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _prefill(url: str) -> None:
    """Queue bget with 20 messages, as the Zaqar write-up's bench.sh does."""
    _request(url + "/v2/queues/bget", "PUT", b"{}")
    body = {"messages": [{"ttl": 300, "body": {"n": i, "pad": "x" * 100}} for i in range(20)]}
    _request(url + "/v2/queues/bget/messages", "POST", json.dumps(body).encode())


def part_zaqar(suite: WrkSuite, home: Path) -> None:
    try:
        with zaqar(home, suite.workdir) as (zaqar_url, gunicorn_pid, zaqar_redis):
            _prefill(zaqar_url)
            with (
                service(suite.redis.url, suite.workdir, log="feedsvc-zaqar.log") as svc,
                service(
                    suite.redis.url, suite.workdir, "--workers", str(WORKERS),
                    log="feedsvc-zaqar-workers.log",
                ) as svc2,
            ):  # fmt: skip
                feedsvcs = {"feedsvc": svc.pid, "feedsvc_workers": svc2.pid}
                urls = {"feedsvc": svc.url, "feedsvc_workers": svc2.url}
                _compare(suite, urls, feedsvcs, zaqar_url, gunicorn_pid, zaqar_redis)
    except ZaqarUnavailable as exc:
        suite.add("feedsvc vs Zaqar", skipped=str(exc))


def _compare(
    suite: WrkSuite,
    urls: dict[str, str],
    pids: dict[str, int],
    zaqar_url: str,
    gunicorn_pid: int,
    zaqar_redis: int,
) -> None:
    """Each feedsvc side (urls and pids by name: one process, and as many
    worker processes as Zaqar's gunicorn has) against Zaqar, in turns."""
    redis = [suite.redis.pid or 0]
    sides = {
        name: (urls[name], {"service": process_tree(pid), "redis": redis})
        for name, pid in pids.items()
    }
    sides["zaqar"] = (zaqar_url, {"service": process_tree(gunicorn_pid), "redis": [zaqar_redis]})
    order = list(sides)
    for what, script, path in (
        ("POST 1 message", "post.lua", "/v2/queues/bpost/messages"),
        ("GET page of 10, echo", "get.lua", GET_PATH),
    ):
        results: dict[str, list[WrkResult]] = {side: [] for side in sides}
        for r in range(suite.rounds):
            # each side takes each place in the order in turn
            for side in order[r % len(order) :] + order[: r % len(order)]:
                base, groups = sides[side]
                results[side].append(
                    wrk(
                        base + path,
                        script,
                        CONNECTIONS,
                        suite.duration,
                        threads=WRK_THREADS,
                        cpu_of=groups,
                    )
                )
        rps = {side: statistics.median(x.rps for x in results[side]) for side in results}
        cores = {
            (side, name): statistics.median((x.cores or {}).get(name, 0.0) for x in done)
            for side, done in results.items()
            for name in ("service", "redis", "wrk", "other")
        }
        # On a shared machine the two sides may get different shares of the
        # cores: requests per core-second of the service and its Redis
        # compare the work each request takes.
        per_core = {
            side: rps[side] / max(1e-9, cores[side, "service"] + cores[side, "redis"])
            for side in results
        }
        values: dict[str, object] = {
            "feedsvc_rps": rps["feedsvc"],
            "zaqar_rps": rps["zaqar"],
            "ratio": rps["feedsvc"] / max(1e-9, rps["zaqar"]),
            "ratio_per_core": per_core["feedsvc"] / max(1e-9, per_core["zaqar"]),
        }
        if "feedsvc_workers" in rps:
            # as many processes as Zaqar's gunicorn runs
            values["feedsvc_workers_rps"] = rps["feedsvc_workers"]
            values["ratio_workers"] = rps["feedsvc_workers"] / max(1e-9, rps["zaqar"])
            values["ratio_workers_per_core"] = per_core["feedsvc_workers"] / max(
                1e-9, per_core["zaqar"]
            )
        for side, done in results.items():
            values[f"{side}_p99_ms"] = statistics.median(x.p99_ms for x in done)
            values[f"{side}_errors"] = sum(x.errors for x in done)
            for name in ("service", "redis", "wrk", "other"):
                values[f"{side}_{name}_cores"] = cores[side, name]
        suite.add(f"{what}: feedsvc/Zaqar", **values)
