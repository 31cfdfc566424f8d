"""The embedded Redis of ``feedsvc serve`` (no ``--redis-url``): started in
its data dir, kept alive, and reported in ``/v2/health``.

:class:`EmbeddedRedis` makes the data dir, locks it, picks the server that
can read it (:mod:`feedsvc.embedded_redis.data_dir`), starts it
(:class:`feedsvc.embedded_redis.server.RedisServer`) and records it as the data
dir's. Then a watchdog thread looks at the child every ``POLL_INTERVAL``
seconds. When the child has died (killed, crashed, out of memory), the watchdog
reaps it (no zombie), logs the death at ERROR and starts the server again
on the same port and data dir, after a back-off: ``RESTART_BACKOFF_MIN``
seconds, doubled for every death or failed start that follows within
``STABLE_AFTER`` seconds of the last start, at most ``RESTART_BACKOFF_MAX``;
a failed start is logged at ERROR and tried again. Meanwhile requests are
answered 503 with Retry-After, as for any Redis that cannot be reached, and
the service's connections find the new server by themselves (same address;
the lua driver reloads its scripts on NOSCRIPT). With ``--workers`` the
parent, which started Redis, runs the watchdog; workers only read its
report.

The report (``"embedded_redis"`` in ``/v2/health``)::

    {"running": true, "pid": 4242, "server": "valkey 9.1.2", "restarts": 1,
     "last_exit": {"code": null, "signal": "SIGKILL", "at": "2026-11-24T09:54:25Z"}}

It lives in a page of shared memory (:class:`SharedStatus`), written by the
watchdog and read by every process forked after it was made: the workers.
"""

from __future__ import annotations

import json
import logging
import mmap
import signal
import struct
import threading
import time
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from feedsvc.embedded_redis.data_dir import (
    DataDirLock,
    choose_server,
    make_data_dir,
    read_record,
    write_record,
)
from feedsvc.embedded_redis.server import RedisServer, RedisServerError, RedisServerNotFound

log = logging.getLogger("feedsvc.embedded")

#: How often the watchdog looks at the child.
POLL_INTERVAL = 0.1
RESTART_BACKOFF_MIN = 0.1
RESTART_BACKOFF_MAX = 5.0
#: A server that ran this long had recovered: its death waits the minimum again.
STABLE_AFTER = 10.0


class SharedStatus:
    """A small JSON document in anonymous shared memory (``MAP_SHARED``).

    One process writes it (the watchdog thread); it and the processes it
    forks afterwards read it. A read that overlaps a write sees a checksum
    that does not match and reads again, so no lock is shared between
    processes.
    """

    SIZE = 4096
    _HEADER = struct.Struct("<II")  # payload length, crc32 of the payload

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, self.SIZE)
        self.write({})

    def write(self, doc: dict[str, Any]) -> None:
        payload = json.dumps(doc, sort_keys=True).encode()
        if self._HEADER.size + len(payload) > self.SIZE:
            raise ValueError(f"status document of {len(payload)} bytes does not fit")
        self._map[: self._HEADER.size + len(payload)] = (
            self._HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        )

    def read(self) -> dict[str, Any]:
        """The last document written (``{}`` only if every try met a write)."""
        for _ in range(1000):  # a write takes microseconds; this never spins long
            length, crc = self._HEADER.unpack_from(self._map, 0)
            payload = self._map[self._HEADER.size : self._HEADER.size + length]
            if len(payload) == length and zlib.crc32(payload) == crc:
                doc: dict[str, Any] = json.loads(payload)
                return doc
        return {}


