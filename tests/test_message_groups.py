"""Ordered message groups (issue 32, point 4; docs/consumers.md#ordered-groups).

A posted message may carry ``"group"``; messages of one group are handed
out in post order and at most one claim at a time holds messages of a group.
The interface tests (400s) run on every driver; the rest run on the drivers
listed in :data:`GROUPED_DRIVERS` (the watch drivers' claims of groups are
built beside the lua driver's, on the same layout), against a real Redis,
and some look at its keys: the claim index ``Q:ci``, the groups' ``Q:g:<G>``
and the queue's ``gs`` field.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.api.message_groups import MAX_GROUP_LENGTH
from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import STORAGE_LAYOUTS, Settings
from feedsvc.storage import record
from feedsvc.storage.keys import GROUP_ENTRY, QueueKeys
from tests.conftest import both_layouts, direct_client
from tests.test_api import (
    Client,
    Headers,
    error,
    follow,
    messages_path,
    ok_json,
    other_client,
    post,
)
from tests.test_api_redrive import progress_when
from tests.test_live import next_event, open_stream

#: The drivers that order claims by group so far.
GROUPED_DRIVERS = ["lua"]
grouped = pytest.mark.parametrize("driver", GROUPED_DRIVERS, indirect=True)
both_topologies = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)

BAD_GROUPS: list[Any] = [
    "",
    "a" * (MAX_GROUP_LENGTH + 1),
    "has space",
    "tab\there",
    "new\nline",
    "del\x7f",
    "é",
    7,
    None,
    True,
    ["g"],
    {"g": 1},
]


#: tests that read the older layout's keys, or what is built for it only so far
#: (the GC of expired segment ids in the claim index: compact-expiry's sweep;
#: redriving into a queue in segments)
records_only = pytest.mark.parametrize("storage_layout", ["records"], indirect=True)


@pytest.fixture(params=STORAGE_LAYOUTS)
def storage_layout(request: pytest.FixtureRequest, driver: str) -> str:
    """Both layouts new messages are written in (the segments on the drivers that write them)."""
    return both_layouts(request, driver)


async def claim(
    http: Client, headers: Headers, queue: str, limit: int = 10, ttl: int = 60
) -> tuple[str | None, list[Any]]:
    """(claim id, claimed messages) of a claim; (None, []) when nothing was free."""
    url = f"/v2/queues/{queue}/claims?limit={limit}"
    resp = await http.post(url, json={"ttl": ttl, "grace": 60}, headers=headers)
    if resp.status == 204:
        return None, []
    doc = await ok_json(resp, 201)
    return resp.headers["Location"].rsplit("/", 1)[1], doc["messages"]


async def zset(redis: Any, key: str) -> list[tuple[str, int]]:
    """A zset's (member, score) pairs in order, as text and integers."""
    return [(m.decode(), int(s)) for m, s in await redis.zrange(key, 0, -1, withscores=True)]


async def listed(http: Client, headers: Headers, queue: str, query: str = "") -> list[Any]:
    pages, _ = await follow(http, f"{messages_path(queue)}?limit=20{query}", headers)
    return [m for page in pages for m in page]


@pytest.mark.parametrize("group", BAD_GROUPS, ids=repr)
async def test_a_bad_group_is_a_400_naming_group_and_stores_nothing(
    http: Client, headers: Headers, group: Any
) -> None:
    messages = [{"body": "fine"}, {"body": "bad", "group": group}]
    resp = await http.post(messages_path("bad"), json={"messages": messages}, headers=headers)
    problem = await error(resp, 400)
    assert '"group"' in problem["description"]
    assert await listed(http, other_client(headers), "bad") == []


@grouped
@pytest.mark.parametrize("group", ["a", "!~", "x" * MAX_GROUP_LENGTH, "{tag}:g:1"])
async def test_a_group_at_the_limits_is_accepted(
    http: Client, headers: Headers, group: str
) -> None:
    [message_id] = await post(http, headers, "ok", [{"body": 1, "group": group}])
    shown = await ok_json(await http.get(f"{messages_path('ok')}/{message_id}", headers=headers))
    assert shown["group"] == group


