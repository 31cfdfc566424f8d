"""Followers wake through Redis: a post, a delayed message falling due, the
queue's deletion, a lost subscription; and an idle follower costs Redis
nothing. Both drivers, single Redis and Cluster."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from contextlib import AsyncExitStack

import pytest

from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.errors import StorageUnavailable
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.drivers import make_store
from tests.conftest import direct_client

READER = str(uuid.uuid4())


async def post_later(store: FeedStore, project: str, queue: str, body: bytes) -> list[str]:
    await asyncio.sleep(0.05)
    return await store.post_messages(project, queue, "writer", [NewMessage(body)])


async def test_a_post_wakes_a_waiting_follower(store: FeedStore, project: str) -> None:
    async with store.follow(project, "q") as follow:
        token = follow.token()
        page = await store.list_messages(project, "q", ListQuery(READER))
        assert page.messages == []
        poster = asyncio.create_task(post_later(store, project, "q", b"1"))
        assert await follow.wait(token, 10), "the post did not wake the follower"
        ids = await poster
        page = await store.list_messages(project, "q", ListQuery(READER))
        assert [m.id for m in page.messages] == ids
        assert not follow.ended


async def test_a_wake_up_between_read_and_wait_is_not_lost(store: FeedStore, project: str) -> None:
    async with store.follow(project, "q") as follow:
        token = follow.token()
        await store.post_messages(project, "q", "writer", [NewMessage(b"1")])
        for _ in range(100):  # the notification arrives while we are not waiting
            await asyncio.sleep(0.01)
            if token.is_set():
                break
        assert await follow.wait(token, 0.001), "the wake-up before wait() was lost"


@pytest.mark.slow
async def test_posts_to_other_queues_do_not_wake(store: FeedStore, project: str) -> None:
    async with store.follow(project, "q") as follow:
        token = follow.token()
        await store.post_messages(project, "other", "writer", [NewMessage(b"1")])
        await store.post_messages("elsewhere-" + project, "q", "writer", [NewMessage(b"1")])
        assert not await follow.wait(token, 0.3)


async def test_deleting_the_queue_ends_its_follow(store: FeedStore, project: str) -> None:
    await store.post_messages(project, "q", "writer", [NewMessage(b"1")])
    async with store.follow(project, "q") as follow:
        token = follow.token()
        await store.delete_queue(project, "q")
        assert await follow.wait(token, 10)
        assert follow.ended


@pytest.mark.slow  # waits for a 1 s delay to pass, in real time
async def test_a_delayed_message_wakes_its_follower_when_due(
    store: FeedStore, project: str
) -> None:
    async with store.follow(project, "q") as follow:
        await store.post_messages(project, "q", "writer", [NewMessage(b"1", delay=1)])
        token = follow.token()  # after the post's own wake-up
        await asyncio.sleep(0.1)
        token = follow.token()
        assert await follow.wait(token, 5), "the delayed message's due time woke nobody"


@pytest.mark.slow
async def test_an_idle_follower_costs_redis_nothing(
    store: FeedStore, project: str, redis_url: str
) -> None:
    async with store.follow(project, "q") as follow:
        await asyncio.sleep(0.2)  # subscribed
        client = direct_client(redis_url)
        try:
            before = await commands_served(client)
            assert not await follow.wait(follow.token(), 1.0)
            after = await commands_served(client)
        finally:
            await client.aclose()
        # nothing ran but INFO: ours, and the process's own read of the memory
        # policy (storage/policy_reader.py), which no follower adds to
        assert after == before


async def commands_served(client: object) -> int:
    """Commands the server(s) ran so far, INFO left out."""
    info = await client.info("commandstats")  # type: ignore[attr-defined]
    nodes = [info] if any(k.startswith("cmdstat_") for k in info) else list(info.values())
    return sum(
        int(stats["calls"])
        for node in nodes
        for name, stats in node.items()
        if name.startswith("cmdstat_") and name != "cmdstat_info"
    )


async def test_a_subscription_is_watched_by_tcp_keepalive_not_by_commands(
    store: FeedStore, project: str, redis_url: str
) -> None:
    """No PING while idle (the test above would see it after 10 s): over TCP
    the kernel's keep-alive probes find a peer that went away silently."""
    if redis_url.startswith("unix://"):
        pytest.skip("a local socket has no peer to lose")
    async with store.follow(project, "q"):
        await asyncio.sleep(0.2)  # subscribed
        notifier = store._transport.notifier  # type: ignore[attr-defined]
        [subscriber] = notifier._subscribers.values()
        sock = subscriber._conn._writer.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


async def test_nothing_subscribes_after_the_store_closed(
    settings: Settings, clock: ManualClock, project: str
) -> None:
    """A follower that outlives the store (a background task still winding
    down at shutdown) gets a 503, not a new subscription that nobody would
    ever close (its connection and task left behind)."""
    store = make_store(settings, clock)
    await store.open()
    async with store.follow(project, "q"):
        pass
    await store.close()
    with pytest.raises(StorageUnavailable):
        async with store.follow(project, "q"):
            pass
    notifier = store._transport.notifier  # type: ignore[attr-defined]
    assert notifier._subscribers == {}


async def test_queues_followed_at_once_share_a_subscription_that_stays_up(
    settings: Settings, clock: ManualClock, project: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Queues followed before the subscriber's connection is up are all
    subscribed when it comes up: on a cluster one SSUBSCRIBE per channel
    (channels of several slots in one command are refused with CROSSSLOT,
    which used to tear the subscription down and re-route every channel)."""
    caplog.set_level(logging.DEBUG, logger="feedsvc")
    fresh = make_store(settings, clock)  # no subscription yet: all channels wait for it
    await fresh.open()
    queues = [f"q{i}" for i in range(8)]
    try:
        async with AsyncExitStack() as stack:
            follows = await asyncio.gather(
                *(stack.enter_async_context(fresh.follow(project, q)) for q in queues)
            )
            for queue, follow in zip(queues, follows, strict=True):
                token = follow.token()
                await fresh.post_messages(project, queue, "writer", [NewMessage(b"1")])
                assert await follow.wait(token, 10), f"the post to {queue} woke nobody"
    finally:
        await fresh.close()
    lost = [r.getMessage() for r in caplog.records if "subscription lost" in r.getMessage()]
    assert lost == []


async def test_closing_while_a_reroute_is_pending_starts_no_subscription(
    settings: Settings, clock: ManualClock, project: str
) -> None:
    """A channel whose subscription ended is routed again in a task of the
    notifier's; close() ends that task, and nothing subscribes afterwards."""
    fresh = make_store(settings, clock)
    await fresh.open()
    notifier = fresh._transport.notifier  # type: ignore[attr-defined]
    async with fresh.follow(project, "q"), fresh.follow(project, "r"):
        before = asyncio.all_tasks()
        notifier.moved_away(list(notifier._follows))  # as when Redis ends them
        reroutes = asyncio.all_tasks() - before
        assert reroutes
        await fresh.close()
        await asyncio.wait(reroutes)
        assert notifier._subscribers == {}
        assert all(s._task.done() for s in notifier._routes.values())
