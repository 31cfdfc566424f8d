"""Command line: ``feedsvc serve`` (and ``python -m feedsvc serve``)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from aiohttp import web

from feedsvc import __version__, tracing
from feedsvc.api.protocol import FeedAppRunner
from feedsvc.api.query_secrets import AccessLogger
from feedsvc.app import create_app
from feedsvc.appkeys import AUTHENTICATOR, DRAINING
from feedsvc.auth.access import Authenticator
from feedsvc.clock import SYSTEM_CLOCK
from feedsvc.config import LogSettings, Settings, UnusableSetting, add_arguments, settings_from
from feedsvc.embedded_redis.server import RedisServerError, RedisServerNotFound
from feedsvc.embedded_redis.supervisor import EmbeddedRedis
from feedsvc.process.drain import CUT_OFF_WAIT, Drain
from feedsvc.process.readiness import Ready, remove_ready_file, write_ready_file
from feedsvc.process.setup import YoungCollections, raise_open_files_limit, settle_heap
from feedsvc.process.workers import BACKLOG, bind, run_workers
from feedsvc.storage.drivers import eviction_problems

log = logging.getLogger("feedsvc")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="feedsvc", description="A Zaqar-v2-compatible message feed on Redis."
    )
    parser.add_argument("--version", action="version", version=f"feedsvc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP service",
        usage="%(prog)s [--help] [options]",  # every flag is listed below, by section
        description="Run the HTTP service. Every flag can also be set with the "
        "FEEDSVC_* environment variable named in its help; a flag wins.",
    )
    add_arguments(serve)
    return parser


def _loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if settings.loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


#: Called once the service accepts connections, with the address bound (host, port).
OnListening = Callable[[str, int], None]


async def serve(
    settings: Settings,
    sock: socket.socket | None = None,
    on_listening: OnListening | None = None,
    on_stopping: Callable[[], None] | None = None,
    embedded_redis: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Serve until SIGTERM (or SIGINT, unless ignored), then drain and close.

    With sock (a worker of --workers), accept on that already bound socket.
    ``on_listening`` runs once the socket accepts and the stop signals are
    handled, so whoever it tells may send SIGTERM at once; ``on_stopping``
    runs when the stop begins. The stop sequence is
    :class:`feedsvc.process.drain.Drain`'s. ``embedded_redis`` reports the embedded
    Redis in /v2/health.
    """
    # per process (a worker's exporter threads do not survive the fork)
    tracing.configure()
    app = create_app(settings, embedded_redis=embedded_redis)
    # answers requests too malformed to reach a route as JSON, like other errors
    runner = FeedAppRunner(
        app,
        access_log=logging.getLogger("feedsvc.access") if settings.access_log else None,
        access_log_format=ACCESS_FORMAT,
        access_log_class=AccessLogger,  # credentials in a query string are redacted
        handle_signals=False,
        keepalive_timeout=settings.keepalive_timeout,
        # every request head, not only a connection's first, within --client-timeout
        head_timeout=settings.client_timeout,
        # after an early answer (413, 408) do not wait long for the rest of a body
        lingering_time=1.0,
        # the grace period is spent by Drain.run(); cleanup() only cuts off
        shutdown_timeout=CUT_OFF_WAIT,
    )
    drain = Drain(runner, settings.shutdown_grace, app[DRAINING])
    app.on_response_prepare.append(drain.on_response_prepare)
    await runner.setup()
    site: web.BaseSite
    if sock is None:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=BACKLOG)
    else:
        site = web.SockSite(runner, sock, backlog=BACKLOG)
    await site.start()
    for address in runner.addresses:
        host, port = address[0], address[1]
        log.info(
            "feedsvc %s listening on http://%s:%s (driver %s, loop %s)",
            __version__,
            host,
            port,
            settings.driver,
            type(asyncio.get_running_loop()).__module__,
        )
    # everything made so far lives as long as the process: out of the
    # collector's way, which is set for many keep-alive clients
    settle_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None  # set up above
    young_collections = YoungCollections(loop, lambda: server.requests_count)
    young_collections.start()
    # the token file read again (with --workers, the supervisor passes SIGHUP on)
    loop.add_signal_handler(signal.SIGHUP, app[AUTHENTICATOR].reload)
    for sig in (signal.SIGINT, signal.SIGTERM):
        # a worker ignores SIGINT: its supervisor decides when it stops
        if signal.getsignal(sig) is not signal.SIG_IGN:
            loop.add_signal_handler(sig, stop.set)
    try:
        if on_listening is not None:
            host, port = runner.addresses[0][:2]
            on_listening(str(host), int(port))
        await stop.wait()
    finally:
        log.info("shutting down")
        if on_stopping is not None:
            on_stopping()
        await drain.run()
        await runner.cleanup()
        young_collections.stop()
        tracing.disable()  # the spans still buffered are exported


