"""Faults injected into real processes, for both drivers (nothing is mocked).

Every test starts its own ``redis-server`` (``RedisServer``, never 6379) and a
live ``feedsvc serve --redis-url ...`` subprocess, drives it over HTTP from
this process, and breaks Redis or the clients on purpose:

1. Redis killed (``kill -9``) and restarted with an empty script cache, then
   paused (SIGSTOP: it accepts connections and never answers): every answer
   is 2xx or 503 + Retry-After, none hangs, /v2/ping and /v2/health say 503,
   and the service recovers by itself once Redis is back.
2. Durability: ``appendfsync always``, producers under load, ``kill -9`` of
   Redis twice, restart from the same data dir: every message that got a 201
   is there, by listing and by id, once, in per-producer order.
3. ``SCRIPT FLUSH`` every 200 ms under load: no failed request, every
   acknowledged message readable.
4. Thousands of clients that disconnect at random points: replies still match
   requests, the service's Redis connections stay within the pool size, and
   no message is half-written.

Each test gathers every problem it finds and fails with the whole list, so
one run tells everything that is wrong. The numbers each run measured are
printed (``pytest -s``) as ``RELIABILITY ...`` lines; docs/RELIABILITY.md
quotes them. No assertion is about speed: the bounds below only tell a hang
from an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import re
import signal
import socket
import struct
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from feedsvc.embedded_redis.server import RedisServer
from feedsvc.storage import record
from feedsvc.testing import ServiceProcess
from tests.conftest import PROCESS_DRIVERS

# The longest any one request may take before the test calls it a hang.
CLIENT_TIMEOUT = 15.0
# Once Redis is back, the first successful answer must come within this
# (the contract says "about 2 s"; this only tells "recovered" from "stuck").
RECOVERY_BOUND = 5.0
# Short Redis timeouts so that a paused Redis turns into 503s quickly.
FAST_FAIL = ("--redis-timeout", "1", "--redis-connect-timeout", "0.5", "--pool-timeout", "1")
POOL_SIZE = 8
ADMIN_NAME = "feedsvc-test-admin"
PAGE = 20
LONG_TTL = 3600
# Acknowledged messages also read back one GET each (all of them are read by ?ids=).
BY_ID_SAMPLE = 300
# Routes whose errors are not the {title, description} document: ping's 503
# has no body, health's 503 is the health document.
BARE = ("/v2/ping", "/v2/health")

# feedsvc serve and redis-servers of its own, killed and paused
pytestmark = [pytest.mark.timeout(120), pytest.mark.process]


def report(test: str, **numbers: object) -> None:
    """One line of numbers for docs/RELIABILITY.md (shown with pytest -s)."""
    print(f"\nRELIABILITY {test} " + " ".join(f"{k}={v}" for k, v in numbers.items()))


# -- processes -------------------------------------------------------------------------


class LiveService(ServiceProcess):
    """``python -m feedsvc serve --redis-url ... --driver ...`` as a child
    process on a port of its own, plus what the tests read from its log."""

    def __init__(self, redis_url: str, driver: str, log: Path, *args: str) -> None:
        super().__init__(
            "--redis-url", redis_url, "--driver", driver, "--host", "127.0.0.1", *args,
            log_path=log,
        )  # fmt: skip
        self.driver = driver

    @property
    def base(self) -> str:
        return self.url

    def unhandled(self) -> list[str]:
        """Log lines of requests that ended in a 500 (the middleware's 'unhandled error')."""
        lines = self.log_text().splitlines()
        found = []
        for i, line in enumerate(lines):
            if "unhandled error" in line:
                # the exception's last line closes the traceback that follows
                tail = next(
                    (
                        t
                        for t in lines[i + 1 : i + 40]
                        if re.match(r"^[A-Za-z_.]+(Error|Exception)", t)
                    ),
                    "",
                )
                what = re.sub(r" \[req-[^\]]*\]", "", line.split(" ERROR ")[-1])
                found.append(f"{what} -> {tail}")
        return found

    def check_log(self, problems: list[str]) -> int:
        """Add one problem per kind of 500 in the log; the number of 500s."""
        found = Counter(self.unhandled())
        problems += [f"{n} x 500 in the log: {what}" for what, n in found.most_common(5)]
        return sum(found.values())


@contextlib.contextmanager
def own_redis(data_dir: Path, appendfsync: str = "always") -> Iterator[RedisServer]:
    """A redis-server of this test's own; stopped (resumed first if paused) at the end."""
    server = RedisServer(data_dir, appendfsync=appendfsync)
    assert server.port != 6379
    server.start()
    try:
        yield server
    finally:
        pid = server.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        server.stop()


def admin(server: RedisServer) -> aioredis.Redis:
    """The test's own Redis connection (named, so CLIENT LIST can tell it apart)."""
    return aioredis.Redis.from_url(
        server.url, client_name=ADMIN_NAME, socket_timeout=10, socket_connect_timeout=5
    )


# -- HTTP traffic ------------------------------------------------------------------------


def headers_for(project: str, client: str | None = None) -> dict[str, str]:
    return {"Client-ID": client or str(uuid.uuid4()), "X-Project-ID": project}


@dataclass
class Outcome:
    kind: str
    start: float
    end: float
    status: int | None  # None: no answer (client timeout, connection error)
    error: str = ""
    retry_after: str | None = None
    error_shape_ok: bool = True


@dataclass
class Batch:
    """One POST of a producer: the bodies sent and what came back."""

    producer: int
    n: int
    bodies: list[dict[str, Any]]
    status: int | None = None
    ids: list[str] = field(default_factory=list)


class Traffic:
    """Requests that record what they got; nothing is retried behind the test's back."""

    def __init__(self, session: aiohttp.ClientSession, base: str, project: str) -> None:
        self.session = session
        self.base = base
        self.project = project
        self.outcomes: list[Outcome] = []
        self.batches: list[Batch] = []
        self.loop = asyncio.get_running_loop()

    async def request(
        self,
        kind: str,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Any = None,
    ) -> tuple[int | None, Any]:
        start = self.loop.time()
        doc: Any = None
        try:
            async with self.session.request(
                method, self.base + path, headers=headers, json=body
            ) as resp:
                raw = await resp.read()
                status: int | None = resp.status
                retry_after = resp.headers.get("Retry-After")
                if raw and resp.content_type == "application/json":
                    doc = json.loads(raw)
            shape_ok = True
            if status is not None and status >= 400 and method != "HEAD" and path not in BARE:
                shape_ok = isinstance(doc, dict) and set(doc) == {"title", "description"}
            outcome = Outcome(kind, start, self.loop.time(), status, "", retry_after, shape_ok)
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = Outcome(kind, start, self.loop.time(), None, repr(exc))
            status = None
        self.outcomes.append(outcome)
        return status, doc

    def statuses(self) -> Counter[str]:
        return Counter(
            str(o.status) if o.status is not None else "no answer" for o in self.outcomes
        )

    async def poster(
        self, producer: int, queue: str, stop: asyncio.Event, max_batch: int = 1
    ) -> None:
        headers = headers_for(self.project)
        n = 0
        while not stop.is_set():
            size = random.randint(1, max_batch)
            bodies = [{"p": producer, "n": n, "k": k} for k in range(size)]
            batch = Batch(producer, n, bodies)
            self.batches.append(batch)
            payload = {"messages": [{"body": b, "ttl": LONG_TTL} for b in bodies]}
            status, doc = await self.request("post", "POST", messages_path(queue), headers, payload)
            batch.status = status
            if status == 201:
                batch.ids = [href.rsplit("/", 1)[1] for href in doc["resources"]]
            n += 1
            if status != 201:
                await asyncio.sleep(0.02)  # do not spin while Redis is away

    async def lister(self, queue: str, stop: asyncio.Event, seen: list[dict[str, Any]]) -> None:
        """A reader following the feed with its marker, as a Zaqar client does."""
        headers = headers_for(self.project)
        marker: str | None = None
        while not stop.is_set():
            path = f"{messages_path(queue)}?limit={PAGE}"
            if marker is not None:
                path += f"&marker={marker}"
            status, doc = await self.request("list", "GET", path, headers)
            if status == 200:
                seen.extend(doc["messages"])
                if doc["links"]:
                    marker = re.findall(r"marker=(\d+)", doc["links"][0]["href"])[0]
                    continue
            await asyncio.sleep(0.02)

    def acknowledged(self) -> dict[str, dict[str, Any]]:
        """Message id -> body, for every message that got a 201."""
        return {
            i: body
            for batch in self.batches
            if batch.status == 201
            for i, body in zip(batch.ids, batch.bodies, strict=True)
        }

    def first_success_after(self, moment: float) -> float | None:
        ends = [o.end for o in self.outcomes if o.start >= moment and o.status and o.status < 300]
        return min(ends) - moment if ends else None

    async def recovery(self, moment: float) -> float | None:
        """Seconds from moment to the first 2xx of a request sent after it (None: none
        within RECOVERY_BOUND)."""
        while self.loop.time() < moment + RECOVERY_BOUND:
            took = self.first_success_after(moment)
            if took is not None:
                return took
            await asyncio.sleep(0.05)
        return self.first_success_after(moment)


def messages_path(queue: str) -> str:
    return f"/v2/queues/{queue}/messages"


async def read_feed(
    session: aiohttp.ClientSession, base: str, project: str, queue: str
) -> list[dict[str, Any]]:
    """The whole feed from the head (echo=true), following next links to the empty page."""
    headers = headers_for(project)
    out: list[dict[str, Any]] = []
    path = f"{messages_path(queue)}?echo=true&limit={PAGE}"
    for _ in range(100_000):
        async with session.get(base + path, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            doc = await resp.json()
        out.extend(doc["messages"])
        if not doc["links"]:
            assert not doc["messages"], "a page with messages must have a next link"
            return out
        assert doc["messages"] or doc["links"][0]["href"] != path, "the listing does not move"
        path = doc["links"][0]["href"]
    raise AssertionError("the listing never ended")


async def bounded_gather(limit: int, jobs: list[Callable[[], Awaitable[None]]]) -> None:
    gate = asyncio.Semaphore(limit)

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(run(job) for job in jobs))


async def check_stored(
    session: aiohttp.ClientSession,
    base: str,
    project: str,
    queue: str,
    batches: list[Batch],
    problems: list[str],
) -> dict[str, int]:
    """Every acknowledged message exactly once, in per-producer order, by listing and by id.

    Also: no body appears twice (nothing was written twice) and a batch is
    stored whole or not at all, acknowledged or not.
    """
    feed = await read_feed(session, base, project, queue)
    ids = [m["id"] for m in feed]
    if len(ids) != len(set(ids)):
        dup = [i for i, c in Counter(ids).items() if c > 1]
        problems.append(f"listing repeats ids {dup[:5]} ({len(dup)} in all)")
    keys = [(m["body"]["p"], m["body"]["n"], m["body"]["k"]) for m in feed]
    if len(keys) != len(set(keys)):
        dup_keys = [k for k, c in Counter(keys).items() if c > 1]
        problems.append(f"bodies stored twice: {dup_keys[:5]} ({len(dup_keys)} in all)")
    listed = {m["id"]: m["body"] for m in feed}
    acked = {
        i: body
        for batch in batches
        if batch.status == 201
        for i, body in zip(batch.ids, batch.bodies, strict=True)
    }
    lost = [i for i in acked if i not in listed]
    wrong = [i for i in acked if i in listed and listed[i] != acked[i]]
    if lost:
        problems.append(f"{len(lost)} acknowledged messages missing from the listing: {lost[:5]}")
    if wrong:
        problems.append(f"{len(wrong)} listed messages have another body than posted: {wrong[:5]}")
    last: dict[int, tuple[int, int]] = {}
    for p, n, k in keys:
        if p in last and (n, k) <= last[p]:
            problems.append(f"producer {p}: ({n},{k}) listed after {last[p]}: order broken")
            break
        last[p] = (n, k)
    stored_keys = set(keys)
    unacked_stored = 0
    for batch in batches:
        present = [(b["p"], b["n"], b["k"]) in stored_keys for b in batch.bodies]
        if any(present) and not all(present):
            problems.append(f"batch {batch.producer}/{batch.n} is stored in part: {present}")
        if batch.status != 201 and all(present):
            unacked_stored += len(batch.bodies)

    # by id: every message in ?ids= pages of 20, and a sample one request each
    by_id_missing: list[str] = []
    unreadable: set[str] = set()
    headers = headers_for(project)
    wanted = list(acked)

    def fetch_page(chunk: list[str]) -> Callable[[], Awaitable[None]]:
        async def job() -> None:
            url = f"{base}{messages_path(queue)}?ids={','.join(chunk)}"
            async with session.get(url, headers=headers) as resp:
                doc = await resp.json() if resp.status == 200 else {"messages": []}
            found = {m["id"]: m["body"] for m in doc["messages"]}
            for i in chunk:
                if found.get(i) != acked[i]:
                    by_id_missing.append(f"{i}: {found.get(i)}")
                    unreadable.add(i)

        return job

    def fetch_one(message_id: str) -> Callable[[], Awaitable[None]]:
        async def job() -> None:
            url = f"{base}{messages_path(queue)}/{message_id}"
            async with session.get(url, headers=headers) as resp:
                doc = await resp.json() if resp.status == 200 else None
            if doc is None or doc["id"] != message_id or doc["body"] != acked[message_id]:
                by_id_missing.append(f"{message_id}: {doc}")
                unreadable.add(message_id)

        return job

    jobs = [fetch_page(wanted[i : i + PAGE]) for i in range(0, len(wanted), PAGE)]
    jobs += [fetch_one(i) for i in random.sample(wanted, min(len(wanted), BY_ID_SAMPLE))]
    await bounded_gather(16, jobs)
    if by_id_missing:
        problems.append(
            f"{len(by_id_missing)} acknowledged messages not readable by id: {by_id_missing[:5]}"
        )
    return {
        "acked": len(acked),
        "listed": len(feed),
        "unacked_but_stored": unacked_stored,
        "lost": len(set(lost) | unreadable),
    }


def check_reader(seen: list[dict[str, Any]], problems: list[str], who: str) -> None:
    """What a reader saw while following its marker: nothing twice, producers in order."""
    ids = [m["id"] for m in seen]
    if len(ids) != len(set(ids)):
        problems.append(f"{who} saw {len(ids) - len(set(ids))} messages twice")
    last: dict[int, tuple[int, int]] = {}
    for m in seen:
        p, n, k = m["body"]["p"], m["body"]["n"], m["body"]["k"]
        if p in last and (n, k) <= last[p]:
            problems.append(f"{who}: producer {p} ({n},{k}) after {last[p]}")
            return
        last[p] = (n, k)


def check_answers(traffic: Traffic, problems: list[str], allowed: set[int]) -> None:
    """Statuses only from `allowed`; a 503 carries Retry-After; errors are JSON."""
    bad = Counter(o.status for o in traffic.outcomes if o.status not in allowed)
    if bad:
        samples = [o for o in traffic.outcomes if o.status not in allowed][:3]
        problems.append(f"unexpected answers {dict(bad)}, e.g. {samples}")
    no_retry = [o for o in traffic.outcomes if o.status == 503 and not o.retry_after]
    if no_retry:
        kinds = Counter(o.kind for o in no_retry)
        problems.append(f"{len(no_retry)} 503s without Retry-After: {dict(kinds)}")
    badly_shaped = [o for o in traffic.outcomes if not o.error_shape_ok]
    if badly_shaped:
        problems.append(f"{len(badly_shaped)} errors not JSON {{title, description}}")


@contextlib.asynccontextmanager
async def client_session() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=200)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        yield session


