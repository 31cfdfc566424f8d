"""Isolation: another project (or another queue) reaches nothing and changes nothing.

Every route is tried with a victim's queue names, message ids, claim ids and
markers. Besides the HTTP answers, Redis itself is compared before and after:
every key that is not the intruder's own keeps its exact value (DUMP) and
expiry (PEXPIRETIME). The tests run against a Redis server of this module's
own, so nothing else writes to it meanwhile.

Names and ids can never form another key: bad queue names, ids and markers
are refused before storage is touched, and project ids with ``{ } : / %``
stay apart (feedsvc.storage.keys escapes them).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.storage.keys import KINDS, SWEEP_KEY, QueueKeys, escape_project
from feedsvc.storage.reviews import parse_member
from tests.conftest import PROCESS_DRIVERS, make_settings

pytestmark = pytest.mark.process  # a redis-server of its own

Client = TestClient[web.Request, web.Application]
Headers = dict[str, str]
Snapshot = dict[bytes, tuple[bytes | None, int]]
SHARED = "shared.q"
UNKNOWN_ID = "0" * 24


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("isolation"), appendfsync="no")
    assert server.port != 6379
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=PROCESS_DRIVERS)
async def http(request: pytest.FixtureRequest, own_server: RedisServer) -> AsyncIterator[Client]:
    settings = make_settings(own_server.url, driver=request.param)
    async with TestClient(TestServer(create_app(settings))) as client:
        yield client


@pytest.fixture
async def redis(own_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(own_server.url)
    yield client
    await client.aclose()


def caller(project: str) -> Headers:
    return {"Client-ID": str(uuid.uuid4()), "X-Project-ID": project}


def hash_tag(key: bytes) -> bytes:
    """What Redis Cluster hashes: the text between the first '{' and the next '}'."""
    start = key.find(b"{")
    end = key.find(b"}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


def owned_by(key: bytes, project: str, queue: str | None = None) -> bool:
    """Is key one of project's keys (of queue, if given; the registry goes with any queue)?"""
    tag = hash_tag(key).decode()
    escaped = escape_project(project)
    if tag == escaped:
        return True
    if queue is None:
        return tag.startswith(escaped + "/")
    return tag == f"{escaped}/{queue}"


async def snapshot(redis: aioredis.Redis, keep: Any = None) -> Snapshot:
    """Every key (for which keep(key) is true) -> (DUMP, PEXPIRETIME). The
    segment sweep's schedule (fs:sweep) is shared by every queue, one member
    each: a member is one entry, kept as its queue's own keys are."""
    out: Snapshot = {}
    async for key in redis.scan_iter(count=1000):
        if key == SWEEP_KEY.encode():
            entries: list[Any] = await redis.zrange(key, 0, -1, withscores=True)
            for member, when in entries:
                kind, project, queue = parse_member(member)
                if keep is None or keep(QueueKeys.of(project, queue, kind).meta.encode()):
                    out[key + b" " + member] = (repr(when).encode(), -1)
            continue
        if keep is not None and not keep(key):
            continue
        expires: int = await redis.execute_command("PEXPIRETIME", key)  # type: ignore[no-untyped-call]
        out[key] = (await redis.dump(key), expires)
    return out


def diff(before: Snapshot, after: Snapshot) -> list[str]:
    changes = [f"gone: {k!r}" for k in before if k not in after]
    changes += [f"new: {k!r}" for k in after if k not in before]
    changes += [f"changed: {k!r}" for k in before if k in after and before[k] != after[k]]
    return changes


async def status_of(http: Client, method: str, path: str, headers: Headers, **kw: Any) -> int:
    resp = await http.request(method, path, headers=headers, **kw)
    await resp.read()
    return resp.status


async def json_of(
    http: Client, method: str, path: str, headers: Headers, status: int, **kw: Any
) -> Any:
    resp = await http.request(method, path, headers=headers, **kw)
    assert resp.status == status, (method, path, await resp.text())
    return await resp.json()


