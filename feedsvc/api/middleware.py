"""The one place where errors become HTTP answers.

Domain errors (``feedsvc.errors``) carry their status; aiohttp's own HTTP
errors (unknown route, wrong method, body too large) are re-shaped into the
same Zaqar-style JSON; anything else is a bug: logged with the request id,
answered 500 without details.
"""

from __future__ import annotations

import itertools
import logging
import os

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from feedsvc.errors import FeedError, RequestTimeout, Unauthorized, Unavailable

log = logging.getLogger("feedsvc.api")

REQUEST_ID_HEADER = "X-Openstack-Request-Id"
# Cheaper than a uuid4 per request, and still unique across processes.
_REQUEST_PREFIX = "req-" + os.urandom(6).hex() + "-"
_request_numbers = itertools.count(1)


def error_response(status: int, title: str, description: str, request_id: str) -> web.Response:
    body = orjson.dumps({"title": title, "description": description})
    response = web.Response(status=status, body=body, content_type="application/json")
    response.headers[REQUEST_ID_HEADER] = request_id
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = _REQUEST_PREFIX + str(next(_request_numbers))
    try:
        response = await handler(request)
    except FeedError as exc:
        answer = error_response(exc.status, exc.title, exc.description, request_id)
        if isinstance(exc, Unauthorized):
            answer.headers["WWW-Authenticate"] = "Bearer"
        if isinstance(exc, RequestTimeout):
            answer.force_close()
        if isinstance(exc, Unavailable):
            answer.headers["Retry-After"] = str(exc.retry_after)
            log.warning("%s %s -> 503 (%s) [%s]", request.method, request.path, exc, request_id)
        return answer
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        description = exc.text if exc.text and exc.status != 404 else exc.reason
        if exc.status == 413:
            description = "The request body is larger than this service accepts."
        answer = error_response(exc.status, exc.reason, description or exc.reason, request_id)
        for name in ("Allow", "Retry-After"):
            if name in exc.headers:
                answer.headers[name] = exc.headers[name]
        return answer
    except ConnectionResetError:
        # the client went away while we read its request: nobody to answer
        log.debug("%s %s: client disconnected [%s]", request.method, request.path, request_id)
        return web.Response(status=499, reason="Client Closed Request")
    except Exception:
        log.exception("unhandled error in %s %s [%s]", request.method, request.path, request_id)
        return error_response(
            500,
            "Internal server error",
            f"The service failed unexpectedly; request id {request_id}.",
            request_id,
        )
    response.headers[REQUEST_ID_HEADER] = request_id
    return response