# -- 1. Redis down, paused and back ----------------------------------------------------------


async def probe_unavailable(traffic: Traffic, problems: list[str], when: str) -> None:
    """While Redis is away: ping (GET and HEAD) and health say 503 with Retry-After."""
    headers = headers_for(traffic.project)
    for method, path in (("GET", "/v2/ping"), ("HEAD", "/v2/ping"), ("GET", "/v2/health")):
        status, doc = await traffic.request("probe", method, path, headers)
        outcome = traffic.outcomes[-1]
        if status != 503:
            problems.append(f"{when}: {method} {path} answered {status} ({outcome.error})")
        elif not outcome.retry_after:
            problems.append(f"{when}: {method} {path} 503 has no Retry-After")
        if path == "/v2/health" and status == 503 and doc.get("storage_reachable") is not False:
            problems.append(f"{when}: health says {doc}")


@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_redis_killed_or_paused_is_503_then_recovers(driver: str, tmp_path: Path) -> None:
    project = "faults-" + uuid.uuid4().hex
    queue = "down.q"
    problems: list[str] = []
    with (
        own_redis(tmp_path / "redis") as server,
        LiveService(
            server.url, driver, tmp_path / "serve.log", *FAST_FAIL, "--pool-size", str(POOL_SIZE)
        ) as svc,
    ):
        async with client_session() as session:
            traffic = Traffic(session, svc.base, project)
            loop = asyncio.get_running_loop()
            stop = asyncio.Event()
            readers: list[list[dict[str, Any]]] = [[], []]
            workers = [traffic.poster(p, queue, stop, max_batch=3) for p in range(3)]
            workers += [traffic.lister(queue, stop, seen) for seen in readers]
            tasks = [asyncio.create_task(w) for w in workers]
            await asyncio.sleep(1.0)

            # fault 1: kill -9, then restart (same port and data, empty script cache)
            server.kill()
            killed_at = loop.time()
            await asyncio.sleep(0.3)
            await probe_unavailable(traffic, problems, "Redis killed")
            await asyncio.sleep(0.7)
            restarting_at = loop.time()
            server.start()
            back_at = loop.time()
            recovery_kill = await traffic.recovery(back_at)
            await asyncio.sleep(1.5)

            # fault 2: Redis paused: connections open, nothing answers
            pid = server.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            paused_at = loop.time()
            await asyncio.sleep(0.5)
            await probe_unavailable(traffic, problems, "Redis paused")
            await asyncio.sleep(1.5)
            os.kill(pid, signal.SIGCONT)
            resumed_at = loop.time()
            recovery_pause = await traffic.recovery(resumed_at)
            await asyncio.sleep(1.5)
            stop.set()
            await asyncio.gather(*tasks)

            check_answers(traffic, problems, allowed={200, 201, 204, 503})
            hangs = [o for o in traffic.outcomes if o.status is None]
            if hangs:
                problems.append(f"{len(hangs)} requests got no answer, e.g. {hangs[:3]}")
            while_killed = [
                o for o in traffic.outcomes if o.start > killed_at + 0.05 and o.end < restarting_at
            ]
            if not while_killed or any(o.status != 503 for o in while_killed):
                problems.append(
                    f"while Redis was dead: {Counter(o.status for o in while_killed)} (want 503s)"
                )
            while_paused = [
                o
                for o in traffic.outcomes
                if o.start > paused_at + 0.05 and o.end < resumed_at and o.kind != "probe"
            ]
            if not while_paused or any(o.status != 503 for o in while_paused):
                problems.append(
                    f"while Redis was paused: {Counter(o.status for o in while_paused)} (want 503s)"
                )
            for name, took in (("restart", recovery_kill), ("resume", recovery_pause)):
                if took is None or took > RECOVERY_BOUND:
                    problems.append(f"no 2xx within {RECOVERY_BOUND} s after Redis {name}")
            settled = [
                o
                for o in traffic.outcomes
                if (back_at + 1.0 < o.start and o.end < paused_at)
                or (resumed_at + 1.0 < o.start and o.kind != "probe")
            ]
            flapping = Counter(o.status for o in settled if o.status not in (200, 201, 204))
            if flapping:
                problems.append(f"after recovery, still failing: {dict(flapping)}")
            for n, seen in enumerate(readers):
                check_reader(seen, problems, f"reader {n} following its marker")
            stored = await check_stored(
                session, svc.base, project, queue, traffic.batches, problems
            )
        server_500s = svc.check_log(problems)
    report(
        f"redis-down[{driver}]",
        requests=len(traffic.outcomes),
        statuses=dict(traffic.statuses()),
        faults="kill-9+restart,SIGSTOP+SIGCONT",
        recovery_after_restart_s=None if recovery_kill is None else round(recovery_kill, 2),
        recovery_after_resume_s=None if recovery_pause is None else round(recovery_pause, 2),
        server_500s=server_500s,
        **stored,
    )
    assert not problems, "\n".join(problems)