def run_serve(settings: Settings) -> int:
    """Run ``feedsvc serve``: its exit code (2: a setting this machine cannot honour)."""
    embedded: EmbeddedRedis | None = None
    raise_open_files_limit()  # a client is a descriptor (workers inherit it)
    try:
        Authenticator(settings, SYSTEM_CLOCK)  # the token and key files read, or exit 2
        tracing.check()  # the OTEL_* variables ask for what is installed, or exit 2
    except ValueError as exc:
        return refuse(UnusableSetting(str(exc)))
    if settings.auth_token:
        log.warning("--auth-token is visible to ps and in /proc: prefer --auth-token-file")
    try:
        # first, so that an address we cannot have costs nothing
        sock = bind(settings)
    except UnusableSetting as exc:
        return refuse(exc)
    try:
        if settings.redis_url is None:
            try:
                embedded = EmbeddedRedis(settings.data_dir, settings.redis_fsync)
                embedded.start()
            except UnusableSetting as exc:
                return refuse(exc)
            except (RedisServerNotFound, RedisServerError) as exc:
                print(f"feedsvc: error: {exc}", file=sys.stderr)
                return 1
            settings = settings.replace(redis_url=embedded.url)
        try:
            check_memory_policy(settings)
        except UnusableSetting as exc:
            return refuse(exc)
        report = None if embedded is None else embedded.status.read
        count = settings.worker_count()
        if count > 1:
            return run_workers(settings, count, partial(serve_on, embedded_redis=report), sock)
        ready_file = settings.ready_file
        if ready_file is None:
            serve_on(settings, sock, embedded_redis=report)
        else:

            def announce(host: str, port: int) -> None:
                ready = Ready.listening(host, port, os.getpid(), 1, settings.redis_url)
                write_ready_file(ready_file, ready)

            stopping = partial(remove_ready_file, ready_file)
            serve_on(settings, sock, announce, stopping, embedded_redis=report)
    finally:
        sock.close()
        if embedded is not None:
            embedded.stop()
    return 0


def check_memory_policy(settings: Settings) -> None:
    """UnusableSetting (one line, exit 2) if a Redis primary may evict
    feedsvc's keys, unless --allow-evicting-redis (then a warning)."""
    problems = asyncio.run(eviction_problems(settings))
    if problems is None:
        log.warning(
            "Redis not reachable at startup: its maxmemory-policy is read before the first write"
        )
    elif problems and settings.allow_evicting_redis:
        for line in problems:
            log.warning("serving anyway (--allow-evicting-redis): %s", line)
    elif problems:
        raise UnusableSetting(problems[0])


def refuse(exc: UnusableSetting) -> int:
    print(f"feedsvc: error: {exc}", file=sys.stderr)
    return 2


def serve_on(
    settings: Settings,
    sock: socket.socket | None = None,
    on_listening: OnListening | None = None,
    on_stopping: Callable[[], None] | None = None,
    embedded_redis: Callable[[], dict[str, Any]] | None = None,
) -> None:
    with asyncio.Runner(loop_factory=_loop_factory(settings)) as runner:
        runner.run(serve(settings, sock, on_listening, on_stopping, embedded_redis))


ACCESS_FORMAT = '%a "%r" %s %b %Tf %{X-Openstack-Request-Id}o'


def iso_utc(record: logging.LogRecord) -> str:
    """A record's time in ISO 8601, UTC, to the millisecond: 2026-01-31T12:00:00.123Z."""
    moment = dt.datetime.fromtimestamp(record.created, dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def json_formatter() -> logging.Formatter:
    """One JSON object a line: time (``iso_utc``), level, logger, pid, message,
    and whatever ``extra`` a call adds."""
    from pythonjsonlogger.json import JsonFormatter

    class Formatter(JsonFormatter):
        def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
            return iso_utc(record)

    return Formatter(
        "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
        rename_fields={"levelname": "level", "asctime": "time", "name": "logger", "process": "pid"},
    )


def configure_logging(settings: LogSettings) -> None:
    handler = logging.StreamHandler()
    if settings.log_format == "json":
        handler.setFormatter(json_formatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(settings)
    return run_serve(settings)
