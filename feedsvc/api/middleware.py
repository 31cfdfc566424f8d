"""feedsvc's one middleware (``request_middleware``), and the one place
where errors become HTTP answers.

Domain errors (``feedsvc.errors``) carry their status; aiohttp's own HTTP
errors (unknown route, wrong method, body too large, a body whose chunking or
content encoding is broken) are re-shaped into the same Zaqar-style JSON;
anything else is a bug: logged with the request id, answered 500 without
details. Requests too malformed to reach a route are answered in the same
shape by ``feedsvc.api.protocol``.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from feedsvc.api.cors import preflight
from feedsvc.api.identity import authorize
from feedsvc.api.metrics import observe_request
from feedsvc.api.query_secrets import redacted_text
from feedsvc.api.signed_urls import mark_signed
from feedsvc.api.validation import IDENTITY, rate_limited_project
from feedsvc.appkeys import AUTHENTICATOR, COUNTED_ERRORS, RATE_LIMITER
from feedsvc.errors import (
    BadRequest,
    FeedError,
    InsufficientScope,
    RateLimited,
    RequestTimeout,
    Unauthorized,
    Unavailable,
)

log = logging.getLogger("feedsvc.api")

REQUEST_ID_HEADER = "X-Openstack-Request-Id"
#: The request's id, for a handler that sends its head itself (an event stream):
#: the middleware sets the header only on the response a handler returns.
REQUEST_ID = web.RequestKey("request_id", str)


# Cheaper than a uuid4 per request, and still unique across processes.
class _RequestIds:
    """Request ids: a random prefix per process, then a count."""

    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        self.prefix = "req-" + os.urandom(6).hex() + "-"
        self.numbers = itertools.count(1)


_ids = _RequestIds()
# a --workers worker is forked after this module was imported: it takes a
# prefix of its own, or two workers would hand out the same ids
os.register_at_fork(after_in_child=_ids.renew)
#: The routes that count against a project's rate: all of its data (ping,
#: health, the home and OpenAPI documents, metrics and the console do not).
RATE_LIMITED_PATHS = ("/v2/queues", "/v2/topics")


def new_request_id() -> str:
    return _ids.prefix + str(next(_ids.numbers))


def http_error_message(exc: BaseException) -> str:
    """What aiohttp's parser found wrong, without the exception's "400, message:"
    frame, and without the values of credentials in a query string that it
    may quote (``query_secrets``): it is logged."""
    for error in (exc, exc.__cause__):
        if isinstance(error, HttpProcessingError) and error.message:
            return redacted_text(" ".join(error.message.split()))[:300]
    return redacted_text(" ".join(str(exc).split()))[:300] or type(exc).__name__


def error_response(status: int, title: str, description: str, request_id: str) -> web.Response:
    body = orjson.dumps({"title": title, "description": description})
    response = web.Response(status=status, body=body, content_type="application/json")
    response.headers[REQUEST_ID_HEADER] = request_id
    return response


def _error_answer(request: web.Request, exc: Exception, request_id: str) -> web.Response | None:
    """The answer to what a handler raised, or None: a bug (logged here, 500)
    is answered, anything that is not an Exception never reaches here, and a
    web.HTTPException below 400 (a redirect) is None: raised on."""
    if isinstance(exc, FeedError):
        answer = error_response(exc.status, exc.title, exc.description, request_id)
        if isinstance(exc, (Unauthorized, InsufficientScope)):
            answer.headers["WWW-Authenticate"] = exc.challenge()
        if isinstance(exc, RequestTimeout):
            answer.force_close()
        if isinstance(exc, RateLimited):
            answer.headers["Retry-After"] = str(exc.retry_after)
            request.app[COUNTED_ERRORS][RateLimited].count(
                f"{request.method} {request.path}: {exc} [{request_id}]"
            )
        if isinstance(exc, Unavailable):
            answer.headers["Retry-After"] = str(exc.retry_after)
            # a flood of one kind (followers refused, contention) is a line per interval
            counter = request.app.get(COUNTED_ERRORS, {}).get(type(exc))
            if counter is None:
                log.warning("%s %s -> 503 (%s) [%s]", request.method, request.path, exc, request_id)
            else:
                counter.count(f"{request.method} {request.path}: {exc} [{request_id}]")
        return answer
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            return None
        description = exc.text if exc.text and exc.status != 404 else exc.reason
        if exc.status == 413:
            description = "The request body is larger than this service accepts."
        answer = error_response(exc.status, exc.reason, description or exc.reason, request_id)
        for name in ("Allow", "Retry-After"):
            if name in exc.headers:
                answer.headers[name] = exc.headers[name]
        return answer
    if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
        # The body's framing or content encoding is broken (a bad chunk,
        # gzip that is not): the client's fault, and the connection cannot
        # carry another request.
        description = f"The request body could not be read: {http_error_message(exc)}"
        log.info("%s %s -> 400 (%s) [%s]", request.method, request.path, description, request_id)
        answer = error_response(400, BadRequest.title, description, request_id)
        answer.force_close()
        return answer
    if isinstance(exc, ConnectionResetError):
        # the client went away while we read its request: nobody to answer
        log.debug("%s %s: client disconnected [%s]", request.method, request.path, request_id)
        return web.Response(status=499, reason="Client Closed Request")
    log.error(
        "unhandled error in %s %s [%s]", request.method, request.path, request_id, exc_info=exc
    )
    return error_response(
        500,
        "Internal server error",
        f"The service failed unexpectedly; request id {request_id}.",
        request_id,
    )


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """feedsvc's one middleware, run on every request: its id, its pre-signed
    URL checked (``signed_urls.mark_signed``), its bearer token and scope
    checked when authentication is on (``identity.authorize``), its
    project's rate (``feedsvc.services.rate_limiter``, with --project-rate), a CORS
    preflight answered (``cors.preflight``), errors answered as JSON, and
    the request counted in the metrics (``metrics.observe_request``, with the
    status sent, 500 for whatever left unanswered).

    One function rather than a middleware for each: aiohttp calls each
    middleware as a coroutine of its own, about 0.7 µs a layer on every
    request (docs/BENCHMARKS.md).
    """
    started = time.perf_counter()
    request_id = request[REQUEST_ID] = new_request_id()
    status = 500
    try:
        try:
            mark_signed(request)
            if request.app[AUTHENTICATOR].on:
                await authorize(request)
            else:
                request[IDENTITY] = None
            limiter = request.app.get(RATE_LIMITER)
            if limiter is not None and request.path.startswith(RATE_LIMITED_PATHS):
                project = rate_limited_project(request)
                if project is not None and not limiter.admit_now(project):
                    await limiter.admit(project)
            if request.method == "OPTIONS" and (answer := preflight(request)) is not None:
                response: web.StreamResponse = answer
            else:
                response = await handler(request)
        except Exception as exc:
            answer = _error_answer(request, exc, request_id)
            if answer is None:
                raise
            status = answer.status
            return answer
        response.headers[REQUEST_ID_HEADER] = request_id
        status = response.status
        return response
    finally:
        observe_request(request, status, started)
