"""A generation's process groups, every pair connected while all members are known alive.

Why: gloo does not connect a group's pairs when the group is created. The side of a pair that
waits for its peer to connect has no socket until the peer does, and it waits at the pair's
first use, for that operation's timeout (the collectives', ``recovery.collective_timeout_s``,
a minute by default). A machine cut off (no FIN, no RST) between a group's creation and that
first use leaves that side waiting with nothing the watchdog can shut
(``spotline.worker.liveness.abort_connections``) and no store wait to end
(``spotline.wire.stores.AbortableStore``): the coordinator kills the process as unresponsive,
with the stages it holds in memory.

So every group is set up within a bound (:func:`setup_bound`: ten seconds, or the collectives'
timeout if shorter): it is created under a fifth of it (gloo waits up to five times a group's
timeout for a pair to connect while creating it: measured on torch 2.13, 2 s gave 10 s and
3 s gave 15 s), then each of its pairs is used once (an all-to-all of one element a member,
under the bound) right after, while every member has just written its address and is alive;
the group then runs its collectives under the collectives' timeout. A live member connects
in milliseconds: the bound only leaves room for a loaded machine's scheduling. From then on
every peer a member may block on has a socket, which the watchdog shuts when the generation
is aborted; a machine lost while a group is set up costs its peers at most the bound, well
inside the collectives' timeout after which the coordinator takes them for hung, and the
generation fails and is planned again without it.

Point-to-point operations need one more step. gloo waits for a send or a receive under the
timeout its context was created with, the short creation timeout above (2 s), and
``_set_pg_timeout`` does not reach it: a pipeline stage whose peer was 2 s late (a loaded
host, a long micro-batch, a job paused and resumed) failed its generation. So every wait on
a send or a receive of a generation is given the collectives' timeout (:func:`wait_p2p`),
DeepSpeed's pipeline transfers included (:func:`bind_p2p_waits`); a collective runs under
the timeout ``_set_pg_timeout`` set, as it should.

A generation's waits on gloo (its sends and receives, and its blocking collectives) also
end as soon as it is aborted (``aborted``, the event given to :func:`init_generation_group`):
shutting the sockets does not end a transfer that has begun (see
:mod:`spotline.wire.gloo_waits`).

The default group is created here; DeepSpeed creates the pipeline and data-parallel groups
with ``torch.distributed.new_group`` (looked up at call time, a pinned seam: see
``spotline.patches.deepspeed_seams``), which is wrapped for the generation's set-up only (one
thread sets groups up, in the same order on every rank).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from spotline.wire.gloo_waits import bind_collective_waits, wait_work, watch_abort

SETUP_BOUND = timedelta(seconds=10)
"""The most a group's set-up may take, where the collectives' timeout is longer."""
# gloo's creation of a group waits up to this many times the group's timeout for a pair.
GLOO_CONNECT_WAITS = 5


_p2p_timeout: timedelta | None = None
"""The running generation's collectives' timeout (set by :func:`init_generation_group`);
None: no generation group, the default group's own timeouts apply."""


def wait_p2p(work: dist.Work) -> None:
    """Wait for a send or a receive under the generation's collectives' timeout (not the
    gloo context's creation timeout, which a bare ``work.wait()`` would use), and no longer
    than the generation lasts (:func:`spotline.wire.gloo_waits.wait_work`)."""
    if _p2p_timeout is None:
        work.wait()
    else:
        wait_work(work, _p2p_timeout)


_blocking_p2p: tuple[Callable[..., Any], Callable[..., Any]] | None = None
"""torch's own ``send`` and ``recv``, once :func:`bind_p2p_waits` replaced them."""


def _send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    work = dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    if work is not None:  # None: this rank is not in ``group``
        wait_p2p(work)


def _recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    assert _blocking_p2p is not None
    if src is None:
        # From any source (no caller of Spotline's does): torch's own, which finds the
        # sender's rank.
        return int(_blocking_p2p[1](tensor, src, group, tag, group_src))
    work = dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    if work is None:
        return -1  # torch's answer for a rank not in ``group``
    wait_p2p(work)
    return src


def bind_p2p_waits() -> None:
    """Make ``torch.distributed.send``/``recv`` wait through :func:`wait_p2p`: DeepSpeed's
    pipeline sends its activations and gradients with them (``deepspeed.runtime.pipe.p2p``,
    through ``deepspeed.comm``, which looks them up at call time; pinned in
    ``spotline.patches.deepspeed_seams``), and they wait without a timeout. In a worker
    process only, from its first generation on."""
    global _blocking_p2p
    if _blocking_p2p is None:
        _blocking_p2p = (dist.send, dist.recv)
        dist.send = _send
        dist.recv = _recv


def setup_bound(collective: timedelta) -> timedelta:
    """How long setting a group up may take: :data:`SETUP_BOUND`, or ``collective`` if
    shorter."""
    return min(SETUP_BOUND, collective)


def connect_all_pairs(group: dist.ProcessGroup) -> None:
    """Use every pair of ``group`` once (gloo's all-to-all sends to each member in turn)."""
    size = dist.get_world_size(group)
    if size > 1:
        dist.all_to_all_single(torch.zeros(size), torch.zeros(size), group=group)


def _connected(group: dist.ProcessGroup, collective: timedelta) -> None:
    # Under the set-up bound: every member is in this call or about to be.
    c10d._set_pg_timeout(setup_bound(collective), group)
    connect_all_pairs(group)
    c10d._set_pg_timeout(collective, group)


def init_generation_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    *,
    collective: timedelta,
    aborted: threading.Event | None = None,
) -> None:
    """The default gloo group over ``store``, every pair connected, collectives under
    ``collective``; a member lost meanwhile raises within about :func:`setup_bound`. Its
    sends and receives are waited for under ``collective`` too, and every wait on gloo
    ends once ``aborted`` is set (the generation's abort; None: as gloo ends it)."""
    assert not dist.is_initialized(), "the previous generation's groups are destroyed first"
    # Members find each other's addresses under their group's name, which torch numbers from
    # a count ("0" the default group, then "1", ...) that only destroy_process_group resets.
    # A generation lost inside init_process_group (a peer gone while it connected) has
    # advanced the count with no group to destroy: every member starts again from 0, or the
    # members that failed there and those that failed later would rendezvous under names
    # that never meet.
    c10d._world.group_count = 0
    global _p2p_timeout
    _p2p_timeout = collective
    watch_abort(aborted)
    bind_p2p_waits()
    bind_collective_waits()
    create = setup_bound(collective) / GLOO_CONNECT_WAITS
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=create)
    _connected(dist.group.WORLD, collective)  # type: ignore[arg-type]


@contextlib.contextmanager
def connected_new_groups(collective: timedelta) -> Iterator[None]:
    """Inside the block, each group ``torch.distributed.new_group`` creates (DeepSpeed's and
    Spotline's alike) is connected on creation and then runs under ``collective``."""
    original: Callable[..., Any] = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        assert len(args) <= 1, "timeout and later arguments by name"  # DeepSpeed passes ranks only
        kwargs["timeout"] = setup_bound(collective) / GLOO_CONNECT_WAITS
        group = original(*args, **kwargs)
        # Every rank calls new_group for every group; only members get a group to warm.
        if isinstance(group, dist.ProcessGroup) and not c10d._rank_not_in_group(group):
            _connected(group, collective)
        return group

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout ``group``'s gloo backend runs its operations under."""
    backend = group._get_backend(torch.device("cpu"))
    timeout: timedelta = backend.options._timeout
    return timeout
