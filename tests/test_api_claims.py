"""HTTP tests of the Zaqar v2 surface around claims, through aiohttp's test client.

Claims, deleting under claims, pop, delay, queue metadata PATCH and the
reserved settings it honours, dead-lettering, stats with claims, purge and
the JSON-home entries for them. Every test runs once per storage driver (the
``http`` fixture is parametrised over "lua" and "watch") in a project of its
own. Expected behaviour is the product contract (DESIGN.md) and, where it is
silent, real Zaqar's wire behaviour.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import STORAGE_LAYOUTS, Settings
from tests.conftest import both_layouts, make_settings
from tests.test_api import (
    RESERVED_DEFAULTS,
    UNKNOWN_ID,
    Client,
    Headers,
    bodies_of,
    check_request_id,
    error,
    follow,
    list_page,
    messages_path,
    no_content,
    ok_json,
    other_client,
    other_project,
    post,
    post_bodies,
)

JSON_PATCH = "application/openstack-messaging-v2.0-json-patch"
MESSAGE_KEYS = {"id", "href", "ttl", "age", "body"}
# a claimed message also says how often it was claimed (a feedsvc extension)
CLAIMED_KEYS = MESSAGE_KEYS | {"claim_count"}
MAX_CLAIM_TTL = 43200
MAX_CLAIM_LIMIT = 20

# -- helpers -------------------------------------------------------------------------------


@pytest.fixture(params=STORAGE_LAYOUTS)
def storage_layout(request: pytest.FixtureRequest, driver: str) -> str:
    """Both layouts new messages are written in (the segments on the drivers that write them)."""
    return both_layouts(request, driver)


def claims_path(queue: str) -> str:
    return f"/v2/queues/{queue}/claims"


def ids_of(items: list[dict[str, Any]]) -> list[str]:
    return [m["id"] for m in items]


async def claim(
    http: Client,
    headers: Headers,
    queue: str,
    *,
    limit: int | None = None,
    body: Any = None,
) -> tuple[str, list[dict[str, Any]]]:
    """POST a claim that must succeed; (claim id, claimed messages)."""
    url = claims_path(queue) + ("" if limit is None else f"?limit={limit}")
    payload = {"ttl": 60, "grace": 60} if body is None else body
    resp = await http.post(url, json=payload, headers=headers)
    doc = await ok_json(resp, 201)
    assert set(doc) == {"messages"}, doc
    prefix = claims_path(queue) + "/"
    location = resp.headers["Location"]
    assert location.startswith(prefix), location
    claim_id = location[len(prefix) :]
    assert claim_id
    assert "/" not in claim_id
    assert "?" not in claim_id
    messages: list[dict[str, Any]] = doc["messages"]
    assert messages
    for m in messages:
        assert set(m) == CLAIMED_KEYS, m
        assert m["href"] == f"{messages_path(queue)}/{m['id']}?claim_id={claim_id}", m
    return claim_id, messages


async def nothing_claimable(http: Client, headers: Headers, queue: str, query: str = "") -> None:
    resp = await http.post(claims_path(queue) + query, json={"ttl": 60}, headers=headers)
    await no_content(resp)
    assert "Location" not in resp.headers


async def get_claim(http: Client, headers: Headers, queue: str, claim_id: str) -> Any:
    doc = await ok_json(await http.get(f"{claims_path(queue)}/{claim_id}", headers=headers))
    assert set(doc) == {"age", "ttl", "messages", "href"}, doc
    assert doc["href"] == f"{claims_path(queue)}/{claim_id}"
    return doc


async def stats(http: Client, headers: Headers, queue: str) -> tuple[int, int, int]:
    """(claimed, free, total) of a queue."""
    doc = await ok_json(await http.get(f"/v2/queues/{queue}/stats", headers=headers))
    counts = doc["messages"]
    return counts["claimed"], counts["free"], counts["total"]


async def queue_names(http: Client, headers: Headers) -> list[str]:
    doc = await ok_json(await http.get("/v2/queues", headers=headers))
    return [q["name"] for q in doc["queues"]]


async def listed_ids(http: Client, headers: Headers, queue: str, query: str = "") -> list[str]:
    """Every message a reader sees by following the listing from the start."""
    url = messages_path(queue) + "?limit=20" + query
    pages, _ = await follow(http, url, headers)
    return [m["id"] for page in pages for m in page]


async def listed_messages(
    http: Client, headers: Headers, queue: str, query: str = ""
) -> list[dict[str, Any]]:
    url = messages_path(queue) + "?limit=20" + query
    pages, _ = await follow(http, url, headers)
    return [m for page in pages for m in page]


async def patch_queue(
    http: Client, headers: Headers, queue: str, ops: Any, content_type: str = JSON_PATCH
) -> ClientResponse:
    data = ops if isinstance(ops, bytes) else json.dumps(ops).encode()
    return await http.patch(
        f"/v2/queues/{queue}", data=data, headers={**headers, "Content-Type": content_type}
    )


async def queue_doc(http: Client, headers: Headers, queue: str) -> Any:
    return await ok_json(await http.get(f"/v2/queues/{queue}", headers=headers))


def with_defaults(metadata: dict[str, Any]) -> dict[str, Any]:
    return RESERVED_DEFAULTS | metadata


def check_metadata(doc: dict[str, Any], expected: dict[str, Any]) -> None:
    """doc is expected plus the reserved defaults (and possibly other reserved keys)."""
    want = with_defaults(expected)
    assert {k: doc.get(k, "<missing>") for k in want} == want, doc
    assert all(k.startswith("_") for k in set(doc) - set(want)), doc


# -- claims --------------------------------------------------------------------------------


async def test_claim_returns_location_and_claimed_hrefs(http: Client, headers: Headers) -> None:
    # Own messages are claimable: echo does not apply to claims.
    ids = await post(http, headers, "c", [{"body": "c1", "ttl": 300}, {"body": "c2"}, {"body": 3}])
    claim_id, messages = await claim(http, headers, "c", limit=2)
    assert ids_of(messages) == ids[:2]
    assert bodies_of(messages) == ["c1", "c2"]
    assert all(isinstance(m["age"], int) and m["age"] >= 0 for m in messages)
    # ttl 300 < claim 60 + grace 60 would not extend it; 3600 neither.
    assert [m["ttl"] for m in messages] == [300, 3600]
    # Reading a claimed message by id shows its claim in the href.
    one = await ok_json(await http.get(f"{messages_path('c')}/{ids[0]}", headers=headers))
    assert one["href"] == f"{messages_path('c')}/{ids[0]}?claim_id={claim_id}"
    doc = await ok_json(
        await http.get(f"{messages_path('c')}?ids={','.join(ids)}", headers=headers)
    )
    hrefs = [m["href"] for m in doc["messages"]]
    assert hrefs[:2] == [m["href"] for m in messages]
    assert hrefs[2] == f"{messages_path('c')}/{ids[2]}"


async def test_claim_of_empty_or_missing_queue_is_204(http: Client, headers: Headers) -> None:
    await nothing_claimable(http, headers, "ghost")
    assert await queue_names(http, headers) == []
    assert (await http.put("/v2/queues/empty", headers=headers)).status == 201
    await nothing_claimable(http, headers, "empty")
    await nothing_claimable(http, headers, "empty", "?limit=20")


async def test_claim_when_all_claimed_is_204(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "all", ["a", "b"])
    _, messages = await claim(http, headers, "all")
    assert bodies_of(messages) == ["a", "b"]
    await nothing_claimable(http, headers, "all")


async def test_claim_defaults(http: Client, headers: Headers) -> None:
    await post(http, headers, "d", [{"body": i, "ttl": 60} for i in range(12)])
    # No body: ttl 300, grace 60; no limit: 10 messages.
    resp = await http.post(claims_path("d"), headers=headers)
    doc = await ok_json(resp, 201)
    assert bodies_of(doc["messages"]) == list(range(10))
    claim_id = resp.headers["Location"].rsplit("/", 1)[1]
    got = await get_claim(http, headers, "d", claim_id)
    assert got["ttl"] == 300
    # The messages now live at least until claim expiry + grace (300 + 60).
    for m in doc["messages"] + got["messages"]:
        assert 360 <= m["ttl"] <= 361, m
    # {} and a partial body take the defaults for what is missing.
    resp = await http.post(claims_path("d") + "?limit=1", json={}, headers=headers)
    doc = await ok_json(resp, 201)
    assert bodies_of(doc["messages"]) == [10]
    assert 360 <= doc["messages"][0]["ttl"] <= 361
    resp = await http.post(claims_path("d") + "?limit=1", json={"ttl": 100}, headers=headers)
    doc = await ok_json(resp, 201)
    assert bodies_of(doc["messages"]) == [11]
    assert 160 <= doc["messages"][0]["ttl"] <= 161
    got = await get_claim(http, headers, "d", resp.headers["Location"].rsplit("/", 1)[1])
    assert got["ttl"] == 100


@pytest.mark.parametrize(
    ("query", "body"),
    [
        ("", {"ttl": 59}),
        ("", {"ttl": MAX_CLAIM_TTL + 1}),
        ("", {"ttl": 0}),
        ("", {"ttl": -60}),
        ("", {"grace": 59}),
        ("", {"grace": MAX_CLAIM_TTL + 1}),
        ("", {"ttl": "x"}),
        ("", {"ttl": "120"}),
        ("", {"ttl": 120.5}),
        ("", {"ttl": True}),
        ("", {"grace": None}),
        ("", b"{"),
        ("", b"[1]"),
        ("", b'"ttl"'),
        ("?limit=0", None),
        ("?limit=21", None),
        ("?limit=-1", None),
        ("?limit=abc", None),
        ("?limit=1.5", None),
    ],
    ids=lambda p: p if isinstance(p, str) else repr(p),
)
async def test_bad_claim_is_400(http: Client, headers: Headers, query: str, body: Any) -> None:
    await post_bodies(http, headers, "bad", ["x", "y"])
    if isinstance(body, bytes):
        data = body
    else:
        data = json.dumps({"ttl": 60} if body is None else body).encode()
    resp = await http.post(
        claims_path("bad") + query,
        data=data,
        headers={**headers, "Content-Type": "application/json"},
    )
    await error(resp, 400)
    assert await stats(http, headers, "bad") == (0, 2, 2)


async def test_claim_bounds_are_inclusive(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "b", list(range(25)))
    _, low = await claim(http, headers, "b", limit=1, body={"ttl": 60, "grace": 60})
    assert len(low) == 1
    body = {"ttl": MAX_CLAIM_TTL, "grace": MAX_CLAIM_TTL}
    claim_id, high = await claim(http, headers, "b", limit=MAX_CLAIM_LIMIT, body=body)
    assert len(high) == MAX_CLAIM_LIMIT
    assert (await get_claim(http, headers, "b", claim_id))["ttl"] == MAX_CLAIM_TTL
    assert ids_of(low + high) == ids[:21]


async def test_get_claim(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "g", ["a", "b", "c"])
    claim_id, messages = await claim(http, headers, "g", limit=2)
    doc = await get_claim(http, headers, "g", claim_id)
    assert doc["ttl"] == 60
    assert isinstance(doc["age"], int)
    assert doc["age"] >= 0
    assert ids_of(doc["messages"]) == ids[:2]
    assert bodies_of(doc["messages"]) == ["a", "b"]
    assert [m["href"] for m in doc["messages"]] == [m["href"] for m in messages]
    assert all(set(m) == CLAIMED_KEYS for m in doc["messages"])
    # Unknown, malformed, another queue's or another project's: 404.
    assert (await http.put("/v2/queues/h", headers=headers)).status == 201
    for who, path in (
        (headers, f"{claims_path('g')}/{UNKNOWN_ID}"),
        (headers, f"{claims_path('g')}/not-a-claim"),
        (headers, f"{claims_path('g')}/{claim_id.upper()}x"),
        (headers, f"{claims_path('h')}/{claim_id}"),
        (headers, f"{claims_path('ghost')}/{claim_id}"),
        (other_project(headers), f"{claims_path('g')}/{claim_id}"),
    ):
        await error(await http.get(path, headers=who), 404)


async def test_patch_claim_renews_it(http: Client, headers: Headers) -> None:
    [mid] = await post(http, headers, "p", [{"body": "m", "ttl": 60}])
    claim_id, _ = await claim(http, headers, "p")
    url = f"{claims_path('p')}/{claim_id}"
    await no_content(await http.patch(url, json={"ttl": 120}, headers=headers))
    doc = await get_claim(http, headers, "p", claim_id)
    assert doc["ttl"] == 120
    assert ids_of(doc["messages"]) == [mid]
    # A renewal extends the message's life to claim expiry + grace as well.
    await no_content(await http.patch(url, json={"ttl": 600, "grace": 120}, headers=headers))
    one = await ok_json(await http.get(f"{messages_path('p')}/{mid}", headers=headers))
    assert one["ttl"] >= 720, one
    assert one["href"].endswith(f"?claim_id={claim_id}")
    assert (await get_claim(http, headers, "p", claim_id))["ttl"] == 600
    # The json-patch media type is accepted too; {} restores the defaults.
    json_patch = {**headers, "Content-Type": JSON_PATCH}
    await no_content(await http.patch(url, data=b'{"ttl": 90}', headers=json_patch))
    assert (await get_claim(http, headers, "p", claim_id))["ttl"] == 90
    await no_content(await http.patch(url, json={}, headers=headers))
    assert (await get_claim(http, headers, "p", claim_id))["ttl"] == 300


async def test_bad_claim_patch(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "bp", ["m"])
    claim_id, _ = await claim(http, headers, "bp")
    url = f"{claims_path('bp')}/{claim_id}"
    await error(await http.patch(url, data=b"", headers=headers), 400)
    await error(await http.patch(url, json={"ttl": 59}, headers=headers), 400)
    await error(await http.patch(url, json={"ttl": MAX_CLAIM_TTL + 1}, headers=headers), 400)
    await error(await http.patch(url, json={"grace": "x"}, headers=headers), 400)
    await error(await http.patch(url, json=[1], headers=headers), 400)
    assert (await get_claim(http, headers, "bp", claim_id))["ttl"] == 60
    for path in (
        f"{claims_path('bp')}/{UNKNOWN_ID}",
        f"{claims_path('bp')}/not-a-claim",
        f"{claims_path('ghost')}/{claim_id}",
    ):
        await error(await http.patch(path, json={"ttl": 120}, headers=headers), 404)
    await error(await http.patch(url, json={"ttl": 120}, headers=other_project(headers)), 404)


async def test_release_claim(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "r", ["a", "b", "c"])
    reader = other_client(headers)
    claim_id, _ = await claim(http, headers, "r", limit=2)
    assert await listed_ids(http, reader, "r") == ids[2:]
    url = f"{claims_path('r')}/{claim_id}"
    await no_content(await http.delete(url, headers=headers))
    await no_content(await http.delete(url, headers=headers))
    await error(await http.get(url, headers=headers), 404)
    await error(await http.patch(url, json={"ttl": 120}, headers=headers), 404)
    assert await listed_ids(http, reader, "r") == ids
    doc = await ok_json(await http.get(f"{messages_path('r')}/{ids[0]}", headers=headers))
    assert doc["href"] == f"{messages_path('r')}/{ids[0]}"
    # Released messages are claimable again.
    again_id, again = await claim(http, headers, "r")
    assert ids_of(again) == ids
    # Unknown, malformed, or in a queue that does not exist: still 204.
    for path in (
        f"{claims_path('r')}/{UNKNOWN_ID}",
        f"{claims_path('r')}/not-a-claim",
        f"{claims_path('ghost')}/{claim_id}",
    ):
        await no_content(await http.delete(path, headers=headers))
    # Releasing through another project touches nothing.
    url = f"{claims_path('r')}/{again_id}"
    await no_content(await http.delete(url, headers=other_project(headers)))
    assert await stats(http, headers, "r") == (3, 0, 3)
    assert ids_of((await get_claim(http, headers, "r", again_id))["messages"]) == ids


async def test_claimed_messages_carry_their_claim_count(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "n", ["a", "b", "c"])
    first, claimed = await claim(http, headers, "n", limit=1)
    assert [m["claim_count"] for m in claimed] == [1]
    await no_content(await http.delete(f"{claims_path('n')}/{first}", headers=headers))
    # released, then claimed again with the next one: this claim included
    second, claimed = await claim(http, headers, "n", limit=2)
    assert [(m["id"], m["claim_count"]) for m in claimed] == [(ids[0], 2), (ids[1], 1)]
    doc = await get_claim(http, headers, "n", second)
    assert [m["claim_count"] for m in doc["messages"]] == [2, 1]
    one = await ok_json(await http.get(f"{messages_path('n')}/{ids[0]}", headers=headers))
    assert one["claim_count"] == 2
    doc = await ok_json(
        await http.get(f"{messages_path('n')}?ids={','.join(ids)}", headers=headers)
    )
    assert [m.get("claim_count") for m in doc["messages"]] == [2, 1, None]
    listed = await listed_messages(http, other_client(headers), "n", "&include_claimed=true")
    assert [m.get("claim_count") for m in listed] == [2, 1, None]
    # a message no live claim holds shows no count (as Zaqar shows it)
    await no_content(await http.delete(f"{claims_path('n')}/{second}", headers=headers))
    one = await ok_json(await http.get(f"{messages_path('n')}/{ids[0]}", headers=headers))
    assert set(one) == MESSAGE_KEYS


def release_path(queue: str, message_id: str, claim_id: str | None) -> str:
    query = "" if claim_id is None else f"?claim_id={claim_id}"
    return f"{messages_path(queue)}/{message_id}/release{query}"


async def test_release_one_message(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "rm", ["a", "b", "c"])
    claim_id, _ = await claim(http, headers, "rm", limit=2)
    url = release_path("rm", ids[0], claim_id)
    await no_content(await http.post(url, json={"delay": 0}, headers=headers))
    # the rest of the claim is untouched; a is claimable again, counted
    assert ids_of((await get_claim(http, headers, "rm", claim_id))["messages"]) == [ids[1]]
    again_id, again = await claim(http, headers, "rm", limit=1)
    assert [(m["id"], m["claim_count"]) for m in again] == [(ids[0], 2)]
    # released once: its claim holds it no more
    doc = await error(await http.post(url, json={"delay": 0}, headers=headers), 400)
    assert doc["title"] == "Unable to release"
    assert claim_id in doc["description"]
    # a delay hides it; no body means no delay
    url = release_path("rm", ids[0], again_id)
    await no_content(await http.post(url, json={"delay": 900}, headers=headers))
    assert ids_of(await listed_messages(http, other_client(headers), "rm")) == [ids[2]]
    await no_content(await http.post(release_path("rm", ids[1], claim_id), headers=headers))
    assert ids_of((await claim(http, headers, "rm"))[1]) == [ids[1], ids[2]]


@pytest.mark.parametrize(
    ("query", "body", "status"),
    [
        (None, {"delay": 0}, 400),  # no claim_id
        ("", {"delay": 0}, 400),
        ("claim", {"delay": -1}, 400),
        ("claim", {"delay": 901}, 400),
        ("claim", {"delay": "5"}, 400),
        ("claim", {"delay": 1.5}, 400),
        ("claim", {"delay": True}, 400),
        ("claim", {"delay": None}, 400),
        ("claim", [5], 400),
        ("claim", b"{", 400),
        ("other", {"delay": 0}, 400),  # another live claim's
        (UNKNOWN_ID, {"delay": 0}, 400),
        ("not-a-claim", {"delay": 0}, 400),
    ],
    ids=repr,
)
async def test_bad_release_changes_nothing(
    http: Client, headers: Headers, query: str | None, body: Any, status: int
) -> None:
    ids = await post_bodies(http, headers, "br", ["a", "b"])
    claim_id, _ = await claim(http, headers, "br", limit=1)
    other, _ = await claim(http, headers, "br", limit=1)
    given = {"claim": claim_id, "other": other}.get(query, query) if query else query
    url = release_path("br", ids[0], given)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await http.post(url, data=data, headers={**headers, "Content-Type": "application/json"})
    await error(resp, status)
    assert ids_of((await get_claim(http, headers, "br", claim_id))["messages"]) == ids[:1]
    assert await stats(http, headers, "br") == (2, 0, 2)


async def test_release_of_a_missing_message_is_404(http: Client, headers: Headers) -> None:
    [mid] = await post_bodies(http, headers, "rg", ["a"])
    claim_id, _ = await claim(http, headers, "rg")
    for path in (
        release_path("rg", UNKNOWN_ID, claim_id),
        release_path("rg", "not-a-message", claim_id),
        release_path("ghost", mid, claim_id),
    ):
        await error(await http.post(path, headers=headers), 404)
    await error(
        await http.post(release_path("rg", mid, claim_id), headers=other_project(headers)), 404
    )
    assert await stats(http, headers, "rg") == (1, 0, 1)


async def test_claimed_messages_are_hidden_from_listings(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "h", list(range(5)))
    reader = other_client(headers)
    # A reader holds a marker after the first message, taken before the claim.
    first = await list_page(http, messages_path("h") + "?limit=1", reader)
    assert ids_of(first["messages"]) == ids[:1]
    [link] = first["links"]
    claim_id, claimed = await claim(http, headers, "h", limit=3)
    assert ids_of(claimed) == ids[:3]
    # Without a marker.
    assert await listed_ids(http, reader, "h") == ids[3:]
    doc = await list_page(http, messages_path("h"), reader)
    assert ids_of(doc["messages"]) == ids[3:]
    doc = await list_page(http, messages_path("h") + "?include_claimed=true", reader)
    assert ids_of(doc["messages"]) == ids
    hrefs = [m["href"] for m in doc["messages"]]
    assert hrefs[:3] == [f"{messages_path('h')}/{i}?claim_id={claim_id}" for i in ids[:3]]
    assert hrefs[3:] == [f"{messages_path('h')}/{i}" for i in ids[3:]]
    assert await listed_ids(http, reader, "h", "&include_claimed=true") == ids
    # With a marker.
    pages, _ = await follow(http, link["href"], reader)
    assert [m["id"] for page in pages for m in page] == ids[3:]
    pages, _ = await follow(http, link["href"] + "&include_claimed=true", reader)
    assert [m["id"] for page in pages for m in page] == ids[1:]
    # The next links keep include_claimed.
    doc = await list_page(http, messages_path("h") + "?include_claimed=true&limit=2", reader)
    assert "include_claimed=true" in doc["links"][0]["href"]


async def test_claims_never_share_a_message(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "x", list(range(5)))
    first_id, first = await claim(http, headers, "x", limit=3)
    second_id, second = await claim(http, other_client(headers), "x", limit=20)
    assert first_id != second_id
    assert ids_of(first) == ids[:3]
    assert ids_of(second) == ids[3:]
    await nothing_claimable(http, headers, "x", "?limit=20")
    assert ids_of((await get_claim(http, headers, "x", first_id))["messages"]) == ids[:3]
    assert ids_of((await get_claim(http, headers, "x", second_id))["messages"]) == ids[3:]
    # Releasing one claim frees only its own messages.
    await no_content(await http.delete(f"{claims_path('x')}/{first_id}", headers=headers))
    _, third = await claim(http, headers, "x", limit=20)
    assert ids_of(third) == ids[:3]


async def test_concurrent_claims_are_exclusive(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "cc", list(range(20)))

    async def one() -> list[str]:
        resp = await http.post(claims_path("cc") + "?limit=3", json={}, headers=headers)
        if resp.status == 204:
            return []
        doc = await ok_json(resp, 201)
        return ids_of(doc["messages"])

    results = await asyncio.gather(*(one() for _ in range(10)))
    claimed = [i for r in results for i in r]
    assert sorted(claimed) == sorted(ids)
    assert len(set(claimed)) == len(claimed)


async def test_concurrent_pops_are_exclusive(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "cp", list(range(20)))

    async def one() -> list[str]:
        resp = await http.delete(f"{messages_path('cp')}?pop=3", headers=headers)
        doc = await ok_json(resp)
        return ids_of(doc["messages"])

    results = await asyncio.gather(*(one() for _ in range(10)))
    popped = [i for r in results for i in r]
    assert sorted(popped) == sorted(ids)
    assert len(set(popped)) == len(popped)
    assert await stats(http, headers, "cp") == (0, 0, 0)


# -- claim expiry (short limits) -----------------------------------------------------------


def quick_settings(redis_url: str, driver: str) -> Settings:
    """A service whose claims may last 1 s, so short claims can be tested."""
    return make_settings(redis_url, driver=driver, min_claim_ttl=1, min_claim_grace=0)


@pytest.fixture
async def quick(redis_url: str, driver: str, clock: ManualClock) -> AsyncIterator[Client]:
    """The short-claims service on the test's clock."""
    app = create_app(quick_settings(redis_url, driver), clock)
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_expired_claim_frees_its_messages(
    quick: Client, headers: Headers, clock: ManualClock
) -> None:
    [mid] = await post(quick, headers, "e", [{"body": "m", "ttl": 1}])
    claim_id, [claimed] = await claim(quick, headers, "e", body={"ttl": 1, "grace": 3})
    # The claim keeps the message alive until claim expiry + grace.
    assert claimed["ttl"] >= 4
    clock.advance(0.9)
    assert ids_of((await get_claim(quick, headers, "e", claim_id))["messages"]) == [mid]
    await nothing_claimable(quick, headers, "e")
    clock.advance(0.2)
    await check_claim_expired(quick, headers, claim_id, mid)


