"""``feedsvc serve`` as a child process: start it, know where it listens, stop
it, and leave nothing behind.

One harness for everything that runs the real service: the tests, the
benchmarks (``bench/``) and the load test runner (``loadtest/compare.py``)::

    with ServiceProcess("--redis-url", url, "--driver", "watch") as svc:
        urllib.request.urlopen(svc.url + "/v2/ping", ...)
        assert svc.stop() == 0          # SIGTERM: drain, exit code
    # here every process of the service is gone

Why it lives in the package (``feedsvc.testing``) and not in ``tests/``: bench
and loadtest import it as well, and they run against an installed feedsvc,
from a checkout where ``tests`` is no package of theirs. It imports only the
standard library and feedsvc (no pytest), so shipping it in the wheel costs
nothing. The compose Locust image mounts only ``loadtest/`` and runs only
the locustfile, which imports none of this (and no feedsvc at all).

How it works:

* **Ready.** It passes ``FEEDSVC_READY_FILE`` (a path in a temporary
  directory of its own) and waits for that file, whose ``pid`` must be the
  child's, so a file left by an earlier run does not count
  (:mod:`feedsvc.process.readiness`). Meanwhile it checks the child is alive; if it
  exits or is not ready in ``ready_timeout`` seconds, :class:`ServiceError`
  carries the tail of its log. With ``port=0`` (the default) the kernel
  picks the port, so there is no free-port race to retry.
* **Environment.** The caller's environment without any ``FEEDSVC_*``
  variable (a developer's settings must not leak in), then ``env``. The
  embedded Redis's data directory defaults to the temporary directory, not
  the caller's working directory.
* **Signals.** The child starts a session of its own
  (``start_new_session``): a Ctrl-C in a terminal reaches the runner, not
  the service, which the runner then stops. Its SIGINT is reset to the
  default, because a runner started with SIGINT ignored (``nohup``, ``&`` in
  a script) would otherwise pass the ignoring on, and the service respects
  an ignored SIGINT. Nothing here stops anything with SIGINT: ``stop()``
  sends SIGTERM unless told otherwise. On Linux the child also gets SIGTERM
  (``PR_SET_PDEATHSIG``) if the runner dies without cleaning up (``kill
  -9``, a CI time limit), so it drains and takes its workers and Redis
  along; as with :class:`feedsvc.embedded_redis.server.RedisServer`, that signal
  comes when the *thread* that called ``start()`` exits, so start the
  service from a long-lived thread, normally the main one.
* **Nothing left behind.** ``kill()``, a ``stop()`` that times out and the
  end of the ``with`` block SIGKILL every process of the child's session:
  its process group (``--workers`` children) and, on Linux, also the
  embedded ``redis-server``, which feedsvc starts in a process group of its
  own so that a terminal's Ctrl-C does not reach it before the service has
  stopped. The block ends with a graceful ``stop()`` first, unless it is
  left by an exception (a failing test should not wait for a drain).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from feedsvc.config import ENV_PREFIX
from feedsvc.embedded_redis.server import make_pdeathsig_preexec
from feedsvc.process.readiness import Ready, read_ready_file

__all__ = ["ServiceError", "ServiceProcess", "feedsvc_command"]

#: How much of the log an error message quotes.
LOG_TAIL_CHARS = 4000
#: How often the ready file and the child are looked at while starting.
POLL_INTERVAL = 0.02
#: How long kill() goes on finding and killing processes of the session.
KILL_PATIENCE = 10.0


class ServiceError(RuntimeError):
    """The service exited before it was ready, or was not ready in time."""


def feedsvc_command() -> list[str]:
    """``python -m feedsvc serve`` with this interpreter."""
    return [sys.executable, "-m", "feedsvc", "serve"]


def _child_setup() -> Callable[[], None]:
    """What the child does between fork and exec: SIGINT back to the
    default, and (Linux) SIGTERM when the thread that started it exits."""
    die_with_runner = make_pdeathsig_preexec()  # resolved here, in the parent

    def setup() -> None:
        # one signal call and one prctl: no lock is taken, nothing is loaded
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if die_with_runner is not None:
            die_with_runner()

    return setup


def session_members(sid: int) -> list[int]:
    """Pids of the live (not zombie) processes in session ``sid`` (Linux; else [])."""
    found = []
    try:
        entries = os.listdir("/proc")
    except FileNotFoundError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and ')'
        fields = stat.rpartition(b")")[2].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != b"Z":
            found.append(int(name))
    return found


class ServiceProcess:
    """One ``feedsvc serve`` child process (see the module docstring).

    ``args`` go after ``serve`` (after ``--port PORT`` unless ``port`` is
    None, so an explicit ``--port`` in args wins). ``command`` replaces
    ``python -m feedsvc serve`` (e.g. a ``feedsvc`` console script). The log
    (stdout and stderr) is appended to ``log_path``, by default a file in the
    temporary directory; :meth:`log_text` still reads it after the end.
    The temporary directory (ready file, default log, the embedded Redis's
    data) is made in ``temp_parent`` (default: the system's) and removed by
    :meth:`close`.
    """

    def __init__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        port: int | None = 0,
        command: Sequence[str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        temp_parent: Path | None = None,
        ready_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self.args = tuple(args)
        self.env = dict(env or {})
        self.port_flag = port
        self.command = list(command) if command is not None else feedsvc_command()
        self.cwd = cwd
        self.temp_parent = temp_parent
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self._log_path = log_path
        self._workdir: Path | None = None
        self._ready_file: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready: Ready | None = None
        self._log_offset = 0  # where this run's output starts in the log
        self._final_log: str | None = None  # the log, once its directory is gone

    # -- what it reports -------------------------------------------------------

    @property
    def ready(self) -> Ready:
        """The service's ready file (:class:`feedsvc.process.readiness.Ready`)."""
        if self._ready is None:
            raise ServiceError("the service has not been started")
        return self._ready

    @property
    def url(self) -> str:
        """``http://host:port``, the port being the real one."""
        return self.ready.url

    @property
    def host(self) -> str:
        return self.ready.host

    @property
    def port(self) -> int:
        return self.ready.port

    @property
    def pid(self) -> int:
        """The service's pid (the supervisor's with ``--workers``)."""
        return self.ready.pid

    @property
    def redis_url(self) -> str | None:
        """The Redis it uses: the embedded one's URL if it started one."""
        return self.ready.redis_url

    @property
    def ready_file(self) -> Path:
        """Where the service writes its ready file (in the temporary directory)."""
        if self._ready_file is None:
            raise ServiceError("the service has not been started")
        return self._ready_file

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise ServiceError("the service has not been started")
        return self._log_path

    @property
    def process(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise ServiceError("the service has not been started")
        return self._proc

    @property
    def returncode(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.process.poll()

    def log_text(self) -> str:
        """Everything in the log so far (also from earlier runs into the same file)."""
        if self._final_log is not None:
            return self._final_log
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def live_pids(self) -> list[int]:
        """Every live process of the service: itself, workers, the embedded Redis."""
        if self._proc is None:
            return []
        members = session_members(self._proc.pid)
        if not members and self._proc.poll() is None:
            members = [self._proc.pid]  # no /proc: only the child is known
        return members

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> Self:
        """Start the service and wait until it is ready; again after it stopped."""
        if self._proc is not None:
            if self._proc.poll() is None:
                raise ServiceError(f"already running (pid {self._proc.pid})")
            self._kill_session()
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="feedsvc-service-", dir=self.temp_parent))
        if self._log_path is None:
            self._log_path = self._workdir / "serve.log"
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        ready_file = self._ready_file = self._workdir / "ready.json"
        ready_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env[ENV_PREFIX + "DATA_DIR"] = str(self._workdir / "data")
        env.update(self.env)
        env[ENV_PREFIX + "READY_FILE"] = str(ready_file)
        argv = list(self.command)
        if self.port_flag is not None:
            argv += ["--port", str(self.port_flag)]
        argv += self.args
        self._ready = None
        self._final_log = None
        with self._log_path.open("ab") as out:
            self._log_offset = out.tell()
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
                # From Python, the only way to undo an inherited SIG_IGN and
                # to set PDEATHSIG in the child (see _child_setup).
                preexec_fn=_child_setup(),  # noqa: PLW1509
            )
        try:
            self._ready = self._wait_ready(self._proc, ready_file)
        except BaseException:
            self.close(graceful=False)  # the error carries the log's tail
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen[bytes], ready_file: Path) -> Ready:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise ServiceError(
                    f"{self._describe()} exited with code {code} before it was ready" + self._tail()
                )
            ready = read_ready_file(ready_file)
            if ready is not None and ready.pid == proc.pid:
                return ready
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"{self._describe()} was not ready after {self.ready_timeout:g} s"
                    + self._tail()
                )
            time.sleep(POLL_INTERVAL)

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int:
        """Send ``sig`` (SIGTERM: drain and exit) and wait for the exit code.

        If it has not exited after ``timeout`` seconds (default
        ``stop_timeout``), every process of the service is killed and the
        code is then -9. Processes it leaves behind (none, normally) are
        left to :meth:`close`, so that a test can look for them.
        """
        proc = self.process
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._kill_session()
                proc.wait()
        return proc.returncode

    def kill(self) -> int:
        """SIGKILL every process of the service at once; the exit code (-9 if it ran)."""
        proc = self.process
        self._kill_session()
        proc.wait()
        return proc.returncode

    def close(self, graceful: bool = True) -> None:
        """Stop (gracefully, or not), kill whatever is left, remove the temporary files."""
        if self._proc is not None:
            if graceful:
                self.stop()
            self._kill_session()
            self._proc.wait()
        if self._workdir is not None:
            if self._log_path is not None and self._log_path.is_relative_to(self._workdir):
                self._final_log = self.log_text()
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _kill_session(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if not os.path.isdir("/proc/self"):
            # no /proc to find the session by: the process group (the
            # service and its workers) is what can be named
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        # The session holds the service's process group (it and its workers)
        # and the embedded redis-server's (a group of its own). Linux does not
        # hand out a pid that is still some process's session id, so the
        # members found are ours even after the service itself was reaped.
        deadline = time.monotonic() + KILL_PATIENCE
        while True:
            members = session_members(proc.pid)
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # a supervisor may have forked a worker between the scan and its death
            if not members or time.monotonic() > deadline:
                return
            time.sleep(POLL_INTERVAL)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(graceful=exc_type is None)

    def __repr__(self) -> str:
        where = self._ready.url if self._ready is not None else "not ready"
        pid = self._proc.pid if self._proc is not None else None
        return f"ServiceProcess({where}, pid={pid})"

    # -- messages ----------------------------------------------------------------

    def _describe(self) -> str:
        return f"feedsvc serve (pid {self.process.pid})"

    def _tail(self) -> str:
        """The end of what this run wrote to the log, for an error message."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            text = ""
        if not text.strip():
            return f" (nothing in {self.log_path})"
        return f"; the end of its log ({self.log_path}):\n" + text[-LOG_TAIL_CHARS:]
