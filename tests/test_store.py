"""The store contract, run against both drivers (lua and watch).

Everything a reader relies on (DESIGN.md "What users must be able to rely
on" 1-3) is checked here at the FeedStore level, on a real Redis.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from feedsvc.clock import SYSTEM_CLOCK, ManualClock
from feedsvc.config import Settings
from feedsvc.errors import (
    InvalidClaim,
    MarkerNotGivenOut,
    SubscriptionNotFound,
    TooMuchContention,
)
from feedsvc.storage import record
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage, Parent
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys, escape_project, registry_key
from feedsvc.storage.lua_store import LuaStore
from feedsvc.storage.scripts import load_script
from feedsvc.storage.subscriptions import PURGE_STEP
from feedsvc.storage.transport import Transport
from tests.conftest import direct_client, make_settings

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())


def msg(body: Any, ttl: int | None = None) -> NewMessage:
    return NewMessage(orjson.dumps(body), ttl)


async def post_n(
    store: FeedStore, project: str, queue: str, n: int, client: str = WRITER, ttl: int = 300
) -> list[str]:
    ids: list[str] = []
    for start in range(0, n, 20):
        batch = [msg({"n": i}, ttl) for i in range(start, min(n, start + 20))]
        ids += await store.post_messages(project, queue, client, batch)
    return ids


async def read_all(
    store: FeedStore,
    project: str,
    queue: str,
    limit: int,
    marker: int | None = None,
    client: str = READER,
    echo: bool = False,
) -> tuple[list[str], int | None]:
    """Follow next markers until an empty page; returns ids seen and the last marker."""
    seen: list[str] = []
    for _ in range(10_000):
        page = await store.list_messages(
            project, queue, ListQuery(client, marker=marker, limit=limit, echo=echo)
        )
        if page.next_marker is None:
            assert page.messages == []
            return seen, marker
        assert len(page.messages) <= limit
        seen += [m.id for m in page.messages]
        assert page.next_marker > (marker or 0), "a next marker must move forward"
        marker = page.next_marker
    raise AssertionError("listing never reached an empty page")


async def test_post_then_list_returns_bodies_verbatim(store: FeedStore, project: str) -> None:
    bodies: list[Any] = [{"a": [1, 2, {"b": None}]}, "text", 3.5, None, [], "ünïcødé ✓"]
    ids = await store.post_messages(project, "q", WRITER, [msg(b) for b in bodies])
    page = await store.list_messages(project, "q", ListQuery(READER, limit=20))
    assert [m.id for m in page.messages] == ids
    assert [orjson.loads(m.body) for m in page.messages] == bodies
    assert all(m.ttl in {300, 3600} for m in page.messages)
    assert page.next_marker == page.messages[-1].seq


@pytest.mark.parametrize("storage_layout", ["records"], indirect=True)  # looks at its keys
async def test_one_large_post_is_indexed_whole_in_order_with_its_own_expiries(
    store: FeedStore, project: str, redis_url: str
) -> None:
    """A post bigger than the lua driver indexes per Redis call (1,000 at a
    time) still indexes every message, in post order, each expiring by its
    own ttl, and moves the queue's sequence by exactly its size."""
    keys = QueueKeys.of(project, "q")
    [first] = await store.post_messages(project, "q", WRITER, [msg("before")])
    client = direct_client(redis_url)
    try:
        seq_before = int(await client.get(keys.seq) or 0)
        batch = [msg({"n": i}, ttl=60 + i % 7) for i in range(2345)]
        ids = await store.post_messages(project, "q", WRITER, batch)
        assert int(await client.get(keys.seq) or 0) == seq_before + 2345
        raw = await client.get(keys.record(ids[0]))
        assert isinstance(raw, bytes)
        created = record.Header.decode(raw).created
        for i in (0, 999, 1000, 1001, 2344):
            expires = await client.zscore(keys.expiry, ids[i])
            assert expires == created + (60 + i % 7) * 1000
    finally:
        await client.aclose()
    seen, _ = await read_all(store, project, "q", limit=20)
    assert seen == [first, *ids]


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 10, 19, 20])
async def test_paging_sees_every_message_once_in_order(
    store: FeedStore, project: str, limit: int
) -> None:
    ids = await post_n(store, project, "q", 45)
    seen, _ = await read_all(store, project, "q", limit)
    assert seen == ids