@pytest.mark.slow
async def test_expired_claim_frees_its_messages_in_real_time(
    redis_url: str, driver: str, headers: Headers
) -> None:
    """End to end on the host's clock: the claim's ttl really passes."""
    app = create_app(quick_settings(redis_url, driver))
    async with TestClient(TestServer(app)) as quick:
        [mid] = await post(quick, headers, "e", [{"body": "m", "ttl": 1}])
        claim_id, [claimed] = await claim(quick, headers, "e", body={"ttl": 1, "grace": 3})
        assert claimed["ttl"] >= 4
        await asyncio.sleep(1.5)
        await check_claim_expired(quick, headers, claim_id, mid)


async def check_claim_expired(quick: Client, headers: Headers, claim_id: str, mid: str) -> None:
    """After claim expiry, within the grace: the claim is gone, its message is free."""
    await error(await quick.get(f"{claims_path('e')}/{claim_id}", headers=headers), 404)
    one = await ok_json(await quick.get(f"{messages_path('e')}/{mid}", headers=headers))
    assert one["href"] == f"{messages_path('e')}/{mid}"
    assert await stats(quick, headers, "e") == (0, 1, 1)
    assert await listed_ids(quick, other_client(headers), "e") == [mid]
    # The expired claim no longer holds the message.
    url = f"{messages_path('e')}/{mid}?claim_id={claim_id}"
    await error(await quick.delete(url, headers=headers), 400)
    _, [again] = await claim(quick, headers, "e", body={"ttl": 60, "grace": 60})
    assert again["id"] == mid


