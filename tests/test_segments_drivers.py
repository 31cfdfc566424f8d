"""The segment layout is one layout whichever driver writes it (issue 30):
the watch drivers (WATCH / MULTI / EXEC, storage/watch_segments.py) write
the very bytes the lua driver's scripts write, and a queue written by one
is read by the other, also while both post to it at once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import orjson
import pytest

from feedsvc.clock import ManualClock
from feedsvc.storage import segments
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.segment_pages import ReadReply, read_by_commands
from feedsvc.storage.watch_store import WatchStore
from tests.conftest import direct_client, make_settings, opened_store

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())

StoreMaker = Callable[[str], AbstractAsyncContextManager[FeedStore]]


@pytest.fixture(params=["watch", "watch-naive"])
def driver(request: pytest.FixtureRequest) -> str:
    """The driver set beside lua."""
    return str(request.param)


@pytest.fixture
def stores(redis_url: str, clock: ManualClock) -> StoreMaker:
    @asynccontextmanager
    async def opened(driver: str) -> AsyncIterator[FeedStore]:
        settings = make_settings(
            redis_url, driver=driver, storage_layout="segments", max_messages_per_post=100
        )
        async with opened_store(settings, clock) as feed:
            yield feed

    return opened


def body(n: int) -> bytes:
    return orjson.dumps({"n": n, "pad": "x" * (n % 17)})


def batch(n: int, size: int) -> list[NewMessage]:
    """Messages n.. of every kind: ttls, delays, headers, groups."""
    return [
        NewMessage(
            body(i),
            ttl=60 + i % 5 * 100,
            delay=30 if i % 11 == 0 else None,
            headers=b'{"h":"%d"}' % i if i % 4 == 0 else b"",
            group=f"g{i % 3}" if i % 7 == 0 else "",
        )
        for i in range(n, n + size)
    ]


async def read_all(store: FeedStore, project: str, queue: str, limit: int) -> list[int]:
    seen: list[int] = []
    marker = None
    for _ in range(10_000):
        page = await store.list_messages(
            project, queue, ListQuery(READER, marker=marker, limit=limit, include_delayed=True)
        )
        if not page.messages:
            return seen
        seen += [orjson.loads(m.body)["n"] for m in page.messages]
        marker = page.next_marker
    raise AssertionError("the pages never ended")


async def layout_of(redis_url: str, keys: QueueKeys) -> dict[str, Any]:
    """Everything a post writes of a queue in segments, as stored."""
    client = direct_client(redis_url)
    try:
        members: Any = await client.zrange(keys.directory, 0, -1)
        numbers = [int(k) for k in members]
        out: dict[str, Any] = {"dir": numbers, "seq": await client.get(keys.seq)}
        for k in numbers:
            key = keys.segment(k)
            out[f"p{k}"] = (await client.get(key), await client.pexpiretime(key))
        meta = await client.hgetall(keys.meta)
        out["meta"] = sorted((f, v) for f, v in meta.items() if f != b"m")
        out["ci"] = await client.zrange(keys.claim_index, 0, -1, withscores=True)
        for g in ("g0", "g1", "g2"):
            out[g] = await client.zrange(keys.group(g), 0, -1, withscores=True)
        out["idem"] = sorted((await client.hgetall(keys.idempotency)).values())
        out["counts"] = sorted((await client.hgetall(keys.segment_counts)).items())
        out["reviews"] = await client.zrange(keys.reviews, 0, -1, withscores=True)
        return out
    finally:
        await client.aclose()


@pytest.mark.parametrize("sizes", [[1, 7, 100, 33, 1, 99, 40], [100, 100, 60]])
async def test_both_drivers_write_the_same_bytes(
    stores: StoreMaker,
    driver: str,
    project: str,
    redis_url: str,
    sizes: list[int],
) -> None:
    """The same posts at the same clock: every key of the layout alike,
    byte for byte (the counter starts at the clock, so the seqs agree)."""
    async with stores("lua") as lua, stores(driver) as other:
        n = 0
        for j, size in enumerate(sizes):
            for store, queue in ((lua, "a"), (other, "b")):
                key = f"k{j}" if j % 2 else None
                await store.post_messages(
                    project, queue, WRITER, batch(n, size), idempotency_key=key
                )
            n += size
        a = await layout_of(redis_url, QueueKeys.of(project, "a"))
        b = await layout_of(redis_url, QueueKeys.of(project, "b"))
        assert len(a["dir"]) >= 3
        # ids start with their queue's tag (segments.id_tag): alike but for it
        tag_a, tag_b = (segments.id_tag(QueueKeys.of(project, q).prefix) for q in "ab")
        assert repr(a).replace(tag_a, "T") == repr(b).replace(tag_b, "T")


async def test_a_queue_written_by_both_is_read_by_both_each_message_once(
    stores: StoreMaker, driver: str, project: str
) -> None:
    async with stores("lua") as lua, stores(driver) as other:
        n, ids = 0, []
        for j, size in enumerate([3, 98, 1, 100, 7, 55]):
            writer = (lua, other)[j % 2]
            ids += await writer.post_messages(project, "q", WRITER, batch(n, size))
            n += size
        assert ids == sorted(ids) and len(set(ids)) == n
        for store in (lua, other):
            for limit in (1, 10, 20):
                assert await read_all(store, project, "q", limit) == list(range(n))
            got = await store.get_messages(project, "q", [ids[0], ids[150], ids[-1]])
            assert [orjson.loads(m.body)["n"] for m in got] == [0, 150, n - 1]
            assert [m.group for m in got] == ["g0", None, None]


async def test_posts_at_once_from_both_drivers_lose_nothing(
    stores: StoreMaker, driver: str, project: str
) -> None:
    """Concurrent posts conflict under WATCH and are tried again: every
    message is stored once, at the offset its slot says."""
    async with stores("lua") as lua, stores(driver) as other:

        async def post(store: FeedStore, start: int) -> list[str]:
            posted: list[str] = []
            for i in range(start, start + 150, 3):
                posted += await store.post_messages(project, "q", WRITER, batch(i, 3))
            return posted

        posted = await asyncio.gather(
            post(lua, 0), post(other, 150), post(other, 300), post(lua, 450)
        )
        ids = [i for p in posted for i in p]
        assert len(set(ids)) == 600
        for store in (lua, other):
            seen = await read_all(store, project, "q", 20)
            assert sorted(seen) == list(range(600))
            got = await store.get_messages(project, "q", ids)
            assert sorted(orjson.loads(m.body)["n"] for m in got) == list(range(600))


async def test_a_segment_opened_at_its_first_slot_takes_deletes(
    stores: StoreMaker, driver: str, project: str
) -> None:
    """A post that opens a segment at slot 0 starts its count at 0 (Q:sn),
    a number HINCRBY takes: a delete there works, by either driver (Lua's
    -0 was written "-0", which Redis refuses to increment)."""
    async with stores("lua") as lua, stores(driver) as other:
        for writer, deleter, queue in ((lua, other, "a"), (other, lua, "b")):
            [first] = await writer.post_messages(project, queue, WRITER, batch(0, 1))
            tag = segments.id_tag(QueueKeys.of(project, queue).prefix)
            seq = segments.seq_of(tag, first)
            assert seq is not None
            room = segments.SLOTS - seq % segments.SLOTS
            ids = [first]
            if room > 1:
                ids += await writer.post_messages(project, queue, WRITER, batch(1, room - 1))
            ids += await writer.post_messages(project, queue, WRITER, batch(room, 3))
            assert (segments.seq_of(tag, ids[room]) or 1) % segments.SLOTS == 0
            await deleter.delete_message(project, queue, ids[room], None)
            await writer.delete_messages(project, queue, ids[room + 1 :])
            assert await read_all(deleter, project, queue, 200) == list(range(room))


async def test_posted_by_one_claimed_and_deleted_by_the_other(
    stores: StoreMaker, driver: str, project: str, clock: ManualClock
) -> None:
    """Post with lua, claim, list and delete with the other driver, and back:
    one claim state, one claim head, one count, whichever driver wrote them."""
    async with stores("lua") as lua, stores(driver) as other:
        for writer, reader, queue in ((lua, other, "a"), (other, lua, "b")):
            plain = [NewMessage(body(i), 300, group="g" if i == 119 else "") for i in range(120)]
            ids = await writer.post_messages(project, queue, WRITER, plain)
            claim = await reader.claim_messages(project, queue, 60, 60, 10)
            assert claim is not None and [m.id for m in claim.messages] == ids[:10]
            # the other driver sees the claim: not claimable, listed only when asked
            again = await writer.claim_messages(project, queue, 60, 60, 5)
            assert again is not None and [m.id for m in again.messages] == ids[10:15]
            page = await writer.list_messages(project, queue, ListQuery(READER, limit=20))
            assert [m.id for m in page.messages] == ids[15:35]
            held = await writer.list_messages(
                project, queue, ListQuery(READER, limit=3, include_claimed=True)
            )
            assert [m.claim_id for m in held.messages] == [claim.id] * 3
            for m in claim.messages[:5]:
                await writer.delete_message(project, queue, m.id, claim.id)
            await reader.release_claim(project, queue, claim.id)
            popped = await writer.pop_messages(project, queue, 3)
            assert [m.id for m in popped] == ids[5:8]
            await reader.delete_messages(project, queue, ids[100:])
            left = await read_all(reader, project, queue, 50)
            assert left == [8, 9, *range(15, 100)]  # 10-14: the second claim's
            stats = await writer.queue_stats(project, queue)
            assert (stats.total, stats.claimed) == (92, 5)
            clock.advance(61)  # the second claim ran out: all free again
            rest = await reader.pop_messages(project, queue, 100)
            assert [m.id for m in rest] == ids[8:100]
            assert (await writer.queue_stats(project, queue)).total == 0


async def test_a_read_by_commands_ends_its_last_record_where_the_next_begins(
    stores: StoreMaker, driver: str, project: str, redis_url: str
) -> None:
    """A post lands between the counter's read and the records' (a plain
    read is no script): the last record read ends where the next slot's
    starts, not at the string's end, which the post has moved on."""
    async with stores(driver) as store:
        keys = QueueKeys.of(project, "q")
        await store.post_messages(project, "q", WRITER, batch(0, 2))
        client = direct_client(redis_url)
        try:
            counter = await client.get(keys.seq)
            assert counter is not None
            await store.post_messages(project, "q", WRITER, batch(2, 1))
            await client.set(keys.seq, counter)  # as the read saw it
            assert isinstance(store, WatchStore)
            transport = store.segments.transport
            got = await read_by_commands(transport, keys, 0, None, 10, False, None)
        finally:
            await client.aclose()
        bodies = [raw for _, raw in ReadReply.parse(got).slots]
        assert [segments.SegmentRecord.decode(0, b).body for b in bodies if b] == [
            body(0),
            body(1),
        ]
