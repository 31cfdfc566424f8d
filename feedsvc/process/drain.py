"""Graceful stop of one serving process: stop accepting, let the requests in
flight finish within ``--shutdown-grace``, cut off what is left.

Why not just ``AppRunner.cleanup()`` with ``shutdown_timeout=grace``? In
aiohttp 3.14 it stops the sites, then ``close()``s every connection, after
which the connection ignores every byte it receives, so a request whose body
is still arriving can never finish; then, per connection, it waits up to the
timeout for the request in progress, fails its body stream, waits up to the
timeout *again* and only then cancels it (twice the grace); and a timeout of
0 means no limit at all.

:meth:`Drain.run` therefore does the waiting itself, before ``cleanup()``:

1. from now on every response ends its connection (``Connection: close``,
   set in ``on_response_prepare``), so a keep-alive client is told to go
   elsewhere and a connection is done once its request is; and the
   :class:`~feedsvc.drain_signal.DrainSignal` is set, so every waiter (an
   event stream, a long poll, a claim wait) ends now with what it has
   instead of holding the grace period;
2. stop the sites: this process closes its listening socket (with
   ``--workers`` the supervisor closed its own copy first, so once every
   worker has stopped, new connections are refused, not queued for nobody);
3. close idle keep-alive connections, then wait until no connection has a
   request in progress (bodies still arriving are still read), polling, up
   to the grace period.

``cleanup()`` then finds only the requests that outlived the grace period;
the runner's tiny ``shutdown_timeout`` (:data:`CUT_OFF_WAIT`) makes it cancel
them at once: their clients see the connection closed without a response.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler

from feedsvc.drain_signal import DrainSignal

log = logging.getLogger("feedsvc")

#: How often the drain looks for finished requests and newly idle connections.
POLL_INTERVAL = 0.05

#: The runner's ``shutdown_timeout``: how long ``cleanup()`` still waits for a
#: request that outlived the grace period before cancelling it (aiohttp waits
#: it twice). Positive, because aiohttp reads 0 as "no limit".
CUT_OFF_WAIT = 0.05


def is_idle(handler: RequestHandler) -> bool:
    """The connection waits for a request head and has no request in progress.

    aiohttp has no public way to ask; its own keep-alive timer makes the
    same test (``_waiter`` exists only while ``start()`` waits for the next
    message). Bytes of a head not yet complete are dropped with the
    connection, as when the keep-alive timer closes it.
    """
    waiter = handler._waiter
    return waiter is not None and not waiter.done()


def has_request(handler: RequestHandler) -> bool:
    """A request on this connection has started and not finished.

    True from the moment its head is parsed (queued, not yet handled) until
    its response is written, also when the client left meanwhile (the
    handler still runs); false for a connection closed while idle.
    """
    if handler._request_in_progress:
        return True
    return handler.transport is not None and not is_idle(handler)


class Drain:
    """The stop sequence of one process; ``run()`` once, then ``runner.cleanup()``."""

    def __init__(self, runner: web.AppRunner, grace: float, draining: DrainSignal) -> None:
        self._runner = runner
        self._grace = grace
        self._draining = draining  # the app's (``feedsvc.appkeys.DRAINING``)
        self.started = False

    async def on_response_prepare(
        self, request: web.BaseRequest, response: web.StreamResponse
    ) -> None:
        if self.started:
            response.force_close()  # aiohttp closes the connection after it
            # aiohttp 3.14 has already chosen the headers when it calls this hook
            response.headers[hdrs.CONNECTION] = "close"

    async def run(self) -> None:
        """Stop accepting and wait for the requests in flight, up to the grace period."""
        self.started = True
        self._draining.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace
        for site in list(self._runner.sites):
            await site.stop()
        server = self._runner.server
        if server is None:
            return
        # One loop turn: bytes the kernel already holds are read, so a
        # connection whose request head has arrived does not look idle.
        await asyncio.sleep(0)
        busy = self._close_idle(server.connections)
        log.info(
            "draining: not accepting connections; %d requests in flight (grace %g s)",
            len(busy),
            self._grace,
        )
        while busy and loop.time() < deadline:
            await asyncio.sleep(min(POLL_INTERVAL, deadline - loop.time()))
            # A connection whose response was sent closes itself (Connection:
            # close); one that went idle in between is closed here.
            busy = self._close_idle(server.connections)
        if busy:
            log.warning(
                "cutting off %d requests still in progress after %g s", len(busy), self._grace
            )
        else:
            log.info("drained: no requests in flight")

    @staticmethod
    def _close_idle(connections: list[RequestHandler]) -> list[RequestHandler]:
        busy = []
        for handler in connections:
            if is_idle(handler):
                handler.force_close()
            elif has_request(handler):
                busy.append(handler)
        return busy
