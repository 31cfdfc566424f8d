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

With the test Keystone's venv built (``make keystone``), a third service
takes Keystone tokens (``--keystone-url``, a real Keystone of
feedsvc/testing/keystone.py, a member's token): validated against Keystone
once, then served from the cache (``--keystone-cache``, 300 s, longer than
a run), so it too measures the per-request check, not a call to Keystone.
Without the venv that variant is skipped, and the part says so.
"""

from __future__ import annotations

import contextlib
import time

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bench.service import Service, SuiteLike, WrkResult, WrkSuite, fill_bget, service, wrk
from feedsvc.testing import keystone as keystone_harness

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


def keystone_service(
    stack: contextlib.ExitStack, suite: WrkSuite, off: Service
) -> tuple[Service, str] | None:
    """A feedsvc taking Keystone tokens and a member's token, its project's
    bget filled through off; None without the Keystone venv."""
    if not keystone_harness.available():
        print("auth: no Keystone venv (make keystone): the Keystone variant is skipped")
        return None
    ks = stack.enter_context(keystone_harness.Keystone())
    project = ks.make("projects", {"name": "bench", "domain_id": "default"})
    service_project = ks.make("projects", {"name": "service", "domain_id": "default"})
    ks.user("feedsvc", "bench-service-password", service_project, "service")
    ks.user("bench", "bench-password", project, "member")
    token = ks.token("bench", "bench-password", "bench")[0]
    password = suite.workdir / "keystone-password"
    password.write_text("bench-service-password\n")
    flags = ["--keystone-url", ks.url, "--keystone-user", "feedsvc", "--keystone-project",
             "service", "--keystone-password-file", str(password)]  # fmt: skip
    on = stack.enter_context(Service(suite.redis.url, suite.workdir / "auth-keystone.log", *flags))
    fill_bget(off, project)  # off takes X-Project-ID as it comes
    return on, token


def part_auth(suite: WrkSuite) -> None:
    pem, token = bench_token(suite)
    flags = ["--jwt-key-file", pem, "--jwt-issuer", ISSUER, "--jwt-audience", AUDIENCE]
    bearer = {"BENCH_AUTHORIZATION": f"Bearer {token}"}
    c, seconds = suite.connections, suite.duration
    targets = {"POST": ("post.lua", "/v2/queues/bpost/messages"),
               "GET": ("get.lua", "/v2/queues/bget/messages?limit=10")}  # fmt: skip
    with contextlib.ExitStack() as stack:
        off = stack.enter_context(service(suite.redis.url, suite.workdir, log="auth-off.log"))
        # not service(): it fills the queue without a token; off's filling serves both
        on = stack.enter_context(Service(suite.redis.url, suite.workdir / "auth-jwt.log", *flags))
        keystone = keystone_service(stack, suite, off)
        variants = {"jwt": (on, bearer)}
        if keystone is not None:
            variants["keystone"] = (keystone[0], {"BENCH_X_AUTH_TOKEN": keystone[1]})
        runs: dict[tuple[str, str], list[tuple[WrkResult, WrkResult]]] = {
            (m, v): [] for m in targets for v in variants
        }
        for _ in range(suite.rounds):
            for method, (script, path) in targets.items():
                plain = wrk(off.url + path, script, c, seconds)
                for name, (svc, env) in variants.items():
                    authed = wrk(svc.url + path, script, c, seconds, env=env)
                    runs[method, name].append((plain, authed))
    for (method, name), pairs in runs.items():
        ordered = sorted(pairs, key=lambda pair: pair[1].rps / pair[0].rps)
        plain, authed = ordered[len(ordered) // 2]
        suite.add(
            f"{method} with {'a JWT' if name == 'jwt' else 'Keystone'} / without auth",
            rps_off=plain.rps,
            **{f"rps_{name}": authed.rps},
            ratio=authed.rps / plain.rps,
            p50_ms_off=plain.p50_ms,
            **{f"p50_ms_{name}": authed.p50_ms},
            errors=plain.errors + authed.errors,
        )
