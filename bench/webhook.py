"""Webhook delivery under load: the ``webhook`` part of ``python -m bench``.

One ``feedsvc serve`` process (default settings, lua driver, plus
``--subscriber-allow 127.0.0.0/8``), one webhook receiver in a process of
its own (bench/webhook_receiver.py: records each notification's arrival
and the stamp in its body, checks order and repeats by the body's counter)
and one subscription on the queue. The producer (bench/live.py's: one
message per POST, in order, stamped with its counter and the time the POST
was sent) posts at fixed rates, each step 1 s to settle and then
``MEASURE_S`` measured:

* **fast receiver** (answers 200 at once): 50 and 200 posts/s, then as fast
  as one producer goes. Per step: posts/s, deliveries/s (notifications that
  arrived while the step posted, per second), the step's messages delivered
  ``GRACE_S`` after it, post→webhook latency p50/p99 (arrival minus the
  stamp, over the step's messages once the backlog is delivered, waiting at
  most ``DRAIN_S``; ``drain_s`` is how long after the step's last post its
  last message arrived), repeats and out-of-order arrivals (0 for a
  receiver that answers 200), the producer's POST latency, the Redis
  commands per post (``INFO commandstats``: the posts' and the deliveries')
  and the CPU of feedsvc, the receiver, Redis, this process (the producer)
  and the rest of the machine (``other``).
* **posting is decoupled from delivery**: at ``DECOUPLED_RATE`` posts/s,
  ``DECOUPLED_ROUNDS`` times a fast receiver and then one that answers
  after ``SLOW_MS``, alternately, each with a new subscription (deleted
  after its step, so no backlog is carried over). The POST latencies of
  each kind, pooled, are set side by side: posting must not notice.
  Delivery runs one notification at a time per subscription, so the slow
  receiver gets ``1000 / SLOW_MS`` a second and the rest waits; its rows'
  ``delivered`` and latencies are over every message since the
  subscription was made (what got through, in order).

The part first waits (at most ``IDLE_WAIT_S``) for an idle machine; it takes
about a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from bench.live import (
    PRODUCER_ID,
    PROJECT,
    Producer,
    bench_server,
    commandstats,
    delta,
    get_json,
    ms,
)
from bench.machine import CpuWindow, wait_for_idle
from bench.service import Service, SuiteLike

HERE = Path(__file__).resolve().parent
FAST_RATES = (50.0, 200.0, float("inf"))
SLOW_MS = 200
DECOUPLED_RATE = 200.0
DECOUPLED_ROUNDS = 3
SETTLE_S = 1.0
MEASURE_S = 4.0
GRACE_S = 1.0
DRAIN_S = 30.0
IDLE_WAIT_S = 30.0


@contextlib.contextmanager
def receiver(workdir: Path) -> Iterator[tuple[int, int]]:
    """bench/webhook_receiver.py on a free port of 127.0.0.1: (port, pid)."""
    with bench_server(workdir, "webhook_receiver", "/ping") as started:
        yield started


def api(port: int, method: str, path: str, body: object = None) -> Any:
    """One request to feedsvc as the producer's project; its JSON answer (or None)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Client-ID": PRODUCER_ID, "X-Project-ID": PROJECT,
               "Content-Type": "application/json"}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def report(port: int, tag: str, first: int, last: int, t0: float, t1: float) -> dict[str, Any]:
    query = f"tag={tag}&first={first}&last={last}&t0={t0!r}&t1={t1!r}"
    answer: dict[str, Any] = get_json(f"http://127.0.0.1:{port}/report?{query}")
    return answer


@dataclass
class Step:
    rate: float
    posted_per_s: float
    deliveries_per_s: float
    delivered: float  # of the step's messages, GRACE_S after its last post
    p50_ms: float
    p99_ms: float
    drain_s: float  # from the step's last post to its last message's arrival
    repeats: int
    out_of_order: int
    most_in_flight: int
    post_p50_ms: float
    post_p99_ms: float
    redis_cmds_per_post: float  # every Redis command in the window (posts and deliveries)
    cpu: dict[str, float]
    took: list[float]  # seconds each of the window's POSTs took


