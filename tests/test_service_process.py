"""``--ready-file`` and the harness built on it, ``feedsvc.testing.ServiceProcess``.

The service says it is ready with the real port (``--port 0``), only once it
accepts (every worker, with ``--workers``), and takes the file away when it
stops; the harness fails with the log when the service cannot start, stops
it with SIGTERM even under a runner that ignores SIGINT, and leaves no
process behind: not the workers, not the embedded Redis.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import redis

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.process.readiness import Ready, connect_url, read_ready_file, write_ready_file
from feedsvc.testing import ServiceError, ServiceProcess

pytestmark = pytest.mark.process  # feedsvc serve, and redis-servers of its own

pytestmark = pytest.mark.process  # feedsvc serve, embedded redis-servers, a runner script

HEADERS = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "harness"}


def ping(url: str) -> int:
    request = urllib.request.Request(url + "/v2/ping", headers=HEADERS)
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_ready_file_round_trips_and_its_url_reaches_a_wildcard_address(
    tmp_path: Path,
) -> None:
    assert connect_url("0.0.0.0", 8888) == "http://127.0.0.1:8888"
    assert connect_url("::", 8888) == "http://[::1]:8888"
    assert connect_url("::1", 8888) == "http://[::1]:8888"
    assert connect_url("10.0.0.5", 8888) == "http://10.0.0.5:8888"
    ready = Ready.listening("0.0.0.0", 8888, 42, 2, None)
    path = tmp_path / "run" / "feedsvc" / "ready.json"  # directories made as needed
    write_ready_file(path, ready)
    assert read_ready_file(path) == ready
    assert [p.name for p in path.parent.iterdir()] == ["ready.json"]
    assert read_ready_file(tmp_path / "absent.json") is None


def test_the_ready_file_holds_the_real_port_until_the_service_stops(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with ServiceProcess("--redis-url", redis_server.url, log_path=tmp_path / "serve.log") as svc:
        assert svc.port != 0
        assert svc.url == f"http://127.0.0.1:{svc.port}"
        assert svc.pid == svc.process.pid
        assert svc.redis_url == redis_server.url
        assert svc.ready.workers == 1
        assert ping(svc.url) == 204
        assert f"listening on http://127.0.0.1:{svc.port}" in svc.log_text()
        # what the harness read is what the service wrote, readable by its owner only
        assert read_ready_file(svc.ready_file) == svc.ready
        assert stat.S_IMODE(svc.ready_file.stat().st_mode) == 0o600
        assert [p.name for p in svc.ready_file.parent.glob(".ready*")] == []  # no temp file
        assert svc.stop() == 0
        assert not svc.ready_file.exists()


def test_with_workers_the_file_comes_once_every_worker_serves(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with ServiceProcess("--redis-url", redis_server.url, "--workers", "3", log_path=log) as svc:
        # each worker logs "listening" before it tells the supervisor
        assert svc.log_text().count(f"listening on http://127.0.0.1:{svc.port}") == 3
        assert svc.ready.workers == 3
        assert svc.pid == svc.process.pid  # the supervisor: the one to send SIGTERM to
        assert ping(svc.url) == 204
        assert svc.stop() == 0
        assert not svc.ready_file.exists()


def test_a_service_that_cannot_start_fails_with_its_log(tmp_path: Path) -> None:
    svc = ServiceProcess("--pool-size", "1", temp_parent=tmp_path)
    with pytest.raises(ServiceError, match=r"exited with code 2 before it was ready") as failed:
        svc.start()
    assert "--pool-size must be >= 2" in str(failed.value)
    assert "--pool-size must be >= 2" in svc.log_text()  # the log outlives its directory
    assert list(tmp_path.iterdir()) == []
    assert svc.live_pids() == []


@pytest.mark.parametrize("ending", ["graceful", "error"])
def test_nothing_outlives_the_block(ending: str, tmp_path: Path) -> None:
    """The supervisor, its workers and the embedded Redis (a process group of
    its own) are all gone after the block, whether it ended well or not."""
    svc = ServiceProcess("--workers", "2", log_path=tmp_path / "serve.log")
    failing: AbstractContextManager[object] = (
        pytest.raises(RuntimeError, match="the test failed") if ending == "error" else nullcontext()
    )
    with failing, svc:
        assert svc.redis_url is not None
        client = redis.Redis.from_url(svc.redis_url)
        try:
            redis_pid = int(client.info("server")["process_id"])
        finally:
            client.close()
        found = re.findall(r"worker \d+ started \(pid (\d+)\)", svc.log_text())
        workers = {int(pid) for pid in found}
        assert len(workers) == 2
        pids = set(svc.live_pids())
        assert pids == {svc.pid, redis_pid, *workers}
        if ending == "error":
            raise RuntimeError("the test failed")
    assert [pid for pid in pids if alive(pid)] == []
    assert svc.live_pids() == []


def test_a_stop_that_times_out_kills_everything(redis_server: RedisServer, tmp_path: Path) -> None:
    with ServiceProcess(
        "--redis-url", redis_server.url, "--workers", "2", log_path=tmp_path / "serve.log"
    ) as svc:
        pids = svc.live_pids()
        assert len(pids) == 3
        os.kill(svc.pid, signal.SIGSTOP)  # it can no longer act on SIGTERM
        assert svc.stop(timeout=0.5) == -signal.SIGKILL
        assert [pid for pid in pids if alive(pid)] == []


SIGINT_IGNORED = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup, or & in a script
from feedsvc.testing import ServiceProcess
codes = []
for sig in (signal.SIGTERM, signal.SIGINT):
    with ServiceProcess("--redis-url", sys.argv[1], stop_timeout=30) as svc:
        codes.append(svc.stop(sig))
print(*codes)
"""


def test_a_runner_that_ignores_sigint_still_stops_the_service(
    redis_server: RedisServer,
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SIGINT_IGNORED, redis_server.url],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    # SIGTERM, and SIGINT too: the service does not inherit the runner's SIG_IGN
    assert result.stdout.split() == ["0", "0"], result.stderr


RUNNER = """
import json, sys, time
from pathlib import Path
from feedsvc.testing import ServiceProcess
svc = ServiceProcess("--redis-url", sys.argv[1], "--workers", "2", temp_parent=Path(sys.argv[2]))
print(json.dumps(svc.start().live_pids()), flush=True)
time.sleep(120)
"""


def test_a_runner_killed_without_cleaning_up_takes_the_service_along(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", RUNNER, redis_server.url, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    ) as runner:
        try:
            assert runner.stdout is not None
            line = runner.stdout.readline()  # bounded: start() has a ready timeout
            pids = json.loads(line)
            assert len(pids) == 3 and all(alive(pid) for pid in pids)  # supervisor, 2 workers
        finally:
            runner.kill()  # no with block ends, nothing is cleaned up
    # SIGTERM from the kernel: the supervisor drains and stops its workers
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if alive(pid)] == []
