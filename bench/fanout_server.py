"""The ceiling for fan-out: a bare aiohttp loop writing one event to every
open stream (``python -m bench.fanout_server PORT``), no Redis, no feedsvc.

* ``GET /stream``: an event stream that stays open (``retry:`` first, like
  feedsvc's), kept in a set;
* ``POST /fire?seconds=S&size=B&rate=R``: for S seconds, event after
  event (R a second, or as fast as it goes without R), write one event of B
  bytes (``id``, ``event: message``, ``data`` with the body stamp ``{"n":
  ..., "t": <time of the write>}`` that bench/sse_client.py reads) to every
  open stream, yielding to the loop once per event; answers how many events
  and writes it made;
* ``GET /streams``: how many streams are open.

uvloop, like ``feedsvc serve``'s default.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence

from aiohttp import web

STREAMS = web.AppKey("streams", set[web.StreamResponse])
# the last event's number: it goes on across fires, so a reader sees 1, 2, 3, ...
LAST = web.AppKey("last", list[int])


async def stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    await response.write(b"retry: 2000\n\n")
    streams = request.app[STREAMS]
    streams.add(response)
    try:
        await asyncio.Event().wait()  # until the client goes (the handler is cancelled)
    finally:
        streams.discard(response)
    return response


def event(n: int, size: int) -> bytes:
    head = b'id: %d\nevent: message\ndata: {"body":{"n":%d,"t":%.6f,"x":"' % (n, n, time.time())
    tail = b'"}}\n\n'
    return head + b"x" * max(0, size - len(head) - len(tail)) + tail


async def fire(request: web.Request) -> web.Response:
    seconds = float(request.query.get("seconds", "5"))
    size = int(request.query.get("size", "200"))
    rate = float(request.query.get("rate", "0"))  # events/s; 0: as fast as it goes
    streams = request.app[STREAMS]
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + seconds
    last = request.app[LAST]
    first = last[0]
    writes = 0
    while loop.time() < deadline:
        if rate > 0 and (due := start + (last[0] - first) / rate) > loop.time():
            await asyncio.sleep(due - loop.time())
        last[0] += 1
        data = event(last[0], size)
        for response in list(streams):
            try:
                await response.write(data)
            except ConnectionError:
                streams.discard(response)
                continue
            writes += 1
        await asyncio.sleep(0)
    events = last[0] - first
    return web.json_response(
        {"events": events, "writes": writes, "event_bytes": len(event(last[0], size))}
    )


async def count(request: web.Request) -> web.Response:
    return web.json_response({"streams": len(request.app[STREAMS])})


def make_app() -> web.Application:
    app = web.Application()
    app[STREAMS] = set()
    app[LAST] = [0]
    app.router.add_get("/stream", stream)
    app.router.add_post("/fire", fire)
    app.router.add_get("/streams", count)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    import uvloop

    web.run_app(
        make_app(),
        host="127.0.0.1",
        port=int(args[0]),
        backlog=2048,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
        shutdown_timeout=1.0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
