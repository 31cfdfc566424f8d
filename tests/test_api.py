"""HTTP tests of the Zaqar v2 API, through aiohttp's test client.

Every test runs once per storage driver (the ``http`` fixture is parametrised
over "lua" and "watch") against the session's real redis-server, in a project
of its own. Expected behaviour is the product contract (docs DESIGN.md) and,
where it is silent, real Zaqar's wire behaviour.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import socket
import uuid
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.validation import CLIENT_ID_OPTIONAL
from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]

REQUEST_ID = "X-Openstack-Request-Id"
MAX_POST_SIZE = 262144
MAX_TTL = 1209600
MAX_DELAY = 900
MAX_PER_PAGE = 20
MAX_PER_POST = 1000
# An id of the service's own format that no message has.
UNKNOWN_ID = "0" * 24
RESERVED_DEFAULTS: dict[str, Any] = {
    "_max_messages_post_size": MAX_POST_SIZE,
    "_default_message_ttl": 3600,
    "_default_message_delay": 0,
    "_dead_letter_queue": None,
    "_dead_letter_queue_messages_ttl": None,
    "_max_claim_count": None,
}
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
# Following `next` links must end; this bounds a listing that would loop.
MAX_PAGES = 100


# -- helpers -------------------------------------------------------------------


def other_client(headers: Headers) -> Headers:
    """The same project, seen by another client (so echo=false shows our messages)."""
    return {**headers, "Client-ID": str(uuid.uuid4())}


def other_project(headers: Headers) -> Headers:
    return {**headers, "X-Project-ID": "other-" + uuid.uuid4().hex}


def check_request_id(resp: ClientResponse) -> None:
    assert resp.headers.get(REQUEST_ID, "").startswith("req-"), dict(resp.headers)


async def ok_json(resp: ClientResponse, status: int = 200) -> Any:
    """The JSON body of a successful answer, after checking status and headers."""
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    check_request_id(resp)
    return await resp.json()


async def no_content(resp: ClientResponse) -> None:
    assert resp.status == 204, await resp.text()
    assert await resp.read() == b""
    check_request_id(resp)


async def error(resp: ClientResponse, status: int) -> dict[str, str]:
    """A Zaqar-style error: JSON {"title", "description"}, both non-empty strings."""
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    check_request_id(resp)
    doc = await resp.json()
    assert isinstance(doc, dict)
    assert set(doc) == {"title", "description"}, doc
    assert isinstance(doc["title"], str)
    assert doc["title"]
    assert isinstance(doc["description"], str)
    assert doc["description"]
    return doc


def messages_path(queue: str) -> str:
    return f"/v2/queues/{queue}/messages"


async def post(
    http: Client, headers: Headers, queue: str, messages: list[dict[str, Any]]
) -> list[str]:
    """POST messages; the new ids, in order."""
    resp = await http.post(messages_path(queue), json={"messages": messages}, headers=headers)
    doc = await ok_json(resp, 201)
    prefix = messages_path(queue) + "/"
    ids = []
    for href in doc["resources"]:
        assert href.startswith(prefix), href
        ids.append(href[len(prefix) :])
    assert len(ids) == len(messages)
    return ids


async def post_bodies(http: Client, headers: Headers, queue: str, bodies: list[Any]) -> list[str]:
    return await post(http, headers, queue, [{"body": b} for b in bodies])


async def list_page(http: Client, url: str, headers: Headers) -> Any:
    doc = await ok_json(await http.get(url, headers=headers))
    assert set(doc) == {"messages", "links"}, doc
    return doc


async def follow(
    http: Client, url: str, headers: Headers, key: str = "messages"
) -> tuple[list[list[dict[str, Any]]], str]:
    """Follow `next` links exactly as given until an empty page.

    Returns the non-empty pages and the URL of the empty page: the last
    marker, which a reader polls again. Every non-empty page must carry a
    relative `next` link; the empty page must carry none.
    """
    pages: list[list[dict[str, Any]]] = []
    path = url.split("?", maxsplit=1)[0]
    for _ in range(MAX_PAGES):
        doc = await ok_json(await http.get(url, headers=headers))
        assert set(doc) >= {key, "links"}, doc
        items = doc[key]
        if not items:
            assert doc["links"] == [], doc
            return pages, url
        [link] = doc["links"]
        assert link["rel"] == "next"
        assert link["href"].startswith(path + "?"), link
        pages.append(items)
        url = link["href"]
    raise AssertionError(f"no empty page after {MAX_PAGES} pages of {url}: the listing loops")


def bodies_of(items: list[dict[str, Any]]) -> list[Any]:
    return [m["body"] for m in items]


def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- service documents -----------------------------------------------------------


async def test_versions_document_needs_no_headers(http: Client) -> None:
    resp = await http.get("/")
    doc = await ok_json(resp, 300)
    [version] = doc["versions"]
    assert version["id"] == "2"
    assert version["status"] == "CURRENT"
    assert version["links"] == [{"href": "/v2/", "rel": "self"}]
    assert {"base": "application/json", "type": "application/vnd.openstack.messaging-v2+json"} in (
        version["media-types"]
    )


@pytest.mark.parametrize("path", ["/v2/", "/v2"])
async def test_home_document(http: Client, headers: Headers, path: str) -> None:
    resp = await http.get(path, headers=headers)
    assert resp.status == 200
    assert resp.content_type == "application/json-home"
    assert resp.headers["Cache-Control"] == "max-age=86400"
    check_request_id(resp)
    doc = json.loads(await resp.read())
    resources = doc["resources"]
    for rel in ("queues", "queue", "queue_stats", "messages", "post_messages", "ping"):
        assert f"rel/{rel}" in resources, sorted(resources)
    assert resources["rel/post_messages"]["hints"]["allow"] == ["POST"]
    assert "GET" in resources["rel/messages"]["hints"]["allow"]
    for resource in resources.values():
        href = resource.get("href-template", resource.get("href"))
        assert href.startswith("/v2/"), resource


async def test_ping_get_and_head(http: Client, headers: Headers) -> None:
    await no_content(await http.get("/v2/ping", headers=headers))
    resp = await http.head("/v2/ping", headers=headers)
    assert resp.status == 204
    check_request_id(resp)


async def test_health_names_the_driver(http: Client, headers: Headers, driver: str) -> None:
    doc = await ok_json(await http.get("/v2/health", headers=headers))
    assert doc["driver"] == driver
    assert doc["storage_reachable"] is True


async def test_ping_and_health_need_no_headers(http: Client, driver: str) -> None:
    """Probes (load balancers, uptime checks) often cannot send headers; the
    answer is the same whatever headers come, malformed ones too."""
    malformed = {"Client-ID": "not-a-uuid", "X-Project-ID": ""}
    for sent in ({}, malformed):
        await no_content(await http.get("/v2/ping", headers=sent))
        assert (await http.head("/v2/ping", headers=sent)).status == 204
        doc = await ok_json(await http.get("/v2/health", headers=sent))
        assert doc["driver"] == driver and doc["storage_reachable"] is True


async def test_request_ids_differ(http: Client, headers: Headers) -> None:
    first = await http.get("/v2/ping", headers=headers)
    second = await http.get("/v2/ping", headers=headers)
    check_request_id(first)
    check_request_id(second)
    assert first.headers[REQUEST_ID] != second.headers[REQUEST_ID]


def test_the_message_routes_are_the_first_tried_under_a_feed() -> None:
    """aiohttp tries a path's candidate resources in the order they were
    added; the message routes carry nearly all the traffic, so a POST or a
    GET of messages finds its resource at the first try (routes.FEED)."""
    app = create_app(make_settings("redis://127.0.0.1:1/0"))
    for prefix in ("/v2/queues", "/v2/topics"):
        under = [r.canonical for r in app.router.resources() if r.canonical.startswith(prefix)]
        feed = prefix + ("/{queue}" if prefix == "/v2/queues" else "/{topic}")
        assert under[:2] == [f"{feed}/messages", f"{feed}/messages/{{message_id}}"], under


# -- headers -----------------------------------------------------------------------

V2_ROUTES = [
    ("GET", "/v2/"),
    ("GET", "/v2"),
    ("GET", "/v2/queues"),
    ("PUT", "/v2/queues/q1"),
    ("GET", "/v2/queues/q1"),
    ("DELETE", "/v2/queues/q1"),
    ("GET", "/v2/queues/q1/stats"),
    ("POST", "/v2/queues/q1/messages"),
    ("GET", "/v2/queues/q1/messages"),
    ("DELETE", f"/v2/queues/q1/messages?ids={UNKNOWN_ID}"),
    ("GET", f"/v2/queues/q1/messages/{UNKNOWN_ID}"),
    ("DELETE", f"/v2/queues/q1/messages/{UNKNOWN_ID}"),
    ("POST", f"/v2/queues/q1/messages/{UNKNOWN_ID}/release?claim_id={UNKNOWN_ID}"),
    ("POST", "/v2/queues/q1/redrive"),
    ("GET", "/v2/queues/q1/redrive"),
    ("DELETE", "/v2/queues/q1/redrive"),
]


@pytest.mark.parametrize(("method", "path"), V2_ROUTES, ids=[f"{m} {p}" for m, p in V2_ROUTES])
async def test_bad_headers_are_400_on_every_v2_route(
    http: Client, headers: Headers, method: str, path: str
) -> None:
    project = headers["X-Project-ID"]
    good_client = headers["Client-ID"]
    cases: dict[str, Headers] = {
        "missing Client-ID": {"X-Project-ID": project},
        "empty Client-ID": {"Client-ID": "", "X-Project-ID": project},
        "malformed Client-ID": {"Client-ID": "not-a-uuid", "X-Project-ID": project},
        "missing X-Project-ID": {"Client-ID": good_client},
        "empty X-Project-ID": {"Client-ID": good_client, "X-Project-ID": ""},
        "257-char X-Project-ID": {"Client-ID": good_client, "X-Project-ID": "p" * 257},
    }
    body = json.dumps({"messages": [{"body": 1}]}) if method == "POST" else None
    for case, bad in cases.items():
        if case == "missing Client-ID" and method in CLIENT_ID_OPTIONAL:
            continue  # a read may leave it out (tests/test_query_credentials.py)
        resp = await http.request(method, path, headers=bad, data=body)
        if method == "HEAD":
            assert resp.status == 400, case
            continue
        assert resp.status == 400, (case, await resp.text())
        await error(resp, 400)
    # Nothing was written by any of the refused requests.
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert doc == {"queues": [], "links": []}


async def test_client_id_forms_accepted_and_normalised(http: Client, headers: Headers) -> None:
    cid = uuid.UUID(headers["Client-ID"])
    # python-zaqarclient sends 32 hex digits without dashes; header names
    # arrive in any case (it spells X-Project-Id).
    dashless = {"client-id": cid.hex, "x-project-id": headers["X-Project-ID"]}
    upper = {**headers, "Client-ID": str(cid).upper()}
    for variant in (dashless, upper):
        await no_content(await http.get("/v2/ping", headers=variant))
    await post_bodies(http, dashless, "q", ["mine"])
    # The same client in its dashed spelling does not see its own message...
    own = await list_page(http, messages_path("q"), headers)
    assert own["messages"] == []
    # ...nor in upper case, but another client does.
    own = await list_page(http, messages_path("q"), upper)
    assert own["messages"] == []
    other = await list_page(http, messages_path("q"), other_client(headers))
    assert bodies_of(other["messages"]) == ["mine"]


async def test_project_id_of_256_chars_is_accepted(http: Client, headers: Headers) -> None:
    long_project = {**headers, "X-Project-ID": "p" * 255 + uuid.uuid4().hex[:1]}
    resp = await http.put("/v2/queues/q", headers=long_project)
    assert resp.status == 201
    doc = await ok_json(await http.get("/v2/queues", headers=long_project))
    assert [q["name"] for q in doc["queues"]] == ["q"]
    await no_content(await http.delete("/v2/queues/q", headers=long_project))


# -- routing errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/v2/nope", "/v3", "/v1.1/ping", "/v2/queues/q/messages/a/b", "/v2/queues/q/stats/x"],
)
async def test_unknown_route_is_404_json(http: Client, headers: Headers, path: str) -> None:
    await error(await http.get(path, headers=headers), 404)


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("POST", "/v2/ping", {"GET"}),
        ("POST", "/", {"GET"}),
        ("POST", "/v2/queues", {"GET"}),
        ("POST", "/v2/queues/q", {"GET", "PUT", "DELETE"}),
        ("PUT", "/v2/queues/q/messages", {"GET", "POST", "DELETE"}),
        ("POST", f"/v2/queues/q/messages/{UNKNOWN_ID}", {"GET", "DELETE"}),
        ("DELETE", "/v2/queues/q/stats", {"GET"}),
    ],
)
async def test_wrong_method_is_405_json_with_allow(
    http: Client, headers: Headers, method: str, path: str, allowed: set[str]
) -> None:
    resp = await http.request(method, path, headers=headers)
    await error(resp, 405)
    allow = {m.strip() for m in resp.headers["Allow"].split(",")}
    assert allowed <= allow, allow
    assert method not in allow


# -- queues ------------------------------------------------------------------------------


async def test_put_queue_201_then_204(http: Client, headers: Headers) -> None:
    resp = await http.put("/v2/queues/fresh", headers=headers)
    assert resp.status == 201, await resp.text()
    assert resp.headers["Location"] == "/v2/queues/fresh"
    check_request_id(resp)
    assert await resp.read() == b""
    resp = await http.put("/v2/queues/fresh", headers=headers)
    await no_content(resp)
    assert resp.headers["Location"] == "/v2/queues/fresh"
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert doc["queues"] == [{"name": "fresh", "href": "/v2/queues/fresh"}]


async def test_put_queue_metadata_is_merged_with_reserved_defaults(
    http: Client, headers: Headers
) -> None:
    metadata = {"a": 1, "nested": {"x": [1, "two", None]}, "_custom": "kept", "_max_claim_count": 5}
    resp = await http.put("/v2/queues/meta", json=metadata, headers=headers)
    assert resp.status == 201
    doc = await ok_json(await http.get("/v2/queues/meta", headers=headers))
    expected = RESERVED_DEFAULTS | metadata
    assert {k: doc.get(k, "<missing>") for k in expected} == expected
    assert all(k.startswith("_") for k in set(doc) - set(expected)), doc
    # A PUT on an existing queue changes nothing (Zaqar: use PATCH).
    resp = await http.put("/v2/queues/meta", json={"b": 2}, headers=headers)
    await no_content(resp)
    assert await ok_json(await http.get("/v2/queues/meta", headers=headers)) == doc


async def test_put_queue_empty_object_and_empty_body(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/a", json={}, headers=headers)).status == 201
    assert (await http.put("/v2/queues/b", data=b"", headers=headers)).status == 201
    for name in ("a", "b"):
        doc = await ok_json(await http.get(f"/v2/queues/{name}", headers=headers))
        assert {k: doc[k] for k in RESERVED_DEFAULTS} == RESERVED_DEFAULTS


@pytest.mark.parametrize("body", [b"[1, 2]", b'"x"', b"5", b"null", b"true", b"{bad", b"{"])
async def test_put_queue_with_non_object_body_is_400(
    http: Client, headers: Headers, body: bytes
) -> None:
    resp = await http.put(
        "/v2/queues/q", data=body, headers={**headers, "Content-Type": "application/json"}
    )
    await error(resp, 400)
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert doc["queues"] == []


@pytest.mark.parametrize(
    "metadata",
    [
        {"_default_message_ttl": 0},
        {"_default_message_ttl": MAX_TTL + 1},
        {"_default_message_ttl": "x"},
        {"_default_message_delay": MAX_DELAY + 1},
        {"_default_message_delay": -1},
        {"_max_messages_post_size": MAX_POST_SIZE + 1},
        {"_max_messages_post_size": 0},
    ],
    ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()),
)
async def test_put_queue_with_invalid_reserved_value_is_400(
    http: Client, headers: Headers, metadata: dict[str, Any]
) -> None:
    await error(await http.put("/v2/queues/q", json=metadata, headers=headers), 400)
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert doc["queues"] == []


async def test_queue_metadata_over_64k_is_400(http: Client, headers: Headers) -> None:
    metadata = {"big": "x" * 65536}
    await error(await http.put("/v2/queues/q", json=metadata, headers=headers), 400)


def padded_metadata(size: int) -> bytes:
    """A metadata body of exactly size bytes, most of them spaces: compact,
    it is about 1 KiB."""
    body = b'{"big": "' + b"x" * 1000 + b'"}'
    return body[:-1] + b" " * (size - len(body)) + body[-1:]


async def test_queue_metadata_limit_counts_the_body_as_sent(http: Client, headers: Headers) -> None:
    # Zaqar measures the request body (Content-Length), whitespace included,
    # before reading it; the compact re-encoding is not what the client sent.
    json_headers = {**headers, "Content-Type": "application/json"}
    too_big = padded_metadata(65538)
    doc = await error(await http.put("/v2/queues/q", data=too_big, headers=json_headers), 400)
    assert "65536" in doc["description"]
    assert (await ok_json(await http.get("/v2/queues", headers=headers)))["queues"] == []
    at_limit = padded_metadata(65536)
    assert (await http.put("/v2/queues/q", data=at_limit, headers=json_headers)).status == 201
    # a PATCH body is measured the same way
    patch = b'[{"op": "add", "path": "/metadata/y", "value": 1}' + b" " * 65536 + b"]"
    patch_headers = {**headers, "Content-Type": "application/openstack-messaging-v2.0-json-patch"}
    resp = await http.patch("/v2/queues/q", data=patch, headers=patch_headers)
    assert "65536" in (await error(resp, 400))["description"]
    assert "y" not in await ok_json(await http.get("/v2/queues/q", headers=headers))
    # Larger than any post: still the metadata's 400 (and its description),
    # from Content-Length, not the post size limit's.
    huge = padded_metadata(MAX_POST_SIZE + 1)
    for method, sent in (("PUT", json_headers), ("PATCH", patch_headers)):
        resp = await http.request(method, "/v2/queues/q2", data=huge, headers=sent)
        assert "65536" in (await error(resp, 400))["description"], method


@pytest.mark.parametrize("body", [b"  ", b"\n", b" \t\r\n "])
async def test_put_queue_with_a_blank_body_is_400(
    http: Client, headers: Headers, body: bytes
) -> None:
    # Zaqar reads any body that has a length: whitespace is not JSON. Only an
    # empty body means "no metadata".
    json_headers = {**headers, "Content-Type": "application/json"}
    await error(await http.put("/v2/queues/q", data=body, headers=json_headers), 400)
    assert (await ok_json(await http.get("/v2/queues", headers=headers)))["queues"] == []


FORM = "application/x-www-form-urlencoded"


@pytest.mark.parametrize(
    "content_type", [FORM, "Application/X-WWW-Form-URLEncoded", FORM + "; charset=utf-8"]
)
async def test_a_form_urlencoded_body_is_400(
    http: Client, headers: Headers, content_type: str
) -> None:
    # Zaqar refuses a body sent as a form (what `curl -d` sends unless told
    # otherwise) before looking at anything else, Client-ID included.
    form = {**headers, "Content-Type": content_type}
    message = json.dumps({"messages": [{"body": 1}]})
    for method, path, body in [
        ("POST", messages_path("q"), message),
        ("PUT", "/v2/queues/q", '{"a": 1}'),
        ("POST", "/v2/queues/q/claims", '{"ttl": 60}'),
    ]:
        resp = await http.request(method, path, data=body, headers=form)
        doc = await error(resp, 400)
        assert doc["title"] == "Invalid Content-Type", (method, path, doc)
        no_client = {k: v for k, v in form.items() if k != "Client-ID"}
        resp = await http.request(method, path, data=body, headers=no_client)
        assert (await error(resp, 400))["title"] == "Invalid Content-Type"
    assert (await ok_json(await http.get("/v2/queues", headers=headers)))["queues"] == []
    # Without a body the content type does not matter (Zaqar's own test).
    resp = await http.put("/v2/queues/q", headers=form)
    assert resp.status == 201, await resp.text()


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "text/plain", "application/octet-stream"]
)
async def test_other_content_types_of_a_json_body_are_accepted(
    http: Client, headers: Headers, content_type: str | None
) -> None:
    # Zaqar reads the body as JSON whatever else the client calls it.
    sent = headers if content_type is None else {**headers, "Content-Type": content_type}
    body = json.dumps({"messages": [{"body": 1}]}).encode()
    resp = await http.post(
        messages_path("q"), data=body, headers=sent, skip_auto_headers=["Content-Type"]
    )
    await ok_json(resp, 201)


async def test_queue_default_ttl_applies_to_messages(http: Client, headers: Headers) -> None:
    resp = await http.put("/v2/queues/q", json={"_default_message_ttl": 120}, headers=headers)
    assert resp.status == 201
    [mid] = await post_bodies(http, headers, "q", ["x"])
    doc = await ok_json(await http.get(f"{messages_path('q')}/{mid}", headers=headers))
    assert doc["ttl"] == 120


async def test_queue_default_delay_applies_to_messages(http: Client, headers: Headers) -> None:
    resp = await http.put("/v2/queues/q", json={"_default_message_delay": 600}, headers=headers)
    assert resp.status == 201
    await post(http, headers, "q", [{"body": "late"}, {"body": "now", "delay": 0}])
    doc = await list_page(http, messages_path("q"), other_client(headers))
    assert bodies_of(doc["messages"]) == ["now"]


INVALID_NAMES = ["x" * 65, "a!b", "a%20b", "caf%C3%A9", "a%2Fb", "a*"]


@pytest.mark.parametrize("name", INVALID_NAMES)
async def test_invalid_queue_names_are_400_everywhere(
    http: Client, headers: Headers, name: str
) -> None:
    q = f"/v2/queues/{name}"
    requests = [
        ("PUT", q, None),
        ("GET", q, None),
        ("DELETE", q, None),
        ("GET", q + "/stats", None),
        ("POST", q + "/messages", {"messages": [{"body": 1}]}),
        ("GET", q + "/messages", None),
        ("DELETE", q + f"/messages?ids={UNKNOWN_ID}", None),
        ("GET", q + f"/messages/{UNKNOWN_ID}", None),
        ("DELETE", q + f"/messages/{UNKNOWN_ID}", None),
    ]
    for method, path, body in requests:
        resp = await http.request(method, path, json=body, headers=headers)
        assert resp.status == 400, (method, path, resp.status)
        await error(resp, 400)
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert doc["queues"] == []


async def test_name_of_64_chars_is_valid(http: Client, headers: Headers) -> None:
    name = "n" * 64
    assert (await http.put(f"/v2/queues/{name}", headers=headers)).status == 201
    await post_bodies(http, headers, name, [1])
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert [q["name"] for q in doc["queues"]] == [name]


@pytest.mark.parametrize("name", ["a.b.c", "v1.0-beta_2", ".hidden", "end."])
async def test_dotted_queue_names_work_everywhere(
    http: Client, headers: Headers, name: str
) -> None:
    q = f"/v2/queues/{name}"
    resp = await http.put(q, json={"k": "v"}, headers=headers)
    assert resp.status == 201
    assert resp.headers["Location"] == q
    ids = await post_bodies(http, headers, name, ["one", "two"])
    reader = other_client(headers)
    doc = await list_page(http, q + "/messages", reader)
    assert [m["id"] for m in doc["messages"]] == ids
    assert [m["href"] for m in doc["messages"]] == [f"{q}/messages/{i}" for i in ids]
    assert doc["links"][0]["href"].startswith(q + "/messages?")
    one = await ok_json(await http.get(f"{q}/messages/{ids[0]}", headers=headers))
    assert one["body"] == "one"
    stats = await ok_json(await http.get(q + "/stats", headers=headers))
    assert stats["messages"]["total"] == 2
    meta = await ok_json(await http.get(q, headers=headers))
    assert meta["k"] == "v"
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed["queues"] == [{"name": name, "href": q}]
    await no_content(await http.delete(f"{q}/messages/{ids[0]}", headers=headers))
    doc = await list_page(http, q + "/messages", reader)
    assert [m["id"] for m in doc["messages"]] == ids[1:]
    await no_content(await http.delete(q, headers=headers))
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed["queues"] == []


async def test_get_nonexistent_queue_shows_defaults_and_creates_nothing(
    http: Client, headers: Headers
) -> None:
    doc = await ok_json(await http.get("/v2/queues/ghost", headers=headers))
    assert {k: doc[k] for k in RESERVED_DEFAULTS} == RESERVED_DEFAULTS
    assert all(k.startswith("_") for k in doc), doc
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed == {"queues": [], "links": []}


async def test_delete_queue_removes_it_and_its_messages(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/q", json={"k": 1}, headers=headers)).status == 201
    ids = await post_bodies(http, headers, "q", ["a", "b"])
    await no_content(await http.delete("/v2/queues/q", headers=headers))
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed["queues"] == []
    meta = await ok_json(await http.get("/v2/queues/q", headers=headers))
    assert "k" not in meta
    stats = await ok_json(await http.get("/v2/queues/q/stats", headers=headers))
    assert stats == {"messages": {"claimed": 0, "free": 0, "total": 0}}
    doc = await list_page(http, messages_path("q"), other_client(headers))
    assert doc == {"messages": [], "links": []}
    await error(await http.get(f"{messages_path('q')}/{ids[0]}", headers=headers), 404)
    # Deleting again, or a queue that never existed, is fine.
    await no_content(await http.delete("/v2/queues/q", headers=headers))
    await no_content(await http.delete("/v2/queues/never", headers=headers))
    # A re-created queue starts empty, with fresh metadata.
    assert (await http.put("/v2/queues/q", headers=headers)).status == 201
    assert "k" not in await ok_json(await http.get("/v2/queues/q", headers=headers))


async def test_queue_list_of_empty_project(http: Client, headers: Headers) -> None:
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert doc == {"queues": [], "links": []}
    doc = await ok_json(await http.get("/v2/queues?with_count=true", headers=headers))
    assert doc == {"queues": [], "links": [], "count": 0}


@pytest.mark.parametrize("limit", [1, 2, 3, 20])
async def test_queue_list_paging_visits_every_queue_once(
    http: Client, headers: Headers, limit: int
) -> None:
    names = ["q-7", "a.1", "m_3", "Z", "b-2", "q-10", "zz"]
    for name in names:
        assert (await http.put(f"/v2/queues/{name}", headers=headers)).status == 201
    pages, _ = await follow(http, f"/v2/queues?limit={limit}", headers, key="queues")
    assert all(len(page) <= limit for page in pages)
    assert all(len(page) == limit for page in pages[:-1])
    seen = [q["name"] for page in pages for q in page]
    assert seen == sorted(names)
    assert all(q["href"] == f"/v2/queues/{q['name']}" for page in pages for q in page)


async def test_queue_list_marker_of_first_and_only_queue(http: Client, headers: Headers) -> None:
    # Zaqar's redis driver treats a marker equal to the first name as "no
    # marker" and loops forever here.
    assert (await http.put("/v2/queues/only", headers=headers)).status == 201
    for limit in (1, 2):
        pages, _ = await follow(http, f"/v2/queues?limit={limit}", headers, key="queues")
        assert [[q["name"] for q in page] for page in pages] == [["only"]]
    doc = await ok_json(await http.get("/v2/queues?marker=only", headers=headers))
    assert doc == {"queues": [], "links": []}


async def test_queue_list_marker_is_exclusive_and_needs_no_such_queue(
    http: Client, headers: Headers
) -> None:
    for name in ("a", "c", "e"):
        assert (await http.put(f"/v2/queues/{name}", headers=headers)).status == 201
    doc = await ok_json(await http.get("/v2/queues?marker=a", headers=headers))
    assert [q["name"] for q in doc["queues"]] == ["c", "e"]
    # A marker that names no queue (e.g. one deleted since) goes on after it.
    doc = await ok_json(await http.get("/v2/queues?marker=b", headers=headers))
    assert [q["name"] for q in doc["queues"]] == ["c", "e"]
    await no_content(await http.delete("/v2/queues/c", headers=headers))
    doc = await ok_json(await http.get("/v2/queues?marker=c", headers=headers))
    assert [q["name"] for q in doc["queues"]] == ["e"]


async def test_queue_list_detailed(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/a", json={"x": 1}, headers=headers)).status == 201
    assert (await http.put("/v2/queues/b", headers=headers)).status == 201
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert all(set(q) == {"name", "href"} for q in doc["queues"])
    doc = await ok_json(await http.get("/v2/queues?detailed=true&limit=1", headers=headers))
    [a] = doc["queues"]
    assert a["name"] == "a"
    assert a["href"] == "/v2/queues/a"
    assert a["metadata"]["x"] == 1
    # The metadata is the document GET /v2/queues/a shows (as in Zaqar).
    assert a["metadata"] == await ok_json(await http.get("/v2/queues/a", headers=headers))
    # The next link keeps asking for details.
    doc = await ok_json(await http.get(doc["links"][0]["href"], headers=headers))
    [b] = doc["queues"]
    assert b["name"] == "b"
    assert "metadata" in b
    assert {k: b["metadata"][k] for k in RESERVED_DEFAULTS} == RESERVED_DEFAULTS


async def test_queue_list_with_count(http: Client, headers: Headers) -> None:
    for name in ("a", "b", "c"):
        assert (await http.put(f"/v2/queues/{name}", headers=headers)).status == 201
    doc = await ok_json(await http.get("/v2/queues?with_count=true&limit=2", headers=headers))
    assert doc["count"] == 3
    assert len(doc["queues"]) == 2
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    assert "count" not in doc


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=21",
        "limit=-1",
        "limit=abc",
        "limit=1.5",
        "marker=a!b",
        "marker=" + "x" * 65,
        "detailed=maybe",
        "with_count=maybe",
    ],
)
async def test_queue_list_bad_parameters_are_400(
    http: Client, headers: Headers, query: str
) -> None:
    await error(await http.get(f"/v2/queues?{query}", headers=headers), 400)


async def test_queue_list_limit_bounds_accepted(http: Client, headers: Headers) -> None:
    for limit in (1, 20):
        doc = await ok_json(await http.get(f"/v2/queues?limit={limit}", headers=headers))
        assert doc == {"queues": [], "links": []}


# -- stats -------------------------------------------------------------------------------


async def test_stats_of_empty_and_nonexistent_queue(http: Client, headers: Headers) -> None:
    zero = {"messages": {"claimed": 0, "free": 0, "total": 0}}
    assert await ok_json(await http.get("/v2/queues/ghost/stats", headers=headers)) == zero
    assert (await http.put("/v2/queues/empty", headers=headers)).status == 201
    assert await ok_json(await http.get("/v2/queues/empty/stats", headers=headers)) == zero
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert [q["name"] for q in listed["queues"]] == ["empty"]


async def test_stats_after_posting(http: Client, headers: Headers) -> None:
    before = dt.datetime.now(dt.UTC)
    ids = await post_bodies(http, headers, "s", ["m1", "m2", "m3"])
    doc = await ok_json(await http.get("/v2/queues/s/stats", headers=headers))
    stats = doc["messages"]
    assert stats["total"] == 3
    assert stats["free"] == 3
    assert stats["claimed"] == 0
    assert stats["oldest"]["href"] == f"{messages_path('s')}/{ids[0]}"
    assert stats["newest"]["href"] == f"{messages_path('s')}/{ids[2]}"
    for end in (stats["oldest"], stats["newest"]):
        assert isinstance(end["age"], int)
        assert end["age"] >= 0
        assert ISO_UTC.match(end["created"]), end
        created = dt.datetime.strptime(end["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        # The creation time is the real one (not local time, not ms as s).
        assert abs((created - before).total_seconds()) < 120, (created, before)
    # Deleting the oldest moves "oldest" on.
    await no_content(await http.delete(f"{messages_path('s')}/{ids[0]}", headers=headers))
    stats = (await ok_json(await http.get("/v2/queues/s/stats", headers=headers)))["messages"]
    assert (stats["total"], stats["free"]) == (2, 2)
    assert stats["oldest"]["href"].endswith(ids[1])
    assert stats["newest"]["href"].endswith(ids[2])


# -- posting messages ----------------------------------------------------------------------


async def test_post_batch(http: Client, headers: Headers) -> None:
    resp = await http.post(
        messages_path("m1"),
        json={"messages": [{"body": "a", "ttl": 300}, {"body": "b"}, {"body": "c", "delay": 0}]},
        headers=headers,
    )
    doc = await ok_json(resp, 201)
    assert set(doc) == {"resources"}
    resources = doc["resources"]
    assert len(resources) == 3
    prefix = messages_path("m1") + "/"
    ids = [href.removeprefix(prefix) for href in resources]
    assert all(href.startswith(prefix) for href in resources)
    assert len(set(ids)) == 3
    assert resp.headers["Location"] == f"{messages_path('m1')}?ids={','.join(ids)}"
    # The Location, followed as given, names exactly these messages.
    got = await ok_json(await http.get(resp.headers["Location"], headers=headers))
    assert [m["id"] for m in got["messages"]] == ids
    assert bodies_of(got["messages"]) == ["a", "b", "c"]
    assert got["messages"][0]["ttl"] == 300
    assert got["messages"][1]["ttl"] == 3600
    # Message ids are unique across requests too.
    more = await post_bodies(http, headers, "m1", ["d"])
    assert not set(more) & set(ids)


async def test_post_creates_the_queue(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "auto", ["x"])
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed["queues"] == [{"name": "auto", "href": "/v2/queues/auto"}]
    meta = await ok_json(await http.get("/v2/queues/auto", headers=headers))
    assert {k: meta[k] for k in RESERVED_DEFAULTS} == RESERVED_DEFAULTS
    # A PUT afterwards finds it.
    await no_content(await http.put("/v2/queues/auto", headers=headers))


BAD_POSTS: dict[str, bytes | Any] = {
    "invalid JSON": b"{bad",
    "truncated JSON": b'{"messages": [{"body": 1}',
    "empty body": b"",
    "number": 42,
    "string": "hi",
    "null": None,
    "plain list": [{"body": 1}],
    "empty object": {},
    "no messages key": {"foo": [{"body": 1}]},
    "empty list": {"messages": []},
    "messages is an object": {"messages": {"body": 1}},
    "messages is a string": {"messages": "x"},
    "message is a number": {"messages": [1]},
    "message is null": {"messages": [None]},
    "message is a list": {"messages": [[{"body": 1}]]},
    "message is a string": {"messages": ["body"]},
    "missing body": {"messages": [{"ttl": 60}]},
    "missing body in second message": {"messages": [{"body": 1}, {"ttl": 60}]},
    "ttl 0": {"messages": [{"body": 1, "ttl": 0}]},
    "ttl negative": {"messages": [{"body": 1, "ttl": -5}]},
    "ttl over max": {"messages": [{"body": 1, "ttl": MAX_TTL + 1}]},
    "ttl string": {"messages": [{"body": 1, "ttl": "x"}]},
    "ttl numeric string": {"messages": [{"body": 1, "ttl": "300"}]},
    "ttl true": {"messages": [{"body": 1, "ttl": True}]},
    "ttl float": {"messages": [{"body": 1, "ttl": 300.5}]},
    "ttl null": {"messages": [{"body": 1, "ttl": None}]},
    "ttl huge": {"messages": [{"body": 1, "ttl": 10**30}]},
    "delay over max": {"messages": [{"body": 1, "delay": MAX_DELAY + 1}]},
    "delay negative": {"messages": [{"body": 1, "delay": -1}]},
    "delay string": {"messages": [{"body": 1, "delay": "x"}]},
    "bad ttl in second message": {"messages": [{"body": 1}, {"body": 2, "ttl": 0}]},
    "too many messages": {"messages": [{"body": i} for i in range(MAX_PER_POST + 1)]},
}


@pytest.mark.parametrize("case", list(BAD_POSTS))
async def test_bad_post_is_400_and_stores_nothing(
    http: Client, headers: Headers, case: str
) -> None:
    payload = BAD_POSTS[case]
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    resp = await http.post(
        messages_path("bad"),
        data=data,
        headers={**headers, "Content-Type": "application/json"},
    )
    await error(resp, 400)
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed["queues"] == []
    doc = await list_page(http, messages_path("bad") + "?echo=true", headers)
    assert doc == {"messages": [], "links": []}
    stats = await ok_json(await http.get("/v2/queues/bad/stats", headers=headers))
    assert stats["messages"]["total"] == 0


async def test_post_bounds_accepted(http: Client, headers: Headers) -> None:
    ids = await post(
        http,
        headers,
        "b",
        [
            {"body": "min", "ttl": 1},
            {"body": "max", "ttl": MAX_TTL},
            {"body": "d0", "delay": 0},
            {"body": "d900", "delay": MAX_DELAY},
            {"body": "extra", "unknown": "ignored"},
        ],
    )
    doc = await ok_json(
        await http.get(f"{messages_path('b')}?ids={ids[1]}&ids={ids[4]}", headers=headers)
    )
    assert [m["ttl"] for m in doc["messages"]] == [MAX_TTL, 3600]
    assert bodies_of(doc["messages"]) == ["max", "extra"]


async def test_post_of_the_most_messages_allowed(
    http: Client, headers: Headers, settings: Settings
) -> None:
    # The Location header of a 1000-message POST is about 26 KB; read the
    # answer with a client that accepts such a header.
    async with TestClient(TestServer(create_app(settings)), max_field_size=1 << 16) as big:
        ids = await post_bodies(big, headers, "many", list(range(MAX_PER_POST)))
    assert len(set(ids)) == MAX_PER_POST
    stats = await ok_json(await http.get("/v2/queues/many/stats", headers=headers))
    assert stats["messages"]["total"] == MAX_PER_POST


def post_of_size(size: int) -> bytes:
    prefix, suffix = b'{"messages": [{"body": "', b'"}]}'
    return prefix + b"x" * (size - len(prefix) - len(suffix)) + suffix


async def test_body_over_size_limit_is_400_as_in_zaqar_and_stores_nothing(
    http: Client, headers: Headers
) -> None:
    data = post_of_size(MAX_POST_SIZE + 1)
    resp = await http.post(
        messages_path("big"), data=data, headers={**headers, "Content-Type": "application/json"}
    )
    doc = await error(resp, 400)
    # Zaqar's words and status (test_exceeded_message_posting): python-zaqarclient
    # raises MalformedRequest for a 400, and nothing of its own for a 413.
    assert doc["description"] == f"Message collection size is too large. Max size: {MAX_POST_SIZE}"
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed["queues"] == []
    # Far over the limit too (the service must not buffer it whole to say no).
    data = post_of_size(4 * MAX_POST_SIZE)
    resp = await http.post(
        messages_path("big"), data=data, headers={**headers, "Content-Type": "application/json"}
    )
    await error(resp, 400)
    stats = await ok_json(await http.get("/v2/queues/big/stats", headers=headers))
    assert stats["messages"]["total"] == 0


async def test_chunked_post_over_the_size_limit_is_400_too(http: Client, headers: Headers) -> None:
    """Without a Content-Length the limit is found while the body streams in;
    the answer must not depend on the framing."""

    async def chunks() -> Any:
        data = post_of_size(MAX_POST_SIZE + 1)
        for start in range(0, len(data), 65536):
            yield data[start : start + 65536]

    resp = await http.post(
        messages_path("chunky"),
        data=chunks(),
        headers={**headers, "Content-Type": "application/json"},
    )
    doc = await error(resp, 400)
    assert doc["description"] == f"Message collection size is too large. Max size: {MAX_POST_SIZE}"
    stats = await ok_json(await http.get("/v2/queues/chunky/stats", headers=headers))
    assert stats["messages"]["total"] == 0


async def test_other_bodies_over_the_size_limit_are_413(http: Client, headers: Headers) -> None:
    """Zaqar reads claim bodies whole whatever their size; feedsvc reads at
    most the post size limit of any body and says so with a 413."""
    await post(http, headers, "cl", [{"body": 1}])
    padded = b'{"ttl": 60' + b" " * MAX_POST_SIZE + b"}"
    resp = await http.post(
        "/v2/queues/cl/claims", data=padded, headers={**headers, "Content-Type": "application/json"}
    )
    await error(resp, 413)
    stats = await ok_json(await http.get("/v2/queues/cl/stats", headers=headers))
    assert stats["messages"]["claimed"] == 0


async def test_body_of_exactly_the_size_limit_is_accepted(http: Client, headers: Headers) -> None:
    data = post_of_size(MAX_POST_SIZE)
    assert len(data) == MAX_POST_SIZE
    resp = await http.post(
        messages_path("edge"), data=data, headers={**headers, "Content-Type": "application/json"}
    )
    doc = await ok_json(resp, 201)
    [href] = doc["resources"]
    got = await ok_json(await http.get(href, headers=headers))
    assert got["body"] == json.loads(data)["messages"][0]["body"]


BODIES: list[Any] = [
    None,
    True,
    False,
    0,
    -17,
    2**62,
    3.5,
    -0.125,
    1e300,
    "",
    "plain",
    'héllo ☃ 𝄞 \u0000 "quoted" \\ \n',
    [],
    [1, "a", None, [2, {"b": []}]],
    {},
    {"nested": {"deeper": {"list": [1, 2.5, "x"], "t": True}}, "ü": "ß"},
]


async def test_bodies_of_every_json_type_round_trip(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "types", BODIES)
    # One at a time.
    for message_id, body in zip(ids, BODIES, strict=True):
        doc = await ok_json(
            await http.get(f"{messages_path('types')}/{message_id}", headers=headers)
        )
        assert doc["body"] == body, (body, doc["body"])
        assert type(doc["body"]) is type(body)
    # By ids.
    got = await ok_json(
        await http.get(f"{messages_path('types')}?ids={','.join(ids)}", headers=headers)
    )
    assert bodies_of(got["messages"]) == BODIES
    # In the feed.
    pages, _ = await follow(http, messages_path("types") + "?limit=20", other_client(headers))
    listed = [m for page in pages for m in page]
    assert bodies_of(listed) == BODIES
    assert [type(b) for b in bodies_of(listed)] == [type(b) for b in BODIES]


# -- listing messages --------------------------------------------------------------------------


async def test_message_item_shape(http: Client, headers: Headers) -> None:
    [mid] = await post(http, headers, "shape", [{"body": {"k": "v"}, "ttl": 500}])
    doc = await list_page(http, messages_path("shape"), other_client(headers))
    [item] = doc["messages"]
    assert set(item) == {"id", "href", "ttl", "age", "body"}
    assert item["id"] == mid
    assert item["href"] == f"{messages_path('shape')}/{mid}"
    assert item["ttl"] == 500
    assert isinstance(item["age"], int)
    assert item["age"] >= 0
    assert item["body"] == {"k": "v"}
    one = await ok_json(await http.get(item["href"], headers=headers))
    assert set(one) == {"id", "href", "ttl", "age", "body"}
    assert {k: one[k] for k in ("id", "href", "ttl", "body")} == {
        k: item[k] for k in ("id", "href", "ttl", "body")
    }


async def test_echo_hides_own_messages_by_default(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "e", ["mine1", "mine2"])
    doc = await list_page(http, messages_path("e"), headers)
    assert doc == {"messages": [], "links": []}
    doc = await list_page(http, messages_path("e") + "?echo=false", headers)
    assert doc == {"messages": [], "links": []}
    doc = await list_page(http, messages_path("e") + "?echo=true", headers)
    assert bodies_of(doc["messages"]) == ["mine1", "mine2"]
    doc = await list_page(http, messages_path("e"), other_client(headers))
    assert bodies_of(doc["messages"]) == ["mine1", "mine2"]


async def test_paging_limit_1_sees_every_message_once_in_order(
    http: Client, headers: Headers
) -> None:
    bodies = [f"m{i}" for i in range(25)]
    ids = await post(http, headers, "p", [{"body": b} for b in bodies[:10]])
    ids += await post(http, headers, "p", [{"body": b} for b in bodies[10:]])
    reader = other_client(headers)
    pages, poll_url = await follow(http, messages_path("p") + "?limit=1", reader)
    assert [len(page) for page in pages] == [1] * 25
    seen = [m for page in pages for m in page]
    assert [m["id"] for m in seen] == ids
    assert bodies_of(seen) == bodies
    # A reader that got to the end polls again with its last marker and gets
    # exactly what was posted since.
    new_ids = await post_bodies(http, headers, "p", ["late1", "late2"])
    pages, _ = await follow(http, poll_url, reader)
    assert [m["id"] for page in pages for m in page] == new_ids


async def test_marker_of_the_first_message_moves_forward(http: Client, headers: Headers) -> None:
    # Zaqar's redis driver treats the first message's marker as "no marker".
    ids = await post_bodies(http, headers, "r0", ["first", "second"])
    reader = other_client(headers)
    first = await list_page(http, messages_path("r0") + "?limit=1", reader)
    assert [m["id"] for m in first["messages"]] == ids[:1]
    [link] = first["links"]
    second = await list_page(http, link["href"], reader)
    assert [m["id"] for m in second["messages"]] == ids[1:]
    third = await list_page(http, second["links"][0]["href"], reader)
    assert third == {"messages": [], "links": []}


@pytest.mark.parametrize("limit", [2, 7, 20])
async def test_paging_as_the_poster_with_echo(http: Client, headers: Headers, limit: int) -> None:
    ids = await post_bodies(http, headers, "pe", list(range(25)))
    url = f"{messages_path('pe')}?echo=true&limit={limit}"
    pages, _ = await follow(http, url, headers)
    assert all(len(page) == limit for page in pages[:-1])
    assert [m["id"] for page in pages for m in page] == ids


async def test_default_page_size_is_10(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "d", list(range(12)))
    pages, _ = await follow(http, messages_path("d"), other_client(headers))
    assert [len(page) for page in pages] == [10, 2]
    assert [m["id"] for page in pages for m in page] == ids


async def test_paging_fills_pages_past_filtered_messages(http: Client, headers: Headers) -> None:
    alice, bob = headers, other_client(headers)
    bob_ids: list[str] = []
    for _ in range(2):
        await post_bodies(http, alice, "f", ["a"] * 5)
        bob_ids += await post_bodies(http, bob, "f", ["b"] * 3)
    await post_bodies(http, alice, "f", ["a"] * 5)
    pages, _ = await follow(http, messages_path("f") + "?limit=2", alice)
    assert [len(page) for page in pages] == [2, 2, 2]
    assert [m["id"] for page in pages for m in page] == bob_ids


async def test_paging_when_the_marker_message_is_deleted(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "del", list(range(6)))
    reader = other_client(headers)
    first = await list_page(http, messages_path("del") + "?limit=2", reader)
    assert [m["id"] for m in first["messages"]] == ids[:2]
    await no_content(await http.delete(f"{messages_path('del')}/{ids[1]}", headers=headers))
    await no_content(await http.delete(f"{messages_path('del')}/{ids[2]}", headers=headers))
    pages, _ = await follow(http, first["links"][0]["href"], reader)
    assert [m["id"] for page in pages for m in page] == ids[3:]


async def test_delayed_messages_are_hidden_unless_asked(http: Client, headers: Headers) -> None:
    ids = await post(http, headers, "dl", [{"body": "late", "delay": 600}, {"body": "now"}])
    reader = other_client(headers)
    doc = await list_page(http, messages_path("dl"), reader)
    assert bodies_of(doc["messages"]) == ["now"]
    pages, _ = await follow(http, messages_path("dl") + "?include_delayed=true&limit=1", reader)
    assert [m["id"] for page in pages for m in page] == ids


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=21",
        "limit=-1",
        "limit=abc",
        "limit=2.0",
        "marker=abc",
        "marker=-1",
        "marker=1.5",
        "marker=1e3",
        "marker=" + "9" * 30,
        "marker=9999999999999999999",  # 19 digits: well formed, never given out
        f"marker={UNKNOWN_ID}x",
        "limit=1_0",  # int() would read 10
        "limit=%D9%A3",  # an Arabic-Indic 3, which int() would read
        "limit=%2B5",
        "limit=%205",
        "echo=maybe",
        "include_claimed=maybe",
        "include_delayed=maybe",
    ],
)
async def test_message_list_bad_parameters_are_400(
    http: Client, headers: Headers, query: str
) -> None:
    await post_bodies(http, other_client(headers), "bp", ["x"])
    await error(await http.get(f"{messages_path('bp')}?{query}", headers=headers), 400)


def marker_of(link: dict[str, str]) -> int:
    return int(link["href"].split("marker=")[1].split("&")[0])


async def test_a_marker_past_the_last_message_is_400_and_the_last_one_is_not(
    http: Client, headers: Headers
) -> None:
    """A marker past the queue's counter was never given out: taken, it would
    hide every message posted until the counter caught up (issue 28, item 10)."""
    poster = other_client(headers)
    await post_bodies(http, poster, "ahead", ["a", "b"])
    page = await list_page(http, messages_path("ahead") + "?limit=2", headers)
    last = marker_of(page["links"][0])
    for marker in (last + 1, 9999999999999999999):
        url = f"{messages_path('ahead')}?marker={marker}"
        doc = await error(await http.get(url, headers=headers), 400)
        assert doc["title"] == "Unknown marker"
        assert str(marker) in doc["description"]
    # the last marker given out is an empty page; then what follows it
    url = f"{messages_path('ahead')}?marker={last}"
    assert await list_page(http, url, headers) == {"messages": [], "links": []}
    more = await post_bodies(http, poster, "ahead", ["c"])
    assert [m["id"] for m in (await list_page(http, url, headers))["messages"]] == more


async def test_a_queue_without_messages_refuses_a_marker_past_now(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    """With no counter yet, a first post starts it at now in microseconds: a
    marker past that is refused, one before it sees every message posted."""
    now_us = clock.now_ms() * 1000
    url = messages_path("fresh") + "?marker="
    await error(await http.get(url + str(now_us + 1), headers=headers), 400)
    assert await list_page(http, url + str(now_us), headers) == {"messages": [], "links": []}
    ids = await post_bodies(http, other_client(headers), "fresh", ["first"])
    assert [m["id"] for m in (await list_page(http, url + str(now_us), headers))["messages"]] == ids


async def test_a_marker_of_a_deleted_queue_reads_its_successor_from_the_start(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    poster = other_client(headers)
    await post_bodies(http, poster, "again", ["old"])
    page = await list_page(http, messages_path("again"), headers)
    url = f"{messages_path('again')}?marker={marker_of(page['links'][0])}"
    await no_content(await http.delete("/v2/queues/again", headers=headers))
    clock.advance(0.001)  # the old counter started at this same millisecond
    assert await list_page(http, url, headers) == {"messages": [], "links": []}
    ids = await post_bodies(http, poster, "again", ["new"])
    assert [m["id"] for m in (await list_page(http, url, headers))["messages"]] == ids


async def test_list_of_nonexistent_queue_is_empty_and_creates_nothing(
    http: Client, headers: Headers
) -> None:
    doc = await list_page(http, messages_path("ghost"), headers)
    assert doc == {"messages": [], "links": []}
    doc = await list_page(http, messages_path("ghost") + "?echo=true&limit=20", headers)
    assert doc == {"messages": [], "links": []}
    listed = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listed["queues"] == []


async def test_boolean_parameter_spellings(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "bool", ["own"])
    for raw in ("True", "true", "1", "yes", "on", "t", "y"):
        doc = await list_page(http, f"{messages_path('bool')}?echo={raw}", headers)
        assert bodies_of(doc["messages"]) == ["own"], raw
    for raw in ("False", "false", "0", "no", "off", "f", "n", ""):
        doc = await list_page(http, f"{messages_path('bool')}?echo={raw}", headers)
        assert doc["messages"] == [], raw
    for raw in ("maybe", "2", "truee"):
        await error(await http.get(f"{messages_path('bool')}?echo={raw}", headers=headers), 400)


# -- messages by id ----------------------------------------------------------------------------


async def test_get_messages_by_ids(http: Client, headers: Headers) -> None:
    a, b, c = await post_bodies(http, headers, "ids", ["A", "B", "C"])
    base = messages_path("ids")
    for url in (f"{base}?ids={a},{c}", f"{base}?ids={a}&ids={c}"):
        doc = await ok_json(await http.get(url, headers=headers))
        assert set(doc) == {"messages"}
        assert [m["id"] for m in doc["messages"]] == [a, c]
        assert bodies_of(doc["messages"]) == ["A", "C"]
        assert doc["messages"][0]["href"] == f"{base}/{a}"
    # Order as asked; unknown and malformed ids are skipped.
    url = f"{base}?ids={c},{UNKNOWN_ID},not-an-id,{b}"
    doc = await ok_json(await http.get(url, headers=headers))
    assert [m["id"] for m in doc["messages"]] == [c, b]
    # Twenty ids are allowed.
    url = f"{base}?ids={a}," + ",".join([UNKNOWN_ID] * 19)
    doc = await ok_json(await http.get(url, headers=headers))
    assert [m["id"] for m in doc["messages"]] == [a]


async def test_get_messages_by_ids_none_found_is_404(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "ids", ["A"])
    base = messages_path("ids")
    await error(await http.get(f"{base}?ids={UNKNOWN_ID},zzz", headers=headers), 404)
    await error(await http.get(f"{messages_path('ghost')}?ids={UNKNOWN_ID}", headers=headers), 404)


async def test_get_messages_by_more_than_20_ids_is_400(http: Client, headers: Headers) -> None:
    [a] = await post_bodies(http, headers, "ids", ["A"])
    base = messages_path("ids")
    await error(
        await http.get(f"{base}?ids={a}," + ",".join([UNKNOWN_ID] * 20), headers=headers), 400
    )
    many = "&".join(f"ids={i}" for i in [a] + [UNKNOWN_ID] * 20)
    await error(await http.get(f"{base}?{many}", headers=headers), 400)


async def test_get_messages_with_empty_ids_is_a_listing(http: Client, headers: Headers) -> None:
    # Zaqar treats "?ids=" as absent (a normal listing).
    await post_bodies(http, headers, "ids", ["A"])
    doc = await list_page(http, messages_path("ids") + "?ids=&echo=true", headers)
    assert bodies_of(doc["messages"]) == ["A"]


async def test_get_one_message(http: Client, headers: Headers) -> None:
    [mid] = await post(http, headers, "one", [{"body": [1, 2], "ttl": 77}])
    doc = await ok_json(await http.get(f"{messages_path('one')}/{mid}", headers=headers))
    assert doc["id"] == mid
    assert doc["href"] == f"{messages_path('one')}/{mid}"
    assert doc["ttl"] == 77
    assert doc["body"] == [1, 2]
    for bad in (UNKNOWN_ID, "not-an-id!", "00000000-0000-0000-0000-000000000000", mid.upper()):
        await error(await http.get(f"{messages_path('one')}/{bad}", headers=headers), 404)
    await error(await http.get(f"{messages_path('ghost')}/{mid}", headers=headers), 404)


async def test_handlers_take_now_from_the_apps_clock(settings: Settings, headers: Headers) -> None:
    clock = ManualClock()
    async with TestClient(TestServer(create_app(settings, clock))) as http:
        [mid] = await post(http, headers, "clocked", [{"body": 1, "ttl": 300}])
        clock.advance(120)
        one = await ok_json(await http.get(f"{messages_path('clocked')}/{mid}", headers=headers))
        page = await list_page(http, messages_path("clocked") + "?echo=true", headers)
    assert one["age"] == 120
    assert [m["age"] for m in page["messages"]] == [120]


async def test_message_ids_are_scoped_by_queue_and_project(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "home", ["secret1", "secret2"])
    assert (await http.put("/v2/queues/elsewhere", headers=headers)).status == 201
    stranger = other_project(headers)
    await post_bodies(http, stranger, "home", ["theirs"])
    for who, queue in ((headers, "elsewhere"), (stranger, "home"), (stranger, "elsewhere")):
        base = messages_path(queue)
        await error(await http.get(f"{base}/{ids[0]}", headers=who), 404)
        await error(await http.get(f"{base}?ids={','.join(ids)}", headers=who), 404)
        # Deletes through the wrong queue or project touch nothing.
        await no_content(await http.delete(f"{base}/{ids[0]}", headers=who))
        await no_content(await http.delete(f"{base}?ids={ids[1]}", headers=who))
    doc = await ok_json(
        await http.get(f"{messages_path('home')}?ids={','.join(ids)}", headers=headers)
    )
    assert bodies_of(doc["messages"]) == ["secret1", "secret2"]
    # The stranger's feed and queue list show only their own things.
    pages, _ = await follow(http, messages_path("home") + "?echo=true", stranger)
    assert [bodies_of(p) for p in pages] == [["theirs"]]
    listed = await ok_json(await http.get("/v2/queues", headers=stranger))
    assert [q["name"] for q in listed["queues"]] == ["home"]
    stats = await ok_json(await http.get("/v2/queues/home/stats", headers=headers))
    assert stats["messages"]["total"] == 2


# -- deleting messages --------------------------------------------------------------------------


async def test_delete_one_message(http: Client, headers: Headers) -> None:
    a, b = await post_bodies(http, headers, "dq", ["A", "B"])
    url = f"{messages_path('dq')}/{a}"
    await no_content(await http.delete(url, headers=headers))
    await error(await http.get(url, headers=headers), 404)
    doc = await list_page(http, messages_path("dq") + "?echo=true", headers)
    assert [m["id"] for m in doc["messages"]] == [b]
    stats = await ok_json(await http.get("/v2/queues/dq/stats", headers=headers))
    assert stats["messages"]["total"] == 1
    # Missing, malformed, or in a queue that does not exist: still 204.
    await no_content(await http.delete(url, headers=headers))
    await no_content(await http.delete(f"{messages_path('dq')}/{UNKNOWN_ID}", headers=headers))
    await no_content(await http.delete(f"{messages_path('dq')}/not-an-id!", headers=headers))
    await no_content(await http.delete(f"{messages_path('ghost')}/{b}", headers=headers))
    await ok_json(await http.get(f"{messages_path('dq')}/{b}", headers=headers))


async def test_delete_messages_by_ids(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "dm", list(range(5)))
    base = messages_path("dm")
    await no_content(
        await http.delete(f"{base}?ids={ids[0]},{ids[1]},{UNKNOWN_ID}", headers=headers)
    )
    await no_content(await http.delete(f"{base}?ids={ids[3]}&ids=not-an-id", headers=headers))
    doc = await ok_json(await http.get(f"{base}?ids={','.join(ids)}", headers=headers))
    assert [m["id"] for m in doc["messages"]] == [ids[2], ids[4]]
    doc = await list_page(http, base + "?echo=true", headers)
    assert [m["id"] for m in doc["messages"]] == [ids[2], ids[4]]
    stats = await ok_json(await http.get("/v2/queues/dm/stats", headers=headers))
    assert stats["messages"]["total"] == 2
    await no_content(await http.delete(f"{messages_path('ghost')}?ids={ids[2]}", headers=headers))


@pytest.mark.parametrize(
    "query", ["", "?ids=", "?ids=,", "?limit=1", "?ids=" + ",".join([UNKNOWN_ID] * 21)]
)
async def test_bad_bulk_delete_is_400(http: Client, headers: Headers, query: str) -> None:
    ids = await post_bodies(http, headers, "bd", ["keep"])
    await error(await http.delete(messages_path("bd") + query, headers=headers), 400)
    doc = await ok_json(await http.get(f"{messages_path('bd')}/{ids[0]}", headers=headers))
    assert doc["body"] == "keep"


# -- expiry ------------------------------------------------------------------------------------


async def test_expired_messages_are_gone_everywhere(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    short, long = await post(http, headers, "x", [{"body": "short", "ttl": 1}, {"body": "long"}])
    base = messages_path("x")
    reader = other_client(headers)
    clock.advance(0.9)
    pages, _ = await follow(http, base + "?limit=1", reader)
    assert [m["id"] for page in pages for m in page] == [short, long], "gone before its ttl"
    await ok_json(await http.get(f"{base}/{short}", headers=headers))
    clock.advance(0.2)
    pages, _ = await follow(http, base + "?limit=1", reader)
    assert [m["id"] for page in pages for m in page] == [long]
    await error(await http.get(f"{base}/{short}", headers=headers), 404)
    doc = await ok_json(await http.get(f"{base}?ids={short},{long}", headers=headers))
    assert [m["id"] for m in doc["messages"]] == [long]
    await error(await http.get(f"{base}?ids={short}", headers=headers), 404)
    stats = await ok_json(await http.get("/v2/queues/x/stats", headers=headers))
    assert (stats["messages"]["total"], stats["messages"]["free"]) == (1, 1)
    assert stats["messages"]["oldest"]["href"] == f"{base}/{long}"
    assert stats["messages"]["newest"]["href"] == f"{base}/{long}"
    await no_content(await http.delete(f"{base}/{short}", headers=headers))


# -- Redis down --------------------------------------------------------------------------------


async def test_redis_down_is_503_with_retry_after(headers: Headers, driver: str) -> None:
    settings = make_settings(
        f"redis://127.0.0.1:{closed_port()}",
        driver=driver,
        pool_timeout=0.5,
        redis_timeout=0.5,
        redis_connect_timeout=0.5,
    )
    async with TestClient(TestServer(create_app(settings))) as down:
        # A guard against a hang, not a speed requirement.
        async with asyncio.timeout(60):
            requests: list[tuple[str, str, Any]] = [
                ("POST", messages_path("q"), {"messages": [{"body": 1}]}),
                ("GET", messages_path("q"), None),
                ("GET", f"{messages_path('q')}/{UNKNOWN_ID}", None),
                ("DELETE", f"{messages_path('q')}/{UNKNOWN_ID}", None),
                ("PUT", "/v2/queues/q", None),
                ("GET", "/v2/queues", None),
                ("GET", "/v2/queues/q/stats", None),
            ]
            for method, path, body in requests:
                resp = await down.request(method, path, json=body, headers=headers)
                await error(resp, 503)
                assert int(resp.headers["Retry-After"]) >= 1, (method, path)
            resp = await down.get("/v2/health", headers=headers)
            assert resp.status == 503
            doc = await resp.json()
            assert doc["storage_reachable"] is False
            assert doc["driver"] == driver
            # What needs no Redis still works, and bad input is still a 400.
            assert (await down.get("/")).status == 300
            assert (await down.get("/v2/", headers=headers)).status == 200
            await error(await down.get("/v2/queues/a!b", headers=headers), 400)
            await error(await down.get("/v2/queues", headers={"Client-ID": "x"}), 400)
            for method in ("GET", "HEAD"):
                resp = await down.request(method, "/v2/ping", headers=headers)
                assert resp.status == 503, method
                assert int(resp.headers["Retry-After"]) >= 1
                check_request_id(resp)


async def test_an_unknown_expectation_is_ignored_and_100_continue_still_works(
    http: Client, headers: Headers
) -> None:
    """aiohttp answers an Expect other than 100-continue with a plain-text 417
    before any handler, a status no operation documents (the OpenAPI fuzz
    found it); RFC 9110 lets a server ignore it, and feedsvc does."""
    resp = await http.get("/v2", headers={**headers, "Expect": "T"})
    assert resp.status == 200, await resp.text()
    ids = await post(http, {**headers, "Expect": "100-continue"}, "exp", [{"body": 1}])
    resp = await http.post(
        messages_path("exp"), json={"messages": [{"body": 2}]}, headers={**headers, "Expect": "x"}
    )
    assert resp.status == 201, await resp.text()
    assert len(ids) == 1
