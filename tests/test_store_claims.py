"""Claims, pop, delay, dead-lettering and queue settings: the store contract
for both drivers (DESIGN.md rule 5: claims are exclusive)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
import pytest

from feedsvc.clock import ManualClock
from feedsvc.config import STORAGE_LAYOUTS
from feedsvc.errors import (
    ClaimDoesNotHold,
    ClaimNotFound,
    InvalidClaim,
    MessageIsClaimed,
    MessageNotFound,
    QueueNotFound,
)
from feedsvc.storage import segments
from feedsvc.storage.base import Claim, FeedStore, ListQuery, NewMessage, Unclaimable
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.record import Parked, hold_commands, read_commands, rows
from feedsvc.storage.redis_store import RedisStore
from tests.conftest import both_layouts, direct_client

READER = str(uuid.uuid4())
WRITER = str(uuid.uuid4())


@pytest.fixture(params=STORAGE_LAYOUTS)
def storage_layout(request: pytest.FixtureRequest, driver: str) -> str:
    """Both layouts new messages are written in (the segments on the drivers that write them)."""
    return both_layouts(request, driver)


async def post(
    store: FeedStore, project: str, n: int, ttl: int = 300, delay: int | None = None
) -> list[str]:
    batch = [NewMessage(orjson.dumps(i), ttl, delay) for i in range(n)]
    return await store.post_messages(project, "q", WRITER, batch)


async def claim_ids(store: FeedStore, project: str, limit: int, ttl: int = 300) -> list[str]:
    claim = await store.claim_messages(project, "q", ttl, 60, limit)
    return [] if claim is None else [m.id for m in claim.messages]


def life_key(keys: QueueKeys, message_id: str) -> str:
    """The key whose expiry is a message's life: its record, or its segment
    (which lives as long as its longest-lived message)."""
    seq = segments.seq_of(segments.id_tag(keys.prefix), message_id)
    return keys.record(message_id) if seq is None else keys.segment(seq // segments.SLOTS)


async def pttl(redis_url: str, key: str) -> int:
    client = direct_client(redis_url)
    try:
        return int(await client.pttl(key))
    finally:
        await client.aclose()


async def test_claims_never_share_a_message(store: FeedStore, project: str) -> None:
    a, b, c, d = await post(store, project, 4)
    first = await store.claim_messages(project, "q", 300, 60, 1)
    assert first is not None and [m.id for m in first.messages] == [a]
    assert all(m.claim_id == first.id for m in first.messages)
    assert await claim_ids(store, project, 1) == [b]
    await store.release_claim(project, "q", first.id)
    # a is free again but b is not: no "claimed messages form a prefix" shortcut
    assert await claim_ids(store, project, 20) == [a, c, d]
    assert await store.claim_messages(project, "q", 300, 60, 20) is None


async def test_concurrent_claimers_each_message_once(store: FeedStore, project: str) -> None:
    ids: list[str] = []
    for _ in range(3):
        ids += await post(store, project, 20)

    async def claimer() -> list[str]:
        mine: list[str] = []
        while got := await claim_ids(store, project, 3):
            mine += got
        return mine

    results = await asyncio.gather(*(claimer() for _ in range(12)))
    everything = [i for r in results for i in r]
    assert sorted(everything) == sorted(ids)
    assert len(set(everything)) == len(everything)


async def test_concurrent_pops_never_return_a_message_twice(store: FeedStore, project: str) -> None:
    ids = await post(store, project, 20)
    held = await claim_ids(store, project, 5)

    async def popper() -> list[str]:
        mine: list[str] = []
        while got := await store.pop_messages(project, "q", 3):
            mine += [m.id for m in got]
        return mine

    results = await asyncio.gather(*(popper() for _ in range(8)))
    popped = [i for r in results for i in r]
    assert len(set(popped)) == len(popped)
    assert sorted(popped) == sorted(set(ids) - set(held))
    assert [m.id for m in await store.get_messages(project, "q", ids)] == held


async def test_claim_extends_message_life_in_redis(
    store: FeedStore, project: str, redis_url: str
) -> None:
    [message_id] = await post(store, project, 1, ttl=60)
    claim = await store.claim_messages(project, "q", 600, 120, 5)
    assert claim is not None
    key = life_key(QueueKeys.of(project, "q"), message_id)
    assert 715_000 < await pttl(redis_url, key) <= 720_000
    [message] = await store.get_messages(project, "q", [message_id])
    assert message.ttl == 720 and message.claim_id == claim.id
    # renewing with a shorter ttl never shortens the message's life
    await store.renew_claim(project, "q", claim.id, 60, 60)
    assert 715_000 < await pttl(redis_url, key) <= 720_000
    renewed = await store.get_claim(project, "q", claim.id)
    assert renewed.ttl == 60 and [m.id for m in renewed.messages] == [message_id]


async def test_renew_extends_when_needed(store: FeedStore, project: str, redis_url: str) -> None:
    [message_id] = await post(store, project, 1, ttl=100)
    claim = await store.claim_messages(project, "q", 60, 60, 5)
    assert claim is not None
    key = life_key(QueueKeys.of(project, "q"), message_id)
    assert 115_000 < await pttl(redis_url, key) <= 120_000
    await store.renew_claim(project, "q", claim.id, 3000, 100)
    assert 3_095_000 < await pttl(redis_url, key) <= 3_100_000


async def test_expired_messages_are_never_claimed_or_revived(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    [dead] = await post(store, project, 1, ttl=1)
    clock.advance(0.9)
    assert len(await store.get_messages(project, "q", [dead])) == 1, "gone before its ttl"
    clock.advance(0.2)
    assert await store.get_messages(project, "q", [dead]) == []
    assert await store.claim_messages(project, "q", 300, 60, 10) is None
    assert await store.pop_messages(project, "q", 10) == []
    # Not revived: the body is gone (lua collects it) or still due to expire
    # in Redis at its own ttl (watch leaves that to Redis, on real time).
    left = await pttl(redis_url, QueueKeys.of(project, "q").record(dead))
    assert left == -2 or 0 < left <= 1000, left


async def test_claimed_messages_are_hidden_from_listing(store: FeedStore, project: str) -> None:
    a, b = await post(store, project, 2)
    claim = await store.claim_messages(project, "q", 300, 60, 1)
    assert claim is not None
    visible = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in visible.messages] == [b]
    both = await store.list_messages(project, "q", ListQuery(READER, include_claimed=True))
    assert [(m.id, m.claim_id) for m in both.messages] == [(a, claim.id), (b, None)]
    after = await store.list_messages(
        project, "q", ListQuery(READER, marker=0, include_claimed=True)
    )
    assert [m.id for m in after.messages] == [a, b]
    stats = await store.queue_stats(project, "q")
    assert (stats.total, stats.claimed, stats.free) == (2, 1, 1)


async def test_delete_respects_claims(store: FeedStore, project: str) -> None:
    a, b = await post(store, project, 2)
    claim = await store.claim_messages(project, "q", 300, 60, 1)
    assert claim is not None
    with pytest.raises(MessageIsClaimed):
        await store.delete_message(project, "q", a, None)
    with pytest.raises(InvalidClaim):
        await store.delete_message(project, "q", a, "0" * 24)
    with pytest.raises(InvalidClaim):
        await store.delete_message(project, "q", b, claim.id)
    await store.delete_message(project, "q", a, claim.id)
    assert await store.get_messages(project, "q", [a]) == []
    assert (await store.get_claim(project, "q", claim.id)).messages == []
    stats = await store.queue_stats(project, "q")
    assert (stats.total, stats.claimed) == (1, 0)


async def test_release_and_missing_claims(store: FeedStore, project: str) -> None:
    ids = await post(store, project, 3)
    claim = await store.claim_messages(project, "q", 300, 60, 10)
    assert claim is not None and len(claim.messages) == 3
    await store.release_claim(project, "q", claim.id)
    await store.release_claim(project, "q", claim.id)
    with pytest.raises(ClaimNotFound):
        await store.get_claim(project, "q", claim.id)
    with pytest.raises(ClaimNotFound):
        await store.renew_claim(project, "q", claim.id, 300, 60)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == ids
    assert (await store.queue_stats(project, "q")).claimed == 0


async def test_claims_are_isolated_by_project(store: FeedStore, project: str) -> None:
    await post(store, project, 1)
    claim = await store.claim_messages(project, "q", 300, 60, 1)
    assert claim is not None
    other = project + "-other"
    with pytest.raises(ClaimNotFound):
        await store.get_claim(other, "q", claim.id)
    await store.release_claim(other, "q", claim.id)
    assert len((await store.get_claim(project, "q", claim.id)).messages) == 1


async def test_delayed_messages_wait_until_due(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    [late] = await post(store, project, 1, delay=1)
    [now] = await post(store, project, 1)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == [now]
    shown = await store.list_messages(project, "q", ListQuery(READER, include_delayed=True))
    assert [m.id for m in shown.messages] == [late, now]
    assert await claim_ids(store, project, 10) == [now]
    clock.advance(0.9)
    assert await claim_ids(store, project, 10) == [], "due before its delay"
    clock.advance(0.2)
    assert await claim_ids(store, project, 10) == [late]


async def test_queue_settings_are_honoured(store: FeedStore, project: str) -> None:
    metadata: dict[str, Any] = {"_default_message_ttl": 120, "_default_message_delay": 1}
    await store.create_queue(project, "q", metadata)
    [message_id] = await store.post_messages(project, "q", WRITER, [NewMessage(b"1")])
    assert (await store.list_messages(project, "q", ListQuery(READER))).messages == []
    [message] = await store.get_messages(project, "q", [message_id])
    assert message.ttl == 120

    def no_delay(current: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in current.items() if k != "_default_message_delay"}

    updated = await store.update_queue_metadata(project, "q", no_delay)
    assert updated == {"_default_message_ttl": 120}
    await store.post_messages(project, "q", WRITER, [NewMessage(b"2")])
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [orjson.loads(m.body) for m in page.messages] == [2]
    with pytest.raises(QueueNotFound):
        await store.update_queue_metadata(project, "missing", no_delay)


async def test_post_size_limit_of_a_queue(store: FeedStore, project: str) -> None:
    from feedsvc.errors import PostTooLarge

    await store.create_queue(project, "q", {"_max_messages_post_size": 100})
    await store.post_messages(project, "q", WRITER, [NewMessage(b"1")], request_size=100)
    with pytest.raises(PostTooLarge):
        await store.post_messages(project, "q", WRITER, [NewMessage(b"2")], request_size=101)
    assert (await store.queue_stats(project, "q")).total == 1


async def test_dead_lettering_after_max_claims(store: FeedStore, project: str) -> None:
    await store.create_queue(
        project,
        "q",
        {
            "_max_claim_count": 2,
            "_dead_letter_queue": "dlq",
            "_dead_letter_queue_messages_ttl": 500,
        },
    )
    [message_id] = await post(store, project, 1)
    for _ in range(2):
        claim = await store.claim_messages(project, "q", 300, 60, 5)
        assert claim is not None and [m.id for m in claim.messages] == [message_id]
        await store.release_claim(project, "q", claim.id)
    assert await store.claim_messages(project, "q", 300, 60, 5) is None
    assert await store.get_messages(project, "q", [message_id]) == []
    dead = await store.list_messages(project, "dlq", ListQuery(READER))
    assert [(m.id, m.body, m.ttl) for m in dead.messages] == [(message_id, b"0", 500)]
    names = [q.name for q in await store.list_queues(project, None, 10, False)]
    assert names == ["dlq", "q"]


async def test_a_dead_letter_wakes_the_dead_letter_queues_followers(
    store: FeedStore, project: str
) -> None:
    """A message moved to the dead-letter queue becomes visible there as a
    post would: its followers are woken (DESIGN.md rule 12), not left to
    their timeout."""
    await store.create_queue(project, "q", {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    await post(store, project, 1)
    claim = await store.claim_messages(project, "q", 300, 60, 5)
    assert claim is not None
    await store.release_claim(project, "q", claim.id)
    async with store.follow(project, "dlq") as follow:
        await asyncio.sleep(0.2)  # subscribed
        token = follow.token()
        assert await store.claim_messages(project, "q", 300, 60, 5) is None  # moves it
        assert await follow.wait(token, 10.0)
    dead = await store.list_messages(project, "dlq", ListQuery(READER))
    assert len(dead.messages) == 1


@pytest.mark.parametrize("storage_layout", ["records"], indirect=True)
async def test_dead_lettering_survives_a_stop_between_its_steps(
    store: FeedStore, project: str, redis_url: str
) -> None:
    """A claim parks the message and the service stops before moving it: the
    claim's ttl runs out, a later claim moves it. Moving it again (copy done,
    forget not) leaves exactly one copy."""
    await store.create_queue(project, "q", {"_max_claim_count": 1, "_dead_letter_queue": "dlq"})
    [message_id] = await post(store, project, 1)
    claim = await store.claim_messages(project, "q", 300, 60, 5)
    assert claim is not None
    await store.release_claim(project, "q", claim.id)
    # step 1 only, as if the service stopped right after the claim script:
    # parked under a claim whose ttl has already run out
    keys = QueueKeys.of(project, "q")
    client = direct_client(redis_url)
    try:
        replies = [await client.execute_command(*c) for c in read_commands(keys, [message_id])]
        [row] = rows([message_id], replies)
        assert row is not None
        for command in hold_commands(keys, row, "ab" * 12, 1):
            await client.execute_command(*command)
    finally:
        await client.aclose()
    assert await store.claim_messages(project, "q", 300, 60, 5) is None
    first = (await store.list_messages(project, "dlq", ListQuery(READER))).messages
    assert [m.id for m in first] == [message_id]
    # both steps again for the same message (a stop between copy and forget)
    assert isinstance(store, RedisStore)
    parked = Parked(message_id, b"0", WRITER.encode(), 300, 1)
    await store.claims.dead_letter(project, "q", "dlq", "cd" * 12, [parked])
    dead = await store.list_messages(project, "dlq", ListQuery(READER, include_claimed=True))
    # the same copy: a reader past its marker does not get it again
    assert [(m.id, m.body, m.seq) for m in dead.messages] == [(message_id, b"0", first[0].seq)]
    assert (await store.queue_stats(project, "q")).total == 0


async def test_purge_keeps_the_queue(store: FeedStore, project: str) -> None:
    await store.create_queue(project, "q", {"keep": True})
    await post(store, project, 5)
    await store.claim_messages(project, "q", 300, 60, 2)
    await store.purge_queue(project, "q")
    stats = await store.queue_stats(project, "q")
    assert (stats.total, stats.claimed) == (0, 0)
    assert await store.get_queue_metadata(project, "q") == {"keep": True}
    assert await store.claim_messages(project, "q", 300, 60, 5) is None
    fresh = await post(store, project, 1)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == fresh


async def test_a_fruitless_claim_says_when_something_becomes_free(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    """DESIGN.md rule 12: a claim wait sleeps until the earliest moment a
    message it looked at falls due or leaves its claim, learnt by the claim
    itself (no extra command)."""
    assert await store.try_claim(project, "q", 300, 60, 5) == Unclaimable(None)
    now = clock.now_ms()
    await post(store, project, 1, delay=30)
    await post(store, project, 1)
    held = await store.claim_messages(project, "q", 10, 0, 5)
    assert held is not None
    # the claim's expiry (10 s) comes before the delayed message (30 s)
    assert await store.try_claim(project, "q", 300, 60, 5) == Unclaimable(now + 10_000)
    await store.release_claim(project, "q", held.id)
    assert await claim_ids(store, project, 5) != []
    # a delayed message that expires before it is due never becomes free
    await store.purge_queue(project, "q")
    await post(store, project, 1, ttl=20, delay=30)
    assert await store.try_claim(project, "q", 300, 60, 5) == Unclaimable(None)
    await post(store, project, 1, delay=30)
    assert await store.try_claim(project, "q", 300, 60, 5) == Unclaimable(now + 30_000)
    clock.advance(30)
    claim = await store.try_claim(project, "q", 300, 60, 5)
    assert isinstance(claim, Claim) and len(claim.messages) == 1


async def test_an_empty_page_says_when_a_delayed_message_falls_due(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    now = clock.now_ms()
    await post(store, project, 1, delay=20)
    await post(store, project, 1, delay=10)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert (page.messages, page.next_marker, page.next_due) == ([], None, now + 10_000)
    # a message the reader would not see anyway (its own, echo off) is no reason
    mine = await store.list_messages(project, "q", ListQuery(WRITER))
    assert mine.next_due is None
    clock.advance(10)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert len(page.messages) == 1 and page.next_due is None


async def test_a_page_does_not_pass_a_delayed_message_after_its_last_one(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    """A delayed message posted after a visible one is seen once it falls
    due, by a reader (or a live follower) that was given the visible one."""
    now = clock.now_ms()
    batch = [NewMessage(b"1"), NewMessage(b"2", delay=10), NewMessage(b"3", delay=20)]
    [first, later, latest] = await store.post_messages(project, "q", WRITER, batch)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == [first]
    assert page.next_due == now + 10_000
    after = ListQuery(READER, marker=page.next_marker)
    waiting = await store.list_messages(project, "q", after)
    assert (waiting.messages, waiting.next_marker, waiting.next_due) == ([], None, now + 10_000)
    clock.advance(10)
    page = await store.list_messages(project, "q", after)
    assert [m.id for m in page.messages] == [later]
    assert page.next_due == now + 20_000
    clock.advance(10)
    page = await store.list_messages(project, "q", ListQuery(READER, marker=page.next_marker))
    assert [m.id for m in page.messages] == [latest] and page.next_due is None


# -- releasing one message of a claim (a feedsvc extension) ----------------------------


async def test_release_one_message_with_a_delay(
    store: FeedStore, project: str, clock: ManualClock, redis_url: str
) -> None:
    a, b = await post(store, project, 2)
    claim = await store.claim_messages(project, "q", 300, 60, 2)
    assert claim is not None and [m.claim_count for m in claim.messages] == [1, 1]
    [before] = await store.get_messages(project, "q", [a])
    key = QueueKeys.of(project, "q").record(a)
    life = await pttl(redis_url, key)
    now = clock.now_ms()
    await store.release_message(project, "q", a, claim.id, 30)
    # its life is what the claim promised (claim expiry + grace), not shorter
    assert await pttl(redis_url, key) > life - 10_000
    [released] = await store.get_messages(project, "q", [a])
    assert released.ttl == before.ttl == 360
    # the rest of the claim is untouched
    held = await store.get_claim(project, "q", claim.id)
    assert [m.id for m in held.messages] == [b]
    assert (await store.queue_stats(project, "q")).claimed == 1
    # a is hidden until its delay has passed (a waiter sleeps until then),
    # then claimable, its claim count kept
    assert await store.try_claim(project, "q", 300, 60, 5) == Unclaimable(now + 30_000)
    page = await store.list_messages(project, "q", ListQuery(READER))
    assert [m.id for m in page.messages] == []
    page = await store.list_messages(project, "q", ListQuery(READER, include_delayed=True))
    assert [m.id for m in page.messages] == [a]
    [shown] = page.messages
    assert shown.claim_id is None and shown.claim_count == 1
    clock.advance(29.9)
    assert await claim_ids(store, project, 5) == []
    clock.advance(0.2)
    again = await store.claim_messages(project, "q", 300, 60, 5)
    assert again is not None
    assert [(m.id, m.claim_count) for m in again.messages] == [(a, 2)]


async def test_release_one_message_at_once(store: FeedStore, project: str) -> None:
    a, b = await post(store, project, 2)
    claim = await store.claim_messages(project, "q", 300, 60, 2)
    assert claim is not None
    await store.release_message(project, "q", b, claim.id, 0)
    assert await claim_ids(store, project, 5) == [b]
    assert [m.id for m in (await store.get_claim(project, "q", claim.id)).messages] == [a]


async def test_release_by_a_claim_that_does_not_hold_the_message_changes_nothing(
    store: FeedStore, project: str, clock: ManualClock
) -> None:
    a, b, c = await post(store, project, 3)
    first = await store.claim_messages(project, "q", 300, 60, 1)
    second = await store.claim_messages(project, "q", 60, 60, 1)
    assert first is not None and second is not None
    for message_id, claim_id in (
        (a, second.id),  # another claim's
        (c, first.id),  # held by no claim
        (a, "0" * 24),  # no such claim
    ):
        with pytest.raises(ClaimDoesNotHold):
            await store.release_message(project, "q", message_id, claim_id, 0)
    with pytest.raises(MessageNotFound):  # another project's is no message here
        await store.release_message(project + "-other", "q", a, first.id, 0)
    with pytest.raises(MessageNotFound):
        await store.release_message(project, "q", "0" * 24, first.id, 0)
    # released once: the second time the claim holds it no more
    await store.release_message(project, "q", a, first.id, 0)
    with pytest.raises(ClaimDoesNotHold):
        await store.release_message(project, "q", a, first.id, 0)
    # an expired claim holds nothing
    clock.advance(61)
    with pytest.raises(ClaimDoesNotHold):
        await store.release_message(project, "q", b, second.id, 0)
    assert sorted(await claim_ids(store, project, 5)) == sorted([a, b, c])


async def test_releases_count_towards_dead_lettering(store: FeedStore, project: str) -> None:
    await store.create_queue(project, "q", {"_max_claim_count": 2, "_dead_letter_queue": "dlq"})
    [message_id] = await post(store, project, 1)
    for count in (1, 2):
        claim = await store.claim_messages(project, "q", 300, 60, 5)
        assert claim is not None
        assert [(m.id, m.claim_count) for m in claim.messages] == [(message_id, count)]
        await store.release_message(project, "q", message_id, claim.id, 0)
    # the claim after the limit moves it, as after claims that expired
    assert await store.claim_messages(project, "q", 300, 60, 5) is None
    dead = await store.list_messages(project, "dlq", ListQuery(READER))
    assert [m.id for m in dead.messages] == [message_id]


@pytest.mark.parametrize("storage_layout", ["records"], indirect=True)
async def test_a_parked_message_cannot_be_released(
    store: FeedStore, project: str, redis_url: str, clock: ManualClock
) -> None:
    """A message parked for the dead-letter queue carries the claim's id
    but is not the consumer's: releasing it would keep it from moving."""
    [a, b] = await post(store, project, 2)
    claim = await store.claim_messages(project, "q", 300, 60, 1)
    assert claim is not None
    keys = QueueKeys.of(project, "q")
    client = direct_client(redis_url)
    try:
        replies = [await client.execute_command(*c) for c in read_commands(keys, [b])]
        [row] = rows([b], replies)
        assert row is not None
        for command in hold_commands(keys, row, claim.id, clock.now_ms() + 300_000):
            await client.execute_command(*command)
    finally:
        await client.aclose()
    with pytest.raises(ClaimDoesNotHold):
        await store.release_message(project, "q", b, claim.id, 0)
    await store.release_message(project, "q", a, claim.id, 0)
