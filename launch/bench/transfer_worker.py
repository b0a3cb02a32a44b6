"""One rank of ``spotline bench cluster``'s state-transfer measurement (never imported by the
command: started with ``python -m`` inside a namespace machine, one rank per machine).

    python -m spotline.launch.bench.transfer_worker --rank R --iface IF --master ADDR
        --port P --peer ADDR1 --tcp-port Q --bytes N --repeats K [--output FILE]

Rank 0 (the sender) hosts the rendezvous store on its own address; rank 1 (the receiver)
listens for the plain TCP connection on its own. Both bind gloo to ``--iface``
(spotline.wire.net.gloo_environment, as an agent's workers do). The same ``N`` bytes (one float32
tensor) go from rank 0 to rank 1 ``K`` times each way, alternating which goes first:

- gloo: ``batch_isend_irecv`` of one ``P2POp`` pair, as a replica rebuild sends a stage
  (spotline.worker.state_transfer ``prepare_exchange``);
- tcp: ``socket.sendall`` of the tensor's memory and ``recv_into`` the receiver's tensor.

Each timed transfer starts after a barrier and ends when the sender has the receiver's
one-byte (one-element) acknowledgement, so both clocks measure the same thing: the bytes
landed in the receiver's tensor. Rank 0 writes the times (seconds) as JSON to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

from spotline.wire import net

ACK = b"k"


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the sender closed the connection mid-transfer")
        got += n


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="transfer_worker")
    parser.add_argument("--rank", type=int, required=True, choices=(0, 1))
    parser.add_argument("--iface", required=True)
    parser.add_argument("--master", required=True, help="rank 0's address (the store)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--peer", required=True, help="rank 1's address (the TCP listener)")
    parser.add_argument("--tcp-port", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--output")
    return parser.parse_args(argv)


def _connect(args: argparse.Namespace, ip: str) -> socket.socket:
    """The gloo group (rendezvous at rank 0's store) and the plain TCP connection."""
    import torch.distributed as dist

    listener: socket.socket | None = None
    if args.rank == 1:
        # Listening before the rendezvous: once both ranks are in the group, rank 0 connects.
        listener = socket.create_server((ip, args.tcp_port))
    store = dist.TCPStore(
        args.master,
        args.port,
        world_size=2,
        is_master=args.rank == 0,
        timeout=timedelta(seconds=120),
        wait_for_workers=False,
    )
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=2)
    if listener is not None:
        sock, _ = listener.accept()
        listener.close()
    else:
        sock = socket.create_connection((args.peer, args.tcp_port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


class Transfers:
    """One rank's side of both paths over the same tensor ``buf``."""

    def __init__(self, rank: int, sock: socket.socket, buf: Any) -> None:
        import torch

        self.rank, self.sock, self.buf = rank, sock, buf
        self.view = memoryview(buf.numpy()).cast("B")
        self.ack = torch.zeros(1)

    def gloo(self) -> float:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        if self.rank == 0:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, self.buf, 1)]):
                work.wait()
            dist.recv(self.ack, src=1)
        else:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, self.buf, 0)]):
                work.wait()
            dist.send(self.ack, dst=0)
        return time.perf_counter() - t0

    def tcp(self) -> float:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        if self.rank == 0:
            self.sock.sendall(self.view)
            if self.sock.recv(1) != ACK:
                raise ConnectionError("no acknowledgement from the receiver")
        else:
            _recv_exactly(self.sock, self.view)
            self.sock.sendall(ACK)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    binding = net.resolve(iface=args.iface)
    os.environ.update(net.gloo_environment(binding.ifname))

    import torch
    import torch.distributed as dist

    sock = _connect(args, binding.ip)
    numel = args.bytes // 4
    expected = (torch.arange(numel, dtype=torch.int64) % 251).to(torch.float32)
    paths = Transfers(args.rank, sock, expected.clone() if args.rank == 0 else torch.empty(numel))
    for name in ("gloo", "tcp"):  # warm-up (connections, page faults), checked
        if args.rank == 1:
            paths.buf.zero_()
        getattr(paths, name)()
        if args.rank == 1 and not torch.equal(paths.buf, expected):
            print(f"transfer_worker: {name} delivered wrong bytes", file=sys.stderr)
            return 1
    times: dict[str, list[float]] = {"gloo": [], "tcp": []}
    for i in range(args.repeats):
        for name in ("gloo", "tcp") if i % 2 == 0 else ("tcp", "gloo"):
            times[name].append(getattr(paths, name)())
    sock.close()
    dist.destroy_process_group()
    if args.rank == 0 and args.output:
        result: dict[str, Any] = {"bytes": numel * 4, "repeats": args.repeats, **times}
        with open(args.output, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
