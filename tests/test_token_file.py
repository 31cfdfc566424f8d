"""--auth-token-file: tokens kept off the command line, read again on
SIGHUP by every worker of ``feedsvc serve --workers``."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from feedsvc.embedded_redis.server import RedisServer
from tests.test_workers import serving, wait_for

pytestmark = pytest.mark.process  # feedsvc serve --workers


def status(port: int, token: str) -> int:
    """A POST on a connection of its own (so the workers share them out)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/queues/tf/messages",
        data=b'{"messages": [{"body": 1}]}',
        method="POST",
        headers={
            "Client-ID": str(uuid.uuid4()),
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            "Connection": "close",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_makes_every_worker_read_the_token_file_again(
    redis_server: RedisServer, tmp_path: Path, workers: int
) -> None:
    old, new = "old-" + uuid.uuid4().hex, "new-" + uuid.uuid4().hex
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{old} tf-project *:*\n")
    log = tmp_path / "serve.log"
    flags = ("--auth-token-file", str(tokens))
    with serving(redis_server.url, log, *flags, workers=workers) as svc:
        assert all(status(svc.port, old) == 201 for _ in range(10))
        assert status(svc.port, new) == 401
        tokens.write_text(f"# rotated\n{new} tf-project post:tf\n")
        svc.process.send_signal(signal.SIGHUP)
        wait_for(lambda: log.read_text().count("read 1 tokens from") == workers, "each reading")
        assert [status(svc.port, old) for _ in range(20)] == [401] * 20
        assert [status(svc.port, new) for _ in range(20)] == [201] * 20
        # a file that does not parse keeps the tokens in force
        tokens.write_text(f"{new} tf-project\n")
        svc.process.send_signal(signal.SIGHUP)
        wait_for(lambda: log.read_text().count("kept the tokens in force") == workers, "refusing")
        assert [status(svc.port, new) for _ in range(10)] == [201] * 10
        assert svc.returncode is None


def test_a_token_file_that_does_not_parse_stops_the_start(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("t p write:*\n")
    done = subprocess.run(
        [sys.executable, "-m", "feedsvc", "serve", "--redis-url", "redis://127.0.0.1:1",
         "--auth-token-file", str(tokens)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "line 1: 'write:*' is no scope" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_token_on_the_command_line_is_logged_as_visible_to_ps(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with serving(redis_server.url, log, "--auth-token", "cli-token=p", workers=1) as svc:
        assert status(svc.port, "cli-token") == 201
    assert "--auth-token is visible to ps" in log.read_text()
