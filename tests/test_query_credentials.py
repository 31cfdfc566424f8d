"""Credentials in the query string, for a browser's EventSource (issue 31,
point 6): a pre-signed URL's parts under their header names, a bearer token
as ``access_token`` (RFC 6750 section 2.3), Client-ID optional on reads, and
none of those values in any log line. The browser itself is in
tests/test_browser_eventsource.py; here each rule over plain HTTP, through
aiohttp's test client against the session's redis-server (one driver:
credentials are checked before storage)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse, ClientSession, web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.protocol import FeedAppRunner
from feedsvc.api.query_secrets import REDACTED, AccessLogger, redacted_query
from feedsvc.app import create_app
from feedsvc.cli import ACCESS_FORMAT
from feedsvc.clock import ManualClock
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]

KEY = "query-key-" + uuid.uuid4().hex
READER = "reader-" + uuid.uuid4().hex  # may read orders-* only
WRITER = "writer-" + uuid.uuid4().hex  # may do anything in the project
POSTER = "poster-" + uuid.uuid4().hex  # may post only


@pytest.fixture
def driver() -> str:
    return "lua"


@pytest.fixture
def project() -> str:
    return "qc-" + uuid.uuid4().hex[:12]


@pytest.fixture
def token_file(tmp_path: Path, project: str) -> Path:
    path = tmp_path / "tokens"
    path.write_text(
        f"{READER} {project} read:orders-*\n{WRITER} {project} *:*\n{POSTER} {project} post:*\n"
    )
    return path


def settings_for(redis_url: str, token_file: Path, **changes: Any) -> Any:
    changes = {"cors_origin": "http://page.test", **changes}
    return make_settings(
        redis_url, driver="lua", signed_url_key=KEY, auth_token_file=token_file, **changes
    )


@pytest.fixture
async def http(redis_url: str, token_file: Path, clock: ManualClock) -> AsyncIterator[Client]:
    """Tokens from a file, a signed-URL key, one CORS origin."""
    settings = settings_for(redis_url, token_file)
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


def writer() -> Headers:
    return {"Client-ID": str(uuid.uuid4()), "Authorization": f"Bearer {WRITER}"}


async def post(http: Client, queue: str, *bodies: Any) -> list[str]:
    resp = await http.post(
        f"/v2/queues/{queue}/messages",
        json={"messages": [{"body": b} for b in bodies]},
        headers=writer(),
    )
    assert resp.status == 201, await resp.text()
    return [href.rsplit("/", 1)[1] for href in (await resp.json())["resources"]]


async def bodies(http: Client, queue: str) -> list[Any]:
    resp = await http.get(f"/v2/queues/{queue}/messages?echo=true", headers=writer())
    assert resp.status == 200, await resp.text()
    return [m["body"] for m in (await resp.json())["messages"]]


async def share(http: Client, queue: str, **options: Any) -> dict[str, str]:
    """A pre-signed URL's parts, by their header (and query) names."""
    resp = await http.post(f"/v2/queues/{queue}/share", json=options, headers=writer())
    assert resp.status == 200, await resp.text()
    doc = await resp.json()
    return {
        "URL-Signature": doc["signature"],
        "URL-Expires": doc["expires"],
        "URL-Methods": ",".join(doc["methods"]),
        "URL-Paths": ",".join(doc["paths"]),
        "X-Project-ID": doc["project"],
    }


