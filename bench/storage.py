"""What a message costs its Redis: the ``storage`` part of ``python -m bench``
(issue 30), side by side with a Redis Stream on the same Redis in one run.

Measured from outside, on the suite's own redis-server (a free port, default
configuration: no listpack tuning), ``FLUSHALL`` first:

* N single-message posts (``--storage-messages``, default 20,000) of a
  100-byte JSON body over HTTP to a real ``feedsvc serve``, once per storage
  layout (``--storage-layout records``: a key per message; ``segments``:
  packed segments, docs/design.md) and driver (lua, watch), each its own
  process and queue, ``CONCURRENCY`` posts in flight; then one reader
  paging through them 10 at a time, following the ``next`` links; and
  ``LONE_POSTS`` more one at a time (nothing for the service to combine:
  the worst case, against the same XADD anchor); against
  the same N bodies ``XADD``\\ ed to a stream with the fields a message
  needs (ttl, client id, expiry), pipelined ``PIPELINE`` at a time, and read
  back with ``XRANGE COUNT 10``, one per round trip.
* per message: Redis memory (``used_memory`` after ``MEMORY PURGE``, the
  delta over the posts divided by N) and Redis main-thread CPU
  (``used_cpu_{sys,user}_main_thread`` of ``INFO cpu``, else the process's);
  per batch of 100 (a POST of 100 against 100 ``XADD``\\ s in one pipeline);
  per page of 10; the worst page filters (``echo=true&include_claimed=true``
  on a queue where every other message is delayed and an eighth are
  claimed); ``INFO commandstats`` per post (calls and µs per call of each
  command, over the N posts).
* 1 KiB and 10 KiB bodies: memory per message against a stream's, per
  layout (N / 10 of each, ``BIG_MIN`` at least).
* the expiry reclaim, per layout: M messages (``--storage-reclaim`` or
  ``--reclaim``, default 20,000; the issue's figure is 1,000,000) behind one
  14-day message, with ttls of ``SHORT_TTLS`` seconds (the service runs
  with ``--min-message-ttl 1``), posted 100 a POST. The start is read
  after a warm-up (the run in small on a queue of its own, ``warm_up``)
  has run every command the run will, so that no command's latency
  histogram is made during the run and counted as the messages' memory
  (the commands first run after the start are reported all the same).
  Once all are past their ttl, ``used_memory`` is watched with no traffic
  until it is back within ``WITHIN`` of where it started, makes no new low
  for ``PLATEAU_S`` (longer than a review takes to come due), or
  ``RECLAIM_WAIT_S`` pass; then (if still not back) one-message posts of
  ttl 1 s, as a queue in use sees them, until it is back, stops falling for
  ``PLATEAU_POSTS`` posts, or ``RECLAIM_POSTS`` (or M / 50) posts were
  sent. What is true is reported: the share of the added memory still held
  and how long it took.
* the hot-queue ceiling: messages per second one Redis core indexes for one
  queue in POSTs of 100 (1 / its CPU per message), against XADD pipelined.

Every figure is reported per variant, ``<layout>_<driver>`` (e.g.
``segments_lua``); ratios are feedsvc / stream (``ratio_<variant>``), each
against the stream measured just before and just after that variant (the
mean of the two: ``beside``), and ``stream`` is the mean of those anchors.
CPU in µs, memory in bytes, per message unless the row says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson
import redis

from bench.service import PRODUCER, Service, SuiteLike, serving
from feedsvc.services.redriver import IDLE_LOOK as REDRIVE_LOOK
from feedsvc.storage.keys import QueueKeys
from feedsvc.storage.reviews import REVIEW_AFTER_MS
from feedsvc.storage.segments import NEW_START
from feedsvc.storage.sweeper import IDLE_LOOK

READER = "d1d3e5c2-86a6-4a5e-9c7b-3c8a4d1f0b11"
PIPELINE = 32  # XADDs per round trip for the per-message anchor
#: posts in flight against one service: as many as the anchor's XADDs a round
#: trip, so both sides are offered the same concurrency (the lua driver
#: combines the posts to a queue that arrive while its call is in flight)
CONCURRENCY = PIPELINE
#: one-message posts sent one at a time (nothing to combine: the worst case)
LONE_POSTS = 1000
BATCH = 100
PAGE = 10
BODY_BYTES = 100
BIG_BODIES = (1024, 10240)
#: at least this many of each (N / 10 by default): fewer are lost in used_memory's noise
BIG_MIN = 200
TTL = 3600
LONG_TTL = 1209600  # the 14-day message in front of the reclaim queue
SHORT_TTLS = (10, 20)  # s: none expires before the M are posted
WITHIN = 0.05  # "back": used_memory within 5 % of where it started
RECLAIM_WAIT_S = 60.0
#: no new low of used_memory for this long: the idle wait stops (a segment's
#: review comes REVIEW_AFTER_MS after its earliest expiry, the sweep loop
#: looks every IDLE_LOOK s at most)
PLATEAU_S = REVIEW_AFTER_MS / 1000 + IDLE_LOOK
#: the warm-up's wait after its batch was posted: the service's loops
#: (sweep, redrives) have each looked once, and in segments the batch's
#: reviews ran
WARM_LOOKS_S = max(IDLE_LOOK, REDRIVE_LOOK) + 2
WARM_WAIT_S = 1 + REVIEW_AFTER_MS / 1000 + WARM_LOOKS_S
POLL_S = 0.5
RECLAIM_POSTS = 2000  # at least this bound (and 2 per 100 messages), after the idle wait
PLATEAU_POSTS = 300  # posts with no new low of used_memory: it will not come back
PROJECT = "bench"
HEADERS = {"X-Project-ID": PROJECT, "Content-Type": "application/json"}
#: the storage layouts (--storage-layout) and the variants measured: each layout on each driver
LAYOUTS = ("records", "segments")
VARIANTS = tuple((layout, driver) for layout in LAYOUTS for driver in ("lua", "watch"))


class StorageSuite(SuiteLike, Protocol):
    storage_messages: int
    storage_reclaim: int


def body(n: int, size: int) -> dict[str, Any]:
    """A JSON body whose compact encoding (as feedsvc stores it) is size bytes."""
    bare = len(orjson.dumps({"n": n, "pad": ""}))
    return {"n": n, "pad": "x" * max(0, size - bare)}


# -- Redis, measured from outside -------------------------------------------------


def redis_cpu_us(client: redis.Redis) -> float:
    """The main thread's CPU time so far (the process's on a Redis without it), µs."""
    info = client.info("cpu")
    if "used_cpu_sys_main_thread" in info:
        return 1e6 * float(info["used_cpu_sys_main_thread"] + info["used_cpu_user_main_thread"])
    return 1e6 * float(info["used_cpu_sys"] + info["used_cpu_user"])


def used_memory(client: redis.Redis) -> int:
    """``used_memory`` after ``MEMORY PURGE``, less the clients' buffers: a
    service's connections hold tens of KiB of query and reply buffers that
    grow, shrink and go when it stops, which is not what its data costs."""
    client.memory_purge()
    info = client.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


def settle(client: redis.Redis) -> None:
    """Until only this client is connected (a service that stopped is gone), 10 s at most."""
    deadline = time.monotonic() + 10
    while client.info("clients")["connected_clients"] > 1 and time.monotonic() < deadline:
        time.sleep(0.05)


@dataclass
class Cost:
    """What some work cost Redis: CPU µs, bytes of memory, and each command's
    (calls, µs per call) over it (``INFO commandstats``)."""

    cpu_us: float
    memory: int
    commands: dict[str, tuple[int, float]] = field(default_factory=dict)


def measure(client: redis.Redis, work: Callable[[], object]) -> Cost:
    """What work cost Redis. ``INFO commandstats`` is read before and after
    rather than reset: ``CONFIG RESETSTAT`` frees each command's latency
    histogram (Redis 7, ≈ 34 KiB each), which the work would then allocate
    again and be charged for."""
    before = _commandstats(client)
    memory, cpu = used_memory(client), redis_cpu_us(client)
    work()
    cpu = redis_cpu_us(client) - cpu
    memory = used_memory(client) - memory
    after = _commandstats(client)
    commands = {}
    for name, (total_calls, total_usec) in after.items():
        calls = total_calls - before.get(name, (0, 0.0))[0]
        usec = total_usec - before.get(name, (0, 0.0))[1]
        if calls > 0 and name not in ("info", "memory|purge"):  # this function's own
            commands[name] = (calls, usec / calls)
    return Cost(cpu, memory, commands)


def _commandstats(client: redis.Redis) -> dict[str, tuple[int, float]]:
    """command -> (calls, µs in all) so far."""
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
        for name, v in client.info("commandstats").items()
    }


# -- feedsvc, over HTTP -----------------------------------------------------------


async def _post_all(
    url: str, path: str, payloads: Sequence[dict[str, Any]], client: str, concurrency: int
) -> int:
    """POST each payload, concurrency at a time; the number of failures."""
    failures = 0
    todo = iter(payloads)
    headers = {**HEADERS, "Client-ID": client}

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal failures
        for payload in todo:
            async with http.post(path, data=orjson.dumps(payload), headers=headers) as r:
                await r.read()
                failures += r.status != 201

    async with aiohttp.ClientSession(url) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return failures


def post_all(
    svc: Service,
    queue: str,
    payloads: Sequence[dict[str, Any]],
    client: str = PRODUCER,
    concurrency: int = CONCURRENCY,
) -> int:
    path = f"/v2/queues/{queue}/messages"
    return asyncio.run(_post_all(svc.url, path, payloads, client, concurrency))


def singles(sizes: int, count: int, ttl: int = TTL, start: int = 0) -> list[dict[str, Any]]:
    return [{"messages": [{"ttl": ttl, "body": body(start + i, sizes)}]} for i in range(count)]


async def _page_all(url: str, queue: str, query: str) -> tuple[int, int]:
    """Follow the next links from the head until a page comes back empty:
    (pages read, messages seen)."""
    headers = {**HEADERS, "Client-ID": READER}
    href: str | None = f"/v2/queues/{queue}/messages?limit={PAGE}{query}"
    pages = seen = 0
    async with aiohttp.ClientSession(url) as http:
        while href:
            async with http.get(href, headers=headers) as r:
                assert r.status == 200, (r.status, await r.text())
                page = await r.json()
            pages += 1
            seen += len(page["messages"])
            links = [link["href"] for link in page["links"] if link["rel"] == "next"]
            href = links[0] if page["messages"] and links else None
    return pages, seen


def page_all(svc: Service, queue: str, query: str = "") -> tuple[int, int]:
    return asyncio.run(_page_all(svc.url, queue, query))


# -- the stream anchor ------------------------------------------------------------


def xadd_all(client: redis.Redis, key: str, size: int, count: int, per_trip: int) -> None:
    """count entries of a size-byte body with ttl, client id and expiry,
    per_trip XADDs a round trip."""
    now = int(time.time() * 1000)
    for first in range(0, count, per_trip):
        pipe = client.pipeline(transaction=False)
        for n in range(first, min(count, first + per_trip)):
            fields = {"t": TTL, "u": PRODUCER, "e": now + TTL * 1000,
                      "b": orjson.dumps(body(n, size))}  # fmt: skip
            pipe.xadd(key, fields)  # type: ignore[arg-type]
        pipe.execute()


def xrange_all(client: redis.Redis, key: str) -> int:
    """Page through a stream PAGE entries a round trip; the pages read."""
    start, pages = "-", 0
    while True:
        entries = client.xrange(key, min=start, count=PAGE)
        pages += 1
        if not entries:
            return pages
        last = entries[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else str(last))


async def _page_stream(url: str, key: str) -> int:
    """Page through a stream served by bench/stream_feed.py as _page_all
    pages through a queue (the same reader, one page after the other);
    the pages read."""
    pages, after = 0, None
    async with aiohttp.ClientSession(url) as http:
        while True:
            params: dict[str, str] = {} if after is None else {"after": after}
            async with http.get(f"/streams/{key}", params=params) as r:
                assert r.status == 200, (r.status, await r.text())
                entries = (await r.json())["entries"]
            pages += 1
            if not entries:
                return pages
            after = entries[-1][0]


@contextlib.contextmanager
def stream_pages(redis_url: str, key: str) -> Iterator[Callable[[], int]]:
    """A reader paging through the stream at key over HTTP, served by
    bench/stream_feed.py (started first, so its start is not measured)."""
    with serving("bench.stream_feed", redis_url) as port:
        yield lambda: asyncio.run(_page_stream(f"http://127.0.0.1:{port}", key))


# -- the part ---------------------------------------------------------------------


def _ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else math.nan


def part_storage(suite: StorageSuite) -> None:
    n = suite.storage_messages
    client = redis.Redis.from_url(suite.redis.url)
    phases: dict[str, float] = {}
    try:
        client.flushall()
        reclaims = {}
        for layout in LAYOUTS:
            began = time.monotonic()
            reclaims[layout] = expiry_reclaim(suite, client, suite.storage_reclaim, layout)
            settle(client)
            client.flushall()
            phases[f"reclaim_{layout}"] = time.monotonic() - began
        began = time.monotonic()
        streams = [stream_costs(client, suite.redis.url, n)]
        phases["stream"] = time.monotonic() - began
        variants, anchors = {}, {}
        for layout, driver in VARIANTS:
            began = time.monotonic()
            name = f"{layout}_{driver}"
            variants[name] = driver_costs(suite, client, layout, driver, n)
            phases[name] = time.monotonic() - began
            began = time.monotonic()
            streams.append(stream_costs(client, suite.redis.url, n))
            phases["stream"] += time.monotonic() - began
            anchors[name] = beside(streams[-2], streams[-1])
        stream = streams[0]
        began = time.monotonic()
        big = {
            layout: big_bodies(suite, client, max(BIG_MIN, n // 10), layout) for layout in LAYOUTS
        }
        phases["big_bodies"] = time.monotonic() - began
    finally:
        client.close()
    report(suite, stream, variants, anchors, big, reclaims)
    suite.add("storage: seconds taken", **phases, total=sum(phases.values()))


#: the stream's figures that a variant's are divided by
ANCHORED = ("memory", "post_us", "lone_us", "batch_us", "page_us", "page_paced_us")


def beside(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """A variant's anchor: the mean of the stream measured just before it
    and just after it. A shared machine drifts by whole factors over the
    minutes a run takes (a run saw XADD at 2.3 and at 5.9 µs within the
    hour); an anchor measured beside each variant keeps that drift out of
    the ratio."""
    return {key: (before[key] + after[key]) / 2 for key in ANCHORED}


def side_by_side(
    variants: dict[str, dict[str, Any]], key: str, anchors: dict[str, dict[str, float]]
) -> dict[str, object]:
    """Each variant's figure, the stream's (the mean of the variants'
    anchors), then each variant's ratio to its own anchor."""
    values: dict[str, object] = {name: costs[key] for name, costs in variants.items()}
    values["stream"] = sum(a[key] for a in anchors.values()) / len(anchors)
    values |= {
        f"ratio_{name}": _ratio(costs[key], anchors[name][key]) for name, costs in variants.items()
    }
    return values