# -- 2. Durability: kill -9 under load ------------------------------------------------------------


@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_acknowledged_messages_survive_kill_9(driver: str, tmp_path: Path) -> None:
    project = "durable-" + uuid.uuid4().hex
    queue = "durable.q"
    problems: list[str] = []
    kills = 2
    with (
        own_redis(tmp_path / "redis", appendfsync="always") as server,
        LiveService(server.url, driver, tmp_path / "serve.log", *FAST_FAIL) as svc,
    ):
        async with client_session() as session:
            traffic = Traffic(session, svc.base, project)
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(traffic.poster(p, queue, stop, max_batch=3)) for p in range(4)
            ]
            for _ in range(kills):
                await asyncio.sleep(1.0)
                server.kill()
                await asyncio.sleep(0.4)
                server.start()
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*tasks)
            check_answers(traffic, problems, allowed={201, 503})
            stored = await check_stored(
                session, svc.base, project, queue, traffic.batches, problems
            )
        server_500s = svc.check_log(problems)
    report(
        f"durability[{driver}]",
        posts=len(traffic.batches),
        statuses=dict(traffic.statuses()),
        kill9=kills,
        server_500s=server_500s,
        **stored,
    )
    assert stored["acked"] > 0
    assert not problems, "\n".join(problems)


