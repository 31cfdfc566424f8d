"""The segment layout (issue 30, storage/segments.py) on a real Redis: posts,
lists and reads by id round trip every field; markers never skip or repeat
across segment boundaries; a queue that switches from the older layout is
read legacy first, then segments, each message once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial

import orjson
import pytest

from feedsvc.clock import ManualClock
from feedsvc.errors import MarkerNotGivenOut, ProjectMessagesFull, QueueFull
from feedsvc.storage import segments
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage, Parent, Unreadable
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.sealing import MAGIC
from feedsvc.storage.segment_pages import PageScan, read_by_commands, scan_segments
from feedsvc.storage.transport import Transport
from tests.conftest import direct_client, make_settings, opened_store

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())
KEY = "correct horse battery staple, twice"

StoreMaker = Callable[..., AbstractAsyncContextManager[FeedStore]]


@pytest.fixture(params=["lua", "watch", "watch-naive"])
def driver(request: pytest.FixtureRequest) -> str:
    """The drivers that write segments so far."""
    return str(request.param)


@pytest.fixture
def stores(redis_url: str, driver: str, clock: ManualClock) -> StoreMaker:
    """Open a store of the driver under test in a layout."""

    @asynccontextmanager
    async def opened(layout: str = "segments", **changes: object) -> AsyncIterator[FeedStore]:
        settings = make_settings(redis_url, driver=driver, storage_layout=layout, **changes)
        async with opened_store(settings, clock) as feed:
            yield feed

    return opened


def body(n: int) -> bytes:
    return orjson.dumps({"n": n})


async def read_all(
    store: FeedStore, project: str, queue: str, limit: int, marker: int | None = None, **query: bool
) -> tuple[list[int], int | None]:
    """Follow next markers until an empty page: the bodies' n seen, the last marker."""
    seen: list[int] = []
    for _ in range(10_000):
        page = await store.list_messages(
            project, queue, ListQuery(READER, marker=marker, limit=limit, **query)
        )
        if not page.messages:
            assert page.next_marker is None
            return seen, marker
        assert page.next_marker is not None and (marker is None or page.next_marker > marker)
        seen += [orjson.loads(m.body)["n"] for m in page.messages]
        marker = page.next_marker
    raise AssertionError("the pages never ended")


async def test_a_post_lists_and_reads_back_every_field(
    stores: StoreMaker, project: str, redis_url: str
) -> None:
    async with stores() as store:
        posted = [
            NewMessage(body(0), 300),
            NewMessage(body(1), 600, headers=b'{"traceparent":"x"}'),
            NewMessage(body(2), 300, group="g1"),
            NewMessage(body(3), 300, headers=b'{"a":"b"}', group="g1"),
        ]
        ids = await store.post_messages(project, "q", WRITER, posted)
        tag = segments.id_tag(QueueKeys.of(project, "q").prefix)
        assert all(len(i) == 24 and i.startswith(tag) for i in ids)
        assert ids == sorted(ids)
        page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
        assert [m.id for m in page.messages] == ids
        assert [m.body for m in page.messages] == [m.body for m in posted]
        assert [m.headers for m in page.messages] == [
            None,
            b'{"traceparent":"x"}',
            None,
            b'{"a":"b"}',
        ]
        assert [m.group for m in page.messages] == [None, None, "g1", "g1"]
        assert [m.ttl for m in page.messages] == [300, 600, 300, 300]
        assert [m.seq for m in page.messages] == [int(i[11:], 16) for i in ids]
        got = await store.get_messages(project, "q", [ids[3], ids[1], "0" * 24])
        assert [(m.id, m.body, m.headers, m.group) for m in got] == [
            (ids[3], body(3), b'{"a":"b"}', "g1"),
            (ids[1], body(1), b'{"traceparent":"x"}', None),
        ]
        # the record is in a segment, no key of its own
        client = direct_client(redis_url)
        try:
            keys = QueueKeys.of(project, "q")
            assert not await client.exists(keys.record(ids[0]))
            k, _ = segments.segment_of(page.messages[0].seq)
            assert await client.exists(keys.segment(k))
        finally:
            await client.aclose()