class Victim:
    """A project with two queues, messages, a live claim and metadata."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.headers = caller(project)
        self.ids: list[str] = []
        self.claim_id = ""
        self.claimed: list[str] = []
        self.marker = ""

    async def build(self, http: Client) -> None:
        h = self.headers
        meta = {"owner": self.project, "_default_message_ttl": 1200}
        assert await status_of(http, "PUT", f"/v2/queues/{SHARED}", h, json=meta) == 201
        for queue in (SHARED, "victim-only.q"):
            doc = await json_of(
                http,
                "POST",
                f"/v2/queues/{queue}/messages",
                h,
                201,
                json={"messages": [{"body": {"n": n, "of": self.project}} for n in range(6)]},
            )
            if queue == SHARED:
                self.ids = [href.rsplit("/", 1)[1] for href in doc["resources"]]
        doc = await json_of(
            http, "POST", f"/v2/queues/{SHARED}/claims?limit=2", h, 201, json={"ttl": 300}
        )
        self.claimed = [m["id"] for m in doc["messages"]]
        self.claim_id = re.findall(r"claim_id=([0-9a-f]+)", doc["messages"][0]["href"])[0]
        page = await json_of(http, "GET", f"/v2/queues/{SHARED}/messages?limit=2&echo=true", h, 200)
        self.marker = re.findall(r"marker=(\d+)", page["links"][0]["href"])[0]

    async def check_unchanged(self, http: Client) -> None:
        """The victim's own view, through the API."""
        h = self.headers
        page = await json_of(
            http,
            "GET",
            f"/v2/queues/{SHARED}/messages?echo=true&include_claimed=true&limit=20",
            h,
            200,
        )
        assert [m["id"] for m in page["messages"]] == self.ids
        claim = await json_of(http, "GET", f"/v2/queues/{SHARED}/claims/{self.claim_id}", h, 200)
        assert [m["id"] for m in claim["messages"]] == self.claimed
        meta = await json_of(http, "GET", f"/v2/queues/{SHARED}", h, 200)
        assert meta["owner"] == self.project
        assert meta["_default_message_ttl"] == 1200
        names = await json_of(http, "GET", "/v2/queues", h, 200)
        assert [q["name"] for q in names["queues"]] == [SHARED, "victim-only.q"]


async def intrude(http: Client, victim: Victim, h: Headers, queue: str) -> None:
    """Every route, from `h`, on `queue`, with the victim's ids, claim and marker."""
    q = f"/v2/queues/{queue}"
    m = f"{q}/messages"
    some = victim.ids[0]
    claimed = victim.claimed[0]
    ids = ",".join(victim.ids)

    # reads find nothing of the victim's
    listing = await json_of(http, "GET", f"{m}?echo=true&include_claimed=true", h, 200)
    assert listing == {"messages": [], "links": []}
    after_marker = await json_of(
        http, "GET", f"{m}?marker={victim.marker}&echo=true&include_claimed=true", h, 200
    )
    assert after_marker == {"messages": [], "links": []}
    assert await status_of(http, "GET", f"{m}?ids={ids}", h) == 404
    for message_id in (some, claimed):
        assert await status_of(http, "GET", f"{m}/{message_id}", h) == 404
    assert await status_of(http, "GET", f"{q}/claims/{victim.claim_id}", h) == 404
    stats = await json_of(http, "GET", f"{q}/stats", h, 200)
    assert stats["messages"] == {"claimed": 0, "free": 0, "total": 0}
    meta = await json_of(http, "GET", q, h, 200)
    assert "owner" not in meta
    # writes with the victim's ids touch nothing of the victim's
    assert await status_of(http, "DELETE", f"{m}/{some}", h) == 204
    assert await status_of(http, "DELETE", f"{m}/{claimed}?claim_id={victim.claim_id}", h) == 204
    assert await status_of(http, "DELETE", f"{m}?ids={ids}", h) == 204
    assert await json_of(http, "DELETE", f"{m}?pop=20", h, 200) == {"messages": []}
    assert await status_of(http, "POST", f"{q}/claims?limit=20", h, json={"ttl": 60}) == 204
    claim = f"{q}/claims/{victim.claim_id}"
    assert await status_of(http, "PATCH", claim, h, json={"ttl": 120}) == 404
    assert await status_of(http, "DELETE", claim, h) == 204
    assert await status_of(http, "POST", f"{q}/purge", h) == 204
    patch = [{"op": "add", "path": "/metadata/owner", "value": "intruder"}]
    json_patch = {"Content-Type": "application/openstack-messaging-v2.0-json-patch"}
    assert await status_of(http, "PATCH", q, {**h, **json_patch}, json=patch) == 404
    assert await status_of(http, "DELETE", q, h) == 204
    # the intruder's own queue of the same name is its own
    assert await status_of(http, "PUT", q, h, json={"owner": "intruder"}) == 201
    assert await status_of(http, "PATCH", q, {**h, **json_patch}, json=patch) == 200
    posted = await json_of(http, "POST", m, h, 201, json={"messages": [{"body": "mine"}]})
    mine = posted["resources"][0].rsplit("/", 1)[1]
    assert mine not in victim.ids
    listing = await json_of(http, "GET", f"{m}?echo=true", h, 200)
    assert [x["body"] for x in listing["messages"]] == ["mine"]
    assert await status_of(http, "POST", f"{q}/claims", h, json={"ttl": 60}) == 201
    assert await status_of(http, "DELETE", f"{m}?pop=5", h) == 200
    assert await status_of(http, "POST", f"{q}/purge", h) == 204
    assert await status_of(http, "DELETE", q, h) == 204