def report(
    suite: StorageSuite,
    stream: dict[str, Any],
    variants: dict[str, dict[str, Any]],
    anchors: dict[str, dict[str, float]],
    big: dict[str, dict[int, tuple[float, float]]],
    reclaims: dict[str, dict[str, object]],
) -> None:
    """The rows; stream: the first anchor (its commandstats), anchors: each
    variant's (beside)."""
    rows = (
        ("memory per message (100 B body), bytes", "memory"),
        ("Redis CPU per 1-message post, us", "post_us"),
        ("Redis CPU per 1-message post, one in flight, us", "lone_us"),
        ("Redis CPU per batch of 100, us", "batch_us"),
        ("Redis CPU per page of 10, us", "page_us"),
    )
    for label, key in rows:
        suite.add(f"storage: {label}", **side_by_side(variants, key, anchors))
    suite.add(
        "storage: Redis CPU per page of 10, against the stream paged over HTTP, us",
        **side_by_side(
            variants, "page_us", {n: {"page_us": a["page_paced_us"]} for n, a in anchors.items()}
        ),
    )
    suite.add(
        "storage: Redis CPU per worst page, us",
        filter="echo=true&include_claimed=true, 1/2 delayed, 1/8 claimed",
        **side_by_side(
            variants, "worst_us", {n: {"worst_us": a["page_us"]} for n, a in anchors.items()}
        ),
        **{f"shown_{name}": costs["worst_shown"] for name, costs in variants.items()},
    )
    for name, costs in variants.items():
        suite.add(f"storage: commandstats per post ({name})", **costs["commands"])
        suite.add(
            f"storage: run ({name})",
            messages=suite.storage_messages,
            written_in=costs["written_in"],
            pages=costs["pages"],
            seen=costs["seen"],
            worst_pages=costs["worst_pages"],
            errors=costs["errors"],
        )
    suite.add("storage: commandstats per XADD (stream)", **stream["commands"])
    for size in BIG_BODIES:
        values: dict[str, object] = {layout: big[layout][size][0] for layout in big}
        values["stream"] = theirs = min(big[layout][size][1] for layout in big)
        values |= {f"ratio_{layout}": _ratio(big[layout][size][0], theirs) for layout in big}
        suite.add(f"storage: memory per message ({size // 1024} KiB body), bytes", **values)
    for layout, reclaim in reclaims.items():
        suite.add(f"storage: expiry reclaim ({layout}, lua)", **reclaim)
    ceilings = {
        name: {"ceiling": 100e6 / c["batch_us"] if c["batch_us"] else math.nan}
        for name, c in variants.items()
    }
    xadd_ceilings = {
        name: {"ceiling": 100e6 / a["batch_us"] if a["batch_us"] else math.nan}
        for name, a in anchors.items()
    }
    suite.add(
        "storage: hot-queue ceiling, messages/s",
        **side_by_side(ceilings, "ceiling", xadd_ceilings),
    )


