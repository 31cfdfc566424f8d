"""Quotas: a queue's _max_messages, a project's max_messages and max_queues.

Over a quota a post is refused whole with 403 and a title naming the quota,
and nothing of it is stored; whatever takes a message away (delete, pop,
expiry, dead-lettering, purge, queue delete) gives its room back. Run for
every driver, on one server and on the Redis Cluster (CLUSTER_SUITES).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.config import STORAGE_LAYOUTS, Settings
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.errors import ProjectMessagesFull
from feedsvc.storage.base import NewMessage
from feedsvc.storage.drivers import make_store
from feedsvc.storage.quotas import HOLD_MS
from feedsvc.storage.redis_store import RedisStore
from feedsvc.testing import ServiceProcess
from feedsvc.testing.sentinel import LocalSentinel
from tests.conftest import make_settings

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]


def batch(n: int, ttl: int = 300) -> dict[str, Any]:
    return {"messages": [{"body": {"n": i}, "ttl": ttl} for i in range(n)]}


async def live(http: Client, headers: Headers, queue: str) -> int:
    resp = await http.get(f"/v2/queues/{queue}/stats", headers=headers)
    assert resp.status == 200
    total: int = (await resp.json())["messages"]["total"]
    return total


async def capped(http: Client, headers: Headers, queue: str, most: int) -> None:
    resp = await http.put(f"/v2/queues/{queue}", headers=headers, json={"_max_messages": most})
    assert resp.status == 201


async def test_a_post_over_the_queue_cap_is_403_and_stores_nothing(
    http: Client, headers: Headers
) -> None:
    await capped(http, headers, "q", 5)
    assert (await http.post("/v2/queues/q/messages", headers=headers, json=batch(3))).status == 201
    resp = await http.post("/v2/queues/q/messages", headers=headers, json=batch(3))
    assert resp.status == 403
    error = await resp.json()
    assert error["title"] == "Quota exceeded: _max_messages"
    assert "5" in error["description"]
    assert await live(http, headers, "q") == 3
    # what fits still goes in, up to the cap exactly
    assert (await http.post("/v2/queues/q/messages", headers=headers, json=batch(2))).status == 201
    assert await live(http, headers, "q") == 5
    resp = await http.post("/v2/queues/q/messages", headers=headers, json=batch(1))
    assert resp.status == 403


async def test_concurrent_posts_at_the_queue_cap_admit_exactly_the_cap(
    http: Client, headers: Headers
) -> None:
    await capped(http, headers, "q", 10)
    posts = [http.post("/v2/queues/q/messages", headers=headers, json=batch(1)) for _ in range(40)]
    statuses = sorted(resp.status for resp in await asyncio.gather(*posts))
    assert statuses == [201] * 10 + [403] * 30
    assert await live(http, headers, "q") == 10


async def test_delete_pop_and_expiry_give_the_queue_its_room_back(
    http: Client, headers: Headers, clock: ManualClock
) -> None:
    await capped(http, headers, "q", 3)
    resp = await http.post("/v2/queues/q/messages", headers=headers, json=batch(2, ttl=60))
    first = [href.rpartition("/")[2] for href in (await resp.json())["resources"]]
    resp = await http.post("/v2/queues/q/messages", headers=headers, json=batch(1, ttl=600))
    assert resp.status == 201
    full = await http.post("/v2/queues/q/messages", headers=headers, json=batch(1))
    assert full.status == 403
    # delete one
    resp = await http.delete(f"/v2/queues/q/messages/{first[0]}", headers=headers)
    assert resp.status == 204
    assert (await http.post("/v2/queues/q/messages", headers=headers, json=batch(1))).status == 201
    # pop one
    resp = await http.delete("/v2/queues/q/messages?pop=1", headers=headers)
    assert resp.status == 200
    resp = await http.post("/v2/queues/q/messages", headers=headers, json=batch(1, ttl=60))
    assert resp.status == 201
    assert (await http.post("/v2/queues/q/messages", headers=headers, json=batch(1))).status == 403
    # expiry, before any garbage collection ran: the ttl=60 one is not counted
    clock.advance(61)
    assert await live(http, headers, "q") == 2
    assert (await http.post("/v2/queues/q/messages", headers=headers, json=batch(1))).status == 201
    # purge gives all of it back
    assert (await http.post("/v2/queues/q/purge", headers=headers)).status == 204
    assert (await http.post("/v2/queues/q/messages", headers=headers, json=batch(3))).status == 201


async def test_dead_lettering_gives_the_queue_its_room_back(http: Client, headers: Headers) -> None:
    """A move to the dead-letter queue frees the room (and is never refused:
    the dead-letter queue takes it whatever its own cap)."""
    metadata = {"_max_messages": 1, "_max_claim_count": 1, "_dead_letter_queue": "dlq"}
    assert (await http.put("/v2/queues/work", headers=headers, json=metadata)).status == 201
    await capped(http, headers, "dlq", 1)
    assert (
        await http.post("/v2/queues/dlq/messages", headers=headers, json=batch(1))
    ).status == 201
    resp = await http.post("/v2/queues/work/messages", headers=headers, json=batch(1))
    assert resp.status == 201
    assert (
        await http.post("/v2/queues/work/messages", headers=headers, json=batch(1))
    ).status == 403
    claims = "/v2/queues/work/claims"
    resp = await http.post(claims, headers=headers, json={"ttl": 60, "grace": 60})
    assert resp.status == 201
    claim_href = resp.headers["Location"]
    assert (await http.delete(claim_href, headers=headers)).status == 204
    # claimed once already: this claim moves it to dlq and finds nothing else
    resp = await http.post(claims, headers=headers, json={"ttl": 60, "grace": 60})
    assert resp.status == 204
    assert await live(http, headers, "dlq") == 2
    assert (
        await http.post("/v2/queues/work/messages", headers=headers, json=batch(1))
    ).status == 201


async def test_max_messages_is_bounded(http: Client, headers: Headers) -> None:
    for bad in (0, -1, 10**12, "5", True):
        resp = await http.put("/v2/queues/q", headers=headers, json={"_max_messages": bad})
        assert resp.status == 400, (bad, resp.status)
    resp = await http.get("/v2/queues", headers=headers)
    assert (await resp.json())["queues"] == []


@pytest.fixture
async def quota_http(
    redis_url: str, driver: str, storage_layout: str, clock: ManualClock
) -> AsyncIterator[Client]:
    """The API with project quotas: 10 live messages, 3 queues and topics
    (and the admin API, to read the usage)."""
    settings = make_settings(
        redis_url,
        driver=driver,
        storage_layout=storage_layout,
        project_max_messages=10,
        project_max_queues=3,
        admin_token=ADMIN_TOKEN,
    )
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


async def test_a_post_over_the_project_quota_is_403_and_stores_nothing(
    quota_http: Client, headers: Headers
) -> None:
    http = quota_http
    assert (await http.post("/v2/queues/a/messages", headers=headers, json=batch(6))).status == 201
    assert (await http.post("/v2/topics/t/messages", headers=headers, json=batch(3))).status == 201
    resp = await http.post("/v2/queues/b/messages", headers=headers, json=batch(2))
    assert resp.status == 403
    assert (await resp.json())["title"] == "Quota exceeded: max_messages"
    assert await live(http, headers, "b") == 0
    assert (await http.post("/v2/queues/b/messages", headers=headers, json=batch(1))).status == 201
    assert (await http.post("/v2/queues/a/messages", headers=headers, json=batch(1))).status == 403
    # another project has its own room
    other = {**headers, "X-Project-ID": headers["X-Project-ID"] + "-other"}
    assert (await http.post("/v2/queues/a/messages", headers=other, json=batch(10))).status == 201


async def test_concurrent_posts_at_the_project_quota(
    quota_http: Client, headers: Headers, topology: str
) -> None:
    """Exactly the quota on one server; on a cluster within the posts in
    flight of it (docs/design.md: Quotas), and exact once they are done."""
    http = quota_http
    in_flight = 20
    posts = [
        http.post(f"/v2/queues/q{i % 3}/messages", headers=headers, json=batch(1))
        for i in range(in_flight)
    ]
    statuses = [resp.status for resp in await asyncio.gather(*posts)]
    accepted = statuses.count(201)
    assert statuses.count(403) == in_flight - accepted
    stored = sum([await live(http, headers, f"q{i}") for i in range(3)])
    assert stored == accepted
    if topology == "single":
        assert accepted == 10
    else:
        # over by at most the posts in flight; or under by as many (a post
        # indexed but not yet let go of is counted twice meanwhile): once
        # they are done the room is exact, one post at a time fills it
        assert accepted <= 10 + in_flight - 1
        for i in range(10 - accepted):
            resp = await http.post(f"/v2/queues/q{i % 3}/messages", headers=headers, json=batch(1))
            assert resp.status == 201
    # full now, whatever the overshoot: nothing more gets in
    again = [
        http.post(f"/v2/queues/q{i % 3}/messages", headers=headers, json=batch(1))
        for i in range(in_flight)
    ]
    assert {resp.status for resp in await asyncio.gather(*again)} == {403}


@pytest.mark.parametrize("storage_layout", STORAGE_LAYOUTS, indirect=True)
async def test_everything_that_takes_messages_away_gives_the_project_room_back(
    quota_http: Client, headers: Headers, clock: ManualClock
) -> None:
    """At once, in either layout: an expired segment message holds no room
    though its segment's review (the sweep) is up to a minute away."""
    http = quota_http

    async def fits(n: int) -> bool:
        resp = await http.post("/v2/queues/a/messages", headers=headers, json=batch(n, ttl=60))
        assert resp.status in (201, 403)
        return resp.status == 201

    assert await fits(4)
    resp = await http.post("/v2/queues/b/messages", headers=headers, json=batch(6))
    ids = [href.rpartition("/")[2] for href in (await resp.json())["resources"]]
    assert not await fits(1)
    assert (await http.delete(f"/v2/queues/b/messages/{ids[0]}", headers=headers)).status == 204
    assert await fits(1) and not await fits(1)
    assert (await http.delete("/v2/queues/b/messages?pop=2", headers=headers)).status == 200
    assert await fits(2) and not await fits(1)
    clock.advance(61)  # the 7 in a expire; nothing collected them yet
    assert await project_usage(http, headers) == 3
    assert await fits(7) and not await fits(1)
    assert (await http.post("/v2/queues/b/purge", headers=headers)).status == 204
    assert await fits(3) and not await fits(1)
    assert (await http.delete("/v2/queues/a", headers=headers)).status == 204
    assert await fits(10) and not await fits(1)


