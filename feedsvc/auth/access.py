"""Who a bearer token speaks for, and what it may do: identities and scopes.

A token names a project and carries scopes: space-separated
``ACTION:NAME_GLOB`` items, ACTION one of :data:`ACTIONS` or ``*``, NAME_GLOB
a shell glob over queue and topic names (``orders-*``, ``*``). One more item,
``admin:PROJECT_GLOB``, grants the admin API (``feedsvc.api.admin``) on the
projects the glob matches; ``*`` never stands for it, so a project's
``*:*`` token is no operator's. Tokens come
from three places, checked in this order by :class:`Authenticator`:

- ``--auth-token TOKEN=PROJECT,...``: each grants its whole project (``*:*``);
- ``--auth-token-file``: ``TOKEN PROJECT SCOPE...`` per line, read again on
  SIGHUP (:meth:`Authenticator.reload`);
- JWTs (``--jwt-jwks-url`` or ``--jwt-key-file``), checked by
  :class:`feedsvc.auth.jwt_keys.JwtVerifier`; a verified token's identity is kept
  until its ``exp`` or until the issuer's keys change, so a busy client's
  token costs one dict lookup, not a signature check, per request;
- Keystone tokens (``X-Auth-Token``, with ``--keystone-url``), validated by
  :class:`feedsvc.auth.keystone.KeystoneValidator` and cached likewise; their
  roles give the scopes (``--keystone-roles``, :func:`role_scopes`).

Which action a route is, and where the check runs, is the HTTP layer's
(``feedsvc.api.identity``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from feedsvc.auth.jwt_keys import JwtVerifier
from feedsvc.auth.keystone import KeystoneValidator
from feedsvc.clock import Clock
from feedsvc.config import AccessSettings
from feedsvc.errors import Unauthorized

log = logging.getLogger("feedsvc.access")

#: What a scope may allow. read: list, get, stats, follow; post: post
#: messages; claim: claim, renew, release, delete a claimed message; delete:
#: delete messages (by id, ids, pop); manage: create, delete, metadata,
#: purge, subscriptions, share.
ACTIONS = ("read", "post", "claim", "delete", "manage")
#: The admin API's action (its glob is over project names); only an item
#: that names it allows it.
ADMIN = "admin"
MAX_PROJECT_LENGTH = 256
#: Verified JWTs kept (emptied when full, as validation's Client-ID cache).
CACHED_TOKENS = 10_000

Scopes = tuple[tuple[str, str], ...]
#: Everything, in every queue and topic: what --auth-token grants.
ALL: Scopes = (("*", "*"),)


@dataclass(frozen=True, slots=True)
class Identity:
    """A verified caller: its project and what it may do there."""

    project: str
    scopes: Scopes

    def allows(self, action: str, name: str | None) -> bool:
        """Whether an item allows action on name; a route without a name (a
        list of every queue) needs an item whose glob is ``*``."""
        for allowed, glob in self.scopes:
            if allowed != action and (allowed != "*" or action == ADMIN):
                continue
            if glob == "*" or (name is not None and fnmatchcase(name, glob)):
                return True
        return False


def scope_item(item: str) -> tuple[str, str] | None:
    """``ACTION:GLOB`` as a pair; None if it is not one of ours."""
    action, colon, glob = item.partition(":")
    if not colon or not glob or (action not in ("*", ADMIN) and action not in ACTIONS):
        return None
    return action, glob


def parse_scopes(value: Any) -> Scopes:
    """A JWT's scope claim (a space-separated string, or a list as some
    issuers send ``scp``) as pairs. Items that are not ours (``openid``,
    ``profile``) are left out: an issuer adds them to every token."""
    items = value.split() if isinstance(value, str) else value if isinstance(value, list) else []
    pairs = (scope_item(i) for i in items if isinstance(i, str))
    return tuple(p for p in pairs if p is not None)


def role_scopes(value: str) -> dict[str, Scopes]:
    """``--keystone-roles``: ``ROLE=SCOPE[ SCOPE...]``, comma-separated, as
    role -> scopes; ValueError (one line) when an item does not parse."""
    roles: dict[str, Scopes] = {}
    for entry in value.split(","):
        role, equals, items = entry.strip().partition("=")
        role = role.strip()
        pairs = [scope_item(item) for item in items.split()]
        if not equals or not role or not pairs or any(p is None or p[0] == ADMIN for p in pairs):
            raise ValueError(
                f"--keystone-roles: want ROLE=SCOPE[ SCOPE...] (e.g. 'reader=read:*'; not "
                f"admin:, the admin API's), "
                f"got {entry.strip()!r}"
            )
        roles[role] = tuple(p for p in pairs if p is not None)
    return roles


def checked_project(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PROJECT_LENGTH:
        raise ValueError(f"{where}: the project must be 1 to {MAX_PROJECT_LENGTH} characters")
    if not value.isprintable():
        raise ValueError(f"{where}: the project must be printable characters only")
    return value


def read_token_file(path: Path) -> dict[str, Identity]:
    """``TOKEN PROJECT SCOPE...`` per line (blank lines and # comments left
    out); ValueError naming the line when one does not parse."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--auth-token-file {path}: cannot read it ({exc})") from None
    tokens: dict[str, Identity] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--auth-token-file {path} line {number}"
        if len(words) < 3:
            raise ValueError(f"{where}: want TOKEN PROJECT SCOPE... (e.g. '*:*')")
        token, project, *items = words
        scopes = tuple(scope_item(item) for item in items)
        bad = [item for item, pair in zip(items, scopes, strict=True) if pair is None]
        if bad:
            raise ValueError(
                f"{where}: {bad[0]!r} is no scope; want ACTION:NAME_GLOB, ACTION one of "
                f"{', '.join(ACTIONS)} or *, or admin:PROJECT_GLOB"
            )
        if token in tokens:
            raise ValueError(f"{where}: the token is given twice")
        tokens[token] = Identity(
            checked_project(project, where), tuple(p for p in scopes if p is not None)
        )
    return tokens


