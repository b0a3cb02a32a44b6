"""Processes of the cluster network test (tests/test_cluster_net.py), one per namespace.

``netns_worker.py store ADDR PORT``: a TCPStore server on ADDR:PORT (the rendezvous, in the
coordinator's namespace); prints ``ready`` once it listens, then waits to be killed.

``netns_worker.py rank RANK IFACE ADDR PORT [--hold]``: one rank of a world-2 gloo group
whose store is ADDR:PORT, gloo bound to IFACE through spotline.wire.net.gloo_environment. It
all-reduces ``arange(8) * (RANK + 1)`` and prints one JSON line: the sum, its own binding
and the TCP connections it holds (from /proc/net/tcp, which is per network namespace), so
the test sees which addresses gloo really used. Then it starts a second all-reduce, unless
``--hold``: then it waits on stdin and never joins it (the test cuts its link instead).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import struct
import sys
from datetime import timedelta

from spotline.wire import net

ESTABLISHED = "01"


def tcp_connections() -> list[tuple[str, int, str, int]]:
    """(local ip, local port, remote ip, remote port) of this namespace's established TCP
    connections, IPv4 and IPv6 (an IPv4-mapped IPv6 address is shown as its IPv4 address:
    torch's store sockets are dual-stack)."""

    def endpoint(field: str) -> tuple[str, int]:
        ip_hex, port_hex = field.split(":")
        # The address is printed as 32-bit words, each in host byte order.
        raw = b"".join(
            struct.pack("=I", int(ip_hex[i : i + 8], 16)) for i in range(0, len(ip_hex), 8)
        )
        ip = ipaddress.ip_address(raw)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return str(ip), int(port_hex, 16)

    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == ESTABLISHED:
                    found.append((*endpoint(fields[1]), *endpoint(fields[2])))
    return found


def serve_store(addr: str, port: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, is_master=True, wait_for_workers=False)
    print("ready", flush=True)
    signal.pause()
    del store


def run_rank(rank: int, iface: str, addr: str, port: int, hold: bool) -> None:
    binding = net.resolve(iface=iface)
    # The address resolves back to the same interface inside this namespace.
    assert net.resolve(address=binding.ip) == binding, binding
    os.environ.update(net.gloo_environment(binding.ifname))
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))

    import torch
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    tensor = torch.arange(8, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(tensor)
    report = {
        "rank": rank,
        "sum": tensor.tolist(),
        "ip": binding.ip,
        "ifname": binding.ifname,
        "master_addr": os.environ["MASTER_ADDR"],
        "connections": tcp_connections(),
    }
    print(json.dumps(report), flush=True)
    if hold:
        sys.stdin.readline()
        return
    dist.all_reduce(tensor)
    # Reached only if the peer's loss were noticed: the test asserts it is not.
    print("returned", flush=True)


def main() -> None:
    if sys.argv[1] == "store":
        serve_store(sys.argv[2], int(sys.argv[3]))
    else:
        rank, iface, addr, port = sys.argv[2:6]
        run_rank(int(rank), iface, addr, int(port), hold="--hold" in sys.argv[6:])


if __name__ == "__main__":
    main()
