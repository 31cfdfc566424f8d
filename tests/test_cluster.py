"""feedsvc on a real 3-primary Redis Cluster, beyond the contract suites
(which run on the cluster too, see CLUSTER_SUITES in conftest.py): queues of
one project on different nodes, dead-lettering across nodes, a slot moved and
a primary failed over while producers and consumers are busy, for both
drivers.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
from redis.crc import key_slot

from feedsvc.clock import SystemClock
from feedsvc.config import Settings
from feedsvc.errors import Unavailable
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.lua_store import LuaStore
from feedsvc.storage.transport import Transport
from feedsvc.storage.watch_store import WatchStore
from feedsvc.testing.cluster import LocalCluster
from tests.conftest import make_settings

WRITER, READER = str(uuid.uuid4()), str(uuid.uuid4())
Store = LuaStore | WatchStore


def slot_of(project: str, queue: str) -> int:
    return key_slot(QueueKeys.of(project, queue).meta.encode())


@pytest.fixture
async def cluster_store(
    redis_cluster: LocalCluster, driver: str
) -> AsyncIterator[LuaStore | WatchStore]:
    store = make_store(make_settings(redis_cluster.url, driver=driver))
    await store.open()
    assert isinstance(store, LuaStore | WatchStore)
    yield store
    await store.close()


async def everything(store: FeedStore, project: str, queue: str) -> list[str]:
    """Every message id in the queue, claimed or not, by following markers."""
    seen: list[str] = []
    marker = None
    while True:
        query = ListQuery(READER, marker=marker, limit=20, echo=True, include_claimed=True)
        page = await store.list_messages(project, queue, query)
        if page.next_marker is None:
            return seen
        seen += [m.id for m in page.messages]
        marker = page.next_marker


def test_cluster_url_is_validated() -> None:
    assert Settings(redis_url="redis+cluster://127.0.0.1:7000").redis_cluster()
    assert not Settings(redis_url="redis://127.0.0.1:7000").redis_cluster()
    with pytest.raises(ValueError, match="redis\\+cluster://"):
        Settings(redis_url="cluster://127.0.0.1:7000")


async def test_queues_of_one_project_on_every_node_are_listed(
    cluster_store: Store, redis_cluster: LocalCluster, project: str
) -> None:
    names = [f"q{i:02d}" for i in range(24)]
    owners = {redis_cluster.owner(slot_of(project, name)) for name in names}
    assert owners == {0, 1, 2}, "the queues should spread over all three primaries"
    for name in names:
        assert await cluster_store.create_queue(project, name, {"n": name})
        await cluster_store.post_messages(project, name, WRITER, [NewMessage(b'"x"')])
    listed, marker = [], None
    while page := await cluster_store.list_queues(project, marker, 5, detailed=True):
        listed += page
        marker = page[-1].name
    assert [q.name for q in listed] == names
    assert [q.metadata for q in listed] == [{"n": n} for n in names]
    assert await cluster_store.count_queues(project) == len(names)


async def test_dead_letters_cross_nodes(
    cluster_store: Store, redis_cluster: LocalCluster, project: str
) -> None:
    source, dlq = (
        "work",
        next(
            f"dead{i}"
            for i in range(100)
            if redis_cluster.owner(slot_of(project, f"dead{i}"))
            != redis_cluster.owner(slot_of(project, "work"))
        ),
    )
    await cluster_store.create_queue(
        project, source, {"_max_claim_count": 1, "_dead_letter_queue": dlq}
    )
    ids = await cluster_store.post_messages(
        project, source, WRITER, [NewMessage(orjson.dumps(i)) for i in range(3)]
    )
    first = await cluster_store.claim_messages(project, source, 60, 60, 10)
    assert first is not None
    await cluster_store.release_claim(project, source, first.id)
    # claimed once already: the next claim moves them instead
    assert await cluster_store.claim_messages(project, source, 60, 60, 10) is None
    assert await everything(cluster_store, project, source) == []
    assert await everything(cluster_store, project, dlq) == ids
    moved = await cluster_store.get_messages(project, dlq, ids)
    assert [orjson.loads(m.body) for m in moved] == [0, 1, 2]
    assert [q.name for q in await cluster_store.list_queues(project, None, 10, False)] == [
        dlq,
        source,
    ]


class Traffic:
    """Three producers and two consumers (claim, then delete) on one queue,
    and the check that nothing acknowledged was lost, doubled or claimed
    twice, whatever happened to the cluster meanwhile."""

    def __init__(self, store: Store, project: str, queue: str) -> None:
        self.store, self.project, self.queue = store, project, queue
        self.acked: dict[str, bytes] = {}
        self.claims: Counter[str] = Counter()
        self.deleted: set[str] = set()
        self.unsure: set[str] = set()  # deletes answered 503: done or not
        self.unavailable: Counter[str] = Counter()
        self._stop = asyncio.Event()
        self._goal, self._reached = 0, asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, backlog: int) -> None:
        """Producers first, until `backlog` posts are acknowledged; then consumers."""
        self._tasks = [asyncio.create_task(self._produce(i)) for i in range(3)]
        await self.acknowledged(backlog)
        self._tasks += [asyncio.create_task(self._consume()) for _ in range(2)]

    async def acknowledged(self, more: int) -> None:
        """Wait until `more` further posts are acknowledged."""
        self._goal = len(self.acked) + more
        self._reached.clear()
        await self._reached.wait()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _produce(self, who: int) -> None:
        n = 0
        while not self._stop.is_set():
            body = orjson.dumps({"p": who, "n": n})
            n += 1
            try:
                [message_id] = await self.store.post_messages(
                    self.project, self.queue, WRITER, [NewMessage(body)]
                )
                self.acked[message_id] = body
                if len(self.acked) >= self._goal:
                    self._reached.set()
            except Unavailable:
                self.unavailable["post"] += 1
            await asyncio.sleep(0.001)

    async def _consume(self) -> None:
        store, project, queue = self.store, self.project, self.queue
        while not self._stop.is_set():
            try:
                claim = await store.claim_messages(project, queue, 300, 60, 5)
            except Unavailable:
                self.unavailable["claim"] += 1
                await asyncio.sleep(0.001)
                continue
            if claim is None:
                await asyncio.sleep(0.005)
                continue
            for message in claim.messages:
                self.claims[message.id] += 1
                try:
                    await store.delete_message(project, queue, message.id, claim.id)
                    self.deleted.add(message.id)
                except Unavailable:
                    self.unavailable["delete"] += 1
                    self.unsure.add(message.id)

    async def lost(self) -> int:
        """How many acknowledged messages are neither in the queue nor deleted."""
        remaining = await everything(self.store, self.project, self.queue)
        return len(set(self.acked) - set(remaining) - self.deleted - self.unsure)

    async def check(self) -> str:
        """Assert the guarantees; a one-line summary for the report."""
        store = self.store
        remaining = await everything(store, self.project, self.queue)
        assert len(remaining) == len(set(remaining)), "a message is listed twice"
        lost = set(self.acked) - set(remaining) - self.deleted - self.unsure
        assert not lost, "an acknowledged message was lost"
        assert not set(remaining) & self.deleted, "a deleted message came back"
        assert max(self.claims.values(), default=1) == 1, "a message was claimed twice"
        bodies = [m.body for m in await store.get_messages(self.project, self.queue, remaining)]
        bodies += [self.acked[i] for i in self.deleted if i in self.acked]
        assert len(bodies) == len(set(bodies)), "a post was stored twice"
        return (
            f"{len(self.acked)} posts acknowledged, {len(self.deleted)} claimed and deleted, "
            f"{store.counters.cluster_redirects} redirects, 503s: {dict(self.unavailable)}"
        )


async def test_a_slot_moved_mid_run_loses_and_doubles_nothing(
    cluster_store: Store, redis_cluster: LocalCluster, project: str
) -> None:
    """Producers and consumers run while the queue's slot migrates to another
    primary, key by key. Writes that meet ASK/TRYAGAIN fail cleanly (503) or
    are retried; after the move MOVED is followed. Every acknowledged message
    is then either deleted by the one consumer that claimed it or still in
    the queue, once."""
    queue = "moving"
    slot = slot_of(project, queue)
    target = (redis_cluster.owner(slot) + 1) % 3
    traffic = Traffic(cluster_store, project, queue)
    await traffic.start(backlog=300)  # so the move has keys to carry
    moved_keys = await asyncio.to_thread(redis_cluster.move_slot, slot, target)
    await traffic.acknowledged(200)  # and traffic after the move
    await traffic.stop()

    assert redis_cluster.owner(slot) == target
    assert moved_keys > 0
    assert cluster_store.counters.cluster_redirects > 0, "the move went unnoticed"
    summary = await traffic.check()
    print(f"CLUSTER slot move ({cluster_store.name}): {moved_keys} keys moved, {summary}")


@pytest.mark.process
def test_a_node_port_taken_before_the_first_start_is_given_up_for_another(
    tmp_path: Path,
) -> None:
    """Test runs in parallel (make test) pick free ports at the same moment: a
    port taken between LocalCluster's pick and its start gets a new one."""
    cluster = LocalCluster(tmp_path)
    taken = cluster.nodes[1].port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            cluster.start()
            assert cluster.nodes[1].port != taken
            with cluster.client(1) as client:
                assert client.cluster("INFO")["cluster_state"] == "ok"
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One for both drivers: fail_over returns with the cluster ready for the next."""
    cluster = LocalCluster(tmp_path_factory.mktemp("replicated"), replicas=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.cluster
async def test_a_key_named_after_a_subcommand_routes_the_command(
    redis_cluster: LocalCluster,
) -> None:
    """OBJECT ENCODING names its key after the subcommand: it goes to the
    key's node (a watch review's index compaction asks it). Routed by the
    word ENCODING, it went to that word's slot's node, was answered MOVED
    every time, and became a 503."""
    transport = Transport(make_settings(redis_cluster.url), SystemClock())
    transport.open()
    try:
        word = redis_cluster.owner(key_slot(b"ENCODING"))
        keys = (f"{{object-{uuid.uuid4().hex}}}:z" for _ in range(100))
        key = next(k for k in keys if redis_cluster.owner(key_slot(k.encode())) != word)
        await transport.call_checked([("ZADD", key, 1, "a")])
        assert await transport.call_checked([("OBJECT", "ENCODING", key)]) == [b"listpack"]
        assert transport.counters.cluster_redirects == 0
    finally:
        await transport.close()


@pytest.mark.cluster  # a cluster with replicas, of its own
@pytest.mark.process
async def test_a_transaction_answered_moved_is_sent_again_whole(
    replicated_cluster: LocalCluster,
) -> None:
    """A MULTI block whose commands a failed-over primary answers MOVED was
    discarded there (EXECABORT): the transport sends the whole block again to
    the slot's new owner, never its commands alone outside MULTI (a
    transaction's writes are all or nothing, and run once)."""
    cluster = replicated_cluster
    transport = Transport(make_settings(cluster.url), SystemClock())
    transport.open()
    try:
        key = "{moved-" + uuid.uuid4().hex + "}:n"
        assert await transport.transaction([("SET", key, 0)]) == [b"OK"]  # its slot learned
        await asyncio.to_thread(cluster.fail_over, cluster.owner(key_slot(key.encode())))
        assert await transport.transaction([("INCR", key), ("INCR", key)]) == [1, 2]
        assert await transport.call_checked([("GET", key)]) == [b"2"]
        assert transport.counters.cluster_redirects > 0, "the failover went unnoticed"
    finally:
        await transport.close()


