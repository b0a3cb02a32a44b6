"""Which address and interface a machine's processes use (issue 12, "Addresses").

An agent is told ``--address IP`` or ``--iface IFNAME``; :func:`resolve` turns either into
both, checked against this machine's interfaces, and :func:`gloo_environment` gives the
environment that makes the collective backends bind to that interface instead of guessing
(gloo's guess is the address the host name resolves to, which on a spot machine or in a
network namespace is often not the one its peers can reach).

Pure: standard library only (no torch), Linux (the SIOCGIFADDR ioctl; no subprocess).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from spotline.errors import UserError

# <linux/sockios.h>: get an interface's (primary) IPv4 address.
_SIOCGIFADDR = 0x8915
# struct ifreq: a 16-byte name, then a 24-byte union (here a struct sockaddr_in, whose
# address is at bytes 4..8 of it).
_IFREQ_SIZE = 40


@dataclass(frozen=True)
class Binding:
    """An IPv4 address of this machine and the interface that holds it."""

    ip: str
    ifname: str


def interface_ipv4(ifname: str) -> str | None:
    """The interface's primary IPv4 address; None if it has none. UserError if no such
    interface. (Secondary addresses, ``ip addr add`` beyond the first, are not seen.)"""
    if not ifname or len(ifname) >= 16 or "/" in ifname:
        raise UserError(f"no network interface {ifname!r} (names are 1-15 characters)")
    request = struct.pack("16s24s", ifname.encode(), b"")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return None
            if e.errno == errno.ENODEV:
                raise UserError(
                    f"no network interface {ifname!r} on this machine; "
                    f"choose one of {', '.join(interfaces())}"
                ) from None
            raise
    assert len(reply) == _IFREQ_SIZE, len(reply)
    return socket.inet_ntoa(reply[20:24])


def interfaces() -> list[str]:
    """This machine's (this network namespace's) interface names, in index order."""
    return [name for _, name in socket.if_nameindex()]


def _addresses() -> dict[str, str]:
    """Interface -> primary IPv4 address, for the interfaces that have one."""
    found: dict[str, str] = {}
    for name in interfaces():
        try:
            ip = interface_ipv4(name)
        except UserError:
            # The interface went away between listing and asking.
            continue
        if ip is not None:
            found[name] = ip
    return found


def resolve(*, address: str | None = None, iface: str | None = None) -> Binding:
    """An agent's ``--address``/``--iface`` (one or both) as (ip, ifname) of this machine."""
    if address is None and iface is None:
        raise UserError("give the machine's --address IP or --iface IFNAME")
    if address is not None:
        try:
            parsed = ipaddress.IPv4Address(address)
        except ValueError:
            raise UserError(f"--address {address!r} is not an IPv4 address") from None
        address = str(parsed)
    if iface is not None:
        ip = interface_ipv4(iface)
        if ip is None:
            raise UserError(
                f"network interface {iface!r} has no IPv4 address; give one that has "
                f"(`ip -4 addr` lists them) or pass --address"
            )
        if address is not None and address != ip:
            raise UserError(
                f"--address {address} is not on --iface {iface} (its address is {ip}); "
                f"give one of them or a matching pair"
            )
        return Binding(ip, iface)
    assert address is not None
    held = _addresses()
    for name, ip in held.items():
        if ip == address:
            return Binding(ip, name)
    listed = ", ".join(f"{ip} ({name})" for name, ip in held.items()) or "none"
    raise UserError(
        f"--address {address} is not an address of this machine; its addresses: {listed}"
    )


def gloo_environment(ifname: str) -> dict[str, str]:
    """The environment that makes torch.distributed's backends bind to ``ifname``.

    GLOO_SOCKET_IFNAME: gloo (the CPU path) creates its device on that interface's address.
    NCCL_SOCKET_IFNAME: NCCL's bootstrap and socket transport (the GPU path); NCCL reads the
    value as a list of name prefixes ("eth0" would also match "eth01"), "=" makes it exact.
    TP_SOCKET_IFNAME (TensorPipe) is left out: it serves torch.distributed.rpc only, which
    Spotline does not use.
    """
    if not ifname or "," in ifname:
        raise UserError(f"network interface name {ifname!r}: give exactly one interface")
    return {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": f"={ifname}"}
