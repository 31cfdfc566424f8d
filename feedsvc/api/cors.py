"""CORS: which browser origins may call the API from their own pages.

With ``--cors-origin`` (repeatable), a request whose ``Origin`` is one of
the exact origins listed gets ``Access-Control-Allow-Origin`` naming it
(and ``Vary: Origin``), on every answer, errors and event streams included,
with ``Access-Control-Expose-Headers`` for what a page needs to read:
``Location``, ``Retry-After``, the request id, ``WWW-Authenticate``,
``X-Gap``. A listed ``*`` lets any origin read without credentials: a GET or
HEAD that carries no ``Authorization`` header and no ``access_token`` in its
query gets ``Access-Control-Allow-Origin: *``; nothing else does. An origin
not listed gets no CORS header at all, so its page cannot read the answer.

A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered
for every route (``feedsvc.api.middleware`` calls :func:`preflight`): 204
with the methods the path answers and the headers the API reads, or 403 for
an origin or method not allowed. Without ``--cors-origin`` an ``OPTIONS`` is
what it was, a 405.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from feedsvc.appkeys import SETTINGS
from feedsvc.errors import Forbidden

#: What a page may read of an answer beyond the CORS-safelisted headers.
EXPOSED = "Location, Retry-After, X-Openstack-Request-Id, WWW-Authenticate, X-Gap"
#: The request headers the API reads.
ALLOWED_HEADERS = (
    "Authorization, X-Auth-Token, Client-ID, X-Project-ID, Content-Type, Idempotency-Key, "
    "Last-Event-ID, URL-Signature, URL-Expires, URL-Methods, URL-Paths"
)
#: Seconds a browser may keep a preflight's answer.
MAX_AGE = "600"
#: What '*' allows: reads, without credentials.
ANYONE_METHODS = ("GET", "HEAD")


def allowed_origin(origins: frozenset[str], origin: str, method: str, credentials: bool) -> str:
    """What Access-Control-Allow-Origin says for origin ("" for nothing)."""
    if origin in origins:
        return origin
    if "*" in origins and method in ANYONE_METHODS and not credentials:
        return "*"
    return ""


def on_prepare(
    origins: frozenset[str],
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """The app's on_response_prepare: CORS headers on every answer, before
    its head is sent (so an event stream has them too)."""

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or "Access-Control-Allow-Origin" in response.headers:
            return
        credentials = "Authorization" in request.headers or (
            bool(request.query_string) and "access_token" in request.query
        )
        allowed = allowed_origin(origins, origin, request.method, credentials)
        response.headers.add("Vary", "Origin")
        if allowed:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = EXPOSED

    return add_headers


def preflight(request: web.Request) -> web.Response | None:
    """The answer to a CORS preflight, or None: not one (or CORS is off)."""
    origins = request.app[SETTINGS].cors_origins()
    origin = request.headers.get("Origin")
    method = request.headers.get("Access-Control-Request-Method")
    if not origins or origin is None or method is None:
        return None
    error = request.match_info.http_exception
    if not isinstance(error, web.HTTPMethodNotAllowed):
        return None  # an unknown path: its 404
    methods = sorted(set(error.allowed_methods) - {"OPTIONS"})
    asked = {
        h.strip().lower()
        for h in request.headers.get("Access-Control-Request-Headers", "").split(",")
    }
    credentials = "authorization" in asked
    allowed = allowed_origin(origins, origin, method, credentials)
    if allowed == "*":
        methods = [m for m in methods if m in ANYONE_METHODS]
    if not allowed or method not in methods:
        raise Forbidden(
            f"{method} {request.path} is not allowed from {origin[:100]!r} (--cors-origin)."
        )
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Origin": allowed,
            "Access-Control-Allow-Methods": ", ".join(methods),
            "Access-Control-Allow-Headers": ALLOWED_HEADERS,
            "Access-Control-Max-Age": MAX_AGE,
            "Vary": "Origin",
        },
    )
