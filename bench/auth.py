"""What authentication costs: the ``auth`` part of ``python -m bench``.

Two ``feedsvc serve`` processes on the suite's Redis, one without
authentication and one taking JWT bearer tokens (``--jwt-key-file``, an
ES256 key made here; the token's project is the other's X-Project-ID, so
both read the same queue). Each round runs wrk on a POST and on a GET of a
10-message page against the one and then the other, back to back; the
median over rounds of JWT/off req/s is reported for each. A client sends
the same token on every request, as real ones do, so this measures the
check of a token already verified (a dictionary lookup and the scope
match), not a signature per request.
"""

from __future__ import annotations

import time

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bench.service import Service, SuiteLike, WrkResult, WrkSuite, service, wrk

ISSUER = "https://bench.test/"
AUDIENCE = "feedsvc-bench"


def bench_token(suite: SuiteLike) -> tuple[str, str]:
    """(the key file, a token for project 'bench' with every scope)."""
    key = ec.generate_private_key(ec.SECP256R1())
    pem = suite.workdir / "jwt-key.pem"
    pem.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 86400}
    token = jwt.encode({**claims, "project": "bench", "scope": "*:*"}, key, algorithm="ES256")
    return str(pem), token


def part_auth(suite: WrkSuite) -> None:
    pem, token = bench_token(suite)
    flags = ["--jwt-key-file", pem, "--jwt-issuer", ISSUER, "--jwt-audience", AUDIENCE]
    bearer = {"BENCH_AUTHORIZATION": f"Bearer {token}"}
    c, seconds = suite.connections, suite.duration
    targets = {"POST": ("post.lua", "/v2/queues/bpost/messages"),
               "GET": ("get.lua", "/v2/queues/bget/messages?limit=10")}  # fmt: skip
    with (
        service(suite.redis.url, suite.workdir, log="auth-off.log") as off,
        # not service(): it fills the queue without a token; off's filling serves both
        Service(suite.redis.url, suite.workdir / "auth-jwt.log", *flags) as on,
    ):
        runs: dict[str, list[tuple[WrkResult, WrkResult]]] = {m: [] for m in targets}
        for _ in range(suite.rounds):
            for method, (script, path) in targets.items():
                plain = wrk(off.url + path, script, c, seconds)
                authed = wrk(on.url + path, script, c, seconds, env=bearer)
                runs[method].append((plain, authed))
    for method, pairs in runs.items():
        ordered = sorted(pairs, key=lambda pair: pair[1].rps / pair[0].rps)
        plain, authed = ordered[len(ordered) // 2]
        suite.add(
            f"{method} with a JWT / without auth",
            rps_off=plain.rps,
            rps_jwt=authed.rps,
            ratio=authed.rps / plain.rps,
            p50_ms_off=plain.p50_ms,
            p50_ms_jwt=authed.p50_ms,
            errors=plain.errors + authed.errors,
        )
