"""Scopes (``ACTION:NAME_GLOB``): every route of the OpenAPI document, asked
with a token that lacks its action (or holds it for other names only), is a
403 that changes nothing in Redis; and no route can be added without an
action (``routes.ACTIONS``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.openapi import UNAUTHENTICATED, openapi_document
from feedsvc.api.routes import ACTIONS as ROUTE_ACTIONS
from feedsvc.api.routes import add_routes, route_actions
from feedsvc.app import create_app
from feedsvc.auth.access import ACTIONS, ADMIN, Identity, parse_scopes, read_token_file
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from tests.conftest import direct_client, make_settings

Client = TestClient[web.Request, web.Application]
SUFFIX = uuid.uuid4().hex[:10]
PATCH_TYPE = "application/openstack-messaging-v2.0-json-patch"
ADMIN_TOKEN = "admin-" + "z" * 20

# A request each route would act on, were it allowed (so "no change" means something).
BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/messages"): {"messages": [{"body": "x"}]},
    ("PUT", ""): {"a": 1},
    ("PATCH", ""): [{"op": "add", "path": "/metadata/b", "value": 2}],
    ("POST", "/claims"): {"ttl": 60, "grace": 60},
    ("PATCH", "/claims/{claim_id}"): {"ttl": 120},
    ("POST", "/subscriptions"): {"subscriber": "http://example.com/other"},
    ("PATCH", "/subscriptions/{subscription_id}"): {"ttl": 600},
    ("PUT", "/subscriptions/{subscription_id}/confirm"): {"confirmed": True},
    ("POST", "/share"): {},
    ("POST", "/purge"): {},
    ("POST", "/redrive"): {"max_per_second": 1},
}
QUERIES = {("DELETE", "/messages"): "?pop=1", ("POST", "/claims"): "?limit=1"}


@pytest.fixture
def driver() -> str:
    """Scopes are checked before storage: one driver is enough here."""
    return "lua"


@pytest.fixture
def project() -> str:
    return "scoped-" + uuid.uuid4().hex


@pytest.fixture
def token_file(tmp_path: Path, project: str) -> Path:
    lines = [f"all-{SUFFIX} {project} *:*", f"elsewhere-{SUFFIX} {project} *:other-*"]
    for action in ACTIONS:
        others = " ".join(f"{a}:*" for a in ACTIONS if a != action)
        lines.append(f"no-{action}-{SUFFIX} {project} {others}  # all but {action}")
    # *:* is everything but the admin API
    lines.append(f"no-admin-{SUFFIX} {project} *:*")
    lines.append(f"admin-{SUFFIX} {project} admin:tenant-*")
    path = tmp_path / "tokens"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
async def service(
    redis_url: str, driver: str, token_file: Path, clock: ManualClock
) -> AsyncIterator[Client]:
    settings = make_settings(
        redis_url,
        driver=driver,
        auth_token_file=token_file,
        deliver=False,
        signed_url_key="k",
        admin_token=ADMIN_TOKEN,
    )
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


def as_(who: str) -> dict[str, str]:
    return {"Client-ID": str(uuid.uuid4()), "Authorization": f"Bearer {who}-{SUFFIX}"}


async def fill(client: Client, kind: str, name: str) -> dict[str, str]:
    """A feed with messages, a claim and a subscription: the ids routes name."""
    base = f"/v2/{kind}/{name}"
    assert (await client.put(base, json={}, headers=as_("all"))).status == 201
    body = {"messages": [{"body": i} for i in range(3)]}
    posted = await client.post(base + "/messages", json=body, headers=as_("all"))
    ids = [href.rsplit("/", 1)[1] for href in (await posted.json())["resources"]]
    sub = await client.post(
        base + "/subscriptions", json={"subscriber": "http://example.com/h"}, headers=as_("all")
    )
    values = {"message_id": ids[-1], "subscription_id": (await sub.json())["subscription_id"]}
    if kind == "queues":
        claim = await client.post(base + "/claims?limit=1", json={}, headers=as_("all"))
        values["claim_id"] = (await claim.json())["messages"][0]["href"].rsplit("=", 1)[1]
    return values


async def snapshot(redis_url: str, project: str) -> dict[bytes, bytes | None]:
    redis = direct_client(redis_url)
    try:
        keys = [key async for key in redis.scan_iter(match=f"*{project}*", count=1000)]
        return {key: await redis.dump(key) for key in sorted(keys)}
    finally:
        await redis.aclose()


def operations() -> list[tuple[str, str, str]]:
    """(method, path, action) of every operation the OpenAPI document lists."""
    document = openapi_document(make_settings("redis://x", signed_url_key="k"), ROUTE_ACTIONS)
    out = []
    for path, item in document["paths"].items():
        for method in item:
            if method in ("get", "put", "post", "patch", "delete"):
                action = ROUTE_ACTIONS[method.upper(), path]
                assert (action is None) == (path in UNAUTHENTICATED), path
                if action is not None:
                    out.append((method.upper(), path, action))
    return out


def test_which_routes_take_an_access_token_comes_from_the_route_table() -> None:
    """The OpenAPI document puts access_token on the GETs that routes.ACTIONS
    calls read, whatever their path looks like: a table that says otherwise
    moves it."""
    settings = Settings(auth_token="secret=tenant")
    stats, claim = "/v2/queues/{queue}/stats", "/v2/queues/{queue}/claims/{claim_id}"
    token = {"$ref": "#/components/parameters/AccessToken"}

    def takes_token(document: dict[str, Any], path: str) -> bool:
        return token in document["paths"][path]["get"]["parameters"]

    routed = openapi_document(settings, ROUTE_ACTIONS)
    assert takes_token(routed, stats) and not takes_token(routed, claim)
    swapped = {**ROUTE_ACTIONS, ("GET", stats): "manage", ("GET", claim): "read"}
    document = openapi_document(settings, swapped)
    assert not takes_token(document, stats) and takes_token(document, claim)


async def test_the_served_document_has_the_apps_route_table(redis_url: str) -> None:
    """The app's copy of routes.ACTIONS, by route, is the table the served
    document's reads come from."""
    settings = make_settings(redis_url, driver="lua", auth_token="secret=tenant")
    async with TestClient(TestServer(create_app(settings))) as http:
        served = await (await http.get("/v2/openapi.json")).json()
    assert served == json.loads(json.dumps(openapi_document(settings, ROUTE_ACTIONS)))


