"""/metrics (Prometheus) and structured logs with the request id."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import re
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from feedsvc.api.middleware import new_request_id, request_middleware
from feedsvc.app import create_app
from feedsvc.cli import configure_logging
from feedsvc.testing import ServiceProcess
from tests.conftest import make_settings


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', head))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


async def test_metrics_count_requests_and_redis_calls(
    http: TestClient[web.Request, web.Application], headers: dict[str, str]
) -> None:
    body = {"messages": [{"body": 1}]}
    for _ in range(3):
        assert (await http.post("/v2/queues/m/messages", json=body, headers=headers)).status == 201
    assert (await http.get("/v2/queues/m/messages", headers=headers)).status == 200
    assert (await http.get("/v2/queues/m/messages?limit=0", headers=headers)).status == 400
    response = await http.get("/metrics")
    assert response.status == 200
    assert response.content_type == "text/plain"
    text = await response.text()
    route = "/v2/queues/{queue}/messages"
    name = "feedsvc_http_request_duration_seconds_count"
    assert sample(text, name, method="POST", route=route, status="201") == 3
    assert sample(text, name, method="GET", route=route, status="200") == 1
    assert sample(text, name, method="GET", route=route, status="400") == 1
    assert sample(text, "feedsvc_redis_calls_total") >= 4
    assert sample(text, "feedsvc_redis_seconds_total") > 0
    assert sample(text, "feedsvc_pool_size") == 32
    assert sample(text, "feedsvc_pool_in_use") == 0
    assert sample(text, "feedsvc_pool_waiting") == 0
    assert sample(text, "feedsvc_watch_retries_total") >= 0
    assert sample(text, "feedsvc_coalesced_calls_total") >= sample(
        text, "feedsvc_coalesced_batches_total"
    )


async def test_unknown_methods_share_one_label(
    http: TestClient[web.Request, web.Application], headers: dict[str, str]
) -> None:
    """Methods beyond the API's (HTTP's parser knows dozens) are counted as
    OTHER, so that clients cannot grow the metric's label sets (and the
    scrape) at will."""
    for method in ("PROPFIND", "MKCOL", "LOCK"):
        response = await http.request(method, "/v2/queues/m/messages", headers=headers)
        assert response.status == 405
    text = await (await http.get("/metrics")).text()
    name = "feedsvc_http_request_duration_seconds_count"
    assert sample(text, name, method="OTHER", status="405") == 3
    assert "PROPFIND" not in text and "MKCOL" not in text


async def test_unmatched_routes_are_one_label(
    http: TestClient[web.Request, web.Application],
) -> None:
    for path in ("/nope/1", "/nope/2"):
        assert (await http.get(path)).status == 404
    text = await (await http.get("/metrics")).text()
    name = "feedsvc_http_request_duration_seconds_count"
    assert sample(text, name, route="unmatched", status="404") == 2


async def test_a_refused_signed_url_is_answered_and_counted_as_any_error(
    http: TestClient[web.Request, web.Application], headers: dict[str, str]
) -> None:
    """The pre-signed URL check runs inside the error handling and the
    metrics (one middleware since they were merged): its 404 is JSON with
    the request id, and counted with the status sent."""
    signed = {**headers, "URL-Signature": "0" * 64, "URL-Paths": "/v2/queues/m/messages",
              "URL-Methods": "GET", "URL-Expires": "2099-01-01T00:00:00"}  # fmt: skip
    response = await http.get("/v2/queues/m/messages", headers=signed)
    assert response.status == 404
    assert (await response.json())["title"] == "Not found"
    assert response.headers["X-Openstack-Request-Id"].startswith("req-")
    text = await (await http.get("/metrics")).text()
    name = "feedsvc_http_request_duration_seconds_count"
    route = "/v2/queues/{queue}/messages"
    assert sample(text, name, method="GET", route=route, status="404") == 1


def test_feedsvc_runs_one_middleware() -> None:
    """aiohttp runs each middleware as a coroutine layer of its own, on every
    request; feedsvc's work around a handler is one (docs/BENCHMARKS.md)."""
    app = create_app(make_settings("redis://127.0.0.1:1/0"))
    assert list(app.middlewares) == [request_middleware]


def test_a_json_log_line_has_an_iso_8601_utc_time_in_ms_and_the_pid() -> None:
    """Log collectors read the time without guessing a zone or format, and
    tell the workers of one service apart (issue 28)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    try:
        configure_logging(make_settings("redis://127.0.0.1:1/0", log_format="json"))
        [handler] = root.handlers
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(out)
        logging.getLogger("feedsvc").warning("hello %s", "there")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    record = json.loads(out.getvalue())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"]), record
    assert dt.datetime.fromisoformat(record["time"]).utcoffset() == dt.timedelta(0)
    assert record["pid"] == os.getpid()
    assert (record["level"], record["logger"], record["message"]) == (
        "WARNING",
        "feedsvc",
        "hello there",
    )


@pytest.mark.process
def test_json_logs_carry_the_request_id(redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    flags = ("--redis-url", redis_url, "--log-format", "json", "--access-log")
    with ServiceProcess(*flags, log_path=log) as svc:
        req = urllib.request.Request(
            f"{svc.url}/v2/queues/logs/messages",
            headers={"Client-ID": str(uuid.uuid4()), "X-Project-ID": "logs"},
        )
        with urllib.request.urlopen(req, timeout=10) as response:
            request_id = response.headers["X-Openstack-Request-Id"]
        assert request_id
        deadline = time.monotonic() + 10
        while request_id not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.stop(signal.SIGTERM) == 0
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    access = [r for r in records if request_id in r["message"]]
    assert len(access) == 1 and access[0]["logger"] == "feedsvc.access"
    assert '"GET /v2/queues/logs/messages HTTP/1.1" 200' in access[0]["message"]


@pytest.mark.process  # forks, as the --workers supervisor does
def test_a_forked_worker_hands_out_request_ids_of_its_own() -> None:
    """Workers are forked after the middleware module is imported; each must
    number its requests under a prefix of its own (two workers both logged
    req-02dc07251486-1 for different requests before)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then gone
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    parent = new_request_id()
    assert child.rpartition("-")[0] != parent.rpartition("-")[0], (child, parent)
