"""What the handlers and the event stream add to a message's journey for
tracing (``feedsvc.tracing``) and W3C context propagation: a post's
request context stamped into its messages, a consumer span's links."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from feedsvc import tracing
from feedsvc.message_headers import (
    TRACEPARENT,
    TRACESTATE,
    request_trace_context,
    trace_headers,
    with_trace_context,
)
from feedsvc.storage.base import Message, NewMessage


def request_context(request: web.Request) -> dict[str, str]:
    """The request's W3C Trace Context ({} if none, or malformed)."""
    headers = request.headers
    if TRACEPARENT not in headers:  # the common case: one lookup
        return {}
    return request_trace_context(headers[TRACEPARENT], headers.get(TRACESTATE))


def stamp(messages: list[NewMessage], context: dict[str, str]) -> None:
    """Store a W3C context in the headers of the messages that carry none."""
    if context:
        for m in messages:
            m.headers = with_trace_context(m.headers, context)


def carriers(messages: list[NewMessage] | list[Message]) -> list[dict[str, str]]:
    """The W3C context each message carries in its headers (a span's links)."""
    return [trace_headers(m.headers) for m in messages]


def consumed(span: Any, messages: list[Message]) -> None:
    """A consumer span names the messages it got and links to their producers."""
    tracing.link(span, carriers(messages))
    tracing.message_ids(span, [m.id for m in messages])
