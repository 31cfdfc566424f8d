"""Build the aiohttp application.

``create_app`` is synchronous and pure; the Redis client and the store are
made in a cleanup context (startup and cleanup paired, cleanup only if
startup succeeded), so the app can be built before any loop runs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from redis.utils import HIREDIS_AVAILABLE

from feedsvc.api import cors
from feedsvc.api.metrics import setup_metrics
from feedsvc.api.middleware import request_middleware
from feedsvc.api.queue_gauges import setup_queue_gauges
from feedsvc.api.routes import add_routes
from feedsvc.appkeys import (
    ADMIN_TOKEN,
    AUTHENTICATOR,
    CLOCK,
    COUNTED_ERRORS,
    DELIVERIES,
    DRAINING,
    EMBEDDED_REDIS,
    LIVE,
    RATE_LIMITER,
    REDRIVER,
    SETTINGS,
    STORE,
    TOPIC_LIVE,
)
from feedsvc.auth.access import Authenticator
from feedsvc.clock import SYSTEM_CLOCK, Clock
from feedsvc.config import Settings
from feedsvc.delivery.worker import Deliverer
from feedsvc.drain_signal import DrainSignal
from feedsvc.errors import RateLimited, TooManyFollowers, TooMuchContention
from feedsvc.log_counter import LogCounter
from feedsvc.services.live import LiveFeeds
from feedsvc.services.rate_limiter import ProjectRateLimiter
from feedsvc.services.redriver import Redriver
from feedsvc.storage.drivers import make_store

log = logging.getLogger("feedsvc")


def _storage_context(
    settings: Settings, clock: Clock
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def storage(app: web.Application) -> AsyncIterator[None]:
        if not HIREDIS_AVAILABLE:
            # redis-py would fall back to its pure-Python parser: slower
            log.warning("hiredis is not installed; replies are parsed in Python")
        store = make_store(settings, clock)
        await store.open()
        live = LiveFeeds(store, settings.scan_limit, tick=settings.stream_heartbeat)
        topic_live = LiveFeeds(store.topics(), settings.scan_limit, tick=settings.stream_heartbeat)
        # every serving process delivers subscriptions (see feedsvc.delivery.worker)
        deliverer = Deliverer(store, settings, clock) if settings.deliver else None
        if deliverer is not None:
            deliverer.start()
            app[DELIVERIES] = deliverer
        # every serving process moves running redrives on (see feedsvc.services.redriver)
        redriver = Redriver(store)
        redriver.start()
        app[REDRIVER] = redriver
        limiter_trouble = LogCounter(
            log, "let through", "requests unchecked: the rate limiter met Redis trouble", clock
        )
        if settings.project_rate:
            app[RATE_LIMITER] = ProjectRateLimiter(
                store.rate_limits, settings, clock, limiter_trouble
            )
        app[STORE] = store
        app[LIVE] = live
        app[TOPIC_LIVE] = topic_live
        yield
        limiter_trouble.close()
        await redriver.close()
        if deliverer is not None:
            await deliverer.close()
        await topic_live.close()
        await live.close()
        await store.close()

    return storage


def _counted_errors(clock: Clock) -> dict[type[Exception], LogCounter]:
    """The errors a busy service answers by the thousand: a line per interval
    for them (``feedsvc.api.middleware``), not one each; metrics count each."""
    api_log = logging.getLogger("feedsvc.api")
    return {
        TooManyFollowers: LogCounter(api_log, "refused", "followers (--max-followers)", clock),
        TooMuchContention: LogCounter(
            api_log, "gave up", "writes after too many WATCH conflicts", clock
        ),
        RateLimited: LogCounter(
            api_log, "refused", "requests over their project's rate (--project-rate)", clock
        ),
    }


async def _issuer_keys(app: web.Application) -> AsyncIterator[None]:
    """The JWT issuer's keys fetched before serving (with --jwt-jwks-url)."""
    authenticator = app[AUTHENTICATOR]
    if authenticator.jwt is not None:
        await authenticator.jwt.start()
    yield
    await authenticator.close()


async def _tell_counted_errors(app: web.Application) -> None:
    for counter in app[COUNTED_ERRORS].values():
        counter.close()


def create_app(
    settings: Settings,
    clock: Clock = SYSTEM_CLOCK,
    embedded_redis: Callable[[], dict[str, Any]] | None = None,
) -> web.Application:
    """The application; embedded_redis reports the embedded Redis in /v2/health."""
    # Zaqar's post-size limit applies to the whole request body; aiohttp
    # refuses a larger body while reading it, before buffering it whole.
    app = web.Application(
        middlewares=[request_middleware],
        client_max_size=settings.max_messages_post_size,
    )
    app[SETTINGS] = settings
    app[CLOCK] = clock
    app[DRAINING] = DrainSignal()
    app[COUNTED_ERRORS] = _counted_errors(clock)
    app.on_cleanup.append(_tell_counted_errors)
    app[AUTHENTICATOR] = Authenticator(settings, clock)
    app[ADMIN_TOKEN] = settings.admin_secret()
    if settings.cors_origins():
        app.on_response_prepare.append(cors.on_prepare(settings.cors_origins()))
    app.cleanup_ctx.append(_issuer_keys)
    if embedded_redis is not None:
        app[EMBEDDED_REDIS] = embedded_redis
    setup_metrics(app)
    app.cleanup_ctx.append(_storage_context(settings, clock))
    setup_queue_gauges(app)  # after the store's context: it reports followers through it
    add_routes(app, settings.bench_routes)
    return app
