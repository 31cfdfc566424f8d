"""The webhook receiver of ``python -m bench webhook`` (bench/webhook.py): a
small aiohttp server (``python -m bench.webhook_receiver PORT``) that feedsvc
delivers Zaqar's notifications to, and that the benchmark asks what arrived.

* ``POST /hook/{tag}[?delay_ms=D]``: one notification (feedsvc/delivery/
  senders.py: ``{"body": ..., "ttl": ..., "queue_name": ...,
  "Message_Type": "Notification"}``) of a message whose body is the bench
  producer's stamp ``{"n": counter, "t": time the POST was sent}``. The
  arrival time is taken first, then the answer (200) waits D ms: a slow
  subscriber. Each tag (one per subscription) keeps a :class:`Ledger`.
* ``GET /report?tag=&first=&last=&t0=&t1=``: what the tag's ledger saw of
  the messages numbered ``first`` to ``last`` and between the times ``t0``
  and ``t1`` (:meth:`Ledger.report`).
* ``GET /ping``: ``{}`` once it listens.

uvloop, like ``feedsvc serve``'s default.
"""

from __future__ import annotations

import asyncio
import bisect
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class Ledger:
    """The notifications of one subscription, checked as they come.

    ``repeats``: a counter that arrived before (at least once delivery
    allows them; a receiver that always answers 200 should see none).
    ``out_of_order``: a counter that arrived for the first time after a
    higher one (delivery is in post order: should be none). A counter that
    never arrives is missing from :meth:`report`'s ``received``."""

    arrived: dict[int, float] = field(default_factory=dict)  # n -> first arrival
    latency: dict[int, float] = field(default_factory=dict)  # n -> arrival - stamp, s
    arrivals: list[float] = field(default_factory=list)  # every arrival, in order
    highest: int = 0
    repeats: int = 0
    out_of_order: int = 0
    in_flight: int = 0
    most_in_flight: int = 0

    def record(self, n: int, stamp: float, at: float) -> None:
        self.arrivals.append(at)
        if n in self.arrived:
            self.repeats += 1
            return
        if n < self.highest:
            self.out_of_order += 1
        self.highest = max(self.highest, n)
        self.arrived[n] = at
        self.latency[n] = at - stamp

    def report(self, first: int, last: int, t0: float, t1: float) -> dict[str, Any]:
        """Of the messages numbered first..last: how many arrived, their
        latencies (ms) and the last one's arrival; of all notifications: how
        many arrived between t0 and t1; and the running counts."""
        numbers = [n for n in range(first, last + 1) if n in self.arrived]
        return {
            "received": len(numbers),
            "latencies_ms": [self.latency[n] * 1000 for n in numbers],
            "last_arrival": max((self.arrived[n] for n in numbers), default=None),
            "arrived_between": bisect.bisect_right(self.arrivals, t1)
            - bisect.bisect_left(self.arrivals, t0),
            "notifications": len(self.arrivals),
            "repeats": self.repeats,
            "out_of_order": self.out_of_order,
            "most_in_flight": self.most_in_flight,
        }


LEDGERS = web.AppKey("ledgers", dict[str, Ledger])
MALFORMED = web.AppKey("malformed", list[str])


async def hook(request: web.Request) -> web.Response:
    at = time.time()
    ledger = request.app[LEDGERS].setdefault(request.match_info["tag"], Ledger())
    ledger.in_flight += 1
    ledger.most_in_flight = max(ledger.most_in_flight, ledger.in_flight)
    try:
        raw = await request.read()
        try:
            document = orjson.loads(raw)
            assert document["Message_Type"] == "Notification"
            body = document["body"]
            n, stamp = int(body["n"]), float(body["t"])
        except (ValueError, KeyError, TypeError, AssertionError):
            request.app[MALFORMED].append(raw[:200].decode(errors="replace"))
            return web.Response(status=200)
        ledger.record(n, stamp, at)
        delay = float(request.query.get("delay_ms", "0")) / 1000
        if delay > 0:
            await asyncio.sleep(delay)
        return web.Response(status=200)
    finally:
        ledger.in_flight -= 1


async def report(request: web.Request) -> web.Response:
    q = request.query
    ledger = request.app[LEDGERS].get(q["tag"], Ledger())
    answer = ledger.report(int(q["first"]), int(q["last"]), float(q["t0"]), float(q["t1"]))
    answer["malformed"] = len(request.app[MALFORMED])
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def ping(request: web.Request) -> web.Response:
    return web.Response(body=b"{}", content_type="application/json")


def make_app() -> web.Application:
    app = web.Application()
    app[LEDGERS] = {}
    app[MALFORMED] = []
    app.router.add_post("/hook/{tag}", hook)
    app.router.add_get("/report", report)
    app.router.add_get("/ping", ping)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    import uvloop

    web.run_app(
        make_app(),
        host="127.0.0.1",
        port=int(args[0]),
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
        shutdown_timeout=1.0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
