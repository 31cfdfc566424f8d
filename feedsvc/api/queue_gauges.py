"""Per-queue gauges for autoscaling: the queues ``--metrics-queues`` names.

For each listed queue ``/metrics`` reports its depth (live messages,
claimed ones included, as ``GET /v2/queues/{q}/stats`` counts ``total``),
its claimed messages, the age of its oldest live message, the messages in
its dead-letter queue (its ``_dead_letter_queue``; 0 without one) and its
followers (long polls and event streams, in every process), with the
labels ``project`` and ``queue``. KEDA and the Prometheus adapter scale
workers on them (docs/operations.md: Autoscaling).

Cardinality is the allow-list's, fixed at start (at most
``MAX_METRICS_QUEUES``): a queue a client invents never becomes a label.
There is no "top N queues by depth": Redis holds a queue index per project
but none of the projects, so finding the deepest queues would mean scanning
the keyspace.

The numbers come from Redis through the store's own ``queue_stats`` (the
one owner of those counts), so every process, and every worker of
``--workers``, reports the same values: take ``max`` over processes, never
``sum``. They are read when a scrape comes, at most once per
``--metrics-queue-refresh`` seconds (concurrent scrapes share one read), so
a scrape costs Redis at most a few calls per listed queue, however often
``/metrics`` is asked. If Redis cannot answer, the queue gauges are left out
of that scrape rather than shown stale.

Followers live in each process's memory, so for every worker to answer the
same, each process reports its followers of the listed queues to Redis
(``FeedStore.follower_counts``): those that changed, every
``REPORT_CHECK`` seconds, and all of them every ``REPORT_HEARTBEAT``; a
report lapses after ``REPORT_TTL``, so a process that died stops counting.
Reads add up the reports that hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from feedsvc.api.metrics import BEFORE_SCRAPE
from feedsvc.appkeys import CLOCK, LIVE, METRICS_REGISTRY, SETTINGS, STORE
from feedsvc.config import metrics_queue_names
from feedsvc.errors import Unavailable
from feedsvc.storage.base import FeedStore

log = logging.getLogger("feedsvc")

#: Queues read from Redis at once during a refresh (the rest wait their turn),
#: so a refresh of a long list does not take the whole connection pool.
CONCURRENT_READS = 8
LABELS = ["project", "queue"]


#: Seconds between a process's looks at its followers of the listed queues:
#: it reports to Redis those that changed since its last report ...
REPORT_CHECK = 0.5
#: ... and all of them again this often, each report holding REPORT_TTL, so
#: a process that dies without withdrawing its followers stops counting
#: within REPORT_TTL seconds.
REPORT_HEARTBEAT = 10.0
REPORT_TTL = 30.0


@dataclass(frozen=True, slots=True)
class QueueReading:
    depth: int
    claimed: int
    oldest_age: float  # seconds; 0 when the queue is empty
    dead_letters: int
    followers: int


class QueueGauges(Collector):
    """The allow-listed queues' gauges; ``refresh`` before each scrape."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        settings = app[SETTINGS]
        self._queues = metrics_queue_names(settings.metrics_queues)
        self._refresh_ms = settings.metrics_queue_refresh * 1000
        self._readings: dict[tuple[str, str], QueueReading] | None = None
        self._read_at_ms: int | None = None
        self._reading: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Read the queues from Redis, unless the last reading is recent enough."""
        if not self._queues or self._app.get(STORE) is None:
            return
        now = self._app[CLOCK].now_ms()
        fresh = self._read_at_ms is not None and now - self._read_at_ms < self._refresh_ms
        if fresh and self._readings is not None:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read())
        # shielded: a scraper that hangs up does not cancel the others' reading
        await asyncio.shield(self._reading)

    async def _read(self) -> None:
        store = self._app[STORE]
        limit = asyncio.Semaphore(CONCURRENT_READS)

        async def one(project: str, queue: str) -> QueueReading:
            async with limit:
                return await _reading(store, project, queue, self._app[CLOCK].now_ms())

        try:
            readings = await asyncio.gather(*(one(p, q) for p, q in self._queues))
        except Unavailable as exc:
            log.warning("queue gauges left out of /metrics: %s", exc)
            self._readings = None
            return
        self._readings = dict(zip(self._queues, readings, strict=True))
        self._read_at_ms = self._app[CLOCK].now_ms()

    async def reporting(self, app: web.Application) -> AsyncIterator[None]:
        """A cleanup context, after the store's: this process reports its
        followers of the listed queues to Redis while it serves."""
        task = asyncio.create_task(self._report()) if self._queues else None
        yield
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        try:  # withdrawn at once rather than lapsing REPORT_TTL later
            await self._app[STORE].follower_counts.report(dict.fromkeys(self._queues, 0), 0)
        except Unavailable as exc:
            log.debug("followers not withdrawn (they lapse by themselves): %s", exc)

    async def _report(self) -> None:
        store, live = self._app[STORE], self._app[LIVE]
        ttl_ms = int(REPORT_TTL * 1000)
        reported: dict[tuple[str, str], int] = {}
        since_all = REPORT_HEARTBEAT
        while True:
            counts = {key: live.followers_of(*key) for key in self._queues}
            if since_all >= REPORT_HEARTBEAT:
                # every count (0s withdraw reports a failed write may have left)
                changed = counts
                since_all = 0.0
            else:
                changed = {k: n for k, n in counts.items() if n != reported.get(k, 0)}
            try:
                await store.follower_counts.report(changed, ttl_ms)
                reported.update(changed)
            except Unavailable as exc:
                log.debug("followers not reported: %s", exc)
                since_all = REPORT_HEARTBEAT  # all of them again next time
            await asyncio.sleep(REPORT_CHECK)
            since_all += REPORT_CHECK

    def collect(self) -> Iterator[Metric]:
        readings = self._readings
        if readings is None:
            return
        families: list[tuple[str, str, Callable[[QueueReading], float]]] = [
            (
                "depth",
                "live messages in the queue, claimed ones included (its stats' total)",
                lambda reading: reading.depth,
            ),
            ("claimed", "messages of the queue in a live claim", lambda reading: reading.claimed),
            (
                "oldest_age_seconds",
                "age of the queue's oldest live message; 0 when it is empty",
                lambda reading: reading.oldest_age,
            ),
            (
                "dead_letters",
                "messages in the queue's dead-letter queue; 0 without one",
                lambda reading: reading.dead_letters,
            ),
            (
                "followers",
                "long polls and event streams of the queue, in every process",
                lambda reading: reading.followers,
            ),
        ]
        for name, text, value in families:
            family = GaugeMetricFamily(f"feedsvc_queue_{name}", text, labels=LABELS)
            for (project, queue), reading in readings.items():
                family.add_metric([project, queue], value(reading))
            yield family


async def _reading(store: FeedStore, project: str, queue: str, now_ms: int) -> QueueReading:
    stats = await store.queue_stats(project, queue)
    oldest_age = 0.0
    if stats.oldest is not None:
        oldest_age = max(0, now_ms - stats.oldest.created_ms) / 1000
    dead_letters = 0
    metadata = await store.get_queue_metadata(project, queue)
    dlq = (metadata or {}).get("_dead_letter_queue")
    if isinstance(dlq, str) and dlq and dlq != queue:
        dead_letters = (await store.queue_stats(project, dlq)).total
    followers = await store.follower_counts.count(project, queue)
    return QueueReading(stats.total, stats.claimed, oldest_age, dead_letters, followers)


def setup_queue_gauges(app: web.Application) -> None:
    """Add the gauges to the app's /metrics; call after the storage cleanup
    context is added (the follower reports need the store)."""
    gauges = QueueGauges(app)
    app[METRICS_REGISTRY].register(gauges)
    app[BEFORE_SCRAPE].append(gauges.refresh)
    app.cleanup_ctx.append(gauges.reporting)
