"""Requests too malformed to reach a route, answered like every other error.

aiohttp answers a request it cannot parse (a header over 8190 bytes, broken
chunked framing, a method that is not a token, a NUL in a header) itself, in
``RequestHandler.handle_error``, before any middleware runs: plain text, and
logged at ERROR with a traceback. :class:`JsonErrorRequestHandler` answers it
as the error middleware would (Zaqar-style JSON, ``X-Openstack-Request-Id``,
``Connection: close``) and logs it as the client error it is: INFO, one
line, no traceback. A 5xx from aiohttp itself (a bug) keeps its traceback.

aiohttp has no option for the connection handler's class: an ``AppRunner``
makes a ``web.Server``, which makes a ``RequestHandler`` per connection.
:class:`FeedAppRunner` makes a server that makes ours, through the private
``AppRunner._make_server`` and ``Server._kwargs``/``_loop``;
tests/test_canaries.py checks that they still mean what this module assumes.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_request import BaseRequest

from feedsvc.api.middleware import error_response, http_error_message, new_request_id

log = logging.getLogger("feedsvc.api")

#: The title of an answer to a request aiohttp could not parse.
MALFORMED = "Malformed HTTP request"


class JsonErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, with feedsvc's error answers and log levels."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        request_id = new_request_id()
        if status >= 500:
            self.log_exception(
                "Error handling request from %s [%s]", request.remote, request_id, exc_info=exc
            )
            title = "Internal server error"
            description = f"The service failed unexpectedly; request id {request_id}."
        else:
            title = MALFORMED
            description = http_error_message(exc) if exc is not None else message or title
            log.info(
                "malformed request from %s -> %s (%s) [%s]",
                request.remote,
                status,
                description,
                request_id,
            )
        if request.writer.output_size > 0:
            # as aiohttp does: a response has begun, there is no answering now
            raise ConnectionError("Response is sent already, cannot send another response")
        response = error_response(status, title, description, request_id)
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp reads the rest of a refused request's body before it closes;
        # a body whose framing or encoding is broken fails that read again
        exc = kw.get("exc_info")
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            log.info("malformed request body from a client: %s", http_error_message(exc))
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class FeedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are handled by :class:`JsonErrorRequestHandler`."""

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