def _per_post(cost: Cost, posts: int) -> dict[str, float]:
    """calls per post and µs per call of each command: ``<cmd>_calls``, ``<cmd>_us``."""
    out: dict[str, float] = {}
    for name, (calls, us) in sorted(cost.commands.items()):
        out[f"{name}_calls"] = calls / posts
        out[f"{name}_us"] = us
    return out


def stream_costs(client: redis.Redis, redis_url: str, n: int) -> dict[str, Any]:
    """The anchor, on streams made for it and deleted after (it is measured
    again beside each variant, on the same Redis). page_paced_us: its pages
    read at a reader's pace, over HTTP (bench/stream_feed.py)."""
    client.delete("bench:stream", "bench:stream-batch")
    xadd_all(client, "bench:warm", BODY_BYTES, 10, 10)  # XADD's histogram exists before
    posts = measure(client, lambda: xadd_all(client, "bench:stream", BODY_BYTES, n, PIPELINE))
    pages: list[int] = []
    paging = measure(client, lambda: pages.append(xrange_all(client, "bench:stream")))
    with stream_pages(redis_url, "bench:stream") as read_paced:
        paced = measure(client, lambda: pages.append(read_paced()))
    batches = max(1, n // BATCH)
    batch = measure(
        client, lambda: xadd_all(client, "bench:stream-batch", BODY_BYTES, batches * BATCH, BATCH)
    )
    client.delete("bench:stream", "bench:stream-batch")
    return {
        "memory": posts.memory / n,
        "post_us": posts.cpu_us / n,
        "lone_us": posts.cpu_us / n,  # the same anchor: XADDs pipelined PIPELINE a trip
        "batch_us": batch.cpu_us / batches,
        "page_us": paging.cpu_us / pages[0],
        "page_paced_us": paced.cpu_us / pages[1],
        "commands": _per_post(posts, n),
    }


def layout_flags(layout: str) -> tuple[str, ...]:
    return ("--storage-layout", layout)


def driver_costs(
    suite: StorageSuite, client: redis.Redis, layout: str, driver: str, n: int
) -> dict[str, Any]:
    name = f"{layout}-{driver}"
    queue, batch_queue, worst = f"bstore-{name}", f"bstore-{name}-batch", f"bstore-{name}-worst"
    lone_queue, lone = f"bstore-{name}-lone", min(n, LONE_POSTS)
    log = suite.workdir / f"feedsvc-storage-{name}.log"
    flags = ("--driver", driver, "--max-messages-per-post", str(BATCH), *layout_flags(layout))
    with Service(suite.redis.url, log, *flags) as svc:
        for q in (queue, batch_queue, worst, lone_queue):
            # the queue's own keys exist before anything is measured
            post_all(svc, q, singles(BODY_BYTES, 1))
        errors: list[int] = []
        posts = measure(client, lambda: errors.append(post_all(svc, queue, singles(BODY_BYTES, n))))
        alone = measure(
            client,
            lambda: errors.append(
                post_all(svc, lone_queue, singles(BODY_BYTES, lone), concurrency=1)
            ),
        )
        read: list[tuple[int, int]] = []
        paging = measure(client, lambda: read.append(page_all(svc, queue)))
        batches = max(1, n // BATCH)
        payloads = [
            {
                "messages": [
                    {"ttl": TTL, "body": body(b * BATCH + i, BODY_BYTES)} for i in range(BATCH)
                ]
            }
            for b in range(batches)
        ]
        batch = measure(client, lambda: errors.append(post_all(svc, batch_queue, payloads)))
        worst_pages, worst_shown, worst_us = worst_page(svc, client, worst, max(40, n // 4))
    return {
        "written_in": written_in(client, queue),
        "memory": posts.memory / n,
        "post_us": posts.cpu_us / n,
        "lone_us": alone.cpu_us / lone,
        "batch_us": batch.cpu_us / batches,
        "page_us": paging.cpu_us / read[0][0],
        "pages": read[0][0],
        "seen": read[0][1],
        "errors": sum(errors),
        "commands": _per_post(posts, n),
        "worst_us": worst_us,
        "worst_pages": worst_pages,
        "worst_shown": worst_shown,
    }


def written_in(client: redis.Redis, queue: str) -> str:
    """The layout a queue's messages went to: a queue switched to segments
    has its first segment seq in its hash (a driver that writes no segments
    yet writes records whatever it is told)."""
    switched = client.hexists(QueueKeys.of(PROJECT, queue).meta, NEW_START)
    return "segments" if switched else "records"


def worst_page(svc: Service, client: redis.Redis, queue: str, count: int) -> tuple[int, int, float]:
    """A queue of count messages posted by the reader itself (shown only
    with echo=true), every other one delayed (passed over, read all the
    same), an eighth claimed (shown with include_claimed): read
    through with both filters on. (pages, messages shown, µs per page)."""
    payloads = [
        {"messages": [{"ttl": TTL, "delay": 900 if i % 2 else 0, "body": body(i, BODY_BYTES)}]}
        for i in range(count)
    ]
    post_all(svc, queue, payloads, client=READER)
    headers = {**HEADERS, "Client-ID": READER}
    for _ in range(max(1, count // 8 // 20)):
        svc_claim(svc, queue, headers)
    read: list[tuple[int, int]] = []
    cost = measure(
        client, lambda: read.append(page_all(svc, queue, "&echo=true&include_claimed=true"))
    )
    pages, shown = read[0]
    return pages, shown, cost.cpu_us / pages


def svc_claim(svc: Service, queue: str, headers: dict[str, str]) -> None:
    async def claim() -> None:
        async with aiohttp.ClientSession(svc.url) as http:
            path = f"/v2/queues/{queue}/claims?limit=20"
            async with http.post(path, json={"ttl": 300, "grace": 60}, headers=headers) as r:
                assert r.status in (201, 204), (r.status, await r.text())

    asyncio.run(claim())


def big_bodies(
    suite: StorageSuite, client: redis.Redis, count: int, layout: str
) -> dict[int, tuple[float, float]]:
    """{body size: (feedsvc's bytes per message, a stream entry's)}, lua driver."""
    out = {}
    log = suite.workdir / f"feedsvc-storage-big-{layout}.log"
    with Service(suite.redis.url, log, *layout_flags(layout)) as svc:
        for size in BIG_BODIES:
            queue, posts = f"bstore-{layout}-{size}", singles(size, count)
            post_all(svc, queue, singles(size, 1))
            ours = measure(client, functools.partial(post_all, svc, queue, posts))
            theirs = measure(
                client,
                functools.partial(
                    xadd_all, client, f"bench:stream-{layout}-{size}", size, count, PIPELINE
                ),
            )
            out[size] = (ours.memory / count, theirs.memory / count)
    return out


# -- expiry reclaim ---------------------------------------------------------------


async def _trickle(
    url: str, queue: str, client: redis.Redis, m: int, back: Callable[[int], bool]
) -> tuple[int, bool]:
    """One-message posts (ttl 1 s), one at a time, until used_memory is back,
    stops falling for PLATEAU_POSTS posts, or max(RECLAIM_POSTS, m / 50)
    were sent: (posts sent, whether it came back)."""
    headers = {**HEADERS, "Client-ID": PRODUCER}
    one = orjson.dumps({"messages": [{"ttl": 1, "body": body(0, BODY_BYTES)}]})
    best, best_at, posts = used_memory(client), 0, 0
    async with aiohttp.ClientSession(url) as http:
        while posts < max(RECLAIM_POSTS, m // 50) and posts - best_at < PLATEAU_POSTS:
            async with http.post(f"/v2/queues/{queue}/messages", data=one, headers=headers) as r:
                await r.read()
            posts += 1
            if posts % 10 == 0:
                memory = used_memory(client)
                if back(memory):
                    return posts, True
                if memory < best:
                    best, best_at = memory, posts
    return posts, False


class Plateau:
    """Whether used_memory stopped falling: no reading below the lowest so
    far for ``span`` seconds. Any new low, however small, starts the span
    again, so the wait never ends while memory is still coming back."""

    def __init__(self, first: int, at: float, span: float) -> None:
        self.best, self.best_at, self.span = first, at, span

    def reached(self, memory: int, at: float) -> bool:
        if memory < self.best:
            self.best, self.best_at = memory, at
            return False
        return at - self.best_at >= self.span


def _one_ttl_1s() -> dict[str, Any]:
    return {"messages": [{"ttl": 1, "body": body(0, BODY_BYTES)}]}


def warm_up(svc: Service, client: redis.Redis, queue: str, wait: float) -> None:
    """The reclaim in small on a queue of its own: posts (a 14-day message,
    a batch of ttl 1 s), their expiry, the reviews and clean-ups that follow,
    one-message posts after, and the readings. Every command the run will
    use has run, so its latency histogram (Redis 7: ≈ 34 KiB each, made at a
    command's first call and kept; ``measure``) exists before the start is
    read, and is not counted as memory the messages held. wait: seconds
    after the batch was posted: the service's loops have looked once (the
    records layout cleans up at the next post), in segments the batch's
    reviews ran too (``WARM_WAIT_S``)."""
    post_all(svc, queue, [{"messages": [{"ttl": LONG_TTL, "body": body(0, BODY_BYTES)}]}])
    batch = {"messages": [{"ttl": 1, "body": body(i, BODY_BYTES)} for i in range(BATCH)]}
    post_all(svc, queue, [batch])
    time.sleep(wait)
    post_all(svc, queue, [_one_ttl_1s() for _ in range(3)])
    used_memory(client)


def expiry_reclaim(
    suite: StorageSuite, client: redis.Redis, m: int, layout: str
) -> dict[str, object]:
    log = suite.workdir / f"feedsvc-storage-reclaim-{layout}.log"
    flags = ("--min-message-ttl", "1", "--max-messages-per-post", str(BATCH), *layout_flags(layout))
    queue = f"bstore-reclaim-{layout}"
    with Service(suite.redis.url, log, *flags) as svc:
        began = time.monotonic()
        wait = WARM_WAIT_S if layout == "segments" else min(WARM_WAIT_S, WARM_LOOKS_S)
        warm_up(svc, client, f"{queue}-warm", wait)
        # the queue's own keys exist before the start is read
        post_all(svc, queue, [_one_ttl_1s()])
        warm_s = time.monotonic() - began
        known = set(_commandstats(client))
        start = used_memory(client)
        post_all(svc, queue, [{"messages": [{"ttl": LONG_TTL, "body": body(0, BODY_BYTES)}]}])
        payloads = [
            {
                "messages": [
                    {"ttl": SHORT_TTLS[(b + i) % len(SHORT_TTLS)], "body": body(b + i, BODY_BYTES)}
                    for i in range(min(BATCH, m - b))
                ]
            }
            for b in range(0, m, BATCH)
        ]
        began = time.monotonic()
        errors = post_all(svc, queue, payloads)
        peak = used_memory(client)
        posted_s = time.monotonic() - began
        expired_at = began + posted_s + max(SHORT_TTLS) + 0.1
        time.sleep(max(0.0, expired_at - time.monotonic()))
        added = max(1, peak - start)

        def back(memory: int) -> bool:
            return memory <= start * (1 + WITHIN)

        # no traffic: what Redis gives back by itself, RECLAIM_WAIT_S at most
        memory = used_memory(client)
        plateau = Plateau(peak, time.monotonic(), PLATEAU_S)
        idle_s = math.nan
        while time.monotonic() - expired_at < RECLAIM_WAIT_S:
            memory = used_memory(client)
            if back(memory):
                idle_s = time.monotonic() - expired_at
                break
            if plateau.reached(memory, time.monotonic()):
                break
            time.sleep(POLL_S)
        idle_memory, idle_waited = memory, time.monotonic() - expired_at
        # traffic: one-message posts, as a queue in use sees them
        posts, traffic_s = 0, math.nan
        if not back(memory):
            t0 = time.monotonic()
            posts, done = asyncio.run(_trickle(svc.url, queue, client, m, back))
            traffic_s = time.monotonic() - t0 if done else math.nan
            memory = used_memory(client)
        # commands first run after the start: their histograms are in the
        # readings (none, if the warm-up did its work)
        unwarmed = sorted(set(_commandstats(client)) - known)
    return {
        "messages": m,
        "ttls_s": "/".join(str(t) for t in SHORT_TTLS) + f" behind {LONG_TTL}",
        "start_bytes": start,
        "peak_bytes": peak,
        "idle_waited_s": idle_waited,
        "idle_back_s": idle_s,
        "idle_held_pct": 100 * (idle_memory - start) / added,
        "idle_over_start_pct": 100 * (idle_memory - start) / start,
        "posts_after": posts,
        "posts_back_s": traffic_s,
        "end_held_pct": 100 * (memory - start) / added,
        "end_over_start_pct": 100 * (memory - start) / start,
        "errors": errors,
        "warm_up_s": warm_s,
        "unwarmed_commands": ",".join(unwarmed) or "none",
    }
