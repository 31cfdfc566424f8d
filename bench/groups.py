"""Claims over ordered message groups (issue 32 point 4): the ``groups`` part
of ``python -m bench``.

For each driver (lua, watch), one ``feedsvc serve`` on the suite's Redis.
In each round three queues are filled afresh (``POST`` of 100 messages at a
time) and drained by ``CLAIMERS`` concurrent claimers for ``--duration``
seconds: wrk connections running bench/wrk/claim_delete.lua, which claims up
to ``LIMIT`` messages and then deletes those it got (one ``DELETE
.../messages?ids=``) before claiming again. The queues:

- ``ungrouped``: messages without a group (a queue that never used groups
  claims as before groups existed);
- ``1,000 groups``: message i posted with ``"group": "g<i mod 1000>"``, so
  every one of the 1,000 groups is active and a claim can only take a run
  of one group's messages from its head;
- ``hot``: ``HOT_BACKLOG`` messages of group ``hot`` first, then messages
  of ``HOT_OTHERS`` other groups. Before wrk starts, a claim of an hour
  takes the head of ``hot`` and holds it through the run: the queue's
  oldest messages are locked, and every claim of the others passes them by.
  A probe claim (its messages then deleted) checks that the service keeps
  it off ``hot``: ``groups_honoured`` says whether it did in every round (a
  driver without groups hands ``hot`` out; its figures say nothing of them).

The three run back to back, in an order that rotates by round. Reported per
driver, as medians over rounds of the same round's figures: claims/s,
messages claimed/s, and the CPU of feedsvc and Redis per message claimed
and deleted (``cpu_us``); ``ratio`` = messages claimed/s of ``1,000
groups`` / ``ungrouped`` (issue 32's goal: at least 0.8) and of ``hot`` /
``1,000 groups`` (one hot group should not slow the others: near 1), and
``cpu_ratio`` the same comparison by CPU per message (under's / top's): on
a machine others share, req/s of one run against the next move by a third,
what a message costs far less.

A run must not empty its queue (an empty claim is fast and claims
nothing): the backlog is ``HEADROOM`` times the highest rate seen so far
times the duration (a warm-up second of claims, not reported, gives the
first rate), and a run whose claimers met an empty queue (``empty`` > 0)
is made again once with twice the backlog; ``empty`` says whether the last
one still did.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from bench.service import Service, WrkSuite, median_round, service, wrk
from bench.storage import post_all

DRIVERS = ("lua", "watch")
CLAIMERS = 16
LIMIT = 10
GROUPS = 1000
HOT_BACKLOG = 5000
HOT_OTHERS = 200
PER_POST = 100
TTL = 3600
#: messages of the warm-up run (one second, not reported)
WARM_UP_BACKLOG = 20000
HEADROOM = 1.5
CASES = ("ungrouped", "1,000 groups", "hot")
_REPORT = re.compile(
    r"claimers: claims (\d+) messages (\d+) no_content (\d+) deletes (\d+) failures (\d+)"
)


@dataclass
class Drain:
    """What the claimers did in one run, and what it cost feedsvc and Redis."""

    claims_s: float
    messages_s: float
    #: CPU of the feedsvc process and of redis-server per message claimed
    #: (and deleted), in µs: what the run cost, whoever else used the machine
    cpu_us: float
    errors: int
    empty: int


def messages(case: str, count: int) -> list[dict[str, Any]]:
    """count messages of a case, in post order (the hot case's backlog of
    group ``hot`` comes on top of count)."""
    if case == "ungrouped":
        return [{"ttl": TTL, "body": {"n": i}} for i in range(count)]
    if case == "hot":
        hot = [{"ttl": TTL, "body": {"n": i}, "group": "hot"} for i in range(HOT_BACKLOG)]
        return hot + [
            {"ttl": TTL, "body": {"n": i}, "group": f"o{i % HOT_OTHERS}"} for i in range(count)
        ]
    return [{"ttl": TTL, "body": {"n": i}, "group": f"g{i % GROUPS}"} for i in range(count)]


class GroupsRun:
    """One driver's service and the backlog sizing of its runs."""

    def __init__(self, suite: WrkSuite, svc: Service) -> None:
        self.suite = suite
        self.svc = svc
        self.rate = 0.0
        self.queues = 0
        #: whether the last hot run found the service keeping others off a held group
        self.honoured = False

    def warm_up(self) -> None:
        """One second of claims on an ungrouped queue, not reported: the
        service's first requests, and the rate the first backlog is sized by."""
        run = self.drain_once("ungrouped", WARM_UP_BACKLOG, 1.0)
        self.rate = run.messages_s * (2 if run.empty else 1)

    def drain(self, case: str) -> Drain:
        backlog = math.ceil(HEADROOM * self.rate * self.suite.duration)
        for _ in range(2):
            run = self.drain_once(case, backlog, self.suite.duration)
            self.rate = max(self.rate, run.messages_s)
            if not run.empty:
                break
            backlog *= 2
        return run

    def hold_hot_group(self, queue: str) -> bool:
        """Claim the head of group ``hot`` for an hour (the claim that holds
        it through the run), then probe with a second claim, whose messages
        are deleted: whether the service keeps the probe off ``hot``, i.e.
        honours groups (a driver or version without them hands it out)."""
        path = f"/v2/queues/{queue}/claims?limit={LIMIT}"
        held = orjson.loads(self.svc.request("POST", path, {"ttl": 3600, "grace": 60}))
        assert held["messages"] and {m.get("group", "hot") for m in held["messages"]} == {"hot"}
        probe = orjson.loads(self.svc.request("POST", path, {"ttl": 60, "grace": 60}))["messages"]
        ids = ",".join(m["id"] for m in probe)
        self.svc.request("DELETE", f"/v2/queues/{queue}/messages?ids={ids}")
        return all(m.get("group") not in (None, "hot") for m in probe)

    def drain_once(self, case: str, backlog: int, seconds: float) -> Drain:
        self.queues += 1
        queue = f"bgroups{self.queues}"
        batch = messages(case, backlog)
        payloads = [{"messages": batch[i : i + PER_POST]} for i in range(0, len(batch), PER_POST)]
        errors = post_all(self.svc, queue, payloads)
        if case == "hot":
            self.honoured = self.hold_hot_group(queue)
        result = wrk(
            self.svc.url + f"/v2/queues/{queue}/claims",
            "claim_delete.lua",
            CLAIMERS,
            seconds,
            env={"QUEUE": queue, "LIMIT": str(LIMIT)},
            cpu_of={"feedsvc": [self.svc.pid], "redis": [self.suite.redis.pid or 0]},
        )
        self.svc.request("DELETE", f"/v2/queues/{queue}")
        found = _REPORT.search(result.output)
        assert found is not None, result.output
        claims, claimed, no_content, deletes, failures = map(int, found.groups())
        cores = result.cores or {}
        return Drain(
            claims_s=claims / result.seconds,
            messages_s=claimed / result.seconds,
            cpu_us=(cores["feedsvc"] + cores["redis"]) * result.seconds * 1e6 / max(claimed, 1),
            errors=errors + failures + result.errors,
            empty=max(0, no_content - deletes),
        )


