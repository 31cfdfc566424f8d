"""Per-queue gauges for autoscaling (``--metrics-queues``): the allow-listed
queues' depth, claimed messages, oldest age, dead letters and followers in
/metrics, and nothing for any other queue, however many clients invent."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import MAX_METRICS_QUEUES, Settings, metrics_queue_names, parse_settings
from feedsvc.storage.base import FeedStore
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys
from feedsvc.testing import ServiceProcess
from tests.conftest import PROCESS_DRIVERS
from tests.test_cli import run_cli
from tests.test_live_workers import read_event, shard_subscribers
from tests.test_metrics import sample

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
GAUGES = ("depth", "claimed", "oldest_age_seconds", "dead_letters", "followers")


@pytest.fixture
async def gauged(settings: Settings, clock: ManualClock, project: str) -> AsyncIterator[Client]:
    """The app with two queues of the test's project allow-listed, read on every scrape."""
    listed = f"{project}/work,{project}/idle"
    app = create_app(settings.replace(metrics_queues=listed, metrics_queue_refresh=0), clock)
    async with TestClient(TestServer(app)) as client:
        yield client


async def scrape(http: Client) -> str:
    response = await http.get("/metrics")
    assert response.status == 200
    return await response.text()


def gauge(text: str, name: str, project: str, queue: str) -> float:
    return sample(text, f"feedsvc_queue_{name}", project=project, queue=queue)


async def post(http: Client, headers: Headers, queue: str, count: int) -> None:
    body = {"messages": [{"body": n, "ttl": 600} for n in range(count)]}
    response = await http.post(f"/v2/queues/{queue}/messages", json=body, headers=headers)
    assert response.status == 201, await response.text()


async def claim(http: Client, headers: Headers, queue: str, limit: int) -> dict[str, Any]:
    response = await http.post(
        f"/v2/queues/{queue}/claims?limit={limit}", json={"ttl": 60, "grace": 60}, headers=headers
    )
    assert response.status == 201, await response.text()
    return {"href": response.headers["Location"], "messages": await response.json()}


async def test_gauges_follow_posts_claims_and_age(
    gauged: Client, headers: Headers, project: str, clock: ManualClock
) -> None:
    text = await scrape(gauged)
    for queue in ("work", "idle"):  # listed queues are reported before they exist
        for name in GAUGES:
            assert gauge(text, name, project, queue) == 0
    await post(gauged, headers, "work", 3)
    clock.advance(10)
    await post(gauged, headers, "work", 1)
    await claim(gauged, headers, "work", 2)
    clock.advance(2.5)
    text = await scrape(gauged)
    assert gauge(text, "depth", project, "work") == 4
    assert gauge(text, "claimed", project, "work") == 2
    assert gauge(text, "oldest_age_seconds", project, "work") == 12.5
    assert gauge(text, "dead_letters", project, "work") == 0
    assert gauge(text, "depth", project, "idle") == 0
    # the oldest message gone, the next one's age is reported
    popped = await gauged.delete("/v2/queues/work/messages?pop=1", headers=headers)
    assert popped.status == 200
    text = await scrape(gauged)
    assert gauge(text, "depth", project, "work") == 3
    assert gauge(text, "oldest_age_seconds", project, "work") == 12.5
    # claims expire: nothing is claimed any more, and all of it is still there
    clock.advance(61)
    text = await scrape(gauged)
    assert gauge(text, "claimed", project, "work") == 0
    assert gauge(text, "depth", project, "work") == 3


async def test_dead_letters_are_the_dead_letter_queues_depth(
    gauged: Client, headers: Headers, project: str
) -> None:
    metadata = {"_max_claim_count": 1, "_dead_letter_queue": "work.dead"}
    assert (await gauged.put("/v2/queues/work", json=metadata, headers=headers)).status == 201
    await post(gauged, headers, "work", 2)
    first = await claim(gauged, headers, "work", 2)
    assert (await gauged.delete(first["href"], headers=headers)).status == 204
    # the next claim moves both (each claimed once already) to the dead-letter queue
    response = await gauged.post("/v2/queues/work/claims", json={}, headers=headers)
    assert response.status == 204
    text = await scrape(gauged)
    assert gauge(text, "dead_letters", project, "work") == 2
    assert gauge(text, "depth", project, "work") == 0
    # the dead-letter queue itself is not listed: it is no label
    assert 'queue="work.dead"' not in text


async def followers(http: Client, project: str, queue: str, expected: float) -> float:
    """The followers gauge once it shows expected (processes report their
    followers every half second), or after 10 s, as it is then."""
    for _ in range(400):
        found = gauge(await scrape(http), "followers", project, queue)
        if found == expected:
            break
        await asyncio.sleep(0.025)
    return found


