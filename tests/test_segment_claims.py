"""Claims on segment messages (issue 30, lua/_lib.lua's segment functions,
storage/segment_claims.py) on a real Redis: what the claim suites cannot
see from outside — where a claim's state lives, that a delete counts once,
that a release with a delay hides a message whose record cannot change,
and that claim states do not outlive their messages at the queue's head."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
import pytest

from feedsvc.clock import ManualClock
from feedsvc.storage import segments
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.coalescer import Command
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.record import Parked
from feedsvc.storage.redis_store import RedisStore
from tests.conftest import direct_client, make_settings

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())


@pytest.fixture(params=["lua"])
def driver(request: pytest.FixtureRequest) -> str:
    """The drivers that write segments so far."""
    return str(request.param)


@pytest.fixture
async def store(redis_url: str, driver: str, clock: ManualClock) -> AsyncIterator[FeedStore]:
    feed = make_store(make_settings(redis_url, driver=driver, storage_layout="segments"), clock)
    await feed.open()
    yield feed
    await feed.close()


async def post(store: FeedStore, project: str, n: int, ttl: int = 300) -> list[str]:
    batch = [NewMessage(orjson.dumps({"n": i}), ttl) for i in range(n)]
    return await store.post_messages(project, "q", WRITER, batch)


async def test_a_claim_lives_in_the_claim_states_and_a_delete_counts_once(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    ids = await post(store, project, 3)
    claim = await store.claim_messages(project, "q", 60, 30, 2)
    assert claim is not None and [m.id for m in claim.messages] == ids[:2]
    keys = QueueKeys.of(project, "q")
    client = direct_client(redis_url)
    try:
        raw = await client.hget(
            keys.claim_states, str(segments.seq_of(segments.id_tag(keys.prefix), ids[0]))
        )
        assert isinstance(raw, bytes)
        state = segments.ClaimState.decode(raw)
        assert (state.claim, state.claim_expires, state.count) == (
            claim.id,
            clock.now_ms() + 60_000,
            1,
        )
        assert await client.hlen(keys.claim_states) == 2
        await store.delete_message(project, "q", ids[0], claim.id)
        await store.delete_messages(project, "q", [ids[0], ids[0]])
        # gone from the claim states and counted gone once
        assert await client.hlen(keys.claim_states) == 1
        assert await client.hget(keys.meta, segments.GONE) == b"1"
    finally:
        await client.aclose()
    assert (await store.queue_stats(project, "q")).total == 2
    held = await store.get_claim(project, "q", claim.id)
    assert [m.id for m in held.messages] == ids[1:2]


async def test_a_release_with_a_delay_hides_the_message_until_due(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    ids = await post(store, project, 2)
    claim = await store.claim_messages(project, "q", 60, 30, 1)
    assert claim is not None
    await store.release_message(project, "q", ids[0], claim.id, 30)
    page = await store.list_messages(project, "q", ListQuery(READER, limit=10))
    assert [m.id for m in page.messages] == ids[1:]
    delayed = await store.list_messages(
        project, "q", ListQuery(READER, limit=10, include_delayed=True)
    )
    assert [(m.id, m.claim_id, m.claim_count) for m in delayed.messages] == [
        (ids[0], None, 1),
        (ids[1], None, 0),
    ]
    again = await store.claim_messages(project, "q", 60, 30, 5)
    assert again is not None and [m.id for m in again.messages] == ids[1:]
    clock.advance(31)
    later = await store.claim_messages(project, "q", 60, 30, 5)
    assert later is not None and [(m.id, m.claim_count) for m in later.messages] == [(ids[0], 2)]


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_a_release_goes_through_while_posts_keep_landing_in_its_segment(
    store: FeedStore,
    project: str,
    redis_url: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Claim upkeep reads a message's record, then again in a MULTI with its
    segment's slot table, and keeps it if it did not move. A post appending
    to the segment moves no record already there (the last one gets its
    end): with a producer posting between every two reads (a hot queue),
    each release once gave up after 8 reads with a 503 (the loadtest's
    consumption run on segments)."""
    ids = await post(store, project, 3)
    claim = await store.claim_messages(project, "q", 60, 30, 3)
    assert claim is not None and [m.id for m in claim.messages] == ids
    writer = make_store(make_settings(redis_url, driver="lua", storage_layout="segments"), clock)
    await writer.open()
    assert isinstance(store, RedisStore)
    transport = store._transport
    transaction = transport.transaction
    posted: list[str] = []

    async def post_in_between(commands: Sequence[Command]) -> list[Any]:
        if commands and commands[0][0] == "GETRANGE":  # read_records' check of the tables
            posted.extend(await post(writer, project, 1))
        return await transaction(commands)

    monkeypatch.setattr(transport, "transaction", post_in_between)
    try:
        # the last record first: its end is the segment's end until a post
        await store.release_message(project, "q", ids[2], claim.id, 0)
        await store.release_message(project, "q", ids[0], claim.id, 0)
    finally:
        monkeypatch.undo()
        await writer.close()
    assert len(posted) >= 2
    held = await store.get_claim(project, "q", claim.id)
    assert [m.id for m in held.messages] == ids[1:2]
    again = await store.claim_messages(project, "q", 60, 30, 10)
    assert again is not None
    assert [(m.id, m.body) for m in again.messages[:2]] == [
        (ids[0], orjson.dumps({"n": 0})),
        (ids[2], orjson.dumps({"n": 2})),
    ]


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_messages_by_id_are_read_whole_while_a_review_rewrites_their_segment(
    store: FeedStore, project: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET by ids reads the slot tables, then the records where the tables put
    them. A review that rewrites the segment in between (the expired records
    in front dropped: every later record moves) must not cut a record wrong:
    the read is checked against the tables read with it, and made again."""
    short = [NewMessage(orjson.dumps({"n": i}), 60) for i in range(5)]
    await store.post_messages(project, "q", WRITER, short)
    long = await post(store, project, 5)
    clock.advance(60 + 30 + 1)  # the short ones expired, their review due
    assert isinstance(store, RedisStore)
    transport = store._transport
    call_checked = transport.call_checked
    reviewed: list[bool] = []

    async def review_in_between(commands: Sequence[Command], *args: Any, **kw: Any) -> list[Any]:
        replies = await call_checked(commands, *args, **kw)
        if not reviewed and commands[-1][0] == "HMGET":  # the tables and the claim states
            ran, _ = await store._sweep_queue("queue", project, "q", 1)
            reviewed.append(ran == 1)
        return replies

    monkeypatch.setattr(transport, "call_checked", review_in_between)
    got = await store.get_messages(project, "q", long)
    monkeypatch.undo()
    assert reviewed == [True]
    assert [(m.id, orjson.loads(m.body)) for m in got] == [
        (i, {"n": n}) for n, i in enumerate(long)
    ]


async def test_claims_move_past_gone_messages_and_drop_their_states(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    """A head of deleted and expired messages is looked at once: the claim
    that passes it moves the claim head past it and drops the claim states
    of the expired ones there (they would outlive their messages)."""
    short = await post(store, project, 150, ttl=60)
    claim = await store.claim_messages(project, "q", 10, 0, 20)
    assert claim is not None
    await store.delete_messages(project, "q", short[20:40])
    kept = await post(store, project, 5, ttl=600)
    clock.advance(61)
    keys = QueueKeys.of(project, "q")
    client = direct_client(redis_url)
    try:
        assert await client.hlen(keys.claim_states) == 20
        claim = await store.claim_messages(project, "q", 10, 0, 2)
        assert claim is not None and [m.id for m in claim.messages] == kept[:2]
        head = await client.hget(keys.meta, segments.CLAIM_HEAD)
        assert isinstance(head, bytes) and int(head) == segments.seq_of(
            segments.id_tag(keys.prefix), kept[0]
        )
        # only the new claim's states are left
        assert await client.hlen(keys.claim_states) == 2
    finally:
        await client.aclose()
    more = await store.claim_messages(project, "q", 10, 0, 5)
    assert more is not None and [m.id for m in more.messages] == kept[2:]


async def test_the_garbage_collection_keeps_live_segment_messages_in_their_groups(
    store: FeedStore, project: str
) -> None:
    """Every post tidies the fronts of the first groups: a segment message
    there is read from its segment (it has no record key of its own)."""
    grouped = [NewMessage(orjson.dumps({"n": i}), 300, group="a") for i in range(2)]
    ids = await store.post_messages(project, "q", WRITER, grouped)
    ids += await post(store, project, 1)
    ids += await post(store, project, 1)
    claim = await store.claim_messages(project, "q", 60, 30, 5)
    assert claim is not None and [m.id for m in claim.messages] == ids
    assert [m.group for m in claim.messages] == ["a", "a", None, None]


async def test_dead_letters_land_in_a_dead_letter_queue_in_segments_once(
    store: FeedStore, project: str
) -> None:
    """Into a dead-letter queue that has segments a dead letter is a new
    message there (a new id), its body, headers, group and claim count
    kept; moving it again (a stop between copy and forget) finds the copy."""
    await store.create_queue(project, "q", {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    [seed] = await store.post_messages(project, "dlq", WRITER, [NewMessage(b'"seed"', 300)])
    batch = [
        NewMessage(b'"a"', 300, headers=b'{"h":1}', group="g"),
        NewMessage(b'"b"', 300),
    ]
    ids = await store.post_messages(project, "q", WRITER, batch)
    claim = await store.claim_messages(project, "q", 60, 30, 5)
    assert claim is not None
    await store.release_claim(project, "q", claim.id)
    assert await store.claim_messages(project, "q", 60, 30, 5) is None  # moves them
    assert await store.get_messages(project, "q", ids) == []
    query = ListQuery(READER, limit=10, with_authors=True)
    dead = (await store.list_messages(project, "dlq", query)).messages
    assert dead[0].id == seed and not set(ids) & {m.id for m in dead}
    assert [(m.body, m.headers, m.group, m.claim_count, m.author) for m in dead[1:]] == [
        (b'"a"', b'{"h":1}', "g", 1, WRITER),
        (b'"b"', None, None, 1, WRITER),
    ]
    assert isinstance(store, RedisStore)
    parked = [Parked(ids[1], b'"b"', WRITER.encode(), 300, 1)]
    await store.claims.dead_letter(project, "q", "dlq", "cd" * 12, parked)
    again = (await store.list_messages(project, "dlq", query)).messages
    assert [m.id for m in again] == [m.id for m in dead]
    # claimed there in order, the group's head first
    held = await store.claim_messages(project, "dlq", 60, 30, 5)
    assert held is not None and [m.id for m in held.messages] == [m.id for m in dead]


async def test_a_redrive_moves_dead_letters_out_of_a_dead_letter_queue_in_segments(
    store: FeedStore, project: str
) -> None:
    await store.create_queue(project, "q", {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    [seed] = await store.post_messages(project, "dlq", WRITER, [NewMessage(b'"seed"', 300)])
    batch = [NewMessage(b'"a"', 300, headers=b'{"h":1}', group="g"), NewMessage(b'"b"', 300)]
    await store.post_messages(project, "q", WRITER, batch)
    claim = await store.claim_messages(project, "q", 60, 30, 5)
    assert claim is not None
    await store.release_claim(project, "q", claim.id)
    assert await store.claim_messages(project, "q", 60, 30, 5) is None  # moves them
    await store.redrives.start(project, "dlq", 100, None)
    assert await store.redrives.step(project, "dlq", "owner") == 2
    assert await store.redrives.step(project, "dlq", "owner") == 0
    done = await store.redrives.get(project, "dlq")
    assert done is not None and (done.state, done.moved, done.skipped) == ("done", 2, 1)
    query = ListQuery(READER, limit=10)
    left = (await store.list_messages(project, "dlq", query)).messages
    assert [m.id for m in left] == [seed]
    back = (await store.list_messages(project, "q", query)).messages
    assert [(m.body, m.headers, m.group, m.claim_count) for m in back] == [
        (b'"a"', b'{"h":1}', "g", 0),
        (b'"b"', None, None, 0),
    ]
