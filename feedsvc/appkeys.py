"""The application's typed state keys: what ``create_app`` puts on the app.

A leaf module, as aiohttp-demos' ``polls/typedefs.py``: every part of the
HTTP layer (and ``feedsvc.app``) may import it, and it imports only lower
layers (config, clock, the storage interface) and never ``feedsvc.api``, so
reading a key never ties two handler modules together.
``tests/test_layers.py`` keeps it so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRoute
from prometheus_client import CollectorRegistry, Histogram

from feedsvc.auth.access import Authenticator
from feedsvc.clock import Clock
from feedsvc.config import Settings
from feedsvc.delivery.worker import Deliverer
from feedsvc.drain_signal import DrainSignal
from feedsvc.log_counter import LogCounter
from feedsvc.services.live import LiveFeeds
from feedsvc.services.rate_limiter import ProjectRateLimiter
from feedsvc.services.redriver import Redriver
from feedsvc.storage.base import FeedStore

SETTINGS = web.AppKey("settings", Settings)
#: "now" for every handler (ages, expiry shown to clients); a test may pass a ManualClock.
CLOCK: web.AppKey[Clock] = web.AppKey("clock")
#: Set when this process begins to drain (``feedsvc.process.drain``): waiters end on it.
DRAINING = web.AppKey("draining", DrainSignal)
#: Set by the storage cleanup context once the store is open; absent before.
STORE = web.AppKey("store", FeedStore)
#: The shared tails of live followers (long polls, event streams); set with STORE.
LIVE = web.AppKey("live", LiveFeeds)
#: The same for topics (over ``FeedStore.topics()``).
TOPIC_LIVE = web.AppKey("topic_live", LiveFeeds)
#: This process's share of the projects' request rates; set with STORE, and
#: only with --project-rate.
RATE_LIMITER = web.AppKey("rate_limiter", ProjectRateLimiter)
#: This process's delivery worker for subscriptions; set with STORE.
DELIVERIES = web.AppKey("deliveries", Deliverer)
#: this process's redriver (feedsvc.services.redriver): a started redrive kicks it
REDRIVER = web.AppKey("redriver", Redriver)
#: Bearer token -> identity (--auth-token, --auth-token-file, JWTs); ``on`` is
#: False when none is set: then no request is authenticated.
AUTHENTICATOR = web.AppKey("authenticator", Authenticator)
#: Each route -> the action its scope check asks for (``feedsvc.api.routes``);
#: None: open to all (probes, the console's files, the home document).
ROUTE_ACTIONS: web.AppKey[dict[AbstractRoute, str | None]] = web.AppKey("route_actions")
#: The admin API's bearer token (``--admin-token``); None: none is set.
ADMIN_TOKEN: web.AppKey[str | None] = web.AppKey("admin_token")
#: This app's own Prometheus registry (several apps in one process do not collide).
METRICS_REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)
METRICS_REQUESTS = web.AppKey("metrics_requests", Histogram)
# its children by (method, route, status): labels() resolved once per set
METRICS_CHILDREN = web.AppKey("metrics_children", dict[tuple[str, str, int], Any])
#: Errors answered in floods (a follower refused, a write given up on
#: contention), by class: each counted and logged a line per interval.
COUNTED_ERRORS: web.AppKey[dict[type[Exception], LogCounter]] = web.AppKey("counted_errors")
#: The embedded Redis's report for /v2/health (``feedsvc.embedded_redis.supervisor``); absent
#: when the service runs on a Redis it did not start.
EMBEDDED_REDIS: web.AppKey[Callable[[], dict[str, Any]]] = web.AppKey("embedded_redis")