async def test_every_route_refuses_a_token_without_its_scope_and_changes_nothing(
    service: Client, redis_url: str, project: str
) -> None:
    values = {"queue": "q1", "topic": "t1", "project": project}
    values |= await fill(service, "queues", "q1")
    topic_values = await fill(service, "topics", "t1")
    before = await snapshot(redis_url, project)
    assert before
    asked = 0
    for method, path, action in operations():
        filled = path.format(**(values | (topic_values if "{topic}" in path else {})))
        tail = path.split("}", 1)[1] if "}" in path else path
        body = BODIES.get((method, tail))
        query = QUERIES.get((method, tail), "")
        variants = [(query, action)]
        if (method, tail) == ("DELETE", "/messages/{message_id}"):
            variants.append((f"?claim_id={values['claim_id']}", "claim"))
        for q, needed in variants:
            for who in (f"no-{needed}", "elsewhere"):
                headers = as_(who)
                if method == "PATCH" and tail == "":
                    headers["Content-Type"] = PATCH_TYPE
                response = await service.request(method, filled + q, json=body, headers=headers)
                assert response.status == 403, (who, method, path, q, await response.text())
                challenge = response.headers["WWW-Authenticate"]
                assert challenge.startswith('Bearer error="insufficient_scope"'), challenge
                assert set(await response.json()) == {"title", "description"}
                asked += 1
    assert asked >= 2 * len(operations())
    assert await snapshot(redis_url, project) == before
    # and the token that has every scope is served (the walk above was not vacuous)
    ok = await service.get("/v2/queues/q1/messages", headers=as_("all"))
    assert ok.status == 200


async def test_a_glob_allows_its_names_only(service: Client) -> None:
    body = {"messages": [{"body": 1}]}
    assert (
        await service.post("/v2/queues/other-a/messages", json=body, headers=as_("elsewhere"))
    ).status == 201
    assert (
        await service.post("/v2/queues/mine/messages", json=body, headers=as_("elsewhere"))
    ).status == 403
    # a list of every queue needs a glob that is every name
    assert (await service.get("/v2/queues", headers=as_("elsewhere"))).status == 403
    assert (await service.get("/v2/queues", headers=as_("no-post"))).status == 200
    # open routes stay open
    assert (await service.get("/v2/ping")).status == 204


async def forgotten(request: web.Request) -> web.Response:
    return web.Response()


async def test_an_admin_scope_reaches_the_admin_api_of_its_projects_only(
    service: Client,
) -> None:
    limits = "/v2/admin/projects/{}/limits"
    resp = await service.put(
        limits.format("tenant-a"), json={"max_queues": 3}, headers=as_("admin")
    )
    assert resp.status == 200, await resp.text()
    resp = await service.get(
        limits.format("tenant-a"), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert (await resp.json())["limits"]["max_queues"] == 3
    for who, path in (("admin", "other"), ("no-admin", "tenant-a"), ("all", "tenant-a")):
        resp = await service.get(limits.format(path), headers=as_(who))
        assert resp.status == 403, (who, path)
        assert resp.headers["WWW-Authenticate"].startswith('Bearer error="insufficient_scope"')
    # an unknown token is 401, and the admin item grants no data route
    resp = await service.get(limits.format("tenant-a"), headers=as_("nobody"))
    assert resp.status == 401
    assert (await service.get("/v2/queues/q/messages", headers=as_("admin"))).status == 403


def test_a_route_without_an_action_is_refused() -> None:
    app = web.Application()
    add_routes(app)
    app.router.add_get("/v2/forgotten", forgotten)
    with pytest.raises(RuntimeError, match="/v2/forgotten has no action"):
        route_actions(app)


def test_scope_claims_are_read_leniently_and_token_files_strictly(tmp_path: Path) -> None:
    assert parse_scopes("openid read:orders-* post:* bogus:x *:*") == (
        ("read", "orders-*"), ("post", "*"), ("*", "*"),
    )  # fmt: skip
    assert parse_scopes(["read:a"]) == (("read", "a"),)
    assert parse_scopes(None) == ()
    alice = Identity("p", parse_scopes("read:orders-* claim:jobs"))
    assert alice.allows("read", "orders-1") and not alice.allows("read", "jobs")
    assert alice.allows("claim", "jobs") and not alice.allows("claim", "jobs2")
    assert not alice.allows("read", None)
    # admin is named or not had: "*" stands for every other action only
    operator = Identity("p", parse_scopes("admin:tenant-* *:*"))
    assert operator.allows(ADMIN, "tenant-1") and not operator.allows(ADMIN, "other")
    assert not Identity("p", parse_scopes("*:*")).allows(ADMIN, "tenant-1")
    path = tmp_path / "tokens"
    for text, message in [
        ("tok project\n", "line 1: want TOKEN PROJECT SCOPE"),
        ("# ok\ntok project write:*\n", "line 2: 'write:\\*' is no scope"),
        ("a p *:*\na q *:*\n", "line 2: the token is given twice"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_token_file(path)
