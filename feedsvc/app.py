"""Build the aiohttp application.

``create_app`` is synchronous and pure; the Redis client and the store are
made in a cleanup context (startup and cleanup paired, cleanup only if
startup succeeded), so the app can be built before any loop runs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from redis.utils import HIREDIS_AVAILABLE

from feedsvc.api.handlers import SETTINGS, STORE
from feedsvc.api.metrics import metrics_middleware, setup_metrics
from feedsvc.api.middleware import error_middleware
from feedsvc.api.routes import add_routes
from feedsvc.api.validation import AUTH_TOKENS
from feedsvc.config import Settings
from feedsvc.errors import Unavailable
from feedsvc.storage.base import FeedStore
from feedsvc.storage.lua_store import LuaStore
from feedsvc.storage.redis_store import connect
from feedsvc.storage.watch_store import WatchStore

log = logging.getLogger("feedsvc")


def make_store(settings: Settings) -> FeedStore:
    if settings.redis_url is None:
        raise ValueError("make_store needs settings.redis_url")
    redis = connect(settings, settings.redis_url)
    if settings.driver == "watch":
        return WatchStore(redis, settings)
    return LuaStore(redis, settings)


def _storage_context(
    settings: Settings,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def storage(app: web.Application) -> AsyncIterator[None]:
        if not HIREDIS_AVAILABLE:
            # redis-py would fall back to its pure-Python parser: slower
            log.warning("hiredis is not installed; replies are parsed in Python")
        store = make_store(settings)
        if isinstance(store, LuaStore):
            try:
                await store.load_scripts()
            except Unavailable as exc:
                # Start anyway: requests answer 503 until Redis is back, and
                # scripts are loaded on first use (NOSCRIPT).
                log.warning("Redis not reachable at startup: %s", exc)
        app[STORE] = store
        yield
        await store.close()

    return storage


def create_app(settings: Settings) -> web.Application:
    # Zaqar's post-size limit applies to the whole request body; aiohttp
    # refuses a larger body while reading it, before buffering it whole.
    app = web.Application(
        middlewares=[metrics_middleware, error_middleware],
        client_max_size=settings.max_messages_post_size,
    )
    app[SETTINGS] = settings
    app[AUTH_TOKENS] = settings.auth_tokens()
    setup_metrics(app)
    app.cleanup_ctx.append(_storage_context(settings))
    add_routes(app, settings.bench_routes)
    return app