async def test_echo_delay_and_expiry_filter_as_the_older_layout_does(
    stores: StoreMaker, project: str, clock: ManualClock
) -> None:
    async with stores() as store:
        mine = await store.post_messages(project, "q", READER, [NewMessage(body(0), 300)])
        await store.post_messages(project, "q", WRITER, [NewMessage(body(1), 300, delay=60)])
        await store.post_messages(project, "q", WRITER, [NewMessage(body(2), 5)])
        await store.post_messages(project, "q", WRITER, [NewMessage(body(3), 300)])
        assert (await read_all(store, project, "q", 10))[0] == [2, 3]
        assert (await read_all(store, project, "q", 10, echo=True))[0] == [0, 2, 3]
        assert (await read_all(store, project, "q", 10, include_delayed=True))[0] == [1, 2, 3]
        page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
        assert page.next_due is None and page.next_marker is not None
        # a delayed message the page would show once due is not passed
        first = await store.list_messages(project, "q", ListQuery(READER, limit=1, echo=True))
        assert [m.id for m in first.messages] == mine
        clock.advance(10)
        seen, marker = await read_all(store, project, "q", 10)
        assert seen == [3]
        clock.advance(60)
        assert (await read_all(store, project, "q", 10))[0] == [1, 3]
        assert marker is not None
        got = await store.get_messages(project, "q", mine)
        assert [m.body for m in got] == [body(0)]


@pytest.mark.parametrize("batch", [1, 7, 100, 33])
async def test_markers_never_skip_or_repeat_across_segment_boundaries(
    stores: StoreMaker, project: str, clock: ManualClock, batch: int
) -> None:
    async with stores(max_messages_per_post=100) as store:
        n = 0
        while n < 260:
            size = min(batch, 260 - n)
            posted = [NewMessage(body(n + i), 5 if (n + i) % 3 == 0 else 300) for i in range(size)]
            await store.post_messages(project, "q", WRITER, posted)
            n += size
        for limit in (1, 7, 10, 20):
            assert (await read_all(store, project, "q", limit))[0] == list(range(260))
        # a page from every marker goes on from the message after it
        page = await store.list_messages(project, "q", ListQuery(READER, limit=20))
        for m in page.messages:
            after = await store.list_messages(
                project, "q", ListQuery(READER, marker=m.seq, limit=1)
            )
            assert orjson.loads(after.messages[0].body)["n"] == orjson.loads(m.body)["n"] + 1
        clock.advance(10)
        expected = [i for i in range(260) if i % 3]
        for limit in (1, 10):
            assert (await read_all(store, project, "q", limit))[0] == expected
        # from a marker, missed counts the expired seqs after it exactly
        first = await store.list_messages(project, "q", ListQuery(READER, limit=1))
        assert first.messages[0].seq == page.messages[1].seq
        marker = page.messages[0].seq - 1  # before message 0 (expired)
        again = await store.list_messages(project, "q", ListQuery(READER, marker=marker, limit=2))
        assert [orjson.loads(m.body)["n"] for m in again.messages] == [1, 2]
        assert again.missed == 1


async def test_a_marker_past_the_counter_is_refused(stores: StoreMaker, project: str) -> None:
    async with stores() as store:
        [one] = await store.post_messages(project, "q", WRITER, [NewMessage(body(0), 300)])
        with pytest.raises(MarkerNotGivenOut):
            await store.list_messages(
                project, "q", ListQuery(READER, marker=int(one[11:], 16) + 5, check_marker=True)
            )


async def test_a_queue_switches_to_segments_once_and_is_read_legacy_then_segments(
    stores: StoreMaker, project: str, redis_url: str
) -> None:
    async with stores("records") as old, stores("segments") as new:
        legacy = []
        for i in range(0, 25, 5):
            legacy += await old.post_messages(
                project, "q", WRITER, [NewMessage(body(n), 300) for n in range(i, i + 5)]
            )
        page = await old.list_messages(project, "q", ListQuery(READER, limit=12))
        old_marker = page.next_marker
        assert old_marker is not None
        fresh = await new.post_messages(
            project, "q", WRITER, [NewMessage(body(n), 300) for n in range(25, 40)]
        )
        # a process configured records: the queue's segments win
        fresh += await old.post_messages(project, "q", WRITER, [NewMessage(body(40), 300)])
        assert fresh == sorted(fresh)
        client = direct_client(redis_url)
        try:
            keys = QueueKeys.of(project, "q")
            assert not await client.exists(keys.record(fresh[-1]))
            ns = int(await client.hget(keys.meta, segments.NEW_START) or 0)
            assert ns == int(fresh[0][11:], 16)
        finally:
            await client.aclose()
        for store in (old, new):
            for limit in (1, 3, 10, 20):
                assert (await read_all(store, project, "q", limit))[0] == list(range(41))
                seen, _ = await read_all(store, project, "q", limit, marker=old_marker)
                assert seen == list(range(12, 41))
            got = await store.get_messages(project, "q", [legacy[3], fresh[3], fresh[-1]])
            assert [m.body for m in got] == [body(3), body(28), body(40)]