async def test_a_retried_post_at_a_full_project_gets_its_first_answer(
    quota_http: Client, headers: Headers
) -> None:
    """The retry of a stored post (same Idempotency-Key) is answered as the
    first was, not 403: its messages are the ones filling the project."""
    keyed = {**headers, "Idempotency-Key": "order-42"}
    first = await quota_http.post("/v2/queues/a/messages", headers=keyed, json=batch(10))
    assert first.status == 201
    again = await quota_http.post("/v2/queues/a/messages", headers=keyed, json=batch(10))
    assert again.status == 201
    assert (await again.json()) == (await first.json())
    assert await live(quota_http, headers, "a") == 10
    other = {**headers, "Idempotency-Key": "order-43"}
    assert (
        await quota_http.post("/v2/queues/a/messages", headers=other, json=batch(1))
    ).status == 403


async def test_project_queue_quota(quota_http: Client, headers: Headers) -> None:
    http = quota_http
    assert (await http.put("/v2/queues/a", headers=headers)).status == 201
    assert (await http.put("/v2/topics/t", headers=headers)).status == 201
    assert (await http.post("/v2/queues/b/messages", headers=headers, json=batch(1))).status == 201
    resp = await http.put("/v2/queues/c", headers=headers)
    assert resp.status == 403
    assert (await resp.json())["title"] == "Quota exceeded: max_queues"
    resp = await http.post("/v2/queues/c/messages", headers=headers, json=batch(1))
    assert resp.status == 403
    names = (await (await http.get("/v2/queues", headers=headers)).json())["queues"]
    assert [q["name"] for q in names] == ["a", "b"]
    # an existing queue takes posts and PUTs as before
    assert (await http.put("/v2/queues/a", headers=headers)).status == 204
    assert (await http.post("/v2/queues/a/messages", headers=headers, json=batch(1))).status == 201
    assert (await http.delete("/v2/topics/t", headers=headers)).status == 204
    assert (await http.put("/v2/queues/c", headers=headers)).status == 201