async def error(resp: ClientResponse, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    doc: dict[str, Any] = await resp.json()
    assert set(doc) == {"title", "description"} and doc["description"], doc
    return doc


async def first_event(resp: ClientResponse) -> str:
    """The data of the stream's first message event."""
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "text/event-stream"
    async with asyncio.timeout(10):
        async for line in resp.content:
            if line.startswith(b"data: "):
                return line[6:].decode()
    raise AssertionError("the stream ended without an event")


# -- a pre-signed URL in the query string ------------------------------------------------


async def test_a_signed_query_string_serves_a_get_and_a_stream_without_headers(
    http: Client, project: str
) -> None:
    await post(http, "inbox", "one")
    parts = await share(http, "inbox")
    # no Client-ID, no X-Project-ID header, no token: only the query
    resp = await http.get("/v2/queues/inbox/messages", params=parts)
    assert resp.status == 200, await resp.text()
    page = await resp.json()
    assert [m["body"] for m in page["messages"]] == ["one"]  # no Client-ID: sees every message
    assert "URL-Signature" not in page["links"][0]["href"]  # a next link carries no credential
    head = await http.head("/v2/queues/inbox/messages", params=parts)
    assert head.status == 200
    stream = await http.get(
        "/v2/queues/inbox/messages", params=parts, headers={"Accept": "text/event-stream"}
    )
    assert '"body":"one"' in await first_event(stream)
    stream.close()
    # the signature covers the project: another one in the query does not hold
    spoofed = {**parts, "X-Project-ID": project + "-other"}
    await error(await http.get("/v2/queues/inbox/messages", params=spoofed), 403)


async def test_a_signed_query_string_is_refused_for_a_write_even_if_signed_for_it(
    http: Client,
) -> None:
    parts = await share(http, "inbox", methods=["GET", "POST", "DELETE"])
    doc = await error(
        await http.post(
            "/v2/queues/inbox/messages",
            params=parts,
            json={"messages": [{"body": "smuggled"}]},
            headers={"Client-ID": str(uuid.uuid4())},
        ),
        403,
    )
    assert "GET and HEAD only" in doc["description"]
    await error(await http.delete("/v2/queues/inbox/messages?pop=1", params=parts), 403)
    assert await bodies(http, "inbox") == []
    # the same parts as headers still work for a POST (Zaqar's form)
    resp = await http.post(
        "/v2/queues/inbox/messages",
        json={"messages": [{"body": "signed"}]},
        headers={**parts, "Client-ID": str(uuid.uuid4())},
    )
    assert resp.status == 201, await resp.text()
    assert await bodies(http, "inbox") == ["signed"]


async def test_bad_or_expired_signed_query_strings_are_403_json(
    http: Client, clock: ManualClock
) -> None:
    await post(http, "inbox", "secret")
    parts = await share(http, "inbox")
    bad = {
        "wrong signature": {**parts, "URL-Signature": "0" * 64},
        "no signature": {k: v for k, v in parts.items() if k != "URL-Signature"},
        "malformed expires": {**parts, "URL-Expires": "tomorrow"},
        "methods widened": {**parts, "URL-Methods": "GET,POST"},
        "no project": {k: v for k, v in parts.items() if k != "X-Project-ID"},
    }
    for case, params in bad.items():
        resp = await http.get("/v2/queues/inbox/messages", params=params)
        assert resp.status == 403, (case, await resp.text())
        await error(resp, 403)
    # another queue of the project is not covered
    await error(await http.get("/v2/queues/other/messages", params=parts), 403)
    # parts in the headers and the query at once: which would count?
    both = await http.get("/v2/queues/inbox/messages", params=parts, headers=parts)
    assert "not both" in (await error(both, 400))["description"]
    clock.advance(2 * 24 * 3600)  # past the default lifetime of a day
    expired = await error(await http.get("/v2/queues/inbox/messages", params=parts), 403)
    assert "expired" in expired["description"]
    # the header form keeps Zaqar's answer
    resp = await http.get("/v2/queues/inbox/messages", headers=parts)
    await error(resp, 404)


# -- a bearer token in the query string ------------------------------------------------------


async def test_access_token_in_the_query_reads_and_streams(http: Client) -> None:
    await post(http, "orders-eu", {"order": 1})
    query = {"access_token": READER}
    resp = await http.get("/v2/queues/orders-eu/messages", params=query)
    assert resp.status == 200, await resp.text()
    assert [m["body"] for m in (await resp.json())["messages"]] == [{"order": 1}]
    for path in ("/v2/queues/orders-eu", "/v2/queues/orders-eu/stats"):
        assert (await http.get(path, params=query)).status == 200, path
    stream = await http.get(
        "/v2/queues/orders-eu/messages", params=query, headers={"Accept": "text/event-stream"}
    )
    assert '"order":1' in await first_event(stream)
    stream.close()
    # its scopes hold as in a header: orders-* only
    resp = await http.get("/v2/queues/invoices/messages", params=query)
    assert resp.headers["WWW-Authenticate"].startswith('Bearer error="insufficient_scope"')
    await error(resp, 403)


async def test_access_token_is_refused_for_anything_but_a_read(http: Client) -> None:
    ids = await post(http, "orders-eu", "kept")
    writes = [
        ("POST", "/v2/queues/orders-eu/messages", {"messages": [{"body": "no"}]}),
        ("DELETE", f"/v2/queues/orders-eu/messages/{ids[0]}", None),
        ("DELETE", "/v2/queues/orders-eu", None),
        ("PUT", "/v2/queues/orders-new", None),
        ("POST", "/v2/queues/orders-eu/claims", {"ttl": 60, "grace": 60}),
    ]
    for method, path, body in writes:
        # the all-powerful token: refused in the query before it is looked at
        resp = await http.request(
            method,
            path,
            params={"access_token": WRITER},
            json=body,
            headers={"Client-ID": str(uuid.uuid4())},
        )
        doc = await error(resp, 403)
        assert "reads only" in doc["description"], (method, path)
    # GETs that are no read: a claim's (claim), the subscriptions' (manage)
    for path in ("/v2/queues/orders-eu/subscriptions", f"/v2/queues/orders-eu/claims/{ids[0]}"):
        await error(await http.get(path, params={"access_token": WRITER}), 403)
    assert await bodies(http, "orders-eu") == ["kept"]


async def test_bad_access_tokens_are_401_and_two_tokens_400(http: Client) -> None:
    for token in ("not-a-token", "", "a.b.c"):
        resp = await http.get("/v2/queues/orders-eu/messages", params={"access_token": token})
        assert resp.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"', token
        await error(resp, 401)
    resp = await http.get(
        "/v2/queues/orders-eu/messages",
        params={"access_token": READER},
        headers={"Authorization": f"Bearer {READER}"},
    )
    assert "not both" in (await error(resp, 400))["description"]
    # a token that may post but not read gets nothing from the query either
    resp = await http.get("/v2/queues/orders-eu/messages", params={"access_token": POSTER})
    await error(resp, 403)


# -- Client-ID ---------------------------------------------------------------------------------


async def test_client_id_is_optional_for_reads_and_required_for_writes(http: Client) -> None:
    bearer = {"Authorization": f"Bearer {WRITER}"}
    mine = {**bearer, "Client-ID": str(uuid.uuid4())}
    resp = await http.post(
        "/v2/queues/orders-eu/messages", json={"messages": [{"body": 1}]}, headers=mine
    )
    assert resp.status == 201
    # the author does not see its own message without echo; a reader without
    # a Client-ID has no messages of its own, so it sees it
    resp = await http.get("/v2/queues/orders-eu/messages", headers=mine)
    assert (await resp.json())["messages"] == []
    resp = await http.get("/v2/queues/orders-eu/messages", headers=bearer)
    assert [m["body"] for m in (await resp.json())["messages"]] == [1]
    # a write still needs one, and a read that sends one must send a good one
    resp = await http.post(
        "/v2/queues/orders-eu/messages", json={"messages": [{"body": 2}]}, headers=bearer
    )
    assert "Client-ID" in (await error(resp, 400))["description"]
    resp = await http.get(
        "/v2/queues/orders-eu/messages", headers={**bearer, "Client-ID": "not-a-uuid"}
    )
    await error(resp, 400)
    assert await bodies(http, "orders-eu") == [1]


# -- CORS ----------------------------------------------------------------------------------------


async def test_cors_exposes_x_gap_and_star_refuses_query_tokens(
    redis_url: str, token_file: Path, clock: ManualClock
) -> None:
    settings = settings_for(redis_url, token_file, cors_origin="*")
    async with TestClient(TestServer(create_app(settings, clock))) as star:
        origin = {"Origin": "http://anywhere.test"}
        resp = await star.get(
            "/v2/queues/orders-eu/messages", params={"access_token": READER}, headers=origin
        )
        assert resp.status == 200
        assert "Access-Control-Allow-Origin" not in resp.headers
    async with TestClient(TestServer(create_app(settings_for(redis_url, token_file), clock))) as c:
        resp = await c.get(
            "/v2/queues/orders-eu/messages",
            params={"access_token": READER},
            headers={"Origin": "http://page.test"},
        )
        assert resp.headers["Access-Control-Allow-Origin"] == "http://page.test"
        assert "X-Gap" in resp.headers["Access-Control-Expose-Headers"].split(", ")


# -- the logs ---------------------------------------------------------------------------------


def test_redacted_query_replaces_each_credential_and_keeps_the_rest() -> None:
    assert redacted_query("limit=5&echo=true") is None
    assert (
        redacted_query(
            "access_token=s3cr3t&limit=5&URL-Signature=ab&URL%2DPaths=%2Fv2&X-Project-ID"
        )
        == f"access_token={REDACTED}&limit=5&URL-Signature={REDACTED}&URL%2DPaths={REDACTED}"
        "&X-Project-ID"
    )


@pytest.fixture
async def logged_service(
    redis_url: str, token_file: Path, clock: ManualClock
) -> AsyncIterator[str]:
    """The app served on a real socket by the runner ``feedsvc serve`` uses,
    with --access-log on, as cli.serve sets it up."""
    settings = settings_for(redis_url, token_file, access_log=True)
    runner = FeedAppRunner(
        create_app(settings, clock),
        access_log=logging.getLogger("feedsvc.access"),
        access_log_format=ACCESS_FORMAT,
        access_log_class=AccessLogger,
        handle_signals=False,
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_query_credentials_never_reach_a_log(
    logged_service: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every record of every logger, its text and each of its attributes (a
    JSON log writes those as fields), for accepted and refused requests."""
    base = logged_service
    caplog.set_level(logging.DEBUG)
    async with ClientSession(base) as session:
        author = {"Client-ID": str(uuid.uuid4()), "Authorization": f"Bearer {WRITER}"}
        resp = await session.post(
            "/v2/queues/orders-eu/share", json={"methods": ["GET", "POST"]}, headers=author
        )
        doc = await resp.json()
        parts = {
            "URL-Signature": doc["signature"],
            "URL-Expires": doc["expires"],
            "URL-Methods": ",".join(doc["methods"]),
            "URL-Paths": ",".join(doc["paths"]),
            "X-Project-ID": doc["project"],
        }
        wrong = {**parts, "URL-Signature": "f" * 64}
        requests: list[tuple[str, str, dict[str, str], Headers]] = [
            ("GET", "/v2/queues/orders-eu/messages", parts, {}),
            ("POST", "/v2/queues/orders-eu/messages", parts, {}),  # 403
            ("GET", "/v2/queues/orders-eu/messages", wrong, {}),  # 403
            ("GET", "/v2/queues/orders-eu/messages", {"access_token": READER}, {}),
            ("GET", "/v2/queues/orders-eu/messages", {"access_token": READER + "x"}, {}),  # 401
            ("DELETE", "/v2/queues/orders-eu", {"access_token": WRITER}, {}),  # 403
            ("GET", "/v2/queues/orders-eu/messages?limit=999", {"access_token": READER}, {}),
        ]
        statuses = []
        for method, path, params, headers in requests:
            async with session.request(method, path, params=params, headers=headers) as resp:
                statuses.append(resp.status)
                await resp.read()
    assert statuses == [200, 403, 403, 200, 401, 403, 400], statuses  # limit=999: 400
    await asyncio.sleep(0)  # the access log is written after the answer
    access = [
        r for r in caplog.records if r.name == "feedsvc.access" and "HTTP/1.1" in r.getMessage()
    ]
    assert len(access) >= len(requests), [r.getMessage() for r in caplog.records]
    assert any(f"access_token={REDACTED}" in r.getMessage() for r in access)
    assert any(f"URL-Signature={REDACTED}" in r.getMessage() for r in access)
    secrets = [READER, WRITER, doc["signature"], "f" * 64, doc["expires"]]
    for record in caplog.records:
        text = record.getMessage() + " " + " ".join(str(v) for v in vars(record).values())
        for secret in secrets:
            assert secret not in text, (secret, record.name, record.getMessage())


async def test_a_malformed_request_line_is_logged_without_its_query_credentials(
    logged_service: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's parser quotes the request line it refuses; that line is
    logged (feedsvc.api.protocol), so its credentials are redacted."""
    caplog.set_level(logging.DEBUG)
    host, port = logged_service.removeprefix("http://").split(":")
    secrets = ["tok-" + uuid.uuid4().hex, "sig-" + uuid.uuid4().hex]
    heads = [
        f"GET /v2/queues/q/messages?access_token={secrets[0]}\x01 HTTP/1.1\r\n\r\n",
        f"GET /v2/queues/q/messages?limit=1&URL-Signature={secrets[1]} HTTP/1.1 x\r\n\r\n",
    ]
    for head in heads:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head.encode())
        answer = await reader.read(200)
        assert answer.split(b" ", 2)[1] == b"400", answer
        writer.close()
    logged = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(logged) == len(heads), [r.getMessage() for r in caplog.records]
    assert all(REDACTED in r.getMessage() for r in logged), [r.getMessage() for r in logged]
    for record in caplog.records:
        for secret in secrets:
            assert secret not in record.getMessage(), record.getMessage()
