"""Exact gradient reduction over logical workers: the same bits however they are grouped.

Float addition is not associative, so a float all-reduce over a different number of
processes (or two logical workers summed locally first) changes the result. This module
fixes the order instead: the sum is, element by element, the float32 left fold over the
logical workers in id order, ``((g_0 + g_1) + g_2) + ... + g_(N-1)``, then times ``scale``.
Each addition is one correctly rounded float32 operation on the same two operands wherever
it runs, so the bits depend on neither the processes nor the backend:

1. One small all-reduce MAX tells every process which one hosts each logical worker.
2. Sharded over the processes, a chunk at a time: each process sends its logical workers'
   float32 gradients, shard by shard and in id order, to the shard's owner (one
   all-to-all); the owner folds every logical worker's values of its shard in id order and
   scales them; one all-gather gives everyone every shard. ``(k + 1) (P - 1) / P`` float32
   values an element sent by a process hosting k, against a float ring all-reduce's
   ``2 (P - 1) / P``: the same bytes when each process hosts one. The next chunk's
   all-to-all runs while this one is folded.
3. On one process (or ``local``) the same fold over the hosted gradients, nothing sent.
4. Two logical workers on two processes: a float all-reduce, whose one addition of two
   operands per element is the fold's (addition commutes; :func:`_pair_sum`).

The error against the true sum is a float32 sum's (at most ``(N - 1) 2**-24`` of the sum
of magnitudes), what a float all-reduce has. A non-finite result (a NaN or Inf gradient, or
finite ones whose sum overflows float32) is seen alike by every process, which holds the
same sum; they then find which logical workers sent one (one more MAX all-reduce) and raise
NonFiniteGradient together, before the caller writes anything.

One logical worker is its own sum: its gradient, bit for bit (on its one process, no
communication; a NaN or Inf refused all the same). Works on gloo and NCCL (both run
all-to-all and all-gather).

(An earlier version summed 64-bit fixed-point integers against a shared per-block exponent,
exact and so order-free: it needed a MAX all-reduce of the block exponents and two
conversions an element, 1.5-2x a float all-reduce's time on CPU; the fixed order gives
grouping-free bits without either.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.distributed as dist

from spotline.wire.gloo_waits import wait_work

# Elements folded and sent at a time. Chunks keep every temporary under glibc's 32 MiB mmap
# threshold, so the allocator reuses its pages instead of faulting in fresh ones for each (a
# 10M-element temporary cost more in page faults than its arithmetic), and let one chunk's
# all-to-all run while the previous one is folded.
CHUNK = 1 << 20
# Chunks whose all-gather may be outstanding at once (a few chunk buffers, reused).
IN_FLIGHT = 2


class NonFiniteGradient(FloatingPointError):
    """The gradient sum holds NaN or Inf; the step must not be applied. ``logical_workers``:
    those whose own gradient is not finite (none when finite gradients overflowed)."""

    def __init__(self, logical_workers: Sequence[int]) -> None:
        self.logical_workers = tuple(logical_workers)
        if self.logical_workers:
            what = f"from logical worker(s) {list(self.logical_workers)}"
        else:
            what = "in the sum of finite gradients (it overflowed float32)"
        super().__init__(f"non-finite gradient (NaN or Inf) {what}")


def _finite(flat: torch.Tensor) -> bool:
    """Whether every element is finite, in one pass when they are: an Inf or a NaN makes
    every partial sum that holds it non-finite (Inf + x is Inf, Inf - Inf and NaN + x are
    NaN), so a finite sum proves every element finite. A non-finite sum may also be finite
    elements that overflowed: then ``amax`` and ``amin`` decide (they propagate NaN and
    reach an Inf); no temporary of the tensor's size either way."""
    if bool(torch.isfinite(flat.sum())):
        return True
    return bool(torch.isfinite(flat.amax())) and bool(torch.isfinite(flat.amin()))