async def test_a_segment_post_collects_the_older_layout_until_it_is_empty(
    stores: StoreMaker,
    project: str,
    redis_url: str,
    clock: ManualClock,
) -> None:
    """The post looks at the older layout's index while it has messages,
    and stops looking (LEGACY_GONE) only once it is empty; a new queue in
    segments never looks."""
    client = direct_client(redis_url)
    keys = QueueKeys.of(project, "q")
    try:
        async with stores("records") as old, stores("segments") as new:
            await old.post_messages(project, "q", WRITER, [NewMessage(body(0), 60)])
            await new.post_messages(project, "q", WRITER, [NewMessage(body(1), 300)])
            # a live legacy message: the post must keep collecting
            assert await client.zcard(keys.expiry) == 1
            assert not await client.hexists(keys.meta, segments.LEGACY_GONE)
            clock.advance(61)
            await new.post_messages(project, "q", WRITER, [NewMessage(body(2), 300)])
            # expired: the post removed its index entries and stopped looking
            assert not await client.exists(keys.expiry, keys.index)
            assert await client.hget(keys.meta, segments.LEGACY_GONE) == b"1"
            await new.post_messages(project, "fresh", WRITER, [NewMessage(body(3), 300)])
            fresh = QueueKeys.of(project, "fresh").meta
            assert await client.hget(fresh, segments.LEGACY_GONE) == b"1"
            assert (await read_all(new, project, "q", 10))[0] == [1, 2]
    finally:
        await client.aclose()


async def test_the_older_layout_is_marked_empty_by_the_post_that_collects_its_last_batch(
    stores: StoreMaker, project: str, redis_url: str, clock: ManualClock
) -> None:
    """Exactly one collection batch (100) of expired legacy messages: the
    post that forgets them knows the index is empty after it, and marks it."""
    client = direct_client(redis_url)
    keys = QueueKeys.of(project, "q")
    try:
        async with stores("records", max_messages_per_post=100) as old:
            await old.post_messages(
                project, "q", WRITER, [NewMessage(body(i), 60) for i in range(100)]
            )
        clock.advance(61)
        async with stores("segments") as new:
            await new.post_messages(project, "q", WRITER, [NewMessage(body(100), 300)])
        assert not await client.exists(keys.expiry)
        assert await client.hget(keys.meta, segments.LEGACY_GONE) == b"1"
    finally:
        await client.aclose()


async def test_idempotent_posts_are_answered_as_the_first(
    stores: StoreMaker, project: str, redis_url: str
) -> None:
    async with stores() as store:
        batch = [NewMessage(body(0), 300), NewMessage(body(1), 300)]
        first = await store.post_messages(project, "q", WRITER, batch, idempotency_key="k1")
        client = direct_client(redis_url)
        try:
            counter = await client.get(QueueKeys.of(project, "q").seq)
            again = await store.post_messages(project, "q", WRITER, batch, idempotency_key="k1")
            # the retry wrote nothing: the counter did not move
            assert await client.get(QueueKeys.of(project, "q").seq) == counter
        finally:
            await client.aclose()
        assert again == first
        assert (await read_all(store, project, "q", 10))[0] == [0, 1]


async def test_a_full_queue_refuses_posts(stores: StoreMaker, project: str) -> None:
    async with stores() as store:
        await store.create_queue(project, "q", {"_max_messages": 3})
        await store.post_messages(
            project, "q", WRITER, [NewMessage(body(i), 300) for i in range(3)]
        )
        with pytest.raises(QueueFull):
            await store.post_messages(project, "q", WRITER, [NewMessage(body(3), 300)])
        assert (await read_all(store, project, "q", 10))[0] == [0, 1, 2]


async def test_sealed_bodies_are_stored_sealed(
    stores: StoreMaker, project: str, redis_url: str
) -> None:
    async with stores(message_encryption_key=KEY) as store:
        await store.create_queue(project, "vault", {"_enable_encrypt_messages": True})
        ids = await store.post_messages(project, "vault", WRITER, [NewMessage(body(7), 300)])
        page = await store.list_messages(project, "vault", ListQuery(READER, limit=10))
        assert [m.body for m in page.messages] == [body(7)]
        assert [m.body for m in await store.get_messages(project, "vault", ids)] == [body(7)]
        client = direct_client(redis_url)
        try:
            k, _ = segments.segment_of(page.messages[0].seq)
            raw = await client.get(QueueKeys.of(project, "vault").segment(k))
            assert isinstance(raw, bytes) and MAGIC in raw and b'{"n":7}' not in raw
        finally:
            await client.aclose()


