"""The upgrade to compact storage (issue 30; docs/operations.md, "Upgrading
to compact storage"): data written in the records layout (a key per
message), then the same Redis served with ``--storage-layout segments``.

The old data is written two ways:

* ``previous-release``: the release before compact storage, run as a
  process: main's commit :data:`PREVIOUS_RELEASE` is exported from this
  checkout (``git archive``) into a temporary directory and its ``python -m
  feedsvc serve`` runs there with this venv, against the test's Redis, over
  HTTP as its clients did;
* ``records``: this code with ``--storage-layout records``, over HTTP too.

The writer is stopped before the new layout is served (the upgrade is not
rolling: the previous release does not know a queue's ``ns``). Then, on
both drivers, single Redis and Cluster: every old message is read exactly
once, from the head and through the markers the old release handed out,
and a list from an old marker crosses into the segments; old ids are
fetched; an idempotent re-post of an old key replays the old ids; a
subscription delivers from its old position; old claims hold, are
deleted with and released; old messages are claimed after the switch; and
once the old messages' ttl has passed and the garbage collection ran, no
legacy key is left (``Q:idx``, ``Q:exp``, ``Q:r:*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tarfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from feedsvc.app import create_app
from feedsvc.clock import SYSTEM_CLOCK, Clock, ManualClock
from feedsvc.errors import MessageIsClaimed
from feedsvc.storage.base import FeedStore, ListQuery, NewMessage, Parent
from feedsvc.storage.drivers import make_store
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.segments import ID_TAG_DIGITS, NEW_START
from feedsvc.testing import ServiceProcess
from tests.conftest import PROCESS_DRIVERS, REPO_ROOT, direct_client, make_settings

pytestmark = pytest.mark.process  # the previous release runs as a process

#: main's last commit before compact storage (issue 30): the previous
#: release. By its full hash: a clone of main has it, tags may not be cloned.
PREVIOUS_RELEASE = "1654064b44722557ac7295aed14a685b7191c5e4"
WRITERS = ["previous-release", "records"]

WRITER = str(uuid.uuid4())
READER = str(uuid.uuid4())
OLD_TTL = 300  # s
NEW_TTL = 3600  # s: outlives the old messages and their claims
IDEMPOTENCY_KEY = "upgrade-1"
PAGE = 4  # the old reader's page: markers inside the legacy part

#: What the tests need that is not built yet (issue 30 is built in parts:
#: compact-core, -claims, -expiry, -watch): a test that needs one is expected
#: to fail (strict: it fails once it passes, so the entry is deleted then).
UNBUILT: dict[str, str] = {}


def seq_in_id(message_id: str) -> int:
    """The seq a segment message's id names (after its feed's tag)."""
    return int(message_id[ID_TAG_DIGITS:], 16)


def expect_unbuilt(request: pytest.FixtureRequest, driver: str, *needs: str) -> None:
    """Mark the test as expected to fail while something it needs is unbuilt."""
    wanted = [*needs, *(["watch"] if driver != "lua" else [])]
    reasons = [UNBUILT[need] for need in wanted if need in UNBUILT]
    if reasons:
        request.applymarker(pytest.mark.xfail(strict=True, reason="; ".join(reasons)))


@pytest.fixture(params=PROCESS_DRIVERS)
def driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=WRITERS)
def writer(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def git(*args: str, check: bool = False) -> subprocess.CompletedProcess[bytes]:
    command = ["git", "-C", str(REPO_ROOT), *args]
    return subprocess.run(command, check=check, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's tree, exported from this checkout's history."""
    try:
        inside = git("rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:
        pytest.skip("git is not installed: the previous release comes from this checkout")
    if inside.returncode != 0:
        pytest.skip("not in a git checkout: the previous release comes from its history")
    found = git("cat-file", "-e", PREVIOUS_RELEASE + "^{commit}")
    assert found.returncode == 0, (
        f"commit {PREVIOUS_RELEASE} (the previous release) is not in this checkout's "
        "history: fetch main's full history (a shallow clone lacks it)"
    )
    tree = tmp_path_factory.mktemp("previous-release")
    archive = tree / "release.tar"
    git("archive", "--format=tar", "-o", str(archive), PREVIOUS_RELEASE, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    archive.unlink()
    return tree


@contextlib.asynccontextmanager
async def old_service(
    writer: str, redis_url: str, driver: str, tree: Path | None, log: Path
) -> AsyncIterator[str]:
    """The old layout's writer, serving HTTP at the URL yielded; stopped after."""
    if writer == "previous-release":
        assert tree is not None
        flags = ("--redis-url", redis_url, "--driver", driver, "--min-message-ttl", "1",
                 "--no-deliver", "--log-level", "WARNING")  # fmt: skip
        # run in the exported tree: ``-m`` puts it first on sys.path
        with ServiceProcess(*flags, command=[sys.executable, "-m", "feedsvc", "serve"],
                            cwd=tree, log_path=log) as svc:  # fmt: skip
            yield svc.url
            assert svc.stop() == 0, svc.log_text()[-2000:]
        return
    settings = make_settings(redis_url, driver=driver, storage_layout="records", deliver=False)
    async with TestServer(create_app(settings)) as server:
        yield str(server.make_url("")).rstrip("/")


@dataclass
class OldData:
    """What the old release wrote and handed out."""

    ids: list[str] = field(default_factory=list)  # queue q, in post order
    idempotent: list[str] = field(default_factory=list)  # the post with IDEMPOTENCY_KEY
    seen: list[str] = field(default_factory=list)  # READER's pages, in order
    markers: list[tuple[int, int]] = field(default_factory=list)  # (marker, ids seen before it)
    subscription: str = ""
    position: int = 0  # the subscription's position when created
    claimable: list[str] = field(default_factory=list)  # queue c, in post order
    claimed: dict[str, list[str]] = field(default_factory=dict)  # queue c: claim id -> ids
    free: list[str] = field(default_factory=list)  # queue c: not claimed


class Http:
    def __init__(self, session: aiohttp.ClientSession, project: str) -> None:
        self.session, self.project = session, project

    async def call(
        self, method: str, path: str, client: str = WRITER, body: Any = None, **headers: str
    ) -> tuple[int, Any, Any]:
        head = {"Client-ID": client, "X-Project-ID": self.project, **headers}
        async with self.session.request(method, "/v2/" + path, json=body, headers=head) as r:
            text = await r.read()
            return r.status, orjson.loads(text) if text else None, r.headers

    async def post(
        self, queue: str, bodies: list[Any], client: str = WRITER, **headers: str
    ) -> list[str]:
        messages = [{"body": b, "ttl": OLD_TTL} for b in bodies]
        status, doc, _ = await self.call(
            "POST", f"queues/{queue}/messages", client, {"messages": messages}, **headers
        )
        assert status == 201, doc
        return [href.rsplit("/", 1)[1] for href in doc["resources"]]

    async def claim(self, queue: str, limit: int) -> tuple[str, list[str]]:
        status, doc, head = await self.call(
            "POST", f"queues/{queue}/claims?limit={limit}", body={"ttl": 600, "grace": 60}
        )
        assert status == 201, doc
        return str(head["Location"]).rsplit("/", 1)[1], [m["id"] for m in doc["messages"]]


async def write_old_data(url: str, project: str) -> OldData:
    """Queue q: 22 messages (2 of them READER's own, hidden from it without
    echo), one post idempotent, a subscription created after the first 10;
    READER pages through it PAGE at a time. Queue c: 8 messages, two
    claims of 2."""
    old = OldData()
    async with aiohttp.ClientSession(url) as session:
        http = Http(session, project)
        old.idempotent = await http.post(
            "q", list(range(10)), **{"Idempotency-Key": IDEMPOTENCY_KEY}
        )
        status, doc, _ = await http.call(
            "POST",
            "queues/q/subscriptions",
            body={"subscriber": "http://example.com/hook", "ttl": 3600},
        )
        assert status == 201, doc
        old.subscription = doc["subscription_id"]
        status, doc, _ = await http.call("GET", f"queues/q/subscriptions/{old.subscription}")
        assert status == 200, doc
        old.ids = [*old.idempotent]
        for first in range(10, 20, 3):
            old.ids += await http.post("q", list(range(first, min(20, first + 3))))
        old.ids += await http.post("q", [20, 21], client=READER)
        path: str | None = f"queues/q/messages?limit={PAGE}"
        while path:
            status, doc, _ = await http.call("GET", path, client=READER)
            assert status == 200, doc
            if not doc["messages"]:
                break
            old.seen += [m["id"] for m in doc["messages"]]
            [link] = [link["href"] for link in doc["links"] if link["rel"] == "next"]
            old.markers.append((int(link.rpartition("marker=")[2].split("&")[0]), len(old.seen)))
            path = link.removeprefix("/v2/")
        old.claimable = old.free = await http.post("c", list(range(8)))
        for _ in range(2):
            claim_id, ids = await http.claim("c", 2)
            old.claimed[claim_id] = ids
            old.free = [i for i in old.free if i not in ids]
    assert old.seen == old.ids[:20], "the old release shows READER its own messages"
    return old


@pytest.fixture
async def old(
    writer: str,
    redis_url: str,
    driver: str,
    project: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> OldData:
    """The old data, written by the writer, which is stopped after."""
    tree = request.getfixturevalue("previous_release") if writer == "previous-release" else None
    async with old_service(writer, redis_url, driver, tree, tmp_path / "old.log") as url:
        data = await write_old_data(url, project)
    # the positions the old release stored
    client = direct_client(redis_url)
    try:
        keys = QueueKeys.of(project, "q")
        assert await client.exists(keys.index, keys.expiry) == 2
        assert not await client.hexists(keys.meta, NEW_START), "the old writer switched"
    finally:
        await client.aclose()
    return data


@contextlib.asynccontextmanager
async def new_store(redis_url: str, driver: str, clock: Clock) -> AsyncIterator[FeedStore]:
    """This release on the same Redis, writing segments."""
    settings = make_settings(redis_url, driver=driver, storage_layout="segments")
    store = make_store(settings, clock)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def post_new(store: FeedStore, project: str, queue: str, bodies: list[int]) -> list[str]:
    batch = [NewMessage(orjson.dumps(b), NEW_TTL) for b in bodies]
    return await store.post_messages(project, queue, WRITER, batch)


async def switch(
    store: FeedStore, redis_url: str, project: str, queue: str, bodies: list[int]
) -> list[str]:
    """The first post with segments on: the queue switches for good."""
    ids = await post_new(store, project, queue, bodies)
    client = direct_client(redis_url)
    try:
        switched = await client.hget(QueueKeys.of(project, queue).meta, NEW_START)
    finally:
        await client.aclose()
    assert switched is not None, f"{queue} did not switch to segments"
    return ids


async def read_all(
    store: FeedStore, project: str, queue: str, marker: int | None = None, limit: int = 3
) -> list[Any]:
    seen: list[Any] = []
    while True:
        query = ListQuery(READER, marker=marker, limit=limit, check_marker=True)
        page = await store.list_messages(project, queue, query)
        if not page.messages:
            return seen
        seen += page.messages
        marker = page.next_marker


def body_of(message: Any) -> Any:
    return orjson.loads(message.body)


async def legacy_keys(redis_url: str, project: str, queue: str) -> list[str]:
    keys = QueueKeys.of(project, queue)
    client = direct_client(redis_url)
    try:
        fixed = [k for k in (keys.index, keys.expiry) if await client.exists(k)]
        records = [k async for k in client.scan_iter(match=keys.record("*"), count=1000)]
    finally:
        await client.aclose()
    return fixed + [k.decode() if isinstance(k, bytes) else k for k in records]


# -- the tests ----------------------------------------------------------------------


async def test_the_old_data_is_in_the_records_layout(
    old: OldData, redis_url: str, project: str
) -> None:
    """What the rest start from: a key per message, indexed, no ``ns``."""
    client = direct_client(redis_url)
    try:
        for queue, ids in (("q", old.ids), ("c", old.claimable)):
            keys = QueueKeys.of(project, queue)
            assert await client.zcard(keys.index) == len(ids)
            assert [await client.exists(keys.record(i)) for i in ids] == [1] * len(ids)
            assert not await client.hexists(keys.meta, NEW_START)
        assert len(old.markers) == 5 and len(old.claimed) == 2
    finally:
        await client.aclose()


async def test_old_messages_are_read_once_through_old_markers_into_the_segments(
    old: OldData,
    redis_url: str,
    driver: str,
    project: str,
    request: pytest.FixtureRequest,
) -> None:
    expect_unbuilt(request, driver)
    clock = ManualClock()
    async with new_store(redis_url, driver, clock) as store:
        keys = QueueKeys.of(project, "q")
        client = direct_client(redis_url)
        try:
            last_old = int(await client.get(keys.seq) or 0)
            new = await switch(store, redis_url, project, "q", [100, 101, 102, 103, 104])
            # the queue switched for good at the first segments post (ns)
            assert int(await client.hget(keys.meta, NEW_START) or 0) == last_old + 1
        finally:
            await client.aclose()
        # a segment message's id is its seq, 24 hex digits
        assert [seq_in_id(i) for i in new] == list(range(last_old + 1, last_old + 6))
        visible = old.ids[:20] + new
        for limit in (1, 3, 10):
            seen = await read_all(store, project, "q", limit=limit)
            assert [m.id for m in seen] == visible
        assert [body_of(m) for m in seen] == [*range(20), *range(100, 105)]
        assert [m.seq for m in seen] == sorted({m.seq for m in seen})
        # every marker the old release handed out: the rest, once, into the segments
        for marker, before in old.markers:
            rest = await read_all(store, project, "q", marker=marker)
            assert [m.id for m in rest] == visible[before:], marker
        # echo: READER's own old messages, then the new ones
        page = await store.list_messages(
            project, "q", ListQuery(READER, marker=old.markers[-1][0], echo=True, limit=10)
        )
        assert [m.id for m in page.messages] == old.ids[20:] + new
        # by id, old and new, in the order asked
        fetched = await store.get_messages(project, "q", [new[0], *old.ids, new[-1]])
        assert [m.id for m in fetched] == [new[0], *old.ids, new[-1]]
        # the tail is past everything
        assert await store.tail_marker(project, "q") == seq_in_id(new[-1])


async def test_stats_count_the_old_and_the_new_messages(
    old: OldData,
    redis_url: str,
    driver: str,
    project: str,
    request: pytest.FixtureRequest,
) -> None:
    expect_unbuilt(request, driver)
    clock = ManualClock()
    async with new_store(redis_url, driver, clock) as store:
        new = await switch(store, redis_url, project, "q", [100, 101, 102])
        stats = await store.queue_stats(project, "q")
        assert (stats.total, stats.claimed, stats.free) == (25, 0, 25)
        assert stats.oldest is not None and stats.oldest.id == old.ids[0]
        assert stats.newest is not None and stats.newest.id == new[-1]
        clock.advance(OLD_TTL + 1)  # the old ones expired, none collected yet
        stats = await store.queue_stats(project, "q")
        assert (stats.total, stats.free) == (3, 3)
        assert stats.oldest is not None and stats.oldest.id == new[0]


async def test_an_old_idempotency_key_replays_the_old_ids(
    old: OldData,
    redis_url: str,
    driver: str,
    project: str,
    request: pytest.FixtureRequest,
) -> None:
    expect_unbuilt(request, driver)
    async with new_store(redis_url, driver, ManualClock()) as store:
        new = await switch(store, redis_url, project, "q", [100])
        batch = [NewMessage(orjson.dumps(n), OLD_TTL) for n in range(10)]
        again = await store.post_messages(
            project, "q", WRITER, batch, idempotency_key=IDEMPOTENCY_KEY
        )
        assert again == old.idempotent
        # nothing written twice
        assert [m.id for m in await read_all(store, project, "q")] == old.ids[:20] + new


async def test_a_subscription_delivers_from_its_old_position(
    old: OldData,
    redis_url: str,
    driver: str,
    project: str,
    request: pytest.FixtureRequest,
) -> None:
    expect_unbuilt(request, driver)
    async with new_store(redis_url, driver, ManualClock()) as store:
        parent = Parent("queue", project, "q")
        subscription = await store.subscriptions.get(parent, old.subscription)
        position = subscription.delivery.position
        # created after the first post: its position is that post's last seq
        [tenth] = await store.get_messages(project, "q", old.idempotent[-1:])
        assert position == tenth.seq
        new = await switch(store, redis_url, project, "q", [100, 101])
        # as the delivery worker reads: on from the last seq until nothing is left
        due: list[tuple[int, Any]] = []
        while batch := await store.deliveries.messages_after(parent, position, 100):
            due += batch
            position = batch[-1][0]
        assert [m.id for _, m in due if m is not None] == old.ids[10:] + new
        assert [seq for seq, _ in due] == sorted({seq for seq, _ in due})
        assert await store.deliveries.last_seq(parent) == seq_in_id(new[-1])


async def test_old_claims_hold_and_are_deleted_with_and_released(
    old: OldData,
    redis_url: str,
    driver: str,
    project: str,
    request: pytest.FixtureRequest,
) -> None:
    expect_unbuilt(request, driver, "claims")
    async with new_store(redis_url, driver, ManualClock()) as store:
        new = await switch(store, redis_url, project, "c", [100, 101])
        (kept, kept_ids), (freed, freed_ids) = old.claimed.items()
        claim = await store.get_claim(project, "c", kept)
        assert [m.id for m in claim.messages] == kept_ids
        # held: hidden from a list, listed with include_claimed, 403 without its claim
        listed = await read_all(store, project, "c")
        assert [m.id for m in listed] == old.free + new
        page = await store.list_messages(project, "c", ListQuery(READER, include_claimed=True))
        assert [(m.id, m.claim_id) for m in page.messages[:6]] == [
            (i, next((c for c, ids in old.claimed.items() if i in ids), None))
            for i in old.claimable[:6]
        ]
        with pytest.raises(MessageIsClaimed):
            await store.delete_message(project, "c", kept_ids[0], None)
        await store.delete_message(project, "c", kept_ids[0], kept)
        await store.renew_claim(project, "c", kept, 900, 60)
        assert [m.id for m in (await store.get_claim(project, "c", kept)).messages] == kept_ids[1:]
        await store.release_claim(project, "c", freed)
        # claims after the switch: the released and free old messages first, then the new
        taken = await store.claim_messages(project, "c", 300, 60, 20)
        assert taken is not None
        again = [i for i in old.claimable if i in freed_ids or i in old.free]
        assert [m.id for m in taken.messages] == again + new
        assert await store.claim_messages(project, "c", 300, 60, 20) is None
        await store.release_message(project, "c", freed_ids[0], taken.id, 0)
        [popped] = await store.pop_messages(project, "c", 5)
        assert popped.id == freed_ids[0]
        await store.delete_messages(project, "c", [m.id for m in taken.messages])
        await store.delete_message(project, "c", kept_ids[1], kept)
        assert await read_all(store, project, "c") == []
        assert (await store.queue_stats(project, "c")).total == 0


async def test_no_legacy_key_is_left_once_the_old_messages_expire(
    old: OldData,
    redis_url: str,
    driver: str,
    project: str,
    request: pytest.FixtureRequest,
) -> None:
    expect_unbuilt(request, driver)
    clock = ManualClock()
    async with new_store(redis_url, driver, clock) as store:
        new = await switch(store, redis_url, project, "q", [100, 101])
        await switch(store, redis_url, project, "c", [100])
        clock.advance(OLD_TTL + 1)
        assert [m.id for m in await read_all(store, project, "q")] == new
        assert await store.get_messages(project, "q", old.ids) == []
        # the old claims ran out (600 s) after their messages' own ttl
        clock.advance(600)
        # the garbage collection runs in the queues' writes
        for queue in ("q", "c"):
            for _ in range(10):
                if not await legacy_keys(redis_url, project, queue):
                    break
                await post_new(store, project, queue, [200])
            assert await legacy_keys(redis_url, project, queue) == []
        [*_, old_marker_last] = old.markers
        rest = await read_all(store, project, "q", marker=old_marker_last[0])
        assert [m.id for m in rest][: len(new)] == new


@pytest.mark.slow
async def test_short_lived_old_messages_leave_nothing_behind_in_real_time(
    writer: str,
    redis_url: str,
    driver: str,
    project: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """As above on the real clock: old messages of 1 and 2 s, Redis's own
    expiry and the collection by the next posts."""
    expect_unbuilt(request, driver)
    tree = request.getfixturevalue("previous_release") if writer == "previous-release" else None
    log = tmp_path / "old.log"
    async with (
        old_service(writer, redis_url, driver, tree, log) as url,
        aiohttp.ClientSession(url) as session,
    ):
        status, doc, _ = await Http(session, project).call(
            "POST",
            "queues/s/messages",
            body={"messages": [{"body": n, "ttl": 1 + n % 2} for n in range(6)]},
        )
        assert status == 201, doc
    async with new_store(redis_url, driver, SYSTEM_CLOCK) as store:
        new = await switch(store, redis_url, project, "s", [100])
        await asyncio.sleep(2.1)  # every old message's ttl has passed
        for _ in range(10):
            if not await legacy_keys(redis_url, project, "s"):
                break
            await post_new(store, project, "s", [200])
        assert await legacy_keys(redis_url, project, "s") == []
        seen = await read_all(store, project, "s")
        assert [m.id for m in seen][:1] == new