async def test_another_project_reaches_nothing(http: Client, redis: aioredis.Redis) -> None:
    tag = uuid.uuid4().hex
    victim = Victim(f"victim-{tag}")
    await victim.build(http)
    intruder = f"intruder-{tag}"
    h = caller(intruder)

    def not_intruders(key: bytes) -> bool:
        return not owned_by(key, intruder)

    before = await snapshot(redis, not_intruders)
    assert any(owned_by(k, victim.project) for k in before)
    for queue in (SHARED, "victim-only.q"):
        await intrude(http, victim, h, queue)
    # the project-wide routes
    assert await json_of(http, "GET", "/v2/queues?with_count=true", h, 200) == {
        "queues": [],
        "links": [],
        "count": 0,
    }
    listed = await json_of(http, "GET", f"/v2/queues?marker={SHARED[:-1]}&detailed=true", h, 200)
    assert listed["queues"] == []
    assert diff(before, await snapshot(redis, not_intruders)) == []
    await victim.check_unchanged(http)


async def test_another_queue_of_the_same_project_reaches_nothing(
    http: Client, redis: aioredis.Redis
) -> None:
    victim = Victim(f"victim-{uuid.uuid4().hex}")
    await victim.build(http)
    other = "other.q"
    registry = f"fs:p:{{{escape_project(victim.project)}}}:queues".encode()

    def not_the_other_queue(key: bytes) -> bool:
        return key != registry and not owned_by(key, victim.project, other)

    before = await snapshot(redis, not_the_other_queue)
    await intrude(http, victim, caller(victim.project), other)
    assert diff(before, await snapshot(redis, not_the_other_queue)) == []
    await victim.check_unchanged(http)


TRICKY_PROJECTS = [
    "a",
    "b",
    "a}b",
    "{x}",
    "{",
    "}",
    "a:b",
    "a/b",
    "a/b/c",
    "a%7Db",  # what "a}b" escapes to
    "a%2Fb",  # what "a/b" escapes to
    "a%",
    "%25",
    "x}:m:y",
    "p}:queues",
    "a b",
    "ü{ß}",
    "*",
    "?",
    "[ab]",
    "\\",
]