def test_the_record_codec_round_trips() -> None:
    author = segments.author_bytes(WRITER)
    extra = segments.extras("g", b'{"a":"b"}')
    raw = segments.encode_record(1_800_000_000_000, 0, 300, author, extra, b'{"x":1}')
    rec = segments.SegmentRecord.decode(5, raw)
    assert (rec.expires, rec.due, rec.ttl, rec.body) == (1_800_000_000_000, 0, 300, b'{"x":1}')
    assert segments.author_text(rec.author) == WRITER
    assert segments.split_extras(rec.extras) == ("g", b'{"a":"b"}')
    assert rec.created == 1_800_000_000_000 - 300_000
    tag = segments.id_tag(QueueKeys.of("p", "q").prefix)
    assert len(tag) == 11 and tag != segments.id_tag(QueueKeys.of("p", "r").prefix)
    seq = 1_799_999_999_999_999
    assert segments.seq_of(tag, segments.message_id(tag, seq)) == seq
    assert segments.seq_of(tag, "0123456789abcdef01234567") is None
    state = segments.ClaimState("c" * 24, 5, 2, 9)
    assert segments.ClaimState.decode(state.encode()) == state


async def test_stats_count_both_layouts(
    stores: StoreMaker, project: str, clock: ManualClock
) -> None:
    async with stores("records") as old, stores("segments") as new:
        legacy = await old.post_messages(project, "q", WRITER, [NewMessage(body(0), 300)])
        fresh = await new.post_messages(
            project, "q", WRITER, [NewMessage(body(i), 300) for i in (1, 2)]
        )
        stats = await new.queue_stats(project, "q")
        assert (stats.total, stats.claimed, stats.free) == (3, 0, 3)
        assert stats.oldest is not None and stats.oldest.id == legacy[0]
        assert stats.newest is not None and stats.newest.id == fresh[-1]
        only = await new.post_messages(project, "s", WRITER, [NewMessage(body(3), 300)])
        stats = await new.queue_stats(project, "s")
        assert stats.total == 1 and stats.oldest == stats.newest
        assert stats.oldest is not None and stats.oldest.id == only[0]
        assert stats.oldest.created_ms == clock.now_ms()


async def test_the_project_quota_counts_segment_messages(stores: StoreMaker, project: str) -> None:
    async with stores(project_max_messages=3) as store:
        await store.post_messages(project, "a", WRITER, [NewMessage(body(i), 300) for i in (0, 1)])
        await store.post_messages(project, "b", WRITER, [NewMessage(body(2), 300)])
        with pytest.raises(ProjectMessagesFull):
            await store.post_messages(project, "a", WRITER, [NewMessage(body(3), 300)])
        usage = await store.quotas.usage(project)
        assert usage["messages"] == 3


async def test_deliveries_read_both_layouts_in_order(
    stores: StoreMaker, project: str, clock: ManualClock
) -> None:
    """A subscription's delivery reads (no script) find the older messages,
    then the segments', gone ones as None so the position moves past them."""
    async with stores("records") as old, stores("segments") as new:
        await old.post_messages(project, "q", WRITER, [NewMessage(body(0), 300)])
        await new.post_messages(
            project, "q", WRITER, [NewMessage(body(i), 5 if i == 2 else 300) for i in range(1, 150)]
        )
        clock.advance(10)
        parent = Parent("queue", project, "q")
        seen: list[int | None] = []
        position = 0
        while batch := await new.deliveries.messages_after(parent, position, 40):
            for seq, message in batch:
                assert seq > position
                position = seq
                assert not isinstance(message, Unreadable)
                seen.append(None if message is None else orjson.loads(message.body)["n"])
        assert seen == [0, 1, None, *range(3, 150)]


async def test_the_read_by_commands_pages_as_the_script_does(
    stores: StoreMaker, project: str, redis_url: str, clock: ManualClock
) -> None:
    """read_by_commands (no script) answers what read_segments.lua does."""
    async with stores() as store:
        for i in range(0, 230, 23):
            batch = [NewMessage(body(n), 5 if n % 4 == 0 else 300) for n in range(i, i + 23)]
            await store.post_messages(project, "q", WRITER, batch)
        clock.advance(10)
        keys = QueueKeys.of(project, "q")
        transport = Transport(make_settings(redis_url), clock)
        try:
            transport.open()
            for limit in (1, 10, 20):
                marker: int | None = None
                while True:
                    query = ListQuery(READER, marker=marker, limit=limit)
                    tag = segments.id_tag(keys.prefix)
                    scan = PageScan(tag, query, clock.now_ms(), 1000)
                    read = partial(read_by_commands, transport, keys, clock.now_ms())
                    page = await scan_segments(read, scan, marker, None, False)
                    assert page == await store.list_messages(project, "q", query)
                    if not page.messages:
                        break
                    marker = page.next_marker
        finally:
            await transport.close()


