"""``feedsvc serve``: settings from flags and env, and the embedded Redis."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from feedsvc.config import ENV_PREFIX, Settings, parse_settings
from feedsvc.testing import ServiceProcess

pytestmark = pytest.mark.process  # starts python -m feedsvc, and feedsvc serve

HEADERS = {
    "Client-ID": str(uuid.uuid4()),
    "X-Project-ID": "cli",
    "Content-Type": "application/json",
}


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "feedsvc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_help_documents_every_setting() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in result.stdout
        assert ENV_PREFIX + f.name.upper() in result.stdout


def test_help_groups_the_flags_by_section_and_shows_choices() -> None:
    """305 lines of flags in one list were hard to read (issue 28): each flag
    is under the heading of its section, and a flag with choices names them."""
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    sections: dict[str, list[str]] = {}
    heading = ""
    for line in result.stdout.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
            sections[heading] = []
        elif line.startswith("  --"):
            sections[heading].append(line.split()[0].rstrip(","))
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(Settings)}
    grouped = [flag for heading, found in sections.items() for flag in found if flag in flags]
    assert sorted(grouped) == sorted(flags)  # each flag once
    assert {"service", "Redis", "subscriptions", "logs and benchmarks"} <= set(sections)
    assert all(len(found) <= 25 for found in sections.values()), sections
    assert "--redis-url" in sections["Redis"]
    assert "--driver {lua,watch,watch-naive}" in result.stdout
    assert "--log-format {text,json}" in result.stdout


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--pool-size", "1"], {}, "--pool-size must be >= 2"),
        (["--driver", "etcd"], {}, "--driver must be one of lua, watch, watch-naive"),
        ([], {"FEEDSVC_PORT": "http"}, "FEEDSVC_PORT: invalid value"),
        (["--min-message-ttl", "100", "--default-message-ttl", "60"], {}, "need --min-message-ttl"),
        (["--redis-url", "localhost:6379"], {}, "--redis-url must start with redis://"),
        (["--auth-token", "secret"], {}, "--auth-token must be TOKEN=PROJECT"),
        (
            [],
            {"FEEDSVC_MESSAGE_ENCRYPTION_KEY": "too-short"},
            "--message-encryption-key must be at least 16 characters",
        ),
        (["--subscriber-allow", "10.0.0.0/33"], {}, "--subscriber-allow must be CIDR"),
        (
            [],
            {"FEEDSVC_MESSAGE_ENCRYPTION_OLD_KEYS": "an old key of enough length"},
            "--message-encryption-old-keys needs --message-encryption-key",
        ),
        ([], {"FEEDSVC_SMTP_SERVER": "mail.example.org"}, "--smtp-server must be host:port"),
        (["--require-confirmation"], {}, "--require-confirmation needs --signed-url-key"),
        (["--delivery-lease", "2", "--delivery-timeout", "1"], {}, "below half"),
        (["--project-rate", "-1"], {}, "--project-rate must be >= 0"),
        (["--project-rate", "1e-9"], {}, "--project-rate must be 0 (no limit) or at least"),
        (["--project-rate", "2000000"], {}, "--project-rate must be <= 1000000"),
        ([], {"FEEDSVC_PROJECT_RATE": "nan"}, "--project-rate must be a number"),
        (["--project-burst", "5"], {}, "--project-burst needs --project-rate"),
        (["--project-rate", "5", "--project-burst", "-1"], {}, "--project-burst must be >= 0"),
    ],
)
def test_bad_setting_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    result = run_cli("serve", *args, env=env)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single line of a refusal to start (exit code 2), as for a bad setting."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("feedsvc: error: "), result.stderr
    return lines[0]


# No Redis is needed: the address is taken before anything else starts.
UNUSED_REDIS = ["--redis-url", "redis://127.0.0.1:1/0"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_port_in_use_is_one_line_and_exit_2(workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--port", str(port), "--workers", workers, *UNUSED_REDIS)
    line = one_line_error(result)
    assert f"127.0.0.1:{port}" in line
    assert "in use" in line


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])
def test_bad_host_is_one_line_and_exit_2(host: str) -> None:
    result = run_cli("serve", "--host", host, "--port", "0", *UNUSED_REDIS)
    assert host in one_line_error(result)


def test_data_dir_that_is_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("a file, not a directory\n")
    result = run_cli("serve", "--port", "0", "--data-dir", str(not_a_dir))
    line = one_line_error(result)
    assert "--data-dir" in line
    assert str(not_a_dir) in line
    assert "not a directory" in line


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


def pid_of_redis(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
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
    data_dir, log = tmp_path / "data", tmp_path / "serve.log"
    path = "/v2/queues/cli.q/messages"

    with ServiceProcess("--data-dir", str(data_dir), log_path=log) as svc:
        assert svc.redis_url is not None
        redis_pid = pid_of_redis(svc.redis_url)
        status, body = request("POST", svc.url + path, {"messages": [{"body": {"kept": True}}]})
        assert status == 201, body
        assert svc.stop(signal.SIGTERM) == 0
        # checked before the block ends: leaving it kills whatever is left
        deadline = time.monotonic() + 10
        while not gone(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(redis_pid), "the embedded Redis outlived the service"

    with ServiceProcess("--data-dir", str(data_dir), log_path=log) as svc:
        status, body = request("GET", svc.url + path + "?echo=true")
        assert status == 200
        assert [m["body"] for m in json.loads(body)["messages"]] == [{"kept": True}]
        assert svc.stop(signal.SIGINT) == 0


def test_the_configuration_table_lists_every_setting() -> None:
    guide = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    missing = [
        f.name
        for f in dataclasses.fields(Settings)
        if f"`--{f.name.replace('_', '-')}`" not in guide
    ]
    assert missing == []
