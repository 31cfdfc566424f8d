"""Redis CPU per claim of 10, the segment layout against the older one
(issue 30), measured side by side on one redis-server in one run.

Each layout gets a queue of ``--messages`` posted messages (100-byte
bodies, posted 100 a call) on the lua driver; then ``--claims`` claims of
10 are made, each after the clock passed the claim before's expiry, so
every claim takes ten messages at the queue's head that a claim held
before (their claim states exist: the steady state of a consumer that
fails). Measured: Redis's main-thread CPU (``INFO cpu``) and
``EVALSHA``'s time in ``INFO commandstats`` over the claims only.

    python -m bench.claims_layout [--messages 5000] [--claims 500]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

import orjson
import redis

from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.storage.base import NewMessage
from feedsvc.storage.drivers import make_store

PROJECT = "bench-claims"
WRITER = str(uuid.uuid4())
ROUNDS = 3  # the layouts alternate, each measured this often


def cpu_us(client: redis.Redis) -> tuple[float, float, int]:
    """(main thread CPU µs, EVALSHA µs, EVALSHA calls) so far."""
    cpu = client.info("cpu")
    stats = client.info("commandstats").get("cmdstat_evalsha", {"usec": 0, "calls": 0})
    main = cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]) + cpu.get(
        "used_cpu_sys_main_thread", cpu["used_cpu_sys"]
    )
    return main * 1e6, float(stats["usec"]), int(stats["calls"])


async def measure(url: str, layout: str, messages: int, claims: int) -> tuple[float, float]:
    """(CPU µs per claim, EVALSHA µs per claim) in one layout."""
    clock = ManualClock()
    settings = Settings(redis_url=url, driver="lua", storage_layout=layout, min_message_ttl=1)
    store = make_store(settings, clock)
    await store.open()
    client = redis.Redis.from_url(url)
    try:
        queue = f"q-{layout}-{uuid.uuid4().hex[:8]}"
        body = orjson.dumps({"pad": "x" * 88})
        for _ in range(messages // 100):
            batch = [NewMessage(body, 86400) for _ in range(100)]
            await store.post_messages(PROJECT, queue, WRITER, batch)
        cpu0, eval0, calls0 = cpu_us(client)
        for _ in range(claims):
            claim = await store.claim_messages(PROJECT, queue, 60, 0, 10)
            assert claim is not None and len(claim.messages) == 10
            clock.advance(61)
        cpu1, eval1, calls1 = cpu_us(client)
        assert calls1 - calls0 == claims
        return (cpu1 - cpu0) / claims, (eval1 - eval0) / claims
    finally:
        client.close()
        await store.close()


async def run(url: str, messages: int, claims: int) -> None:
    results: dict[str, list[tuple[float, float]]] = {}
    for layout in ("records", "segments") * ROUNDS:
        cpu, evalsha = await measure(url, layout, messages, claims)
        results.setdefault(layout, []).append((cpu, evalsha))
    for layout, rows in results.items():
        shown = ", ".join(f"{c:.1f} µs CPU / {e:.1f} µs EVALSHA" for c, e in rows)
        print(f"{layout:9} per claim of 10: {shown}")
    for n in range(ROUNDS):
        (rc, re), (sc, se) = results["records"][n], results["segments"][n]
        print(f"run {n + 1}: segments / records: CPU {sc / rc:.2f} x, EVALSHA {se / re:.2f} x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.claims_layout", description=__doc__)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--claims", type=int, default=500)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(Path(workdir) / "redis", appendonly=False)
        server.start()
        try:
            asyncio.run(run(server.url, args.messages, args.claims))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
