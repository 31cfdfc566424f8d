"""The floor under the post and get ratios: ``python -m bench.bare_feed PORT REDIS_URL``.

A bare aiohttp + uvloop application, as bench/bare_hello.py is, with two
routes that do only what a POST of one message and a GET of a page cannot
do without: read the request, turn the body into messages (feedsvc's own
``new_messages``), one call to feedsvc's own store (the lua driver, its
coalescer, its Redis connection) and the answer feedsvc's handlers build
(``posted_response``, ``page_response``). It runs none of what the service
adds to every request: no middleware (request id, metrics, error shaping,
pre-signed URLs), no caller or name checks, no head clock, no drain hook.
It keeps what makes feedsvc faster: the collector set up as feedsvc's
(``feedsvc.process.setup``).

Served beside the bare hello in one run (the ``floor`` part), its rates say
how near half of a bare hello a POST and a GET could come if every feature
the service must keep on were free: the store and the answer alone, against
aiohttp alone.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator

from aiohttp import web

from bench.bare_hello import run_bare
from feedsvc.api.handlers import page_response, posted_response
from feedsvc.api.validation import json_document, new_messages
from feedsvc.appkeys import SETTINGS, STORE
from feedsvc.clock import SYSTEM_CLOCK
from feedsvc.config import parse_settings
from feedsvc.process.setup import YoungCollections, settle_heap
from feedsvc.storage.base import ListQuery
from feedsvc.storage.drivers import make_store

PROJECT = "bench"


async def post(request: web.Request) -> web.Response:
    queue = request.match_info["queue"]
    raw = await request.read()
    messages = new_messages(json_document(raw), request.app[SETTINGS])
    ids = await request.app[STORE].post_messages(
        PROJECT, queue, request.headers["Client-ID"], messages, len(raw)
    )
    return posted_response(f"/v2/queues/{queue}/messages", ids)


async def get(request: web.Request) -> web.Response:
    queue = request.match_info["queue"]
    query = ListQuery(request.headers["Client-ID"], limit=int(request.query.get("limit", 10)))
    now = SYSTEM_CLOCK.now_ms()
    page = await request.app[STORE].list_messages(PROJECT, queue, query)
    return page_response(f"/v2/queues/{queue}", page, query, now)


def make_app(redis_url: str) -> web.Application:
    settings = parse_settings(["--redis-url", redis_url], {})

    async def storage(app: web.Application) -> AsyncIterator[None]:
        store = make_store(settings, SYSTEM_CLOCK)
        await store.open()
        app[STORE] = store
        settle_heap()
        # as busy as feedsvc under the bench's load: it collects every YOUNG_EVERY
        young = YoungCollections(asyncio.get_running_loop(), itertools.count().__next__)
        young.start()
        yield
        young.stop()
        await store.close()

    app = web.Application()
    app[SETTINGS] = settings
    app.cleanup_ctx.append(storage)
    app.router.add_post("/v2/queues/{queue}/messages", post)
    app.router.add_get("/v2/queues/{queue}/messages", get)
    return app


def main(argv: list[str]) -> None:
    run_bare(make_app(argv[1]), int(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
