"""Requests too malformed to reach a route, answered like every other error.

aiohttp answers a request it cannot parse (a header over 8190 bytes, broken
chunked framing, a method that is not a token, a NUL in a header) itself, in
``RequestHandler.handle_error``, before any middleware runs: plain text, and
logged at ERROR with a traceback. :class:`JsonErrorRequestHandler` answers it
as the error middleware would (Zaqar-style JSON, ``X-Openstack-Request-Id``,
``Connection: close``) and logs it as the client error it is: INFO, one
line, no traceback. A 5xx from aiohttp itself (a bug) keeps its traceback.

It also bounds how long a request head may take to arrive (``head_timeout``,
``--client-timeout``), on every request of a connection. aiohttp bounds only
an idle keep-alive connection (``keepalive_timeout``), and that timer runs
through a half-sent head too: a client sending a byte a second held a
connection 75 s. The head clock starts when the connection is made (the
first head), and when the first bytes of a later head arrive, or when the
response before it ends if they arrived while it was being handled; it stops
when the head is complete. Bytes of a body start no clock (a slow body is the
handler's 408), nor does silence after a response (that is the keep-alive
timeout's). A head that was complete in time is never cut afterwards, so a
long poll or an event stream runs as long as its handler wants. Bytes that
arrive in the same packet as the end of the previous request start the clock
only with the next packet; a client that then stops is an idle connection.

The clock is a time, not a timer per head: starting it notes when, stopping
it forgets that. One timer per connection checks the deadline and, when the
clock was started again since, moves itself to the new deadline (as aiohttp's
keep-alive timer does), so a connection makes a timer about once per
``head_timeout`` instead of one per request: making and cancelling a libuv
timer for every head cost each request ≈ 3 µs, 7 % of a small request's time.

aiohttp has no option for the connection handler's class: an ``AppRunner``
makes a ``web.Server``, which makes a ``RequestHandler`` per connection.
:class:`FeedAppRunner` makes a server that makes ours, through the private
``AppRunner._make_server`` and ``Server._kwargs``/``_loop``; the head clock
reads ``RequestHandler._request_count``, ``._messages`` and ``._waiter``.
tests/test_canaries.py checks that they still mean what this module assumes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_request import BaseRequest

from feedsvc.api.middleware import error_response, http_error_message, new_request_id

log = logging.getLogger("feedsvc.api")

#: The title of an answer to a request aiohttp could not parse.
MALFORMED = "Malformed HTTP request"


# Requests being handled (by id) -> what to call if their client goes away.
_HANG_UPS: dict[int, Callable[[], None]] = {}


@contextmanager
def on_hang_up(request: BaseRequest, hang_up: Callable[[], None]) -> Iterator[None]:
    """Call hang_up if the client goes away while this request is handled:
    aiohttp does not cancel handlers, so a waiting long poll or a quiet event
    stream would otherwise notice only at its next write. (Served by
    FeedAppRunner's handler; elsewhere, e.g. aiohttp's test server, it is
    never called.)"""
    _HANG_UPS[id(request)] = hang_up
    try:
        yield
    finally:
        _HANG_UPS.pop(id(request), None)


class JsonErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, with feedsvc's error answers and log
    levels, and a time limit on every request head (``head_timeout``)."""

    __slots__ = ("_body", "_head_since", "_head_timeout", "_head_timer")

    def __init__(
        self, manager: web.Server, *, head_timeout: float | None = None, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout = head_timeout
        # when the clock of the head that is due started (loop time); None
        # while no head is due
        self._head_since: float | None = None
        # pending while a clock may run, due at or before its deadline
        self._head_timer: asyncio.TimerHandle | None = None
        # the body of the last request whose head arrived: until it is read,
        # the bytes that come are its, not a head's
        self._body: StreamReader | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_head_clock()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_clock()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._body = None
        request = self._current_request
        super().connection_lost(exc)
        hang_up = _HANG_UPS.get(id(request)) if request is not None else None
        if hang_up is not None:
            hang_up()  # a long poll or a stream: free it now, not at its next write

    def data_received(self, data: bytes) -> None:
        if data and self._head_since is None and (self._body is None or self._body.is_eof()):
            self._start_head_clock()  # no body is due: these bytes begin a head
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads and self._messages:
            # (bytes after the head in this packet start no clock: the next packet does)
            self._stop_head_clock()
            self._body = self._messages[-1][1]

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        # bytes held back behind an Upgrade request are parsed by aiohttp's
        # finish_response (not data_received) once the upgrade is declined
        held_back = self._upgraded and not self._messages and self._payload_parser is None
        heads = self._request_count
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if held_back and self._request_count != heads and self._messages:
                # the head they began is whole (the start of another after it
                # in the same bytes starts no clock, as in data_received)
                self._stop_head_clock()
                self._body = self._messages[-1][1]
            elif self._head_since is not None:
                # the next head began while this request was handled: its time
                # counts from now, when the client has its answer
                self._start_head_clock()

    def _start_head_clock(self) -> None:
        if self._head_timeout is None:
            return
        loop = asyncio.get_running_loop()
        self._head_since = now = loop.time()
        if self._head_timer is None:
            self._head_timer = loop.call_at(now + self._head_timeout, self._head_check)
        # else the pending timer is due sooner than this deadline, and moves on

    def _stop_head_clock(self) -> None:
        self._head_since = None  # the pending timer, if any, finds nothing due

    def _head_check(self) -> None:
        self._head_timer = None
        if self._head_since is None or self._head_timeout is None:
            return
        loop = asyncio.get_running_loop()
        deadline = self._head_since + self._head_timeout
        now = loop.time()
        if now < deadline:  # the clock started again since
            # at least a millisecond on: uvloop keeps time in whole ms, and a
            # timer due in less would run again at once until the ms turns
            self._head_timer = loop.call_at(max(deadline, now + 0.001), self._head_check)
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():  # no request is being handled
            log.debug("closing a connection that sent no whole request head in time")
            self._head_since = None
            self.force_close()
        # else a request runs (its head began this clock while it was handled):
        # the clock stays started, and finish_response starts it again

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
    def __init__(self, *args: Any, head_timeout: float | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout

    def __call__(self) -> web.RequestHandler:
        return JsonErrorRequestHandler(
            self, loop=self._loop, head_timeout=self.head_timeout, **self._kwargs
        )


class FeedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are handled by :class:`JsonErrorRequestHandler`.

    ``head_timeout``: seconds every request head may take to arrive (None:
    no limit but aiohttp's ``keepalive_timeout``).
    """

    def __init__(
        self, app: web.Application, *, head_timeout: float | None = None, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self.head_timeout = head_timeout

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            head_timeout=self.head_timeout,
            **made._kwargs,
        )
