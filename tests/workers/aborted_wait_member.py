"""One of two members of a gloo generation (spotline.pipeline.group_setup) whose transfer is
cut off midway (tests/test_group_setup.py).

argv: STORE_PORT RANK KIND. Rank 0 sends a tensor larger than the sockets' buffers to rank 1
(``send``), receives one from it (``recv``), or broadcasts one to it (``broadcast``), through
torch's blocking send, recv or broadcast as DeepSpeed's pipeline and Spotline's engine call
them; rank 1 posts its half and stops itself (SIGSTOP) with the transfer begun, as a machine
cut off then would. Once rank 0 waits, its generation is aborted as a worker's liveness
aborts one (the generation's event set, every connection shut: spotline.worker.liveness).
Rank 0 prints how its wait ended, then destroys its groups as a worker leaving the
generation does and prints ``left``.
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

from spotline.pipeline.group_setup import init_generation_group
from spotline.wire.gloo_waits import hold_groups_past_abort, wait_work
from spotline.worker.liveness import abort_connections

# Far beyond the test's bound: a wait (or a teardown) that outlives the abort hangs the test.
COLLECTIVE = timedelta(seconds=900)
# 64 MB of float32: a few MB fit in the sockets' buffers, the rest waits for the peer.
NUMEL = 16 * 1024 * 1024
# For rank 1's posting, then its stop, to have happened (an ordering, not a measurement).
SETTLE_S = 1.0


def client(port: int) -> dist.TCPStore:
    """A client of the test's store (one a thread)."""
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=COLLECTIVE)


def stop_midway(store: dist.TCPStore, kind: str) -> None:
    """Rank 1: post this side of the transfer, then stop with it begun."""
    if kind == "recv":
        store.wait(["rank0-waiting"])  # rank 0's receive is posted ...
        time.sleep(SETTLE_S)  # ... and its "ready to receive" read by this side's gloo
        store.set("rank1", "sending")
        # Written in this thread for as long as the socket takes it, then by gloo's own.
        work = dist.isend(torch.ones(NUMEL), 0)
    else:
        # Its "ready to receive" leaves here, or from gloo's thread that runs the broadcast.
        if kind == "send":
            work = dist.irecv(torch.zeros(NUMEL), 0)
        else:
            work = dist.broadcast(torch.zeros(NUMEL), 0, async_op=True)
            time.sleep(SETTLE_S)
        store.set("rank1", "posted")
    os.kill(os.getpid(), signal.SIGSTOP)
    assert work is not None  # the test kills this process before it gets here


def waits_on_gloo(thread: int) -> bool:
    """Whether ``thread`` is inside :func:`wait_work`."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code is wait_work.__code__:
            return True
        frame = frame.f_back
    return False


def abort_once_waiting(port: int, main: int, aborted: threading.Event) -> None:
    """Rank 0's liveness, as it acts on an abort, once the main thread waits in the
    transfer and rank 1 has stopped."""
    store = client(port)
    while not waits_on_gloo(main):
        time.sleep(0.01)
    store.set("rank0-waiting", "1")
    store.wait(["rank1"])
    time.sleep(SETTLE_S)
    aborted.set()
    abort_connections(port)


def main() -> None:
    port, rank, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = client(port)
    aborted = threading.Event()
    group_store = dist.PrefixStore("pg", store)
    init_generation_group(group_store, rank, 2, collective=COLLECTIVE, aborted=aborted)
    if rank == 1:
        stop_midway(store, kind)
        return
    args = (port, threading.get_ident(), aborted)
    threading.Thread(target=abort_once_waiting, args=args, daemon=True).start()
    try:
        if kind == "recv":
            dist.recv(torch.zeros(NUMEL), 1)
        else:
            store.wait(["rank1"])
            if kind == "send":
                dist.send(torch.ones(NUMEL), 1)
            else:
                dist.broadcast(torch.ones(NUMEL), 0)
        outcome = "returned"
    except RuntimeError as exc:
        outcome = f"raised {type(exc).__name__}"
    print(outcome, flush=True)
    # As spotline.worker.generation.leave_process_group does.
    hold_groups_past_abort()
    dist.destroy_process_group()
    print("left", flush=True)
    # Not the interpreter's teardown: an abandoned wait's thread is still in gloo.
    os._exit(0)


if __name__ == "__main__":
    main()
