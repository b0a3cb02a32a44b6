"""spotline.wire.net: an agent's --address/--iface resolved against this machine's interfaces."""

from __future__ import annotations

import pytest

from spotline.errors import UserError
from spotline.wire.net import Binding, gloo_environment, interfaces, resolve


def test_loopback_resolves_both_ways() -> None:
    assert "lo" in interfaces()
    assert resolve(iface="lo") == Binding("127.0.0.1", "lo")
    assert resolve(address="127.0.0.1") == Binding("127.0.0.1", "lo")
    assert resolve(address="127.0.0.1", iface="lo") == Binding("127.0.0.1", "lo")


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"iface": "nosuchif0"}, ["nosuchif0", "choose one of", "lo"]),
        ({"iface": "x" * 16}, ["1-15 characters"]),
        # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of a real machine.
        (
            {"address": "192.0.2.7"},
            ["192.0.2.7", "not an address of this machine", "127.0.0.1 (lo)"],
        ),
        ({"address": "10.1.2"}, ["not an IPv4 address"]),
        ({"address": "192.0.2.7", "iface": "lo"}, ["not on --iface lo", "127.0.0.1"]),
        ({}, ["--address IP or --iface IFNAME"]),
    ],
)
def test_mistakes_are_one_line_user_errors(kwargs: dict[str, str], names: list[str]) -> None:
    with pytest.raises(UserError) as info:
        resolve(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, (name, message)


def test_gloo_environment_names_the_interface_for_gloo_and_exactly_for_nccl() -> None:
    assert gloo_environment("eth0") == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}
    with pytest.raises(UserError):
        gloo_environment("eth0,eth1")