async def test_expired_claim_cannot_touch_the_next_claim(
    quick: Client, headers: Headers, clock: ManualClock
) -> None:
    [mid] = await post_bodies(quick, headers, "nx", ["m"])
    old_id, _ = await claim(quick, headers, "nx", body={"ttl": 1, "grace": 0})
    clock.advance(0.9)
    await nothing_claimable(quick, headers, "nx")
    clock.advance(0.2)
    new_id, [taken] = await claim(quick, headers, "nx")
    assert taken["id"] == mid
    # The expired claim can neither renew, nor release, nor delete with,
    # what the new claim holds.
    old = f"{claims_path('nx')}/{old_id}"
    await error(await quick.patch(old, json={"ttl": 60}, headers=headers), 404)
    await no_content(await quick.delete(old, headers=headers))
    url = f"{messages_path('nx')}/{mid}?claim_id={old_id}"
    await error(await quick.delete(url, headers=headers), 400)
    one = await ok_json(await quick.get(f"{messages_path('nx')}/{mid}", headers=headers))
    assert one["href"].endswith(f"?claim_id={new_id}")
    assert ids_of((await get_claim(quick, headers, "nx", new_id))["messages"]) == [mid]
    assert await stats(quick, headers, "nx") == (1, 0, 1)
    await nothing_claimable(quick, headers, "nx")


