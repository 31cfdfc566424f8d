"""``GET /console``: the browser console, a static page shipped in the package.

The page (``feedsvc/console/``: one HTML, one CSS and one JavaScript file, no
build step) talks to this service's /v2 API from the browser, with the same
headers as any client; serving it needs no Redis and shows no data, so it is
open even with --auth-token (the page asks for the token). Only the files
named in ``ASSETS`` are served, from memory after the first request.

The Content-Security-Policy lets the page load and fetch from this origin
only: no CDN, no font service, nothing that stops it working offline, and a
message body that looks like HTML stays text.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web

from feedsvc.errors import NotFound

#: The files under ``feedsvc/console/`` and their media types; the page is index.html.
ASSETS = {
    "index.html": "text/html",
    "console.css": "text/css",
    "console.js": "text/javascript",
}

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # a new feedsvc brings a new console: browsers ask again every time
    "Cache-Control": "no-cache",
}


@cache
def asset_bytes(name: str) -> bytes:
    return (resources.files("feedsvc") / "console" / name).read_bytes()


def _asset_response(name: str) -> web.Response:
    return web.Response(
        body=asset_bytes(name),
        content_type=ASSETS[name],
        charset="utf-8",
        headers=SECURITY_HEADERS,
    )


async def get_console(request: web.Request) -> web.Response:
    return _asset_response("index.html")


async def get_console_asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    if name not in ASSETS or name == "index.html":
        raise NotFound(f"The console has no file {name!r}.")
    return _asset_response(name)
