"""The issue's ceiling, served on its own: ``python -m bench.bare_hello PORT``.

A bare aiohttp + uvloop handler answering ``{"hello":"world"}`` with orjson,
in an application with no middleware, no metrics and no routes but this one.
``GET /bench/hello`` of ``feedsvc serve --bench-routes`` answers the same
document in feedsvc's own process, through every middleware feedsvc runs
(request id, metrics, error shaping, pre-signed URL check); the post and get
parts measure against both, so that the reader sees what those middlewares
cost every request as well as what a POST or a GET adds on top of them.
"""

from __future__ import annotations

import sys

import orjson
import uvloop
from aiohttp import web

_HELLO = {"hello": "world"}


async def hello(request: web.Request) -> web.Response:
    # as feedsvc's json_response builds it: orjson per request, bytes body
    return web.Response(body=orjson.dumps(_HELLO), content_type="application/json")


def run_bare(app: web.Application, port: int) -> None:
    """Serve app on 127.0.0.1:port on uvloop, with no access log, until stopped."""
    web.run_app(
        app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop()
    )


def main(argv: list[str]) -> None:
    app = web.Application()
    app.router.add_get("/bench/hello", hello)
    run_bare(app, int(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
