"""The embedded Redis's data directory (``--data-dir``): made, and locked.

What is in it::

    appendonlydir/       Redis's AOF files (the data)
    redis.log            Redis's log
    feedsvc.lock         flock()ed by the one feedsvc serve using the directory;
                         holds its pid and its redis-server's

**One service per directory.** Two services on one directory would run two
redis-servers appending to one AOF, each blind to the other's writes.
:class:`DataDirLock` takes an exclusive ``flock`` on ``feedsvc.lock`` (and
writes its pid there, for the error message of the next one); the lock
lives as long as the open file, which ``feedsvc serve`` keeps for its whole
life and hands to its redis-server too, so the directory stays locked until
both are gone. Workers of ``--workers`` inherit it from the parent that took
it. ``flock`` is advisory and local: it does not guard a directory shared
over NFS between machines.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from feedsvc.config import UnusableSetting

LOCK_NAME = "feedsvc.lock"


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
