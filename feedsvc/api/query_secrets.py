"""Credentials in a query string, kept out of the logs.

A browser's ``EventSource`` cannot send headers, so a read may carry its
credential in the URL: a bearer token as ``access_token`` (RFC 6750
section 2.3, ``feedsvc.api.identity``) or a pre-signed URL's parts under
their header names (``feedsvc.api.signed_urls``). Their values must never
reach a log. Every log line of feedsvc names a request by its method and
path, never its query, except two: the access log (``--access-log``), whose
request line (``%r``) is the whole target: :class:`AccessLogger` writes it
with each of those values replaced by :data:`REDACTED`, in the text and in
the fields a JSON log takes from it; and the line about a request too
malformed to parse, which quotes aiohttp's parser, request line and all:
:func:`redacted_text` goes over it (``middleware.http_error_message``).
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

from aiohttp import web
from aiohttp.web_log import AccessLogger as _AiohttpAccessLogger

#: The query parameters whose values no log shows.
SECRET_PARAMETERS = frozenset(
    (
        "access_token",
        "URL-Signature",
        "URL-Expires",
        "URL-Methods",
        "URL-Paths",
        "X-Project-ID",
    )
)
#: What a log shows instead of such a value.
REDACTED = "REDACTED"
#: Any of them with its value, in free text (a request line quoted by the
#: parser), in any case, its '-' or '_' written plain or percent-encoded.
_IN_TEXT = re.compile(
    r"((?:access(?:_|%5F)token|URL(?:-|%2D)(?:Signature|Expires|Methods|Paths)"
    r"|X(?:-|%2D)Project(?:-|%2D)ID)=)[^&\s'\"]*",
    re.IGNORECASE,
)


def redacted_text(text: str) -> str:
    """text with the value of each SECRET_PARAMETERS name=value in it replaced."""
    return _IN_TEXT.sub(rf"\1{REDACTED}", text)


def redacted_query(query_string: str) -> str | None:
    """The query string with the values of SECRET_PARAMETERS replaced; None
    when it holds none of them (the common case: nothing to copy)."""
    parts = query_string.split("&")
    changed = False
    for index, part in enumerate(parts):
        name, equals, _ = part.partition("=")
        if unquote_plus(name) in SECRET_PARAMETERS:
            parts[index] = f"{name}={REDACTED}" if equals else name
            changed = True
    return "&".join(parts) if changed else None


class AccessLogger(_AiohttpAccessLogger):
    """aiohttp's access logger, fed a copy of a request whose query holds a
    credential, with that credential's value redacted."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        query = request.rel_url.raw_query_string
        if query:
            clean = redacted_query(query)
            if clean is not None:
                url = request.rel_url.with_query(None)
                request = request.clone(rel_url=f"{url.raw_path}?{clean}")
        super().log(request, response, time)
