"""A generation's gloo groups have every pair connected at creation (spotline.pipeline.group_setup).

gloo connects a pair at its first use; the side waiting for its peer to connect has no
socket until then. A member lost between the group's creation and that use left its peers
waiting for the collectives' timeout with nothing to abort. Real gloo groups over a real
TCPStore in real processes; a member stopped (SIGSTOP) right after writing its address
stands for a machine cut off at that moment.

And a generation's waits on gloo end at its abort (spotline.wire.gloo_waits): gloo does not
fail a transfer that has begun when its sockets are shut. A member stopped with a transfer
half done stands for a machine cut off then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist
from conftest import REPO, child_env

MEMBER = REPO / "tests" / "workers" / "group_member.py"
ABORTED_MEMBER = REPO / "tests" / "workers" / "aborted_wait_member.py"
# A hang detector only: a set-up that does not end in this long waits for the collectives'
# 900 s timeout (tests/workers/group_member.py).
BOUND_S = 120


def _members(world: int, frozen: int) -> list[str]:
    """Each live member's one line; the frozen member is killed; every process is reaped."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, str(MEMBER), str(server.port), str(rank), str(world), str(frozen)],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(world)
    ]
    lines: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            if rank == frozen:
                continue
            out, _ = proc.communicate(timeout=BOUND_S)
            lines.append(out.strip())
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return lines


def test_a_member_lost_after_its_address_fails_every_peer_set_up_instead_of_hanging() -> None:
    # Which side of a pair waits is gloo's choice (it compares the two addresses, ports
    # first): with four live members, at least one waits for the frozen one in 15 runs of 16.
    lines = _members(world=5, frozen=0)
    assert len(lines) == 4
    for line in lines:
        error, next_group = line.splitlines()
        assert error.startswith("error after "), lines
        # Failed inside init_process_group or after it: the next generation's groups are
        # named alike on every member (their rendezvous keys).
        assert next_group == "next generation's group: 0", lines


def test_groups_connect_under_the_short_timeout_then_run_under_the_collectives_one() -> None:
    lines = _members(world=2, frozen=-1)
    # Both groups made through spotline.pipeline.group_setup run under the collectives' timeout; one
    # created outside the block keeps torch's default (the wrapper is gone). So do sends
    # and receives, which gloo waits for under the creation timeout unless told otherwise:
    # rank 0 gets both of rank 1's late sends (1 + 2), the blocking one and the posted one.
    default = dist.distributed_c10d.default_pg_timeout.total_seconds()
    assert lines == [
        f"ok timeouts=[900.0, 900.0] outside={default} sum=2.0 late=3.0",
        f"ok timeouts=[900.0, 900.0] outside={default} sum=2.0 late=-1.0",
    ]


@pytest.mark.parametrize("kind", ["send", "recv", "broadcast"])
def test_an_aborted_generation_ends_a_transfer_cut_off_midway(kind: str) -> None:
    # gloo, when a connection closes, does not fail a send, a receive or a collective whose
    # transfer has begun: shutting the sockets left rank 0 waiting for the collectives'
    # timeout (900 s here) instead of leaving on the abort, and the stuck collective's
    # thread held the group's destruction as long (spotline.wire.gloo_waits).
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, str(ABORTED_MEMBER), str(server.port), str(rank), kind],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        try:
            out, _ = procs[0].communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0's {kind} or its teardown outlived its generation's abort")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # rank 1 is stopped: SIGKILL still ends it
            proc.wait()
    assert out.split() == ["raised", "GenerationAborted", "left"]
