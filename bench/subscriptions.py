"""Many subscriptions on one queue: creating them at once, and deleting the
queue that holds them (issue 28, items 7 and 8)::

    python -m bench.subscriptions [--driver lua|watch] [--count 10000]
                                  [--concurrency 50] [--deliveries]

One private redis-server, one ``feedsvc serve`` on it and, with
``--deliveries``, a webhook receiver in this process that every
subscription points at (answering 200 after ``RECEIVER_DELAY`` s, so the
deliveries are still running when the queue goes). It creates ``--count``
subscriptions (distinct subscribers) on one queue, ``--concurrency`` at a
time, and counts the answers by status; with ``--deliveries`` it then posts
``MESSAGES`` messages and lets delivery start. Then it times the ``DELETE``
of the queue, checks the queue's subscriptions are gone at once (a listing
is empty, the receiver gets nothing of that queue posted afterwards), and
waits for the keys the subscriptions left to be swept. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from redis.asyncio import Redis

from bench.service import PRODUCER, Service
from feedsvc.embedded_redis.server import RedisServer

QUEUE = "many"
MESSAGES = 3
RECEIVER_DELAY = 0.2
SWEEP_PATIENCE = 120.0
# the subscription keys of the queue: :s:<id>, :sl:<id>, :sg:<sha1>, :subs, :subu, :subx
LEFT = "fs:{bench/many}:s[:lgu]*"
HEADERS = {"Client-ID": PRODUCER, "X-Project-ID": "bench"}


async def receiver(hits: Counter[str]) -> tuple[web.AppRunner, str]:
    async def hook(request: web.Request) -> web.Response:
        hits["received"] += 1
        await asyncio.sleep(RECEIVER_DELAY)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook/{n}", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/hook/"


async def measure(svc: Service, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    hits: Counter[str] = Counter()
    runner, hook = await receiver(hits)
    base = svc.url + f"/v2/queues/{QUEUE}"
    statuses: Counter[int] = Counter()
    limit = asyncio.Semaphore(args.concurrency)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(headers=HEADERS, connector=connector) as http:

        async def create(n: int) -> None:
            body = {"subscriber": f"{hook}{n}", "ttl": 3600}
            async with limit, http.post(base + "/subscriptions", json=body) as resp:
                await resp.read()
                statuses[resp.status] += 1

        started = time.perf_counter()
        await asyncio.gather(*(create(n) for n in range(args.count)))
        create_s = time.perf_counter() - started
        if args.deliveries:
            messages = [{"body": {"n": i}, "ttl": 300} for i in range(MESSAGES)]
            async with http.post(base + "/messages", json={"messages": messages}) as resp:
                assert resp.status == 201, await resp.text()
            async with asyncio.timeout(60):
                while hits["received"] < min(args.count, 100):  # noqa: ASYNC110 (a count)
                    await asyncio.sleep(0.05)
        started = time.perf_counter()
        async with http.delete(base) as resp:
            delete_status = resp.status
        delete_s = time.perf_counter() - started
        after_delete = hits["received"]
        async with http.get(base + "/subscriptions?limit=20") as resp:
            listed = (await resp.json())["subscriptions"]
        # a message posted to the re-created queue reaches no old subscription
        async with http.post(base + "/messages", json={"messages": [{"body": "after"}]}) as resp:
            assert resp.status == 201, await resp.text()
    await asyncio.sleep(2 * RECEIVER_DELAY)
    # notifications that reached the receiver after the DELETE was answered
    late = hits["received"] - after_delete
    redis = Redis.from_url(redis_url)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(SWEEP_PATIENCE):
            while left := [k async for k in redis.scan_iter(match=LEFT, count=1000)]:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
    except TimeoutError:
        pass
    finally:
        await redis.aclose()
    swept_s = time.perf_counter() - started
    await runner.cleanup()
    return {
        "driver": args.driver,
        "subscriptions": args.count,
        "concurrency": args.concurrency,
        "deliveries": args.deliveries,
        "create_s": round(create_s, 2),
        "create_statuses": dict(sorted(statuses.items())),
        "delete_status": delete_status,
        "delete_s": round(delete_s, 3),
        "listed_after_delete": len(listed),
        "received_after_delete": late,
        "subscription_keys_left": len(left),
        "swept_within_s": round(swept_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", default="lua", choices=["lua", "watch"])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--deliveries", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with (
            RedisServer(work / "redis", appendonly=False) as redis,
            Service(
                redis.url, work / "feedsvc.log", "--driver", args.driver,
                "--subscriber-allow", "127.0.0.0/8",
            ) as svc,
        ):  # fmt: skip
            result = asyncio.run(measure(svc, redis.url, args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
