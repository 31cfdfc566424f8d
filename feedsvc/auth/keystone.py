"""Keystone tokens (``X-Auth-Token``) validated against Keystone's v3 API.

As keystonemiddleware's auth_token does it, over aiohttp's client (the call
is one ``GET /v3/auth/tokens`` with ``X-Subject-Token``; keystoneauth1 is
synchronous, on requests):

- feedsvc logs in as its service user (``--keystone-user``, its password
  read from ``--keystone-password-file`` at start and at each login, scoped
  to ``--keystone-project``) and keeps that token until a minute before it
  expires, or until Keystone refuses it (then logs in again once);
- a valid token's identity is cached for ``--keystone-cache`` seconds, never
  past the token's own ``expires_at``; an invalid one (Keystone's 404) is
  cached as invalid for ``--keystone-negative-cache`` seconds. So a token
  revoked at Keystone stops working within ``--keystone-cache`` seconds; at
  most :data:`CACHED_TOKENS` are kept (emptied when full);
- the project is the token's project scope (its id); a token scoped to no
  project is refused (403). Its roles give the scopes, by ``--keystone-roles``
  (``ROLE=SCOPE[ SCOPE...]``, comma-separated; a role not named gives none);
- Keystone unreachable, timing out or failing (5xx), or refusing the service
  user: 503 with Retry-After for a token not in the cache; cached tokens
  keep working until their cache time ends.

Concurrent requests with the same new token share one validation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from typing import Any

import aiohttp
import orjson

from feedsvc.config import AccessSettings
from feedsvc.errors import Forbidden, Unauthorized, Unavailable

log = logging.getLogger("feedsvc.access")

#: Seconds one call to Keystone may take.
KEYSTONE_TIMEOUT = 5.0
#: Tokens cached (valid and invalid), emptied when full.
CACHED_TOKENS = 10_000
#: The longest X-Auth-Token looked at (Fernet tokens are about 200 characters).
MAX_TOKEN_LENGTH = 4096
#: The service token is renewed this many seconds before it expires.
RENEW_BEFORE = 60.0
MAX_BODY_BYTES = 1 << 20

Scopes = tuple[tuple[str, str], ...]


class KeystoneUnauthorized(Unauthorized):
    """A missing or invalid Keystone token: keystonemiddleware's challenge."""

    def __init__(self, description: str, uri: str) -> None:
        super().__init__(description, "invalid_token")
        self.uri = uri

    def challenge(self) -> str:
        return f'Keystone uri="{self.uri}"'


def v3_url(url: str) -> str:
    """``--keystone-url`` as the v3 API's base (``/v3`` added when missing)."""
    url = url.rstrip("/")
    return url if url.endswith("/v3") else url + "/v3"


def expires_at(token: dict[str, Any]) -> float:
    """A token body's ``expires_at`` in seconds since the epoch."""
    raw = token.get("expires_at")
    if not isinstance(raw, str):
        raise ValueError("the token has no expires_at")
    return datetime.fromisoformat(raw).timestamp()