async def test_tricky_project_ids_stay_apart(http: Client, redis: aioredis.Redis) -> None:
    tag = uuid.uuid4().hex[:8]
    projects = [f"{p}-{tag}" for p in TRICKY_PROJECTS] + [f"{tag}-{p}" for p in TRICKY_PROJECTS]
    posted: dict[str, str] = {}
    for project in projects:
        doc = await json_of(
            http,
            "POST",
            "/v2/queues/q/messages",
            caller(project),
            201,
            json={"messages": [{"body": {"project": project}}]},
        )
        posted[project] = doc["resources"][0].rsplit("/", 1)[1]
    for project in projects:
        h = caller(project)
        page = await json_of(http, "GET", "/v2/queues/q/messages?echo=true", h, 200)
        assert [m["body"] for m in page["messages"]] == [{"project": project}], project
        queues = await json_of(http, "GET", "/v2/queues?with_count=true", h, 200)
        assert [q["name"] for q in queues["queues"]] == ["q"] and queues["count"] == 1, project
        stats = await json_of(http, "GET", "/v2/queues/q/stats", h, 200)
        assert stats["messages"]["total"] == 1, project
        others = [i for p, i in posted.items() if p != project]
        assert (
            await status_of(http, "GET", f"/v2/queues/q/messages?ids={','.join(others[:20])}", h)
            == 404
        )
        for other_id in others[:5]:
            assert await status_of(http, "GET", f"/v2/queues/q/messages/{other_id}", h) == 404
    # In Redis: every key has one of the projects' escaped names as its hash
    # tag, and each project's keys use exactly its own.
    tags: dict[str, set[bytes]] = {p: set() for p in projects}
    escaped = {escape_project(p): p for p in projects}
    assert len(escaped) == len(projects), "two projects escape to the same text"
    async for key in redis.scan_iter(count=1000):
        key_tag = hash_tag(key).decode()
        base = key_tag if key.startswith(b"fs:p:") else key_tag.rsplit("/", 1)[0]
        if base.endswith(tag) or base.startswith(tag):
            assert base in escaped, key
            assert b"{" not in hash_tag(key) and b"}" not in hash_tag(key), key
            tags[escaped[base]].add(key)
    for project, keys in tags.items():
        queue_tags = {hash_tag(k) for k in keys if not k.startswith(b"fs:p:")}
        assert queue_tags == {f"{escape_project(project)}/q".encode()}, (project, queue_tags)
        assert any(k.startswith(b"fs:p:") for k in keys), project


BAD_QUEUE_NAMES = [
    "a:b",
    "a*b",
    "a%3Fb",
    "a[b]",
    "a,b",
    "a;b",
    "a'b",
    "a%20b",
    "a%25b",
    "%C3%BC",
    "x" * 65,
    "a%00b",
    "a%0Ab",
]
# The router's own pattern leaves out '{', '}' and '/' (%2F decodes to '/'),
# so these may not even match a route: 404 instead of 400, refused all the same.
ROUTER_REFUSED_QUEUE_NAMES = ["a{b", "a}b", "{x}", "a%7Bb%7D", "a%2Fb", "%2F", "a%2F..%2Fb"]
BAD_IDS = ["x}y", "{x}", "a:b", "A" * 24, "0" * 25, "0" * 23, "*", "%2A", "%7Bx%7D", "0" * 23 + "g"]
BAD_MARKERS = ["{x}", "1:2", "-1", "1e5", "abc", "9" * 20, "%7B1%7D", "1%00", "%201"]
BAD_QUEUE_MARKERS = ["a:b", "{x}", "%7Bx%7D", "a*", "x" * 65, "a%20b", "a%2Fb"]


def queue_routes(name: str) -> list[tuple[str, str, Any]]:
    q = f"/v2/queues/{name}"
    m = f"{q}/messages"
    body = {"messages": [{"body": 1}]}
    return [
        ("PUT", q, None),
        ("GET", q, None),
        ("PATCH", q, [{"op": "add", "path": "/metadata/x", "value": 1}]),
        ("DELETE", q, None),
        ("POST", f"{q}/purge", None),
        ("GET", f"{q}/stats", None),
        ("POST", m, body),
        ("GET", m, None),
        ("DELETE", f"{m}?ids={UNKNOWN_ID}", None),
        ("DELETE", f"{m}?pop=1", None),
        ("GET", f"{m}/{UNKNOWN_ID}", None),
        ("DELETE", f"{m}/{UNKNOWN_ID}", None),
        ("POST", f"{q}/claims", {"ttl": 60}),
        ("GET", f"{q}/claims/{UNKNOWN_ID}", None),
        ("PATCH", f"{q}/claims/{UNKNOWN_ID}", {"ttl": 60}),
        ("DELETE", f"{q}/claims/{UNKNOWN_ID}", None),
    ]


