"""Redrive of a dead-letter queue: the store contract on every driver, on one
server and on a Cluster (the dead-letter queue and its targets in different
slots)."""

from __future__ import annotations

import uuid

import orjson
import pytest

from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.errors import QueueNotFound, RedriveRunning
from feedsvc.storage import record as rec
from feedsvc.storage import segments
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.redis_store import RedisStore
from feedsvc.storage.redrive import BATCH, FIELDS, LEASE_MS, State
from feedsvc.storage.sealing import MAGIC
from tests.conftest import both_layouts, direct_client

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())
A, B = "owner-a", "owner-b"


@pytest.fixture(params=["records"])
def storage_layout(request: pytest.FixtureRequest, driver: str) -> str:
    """These tests follow a message by its id, which a redrive keeps in the
    older layout only (in segments an id is a position: a moved message gets
    a new one there); the segment layout's redrive is tested below."""
    return both_layouts(request, driver)


async def dead_letters(store: FeedStore, project: str, n: int, queue: str = "q") -> list[str]:
    """n messages posted to queue, then moved to "dlq" by claims over its
    _max_claim_count; their ids in post order."""
    await store.create_queue(
        project,
        queue,
        {"_max_claim_count": 1, "_dead_letter_queue": "dlq", "_default_message_ttl": 700},
    )
    batch = [NewMessage(orjson.dumps({"n": i}), 300) for i in range(n)]
    ids = await store.post_messages(project, queue, WRITER, batch)
    claim = await store.claim_messages(project, queue, 300, 60, 20)
    assert claim is not None and len(claim.messages) == n
    await store.release_claim(project, queue, claim.id)
    assert await store.claim_messages(project, queue, 300, 60, 20) is None  # moves them
    assert await listed(store, project, "dlq") == ids
    return ids


async def listed(store: FeedStore, project: str, queue: str) -> list[str]:
    page = await store.list_messages(project, queue, ListQuery(READER, limit=20))
    return [m.id for m in page.messages]


async def raw_records(redis_url: str, keys: QueueKeys, ids: list[str]) -> list[bytes]:
    client = direct_client(redis_url)
    try:
        found = [await client.get(keys.record(i)) for i in ids]
    finally:
        await client.aclose()
    assert all(isinstance(raw, bytes) for raw in found)
    return [raw for raw in found if isinstance(raw, bytes)]


async def test_dead_letters_go_back_to_their_queue_in_order_with_their_record(
    store: FeedStore, project: str, redis_url: str
) -> None:
    ids = await dead_letters(store, project, 3)
    before = await raw_records(redis_url, QueueKeys.of(project, "dlq"), ids)
    progress = await store.redrives.start(project, "dlq", 100, None)
    assert (progress.state, progress.moved, progress.remaining, progress.to) == (
        "running",
        0,
        3,
        None,
    )
    assert await store.redrives.step(project, "dlq", A) == 3
    assert await listed(store, project, "q") == ids
    assert await listed(store, project, "dlq") == []
    back = await store.get_messages(project, "q", ids)
    # a fresh life (the queue's default ttl) and a claim count from zero
    assert [(m.body, m.ttl, m.claim_count) for m in back] == [
        (orjson.dumps({"n": i}), 700, 0) for i in range(3)
    ]
    after = await raw_records(redis_url, QueueKeys.of(project, "q"), ids)
    # everything after the header (author, body, whatever else) moved byte for byte
    assert [a[rec.FIXED :] for a in after] == [b[rec.FIXED :] for b in before]
    claim = await store.claim_messages(project, "q", 300, 60, 20)
    assert claim is not None and [m.claim_count for m in claim.messages] == [1, 1, 1]
    # the next step finds nothing left: done
    assert await store.redrives.step(project, "dlq", A) == 0
    done = await store.redrives.get(project, "dlq")
    assert done is not None and (done.state, done.moved, done.remaining) == ("done", 3, 0)
    assert await store.redrives.step(project, "dlq", A) is None