@pytest.mark.slow
async def test_followers_of_a_queue(gauged: Client, headers: Headers, project: str) -> None:
    poll = asyncio.create_task(gauged.get("/v2/queues/work/messages?wait=20", headers=headers))
    assert await followers(gauged, project, "work", 1) == 1
    assert gauge(await scrape(gauged), "followers", project, "idle") == 0
    poster = {**headers, "Client-ID": str(uuid.uuid4())}  # the poll sees others' messages
    await post(gauged, poster, "work", 1)
    response = await asyncio.wait_for(poll, 10)
    assert response.status == 200
    assert len((await response.json())["messages"]) == 1
    assert await followers(gauged, project, "work", 0) == 0


@pytest.mark.slow
async def test_every_process_reports_all_followers(
    settings: Settings, clock: ManualClock, headers: Headers, project: str
) -> None:
    """Two processes (workers, or pods) on one Redis: a scrape of either
    counts the followers of both."""
    listed = settings.replace(metrics_queues=f"{project}/work", metrics_queue_refresh=0)
    one, other = (TestClient(TestServer(create_app(listed, clock))) for _ in range(2))
    async with one, other:
        polls = [
            asyncio.create_task(http.get("/v2/queues/work/messages?wait=20", headers=headers))
            for http in (one, one, other)
        ]
        assert await followers(other, project, "work", 3) == 3
        assert gauge(await scrape(one), "followers", project, "work") == 3
        poster = {**headers, "Client-ID": str(uuid.uuid4())}
        await post(one, poster, "work", 1)
        for poll in polls:
            assert (await asyncio.wait_for(poll, 10)).status == 200
        assert await followers(one, project, "work", 0) == 0


async def test_a_silent_process_reports_lapse(
    store: FeedStore, settings: Settings, clock: ManualClock, project: str
) -> None:
    """A process that died without withdrawing its report stops counting
    once the report's ttl has passed, and its report is dropped."""
    other = make_store(settings, clock)
    await other.open()
    try:
        await store.follower_counts.report({(project, "q"): 3}, 1000)
        await other.follower_counts.report({(project, "q"): 2, (project, "r"): 1}, 5000)
        assert await store.follower_counts.count(project, "q") == 5
        clock.advance(1.001)  # the first process went silent
        assert await other.follower_counts.count(project, "q") == 2
        await other.follower_counts.report({(project, "q"): 0}, 5000)  # withdrawn
        assert await store.follower_counts.count(project, "q") == 0
        assert await store.follower_counts.count(project, "r") == 1
    finally:
        await other.close()


@pytest.mark.process
@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_any_worker_reports_the_followers_of_all(driver: str) -> None:
    """feedsvc serve --workers 2: whichever worker a scrape reaches, it
    counts the streams of both."""
    project = "gauges-" + uuid.uuid4().hex
    headers = {"X-Project-ID": project, "Accept": "text/event-stream"}
    listed = ("--metrics-queues", f"{project}/q", "--metrics-queue-refresh", "0")
    with ServiceProcess("--workers", "2", "--driver", driver, *listed) as service:
        redis = aioredis.Redis.from_url(str(service.redis_url))
        channel = QueueKeys.of(project, "q").feed
        streams: list[aiohttp.ClientResponse] = []
        async with aiohttp.ClientSession(service.url) as http:
            try:
                # open streams until both workers serve some (each subscribes once)
                for _ in range(90):  # (under aiohttp's 100 connections a session holds)
                    reader = {**headers, "Client-ID": str(uuid.uuid4())}
                    response = await http.get("/v2/queues/q/messages", headers=reader)
                    assert response.status == 200
                    streams.append(response)
                    await read_event(response)  # retry: the stream is up
                    if await shard_subscribers(redis, channel) == 2:
                        break
                assert await shard_subscribers(redis, channel) == 2
                for _ in range(400):  # up to 10 s for both workers to report
                    async with http.get("/metrics", headers={"Connection": "close"}) as got:
                        text = await got.text()
                    if gauge(text, "followers", project, "q") == len(streams):
                        break
                    await asyncio.sleep(0.025)
                # ten scrapes, each on a connection of its own: whichever worker
                # accepts it, it counts every stream
                for _ in range(10):
                    async with http.get("/metrics", headers={"Connection": "close"}) as got:
                        assert gauge(await got.text(), "followers", project, "q") == len(streams)
            finally:
                for stream in streams:
                    stream.close()
                await redis.aclose()


def queue_series(text: str) -> set[str]:
    """Every series of the feedsvc_queue_* gauges: name and labels, no value."""
    return {
        line.rpartition(" ")[0] for line in text.splitlines() if line.startswith("feedsvc_queue_")
    }


