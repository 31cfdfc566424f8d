"""Redis that is not there yet, goes away, or comes back: the transport's
503s and its recovery, on a single server and on a Cluster, both drivers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import uvloop

from feedsvc.clock import SYSTEM_CLOCK
from feedsvc.embedded_redis.server import pick_free_port
from feedsvc.errors import Unavailable
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage
from feedsvc.storage.drivers import make_store
from feedsvc.storage.transport import Transport
from tests.cluster import LocalCluster
from tests.conftest import make_settings

pytestmark = pytest.mark.process  # redis-servers and clusters of its own

pytestmark = pytest.mark.process  # starts redis-servers and a cluster of its own
READER = str(uuid.uuid4())


async def assert_unavailable(store: FeedStore, project: str) -> None:
    """Every kind of call answers Unavailable (a 503), none anything else."""
    with pytest.raises(Unavailable):
        await store.ping()
    with pytest.raises(Unavailable):
        await store.post_messages(project, "q", READER, [NewMessage(b"1")])
    with pytest.raises(Unavailable):
        await store.list_messages(project, "q", ListQuery(READER))
    with pytest.raises(Unavailable):
        await store.get_queue_metadata(project, "q")
    with pytest.raises(Unavailable):
        await store.claim_messages(project, "q", 60, 60, 1)


async def recovers(store: FeedStore, project: str, deadline: float = 30.0) -> list[str]:
    """Post until the store answers (it must recover by itself); the ids posted."""
    give_up = time.monotonic() + deadline
    while True:
        try:
            return await store.post_messages(project, "q", "writer", [NewMessage(b"1")])
        except Unavailable:
            if time.monotonic() > give_up:
                raise
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_a_single_server_not_up_yet_is_503_until_it_is(driver: str, tmp_path: Path) -> None:
    from feedsvc.embedded_redis.server import RedisServer

    port = pick_free_port()
    store = make_store(make_settings(f"redis://127.0.0.1:{port}/0", driver=driver))
    project = "p-" + uuid.uuid4().hex
    try:
        await store.open()  # logs, does not raise
        await assert_unavailable(store, project)
        server = RedisServer(tmp_path, port=port, appendfsync="no")
        server.start()
        try:
            ids = await recovers(store, project)
            page = await store.list_messages(project, "q", ListQuery(READER))
            assert [m.id for m in page.messages] == ids
        finally:
            server.stop()
    finally:
        await store.close()


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("down-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def cluster_ok(cluster: LocalCluster) -> bool:
    try:
        info = cluster.client(0).cluster("info")
    except redis.RedisError:
        return False
    return bool(info.get("cluster_state") == "ok")


def bring_back(cluster: LocalCluster) -> None:
    """Restart every node (same ports, same nodes.conf) and wait for the
    cluster to say it is ok (bounded; the store's recovery is what is tested)."""
    for node in cluster.nodes:
        node.start()
    give_up = time.monotonic() + 30
    while not cluster_ok(cluster) and time.monotonic() < give_up:
        time.sleep(0.2)


@pytest.mark.cluster
@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_a_cluster_down_or_not_up_yet_is_503_then_recovers(
    driver: str, own_cluster: LocalCluster
) -> None:
    """Started while the cluster is down (as compose may start it), the store
    answers 503 to everything, then serves once the cluster is back."""
    own_cluster.stop()
    store = make_store(make_settings(own_cluster.url, driver=driver))
    project = "p-" + uuid.uuid4().hex
    try:
        await store.open()  # logs, does not raise
        await assert_unavailable(store, project)
        await asyncio.to_thread(bring_back, own_cluster)
        ids = await recovers(store, project)
        page = await store.list_messages(project, "q", ListQuery(READER))
        assert [m.id for m in page.messages] == ids
        # and going down again while it runs is a 503 too, not a 500
        for node in own_cluster.nodes:
            node.stop()
        await assert_unavailable(store, project)
        await asyncio.to_thread(bring_back, own_cluster)
        assert len(await recovers(store, project)) == 1
    finally:
        await store.close()


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_reads_after_a_redis_restart_do_not_fail_on_stale_connections(
    driver: str, coalesce: bool, tmp_path: Path
) -> None:
    """Connections opened before a restart are dead after it; a read that
    meets one is retried once on a fresh connection instead of failing."""
    from feedsvc.embedded_redis.server import RedisServer

    server = RedisServer(tmp_path, appendfsync="always")
    server.start()
    settings = make_settings(server.url, driver=driver, coalesce=coalesce, pool_size=4)
    store = make_store(settings)
    project = "p-" + uuid.uuid4().hex
    try:
        await store.open()
        [posted] = await store.post_messages(project, "q", "writer", [NewMessage(b"1")])
        # open several pooled connections, so some stay idle in the pool
        await asyncio.gather(*(store.get_queue_metadata(project, "q") for _ in range(8)))
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)
        for _ in range(3):
            assert await store.get_queue_metadata(project, "q") == {}
            page = await store.list_messages(project, "q", ListQuery(READER))
            assert [m.id for m in page.messages] == [posted]
            assert [m.id for m in await store.get_messages(project, "q", [posted])] == [posted]
            await store.ping()
    finally:
        await store.close()
        server.stop()