async def test_dead_lettering_makes_no_queue_over_the_queue_quota(
    quota_http: Client, headers: Headers
) -> None:
    """A dead-letter queue that does not exist yet is a new queue: over
    max_queues the move does not happen and the message stays in its queue."""
    http = quota_http
    for name in ("a", "b"):
        assert (await http.put(f"/v2/queues/{name}", headers=headers)).status == 201
    metadata = {"_max_claim_count": 1, "_dead_letter_queue": "dlq"}
    assert (await http.put("/v2/queues/work", headers=headers, json=metadata)).status == 201
    assert (
        await http.post("/v2/queues/work/messages", headers=headers, json=batch(1))
    ).status == 201
    for _ in range(2):
        resp = await http.post("/v2/queues/work/claims", headers=headers, json={"ttl": 60})
        if resp.status == 201:
            assert (await http.delete(resp.headers["Location"], headers=headers)).status == 204
    names = (await (await http.get("/v2/queues", headers=headers)).json())["queues"]
    assert [q["name"] for q in names] == ["a", "b", "work"]
    assert await live(http, headers, "work") == 1


async def test_concurrent_creates_at_the_queue_quota_admit_exactly_the_quota(
    quota_http: Client, headers: Headers
) -> None:
    """The registries live in the project's slot: exact on a cluster too."""
    creates = [quota_http.put(f"/v2/queues/n{i}", headers=headers) for i in range(12)]
    statuses = sorted(resp.status for resp in await asyncio.gather(*creates))
    assert statuses == [201] * 3 + [403] * 9


