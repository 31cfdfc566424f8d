"""What the tuned watch driver adds over the naive one, and what must not change.

The contract suites run every driver; these tests pin the watch drivers'
own mechanics through their counters (never through timing): posts to one
queue combined inside a process so that it never conflicts with itself,
bodies written ahead of the transaction never visible until indexed, and
one refused post in a combined transaction not taking the others with it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.errors import PostTooLarge
from feedsvc.storage import record as r
from feedsvc.storage import segments
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.combiner import Combiner
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys
from tests.conftest import direct_client, make_settings

POSTS = 40


async def open_store(url: str, driver: str, **changes: object) -> FeedStore:
    store = make_store(make_settings(url, driver=driver, **changes))
    await store.open()
    return store


@pytest.fixture
async def watch(redis_server: RedisServer) -> AsyncIterator[FeedStore]:
    store = await open_store(redis_server.url, "watch")
    yield store
    await store.close()


@pytest.fixture
async def records_watch(redis_server: RedisServer) -> AsyncIterator[FeedStore]:
    """The tuned driver writing the older layout (a key per message), whose
    bodies it writes ahead of the transaction."""
    store = await open_store(redis_server.url, "watch", storage_layout="records")
    yield store
    await store.close()


async def stored(url: str, project: str, queue: str) -> int:
    """How many messages' bytes a queue holds, in either layout: its record
    keys, and the slots of its segments that point to a record."""
    keys = QueueKeys.of(project, queue)
    client = direct_client(url)
    async with client:
        count = len([k async for k in client.scan_iter(match=keys.record("*"))])
        numbers: Any = await client.zrange(keys.directory, 0, -1)
        for k in numbers:
            table: Any = await client.getrange(keys.segment(int(k)), 0, segments.TABLE_BYTES - 1)
            count += sum(1 for v in segments.slot_offsets(table) if v)
    return count


def body(n: int) -> NewMessage:
    return NewMessage(orjson.dumps({"n": n}))


async def everything(store: FeedStore, project: str, queue: str) -> list[int]:
    """Every message's n, following markers from the head."""
    seen: list[int] = []
    marker = None
    while True:
        page = await store.list_messages(
            project, queue, ListQuery("reader", marker=marker, limit=20, echo=True)
        )
        if not page.messages:
            return seen
        seen += [orjson.loads(m.body)["n"] for m in page.messages]
        marker = page.next_marker


async def test_concurrent_posts_in_one_process_never_conflict(
    watch: FeedStore, project: str
) -> None:
    posted = await asyncio.gather(
        *(watch.post_messages(project, "hot", "c", [body(n)]) for n in range(POSTS))
    )
    assert watch.counters.watch_retries == 0
    # they shared transactions: fewer EXECs than posts
    assert watch.counters.posts_combined > 0
    assert watch.counters.watch_transactions < POSTS
    assert sorted(await everything(watch, project, "hot")) == list(range(POSTS))
    assert len({i for ids in posted for i in ids}) == POSTS


async def test_the_naive_driver_conflicts_with_itself(
    redis_server: RedisServer, project: str
) -> None:
    """The control for the test above: the same load, each post its own
    transaction, makes the process race itself for the queue's counter."""
    naive = await open_store(redis_server.url, "watch-naive")
    try:
        await asyncio.gather(
            *(naive.post_messages(project, "hot", "c", [body(n)]) for n in range(POSTS))
        )
        assert naive.counters.watch_retries > 0
        assert naive.counters.posts_combined == 0
        assert sorted(await everything(naive, project, "hot")) == list(range(POSTS))
    finally:
        await naive.close()


async def test_two_processes_posting_to_one_queue_lose_and_repeat_nothing(
    redis_server: RedisServer, project: str
) -> None:
    """Two stores are two processes: only they can race each other, and the
    retries that follow index every post exactly once, in one order."""
    a = await open_store(redis_server.url, "watch")
    b = await open_store(redis_server.url, "watch")
    try:
        await asyncio.gather(
            *(
                (a if n % 2 else b).post_messages(project, "hot", "c", [body(n), body(n + 1000)])
                for n in range(POSTS)
            )
        )
        seen = await everything(a, project, "hot")
        assert sorted(seen) == sorted([*range(POSTS), *range(1000, 1000 + POSTS)])
        # a post's messages are consecutive: a transaction indexed them together
        for n in range(POSTS):
            assert seen[seen.index(n) + 1] == n + 1000
    finally:
        await a.close()
        await b.close()


