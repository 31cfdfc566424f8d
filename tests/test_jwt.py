"""JWT bearer tokens (--jwt-jwks-url, --jwt-key-file): checked with PyJWT
against a real JWKS served over HTTP by the test, keys made by PyJWT and
cryptography; the refresh intervals moved on by the app's clock."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]
ISSUER = "https://issuer.test/"
AUDIENCE = "feedsvc"


class Issuer:
    """An identity provider's JWKS endpoint, with keys that can be rotated."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # kid -> private key
        self.fetches = 0

    def add_key(self, kind: str = "rsa") -> str:
        kid = f"{kind}-{uuid.uuid4().hex[:8]}"
        if kind == "rsa":
            self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            self.keys[kid] = ec.generate_private_key(ec.SECP256R1())
        return kid

    def jwks(self) -> dict[str, Any]:
        keys = []
        for kid, key in self.keys.items():
            if isinstance(key, rsa.RSAPrivateKey):
                jwk = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
                jwk["alg"] = "RS256"
            else:
                jwk = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
                jwk["alg"] = "ES256"
            keys.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": keys}

    async def serve_jwks(self, request: web.Request) -> web.Response:
        self.fetches += 1
        return web.json_response(self.jwks())


def claims(owner: str, scope: str = "*:*", **changes: Any) -> dict[str, Any]:
    now = int(time.time())
    out = {"iss": ISSUER, "aud": AUDIENCE, "exp": now + 600, "iat": now, "project": owner}
    out["scope"] = scope
    out.update(changes)
    return {k: v for k, v in out.items() if v is not None}


def sign(issuer: Issuer, kid: str, body: dict[str, Any], key: Any = None) -> str:
    private = key if key is not None else issuer.keys[kid]
    algorithm = "RS256" if isinstance(private, rsa.RSAPrivateKey) else "ES256"
    return jwt.encode(body, private, algorithm=algorithm, headers={"kid": kid})


def hmac_token(body: dict[str, Any], kid: str, secret: bytes) -> str:
    """An HS256 JWT made by hand (PyJWT refuses to key an HMAC with a PEM key)."""
    header = jwt.utils.base64url_encode(json.dumps({"alg": "HS256", "kid": kid}).encode())
    payload = jwt.utils.base64url_encode(json.dumps(body).encode())
    signed = header + b"." + payload
    mac = hmac.new(secret, signed, hashlib.sha256).digest()
    return (signed + b"." + jwt.utils.base64url_encode(mac)).decode()


@pytest.fixture
def driver() -> str:
    """Tokens are checked before storage: one driver is enough here."""
    return "lua"


@pytest.fixture
async def issuer() -> AsyncIterator[Issuer]:
    provider = Issuer()
    app = web.Application()
    app.router.add_get("/jwks", provider.serve_jwks)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    provider.url = str(server.make_url("/jwks"))  # type: ignore[attr-defined]
    yield provider
    await server.close()


def jwt_settings(redis_url: str, driver: str, **changes: Any) -> Settings:
    return make_settings(
        redis_url, driver=driver, jwt_issuer=ISSUER, jwt_audience=AUDIENCE, **changes
    )


@pytest.fixture
async def service(
    redis_url: str, driver: str, issuer: Issuer, clock: ManualClock
) -> AsyncIterator[Client]:
    issuer.add_key("rsa")
    settings = jwt_settings(redis_url, driver, jwt_jwks_url=issuer.url)  # type: ignore[attr-defined]
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


def with_token(token: str | None, project: str = "spoofed") -> dict[str, str]:
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": project}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


async def test_a_token_names_the_project_whatever_x_project_id_says(
    service: Client, issuer: Issuer
) -> None:
    [kid] = issuer.keys
    mine, theirs = "pj-" + uuid.uuid4().hex, "pj-" + uuid.uuid4().hex
    alice = sign(issuer, kid, claims(mine))
    posted = await service.post(
        "/v2/queues/q/messages", json={"messages": [{"body": 1}]}, headers=with_token(alice, theirs)
    )
    assert posted.status == 201, await posted.text()
    bob = sign(issuer, kid, claims(theirs))
    listed = await service.get("/v2/queues/q/messages", headers=with_token(bob, mine))
    assert (await listed.json())["messages"] == []
    again = await service.get("/v2/queues/q/messages?echo=true", headers=with_token(alice))
    assert [m["body"] for m in (await again.json())["messages"]] == [1]


async def test_a_jwt_with_an_admin_scope_reaches_the_admin_api(
    redis_url: str, driver: str, issuer: Issuer, clock: ManualClock
) -> None:
    """With an admin token set, a JWT whose scope holds admin:GLOB is an
    operator of the projects its glob matches; *:* is not."""
    kid = issuer.add_key("rsa")
    url = issuer.url  # type: ignore[attr-defined]
    settings = jwt_settings(redis_url, driver, jwt_jwks_url=url, admin_token="admin-" + "q" * 20)
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        operator = sign(issuer, kid, claims("ops", scope="openid admin:tenant-*"))
        limits = "/v2/admin/projects/tenant-1/limits"
        resp = await client.put(limits, json={"max_messages": 9}, headers=with_token(operator))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["limits"]["max_messages"] == 9
        other = await client.get("/v2/admin/projects/x/limits", headers=with_token(operator))
        assert other.status == 403
        everything = sign(issuer, kid, claims("tenant-1"))
        assert (await client.get(limits, headers=with_token(everything))).status == 403