ADMIN_TOKEN = "admin-" + "x" * 20


@pytest.fixture
async def admin_http(redis_url: str, driver: str, clock: ManualClock) -> AsyncIterator[Client]:
    """The API with an admin token and no quota by default."""
    settings = make_settings(redis_url, driver=driver, admin_token=ADMIN_TOKEN)
    async with TestClient(TestServer(create_app(settings, clock))) as client:
        yield client


def as_admin(token: str = ADMIN_TOKEN) -> Headers:
    return {"Authorization": f"Bearer {token}"}


async def project_usage(http: Client, headers: Headers) -> int:
    """The project's live messages as the admin API's usage counts them."""
    resp = await http.get(f"/v2/admin/projects/{headers['X-Project-ID']}/usage", headers=as_admin())
    assert resp.status == 200
    messages: int = (await resp.json())["messages"]
    return messages


async def test_the_admin_sets_reads_and_resets_a_project_quota(
    admin_http: Client, headers: Headers
) -> None:
    http, project = admin_http, headers["X-Project-ID"]
    limits = f"/v2/admin/projects/{project}/limits"
    assert (await http.post("/v2/queues/a/messages", headers=headers, json=batch(3))).status == 201
    resp = await http.put(limits, headers=as_admin(), json={"max_messages": 4, "rate": 2.5})
    assert resp.status == 200
    document = await resp.json()
    assert document["limits"] == {"max_messages": 4, "max_queues": None, "rate": 2.5, "burst": None}
    assert document["effective"] == {"max_messages": 4, "max_queues": 0}
    assert (await (await http.get(limits, headers=as_admin())).json()) == document
    assert (await http.post("/v2/queues/b/messages", headers=headers, json=batch(2))).status == 403
    assert (await http.post("/v2/topics/t/messages", headers=headers, json=batch(1))).status == 201
    resp = await http.get(f"/v2/admin/projects/{project}/usage", headers=as_admin())
    assert resp.status == 200
    usage = await resp.json()
    assert (usage["messages"], usage["queues"], usage["topics"]) == (4, 1, 1)
    assert usage["in_flight"] == 0
    assert usage["limits"]["max_messages"] == 4
    # null puts one limit back to the default; DELETE all of them
    resp = await http.put(limits, headers=as_admin(), json={"max_messages": None})
    assert (await resp.json())["limits"]["rate"] == 2.5
    assert (await http.post("/v2/queues/b/messages", headers=headers, json=batch(2))).status == 201
    await http.put(limits, headers=as_admin(), json={"max_queues": 2})
    resp = await http.put("/v2/queues/c", headers=headers)
    assert (resp.status, (await resp.json())["title"]) == (403, "Quota exceeded: max_queues")
    assert (await http.delete(limits, headers=as_admin())).status == 204
    assert (await (await http.get(limits, headers=as_admin())).json())["limits"]["rate"] is None
    assert (await http.put("/v2/queues/c", headers=headers)).status == 201


