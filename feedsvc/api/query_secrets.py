"""Credentials in a query string, kept out of the logs.

A browser's ``EventSource`` cannot send headers, so a read may carry its
credential in the URL: a bearer token as ``access_token`` (RFC 6750
section 2.3, ``feedsvc.api.identity``) or a pre-signed URL's parts under
their header names (``feedsvc.api.signed_urls``). Their values must never
reach a log. Every log line of feedsvc names a request by its method and
path, never its query, except the access log (``--access-log``), whose
request line (``%r``) is the whole target: :class:`AccessLogger` writes it
with each of those values replaced by :data:`REDACTED`, in the text and in
the fields a JSON log takes from it.
"""

from __future__ import annotations

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