def _rate_ratio(top: str, under: str) -> Callable[[dict[str, Drain]], float]:
    """A round's messages claimed/s of the case named top over that of under."""
    return lambda runs: runs[top].messages_s / runs[under].messages_s


def part_groups(suite: WrkSuite) -> None:
    for driver in DRIVERS:
        log = f"feedsvc-groups-{driver}.log"
        with service(suite.redis.url, suite.workdir, "--driver", driver, log=log) as svc:
            runner = GroupsRun(suite, svc)
            runner.warm_up()
            rounds: list[dict[str, Drain]] = []
            honoured = []
            for r in range(suite.rounds):
                order = CASES[r % 3 :] + CASES[: r % 3]
                rounds.append({case: runner.drain(case) for case in order})
                honoured.append(runner.honoured)
        for top, under, name in (
            ("1,000 groups", "ungrouped", "claims: 1,000 groups / ungrouped"),
            ("hot", "1,000 groups", "claims: others of a held hot group / 1,000 groups"),
        ):
            runs, ratio = median_round(rounds, _rate_ratio(top, under))
            suite.add(
                f"{name} ({driver})",
                ratio=ratio,
                cpu_ratio=statistics.median(r[under].cpu_us / r[top].cpu_us for r in rounds),
                messages_s=runs[top].messages_s,
                under_messages_s=runs[under].messages_s,
                claims_s=runs[top].claims_s,
                under_claims_s=runs[under].claims_s,
                cpu_us=statistics.median(r[top].cpu_us for r in rounds),
                under_cpu_us=statistics.median(r[under].cpu_us for r in rounds),
                claimers=CLAIMERS,
                groups_honoured=all(honoured),
                errors=sum(d.errors for by_case in rounds for d in by_case.values()),
                empty=sum(d.empty for by_case in rounds for d in by_case.values()),
            )
