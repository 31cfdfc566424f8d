"""The subscriptions section of the settings: webhooks' and mails' delivery
(``serve --help``'s "subscriptions"), and the parsers of its values that
the delivery and the API share."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from feedsvc.config.fields import opt, section

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class SubscriptionSettings:
    """The subscriptions section of Settings (and of ``serve --help``)."""

    section("subscriptions")
    default_subscription_ttl: int = opt(
        3600, "subscription ttl in seconds when none is given", minimum=60
    )
    max_subscriptions_per_page: int = opt(20, "largest 'limit' of a subscription list", minimum=1)
    require_confirmation: bool = opt(
        False,
        "as Zaqar's [notification] require_confirmation: a new subscriber is sent a "
        "confirmation request (a pre-signed PUT .../confirm; needs --signed-url-key) and "
        "nothing else until it confirms",
    )
    subscriber_allow: str | None = opt(
        None,
        "CIDRs webhooks may reach although private, loopback, link-local or otherwise "
        "not public, e.g. 10.1.0.0/16,127.0.0.1/32 (the rest of those ranges stays refused)",
    )
    smtp_server: str | None = opt(
        None,
        "host:port of the SMTP server that mailto: subscribers are sent through "
        "(plain SMTP, STARTTLS when the server offers it); unset = mailto deliveries fail",
    )
    smtp_sender: str = opt(
        "feedsvc@localhost",
        "envelope sender and default From: of notification mails (a subscription's "
        "options.from sets its From:)",
    )
    deliver: bool = opt(
        True,
        "run the subscription delivery worker in this process; --no-deliver makes an "
        "API-only process (some process must deliver)",
    )
    delivery_lease: float = opt(
        30.0,
        "seconds a worker holds a subscription it delivers (renewed while it works); "
        "a crashed worker's subscriptions are taken over after this",
        minimum=0.5,
    )
    delivery_timeout: float = opt(
        10.0,
        "seconds one webhook or mail attempt may take (must be below half of --delivery-lease)",
        minimum=0.1,
    )
    delivery_sweep: float = opt(
        10.0,
        "seconds between each process's sweeps for subscriptions with work and no "
        "live worker (new messages wake delivery at once, without a sweep)",
        minimum=0.1,
    )


def subscriber_networks(allow: str | None) -> list[IPNetwork]:
    """The networks of --subscriber-allow."""
    if not allow:
        return []
    out: list[IPNetwork] = []
    for item in allow.split(","):
        try:
            out.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"--subscriber-allow must be CIDR[,CIDR...], got {item.strip()!r}"
            ) from None
    return out


def smtp_address(server: str | None) -> tuple[str, int] | None:
    """(host, port) of --smtp-server."""
    if not server:
        return None
    host, colon, port = server.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--smtp-server must be host:port, got {server!r}")
    return host.strip("[]"), int(port)