# -- 3. Script cache flushed under load ------------------------------------------------------------


async def churn(traffic: Traffic, queue: str, stop: asyncio.Event) -> None:
    """Every write path that runs a script: post, claim, delete with claim, release, pop,
    create and delete a queue."""
    headers = headers_for(traffic.project)
    path = messages_path(queue)
    while not stop.is_set():
        payload = {"messages": [{"body": {"churn": i}, "ttl": LONG_TTL} for i in range(3)]}
        await traffic.request("churn", "POST", path, headers, payload)
        status, doc = await traffic.request(
            "claim", "POST", f"/v2/queues/{queue}/claims?limit=2", headers, {"ttl": 60}
        )
        if status == 201:
            for message in doc["messages"]:
                await traffic.request("delete", "DELETE", message["href"], headers)
        await traffic.request("pop", "DELETE", f"{path}?pop=1", headers)
        status, doc = await traffic.request(
            "claim", "POST", f"/v2/queues/{queue}/claims?limit=5", headers, {"ttl": 60}
        )
        if status == 201:
            claim = re.findall(r"claim_id=([0-9a-f]+)", doc["messages"][0]["href"])[0]
            await traffic.request(
                "release", "DELETE", f"/v2/queues/{queue}/claims/{claim}", headers
            )
        await traffic.request("queue", "PUT", f"/v2/queues/{queue}.tmp", headers)
        await traffic.request("queue", "DELETE", f"/v2/queues/{queue}.tmp", headers)
        await traffic.request("purge", "POST", f"/v2/queues/{queue}.other/purge", headers)


