"""--cors-origin: preflights for every route, CORS headers on answers, and
nothing for an origin not listed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.openapi import openapi_document
from feedsvc.api.routes import ACTIONS
from feedsvc.app import create_app
from feedsvc.config import Settings, parse_settings
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]
APP = "https://app.test"
TOKEN = "cors-" + uuid.uuid4().hex


@pytest.fixture
def driver() -> str:
    """CORS is answered before storage: one driver is enough here."""
    return "lua"


async def serving(settings: Settings) -> AsyncIterator[Client]:
    async with TestClient(TestServer(create_app(settings))) as client:
        yield client


@pytest.fixture
async def listed(redis_url: str) -> AsyncIterator[Client]:
    settings = make_settings(
        redis_url, cors_origin=f"{APP},http://localhost:3000", auth_token=f"{TOKEN}=cors-p"
    )
    async for client in serving(settings):
        yield client


@pytest.fixture
async def anyone(redis_url: str) -> AsyncIterator[Client]:
    async for client in serving(make_settings(redis_url, cors_origin="*")):
        yield client


def preflight(origin: str, method: str, headers: str = "client-id,x-project-id") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers,
    }


async def test_every_route_answers_a_preflight_with_its_methods(listed: Client) -> None:
    document = openapi_document(Settings(), ACTIONS)
    for path, item in document["paths"].items():
        filled = path.format(
            queue="q",
            topic="t",
            message_id="0" * 24,
            claim_id="0" * 24,
            subscription_id="s",
            project="p",
        )
        methods = {m.upper() for m in item if m != "parameters"}
        for method in methods:
            response = await listed.options(
                filled, headers=preflight(APP, method, "authorization,client-id,content-type")
            )
            assert response.status == 204, (path, method)
            assert response.headers["Access-Control-Allow-Origin"] == APP
            allowed = set(response.headers["Access-Control-Allow-Methods"].split(", "))
            assert methods <= allowed, path
            asked = response.headers["Access-Control-Allow-Headers"]
            assert {"Authorization", "Client-ID", "Content-Type", "X-Project-ID"} <= set(
                asked.split(", ")
            )
            assert "Origin" in response.headers["Vary"]


async def test_answers_to_a_listed_origin_expose_what_a_page_reads(listed: Client) -> None:
    headers = {"Origin": APP, "Client-ID": str(uuid.uuid4()), "Authorization": f"Bearer {TOKEN}"}
    posted = await listed.post("/v2/queues/q/messages", json={"messages": [{"body": 1}]},
                               headers=headers)  # fmt: skip
    assert posted.status == 201
    assert posted.headers["Access-Control-Allow-Origin"] == APP
    exposed = posted.headers["Access-Control-Expose-Headers"].split(", ")
    assert {"Location", "Retry-After", "X-Openstack-Request-Id"} <= set(exposed)
    # errors too: a page can read why it was refused
    refused = await listed.get("/v2/queues/q/messages", headers={"Origin": APP,
                               "Client-ID": str(uuid.uuid4())})  # fmt: skip
    assert refused.status == 401
    assert refused.headers["Access-Control-Allow-Origin"] == APP


async def test_an_origin_not_listed_gets_no_cors_header(listed: Client) -> None:
    evil = "https://evil.test"
    headers = {"Origin": evil, "Client-ID": str(uuid.uuid4()), "Authorization": f"Bearer {TOKEN}"}
    response = await listed.get("/v2/queues/q/messages", headers=headers)
    assert response.status == 200
    assert "Access-Control-Allow-Origin" not in response.headers
    answer = await listed.options("/v2/queues/q/messages", headers=preflight(evil, "GET"))
    assert answer.status == 403
    assert "Access-Control-Allow-Origin" not in answer.headers
    assert set(await answer.json()) == {"title", "description"}


async def test_star_allows_reads_without_credentials_only(anyone: Client) -> None:
    origin = "https://somewhere.test"
    plain = {"Origin": origin, "Client-ID": str(uuid.uuid4()), "X-Project-ID": "cors-star"}
    read = await anyone.get("/v2/queues/q/messages", headers=plain)
    assert read.status == 200
    assert read.headers["Access-Control-Allow-Origin"] == "*"
    posted = await anyone.post("/v2/queues/q/messages", json={"messages": [{"body": 1}]},
                               headers={"Origin": origin, "Client-ID": str(uuid.uuid4()),
                                        "X-Project-ID": "cors-star"})  # fmt: skip
    assert "Access-Control-Allow-Origin" not in posted.headers
    ok = await anyone.options("/v2/queues/q/messages", headers=preflight(origin, "GET"))
    assert ok.status == 204
    assert ok.headers["Access-Control-Allow-Origin"] == "*"
    assert ok.headers["Access-Control-Allow-Methods"] == "GET, HEAD"
    for refused in (
        preflight(origin, "POST"),
        preflight(origin, "GET", "authorization,client-id"),
    ):
        answer = await anyone.options("/v2/queues/q/messages", headers=refused)
        assert answer.status == 403
        assert "Access-Control-Allow-Origin" not in answer.headers


async def test_without_cors_an_options_is_still_405(redis_url: str) -> None:
    async for client in serving(make_settings(redis_url)):
        response = await client.options("/v2/queues/q/messages", headers=preflight(APP, "GET"))
        assert response.status == 405
        assert "Access-Control-Allow-Origin" not in response.headers


def test_the_flag_repeats() -> None:
    settings = parse_settings(["--cors-origin", APP, "--cors-origin", "http://[::1]:8080"], {})
    assert settings.cors_origins() == {APP, "http://[::1]:8080"}
    from_env = parse_settings([], {"FEEDSVC_CORS_ORIGIN": f"{APP}, *"})
    assert from_env.cors_origins() == {APP, "*"}


async def test_an_event_stream_carries_the_cors_headers(listed: Client) -> None:
    headers = {"Origin": APP, "Client-ID": str(uuid.uuid4()), "Authorization": f"Bearer {TOKEN}",
               "Accept": "text/event-stream"}  # fmt: skip
    async with listed.get("/v2/queues/q/messages", headers=headers) as stream:
        assert stream.status == 200
        assert stream.content_type == "text/event-stream"
        assert stream.headers["Access-Control-Allow-Origin"] == APP
