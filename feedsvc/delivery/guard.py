"""The address guard: a webhook is a request a client makes the service
send, so by default it may reach public unicast addresses only.

Loopback, private, link-local, shared (CGNAT), reserved, multicast and
unspecified addresses (everything ``ipaddress`` does not call global) are
refused unless a network of ``--subscriber-allow`` holds them. IPv4-mapped
IPv6 addresses are judged as the IPv4 address they carry.

Where it is checked:

* at creation (``feedsvc.api.subscription_rules``): the scheme, and the host
  when it is a literal IP;
* at every delivery: :class:`GuardedResolver` resolves the host name, drops
  every refused address, and hands aiohttp only the addresses it checked, so
  the connection goes to an address that passed (DNS cannot swap in another
  between the check and the connect). No DNS cache: each delivery resolves
  again. A literal IP host does not go through a resolver in aiohttp, so the
  sender checks it itself (:func:`check_host`). Redirects are not followed.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from feedsvc.config import IPNetwork

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class RefusedAddress(OSError):
    """The subscriber's host is (or resolves only to) refused addresses."""


def literal_ip(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return None


def allowed(address: Address, networks: list[IPNetwork]) -> bool:
    """Inside a network of --subscriber-allow, or public unicast."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address.version == net.version and address in net for net in networks):
        return True
    return address.is_global and not address.is_multicast


def check_host(host: str, networks: list[IPNetwork]) -> None:
    """Refuse a literal IP host that is not allowed (names are left to the resolver)."""
    address = literal_ip(host)
    if address is not None and not allowed(address, networks):
        raise RefusedAddress(f"{address} is not a public address (see --subscriber-allow)")


class GuardedResolver(AbstractResolver):
    """aiohttp's threaded resolver, keeping only the allowed addresses."""

    def __init__(self, networks: list[IPNetwork]) -> None:
        self._networks = networks
        self._resolver = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        kept = [r for r in found if (a := literal_ip(r["host"])) and allowed(a, self._networks)]
        if not kept:
            shown = ", ".join(sorted({r["host"] for r in found}))
            raise RefusedAddress(f"{host} resolves to {shown}: not public (see --subscriber-allow)")
        return kept

    async def close(self) -> None:
        await self._resolver.close()

    def __repr__(self) -> str:
        return f"GuardedResolver({self._networks!r})"


def describe(exc: BaseException) -> Any:
    """A short text for an error, for last_error."""
    return f"{type(exc).__name__}: {exc}"[:300]
