"""OpenTelemetry spans of the messages' journeys (docs/operations.md#tracing).

Optional: with the ``feedsvc[otel]`` extra installed and
``OTEL_TRACES_EXPORTER`` set to an exporter (not ``none``), and
``OTEL_SDK_DISABLED`` not ``true``, each process builds an SDK tracer
provider from the standard ``OTEL_*`` variables (the SDK reads them itself:
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*``, and the exporter its ``OTEL_EXPORTER_OTLP_*``), and feedsvc
emits spans following the messaging semantic conventions:

=====================  ===========  ==========================================
span                   kind         where
=====================  ===========  ==========================================
``publish <queue>``    producer     a post of messages
``receive <queue>``    consumer     a claim, a pop, an event stream's messages
``process <queue>``    consumer     a webhook or mail delivery of one message
=====================  ===========  ==========================================

with ``messaging.system`` = ``feedsvc``, ``messaging.destination.name``,
``messaging.operation.type`` (publish, receive, process),
``messaging.message.id`` (one message) or ``messaging.batch.message_count``
(several). A consumer span is *linked* to the ``traceparent`` stored in each
message's headers; a post whose request carries a ``traceparent`` (the
publish span's parent) stores the publish span's context in each of its
messages that has none of its own, so the links lead back to the producer.
A post without one changes no message (Zaqar clients cannot read headers).

The cost with tracing off is nil: nothing here imports opentelemetry until
:func:`configure` finds it switched on, and the hot paths test one module
global, :data:`ENABLED`, resolved once per process. A setting that cannot be
honoured (an exporter not installed, the extra missing) is refused by
:func:`check` at startup: one line, exit 2.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import Any, Final

from feedsvc import __version__

#: Whether spans are made: set once per process (configure, or enable in tests).
ENABLED = False
SYSTEM: Final = "feedsvc"
_state: dict[str, Any] = {}

EXPORTER_GROUP: Final = "opentelemetry_traces_exporter"
#: OTEL_TRACES_EXPORTER=otlp names no entry point of its own once only the
#: HTTP exporter is installed: it is chosen by the OTLP protocol variable.
_OTLP: Final = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


class TracingSettingError(ValueError):
    """The OTEL_* variables ask for what this installation cannot do."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment switches tracing on (see the module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return _exporter_names(environ) != []


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    raw = environ.get("OTEL_TRACES_EXPORTER", "")
    return [n.strip() for n in raw.split(",") if n.strip() and n.strip() != "none"]


def _entry_point_name(name: str, environ: Mapping[str, str]) -> str:
    if name != "otlp" or entry_points(group=EXPORTER_GROUP, name="otlp"):
        return name
    protocol = environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    )
    if protocol not in _OTLP:
        raise TracingSettingError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not one of {sorted(_OTLP)}"
        )
    return _OTLP[protocol]


def _exporters(environ: Mapping[str, str]) -> list[Any]:
    """The exporter classes OTEL_TRACES_EXPORTER names; TracingSettingError
    if one is not installed."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise TracingSettingError(
            "OTEL_TRACES_EXPORTER is set but OpenTelemetry is not installed: "
            "pip install 'feedsvc[otel]' (or unset it)"
        ) from None
    found = []
    for name in _exporter_names(environ):
        point = _entry_point_name(name, environ)
        matches = list(entry_points(group=EXPORTER_GROUP, name=point))
        if not matches:
            which = repr(name) if point == name else f"{name!r} ({point})"
            raise TracingSettingError(
                f"OTEL_TRACES_EXPORTER names {which}, but no such span exporter is installed"
            )
        found.append(matches[0].load())
    return found


def check(environ: Mapping[str, str] = os.environ) -> None:
    """TracingSettingError if the environment asks for tracing this
    installation cannot do (the serve command's startup check)."""
    if wanted(environ):
        _exporters(environ)


def configure(environ: Mapping[str, str] = os.environ) -> None:
    """Switch tracing on in this process if the environment asks for it:
    an SDK tracer provider with a batch processor per named exporter."""
    if ENABLED or not wanted(environ):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {}
    if "OTEL_SERVICE_NAME" not in environ and "service.name=" not in environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = SYSTEM
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in _exporters(environ):
        provider.add_span_processor(BatchSpanProcessor(exporter()))
    enable(provider)


def enable(provider: Any) -> None:
    """Make spans with provider (an SDK TracerProvider) from now on."""
    global ENABLED  # noqa: PLW0603 (the one switch the hot paths read)
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _state.update(
        provider=provider,
        tracer=provider.get_tracer("feedsvc", __version__),
        trace=trace,
        propagator=TraceContextTextMapPropagator(),
    )
    ENABLED = True


def disable() -> None:
    """Stop making spans; the provider's spans are flushed."""
    global ENABLED  # noqa: PLW0603 (the one switch the hot paths read)
    ENABLED = False
    provider = _state.pop("provider", None)
    _state.clear()
    if provider is not None:
        provider.shutdown()


def _context(carrier: Mapping[str, str]) -> Any:
    return _state["propagator"].extract(carrier)


def _linked(carriers: Iterable[Mapping[str, str]]) -> list[Any]:
    trace = _state["trace"]
    links = []
    for carrier in carriers:
        if carrier:
            found = trace.get_current_span(_context(carrier)).get_span_context()
            if found.is_valid:
                links.append(trace.Link(found))
    return links


@contextmanager
def span(
    operation: str,
    destination: str,
    *,
    producer: bool = False,
    parent: Mapping[str, str] | None = None,
    links: Iterable[Mapping[str, str]] = (),
) -> Iterator[Any]:
    """A span ``<operation> <destination>`` (a producer's, else a
    consumer's), child of parent (W3C headers) if given, linked to each of
    links (messages' W3C headers); an exception marks it failed."""
    trace = _state["trace"]
    kind = trace.SpanKind.PRODUCER if producer else trace.SpanKind.CONSUMER
    with _state["tracer"].start_as_current_span(
        f"{operation} {destination}",
        context=_context(parent) if parent else None,
        kind=kind,
        links=_linked(links),
        attributes={
            "messaging.system": SYSTEM,
            "messaging.destination.name": destination,
            "messaging.operation.type": operation,
            "messaging.operation.name": operation,
        },
    ) as current:
        yield current


def carrier_of(current: Any) -> dict[str, str]:
    """The W3C headers of a span's context (what a message stores)."""
    carrier: dict[str, str] = {}
    _state["propagator"].inject(carrier, _state["trace"].set_span_in_context(current))
    return carrier


def message_ids(current: Any, ids: list[str]) -> None:
    """Name the messages a span was about: one id, or the batch's size."""
    if len(ids) == 1:
        current.set_attribute("messaging.message.id", ids[0])
    elif ids:
        current.set_attribute("messaging.batch.message_count", len(ids))


def link(current: Any, carriers: Iterable[Mapping[str, str]]) -> None:
    """Link a started span to the messages' stored W3C headers."""
    for found in _linked(carriers):
        current.add_link(found.context)
