"""Keystone tokens (X-Auth-Token, --keystone-url) checked by a real Keystone.

The Keystone is OpenStack's own, from PyPI, in its venv (``make keystone``;
feedsvc/testing/keystone.py), with projects, users and roles made through
its v3 API; feedsvc is a real ``feedsvc serve``. No assertion is timed: a
revoked token is polled for until a deadline.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.auth.access import role_scopes
from feedsvc.config import Settings
from feedsvc.testing import keystone as harness
from feedsvc.testing.keystone import Keystone
from feedsvc.testing.service import ServiceProcess
from tests.conftest import make_settings
from tests.test_cli import run_cli

#: A real Keystone (its venv, make keystone) and feedsvc serve: processes.
needs_keystone = pytest.mark.skipif(
    not harness.available(), reason="no Keystone venv: make keystone"
)
PASSWORD = "a-user-password"


def call(
    svc: ServiceProcess, method: str, path: str, token: str | None = None, body: Any = None,
    project: str | None = None,
) -> tuple[int, dict[str, Any], dict[str, str]]:  # fmt: skip
    headers = {"Client-ID": str(uuid.uuid4()), "Content-Type": "application/json"}
    if token is not None:
        headers["X-Auth-Token"] = token
    if project is not None:
        headers["X-Project-ID"] = project
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(svc.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw, status, got = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    return status, (json.loads(raw) if raw else {}), got


def post(svc: ServiceProcess, queue: str, token: str | None, project: str | None = None) -> int:
    body = {"messages": [{"ttl": 300, "body": {"n": 1}}]}
    return call(svc, "POST", f"/v2/queues/{queue}/messages", token, body, project)[0]


def bodies(svc: ServiceProcess, queue: str, token: str) -> list[Any]:
    status, answer, _ = call(svc, "GET", f"/v2/queues/{queue}/messages?echo=true", token)
    assert status in (200, 204), (status, answer)
    return [m["body"] for m in answer.get("messages", [])]


class World:
    """A Keystone with two projects, users by role, and feedsvc's service user."""

    def __init__(self, ks: Keystone, tmp: Path) -> None:
        self.ks = ks
        self.project_a = ks.make("projects", {"name": "ks-a", "domain_id": "default"})
        self.project_b = ks.make("projects", {"name": "ks-b", "domain_id": "default"})
        service = ks.make("projects", {"name": "service", "domain_id": "default"})
        ks.user("feedsvc", "service-password", service, "service")
        ks.user("alice", PASSWORD, self.project_a, "member")
        ks.user("rita", PASSWORD, self.project_a, "reader")
        ks.user("olga", PASSWORD, self.project_a, "observer")  # a role not mapped
        ks.user("bob", PASSWORD, self.project_b, "member")
        self.password_file = tmp / "keystone-password"
        self.password_file.write_text("service-password\n")

    def flags(self, cache: float) -> tuple[str, ...]:
        return (
            "--keystone-url", self.ks.url, "--keystone-user", "feedsvc",
            "--keystone-password-file", str(self.password_file),
            "--keystone-project", "service", "--keystone-cache", str(cache),
            "--keystone-negative-cache", "1",
        )  # fmt: skip

    def token(self, user: str, project: str | None = "ks-a") -> str:
        return self.ks.token(user, PASSWORD, project)[0]


@pytest.fixture
def keystone_world(tmp_path: Path) -> Iterator[World]:
    with Keystone() as ks:
        yield World(ks, tmp_path)