async def flush_run(
    driver: str, tmp_path: Path, name: str, period: float, seconds: float, allowed: set[int]
) -> None:
    """Load (posters, a reader, every scripted write) while SCRIPT FLUSH runs every period."""
    project = "flush-" + uuid.uuid4().hex
    queue = "flush.q"
    problems: list[str] = []
    flushes = 0
    with (
        own_redis(tmp_path / "redis", appendfsync="no") as server,
        LiveService(server.url, driver, tmp_path / "serve.log") as svc,
    ):
        redis = admin(server)
        async with client_session() as session:
            traffic = Traffic(session, svc.base, project)
            stop = asyncio.Event()
            seen: list[dict[str, Any]] = []
            tasks = [asyncio.create_task(traffic.poster(p, queue, stop, 3)) for p in range(3)]
            tasks.append(asyncio.create_task(traffic.lister(queue, stop, seen)))
            tasks += [asyncio.create_task(churn(traffic, "churn.q", stop)) for _ in range(2)]
            deadline = asyncio.get_running_loop().time() + seconds
            while asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(period)
                await redis.script_flush()
                flushes += 1
            stop.set()
            await asyncio.gather(*tasks)
            await redis.aclose()
            check_answers(traffic, problems, allowed=allowed)
            hangs = [o for o in traffic.outcomes if o.status is None]
            if hangs:
                problems.append(f"{len(hangs)} requests got no answer, e.g. {hangs[:3]}")
            check_reader(seen, problems, "a reader following its marker")
            stored = await check_stored(
                session, svc.base, project, queue, traffic.batches, problems
            )
            async with session.get(svc.base + "/v2/health", headers=headers_for(project)) as resp:
                health = await resp.json()
        server_500s = svc.check_log(problems)
    if driver == "lua" and health["noscript_reloads"] == 0:
        problems.append("the flushes never made the lua driver reload a script")
    report(
        f"{name}[{driver}]",
        requests=len(traffic.outcomes),
        statuses=dict(traffic.statuses()),
        script_flushes=flushes,
        noscript_reloads=health["noscript_reloads"],
        server_500s=server_500s,
        **stored,
    )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_script_flush_under_load_fails_nothing(driver: str, tmp_path: Path) -> None:
    """SCRIPT FLUSH every 200 ms: not one request may fail."""
    await flush_run(driver, tmp_path, "script-flush", 0.2, 3.0, allowed={200, 201, 204})