@grouped
async def test_the_group_comes_back_wherever_the_message_is(http: Client, headers: Headers) -> None:
    q = "gq"
    ids = await post(
        http, headers, q, [{"body": 1, "group": "g1", "headers": {"k": "v"}}, {"body": 2}]
    )
    reader = other_client(headers)
    shown = await listed(http, reader, q)
    assert [m.get("group") for m in shown] == ["g1", None]
    assert "group" not in shown[1]
    assert shown[0]["headers"] == {"k": "v"}
    one = await ok_json(await http.get(f"{messages_path(q)}/{ids[0]}", headers=reader))
    assert one["group"] == "g1"
    many = await ok_json(
        await http.get(f"{messages_path(q)}?ids={ids[0]},{ids[1]}", headers=reader)
    )
    assert {m["id"]: m.get("group") for m in many["messages"]} == {ids[0]: "g1", ids[1]: None}
    claim_id, claimed = await claim(http, headers, q, limit=2)
    assert [(m["body"], m.get("group")) for m in claimed] == [(1, "g1"), (2, None)]
    read = await ok_json(await http.get(f"/v2/queues/{q}/claims/{claim_id}", headers=headers))
    assert [m.get("group") for m in read["messages"]] == ["g1", None]
    echoed = await listed(http, headers, q, "&echo=true&include_claimed=true")
    assert [m.get("group") for m in echoed] == ["g1", None]
    # pop
    q2 = "gq2"
    await post(http, headers, q2, [{"body": "p", "group": "g2", "headers": {"k": "v"}}])
    popped = await ok_json(await http.delete(f"{messages_path(q2)}?pop=1", headers=headers))
    assert [(m["body"], m["group"], m["headers"]) for m in popped["messages"]] == [
        ("p", "g2", {"k": "v"})
    ]


@grouped
async def test_a_stream_event_carries_the_group(http: Client, headers: Headers) -> None:
    stream = await open_stream(http, headers)  # the queue "q" of tests/test_live.py
    try:
        await next_event(stream)  # retry
        await post(http, other_client(headers), "q", [{"body": "s", "group": "g"}])
        event = orjson.loads((await next_event(stream))["data"])
    finally:
        stream.close()
    assert (event["body"], event["group"]) == ("s", "g")


@grouped
async def test_a_client_s_own_grouped_messages_stay_hidden_without_echo(
    http: Client, headers: Headers
) -> None:
    """The group rides on the author's line: the echo filter must still know the author."""
    await post(http, headers, "echo", [{"body": "mine", "group": "g"}])
    assert await listed(http, headers, "echo") == []
    [seen] = await listed(http, other_client(headers), "echo")
    assert seen["group"] == "g"


@grouped
async def test_a_topic_accepts_and_returns_a_group(http: Client, headers: Headers) -> None:
    url = "/v2/topics/t/messages"
    resp = await http.post(url, json={"messages": [{"body": 1, "group": "g"}]}, headers=headers)
    await ok_json(resp, 201)
    doc = await ok_json(await http.get(url, headers=other_client(headers)))
    assert [m.get("group") for m in doc["messages"]] == ["g"]


@records_only
@grouped
@both_topologies
async def test_posts_index_grouped_queues_into_the_claim_index_and_the_groups(
    http: Client, headers: Headers, redis_url: str
) -> None:
    q = "ix"
    keys = QueueKeys.of(headers["X-Project-ID"], q)
    redis: Any = direct_client(redis_url)
    try:
        [before] = await post(http, headers, q, [{"body": 0}])
        # a queue that never had a group: no claim index, no gs
        assert await redis.exists(keys.claim_index) == 0
        assert await redis.hget(keys.meta, record.GROUPS_SINCE) is None
        ids = await post(
            http,
            headers,
            q,
            [{"body": 1}, {"body": 2, "group": "a"}, {"body": 3}, {"body": 4, "group": "a"}],
        )
        ids += await post(http, headers, q, [{"body": 5, "group": "b"}, {"body": 6}])
        seq = dict(await zset(redis, keys.index))
        # gs: the seq of the first grouped message; messages before it stay out
        assert int(await redis.hget(keys.meta, record.GROUPS_SINCE)) == seq[ids[1]]
        ci = await zset(redis, keys.claim_index)
        assert ci == [
            (GROUP_ENTRY + "a", seq[ids[1]]),
            (ids[2], seq[ids[2]]),
            (GROUP_ENTRY + "b", seq[ids[4]]),
            (ids[5], seq[ids[5]]),
        ]
        assert before not in dict(ci) and ids[0] not in dict(ci)
        assert await zset(redis, keys.group("a")) == [(ids[1], seq[ids[1]]), (ids[3], seq[ids[3]])]
        assert await zset(redis, keys.group("b")) == [(ids[4], seq[ids[4]])]
    finally:
        await redis.aclose()