async def test_a_body_not_indexed_is_never_visible_and_expires(
    records_watch: FeedStore, redis_server: RedisServer, project: str
) -> None:
    """What a crash between the body write and the transaction leaves behind
    (written the way the driver writes bodies ahead): no read path shows it."""
    watch = records_watch
    [kept] = await watch.post_messages(project, "q", "c", [body(1)])
    orphan = uuid.uuid4().hex[:24]
    keys = QueueKeys.of(project, "q")
    key = keys.record(orphan)
    client = direct_client(redis_server.url)
    async with client:
        [write] = r.body_commands(keys, orphan, "c", b'{"n": 2}', 3600)
        await client.execute_command(*write)
        assert await watch.get_messages(project, "q", [orphan, kept]) != []
        assert [m.id for m in await watch.get_messages(project, "q", [orphan])] == []
        assert await everything(watch, project, "q") == [1]
        assert (await watch.queue_stats(project, "q")).total == 1
        assert 0 < await client.ttl(key) <= 3600
        # the next post indexes its own bodies, not the orphan
        await watch.post_messages(project, "q", "c", [body(3)])
        assert await everything(watch, project, "q") == [1, 3]
        claim = await watch.claim_messages(project, "q", ttl=60, grace=60, limit=10)
        assert claim is not None and len(claim.messages) == 2
        assert orphan not in {m.id for m in claim.messages}


async def test_a_refused_post_leaves_no_body_and_does_not_stop_its_batch(
    watch: FeedStore, redis_server: RedisServer, project: str
) -> None:
    await watch.create_queue(project, "small", {"_max_messages_post_size": 1000})
    big, small = [body(1)], [body(2)]
    outcomes = await asyncio.gather(
        watch.post_messages(project, "small", "c", big, request_size=5000),
        watch.post_messages(project, "small", "c", small, request_size=100),
        return_exceptions=True,
    )
    assert isinstance(outcomes[0], PostTooLarge)
    assert isinstance(outcomes[1], list)
    assert watch.counters.posts_combined == 1  # the two went in one transaction
    assert await everything(watch, project, "small") == [2]
    assert await stored(redis_server.url, project, "small") == 1


async def test_one_idempotency_key_twice_in_one_batch_posts_once(
    watch: FeedStore, redis_server: RedisServer, project: str
) -> None:
    first, again = await asyncio.gather(
        *(watch.post_messages(project, "q", "c", [body(n)], idempotency_key="k") for n in range(2))
    )
    assert first == again
    assert len(await everything(watch, project, "q")) == 1
    assert await stored(redis_server.url, project, "q") == 1


# -- the combiner on its own -------------------------------------------------------


async def test_combiner_batches_what_arrives_during_a_flush() -> None:
    batches: list[list[int]] = []
    release = asyncio.Event()

    async def flush(key: str, items: list[int]) -> list[int | Exception]:
        batches.append(items)
        await release.wait()
        return [ValueError(i) if i == 3 else i * 10 for i in items]

    combiner: Combiner[int, int] = Combiner(flush, max_items=2)
    first = asyncio.ensure_future(combiner.submit("q", 0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the first flush is under way, alone
    rest = [asyncio.ensure_future(combiner.submit("q", i)) for i in (1, 2, 3)]
    other = asyncio.ensure_future(combiner.submit("other", 7))
    release.set()
    assert await first == 0
    assert await rest[0] == 10 and await rest[1] == 20
    with pytest.raises(ValueError):
        await rest[2]
    assert await other == 70
    assert sorted(batches) == [[0], [1, 2], [3], [7]]
    await combiner.close()


async def test_combiner_cut_bounds_a_batch_and_keeps_the_order() -> None:
    batches: list[list[int]] = []

    async def flush(key: str, items: list[int]) -> list[int | Exception]:
        batches.append(items)
        await asyncio.sleep(0)
        return list(items)

    def cut(items: list[int]) -> int:
        """As many as sum to at most 10 (an item over it alone)."""
        total = 0
        for i, item in enumerate(items):
            total += item
            if i and total > 10:
                return i
        return len(items)

    combiner: Combiner[int, int] = Combiner(flush, max_items=3, cut=cut)
    items = [4, 5, 6, 20, 1, 1, 1, 1]
    assert await asyncio.gather(*(combiner.submit("q", i) for i in items)) == items
    assert batches == [[4, 5], [6], [20], [1, 1, 1], [1]]
    await combiner.close()


async def test_combiner_close_cancels_the_waiters() -> None:
    started = asyncio.Event()

    async def flush(key: str, items: list[int]) -> list[int | Exception]:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("never")

    combiner: Combiner[int, int] = Combiner(flush, max_items=10)
    waiter = asyncio.ensure_future(combiner.submit("q", 1))
    await started.wait()
    later = asyncio.ensure_future(combiner.submit("q", 2))
    await asyncio.sleep(0)
    await combiner.close()
    for task in (waiter, later):
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_combiner_a_failed_flush_reaches_every_waiter() -> None:
    async def flush(key: str, items: list[int]) -> list[int | Exception]:
        raise ConnectionError("gone")

    combiner: Combiner[int, int] = Combiner(flush, max_items=10)
    outcomes = await asyncio.gather(
        *(combiner.submit("q", i) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(o, ConnectionError) for o in outcomes)
    await combiner.close()


def test_the_naive_driver_is_chosen_by_flag_or_environment() -> None:
    from feedsvc.config import parse_settings

    assert parse_settings(["--driver", "watch-naive"], {}).driver == "watch-naive"
    assert parse_settings([], {"FEEDSVC_DRIVER": "watch-naive"}).driver == "watch-naive"
    store = make_store(make_settings("redis://127.0.0.1:1/0", driver="watch-naive"))
    assert store.name == "watch-naive"