class KeystoneValidator:
    """X-Auth-Token -> (project, role names), cached; see the module docstring."""

    def __init__(self, settings: AccessSettings, scopes: dict[str, Scopes]) -> None:
        assert settings.keystone_url is not None
        self.uri = settings.keystone_url
        self._api = v3_url(settings.keystone_url)
        self._settings = settings
        self._roles = scopes
        self._cache_time = settings.keystone_cache
        self._negative_time = settings.keystone_negative_cache
        self._password()  # unreadable: ValueError at start (exit 2)
        # token -> ((project, scopes) or None when invalid, until when)
        self._cache: dict[str, tuple[tuple[str, Scopes] | None, float]] = {}
        self._pending: dict[str, asyncio.Task[tuple[str, Scopes]]] = {}
        self._service: tuple[str, float] | None = None
        self._login: asyncio.Task[str] | None = None
        self._session: aiohttp.ClientSession | None = None

    def _password(self) -> str:
        path = self._settings.keystone_password_file
        assert path is not None
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--keystone-password-file {path}: cannot read it ({exc})") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--keystone-password-file {path}: the first line is empty")
        return lines[0].strip()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=KEYSTONE_TIMEOUT)
            )
        return self._session

    def _invalid(self, why: str) -> KeystoneUnauthorized:
        return KeystoneUnauthorized(why, self.uri)

    async def identify(self, token: str) -> tuple[str, Scopes]:
        """The project and scopes of a Keystone token; KeystoneUnauthorized
        if Keystone says it is invalid, Forbidden if it names no project,
        Unavailable if Keystone cannot be asked."""
        if not 0 < len(token) <= MAX_TOKEN_LENGTH or not token.isascii():
            raise self._invalid("The X-Auth-Token is not a Keystone token.")
        cached = self._cache.get(token)
        if cached is not None and time.time() < cached[1]:
            if cached[0] is None:
                raise self._invalid("The X-Auth-Token is invalid or expired (Keystone).")
            return cached[0]
        task = self._pending.get(token)
        if task is None:
            task = asyncio.ensure_future(self._validate(token))
            self._pending[token] = task
            task.add_done_callback(lambda _: self._pending.pop(token, None))
        return await asyncio.shield(task)

    def _remember(self, token: str, value: tuple[str, Scopes] | None, until: float) -> None:
        if len(self._cache) >= CACHED_TOKENS:
            self._cache.clear()
        self._cache[token] = (value, until)

    async def _validate(self, token: str) -> tuple[str, Scopes]:
        for attempt in (1, 2):
            service = await self._service_token()
            status, body, _ = await self._call(
                "GET",
                "/auth/tokens",
                {"X-Auth-Token": service, "X-Subject-Token": token},
            )
            if status == 401 and attempt == 1:
                self._service = None  # ours expired or was revoked: log in again
                continue
            break
        now = time.time()
        if status == 404:
            self._remember(token, None, now + self._negative_time)
            raise self._invalid("The X-Auth-Token is invalid or expired (Keystone).")
        if status != 200 or not isinstance(body.get("token"), dict):
            log.error("Keystone %s answered %d to a token validation", self._api, status)
            raise Unavailable("Keystone could not validate the token.")
        info: dict[str, Any] = body["token"]
        try:
            until = min(now + self._cache_time, expires_at(info))
        except ValueError:
            raise Unavailable("Keystone's answer had no usable expires_at.") from None
        project = info.get("project")
        if not isinstance(project, dict) or not isinstance(project.get("id"), str):
            raise Forbidden("The Keystone token is scoped to no project.")
        roles = [r.get("name") for r in info.get("roles") or [] if isinstance(r, dict)]
        scopes = tuple(dict.fromkeys(s for r in roles if r in self._roles for s in self._roles[r]))
        value = (project["id"], scopes)
        self._remember(token, value, until)
        return value

    async def _call(
        self, method: str, path: str, headers: dict[str, str], json: Any = None
    ) -> tuple[int, dict[str, Any], str]:
        """Status, JSON body and X-Subject-Token of one call; Unavailable if
        Keystone cannot be reached."""
        try:
            async with self._client().request(
                method, self._api + path, headers=headers, json=json
            ) as response:
                raw = await response.content.read(MAX_BODY_BYTES)
                body: Any = (
                    orjson.loads(raw) if raw and response.content_type.endswith("json") else {}
                )
                subject = response.headers.get("X-Subject-Token", "")
                return response.status, body if isinstance(body, dict) else {}, subject
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            log.warning("Keystone %s cannot be reached: %s", self._api, exc)
            raise Unavailable("Keystone cannot be reached to validate the token.") from None

    async def _service_token(self) -> str:
        service = self._service
        if service is not None and time.time() < service[1] - RENEW_BEFORE:
            return service[0]
        if self._login is None or self._login.done():
            self._login = asyncio.ensure_future(self._log_in())
        return await asyncio.shield(self._login)

    async def _log_in(self) -> str:
        s = self._settings
        try:
            password = self._password()
        except ValueError as exc:
            log.error("%s", exc)
            raise Unavailable("feedsvc's Keystone password cannot be read.") from None
        request = {
            "auth": {
                "identity": {
                    "methods": ["password"],
                    "password": {
                        "user": {
                            "name": s.keystone_user,
                            "domain": {"name": s.keystone_user_domain},
                            "password": password,
                        }
                    },
                },
                "scope": {
                    "project": {
                        "name": s.keystone_project,
                        "domain": {"name": s.keystone_project_domain},
                    }
                },
            }
        }
        status, body, token = await self._call("POST", "/auth/tokens", {}, request)
        if status != 201 or not token or not isinstance(body.get("token"), dict):
            log.error("Keystone %s refused feedsvc's login as %r: %d", self._api,
                      s.keystone_user, status)  # fmt: skip
            raise Unavailable("feedsvc cannot log in to Keystone to validate tokens.")
        try:
            until = expires_at(body["token"])
        except ValueError:
            until = time.time() + 3600
        self._service = (token, until)
        return token

    async def close(self) -> None:
        for task in (self._login, *self._pending.values()):
            if task is not None and not task.done():
                task.cancel()
        if self._session is not None:
            await self._session.close()