async def test_only_the_admin_reaches_the_admin_api(admin_http: Client, headers: Headers) -> None:
    http, project = admin_http, headers["X-Project-ID"]
    routes = [
        ("GET", "limits", None),
        ("PUT", "limits", {"max_messages": 1}),
        ("DELETE", "limits", None),
        ("GET", "usage", None),
    ]
    callers: list[Headers] = [headers, {**headers, **as_admin("admin-" + "y" * 20)}]
    callers.append({"Authorization": "Basic " + ADMIN_TOKEN})
    for method, path, body in routes:
        for caller in callers:
            url = f"/v2/admin/projects/{project}/{path}"
            resp = await http.request(method, url, headers=caller, json=body)
            assert resp.status == 403, (method, path, caller)
            assert set(await resp.json()) == {"title", "description"}
    resp = await http.get(f"/v2/admin/projects/{project}/limits", headers=as_admin())
    assert (await resp.json())["limits"]["max_messages"] is None


async def test_without_an_admin_token_there_is_no_admin_api(http: Client, headers: Headers) -> None:
    resp = await http.get("/v2/admin/projects/p/limits", headers=as_admin())
    assert resp.status == 404


@pytest.mark.parametrize(
    "body",
    [
        {"max_messages": -1},
        {"max_messages": 10**10},
        {"max_messages": "5"},
        {"max_queues": 1.5},
        {"rate": 0},
        {"rate": 0.0005},  # the rate limiter reads no override below 0.001
        {"rate": True},
        {"burst": 0},
        {"colour": 1},
        {},
        [],
    ],
)
async def test_bad_limits_are_400_and_change_nothing(
    admin_http: Client, headers: Headers, body: Any
) -> None:
    limits = f"/v2/admin/projects/{headers['X-Project-ID']}/limits"
    await admin_http.put(limits, headers=as_admin(), json={"max_messages": 7})
    resp = await admin_http.put(limits, headers=as_admin(), json=body)
    assert resp.status == 400
    assert set(await resp.json()) == {"title", "description"}
    document = await (await admin_http.get(limits, headers=as_admin())).json()
    assert document["limits"]["max_messages"] == 7


