"""JWT bearer tokens checked with PyJWT against the issuer's keys.

The keys are one PEM public key (``--jwt-key-file``) or a JWKS
(``--jwt-jwks-url``), fetched at start and kept: fetched again every
``--jwt-jwks-refresh`` seconds (a key the issuer adds works, one it removes
stops working, within that time, with no restart), and on a token whose
``kid`` is not among them, at most once per :data:`REFETCH_AFTER` seconds
(so tokens with made-up kids cannot make this service hammer the issuer).
A failed fetch keeps the keys in hand; with none in hand a JWT is a 503.

What a token must hold: a signature by one of the keys, with an algorithm of
``--jwt-algorithms`` (asymmetric only: PyJWT is never handed ``none`` or an
HMAC, so a public key can never serve as an HMAC secret); ``iss`` and
``aud`` as configured; ``exp`` (required) and ``nbf`` within
``--jwt-leeway``. Time is the host's: the refresh intervals read the app's
clock, so a test moves them on instead of sleeping.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import jwt
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from feedsvc.clock import Clock
from feedsvc.config import AccessSettings
from feedsvc.errors import Unauthorized, Unavailable

log = logging.getLogger("feedsvc.access")

#: Seconds between two fetches of the JWKS for unknown kids (or after a failure).
REFETCH_AFTER = 10.0
#: Seconds a JWKS fetch may take; the largest JWKS read.
FETCH_TIMEOUT = 5.0
MAX_JWKS_BYTES = 1 << 20
_NEVER = float("-inf")


def load_key_file(path: Path) -> Any:
    """The public key of a PEM file; ValueError (one line) if it holds none."""
    try:
        return load_pem_public_key(path.read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--jwt-key-file {path}: not a PEM public key ({exc})") from None


class JwtVerifier:
    def __init__(self, settings: AccessSettings, clock: Clock) -> None:
        self._clock = clock
        self._url = settings.jwt_jwks_url
        self._refresh = settings.jwt_jwks_refresh
        self._algorithms = settings.jwt_algorithm_list()
        self._issuer = settings.jwt_issuer
        self._audience = settings.jwt_audience
        self._leeway = settings.jwt_leeway
        self._fixed: Any = None
        if settings.jwt_key_file is not None:
            self._fixed = load_key_file(settings.jwt_key_file)
        self._keys: dict[str, Any] = {}  # kid ("" when a key has none) -> key
        self._fetched_at = _NEVER
        self._tried_at = _NEVER
        self._fetch: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        #: Bumped whenever the keys change: what was verified before is checked again.
        self.generation = 0

    def _now(self) -> float:
        return self._clock.now_ms() / 1000

    def stale(self) -> bool:
        """Whether the JWKS is due to be fetched again (and may be)."""
        if self._url is None:
            return False
        now = self._now()
        return now - self._fetched_at >= self._refresh and now - self._tried_at >= REFETCH_AFTER

    async def refresh(self) -> None:
        """Fetch the JWKS (one fetch at a time, shared by whoever waits)."""
        if self._fetch is None or self._fetch.done():
            self._fetch = asyncio.ensure_future(self._fetch_keys())
        await asyncio.shield(self._fetch)

    async def _fetch_keys(self) -> None:
        assert self._url is not None
        self._tried_at = self._now()
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
            )
        try:
            async with self._session.get(self._url) as response:
                response.raise_for_status()
                raw = await response.content.read(MAX_JWKS_BYTES + 1)
            if len(raw) > MAX_JWKS_BYTES:
                raise ValueError(f"the JWKS is larger than {MAX_JWKS_BYTES} bytes")
            keys = {k.key_id or "": k.key for k in jwt.PyJWKSet.from_json(raw.decode()).keys}
        except (aiohttp.ClientError, TimeoutError, ValueError, jwt.PyJWTError) as exc:
            log.warning("could not fetch the JWKS %s (keeping %d keys): %s", self._url,
                        len(self._keys), exc)  # fmt: skip
            return
        if set(keys) != set(self._keys):
            log.info("JWKS %s: keys %s", self._url, ", ".join(sorted(keys)) or "none")
            self.generation += 1
        self._keys = keys
        self._fetched_at = self._now()

    async def _key(self, kid: str) -> Any:
        if self._fixed is not None:
            return self._fixed
        if self.stale():
            await self.refresh()
        key = self._keys.get(kid)
        if key is None and self._now() - self._tried_at >= REFETCH_AFTER:
            await self.refresh()  # a key the issuer added since
            key = self._keys.get(kid)
        if key is None and kid == "" and len(self._keys) == 1:
            key = next(iter(self._keys.values()))
        if key is None:
            if self._fetched_at == _NEVER:
                raise Unavailable("The token issuer's keys (--jwt-jwks-url) could not be fetched.")
            raise Unauthorized("The token is signed by a key the issuer does not list.",
                               "invalid_token")  # fmt: skip
        return key

    async def verify(self, token: str) -> dict[str, Any]:
        """The claims of a token that holds (see the module docstring); else
        Unauthorized with RFC 6750's invalid_token."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthorized("The bearer token is malformed.", "invalid_token") from None
        algorithm = header.get("alg")
        if algorithm not in self._algorithms:
            raise Unauthorized(f"The token's algorithm {str(algorithm)[:20]!r} is not allowed "
                               "here (--jwt-algorithms).", "invalid_token")  # fmt: skip
        kid = header.get("kid")
        key = await self._key(kid if isinstance(kid, str) else "")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=self._audience,
                issuer=self._issuer,
                leeway=self._leeway,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"The token does not hold: {exc}.", "invalid_token") from None
        return claims

    async def start(self) -> None:
        """Fetch the JWKS once before serving (a failure is logged; requests try again)."""
        if self._url is not None:
            await self.refresh()

    async def close(self) -> None:
        if self._fetch is not None and not self._fetch.done():
            self._fetch.cancel()
        if self._session is not None:
            await self._session.close()
