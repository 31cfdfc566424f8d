"""Prometheus metrics: ``GET /metrics``.

HTTP requests are timed by the middleware (``observe_request``; a histogram per method, route and
status, whose ``_count`` is the request count); the store's own numbers
(Redis calls and their time, WATCH retries and conflicts, NOSCRIPT reloads,
pool use, coalesced batches) are read at scrape time, and so are the
process's own (``process_*``: CPU, memory, open files) and its Python's
(``python_gc_*``: the cycle collector's runs per generation, see
:mod:`feedsvc.process.setup`; ``python_info``), as any Python service
exports them; and the gauges of the queues ``--metrics-queues`` names, read
from Redis at most once per ``--metrics-queue-refresh`` (see
:mod:`feedsvc.api.queue_gauges`). Each app has its own registry, so several
apps in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from feedsvc.appkeys import (
    COUNTED_ERRORS,
    DELIVERIES,
    METRICS_CHILDREN,
    METRICS_REGISTRY,
    METRICS_REQUESTS,
    STORE,
)
from feedsvc.errors import RateLimited, TooManyFollowers
from feedsvc.storage.base import FeedStore

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StoreCollector(Collector):
    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        store: FeedStore | None = self._app.get(STORE)
        if store is None:
            return
        stats = store.stats()
        counters = [
            ("watch_retries", "WATCH transactions repeated after a conflict"),
            ("watch_conflicts_exhausted", "writes answered 503 after too many conflicts"),
            ("watch_transactions", "MULTI/EXEC blocks sent, executed or not"),
            ("posts_combined", "posts indexed in the same transaction or call as an earlier one"),
            ("noscript_reloads", "scripts loaded again after NOSCRIPT"),
            ("cluster_redirects", "Redis Cluster MOVED, ASK and TRYAGAIN replies met"),
            ("read_retries", "reads sent again after finding their connection closed"),
            ("not_replicated", "writes answered 503: too few replicas confirmed them in time"),
            ("master_switches", "new masters announced by Redis Sentinel"),
            ("out_of_memory", "writes answered 503: Redis refused them with OOM (full)"),
            (
                "unreadable_skipped",
                "messages passed over by a list, pop, claim or delivery because they cannot "
                "be decrypted (each time one is met; see the log for which)",
            ),
            (
                "redis_calls",
                "Redis operations: coalesced calls and operations on a pool connection",
            ),
            ("redis_seconds", "time spent waiting for Redis, seconds"),
            ("coalesced_batches", "pipelines sent by the coalescer"),
            ("coalesced_calls", "calls carried by those pipelines"),
        ]
        for name, text in counters:
            yield CounterMetricFamily(f"feedsvc_{name}", text, value=stats[name])
        for name, text in [
            ("pool_size", "Redis connection slots"),
            ("pool_in_use", "slots in use"),
            ("pool_waiting", "requests waiting for a slot"),
            (
                "redis_may_evict",
                "1 while a Redis primary's maxmemory-policy may evict feedsvc's keys (or "
                "cannot be read): writes are refused then, unless --allow-evicting-redis",
            ),
            (
                "redis_evicted_keys",
                "keys the Redis primaries say they have evicted since they started "
                "(evicted_keys, read every second): any rise may be lost messages",
            ),
        ]:
            yield GaugeMetricFamily(f"feedsvc_{name}", text, value=stats[name])
        if "sweep_lag_seconds" in stats:
            yield GaugeMetricFamily(
                "feedsvc_sweep_lag_seconds",
                "how late the oldest due review of expired segment messages was at the "
                "sweep's last look (0: none late): memory comes back that much later",
                value=stats["sweep_lag_seconds"],
            )


class RefusalCollector(Collector):
    """Followers refused and requests over their project's rate, each counted
    (their log is a line per interval:
    ``feedsvc.log_counter``). Writes given up on contention are the store's
    ``watch_conflicts_exhausted``."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        refused = self._app.get(COUNTED_ERRORS, {}).get(TooManyFollowers)
        if refused is not None:
            yield CounterMetricFamily(
                "feedsvc_followers_refused",
                "event streams and long polls answered 503: --max-followers reached",
                value=refused.total,
            )
        limited = self._app.get(COUNTED_ERRORS, {}).get(RateLimited)
        if limited is not None:
            yield CounterMetricFamily(
                "feedsvc_rate_limited",
                "requests answered 429: their project was over its rate (--project-rate)",
                value=limited.total,
            )


class DeliveryCollector(Collector):
    """This process's deliveries: outcomes by scheme, messages given up on per
    subscription (sum them over the processes), leases held and lost."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        deliverer = self._app.get(DELIVERIES)
        if deliverer is None:
            return
        counters = deliverer.counters
        outcomes = CounterMetricFamily(
            "feedsvc_deliveries",
            "notification attempts by scheme and outcome: delivered, attempt_failed "
            "(retried or given up), given_up (the retry policy ran out, or a final error)",
            labels=["scheme", "outcome"],
        )
        for (scheme, outcome), count in sorted(counters.outcomes.items()):
            outcomes.add_metric([scheme, outcome], count)
        yield outcomes
        failures = CounterMetricFamily(
            "feedsvc_subscription_failures",
            "notifications given up on, per subscription (this process's share)",
            labels=["project", "queue", "subscription"],
        )
        for (project, queue, sid), count in sorted(counters.failures.items()):
            failures.add_metric([project, queue, sid], count)
        yield failures
        yield CounterMetricFamily(
            "feedsvc_delivery_leases_lost",
            "subscriptions this process stopped delivering because its lease was lost",
            value=counters.leases_lost,
        )
        yield GaugeMetricFamily(
            "feedsvc_delivery_leases",
            "subscriptions this process is delivering now (leases held)",
            value=deliverer.running,
        )


#: What each scrape awaits first: collectors that read Redis refresh there,
#: since a collector's collect() cannot await (feedsvc.api.queue_gauges).
BEFORE_SCRAPE = web.AppKey("metrics_before_scrape", list[Callable[[], Awaitable[None]]])


def setup_metrics(app: web.Application) -> None:
    registry = CollectorRegistry()
    app[METRICS_REGISTRY] = registry
    app[METRICS_REQUESTS] = Histogram(
        "feedsvc_http_request_duration_seconds",
        "HTTP requests by method, route and status",
        ["method", "route", "status"],
        buckets=_BUCKETS,
        registry=registry,
    )
    app[METRICS_CHILDREN] = {}
    registry.register(StoreCollector(app))
    registry.register(RefusalCollector(app))
    registry.register(DeliveryCollector(app))
    app[BEFORE_SCRAPE] = []
    GCCollector(registry=registry)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


# Methods counted by name; any other (a client may send any token) counts as
# OTHER, so that clients cannot grow the metric's label sets without end.
_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))


def observe_request(request: web.Request, status: int, started: float) -> None:
    """Counts a request answered with status, begun at ``time.perf_counter()``
    started. Run by ``feedsvc.api.middleware`` on every request."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    method = request.method
    key = (method, route, status)
    # the histogram's child for these labels, looked up once (labels()
    # costs about as much as the observation itself)
    children = request.app[METRICS_CHILDREN]
    child = children.get(key)
    if child is None:
        label = method if method in _METHODS else "OTHER"
        child = children[key] = request.app[METRICS_REQUESTS].labels(label, route, str(status))
    child.observe(time.perf_counter() - started)


async def get_metrics(request: web.Request) -> web.Response:
    for refresh in request.app[BEFORE_SCRAPE]:
        await refresh()
    body = generate_latest(request.app[METRICS_REGISTRY])
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response
