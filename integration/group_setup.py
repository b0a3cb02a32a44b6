"""A generation's process groups, every pair connected while all members are known alive.

Why: gloo does not connect a group's pairs when the group is created. The side of a pair that
waits for its peer to connect has no socket until the peer does, and it waits at the pair's
first use, for that operation's timeout (the collectives', ``recovery.collective_timeout_s``,
a minute by default). A machine cut off (no FIN, no RST) between a group's creation and that
first use leaves that side waiting with nothing the watchdog can shut
(``spotline.elastic.abort_connections``) and no store wait to end
(``spotline.stores.AbortableStore``): the coordinator kills the process as unresponsive,
with the stages it holds in memory.

So groups are created under a short timeout (a live member connects in milliseconds once
every address is written; gloo's creation of a group waits up to five times its timeout for
a pair), and each group's pairs are all used once (an all-to-all of one element a member)
right after the group is created, when every member has just written its address and is
alive; the group then runs its collectives under the collectives' timeout. From then on every peer a member may block on has a socket,
which the watchdog shuts when the generation is aborted. A machine lost while a group is
created or warmed costs its peers at most the short timeout, and the generation fails and is
planned again without it.

The default group is created here; DeepSpeed creates the pipeline and data-parallel groups
with ``torch.distributed.new_group`` (looked up at call time, a pinned seam: see
``spotline.patches.deepspeed_seams``), which is wrapped for the generation's set-up only (one
thread sets groups up, in the same order on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def connect_all_pairs(group: dist.ProcessGroup) -> None:
    """Use every pair of ``group`` once (gloo's all-to-all sends to each member in turn)."""
    size = dist.get_world_size(group)
    if size > 1:
        dist.all_to_all_single(torch.zeros(size), torch.zeros(size), group=group)


def _connected(group: dist.ProcessGroup, connect: timedelta, collective: timedelta) -> None:
    # Under the short timeout: every member is in this call or about to be.
    c10d._set_pg_timeout(connect, group)
    connect_all_pairs(group)
    c10d._set_pg_timeout(collective, group)


def init_generation_group(
    store: dist.Store, rank: int, world_size: int, *, connect: timedelta, collective: timedelta
) -> None:
    """The default gloo group over ``store``, every pair connected, collectives under
    ``collective``; a member lost meanwhile raises within about ``connect``."""
    assert connect <= collective, (connect, collective)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=connect)
    _connected(dist.group.WORLD, connect, collective)  # type: ignore[arg-type]


@contextlib.contextmanager
def connected_new_groups(connect: timedelta, collective: timedelta) -> Iterator[None]:
    """Inside the block, each group ``torch.distributed.new_group`` creates (DeepSpeed's and
    Spotline's alike) is connected on creation and then runs under ``collective``."""
    assert connect <= collective, (connect, collective)
    original: Callable[..., Any] = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        assert len(args) <= 1, "timeout and later arguments by name"  # DeepSpeed passes ranks only
        kwargs["timeout"] = connect
        group = original(*args, **kwargs)
        # Every rank calls new_group for every group; only members get a group to warm.
        if isinstance(group, dist.ProcessGroup) and not c10d._rank_not_in_group(group):
            _connected(group, connect, collective)
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
