"""A posted message's ``"headers"``: checked, and encoded once for the record.

Headers are a feedsvc extension (docs/consumers.md#message-headers): an
object of strings a producer attaches to a message, returned with it
wherever it is read and sent with its webhook notifications. The limits,
fixed (not settings: they are part of the wire format a consumer relies on,
like Zaqar's id formats):

* at most :data:`MAX_HEADERS` headers;
* names match :data:`NAME` (a letter or digit, then letters, digits, ``.``,
  ``_`` or ``-``, 64 characters at most) and are case-insensitive: they are
  stored lower-cased, as HTTP/2 sends header names, and two names that differ
  only in case are a 400 rather than one silently replacing the other;
* values are strings without control characters (they may become HTTP
  headers of a webhook request: no CR/LF can be smuggled in);
* the encoded object is at most :data:`MAX_HEADERS_SIZE` bytes (and, as part
  of the request, counts towards the post size limit too);
* ``traceparent`` and ``tracestate`` follow W3C Trace Context, because the
  service reads them (span links, webhook request headers).

An empty object is no headers: the message is stored and returned without a
``headers`` field, exactly like one posted without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import orjson

from feedsvc.errors import BadRequest

MAX_HEADERS: Final = 32
MAX_HEADERS_SIZE: Final = 4096  # bytes of the encoded object
NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# any character but the C0 controls and DEL (a tab is a control too)
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
#: W3C Trace Context: version (not ff), trace id, parent id, flags; ids not all zeros.
TRACEPARENT_PATTERN: Final = (
    r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
)
#: W3C Trace Context: a list of printable ASCII, 512 characters at most.
TRACESTATE_PATTERN: Final = r"[\x20-\x7e]{0,512}"
_TRACEPARENT: Final = re.compile(TRACEPARENT_PATTERN)
_TRACESTATE: Final = re.compile(TRACESTATE_PATTERN)
#: The headers a webhook request carries as HTTP headers too.
TRACE_HEADERS: Final = (TRACEPARENT, TRACESTATE)


def _bad(description: str) -> BadRequest:
    return BadRequest(f'A message\'s "headers" {description}')


def message_headers(value: Any) -> bytes:
    """The headers of one posted message as stored (b"": none); BadRequest
    if they break a rule in the module docstring."""
    if not isinstance(value, dict):
        raise _bad("must be an object of strings.")
    if len(value) > MAX_HEADERS:
        raise _bad(f"may hold at most {MAX_HEADERS} headers.")
    headers: dict[str, str] = {}
    for name, text in value.items():
        if not isinstance(name, str) or NAME.fullmatch(name) is None:
            raise _bad(
                f"names must match {NAME.pattern} (letters, digits, '.', '_', '-'): "
                f"{str(name)[:70]!r} does not."
            )
        if not isinstance(text, str):
            raise _bad(f"values must be strings: {name!r} is not.")
        if _CONTROL.search(text):
            raise _bad(f"values may not hold control characters: {name!r} does.")
        key = name.lower()
        if key in headers:
            raise _bad(f"names are case-insensitive: {name!r} is given twice.")
        headers[key] = text
    _check_trace_context(headers)
    if not headers:
        return b""
    encoded = orjson.dumps(headers)
    if len(encoded) > MAX_HEADERS_SIZE:
        raise _bad(f"may take at most {MAX_HEADERS_SIZE} bytes encoded as JSON.")
    return encoded


def _check_trace_context(headers: Mapping[str, str]) -> None:
    parent = headers.get(TRACEPARENT)
    if parent is not None and _TRACEPARENT.fullmatch(parent) is None:
        raise _bad(
            "traceparent must be a W3C Trace Context traceparent (00-<32 hex>-<16 hex>-<2 hex>)."
        )
    state = headers.get(TRACESTATE)
    if state is not None and _TRACESTATE.fullmatch(state) is None:
        raise _bad("tracestate must be at most 512 printable ASCII characters.")


def request_trace_context(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """A request's W3C Trace Context headers as message headers; {} if its
    traceparent is missing or malformed (W3C: then the context is ignored;
    a malformed tracestate alone is dropped)."""
    if traceparent is None or _TRACEPARENT.fullmatch(traceparent) is None:
        return {}
    context = {TRACEPARENT: traceparent}
    if tracestate is not None and _TRACESTATE.fullmatch(tracestate) is not None:
        context[TRACESTATE] = tracestate
    return context


def with_trace_context(stored: bytes, context: Mapping[str, str]) -> bytes:
    """A message's stored headers with context added when it has no
    traceparent of its own (the service's addition: beyond the client's
    limits, by at most two headers of 600 bytes)."""
    if not context:
        return stored
    headers = orjson.loads(stored) if stored else {}
    if TRACEPARENT in headers:
        return stored
    headers.update(context)
    return orjson.dumps(headers)


def trace_headers(stored: bytes | None) -> dict[str, str]:
    """The W3C Trace Context headers among a message's stored headers."""
    if not stored:
        return {}
    headers = orjson.loads(stored)
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}
