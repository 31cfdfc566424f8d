"""What the speed suite (bench/run.py) and its live parts (bench/live.py) share:
the feedsvc process they measure and the little of the suite a part uses."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Protocol

from feedsvc.redis_server import RedisServer
from feedsvc.testing import ServiceProcess

PRODUCER = "3381af92-2b9e-11e3-b191-71861300734c"


class Service(ServiceProcess):
    """A feedsvc serve process (with /bench/hello) against a given Redis."""

    def __init__(self, redis_url: str, log: Path, *flags: str) -> None:
        super().__init__(
            "--redis-url", redis_url, "--bench-routes", "--log-level", "WARNING", *flags,
            log_path=log,
        )  # fmt: skip

    def request(self, method: str, path: str, body: object = None, client: str = PRODUCER) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Client-ID": client, "X-Project-ID": "bench", "Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as response:
            return bytes(response.read())


class SuiteLike(Protocol):
    """What a part in bench/live.py uses of bench.run.Suite."""

    workdir: Path
    redis: RedisServer

    def add(self, name: str, **values: object) -> None: ...
