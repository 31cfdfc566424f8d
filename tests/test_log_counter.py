"""Refusals that come in floods are counted one by one and logged a line per
interval (``feedsvc.log_counter``): a follower refused by --max-followers,
a write given up after too many WATCH conflicts. The interval is driven with
the ManualClock, not slept."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from feedsvc.app import create_app
from feedsvc.clock import ManualClock
from feedsvc.embedded_redis.server import RedisServer
from feedsvc.errors import TooMuchContention
from feedsvc.log_counter import LogCounter
from tests.conftest import make_settings

MESSAGES = "/v2/queues/q/messages"
FLOOD = 1000


def counted(caplog: pytest.LogCaptureFixture, pattern: str) -> list[int]:
    """The counts of the WARNING lines matching pattern (its group 1), in order."""
    found = []
    for record in caplog.records:
        match = re.search(pattern, record.getMessage())
        if match and record.levelno == logging.WARNING:
            found.append(int(match.group(1)))
    return found


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in the metrics"
    return float(match.group(1))


def test_a_counter_writes_the_first_at_once_then_a_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="feedsvc.test")
    clock = ManualClock()
    counter = LogCounter(logging.getLogger("feedsvc.test"), "refused", "things", clock, 10.0)
    for n in range(FLOOD):
        counter.count(f"thing {n}")
        if n == 499:
            clock.advance(10.0)
    counter.close()  # writes what is still untold
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "refused 1 things (thing 0); more are counted and logged every 10 s"
    assert lines[1] == "refused 500 things in the last 10 s (latest: thing 500)"
    assert lines[2].startswith("refused 499 things in the last ")
    assert lines[2].endswith("(latest: thing 999)")
    assert len(lines) == 3
    assert counter.total == FLOOD
    counter.close()
    assert len(caplog.records) == 3  # nothing more to tell


async def test_a_thousand_refused_followers_log_a_few_lines_and_count_each(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="feedsvc")
    clock = ManualClock()
    settings = make_settings(redis_server.url, max_followers=1)
    headers = {"Client-ID": str(uuid.uuid4()), "X-Project-ID": "refusals-" + uuid.uuid4().hex}
    server = TestServer(create_app(settings, clock))
    async with TestClient(server) as http:
        stream = await http.get(MESSAGES, headers={**headers, "Accept": "text/event-stream"})
        assert stream.status == 200
        try:
            for n in range(FLOOD):
                if n == FLOOD // 2:
                    clock.advance(10.0)
                poll = await http.get(MESSAGES, params={"wait": "5"}, headers=headers)
                assert poll.status == 503
                assert poll.headers["Retry-After"]
            metrics = await (await http.get("/metrics")).text()
        finally:
            stream.close()
    # the app's cleanup wrote the rest
    counts = counted(caplog, r"refused (\d+) followers")
    assert sum(counts) == FLOOD
    assert len(counts) <= 3
    assert sample(metrics, "feedsvc_followers_refused_total") == FLOOD
    assert not [r for r in caplog.records if "-> 503" in r.getMessage()]


async def test_a_thousand_contention_503s_log_a_few_lines(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each is counted by the store (feedsvc_watch_conflicts_exhausted);
    here the answer's log alone, from a handler that gives up at once."""
    caplog.set_level(logging.INFO, logger="feedsvc")
    app = create_app(make_settings(redis_server.url), ManualClock())

    async def contended(request: web.Request) -> web.Response:
        await asyncio.sleep(0)
        raise TooMuchContention("Gave up after 10 conflicting attempts; retry.")

    app.router.add_post("/contended", contended)
    async with TestClient(TestServer(app)) as http:
        for _ in range(FLOOD):
            response = await http.post("/contended")
            assert response.status == 503
            assert response.headers["Retry-After"]
    counts = counted(caplog, r"gave up (\d+) writes")
    assert sum(counts) == FLOOD
    assert len(counts) <= 2
