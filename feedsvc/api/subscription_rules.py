"""Validation of subscription requests, with Zaqar's rules and words
(``zaqar/transport/validation.py``: subscription_posting, _patching,
_confirming, _listing, _validate_retry_policy).

Unlike Zaqar, ``trust+http(s)`` subscribers are refused (they need Keystone
trusts), a subscriber must be a string, and a webhook's address is checked
against the address guard when its host, read as the HTTP client reads it,
is an address (a name is checked when it is resolved, at every delivery:
see ``feedsvc.delivery.guard``).
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any
from urllib.parse import urlsplit

import orjson

from feedsvc.config import Settings, subscriber_networks
from feedsvc.delivery.guard import RefusedAddress, check_host, url_host
from feedsvc.errors import BadRequest

SUBSCRIBER_TYPES = ("http", "https", "mailto")
MAX_SUBSCRIBER_LENGTH = 4096
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token
MIN_SUBSCRIPTION_TTL = 60
# Zaqar's consts.py: the retry policy's defaults and its back-off functions
RETRY_INTS = ("retries_with_no_delay", "minimum_delay_retries", "minimum_delay",
              "maximum_delay", "maximum_delay_retries")  # fmt: skip
BACKOFF_FUNCTIONS = ("linear", "arithmetic", "exponential", "geometric")
MINIMUM_DELAY = 5
MAXIMUM_DELAY = 30
LINEAR_INTERVAL = 5


def unparsable() -> BadRequest:
    # Zaqar's words for a body that is not JSON
    return BadRequest("Request body could not be parsed.")


def retry_policy(metadata: Any) -> None:
    """Zaqar's checks of ``_retry_policy`` (in options or queue metadata)."""
    policy = metadata.get("_retry_policy") if isinstance(metadata, dict) else None
    if policy and not isinstance(policy, dict):
        raise BadRequest("retry_policy must be a dict.")
    if not policy:
        return
    for key in RETRY_INTS:
        value = policy.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadRequest(f"Retry policy: {key} must be a integer.")
        if isinstance(value, int) and value < 0:
            raise BadRequest(f"Retry policy: {key} must not be negative.")
    function = policy.get("retry_backoff_function")
    if function and not isinstance(function, str):
        raise BadRequest("retry_backoff_function must be a string.")
    if function and function not in BACKOFF_FUNCTIONS:
        raise BadRequest("invalid retry_backoff_function.")
    ignore = policy.get("ignore_subscription_override")
    if ignore and not isinstance(ignore, bool):
        raise BadRequest("ignore_subscription_override must be a boolean.")
    low = policy.get("minimum_delay", MINIMUM_DELAY)
    high = policy.get("maximum_delay", MAXIMUM_DELAY)
    if high < low:
        raise BadRequest("minimum_delay must less than maximum_delay.")
    if high - low < 2 * LINEAR_INTERVAL:
        raise BadRequest("invalid minimum_delay and maximum_delay.")


def subscriber(value: Any, settings: Settings) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest("The subscriber must be a URI string.")
    if len(value) > MAX_SUBSCRIBER_LENGTH:
        raise BadRequest(f"The subscriber must be at most {MAX_SUBSCRIBER_LENGTH} characters.")
    scheme = urlsplit(value).scheme
    if scheme not in SUBSCRIBER_TYPES:
        raise BadRequest(
            "The subscriber type of subscription must be supported in the list "
            f"{list(SUBSCRIBER_TYPES)}."
        )
    if scheme == "mailto":
        if "@" not in value:
            raise BadRequest("A mailto: subscriber needs an address, e.g. mailto:ops@example.com.")
        return value
    parts = urlsplit(value)
    if not parts.hostname:
        raise BadRequest("A webhook subscriber needs a host, e.g. https://example.com/hook.")
    try:
        check_host(url_host(value), subscriber_networks(settings.subscriber_allow))
    except RefusedAddress as exc:
        raise BadRequest(
            f"The subscriber's host is refused: {exc}. Only public addresses are reached, "
            "unless the operator allows others (--subscriber-allow); write an address as "
            "a dotted quad."
        ) from None
    return value


def ttl(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest("TTL must be an integer.")
    if value < MIN_SUBSCRIPTION_TTL:
        raise BadRequest(
            f"The TTL for a subscription must be at least {MIN_SUBSCRIPTION_TTL} seconds long."
        )
    try:
        dt.datetime.now(dt.UTC) + dt.timedelta(seconds=value)
    except OverflowError:
        raise BadRequest(
            "The TTL seconds for a subscription plus current time must be less than "
            f"{dt.datetime.max}."
        ) from None
    return value


def options(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("Options must be a dict.")
    retry_policy(value)
    headers = value.get("post_headers")
    if headers is not None and not (
        isinstance(headers, dict)
        and all(HEADER_NAME.match(k) for k in headers)
        and all(isinstance(v, str) and "\r" not in v and "\n" not in v for v in headers.values())
    ):
        raise BadRequest(
            "options.post_headers must be an object of header names to one-line strings."
        )
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        raise BadRequest(
            "options may hold integers within 64 bits and nest at most 250 levels."
        ) from None
    data = value.get("post_data")
    if data is not None and not isinstance(data, str):
        raise BadRequest("options.post_data must be a string.")
    return value


def patching(document: Any, settings: Settings) -> tuple[str | None, int | None, Any]:
    """(subscriber, ttl, options) of a PATCH; None where not given."""
    if not document:
        raise BadRequest("No subscription to create.")
    if not isinstance(document, dict):
        raise BadRequest("Subscriptions must be a dict.")
    raw = document.get("subscriber")
    return (
        subscriber(raw, settings) if raw else None,
        ttl(document.get("ttl")),
        options(document.get("options")),
    )


def posting(document: Any, settings: Settings) -> tuple[str, int, dict[str, Any]]:
    """(subscriber, ttl, options) of a POST, defaults filled in."""
    if not isinstance(document, dict):
        raise BadRequest("Subscriptions must be a dict.")
    if "subscriber" not in document:
        raise BadRequest("Missing parameter subscriber in body.")
    found, given_ttl, given_options = patching(document, settings)
    if found is None:
        raise BadRequest("The subscriber must be a URI string.")
    return (
        found,
        settings.default_subscription_ttl if given_ttl is None else given_ttl,
        {} if given_options is None else given_options,
    )


def confirming(document: Any) -> bool:
    confirmed = document.get("confirmed") if isinstance(document, dict) else None
    if not isinstance(confirmed, bool):
        raise BadRequest("The 'confirmed' should be boolean.")
    return confirmed