@dataclass
class Webhooks:
    """The running part: the service, the receiver, the producer, the queue."""

    svc_port: int
    receiver_port: int
    producer: Producer
    queue: str
    groups: dict[str, list[int]]
    redis: redis.Redis
    seen: dict[str, dict[str, int]] = field(default_factory=dict)  # tag -> running counts

    def subscribe(self, tag: str, delay_ms: int = 0) -> str:
        url = f"http://127.0.0.1:{self.receiver_port}/hook/{tag}"
        if delay_ms:
            url += f"?delay_ms={delay_ms}"
        made = api(self.svc_port, "POST", f"/v2/queues/{self.queue}/subscriptions",
                   {"subscriber": url, "ttl": 3600})  # fmt: skip
        return str(made["subscription_id"])

    def unsubscribe(self, sid: str) -> None:
        api(self.svc_port, "DELETE", f"/v2/queues/{self.queue}/subscriptions/{sid}")

    def step(self, tag: str, rate: float, drain: bool, since: int | None = None) -> Step:
        """Post at ``rate`` (a settling second, then the measured window) and
        look at what the receiver got of the window's messages (of every
        message from ``since`` on, if given), ``drain``: waiting for them all."""
        self.producer.run(rate, SETTLE_S)
        first = self.producer.n + 1 if since is None else since
        took: list[float] = []
        cpu = CpuWindow(self.groups)
        stats0 = commandstats(self.redis)
        cpu.start()
        t0 = time.time()
        sent = self.producer.run(rate, MEASURE_S, took)
        t1 = time.time()
        percent = cpu.stop()
        commands = sum(delta(commandstats(self.redis), stats0).values())
        last = self.producer.n
        posted = last - first + 1
        time.sleep(GRACE_S)
        got = report(self.receiver_port, tag, first, last, t0, t1)
        delivered = got["received"] / max(1, posted)
        deadline = time.monotonic() + (DRAIN_S if drain else 0)
        while got["received"] < posted and time.monotonic() < deadline:
            time.sleep(0.2)
            got = report(self.receiver_port, tag, first, last, t0, t1)
        latencies = np.array(got["latencies_ms"]) / 1000
        posts = np.array(took)
        complete = got["received"] == posted and got["last_arrival"] is not None
        before = self.seen.get(tag, {})
        counts = {k: got[k] - before.get(k, 0) for k in ("repeats", "out_of_order")}
        self.seen[tag] = {k: got[k] for k in counts}
        return Step(
            rate=rate,
            posted_per_s=len(sent) / (t1 - t0),
            deliveries_per_s=got["arrived_between"] / (t1 - t0),
            delivered=delivered,
            p50_ms=ms(latencies, 50),
            p99_ms=ms(latencies, 99),
            drain_s=max(0.0, got["last_arrival"] - t1) if complete else float("nan"),
            repeats=counts["repeats"],
            out_of_order=counts["out_of_order"],
            most_in_flight=got["most_in_flight"],
            post_p50_ms=ms(posts, 50),
            post_p99_ms=ms(posts, 99),
            redis_cmds_per_post=commands / max(1, len(sent)),
            cpu=percent,
            took=took,
        )


def rate_label(rate: float) -> str:
    return "flat out" if rate == float("inf") else f"{rate:g}/s"


def row(step: Step) -> dict[str, object]:
    return {
        "posted_per_s": step.posted_per_s,
        "deliveries_per_s": step.deliveries_per_s,
        "delivered": step.delivered,
        "p50_ms": step.p50_ms,
        "p99_ms": step.p99_ms,
        "drain_s": step.drain_s,
        "repeats": step.repeats,
        "out_of_order": step.out_of_order,
        "in_flight_max": step.most_in_flight,
        "post_p50_ms": step.post_p50_ms,
        "post_p99_ms": step.post_p99_ms,
        "redis_cmds_per_post": step.redis_cmds_per_post,
        **{f"{k}_cpu": v for k, v in step.cpu.items()},
    }


def part_webhook(suite: SuiteLike) -> None:
    busy = wait_for_idle(max_wait=IDLE_WAIT_S)
    queue = "hook-" + uuid.uuid4().hex[:8]
    flags = ("--subscriber-allow", "127.0.0.0/8")
    with (
        receiver(suite.workdir) as (receiver_port, receiver_pid),
        Service(suite.redis.url, suite.workdir / "feedsvc-webhook.log", *flags) as svc,
    ):
        api(svc.port, "PUT", f"/v2/queues/{queue}")
        groups = {"feedsvc": [svc.pid], "receiver": [receiver_pid],
                  "redis": [suite.redis.pid or 0], "producer": [os.getpid()]}  # fmt: skip
        producer = Producer(svc.port, queue)
        client = redis.Redis.from_url(suite.redis.url)
        hooks = Webhooks(svc.port, receiver_port, producer, queue, groups, client)
        sid = hooks.subscribe("fast")
        for rate in FAST_RATES:
            step = hooks.step("fast", rate, drain=True)
            suite.add(f"webhook fast, {rate_label(rate)}", **row(step))
        hooks.unsubscribe(sid)
        # posting with a fast and a slow subscriber, alternately (the machine's
        # other work then weighs on both alike), a new subscription each step
        took: dict[str, list[float]] = {"fast": [], "slow": []}
        for i in range(DECOUPLED_ROUNDS):
            for kind, delay in (("fast", 0), ("slow", SLOW_MS)):
                tag = f"{kind}-{i}"
                since = producer.n + 1
                sid = hooks.subscribe(tag, delay)
                step = hooks.step(tag, DECOUPLED_RATE, drain=not delay, since=since)
                hooks.unsubscribe(sid)
                took[kind] += step.took
                name = "fast" if not delay else f"{SLOW_MS} ms"
                suite.add(f"webhook {name}, {rate_label(DECOUPLED_RATE)} #{i + 1}", **row(step))
        producer.close()
        client.close()
    fast, slow = (np.array(took[k]) for k in ("fast", "slow"))
    suite.add(
        f"POST {rate_label(DECOUPLED_RATE)}, fast vs slow receiver",
        fast_posts=fast.size,
        slow_posts=slow.size,
        fast_p50_ms=ms(fast, 50),
        slow_p50_ms=ms(slow, 50),
        fast_p99_ms=ms(fast, 99),
        slow_p99_ms=ms(slow, 99),
        p99_slow_over_fast=ms(slow, 99) / ms(fast, 99),
    )
    suite.add("webhook summary", idle_wait_busy_pct=busy, post_failures=producer.failures)
