"""One member of a gloo generation set up by spotline.pipeline.group_setup (tests/test_group_setup.py).

argv: STORE_PORT RANK WORLD FROZEN_RANK. The store is the test's TCPStore. The member whose
rank is FROZEN_RANK stops itself (SIGSTOP) right after writing its rendezvous address, as a
machine cut off at that moment would: alive to the others' rendezvous, never connecting.
Each live member prints one line: its groups' timeouts, an all-reduce's sum and what rank 0
received from rank 1 sent later than the groups' 2 s creation timeout, or the error its
set-up ended with.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from spotline.pipeline.group_setup import (
    connected_new_groups,
    group_timeout,
    init_generation_group,
    wait_p2p,
)

# Far beyond the test's bound: a member waiting on an unconnected pair would hang it. A
# group's set-up is bounded at 10 s (spotline.pipeline.group_setup.SETUP_BOUND) whatever it is.
COLLECTIVE = timedelta(seconds=900)
# Past the groups' creation timeout (a fifth of the set-up bound: 2 s), well inside
# COLLECTIVE: how late rank 1 sends to rank 0, twice.
LATE_S = 2.5


def late_p2p(rank: int, pair: dist.ProcessGroup) -> float:
    """Rank 1 sends rank 0 a 1 (torch's blocking send, as DeepSpeed's pipeline does) and a 2
    (isend on ``pair``), each LATE_S late; rank 0 returns their sum (-1 elsewhere)."""
    one, two = torch.zeros(1), torch.zeros(1)
    if rank == 1:
        time.sleep(LATE_S)
        dist.send(torch.ones(1), 0)
        time.sleep(LATE_S)
        work = dist.isend(torch.full((1,), 2.0), 0, group=pair)
        assert work is not None
        wait_p2p(work)
    elif rank == 0:
        assert dist.recv(one, 1) == 1
        work = dist.irecv(two, 1, group=pair)
        assert work is not None
        wait_p2p(work)
        return float((one + two).item())
    return -1.0


class FreezeAfterFirstSet(dist.Store):
    """The test's store, except that the frozen member stops after its first write."""

    def __init__(self, inner: dist.Store, freeze: bool) -> None:
        super().__init__()
        self.inner = inner
        self.freeze = freeze

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)
        if self.freeze:
            os.kill(os.getpid(), signal.SIGSTOP)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)


def main() -> None:
    port, rank, world, frozen = (int(a) for a in sys.argv[1:5])
    inner = dist.TCPStore("127.0.0.1", port, None, False, timeout=COLLECTIVE)
    store = FreezeAfterFirstSet(inner, freeze=rank == frozen)
    t0 = time.monotonic()
    try:
        # Abortable waits (a generation's, never aborted here) wait as long as plain ones.
        init_generation_group(store, rank, world, collective=COLLECTIVE, aborted=threading.Event())
        with connected_new_groups(COLLECTIVE):
            pair = dist.new_group(ranks=[0, 1])
        outside = dist.new_group(ranks=list(range(world)))
        total = torch.ones(1)
        dist.all_reduce(total)
        timeouts = [group_timeout(dist.group.WORLD), group_timeout(pair)]  # type: ignore[arg-type]
        late = late_p2p(rank, pair)  # type: ignore[arg-type]
        print(
            f"ok timeouts={[t.total_seconds() for t in timeouts]} "
            f"outside={group_timeout(outside).total_seconds()} sum={total.item()} late={late}",
            flush=True,
        )
    except RuntimeError as exc:
        print(f"error after {time.monotonic() - t0:.1f}s: {str(exc).splitlines()[0]}", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        # The next generation, alone: its default group is "0" again whatever failed here.
        init_generation_group(dist.PrefixStore("next", inner), 0, 1, collective=COLLECTIVE)
        print(f"next generation's group: {dist.group.WORLD.group_name}", flush=True)  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
