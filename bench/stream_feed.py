"""A stream paged over HTTP: ``python -m bench.stream_feed PORT REDIS_URL``.

The storage part's page anchor at a reader's pace (bench/storage.py). Its
own anchor, ``XRANGE COUNT 10`` sent back to back from one client, finds
Redis's thread warm on every call; a feed's reader asks for a page, reads
it, asks again, and between two of its pages Redis waits while HTTP is
served on the same machine. A bare aiohttp + uvloop route (as
bench/bare_hello.py serves) that answers each page with one ``XRANGE
COUNT 10`` on redis.asyncio, paged by the same reader as feedsvc's pages,
is what a stream behind a feed service costs Redis per page: what one round
trip a page costs at that pace, whatever the storage behind it.

GET /streams/{key}?after=ID: the entries after ID (none: from the first),
10 at most, as JSON ``{"entries": [[id, body], ...]}``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import orjson
import redis.asyncio
from aiohttp import web

from bench.bare_hello import run_bare

PAGE = 10
CLIENT = web.AppKey("client", redis.asyncio.Redis)


async def page(request: web.Request) -> web.Response:
    after = request.query.get("after")
    start = "-" if after is None else f"({after}"
    entries: Any = await request.app[CLIENT].xrange(request.match_info["key"], start, "+", PAGE)
    out = [[entry_id.decode(), fields[b"b"].decode()] for entry_id, fields in entries]
    return web.Response(body=orjson.dumps({"entries": out}), content_type="application/json")


def make_app(redis_url: str) -> web.Application:
    async def connected(app: web.Application) -> AsyncIterator[None]:
        app[CLIENT] = redis.asyncio.Redis.from_url(redis_url)
        yield
        await app[CLIENT].aclose()

    app = web.Application()
    app.cleanup_ctx.append(connected)
    app.router.add_get("/streams/{key}", page)
    return app


def main(argv: list[str]) -> None:
    run_bare(make_app(argv[1]), int(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
