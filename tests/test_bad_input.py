"""Bad input, probed the way a newcomer did it (issue 13).

Every test runs once per storage driver. JSON-level probes go through the
in-process ``http`` client; HTTP-level ones (malformed request heads, broken
chunking and encodings, HTTP/1.0, pipelining, 2,000 idle connections) through
real sockets to an in-process server run by :class:`FeedAppRunner`, the
runner ``feedsvc serve`` uses.

Two things hold for every probe: no answer is a 5xx, and a refused request
(any 4xx) changes nothing stored: the project's queues, their metadata, stats
and messages read back the same before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict
from yarl import URL

from feedsvc.api.protocol import FeedAppRunner
from feedsvc.api.validation import MAX_JSON_DEPTH
from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import Settings

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]

PATCH_TYPE = "application/openstack-messaging-v2.0-json-patch"
UNKNOWN_ID = "0" * 24
BIG = 2**70  # 1180591620717411303424: beyond the 64 bits orjson reads as integers


# -- helpers -------------------------------------------------------------------


def nested(depth: int, inner: str = "1") -> str:
    """A JSON value with `depth` arrays around `inner` (depth 0 is `inner` itself)."""
    return "[" * depth + inner + "]" * depth


def post_document(body: str) -> bytes:
    return f'{{"messages": [{{"body": {body}, "ttl": 300}}]}}'.encode()


def member(name: str, value: str) -> str:
    """A JSON object of one member whose value is raw JSON text."""
    return f'{{"{name}": {value}}}'


def patch_add(key: str, value: str) -> bytes:
    return f'[{{"op": "add", "path": "/metadata/{key}", "value": {value}}}]'.encode()


def one_message(field: str, value: str) -> str:
    return f'{{"messages": [{{"body": 1, "{field}": {value}}}]}}'


async def answer(resp: ClientResponse) -> tuple[int, bytes]:
    return resp.status, await resp.read()


def is_zaqar_error(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return (
        isinstance(doc, dict)
        and set(doc) == {"title", "description"}
        and all(isinstance(v, str) and v for v in doc.values())
    )


async def ok_json(resp: ClientResponse, status: int = 200) -> Any:
    assert resp.status == status, (resp.method, resp.url, resp.status, await resp.text())
    # the stdlib parser, which keeps integers of any size exactly
    return json.loads(await resp.read())


async def refused(resp: ClientResponse, status: int = 400) -> str:
    """The description of a Zaqar-style JSON error with this status."""
    body = await resp.read()
    assert resp.status == status, (resp.method, resp.url, resp.status, body)
    assert resp.content_type == "application/json", body
    assert is_zaqar_error(body), body
    description: str = json.loads(body)["description"]
    return description


def without_ages(value: Any) -> Any:
    """The value without its `age` fields: they move with time, they are not stored."""
    if isinstance(value, dict):
        return {k: without_ages(v) for k, v in value.items() if k != "age"}
    if isinstance(value, list):
        return [without_ages(v) for v in value]
    return value


async def stored(http: Client, headers: Headers) -> dict[str, Any]:
    """Everything the project has stored, as the API shows it."""
    listing = await ok_json(await http.get("/v2/queues?detailed=true&limit=20", headers=headers))
    state: dict[str, Any] = {}
    for queue in listing["queues"]:
        name = queue["name"]
        base = f"/v2/queues/{name}"
        stats = await ok_json(await http.get(base + "/stats", headers=headers))
        messages: list[Any] = []
        url = base + "/messages?echo=true&include_claimed=true&include_delayed=true&limit=20"
        for _ in range(50):
            page = await ok_json(await http.get(url, headers=headers))
            if not page["messages"]:
                break
            messages += page["messages"]
            url = page["links"][0]["href"]
        state[name] = without_ages(
            {"metadata": queue["metadata"], "stats": stats, "messages": messages}
        )
    return state


@dataclass
class Seed:
    """A project with something stored: what refused requests must not change."""

    headers: Headers
    other: Headers  # another project
    ids: list[str]  # messages of queue "kept", in post order
    claim_id: str  # a live claim on ids[0]


@pytest.fixture
async def seed(http: Client, headers: Headers) -> Seed:
    resp = await http.put(
        "/v2/queues/kept", json={"k": "v", "_default_message_ttl": 600}, headers=headers
    )
    assert resp.status == 201
    assert (await http.put("/v2/queues/empty", headers=headers)).status == 201
    doc = await ok_json(
        await http.post(
            "/v2/queues/kept/messages",
            json={
                "messages": [
                    {"body": {"n": 1}},
                    {"body": [1, "two", None]},
                    {"body": "three", "ttl": 120},
                    {"body": "later", "delay": 60},
                ]
            },
            headers=headers,
        ),
        201,
    )
    ids = [href.rsplit("/", 1)[1] for href in doc["resources"]]
    resp = await http.post("/v2/queues/kept/claims?limit=1", json={"ttl": 60}, headers=headers)
    claimed = await ok_json(resp, 201)
    assert [m["id"] for m in claimed["messages"]] == ids[:1]
    claim_id = resp.headers["Location"].rsplit("/", 1)[1]
    other = {**headers, "X-Project-ID": headers["X-Project-ID"] + "-other"}
    return Seed(headers, other, ids, claim_id)


@dataclass
class Probe:
    name: str
    method: str
    path: str
    body: bytes | None = None
    content_type: str = "application/json"
    headers: Headers | None = None  # replaces the seed's headers


async def send(http: Client, seed: Seed, probe: Probe) -> tuple[int, bytes]:
    headers = dict(seed.headers if probe.headers is None else probe.headers)
    if probe.body is not None:
        headers["Content-Type"] = probe.content_type
    resp = await http.request(
        probe.method, URL(probe.path, encoded=True), data=probe.body, headers=headers
    )
    return await answer(resp)


async def run_probes(http: Client, seed: Seed, probes: list[Probe]) -> dict[str, int]:
    """Send each probe; none may be a 5xx, and a refused one changes nothing stored."""
    before = await stored(http, seed.headers)
    assert before["kept"]["messages"], before
    statuses: dict[str, int] = {}
    for probe in probes:
        status, body = await send(http, seed, probe)
        statuses[probe.name] = status
        assert status < 500, (probe, status, body)
        if status >= 400:
            assert is_zaqar_error(body), (probe, status, body)
            assert await stored(http, seed.headers) == before, probe
    return statuses


# -- 1. JSON nesting: one limit, a 4xx beyond it, never a 500 -----------------------


def test_orjson_encodes_254_levels_and_no_more() -> None:
    # MAX_JSON_DEPTH leans on this (validation.py): a change in orjson shows here
    orjson.dumps(json.loads(nested(254)))
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(json.loads(nested(255)))
    assert MAX_JSON_DEPTH == 250


async def test_message_body_at_the_depth_limit_is_kept(http: Client, headers: Headers) -> None:
    body = nested(MAX_JSON_DEPTH - 1, '{"deep": true}')  # the object is a level too
    resp = await http.post("/v2/queues/q/messages", data=post_document(body), headers=headers)
    await ok_json(resp, 201)
    page = await ok_json(await http.get("/v2/queues/q/messages?echo=true", headers=headers))
    assert [m["body"] for m in page["messages"]] == [json.loads(body)]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 254, 255, 256, 1023, 1024, 1025, 5000])
async def test_message_body_deeper_than_the_limit_is_400(
    http: Client, headers: Headers, depth: int
) -> None:
    resp = await http.post(
        "/v2/queues/q/messages", data=post_document(nested(depth)), headers=headers
    )
    description = await refused(resp)
    assert str(MAX_JSON_DEPTH) in description, description
    listing = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listing["queues"] == []


async def test_metadata_at_the_depth_limit_is_kept_and_listed(
    http: Client, headers: Headers
) -> None:
    # depth MAX_JSON_DEPTH counts the metadata object itself
    value = json.loads(nested(MAX_JSON_DEPTH - 1))
    resp = await http.put("/v2/queues/deep", json={"v": value}, headers=headers)
    assert resp.status == 201, await resp.text()
    doc = await ok_json(await http.get("/v2/queues/deep", headers=headers))
    assert doc["v"] == value
    # the detailed list shows metadata three levels further down
    listing = await ok_json(await http.get("/v2/queues?detailed=true", headers=headers))
    assert listing["queues"][0]["metadata"]["v"] == value


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 253, 254, 255, 1022, 1023, 1024, 5000])
async def test_metadata_deeper_than_the_limit_is_400(
    http: Client, headers: Headers, depth: int
) -> None:
    document = member("v", nested(depth))  # the object adds one level
    resp = await http.put("/v2/queues/deep", data=document.encode(), headers=headers)
    description = await refused(resp)
    assert str(MAX_JSON_DEPTH) in description, description
    listing = await ok_json(await http.get("/v2/queues", headers=headers))
    assert listing["queues"] == []


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, 254, 255, 1021, 1022, 5000])
async def test_patch_value_deeper_than_the_limit_is_400(
    http: Client, headers: Headers, depth: int
) -> None:
    assert (await http.put("/v2/queues/deep", json={"k": 1}, headers=headers)).status == 201
    patch = patch_add("v", nested(depth))
    headers_patch = {**headers, "Content-Type": PATCH_TYPE}
    resp = await http.patch("/v2/queues/deep", data=patch, headers=headers_patch)
    if depth < MAX_JSON_DEPTH:  # the value sits one level down in the metadata
        doc = await ok_json(resp)
        assert doc["v"] == json.loads(nested(depth))
        return
    description = await refused(resp)
    assert str(MAX_JSON_DEPTH) in description, description
    doc = await ok_json(await http.get("/v2/queues/deep", headers=headers))
    assert "v" not in doc
    assert doc["k"] == 1


# -- 2. purge with unhashable resource types --------------------------------------


@pytest.mark.parametrize("types", ["[[1]]", '[{"a": 1}]', '["messages", []]', "[1]", "[null]"])
async def test_purge_with_malformed_resource_types_is_400(
    http: Client, seed: Seed, types: str
) -> None:
    before = await stored(http, seed.headers)
    resp = await http.post(
        "/v2/queues/kept/purge",
        data=member("resource_types", types).encode(),
        headers=seed.headers,
    )
    await refused(resp)
    assert await stored(http, seed.headers) == before


# -- 3. integers beyond 64 bits ---------------------------------------------------


BIG_BODIES = [
    BIG,
    -BIG,
    2**64,  # one past orjson's largest unsigned integer
    -(2**63) - 1,  # one past its smallest signed one
    10**400,
    {"id": BIG, "ok": 2**63, "list": [1, -BIG, 1.5, "1180591620717411303424"]},
]


@pytest.mark.parametrize("body", BIG_BODIES, ids=range(len(BIG_BODIES)))
async def test_big_integers_in_bodies_come_back_exactly(
    http: Client, headers: Headers, body: Any
) -> None:
    document = json.dumps({"messages": [{"body": body}, {"body": "next"}]}).encode()
    resp = await http.post("/v2/queues/big/messages", data=document, headers=headers)
    doc = await ok_json(resp, 201)
    message_id = doc["resources"][0].rsplit("/", 1)[1]
    one = await ok_json(await http.get(f"/v2/queues/big/messages/{message_id}", headers=headers))
    assert one["body"] == body
    assert type(one["body"]) is type(body)
    page = await ok_json(await http.get("/v2/queues/big/messages?echo=true", headers=headers))
    assert [m["body"] for m in page["messages"]] == [body, "next"]
    popped = await ok_json(await http.delete("/v2/queues/big/messages?pop=1", headers=headers))
    assert [m["body"] for m in popped["messages"]] == [body]


async def test_big_integer_in_a_deep_body_is_still_held_to_the_depth_limit(
    http: Client, headers: Headers
) -> None:
    body = nested(MAX_JSON_DEPTH + 1, str(BIG))
    resp = await http.post("/v2/queues/q/messages", data=post_document(body), headers=headers)
    assert str(MAX_JSON_DEPTH) in await refused(resp)


@pytest.mark.parametrize("field", ["ttl", "delay"])
async def test_big_integer_ttl_or_delay_is_400(http: Client, headers: Headers, field: str) -> None:
    document = json.dumps({"messages": [{"body": 1, field: BIG}]}).encode()
    resp = await http.post("/v2/queues/q/messages", data=document, headers=headers)
    assert f"message {field}" in await refused(resp)


@pytest.mark.parametrize(
    "metadata", [{"v": BIG}, {"v": [1, {"w": -BIG}]}, {"_max_claim_count": BIG}], ids=range(3)
)
async def test_big_integers_in_metadata_are_400_saying_why(
    http: Client, seed: Seed, metadata: dict[str, Any]
) -> None:
    before = await stored(http, seed.headers)
    document = json.dumps(metadata).encode()
    resp = await http.put("/v2/queues/meta", data=document, headers=seed.headers)
    description = await refused(resp)
    if "v" in metadata:
        assert "64 bits" in description, description
    patch = json.dumps([{"op": "add", "path": "/metadata/v", "value": BIG}]).encode()
    resp = await http.patch(
        "/v2/queues/kept", data=patch, headers={**seed.headers, "Content-Type": PATCH_TYPE}
    )
    assert "64 bits" in await refused(resp)
    assert await stored(http, seed.headers) == before


# -- 10. queue names . and .. -------------------------------------------------------


def routes_of(queue: str, claim_id: str) -> list[tuple[str, str, bytes | None, str]]:
    """Every route that takes a queue name: (method, path, body, content type)."""
    q = f"/v2/queues/{queue}"
    body = b'{"messages": [{"body": 1}]}'
    patch = b'[{"op": "add", "path": "/metadata/x", "value": 1}]'
    return [
        ("PUT", q, None, ""),
        ("GET", q, None, ""),
        ("PATCH", q, patch, PATCH_TYPE),
        ("DELETE", q, None, ""),
        ("GET", q + "/stats", None, ""),
        ("POST", q + "/purge", None, ""),
        ("POST", q + "/messages", body, "application/json"),
        ("GET", q + "/messages", None, ""),
        ("DELETE", q + f"/messages?ids={UNKNOWN_ID}", None, ""),
        ("DELETE", q + "/messages?pop=1", None, ""),
        ("GET", q + f"/messages/{UNKNOWN_ID}", None, ""),
        ("DELETE", q + f"/messages/{UNKNOWN_ID}", None, ""),
        ("POST", q + "/claims", None, ""),
        ("GET", q + f"/claims/{claim_id}", None, ""),
        ("PATCH", q + f"/claims/{claim_id}", b'{"ttl": 60}', "application/json"),
        ("DELETE", q + f"/claims/{claim_id}", None, ""),
    ]


@pytest.mark.parametrize("name", ["%2E", "%2E%2E", ".%2E", "%2e"])
async def test_dot_queue_names_are_400_everywhere(http: Client, seed: Seed, name: str) -> None:
    before = await stored(http, seed.headers)
    for method, path, body, content_type in routes_of(name, seed.claim_id):
        headers = {**seed.headers, "Content-Type": content_type} if body else seed.headers
        resp = await http.request(method, URL(path, encoded=True), data=body, headers=headers)
        await refused(resp)
    assert await stored(http, seed.headers) == before


@pytest.mark.parametrize("name", [".", ".."])
async def test_dot_names_as_dead_letter_queue_are_400(http: Client, seed: Seed, name: str) -> None:
    before = await stored(http, seed.headers)
    resp = await http.put(
        "/v2/queues/fresh", json={"_dead_letter_queue": name}, headers=seed.headers
    )
    await refused(resp)
    patch = json.dumps([{"op": "add", "path": "/metadata/_dead_letter_queue", "value": name}])
    patch_headers = {**seed.headers, "Content-Type": PATCH_TYPE}
    resp = await http.patch("/v2/queues/kept", data=patch.encode(), headers=patch_headers)
    await refused(resp)
    assert await stored(http, seed.headers) == before


@pytest.mark.parametrize("name", ["...", ".a", "a.", "a..b", "._."])
async def test_other_dotted_names_still_work(http: Client, headers: Headers, name: str) -> None:
    resp = await http.post(
        URL(f"/v2/queues/{name}/messages", encoded=True),
        json={"messages": [{"body": name}]},
        headers=headers,
    )
    await ok_json(resp, 201)
    listing = await ok_json(await http.get("/v2/queues", headers=headers))
    assert [q["name"] for q in listing["queues"]] == [name]


async def test_a_queue_list_marker_may_still_be_a_dot(http: Client, seed: Seed) -> None:
    # a marker is a place in the sorted names, not a queue that must exist
    for marker in (".", ".."):
        listing = await ok_json(await http.get(f"/v2/queues?marker={marker}", headers=seed.headers))
        assert [q["name"] for q in listing["queues"]] == ["empty", "kept"]


# -- 13. claim errors name the claim ------------------------------------------------


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ({"ttl": 1}, "The claim ttl must be at least"),
        ({"grace": 1}, "The claim grace must be at least"),
        ({"ttl": "60"}, "The claim ttl must be an integer"),
        ({"grace": True}, "The claim grace must be an integer"),
    ],
)
async def test_claim_errors_name_the_claim(
    http: Client, seed: Seed, document: dict[str, Any], words: str
) -> None:
    resp = await http.post("/v2/queues/kept/claims", json=document, headers=seed.headers)
    assert words in await refused(resp)
    resp = await http.patch(
        f"/v2/queues/kept/claims/{seed.claim_id}", json=document, headers=seed.headers
    )
    assert words in await refused(resp)


async def test_message_errors_still_name_the_message(http: Client, headers: Headers) -> None:
    resp = await http.post(
        "/v2/queues/q/messages", json={"messages": [{"body": 1, "ttl": 0}]}, headers=headers
    )
    assert "The message ttl must be at least" in await refused(resp)


# -- the newcomer's probes, rerun ------------------------------------------------------

# Each is refused: none may change what is stored.
POST_DOCUMENTS = [
    "[]", "{}", "null", "1", '"messages"', '{"messages": {}}', '{"messages": "x"}',
    '{"messages": null}', '{"messages": []}', '{"messages": [1]}', '{"messages": [[]]}',
    '{"messages": [{"ttl": 60}]}', '{"messages": [{"body": 1, "ttl": "60"}]}',
    '{"messages": [{"body": 1, "ttl": true}]}', '{"messages": [{"body": 1, "ttl": null}]}',
    '{"messages": [{"body": 1, "ttl": [60]}]}', '{"messages": [{"body": 1, "delay": "1"}]}',
    '{"messages": [{"body": 1, "delay": {}}]}', '{"messages": [{"body": 1}, 2]}',
    '{"messages": [{"body": NaN}]}', '{"messages": [{"body": Infinity}]}',
    '{"messages": [{"body": 1,}]}', '{"messages": [{"body": 01}]}', "{'messages': []}",
    '{"messages": [{"body": 1}]} {}', '{"messages": [{"body": "\\ud800"}]}',
    # long digit runs take the exact (stdlib) path: it must refuse what orjson would
    '{"messages": [{"body": 1' + "0" * 400 + '.5}]}', '{"messages": [{"body": -' + "0" * 30 + "}]}",
    '{"messages": [{"body": NaN, "n": 11111111111111111111}]}',
    '{"messages": [{"body": "\\ud800", "n": 11111111111111111111}]}',
]  # fmt: skip
RAW_POST_DOCUMENTS = [
    b'{"messages": [{"body": "\x00"}]}',  # a raw control character in a string
    b'{"messages": [{"body": "\xff"}]}',  # not UTF-8
    b'\xef\xbb\xbf{"messages": [{"body": 1}]}',  # a byte order mark
    b'{"messages": [{"body": 1}]}\x00',
    b"\x00",
    '{"messages": [{"body": "é"}]}'.encode("utf-16"),
    b"",
    b"messages=1",
    '{"messages": [{"body": 11111111111111111111}]}'.encode("utf-16"),
    b'\xef\xbb\xbf{"messages": [{"body": 11111111111111111111}]}',
]
CLAIM_DOCUMENTS = [
    "[]", '"x"', "1", '{"ttl": "60"}', '{"ttl": []}', '{"grace": {}}', '{"ttl": null}',
    '{"ttl": 60.5}', '{"ttl": 6e1}',
]  # fmt: skip
PURGE_DOCUMENTS = [
    '{"resource_types": "messages"}', '{"resource_types": [[1]]}',
    '{"resource_types": [{"a": 1}]}', '{"resource_types": [1]}', '{"resource_types": [null]}',
    '{"resource_types": []}', '{"resource_types": ["queues"]}', "[]", "{}", '"messages"',
]  # fmt: skip
METADATA_DOCUMENTS = [
    "[]", '"x"', "1", "null", '{"_default_message_ttl": "60"}', '{"_default_message_ttl": 1e400}',
    '{"_dead_letter_queue": 5}', '{"_dead_letter_queue": "."}', '{"_dead_letter_queue": ".."}',
    '{"_dead_letter_queue": "a b"}', '{"_max_claim_count": 0}', f'{{"_max_claim_count": {BIG}}}',
    f'{{"v": {BIG}}}', f'{{"v": [{-BIG}]}}', '{"_default_message_delay": -1}',
    '{"_max_messages_post_size": 0}',
]  # fmt: skip
PATCH_DOCUMENTS = [
    '{"op": "add"}', "[1]", '[{"op": "move", "path": "/metadata/k"}]',
    '[{"op": "add", "path": "/metadata/x"}]', '[{"op": "add", "path": 5, "value": 1}]',
    '[{"op": "add", "path": "/metadata/", "value": 1}]',
    '[{"op": "remove", "path": "/metadata/missing"}]',
    '[{"op": "add", "path": "/other/x", "value": 1}]',
    '[{"op": "add", "path": "/metadata/_default_message_ttl", "value": 0}]',
    f'[{{"op": "replace", "path": "/metadata/k", "value": {BIG}}}]',
    '[{"op": "replace", "path": "/metadata/k", "value": 1e400}]', "",
]  # fmt: skip
NUMBERS = [
    "-1", "0", "-60", "1e400", "-1e400", "60.0", "60.5", "6e1", "-6e1", str(2**63),
    str(2**64), str(BIG), str(-BIG), "1" * 400, "true", '"60"',
]  # fmt: skip
LIMITS = [
    "-1", "0", "21", "1e3", "abc", "1.0", "99999999999999999999999", "%00", "%C2%B2",
    "1_0", "%D9%A3", "%2B5", "%205", "5%20",  # int() reads these: 10, 3, 5, 5, 5
]  # fmt: skip
# float() reads all but the last three
WAITS = ["1_0", "%D9%A3", "%2B1", "%201", "-0", "1e400", "nan", "0x1", "21"]
MESSAGE_MARKERS = [
    "abc", "-1", "1.5", "1e3", "99999999999999999999", "%00", "%C3%BF", "0x10", "%20",
    "1%2C2", "%C2%B2", "%D9%A1%D9%A2", "%EF%BC%91",  # superscript two, Arabic-Indic, fullwidth
    "9999999999999999999",  # well formed, but past the queue's last message
]  # fmt: skip
QUEUE_MARKERS = ["a%20b", "x" * 65, "%00", "caf%C3%A9", "a%2Fb"]
BAD_NAMES = ["caf%C3%A9", "%00", "a%00b", "%E2%80%AE", "%F0%9F%98%80", "a%20b", "a%2Fb", "x" * 65]


def json_probes(seed: Seed, settings: Settings) -> list[Probe]:
    """Probes through the test client, each of them a request to refuse."""
    q = "/v2/queues/kept"
    m = q + "/messages"
    claim = f"{q}/claims/{seed.claim_id}"
    probes: list[Probe] = []

    def add(name: str, method: str, path: str, body: str | bytes | None = None, **kw: Any) -> None:
        raw = body.encode() if isinstance(body, str) else body
        probes.append(Probe(name, method, path, raw, **kw))

    # nesting
    for depth in (MAX_JSON_DEPTH + 1, 255, 1023, 1024, 1025, 20000):
        deep = nested(depth)
        add(f"body nested {depth}", "POST", m, post_document(deep))
        add(f"metadata nested {depth}", "PUT", q, member("v", deep))
        add(f"new queue metadata nested {depth}", "PUT", "/v2/queues/new", member("v", deep))
        patch = patch_add("v", deep)
        add(f"patch nested {depth}", "PATCH", q, patch, content_type=PATCH_TYPE)
        add(f"claim nested {depth}", "POST", q + "/claims", deep)
        add(f"purge nested {depth}", "POST", q + "/purge", member("resource_types", deep))
    add("object nested 1000", "POST", m, '{"a":' * 1000 + "1" + "}" * 1000)
    # wrong types, malformed JSON
    for document in POST_DOCUMENTS:
        add(f"post {document}", "POST", m, document)
    for raw in RAW_POST_DOCUMENTS:
        add(f"post {raw[:40]!r}", "POST", m, raw)
    for document in CLAIM_DOCUMENTS:
        add(f"claim {document}", "POST", q + "/claims", document)
        add(f"renew {document}", "PATCH", claim, document)
    for document in PURGE_DOCUMENTS:
        add(f"purge {document}", "POST", q + "/purge", document)
    for document in METADATA_DOCUMENTS:
        add(f"metadata {document}", "PUT", "/v2/queues/new", document)
    for document in PATCH_DOCUMENTS:
        add(f"patch {document}", "PATCH", q, document, content_type=PATCH_TYPE)
    add("patch as json", "PATCH", q, '[{"op": "add", "path": "/metadata/x", "value": 1}]')
    # huge, negative and float numbers
    for number in NUMBERS:
        add(f"ttl {number}", "POST", m, one_message("ttl", number))
        if number != "0":
            add(f"delay {number}", "POST", m, one_message("delay", number))
        add(f"claim ttl {number}", "POST", q + "/claims", member("ttl", number))
        add(f"claim grace {number}", "POST", q + "/claims", member("grace", number))
        add(f"renew ttl {number}", "PATCH", claim, member("ttl", number))
    add(
        "ttl over the maximum",
        "POST",
        m,
        post_document("1").replace(b"300", b"%d" % (settings.max_message_ttl + 1)),
    )
    for limit in LIMITS:
        add(f"list limit={limit}", "GET", f"{m}?limit={limit}")
        add(f"queues limit={limit}", "GET", f"/v2/queues?limit={limit}")
        add(f"claim limit={limit}", "POST", f"{q}/claims?limit={limit}")
        add(f"pop={limit}", "DELETE", f"{m}?pop={limit}")
    for wait in WAITS:
        add(f"list wait={wait}", "GET", f"{m}?wait={wait}")
        add(f"claim wait={wait}", "POST", f"{q}/claims?wait={wait}")
    add("pop and ids", "DELETE", f"{m}?pop=1&ids={seed.ids[1]}")
    add("too many ids", "DELETE", f"{m}?ids=" + ",".join([UNKNOWN_ID] * 21))
    add("empty ids", "DELETE", f"{m}?ids=,")
    add("neither ids nor pop", "DELETE", m)
    # garbage markers and flags
    for marker in MESSAGE_MARKERS:
        add(f"marker {marker}", "GET", f"{m}?marker={marker}")
    for marker in QUEUE_MARKERS:
        add(f"queue marker {marker}", "GET", f"/v2/queues?marker={marker}")
    for flag in ("echo", "include_claimed", "include_delayed"):
        add(f"flag {flag}", "GET", f"{m}?{flag}=perhaps")
    for flag in ("detailed", "with_count"):
        add(f"flag {flag}", "GET", f"/v2/queues?{flag}=perhaps")
    # unicode and NUL bytes where they do not belong
    for name in BAD_NAMES:
        add(f"queue name {name}", "PUT", f"/v2/queues/{name}")
        add(f"post to queue {name}", "POST", f"/v2/queues/{name}/messages", post_document("1"))
    for project in ("", "x" * 257):
        add(f"project {project[:8]!r}", "GET", m, headers={**seed.headers, "X-Project-ID": project})
    for client in ("", "nope", "1234", "00000000-0000-0000-0000-00000000000g"):
        add(f"client {client!r}", "GET", m, headers={**seed.headers, "Client-ID": client})
    add("no headers", "POST", m, post_document("1"), headers={})
    long_key = {**seed.headers, "Idempotency-Key": "k" * 256}
    add("idempotency key too long", "POST", m, post_document("1"), headers=long_key)
    # sizes
    size = settings.max_messages_post_size
    over = b'{"messages": [{"body": "%s"}]}' % (b"x" * size)
    add("body over the limit", "POST", m, over)
    add("metadata over the limit", "PUT", "/v2/queues/new", over)
    add("metadata over 64k", "PUT", "/v2/queues/new", b'{"v": "%s"}' % (b"x" * 70000))
    too_many = {"messages": [{"body": 1}] * (settings.max_messages_per_post + 1)}
    add("too many messages", "POST", m, json.dumps(too_many))
    # routes and methods that do not exist
    add("unknown route", "GET", q + "/nope")
    add("wrong method", "PUT", m, "{}")
    return probes


@pytest.mark.slow
async def test_json_probes_are_refused_and_change_nothing(
    http: Client, seed: Seed, settings: Settings
) -> None:
    statuses = await run_probes(http, seed, json_probes(seed, settings))
    accepted = {name: status for name, status in statuses.items() if status < 400}
    assert accepted == {}


def subscription_probes() -> list[Probe]:
    """Subscriptions and retry policies that once were a 500 (issue 28, item 6)."""
    q = "/v2/queues/kept"
    subs = q + "/subscriptions"
    probes = [
        Probe("subscriber [::1", "POST", subs, b'{"subscriber": "http://[::1/"}'),
        Probe("subscriber port 99999", "POST", subs, b'{"subscriber": "http://e.com:99999/"}'),
    ]
    for key in ("minimum_delay", "maximum_delay", "retries_with_no_delay"):
        policy = b'{"_retry_policy": {"%s": null}}' % key.encode()
        body = b'{"subscriber": "http://e.com/", "options": %s}' % policy
        probes.append(Probe(f"subscription {key} null", "POST", subs, body))
        probes.append(Probe(f"queue {key} null", "PUT", q, policy))
        probes.append(Probe(f"new queue {key} null", "PUT", "/v2/queues/new", policy))
        patch = b'[{"op": "add", "path": "/metadata/_retry_policy", "value": {"%s": null}}]'
        probes.append(
            Probe(f"patch {key} null", "PATCH", q, patch % key.encode(), content_type=PATCH_TYPE)
        )
    return probes


async def test_subscription_probes_are_400_and_change_nothing(http: Client, seed: Seed) -> None:
    subs = "/v2/queues/kept/subscriptions"
    statuses = await run_probes(http, seed, subscription_probes())
    assert statuses == dict.fromkeys(statuses, 400)
    listed = await ok_json(await http.get(subs, headers=seed.headers))
    assert listed["subscriptions"] == []


async def test_cross_project_access_changes_nothing(http: Client, seed: Seed) -> None:
    q = "/v2/queues/kept"
    m = q + "/messages"
    ids = ",".join(seed.ids)
    claim = f"{q}/claims/{seed.claim_id}"
    claimed = f"{m}/{seed.ids[0]}?claim_id={seed.claim_id}"
    patch = b'[{"op": "add", "path": "/metadata/k", "value": 2}]'
    probes = [
        # (probe, the status another project gets)
        (Probe("get message", "GET", f"{m}/{seed.ids[1]}"), 404),
        (Probe("get messages by id", "GET", f"{m}?ids={ids}"), 404),
        (Probe("delete message", "DELETE", f"{m}/{seed.ids[1]}"), 204),
        (Probe("delete claimed message", "DELETE", claimed), 204),
        (Probe("delete messages by id", "DELETE", f"{m}?ids={ids}"), 204),
        (Probe("pop", "DELETE", f"{m}?pop=5"), 200),
        (Probe("get claim", "GET", claim), 404),
        (Probe("renew claim", "PATCH", claim, b'{"ttl": 600}'), 404),
        (Probe("release claim", "DELETE", claim), 204),
        (Probe("claim", "POST", q + "/claims", b"{}"), 204),
        (Probe("list", "GET", m + "?echo=true&include_claimed=true"), 200),
        (Probe("stats", "GET", q + "/stats"), 200),
        (Probe("metadata", "GET", q), 200),
        (Probe("patch", "PATCH", q, patch, PATCH_TYPE), 404),
        (Probe("purge", "POST", q + "/purge"), 204),
        (Probe("delete queue", "DELETE", q), 204),
        (Probe("create queue", "PUT", q, b'{"k": "other"}'), 201),
        (Probe("post", "POST", m, b'{"messages": [{"body": "theirs"}]}'), 201),
    ]
    before = await stored(http, seed.headers)
    for probe, expected in probes:
        probe.headers = seed.other
        status, body = await send(http, seed, probe)
        assert status == expected, (probe, status, body)
        if probe.name in ("pop", "list"):
            assert json.loads(body)["messages"] == [], body
        assert await stored(http, seed.headers) == before, probe
    theirs = await stored(http, seed.other)
    assert [m["body"] for m in theirs["kept"]["messages"]] == ["theirs"]
    assert theirs["kept"]["metadata"]["k"] == "other"


async def test_odd_bodies_that_are_json_come_back_as_posted(http: Client, headers: Headers) -> None:
    bodies: list[Any] = [
        "a\x00b", {"\x00": "\x00"}, "é😀\u202e", "\ufeff", "\\u0000", -0.0, 1e308, 5e-324,
        2**63, 2**64 - 1, -(2**63), [], {}, None, "", "x" * 1000, {"a": {"b": {"c": []}}},
    ]  # fmt: skip
    document = json.dumps({"messages": [{"body": b} for b in bodies]}, ensure_ascii=False)
    resp = await http.post("/v2/queues/odd/messages", data=document.encode(), headers=headers)
    await ok_json(resp, 201)
    page = await ok_json(
        await http.get("/v2/queues/odd/messages?echo=true&limit=20", headers=headers)
    )
    got = [m["body"] for m in page["messages"]]
    assert got == bodies
    assert [type(b) for b in got] == [type(b) for b in bodies]


async def test_body_at_the_size_limit_is_accepted_and_one_byte_more_is_400(
    http: Client, seed: Seed, settings: Settings
) -> None:
    size = settings.max_messages_post_size
    frame = b'{"messages": [{"body": ""}]}'
    at = b'{"messages": [{"body": "%s"}]}' % (b"x" * (size - len(frame)))
    over = at[:-4] + b'x"}]}'
    assert (len(at), len(over)) == (size, size + 1)
    before = await stored(http, seed.headers)
    resp = await http.post("/v2/queues/kept/messages", data=over, headers=seed.headers)
    await refused(resp, 400)
    assert await stored(http, seed.headers) == before
    resp = await http.post("/v2/queues/kept/messages", data=at, headers=seed.headers)
    await ok_json(resp, 201)
    after = await stored(http, seed.headers)
    total = before["kept"]["stats"]["messages"]["total"]
    assert after["kept"]["stats"]["messages"]["total"] == total + 1


# -- HTTP-level probes, through real sockets ------------------------------------------


@dataclass
class RawResponse:
    status: int
    headers: CIMultiDict[str]
    body: bytes


async def read_response(reader: asyncio.StreamReader) -> RawResponse:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    status = int(status_line.split(" ")[1])
    if 100 <= status < 200:  # e.g. 100 Continue: the answer follows
        return await read_response(reader)
    if "Content-Length" in headers:
        body = await reader.readexactly(int(headers["Content-Length"]))
    elif status in (204, 304):
        body = b""
    else:
        body = await reader.read()
    return RawResponse(status, headers, body)


@dataclass
class Served:
    """feedsvc served in this process on a real port, by the runner `feedsvc serve` uses."""

    port: int

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            yield reader, writer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def exchange(self, *parts: bytes, responses: int = 1) -> list[RawResponse]:
        """Send parts (yielding between them, so they may arrive apart); read answers."""
        async with asyncio.timeout(30), self.connect() as (reader, writer):
            for part in parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0)
            return [await read_response(reader) for _ in range(responses)]


@pytest.fixture
async def served(settings: Settings, clock: ManualClock) -> AsyncIterator[Served]:
    # a body that stops arriving is a 408 after --client-timeout: keep that short
    app = create_app(settings.replace(client_timeout=0.5), clock)
    runner = FeedAppRunner(app, handle_signals=False, lingering_time=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
    await site.start()
    try:
        yield Served(int(runner.addresses[0][1]))
    finally:
        await runner.cleanup()


def head(method: str, path: str, seed: Seed, *extra: str, version: str = "1.1") -> bytes:
    lines = [
        f"{method} {path} HTTP/{version}",
        "Host: feedsvc",
        f"Client-ID: {seed.headers['Client-ID']}",
        f"X-Project-ID: {seed.headers['X-Project-ID']}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def with_header(request: bytes, line: str) -> bytes:
    """The request with one more header line."""
    head_end = request.index(b"\r\n\r\n")
    return request[:head_end] + b"\r\n" + line.encode() + request[head_end:]


def http_probes(seed: Seed) -> list[tuple[str, tuple[bytes, ...]]]:
    """(name, the bytes to send, in parts): requests aiohttp or feedsvc must refuse."""
    m = "/v2/queues/kept/messages"
    get = head("GET", m, seed)
    chunked = head("POST", m, seed, "Transfer-Encoding: chunked")
    body = b'{"messages": [{"body": 1}]}'
    sized = head("POST", m, seed, f"Content-Length: {len(body)}")
    bomb = gzip.compress(b"0" * 20_000_000)
    nul_project = get.replace(b"X-Project-ID: ", b"X-Project-ID: \x00")
    # (the line end lets aiohttp's pure-Python parser judge it too, not wait for more)
    tls_hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n"
    return [
        ("header over 8190 bytes", (with_header(get, "X-Big: " + "a" * 9000),)),
        ("request line over 8190 bytes", (head("GET", m + "?x=" + "a" * 9000, seed),)),
        ("200 headers", (head("GET", m, seed, *[f"X-{i}: {i}" for i in range(200)]),)),
        ("NUL in a header", (with_header(get, "X-Nul: a\x00b"),)),
        ("NUL in the project", (nul_project,)),
        ("tab in the project", (get.replace(b"X-Project-ID: ", b"X-Project-ID: a\tb"),)),
        ("DEL in the project", (get.replace(b"X-Project-ID: ", b"X-Project-ID: a\x7fb"),)),
        # a read may leave Client-ID out (an EventSource cannot send it); a write may not
        ("no Client-ID on a write", (sized.replace(b"Client-ID: ", b"X-Client-ID: ") + body,)),
        ("header without a colon", (with_header(get, "Nonsense"),)),
        ("space before a colon", (with_header(get, "X-Bad : 1"),)),
        ("unknown method", (head("FOO", m, seed),)),
        ("method with a bad character", (head("G@T", m, seed),)),
        ("TLS hello", (tls_hello,)),
        ("HTTP/0.9", (f"GET {m}\r\n\r\n".encode(),)),
        ("HTTP/1.x", (head("GET", m, seed, version="1.x"),)),
        ("bad chunk size", (chunked + b"zz\r\n",)),
        ("bad chunk size, late", (chunked, b"zz\r\n")),
        ("chunk longer than said", (chunked + b"5\r\nabcdefgh\r\n0\r\n\r\n",)),
        ("negative chunk size", (chunked + b"-5\r\nabcde\r\n0\r\n\r\n",)),
        ("chunked and a length", (with_header(chunked, "Content-Length: 5") + b"0\r\n\r\n",)),
        ("two lengths", (with_header(sized, "Content-Length: 3") + body,)),
        ("negative length", (sized.replace(b"Length: ", b"Length: -") + body,)),
        ("length not a number", (sized.replace(b"Length: ", b"Length: x") + body,)),
        ("unknown coding", (chunked.replace(b"chunked", b"bogus, chunked") + b"0\r\n\r\n",)),
        ("body that stops", (sized + body[:10],)),
        ("gzip that is not", (with_header(sized, "Content-Encoding: gzip") + body,)),
        ("brotli that is not", (with_header(sized, "Content-Encoding: br") + body,)),
        ("deflate that is not", (with_header(sized, "Content-Encoding: deflate") + body,)),
        (
            "gzip bomb",
            (
                head("POST", m, seed, "Content-Encoding: gzip", f"Content-Length: {len(bomb)}")
                + bomb,
            ),
        ),
    ]


@pytest.mark.slow
async def test_http_level_errors_are_json_and_logged_as_client_errors(
    http: Client, seed: Seed, served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    before = await stored(http, seed.headers)
    for name, parts in http_probes(seed):
        caplog.clear()
        [resp] = await served.exchange(*parts)
        assert 400 <= resp.status < 500, (name, resp)
        assert resp.headers.get("Content-Type", "").startswith("application/json"), (name, resp)
        assert is_zaqar_error(resp.body), (name, resp)
        assert resp.headers.get("X-Openstack-Request-Id", "").startswith("req-"), (name, resp)
        loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        assert not loud, (name, [(r.name, r.levelname, r.getMessage()) for r in loud])
        assert await stored(http, seed.headers) == before, name


async def test_http_1_0_and_keep_alive(http: Client, seed: Seed, served: Served) -> None:
    m = "/v2/queues/kept/messages"
    body = b'{"messages": [{"body": "one-oh"}]}'
    length = f"Content-Length: {len(body)}"
    [resp] = await served.exchange(head("POST", m, seed, length, version="1.0") + body)
    assert resp.status == 201, resp
    assert resp.headers.get("Connection", "close").lower() == "close"
    stats = head("GET", "/v2/queues/kept/stats", seed, "Connection: keep-alive", version="1.0")
    resp, again = await served.exchange(stats, stats, responses=2)
    assert (resp.status, again.status) == (200, 200), (resp, again)
    after = await stored(http, seed.headers)
    assert [m["body"] for m in after["kept"]["messages"]][-1] == "one-oh"


async def test_pipelined_requests_are_answered_in_order(
    http: Client, seed: Seed, served: Served
) -> None:
    m = "/v2/queues/kept/messages"

    def post(body: bytes) -> bytes:
        return head("POST", m, seed, f"Content-Length: {len(body)}") + body

    requests = [
        post(b'{"messages": [{"body": "piped-1"}]}'),
        head("GET", "/v2/queues/kept/stats", seed),
        post(b'{"messages": [{"body": 1'),  # not JSON
        post(b'{"messages": [{"body": "piped-2"}]}'),
        head("GET", "/v2/queues/kept/nope", seed),
        head("GET", m + "?echo=true&limit=20", seed),
    ]
    responses = await served.exchange(b"".join(requests), responses=len(requests))
    assert [r.status for r in responses] == [201, 200, 400, 201, 404, 200]
    listed = [m["body"] for m in json.loads(responses[-1].body)["messages"]]
    assert listed[-2:] == ["piped-1", "piped-2"]
    # A malformed head ends the connection with a 400. (aiohttp drops the
    # requests it read in the same packet before it, unanswered and not run.)
    bad = head("GET", m, seed, "X-Big: " + "a" * 9000)
    async with served.connect() as (reader, writer):
        writer.write(requests[1])
        assert (await read_response(reader)).status == 200
        writer.write(bad + requests[0])
        resp = await read_response(reader)
        assert resp.status == 400, resp
        assert is_zaqar_error(resp.body), resp
        assert await reader.read() == b""
    after = await stored(http, seed.headers)
    assert [m["body"] for m in after["kept"]["messages"]].count("piped-1") == 1


async def test_chunked_posts(http: Client, seed: Seed, served: Served) -> None:
    m = "/v2/queues/kept/messages"
    post = head("POST", m, seed, "Transfer-Encoding: chunked")
    document = b'{"messages": [{"body": "chunked"}]}'
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (document[:5], document[5:]))
    [resp] = await served.exchange(post, chunks + b"0\r\n\r\n")
    assert resp.status == 201, resp
    [resp] = await served.exchange(post + chunks + b"0\r\nX-Trailer: yes\r\n\r\n")
    assert resp.status == 201, resp
    after = await stored(http, seed.headers)
    assert [m["body"] for m in after["kept"]["messages"]][-2:] == ["chunked", "chunked"]


@pytest.mark.slow
async def test_2000_idle_connections(http: Client, seed: Seed, served: Served) -> None:
    connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(20):
            connections += await asyncio.gather(
                *(asyncio.open_connection("127.0.0.1", served.port) for _ in range(100))
            )
        stats = head("GET", "/v2/queues/kept/stats", seed)
        [resp] = await served.exchange(stats)
        assert resp.status == 200, resp
        # every idle connection still answers
        for reader, writer in connections[::50]:
            writer.write(stats)
            assert (await read_response(reader)).status == 200
    finally:
        for _, writer in connections:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for _, w in connections), return_exceptions=True)
    assert (await stored(http, seed.headers))["kept"]["messages"]
