"""Concurrent posts to one queue in segments go together (issue 30): the lua
driver sends the posts that arrive while a queue's ``post_segments.lua`` call
is in flight in one next call (lua_segments.py's combiner), as the tuned
watch driver does with its transaction. Each post is answered as if it had
come alone: every acknowledged id is stored once, in seq order; a refused
post (too large, not sealed, queue or project full) refuses itself only; an
idempotency key twice in one call stores once.

A burst of posts gathered at once, to a queue whose encryption the process
knows already (one post before it), reaches the combiner before the first
call is sent: the burst is one call, in the order the posts were made."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, cast

import orjson
import pytest
from redis.asyncio import Redis, RedisCluster

from feedsvc.clock import ManualClock
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.errors import MarkerNotGivenOut, PostTooLarge, ProjectMessagesFull, QueueFull
from feedsvc.storage import known_tables, lua_segments, reviews, segments, watch_segments
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.keys import SWEEP_KEY, QueueKeys
from feedsvc.storage.lua_segments import SegmentPost
from feedsvc.storage.lua_store import LuaStore
from feedsvc.storage.sealing import MustSeal
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_store import WatchStore
from tests.conftest import direct_client, make_settings, opened_store

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())
KEY = "correct horse battery staple, twice"
T = TypeVar("T")

StoreMaker = Callable[..., AbstractAsyncContextManager[FeedStore]]


@pytest.fixture(params=["lua", "watch"])
def driver(request: pytest.FixtureRequest) -> str:
    """The drivers that combine posts (watch-naive posts one at a time)."""
    return str(request.param)


@pytest.fixture
def stores(redis_url: str, driver: str, clock: ManualClock) -> StoreMaker:
    @asynccontextmanager
    async def opened(**changes: object) -> AsyncIterator[FeedStore]:
        settings = make_settings(redis_url, driver=driver, storage_layout="segments", **changes)
        async with opened_store(settings, clock) as feed:
            yield feed

    return opened


def messages(*ns: int) -> list[NewMessage]:
    return [NewMessage(orjson.dumps({"n": n}), 300) for n in ns]


async def burst(store: FeedStore, project: str, queue: str, posts: list[Any]) -> list[Any]:
    """Post each (messages, request size, idempotency key) at once: the outcomes."""
    return list(
        await asyncio.gather(
            *(
                store.post_messages(project, queue, WRITER, m, size, idempotency_key=key)
                for m, size, key in posts
            ),
            return_exceptions=True,
        )
    )


async def read_all(store: FeedStore, project: str, queue: str) -> list[tuple[str, int, int]]:
    """(id, seq, body's n) of every message, following markers from the head."""
    seen: list[tuple[str, int, int]] = []
    marker = None
    for _ in range(1000):
        page = await store.list_messages(project, queue, ListQuery(READER, marker=marker, limit=7))
        if not page.messages:
            return seen
        seen += [(m.id, m.seq, orjson.loads(m.body)["n"]) for m in page.messages]
        marker = page.next_marker
    raise AssertionError("the pages never ended")


async def counter(redis_url: str, project: str, queue: str) -> int:
    client = direct_client(redis_url)
    try:
        return int(await client.get(QueueKeys.of(project, queue).seq) or 0)
    finally:
        await client.aclose()


async def test_a_burst_is_stored_once_each_in_seq_order(stores: StoreMaker, project: str) -> None:
    async with stores() as store:
        await store.post_messages(project, "q", WRITER, messages(-1))
        posts = [(messages(2 * i, 2 * i + 1) if i % 3 else messages(2 * i), 0, None)
                 for i in range(40)]  # fmt: skip
        outcomes = await burst(store, project, "q", posts)
        assert store.counters.posts_combined >= 39  # one call (the watch driver: one EXEC)
        sent = {n for m, _, _ in posts for n in (orjson.loads(x.body)["n"] for x in m)}
        acknowledged: dict[str, int] = {}
        for (posted, _, _), ids in zip(posts, outcomes, strict=True):
            assert isinstance(ids, list) and len(ids) == len(posted)
            acknowledged.update(zip(ids, (orjson.loads(m.body)["n"] for m in posted), strict=True))
        stored = await read_all(store, project, "q")
        assert stored[0][2] == -1
        stored = stored[1:]
        # every id once, with its own body; pages in seq order, posts in the order made
        assert {i: n for i, _, n in stored} == acknowledged
        assert len(stored) == len(acknowledged) == len(sent)
        assert [s for _, s, _ in stored] == sorted(s for _, s, _ in stored)
        assert [n for _, _, n in stored] == sorted(sent)
        for ids in outcomes:  # a post's messages have consecutive seqs
            seqs = [int(i[11:], 16) for i in ids]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


async def test_a_refused_post_refuses_only_itself(stores: StoreMaker, project: str) -> None:
    async with stores() as store:
        await store.create_queue(
            project, "q", {"_max_messages_post_size": 1000, "_max_messages": 6}
        )
        await store.post_messages(project, "q", WRITER, messages(0))
        # room for 5 more: too large, 2, 2, 2 (full: 7 > 6), 1, 1 (full)
        posts = [(messages(1), 5000, None), (messages(2, 3), 10, None),
                 (messages(4, 5), 10, None), (messages(6, 7), 10, None),
                 (messages(8), 10, None), (messages(9), 10, None)]  # fmt: skip
        outcomes = await burst(store, project, "q", posts)
        assert isinstance(outcomes[0], PostTooLarge)
        assert isinstance(outcomes[3], QueueFull) and isinstance(outcomes[5], QueueFull)
        kept = [outcomes[i] for i in (1, 2, 4)]
        assert all(isinstance(ids, list) for ids in kept)
        assert store.counters.posts_combined >= 5
        stored = await read_all(store, project, "q")
        assert [n for _, _, n in stored] == [0, 2, 3, 4, 5, 8]
        assert [i for i, _, _ in stored[1:]] == [i for ids in kept for i in ids]
        stats = await store.queue_stats(project, "q")
        assert stats.total == 6


async def test_one_idempotency_key_twice_in_a_burst_stores_once(
    stores: StoreMaker, project: str, redis_url: str
) -> None:
    async with stores() as store:
        await store.post_messages(project, "q", WRITER, messages(0))
        before = await counter(redis_url, project, "q")
        posts = [(messages(1, 2), 0, "k"), (messages(3), 0, None), (messages(4, 5), 0, "k"),
                 (messages(6), 0, "other"), (messages(7, 8), 0, "k")]  # fmt: skip
        first, plain, again, other, third = await burst(store, project, "q", posts)
        assert store.counters.posts_combined >= 4
        assert first == again == third and len(first) == 2
        assert await counter(redis_url, project, "q") == before + 4  # 2 + 1 + 1
        stored = await read_all(store, project, "q")
        assert [n for _, _, n in stored] == [0, 1, 2, 3, 6]
        assert [i for i, _, _ in stored[1:]] == [*first, *plain, *other]
        # and a later retry of the key is answered as the first
        assert (
            await store.post_messages(project, "q", WRITER, messages(9), idempotency_key="k")
            == first
        )


async def test_the_project_quota_is_exact_under_a_burst(
    stores: StoreMaker, project: str, topology: str
) -> None:
    """Exact on one server; on a cluster within the posts in flight of it
    (quotas.py, docs/design.md: Quotas): the burst's 15, at most."""
    async with stores(project_max_messages=10) as store:
        await store.post_messages(project, "q", WRITER, messages(0))
        outcomes = await burst(store, project, "q", [(messages(n), 0, None) for n in range(1, 16)])
        posted = [o for o in outcomes if isinstance(o, list)]
        assert all(isinstance(o, ProjectMessagesFull) for o in outcomes if not isinstance(o, list))
        stored = len(await read_all(store, project, "q"))
        assert stored == 1 + len(posted)
        if topology == "cluster":  # within the posts in flight of it, either way
            assert stored <= 10 + 15
        else:
            assert stored == 10
        usage = await store.quotas.usage(project)
        assert usage["messages"] == stored and usage["in_flight"] == 0


@pytest.fixture
async def lua(redis_server: RedisServer, clock: ManualClock) -> AsyncIterator[LuaStore]:
    settings = make_settings(
        redis_server.url, driver="lua", storage_layout="segments", message_encryption_key=KEY
    )
    async with opened_store(settings, clock) as store:
        assert isinstance(store, LuaStore)
        yield store


async def evalsha_calls(client: Redis) -> int:
    stats: Any = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_common_page_reads_no_counter_and_no_queue_hash(
    lua: LuaStore, redis_server: RedisServer, project: str
) -> None:
    """A page from a client's marker within one segment (what a reader
    paging through a backlog asks) reads its slots, its records and whether
    any claim state exists: its marker is proven given out by the written
    slot after the page, so the counter is not read to check it. The same
    round trip reads the segment's whole slot table, for the page after."""
    await lua.post_messages(project, "q", WRITER, messages(*range(30)))
    first = await lua.list_messages(project, "q", ListQuery(READER, limit=10))
    query = ListQuery(READER, marker=first.next_marker, limit=10, check_marker=True)
    page, called = await commands_of(redis_server.url, lua.list_messages(project, "q", query))
    assert [orjson.loads(m.body)["n"] for m in page.messages] == list(range(10, 20))
    assert called == {"evalsha": 1, "getrange": 3, "exists": 1}
    # a marker past the counter is still refused
    ahead = ListQuery(READER, marker=(first.next_marker or 0) + 10**6, limit=10, check_marker=True)
    with pytest.raises(MarkerNotGivenOut):
        await lua.list_messages(project, "q", ahead)


async def commands_of(redis_url: str, work: Awaitable[T]) -> tuple[T, dict[str, int]]:
    """What work returned, and the commands Redis ran for it (on every node
    of a cluster): name -> calls."""
    client = direct_client(redis_url)
    nodes = {"target_nodes": RedisCluster.ALL_NODES} if isinstance(client, RedisCluster) else {}
    try:
        await client.config_resetstat(**nodes)
        done = await work
        stats: Any = await client.info("commandstats", **nodes)
    finally:
        await client.aclose()
    called: dict[str, int] = {}
    for node in stats.values() if nodes else [stats]:
        for k, v in node.items():
            if k.startswith("cmdstat_") and k != "cmdstat_config|resetstat":
                name = k.removeprefix("cmdstat_")
                called[name] = called.get(name, 0) + int(v["calls"])
    return done, called


async def pages_from(store: FeedStore, project: str, marker: int | None, **query: Any) -> list[int]:
    """The body numbers of a 10-message page from marker."""
    page = await store.list_messages(
        project, "q", ListQuery(READER, marker=marker, limit=10, **query)
    )
    return [orjson.loads(m.body)["n"] for m in page.messages]


async def third_page_marker(store: FeedStore, project: str) -> int:
    """Post 0..49 to q, read the first two pages as a reader does: the
    marker the third page starts from (its segment's table is known now)."""
    await store.post_messages(project, "q", WRITER, messages(*range(50)))
    marker = None
    for _ in range(2):
        page = await store.list_messages(project, "q", ListQuery(READER, marker=marker, limit=10))
        marker = page.next_marker
    assert marker is not None
    return marker


async def test_a_reader_pages_on_by_three_plain_reads(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    """Once a page has read its segment's slot table, the reader's next
    page from its marker is one round trip of plain reads: its records where
    that table says, the table again, its messages' claim states. No
    script, no counter, no queue hash (known_tables.py)."""
    async with stores() as store:
        marker = await third_page_marker(store, project)
        got, called = await commands_of(redis_url, pages_from(store, project, marker))
        assert got == list(range(20, 30))
        assert called == {"getrange": 2, "hmget": 1}


async def test_a_page_across_a_segment_end_is_plain_reads_too(
    stores: StoreMaker, redis_url: str, project: str
) -> None:
    """A page that reaches its segment's end reads the rest of that segment
    (closed: the seq after the page was given out) and the start of the next
    one, whose table the page before read ahead: still one round trip of
    plain reads, whether the page ends at the segment's end or past it."""
    async with stores() as store:
        ids = await store.post_messages(project, "q", WRITER, messages(*range(250)))
        first = int(ids[0][11:], 16)
        edge = (first // segments.SLOTS + 1) * segments.SLOTS  # the next segment's first seq
        assert await pages_from(store, project, edge - 26) == list(
            range(edge - 25 - first, edge - 15 - first)
        )
        assert await pages_from(store, project, edge - 16) == list(
            range(edge - 15 - first, edge - 5 - first)
        )
        across, called = await commands_of(redis_url, pages_from(store, project, edge - 6))
        assert across == list(range(edge - 5 - first, edge + 5 - first))
        # two records reads, two tables, the length of the segment read to its end
        assert called == {"getrange": 4, "strlen": 1, "hmget": 1}
        to_the_end, called = await commands_of(redis_url, pages_from(store, project, edge - 11))
        assert to_the_end == list(range(edge - 10 - first, edge - first))
        # the next segment's table: its first slot
        assert called == {"getrange": 3, "strlen": 1, "hmget": 1}


async def test_a_known_table_of_a_rewritten_segment_is_not_trusted(
    stores: StoreMaker, project: str, clock: ManualClock
) -> None:
    """A review that rewrites the segment after its table was read moves
    the records the next page wants: the page is read as if no table were
    known, and reads them whole where they are now."""
    async with stores(sweep_interval=5) as store:
        assert isinstance(store, LuaStore | WatchStore) and store.sweeper is not None
        await store.sweeper.close()  # its ticks run here, on the clock moved
        marker = await third_page_marker(store, project)
        listed = await store.list_messages(project, "q", ListQuery(READER, limit=10))
        await store.delete_messages(project, "q", [m.id for m in listed.messages[:5]])
        clock.advance(reviews.DELETE_REVIEW_MS / 1000)
        await store.sweeper.tick()
        assert await pages_from(store, project, marker) == list(range(20, 30))
        # and the table read on the way is known: the page after reads right too
        assert await pages_from(store, project, marker + 10) == list(range(30, 40))


class ReviewBetween:
    """A transport whose first call_checked runs its first command, then
    review(), then the rest: a review landing inside a pipeline of reads
    (their round trip is not atomic)."""

    def __init__(self, transport: Any, review: Callable[[], Awaitable[Any]]) -> None:
        self.transport, self.review = transport, review

    async def call_checked(self, commands: list[Any], idempotent: bool = False) -> list[Any]:
        first = await self.transport.call_checked(commands[:1], idempotent=idempotent)
        await self.review()
        return [*first, *await self.transport.call_checked(commands[1:], idempotent=idempotent)]


async def test_a_review_inside_a_page_across_a_segment_end_is_caught(
    stores: StoreMaker, project: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table of a segment known from while it was open has zero slots
    past its counter then. Posted, deleted and dropped by a review since,
    those slots read zero again: a page across the segment's end whose
    records were read before such a review (to the segment's end, as it
    was) must not take those bytes as its last record's (found in review:
    a body with four deleted records' bytes after it)."""
    async with stores(sweep_interval=5) as store:
        assert isinstance(store, LuaStore | WatchStore) and store.sweeper is not None
        sweeper = store.sweeper
        await sweeper.close()  # its ticks run here, on the clock moved
        ids = await store.post_messages(project, "q", WRITER, messages(*range(95)))
        first = int(ids[0][11:], 16)
        assert first % segments.SLOTS == 1  # the manual clock's counter: n is slot n + 1
        seq = {n: first + n for n in range(200)}
        # the open segment's table known, slots 96.. zero
        await pages_from(store, project, seq[79])
        more = await store.post_messages(project, "q", WRITER, messages(*range(95, 105)))
        await pages_from(store, project, seq[99])  # the next segment's table known
        await store.delete_messages(project, "q", more[:4])  # slots 96..99
        clock.advance(reviews.DELETE_REVIEW_MS / 1000)

        async def review_inside(transport: Transport, *args: Any) -> Any:
            between = cast(Transport, ReviewBetween(transport, sweeper.tick))
            return await known_tables.read_known(between, *args)

        monkeypatch.setattr(lua_segments, "read_known", review_inside)
        monkeypatch.setattr(watch_segments, "read_known", review_inside)
        query = ListQuery(READER, marker=seq[90], limit=10)
        page = await store.list_messages(project, "q", query)
        shown = [orjson.loads(m.body)["n"] for m in page.messages]
        assert shown == [*range(91, 95), *range(99, 105)]


async def test_a_page_by_plain_reads_leaves_out_what_went_since_its_table_was_read(
    stores: StoreMaker, project: str
) -> None:
    """A message deleted or claimed after the table was read is left out of
    the page, as it is from a page read by the script: the table read again
    in the same round trip has its gone bit, the claim states its claim."""
    async with stores() as store:
        marker = await third_page_marker(store, project)
        claim = await store.claim_messages(project, "q", 60, 60, 3)
        assert claim is not None and len(claim.messages) == 3  # the first three: 0, 1, 2
        await store.delete_messages(project, "q", [m.id for m in claim.messages])
        claim = await store.claim_messages(project, "q", 60, 60, 20)
        assert claim is not None
        assert {orjson.loads(m.body)["n"] for m in claim.messages} == set(range(3, 23))
        # the page's table known as it is now, then 25 deleted
        listed = await store.list_messages(
            project, "q", ListQuery(READER, marker=marker, limit=10, include_claimed=True)
        )
        assert orjson.loads(listed.messages[5].body)["n"] == 25
        await store.delete_messages(project, "q", [listed.messages[5].id])
        assert await pages_from(store, project, marker) == [23, 24, *range(26, 34)]
        shown = await pages_from(store, project, marker, include_claimed=True)
        assert shown == [*range(20, 25), *range(26, 31)]


def updated(change: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    return metadata | change


async def test_a_post_takes_the_queue_defaults_another_process_set_since(
    stores: StoreMaker, project: str, clock: ManualClock
) -> None:
    """A message without ttl or delay takes the queue's defaults as they are
    when it is posted, though another process changed them after this one
    last posted there (the lua driver builds records with the defaults it
    last saw; its script refuses them when they changed)."""
    async with stores() as store, stores() as other:
        await store.create_queue(project, "q", {})
        await store.post_messages(project, "q", WRITER, messages(0))
        for ttl, delay in ((120, 0), (240, 30), (240, 0)):
            change = {"_default_message_ttl": ttl, "_default_message_delay": delay}
            await other.update_queue_metadata(project, "q", functools.partial(updated, change))
            [posted] = await store.post_messages(
                project, "q", WRITER, [NewMessage(orjson.dumps({"n": ttl}), None)]
            )
            [got] = await store.get_messages(project, "q", [posted])
            assert got.ttl == ttl
            hidden = await store.list_messages(project, "q", ListQuery(READER, limit=20))
            assert (posted in {m.id for m in hidden.messages}) == (delay == 0)


async def burst_calls(
    lua: LuaStore, server: RedisServer, project: str, posts: list[Any]
) -> tuple[list[Any], int]:
    """A burst of posts to queue q (after one that makes its keys): their
    outcomes, and the script calls Redis ran for them."""
    await lua.post_messages(project, "q", WRITER, messages(-1))
    client = Redis.from_url(server.url)
    try:
        before = await evalsha_calls(client)
        outcomes = await burst(lua, project, "q", posts)
        return outcomes, await evalsha_calls(client) - before
    finally:
        await client.aclose()


async def test_a_burst_is_one_script_call(
    lua: LuaStore, redis_server: RedisServer, project: str
) -> None:
    posts = [(messages(n), 0, None) for n in range(30)]
    outcomes, calls = await burst_calls(lua, redis_server, project, posts)
    assert all(isinstance(o, list) for o in outcomes)
    assert calls == 1  # one call of post_segments.lua for the 30 posts
    assert lua.counters.posts_combined == 29


async def test_a_call_is_bounded_by_messages(
    lua: LuaStore, redis_server: RedisServer, project: str
) -> None:
    posts = [(messages(*range(10 * i, 10 * i + 10)), 0, None) for i in range(25)]
    outcomes, calls = await burst_calls(lua, redis_server, project, posts)
    assert all(isinstance(o, list) for o in outcomes)
    assert calls == 3  # 250 messages, at most 100 a call
    assert [n for _, _, n in await read_all(lua, project, "q")] == list(range(-1, 250))


async def test_an_unsealed_post_to_an_encrypted_queue_refuses_only_itself(
    lua: LuaStore, redis_server: RedisServer, project: str
) -> None:
    await lua.create_queue(project, "vault", {"_enable_encrypt_messages": True})
    keys = QueueKeys.of(project, "vault")
    seal = lua.parts.opener.sealer.seal

    def post(n: int, sealed: bool) -> SegmentPost:
        [message] = messages(n)
        if sealed:
            message = NewMessage(seal(message.body), 300)
        return SegmentPost(keys, project, "vault", WRITER, [message], 10, sealed, None)

    outcomes = await asyncio.gather(
        *(lua.segments.post(post(n, n != 1), None, True) for n in range(3)),
        return_exceptions=True,
    )
    assert isinstance(outcomes[1], MustSeal)
    assert isinstance(outcomes[0], list) and isinstance(outcomes[2], list)
    assert lua.counters.posts_combined == 2
    assert [n for _, _, n in await read_all(lua, project, "vault")] == [0, 2]
    client = Redis.from_url(redis_server.url)
    try:
        numbers: Any = await client.zrange(keys.directory, 0, -1)
        [k] = numbers
        raw = await client.get(keys.segment(int(k)))
        assert isinstance(raw, bytes) and b'{"n":1}' not in raw
    finally:
        await client.aclose()


async def test_a_burst_whose_script_was_flushed_is_stored_once(
    lua: LuaStore, redis_server: RedisServer, project: str
) -> None:
    await lua.post_messages(project, "q", WRITER, messages(-1))
    client = Redis.from_url(redis_server.url)
    try:
        await client.script_flush()
    finally:
        await client.aclose()
    outcomes = await burst(lua, project, "q", [(messages(n), 0, None) for n in range(10)])
    assert all(isinstance(o, list) for o in outcomes)
    assert lua.counters.noscript_reloads == 1  # the one call, loaded and sent again
    assert [n for _, _, n in await read_all(lua, project, "q")] == list(range(-1, 10))


async def test_a_failed_call_fails_every_post_of_it(
    lua: LuaStore, redis_server: RedisServer, project: str
) -> None:
    await lua.post_messages(project, "q", WRITER, messages(-1))
    client = Redis.from_url(redis_server.url)
    keys = QueueKeys.of(project, "q")
    try:
        await client.delete(keys.seq)
        await client.hset(keys.seq, "not", "a counter")  # INCRBY fails in the script
        outcomes = await burst(lua, project, "q", [(messages(n), 0, None) for n in range(5)])
        assert lua.counters.posts_combined == 4
        assert all(isinstance(o, Exception) for o in outcomes)
        assert len({type(o) for o in outcomes}) == 1
        numbers: Any = await client.zrange(keys.directory, 0, -1)
        [k] = numbers
        segment = keys.segment(int(k))
        table: Any = await client.getrange(segment, 0, segments.TABLE_BYTES - 1)
        assert sum(1 for v in segments.slot_offsets(table) if v) == 1  # the first post's only
    finally:
        await client.aclose()


async def test_a_call_that_schedules_no_review_notes_none(
    lua: LuaStore, redis_server: RedisServer, project: str, clock: ManualClock
) -> None:
    """The first post opens a segment and notes its review in fs:sweep; a
    later one in the same segment, expiring no earlier, leaves it as it is."""
    await lua.post_messages(project, "q", WRITER, messages(0))
    await lua.parts.sweeps.noted()
    client = Redis.from_url(redis_server.url)
    member = reviews.sweep_member("queue", project, "q")
    try:
        due = await client.zscore(SWEEP_KEY, member)
        assert due is not None and due > clock.now_ms()
        await burst(lua, project, "q", [(messages(n), 0, None) for n in range(1, 4)])
        await lua.post_messages(project, "q", WRITER, messages(4))
        await lua.parts.sweeps.noted()
        assert await client.zscore(SWEEP_KEY, member) == due
    finally:
        await client.aclose()