async def test_bad_names_ids_and_markers_are_refused_and_write_nothing(
    http: Client, redis: aioredis.Redis
) -> None:
    victim = Victim(f"victim-{uuid.uuid4().hex}")
    await victim.build(http)
    h = victim.headers
    patch_type = {"Content-Type": "application/openstack-messaging-v2.0-json-patch"}
    before = await snapshot(redis)
    refused: list[str] = []

    async def expect(method: str, path: str, body: Any, allowed: set[int]) -> None:
        headers = {**h, **patch_type} if method == "PATCH" and "claims" not in path else h
        resp = await http.request(method, path, headers=headers, json=body)
        await resp.read()
        if resp.status not in allowed:
            refused.append(f"{method} {path}: {resp.status} (want {sorted(allowed)})")

    for name in BAD_QUEUE_NAMES:
        for method, path, body in queue_routes(name):
            await expect(method, path, body, {400})
    for name in ROUTER_REFUSED_QUEUE_NAMES:
        for method, path, body in queue_routes(name):
            await expect(method, path, body, {400, 404, 405})
    m = f"/v2/queues/{SHARED}/messages"
    c = f"/v2/queues/{SHARED}/claims"
    for bad in BAD_IDS:
        await expect("GET", f"{m}/{bad}", None, {404})
        # deleting what does not exist is 204 (ids with braces do not route: 404)
        await expect("DELETE", f"{m}/{bad}", None, {204, 404})
        await expect("GET", f"{c}/{bad}", None, {404})
        await expect("PATCH", f"{c}/{bad}", {"ttl": 60}, {404})
        await expect("DELETE", f"{c}/{bad}", None, {204, 404})
        await expect("GET", f"{m}?ids={bad}", None, {404})
        await expect("DELETE", f"{m}?ids={bad}", None, {204})
        # a claim_id that is no claim's cannot delete a message
        await expect("DELETE", f"{m}/{victim.ids[-1]}?claim_id={bad}", None, {400})
        await expect("DELETE", f"{m}/{victim.claimed[0]}?claim_id={bad}", None, {400})
    for marker in BAD_MARKERS:
        await expect("GET", f"{m}?marker={marker}", None, {400})
    for marker in BAD_QUEUE_MARKERS:
        await expect("GET", f"/v2/queues?marker={marker}", None, {400})
    assert not refused, "\n".join(refused)
    assert diff(before, await snapshot(redis)) == []
    await victim.check_unchanged(http)


def test_no_key_pattern_is_left_unescaped() -> None:
    """escape_project is injective and leaves no '{', '}' or '/' in a project's part."""
    seen: dict[str, str] = {}
    for project in [*TRICKY_PROJECTS, "%7B", "%7D", "%2F", "%", "%%", "a%257Db"]:
        escaped = escape_project(project)
        assert not set(escaped) & set("{}/"), project
        assert seen.setdefault(escaped, project) == project, (project, seen[escaped])


def test_the_keys_of_a_queue_are_those_of_its_project_name_and_kind_only() -> None:
    """QueueKeys.of remembers the keys it made: each answer is still the one
    for exactly the names asked (no other project's, queue's or kind's), and
    the keys every script gets are the queue's, in the scripts' order."""
    made: dict[str, tuple[str, str, str]] = {}
    for project in [*TRICKY_PROJECTS, "p", "P"]:
        for queue in ("q", "Q", "q-1"):
            for kind in KINDS:
                names = (project, queue, kind)
                keys = QueueKeys.of(*names)
                assert keys == QueueKeys.of(*names)
                assert keys.prefix.endswith(f"{{{escape_project(project)}/{queue}}}")
                assert keys.prefix.startswith("fs:t:" if kind == "topic" else "fs:{")
                assert made.setdefault(keys.prefix, names) == names
                expected = [keys.meta, keys.seq, keys.index, keys.expiry, keys.claimed, keys.claims]
                assert keys.fixed() == expected
                keys.fixed().append("changed by a caller")
                assert keys.fixed() == expected