@grouped
async def test_a_topic_s_groups_are_not_claim_indexed(
    http: Client, headers: Headers, redis_url: str
) -> None:
    keys = QueueKeys.of(headers["X-Project-ID"], "t", "topic")
    resp = await http.post(
        "/v2/topics/t/messages", json={"messages": [{"body": 1, "group": "g"}]}, headers=headers
    )
    await ok_json(resp, 201)
    redis: Any = direct_client(redis_url)
    try:
        assert await redis.exists(keys.claim_index, keys.group("g")) == 0
        assert await redis.hget(keys.meta, record.GROUPS_SINCE) is None
    finally:
        await redis.aclose()


@pytest.mark.parametrize("headers", [b"", b'{"k":"g=1 2"}'])
@pytest.mark.parametrize("group", ["", "g", "g=x", "{json}"])
def test_the_author_line_carries_group_and_headers_apart(headers: bytes, group: str) -> None:
    author = "1ee16e75-0a78-4d69-a35d-2213afca565a"
    line = record.author_line(author, headers, group)
    assert record.split_author(line) == (author.encode(), group, headers)
    header = record.posted(author, 60, 1000, 7, 0, headers=headers, group=group)
    assert record.Header.decode(header.record(b"{}")) == header


# -- the guarantee ---------------------------------------------------------------


def bodies(messages: list[Any]) -> list[Any]:
    return [m["body"] for m in messages]


def release_path(queue: str, message_id: str, claim_id: str) -> str:
    return f"{messages_path(queue)}/{message_id}/release?claim_id={claim_id}"


def message_path(queue: str, message_id: str, claim_id: str) -> str:
    return f"{messages_path(queue)}/{message_id}?claim_id={claim_id}"


async def pop(http: Client, headers: Headers, queue: str, limit: int = 10) -> list[Any]:
    doc = await ok_json(await http.delete(f"{messages_path(queue)}?pop={limit}", headers=headers))
    return list(doc["messages"])


async def deleted(http: Client, headers: Headers, url: str) -> None:
    resp = await http.delete(url, headers=headers)
    assert resp.status == 204, await resp.text()


@grouped
@both_topologies
async def test_two_claims_never_hold_messages_of_one_group(http: Client, headers: Headers) -> None:
    q = "two"
    await post(
        http,
        headers,
        q,
        [
            {"body": "a1", "group": "a"},
            {"body": "a2", "group": "a"},
            {"body": "u1"},
            {"body": "b1", "group": "b"},
            {"body": "a3", "group": "a"},
            {"body": "u2"},
        ],
    )
    _, first = await claim(http, headers, q, limit=2)
    assert bodies(first) == ["a1", "a2"]
    # a locked group is skipped: the other groups' and the ungrouped messages come
    _, second = await claim(http, headers, q, limit=10)
    assert bodies(second) == ["u1", "b1", "u2"]
    assert await claim(http, headers, q) == (None, [])


