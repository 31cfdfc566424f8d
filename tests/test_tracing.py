"""OpenTelemetry spans (issue 32, point 6; docs/consumers.md#tracing): a post
makes a producer span, claim / pop / an event stream / a webhook delivery a
consumer span linked to the traceparent in each message's headers, which a
post fills from its own context when the message has none. In process, with
the SDK's InMemorySpanExporter, on every driver; the switch itself from the
OTEL_* variables, and a refusal (one line, exit 2) when they ask for what is
not installed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import feedsvc
from bench.tracing import otlp_sink, traced_service
from feedsvc import tracing
from feedsvc.clock import ManualClock
from feedsvc.config import Settings
from feedsvc.embedded_redis.server import RedisServer
from tests import test_message_headers
from tests.test_api import Client, Headers, messages_path, ok_json, other_client, post
from tests.test_cli import one_line_error, run_cli
from tests.test_delivery import Receiver, delivery_settings, service, subscribe
from tests.test_live import next_event, open_stream

#: the fixture: a real webhook receiver on 127.0.0.1
receiver = test_message_headers.receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
OWN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing switched on for one test, its spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def linked_to(span: ReadableSpan) -> list[tuple[str, str]]:
    return [(f"{k.context.trace_id:032x}", f"{k.context.span_id:016x}") for k in span.links]


def traceparent_of(span: ReadableSpan) -> str:
    trace_id, span_id = hex_ids(span)
    context = span.get_span_context()
    assert context is not None
    return f"00-{trace_id}-{span_id}-{context.trace_flags:02x}"


async def traced_post(
    http: Client, headers: Headers, queue: str, messages: list[dict[str, Any]]
) -> list[str]:
    """A post from a traced producer: its request carries a traceparent."""
    return await post(http, {**headers, "traceparent": PARENT}, queue, messages)


async def stored_headers(http: Client, headers: Headers, queue: str) -> list[Any]:
    url = messages_path(queue) + "?echo=true&limit=20&include_claimed=true"
    doc = await ok_json(await http.get(url, headers=headers))
    return [m.get("headers") for m in doc["messages"]]


async def test_a_post_is_a_producer_span_whose_context_the_messages_store(
    http: Client, headers: Headers, spans: InMemorySpanExporter
) -> None:
    resp = await http.post(
        messages_path("orders"),
        json={"messages": [{"body": 1}, {"body": 2, "headers": {"traceparent": OWN}}]},
        headers={**headers, "traceparent": PARENT, "tracestate": "v=1"},
    )
    await ok_json(resp, 201)
    [publish] = named(spans, "publish orders")
    assert publish.kind == SpanKind.PRODUCER
    assert publish.attributes is not None
    assert dict(publish.attributes) == {
        "messaging.system": "feedsvc",
        "messaging.destination.name": "orders",
        "messaging.operation.type": "publish",
        "messaging.operation.name": "publish",
        "messaging.batch.message_count": 2,
    }
    # the request's context is the span's parent
    assert publish.parent is not None
    assert f"{publish.parent.trace_id:032x}" == TRACE_ID
    assert hex_ids(publish)[0] == TRACE_ID
    # linked to the message's own context, which it keeps
    assert linked_to(publish) == [(OWN[3:35], OWN[36:52])]
    first, second = await stored_headers(http, headers, "orders")
    assert first == {"traceparent": traceparent_of(publish), "tracestate": "v=1"}
    assert second == {"traceparent": OWN}


async def test_one_message_is_named_by_its_id(
    http: Client, headers: Headers, spans: InMemorySpanExporter
) -> None:
    [mid] = await post(http, headers, "one", [{"body": 1}])
    [publish] = named(spans, "publish one")
    assert publish.attributes is not None
    assert publish.attributes["messaging.message.id"] == mid
    assert "messaging.batch.message_count" not in publish.attributes
    # no request context: the span starts a trace, and the message is left
    # as posted (no headers: what a Zaqar client can read)
    assert publish.parent is None
    assert await stored_headers(http, headers, "one") == [None]


async def test_claim_and_pop_are_consumer_spans_linked_to_the_producer(
    http: Client, headers: Headers, spans: InMemorySpanExporter
) -> None:
    ids = await traced_post(http, headers, "work", [{"body": i} for i in range(3)])
    [publish] = named(spans, "publish work")
    resp = await http.post("/v2/queues/work/claims?limit=2", json={"ttl": 60}, headers=headers)
    await ok_json(resp, 201)
    popped = await ok_json(await http.delete(messages_path("work") + "?pop=1", headers=headers))
    assert [m["id"] for m in popped["messages"]] == ids[2:]
    claim, pop = named(spans, "receive work")
    for span in (claim, pop):
        assert span.kind == SpanKind.CONSUMER
        assert span.attributes is not None
        assert span.attributes["messaging.operation.type"] == "receive"
        assert span.attributes["messaging.destination.name"] == "work"
    assert claim.attributes is not None
    assert claim.attributes["messaging.batch.message_count"] == 2
    assert linked_to(claim) == [hex_ids(publish)] * 2
    assert pop.attributes is not None
    assert pop.attributes["messaging.message.id"] == ids[2]
    assert linked_to(pop) == [hex_ids(publish)]


async def test_an_empty_claim_is_a_span_without_links(
    http: Client, headers: Headers, spans: InMemorySpanExporter
) -> None:
    resp = await http.post("/v2/queues/none/claims", json={"ttl": 60}, headers=headers)
    assert resp.status == 204
    [span] = named(spans, "receive none")
    assert span.links == ()
    assert span.attributes is not None
    assert "messaging.message.id" not in span.attributes


async def test_a_stream_s_events_are_consumer_spans(
    http: Client, headers: Headers, spans: InMemorySpanExporter
) -> None:
    await traced_post(http, other_client(headers), "q", [{"body": "old"}])
    stream = await open_stream(http, headers)
    try:
        await next_event(stream)  # retry
        await next_event(stream)  # the backlog
        await traced_post(
            http, other_client(headers), "q", [{"body": "new", "headers": {"k": "v"}}]
        )
        event = orjson.loads((await next_event(stream))["data"])
    finally:
        stream.close()
    first, second = named(spans, "publish q")
    assert event["headers"] == {"k": "v", "traceparent": traceparent_of(second)}
    backlog, tail = named(spans, "receive q")
    assert linked_to(backlog) == [hex_ids(first)]
    assert linked_to(tail) == [hex_ids(second)]
    assert tail.kind == SpanKind.CONSUMER


async def test_a_webhook_delivery_is_a_process_span_and_carries_the_context(
    settings: Settings,
    clock: ManualClock,
    headers: Headers,
    receiver: Receiver,
    spans: InMemorySpanExporter,
) -> None:
    async with service(delivery_settings(settings), clock) as http:
        await subscribe(http, headers, receiver.url)
        [mid] = await traced_post(http, headers, "news", [{"body": "w"}])
        await receiver.until(1)
    [publish] = named(spans, "publish news")
    [(sent, _)] = receiver.got
    assert sent["traceparent"] == traceparent_of(publish)
    # this message's: the suite's Redis may still hold an earlier test's
    # subscription to news, whose receiver is gone
    [process] = [
        span
        for span in named(spans, "process news")
        if span.attributes is not None and span.attributes["messaging.message.id"] == mid
    ]
    assert process.kind == SpanKind.CONSUMER
    assert process.attributes is not None
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes["messaging.message.id"] == mid
    assert process.attributes["feedsvc.delivery.ok"] is True
    assert linked_to(process) == [hex_ids(publish)]


async def test_without_tracing_a_post_is_stored_as_sent(http: Client, headers: Headers) -> None:
    """Tracing off, the request's traceparent is not even looked at: a
    message keeps exactly the headers it was posted with (none: none)."""
    assert not tracing.ENABLED
    traced = {**headers, "traceparent": PARENT, "tracestate": "v=1"}
    await post(http, traced, "p", [{"body": 1}, {"body": 2, "headers": {"traceparent": OWN}}])
    assert await stored_headers(http, headers, "p") == [None, {"traceparent": OWN}]


async def test_a_malformed_request_context_is_ignored(
    http: Client, headers: Headers, spans: InMemorySpanExporter
) -> None:
    """W3C: a traceparent that does not parse is ignored (a new trace), and
    nothing is stored; a bad tracestate alone is dropped."""
    await post(http, {**headers, "traceparent": "00-xyz"}, "m", [{"body": 1}])
    [publish] = named(spans, "publish m")
    assert publish.parent is None
    await post(
        http, {**headers, "traceparent": PARENT, "tracestate": "a=" + "b" * 600}, "m", [{"body": 2}]
    )
    _, second = named(spans, "publish m")
    assert await stored_headers(http, headers, "m") == [
        None,
        {"traceparent": traceparent_of(second)},
    ]


def test_the_switch_reads_the_standard_variables() -> None:
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "false"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})


def test_configure_builds_the_sdk_s_provider_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK reads the variables itself (the resource's service name here)."""
    assert not tracing.ENABLED
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "feeds-eu")
    tracing.configure()
    try:
        assert tracing.ENABLED
        provider = tracing._state["provider"]
        assert provider.resource.attributes["service.name"] == "feeds-eu"
    finally:
        tracing.disable()
    assert not tracing.ENABLED
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    tracing.configure()  # the feedsvc default name
    try:
        assert tracing._state["provider"].resource.attributes["service.name"] == "feedsvc"
    finally:
        tracing.disable()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tracing.configure()  # not asked for: stays off
    assert not tracing.ENABLED


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"OTEL_TRACES_EXPORTER": "no-such-exporter"}, "'no-such-exporter'"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "smoke"}, "'smoke'"),
    ],
)
def test_a_tracing_setting_that_cannot_be_honoured_is_refused(
    env: dict[str, str], needle: str
) -> None:
    with pytest.raises(tracing.TracingSettingError, match=needle):
        tracing.check(env)


