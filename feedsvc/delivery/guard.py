"""The address guard: a webhook is a request a client makes the service
send, so by default it may reach public unicast addresses only.

Loopback, private, link-local, shared (CGNAT), reserved, multicast and
unspecified addresses (everything ``ipaddress`` does not call global) are
refused unless a network of ``--subscriber-allow`` holds them. IPv4-mapped
IPv6 addresses are judged as the IPv4 address they carry.

The host judged is the host the HTTP client will use: :func:`url_host` reads
a URL as yarl (and so aiohttp) does, with IDNA and NFKC normalisation, so
``http://①②⑦.0.0.1/``, the same in fullwidth digits, or with ideographic
full stops, is 127.0.0.1, not a name. Legacy numeric IPv4 forms
(``2130706433``, ``0x7f.1``, ``127.1``, ``0``), which the C library maps onto
an address, are refused outright: an address must be written as a dotted
quad.

Where it is checked:

* at creation (``feedsvc.api.subscription_rules``): the scheme, and the host
  when it is an address in any spelling (:func:`check_host`);
* at every delivery, twice. :class:`GuardedResolver` resolves a host name,
  drops every refused address and hands aiohttp only the addresses it
  checked (no DNS cache: each delivery resolves again). And the connector
  (:func:`guarded_connector`) creates every socket through a factory that
  checks the very address the socket is about to connect to, whichever way
  aiohttp arrived at it (a name through the resolver, or a literal address,
  which skips it): nothing connects to an address that was not checked,
  whatever aiohttp's version makes of a host. Redirects are not followed.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.connector import AddrInfoType, SocketFactoryType
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from feedsvc.config.subscriptions import IPNetwork

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


def url_host(url: str) -> str:
    """The host of a URL as the HTTP client reads it ('' if none, or unreadable)."""
    try:
        return URL(url).raw_host or ""
    except (ValueError, TypeError):  # e.g. a name IDNA cannot encode
        return ""


def _numeric_ipv4(host: str) -> bool:
    """A host the C library reads as an IPv4 address (in any legacy form)."""
    try:
        socket.inet_aton(host)
    except (OSError, ValueError):
        return False
    return True


def check_host(host: str, networks: list[IPNetwork]) -> None:
    """Refuse a host that is an address not allowed, or an address in a legacy
    numeric spelling (host as :func:`url_host` gives it; a name is left to
    the resolver, and every address to the connector's check as well)."""
    address = literal_ip(host)
    if address is None and _numeric_ipv4(host):
        raise RefusedAddress(f"{host} is an address not written as a dotted quad")
    if address is not None and not allowed(address, networks):
        raise RefusedAddress(f"{address} is not public (see --subscriber-allow)")


def guarded_socket_factory(networks: list[IPNetwork]) -> SocketFactoryType:
    """aiohttp's socket factory that refuses every address not allowed: it is
    handed the address the socket is about to connect to."""

    def make(addr_info: AddrInfoType) -> socket.socket:
        family, kind, proto, _, sockaddr = addr_info
        host = str(sockaddr[0])
        address = literal_ip(host)
        if address is None or not allowed(address, networks):
            raise RefusedAddress(f"{host} is not public (see --subscriber-allow)")
        return socket.socket(family=family, type=kind, proto=proto)

    return make


def guarded_connector(networks: list[IPNetwork], limit: int = 100) -> aiohttp.TCPConnector:
    """A connector that connects only to addresses the guard checked."""
    return aiohttp.TCPConnector(
        resolver=GuardedResolver(networks),
        socket_factory=guarded_socket_factory(networks),
        use_dns_cache=False,
        limit=limit,
    )


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