async def test_renewed_claim_keeps_its_messages_alive(
    quick: Client, headers: Headers, clock: ManualClock
) -> None:
    [mid] = await post(quick, headers, "rn", [{"body": "m", "ttl": 1}])
    claim_id, _ = await claim(quick, headers, "rn", body={"ttl": 1, "grace": 0})
    url = f"{claims_path('rn')}/{claim_id}"
    await no_content(await quick.patch(url, json={"ttl": 60, "grace": 0}, headers=headers))
    clock.advance(1.5)
    # Past both the message's own ttl and the first claim's: held by the renewal.
    doc = await get_claim(quick, headers, "rn", claim_id)
    assert ids_of(doc["messages"]) == [mid]
    one = await ok_json(await quick.get(f"{messages_path('rn')}/{mid}", headers=headers))
    assert one["href"].endswith(f"?claim_id={claim_id}")
    assert await stats(quick, headers, "rn") == (1, 0, 1)
    # ... until the renewal's ttl (60 s) passes; then the message's own ttl is over too.
    clock.advance(59)
    await error(await quick.get(url, headers=headers), 404)
    await error(await quick.get(f"{messages_path('rn')}/{mid}", headers=headers), 404)


# -- deleting under claims -----------------------------------------------------------------


async def test_delete_claimed_message(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "dc", ["a", "b", "c"])
    claim_id, _ = await claim(http, headers, "dc", limit=2)
    other_claim, _ = await claim(http, headers, "dc", limit=1)
    base = messages_path("dc")
    # No claim_id: 403.
    doc = await error(await http.delete(f"{base}/{ids[0]}", headers=headers), 403)
    assert doc["title"]
    # A wrong claim: unknown, malformed, or another live claim's: 400.
    for wrong in (UNKNOWN_ID, "garbage", other_claim):
        url = f"{base}/{ids[0]}?claim_id={wrong}"
        await error(await http.delete(url, headers=headers), 400)
    one = await ok_json(await http.get(f"{base}/{ids[0]}", headers=headers))
    assert one["body"] == "a"
    # The right one: 204, and the message is gone from the claim too.
    url = f"{base}/{ids[0]}?claim_id={claim_id}"
    await no_content(await http.delete(url, headers=headers))
    await error(await http.get(f"{base}/{ids[0]}", headers=headers), 404)
    assert ids_of((await get_claim(http, headers, "dc", claim_id))["messages"]) == [ids[1]]
    assert await stats(http, headers, "dc") == (2, 0, 2)
    # A missing message with a claim_id: 204.
    await no_content(await http.delete(url, headers=headers))
    await no_content(await http.delete(f"{base}/{UNKNOWN_ID}?claim_id={claim_id}", headers=headers))
    # An unclaimed message with a claim_id: 400.
    await no_content(await http.delete(f"{claims_path('dc')}/{other_claim}", headers=headers))
    for given in (other_claim, claim_id, UNKNOWN_ID):
        url = f"{base}/{ids[2]}?claim_id={given}"
        await error(await http.delete(url, headers=headers), 400)
    # Without one it goes.
    await no_content(await http.delete(f"{base}/{ids[2]}", headers=headers))
    assert await stats(http, headers, "dc") == (1, 0, 1)


