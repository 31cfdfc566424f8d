"""--auth-token: static bearer tokens mapped to projects."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.config import Settings
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]


SUFFIX = uuid.uuid4().hex


@pytest.fixture
async def authed(redis_url: str, driver: str) -> AsyncIterator[Client]:
    tokens = f"alice-{SUFFIX}=pa-{SUFFIX},bob-{SUFFIX}=pb-{SUFFIX}"
    settings = make_settings(redis_url, driver=driver, auth_token=tokens)
    async with TestClient(TestServer(create_app(settings))) as client:
        yield client


def headers(client: Client, who: str | None, project: str = "spoofed") -> dict[str, str]:
    out = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": project}
    if who is not None:
        out["Authorization"] = f"Bearer {who}-{SUFFIX}"
    return out


async def test_writes_and_reads_need_a_known_token(authed: Client) -> None:
    body = {"messages": [{"body": 1}]}
    # RFC 6750: no error code when no token came, invalid_token for a bad one
    challenges = ["Bearer", 'Bearer error="invalid_token"']
    for h, challenge in zip(
        (headers(authed, None), headers(authed, "mallory")), challenges, strict=True
    ):
        for method, path in [
            ("POST", "/v2/queues/q/messages"),
            ("GET", "/v2/queues/q/messages"),
            ("PUT", "/v2/queues/q"),
            ("DELETE", "/v2/queues/q"),
            ("GET", "/v2/queues"),
        ]:
            response = await authed.request(method, path, json=body, headers=h)
            assert response.status == 401, (method, path)
            assert response.headers["WWW-Authenticate"] == challenge
            assert set(await response.json()) == {"title", "description"}
    # probes stay open
    assert (await authed.get("/v2/ping", headers=headers(authed, None))).status == 204


async def test_the_project_comes_from_the_token(authed: Client) -> None:
    await authed.delete("/v2/queues/q", headers=headers(authed, "alice"))
    await authed.delete("/v2/queues/q", headers=headers(authed, "bob"))
    alice = headers(authed, "alice", project="pb-" + SUFFIX)
    posted = await authed.post("/v2/queues/q/messages", json={"messages": [{"body": 1}]},
                               headers=alice)  # fmt: skip
    assert posted.status == 201
    # bob (whose project alice named in X-Project-ID) sees nothing
    bob = headers(authed, "bob")
    listed = await (await authed.get("/v2/queues/q/messages", headers=bob)).json()
    assert listed["messages"] == []
    reader = headers(authed, "alice")
    mine = await (await authed.get("/v2/queues/q/messages", headers=reader)).json()
    assert [m["body"] for m in mine["messages"]] == [1]


def test_malformed_token_list_is_refused() -> None:
    with pytest.raises(ValueError, match="TOKEN=PROJECT"):
        Settings(auth_token="no-equals-sign")
