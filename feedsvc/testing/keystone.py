"""A real OpenStack Keystone for tests and benchmarks: SQLite, Fernet tokens,
served on a free port of 127.0.0.1.

Keystone (the PyPI package, pinned with all its dependencies in
``requirements/keystone.txt``) lives in a venv of its own,
:data:`KEYSTONE_VENV` (``make keystone``, which ``make test`` runs, builds
it once), so its many dependencies never meet feedsvc's. The first start
also makes a template there -- ``keystone-manage db_sync``,
``fernet_setup``, ``credential_setup`` and ``bootstrap`` (admin password
:data:`ADMIN_PASSWORD`, region RegionOne), about a minute -- that every
:class:`Keystone` then copies into a temporary directory of its own. The
server is ``keystone.server.wsgi.initialize_public_application()`` under
the standard library's threading WSGI server (``keystone_wsgi.py`` beside
this file, run by the venv's python with ``-P``: the script's folder,
which holds this module, would otherwise hide the ``keystone`` package).

:class:`Keystone` also speaks the v3 API as an administrator would: make a
project, a user with a role, get a token for it, revoke one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[2]
KEYSTONE_VENV = Path(os.environ.get("FEEDSVC_KEYSTONE_VENV", ROOT / ".venv-keystone"))
ADMIN_PASSWORD = "keystone-admin-password"
#: bcrypt rounds of the test Keystone's passwords: Keystone's default (12)
#: makes each login cost a quarter of a second of CPU; 4 is bcrypt's least.
HASH_ROUNDS = 4
SERVER_SCRIPT = Path(__file__).with_name("keystone_wsgi.py")

CONF = """[DEFAULT]
log_dir = {dir}
[database]
connection = sqlite:///{dir}/keystone.db
[token]
provider = fernet
expiration = {expiration}
[identity]
password_hash_rounds = {rounds}
[fernet_tokens]
key_repository = {dir}/fernet-keys
[fernet_receipts]
key_repository = {dir}/fernet-receipts
[credential]
key_repository = {dir}/credential-keys
"""


def available() -> bool:
    """Whether the Keystone venv is built (``make keystone``)."""
    return (KEYSTONE_VENV / ".installed").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _manage(directory: Path, *args: str) -> None:
    subprocess.run(
        [str(KEYSTONE_VENV / "bin" / "keystone-manage"),
         "--config-file", str(directory / "keystone.conf"), *args],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip


def template() -> Path:
    """The bootstrapped database and keys every Keystone copies (made once)."""
    directory = KEYSTONE_VENV / "template"
    with open(KEYSTONE_VENV / "template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers make it once
        if (directory / ".done").exists():
            return directory
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        (directory / "keystone.conf").write_text(
            CONF.format(dir=directory, expiration=3600, rounds=HASH_ROUNDS)
        )
        owner = ("--keystone-user", str(os.getuid()), "--keystone-group", str(os.getgid()))
        _manage(directory, "db_sync")
        _manage(directory, "fernet_setup", *owner)
        _manage(directory, "credential_setup", *owner)
        _manage(directory, "bootstrap", "--bootstrap-password", ADMIN_PASSWORD,
                "--bootstrap-region-id", "RegionOne",
                "--bootstrap-public-url", "http://127.0.0.1:5000/v3")  # fmt: skip
        (directory / ".done").touch()
        return directory


class Keystone:
    """A Keystone server of its own: ``with Keystone() as ks: ks.url``."""

    def __init__(self, expiration: int = 3600) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._expiration = expiration
        self._tmp = Path(tempfile.mkdtemp(prefix="feedsvc-keystone-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._admin: str | None = None

    def start(self, timeout: float = 180.0) -> Self:
        source = template()
        for name in ("keystone.db", "fernet-keys", "fernet-receipts", "credential-keys"):
            copy = shutil.copytree if (source / name).is_dir() else shutil.copy
            copy(source / name, self._tmp / name)
        conf = self._tmp / "keystone.conf"
        conf.write_text(CONF.format(dir=self._tmp, expiration=self._expiration, rounds=HASH_ROUNDS))
        log = open(self._tmp / "server.log", "wb")  # noqa: SIM115 (the child keeps it)
        python = str(KEYSTONE_VENV / "bin" / "python")
        self._proc = subprocess.Popen(
            [python, "-P", str(SERVER_SCRIPT), str(conf), str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"keystone exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v3", timeout=5):
                    return self
            except OSError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"keystone not ready in {timeout} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self._tmp / "server.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        """Stop the server (Keystone down); ``start_again`` brings it back."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the v3 API, as an administrator
    def call(
        self, method: str, path: str, body: Any = None, token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:  # fmt: skip
        sent = {"Content-Type": "application/json", **(headers or {})}
        if token is not None:
            sent["X-Auth-Token"] = token
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + "/v3" + path, data=data, method=method, headers=sent
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                raw, status, got = response.read(), response.status, dict(response.headers)
        except urllib.error.HTTPError as exc:
            raw, status, got = exc.read(), exc.code, dict(exc.headers)
        return status, (json.loads(raw) if raw else {}), got

    def token(self, user: str, password: str, project: str | None) -> tuple[str, dict[str, Any]]:
        """A token for user (domain Default), scoped to project (by name) if given."""
        auth: dict[str, Any] = {
            "identity": {
                "methods": ["password"],
                "password": {
                    "user": {"name": user, "domain": {"id": "default"}, "password": password}
                },
            }
        }
        if project is not None:
            auth["scope"] = {"project": {"name": project, "domain": {"id": "default"}}}
        status, body, headers = self.call("POST", "/auth/tokens", {"auth": auth})
        if status != 201:
            raise RuntimeError(f"no token for {user}: {status} {body}")
        return headers["X-Subject-Token"], body["token"]

    def admin_token(self) -> str:
        if self._admin is None:
            self._admin = self.token("admin", ADMIN_PASSWORD, "admin")[0]
        return self._admin

    def make(self, kind: str, body: dict[str, Any]) -> str:
        """Create a project, user or role (kind: projects, users, roles); its id."""
        singular = kind[:-1]
        status, answer, _ = self.call(
            "POST", f"/{kind}", {singular: body}, token=self.admin_token()
        )
        if status != 201:
            raise RuntimeError(f"cannot create {singular} {body}: {status} {answer}")
        made: str = answer[singular]["id"]
        return made

    def role_id(self, name: str) -> str:
        status, answer, _ = self.call("GET", f"/roles?name={name}", token=self.admin_token())
        roles = answer.get("roles") or []
        if status != 200 or not roles:
            return self.make("roles", {"name": name})
        found: str = roles[0]["id"]
        return found

    def user(self, name: str, password: str, project_id: str, *roles: str) -> str:
        """A user of domain Default with roles on a project; its id."""
        user_id = self.make("users", {"name": name, "password": password, "domain_id": "default"})
        for role in roles:
            status, answer, _ = self.call(
                "PUT", f"/projects/{project_id}/users/{user_id}/roles/{self.role_id(role)}",
                token=self.admin_token(),
            )  # fmt: skip
            if status != 204:
                raise RuntimeError(f"cannot grant {role}: {status} {answer}")
        return user_id

    def revoke(self, token: str) -> None:
        status, answer, _ = self.call(
            "DELETE", "/auth/tokens", token=self.admin_token(), headers={"X-Subject-Token": token}
        )
        if status != 204:
            raise RuntimeError(f"cannot revoke: {status} {answer}")


TEMPEST_CONF = """[DEFAULT]
log_file = {dir}/tempest.log
use_stderr = False
[oslo_concurrency]
lock_path = {dir}/locks
[auth]
use_dynamic_credentials = True
admin_username = admin
admin_password = {admin_password}
admin_project_name = admin
admin_domain_name = Default
default_credentials_domain_name = Default
tempest_roles = member
create_isolated_networks = False
[identity]
auth_version = v3
uri_v3 = {keystone}/v3
region = RegionOne
[identity-feature-enabled]
api_v2 = False
api_v3 = True
[service_available]
zaqar = True
neutron = False
[messaging]
catalog_type = messaging
"""


def serve_for_tempest(target: str, directory: Path) -> None:
    """A Keystone for Zaqar's tempest suite against target (a feedsvc URL):
    its catalog's 'messaging' service is target, a service user for
    feedsvc's --keystone-* flags, and directory/tempest.conf with dynamic
    credentials (a project and a member user per test class, made by
    tempest as in the OpenStack gate). Serves until SIGTERM or Ctrl-C."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "locks").mkdir(exist_ok=True)
    with Keystone() as ks:
        service = ks.make("projects", {"name": "service", "domain_id": "default"})
        ks.user("feedsvc", "feedsvc-service-password", service, "service")
        (directory / "keystone-password").write_text("feedsvc-service-password\n")
        # the template's identity endpoints name the port it was bootstrapped with
        _, listed, _ = ks.call("GET", "/endpoints", token=ks.admin_token())
        for endpoint in listed["endpoints"]:
            if endpoint["url"].startswith("http://127.0.0.1:5000"):
                ks.call("PATCH", f"/endpoints/{endpoint['id']}",
                        {"endpoint": {"url": ks.url + "/v3"}}, token=ks.admin_token())  # fmt: skip
        messaging = ks.make("services", {"type": "messaging", "name": "zaqar"})
        for interface in ("public", "internal", "admin"):
            ks.make("endpoints", {"service_id": messaging, "interface": interface,
                                  "region_id": "RegionOne", "url": target})  # fmt: skip
        (directory / "tempest.conf").write_text(
            TEMPEST_CONF.format(dir=directory, admin_password=ADMIN_PASSWORD, keystone=ks.url)
        )
        print(
            f"keystone {ks.url}\nfeedsvc flags: --keystone-url {ks.url} --keystone-user feedsvc "
            f"--keystone-password-file {directory / 'keystone-password'} "
            f"--keystone-project service\ntempest: TEMPEST_CONFIG_DIR={directory} "
            "TEMPEST_CONFIG=tempest.conf",
            flush=True,
        )
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m feedsvc.testing.keystone FEEDSVC_URL DIR")
    serve_for_tempest(sys.argv[1].rstrip("/"), Path(sys.argv[2]))
