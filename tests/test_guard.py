"""The address guard of webhooks (feedsvc.delivery.guard), on real resolution."""

from __future__ import annotations

import ipaddress

import pytest

from feedsvc.config import subscriber_networks
from feedsvc.delivery.guard import GuardedResolver, RefusedAddress, allowed, check_host


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