@pytest.mark.cluster
async def test_ping_on_a_cluster_asks_every_primary(own_cluster: LocalCluster) -> None:
    """/v2/ping and /v2/health are healthy only if every primary answers: one
    unreachable primary means a third of the slots cannot be served."""
    await asyncio.to_thread(bring_back, own_cluster)
    store = make_store(make_settings(own_cluster.url, driver="lua"))
    try:
        await store.open()
        await store.ping()
        default = store._transport._redis.get_default_node().port  # type: ignore[attr-defined]
        [other] = [n for n in own_cluster.nodes if n.port != default][:1]
        other.stop()
        with pytest.raises(Unavailable):
            await store.ping()
        other.start()
        await asyncio.to_thread(bring_back, own_cluster)
        await recovers(store, "p-" + uuid.uuid4().hex)
        await store.ping()
    finally:
        await store.close()


@pytest.mark.parametrize("driver", ["lua", "watch"])
async def test_a_lost_subscription_wakes_followers_and_comes_back(
    driver: str, tmp_path: Path
) -> None:
    """Redis restarts under a follower: it is woken to re-read (a post may have
    been missed), and once the subscription is back, posts wake it again."""
    from feedsvc.embedded_redis.server import RedisServer

    server = RedisServer(tmp_path, appendfsync="no")
    server.start()
    store = make_store(make_settings(server.url, driver=driver))
    project = "p-" + uuid.uuid4().hex
    try:
        await store.open()
        async with store.follow(project, "q") as follow:
            token = follow.token()
            await asyncio.to_thread(server.stop)
            assert await follow.wait(token, 10), "losing the subscription woke nobody"
            await asyncio.to_thread(server.start)
            await recovers(store, project)
            for _ in range(3):  # resubscribed: a post wakes the follower again
                token = follow.token()
                await store.post_messages(project, "q", "writer", [NewMessage(b"2")])
                if await follow.wait(token, 2):
                    break
            else:
                raise AssertionError("posts no longer wake the follower after the restart")
    finally:
        await store.close()
        server.stop()


def test_a_write_on_a_connection_reset_under_it_is_a_503_under_uvloop(redis_url: str) -> None:
    """uvloop's write() raises RuntimeError on a transport the peer has reset
    (asyncio's lets the write pass): redis-py lets it through while it
    connects, when Redis dies between the TCP handshake and HELLO (seen once
    in the kill -9 test). It is Redis trouble, a 503; any other RuntimeError
    is still a bug."""

    async def scenario() -> None:
        transport = Transport(make_settings(redis_url), SYSTEM_CLOCK)
        client = aioredis.Redis.from_url(redis_url)
        conn = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        try:
            await conn.connect()
            assert conn._writer is not None
            conn._writer.transport.abort()  # as a reset does
            with pytest.raises(Unavailable):
                async with transport.errors():
                    await conn.send_command("PING")
            with pytest.raises(RuntimeError, match="a bug"):
                async with transport.errors():
                    raise RuntimeError("a bug")
        finally:
            await conn.disconnect(nowait=True)
            await client.aclose()
            await transport.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