def wait_until(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.keystone
@pytest.mark.process
@pytest.mark.timeout(600)
@needs_keystone
def test_roles_projects_and_revocation_through_a_real_keystone(
    keystone_world: World, redis_url: str, tmp_path: Path
) -> None:
    world = keystone_world
    flags = world.flags(cache=2)
    with ServiceProcess("--redis-url", redis_url, *flags, log_path=tmp_path / "serve.log") as svc:
        alice, rita, olga = (world.token(user) for user in ("alice", "rita", "olga"))
        bob = world.token("bob", "ks-b")
        queue = "ks-" + uuid.uuid4().hex[:8]
        # member: every action; the project is the token's (X-Project-ID is ignored)
        assert post(svc, queue, alice, project=world.project_b) == 201
        assert bodies(svc, queue, alice) == [{"n": 1}]
        assert bodies(svc, queue, bob) == []  # project B has no such messages
        # reader: reads, and a post is 403 with nothing posted
        assert bodies(svc, queue, rita) == [{"n": 1}]
        status, answer, headers = call(
            svc, "POST", f"/v2/queues/{queue}/messages", rita, {"messages": [{"body": 2}]}
        )
        assert status == 403, answer
        assert "insufficient_scope" in headers["WWW-Authenticate"]
        assert bodies(svc, queue, alice) == [{"n": 1}]
        # a role the mapping does not name allows nothing
        assert call(svc, "GET", f"/v2/queues/{queue}/messages", olga)[0] == 403
        # a token scoped to no project
        unscoped = world.token("alice", project=None)
        status, answer, _ = call(svc, "GET", f"/v2/queues/{queue}/messages", unscoped)
        assert status == 403 and "no project" in answer["description"]
        # no token, an invalid one: 401, JSON, keystonemiddleware's challenge
        for token in (None, "not-a-keystone-token", alice[:-4] + "AAAA"):
            status, answer, headers = call(svc, "GET", f"/v2/queues/{queue}/messages", token)
            assert status == 401, (token, answer)
            assert answer["title"] == "Authentication required"
            assert headers["WWW-Authenticate"] == f'Keystone uri="{world.ks.url}"'
        # revoked at Keystone: refused once the cache time (2 s) has passed
        doomed = world.token("alice")
        assert post(svc, queue, doomed) == 201
        world.ks.revoke(doomed)
        wait_until(lambda: post(svc, queue, doomed) == 401, "the revoked token refused")
        assert post(svc, queue, alice) == 201  # the others still work
        assert svc.stop() == 0


@pytest.mark.keystone
@pytest.mark.process
@pytest.mark.timeout(600)
@needs_keystone
def test_keystone_down_is_503_for_new_tokens_and_cached_ones_keep_working(
    keystone_world: World, redis_url: str, tmp_path: Path
) -> None:
    world = keystone_world
    with ServiceProcess(
        "--redis-url", redis_url, *world.flags(cache=600), log_path=tmp_path / "serve.log"
    ) as svc:
        seen, unseen = world.token("alice"), world.token("rita")
        queue = "ks-" + uuid.uuid4().hex[:8]
        assert post(svc, queue, seen) == 201
        world.ks.stop()
        assert post(svc, queue, seen) == 201  # validated before: from the cache
        status, answer, headers = call(svc, "GET", f"/v2/queues/{queue}/messages", unseen)
        assert status == 503, answer
        assert int(headers["Retry-After"]) >= 1
        assert "Keystone" in answer["description"]
        assert bodies(svc, queue, seen) == [{"n": 1}, {"n": 1}]


def test_role_mapping_is_parsed_and_bad_ones_are_refused() -> None:
    assert role_scopes("admin=*:*, reader=read:* claim:jobs-*") == {
        "admin": (("*", "*"),),
        "reader": (("read", "*"), ("claim", "jobs-*")),
    }
    for bad in ("reader", "reader=", "reader=peek:*", "=read:*", "admin=admin:*"):
        with pytest.raises(ValueError, match="--keystone-roles"):
            role_scopes(bad)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"keystone_url": "http://k:5000"}, "needs --keystone-user"),
        ({"keystone_url": "ftp://k", "keystone_user": "u"}, "http:// or https://"),
        ({"keystone_cache": 0.5}, "--keystone-cache must be >= 1.0"),
    ],
)
def test_bad_keystone_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**changes)


async def test_keystone_unreachable_is_503_and_bearer_tokens_still_work(
    redis_url: str, tmp_path: Path
) -> None:
    """In process, with nothing listening where Keystone should be: an
    X-Auth-Token is a 503 with Retry-After (the token may be fine), no token
    a 401 with Keystone's challenge, and a static bearer token is judged by
    its own source."""
    password = tmp_path / "password"
    password.write_text("secret\n")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{unused.getsockname()[1]}"
    settings = make_settings(
        redis_url, auth_token="static-token=p1", keystone_url=nowhere,
        keystone_user="feedsvc", keystone_password_file=password, keystone_project="service",
    )  # fmt: skip
    body = {"messages": [{"body": 1}]}
    client_id = {"Client-ID": str(uuid.uuid4())}
    async with TestClient(TestServer(create_app(settings))) as client:
        path = "/v2/queues/ks-down/messages"
        down = await client.post(path, json=body, headers={**client_id, "X-Auth-Token": "t" * 40})
        assert down.status == 503, await down.text()
        assert int(down.headers["Retry-After"]) >= 1
        assert "Keystone" in (await down.json())["description"]
        missing = await client.post(path, json=body, headers=client_id)
        assert missing.status == 401
        assert missing.headers["WWW-Authenticate"] == f'Keystone uri="{nowhere}"'
        bearer = {**client_id, "Authorization": "Bearer static-token"}
        assert (await client.post(path, json=body, headers=bearer)).status == 201
        listed = await client.get(path + "?echo=true", headers=bearer)
        assert [m["body"] for m in (await listed.json())["messages"]] == [1]
        too_long = {**client_id, "X-Auth-Token": "t" * 5000}
        refused = await client.post(path, json=body, headers=too_long)
        assert refused.status == 401


@pytest.mark.process  # feedsvc serve
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--keystone-password-file", "missing-file"), "--keystone-password-file missing-file"),
        (("--keystone-roles", "reader=peek:*"), "--keystone-roles"),
    ],
)
def test_a_bad_keystone_setting_is_one_line_and_exit_2(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    password = tmp_path / "password"
    password.write_text("secret\n")
    base = ("--keystone-url", "http://127.0.0.1:1", "--keystone-user", "u",
            "--keystone-project", "p", "--keystone-password-file", str(password))  # fmt: skip
    result = run_cli("serve", "--port", "0", *base, *flags)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
