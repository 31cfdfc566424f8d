"""feedsvc on any Redis (DESIGN.md rule 10), both drivers.

A Redis that may evict feedsvc's keys (any maxmemory-policy but noeviction)
is refused at start (one line, exit 2) unless --allow-evicting-redis, which
/v2/health and /metrics then report; one that becomes so while serving gets
its writes refused (503 naming the policy), reads go on.

A Redis that is full: every write answers 503 with Retry-After and says
Redis is out of memory, nothing is half-written, reads keep working, and
writes succeed again once memory is freed, on one server and on the Redis
Cluster.

A Redis is made "full" with ``CONFIG SET maxmemory 1`` on every primary
(noeviction, so every write that needs memory is refused with OOM), which
is then set back to 0: deterministic, where filling a server to its limit
depends on sizes. One test fills a small server for real with posts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.appkeys import STORE
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.embedded_redis.supervisor import EmbeddedRedis
from feedsvc.errors import RedisMayEvict, RedisOutOfMemory, Unavailable
from feedsvc.storage import memory_policy
from feedsvc.storage.base import FeedStore, NewMessage, Parent, StoreCounters
from feedsvc.storage.drivers import eviction_problems, make_store
from feedsvc.storage.transport import trouble
from feedsvc.testing.cluster import LocalCluster
from feedsvc.testing.sentinel import LocalSentinel
from tests.conftest import PROCESS_DRIVERS, make_settings
from tests.test_cluster import slot_of

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
OOM_TITLE = "Redis is out of memory"
EVICT_TITLE = "Redis may evict data"


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own: its maxmemory is changed here."""
    server = RedisServer(tmp_path_factory.mktemp("full"), appendonly=False)
    server.start()
    yield server
    server.stop()