async def test_bulk_delete_removes_claimed_messages(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "bk", ["a", "b", "c"])
    claim_id, _ = await claim(http, headers, "bk", limit=2)
    await no_content(await http.delete(f"{messages_path('bk')}?ids={ids[0]}", headers=headers))
    await error(await http.get(f"{messages_path('bk')}/{ids[0]}", headers=headers), 404)
    assert ids_of((await get_claim(http, headers, "bk", claim_id))["messages"]) == [ids[1]]
    assert await stats(http, headers, "bk") == (1, 1, 2)


async def test_deleting_the_queue_ends_its_claims(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "dq", ["a"])
    claim_id, _ = await claim(http, headers, "dq")
    await no_content(await http.delete("/v2/queues/dq", headers=headers))
    await error(await http.get(f"{claims_path('dq')}/{claim_id}", headers=headers), 404)
    [mid] = await post_bodies(http, headers, "dq", ["b"])
    await error(await http.get(f"{claims_path('dq')}/{claim_id}", headers=headers), 404)
    _, [claimed] = await claim(http, headers, "dq")
    assert claimed["id"] == mid
    assert await stats(http, headers, "dq") == (1, 0, 1)


# -- pop -----------------------------------------------------------------------------------


async def test_pop_removes_and_returns_unclaimed_messages(http: Client, headers: Headers) -> None:
    ids = await post(http, headers, "pp", [{"body": i, "ttl": 600} for i in range(5)])
    claim_id, _ = await claim(http, headers, "pp", limit=1)
    base = messages_path("pp")
    doc = await ok_json(await http.delete(f"{base}?pop=2", headers=headers))
    assert set(doc) == {"messages"}
    assert all(set(m) == {"id", "ttl", "age", "body"} for m in doc["messages"]), doc
    assert ids_of(doc["messages"]) == ids[1:3]
    assert bodies_of(doc["messages"]) == [1, 2]
    assert [m["ttl"] for m in doc["messages"]] == [600, 600]
    for mid in ids[1:3]:
        await error(await http.get(f"{base}/{mid}", headers=headers), 404)
    assert await stats(http, headers, "pp") == (1, 2, 3)
    doc = await ok_json(await http.delete(f"{base}?pop=20", headers=headers))
    assert ids_of(doc["messages"]) == ids[3:]
    # Only the claimed one is left, and pop never takes it.
    assert await ok_json(await http.delete(f"{base}?pop=20", headers=headers)) == {"messages": []}
    assert ids_of((await get_claim(http, headers, "pp", claim_id))["messages"]) == ids[:1]
    assert await stats(http, headers, "pp") == (1, 0, 1)


async def test_pop_bounds_are_inclusive(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "pb", list(range(22)))
    base = messages_path("pb")
    doc = await ok_json(await http.delete(f"{base}?pop=1", headers=headers))
    assert ids_of(doc["messages"]) == ids[:1]
    doc = await ok_json(await http.delete(f"{base}?pop=20", headers=headers))
    assert ids_of(doc["messages"]) == ids[1:21]


@pytest.mark.parametrize("query", ["pop=0", "pop=21", "pop=abc", "pop=-1", "pop=1.5"])
async def test_bad_pop_is_400(http: Client, headers: Headers, query: str) -> None:
    ids = await post_bodies(http, headers, "bp", ["keep", "keep2"])
    await error(await http.delete(f"{messages_path('bp')}?{query}", headers=headers), 400)
    assert await stats(http, headers, "bp") == (0, 2, 2)
    url = f"{messages_path('bp')}?ids={ids[0]}&pop=1"
    await error(await http.delete(url, headers=headers), 400)
    url = f"{messages_path('bp')}?pop=1&ids={ids[0]}"
    await error(await http.delete(url, headers=headers), 400)
    assert await stats(http, headers, "bp") == (0, 2, 2)


async def test_pop_of_empty_or_missing_queue(http: Client, headers: Headers) -> None:
    doc = await ok_json(await http.delete(f"{messages_path('ghost')}?pop=3", headers=headers))
    assert doc == {"messages": []}
    assert await queue_names(http, headers) == []
    assert (await http.put("/v2/queues/empty", headers=headers)).status == 201
    doc = await ok_json(await http.delete(f"{messages_path('empty')}?pop=3", headers=headers))
    assert doc == {"messages": []}


async def test_pop_takes_no_delayed_messages(http: Client, headers: Headers) -> None:
    ids = await post(http, headers, "pd", [{"body": "late", "delay": 600}, {"body": "now"}])
    doc = await ok_json(await http.delete(f"{messages_path('pd')}?pop=5", headers=headers))
    assert ids_of(doc["messages"]) == ids[1:]
    one = await ok_json(await http.get(f"{messages_path('pd')}/{ids[0]}", headers=headers))
    assert one["body"] == "late"


# -- delay ---------------------------------------------------------------------------------


async def test_delayed_messages_cannot_be_claimed_until_due(http: Client, headers: Headers) -> None:
    ids = await post(http, headers, "dl", [{"body": "late", "delay": 600}, {"body": "now"}])
    reader = other_client(headers)
    assert await listed_ids(http, reader, "dl") == ids[1:]
    _, claimed = await claim(http, headers, "dl", limit=20)
    assert ids_of(claimed) == ids[1:]
    await nothing_claimable(http, headers, "dl", "?limit=20")
    assert await listed_ids(http, reader, "dl") == []
    assert await listed_ids(http, reader, "dl", "&include_delayed=true") == ids[:1]
    both = "&include_delayed=true&include_claimed=true"
    assert await listed_ids(http, reader, "dl", both) == ids


async def test_due_and_expired_messages_in_claims_and_pops(
    quick: Client, headers: Headers, clock: ManualClock
) -> None:
    messages: list[dict[str, Any]] = [
        {"body": "gone", "ttl": 1},
        {"body": "soon", "delay": 1},
        {"body": "b"},
    ]
    gone, soon, b = await post(quick, headers, "due", messages)
    # "gone" is claimable now, "soon" is not.
    body = {"ttl": 1, "grace": 0}
    claim_id, claimed = await claim(quick, headers, "due", limit=1, body=body)
    assert ids_of(claimed) == [gone]
    await no_content(await quick.delete(f"{claims_path('due')}/{claim_id}", headers=headers))
    clock.advance(0.9)
    assert await listed_ids(quick, other_client(headers), "due") == [gone, b]
    clock.advance(0.2)
    # Now "soon" is due and "gone" has expired (its claim kept it only until
    # claim expiry + grace, 1 s).
    assert await listed_ids(quick, other_client(headers), "due") == [soon, b]
    doc = await ok_json(await quick.delete(f"{messages_path('due')}?pop=1", headers=headers))
    assert ids_of(doc["messages"]) == [soon]
    _, claimed = await claim(quick, headers, "due", limit=20)
    assert ids_of(claimed) == [b]


@pytest.mark.parametrize("delay", [901, -1, "x", "10", 1.5, True, None])
async def test_bad_delay_is_400(http: Client, headers: Headers, delay: Any) -> None:
    body = {"messages": [{"body": "ok"}, {"body": "bad", "delay": delay}]}
    await error(await http.post(messages_path("bd"), json=body, headers=headers), 400)
    assert await stats(http, headers, "bd") == (0, 0, 0)


async def test_delay_bounds_are_inclusive(http: Client, headers: Headers) -> None:
    ids = await post(http, headers, "db", [{"body": 0, "delay": 0}, {"body": 900, "delay": 900}])
    assert await listed_ids(http, other_client(headers), "db") == ids[:1]


async def test_queue_default_delay_applies_to_claims(http: Client, headers: Headers) -> None:
    resp = await http.put("/v2/queues/qd", json={"_default_message_delay": 600}, headers=headers)
    assert resp.status == 201
    ids = await post(http, headers, "qd", [{"body": "late"}, {"body": "now", "delay": 0}])
    _, claimed = await claim(http, headers, "qd", limit=20)
    assert ids_of(claimed) == ids[1:]
    await nothing_claimable(http, headers, "qd")
    reader = other_client(headers)
    assert await listed_ids(http, reader, "qd", "&include_delayed=true") == ids[:1]


