"""The ready file (``--ready-file PATH``): how a supervisor learns that
``feedsvc serve`` accepts connections, and on which address.

Once the service accepts connections it writes one JSON object to PATH::

    {"url": "http://127.0.0.1:41235", "host": "127.0.0.1", "port": 41235,
     "pid": 3120, "workers": 1, "redis_url": "redis://127.0.0.1:40111/0"}

* ``url``: where to connect. A wildcard host (``0.0.0.0``, ``::``) is given
  as loopback, since that is where a supervisor on the same machine reaches
  it; ``host`` is the address bound.
* ``port``: the port bound, so also the real one with ``--port 0``.
* ``pid``: the process to send SIGTERM to (with ``--workers``, the parent
  that supervises the workers).
* ``redis_url``: the Redis in use: the embedded server's address when
  feedsvc started one.

When: a single process writes it once its listening socket is up. With
``--workers N`` the parent binds the socket and forks the workers; each
worker says over a pipe when it serves on the socket, and the parent writes
the file once all N have. Connections made before that would only wait in
the socket's backlog, but a supervisor that counts workers or their log
lines may rely on every worker being up.

The document goes to a temporary file in PATH's directory (created if
missing), which is then renamed over PATH: a reader finds no file or the
whole document, never a part of it. The file's mode is 0600, as the Redis
URL may carry a password. It is removed when the service starts to stop,
which is when it stops accepting connections.

Why a file, and not a log line or a file descriptor (the ``sd_notify`` or
s6 ``notification-fd`` way):

* Log lines are for people. Their wording and format (text or JSON) change,
  and the port had to be parsed back out of them; the test suite, the
  benchmarks and the load test runner each did it a little differently.
* A descriptor ties the service to a parent holding the other end, which
  must read it while the service starts. A path works from a shell script,
  a test, ``docker exec`` or a health check, and can be read again later.

The cost of a file: one left behind by a run that was killed (it had no
chance to remove it) looks like a ready service. A reader compares the
``pid`` in it with the process it started (``feedsvc.testing.service``
does), or removes the path before starting the service.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

#: Bound addresses that mean "every interface", and where to reach them locally.
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


@dataclass(frozen=True, slots=True)
class Ready:
    """The ready file's document (see the module docstring)."""

    url: str
    host: str
    port: int
    pid: int
    workers: int
    redis_url: str | None

    @classmethod
    def listening(cls, host: str, port: int, pid: int, workers: int, redis_url: str | None) -> Self:
        return cls(connect_url(host, port), host, port, pid, workers, redis_url)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Self:
        doc: dict[str, Any] = json.loads(text)
        return cls(
            url=str(doc["url"]),
            host=str(doc["host"]),
            port=int(doc["port"]),
            pid=int(doc["pid"]),
            workers=int(doc["workers"]),
            redis_url=None if doc.get("redis_url") is None else str(doc["redis_url"]),
        )


def connect_url(host: str, port: int) -> str:
    """The URL a client on this machine uses for a socket bound to host:port."""
    host = _WILDCARDS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def write_ready_file(path: Path, ready: Ready) -> None:
    """Write the document to path atomically: a temporary file, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(ready.to_json())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def read_ready_file(path: Path) -> Ready | None:
    """The document at path, or None if there is no file (yet, or any more)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return Ready.from_json(text)


def remove_ready_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