async def test_an_id_reaches_its_own_queue_only(stores: StoreMaker, project: str) -> None:
    """Seqs of two queues overlap; their ids do not (segments.id_tag)."""
    async with stores() as store:
        mine = await store.post_messages(project, "a", WRITER, [NewMessage(body(0), 300)])
        theirs = await store.post_messages(project, "b", WRITER, [NewMessage(body(1), 300)])
        # b's counter started where a's did (the same clock): the same seq
        assert mine[0][11:] == theirs[0][11:] and mine != theirs
        assert await store.get_messages(project, "a", theirs) == []
        assert [m.id for m in await store.get_messages(project, "b", theirs)] == theirs


async def test_a_gone_slot_is_passed_and_ends_the_record_before_it(
    stores: StoreMaker, project: str, redis_url: str
) -> None:
    """A deleted message's slot keeps its offset with GONE_BIT set until its
    segment's review: readers pass it, and the record before still ends there."""
    async with stores() as store:
        ids = await store.post_messages(
            project, "q", WRITER, [NewMessage(body(i), 300) for i in range(5)]
        )
        page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
        seqs = [m.seq for m in page.messages]
        keys = QueueKeys.of(project, "q")
        client = direct_client(redis_url)
        try:
            for seq in seqs[1], seqs[3]:
                k, slot = segments.segment_of(seq)
                at = slot * segments.SLOT_BYTES
                raw = await client.getrange(keys.segment(k), at, at + 3)
                assert isinstance(raw, bytes)
                gone = int.from_bytes(raw, "big") | segments.GONE_BIT
                await client.setrange(keys.segment(k), at, gone.to_bytes(4, "big"))
        finally:
            await client.aclose()
        for limit in (1, 2, 10):
            assert (await read_all(store, project, "q", limit))[0] == [0, 2, 4]
        got = await store.get_messages(project, "q", ids)
        assert [m.body for m in got] == [body(0), body(2), body(4)]
        after = await store.list_messages(project, "q", ListQuery(READER, marker=seqs[0], limit=1))
        assert [m.body for m in after.messages] == [body(2)] and after.missed == 1


async def test_missed_counts_from_the_seq_base_over_a_page_of_several_reads(
    stores: StoreMaker, project: str, clock: ManualClock
) -> None:
    """A marker older than the queue (below its seq base) counts missed from
    the base, also when the page took several reads: the reads after the
    first one start at a message's seq and may leave the base out."""
    async with stores() as store:
        posted = [NewMessage(body(i), 5 if i < 10 else 300) for i in range(30)]
        await store.post_messages(project, "q", WRITER, posted)
        clock.advance(10)  # the first 10 expired: the first read shows nothing
        first = (await store.list_messages(project, "q", ListQuery(READER, limit=1))).messages[0]
        marker = first.seq - 10 - 50  # 50 below the base (the seq before the first message)
        page = await store.list_messages(project, "q", ListQuery(READER, marker=marker, limit=10))
        assert [orjson.loads(m.body)["n"] for m in page.messages] == list(range(10, 20))
        assert page.missed == 10


async def test_a_follower_passes_expired_messages_up_to_the_counter(
    stores: StoreMaker, project: str, clock: ManualClock
) -> None:
    """An empty page from a marker before only expired messages passes them
    all, up to the counter: a read that stands a written seq in for the
    counter never ends the page."""
    async with stores() as store:
        ids = await store.post_messages(
            project, "q", WRITER, [NewMessage(body(i), 5) for i in range(35)]
        )
        tag = segments.id_tag(QueueKeys.of(project, "q").prefix)
        first, last = segments.seq_of(tag, ids[0]), segments.seq_of(tag, ids[-1])
        assert first is not None and last is not None
        clock.advance(10)
        query = ListQuery(READER, marker=first - 1, limit=10, passing=True)
        page = await store.list_messages(project, "q", query)
        assert page.messages == [] and page.next_marker is None
        assert (page.passed, page.missed) == (last, 35)