# -- queue metadata PATCH ------------------------------------------------------------------


async def test_patch_add_replace_remove(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/m", json={"keep": 1}, headers=headers)).status == 201
    add = [{"op": "add", "path": "/metadata/x", "value": {"n": [1, 2]}}]
    doc = await ok_json(await patch_queue(http, headers, "m", add))
    check_metadata(doc, {"keep": 1, "x": {"n": [1, 2]}})
    assert await queue_doc(http, headers, "m") == doc
    # add on an existing key replaces it
    doc = await ok_json(
        await patch_queue(http, headers, "m", [{"op": "add", "path": "/metadata/x", "value": 0}])
    )
    check_metadata(doc, {"keep": 1, "x": 0})
    replace = [{"op": "replace", "path": "/metadata/x", "value": "two"}]
    doc = await ok_json(await patch_queue(http, headers, "m", replace))
    check_metadata(doc, {"keep": 1, "x": "two"})
    doc = await ok_json(
        await patch_queue(http, headers, "m", [{"op": "remove", "path": "/metadata/x"}])
    )
    check_metadata(doc, {"keep": 1})
    assert "x" not in doc
    assert await queue_doc(http, headers, "m") == doc
    # Several operations apply in order; [] changes nothing.
    ops = [
        {"op": "add", "path": "/metadata/a", "value": 1},
        {"op": "replace", "path": "/metadata/a", "value": 2},
        {"op": "add", "path": "/metadata/b", "value": None},
        {"op": "remove", "path": "/metadata/keep"},
    ]
    doc = await ok_json(await patch_queue(http, headers, "m", ops))
    check_metadata(doc, {"a": 2, "b": None})
    assert "keep" not in doc
    assert await ok_json(await patch_queue(http, headers, "m", [])) == doc
    assert await queue_doc(http, headers, "m") == doc


async def test_patch_reserved_settings_are_honoured(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/rs", headers=headers)).status == 201
    ops = [{"op": "replace", "path": "/metadata/_default_message_ttl", "value": 120}]
    doc = await ok_json(await patch_queue(http, headers, "rs", ops))
    check_metadata(doc, {"_default_message_ttl": 120})
    [a, b] = await post(http, headers, "rs", [{"body": "a"}, {"body": "b", "ttl": 90}])
    ttls = await ok_json(await http.get(f"{messages_path('rs')}?ids={a},{b}", headers=headers))
    assert [m["ttl"] for m in ttls["messages"]] == [120, 90]
    ops = [{"op": "remove", "path": "/metadata/_default_message_ttl"}]
    doc = await ok_json(await patch_queue(http, headers, "rs", ops))
    check_metadata(doc, {})
    [c] = await post_bodies(http, headers, "rs", ["c"])
    one = await ok_json(await http.get(f"{messages_path('rs')}/{c}", headers=headers))
    assert one["ttl"] == 3600


async def test_patch_conflicts(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/pc", json={"k": "v"}, headers=headers)).status == 201
    before = await queue_doc(http, headers, "pc")
    for op in ("replace", "remove"):
        ops: list[dict[str, Any]] = [{"op": op, "path": "/metadata/missing", "value": 1}]
        await error(await patch_queue(http, headers, "pc", ops), 409)
    # A conflict anywhere in the patch applies none of it.
    ops = [
        {"op": "add", "path": "/metadata/y", "value": 1},
        {"op": "remove", "path": "/metadata/missing"},
    ]
    await error(await patch_queue(http, headers, "pc", ops), 409)
    assert await queue_doc(http, headers, "pc") == before
    # Reserved keys that are not set may be removed or replaced.
    ops = [
        {"op": "remove", "path": "/metadata/_max_claim_count"},
        {"op": "remove", "path": "/metadata/_dead_letter_queue"},
    ]
    doc = await ok_json(await patch_queue(http, headers, "pc", ops))
    check_metadata(doc, {"k": "v"})
    ops = [{"op": "replace", "path": "/metadata/_max_claim_count", "value": 3}]
    doc = await ok_json(await patch_queue(http, headers, "pc", ops))
    check_metadata(doc, {"k": "v", "_max_claim_count": 3})


@pytest.mark.parametrize(
    "content_type", ["application/json", "text/plain", "application/json-patch+json"]
)
async def test_patch_wrong_content_type_is_415(
    http: Client, headers: Headers, content_type: str
) -> None:
    assert (await http.put("/v2/queues/ct", headers=headers)).status == 201
    before = await queue_doc(http, headers, "ct")
    ops = [{"op": "add", "path": "/metadata/x", "value": 1}]
    await error(await patch_queue(http, headers, "ct", ops, content_type), 415)
    assert await queue_doc(http, headers, "ct") == before


async def test_patch_of_missing_queue_is_404(http: Client, headers: Headers) -> None:
    ops = [{"op": "add", "path": "/metadata/x", "value": 1}]
    await error(await patch_queue(http, headers, "ghost", ops), 404)
    assert await queue_names(http, headers) == []


BAD_PATCHES: dict[str, Any] = {
    "object": {"op": "add", "path": "/metadata/x", "value": 1},
    "empty": b"",
    "blank": b"  ",
    "invalid JSON": b"[{",
    "number": 5,
    "list of numbers": [1],
    "list of lists": [[{"op": "add", "path": "/metadata/x", "value": 1}]],
    "bad op": [{"op": "move", "path": "/metadata/x", "value": 1}],
    "test op": [{"op": "test", "path": "/metadata/x", "value": 1}],
    "no op": [{"path": "/metadata/x", "value": 1}],
    "bad path": [{"op": "add", "path": "/x", "value": 1}],
    "metadata root": [{"op": "add", "path": "/metadata/", "value": 1}],
    "no path": [{"op": "add", "value": 1}],
    "path not a string": [{"op": "add", "path": 5, "value": 1}],
    "add without value": [{"op": "add", "path": "/metadata/x"}],
    "replace without value": [{"op": "replace", "path": "/metadata/k"}],
    "second op bad": [
        {"op": "add", "path": "/metadata/x", "value": 1},
        {"op": "copy", "path": "/metadata/y", "from": "/metadata/x"},
    ],
}


@pytest.mark.parametrize("body", list(BAD_PATCHES.values()), ids=list(BAD_PATCHES))
async def test_bad_patch_is_400(http: Client, headers: Headers, body: Any) -> None:
    assert (await http.put("/v2/queues/bp", json={"k": "v"}, headers=headers)).status == 201
    before = await queue_doc(http, headers, "bp")
    await error(await patch_queue(http, headers, "bp", body), 400)
    assert await queue_doc(http, headers, "bp") == before


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("_default_message_ttl", 0),
        ("_default_message_ttl", 1209601),
        ("_default_message_ttl", "x"),
        ("_default_message_delay", 901),
        ("_default_message_delay", -1),
        ("_max_messages_post_size", 0),
        ("_max_messages_post_size", 262145),
        ("_max_claim_count", 0),
        ("_max_claim_count", "2"),
        ("_dead_letter_queue", "a!b"),
        ("_dead_letter_queue", 5),
        ("_dead_letter_queue_messages_ttl", 0),
    ],
)
async def test_patch_reserved_value_out_of_range_is_400(
    http: Client, headers: Headers, key: str, value: Any
) -> None:
    assert (await http.put("/v2/queues/rv", json={"k": "v"}, headers=headers)).status == 201
    before = await queue_doc(http, headers, "rv")
    ops = [
        {"op": "add", "path": "/metadata/y", "value": 1},
        {"op": "add", "path": f"/metadata/{key}", "value": value},
    ]
    await error(await patch_queue(http, headers, "rv", ops), 400)
    assert await queue_doc(http, headers, "rv") == before
    # Storage did not start honouring the refused value either.
    [mid] = await post_bodies(http, headers, "rv", ["m"])
    one = await ok_json(await http.get(f"{messages_path('rv')}/{mid}", headers=headers))
    assert one["ttl"] == 3600
    assert await listed_ids(http, other_client(headers), "rv") == [mid]


# -- reserved settings ---------------------------------------------------------------------


def sized_post(size: int) -> bytes:
    """A POST body of exactly ``size`` bytes."""
    empty = b'{"messages": [{"body": ""}]}'
    assert size >= len(empty)
    return b'{"messages": [{"body": "' + b"x" * (size - len(empty)) + b'"}]}'


async def test_queue_max_post_size(http: Client, headers: Headers) -> None:
    resp = await http.put("/v2/queues/ps", json={"_max_messages_post_size": 100}, headers=headers)
    assert resp.status == 201
    json_headers = {**headers, "Content-Type": "application/json"}
    body = sized_post(101)
    assert len(body) == 101
    # 400 as in Zaqar (test_post_using_queue_max_messages_post_size)
    doc = await error(await http.post(messages_path("ps"), data=body, headers=json_headers), 400)
    assert doc["description"] == "Queue ps accepts posts of at most 100 bytes."
    assert await stats(http, headers, "ps") == (0, 0, 0)
    for size in (100, 50):
        resp = await http.post(messages_path("ps"), data=sized_post(size), headers=json_headers)
        await ok_json(resp, 201)
    assert await stats(http, headers, "ps") == (0, 2, 2)
    # Raising it by PATCH lets the larger post through.
    ops = [{"op": "replace", "path": "/metadata/_max_messages_post_size", "value": 200}]
    await ok_json(await patch_queue(http, headers, "ps", ops))
    await ok_json(await http.post(messages_path("ps"), data=body, headers=json_headers), 201)
    # Another queue keeps the service's limit.
    await ok_json(await http.post(messages_path("other"), data=body, headers=json_headers), 201)


async def test_queue_default_ttl(http: Client, headers: Headers) -> None:
    resp = await http.put("/v2/queues/tt", json={"_default_message_ttl": 120}, headers=headers)
    assert resp.status == 201
    ids = await post(http, headers, "tt", [{"body": "a"}, {"body": "b", "ttl": 300}])
    doc = await ok_json(
        await http.get(f"{messages_path('tt')}?ids={','.join(ids)}", headers=headers)
    )
    assert [m["ttl"] for m in doc["messages"]] == [120, 300]
    _, claimed = await claim(http, headers, "tt", limit=1, body={"ttl": 60, "grace": 60})
    assert 120 <= claimed[0]["ttl"] <= 121


# -- dead-lettering ------------------------------------------------------------------------


@pytest.mark.parametrize("max_claims", [1, 2])
async def test_dead_letter_after_max_claims(
    http: Client, headers: Headers, max_claims: int
) -> None:
    metadata = {
        "_max_claim_count": max_claims,
        "_dead_letter_queue": "dlq",
        "_dead_letter_queue_messages_ttl": 120,
    }
    assert (await http.put("/v2/queues/work", json=metadata, headers=headers)).status == 201
    [mid] = await post(http, headers, "work", [{"body": {"job": 7}, "ttl": 600}])
    for _ in range(max_claims):
        claim_id, [claimed] = await claim(http, headers, "work")
        assert claimed["id"] == mid
        await no_content(await http.delete(f"{claims_path('work')}/{claim_id}", headers=headers))
        assert await listed_ids(http, headers, "work", "&echo=true") == [mid]
    # Claimed once too often: it moves to the dead-letter queue.
    await nothing_claimable(http, headers, "work")
    await error(await http.get(f"{messages_path('work')}/{mid}", headers=headers), 404)
    assert await listed_ids(http, headers, "work", "&echo=true&include_claimed=true") == []
    assert await stats(http, headers, "work") == (0, 0, 0)
    pages, _ = await follow(http, messages_path("dlq") + "?echo=true", headers)
    [[dead]] = pages
    assert dead["body"] == {"job": 7}
    assert dead["ttl"] == 120
    assert await stats(http, headers, "dlq") == (0, 1, 1)
    assert bodies_of(await listed_messages(http, other_client(headers), "dlq")) == [{"job": 7}]
    # The dead letter is an ordinary message there.
    _, [again] = await claim(http, headers, "dlq")
    assert again["body"] == {"job": 7}


async def test_dead_letter_keeps_ttl_without_dlq_ttl(http: Client, headers: Headers) -> None:
    metadata = {"_max_claim_count": 1, "_dead_letter_queue": "dead.letters"}
    assert (await http.put("/v2/queues/w", json=metadata, headers=headers)).status == 201
    ids = await post(http, headers, "w", [{"body": "a", "ttl": 600}, {"body": "b", "ttl": 600}])
    claim_id, claimed = await claim(http, headers, "w", limit=1)
    assert ids_of(claimed) == ids[:1]
    await no_content(await http.delete(f"{claims_path('w')}/{claim_id}", headers=headers))
    # The next claim moves "a" and claims "b" (claimed for the first time).
    _, claimed = await claim(http, headers, "w", limit=1)
    assert ids_of(claimed) == ids[1:]
    pages, _ = await follow(http, messages_path("dead.letters") + "?echo=true", headers)
    [[dead]] = pages
    assert dead["body"] == "a"
    assert 590 <= dead["ttl"] <= 600
    assert "dead.letters" in await queue_names(http, headers)


async def test_dead_letter_settings_follow_patches(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/pw", headers=headers)).status == 201
    [mid] = await post_bodies(http, headers, "pw", ["m"])
    ops = [
        {"op": "add", "path": "/metadata/_max_claim_count", "value": 1},
        {"op": "add", "path": "/metadata/_dead_letter_queue", "value": "dlq"},
    ]
    doc = await ok_json(await patch_queue(http, headers, "pw", ops))
    check_metadata(doc, {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    # Removing the count again turns dead-lettering off.
    ops = [{"op": "remove", "path": "/metadata/_max_claim_count"}]
    await ok_json(await patch_queue(http, headers, "pw", ops))
    for _ in range(3):
        claim_id, [claimed] = await claim(http, headers, "pw")
        assert claimed["id"] == mid
        await no_content(await http.delete(f"{claims_path('pw')}/{claim_id}", headers=headers))
    assert await listed_ids(http, headers, "dlq", "&echo=true") == []
    # And adding it back turns it on: the message was claimed 3 times already.
    ops = [{"op": "add", "path": "/metadata/_max_claim_count", "value": 2}]
    await ok_json(await patch_queue(http, headers, "pw", ops))
    await nothing_claimable(http, headers, "pw")
    pages, _ = await follow(http, messages_path("dlq") + "?echo=true", headers)
    assert [bodies_of(page) for page in pages] == [["m"]]


async def dead_letter_setup(http: Client, headers: Headers) -> str:
    """Queues a, c and work (dead-lettering to "b-dlq"); a live claim on work's message."""
    metadata = {"_max_claim_count": 1, "_dead_letter_queue": "b-dlq"}
    assert (await http.put("/v2/queues/work", json=metadata, headers=headers)).status == 201
    for name in ("a", "c"):
        assert (await http.put(f"/v2/queues/{name}", headers=headers)).status == 201
    await post_bodies(http, headers, "work", ["m"])
    # A first claim moves nothing to "b-dlq".
    claim_id, _ = await claim(http, headers, "work")
    return claim_id


async def test_queue_listing_is_complete_after_claims_on_a_dead_lettering_queue(
    http: Client, headers: Headers
) -> None:
    claim_id = await dead_letter_setup(http, headers)
    # Paging lists every queue once, and the count agrees with the listing.
    pages, _ = await follow(http, "/v2/queues?limit=1", headers, key="queues")
    paged = [q["name"] for page in pages for q in page]
    assert {"a", "c", "work"} <= set(paged), paged
    assert paged == await queue_names(http, headers)
    doc = await ok_json(await http.get("/v2/queues?with_count=true", headers=headers))
    assert doc["count"] == len(paged)
    # Once a message has been moved there, the dead-letter queue is an ordinary queue.
    await no_content(await http.delete(f"{claims_path('work')}/{claim_id}", headers=headers))
    await nothing_claimable(http, headers, "work")
    pages, _ = await follow(http, "/v2/queues?limit=1", headers, key="queues")
    assert [q["name"] for page in pages for q in page] == ["a", "b-dlq", "c", "work"]
    doc = await ok_json(await http.get("/v2/queues?with_count=true", headers=headers))
    assert doc["count"] == 4
    pages, _ = await follow(http, messages_path("b-dlq") + "?echo=true", headers)
    assert [bodies_of(page) for page in pages] == [["m"]]


async def test_claim_that_moves_nothing_creates_no_dead_letter_queue(
    http: Client, headers: Headers
) -> None:
    await dead_letter_setup(http, headers)
    assert await queue_names(http, headers) == ["a", "c", "work"]
    doc = await queue_doc(http, headers, "b-dlq")
    assert all(k.startswith("_") for k in doc), doc


# -- stats with claims ---------------------------------------------------------------------


async def test_stats_count_claimed_messages(http: Client, headers: Headers) -> None:
    ids = await post_bodies(http, headers, "st", list(range(5)))
    claim_id, _ = await claim(http, headers, "st", limit=2)
    assert await stats(http, headers, "st") == (2, 3, 5)
    doc = await ok_json(await http.get("/v2/queues/st/stats", headers=headers))
    assert doc["messages"]["oldest"]["href"] == f"{messages_path('st')}/{ids[0]}"
    url = f"{messages_path('st')}/{ids[0]}?claim_id={claim_id}"
    await no_content(await http.delete(url, headers=headers))
    assert await stats(http, headers, "st") == (1, 3, 4)
    await no_content(await http.delete(f"{claims_path('st')}/{claim_id}", headers=headers))
    assert await stats(http, headers, "st") == (0, 4, 4)


# -- purge ---------------------------------------------------------------------------------


async def test_purge_messages_keeps_the_queue(http: Client, headers: Headers) -> None:
    assert (await http.put("/v2/queues/pg", json={"k": "v"}, headers=headers)).status == 201
    ids = await post_bodies(http, headers, "pg", ["a", "b", "c"])
    claim_id, _ = await claim(http, headers, "pg", limit=1)
    resp = await http.post(
        "/v2/queues/pg/purge", json={"resource_types": ["messages"]}, headers=headers
    )
    await no_content(resp)
    assert await stats(http, headers, "pg") == (0, 0, 0)
    assert await listed_ids(http, headers, "pg", "&echo=true&include_claimed=true") == []
    for mid in ids:
        await error(await http.get(f"{messages_path('pg')}/{mid}", headers=headers), 404)
    await error(await http.get(f"{claims_path('pg')}/{claim_id}", headers=headers), 404)
    check_metadata(await queue_doc(http, headers, "pg"), {"k": "v"})
    assert await queue_names(http, headers) == ["pg"]
    # The queue works on afterwards.
    new = await post_bodies(http, headers, "pg", ["d"])
    assert await listed_ids(http, other_client(headers), "pg") == new
    _, claimed = await claim(http, headers, "pg")
    assert ids_of(claimed) == new


async def test_purge_without_body_purges(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "pn", ["a", "b"])
    await claim(http, headers, "pn", limit=1)
    await no_content(await http.post("/v2/queues/pn/purge", headers=headers))
    assert await stats(http, headers, "pn") == (0, 0, 0)
    both = {"resource_types": ["messages", "subscriptions"]}
    await post_bodies(http, headers, "pn", ["c"])
    await no_content(await http.post("/v2/queues/pn/purge", json=both, headers=headers))
    assert await stats(http, headers, "pn") == (0, 0, 0)


async def test_purge_of_subscriptions_keeps_messages(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "ps", ["a"])
    body = {"resource_types": ["subscriptions"]}
    await no_content(await http.post("/v2/queues/ps/purge", json=body, headers=headers))
    assert await stats(http, headers, "ps") == (0, 1, 1)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"resource_types": ["bogus"]},
        {"resource_types": ["messages", "bogus"]},
        {"resource_types": "messages"},
        {"resource_types": []},
        {"types": ["messages"]},
        ["messages"],
        b"{",
    ],
    ids=repr,
)
async def test_bad_purge_is_400(http: Client, headers: Headers, body: Any) -> None:
    await post_bodies(http, headers, "bad", ["keep"])
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await http.post(
        "/v2/queues/bad/purge", data=data, headers={**headers, "Content-Type": "application/json"}
    )
    await error(resp, 400)
    assert await stats(http, headers, "bad") == (0, 1, 1)


async def test_purge_of_missing_queue(http: Client, headers: Headers) -> None:
    body = {"resource_types": ["messages"]}
    await no_content(await http.post("/v2/queues/ghost/purge", json=body, headers=headers))
    await no_content(await http.post("/v2/queues/ghost/purge", headers=headers))
    assert await queue_names(http, headers) == []


async def test_purge_is_scoped_by_project(http: Client, headers: Headers) -> None:
    await post_bodies(http, headers, "mine", ["a"])
    stranger = other_project(headers)
    await no_content(await http.post("/v2/queues/mine/purge", headers=stranger))
    assert await stats(http, headers, "mine") == (0, 1, 1)


# -- JSON-home -----------------------------------------------------------------------------


async def test_home_document_lists_claims(http: Client, headers: Headers) -> None:
    resp = await http.get("/v2/", headers=headers)
    assert resp.status == 200
    check_request_id(resp)
    resources = json.loads(await resp.read())["resources"]
    expected = {
        "rel/claim": "GET",
        "rel/post_claim": "POST",
        "rel/patch_claim": "PATCH",
        "rel/delete_claim": "DELETE",
        "rel/queue_purge": "POST",
        "rel/message_delete": "DELETE",
        "rel/messages_delete": "DELETE",
    }
    for rel, method in expected.items():
        assert rel in resources, sorted(resources)
        assert method in resources[rel]["hints"]["allow"], resources[rel]
    for rel in ("rel/claim", "rel/patch_claim", "rel/delete_claim"):
        template = resources[rel]["href-template"]
        assert template.startswith("/v2/queues/{queue_name}/claims/{claim_id}"), template
        assert {"queue_name", "claim_id"} <= set(resources[rel]["href-vars"])
    post_claim = resources["rel/post_claim"]
    assert post_claim["href-template"].startswith("/v2/queues/{queue_name}/claims")
    assert "limit" in post_claim["href-template"]
    delete = resources["rel/message_delete"]
    assert "{message_id}" in delete["href-template"]
    assert "claim_id" in delete["href-template"].split("{message_id}", 1)[1]
    assert "claim_id" in delete["href-vars"]
    assert "pop" in resources["rel/messages_delete"]["href-template"]
    assert "PATCH" in resources["rel/queue"]["hints"]["allow"]
    assert "include_claimed" in resources["rel/messages"]["href-template"]


async def test_every_home_template_is_served(http: Client, headers: Headers) -> None:
    """Each JSON-home template, filled in, answers each method it allows."""
    resp = await http.get("/v2/", headers=headers)
    resources = json.loads(await resp.read())["resources"]
    for rel, resource in sorted(resources.items()):
        template = resource.get("href-template", resource.get("href"))
        for method in resource["hints"]["allow"]:
            # Fresh state each time: a queue with a claimed message.
            [mid] = await post_bodies(http, headers, "hq", ["m"])
            claim_id, _ = await claim(http, headers, "hq")
            path = template.split("{?", 1)[0].format(
                queue_name="hq", message_id=mid, claim_id=claim_id
            )
            body = {"messages": [{"body": 1}]} if path.endswith("/messages") else None
            resp = await http.request(method, path, json=body, headers=headers)
            assert resp.status not in (404, 405), (rel, method, path, await resp.text())
            await no_content(await http.delete("/v2/queues/hq", headers=headers))