# the single one starts a redis-server of its own: a process; the cluster is
# asked for by name below, which conftest.py cannot see, so it is marked here
@pytest.fixture(
    params=[
        pytest.param("single", marks=pytest.mark.process),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
def primaries(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[redis.Redis]]]:
    """The URL feedsvc takes and a client per primary."""
    if request.param == "single":
        server: RedisServer = request.getfixturevalue("own_redis")
        clients = [redis.Redis(port=server.port)]
        url = server.url
    else:
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        clients = [cluster.client(i) for i in range(cluster.primaries)]
        url = cluster.url
    yield url, clients
    for client in clients:
        client.close()


@contextlib.contextmanager
def full(clients: list[redis.Redis]) -> Iterator[None]:
    """Every primary refuses writes that need memory, until the block ends."""
    try:
        for client in clients:
            client.config_set("maxmemory", 1)
        yield
    finally:
        for client in clients:
            client.config_set("maxmemory", 0)


@contextlib.asynccontextmanager
async def serving(url: str, driver: str) -> AsyncIterator[Client]:
    async with TestClient(TestServer(create_app(make_settings(url, driver=driver)))) as client:
        yield client


def new_headers() -> Headers:
    return {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "safety-" + uuid.uuid4().hex}


async def refused_for_memory(resp: Any) -> None:
    """A 503 saying Redis is out of memory, with Retry-After."""
    assert resp.status == 503, await resp.text()
    assert int(resp.headers["Retry-After"]) >= 1
    doc = await resp.json()
    assert doc["title"] == OOM_TITLE, doc
    assert "memory" in doc["description"]


async def written_or_refused(resp: Any, ok: int) -> bool:
    """Redis lets a write through when it frees memory (a delete) or when a
    script has already written (it is not stopped half-way): then the write
    is answered as usual. Anything else is a 503 for memory, never a 500."""
    if resp.status == ok:
        return True
    await refused_for_memory(resp)
    return False


async def listed(http: Client, headers: Headers, queue: str) -> list[Any]:
    resp = await http.get(
        f"/v2/queues/{queue}/messages?echo=true&include_claimed=true&limit=20", headers=headers
    )
    assert resp.status == 200, await resp.text()
    return [m["body"] for m in (await resp.json())["messages"]]


@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_every_write_on_a_full_redis_is_a_503_and_reads_go_on(
    driver: str, primaries: tuple[str, list[redis.Redis]]
) -> None:
    url, clients = primaries
    headers = new_headers()
    q = "/v2/queues/full"
    async with serving(url, driver) as http:
        # before: a queue with messages, a claim and a subscription
        resp = await http.post(
            q + "/messages", json={"messages": [{"body": i} for i in range(4)]}, headers=headers
        )
        assert resp.status == 201
        ids = [href.rsplit("/", 1)[1] for href in (await resp.json())["resources"]]
        resp = await http.post(q + "/claims?limit=1", json={"ttl": 60}, headers=headers)
        assert resp.status == 201
        claim = resp.headers["Location"]
        resp = await http.post(
            q + "/subscriptions",
            json={"subscriber": "http://example.com/hook", "ttl": 600},
            headers=headers,
        )
        assert resp.status == 201
        sid = (await resp.json())["subscription_id"]

        with full(clients):
            # writes that need memory: refused, and say why
            post = {"messages": [{"body": "lost?"}]}
            await refused_for_memory(await http.post(q + "/messages", json=post, headers=headers))
            keyed = {**headers, "Idempotency-Key": "k1"}
            await refused_for_memory(await http.post(q + "/messages", json=post, headers=keyed))
            await refused_for_memory(await http.put("/v2/queues/other", headers=headers))
            await refused_for_memory(
                await http.post(
                    "/v2/queues/other/subscriptions",
                    json={"subscriber": "http://example.com/x", "ttl": 600},
                    headers=headers,
                )
            )
            await refused_for_memory(
                await http.patch(
                    "/v2/queues/full",
                    json=[{"op": "add", "path": "/metadata/a", "value": 1}],
                    headers={
                        **headers,
                        "Content-Type": "application/openstack-messaging-v2.0-json-patch",
                    },
                )
            )
            # the rest: written as usual or refused for memory, never a 500
            await written_or_refused(
                await http.post(q + "/claims?limit=1", json={"ttl": 60}, headers=headers), 201
            )
            await written_or_refused(
                await http.patch(claim, json={"ttl": 120}, headers=headers), 204
            )
            await written_or_refused(
                await http.patch(f"{q}/subscriptions/{sid}", json={"ttl": 700}, headers=headers),
                204,
            )
            await written_or_refused(
                await http.delete(f"{q}/messages/{ids[3]}", headers=headers), 204
            )
            await written_or_refused(await http.delete(f"{q}/messages?pop=1", headers=headers), 200)
            # delivery state (the delivery worker's writes; it retries later)
            assert http.app is not None
            deliveries = http.app[STORE].deliveries
            parent = Parent("queue", headers["X-Project-ID"], "full")
            lease = str(uuid.uuid4())  # not the subscription, which this app delivers
            with pytest.raises(RedisOutOfMemory):
                await deliveries.acquire(parent, lease, "a-worker", 10_000)
            # reads go on
            assert "lost?" not in await listed(http, headers, "full")
            assert (await http.get(q + "/stats", headers=headers)).status == 200
            assert (await http.get(f"{q}/messages/{ids[0]}", headers=headers)).status == 200
            resp = await http.get("/v2/queues", headers=headers)
            assert resp.status == 200
            assert [q["name"] for q in (await resp.json())["queues"]] == ["full"]

        # memory freed: writes succeed again, and the refused post left nothing
        assert "lost?" not in await listed(http, headers, "full")
        resp = await http.post(
            q + "/messages", json={"messages": [{"body": "after"}]}, headers=headers
        )
        assert resp.status == 201, await resp.text()
        assert "after" in await listed(http, headers, "full")
        assert (await http.put("/v2/queues/other", headers=headers)).status == 201
        assert await deliveries.acquire(parent, lease, "a-worker", 10_000)
        resp = await http.post(q + "/messages", json=post, headers=keyed)
        assert resp.status == 201, await resp.text()


@pytest.mark.process
@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_posts_until_redis_is_full_lose_nothing(driver: str, tmp_path: Path) -> None:
    """Fill a redis-server of 2 MB (noeviction) with posts: every 201 is read
    back, the posts past the limit are 503s for memory, and posting works
    again once memory is freed."""
    with (
        RedisServer(tmp_path, appendonly=False, extra_args=["--maxmemory", "2mb"]) as server,
        redis.Redis(port=server.port) as direct,
    ):
        headers = new_headers()
        q = "/v2/queues/fill"
        acknowledged: list[int] = []
        refused = 0
        async with serving(server.url, driver) as http:
            for n in range(5000):
                numbers = [n * 10 + i for i in range(10)]
                batch = [{"body": {"n": k, "pad": "x" * 1000}} for k in numbers]
                resp = await http.post(q + "/messages", json={"messages": batch}, headers=headers)
                if resp.status == 201:
                    acknowledged += numbers
                    continue
                await refused_for_memory(resp)
                refused += 1
                if refused == 20:
                    break
            assert refused == 20 and acknowledged, "Redis never filled up"
            # every acknowledged message is there, in order, once
            seen: list[int] = []
            path = q + "/messages?echo=true&limit=20"
            while True:
                resp = await http.get(path, headers=headers)
                assert resp.status == 200
                page = await resp.json()
                if not page["messages"]:
                    break
                seen += [m["body"]["n"] for m in page["messages"]]
                path = page["links"][0]["href"]
            assert seen == acknowledged
            direct.config_set("maxmemory", "0")
            resp = await http.post(
                q + "/messages", json={"messages": [{"body": "again"}]}, headers=headers
            )
            assert resp.status == 201


@pytest.mark.process
@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_a_post_that_fills_redis_is_answered_as_it_was_stored(
    driver: str, own_redis: RedisServer
) -> None:
    """The edge: a body that fits under maxmemory but leaves Redis full for
    the rest of the post's commands. Whatever Redis kept decides the answer:
    a 201 only if the message is there, a 503 only if it is not. maxmemory
    is set at a range of margins above the memory in use, around the body's
    size, so that some post meets the edge (measured: the lua driver met it
    at a margin of 116,000 bytes for a 100,000-byte body)."""
    headers = new_headers()
    q = "/v2/queues/edge"
    answers: set[int] = set()
    with redis.Redis(port=own_redis.port) as direct:
        async with serving(own_redis.url, driver) as http:
            assert (await http.put(q, headers=headers)).status == 201
            try:
                for margin in range(60_000, 260_000, 2_000):
                    used = int(direct.info("memory")["used_memory"])
                    direct.config_set("maxmemory", used + margin)
                    post = {"messages": [{"body": "x" * 100_000}]}
                    resp = await http.post(q + "/messages", json=post, headers=headers)
                    direct.config_set("maxmemory", 0)
                    page = await (await http.get(q + "/messages?echo=true", headers=headers)).json()
                    kept = [m["id"] for m in page["messages"]]
                    answers.add(resp.status)
                    if resp.status == 201:
                        assert [
                            h.rsplit("/", 1)[1] for h in (await resp.json())["resources"]
                        ] == kept
                    else:
                        await refused_for_memory(resp)
                        assert kept == [], f"a 503 for a stored message (margin {margin})"
                    assert (await http.post(q + "/purge", headers=headers)).status == 204
            finally:
                direct.config_set("maxmemory", 0)
    assert answers == {201, 503}


# -- the eviction policy ------------------------------------------------------


@pytest.fixture
def evicting_redis(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A redis-server with the maxmemory-policy the test is parametrized with
    (and no maxmemory: a policy is refused whatever the limit is now)."""
    policy = getattr(request, "param", "allkeys-lru")
    with RedisServer(
        tmp_path, appendonly=False, extra_args=["--maxmemory-policy", policy]
    ) as server:
        yield server


@pytest.mark.process
@pytest.mark.parametrize(
    "evicting_redis", ["allkeys-lru", "volatile-lru", "volatile-ttl"], indirect=True
)
@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_a_redis_that_may_evict(evicting_redis: RedisServer, workers: str) -> None:
    policy = evicting_redis_policy(evicting_redis)
    result = subprocess.run(
        [sys.executable, "-m", "feedsvc", "serve", "--redis-url", evicting_redis.url,
         "--port", "0", "--workers", workers],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("feedsvc: error: Redis at 127.0.0.1:")
    assert f"maxmemory-policy {policy}" in lines[0]
    assert "noeviction" in lines[0] and "--allow-evicting-redis" in lines[0]


def evicting_redis_policy(server: RedisServer) -> str:
    with redis.Redis(port=server.port) as direct:
        return str(direct.config_get("maxmemory-policy")["maxmemory-policy"])


@pytest.mark.process
@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_allow_evicting_redis_serves_and_says_so(
    driver: str, evicting_redis: RedisServer
) -> None:
    settings = make_settings(evicting_redis.url, driver=driver, allow_evicting_redis=True)
    headers = new_headers()
    async with TestClient(TestServer(create_app(settings))) as http:
        resp = await http.post(
            "/v2/queues/q/messages", json={"messages": [{"body": 1}]}, headers=headers
        )
        assert resp.status == 201
        health = await (await http.get("/v2/health")).json()
        [(_, policy)] = health["redis_eviction"]["policies"].items()
        assert policy == "allkeys-lru"
        assert health["redis_eviction"]["may_evict"] is True
        assert health["redis_eviction"]["allowed"] is True
        assert health["redis_eviction"]["refusing_writes"] is False
        metrics = await (await http.get("/metrics")).text()
        assert "feedsvc_redis_may_evict 1.0" in metrics


async def refused_for_eviction(resp: Any, policy: str) -> None:
    assert resp.status == 503, await resp.text()
    assert int(resp.headers["Retry-After"]) >= 1
    doc = await resp.json()
    assert doc["title"] == EVICT_TITLE, doc
    assert f"maxmemory-policy {policy}" in doc["description"]


async def post_until(http: Client, headers: Headers, wanted: int, body: Any) -> Any:
    """Post until the answer is wanted (or 20 s pass): what a client retrying does."""
    for _ in range(200):
        resp = await http.post(
            "/v2/queues/q/messages", json={"messages": [{"body": body}]}, headers=headers
        )
        if resp.status == wanted:
            return resp
        assert resp.status in (201, 503), await resp.text()
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {wanted} in 20 s")


async def refusing_writes(http: Client) -> None:
    for _ in range(200):
        health = await (await http.get("/v2/health")).json()
        if health["redis_eviction"]["refusing_writes"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the policy was not read again in 20 s")


@pytest.mark.process
@pytest.mark.parametrize("how", ["recheck", "reconnect"])
@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_a_redis_that_becomes_evicting_gets_no_writes(
    driver: str, how: str, own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy changed while serving is found by the periodic re-check
    (made short here) or after a reconnect (the connections killed): writes
    are refused naming it, reads go on; set back, writes resume."""
    if how == "recheck":
        monkeypatch.setattr(memory_policy, "RECHECK_INTERVAL", 0.2)
        monkeypatch.setattr(memory_policy, "REFUSING_RECHECK", 0.2)
    headers = new_headers()
    with redis.Redis(port=own_redis.port) as direct:
        async with serving(own_redis.url, driver) as http:
            resp = await post_until(http, headers, 201, "before")
            before = (await resp.json())["resources"][0]
            try:
                direct.config_set("maxmemory-policy", "volatile-lru")
                if how == "reconnect":
                    direct.client_kill_filter(_type="normal", skipme=True)
                else:  # writes until the re-check are written: wait for it
                    await refusing_writes(http)
                resp = await post_until(http, headers, 503, "refused?")
                if (await resp.json())["title"] != EVICT_TITLE:  # the killed connection
                    resp = await post_until(http, headers, 503, "refused?")
                await refused_for_eviction(resp, "volatile-lru")
                assert (await http.put("/v2/queues/other", headers=headers)).status == 503
                # reads go on: a list, stats, a message by id, the queue
                assert await listed(http, headers, "q") == ["before"]
                resp = await http.get("/v2/queues/q/stats", headers=headers)
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["messages"]["total"] == 1
                assert (await http.get(before, headers=headers)).status == 200
                assert (await http.get("/v2/queues/q", headers=headers)).status == 200
                health = await (await http.get("/v2/health")).json()
                assert health["redis_eviction"]["refusing_writes"] is True
            finally:
                direct.config_set("maxmemory-policy", "noeviction")
            if how == "reconnect":
                direct.client_kill_filter(_type="normal", skipme=True)
            await post_until(http, headers, 201, "after")
            assert await listed(http, headers, "q") == ["before", "after"]


@pytest.mark.process
def test_the_embedded_redis_evicts_nothing(tmp_path: Path) -> None:
    embedded = EmbeddedRedis(tmp_path / "data", "no")
    embedded.start()
    try:
        with redis.Redis.from_url(embedded.url) as direct:
            assert direct.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    finally:
        embedded.stop()


@pytest.mark.process
async def test_keys_an_allowed_evicting_redis_evicts_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With --allow-evicting-redis loss is possible, but not silent: the
    keys Redis evicts show in /v2/health, /metrics and an ERROR line."""
    monkeypatch.setattr(memory_policy, "RECHECK_INTERVAL", 0.2)
    args = ["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(tmp_path, appendonly=False, extra_args=args) as server:
        settings = make_settings(server.url, allow_evicting_redis=True)
        headers = new_headers()
        async with TestClient(TestServer(create_app(settings))) as http:
            stored = 0
            for n in range(300):
                batch = [{"body": {"n": n, "pad": "x" * 1000}} for _ in range(10)]
                resp = await http.post(
                    "/v2/queues/q/messages", json={"messages": batch}, headers=headers
                )
                # allkeys-lru may evict a body the post has just written, before
                # its index: that post is refused, not acknowledged and lost
                if resp.status == 503:
                    assert "lost a message body" in (await resp.json())["description"]
                else:
                    assert resp.status == 201, await resp.text()
                    stored += 1
            assert stored > 0
            for _ in range(100):
                health = await (await http.get("/v2/health")).json()
                [evicted] = health["redis_eviction"]["evicted_keys"].values()
                if evicted:
                    break
                await asyncio.sleep(0.1)
            assert evicted > 0
            metrics = await (await http.get("/metrics")).text()
            # the count read since (every RECHECK_INTERVAL), at least as high:
            # the service's own background writes may evict more meanwhile
            [shown] = re.findall(r"^feedsvc_redis_evicted_keys ([0-9.]+)$", metrics, re.MULTILINE)
            assert float(shown) >= evicted
    assert any("evicted" in r.message and r.levelname == "ERROR" for r in caplog.records)


@pytest.mark.process
@pytest.mark.parametrize(
    ("denied", "found"),
    [
        (["-info"], []),  # CONFIG GET says noeviction
        (["-info", "-config"], ["cannot read the maxmemory-policy of Redis at 127.0.0.1:"]),
    ],
)
async def test_a_policy_is_read_where_info_or_config_is_denied(
    own_redis: RedisServer, denied: list[str], found: list[str]
) -> None:
    """Managed services disable CONFIG (or INFO): either one is enough; with
    neither the policy may be anything, so it is refused."""
    user = "u" + uuid.uuid4().hex[:8]
    with redis.Redis(port=own_redis.port) as direct:
        direct.acl_setuser(
            user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
            commands=["+@all", *denied],
        )  # fmt: skip
    url = f"redis://{user}:pw@127.0.0.1:{own_redis.port}/0"
    problems = await eviction_problems(make_settings(url))
    assert problems is not None
    assert [p[: len(f)] for p, f in zip(problems, found, strict=True)] == found


async def test_every_primary_of_a_cluster_is_read(redis_cluster: LocalCluster) -> None:
    settings = make_settings(redis_cluster.url)
    assert await eviction_problems(settings) == []
    with redis_cluster.client(1) as node:
        node.config_set("maxmemory-policy", "volatile-lru")
        try:
            problems = await eviction_problems(settings)
        finally:
            node.config_set("maxmemory-policy", "noeviction")
    assert problems is not None and len(problems) == 1
    assert (
        f"Redis at 127.0.0.1:{redis_cluster.nodes[1].port} has maxmemory-policy volatile-lru"
        in problems[0]
    )


@pytest.mark.process
async def test_a_sentinel_failover_to_an_evicting_replica_stops_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new master's policy is read after the failover, not at the next
    periodic read (made an hour long here)."""
    monkeypatch.setattr(memory_policy, "RECHECK_INTERVAL", 3600.0)
    monkeypatch.setattr(memory_policy, "REFUSING_RECHECK", 3600.0)
    setup = LocalSentinel(tmp_path, appendfsync="no")
    setup.start()
    store = make_store(make_settings(setup.url, driver="lua"))
    project = "p-" + uuid.uuid4().hex
    try:
        await store.open()
        await store.post_messages(project, "q", "w", [NewMessage(b"1")])
        with redis.Redis(port=setup.replica.port) as replica:
            replica.config_set("maxmemory-policy", "volatile-lru")
        setup.failover()
        refused = await first_refusal(store, project, "q")
        assert refused is not None, "writes went on on the evicting new master"
        assert "maxmemory-policy volatile-lru" in refused.description
    finally:
        await store.close()
        setup.stop()


@pytest.mark.process
@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_a_read_only_replica_is_a_503_for_writes(
    driver: str, own_redis: RedisServer, tmp_path: Path
) -> None:
    """A URL that names a replica (or a master demoted under feedsvc):
    Redis answers writes READONLY, which redis-py strips as it does OOM."""
    args = ["--replicaof", "127.0.0.1", str(own_redis.port)]
    with RedisServer(tmp_path, appendonly=False, extra_args=args) as replica:
        async with serving(replica.url, driver) as http:
            resp = await http.post(
                "/v2/queues/q/messages", json={"messages": [{"body": 1}]}, headers=new_headers()
            )
            assert resp.status == 503, await resp.text()
            assert int(resp.headers["Retry-After"]) >= 1


@pytest.mark.process  # its own redis-server (own_redis)
async def test_a_transaction_refused_for_memory_at_exec_is_out_of_memory(
    own_redis: RedisServer,
) -> None:
    """Redis 7 refuses a whole MULTI at EXEC when memory ran out after its
    commands were queued: EXECABORT naming OOM (seen as a 500 from the watch
    driver at a filling Redis). That is Redis out of memory, a 503, like an
    OOM reply to a command."""
    client = redis.Redis(port=own_redis.port)
    other = redis.Redis(port=own_redis.port)
    try:
        conn = client.connection_pool.get_connection()
        try:
            conn.send_command("MULTI")  # type: ignore[no-untyped-call]
            assert conn.read_response() == b"OK"
            conn.send_command("SET", "exec-oom", "v")  # type: ignore[no-untyped-call]
            assert conn.read_response() == b"QUEUED"
            other.config_set("maxmemory", 1)
            conn.send_command("EXEC")  # type: ignore[no-untyped-call]
            with pytest.raises(redis.exceptions.ResponseError) as raised:
                conn.read_response()
        finally:
            client.connection_pool.release(conn)
    finally:
        other.config_set("maxmemory", 0)
        client.close()
        other.close()
    translated = await trouble(raised.value, cast(Any, None), StoreCounters(), cast(Any, None))
    assert isinstance(translated, RedisOutOfMemory), (raised.value, translated)


@pytest.mark.cluster  # a cluster with replicas, of its own
@pytest.mark.process
async def test_a_cluster_failover_to_an_evicting_replica_stops_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As with Sentinel: after CLUSTER FAILOVER onto a replica whose policy
    may evict, writes to its slots are refused, the new primary's policy read
    because the slots moved, not at the next periodic read (an hour here)."""
    monkeypatch.setattr(memory_policy, "RECHECK_INTERVAL", 3600.0)
    monkeypatch.setattr(memory_policy, "REFUSING_RECHECK", 3600.0)
    cluster = LocalCluster(tmp_path, replicas=True)
    cluster.start()
    store = make_store(make_settings(cluster.url, driver="lua"))
    project, queue = "p-" + uuid.uuid4().hex, "q"
    try:
        await store.open()
        await store.post_messages(project, queue, "w", [NewMessage(b"1")])
        old = cluster.owner(slot_of(project, queue))
        with cluster.client(cluster.counterpart(old)) as replica:
            replica.config_set("maxmemory-policy", "volatile-lru")
        assert await asyncio.to_thread(cluster.fail_over, old) != old
        refused = await first_refusal(store, project, queue)
        assert refused is not None, "writes went on on the evicting new primary"
        assert "maxmemory-policy volatile-lru" in refused.description
    finally:
        await store.close()
        cluster.stop()


async def first_refusal(store: FeedStore, project: str, queue: str) -> RedisMayEvict | None:
    """Post until a write is refused for the memory policy (up to some 30 s
    of 503s while a failover settles); that refusal, or None."""
    for _ in range(300):
        try:
            await store.post_messages(project, queue, "w", [NewMessage(b"2")])
        except RedisMayEvict as exc:
            return exc
        except Unavailable:
            pass
        await asyncio.sleep(0.1)
    return None
