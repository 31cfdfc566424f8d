"""Upgrade safety of the message record (record.py's docstring): messages
written by the release before the compact header, in the legacy layout (a
field per value), are still listed, fetched, claimed, renewed, released,
deleted, popped, dead-lettered and expired, on both drivers, single Redis
and Cluster; a write to one moves it to the new layout atomically.

The legacy records are written here with raw Redis commands, as that
release's post script wrote them.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import orjson
import pytest

from feedsvc.clock import ManualClock
from feedsvc.errors import MessageIsClaimed
from feedsvc.storage import record
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.keys import QueueKeys, escape_project, registry_key
from tests.conftest import direct_client

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())
# the legacy layout's field names, spelt out: they are the old release's
LEGACY_FIELDS = ("t", "c", "e", "u", "s", "d", "k", "x", "n")


async def post_legacy(
    redis_url: str,
    project: str,
    queue: str,
    now: int,
    n: int,
    ttl: int = 300,
    delay: int = 0,
    author: str = WRITER,
    count: int = 0,
) -> list[str]:
    """Post n messages (bodies 0..n-1) as the legacy release did."""
    keys = QueueKeys.of(project, queue)
    client = direct_client(redis_url)
    ids = [uuid.uuid4().hex[:24] for _ in range(n)]
    try:
        await client.zadd(registry_key(project), {queue: 0})
        await client.hsetnx(keys.meta, "c", now)
        await client.set(keys.seq, now * 1000, nx=True)
        for i, message_id in enumerate(ids):
            key = keys.message(message_id)
            seq = int(await client.incr(keys.seq))
            expires = now + ttl * 1000
            due = now + delay * 1000 if delay else 0
            fields: dict[str, bytes | str | int] = {
                "b": orjson.dumps(i),
                "u": author,
                "s": seq,
                "t": ttl,
            }
            fields |= {"c": now, "e": expires, "d": due, "k": "", "x": 0, "n": count}
            await client.execute_command("HSET", key, *record.flat(fields))
            await client.pexpireat(key, expires)
            await client.zadd(keys.index, {message_id: seq})
            await client.zadd(keys.expiry, {message_id: expires})
    finally:
        await client.aclose()
    return ids


async def layout_of(redis_url: str, project: str, queue: str, message_id: str) -> str:
    """Where a message is: 'record' (this release), 'legacy', or 'gone'."""
    keys = QueueKeys.of(project, queue)
    client = direct_client(redis_url)
    try:
        new, old = (
            await client.exists(keys.record(message_id)),
            await client.exists(keys.message(message_id)),
        )
    finally:
        await client.aclose()
    assert not (new and old), "a message in both layouts"
    return "record" if new else "legacy" if old else "gone"


async def post(store: FeedStore, project: str, n: int, first: int) -> list[str]:
    batch = [NewMessage(orjson.dumps(first + i), 300) for i in range(n)]
    return await store.post_messages(project, "q", WRITER, batch)


async def read_all(store: FeedStore, project: str, limit: int, **query: Any) -> list[Any]:
    seen: list[Any] = []
    marker = None
    while True:
        page = await store.list_messages(
            project, "q", ListQuery(READER, marker=marker, limit=limit, **query)
        )
        if not page.messages:
            return seen
        seen += page.messages
        marker = page.next_marker


@pytest.mark.parametrize("limit", [1, 2, 10])
async def test_legacy_messages_are_listed_and_fetched_like_new_ones(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock, limit: int
) -> None:
    now = clock.now_ms()
    old = await post_legacy(redis_url, project, "q", now, 3)
    new = await post(store, project, 3, first=3)
    clock.advance(2)
    seen = await read_all(store, project, limit)
    assert [m.id for m in seen] == old + new
    assert [orjson.loads(m.body) for m in seen] == list(range(6))
    assert [(m.ttl, m.created_ms, m.claim_id, m.claim_count) for m in seen] == [
        (300, now, None, 0)
    ] * 6
    assert seen == sorted(seen, key=lambda m: m.seq)
    # by id: the same messages
    fetched = await store.get_messages(project, "q", [*old, *new])
    assert [dataclasses.replace(m, author=None) for m in fetched] == [
        dataclasses.replace(m, author=None) for m in seen
    ]
    # echo and the poster's own messages: hidden from the writer without echo
    page = await store.list_messages(project, "q", ListQuery(WRITER))
    assert page.messages == []
    authored = await store.list_messages(project, "q", ListQuery(READER, with_authors=True))
    assert {m.author for m in authored.messages} == {WRITER}
    stats = await store.queue_stats(project, "q")
    assert (stats.total, stats.oldest and stats.oldest.id) == (6, old[0])
    assert stats.newest is not None and stats.newest.id == new[-1]
    # reading migrates nothing: a read is a read
    assert await layout_of(redis_url, project, "q", old[0]) == "legacy"


async def test_legacy_delayed_and_expired_messages(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    now = clock.now_ms()
    [short] = await post_legacy(redis_url, project, "q", now, 1, ttl=60)
    [delayed] = await post_legacy(redis_url, project, "q", now, 1, delay=30)
    assert [m.id for m in await read_all(store, project, 10)] == [short]
    hidden = await read_all(store, project, 10, include_delayed=True)
    assert [m.id for m in hidden] == [short, delayed]
    clock.advance(61)
    assert [m.id for m in await read_all(store, project, 10)] == [delayed]
    assert await store.get_messages(project, "q", [short]) == []
    assert (await store.queue_stats(project, "q")).total == 1


async def test_claiming_a_legacy_message_migrates_it(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    now = clock.now_ms()
    old = await post_legacy(redis_url, project, "q", now, 2)
    claim = await store.claim_messages(project, "q", 600, 60, 1)
    assert claim is not None and [m.id for m in claim.messages] == old[:1]
    [claimed] = claim.messages
    # held longer than its 300 s ttl: the claim extends it (rule 5)
    assert (claimed.ttl, claimed.claim_count, claimed.created_ms) == (660, 1, now)
    assert await layout_of(redis_url, project, "q", old[0]) == "record"
    assert await layout_of(redis_url, project, "q", old[1]) == "legacy"
    # listed as claimed, hidden from an ordinary list, not claimable again
    assert [m.id for m in await read_all(store, project, 10)] == old[1:]
    held = await read_all(store, project, 10, include_claimed=True)
    assert [(m.id, m.claim_id) for m in held] == [(old[0], claim.id), (old[1], None)]
    again = await store.claim_messages(project, "q", 600, 60, 5)
    assert again is not None and [m.id for m in again.messages] == old[1:]
    await store.renew_claim(project, "q", claim.id, 900, 60)
    [renewed] = (await store.get_claim(project, "q", claim.id)).messages
    assert renewed.ttl == 960
    await store.release_claim(project, "q", claim.id)
    [freed] = await store.get_messages(project, "q", old[:1])
    assert (freed.claim_id, freed.claim_count, orjson.loads(freed.body)) == (None, 1, 0)


async def test_a_legacy_claim_still_holds_its_messages(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    """A message claimed under the legacy release (claim fields in the
    message hash, the claim hash as before) stays claimed: exclusive, listed
    as held, deleted only with its claim id, renewed and released."""
    now = clock.now_ms()
    held, free = await post_legacy(redis_url, project, "q", now, 2, count=1)
    keys = QueueKeys.of(project, "q")
    claim_id, expires = "ab" * 12, now + 120_000
    client = direct_client(redis_url)
    try:
        await client.hset(keys.message(held), mapping={"k": claim_id, "x": expires})
        await client.zadd(keys.claimed, {held: expires})
        claim: dict[str, str | int] = {"t": 120, "g": 60, "c": now, "x": expires, "ids": held}
        await client.execute_command("HSET", keys.claim(claim_id), *record.flat(claim))
        await client.pexpireat(keys.claim(claim_id), expires)
        await client.zadd(keys.claims, {claim_id: expires})
    finally:
        await client.aclose()
    assert [m.id for m in await read_all(store, project, 10)] == [free]
    listed = await read_all(store, project, 10, include_claimed=True)
    assert [(m.id, m.claim_id, m.claim_count) for m in listed] == [
        (held, claim_id, 1),
        (free, None, 1),
    ]
    taken = await store.claim_messages(project, "q", 300, 60, 5)
    assert taken is not None and [m.id for m in taken.messages] == [free]
    assert [m.id for m in (await store.get_claim(project, "q", claim_id)).messages] == [held]
    with pytest.raises(MessageIsClaimed):
        await store.delete_message(project, "q", held, None)
    await store.renew_claim(project, "q", claim_id, 600, 60)
    assert await layout_of(redis_url, project, "q", held) == "record"
    [renewed] = await store.get_messages(project, "q", [held])
    assert (renewed.claim_id, renewed.ttl) == (claim_id, 660)
    await store.delete_message(project, "q", held, claim_id)
    assert await store.get_messages(project, "q", [held]) == []


async def test_legacy_messages_are_popped_and_deleted(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    a, b, c = await post_legacy(redis_url, project, "q", clock.now_ms(), 3)
    popped = await store.pop_messages(project, "q", 1)
    assert [(m.id, orjson.loads(m.body)) for m in popped] == [(a, 0)]
    await store.delete_message(project, "q", b, None)
    await store.delete_messages(project, "q", [c])
    assert await read_all(store, project, 10) == []
    assert {await layout_of(redis_url, project, "q", i) for i in (a, b, c)} == {"gone"}
    assert (await store.queue_stats(project, "q")).total == 0


async def test_a_legacy_message_claimed_too_often_is_dead_lettered(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    await store.create_queue(project, "q", {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    [tired] = await post_legacy(redis_url, project, "q", clock.now_ms(), 1, count=1)
    assert await store.claim_messages(project, "q", 300, 60, 5) is None
    dead = (await store.list_messages(project, "dlq", ListQuery(READER))).messages
    assert [(m.id, orjson.loads(m.body), m.claim_count) for m in dead] == [(tired, 0, 1)]
    assert await store.get_messages(project, "q", [tired]) == []


def test_the_legacy_fields_are_the_ones_record_reads() -> None:
    """The names this test writes are the ones record.py reads as legacy."""
    assert set(record.ROW) == {"b", *LEGACY_FIELDS}


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
async def test_deleting_or_purging_a_queue_removes_legacy_messages(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock, keep: bool
) -> None:
    old = await post_legacy(redis_url, project, "q", clock.now_ms(), 3)
    new = await post(store, project, 2, first=3)
    if keep:
        await store.purge_queue(project, "q")
        assert await read_all(store, project, 10) == []
    else:
        await store.delete_queue(project, "q")
    assert {await layout_of(redis_url, project, "q", i) for i in old + new} == {"gone"}
    client = direct_client(redis_url)
    try:
        left = [k async for k in client.scan_iter(match=f"*{escape_project(project)}*:[mr]:*")]
    finally:
        await client.aclose()
    assert left == []