class EmbeddedRedis:
    """The embedded Redis of one ``feedsvc serve``, supervised (module docstring).

    The constructor takes the data dir (made and locked) and picks the
    server; :meth:`start` starts it and the watchdog; :meth:`stop` stops
    both and unlocks the data dir. Start and stop in the main thread.

    Raises (constructor, start):
        UnusableSetting: the data dir is no directory, is in use, or needs a
            server that is not installed.
        RedisServerNotFound: no server at all.
        RedisServerError: the server did not start.
    """

    def __init__(self, data_dir: Path, appendfsync: str) -> None:
        self.data_dir = make_data_dir(data_dir)
        self._lock = DataDirLock(self.data_dir)
        try:
            self.choice = choose_server(self.data_dir)
            assert self._lock.fd is not None
            # the server holds the lock too: a new service waits until it is gone
            self.server = RedisServer(
                self.data_dir,
                appendfsync=appendfsync,
                executable=self.choice.executable,
                pass_fds=(self._lock.fd,),
                # a full Redis refuses writes (503) rather than evict messages
                extra_args=("--maxmemory-policy", "noeviction"),
            )
        except BaseException:
            self._lock.release()
            raise
        self.status = SharedStatus()
        self._restarts = 0
        self._last_exit: dict[str, Any] | None = None
        self._pid: int | None = None
        self._stopping = threading.Event()
        # held while the server is started or stopped: stop() waits for a restart
        self._mutex = threading.Lock()
        self._watchdog: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        """Start the server, record it as the data dir's, and watch it."""
        try:
            self.server.start()
        except BaseException:
            self._lock.release()
            raise
        # only now: the data is this server's once it has loaded and written it
        if read_record(self.data_dir) != self.choice:
            write_record(self.data_dir, self.choice)
        self._pid = self.server.pid
        self._lock.note_server(self._pid)
        self._publish()
        log.info(
            "embedded Redis (%s, pid %s) at %s, data in %s",
            self.choice.identity,
            self._pid,
            self.url,
            self.data_dir,
        )
        self._watchdog = threading.Thread(target=self._watch, name="embedded-redis", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        """Stop the watchdog and the server (it writes its AOF and exits); unlock. Idempotent."""
        self._stopping.set()
        with self._mutex:
            self.server.stop()
        if self._watchdog is not None:
            self._watchdog.join()
            self._watchdog = None
        self._lock.release()

    # -- the watchdog ----------------------------------------------------------------

    def _watch(self) -> None:
        backoff = 0.0
        started = time.monotonic()
        while not self._stopping.wait(POLL_INTERVAL):
            code = self.server.poll()  # reaps a dead child
            if code is None:
                continue
            self._died(code)
            ran = time.monotonic() - started
            backoff = RESTART_BACKOFF_MIN if ran >= STABLE_AFTER else _grow(backoff)
            log.error(
                "embedded Redis (pid %s) died: %s; restarting it in %g s (its log: %s)",
                self._pid,
                self._last_exit_text(code),
                backoff,
                self.server.log_path,
            )
            while not self._restart(backoff):
                backoff = _grow(backoff)
                if self._stopping.is_set():
                    return
            started = time.monotonic()

    def _restart(self, delay: float) -> bool:
        """After delay, start the server again; False if that failed (or we are stopping)."""
        if self._stopping.wait(delay):
            return False
        with self._mutex:
            if self._stopping.is_set():
                return False
            try:
                self.server.start()
            except (RedisServerError, RedisServerNotFound, OSError) as exc:
                log.error(
                    "embedded Redis did not restart (next attempt in %g s): %s",
                    _grow(delay),
                    exc,
                )
                return False
        self._restarts += 1
        self._pid = self.server.pid
        self._lock.note_server(self._pid)
        self._publish()
        log.warning(
            "embedded Redis restarted (pid %s, restart %d) at %s",
            self._pid,
            self._restarts,
            self.url,
        )
        return True

    def _died(self, code: int) -> None:
        signame = None
        if code < 0:
            try:
                signame = signal.Signals(-code).name
            except ValueError:
                signame = f"signal {-code}"
        self._last_exit = {
            "code": None if code < 0 else code,
            "signal": signame,
            "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        self._publish(running=False)

    def _last_exit_text(self, code: int) -> str:
        if self._last_exit is not None and self._last_exit["signal"] is not None:
            return f"killed by {self._last_exit['signal']}"
        return f"exit code {code}"

    def _publish(self, running: bool = True) -> None:
        self.status.write(
            {
                "running": running,
                "pid": self._pid if running else None,
                "server": str(self.choice.identity),
                "restarts": self._restarts,
                "last_exit": self._last_exit,
            }
        )


def _grow(backoff: float) -> float:
    return min(RESTART_BACKOFF_MAX, max(RESTART_BACKOFF_MIN, backoff * 2))
