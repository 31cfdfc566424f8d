"""The address guard of webhooks (feedsvc.delivery.guard), on real resolution."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from feedsvc.api import subscription_rules
from feedsvc.config import Settings
from feedsvc.config.subscriptions import subscriber_networks
from feedsvc.delivery.guard import (
    GuardedResolver,
    RefusedAddress,
    allowed,
    check_host,
    guarded_connector,
    url_host,
)
from feedsvc.delivery.senders import Senders
from feedsvc.errors import BadRequest
from feedsvc.storage.base import Subscription


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
     "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "fe80::1", "fc00::1", "::",
     "::ffff:127.0.0.1", "ff02::1", "192.0.2.1"],
)  # fmt: skip
def test_not_public_is_refused(address: str) -> None:
    assert not allowed(ipaddress.ip_address(address), [])


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_is_allowed(address: str) -> None:
    assert allowed(ipaddress.ip_address(address), [])


def test_allowed_networks_open_only_themselves() -> None:
    networks = subscriber_networks("127.0.0.0/8, 10.1.0.0/16")
    assert allowed(ipaddress.ip_address("127.0.0.1"), networks)
    assert allowed(ipaddress.ip_address("::ffff:127.0.0.1"), networks)
    assert allowed(ipaddress.ip_address("10.1.200.1"), networks)
    assert not allowed(ipaddress.ip_address("10.2.0.1"), networks)
    assert not allowed(ipaddress.ip_address("::1"), networks)


def test_literal_hosts_are_checked() -> None:
    with pytest.raises(RefusedAddress):
        check_host("[::1]", [])
    with pytest.raises(RefusedAddress):
        check_host("169.254.169.254", [])
    check_host("8.8.8.8", [])
    check_host("example.com", [])  # a name is the resolver's to judge


async def test_resolver_keeps_only_allowed_addresses() -> None:
    refusing = GuardedResolver([])
    try:
        with pytest.raises(RefusedAddress, match="not public"):
            await refusing.resolve("localhost", 80)
    finally:
        await refusing.close()
    allowing = GuardedResolver(subscriber_networks("127.0.0.0/8"))
    try:
        found = await allowing.resolve("localhost", 80)
    finally:
        await allowing.close()
    assert found
    assert {r["host"] for r in found} == {"127.0.0.1"}


# -- the host that is checked is the host that is connected to -----------------

# Spellings of 127.0.0.1 that urllib reads as a name but the HTTP client
# (yarl's IDNA and NFKC normalisation, then the C library's inet_aton) reads
# as the loopback address.
# (circled digits, fullwidth digits, ideographic full stops)
UNICODE_SPELLINGS = [
    "①②⑦.0.0.1",
    "\uff11\uff12\uff17.\uff10.\uff10.\uff11",
    "127\u30020\u30020\u30021",
]
NUMERIC_SPELLINGS = ["2130706433", "017700000001", "0x7f000001", "127.1", "0x7f.1", "0",
                     "0177.0.0.1", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]"]  # fmt: skip
SPELLINGS = UNICODE_SPELLINGS + NUMERIC_SPELLINGS
# names: accepted at creation, refused once resolved
NAMES = ["localhost", "127.0.0.1.", "LOCALHOST."]


@dataclass
class Listener:
    """A webhook receiver on 127.0.0.1: what it got."""

    port: int = 0
    got: list[bytes] = field(default_factory=list)


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    found = Listener()
    app = web.Application()

    async def hook(request: web.Request) -> web.Response:
        found.got.append(await request.read())
        return web.Response()

    app.router.add_post("/hook", hook)
    async with TestServer(app, host="127.0.0.1") as server:
        assert server.port is not None
        found.port = server.port
        yield found


def subscription(url: str) -> Subscription:
    return Subscription("s", "q", url, 3600, 0, 3600_000, {}, True)


@pytest.mark.parametrize("host", SPELLINGS)
def test_every_spelling_of_loopback_is_refused_at_creation(host: str) -> None:
    with pytest.raises(BadRequest, match=r"not public|dotted"):
        subscription_rules.subscriber(f"http://{host}:8080/hook", Settings())


@pytest.mark.parametrize("host", SPELLINGS)
async def test_every_spelling_of_loopback_is_refused_when_delivering(
    host: str, listener: Listener
) -> None:
    """Past creation (a subscription stored before this check, or written
    straight to Redis), delivery refuses it too, for good."""
    senders = Senders(Settings())
    try:
        url = f"http://{host}:{listener.port}/hook"
        outcome = await senders.send(subscription(url), b"{}", "m1")
    finally:
        await senders.close()
    assert listener.got == []
    assert not outcome.ok
    assert outcome.final, outcome.error
    assert outcome.error is not None
    assert "RefusedAddress" in outcome.error


@pytest.mark.parametrize("host", NAMES)
async def test_a_name_of_loopback_never_reaches_it(host: str, listener: Listener) -> None:
    """Refused by the guard once resolved, or not resolved at all: never sent."""
    senders = Senders(Settings())
    try:
        url = f"http://{host}:{listener.port}/hook"
        outcome = await senders.send(subscription(url), b"{}", "m1")
    finally:
        await senders.close()
    assert listener.got == []
    assert not outcome.ok


@pytest.mark.parametrize("host", UNICODE_SPELLINGS)
async def test_an_allowed_address_is_reached_however_it_is_spelled(
    host: str, listener: Listener
) -> None:
    senders = Senders(Settings(subscriber_allow="127.0.0.1/32"))
    try:
        url = f"http://{host}:{listener.port}/hook"
        outcome = await senders.send(subscription(url), b"{}", "m1")
    finally:
        await senders.close()
    assert outcome.ok, outcome.error
    assert listener.got == [b"{}"]


async def test_the_connector_connects_only_to_checked_addresses(listener: Listener) -> None:
    """The last line: whatever a URL's host and whichever way the client
    resolves it, the socket is connected only to an address the guard let
    through (here a literal loopback, which skips the resolver)."""
    for allow, reached in ((None, False), ("127.0.0.0/8", True)):
        connector = guarded_connector(subscriber_networks(allow))
        async with aiohttp.ClientSession(connector=connector) as session:
            url = f"http://127.0.0.1:{listener.port}/hook"
            if reached:
                async with session.post(url, data=b"ok") as response:
                    assert response.status == 200
            else:
                with pytest.raises(aiohttp.ClientConnectorError) as refused:
                    await session.post(url, data=b"no")
                assert isinstance(refused.value.os_error, RefusedAddress)
    assert listener.got == [b"ok"]


@pytest.mark.parametrize(
    ("url", "host"),
    [(f"http://{s}:1/x", "127.0.0.1") for s in UNICODE_SPELLINGS]
    + [("http://Example.COM/x", "example.com"), ("http://[::FFFF:127.0.0.1]/", "::ffff:7f00:1")],
)
def test_the_host_is_read_as_the_http_client_reads_it(url: str, host: str) -> None:
    assert url_host(url) == host
