"""How a stage's reduced gradients travel to its replica holder: the exchange's own tag,
the sends posted from a thread of their own, and which stage streams its gradients from
inside its last backward pass (``spotline.pipeline.redundancy`` runs the exchange).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def joined_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``tensors`` when they lie back to back, in order, in one storage
    (each contiguous, one dtype); None otherwise. Equal to ``torch.cat`` of their flattened
    values, without the copy: after the exact reduction every gradient is such a view of
    the sum's buffer, and a copy of a real model's whole gradient costs a pass over it."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    return first.detach().as_strided((offset - first.storage_offset(),), (1,))


# The replica exchange's own tag. Its receive is posted early, while DeepSpeed's activations
# and gradients (tag 0) still pass between the same two ranks: gloo gives a receive the first
# message of its tag from that rank, so with a shared tag it would take one of those.
REPLICA_GRAD_TAG = 1


def streams_untied(stage: int, num_stages: int, data_parallel: int, *, sharded: bool) -> bool:
    """Whether ``stage`` sends its untied gradients to its replica holder during its last
    backward pass, layer by layer (``StreamUntiedGrads``; owner and holder both ask).

    Stage 0 only: its last backward pass is the step's last computation, so the work done
    inside it delays nothing but the step's end, while a later stage's would delay the
    SendGrad its predecessor waits for. Whole replicas only (a sharded holder takes its
    pieces in one message), and one pipeline only: the exact reduction then runs locally
    and can run inside the backward pass; over pipelines it is a collective."""
    return stage == 0 and num_stages > 1 and data_parallel == 1 and not sharded


class ReplicaSender:
    """Posts sends from a thread of its own, in the order given.

    gloo writes a message into its socket in the posting thread for as long as the socket
    takes it (a few MB), and only the rest from its own loop thread. Posted from the thread
    that runs stage 0's last backward pass, that write is paid by the pass; posted from
    here, it runs on another core (on a pipeline's first stage, the others wait for this
    pass) while the pass goes on. The one thread keeps the order the holder's receives were
    posted in. A daemon thread: a send that never completes must not hold the process."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[dist.Work], torch.Tensor, int] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="spotline-replica-send", daemon=True)
        self._thread.start()

    def post(self, tensor: torch.Tensor, dst: int) -> Future[dist.Work]:
        """The send of ``tensor`` to global rank ``dst`` on the replica exchange's tag."""
        posted: Future[dist.Work] = Future()
        self._queue.put((posted, tensor, dst))
        return posted

    def close(self) -> None:
        """Stop the thread once it has posted what it was given; joined, so that it is gone
        before the interpreter ends (a daemon thread still running at its end aborts it)."""
        self._queue.put(None)
        # The engine may be collected by a garbage collection that runs on this thread.
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            posted, tensor, dst = item
            try:
                work = dist.isend(tensor, dst, tag=REPLICA_GRAD_TAG)
                assert work is not None  # the world group: every rank is in it
                posted.set_result(work)
            except BaseException as exc:  # noqa: BLE001  # raised where the send is waited for
                posted.set_exception(exc)


@dataclass
class GradStream:
    """One armed ``StreamUntiedGrads``: which layers' gradients are final so far."""

    logical_worker: int
    remaining: list[int]  # parameters of each streamed layer still to be made final
    final: set[int] = field(default_factory=set)  # ids of the parameters made final
    sent: int = 0  # streamed layers sent, in order
    error: Exception | None = None
