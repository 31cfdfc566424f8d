"""What a subscriber can be, and what its ``post_headers`` may say.

Checked when a subscription is made or changed
(``feedsvc.api.subscription_rules``, a 400 with the reason) and again when a
notification is sent (``feedsvc.delivery.senders``: a subscription stored
before these rules fails for good rather than being retried through its
whole policy). A subscriber that no delivery can ever reach is refused at
once: a port out of range, a host with spaces, a mail address with a line
break in it.

* **Webhook** ``http(s)://host[:port]/...``: a host that is an IP literal
  or a DNS name (IDNA for non-ASCII), a port from 1 to 65535, no spaces or
  control characters anywhere (RFC 3986 has them percent-encoded).
* **Mail** ``mailto:a@example.com[,b@example.com]...[?subject=...]``
  (RFC 6068): one to ``MAX_MAIL_RECIPIENTS`` addresses, each a valid
  ``local@domain`` (``email.headerregistry``), all of them mailed.
* **post_headers**: at most ``MAX_POST_HEADERS`` headers and
  ``MAX_POST_HEADER_BYTES`` bytes; each name an HTTP token, each value
  visible ASCII with inner spaces or tabs (RFC 9110, 5.5 and 5.6.2); never a
  header that frames the request or belongs to one connection (``Host``,
  ``Content-Length``, ``Transfer-Encoding``, ``Connection`` and the other
  hop-by-hop headers, ``Expect``): the client sets those, and a receiver
  that believed a forged one would read the wrong bytes.
"""

from __future__ import annotations

import re
from email.errors import HeaderParseError
from email.headerregistry import Address
from email.utils import parseaddr
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from feedsvc.delivery.guard import literal_ip

SUBSCRIBER_TYPES = ("http", "https", "mailto")
MAX_SUBSCRIBER_LENGTH = 4096
MAX_MAIL_RECIPIENTS = 10
MAX_POST_HEADERS = 32
MAX_POST_HEADER_BYTES = 8192  # names and values together: a common server's limit
MAX_SUBJECT_LENGTH = 998  # a mail header line (RFC 5322, 2.1.1)
#: Headers the HTTP client owns (lower case).
FORBIDDEN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "upgrade",
        "expect",
    }
)
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token
HEADER_VALUE = re.compile(r"^(?:[\x21-\x7e](?:[\t\x20-\x7e]*[\x21-\x7e])?)?$")
# spaces and control characters (percent-encoded in a valid URI)
UNSAFE = re.compile(r"[\x00-\x20\x7f]")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
DNS_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


class Unreachable(ValueError):
    """A subscriber no delivery can reach; the message says why."""


def _check_text(value: str) -> None:
    if len(value) > MAX_SUBSCRIBER_LENGTH:
        raise Unreachable(f"The subscriber must be at most {MAX_SUBSCRIBER_LENGTH} characters.")
    if UNSAFE.search(value):
        raise Unreachable(
            "The subscriber must not contain spaces or control characters "
            "(percent-encode them, e.g. %20)."
        )


def _host(hostname: str) -> None:
    if literal_ip(hostname) is not None:
        return
    try:
        ascii_name = hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise Unreachable(f"The subscriber's host {hostname!r} is not a valid name.") from None
    labels = ascii_name.removesuffix(".").split(".")
    if len(ascii_name) > 253 or not all(DNS_LABEL.match(label) for label in labels):
        raise Unreachable(f"The subscriber's host {hostname!r} is not a valid name.")


def webhook(value: str) -> SplitResult:
    """The parts of a webhook subscriber that can be reached, else Unreachable."""
    _check_text(value)
    try:
        parts = urlsplit(value)
        port = parts.port  # raises for a port out of range or not a number
    except ValueError as exc:
        raise Unreachable(f"The subscriber is not a valid URL: {exc}.") from None
    if parts.scheme not in ("http", "https"):
        raise Unreachable("A webhook subscriber is an http:// or https:// URL.")
    if not parts.hostname:
        raise Unreachable("A webhook subscriber needs a host, e.g. https://example.com/hook.")
    if port == 0:
        raise Unreachable("The subscriber's port must be from 1 to 65535.")
    _host(parts.hostname)
    return parts


def mail_address(value: str) -> str:
    """value if it is one address ``local@domain``, else Unreachable."""
    try:
        address = Address(addr_spec=value)
    except (ValueError, IndexError, TypeError, HeaderParseError):
        address = None
    if address is None or not address.username or not address.domain:
        raise Unreachable(f"{value!r} is not a mail address like ops@example.com.")
    return value


def mail_recipients(value: str) -> list[str]:
    """The addresses of a mailto: subscriber, else Unreachable."""
    _check_text(value)
    parts = urlsplit(value)
    if parts.scheme != "mailto" or not parts.path:
        raise Unreachable("A mailto: subscriber needs an address, e.g. mailto:ops@example.com.")
    found = [unquote(a) for a in parts.path.split(",")]
    if len(found) > MAX_MAIL_RECIPIENTS:
        raise Unreachable(f"A mailto: subscriber has at most {MAX_MAIL_RECIPIENTS} addresses.")
    for address in found:
        try:
            mail_address(address)
        except Unreachable:
            raise Unreachable(
                "A mailto: subscriber needs an address, e.g. mailto:ops@example.com "
                f"(several are separated by commas); {address!r} is not one."
            ) from None
    return found


def sender_address(value: Any) -> str:
    """A mail's From (``options.from``): an address, with a display name or not."""
    if not isinstance(value, str) or CONTROL.search(value):
        raise Unreachable("options.from must be one line holding a mail address.")
    mail_address(parseaddr(value)[1])
    return value


def subject(value: Any) -> str:
    """A mail's subject (``options.subject`` or ``?subject=``): one line."""
    if not isinstance(value, str) or len(value) > MAX_SUBJECT_LENGTH or CONTROL.search(value):
        raise Unreachable(
            f"A mail subject must be one line of at most {MAX_SUBJECT_LENGTH} characters."
        )
    return value


def header_problem(name: Any, value: Any) -> str | None:
    """Why a post_headers entry cannot be sent (None: it can)."""
    if not isinstance(name, str) or not HEADER_NAME.match(name):
        return f"{name!r} is not an HTTP header name."
    if name.lower() in FORBIDDEN_HEADERS:
        return f"{name} is set by the HTTP client, not by a subscription."
    if not isinstance(value, str) or not HEADER_VALUE.match(value):
        return f"the value of {name} must be a one-line string of visible ASCII."
    return None


def post_headers_problem(headers: Any) -> str | None:
    """Why options.post_headers cannot be sent (None: it can)."""
    if not isinstance(headers, dict):
        return "options.post_headers must be an object of header names to strings."
    if len(headers) > MAX_POST_HEADERS:
        return f"options.post_headers may hold at most {MAX_POST_HEADERS} headers."
    size = 0
    for name, value in headers.items():
        problem = header_problem(name, value)
        if problem is not None:
            return f"options.post_headers: {problem}"
        size += len(name) + len(value)
    if size > MAX_POST_HEADER_BYTES:
        return f"options.post_headers may hold at most {MAX_POST_HEADER_BYTES} bytes."
    return None


def sendable_headers(headers: Any) -> dict[str, str]:
    """The entries of a stored post_headers that can be sent (one stored
    before these rules may hold others: they are left out)."""
    if not isinstance(headers, dict):
        return {}
    return {k: v for k, v in headers.items() if header_problem(k, v) is None}
