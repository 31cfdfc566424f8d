"""Expiry in the segment layout (issue 30, storage/reviews.py) on a real
Redis: a segment's short-lived messages give their memory back at their
review whatever lives beside them, deleted records go at the next review,
an idle queue is swept by the process's loop, counts stay exact before
and after sweeps (a segment Redis dropped whole included), and purge and
queue delete leave no key behind.

The store's clock is a ManualClock: the sweep judges expiry by it, so a
review is seen by moving it on (Redis's own expiry, in real time, is
played by deleting a segment's key)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from redis import Redis
from redis.cluster import RedisCluster as SyncRedisCluster

from feedsvc.clock import ManualClock
from feedsvc.errors import QueueFull
from feedsvc.storage import reviews, segments, sweeper
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import SWEEP_KEY, QueueKeys
from feedsvc.storage.lua_store import LuaStore
from feedsvc.storage.watch_store import WatchStore
from tests.conftest import direct_client, make_settings

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())
DAYS_14 = 14 * 86400
SHORT = 60


@pytest.fixture(params=["lua", "watch", "watch-naive"])
def driver(request: pytest.FixtureRequest) -> str:
    """Every driver reviews segments (the watch drivers by transactions)."""
    return str(request.param)


@pytest.fixture(autouse=True)
async def fresh_sweep_schedule(redis_url: str) -> None:
    """fs:sweep to this test alone: the tests of a worker share its Redis, and
    the others' posts note their queues' reviews there (due on their clocks),
    which a tick on this test's clock, moved on, would take too. A worker runs
    one test at a time, with no sweep loop besides its own (conftest)."""
    client: Any = direct_client(redis_url)
    try:
        await client.delete(SWEEP_KEY)
    finally:
        await client.aclose()


@pytest.fixture
async def store(redis_url: str, driver: str, clock: ManualClock) -> AsyncIterator[Any]:
    settings = make_settings(redis_url, driver=driver, storage_layout="segments", sweep_interval=5)
    feed = make_store(settings, clock)
    assert isinstance(feed, LuaStore | WatchStore)
    await feed.open()
    # the tests run the loop's ticks themselves, on the clock they move
    assert feed.sweeper is not None
    await feed.sweeper.close()
    try:
        yield feed
    finally:
        await feed.close()


@pytest.fixture
def rc(redis_url: str) -> Any:
    """Redis looked at directly (a Cluster's keys on whichever node holds them)."""
    if redis_url.startswith("redis+cluster://"):
        return SyncRedisCluster.from_url(redis_url.replace("+cluster", "", 1))
    return Redis.from_url(redis_url)


def body(n: int) -> bytes:
    return orjson.dumps({"n": n, "pad": "x" * 100})


async def post(store: FeedStore, project: str, ttls: list[int], queue: str = "q") -> list[str]:
    messages = [NewMessage(body(i), ttl) for i, ttl in enumerate(ttls)]
    return await store.post_messages(project, queue, WRITER, messages)


async def listed(store: FeedStore, project: str, queue: str = "q") -> list[str]:
    ids: list[str] = []
    marker = None
    while True:
        page = await store.list_messages(project, queue, ListQuery(READER, marker=marker, limit=20))
        if not page.messages:
            return ids
        ids += [m.id for m in page.messages]
        marker = page.next_marker


def segment_keys(rc: Redis, keys: QueueKeys) -> list[str]:
    pattern = keys.prefix.replace("{", "[{]").replace("}", "[}]") + ":p:*"
    return sorted(k.decode() for k in rc.scan_iter(match=pattern))


def gone(rc: Redis, keys: QueueKeys) -> int:
    return int(rc.hget(keys.meta, segments.GONE) or 0)


async def total(store: FeedStore, project: str, queue: str = "q") -> int:
    return (await store.queue_stats(project, queue)).total


async def test_short_messages_behind_a_long_one_give_their_memory_back_at_their_review(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis
) -> None:
    keys = QueueKeys.of(project, "q")
    [long_id] = await post(store, project, [DAYS_14])
    short = await post(store, project, [SHORT] * 40)
    [segment] = segment_keys(rc, keys)
    full = rc.strlen(segment)
    # the review is due 30 s after the short ones expire; fs:sweep knows
    scheduled: list[Any] = rc.zrange(keys.reviews, 0, -1, withscores=True)
    [[k, due]] = scheduled
    assert int(due) <= clock.now_ms() + (SHORT * 1000 + reviews.REVIEW_AFTER_MS)
    await store.parts.sweeps.noted()  # written by the process after the post answered
    assert rc.zscore(SWEEP_KEY, reviews.sweep_member("queue", project, "q")) == due
    assert await total(store, project) == 41

    clock.advance(SHORT + 1)
    # expired, not yet reviewed: counted exactly all the same, not listed
    assert await total(store, project) == 1
    assert await listed(store, project) == [long_id]
    assert rc.strlen(segment) == full

    clock.advance(reviews.REVIEW_AFTER_MS / 1000)
    assert store.sweeper is not None
    await store.sweeper.tick()  # the idle queue's review, by the process's loop
    # the loop's lag (/metrics): how late the oldest due queue was at its look
    assert store.stats()["sweep_lag_seconds"] == (clock.now_ms() - int(due)) / 1000 > 0
    assert rc.strlen(segment) < segments.TABLE_BYTES + (full - segments.TABLE_BYTES) / 40
    assert gone(rc, keys) == len(short)
    assert await total(store, project) == 1
    assert await listed(store, project) == [long_id]
    [got] = await store.get_messages(project, "q", [long_id])
    assert orjson.loads(got.body)["n"] == 0
    # the segment lives as long as its last message; reviewed again 30 s after it expires
    assert rc.pttl(segment) > (DAYS_14 - 60) * 1000
    assert rc.zscore(keys.reviews, k) == rc.pexpiretime(segment)
    assert rc.zscore(SWEEP_KEY, reviews.sweep_member("queue", project, "q")) == rc.zscore(
        keys.reviews, k
    )


async def test_a_post_runs_a_due_review_of_its_queue_first(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis
) -> None:
    if not isinstance(store, LuaStore):
        pytest.skip("a watch driver's post leaves its queue's reviews to the sweep loop")
    keys = QueueKeys.of(project, "q")
    await post(store, project, [DAYS_14] + [SHORT] * 30)
    [segment] = segment_keys(rc, keys)
    full = rc.strlen(segment)
    clock.advance(SHORT + reviews.REVIEW_AFTER_MS / 1000 + 1)
    await post(store, project, [DAYS_14])
    # the 30 short records went; the long one and the new one stay
    assert rc.strlen(segment) < segments.TABLE_BYTES + 3 * (full - segments.TABLE_BYTES) // 31
    assert gone(rc, keys) == 30
    assert await total(store, project) == 2


def deletes(store: FeedStore, project: str) -> dict[str, Any]:
    """Each way a message goes before its expiry, as a caller makes it go."""

    async def one(ids: list[str]) -> list[str]:
        await store.delete_message(project, "q", ids[3], None)
        return [ids[3]]

    async def several(ids: list[str]) -> list[str]:
        await store.delete_messages(project, "q", [ids[3], ids[5]])
        return [ids[3], ids[5]]

    async def popped(ids: list[str]) -> list[str]:
        return [m.id for m in await store.pop_messages(project, "q", 2)]

    async def claimed(ids: list[str]) -> list[str]:
        claim = await store.claim_messages(project, "q", 60, 60, 1)
        assert claim is not None
        [message] = claim.messages
        await store.delete_message(project, "q", message.id, claim.id)
        return [message.id]

    async def dead_lettered(ids: list[str]) -> list[str]:
        await store.update_queue_metadata(
            project, "q", lambda m: {**m, "_max_claim_count": 1, "_dead_letter_queue": "dlq"}
        )
        claim = await store.claim_messages(project, "q", 60, 60, 1)
        assert claim is not None
        await store.release_claim(project, "q", claim.id)
        again = await store.claim_messages(project, "q", 60, 60, 1)  # moves the first
        assert again is not None and again.messages[0].id == ids[1]
        await store.release_claim(project, "q", again.id)
        return [ids[0]]

    async def redriven(ids: list[str]) -> list[str]:
        await store.redrives.start(project, "q", 2, "elsewhere")  # 2 a second: 2 a step
        assert await store.redrives.step(project, "q", "owner") == 2
        return ids[:2]

    return {
        "one": one,
        "several": several,
        "popped": popped,
        "claimed": claimed,
        "dead_lettered": dead_lettered,
        "redriven": redriven,
    }


@pytest.mark.parametrize(
    "way", ["one", "several", "popped", "claimed", "dead_lettered", "redriven"]
)
async def test_deleted_records_go_at_the_next_review(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis, way: str
) -> None:
    """Whichever way a long-lived message goes, its record goes within
    DELETE_REVIEW_MS: the delete schedules its segment's review, and the
    process notes it in fs:sweep (the segment's own review is 14 days on)."""
    keys = QueueKeys.of(project, "q")
    ids = await post(store, project, [DAYS_14] * 10)
    [segment] = segment_keys(rc, keys)
    full = rc.strlen(segment)
    went = await deletes(store, project)[way](ids)
    await store.parts.sweeps.noted()  # written by the process after the call answered
    member = reviews.sweep_member("queue", project, "q")
    assert rc.zscore(SWEEP_KEY, member) == clock.now_ms() + reviews.DELETE_REVIEW_MS
    assert gone(rc, keys) == len(went)
    assert await total(store, project) == 10 - len(went)
    assert not set(went) & set(await listed(store, project))
    assert rc.strlen(segment) == full  # the record stays until the review

    clock.advance(reviews.DELETE_REVIEW_MS / 1000)
    assert store.sweeper is not None
    await store.sweeper.tick()
    record = (full - segments.TABLE_BYTES) // 10
    assert rc.strlen(segment) == full - len(went) * record
    kept = [i for i in ids if i not in went]
    assert await listed(store, project) == kept
    assert gone(rc, keys) == len(went) and await total(store, project) == len(kept)
    # every other slot kept its record: each reads back whole
    got = await store.get_messages(project, "q", ids)
    assert [m.id for m in got] == kept
    assert [orjson.loads(m.body)["n"] for m in got] == [ids.index(i) for i in kept]
    # deleting it again changes nothing
    await store.delete_messages(project, "q", went)
    await store.parts.sweeps.noted()
    assert gone(rc, keys) == len(went) and rc.strlen(segment) == full - len(went) * record
    assert await total(store, project) == len(kept)
    if isinstance(store, LuaStore):  # and delete.lua says it moved no review
        assert rc.zscore(SWEEP_KEY, member) == rc.pexpiretime(segment)


async def copied_in(store: FeedStore, project: str, way: str) -> str:
    """Short-lived copies made by the process into a queue in segments whose
    first message lives 14 days: dead letters, or a redrive's; the queue."""
    if way == "dead_lettered":
        await post(store, project, [DAYS_14], "dlq")
        settings = {"_max_claim_count": 1, "_dead_letter_queue": "dlq"}
        await store.create_queue(project, "q", settings)
        await post(store, project, [SHORT] * 5)
        claim = await store.claim_messages(project, "q", 60, 60, 10)
        assert claim is not None
        await store.release_claim(project, "q", claim.id)
        assert await store.claim_messages(project, "q", 60, 60, 10) is None  # moves them
        return "dlq"
    await store.create_queue(project, "elsewhere", {"_default_message_ttl": SHORT})
    await post(store, project, [DAYS_14], "elsewhere")
    await post(store, project, [DAYS_14] * 5)
    await store.redrives.start(project, "q", 100, "elsewhere")
    assert await store.redrives.step(project, "q", "owner") == 5
    return "elsewhere"


@pytest.mark.parametrize("way", ["dead_lettered", "redriven"])
async def test_copies_give_their_memory_back_at_their_review(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis, way: str
) -> None:
    """A copy the process appends to a queue's segments (segment_writes.py)
    is reviewed as a post's message is: its short life schedules its
    segment's review, noted in fs:sweep, whatever lives in front of it."""
    queue = await copied_in(store, project, way)
    keys = QueueKeys.of(project, queue)
    [segment] = segment_keys(rc, keys)
    full = rc.strlen(segment)
    assert await total(store, project, queue) == 6
    await store.parts.sweeps.noted()
    clock.advance(600)  # past every copy's expiry and review; 14 days before the first's
    assert store.sweeper is not None
    await store.sweeper.tick()
    assert rc.strlen(segment) < segments.TABLE_BYTES + (full - segments.TABLE_BYTES) / 5
    assert gone(rc, keys) == 5
    assert await total(store, project, queue) == 1
    assert len(await listed(store, project, queue)) == 1


async def test_counts_stay_exact_before_and_after_sweeps_and_a_segment_dropped_whole(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis
) -> None:
    keys = QueueKeys.of(project, "q")
    posted = 0
    for _ in range(3):  # 3 x 90 = 270 messages over 3 or 4 segments
        await post(store, project, [SHORT] * 90)
        posted += 90
    assert await total(store, project) == posted
    segs = segment_keys(rc, keys)
    assert len(segs) >= 3
    clock.advance(SHORT + 1)
    # expired, not yet reviewed: none counts
    assert await total(store, project) == 0
    # Redis drops one whole at its expiry (no feedsvc work)
    rc.delete(segs[0])
    assert await total(store, project) == 0
    clock.advance(reviews.REVIEW_AFTER_MS / 1000)
    assert store.sweeper is not None
    while await store.sweeper.tick():
        pass
    assert gone(rc, keys) == posted
    assert segment_keys(rc, keys) == []
    assert rc.exists(keys.reviews, keys.segment_counts, keys.directory) == 0
    assert await total(store, project) == 0
    # the open segment, dropped whole and opened again, counts from there
    await post(store, project, [SHORT] * 7 + [DAYS_14])
    assert await total(store, project) == 8
    clock.advance(SHORT + reviews.REVIEW_AFTER_MS / 1000 + 1)
    assert await total(store, project) == 1
    await store.sweeper.tick()
    assert gone(rc, keys) == posted + 7
    assert await total(store, project) == 1


async def test_the_count_holds_when_the_open_segment_is_dropped_before_its_review(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis
) -> None:
    keys = QueueKeys.of(project, "q")
    await post(store, project, [SHORT] * 5)
    [segment] = segment_keys(rc, keys)
    clock.advance(SHORT + 1)
    rc.delete(segment)  # Redis's expiry, before any review
    await post(store, project, [SHORT] * 3)  # the same segment, opened again
    assert await total(store, project) == 3
    clock.advance(SHORT + reviews.REVIEW_AFTER_MS / 1000)
    assert store.sweeper is not None
    await store.sweeper.tick()
    assert gone(rc, keys) == 8
    assert await total(store, project) == 0


@pytest.mark.parametrize("purge", [True, False])
async def test_purge_and_delete_leave_no_key(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis, purge: bool
) -> None:
    keys = QueueKeys.of(project, "q")
    for _ in range(3):  # segments, reviews, their counts, the review field
        await post(store, project, [DAYS_14] + [SHORT] * 99)
    assert len(segment_keys(rc, keys)) >= 3
    pattern = keys.prefix.replace("{", "[{]").replace("}", "[}]") + "*"
    if purge:
        await store.purge_queue(project, "q")
        left = {k.decode() for k in rc.scan_iter(match=pattern)}
        assert left <= {keys.meta, keys.seq}
        assert await total(store, project) == 0
        assert await listed(store, project) == []
        await post(store, project, [SHORT] * 4)
        assert await total(store, project) == 4
        assert len(await listed(store, project)) == 4
    else:
        await store.delete_queue(project, "q")
        assert list(rc.scan_iter(match=pattern)) == []
        # the loop finds nothing to review and forgets the queue
        clock.advance(SHORT + reviews.REVIEW_AFTER_MS / 1000 + 1)
        assert store.sweeper is not None
        await store.sweeper.tick()
        assert rc.zscore(SWEEP_KEY, reviews.sweep_member("queue", project, "q")) is None


@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
async def test_the_loop_reclaims_on_a_cluster_too(
    redis_url: str, clock: ManualClock, project: str
) -> None:
    """fs:sweep lives in a slot of its own: the loop's reads and writes of it
    and the queue's script go to their own nodes."""
    settings = make_settings(redis_url, driver="lua", storage_layout="segments", sweep_interval=5)
    store = make_store(settings, clock)
    assert isinstance(store, LuaStore)
    await store.open()
    try:
        assert store.sweeper is not None
        await store.sweeper.close()
        keys = QueueKeys.of(project, "q")
        await post(store, project, [DAYS_14] + [SHORT] * 20)
        await post(store.topics(), project, [DAYS_14] + [SHORT] * 20, queue="t")
        rc = direct_client(redis_url)
        numbers: list[Any] = await rc.zrange(keys.directory, 0, -1)
        [segment] = [keys.segment(int(k)) for k in numbers]
        full = await rc.strlen(segment)
        clock.advance(SHORT + reviews.REVIEW_AFTER_MS / 1000 + 1)
        assert await store.sweeper.tick() == 2  # the queue's review and the topic's
        assert await rc.strlen(segment) < full / 5
        assert await total(store, project) == 1
        assert await total(store.topics(), project, "t") == 1
        topic = QueueKeys.of(project, "t", "topic")
        assert int(await rc.hget(topic.meta, segments.GONE) or 0) == 20
        await rc.aclose()
    finally:
        await store.close()


async def test_the_running_loop_sweeps_an_idle_queue(
    redis_url: str, clock: ManualClock, project: str, rc: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweeper, "TICK", 0.05)
    settings = make_settings(
        redis_url, driver="lua", storage_layout="segments", sweep_interval=0.05
    )
    store = make_store(settings, clock)
    await store.open()
    try:
        keys = QueueKeys.of(project, "q")
        await post(store, project, [DAYS_14] + [SHORT] * 20)
        clock.advance(SHORT + reviews.REVIEW_AFTER_MS / 1000 + 1)
        member = reviews.sweep_member("queue", project, "q")

        def swept() -> bool:
            # the review ran, and the loop wrote back when the next one is due
            first: list[Any] = rc.zrange(keys.reviews, 0, 0, withscores=True)
            [[_, next_due]] = first
            return gone(rc, keys) == 20 and rc.zscore(SWEEP_KEY, member) == next_due

        for _ in range(400):  # nobody posts, claims or asks for stats: the loop alone
            if swept():
                break
            await asyncio.sleep(0.05)
        assert swept()
    finally:
        await store.close()


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_a_store_with_sweep_interval_0_runs_no_sweep_loop(
    redis_url: str, driver: str, clock: ManualClock
) -> None:
    """Tests that move their own clock run their stores without the loop (a
    loop on a clock ahead would review other tests' queues early: they share
    fs:sweep); a process configured so leaves the sweep to the others."""
    settings = make_settings(redis_url, driver=driver, storage_layout="segments", sweep_interval=0)
    store = make_store(settings, clock)
    assert isinstance(store, LuaStore | WatchStore)
    await store.open()
    try:
        assert store.sweeper is None
        assert store.topics().sweeper is None
    finally:
        await store.close()


async def test_a_drained_queue_gives_its_segment_indexes_back(
    store: LuaStore, project: str, clock: ManualClock, rc: Redis
) -> None:
    """Past 128 segments the directory and the reviews are skip lists (hash
    tables); once the sweep has emptied most, they are listpacks again (the
    counts too, a hash table past 512)."""
    keys = QueueKeys.of(project, "q")
    await post(store, project, [DAYS_14])
    for _ in range(140):
        await post(store, project, [SHORT] * 100)
    assert rc.object("encoding", keys.directory) == b"skiplist"
    assert rc.object("encoding", keys.reviews) == b"skiplist"
    clock.advance(SHORT + reviews.REVIEW_AFTER_MS / 1000 + 1)
    assert store.sweeper is not None
    while await store.sweeper.tick():
        pass
    assert await total(store, project) == 1
    for key in (keys.directory, keys.reviews, keys.segment_counts):
        assert rc.object("encoding", key) == b"listpack"


async def test_max_messages_counts_expired_messages_out_before_any_sweep(
    store: LuaStore, project: str, clock: ManualClock
) -> None:
    await store.create_queue(project, "q", {"_max_messages": 3})
    await post(store, project, [SHORT, SHORT, DAYS_14])
    with pytest.raises(QueueFull):
        await post(store, project, [DAYS_14])
    clock.advance(SHORT + 1)  # the two expire; their review is 30 s away
    await post(store, project, [DAYS_14, DAYS_14])
    with pytest.raises(QueueFull):
        await post(store, project, [DAYS_14])
    assert await total(store, project) == 3