@grouped
@both_topologies
async def test_the_next_claim_gets_the_group_s_next_message_after_delete_release_or_expiry(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    q = "next"
    ids = await post(
        http, headers, q, [{"body": f"a{n}", "group": "a"} for n in (1, 2, 3)] + [{"body": "u"}]
    )
    first, got = await claim(http, headers, q, limit=1)
    assert bodies(got) == ["a1"]
    _, got = await claim(http, headers, q, limit=5)
    assert bodies(got) == ["u"]
    assert first is not None
    # deleted: a2 is the head now, and the next claim gets it first
    await deleted(http, headers, message_path(q, ids[0], first))
    second, got = await claim(http, headers, q, limit=1)
    assert bodies(got) == ["a2"]
    # the claim released whole: a2 again
    await deleted(http, headers, f"/v2/queues/{q}/claims/{second}")
    _, got = await claim(http, headers, q, limit=1)
    assert bodies(got) == ["a2"]
    assert await claim(http, headers, q) == (None, [])
    # the claim expired: a2 again, and the rest of the group after it
    clock.advance(61)
    _, got = await claim(http, headers, q, limit=5)
    assert bodies(got) == ["a2", "a3", "u"]


@grouped
async def test_a_delayed_head_blocks_its_group(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    q = "delayed"
    await post(
        http,
        headers,
        q,
        [
            {"body": "a1", "group": "a", "delay": 30},
            {"body": "a2", "group": "a"},
            {"body": "b1", "group": "b"},
        ],
    )
    _, got = await claim(http, headers, q)
    assert bodies(got) == ["b1"]
    clock.advance(31)
    _, got = await claim(http, headers, q)
    assert bodies(got) == ["a1", "a2"]


@grouped
@both_topologies
async def test_releasing_a_message_releases_the_claim_s_later_messages_of_its_group(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    q = "release"
    ids = await post(
        http,
        headers,
        q,
        [
            {"body": "a1", "group": "a"},
            {"body": "a2", "group": "a"},
            {"body": "b1", "group": "b"},
            {"body": "a3", "group": "a"},
        ],
    )
    held, got = await claim(http, headers, q)
    # a group's messages come together, from its head on
    assert held is not None and bodies(got) == ["a1", "a2", "a3", "b1"]
    resp = await http.post(release_path(q, ids[1], held), json={"delay": 30}, headers=headers)
    assert resp.status == 204, await resp.text()
    # a2 and a3 left the claim (a3 may not be handed out before a2); a1 and b1 stay
    doc = await ok_json(await http.get(f"/v2/queues/{q}/claims/{held}", headers=headers))
    assert bodies(doc["messages"]) == ["a1", "b1"]
    assert await claim(http, headers, q) == (None, [])  # a1 still holds the group
    await deleted(http, headers, message_path(q, ids[0], held))
    assert await claim(http, headers, q) == (None, [])  # a2 is not due: it blocks a3
    clock.advance(31)
    _, got = await claim(http, headers, q)
    assert bodies(got) == ["a2", "a3"]


@grouped
@both_topologies
async def test_pop_respects_groups(http: Client, headers: Headers) -> None:
    q = "pop"
    ids = await post(
        http,
        headers,
        q,
        [
            {"body": "a1", "group": "a"},
            {"body": "a2", "group": "a"},
            {"body": "b1", "group": "b"},
            {"body": "b2", "group": "b"},
        ],
    )
    held, _ = await claim(http, headers, q, limit=1)
    assert held is not None
    assert bodies(await pop(http, headers, q)) == ["b1", "b2"]
    await deleted(http, headers, message_path(q, ids[0], held))
    assert bodies(await pop(http, headers, q, limit=1)) == ["a2"]
    assert await pop(http, headers, q) == []


@grouped
async def test_a_hot_group_s_blocked_backlog_does_not_stop_a_claim(
    settings: Settings, clock: ManualClock, headers: Headers
) -> None:
    """3,000 messages of one claimed group stand before another group's
    message, more than a claim may look at (scan_limit 100: 1,000 entries):
    the claim index names the hot group once."""
    q = "hot"
    async with TestClient(TestServer(create_app(settings.replace(scan_limit=100), clock))) as http:
        for _ in range(10):  # (the Location of a post names each id: 300 fit)
            await post(http, headers, q, [{"body": 0, "group": "hot"}] * 300)
        await post(http, headers, q, [{"body": "cold", "group": "cold"}])
        _, got = await claim(http, headers, q, limit=1)
        assert bodies(got) == [0]
        _, got = await claim(http, headers, q, limit=5)
        assert bodies(got) == ["cold"]


@records_only
@grouped
@both_topologies
async def test_expired_grouped_messages_leave_no_stale_ids_after_gc(
    http: Client, headers: Headers, clock: ManualClock, redis_url: str
) -> None:
    q = "gc"
    keys = QueueKeys.of(headers["X-Project-ID"], q)
    await post(
        http,
        headers,
        q,
        [
            {"body": "a1", "group": "a", "ttl": 60},
            {"body": "a2", "group": "a", "ttl": 60},
            {"body": "u", "ttl": 60},
            {"body": "b1", "group": "b", "ttl": 60},
        ],
    )
    clock.advance(61)
    # a post collects the expired messages (no claim walks the groups)
    [kept] = await post(http, headers, q, [{"body": "kept", "ttl": 600}])
    redis: Any = direct_client(redis_url)
    try:
        assert [m for m, _ in await zset(redis, keys.claim_index)] == [kept]
        assert await redis.exists(keys.group("a"), keys.group("b")) == 0
        assert [m for m, _ in await zset(redis, keys.index)] == [kept]
    finally:
        await redis.aclose()


@grouped
async def test_a_claim_wait_wakes_when_the_group_s_head_is_deleted(
    http: Client, headers: Headers
) -> None:
    q = "wake"
    ids = await post(http, headers, q, [{"body": f"a{n}", "group": "a"} for n in (1, 2)])
    held, _ = await claim(http, headers, q, limit=1)
    assert held is not None
    url = f"/v2/queues/{q}/claims?limit=1&wait=10"
    waiting = asyncio.ensure_future(http.post(url, json={"ttl": 60}, headers=headers))
    await asyncio.sleep(0.3)  # let the wait begin (a later start claims at once: still a2)
    assert not waiting.done()
    await deleted(http, headers, message_path(q, ids[0], held))
    resp = await asyncio.wait_for(waiting, 9)  # without a wake-up: 204 after 10 s
    doc = await ok_json(resp, 201)
    assert bodies(doc["messages"]) == ["a2"]


# -- copies keep the group ----------------------------------------------------------


async def dead_lettered(http: Client, headers: Headers) -> list[str]:
    """Two messages of group a and one without, moved from q to dlq."""
    meta = {"_max_claim_count": 1, "_dead_letter_queue": "dlq"}
    assert (await http.put("/v2/queues/q", json=meta, headers=headers)).status == 201
    ids = await post(
        http,
        headers,
        "q",
        [{"body": "a1", "group": "a"}, {"body": "a2", "group": "a"}, {"body": "u"}],
    )
    held, got = await claim(http, headers, "q")
    assert bodies(got) == ["a1", "a2", "u"]
    await deleted(http, headers, f"/v2/queues/q/claims/{held}")
    assert await claim(http, headers, "q") == (None, [])  # all three parked and moved
    return ids


@grouped
@both_topologies
async def test_a_dead_letter_keeps_its_group_and_its_order(
    http: Client, headers: Headers, redis_url: str
) -> None:
    ids = await dead_lettered(http, headers)
    shown = await listed(http, headers, "dlq", "&echo=true")
    assert [(m["id"], m.get("group")) for m in shown] == [
        (ids[0], "a"),
        (ids[1], "a"),
        (ids[2], None),
    ]
    # claimed from the dead-letter queue, the group still holds
    _, got = await claim(http, headers, "dlq", limit=1)
    assert bodies(got) == ["a1"]
    _, got = await claim(http, headers, "dlq")
    assert bodies(got) == ["u"]
    # and the source queue keeps no trace of them
    keys = QueueKeys.of(headers["X-Project-ID"], "q")
    redis: Any = direct_client(redis_url)
    try:
        assert await zset(redis, keys.claim_index) == []
        assert await redis.exists(keys.group("a")) == 0
    finally:
        await redis.aclose()


@records_only
@grouped
async def test_a_redriven_dead_letter_keeps_its_group_and_its_order(
    http: Client, headers: Headers, redis_url: str
) -> None:
    ids = await dead_lettered(http, headers)
    started = await http.post(
        "/v2/queues/dlq/redrive", json={"max_per_second": 50}, headers=headers
    )
    assert started.status == 202
    await progress_when(http, headers, lambda p: p["state"] == "done")
    shown = await listed(http, headers, "q", "&echo=true")
    assert [(m["id"], m.get("group")) for m in shown] == [
        (ids[0], "a"),
        (ids[1], "a"),
        (ids[2], None),
    ]
    _, got = await claim(http, headers, "q", limit=1)
    assert bodies(got) == ["a1"]
    _, got = await claim(http, headers, "q")
    assert bodies(got) == ["u"]
    # the dead-letter queue keeps no trace of them: a group emptied by the
    # redrive keeps its entry until a claim (or the GC) finds it empty
    keys = QueueKeys.of(headers["X-Project-ID"], "dlq")
    redis: Any = direct_client(redis_url)
    try:
        assert await redis.exists(keys.group("a")) == 0
        assert [m for m, _ in await zset(redis, keys.claim_index)] in ([], [GROUP_ENTRY + "a"])
        assert await claim(http, headers, "dlq") == (None, [])
        assert await zset(redis, keys.claim_index) == []
    finally:
        await redis.aclose()


@grouped
@pytest.mark.parametrize("how", ["purge", "delete"])
async def test_purge_and_queue_delete_take_the_claim_index_and_the_groups(
    http: Client, headers: Headers, redis_url: str, how: str
) -> None:
    q = "drop"
    keys = QueueKeys.of(headers["X-Project-ID"], q)
    await post(http, headers, q, [{"body": n, "group": f"g{n % 3}"} for n in range(7)])
    await post(http, headers, q, [{"body": "u"}])
    if how == "purge":
        body = {"resource_types": ["messages"]}
        resp = await http.post(f"/v2/queues/{q}/purge", json=body, headers=headers)
    else:
        resp = await http.delete(f"/v2/queues/{q}", headers=headers)
    assert resp.status == 204, await resp.text()
    redis: Any = direct_client(redis_url)
    try:
        assert await redis.exists(keys.claim_index, *(keys.group(f"g{n}") for n in range(3))) == 0
        assert await redis.hget(keys.meta, record.GROUPS_SINCE) is None
    finally:
        await redis.aclose()
    # a purged queue starts its claim index again with its next grouped post
    await post(http, headers, q, [{"body": "u2"}, {"body": "a", "group": "g0"}])
    _, got = await claim(http, headers, q)
    assert bodies(got) == ["u2", "a"]