@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_script_flush_storm_is_never_a_500(driver: str, tmp_path: Path) -> None:
    """SCRIPT FLUSH back to back, so that one also lands between a reload and its
    retry: a request may then be a 503 (try again), never a 500, and nothing
    acknowledged is lost."""
    await flush_run(driver, tmp_path, "script-flush-storm", 0.001, 1.5, {200, 201, 204, 503})


# -- 4. Clients that go away ----------------------------------------------------------------------


def http_request(method: str, path: str, project: str, client: str, body: bytes = b"") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Client-ID: {client}\r\nX-Project-ID: {project}\r\n"
    )
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def parse_responses(data: bytes) -> list[tuple[int, bytes]]:
    """The complete HTTP responses at the start of data (status, body)."""
    out = []
    while b"\r\n\r\n" in data:
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(rest) < length:
            break
        out.append((status, rest[:length]))
        data = rest[length:]
    return out


@dataclass
class Chaos:
    """What the disconnecting clients did and what the complete answers said."""

    sent: Counter[str] = field(default_factory=Counter)
    complete: Counter[str] = field(default_factory=Counter)
    posted: dict[str, list[str]] = field(default_factory=dict)  # tag -> ids (a 201 was read)
    mismatches: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)


@pytest.mark.parametrize("driver", PROCESS_DRIVERS)
async def test_disconnecting_clients_leave_nothing_broken(driver: str, tmp_path: Path) -> None:
    project = "cancel-" + uuid.uuid4().hex
    queue = "cancel.q"
    client = str(uuid.uuid4())
    problems: list[str] = []
    chaos = Chaos()
    raw_count, aio_count, control_count = 2000, 1000, 200
    with (
        own_redis(tmp_path / "redis", appendfsync="no") as server,
        LiveService(
            server.url, driver, tmp_path / "serve.log", "--pool-size", str(POOL_SIZE)
        ) as svc,
    ):
        redis = admin(server)
        headers = headers_for(project, client)
        path = messages_path(queue)
        async with client_session() as session:
            # messages with known bodies, to ask for by id
            known: dict[str, Any] = {}
            for start in range(0, 40, 20):
                bodies = [{"known": i} for i in range(start, start + 20)]
                async with session.post(
                    svc.base + path,
                    headers=headers,
                    json={"messages": [{"body": b, "ttl": LONG_TTL} for b in bodies]},
                ) as resp:
                    assert resp.status == 201, await resp.text()
                    hrefs = (await resp.json())["resources"]
                known.update({h.rsplit("/", 1)[1]: b for h, b in zip(hrefs, bodies, strict=True)})
            known_ids = list(known)
            # a queue whose first page is a few MB: its readers go away mid-response
            for i in range(PAGE):
                async with session.post(
                    svc.base + messages_path("big.q"),
                    headers=headers,
                    json={"messages": [{"body": {"big": i, "pad": "x" * 200_000}}]},
                ) as resp:
                    assert resp.status == 201, await resp.text()

            def check_reply(request_kind: str, detail: str, status: int, body: bytes) -> None:
                chaos.statuses[status] += 1
                chaos.complete[request_kind] += 1
                if request_kind == "post":
                    if status != 201:
                        chaos.mismatches.append(f"post {detail}: {status} {body[:200]!r}")
                        return
                    hrefs = json.loads(body)["resources"]
                    chaos.posted[detail] = [h.rsplit("/", 1)[1] for h in hrefs]
                elif request_kind == "get":
                    doc = json.loads(body) if status == 200 else None
                    if doc is None or doc["id"] != detail or doc["body"] != known[detail]:
                        chaos.mismatches.append(f"GET {detail}: {status} {body[:200]!r}")
                elif request_kind == "list" and status != 200:
                    chaos.mismatches.append(f"list: {status} {body[:200]!r}")

            def post_payload(tag: str) -> bytes:
                doc = {
                    "messages": [{"body": {"tag": tag, "k": k}, "ttl": LONG_TTL} for k in (0, 1)]
                }
                return json.dumps(doc).encode()

            async def raw_client(i: int) -> None:
                kind = random.choice(["post", "post", "get", "list", "pipelined"])
                if i % 50 == 0:
                    kind = "big-list"
                tag = f"raw-{i}"
                target = random.choice(known_ids)
                post = http_request("POST", path, project, client, post_payload(tag))
                get = http_request("GET", f"{path}/{target}", project, client)
                listing = http_request("GET", f"{path}?echo=true&limit=5", project, client)
                expected: list[tuple[str, str]]
                if kind == "big-list":
                    big = http_request(
                        "GET", f"{messages_path('big.q')}?limit={PAGE}", project, client
                    )
                    chaos.sent[kind] += 1
                    reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
                    try:
                        writer.write(big)
                        with contextlib.suppress(TimeoutError, ConnectionError):
                            async with asyncio.timeout(CLIENT_TIMEOUT):
                                await reader.read(65536)  # the first bytes of a few MB
                    finally:  # also when the run's own deadline cancels this client
                        writer.transport.abort()
                    return
                if kind == "post":
                    payload, expected = post, [("post", tag)]
                elif kind == "get":
                    payload, expected = get, [("get", target)]
                elif kind == "list":
                    payload, expected = listing, [("list", "")]
                else:
                    payload, expected = post + get, [("post", tag), ("get", target)]
                # Most send everything; some stop inside the headers or the body.
                cut = len(payload) if random.random() < 0.7 else random.randint(1, len(payload))
                linger = random.random() < 0.5
                # before the reply is ready, or about when it is
                wait = random.choice((random.uniform(0, 0.003), random.uniform(0.003, 0.03)))
                chaos.sent[kind] += 1
                reader, writer = await asyncio.open_connection("127.0.0.1", svc.port)
                got = b""
                try:
                    writer.write(payload[:cut])
                    if random.random() < 0.7:
                        with contextlib.suppress(TimeoutError, ConnectionError):
                            async with asyncio.timeout(wait):
                                while len(parse_responses(got)) < len(expected):
                                    chunk = await reader.read(65536)
                                    if not chunk:
                                        break
                                    got += chunk
                    else:
                        await asyncio.sleep(wait)
                finally:
                    sock = writer.get_extra_info("socket")
                    if linger and sock is not None:
                        # an abortive close: the server sees a reset, not an end of stream
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    writer.close()
                    with contextlib.suppress(ConnectionError):
                        await writer.wait_closed()
                for (what, detail), (status, body) in zip(
                    expected, parse_responses(got), strict=False
                ):
                    check_reply(what, detail, status, body)

            async def aio_client(i: int) -> None:
                kind = random.choice(["post", "get"])
                tag = f"aio-{i}"
                target = random.choice(known_ids)
                chaos.sent["aio-" + kind] += 1

                async def call() -> tuple[int, bytes]:
                    if kind == "post":
                        request = session.post(
                            svc.base + path,
                            headers={**headers, "Content-Type": "application/json"},
                            data=post_payload(tag),
                        )
                    else:
                        request = session.get(f"{svc.base}{path}/{target}", headers=headers)
                    async with request as resp:
                        return resp.status, await resp.read()

                try:
                    status, body = await asyncio.wait_for(call(), random.uniform(0.0002, 0.01))
                except TimeoutError:
                    return
                check_reply(kind, tag if kind == "post" else target, status, body)

            async def control(i: int) -> None:
                """Complete requests in the middle of it all: each reply is its own."""
                tag = f"control-{i}"
                async with session.post(
                    svc.base + path,
                    headers={**headers, "Content-Type": "application/json"},
                    data=post_payload(tag),
                ) as resp:
                    check_reply("post", tag, resp.status, await resp.read())
                ids = chaos.posted.get(tag, [])
                for k, message_id in enumerate(ids):
                    async with session.get(
                        f"{svc.base}{path}/{message_id}", headers=headers
                    ) as resp:
                        doc = await resp.json() if resp.status == 200 else None
                    if doc is None or doc["body"] != {"tag": tag, "k": k}:
                        chaos.mismatches.append(f"control {tag}: {message_id} -> {doc}")

            jobs: list[Callable[[], Awaitable[None]]] = []
            jobs += [functools.partial(raw_client, i) for i in range(raw_count)]
            jobs += [functools.partial(aio_client, i) for i in range(aio_count)]
            jobs += [functools.partial(control, i) for i in range(control_count)]
            random.shuffle(jobs)
            await bounded_gather(64, jobs)
            await asyncio.sleep(0.5)  # handlers of gone clients finish

            # 1. every reply that arrived whole was the reply to its own request
            problems += [f"reply mismatch: {m}" for m in chaos.mismatches[:10]]
            # ...and what it acknowledged is stored, under each id it returned
            wrong: list[str] = []
            for tag, ids in chaos.posted.items():
                for k, message_id in enumerate(ids):
                    url = f"{svc.base}{path}/{message_id}"
                    async with session.get(url, headers=headers) as resp:
                        doc = await resp.json() if resp.status == 200 else None
                    if doc is None or doc["body"] != {"tag": tag, "k": k}:
                        wrong.append(f"{tag}/{k} {message_id}: {doc}")
            if wrong:
                problems.append(f"{len(wrong)} acknowledged messages wrong or missing: {wrong[:5]}")
            feed = await read_feed(session, svc.base, project, queue)
            listed_ids = [m["id"] for m in feed]
            if len(listed_ids) != len(set(listed_ids)):
                problems.append("the listing repeats messages")
            tags = Counter((m["body"]["tag"], m["body"]["k"]) for m in feed if "tag" in m["body"])
            doubled = [t for t, c in tags.items() if c > 1]
            if doubled:
                problems.append(f"messages stored twice: {doubled[:5]}")

            # 2. the service's Redis connections come back within the pool size
            connections = await service_connections(redis)
            deadline = asyncio.get_running_loop().time() + 3
            while len(connections) > POOL_SIZE and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.2)
                connections = await service_connections(redis)
            if len(connections) > POOL_SIZE:
                problems.append(
                    f"the service holds {len(connections)} Redis connections, pool size "
                    f"{POOL_SIZE}: {[c.get('cmd') for c in connections]}"
                )

            # 3. nothing half-written
            layout = await check_layout(redis, project, queue, problems)
            await redis.aclose()
            async with session.get(svc.base + "/v2/ping", headers=headers) as resp:
                if resp.status != 204:
                    problems.append(f"the service is unwell afterwards: ping {resp.status}")
        count_500 = svc.check_log(problems)
    report(
        f"cancellation[{driver}]",
        requests=raw_count + aio_count + control_count,
        sent=dict(chaos.sent),
        complete_replies=sum(chaos.complete.values()),
        statuses=dict(chaos.statuses),
        acked_checked=sum(len(v) for v in chaos.posted.values()),
        redis_connections=len(connections),
        pool_size=POOL_SIZE,
        server_500s=count_500,
        **layout,
    )
    assert not problems, "\n".join(problems)


