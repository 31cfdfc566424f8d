"""Validation of subscription requests, with Zaqar's rules and words
(``zaqar/transport/validation.py``: subscription_posting, _patching,
_confirming, _listing, _validate_retry_policy).

Unlike Zaqar, ``trust+http(s)`` subscribers are refused (they need Keystone
trusts), a subscriber must be a string that some delivery can reach
(``feedsvc.delivery.subscribers``, which also owns the post_headers rules),
the retry policy's numbers are bounded (``feedsvc.delivery.retry``), and a
webhook's address is checked against the address guard when its host, read
as the HTTP client reads it, is an address (a name is checked when it is
resolved, at every delivery: see ``feedsvc.delivery.guard``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson

from feedsvc.config.subscriptions import SubscriptionSettings, subscriber_networks
from feedsvc.delivery import retry, subscribers
from feedsvc.delivery.guard import RefusedAddress, check_host, url_host
from feedsvc.errors import BadRequest

MIN_SUBSCRIPTION_TTL = 60


def unparsable() -> BadRequest:
    # Zaqar's words for a body that is not JSON
    return BadRequest("Request body could not be parsed.")


def subscriber(value: Any, settings: SubscriptionSettings) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest("The subscriber must be a URI string.")
    scheme = value.partition(":")[0].lower() if ":" in value else ""
    if scheme not in subscribers.SUBSCRIBER_TYPES:
        raise BadRequest(
            "The subscriber type of subscription must be supported in the list "
            f"{list(subscribers.SUBSCRIBER_TYPES)}."
        )
    try:
        if scheme == "mailto":
            subscribers.mail_recipients(value)
            query = parse_qs(urlsplit(value).query)
            for given in query.get("subject", []):
                subscribers.subject(given)
            return value
        subscribers.webhook(value)
    except subscribers.Unreachable as exc:
        raise BadRequest(str(exc)) from None
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
    retry.parse(value)  # the retry policy's checks and bounds have one owner
    headers = value.get("post_headers")
    problem = None if headers is None else subscribers.post_headers_problem(headers)
    if problem is not None:
        raise BadRequest(problem)
    try:
        if value.get("from") is not None:
            subscribers.sender_address(value["from"])
        if value.get("subject") is not None:
            subscribers.subject(value["subject"])
    except subscribers.Unreachable as exc:
        raise BadRequest(str(exc)) from None
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


def patching(document: Any, settings: SubscriptionSettings) -> tuple[str | None, int | None, Any]:
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


def posting(document: Any, settings: SubscriptionSettings) -> tuple[str, int, dict[str, Any]]:
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
