"""Per-project request rates (--project-rate): a 429 with Retry-After over
the rate, other projects unaffected, the limit shared by every process on the
Redis, a project's own limits read from its limits hash, and Redis trouble
letting requests through. Time is the app's ManualClock: the bucket refills
when a test moves it, never while it waits."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis, RedisCluster

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.services.rate_limiter import FAIL_OPEN_MS, LEASE_MS
from feedsvc.storage.keys import project_limits_key, rate_bucket_key, registry_key
from feedsvc.testing.service import ServiceProcess
from tests.conftest import direct_client, make_settings

Client = TestClient[web.Request, web.Application]
AppFactory = Callable[..., AbstractAsyncContextManager[Client]]


@pytest.fixture
def app_on(redis_url: str, driver: str, clock: ManualClock) -> AppFactory:
    """An app on the test Redis with the given settings changes, on the test's clock."""

    @asynccontextmanager
    async def make(**changes: object) -> AsyncIterator[Client]:
        settings = make_settings(redis_url, driver=driver, **changes)
        async with TestClient(TestServer(create_app(settings, clock))) as client:
            yield client

    return make


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis | RedisCluster]:
    client = direct_client(redis_url)
    yield client
    await client.aclose()


#: On a Cluster too: the bucket and the limits hash must share a slot.
ON_A_CLUSTER_TOO = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


def caller(project: str) -> dict[str, str]:
    return {"Client-ID": str(uuid.uuid4()), "X-Project-ID": project}


def new_project() -> str:
    return "rate-" + uuid.uuid4().hex


async def statuses(http: Client, project: str, count: int) -> list[int]:
    got = []
    for _ in range(count):
        async with http.get("/v2/queues", headers=caller(project)) as response:
            got.append(response.status)
    return got


@ON_A_CLUSTER_TOO
async def test_over_its_rate_a_project_gets_429_and_others_do_not(
    app_on: AppFactory, clock: ManualClock, redis: Redis | RedisCluster
) -> None:
    busy, quiet = new_project(), new_project()
    async with app_on(project_rate=1, project_burst=3) as http:
        assert await statuses(http, busy, 3) == [200, 200, 200]
        async with http.get("/v2/queues", headers=caller(busy)) as response:
            assert response.status == 429
            assert response.headers["Retry-After"] == "1"
            body = await response.json()
            assert body["title"] == "Too many requests"
            assert "retry after 1 second" in body["description"]
        assert await statuses(http, quiet, 3) == [200, 200, 200]
        # a refused write changes nothing
        post = {"messages": [{"body": "over"}]}
        async with http.post("/v2/queues/q/messages", json=post, headers=caller(busy)) as response:
            assert response.status == 429
        # ping, health and the home document are not counted
        for path in ("/v2/ping", "/v2/health", "/v2"):
            async with http.get(path, headers=caller(busy)) as response:
                assert response.status < 400, path
        clock.advance(1)  # one request's worth of the rate
        assert await statuses(http, busy, 2) == [200, 429]
        async with http.get("/metrics") as response:
            assert "feedsvc_rate_limited_total 3.0" in await response.text()
    assert await redis.exists(registry_key(busy)) == 0  # the refused post made no queue


async def test_the_limit_holds_across_two_apps_on_one_redis(app_on: AppFactory) -> None:
    project = new_project()
    # a burst of 40: each app leases up to 4 at a time; the clock stands still,
    # so the bucket never refills
    async with (
        app_on(project_rate=1, project_burst=40) as one,
        app_on(project_rate=1, project_burst=40) as two,
    ):
        first = await statuses(one, project, 30)
        second = await statuses(two, project, 30)
        third = await statuses(one, project, 10)
    admitted = (first + second + third).count(200)
    # never more than the bucket holds; at most one lease (4) left unused
    assert 36 <= admitted <= 40, (first, second, third)
    assert first == [200] * 30
    assert 429 in second
    assert 200 in second


@ON_A_CLUSTER_TOO
async def test_an_override_in_the_limits_hash_takes_effect(
    app_on: AppFactory, redis: Redis | RedisCluster, clock: ManualClock
) -> None:
    project, other = new_project(), new_project()
    async with app_on(project_rate=1000) as http:
        assert await statuses(http, project, 20) == [200] * 20
        await redis.hset(project_limits_key(project), mapping={"rate": "0.5", "burst": "2"})
        # in force from the next lease: what this app holds expires by LEASE_MS
        clock.advance(LEASE_MS / 1000)
        assert await statuses(http, project, 3) == [200, 200, 429]
        async with http.get("/v2/queues", headers=caller(project)) as response:
            assert response.headers["Retry-After"] == "2"  # 0.5 per second
        assert await statuses(http, other, 20) == [200] * 20
        # rate 0: this project has no limit
        await redis.hset(project_limits_key(project), "rate", "0")
        clock.advance(2)  # the refusal above stands until then
        assert await statuses(http, project, 30) == [200] * 30
        # an override that is no number is ignored: the default applies
        await redis.hset(project_limits_key(project), mapping={"rate": "fast", "burst": "-1"})
        clock.advance(2)  # the bucket still owes what rate 0.5 lent: 2 requests, 4 s
        assert await statuses(http, project, 30) == [200] * 30
        # ... and so is one out of bounds (TAT would not fit Redis's PX)
        await redis.hset(project_limits_key(project), mapping={"rate": "1e-9", "burst": "1e9"})
        clock.advance(LEASE_MS / 1000)
        assert await statuses(http, project, 30) == [200] * 30
    await redis.delete(project_limits_key(project))


