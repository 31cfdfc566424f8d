"""What tracing costs: the ``tracing`` part of ``python -m bench``.

Two ``feedsvc serve`` processes on the suite's Redis, in the same venv
(``feedsvc[otel]`` installed): one with no ``OTEL_*`` variable (tracing
off: the module-level switch is false and opentelemetry is never
imported), one with ``OTEL_TRACES_EXPORTER=otlp`` sending every span (the
default sampler keeps them all) to an OTLP/HTTP sink in this process that
answers 200 at once. Each round runs wrk on the hello baseline of the
tracing-off process, then on a POST and on a GET of a 10-message page
against the one and then the other, back to back. Reported per method: the
median over rounds of off/hello (compare with the post and get parts: the
cost of the off switch is nil if it is the same) and of on/off.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.service import Service, WrkResult, WrkSuite, service, wrk


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that keeps nothing but the paths posted to."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def otlp_sink(paths: list[str] | None = None) -> Iterator[str]:
    """The endpoint of a local OTLP/HTTP sink (served by a thread); the
    paths of the exports it gets are appended to paths."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.paths = [] if paths is None else paths  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def traced_service(redis_url: str, log: Path, endpoint: str) -> Service:
    """A Service exporting its spans over OTLP/HTTP to endpoint."""
    traced = Service(redis_url, log)
    traced.env.update(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_SERVICE_NAME="feedsvc-bench",
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: exported soon after (the default is 5 s)
    )
    return traced


def part_tracing(suite: WrkSuite) -> None:
    c, seconds = suite.connections, suite.duration
    targets = {"POST": ("post.lua", "/v2/queues/bpost/messages"),
               "GET": ("get.lua", "/v2/queues/bget/messages?limit=10")}  # fmt: skip
    with otlp_sink() as endpoint:
        traced = traced_service(suite.redis.url, suite.workdir / "tracing-on.log", endpoint)
        with service(suite.redis.url, suite.workdir, log="tracing-off.log") as off, traced as on:
            runs: dict[str, list[tuple[WrkResult, WrkResult, WrkResult]]] = {m: [] for m in targets}
            for _ in range(suite.rounds):
                for method, (script, path) in targets.items():
                    hello = wrk(off.url + "/bench/hello", None, c, seconds)
                    plain = wrk(off.url + path, script, c, seconds)
                    spans = wrk(on.url + path, script, c, seconds)
                    runs[method].append((hello, plain, spans))
    for method, triples in runs.items():
        by_off = sorted(triples, key=lambda t: t[1].rps / t[0].rps)
        hello, plain, _ = by_off[len(by_off) // 2]
        by_on = sorted(triples, key=lambda t: t[2].rps / t[1].rps)
        _, plain_on, spans = by_on[len(by_on) // 2]
        suite.add(
            f"{method} with tracing off / hello, on / off",
            rps_hello=hello.rps,
            rps_off=plain.rps,
            off_over_hello=plain.rps / hello.rps,
            rps_on=spans.rps,
            on_over_off=spans.rps / plain_on.rps,
            p50_ms_off=plain_on.p50_ms,
            p50_ms_on=spans.p50_ms,
            errors=sum(r.errors for t in triples for r in t),
        )