async def test_a_missing_or_bad_token_is_401_with_the_rfc_6750_code(
    service: Client, issuer: Issuer
) -> None:
    [kid] = issuer.keys
    project = "pj-" + uuid.uuid4().hex
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_pem = (
        issuer.keys[kid]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    hour = 3600
    bad = {
        "expired": sign(issuer, kid, claims(project, exp=int(time.time()) - hour)),
        "not yet valid": sign(issuer, kid, claims(project, nbf=int(time.time()) + hour)),
        "another issuer": sign(issuer, kid, claims(project, iss="https://evil.test/")),
        "another audience": sign(issuer, kid, claims(project, aud="someone-else")),
        "no exp": sign(issuer, kid, claims(project, exp=None)),
        "no project": sign(issuer, kid, claims(project, project=None)),
        "a key the issuer does not list": sign(issuer, kid, claims(project), key=stranger),
        "alg none": jwt.encode(claims(project), "", algorithm="none", headers={"kid": kid}),
        # the public key as an HMAC secret: the classic confusion attack
        "HS256 keyed by the public key": hmac_token(claims(project), kid, public_pem),
        "garbage": "a.b.c",
        "not a JWT": "opaque",
    }
    missing = await service.get("/v2/queues/q/messages", headers=with_token(None, project))
    assert missing.status == 401
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    for what, token in bad.items():
        response = await service.post(
            "/v2/queues/q/messages", json={"messages": [{"body": 1}]}, headers=with_token(token)
        )
        assert response.status == 401, what
        assert response.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"', what
        assert set(await response.json()) == {"title", "description"}
    good = sign(issuer, kid, claims(project))
    stats = await service.get("/v2/queues/q/stats", headers=with_token(good))
    assert (await stats.json())["messages"]["total"] == 0  # none of the bad posts landed


async def test_a_key_added_at_the_issuer_works_and_a_removed_one_stops(
    service: Client, issuer: Issuer, clock: ManualClock
) -> None:
    [old] = issuer.keys
    project = "pj-" + uuid.uuid4().hex
    old_token = sign(issuer, old, claims(project))
    assert (await service.get("/v2/queues/q/stats", headers=with_token(old_token))).status == 200
    fetches = issuer.fetches
    new = issuer.add_key("ec")
    new_token = sign(issuer, new, claims(project))
    # an unknown kid fetches the keys again, but not more than once per 10 s:
    # tokens with made-up kids cannot make the service hammer the issuer
    response = await service.get("/v2/queues/q/stats", headers=with_token(new_token))
    assert response.status == 401
    for _ in range(20):
        made_up = sign(issuer, "kid-" + uuid.uuid4().hex, claims(project), key=issuer.keys[new])
        await service.get("/v2/queues/q/stats", headers=with_token(made_up))
    assert issuer.fetches == fetches
    clock.advance(11)
    response = await service.get("/v2/queues/q/stats", headers=with_token(new_token))
    assert response.status == 200, await response.text()
    assert issuer.fetches == fetches + 1
    # removed at the issuer: still accepted until the periodic refresh (a minute)
    del issuer.keys[old]
    assert (await service.get("/v2/queues/q/stats", headers=with_token(old_token))).status == 200
    clock.advance(61)
    response = await service.get("/v2/queues/q/stats", headers=with_token(old_token))
    assert response.status == 401
    assert (await service.get("/v2/queues/q/stats", headers=with_token(new_token))).status == 200


async def test_a_fixed_public_key_from_a_file(
    redis_url: str, driver: str, tmp_path: Path, clock: ManualClock
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "issuer.pem"
    pem.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    settings = jwt_settings(redis_url, driver, jwt_key_file=pem)
    project = "pj-" + uuid.uuid4().hex
    token = jwt.encode(claims(project), key, algorithm="ES256")
    other = jwt.encode(claims(project), ec.generate_private_key(ec.SECP256R1()), algorithm="ES256")
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        assert (await client.put("/v2/queues/q", headers=with_token(token))).status == 201
        assert (await client.put("/v2/queues/q", headers=with_token(other))).status == 401


async def test_no_keys_from_the_issuer_is_503_not_401(
    redis_url: str, driver: str, clock: ManualClock, issuer: Issuer
) -> None:
    issuer.add_key()
    [kid] = issuer.keys
    down = "http://127.0.0.1:9/jwks"  # the discard port: nothing answers
    settings = jwt_settings(redis_url, driver, jwt_jwks_url=down)
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        token = sign(issuer, kid, claims("p"))
        response = await client.get("/v2/queues/q/stats", headers=with_token(token))
        assert response.status == 503
        assert "Retry-After" in response.headers


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"jwt_jwks_url": "http://x/jwks", "jwt_issuer": None}, "--jwt-issuer and --jwt-audience"),
        ({"jwt_jwks_url": "ftp://x/jwks"}, "http:// or https://"),
        ({"jwt_jwks_url": "http://x/j", "jwt_key_file": Path("k")}, "not both"),
        ({"jwt_algorithms": "RS256,HS256"}, "--jwt-algorithms"),
        ({"jwt_algorithms": "none"}, "--jwt-algorithms"),
        ({"cors_origin": "https://a.test/path"}, "--cors-origin"),
    ],
)
def test_bad_jwt_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    base = {"jwt_issuer": ISSUER, "jwt_audience": AUDIENCE}
    with pytest.raises(ValueError, match=message):
        Settings(**{**base, **changes})