async def service_connections(redis: aioredis.Redis) -> list[dict[str, str]]:
    clients = await redis.client_list(_type="normal")
    return [c for c in clients if c.get("name") != ADMIN_NAME]


async def check_layout(
    redis: aioredis.Redis, project: str, queue: str, problems: list[str]
) -> dict[str, int]:
    """The queue's keys as base.py documents them: no message half-written."""
    prefix = f"fs:{{{project}/{queue}}}"
    scored: list[Any] = await redis.zrange(prefix + ":idx", 0, -1, withscores=True)
    index = {member.decode(): int(score) for member, score in scored}
    members: list[Any] = await redis.zrange(prefix + ":exp", 0, -1)
    expiry = {member.decode() for member in members}
    hashes = 0
    orphans = 0
    async for raw in redis.scan_iter(match=prefix + ":r:*", count=1000):
        key = raw.decode()
        message_id = key.rsplit(":", 1)[1]
        hashes += 1
        stored: Any = await redis.get(key)
        row = record.Row.read(message_id, stored, [None] * len(record.ROW))
        seq, ttl = (None if row is None else row.seq), await redis.pttl(key)
        if ttl < 0:
            problems.append(f"{key} has no expiry (PTTL {ttl})")
        if seq is None:
            orphans += 1  # a body whose index script never ran: allowed, it expires
            if message_id in index:
                problems.append(f"{key} is indexed but has no seq")
            continue
        if index.get(message_id) != seq:
            problems.append(f"{key} (seq {seq}) is not in {prefix}:idx as such")
        if message_id not in expiry:
            problems.append(f"{key} is not in {prefix}:exp")
    for message_id in index:
        if not await redis.exists(f"{prefix}:r:{message_id}"):
            problems.append(f"{prefix}:idx lists {message_id} whose record is gone")
    return {"message_hashes": hashes, "indexed": len(index), "orphan_bodies": orphans}
