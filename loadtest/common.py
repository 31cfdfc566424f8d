"""What ``python -m loadtest compare`` (loadtest/compare.py) and ``python -m
loadtest follow`` (loadtest/follow.py) share: names, the final audit of the
queues and the description of the machine. Process CPU metering, the
open-files limit, waiting for an idle machine and stopping a process are
bench/machine.py's, shared with the bench."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from feedsvc import __version__ as feedsvc_version
from feedsvc.config import STORAGE_LAYOUTS
from feedsvc.embedded_redis.server import find_redis_server
from loadtest.checker import FeedChecker, read_stamp

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
POST = "POST messages"
GET = "GET messages"
SAMPLE_EVERY = 0.5
QUEUE_PREFIX = "lt"
PROJECT = "compare"


def add_layout_flag(parser: argparse.ArgumentParser) -> None:
    """``--storage-layout``: the layout every ``feedsvc serve`` of the run writes."""
    parser.add_argument(
        "--storage-layout",
        choices=STORAGE_LAYOUTS,
        default=None,
        help="feedsvc serve --storage-layout of every run (default: the service's default)",
    )


def layout_flags(layout: str | None) -> list[str]:
    """The ``feedsvc serve`` flags that choose ``layout`` (none: its default)."""
    return [] if layout is None else ["--storage-layout", layout]


def say(line: str) -> None:
    """A line of progress on the console, indented under its cell's heading."""
    print(f"   {line}", flush=True)


def audit(base: str, queues: list[str], acknowledged: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Read every queue from its head once the producers have stopped, through
    the same checker, then ask it for acknowledged messages never seen."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": PROJECT}
    read, findings = 0, []
    try:
        for queue in queues:
            checker = FeedChecker(queue)
            url = f"/v2/queues/{queue}/messages?limit=20&echo=true&include_claimed=true"
            while True:
                conn.request("GET", url, headers=headers)
                response = conn.getresponse()
                body = response.read()
                if response.status != 200:
                    raise RuntimeError(f"audit: GET {url} -> {response.status} {body[:200]!r}")
                payload = json.loads(body)
                now = time.time()
                for message in payload["messages"]:
                    stamp = read_stamp(message["body"])
                    if stamp is not None:
                        finding = checker.see(stamp, message["ttl"], now)
                        if finding is not None:
                            findings.append(str(finding))
                links = [link["href"] for link in payload["links"] if link["rel"] == "next"]
                if not links:
                    break
                url = links[0]
            findings += [str(f) for f in checker.lost(acknowledged.get(queue, {}))]
            read += checker.checked
    finally:
        conn.close()
    return {"read": read, "findings": len(findings), "examples": findings[:5]}


def _output(*command: str) -> str:
    """stdout of a short command, or "" when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    from importlib.metadata import version

    source = Path(sys.modules["feedsvc"].__file__ or ".").resolve().parent.parent
    commit = _output("git", "-C", str(source), "rev-parse", "--short", "HEAD")
    if not commit:
        commit = "not a git checkout"
    elif _output("git", "-C", str(source), "status", "--porcelain", "feedsvc", "lua"):
        commit += " + local changes"
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "feedsvc": f"{feedsvc_version} ({commit})",
        "locust": version("locust"),
        "redis_server": _output(find_redis_server(), "--version"),
    }
