"""``feedsvc serve``: settings from flags and env, and the embedded Redis."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from feedsvc.config import ENV_PREFIX, Settings, parse_settings
from feedsvc.redis_server import pick_free_port

pytestmark = pytest.mark.process  # starts python -m feedsvc, and feedsvc serve

HEADERS = {
    "Client-ID": str(uuid.uuid4()),
    "X-Project-ID": "cli",
    "Content-Type": "application/json",
}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "feedsvc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_help_documents_every_setting() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in result.stdout
        assert ENV_PREFIX + f.name.upper() in result.stdout


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--pool-size", "1"], {}, "--pool-size must be >= 2"),
        (["--driver", "etcd"], {}, "--driver must be one of lua, watch"),
        ([], {"FEEDSVC_PORT": "http"}, "FEEDSVC_PORT: invalid value"),
        (["--min-message-ttl", "100", "--default-message-ttl", "60"], {}, "need --min-message-ttl"),
        (["--redis-url", "localhost:6379"], {}, "--redis-url must start with redis://"),
        (["--auth-token", "secret"], {}, "--auth-token must be TOKEN=PROJECT"),
    ],
)
def test_bad_setting_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    result = run_cli("serve", *args, env=env)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_flag_wins_over_environment() -> None:
    settings = parse_settings(
        ["--pool-size", "7"],
        {"FEEDSVC_POOL_SIZE": "9", "FEEDSVC_DRIVER": "watch", "FEEDSVC_ACCESS_LOG": "yes"},
    )
    assert settings.pool_size == 7
    assert settings.driver == "watch"
    assert settings.access_log is True
    assert settings.redis_url is None


def request(method: str, url: str, body: object = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=HEADERS)
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start_serve(data_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "feedsvc", "serve", "--port", str(port), "--data-dir", data_dir],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def wait_listening(log: Path, proc: subprocess.Popen[bytes], count: int) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = log.read_text()
        if text.count("listening on") >= count:
            found: list[str] = re.findall(r"embedded Redis at redis://127\.0\.0\.1:(\d+)", text)
            return found[-1]
        assert proc.poll() is None, text
        time.sleep(0.05)
    raise AssertionError(log.read_text())


def pid_of_port(port: str) -> int:
    import redis

    client = redis.Redis(port=int(port), socket_timeout=5)
    try:
        info = client.info("server")
    finally:
        client.close()
    return int(info["process_id"])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_serve_with_embedded_redis_keeps_data_across_restarts(tmp_path: Path) -> None:
    data_dir, log, port = tmp_path / "data", tmp_path / "serve.log", pick_free_port()
    base = f"http://127.0.0.1:{port}/v2/queues/cli.q/messages"

    proc = start_serve(data_dir, port, log)
    try:
        redis_port = wait_listening(log, proc, 1)
        redis_pid = pid_of_port(redis_port)
        status, body = request("POST", base, {"messages": [{"body": {"kept": True}}]})
        assert status == 201, body
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while not gone(redis_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(redis_pid), "the embedded Redis outlived the service"

    proc = start_serve(data_dir, port, log)
    try:
        wait_listening(log, proc, 2)
        status, body = request("GET", base + "?echo=true")
        assert status == 200
        assert [m["body"] for m in json.loads(body)["messages"]] == [{"kept": True}]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_readme_configuration_table_lists_every_setting() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [
        f.name
        for f in dataclasses.fields(Settings)
        if f"`--{f.name.replace('_', '-')}`" not in readme
    ]
    assert missing == []