async def test_a_redrive_is_paced_by_its_rate(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    ids = await dead_letters(store, project, 6)
    await store.redrives.start(project, "dlq", 2, None)
    # one second's worth at most, then only what the rate allows since
    assert await store.redrives.step(project, "dlq", A) == 2
    assert await store.redrives.step(project, "dlq", A) == 0
    clock.advance(0.5)
    assert await store.redrives.step(project, "dlq", A) == 1
    clock.advance(60)  # an idle while does not save up a burst
    assert await store.redrives.step(project, "dlq", A) == 2
    assert await listed(store, project, "q") == ids[:5]
    progress = await store.redrives.get(project, "dlq")
    assert progress is not None and (progress.moved, progress.remaining) == (5, 1)


async def test_a_step_moves_a_bounded_batch(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    await store.create_queue(project, "q", {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    for _ in range(3):  # claims take 20 at most
        batch = [NewMessage(b"0", 300) for _ in range(50)]
        await store.post_messages(project, "q", WRITER, batch)
    # each claim moves the messages the one before claimed and released
    while (claim := await store.claim_messages(project, "q", 300, 60, 20)) is not None:
        await store.release_claim(project, "q", claim.id)
    assert (await store.queue_stats(project, "dlq")).total == 150
    await store.redrives.start(project, "dlq", 1000, None)
    assert await store.redrives.step(project, "dlq", A) == BATCH
    assert await store.redrives.step(project, "dlq", A) == 50


async def test_a_redrive_to_a_named_queue(store: FeedStore, project: str) -> None:
    ids = await dead_letters(store, project, 2)
    progress = await store.redrives.start(project, "dlq", 10, "elsewhere")
    assert progress.to == "elsewhere"
    assert await store.redrives.step(project, "dlq", A) == 2
    assert await listed(store, project, "elsewhere") == ids
    assert await listed(store, project, "q") == []
    names = [q.name for q in await store.list_queues(project, None, 10, False)]
    assert "elsewhere" in names


async def test_dead_letters_from_several_queues_go_back_each_to_its_own(
    store: FeedStore, project: str
) -> None:
    first = await dead_letters(store, project, 2, "one")
    await store.create_queue(project, "two", {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    [second] = await store.post_messages(project, "two", WRITER, [NewMessage(b"2", 300)])
    claim = await store.claim_messages(project, "two", 300, 60, 5)
    assert claim is not None
    await store.release_claim(project, "two", claim.id)
    assert await store.claim_messages(project, "two", 300, 60, 5) is None
    await store.redrives.start(project, "dlq", 10, None)
    assert await store.redrives.step(project, "dlq", A) == 3
    assert await listed(store, project, "one") == first
    assert await listed(store, project, "two") == [second]


async def test_a_dead_letter_with_no_known_source_is_skipped_unless_to_is_given(
    store: FeedStore, project: str, redis_url: str
) -> None:
    old, new = await dead_letters(store, project, 2)
    client = direct_client(redis_url)
    try:  # as dead-lettered by a release that did not keep origins
        await client.hdel(QueueKeys.of(project, "dlq").origins, old)
    finally:
        await client.aclose()
    await store.redrives.start(project, "dlq", 10, None)
    assert await store.redrives.step(project, "dlq", A) == 1
    assert await listed(store, project, "q") == [new]
    assert await listed(store, project, "dlq") == [old]
    assert await store.redrives.step(project, "dlq", A) == 0
    progress = await store.redrives.get(project, "dlq")
    assert progress is not None
    assert (progress.state, progress.moved, progress.skipped) == ("done", 1, 1)
    await store.redrives.start(project, "dlq", 10, "q")
    assert await store.redrives.step(project, "dlq", A) == 1
    assert await listed(store, project, "q") == [new, old]


async def test_a_claimed_dead_letter_is_left_where_it_is(store: FeedStore, project: str) -> None:
    first, second = await dead_letters(store, project, 2)
    claim = await store.claim_messages(project, "dlq", 300, 60, 1)
    assert claim is not None and [m.id for m in claim.messages] == [first]
    await store.redrives.start(project, "dlq", 10, None)
    assert await store.redrives.step(project, "dlq", A) == 1
    assert await listed(store, project, "q") == [second]
    progress = await store.redrives.get(project, "dlq")
    assert progress is not None and (progress.moved, progress.skipped) == (1, 1)
    # the consumer's claim still holds it
    held = await store.get_claim(project, "dlq", claim.id)
    assert [m.id for m in held.messages] == [first]


async def test_cancel_stops_moving_and_what_moved_stays(store: FeedStore, project: str) -> None:
    ids = await dead_letters(store, project, 3)
    await store.redrives.start(project, "dlq", 1, None)
    assert await store.redrives.step(project, "dlq", A) == 1
    cancelled = await store.redrives.cancel(project, "dlq")
    assert cancelled is not None
    assert (cancelled.state, cancelled.moved, cancelled.remaining) == ("cancelled", 1, 2)
    assert await store.redrives.step(project, "dlq", A) is None
    assert await listed(store, project, "q") == ids[:1]
    assert await listed(store, project, "dlq") == ids[1:]


async def test_one_redrive_at_a_time_per_queue(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    await dead_letters(store, project, 2)
    await store.redrives.start(project, "dlq", 1, None)
    with pytest.raises(RedriveRunning):
        await store.redrives.start(project, "dlq", 5, None)
    assert await store.redrives.cancel(project, "dlq") is not None
    again = await store.redrives.start(project, "dlq", 5, None)
    assert (again.state, again.moved, again.max_per_second) == ("running", 0, 5)


async def test_no_redrive_of_a_missing_queue_and_an_empty_one_is_done(
    store: FeedStore, project: str
) -> None:
    with pytest.raises(QueueNotFound):
        await store.redrives.start(project, "nothing", 1, None)
    assert await store.redrives.get(project, "nothing") is None
    assert await store.redrives.cancel(project, "nothing") is None
    await store.create_queue(project, "empty", {})
    started = await store.redrives.start(project, "empty", 1, None)
    assert started.remaining == 0
    assert await store.redrives.step(project, "empty", A) == 0
    done = await store.redrives.get(project, "empty")
    assert done is not None and (done.state, done.moved) == ("done", 0)


async def test_one_mover_at_a_time_and_a_lapsed_lease_is_taken_over(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    ids = await dead_letters(store, project, 4)
    await store.redrives.start(project, "dlq", 1, None)
    assert await store.redrives.step(project, "dlq", A) == 1
    clock.advance(1)
    assert await store.redrives.step(project, "dlq", B) == 0, "A's lease is alive"
    clock.advance(LEASE_MS / 1000)
    assert await store.redrives.step(project, "dlq", B) == 1
    clock.advance(1)
    assert await store.redrives.step(project, "dlq", A) == 0, "now B's"
    assert await listed(store, project, "q") == ids[:2]


async def test_a_stop_between_copy_and_forget_neither_loses_nor_doubles(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    """The mover stops after copying a batch into the target but before
    deleting it from the dead-letter queue: meanwhile the dead letters are
    parked (no consumer of the dead-letter queue gets them), and the next
    mover, once the lease lapsed, only forgets them. The copies were
    consumed in the target meanwhile: they are not written again."""
    ids = await dead_letters(store, project, 3)
    await store.redrives.start(project, "dlq", 10, None)
    assert isinstance(store, RedisStore)
    redrives = store.redrives
    keys = QueueKeys.of(project, "dlq")
    now = clock.now_ms()
    [reply] = await store._transport.call_checked([("HMGET", keys.redrive, *FIELDS)])
    state = State.read(reply)
    assert state is not None
    batch = await redrives._park(keys, state, A, ids, 0, now)
    assert batch is not None and len(batch.moves) == 3
    assert await redrives._copy(project, "q", batch.moves, now) == ids
    # ... and stops. The dead letters are hidden in the dead-letter queue:
    assert await store.claim_messages(project, "dlq", 300, 60, 20) is None
    assert await listed(store, project, "dlq") == []
    # the copies are consumed from the target
    await store.delete_messages(project, "q", ids[:2])
    clock.advance(LEASE_MS / 1000 + 1)
    assert await redrives.step(project, "dlq", B) == 3
    assert await listed(store, project, "q") == ids[2:]
    assert (await store.queue_stats(project, "dlq")).total == 0
    progress = await redrives.get(project, "dlq")
    assert progress is not None and (progress.moved, progress.remaining) == (3, 0)


async def test_deleting_a_dead_letter_queue_deletes_its_redrive(
    store: FeedStore, project: str, redis_url: str
) -> None:
    await dead_letters(store, project, 1)
    await store.redrives.start(project, "dlq", 1, None)
    await store.delete_queue(project, "dlq")
    assert await store.redrives.get(project, "dlq") is None
    keys = QueueKeys.of(project, "dlq")
    client = direct_client(redis_url)
    try:
        assert await client.exists(keys.redrive, keys.origins) == 0
    finally:
        await client.aclose()
    assert await store.redrives.step(project, "dlq", A) is None


async def test_sealed_bodies_move_sealed_and_open_in_their_queue(
    settings: Settings, clock: ManualClock, project: str, redis_url: str
) -> None:
    sealed_settings = settings.replace(message_encryption_key="a key of sixteen chars or more")
    store = make_store(sealed_settings, clock)
    await store.open()
    try:
        await store.create_queue(
            project,
            "q",
            {"_max_claim_count": 1, "_dead_letter_queue": "dlq", "_enable_encrypt_messages": True},
        )
        [message_id] = await store.post_messages(project, "q", WRITER, [NewMessage(b'"secret"')])
        claim = await store.claim_messages(project, "q", 300, 60, 5)
        assert claim is not None
        await store.release_claim(project, "q", claim.id)
        assert await store.claim_messages(project, "q", 300, 60, 5) is None
        await store.redrives.start(project, "dlq", 10, None)
        assert await store.redrives.step(project, "dlq", A) == 1
        [raw] = await raw_records(redis_url, QueueKeys.of(project, "q"), [message_id])
        body = raw[raw.index(rec.NEWLINE, rec.FIXED) + 1 :]
        assert body.startswith(MAGIC) and b"secret" not in body
        [back] = await store.get_messages(project, "q", [message_id])
        assert back.body == b'"secret"'
    finally:
        await store.close()


@pytest.mark.parametrize("storage_layout", ["segments"], indirect=True)
async def test_dead_letters_go_back_into_a_queue_in_segments_once_in_order(
    store: FeedStore, project: str, redis_url: str
) -> None:
    """Into a queue that writes segments a moved message is a new message:
    a new id (its seq there), the same body, author, headers and group, a
    fresh ttl and a claim count of 0, in order, once, and claimable."""
    await store.create_queue(
        project,
        "q",
        {"_max_claim_count": 1, "_dead_letter_queue": "dlq", "_default_message_ttl": 700},
    )
    batch = [
        NewMessage(orjson.dumps({"n": i}), 300, headers=b'{"h":1}' if i == 1 else b"")
        for i in range(3)
    ]
    ids = await store.post_messages(project, "q", WRITER, batch)
    for _ in range(2):  # claimed once, then moved by the next claim
        claim = await store.claim_messages(project, "q", 300, 60, 20)
        if claim is not None:
            await store.release_claim(project, "q", claim.id)
    assert await listed(store, project, "dlq") == ids
    await store.redrives.start(project, "dlq", 100, None)
    assert await store.redrives.step(project, "dlq", A) == 3
    assert await store.redrives.step(project, "dlq", A) == 0
    page = await store.list_messages(project, "q", ListQuery(READER, limit=20, with_authors=True))
    back = page.messages
    assert [orjson.loads(m.body)["n"] for m in back] == [0, 1, 2]
    assert all(
        m.id not in ids
        and segments.seq_of(segments.id_tag(QueueKeys.of(project, "q").prefix), m.id) == m.seq
        for m in back
    )
    assert [(m.ttl, m.claim_count, m.author, m.headers) for m in back] == [
        (700, 0, WRITER, None),
        (700, 0, WRITER, b'{"h":1}'),
        (700, 0, WRITER, None),
    ]
    assert await listed(store, project, "dlq") == []
    claim = await store.claim_messages(project, "q", 300, 60, 20)
    assert claim is not None and [m.id for m in claim.messages] == [m.id for m in back]