def series(text: str) -> set[str]:
    return {line.rpartition(" ")[0] for line in text.splitlines() if not line.startswith("#")}


@pytest.mark.slow
async def test_invented_queues_add_no_series(
    gauged: Client, headers: Headers, project: str
) -> None:
    """A client posting to a thousand queues of its own naming grows no
    series: only the allow-list's queues are labels."""
    await post(gauged, headers, "warm-up", 1)  # the POST route's own series
    await scrape(gauged)  # and /metrics' own
    before = await scrape(gauged)
    assert queue_series(before) == {
        f'feedsvc_queue_{name}{{project="{project}",queue="{queue}"}}'
        for name in GAUGES
        for queue in ("work", "idle")
    }
    for n in range(0, 1000, 50):
        await asyncio.gather(*(post(gauged, headers, f"invented-{i}", 1) for i in range(n, n + 50)))
    after = await scrape(gauged)
    # (the registry is the process's: series of other tests' leftover work
    # may appear meanwhile; none of them may name a queue)
    assert queue_series(after) == queue_series(before)
    assert not any("invented-" in s for s in series(after) - series(before))
    assert "invented-" not in after


async def test_a_scrape_within_the_refresh_reads_nothing_from_redis(
    settings: Settings, clock: ManualClock, project: str, headers: Headers
) -> None:
    """Scrapes within --metrics-queue-refresh reuse the last reading: however
    often /metrics is asked, Redis is read once per refresh."""
    listed = ",".join(f"{project}/q{i}" for i in range(MAX_METRICS_QUEUES))
    app = create_app(settings.replace(metrics_queues=listed, metrics_queue_refresh=5), clock)
    async with TestClient(TestServer(app)) as http:
        await post(http, headers, "q7", 2)
        first = await scrape(http)
        assert gauge(first, "depth", project, "q7") == 2
        await post(http, headers, "q7", 1)
        calls = sample(await scrape(http), "feedsvc_redis_calls_total")
        for _ in range(5):
            again = await scrape(http)
        assert sample(again, "feedsvc_redis_calls_total") == calls
        assert gauge(again, "depth", project, "q7") == 2  # the reading of the first scrape
        clock.advance(5)
        assert gauge(await scrape(http), "depth", project, "q7") == 3


async def test_without_redis_the_queue_gauges_are_left_out(
    settings: Settings, clock: ManualClock, project: str
) -> None:
    """Redis unreachable: /metrics still answers, without queue gauges
    (rather than stale ones)."""
    unreachable = settings.replace(
        redis_url="redis://127.0.0.1:1", metrics_queues=f"{project}/work", metrics_queue_refresh=0
    )
    async with TestClient(TestServer(create_app(unreachable, clock))) as http:
        text = await scrape(http)
    assert "feedsvc_queue_" not in text
    assert sample(text, "feedsvc_pool_size") == 32


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("work", "--metrics-queues must be PROJECT/QUEUE[,PROJECT/QUEUE...], got 'work'"),
        ("p/", "--metrics-queues must be PROJECT/QUEUE[,PROJECT/QUEUE...], got 'p/'"),
        ("p/a b", "--metrics-queues must be PROJECT/QUEUE[,PROJECT/QUEUE...], got 'p/a b'"),
        ("/q", "--metrics-queues must be PROJECT/QUEUE[,PROJECT/QUEUE...], got '/q'"),
        (
            ",".join(f"p/q{i}" for i in range(MAX_METRICS_QUEUES + 1)),
            f"--metrics-queues names at most {MAX_METRICS_QUEUES} queues, got 101",
        ),
    ],
)
def test_bad_allow_lists_are_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_settings(["--metrics-queues", value], {})


def test_allow_list_and_refresh_settings() -> None:
    settings = parse_settings(
        ["--metrics-queue-refresh", "0"], {"FEEDSVC_METRICS_QUEUES": "a/b/q1, c/q2,c/q2"}
    )
    assert settings.metrics_queue_refresh == 0
    assert metrics_queue_names(settings.metrics_queues) == [("a/b", "q1"), ("c", "q2")]
    with pytest.raises(ValueError, match="--metrics-queue-refresh must be <= 300"):
        parse_settings(["--metrics-queue-refresh", "301"], {})


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--metrics-queues", "orders"], {}, "--metrics-queues must be PROJECT/QUEUE"),
        ([], {"FEEDSVC_METRICS_QUEUE_REFRESH": "-1"}, "--metrics-queue-refresh must be >= 0"),
    ],
)
def test_bad_gauge_setting_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    result = run_cli("serve", *args, env=env)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
