"""bench/webhook.py's tools: the receiver reads feedsvc's notifications and
counts repeats and out-of-order arrivals, and the part runs end to end
(shortened); it asserts nothing about speed."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from bench import webhook, webhook_receiver
from bench.webhook_receiver import Ledger
from feedsvc.delivery.senders import notification
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.storage.base import Message, Subscription


def test_the_ledger_counts_repeats_and_out_of_order_and_reports_a_range() -> None:
    ledger = Ledger()
    for n, at in ((1, 10.0), (2, 11.0), (4, 12.0), (4, 13.0), (3, 14.0), (5, 15.0)):
        ledger.record(n, stamp=at - 0.5, at=at)
    assert (ledger.repeats, ledger.out_of_order) == (1, 1)
    got = ledger.report(2, 4, t0=11.0, t1=13.0)
    assert got["received"] == 3
    assert got["latencies_ms"] == [500.0, 500.0, 500.0]
    assert got["last_arrival"] == 14.0  # 3's first arrival, the latest of 2..4
    assert got["arrived_between"] == 3  # 11, 12 and the repeat at 13
    assert got["notifications"] == 6
    nothing = ledger.report(6, 9, t0=20.0, t1=30.0)
    assert nothing["received"] == nothing["arrived_between"] == 0
    assert nothing["last_arrival"] is None


def document(n: int) -> bytes:
    """A notification as feedsvc sends it, of a message the bench producer posted."""
    sub = Subscription("s", "q", "http://127.0.0.1/hook/t", 3600, 0, 0, {}, True)
    body = b'{"n":%d,"t":%.6f,"x":""}' % (n, time.time())
    return notification(sub, Message("m", n, body, 3600, 0))


async def test_the_receiver_reads_feedsvc_notifications_and_answers_late_when_asked() -> None:
    async with (
        TestServer(webhook_receiver.make_app(), host="127.0.0.1") as server,
        aiohttp.ClientSession() as http,
    ):

        async def post(n: int, query: str = "") -> float:
            began = time.perf_counter()
            async with http.post(server.make_url(f"/hook/t{query}"), data=document(n)) as r:
                assert r.status == 200
            return time.perf_counter() - began

        for n in (1, 2, 2):
            await post(n)

        async def after_a_while(n: int) -> float:
            await asyncio.sleep(0.03)  # 3 is there first, and still being answered
            return await post(n, "?delay_ms=100")

        took = await asyncio.gather(post(3, "?delay_ms=100"), after_a_while(4))
        async with http.post(server.make_url("/hook/t"), data=b"{}") as r:
            assert r.status == 200
        query = {"tag": "t", "first": "1", "last": "4", "t0": "0", "t1": str(time.time())}
        async with http.get(server.make_url("/report"), params=query) as r:
            got: dict[str, Any] = await r.json()
    assert min(took) >= 0.1
    assert got["received"] == 4
    assert (got["repeats"], got["out_of_order"], got["malformed"]) == (1, 0, 1)
    assert got["most_in_flight"] == 2
    assert all(0 <= latency < 10_000 for latency in got["latencies_ms"])


class FakeSuite:
    def __init__(self, workdir: Path, redis: RedisServer) -> None:
        self.workdir = workdir
        self.redis = redis
        self.rows: dict[str, dict[str, Any]] = {}

    def add(self, name: str, **values: Any) -> None:
        self.rows[name] = values


@pytest.mark.process
def test_the_webhook_part_runs_short(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = {"FAST_RATES": (50.0, math.inf), "SETTLE_S": 0.3, "MEASURE_S": 0.5,
             "GRACE_S": 0.3, "DRAIN_S": 20.0, "DECOUPLED_ROUNDS": 1, "SLOW_MS": 100}  # fmt: skip
    for name, value in short.items():
        monkeypatch.setattr(webhook, name, value)
    monkeypatch.setattr(webhook, "wait_for_idle", lambda max_wait: 0.0)
    suite = FakeSuite(tmp_path, redis_server)
    webhook.part_webhook(suite)
    rows = suite.rows
    fast = [rows["webhook fast, 50/s"], rows["webhook fast, flat out"],
            rows["webhook fast, 200/s #1"]]  # fmt: skip
    slow = rows["webhook 100 ms, 200/s #1"]
    for row in [*fast, slow]:
        assert row["posted_per_s"] > 0
        assert (row["repeats"], row["out_of_order"], row["in_flight_max"]) == (0, 0, 1)
        assert row["post_p50_ms"] > 0
    for row in fast:  # every message delivered (drained), so the latencies are all there
        assert not math.isnan(row["drain_s"])
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert slow["delivered"] < 1
    assert math.isnan(slow["drain_s"])
    assert rows["POST 200/s, fast vs slow receiver"]["slow_posts"] > 0
    assert rows["webhook summary"]["post_failures"] == 0