def _fold(parts: Sequence[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    """``out = (((parts[0] + parts[1]) + parts[2]) + ...) * scale``: the one order every
    grouping uses (the local and the sharded sums both call this)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)
    if scale != 1.0:
        out.mul_(scale)


def exact_sum(
    gradients: Sequence[tuple[int, torch.Tensor]],
    *,
    num_logical_workers: int,
    group: dist.ProcessGroup | None = None,
    local: bool = False,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    finite_only: bool = True,
) -> torch.Tensor:
    """The sum over all logical workers of their gradients, in logical worker order.

    ``gradients`` are this process's logical workers as ``(logical worker id, gradient)``,
    every gradient of the same shape (and the same shape on every process of ``group``);
    ``num_logical_workers`` counts them on all processes together. Without an initialized
    process group (or with ``group`` None and one process) it reduces locally. Returns a
    tensor of the gradients' shape and dtype, bitwise the same on every process and for
    every grouping of the logical workers onto processes. NonFiniteGradient on every
    process when the sum is not finite. ``out``: a flat float32 tensor of the gradients'
    size to write the sum into (a caller's buffer kept across steps; fresh pages for every
    step's result cost more than the sum). ``scale``: the float32 sum multiplied by it
    (``1 / num_logical_workers`` for the mean), a chunk at a time while it is in cache: the
    same bits as one multiplication of the whole sum. ``finite_only`` False: a NaN or Inf
    is returned, not refused (fp16, whose loss scaler skips such a step).
    """
    if not gradients:
        raise ValueError("a process must host at least one logical worker")
    shape, dtype = gradients[0][1].shape, gradients[0][1].dtype
    if any(g.shape != shape for _, g in gradients):
        raise ValueError("every logical worker's gradient must have the same shape")
    ids = [w for w, _ in gradients]
    if len(set(ids)) != len(ids) or not all(0 <= w < num_logical_workers for w in ids):
        raise ValueError(f"logical worker ids {ids} not distinct in 0..{num_logical_workers - 1}")
    distributed = not local and dist.is_available() and dist.is_initialized()
    numel = gradients[0][1].numel()
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    if num_logical_workers == 1:
        return _only_worker(gradients[0], out, scale, finite_only).to(dtype).view(shape)
    if dtype != torch.float32 and scale != 1.0:
        # Scaled after the conversion to ``dtype``, as the caller would.
        return exact_sum(
            gradients,
            num_logical_workers=num_logical_workers,
            group=group,
            local=local,
            finite_only=finite_only,
        ).mul_(scale)

    ordered = sorted(gradients, key=lambda item: item[0])
    flats = [g.detach().reshape(-1).to(torch.float32) for _, g in ordered]
    result = torch.empty(numel, dtype=torch.float32) if out is None else out
    assert result.shape == (numel,) and result.dtype == torch.float32, "out: flat float32"
    # Over processes only where there are several (a one-process group is the local fold).
    sharded = distributed and dist.get_world_size(group) > 1
    if sharded and num_logical_workers == 2 and dist.get_world_size(group) == 2:
        _pair_sum(flats, result, group, scale)
    elif sharded:
        _sharded_sum(flats, result, group, _hosts(ids, num_logical_workers, group), scale)
    else:
        assert len(flats) == num_logical_workers, "every logical worker hosted here"
        for start in range(0, numel, CHUNK):
            stop = min(start + CHUNK, numel)
            _fold([flat[start:stop] for flat in flats], result[start:stop], scale)
    if finite_only and not _finite(result):
        # Every process holds the same sum, so all of them are here: which sent a NaN or Inf.
        bad = torch.zeros(num_logical_workers, dtype=torch.int32)
        for (worker, _), flat in zip(ordered, flats, strict=True):
            bad[worker] = int(not _finite(flat))
        if sharded:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        raise NonFiniteGradient([w for w in range(num_logical_workers) if bad[w]])
    return result.to(dtype).view(shape)


def _only_worker(
    gradient: tuple[int, torch.Tensor], out: torch.Tensor | None, scale: float, finite_only: bool
) -> torch.Tensor:
    """The sum of one logical worker: its gradient, bit for bit, wherever it runs (there is
    no grouping for the sum to depend on). A NaN or Inf is refused as in the sum."""
    worker, g = gradient
    flat = g.detach().reshape(-1).to(torch.float32)
    if finite_only and not _finite(flat):
        raise NonFiniteGradient([worker])
    result = flat.clone() if out is None else out.copy_(flat)
    if scale != 1.0:
        result.mul_(scale)
    return result


def _hosts(
    ids: Sequence[int], num_logical_workers: int, group: dist.ProcessGroup | None
) -> list[int]:
    """Which process of ``group`` hosts each logical worker (one int32 MAX all-reduce)."""
    rank = dist.get_rank(group)
    hosts = torch.full((num_logical_workers,), -1, dtype=torch.int32)
    hosts[list(ids)] = rank
    dist.all_reduce(hosts, op=dist.ReduceOp.MAX, group=group)
    found = [int(h) for h in hosts]
    # One hosted twice shows as the higher rank only; _sharded_sum's count check then fails
    # on the other (a plan's bug, never a user's).
    assert all(h >= 0 for h in found), f"logical workers hosted nowhere: {found}"
    return found


def ring_bytes(payload: int, processes: int) -> int:
    """What a process sends in a ring all-reduce of ``payload`` bytes."""
    return 2 * payload * (processes - 1) // processes


def bytes_sent_per_process(numel: int, hosted: Sequence[int]) -> int:
    """What the busiest process sends for the sum of ``numel`` elements, ``hosted[i]``
    logical workers on process i (the small MAX all-reduce left out)."""
    processes = len(hosted)
    if processes == 1:
        return 0
    return 4 * (max(hosted) + 1) * numel * (processes - 1) // processes


def _pair_sum(
    flats: Sequence[torch.Tensor],
    result: torch.Tensor,
    group: dist.ProcessGroup | None,
    scale: float,
) -> None:
    """Two logical workers on two processes, one each: a plain float all-reduce.

    With two operands every reduction adds them once per element, as ``a + b`` on one
    process and ``b + a`` on the other or either sent to both, and IEEE addition commutes:
    the bits are the fold's ``g_0 + g_1`` whatever the backend's algorithm (ring, tree,
    halving-doubling). One collective instead of the host map, the all-to-all and the
    all-gather: the 2 x 2 topology's reduction at a float all-reduce's cost."""
    # Two processes hosting two workers, at least one each (exact_sum's check): one each.
    assert len(flats) == 1, f"a process of two hosts {len(flats)} of two logical workers"
    result.copy_(flats[0])
    dist.all_reduce(result, group=group)
    if scale != 1.0:
        result.mul_(scale)


def _sharded_sum(
    flats: Sequence[torch.Tensor],
    result: torch.Tensor,
    group: dist.ProcessGroup | None,
    hosts: Sequence[int],
    scale: float,
) -> None:
    """Step 2 of the module's text into ``result``, a chunk at a time.

    ``flats``: this process's logical workers' gradients in id order; ``hosts[w]``: the
    process hosting logical worker ``w``. A chunk is ``P`` shards (the last chunk's shards
    may be shorter or empty); shard j belongs to process j. One all-to-all gives each owner
    every logical worker's values of its shard, as process i's hosted workers in id order,
    one run each, process after process; it folds the runs in logical worker order into
    its part of ``result``, and one all-gather gives everyone every part."""
    processes, me = dist.get_world_size(group), dist.get_rank(group)
    hosted = [sum(1 for h in hosts if h == p) for p in range(processes)]
    assert hosted[me] == len(flats), (hosted, len(flats))
    # The received runs are process-major, id-ordered within a process: run of worker w.
    runs = sorted(range(len(hosts)), key=lambda w: (hosts[w], w))
    run_of = {w: index for index, w in enumerate(runs)}
    fold_order = [run_of[w] for w in range(len(hosts))]
    mine = len(flats)
    numel = result.numel()
    shard = max(1, CHUNK // processes)
    chunk = processes * shard

    def bounds(start: int) -> list[tuple[int, int]]:
        stop = min(start + chunk, numel)
        los = [min(start + j * shard, stop) for j in range(processes)]
        return [(lo, min(lo + shard, stop)) for lo in los]

    def scatter(start: int) -> tuple[dist.Work, torch.Tensor, list[tuple[int, int]]]:
        parts = bounds(start)
        lo, hi = parts[0][0], parts[-1][1]
        if mine == 1:
            # Its shards lie in destination order already: sent as they are.
            send = flats[0][lo:hi]
        else:
            send = torch.cat([flat[a:b] for a, b in parts for flat in flats])
        own = parts[me][1] - parts[me][0]
        recv = torch.empty(sum(hosted) * own, dtype=torch.float32)
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[k * own for k in hosted],
            input_split_sizes=[mine * (b - a) for a, b in parts],
            group=group,
            async_op=True,
        )
        assert work is not None
        return work, recv, parts

    gathers: deque[tuple[dist.Work, list[tuple[int, int]], list[torch.Tensor] | None]] = deque()

    def finish_gather() -> None:
        work, parts, padded = gathers.popleft()
        wait_work(work)
        if padded is not None:  # a ragged chunk went through equal-sized buffers
            for (a, b), buf in zip(parts, padded, strict=True):
                if b > a:
                    result[a:b].copy_(buf[: b - a])

    starts = list(range(0, numel, chunk))
    ahead = scatter(starts[0])
    for index in range(len(starts)):
        work, recv, parts = ahead
        if index + 1 < len(starts):
            ahead = scatter(starts[index + 1])
        wait_work(work)
        lo, hi = parts[me]
        own = hi - lo
        if own:
            _fold([recv[r * own : (r + 1) * own] for r in fold_order], result[lo:hi], scale)
        if all(b - a == shard for a, b in parts):
            outputs = [result[a:b] for a, b in parts]
            padded = None
        else:
            padded = [torch.empty(shard, dtype=torch.float32) for _ in parts]
            padded[me][:own].copy_(result[lo:hi])
            outputs = padded
        gather = dist.all_gather(outputs, outputs[me], group=group, async_op=True)
        assert gather is not None
        gathers.append((gather, parts, padded))
        if len(gathers) > IN_FLIGHT:
            finish_gather()
    while gathers:
        finish_gather()


def ordered_sum(gradients: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The oracle for tests: every logical worker's gradient summed in float64 in logical
    worker order (all gradients in one process)."""
    total = torch.zeros_like(gradients[0][1], dtype=torch.float64)
    for _, g in sorted(gradients, key=lambda item: item[0]):
        total += g.to(torch.float64)
    return total


class LogicalGradients:
    """The gradients of the logical workers one process hosts, kept apart until reduced.

    A process running ``k`` logical workers in turn calls :meth:`keep` after each one's
    backward passes: the parameters' gradients are copied out (one flat tensor per logical
    worker) and zeroed, so the next logical worker's gradients never touch them; no float
    addition ever mixes two logical workers. :meth:`reduce` then replaces DeepSpeed's
    data-parallel all-reduce: the exact sum over every logical worker of the job, times
    ``1 / num_logical_workers`` (the mean), written back into the parameters' gradients.
    Costs one flat gradient copy per hosted logical worker (DeepSpeed's own all-reduce
    flattens into buckets too), in buffers kept across steps; the model itself exists once.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        num_logical_workers: int,
        *,
        finite_only: bool = True,
    ) -> None:
        """``finite_only`` False: a NaN or Inf sum is kept, not refused (fp16's overflow,
        which its loss scaler handles)."""
        if num_logical_workers < 1:
            raise ValueError(f"num_logical_workers must be >= 1, got {num_logical_workers}")
        self.params = list(params)
        self.num_logical_workers = num_logical_workers
        self.finite_only = finite_only
        self.kept: list[tuple[int, torch.Tensor]] = []
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        assert all(p.dtype == self.dtype for p in self.params), "one gradient dtype"
        self._buffers: list[torch.Tensor] = []
        self._total: torch.Tensor | None = None
        # The spans kept of the last kept logical worker, and the elements reduced this step.
        self._spans: list[tuple[int, int]] = []
        self._reduced = 0
        # Each parameter's first element in the flat gradient.
        self._offsets = list(accumulate((p.numel() for p in self.params), initial=0))[:-1]

    def keep(
        self, logical_worker: int, *, zero: bool = True, span: tuple[int, int] | None = None
    ) -> None:
        """Move the current gradients out as ``logical_worker``'s and zero them.

        ``zero=False`` for a step's last logical worker, when :meth:`reduce` follows and a
        failed step is not run again on these gradients (the pipeline engine's): reduce
        replaces every gradient with a view of the sum, so nothing reads or adds to them
        again, and zeroing them would be a pass over the whole gradient for nothing.

        ``span``: only the parameters in these flat elements (whole parameters), so a part
        can be reduced while another is not final yet. Spans of one logical worker follow
        one another, in any order (a backward pass finishes the last layers first), and do
        not overlap."""
        if not 0 <= logical_worker < self.num_logical_workers:
            raise ValueError(
                f"logical worker {logical_worker} not in 0..{self.num_logical_workers - 1}"
            )
        start, stop = span if span is not None else (0, self.numel)
        if not self.kept or self.kept[-1][0] != logical_worker:
            if any(w == logical_worker for w, _ in self.kept):
                raise ValueError(f"logical worker {logical_worker} ran twice in one step")
            flat = self._buffer(len(self.kept))
            self.kept.append((logical_worker, flat))
            self._spans = []
        else:
            if any(a < stop and start < b for a, b in self._spans):
                raise ValueError(f"logical worker {logical_worker} ran twice in one step")
            flat = self.kept[-1][1]
        self._spans.append((start, stop))
        for p, offset in zip(self.params, self._offsets, strict=True):
            n = p.numel()
            if not start <= offset < stop:
                continue
            assert offset + n <= stop, f"span {span} cuts a parameter"
            if p.grad is None:
                flat[offset : offset + n].zero_()
            else:
                flat[offset : offset + n].copy_(p.grad.detach().reshape(-1))
                if zero:
                    p.grad.zero_()

    def span_params(self, span: tuple[int, int]) -> list[torch.Tensor]:
        """The parameters whose gradients lie in ``span`` (flat elements), in order."""
        start, stop = span
        return [
            p
            for p, offset in zip(self.params, self._offsets, strict=True)
            if start <= offset < stop
        ]

    def _buffer(self, index: int) -> torch.Tensor:
        """The flat gradient buffer of the ``index``-th kept logical worker of a step.

        Kept across steps (a step's kept gradients are dropped once reduced): a fresh
        tensor of a real model's size would fault in fresh pages every step.
        """
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(self.numel, dtype=self.dtype))
        return self._buffers[index]

    def reduce(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        local: bool = False,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Set every parameter's gradient to the mean over all logical workers, exactly.

        Collective over ``group`` (the data-parallel group): every process must call it with
        its own kept logical workers. Raises NonFiniteGradient (on every process) before
        anything is written when a logical worker's gradient holds NaN or Inf. ``local``:
        this process's kept logical workers only, no communication (see :func:`exact_sum`).
        ``span``: only the parameters in these flat elements, kept with the same span (the
        sum is elementwise, so the parts reduced apart give the whole's bits); the kept
        gradients are dropped once every element is reduced.
        """
        assert self.kept, "reduce() before any logical worker was kept"
        start, stop = span if span is not None else (0, self.numel)
        if self._total is None and self.dtype == torch.float32:
            self._total = torch.empty(self.numel, dtype=torch.float32)
        try:
            # One multiplication after the exact sum: the same bits on every process.
            total = exact_sum(
                [(w, flat[start:stop]) for w, flat in self.kept],
                num_logical_workers=self.num_logical_workers,
                group=group,
                local=local,
                out=None if self._total is None else self._total[start:stop],
                scale=1.0 / self.num_logical_workers,
                finite_only=self.finite_only,
            )
        except BaseException:
            self.kept = []  # the step failed: none of its gradients is reduced again
            self._reduced = 0
            raise
        self._reduced += stop - start
        if self._reduced == self.numel:
            self.kept, self._reduced = [], 0
        # The gradients become views of the sum (no copy): keep() copies them out and zeroes
        # them before the next reduce writes the buffer again.
        for p, offset in zip(self.params, self._offsets, strict=True):
            if start <= offset < stop:
                p.grad = total[offset - start : offset - start + p.numel()].view_as(p)