@pytest.mark.process
def test_serve_refuses_an_exporter_it_does_not_have_in_one_line() -> None:
    result = run_cli("serve", "--port", "0", env={"OTEL_TRACES_EXPORTER": "zipkin-json"})
    assert "OTEL_TRACES_EXPORTER" in one_line_error(result)


def test_only_the_tracing_module_imports_opentelemetry_and_only_when_switched_on() -> None:
    """The hot paths test tracing.ENABLED only; opentelemetry is imported
    nowhere else in feedsvc, and in tracing.py only inside the functions
    that switch it on (the module-level switch is resolved once)."""
    package = Path(feedsvc.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "opentelemetry" for n in names):
                found.append((path.name, id(node) in top_level))
    assert found, "the check looks at the wrong files"
    assert {name for name, _ in found} == {"tracing.py"}
    assert not any(top for _, top in found), "imported when tracing.py is"


BLOCKED = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Blocked())
import feedsvc.cli, feedsvc.app, feedsvc.api.handlers, feedsvc.delivery.runner
import feedsvc
from feedsvc import tracing
tracing.check({})
tracing.configure({})
assert not tracing.ENABLED
try:
    tracing.check({"OTEL_TRACES_EXPORTER": "otlp"})
except tracing.TracingSettingError as exc:
    print(exc)
"""


@pytest.mark.process
def test_without_the_extra_feedsvc_runs_and_asking_for_tracing_says_what_to_install() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED], env=env, capture_output=True, text=True, check=True
    )
    assert "pip install 'feedsvc[otel]'" in out.stdout


@pytest.mark.process
def test_a_served_process_exports_its_spans_over_otlp(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Through a real ``feedsvc serve`` configured only by OTEL_* variables
    (the bench's tracing part uses the same): its spans reach an OTLP/HTTP
    receiver."""
    paths: list[str] = []
    log = tmp_path / "serve.log"
    with otlp_sink(paths) as endpoint, traced_service(str(redis_server.url), log, endpoint) as svc:
        svc.request("POST", "/v2/queues/t/messages", {"messages": [{"body": 1}]})
        deadline = time.monotonic() + 30
        while not paths and time.monotonic() < deadline:
            time.sleep(0.05)  # the batch processor exports every 100 ms
    assert paths and set(paths) == {"/v1/traces"}, paths
