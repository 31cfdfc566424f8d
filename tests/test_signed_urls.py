"""Pre-signed URLs (``POST /v2/queues/{q}/share``, ``--signed-url-key``).

The signatures are checked against values computed by Zaqar 23.0.1's own
``zaqar.common.urls.create_signed_url``; the rest runs through aiohttp's
test client against the session's redis-server, for both drivers, with the
app's clock moved by hand to pass an expiry. python-zaqarclient's signed-URL
client is run against a live service in tests/test_zaqarclient.py.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.signed_urls import expiry, signature
from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]

KEY = "test-key-" + uuid.uuid4().hex
TOKEN = "tok-" + uuid.uuid4().hex


@pytest.fixture
def token_project() -> str:
    return "tp-" + uuid.uuid4().hex


async def serve(settings: Any, clock: ManualClock) -> AsyncIterator[Client]:
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


@pytest.fixture
async def keyed(redis_url: str, driver: str, clock: ManualClock) -> AsyncIterator[Client]:
    """A service with a signed-URL key and no authentication."""
    settings = make_settings(redis_url, driver=driver, signed_url_key=KEY)
    async for client in serve(settings, clock):
        yield client


@pytest.fixture
async def keyed_with_tokens(
    redis_url: str, driver: str, clock: ManualClock, token_project: str
) -> AsyncIterator[Client]:
    """A service with a signed-URL key whose queue routes need a bearer token."""
    settings = make_settings(
        redis_url, driver=driver, signed_url_key=KEY, auth_token=f"{TOKEN}={token_project}"
    )
    async for client in serve(settings, clock):
        yield client


@pytest.fixture
async def keyless(redis_url: str, driver: str, clock: ManualClock) -> AsyncIterator[Client]:
    async for client in serve(make_settings(redis_url, driver=driver), clock):
        yield client


def now(clock: ManualClock) -> dt.datetime:
    return dt.datetime.fromtimestamp(clock.now_ms() / 1000, dt.UTC).replace(tzinfo=None)


async def share(http: Client, headers: Headers, queue: str, body: Any) -> dict[str, Any]:
    resp = await http.post(f"/v2/queues/{queue}/share", json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/json"
    doc: dict[str, Any] = await resp.json()
    return doc


def signed(url: dict[str, Any], headers: Headers) -> Headers:
    """Headers of a request made with url, as python-zaqarclient sends them."""
    return {
        "Client-ID": headers["Client-ID"],
        "X-Project-ID": url["project"],
        "URL-Signature": url["signature"],
        "URL-Expires": url["expires"],
        "URL-Methods": ",".join(url["methods"]),
        "URL-Paths": ",".join(url["paths"]),
    }


async def error(resp: ClientResponse, status: int) -> str:
    assert resp.status == status, await resp.text()
    doc = await resp.json()
    assert set(doc) == {"title", "description"}, doc
    return str(doc["description"])


# -- the signature ------------------------------------------------------------------


def test_signatures_are_zaqars() -> None:
    # values printed by Zaqar 23.0.1's create_signed_url for the same input
    paths = ["/v2/queues/shared/messages", "/v2/queues/shared/claims"]
    assert (
        signature("test-key", paths, ["POST", "GET"], "demo", "2030-01-02T03:04:05")
        == "723c31abd66dbfca07dd4ea1b47453d8f389a294ab2faa77304a930b07e86254"
    )
    when = expiry("2030-01-02T03:04:05.999+02:00", dt.datetime(2026, 1, 1))
    assert when == "2030-01-02T01:04:05"
    assert (
        signature("ключ", ["/v2/queues/a.b/messages"], ["GET"], "p", when)
        == "87f327b2dfac6d78b7f038dcd61cdb4aa3edaa251bdd25fc11360f11d75b2f84"
    )


@pytest.mark.parametrize(
    "value",
    [None, 1893553445, "1893553445", "tomorrow", "2015-01-01T00:00:00", "", "2030-13-01T00:00:00"],
)
def test_expiry_refuses_what_is_no_future_time(value: Any) -> None:
    with pytest.raises(ValueError, match="expires"):
        expiry(value, dt.datetime(2026, 1, 1))


# -- making a URL ---------------------------------------------------------------------


async def test_share_answers_as_zaqar_does(
    keyed: Client, headers: Headers, project: str, clock: ManualClock
) -> None:
    url = await share(keyed, headers, "shared", {"methods": ["POST", "GET"]})
    expires = (now(clock) + dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    assert url == {
        "paths": ["/v2/queues/shared/messages"],
        "methods": ["GET", "POST"],
        "project": project,
        "expires": expires,
        "signature": signature(KEY, url["paths"], ["GET", "POST"], project, expires),
    }
    url = await share(
        keyed,
        headers,
        "shared",
        {"paths": ["subscriptions", "messages"], "expires": "2099-01-01T00:00:00Z"},
    )
    assert url["paths"] == ["/v2/queues/shared/messages", "/v2/queues/shared/subscriptions"]
    assert (url["methods"], url["expires"]) == (["GET"], "2099-01-01T00:00:00")
    assert url["signature"] == signature(KEY, url["paths"], ["GET"], project, url["expires"])


BAD_SHARES: dict[str, Any] = {
    "not JSON": b"not json",
    "empty": b"",
    "a list": b"[]",
    "unknown key": {"dummy": "meh"},
    "project_id": {"project_id": "another"},
    "malformed expires": {"expires": "wrong date format"},
    "past expires": {"expires": "2015-01-01T00:00:00"},
    "integer expires": {"expires": 86400},
    "methods not a list": {"methods": "methods not list"},
    "unknown method": {"methods": ["GET", "FETCH"]},
    "lowercase method": {"methods": ["get"]},
    "unknown path": {"paths": ["notallowed"]},
    "path not a list": {"paths": "messages"},
    "path of another queue": {"paths": ["../other/messages"]},
}


@pytest.mark.parametrize("body", list(BAD_SHARES.values()), ids=list(BAD_SHARES))
async def test_bad_share_requests_are_400(
    keyed: Client, keyless: Client, headers: Headers, body: Any
) -> None:
    for http in (keyed, keyless):
        if isinstance(body, bytes):
            json_headers = {**headers, "Content-Type": "application/json"}
            resp = await http.post("/v2/queues/shared/share", data=body, headers=json_headers)
        else:
            resp = await http.post("/v2/queues/shared/share", json=body, headers=headers)
        await error(resp, 400)


async def test_without_a_key_nothing_is_signed_and_signed_requests_are_404(
    keyless: Client, headers: Headers, project: str
) -> None:
    # Zaqar answers 400 too ("The `key` can't be None")
    resp = await keyless.post("/v2/queues/shared/share", json={}, headers=headers)
    assert "--signed-url-key" in await error(resp, 400)
    # a URL signed elsewhere (by a Zaqar with some key) is not honoured here
    expires = "2099-01-01T00:00:00"
    url = {
        "paths": ["/v2/queues/shared/messages"],
        "methods": ["GET"],
        "project": project,
        "expires": expires,
        "signature": signature(KEY, ["/v2/queues/shared/messages"], ["GET"], project, expires),
    }
    resp = await keyless.get("/v2/queues/shared/messages", headers=signed(url, headers))
    await error(resp, 404)
    assert (await keyless.get("/v2/queues/shared/messages", headers=headers)).status == 200


# -- using one ------------------------------------------------------------------------


async def test_a_signed_request_needs_no_token_within_its_paths_and_methods(
    keyed_with_tokens: Client, headers: Headers, token_project: str
) -> None:
    http = keyed_with_tokens
    bearer = {**headers, "Authorization": f"Bearer {TOKEN}"}
    url = await share(http, bearer, "shared", {"methods": ["GET", "POST"]})
    assert url["project"] == token_project  # the token's, not X-Project-ID's
    h = signed(url, headers)
    messages = "/v2/queues/shared/messages"
    posted = await http.post(messages, json={"messages": [{"body": "hi"}]}, headers=h)
    assert posted.status == 201, await posted.text()
    href = (await posted.json())["resources"][0]
    listed = await http.get(messages + "?echo=true", headers=h)
    assert listed.status == 200
    assert [m["body"] for m in (await listed.json())["messages"]] == ["hi"]
    # a message below the signed path; the message is the token project's
    assert (await http.get(href, headers=h)).status == 200
    assert (await http.get(href, headers=bearer)).status == 200
    # not signed for: another method, another route, another queue
    for method, path in [
        ("DELETE", href),
        ("HEAD", messages),
        ("DELETE", messages + "?pop=1"),
        ("GET", "/v2/queues/shared/stats"),
        ("GET", "/v2/queues/shared"),
        ("POST", "/v2/queues/shared/share"),
        ("POST", "/v2/queues/shared/claims"),
        ("GET", "/v2/queues/other/messages"),
        ("GET", "/v2/queues"),
        ("GET", "/v2/ping"),
    ]:
        resp = await http.request(method, path, headers=h, json={})
        assert resp.status == 404, (method, path, await resp.text())
    # without the signature the token is needed again
    assert (await http.get(messages, headers=headers)).status == 401
    # the message is still there: nothing above deleted it
    assert (await http.get(href, headers=bearer)).status == 200


async def test_a_changed_header_breaks_the_signature(keyed: Client, headers: Headers) -> None:
    url = await share(keyed, headers, "shared", {"methods": ["GET"]})
    h = signed(url, headers)
    assert (await keyed.get("/v2/queues/shared/messages", headers=h)).status == 200
    # headers in another order still sign the same text
    reordered = {**h, "URL-Methods": "GET"}
    assert (await keyed.get("/v2/queues/shared/messages", headers=reordered)).status == 200
    for name, value in [
        ("X-Project-ID", "another-project"),
        ("URL-Methods", "DELETE,GET"),
        ("URL-Paths", "/v2/queues/shared/messages,/v2/queues/shared/claims"),
        ("URL-Paths", "/v2/queues/other/messages"),
        ("URL-Expires", "2099-01-01T00:00:00"),
        ("URL-Expires", "not a date"),
        ("URL-Signature", url["signature"][:-1] + "0" if url["signature"][-1] != "0" else "1"),
        ("URL-Signature", url["signature"].upper()),
        ("URL-Signature", ""),
    ]:
        resp = await keyed.get("/v2/queues/shared/messages", headers={**h, name: value})
        assert resp.status == 404, (name, value)
    # the signature itself is checked before Client-ID, as in Zaqar; a read
    # may leave Client-ID out (issue 31), a malformed one is still refused
    no_client = {k: v for k, v in h.items() if k != "Client-ID"}
    assert (await keyed.get("/v2/queues/shared/messages", headers=no_client)).status == 200
    bad_client = {**h, "Client-ID": "not-a-uuid"}
    await error(await keyed.get("/v2/queues/shared/messages", headers=bad_client), 400)


@pytest.mark.parametrize(
    "extra",
    [
        {"URL-Paths": "/v2/queues/shared/messages"},
        {"URL-Methods": "GET"},
        {"URL-Expires": "2099-01-01T00:00:00"},
        {"URL-Signature": ""},
        {"URL-Signature": "dummy", "URL-Methods": "GET", "URL-Paths": "/v2/queues/shared/messages"},
    ],
    ids=["paths only", "methods only", "expires only", "empty signature", "no expires"],
)
async def test_signed_url_headers_are_never_ignored(
    keyed: Client, headers: Headers, extra: Headers
) -> None:
    # each of these requests would be served without the URL-* headers
    for path in ("/v2/queues/shared/messages", "/v2/ping"):
        resp = await keyed.get(path, headers={**headers, **extra})
        assert resp.status == 404, (path, await resp.text())


async def test_a_url_expires(keyed: Client, headers: Headers, clock: ManualClock) -> None:
    at = (now(clock) + dt.timedelta(seconds=90)).strftime("%Y-%m-%dT%H:%M:%S")
    url = await share(keyed, headers, "shared", {"expires": at})
    h = signed(url, headers)
    clock.advance(60)
    assert (await keyed.get("/v2/queues/shared/messages", headers=h)).status == 200
    clock.advance(31)
    assert "expired" in await error(await keyed.get("/v2/queues/shared/messages", headers=h), 404)


async def test_a_dotted_queue_name_covers_only_that_queue(keyed: Client, headers: Headers) -> None:
    # Zaqar matches a signed path as a regular expression: "a.b" also matched "aXb"
    h = signed(await share(keyed, headers, "a.b", {"paths": ["messages", "claims"]}), headers)
    assert (await keyed.get("/v2/queues/a.b/messages", headers=h)).status == 200
    for path in ("/v2/queues/aXb/messages", "/v2/queues/a.bc/messages", "/v2/queues/xa.b/messages"):
        assert (await keyed.get(path, headers=h)).status == 404, path
