"""Subscriptions over HTTP (``/v2/queues/{q}/subscriptions``), Zaqar's answers.

Runs per driver, on one server and on the Redis Cluster (CLUSTER_SUITES).
Expiry is checked with the ManualClock; delivery is in test_delivery.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from feedsvc.appkeys import STORE
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from tests.conftest import direct_client

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
SUBS = "/v2/queues/fans/subscriptions"
FRAMING_HEADERS = ("Content-Length", "transfer-encoding", "Host", "Connection", "Upgrade", "TE",
                   "Trailer", "Keep-Alive", "Proxy-Authorization", "Expect")  # fmt: skip


async def create(
    http: Client, headers: Headers, subscriber: str = "http://example.com/hook", **extra: Any
) -> str:
    body = {"subscriber": subscriber, "ttl": 600, "options": {"a": 1}, **extra}
    resp = await http.post(SUBS, json=body, headers=headers)
    assert resp.status == 201, await resp.text()
    assert resp.headers["Location"] == SUBS
    sid: str = (await resp.json())["subscription_id"]
    return sid


async def listed(http: Client, headers: Headers, query: str = "") -> dict[str, Any]:
    resp = await http.get(SUBS + query, headers=headers)
    assert resp.status == 200, await resp.text()
    doc: dict[str, Any] = await resp.json()
    return doc


async def test_create_get_delete(http: Client, headers: Headers) -> None:
    sid = await create(http, headers)
    resp = await http.get(f"{SUBS}/{sid}", headers=headers)
    assert resp.status == 200
    doc = await resp.json()
    assert {k: doc[k] for k in ("id", "source", "subscriber", "ttl", "options", "confirmed")} == {
        "id": sid,
        "source": "fans",
        "subscriber": "http://example.com/hook",
        "ttl": 600,
        "options": {"a": 1},
        "confirmed": False,
    }
    assert doc["age"] == 0
    assert doc["delivery"] == {"delivered": 0, "failures": 0, "retrying": 0, "last_error": None}
    # the queue was created by the subscription
    assert (await http.get("/v2/queues/fans", headers=headers)).status == 200
    assert (await http.delete(f"{SUBS}/{sid}", headers=headers)).status == 204
    assert (await http.get(f"{SUBS}/{sid}", headers=headers)).status == 404
    assert (await http.delete(f"{SUBS}/{sid}", headers=headers)).status == 204
    assert (await listed(http, headers))["subscriptions"] == []


async def test_same_subscriber_twice_is_the_same_subscription_until_confirmed(
    http: Client, headers: Headers
) -> None:
    first = await create(http, headers)
    assert await create(http, headers) == first
    resp = await http.put(f"{SUBS}/{first}/confirm", json={"confirmed": True}, headers=headers)
    assert resp.status == 204
    resp = await http.post(SUBS, json={"subscriber": "http://example.com/hook"}, headers=headers)
    assert resp.status == 409
    assert "already exists" in (await resp.json())["description"]
    assert len((await listed(http, headers))["subscriptions"]) == 1
    got = await (await http.get(f"{SUBS}/{first}", headers=headers)).json()
    assert got["confirmed"] is True


async def test_a_repeated_post_says_it_changed_nothing(http: Client, headers: Headers) -> None:
    resp = await http.post(SUBS, json={"subscriber": "http://example.com/hook"}, headers=headers)
    assert resp.status == 201
    assert "X-Subscription-Existing" not in resp.headers
    sid = (await resp.json())["subscription_id"]
    again = {"subscriber": "http://example.com/hook", "ttl": 120, "options": {"b": 2}}
    resp = await http.post(SUBS, json=again, headers=headers)
    assert resp.status == 201  # Zaqar's answer, which its clients expect
    assert await resp.json() == {"subscription_id": sid}
    assert resp.headers["X-Subscription-Existing"] == "true"
    got = await (await http.get(f"{SUBS}/{sid}", headers=headers)).json()
    assert (got["ttl"], got["options"]) == (3600, {})  # a PATCH changes them


async def test_projects_and_queues_do_not_share_subscriptions(
    http: Client, headers: Headers
) -> None:
    sid = await create(http, headers)
    other = {**headers, "X-Project-ID": headers["X-Project-ID"] + "-other"}
    assert (await http.get(f"{SUBS}/{sid}", headers=other)).status == 404
    path = f"/v2/queues/elsewhere/subscriptions/{sid}"
    assert (await http.get(path, headers=headers)).status == 404
    # the same subscriber on another queue is another subscription
    resp = await http.post(
        "/v2/queues/elsewhere/subscriptions",
        json={"subscriber": "http://example.com/hook"},
        headers=headers,
    )
    assert resp.status == 201
    assert (await resp.json())["subscription_id"] != sid


async def test_listing_pages_by_id(http: Client, headers: Headers) -> None:
    made = sorted([await create(http, headers, f"http://example.com/{i}") for i in range(7)])
    seen: list[str] = []
    query = "?limit=3"
    for _ in range(10):
        doc = await listed(http, headers, query)
        ids = [s["id"] for s in doc["subscriptions"]]
        if not ids:
            assert doc["links"] == []
            break
        assert len(ids) <= 3
        seen += ids
        [link] = doc["links"]
        assert link["rel"] == "next"
        assert "limit=3" in link["href"]
        query = "?" + link["href"].split("?", 1)[1]
    assert seen == made
    doc = await listed(http, headers, f"?marker={made[3]}")
    assert [s["id"] for s in doc["subscriptions"]] == made[4:]


@pytest.mark.parametrize("query", ["?limit=0", "?limit=21", "?limit=x"])
async def test_listing_limit_out_of_range_is_400(
    http: Client, headers: Headers, query: str
) -> None:
    assert (await http.get(SUBS + query, headers=headers)).status == 400


async def test_patch(http: Client, headers: Headers) -> None:
    sid = await create(http, headers)
    taken = await create(http, headers, "mailto:ops@example.com")
    resp = await http.patch(
        f"{SUBS}/{sid}",
        json={"ttl": 300, "options": {"b": 2}, "subscriber": "https://example.org/x"},
        headers=headers,
    )
    assert resp.status == 204
    doc = await (await http.get(f"{SUBS}/{sid}", headers=headers)).json()
    assert (doc["ttl"], doc["options"], doc["subscriber"]) == (
        300,
        {"b": 2},
        "https://example.org/x",
    )
    # the old subscriber is free again, the taken one is not
    resp = await http.patch(
        f"{SUBS}/{sid}", json={"subscriber": "mailto:ops@example.com"}, headers=headers
    )
    assert resp.status == 409
    assert await create(http, headers, "http://example.com/hook") not in (sid, taken)
    assert (await http.patch(f"{SUBS}/{taken}", json={"ttl": 120}, headers=headers)).status == 204


async def test_patch_unknown_is_404_and_bad_body_400(http: Client, headers: Headers) -> None:
    missing = "00000000-0000-4000-8000-000000000000"
    assert (await http.patch(f"{SUBS}/{missing}", json={"ttl": 300}, headers=headers)).status == 404
    assert (await http.patch(f"{SUBS}/x", json={"ttl": 300}, headers=headers)).status == 404
    resp = await http.patch(f"{SUBS}/x", json=[1], headers=headers)
    assert resp.status == 400
    assert (await resp.json())["description"] == "Subscriptions must be a dict."
    assert (await http.patch(f"{SUBS}/x", json={"ttl": "1"}, headers=headers)).status == 400
    assert (await http.patch(f"{SUBS}/x", headers=headers)).status == 400


async def test_expiry_is_exact(http: Client, headers: Headers, clock: ManualClock) -> None:
    short = await create(http, headers, "http://example.com/short", ttl=60)
    long = await create(http, headers, "http://example.com/long")
    clock.advance(59.9)
    assert (await http.get(f"{SUBS}/{short}", headers=headers)).status == 200
    clock.advance(0.2)
    assert (await http.get(f"{SUBS}/{short}", headers=headers)).status == 404
    assert [s["id"] for s in (await listed(http, headers))["subscriptions"]] == [long]
    # the subscriber is free again
    again = await create(http, headers, "http://example.com/short", ttl=60)
    assert again != short


async def test_patch_ttl_restarts_the_clock(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    sid = await create(http, headers)
    clock.advance(500)
    assert (await http.patch(f"{SUBS}/{sid}", json={"ttl": 60}, headers=headers)).status == 204
    clock.advance(59)
    assert (await http.get(f"{SUBS}/{sid}", headers=headers)).status == 200
    clock.advance(2)
    assert (await http.get(f"{SUBS}/{sid}", headers=headers)).status == 404
    assert (await http.patch(f"{SUBS}/{sid}", json={"ttl": 60}, headers=headers)).status == 404


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "Missing parameter subscriber"),
        ({"subscriber": "fake"}, "must be supported in the list"),
        ({"subscriber": "email://fake"}, "must be supported in the list"),
        ({"subscriber": "trust+http://x.example"}, "must be supported in the list"),
        ({"subscriber": 5}, "URI string"),
        ({"subscriber": "http://e.com", "options": 1}, "must be a dict"),
        ({"subscriber": "http://e.com", "ttl": "1"}, "must be an integer"),
        ({"subscriber": "http://e.com", "ttl": True}, "must be an integer"),
        ({"subscriber": "http://e.com", "ttl": 59}, "at least 60 seconds"),
        ({"subscriber": "http://e.com", "ttl": 99999999999999999}, "less than"),
        ({"subscriber": "http://10.0.0.1/x"}, "not public"),
        ({"subscriber": "http://[::1]/x"}, "not public"),
        ({"subscriber": "http://169.254.169.254/latest"}, "not public"),
        ({"subscriber": "http:///nohost"}, "needs a host"),
        ({"subscriber": "mailto:nobody"}, "needs an address"),
        (
            {"subscriber": "http://e.com", "options": {"_retry_policy": {"minimum_delay": "1"}}},
            "must be a integer",
        ),
        (
            {"subscriber": "http://e.com", "options": {"_retry_policy": {"maximum_delay": 1}}},
            "minimum_delay must less than maximum_delay",
        ),
        (
            {
                "subscriber": "http://e.com",
                "options": {"_retry_policy": {"retry_backoff_function": "cubic"}},
            },
            "invalid retry_backoff_function",
        ),
        ({"subscriber": "http://e.com", "options": {"post_headers": {"a": 1}}}, "post_headers"),
        (
            {"subscriber": "http://e.com", "options": {"post_headers": {"a": "x\r\nEvil: 1"}}},
            "post_headers",
        ),
        ({"subscriber": "http://e.com", "options": {"post_headers": {"a b": "x"}}}, "post_headers"),
        ({"subscriber": "http://e.com", "options": {"n": 2**70}}, "64 bits"),
        # issue 28: subscribers that can never be reached
        ({"subscriber": "http://[::1/"}, "not a valid URL"),
        ({"subscriber": "http://e.com:99999/hook"}, "Port out of range"),
        ({"subscriber": "http://e.com:abc/hook"}, "not a valid URL"),
        ({"subscriber": "http://e.com:0/hook"}, "port must be from 1 to 65535"),
        ({"subscriber": "http://exa mple.com/hook"}, "spaces or control characters"),
        ({"subscriber": "http://-x-.com/hook"}, "not a valid name"),
        ({"subscriber": "mailto:a@b.com\r\nBcc:c@d.com"}, "spaces or control characters"),
        ({"subscriber": "mailto:a@b.com%0D%0ABcc:c@d.com"}, "is not one"),
        ({"subscriber": "mailto:a,b"}, "'a' is not one"),
        ({"subscriber": "mailto:" + ",".join(["a@b.com"] * 11)}, "at most 10 addresses"),
        ({"subscriber": "mailto:a@b.com?subject=x%0ABcc:c@d.com"}, "one line"),
        ({"subscriber": "mailto:a@b.com", "options": {"from": "x@y.com\nBcc: z"}}, "options.from"),
        ({"subscriber": "mailto:a@b.com", "options": {"from": "nobody"}}, "not a mail address"),
        ({"subscriber": "mailto:a@b.com", "options": {"subject": 5}}, "one line"),
        # issue 28: headers that frame the request or are not HTTP
        *[
            (
                {"subscriber": "http://e.com", "options": {"post_headers": {name: "5"}}},
                "HTTP client",
            )
            for name in FRAMING_HEADERS
        ],
        ({"subscriber": "http://e.com", "options": {"post_headers": {"a": "x\x00y"}}}, "ASCII"),
        ({"subscriber": "http://e.com", "options": {"post_headers": {"a": " x"}}}, "ASCII"),
        ({"subscriber": "http://e.com", "options": {"post_headers": {"a": "\u00e9"}}}, "ASCII"),
        (
            {"subscriber": "http://e.com", "options": {"post_headers": {"é": "x"}}},
            "not an HTTP header name",
        ),
        (
            {
                "subscriber": "http://e.com",
                "options": {"post_headers": {f"h{i}": "x" for i in range(33)}},
            },
            "at most 32 headers",
        ),
        (
            {"subscriber": "http://e.com", "options": {"post_headers": {"a": "x" * 9000}}},
            "at most 8192 bytes",
        ),
        # issue 28: the retry policy's numbers are bounded; null is not a number
        *[
            (
                {"subscriber": "http://e.com", "options": {"_retry_policy": {key: value}}},
                words,
            )
            for key, value, words in [
                ("retries_with_no_delay", 100000000, "at most 100"),
                ("retries_with_no_delay", 101, "at most 100"),
                ("minimum_delay_retries", 1001, "at most 1000"),
                ("maximum_delay_retries", 10**18, "at most 1000"),
                ("maximum_delay", 10**9, "at most 86400"),
                ("minimum_delay", 86401, "at most 86400"),
                ("minimum_delay", None, "must be a integer"),
                ("maximum_delay", None, "must be a integer"),
                ("retries_with_no_delay", None, "must be a integer"),
                ("maximum_delay", -1, "must not be negative"),
            ]
        ],
        ({"subscriber": "http://e.com/" + "x" * 5000}, "at most 4096"),
    ],
)
async def test_bad_subscription_is_400_and_changes_nothing(
    http: Client, headers: Headers, body: dict[str, Any], words: str
) -> None:
    resp = await http.post(SUBS, json=body, headers=headers)
    assert resp.status == 400
    assert words in (await resp.json())["description"]
    assert (await listed(http, headers))["subscriptions"] == []


async def test_unparsable_body_is_400(http: Client, headers: Headers) -> None:
    resp = await http.post(SUBS, data=b'{"subscriber": x}', headers=headers)
    assert resp.status == 400
    assert "body could not be parsed" in (await resp.json())["description"]


async def test_confirm(http: Client, headers: Headers) -> None:
    sid = await create(http, headers)
    path = f"{SUBS}/{sid}/confirm"
    resp = await http.put(path, json={"confirmed": 123}, headers=headers)
    assert resp.status == 400
    assert (await resp.json())["description"] == "The 'confirmed' should be boolean."
    missing = f"{SUBS}/00000000-0000-4000-8000-000000000000/confirm"
    assert (await http.put(missing, json={"confirmed": True}, headers=headers)).status == 404
    assert (await http.put(path, json={"confirmed": True}, headers=headers)).status == 204
    doc = await (await http.get(f"{SUBS}/{sid}", headers=headers)).json()
    assert doc["confirmed"] is True
    assert (await http.put(path, json={"confirmed": False}, headers=headers)).status == 204
    doc = await (await http.get(f"{SUBS}/{sid}", headers=headers)).json()
    assert doc["confirmed"] is False


async def test_purge_keeps_or_drops_subscriptions(http: Client, headers: Headers) -> None:
    sid = await create(http, headers)
    await http.post("/v2/queues/fans/messages", json={"messages": [{"body": 1}]}, headers=headers)
    purge = "/v2/queues/fans/purge"
    resp = await http.post(purge, json={"resource_types": ["messages"]}, headers=headers)
    assert resp.status == 204
    assert (await http.get(f"{SUBS}/{sid}", headers=headers)).status == 200
    resp = await http.post(purge, json={"resource_types": ["subscriptions"]}, headers=headers)
    assert resp.status == 204
    assert (await http.get(f"{SUBS}/{sid}", headers=headers)).status == 404


async def test_deleting_the_queue_deletes_its_subscriptions(
    http: Client, headers: Headers, settings: Settings
) -> None:
    for i in range(3):
        await create(http, headers, f"http://example.com/{i}")
    assert (await http.delete("/v2/queues/fans", headers=headers)).status == 204
    assert (await listed(http, headers))["subscriptions"] == []
    redis = direct_client(str(settings.redis_url))
    try:
        project = headers["X-Project-ID"]
        left = [k async for k in redis.scan_iter(match=f"fs:{{{project}/fans}}*")]
        assert left == []
    finally:
        await redis.aclose()


async def test_queue_retry_policy_is_checked_as_zaqar_does(http: Client, headers: Headers) -> None:
    bad = {"_retry_policy": {"minimum_delay": 20, "maximum_delay": 25}}
    resp = await http.put("/v2/queues/fans", json=bad, headers=headers)
    assert resp.status == 400
    assert "invalid minimum_delay and maximum_delay" in (await resp.json())["description"]
    good = {"_retry_policy": {"minimum_delay": 20, "maximum_delay": 40}}
    assert (await http.put("/v2/queues/fans", json=good, headers=headers)).status == 201
    got = await (await http.get("/v2/queues/fans", headers=headers)).json()
    assert got["_retry_policy"] == good["_retry_policy"]


@pytest.mark.parametrize(
    ("policy", "words"),
    [
        ({"retries_with_no_delay": 100000000}, "at most 100"),
        ({"maximum_delay": 10**9}, "at most 86400"),
        ({"minimum_delay": None}, "must be a integer"),
        ({"maximum_delay": None}, "must be a integer"),
    ],
)
async def test_queue_retry_policy_is_bounded(
    http: Client, headers: Headers, policy: dict[str, Any], words: str
) -> None:
    resp = await http.put("/v2/queues/fans", json={"_retry_policy": policy}, headers=headers)
    assert resp.status == 400
    assert words in (await resp.json())["description"]
    # 201: the refused PUT made no queue
    assert (await http.put("/v2/queues/fans", json={"k": 1}, headers=headers)).status == 201
    before = await (await http.get("/v2/queues/fans", headers=headers)).json()
    patch = [{"op": "add", "path": "/metadata/_retry_policy", "value": policy}]
    resp = await http.patch(
        "/v2/queues/fans",
        json=patch,
        headers={**headers, "Content-Type": "application/openstack-messaging-v2.0-json-patch"},
    )
    assert resp.status == 400
    assert words in (await resp.json())["description"]
    assert await (await http.get("/v2/queues/fans", headers=headers)).json() == before


async def test_retry_policy_at_its_bounds_is_kept(http: Client, headers: Headers) -> None:
    policy = {
        "retries_with_no_delay": 100,
        "minimum_delay_retries": 1000,
        "minimum_delay": 0,
        "maximum_delay": 86400,
        "maximum_delay_retries": 1000,
        "retry_backoff_function": "geometric",
    }
    sid = await create(http, headers, options={"_retry_policy": policy})
    got = await (await http.get(f"{SUBS}/{sid}", headers=headers)).json()
    assert got["options"]["_retry_policy"] == policy


async def test_patch_with_bad_input_is_400_and_changes_nothing(
    http: Client, headers: Headers
) -> None:
    sid = await create(http, headers)
    before = await (await http.get(f"{SUBS}/{sid}", headers=headers)).json()
    for body in (
        {"subscriber": "http://e.com:99999/"},
        {"subscriber": "mailto:a,b"},
        {"options": {"_retry_policy": {"retries_with_no_delay": 100000000}}},
        {"options": {"_retry_policy": {"minimum_delay": None}}},
        {"options": {"post_headers": {"Content-Length": "5"}}},
    ):
        resp = await http.patch(f"{SUBS}/{sid}", json=body, headers=headers)
        assert resp.status == 400, body
    after = await (await http.get(f"{SUBS}/{sid}", headers=headers)).json()
    assert after == before


async def test_several_mail_addresses_and_odd_hosts_are_accepted(
    http: Client, headers: Headers
) -> None:
    for subscriber in (
        "mailto:a@example.com,b@example.org?subject=Hi",
        "http://b\u00fccher.example/hook",
        "http://under_score.example:8080/hook",
        "https://[2a00:1450:4001::1]:8443/hook",
        "HTTPS://example.com/upper",
    ):
        await create(http, headers, subscriber)


async def test_concurrent_creates_on_one_queue_are_all_201(http: Client, headers: Headers) -> None:
    """Issue 28 item 7: 50 creates at once on one queue did conflict with
    each other over the queue's subscriber map, and a few ran out of
    attempts into a 503. Now they do not wait on each other at all."""
    assert (await http.put("/v2/queues/fans", headers=headers)).status == 201
    store = http.app[STORE]
    before = store.counters.watch_retries
    bodies = [{"subscriber": f"http://example.com/hook/{i}", "ttl": 600} for i in range(50)]
    answers = await asyncio.gather(*(http.post(SUBS, json=b, headers=headers) for b in bodies))
    assert [r.status for r in answers] == [201] * 50
    assert store.counters.watch_retries == before
    doc = await listed(http, headers, "?limit=20")
    assert len(doc["subscriptions"]) == 20