def test_the_admin_token_comes_from_a_flag_or_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    assert Settings(admin_token_file=token_file).admin_secret() == ADMIN_TOKEN
    assert Settings(admin_token=ADMIN_TOKEN).admin_secret() == ADMIN_TOKEN
    assert Settings().admin_secret() is None
    with pytest.raises(ValueError, match="not both"):
        Settings(admin_token=ADMIN_TOKEN, admin_token_file=token_file)
    with pytest.raises(ValueError, match="16 characters"):
        Settings(admin_token="short")
    with pytest.raises(ValueError, match="cannot read"):
        Settings(admin_token_file=tmp_path / "missing")
    for flag in ("project_max_messages", "project_max_queues"):
        for bad in (-1, 10**9 + 1):
            with pytest.raises(ValueError):
                Settings().replace(**{flag: bad})


@pytest.mark.process  # feedsvc serve
async def test_a_served_process_keeps_the_quotas_and_its_admin_token_file(
    redis_server: RedisServer, driver: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    args = ["--redis-url", redis_server.url, "--driver", driver, "--project-max-queues", "1"]
    args += ["--admin-token-file", str(token_file)]
    env = {"FEEDSVC_PROJECT_MAX_MESSAGES": "2"}
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "p-" + uuid.uuid4().hex}
    with ServiceProcess(*args, env=env) as svc:
        async with aiohttp.ClientSession(svc.url) as http:
            resp = await http.post("/v2/queues/a/messages", headers=headers, json=batch(3))
            assert (resp.status, (await resp.json())["title"]) == (
                403,
                "Quota exceeded: max_messages",
            )
            resp = await http.post("/v2/queues/a/messages", headers=headers, json=batch(2))
            assert resp.status == 201
            resp = await http.put("/v2/queues/b", headers=headers)
            assert (resp.status, (await resp.json())["title"]) == (
                403,
                "Quota exceeded: max_queues",
            )
            usage = f"/v2/admin/projects/{headers['X-Project-ID']}/usage"
            assert (await http.get(usage, headers=headers)).status == 403
            resp = await http.get(usage, headers=as_admin())
            document = await resp.json()
            assert (document["messages"], document["queues"]) == (2, 1)
            assert document["limits"] == {"max_messages": 2, "max_queues": 1}


@pytest.mark.process  # a master, a replica and a sentinel of its own
async def test_concurrent_posts_on_sentinel_admit_exactly_the_project_quota(
    driver: str, tmp_path: Path
) -> None:
    """Sentinel hands out one server: the count is exact there as well."""
    setup = LocalSentinel(tmp_path)
    try:
        setup.start()
        settings = make_settings(setup.url, driver=driver, project_max_messages=10)
        headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "p-" + uuid.uuid4().hex}
        async with TestClient(TestServer(create_app(settings))) as http:
            posts = [
                http.post(f"/v2/queues/q{i % 3}/messages", headers=headers, json=batch(1))
                for i in range(20)
            ]
            statuses = sorted(resp.status for resp in await asyncio.gather(*posts))
            assert statuses == [201] * 10 + [403] * 10
            assert sum([await live(http, headers, f"q{i}") for i in range(3)]) == 10
    finally:
        setup.stop()


async def test_the_hold_of_a_post_that_never_came_lapses(
    redis_url: str, driver: str, clock: ManualClock, project: str
) -> None:
    """A process that dies between admission and its post leaks the post's
    room for HOLD_MS at most (the clock moves instead of sleeping)."""
    settings = make_settings(redis_url, driver=driver, project_max_messages=3)
    store = make_store(settings, clock)
    await store.open()
    try:
        assert isinstance(store, RedisStore)
        assert await store.quotas.admit(project, "queue", "q", 2) is not None  # and no post
        with pytest.raises(ProjectMessagesFull):
            await store.post_messages(project, "q", str(uuid.uuid4()), [NewMessage(b"1")] * 2)
        assert (await store.quotas.usage(project))["in_flight"] == 2
        clock.advance(HOLD_MS / 1000 + 1)
        assert (await store.quotas.usage(project))["in_flight"] == 0
        await store.post_messages(project, "q", str(uuid.uuid4()), [NewMessage(b"1")] * 3)
    finally:
        await store.close()