async def test_marker_of_first_message_does_not_restart(store: FeedStore, project: str) -> None:
    ids = await post_n(store, project, "q", 3)
    first = await store.list_messages(project, "q", ListQuery(READER, limit=1))
    assert [m.id for m in first.messages] == ids[:1]
    second = await store.list_messages(
        project, "q", ListQuery(READER, marker=first.next_marker, limit=1)
    )
    assert [m.id for m in second.messages] == ids[1:2]


async def test_a_clients_marker_past_the_counter_is_refused_in_the_read(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    """check_marker: past the queue's counter (or, with none, past now in
    microseconds) is MarkerNotGivenOut; the service's own positions
    (check_marker off, a tail's) are read as before."""
    await post_n(store, project, "q", 2)
    page = await store.list_messages(project, "q", ListQuery(READER, limit=20))
    last = page.next_marker
    assert last is not None
    for feed, ahead in (("q", last + 1), ("never-posted", clock.now_ms() * 1000 + 1)):
        with pytest.raises(MarkerNotGivenOut, match=str(ahead)):
            await store.list_messages(
                project, feed, ListQuery(READER, marker=ahead, check_marker=True)
            )
        unchecked = await store.list_messages(project, feed, ListQuery(READER, marker=ahead))
        assert (unchecked.messages, unchecked.next_marker) == ([], None)
    at_end = await store.list_messages(
        project, "q", ListQuery(READER, marker=last, check_marker=True)
    )
    assert (at_end.messages, at_end.next_marker) == ([], None)


async def test_marker_whose_message_was_deleted(store: FeedStore, project: str) -> None:
    ids = await post_n(store, project, "q", 6)
    page = await store.list_messages(project, "q", ListQuery(READER, limit=2))
    await store.delete_message(project, "q", ids[1], None)
    await store.delete_message(project, "q", ids[2], None)
    rest, _ = await read_all(store, project, "q", 2, marker=page.next_marker)
    assert rest == ids[3:]


async def test_marker_zero_and_beyond_the_end(store: FeedStore, project: str) -> None:
    ids = await post_n(store, project, "q", 3)
    page = await store.list_messages(project, "q", ListQuery(READER, marker=0, limit=10))
    assert [m.id for m in page.messages] == ids
    assert page.next_marker is not None
    beyond = await store.list_messages(
        project, "q", ListQuery(READER, marker=page.next_marker + 10**6, limit=10)
    )
    assert beyond.messages == [] and beyond.next_marker is None


async def test_new_messages_appear_after_an_empty_poll(store: FeedStore, project: str) -> None:
    ids = await post_n(store, project, "q", 2)
    seen, marker = await read_all(store, project, "q", 10)
    assert seen == ids
    more = await post_n(store, project, "q", 3)
    seen, _ = await read_all(store, project, "q", 10, marker=marker)
    assert seen == more


async def test_echo_filter_scans_past_a_page_of_own_messages(
    store: FeedStore, project: str
) -> None:
    await post_n(store, project, "q", 30, client=READER)
    other = await post_n(store, project, "q", 1, client=WRITER)
    page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
    assert [m.id for m in page.messages] == other
    mine = await store.list_messages(project, "q", ListQuery(READER, limit=10, echo=True))
    assert len(mine.messages) == 10


async def test_empty_page_has_no_next_marker(store: FeedStore, project: str) -> None:
    empty = await store.list_messages(project, "nothing-here", ListQuery(READER))
    assert empty.messages == [] and empty.next_marker is None
    await post_n(store, project, "q", 5, client=READER)
    own_only = await store.list_messages(project, "q", ListQuery(READER))
    assert own_only.messages == [] and own_only.next_marker is None


async def test_bounded_scan_gives_a_forward_marker(redis_url: str, driver: str) -> None:
    settings = Settings(redis_url=redis_url, driver=driver, scan_limit=5)
    store = make_store(settings)
    project = "test-" + uuid.uuid4().hex
    try:
        await post_n(store, project, "q", 12, client=READER)
        theirs = await post_n(store, project, "q", 2, client=WRITER)
        page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
        assert page.messages == [] and page.next_marker is not None
        seen, _ = await read_all(store, project, "q", 10, marker=page.next_marker)
        assert seen == theirs
    finally:
        await store.close()


async def check_only_long_is_left(store: FeedStore, project: str, short: str, long: str) -> None:
    page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
    assert [m.id for m in page.messages] == [long]
    assert await store.get_messages(project, "q", [short, long]) == [
        m for m in await store.get_messages(project, "q", [long])
    ]
    stats = await store.queue_stats(project, "q")
    assert (stats.total, stats.free, stats.claimed) == (1, 1, 0)
    assert stats.oldest is not None and stats.oldest.id == long


async def test_expired_messages_are_never_returned(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    [short] = await store.post_messages(project, "q", WRITER, [msg("short", ttl=60)])
    [long] = await store.post_messages(project, "q", WRITER, [msg("long", ttl=300)])
    clock.advance(59.9)
    page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
    assert [m.id for m in page.messages] == [short, long], "gone before its ttl"
    assert len(await store.get_messages(project, "q", [short, long])) == 2
    assert (await store.queue_stats(project, "q")).total == 2
    clock.advance(0.2)
    await check_only_long_is_left(store, project, short, long)


@pytest.mark.slow
async def test_expired_messages_are_never_returned_in_real_time(
    settings: Settings, project: str
) -> None:
    """End to end on the host's clock: the ttl really passes."""
    store = make_store(settings)
    await store.open()
    try:
        [short] = await store.post_messages(project, "q", WRITER, [msg("short", ttl=1)])
        [long] = await store.post_messages(project, "q", WRITER, [msg("long", ttl=300)])
        await asyncio.sleep(1.1)
        await check_only_long_is_left(store, project, short, long)
    finally:
        await store.close()


@pytest.mark.parametrize("storage_layout", ["records"], indirect=True)  # looks at its keys
async def test_expired_entries_are_collected(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    keys = QueueKeys.of(project, "q")
    client = direct_client(redis_url)
    try:
        await post_n(store, project, "q", 5, ttl=1)
        clock.advance(0.9)
        await post_n(store, project, "q", 1)
        assert await client.zcard(keys.index) == 6, "live entries were collected"
        assert await client.zcard(keys.expiry) == 6
        clock.advance(0.2)
        await post_n(store, project, "q", 1)
        assert await client.zcard(keys.index) == 2
        assert await client.zcard(keys.expiry) == 2
    finally:
        await client.aclose()


@pytest.mark.parametrize("storage_layout", ["records"], indirect=True)  # looks at its keys
async def test_message_key_expires_in_redis_too(
    store: FeedStore, project: str, redis_url: str
) -> None:
    [message_id] = await store.post_messages(project, "q", WRITER, [msg("x", ttl=120)])
    client = direct_client(redis_url)
    try:
        pttl = await client.pttl(QueueKeys.of(project, "q").record(message_id))
    finally:
        await client.aclose()
    assert 110_000 < pttl <= 120_000


async def test_ids_are_isolated_by_project_and_queue(store: FeedStore, project: str) -> None:
    other_project = project + "-other"
    [message_id] = await store.post_messages(project, "q", WRITER, [msg("secret")])
    assert await store.get_messages(other_project, "q", [message_id]) == []
    assert await store.get_messages(project, "q2", [message_id]) == []
    await store.delete_message(other_project, "q", message_id, None)
    await store.delete_messages(project, "q2", [message_id])
    assert [m.id for m in await store.get_messages(project, "q", [message_id])] == [message_id]
    other = await store.list_messages(other_project, "q", ListQuery(READER))
    assert other.messages == []


async def test_projects_with_key_characters_do_not_collide(store: FeedStore) -> None:
    # "a}b" and "a%7Db" must stay different projects after escaping.
    tricky = ["p{x}", "p%7Bx%7D", "p/x", "p:x", "p%2Fx"]
    suffix = uuid.uuid4().hex
    for i, name in enumerate(tricky):
        await store.post_messages(name + suffix, "q", WRITER, [msg(i)])
    for i, name in enumerate(tricky):
        page = await store.list_messages(name + suffix, "q", ListQuery(READER, limit=20))
        assert [orjson.loads(m.body) for m in page.messages] == [i]
    assert len({escape_project(n + suffix) for n in tricky}) == len(tricky)


async def test_dotted_queue_names(store: FeedStore, project: str) -> None:
    ids = await store.post_messages(project, "a.b.c", WRITER, [msg(1)])
    await store.create_queue(project, "x.y", {})
    page = await store.list_messages(project, "a.b.c", ListQuery(READER))
    assert [m.id for m in page.messages] == ids
    names = [q.name for q in await store.list_queues(project, None, 10, False)]
    assert names == ["a.b.c", "x.y"]


async def test_queue_listing_pages_by_name(store: FeedStore, project: str) -> None:
    names = [f"q{i:02d}" for i in range(7)]
    for name in reversed(names):
        assert await store.create_queue(project, name, {"n": name})
    assert not await store.create_queue(project, names[0], {"n": "changed"})
    seen: list[str] = []
    marker = None
    while page := await store.list_queues(project, marker, 3, True):
        assert all(q.metadata == {"n": q.name} for q in page)
        seen += [q.name for q in page]
        marker = page[-1].name
    assert seen == names
    assert await store.count_queues(project) == 7


@pytest.mark.slow
async def test_delete_queue_leaves_no_keys(store: FeedStore, project: str, redis_url: str) -> None:
    await store.create_queue(project, "q", {"a": 1})
    await post_n(store, project, "q", 30)
    await post_n(store, project, "other", 2)
    await store.delete_queue(project, "q")
    await store.delete_queue(project, "other")
    client = direct_client(redis_url)
    try:
        left = [k async for k in client.scan_iter(match=f"*{escape_project(project)}*")]
    finally:
        await client.aclose()
    assert left == []
    assert await store.get_queue_metadata(project, "q") is None
    assert (await store.list_messages(project, "q", ListQuery(READER))).messages == []


async def test_recreated_queue_does_not_reuse_markers(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    await post_n(store, project, "q", 3)
    _, marker = await read_all(store, project, "q", 10)
    await store.delete_queue(project, "q")
    # Markers of a new queue start at its creation time in microseconds
    # (storage/base.py): re-created one clock tick (1 ms) later.
    clock.advance(0.001)
    fresh = await post_n(store, project, "q", 2)
    seen, _ = await read_all(store, project, "q", 10, marker=marker)
    assert seen == fresh


async def test_delete_by_ids_and_get_by_ids(store: FeedStore, project: str) -> None:
    ids = await post_n(store, project, "q", 5)
    await store.delete_messages(project, "q", [ids[0], ids[2], "0" * 24])
    found = await store.get_messages(project, "q", [ids[4], ids[0], ids[1], ids[1]])
    assert [m.id for m in found] == [ids[4], ids[1]]
    stats = await store.queue_stats(project, "q")
    assert stats.total == 3


async def test_delete_with_a_claim_id_of_an_unclaimed_message(
    store: FeedStore, project: str
) -> None:
    [message_id] = await store.post_messages(project, "q", WRITER, [msg(1)])
    with pytest.raises(InvalidClaim):
        await store.delete_message(project, "q", message_id, "f" * 24)
    assert len(await store.get_messages(project, "q", [message_id])) == 1
    await store.delete_message(project, "q", "a" * 24, "f" * 24)  # absent: fine


async def test_queue_stats_counts_and_ends(store: FeedStore, project: str) -> None:
    empty = await store.queue_stats(project, "missing")
    assert (empty.total, empty.oldest, empty.newest) == (0, None, None)
    ids = await post_n(store, project, "q", 4)
    await store.delete_message(project, "q", ids[0], None)
    stats = await store.queue_stats(project, "q")
    assert (stats.total, stats.free, stats.claimed) == (3, 3, 0)
    assert stats.oldest is not None and stats.oldest.id == ids[1]
    assert stats.newest is not None and stats.newest.id == ids[3]


async def test_concurrent_producers_and_observers(store: FeedStore, project: str) -> None:
    """Every observer sees every message exactly once, per-producer order kept."""
    producers, per_producer = 12, 25
    done = asyncio.Event()

    async def produce(p: int) -> None:
        for n in range(per_producer):
            # twelve WATCH transactions on one queue (watch-naive: no group
            # commit) can conflict past the retries on a loaded machine; that
            # 503 wrote nothing, and a producer sends it again, as a client does
            for _ in range(5):
                try:
                    message = [msg({"p": p, "n": n})]
                    await store.post_messages(project, "hot", str(uuid.uuid4()), message)
                    break
                except TooMuchContention:
                    await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"producer {p}: post {n} refused five times")
            if random.random() < 0.3:
                await asyncio.sleep(0)

    async def observe(limit: int) -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []
        marker: int | None = None
        while True:
            finished = done.is_set()
            page = await store.list_messages(
                project, "hot", ListQuery(READER, marker=marker, limit=limit)
            )
            for m in page.messages:
                body = orjson.loads(m.body)
                seen.append((body["p"], body["n"]))
            if page.next_marker is not None:
                marker = page.next_marker
            elif finished:
                return seen
            else:
                await asyncio.sleep(0.001)

    observers = [asyncio.create_task(observe(limit)) for limit in (1, 3, 10, 20)]
    await asyncio.gather(*(produce(p) for p in range(producers)))
    done.set()
    for seen in await asyncio.gather(*observers):
        assert len(seen) == producers * per_producer
        assert len(set(seen)) == len(seen), "a message was repeated"
        for p in range(producers):
            assert [n for q, n in seen if q == p] == list(range(per_producer))


@pytest.fixture
async def lua_store(redis_url: str) -> AsyncIterator[LuaStore]:
    """A lua store writing records: its tests run post.lua, the records
    layout's post script, by hand (post_segments.lua takes the bodies in
    its own call, all or nothing: no body written before it to go missing)."""
    store = make_store(Settings(redis_url=redis_url, driver="lua", storage_layout="records"))
    assert isinstance(store, LuaStore)
    await store.open()
    yield store
    await store.close()


async def test_post_script_is_idempotent(lua_store: LuaStore, project: str, redis_url: str) -> None:
    """Re-running the index script for the same ids (a retry) indexes nothing twice.

    (The watch driver has no such retry: an EXEC either ran or wrote nothing.)
    """
    store = lua_store
    [message_id] = await store.post_messages(project, "q", WRITER, [msg(1)])
    keys = QueueKeys.of(project, "q")
    script = load_script("post")
    all_keys = [*keys.fixed(), keys.record(message_id)]
    client = direct_client(redis_url)
    try:
        seq_before = await client.get(keys.seq)
        again = await client.evalsha(
            script.sha,
            len(all_keys),
            *all_keys,
            1,
            3600,
            0,
            0,
            "",
            0,
            "0",
            "",
            message_id,
            "",
            "",
            "",
        )
        assert await client.get(keys.seq) == seq_before
        assert await client.zcard(keys.index) == 1
        assert again == [int(seq_before or 0)]
    finally:
        await client.aclose()


async def test_post_script_indexes_nothing_when_a_body_is_missing(
    lua_store: LuaStore, project: str, redis_url: str
) -> None:
    """All or nothing: if Redis lost one of a post's bodies before the script
    ran (evicted, or its SET failed), no message of the post is indexed, the
    queue's counter does not move, and the bodies that are there stay
    unindexed (they expire by themselves). The store turns the empty reply
    into a 503 (LuaStore._post)."""
    keys = QueueKeys.of(project, "q")
    await lua_store.post_messages(project, "q", WRITER, [msg(0)])  # the queue exists
    script = load_script("post")
    present, lost = "ab" * 12, "cd" * 12
    client = direct_client(redis_url)
    try:
        await client.set(keys.record(present), record.unindexed(WRITER, b"1"), ex=60)
        seq_before = await client.get(keys.seq)
        for order in ((present, lost), (lost, present)):
            all_keys = [*keys.fixed(), *(keys.record(i) for i in order)]
            per_message = [arg for i in order for arg in (i, "", "", "")]
            reply = await client.evalsha(
                script.sha, len(all_keys), *all_keys, 1, 3600, 0, 0, "", 0, "0", "", *per_message
            )
            assert reply == []
        assert await client.get(keys.seq) == seq_before
        assert await client.zscore(keys.index, present) is None
        assert await client.zcard(keys.index) == 1
        assert await client.get(keys.record(present)) == record.unindexed(WRITER, b"1")
    finally:
        await client.aclose()


async def test_orphan_body_is_never_listed(store: FeedStore, project: str, redis_url: str) -> None:
    keys = QueueKeys.of(project, "q")
    client = direct_client(redis_url)
    try:
        # as the lua driver writes a body before indexing it
        await client.set(keys.record("ab" * 12), record.unindexed(WRITER, b"1"), ex=60)
        # and as the release before the compact record did (record.py)
        await client.hset(keys.message("cd" * 12), mapping={"b": b"1", "u": WRITER})
        await client.expire(keys.message("cd" * 12), 60)
    finally:
        await client.aclose()
    ids = await post_n(store, project, "q", 1)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == ids
    assert await store.get_messages(project, "q", ["ab" * 12, "cd" * 12]) == []


async def test_lua_recovers_from_script_flush(
    lua_store: LuaStore, project: str, redis_url: str
) -> None:
    client = direct_client(redis_url)
    try:
        await client.script_flush()
    finally:
        await client.aclose()
    ids = await post_n(lua_store, project, "q", 2)
    page = await lua_store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == ids
    assert lua_store.counters.noscript_reloads >= 2


def test_registry_key_and_queue_keys_share_no_slot_tag() -> None:
    keys = QueueKeys.of("p", "q")
    assert all(k.startswith("fs:{p/q}:") for k in keys.fixed())
    assert keys.message("ab").startswith("fs:{p/q}:")
    assert registry_key("p") == "fs:p:{p}:queues"


async def test_a_conflict_backoff_gives_the_pool_slot_back(redis_url: str) -> None:
    """A writer sleeping between conflicting attempts holds no connection slot,
    so a crowd of them cannot starve other requests of Redis connections."""
    settings = make_settings(redis_url, driver="watch", pool_size=2)  # one slot
    transport = Transport(settings, SYSTEM_CLOCK)
    other_ran = asyncio.Event()

    async def other() -> None:
        async with transport.slot():
            other_ran.set()

    try:
        async with transport.slot():
            waiting = asyncio.create_task(other())
            await asyncio.sleep(0.01)
            assert not other_ran.is_set()  # the one slot is ours
            await transport.transactions.backoff(6)
            assert other_ran.is_set()  # it got the slot while we slept
            await waiting
        assert transport.stats()["pool_in_use"] == 0
    finally:
        await transport.close()


async def test_the_pooled_path_without_coalescing(
    redis_url: str, driver: str, project: str
) -> None:
    """--no-coalesce: every call takes a pool connection of its own (on a
    cluster, one per node it touches, one at a time). A tour of the store."""
    store = make_store(make_settings(redis_url, driver=driver, coalesce=False, pool_size=2))
    try:
        await store.open()
        meta = {"_max_claim_count": 1, "_dead_letter_queue": "dead"}
        assert await store.create_queue(project, "work", meta)
        ids = await store.post_messages(project, "work", WRITER, [msg(i) for i in range(6)])
        page = await store.list_messages(project, "work", ListQuery(READER, limit=4))
        assert [m.id for m in page.messages] == ids[:4]
        claim = await store.claim_messages(project, "work", 60, 60, 2)
        assert claim is not None and [m.id for m in claim.messages] == ids[:2]
        await store.release_claim(project, "work", claim.id)
        # claimed once: the next claim dead-letters those two and takes two more
        again = await store.claim_messages(project, "work", 60, 60, 2)
        assert again is not None and [m.id for m in again.messages] == ids[2:4]
        dead = await store.list_messages(project, "dead", ListQuery(READER))
        assert [m.id for m in dead.messages] == ids[:2]
        assert [m.id for m in await store.pop_messages(project, "work", 1)] == ids[4:5]
        await store.delete_messages(project, "work", ids[5:])
        await store.purge_queue(project, "dead")
        await store.delete_queue(project, "work")
        assert [q.name for q in await store.list_queues(project, None, 10, False)] == ["dead"]
        assert store.stats()["pool_in_use"] == 0
    finally:
        await store.close()


async def test_concurrent_subscription_creates_on_one_queue_do_not_contend(
    store: FeedStore, project: str
) -> None:
    """Creates of different subscribers on one queue touch nothing in
    common that a transaction watches: none waits on another, so none can
    run out of attempts into a 503 (it was 16 in 10,000 at 50 at once)."""
    parent = Parent("queue", project, "q")
    before = store.counters.watch_retries
    made = await asyncio.gather(
        *(store.subscriptions.create(parent, f"http://hooks.example/{i}", 3600, {})
          for i in range(50))
    )  # fmt: skip
    assert all(m.created for m in made)
    assert store.counters.watch_retries == before
    listed = await store.subscriptions.list(parent, None, 100)
    assert sorted(s.id for s in listed) == sorted(m.id for m in made)


async def test_concurrent_creates_of_one_subscriber_make_one_subscription(
    store: FeedStore, project: str
) -> None:
    parent = Parent("queue", project, "q")
    made = await asyncio.gather(
        *(store.subscriptions.create(parent, "http://hooks.example/same", 3600, {})
          for _ in range(20))
    )  # fmt: skip
    assert len({m.id for m in made}) == 1
    assert [m.created for m in made].count(True) == 1
    listed = await store.subscriptions.list(parent, None, 100)
    assert [s.id for s in listed] == [made[0].id]


@pytest.mark.slow
async def test_deleting_a_queue_with_many_subscriptions_is_bounded_work(
    store: FeedStore, project: str, redis_url: str
) -> None:
    """Purging a queue's subscriptions (as its deletion does) ends them all
    at once, whatever their number, but deletes only a bounded number of
    their records in the call; the rest are swept in bounded steps later.
    A queue made again under the name inherits none of them."""
    parent = Parent("queue", project, "q")
    subs = store.subscriptions
    count = PURGE_STEP + 500
    made: list[str] = []
    for start in range(0, count, 50):
        batch = [
            subs.create(parent, f"http://hooks.example/{i}", 3600, {})
            for i in range(start, min(start + 50, count))
        ]
        made += [m.id for m in await asyncio.gather(*batch)]
    await subs.purge(parent)
    await store.delete_queue(project, "q")
    assert await subs.list(parent, None, 20) == []
    for sid in (made[0], made[-1]):
        with pytest.raises(SubscriptionNotFound):
            await subs.get(parent, sid)
    again = await subs.create(parent, "http://hooks.example/0", 3600, {})
    assert again.created and again.id not in made
    keys = QueueKeys.of(project, "q").subscriptions()
    records = [keys.record(sid) for sid in made]
    client = direct_client(redis_url)
    try:
        left = sum([await client.exists(r) for r in records])
        assert left == 500  # the call deleted PURGE_STEP of them, no more
        assert await store.deliveries.sweep_buried(parent, 400) > 0  # a bounded step
        assert await store.deliveries.sweep_buried(parent, 1000) == 0
        assert sum([await client.exists(r) for r in records]) == 0
        assert await client.exists(keys.buried) == 0
    finally:
        await client.aclose()
    assert [s.id for s in await subs.list(parent, None, 20)] == [again.id]
