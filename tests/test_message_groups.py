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

from typing import Any

import pytest

from feedsvc.api.message_groups import MAX_GROUP_LENGTH
from feedsvc.storage import record
from feedsvc.storage.keys import GROUP_ENTRY, QueueKeys
from tests.conftest import direct_client
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