@pytest.mark.cluster  # a cluster with replicas, of its own
@pytest.mark.process
async def test_a_primary_failed_over_mid_run_loses_and_doubles_nothing(
    replicated_cluster: LocalCluster, driver: str, project: str
) -> None:
    """The same traffic while the queue's primary hands over to its replica
    (CLUSTER FAILOVER): the old primary turns replica and answers MOVED,
    feedsvc follows it to the new one."""
    cluster = replicated_cluster
    store = make_store(make_settings(cluster.url, driver=driver))
    assert isinstance(store, LuaStore | WatchStore)
    try:
        await store.open()
        queue = "failing-over"
        slot = slot_of(project, queue)
        old = cluster.owner(slot)
        traffic = Traffic(store, project, queue)
        await traffic.start(backlog=200)
        new = await asyncio.to_thread(cluster.fail_over, old)
        await traffic.acknowledged(200)
        await traffic.stop()

        assert cluster.owner(slot) == new != old
        assert store.counters.cluster_redirects > 0, "the failover went unnoticed"
        summary = await traffic.check()
        print(f"CLUSTER failover ({store.name}): {summary}")
    finally:
        await store.close()


@pytest.mark.cluster  # a cluster with replicas, of its own
@pytest.mark.process
@pytest.mark.parametrize("acks", [0, 1], ids=["async", "min-replicas-ack-1"])
async def test_a_primary_killed_mid_run(
    replicated_cluster: LocalCluster, acks: int, project: str
) -> None:
    """kill -9 of the queue's primary under traffic; its replica takes over.
    Without --min-replicas-ack the writes it had not received are lost (counted,
    see docs/RELIABILITY.md); with it every acknowledged message survives."""
    cluster = replicated_cluster
    settings = make_settings(
        cluster.url, driver="lua", min_replicas_ack=acks, replica_ack_timeout=0.25
    )
    store = make_store(settings)
    assert isinstance(store, LuaStore)
    try:
        await store.open()
        queue = "killed"
        old = cluster.owner(slot_of(project, queue))
        traffic = Traffic(store, project, queue)
        await traffic.start(backlog=200)
        new = await asyncio.to_thread(cluster.kill_primary, old)
        await traffic.acknowledged(200)
        await traffic.stop()
        assert cluster.owner(slot_of(project, queue)) == new != old
        lost = await traffic.lost()
        print(
            f"CLUSTER kill -9 (lua, --min-replicas-ack {acks}): {len(traffic.acked)} posts "
            f"acknowledged, {lost} lost, {store.counters.not_replicated} not replicated, "
            f"503s: {dict(traffic.unavailable)}"
        )
        if acks:
            assert lost == 0
            await traffic.check()
    finally:
        await store.close()