async def test_without_the_flag_nothing_is_limited_and_redis_holds_no_bucket(
    app_on: AppFactory, redis: Redis | RedisCluster
) -> None:
    project = new_project()
    await redis.hset(project_limits_key(project), mapping={"rate": "0.01", "burst": "1"})
    async with app_on() as http:
        assert await statuses(http, project, 5) == [200] * 5
    assert await redis.exists(rate_bucket_key(project)) == 0
    await redis.delete(project_limits_key(project))


def test_settings_bound_the_rate(redis_url: str) -> None:
    assert Settings(redis_url=redis_url, project_rate=0.5).project_burst == 0
    with pytest.raises(ValueError, match="--project-burst needs --project-rate"):
        Settings(redis_url=redis_url, project_burst=3)


@pytest.mark.process
@pytest.mark.parametrize("driver", ["lua"])
async def test_redis_trouble_lets_requests_through_to_their_own_503(
    tmp_path: Path, clock: ManualClock, driver: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    try:
        settings = make_settings(
            server.url, driver=driver, project_rate=1, project_burst=1, redis_timeout=2
        )
        project = new_project()
        async with TestClient(TestServer(create_app(settings, clock))) as http:
            assert await statuses(http, project, 2) == [200, 429]
            server.stop()
            clock.advance(1)
            async with http.get("/v2/queues", headers=caller(project)) as response:
                # not refused by the limiter, and not a 500: the request's own 503
                assert response.status == 503
                assert "Retry-After" in response.headers
            assert "rate limiter met Redis trouble" in caplog.text
            server.start()
            clock.advance(FAIL_OPEN_MS / 1000)  # the limiter asks Redis again
            assert await statuses(http, project, 2) == [200, 429]
    finally:
        server.stop()


async def test_the_limiter_loads_its_script_again_after_a_flush(
    app_on: AppFactory, redis: Redis | RedisCluster
) -> None:
    project = new_project()
    async with app_on(project_rate=1, project_burst=2) as http:
        await redis.script_flush()
        assert await statuses(http, project, 3) == [200, 200, 429]


async def test_with_tokens_the_rate_is_the_token_projects(app_on: AppFactory) -> None:
    """A caller cannot escape its rate by naming another project."""
    tenant = new_project()
    async with app_on(project_rate=1, project_burst=2, auth_token=f"secret={tenant}") as http:
        got = []
        for spoofed in ("a", "b", "c"):
            headers = {**caller(spoofed), "Authorization": "Bearer secret"}
            async with http.get("/v2/queues", headers=headers) as response:
                got.append(response.status)
        assert got == [200, 200, 429]
        # no token: 401, not counted against anyone
        async with http.get("/v2/queues", headers=caller(tenant)) as response:
            assert response.status == 401


def _get_queues(port: int, project: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/queues", headers=caller(project))
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def _statuses_by_worker(log: Path) -> dict[int, list[int]]:
    """pid -> the statuses of GET /v2/queues in its access log lines (JSON)."""
    found: dict[int, list[int]] = {}
    for line in log.read_text().splitlines():
        if '"logger": "feedsvc.access"' not in line:
            continue
        record = json.loads(line)
        status = re.search(r'"GET /v2/queues HTTP/1.1" (\d+)', record["message"])
        if status:
            found.setdefault(int(record["pid"]), []).append(int(status.group(1)))
    return found


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_limit_holds_across_workers(redis_url: str, tmp_path: Path) -> None:
    """`--workers 2`: the two processes share the project's bucket. The rate
    is 0.1/s, so whatever the time taken, the bucket's 20 and a few more."""
    project, log = new_project(), tmp_path / "feedsvc.log"
    flags = ["--workers", "2", "--project-rate", "0.1", "--project-burst", "20"]
    flags += ["--access-log", "--log-format", "json"]
    started = time.monotonic()
    with (
        ServiceProcess("--redis-url", redis_url, *flags, log_path=log) as svc,
        ThreadPoolExecutor(8) as pool,
    ):
        # new connections, 8 at a time, until both workers have answered some
        for _ in range(10):
            list(pool.map(lambda _: _get_queues(svc.port, project), range(40)))
            if len(_statuses_by_worker(log)) == 2:
                break
    elapsed = time.monotonic() - started
    by_worker = _statuses_by_worker(log)
    assert len(by_worker) == 2, by_worker
    admitted = sum(s.count(200) for s in by_worker.values())
    refused = sum(s.count(429) for s in by_worker.values())
    # never more than the bucket gave; at most a lease (2) per worker unused
    assert 20 - 2 * 2 <= admitted <= 20 + math.ceil(0.1 * elapsed), by_worker
    assert refused > 0