class Authenticator:
    """Bearer token -> :class:`Identity`, from every source the settings name."""

    def __init__(self, settings: AccessSettings, clock: Clock) -> None:
        self._settings = settings
        self._flag_tokens = {
            token: Identity(project, ALL) for token, project in settings.auth_tokens().items()
        }
        self._file_tokens: dict[str, Identity] = {}
        if settings.auth_token_file is not None:
            self._file_tokens = read_token_file(settings.auth_token_file)
        self.jwt = JwtVerifier(settings, clock) if settings.jwt_on() else None
        self.keystone: KeystoneValidator | None = None
        if settings.keystone_url is not None:
            self.keystone = KeystoneValidator(settings, role_scopes(settings.keystone_roles))
        # token -> (identity, exp in seconds, the key generation it was checked under)
        self._verified: dict[str, tuple[Identity, float, int]] = {}
        #: Whether a source of tokens with scopes is set (the file, JWTs):
        #: only those can hold admin:PROJECT_GLOB (feedsvc.api.admin).
        self.scoped = settings.auth_token_file is not None or self.jwt is not None
        #: Whether any token source is set: else nothing is authenticated.
        self.on = bool(
            self._flag_tokens
            or settings.auth_token_file is not None
            or self.jwt is not None
            or self.keystone is not None
        )

    def reload(self) -> None:
        """Read --auth-token-file again (SIGHUP); a file that does not parse
        is logged and the tokens in force stay."""
        path = self._settings.auth_token_file
        if path is None:
            return
        try:
            tokens = read_token_file(path)
        except ValueError as exc:
            log.error("kept the tokens in force: %s", exc)
            return
        self._file_tokens = tokens
        log.info("read %d tokens from --auth-token-file %s", len(tokens), path)

    async def identify(self, token: str) -> Identity:
        """The identity of a bearer token; Unauthorized (invalid_token) if it has none."""
        known = self._flag_tokens.get(token) or self._file_tokens.get(token)
        if known is not None:
            return known
        jwt = self.jwt
        if jwt is None or token.count(".") != 2:
            raise Unauthorized("The bearer token is not one this service knows.", "invalid_token")
        cached = self._verified.get(token)
        if (
            cached is not None
            and cached[2] == jwt.generation
            and time.time() < cached[1]
            and not jwt.stale()
        ):
            return cached[0]
        claims = await jwt.verify(token)
        claim = self._settings.jwt_project_claim
        try:
            project = checked_project(claims.get(claim), f"the token's {claim!r} claim")
        except ValueError as exc:
            raise Unauthorized(str(exc) + ".", "invalid_token") from None
        identity = Identity(project, parse_scopes(claims.get("scope", claims.get("scp"))))
        expires = float(claims["exp"])
        if len(self._verified) >= CACHED_TOKENS:
            self._verified.clear()
        self._verified[token] = (identity, expires, jwt.generation)
        return identity

    async def identify_keystone(self, token: str) -> Identity:
        """The identity of an X-Auth-Token (Keystone must be set)."""
        assert self.keystone is not None
        project, scopes = await self.keystone.identify(token)
        return Identity(project, scopes)

    async def close(self) -> None:
        if self.jwt is not None:
            await self.jwt.close()
        if self.keystone is not None:
            await self.keystone.close()