async def test_a_follower_is_still_woken_after_its_queue_slot_moved(
    cluster_store: Store, redis_cluster: LocalCluster, project: str
) -> None:
    """The shard channel moves with the slot: Redis ends the subscription on
    the old primary (an unasked sunsubscribe), and feedsvc subscribes again
    on the new one, so a post after the move still wakes the follower."""
    queue = "followed-moving"
    slot = slot_of(project, queue)
    target = (redis_cluster.owner(slot) + 1) % 3
    await cluster_store.post_messages(project, queue, "writer", [NewMessage(b"before")])
    async with cluster_store.follow(project, queue) as follow:
        token = follow.token()
        await cluster_store.post_messages(project, queue, "writer", [NewMessage(b"1")])
        assert await follow.wait(token, 5), "not woken before the move"
        await asyncio.to_thread(redis_cluster.move_slot, slot, target)
        assert redis_cluster.owner(slot) == target
        for n in range(20):  # the first posts after the move may meet MOVED, then settle
            token = follow.token()
            await cluster_store.post_messages(project, queue, "writer", [NewMessage(b"%d" % n)])
            await follow.wait(token, 0.5)
        await asyncio.sleep(0.5)  # whatever re-subscribing there is, it is done
        for _ in range(3):
            token = follow.token()
            await cluster_store.post_messages(project, queue, "writer", [NewMessage(b"after")])
            assert await follow.wait(token, 5), "a post after the slot moved woke nobody"


async def test_a_closed_cluster_store_refuses_calls_instead_of_reconnecting(
    redis_cluster: LocalCluster, driver: str, project: str
) -> None:
    """A task that outlives the store at shutdown (a delivery runner, a
    reroute) gets a 503: it must not read the slot table again or open node
    connections that nothing would close."""
    store = make_store(make_settings(redis_cluster.url, driver=driver))
    await store.open()
    await store.create_queue(project, "closing", {})
    await store.close()
    with pytest.raises(Unavailable):
        await store.get_queue_metadata(project, "closing")
