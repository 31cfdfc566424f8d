"""Several event-loop processes behind one listening socket (``--workers N``).

The parent binds the socket once (``feedsvc serve`` does, with
:func:`bind`, before it starts anything else) and forks N workers that all accept on it
(the kernel hands each connection to one of them), so ``--port 0`` works and
no worker can steal the port from another. Each worker has its own event
loop and its own Redis pool and coalescer; they share the one Redis (the
embedded one too, started by the parent).

The parent only supervises: a worker that dies is replaced (with a short
backoff if workers keep dying at once, so a broken setting does not spin);
on SIGTERM or SIGINT it closes its copy of the listening socket and sends
SIGTERM to every worker; each stops accepting, finishes the requests in
flight (up to ``--shutdown-grace`` seconds, then cuts off the rest; see
:mod:`feedsvc.process.drain`), closes its Redis connections and exits. Once all
have stopped accepting, new connections are refused. A worker still alive
``KILL_AFTER_GRACE`` seconds after the grace period is killed, and the exit
code is then 1. Workers die with the parent (``PR_SET_PDEATHSIG`` on Linux).
SIGHUP to the parent is passed on to every worker (each reads
``--auth-token-file`` again).

Each worker tells the parent over a pipe when it serves on the socket
(its number and pid, one line); once every current worker has, the parent
writes ``--ready-file`` (:mod:`feedsvc.process.readiness`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from feedsvc.config import Settings, UnusableSetting
from feedsvc.embedded_redis.server import make_pdeathsig_preexec
from feedsvc.process.readiness import Ready, remove_ready_file, write_ready_file

log = logging.getLogger("feedsvc.workers")

RESTART_BACKOFF_MAX = 5.0
#: Seconds past --shutdown-grace a stopping worker has to exit before it is killed.
KILL_AFTER_GRACE = 5.0

#: What a worker runs: serve on the shared listening socket until SIGTERM,
#: calling the third argument with (host, port) once it accepts
#: (``feedsvc.cli.serve_on``; passed in, so this module needs nothing above it).
ServeOn = Callable[[Settings, socket.socket, Callable[[str, int], None]], None]


#: Connections the kernel completes and queues for the service to accept (a
#: client beyond it has its SYN dropped, and tries again only after one
#: second, then three, seven ...): as many as the kernel allows, which caps
#: it at ``net.core.somaxconn`` (4096 by default since Linux 5.4). Given to
#: every listen() of the socket: the event loop's create_server() calls
#: listen() again, with its own default of 100 or 128 unless told.
BACKLOG = 65535


def bind(settings: Settings) -> socket.socket:
    """The listening socket for --host and --port.

    ``feedsvc serve`` binds it before anything else starts (the embedded
    Redis, workers), so that an address it cannot have costs nothing.

    Raises:
        UnusableSetting: the port is in use, the host is no address of this
            machine or no name that resolves.
    """
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        where = f"[{settings.host}]" if family == socket.AF_INET6 else settings.host
        reason = exc.strerror or str(exc)
        raise UnusableSetting(
            f"cannot listen on {where}:{settings.port} (--host, --port): {reason}"
        ) from None
    sock.setblocking(False)
    return sock


def _worker(
    settings: Settings,
    sock: socket.socket,
    number: int,
    die_with_parent: Callable[[], None] | None,
    serve_on: ServeOn,
    listening_fd: int,
) -> None:
    # A forked worker keeps the parent's logging set-up (feedsvc.cli.main's).
    if die_with_parent is not None:
        die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # until serve() handles it (the token file read again), not the supervisor's handler
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log.info("worker %d started (pid %d)", number, os.getpid())

    def tell_parent(host: str, port: int) -> None:
        # one short line per write: a pipe write below PIPE_BUF is never interleaved
        os.write(listening_fd, f"{number} {os.getpid()}\n".encode())

    serve_on(settings, sock, tell_parent)


class Supervisor:
    def __init__(
        self, settings: Settings, count: int, serve_on: ServeOn, sock: socket.socket
    ) -> None:
        self.settings = settings
        self.count = count
        self._serve_on = serve_on
        self.sock = sock
        self._context = multiprocessing.get_context("fork")
        self._workers: dict[int, BaseProcess] = {}
        self._stopping = False
        # workers write "<number> <pid>" here once they serve (see _worker)
        self._listening_read, self._listening_write = os.pipe()
        os.set_blocking(self._listening_read, False)
        self._listening: dict[int, int] = {}  # worker number -> pid that said so
        self._unread = b""
        self._announced = False

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _start(self, number: int) -> None:
        # made in the parent: it compares the worker's parent pid with ours
        die_with_parent = make_pdeathsig_preexec()
        process = self._context.Process(
            target=_worker,
            args=(
                self.settings,
                self.sock,
                number,
                die_with_parent,
                self._serve_on,
                self._listening_write,
            ),
            daemon=False,
        )
        process.start()
        self._workers[number] = process

    def _stop(self, *_: object) -> None:
        self._stopping = True

    def _pass_on_hangup(self, *_: object) -> None:
        """SIGHUP (read the token file again) goes to every worker."""
        for process in self._workers.values():
            if process.exitcode is None and process.pid is not None:
                os.kill(process.pid, signal.SIGHUP)

    def _wait_for_listening(self, timeout: float) -> None:
        """Up to timeout: read what workers said; announce once every current worker serves."""
        readable, _, _ = select.select([self._listening_read], [], [], timeout)
        if not readable:
            return
        try:
            self._unread += os.read(self._listening_read, 4096)
        except BlockingIOError:
            return
        *lines, self._unread = self._unread.split(b"\n")
        for line in lines:
            number, pid = (int(field) for field in line.split())
            self._listening[number] = pid
        everyone = all(
            self._listening.get(number) == process.pid for number, process in self._workers.items()
        )
        if everyone and not self._announced and not self._stopping:
            self._announced = True
            if self.settings.ready_file is not None:
                host = str(self.sock.getsockname()[0])
                ready = Ready.listening(
                    host, self.port, os.getpid(), self.count, self.settings.redis_url
                )
                write_ready_file(self.settings.ready_file, ready)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGHUP, self._pass_on_hangup)
        log.info(
            "feedsvc supervising %d workers on http://%s:%d",
            self.count,
            self.settings.host,
            self.port,
        )
        for number in range(1, self.count + 1):
            self._start(number)
        backoff = 0.0
        while not self._stopping:
            self._wait_for_listening(0.1)
            for number, process in list(self._workers.items()):
                if process.exitcode is None or self._stopping:
                    continue
                log.warning(
                    "worker %d (pid %s) exited with %s; starting another",
                    number,
                    process.pid,
                    process.exitcode,
                )
                backoff = min(RESTART_BACKOFF_MAX, backoff * 2 or 0.1)
                time.sleep(backoff)
                self._start(number)
            if all(p.exitcode is None for p in self._workers.values()):
                backoff = max(0.0, backoff - 0.01)
        return self._shutdown()

    def _shutdown(self) -> int:
        # Our copy of the listening socket goes first: a stopping worker
        # closes its own before it drains, so once every worker has, the
        # port refuses new connections instead of queueing them for nobody.
        if self.settings.ready_file is not None:
            remove_ready_file(self.settings.ready_file)
        self.sock.close()
        grace = self.settings.shutdown_grace
        log.info("stopping %d workers (grace %g s)", len(self._workers), grace)
        for process in self._workers.values():
            if process.exitcode is None and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        # A worker cuts off what outlives the grace period itself and then
        # closes its Redis connections; only a worker stuck past that is killed.
        deadline = time.monotonic() + grace + KILL_AFTER_GRACE
        killed = 0
        for process in self._workers.values():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                log.warning("worker pid %s did not stop in time; killing it", process.pid)
                process.kill()
                process.join(5)
                killed += 1
        os.close(self._listening_read)
        os.close(self._listening_write)
        return 1 if killed else 0


def run_workers(settings: Settings, count: int, serve_on: ServeOn, sock: socket.socket) -> int:
    """Fork count workers that accept on sock (from :func:`bind`); supervise them."""
    # Nothing asyncio may run in the parent before the fork.
    assert not _running_loop()
    return Supervisor(settings, count, serve_on, sock).run()


def _running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
