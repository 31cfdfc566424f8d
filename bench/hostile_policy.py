"""What one subscription's retry policy costs everyone else:
``python -m bench.hostile_policy``.

Starts ``feedsvc serve`` (its embedded Redis in a temporary directory) and a
webhook on 127.0.0.1 that answers every POST with 500; tries the policy of
the issue that stalled the process (``retries_with_no_delay`` 10^8, now a
400), then subscribes with the largest policy the bounds allow, posts 10
messages and, for 20 s, pings the service every 50 ms and reads its RSS.
Prints the webhook attempts, the ping latency (median, p99, max) and the
RSS at the start and its maximum.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import psutil
from aiohttp import web


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def main() -> None:
    hits = 0

    async def hook(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        await request.read()
        return web.Response(status=500)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    hport = free_port()
    await web.TCPSite(runner, "127.0.0.1", hport).start()
    port = free_port()
    data = tempfile.mkdtemp()
    feedsvc = str(Path(sys.executable).with_name("feedsvc"))
    proc = subprocess.Popen(  # noqa: ASYNC220 (started once, before any measuring)
        [
            feedsvc,
            "serve",
            "--port",
            str(port),
            "--data-dir",
            data,
            "--subscriber-allow",
            "127.0.0.1/32",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    H = {
        "Client-ID": str(uuid.uuid4()),
        "X-Project-ID": "hostile",
        "Content-Type": "application/json",
    }
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(100):
                try:
                    async with s.get(base + "/v2/ping") as r:
                        if r.status == 204:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            hostile = {
                "subscriber": f"http://127.0.0.1:{hport}/hook",
                "ttl": 3600,
                "options": {"_retry_policy": {"retries_with_no_delay": 100000000}},
            }
            async with s.post(base + "/v2/queues/q/subscriptions", json=hostile, headers=H) as r:
                print(
                    "hostile policy (retries_with_no_delay 1e8):",
                    r.status,
                    (await r.json()).get("description"),
                )
            biggest = {
                "retries_with_no_delay": 100,
                "minimum_delay_retries": 1000,
                "minimum_delay": 0,
                "maximum_delay": 86400,
                "maximum_delay_retries": 1000,
            }
            sub = dict(hostile, options={"_retry_policy": biggest})
            async with s.post(base + "/v2/queues/q/subscriptions", json=sub, headers=H) as r:
                print("largest allowed policy:", r.status)
            proc_ps = psutil.Process(proc.pid)
            rss0 = proc_ps.memory_info().rss
            async with s.post(
                base + "/v2/queues/q/messages",
                json={"messages": [{"body": i} for i in range(10)]},
                headers=H,
            ) as r:
                assert r.status == 201
            lat = []
            rss = []
            t_end = time.monotonic() + 20
            while time.monotonic() < t_end:
                t0 = time.perf_counter()
                async with s.get(base + "/v2/ping") as r:
                    await r.read()
                lat.append((time.perf_counter() - t0) * 1000)
                rss.append(proc_ps.memory_info().rss)
                await asyncio.sleep(0.05)
            lat.sort()
            print(
                f"20 s: webhook attempts {hits}; ping median {statistics.median(lat):.2f} ms, "
                f"p99 {lat[int(len(lat) * 0.99)]:.2f} ms, max {lat[-1]:.2f} ms "
                f"over {len(lat)} pings; "
                f"RSS {rss0 / 2**20:.0f} MB at start, max {max(rss) / 2**20:.0f} MB"
            )
    finally:
        proc.terminate()
        proc.wait(10)
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
