"""Exact gradient reduction over logical workers: the same bits however they are grouped.

Float addition is not associative, so a float all-reduce over a different number of
processes (or two logical workers summed locally first) changes the result. This module
sums in 64-bit fixed point instead, where addition is exact and so order-free:

1. Per block of ``BLOCK`` elements, every process takes the largest magnitude over its
   logical workers' gradients and one all-reduce MAX gives the block's shared exponent
   ``e`` (``max |g| < 2**e``).
2. Each logical worker's gradient is scaled by ``2**(F - e)`` and rounded to int64, where
   ``F = 62 - ceil(log2(num_logical_workers))`` leaves room for the sum of every worker:
   the scaling is by a power of two (exact in float32), the rounding depends only on the
   worker's own value and the shared exponent, never on the grouping.
3. The integers are added, locally over the process's logical workers and then by an
   all-reduce SUM over processes: exact, so any order gives the same integers.
4. Back to floating point once: the integer sum rounded to float32, times ``2**(e - F)``
   (the same integers give the same float).

The error against the true sum is at most ``num_logical_workers * 2**(e - F - 1)`` per
element (rounding), far below float32's own resolution of the largest gradient. A
non-finite gradient (NaN or Inf) is detected before anything is scaled and reported with
the logical worker that produced it, on every process; it is never folded into the sum.

Costs: one int32 MAX all-reduce (a non-finite flag per logical worker and an exponent per
block) and one int64 all-reduce of the gradient (8 bytes an element, 2x a float32 all-reduce), whatever the number of logical
workers a process hosts. Works on gloo and NCCL (both reduce int64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

BLOCK = 4096
# Blocks whose gradients are all zero get this exponent: any value works, zero stays zero.
_ZERO_BLOCK_EXPONENT = -126


class NonFiniteGradient(FloatingPointError):
    """A logical worker's gradient holds NaN or Inf; the step must not be applied."""

    def __init__(self, logical_workers: Sequence[int]) -> None:
        self.logical_workers = tuple(logical_workers)
        super().__init__(
            f"non-finite gradient (NaN or Inf) from logical worker(s) {list(self.logical_workers)}"
        )


def fraction_bits(num_logical_workers: int) -> int:
    """Bits below the block exponent: the sum of every worker's value must fit in int64."""
    if num_logical_workers < 1:
        raise ValueError(f"num_logical_workers must be >= 1, got {num_logical_workers}")
    return 62 - math.ceil(math.log2(num_logical_workers))


def _blocks(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` as whole blocks (a view, no copy) and the ragged tail."""
    whole = flat.numel() // BLOCK * BLOCK
    return flat[:whole].view(-1, BLOCK), flat[whole:]


def _block_max(flat: torch.Tensor) -> torch.Tensor:
    head, tail = _blocks(flat.abs())
    parts = [head.amax(dim=1)] if head.numel() else []
    if tail.numel():
        parts.append(tail.amax().reshape(1))
    return torch.cat(parts)


def _exponents(block_max: torch.Tensor) -> torch.Tensor:
    """Per block the least ``e`` with ``max |g| < 2**e`` (int32)."""
    _, exponent = torch.frexp(block_max)  # max = m * 2**e, 0.5 <= m < 1: max < 2**e
    zero = block_max == 0
    return torch.where(zero, torch.full_like(exponent, _ZERO_BLOCK_EXPONENT), exponent).to(
        torch.int32
    )


def _scaled(flat: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``flat * 2**shift`` per block, in float32.

    Multiplying by a power of two only moves the exponent, so it is exact while the result
    stays in range (to fixed point every product is below 2**62). ``2**shift`` itself may
    not fit float32 (a block of tiny values), so it is applied in two halves that do."""
    low = torch.div(shift, 2, rounding_mode="floor")
    one = torch.ones(shift.shape, dtype=torch.float32)
    first, second = torch.ldexp(one, low), torch.ldexp(one, shift - low)
    head, tail = _blocks(flat)
    pieces = []
    if head.numel():
        rows = head.shape[0]
        scaled = head * first[:rows, None]
        pieces.append(scaled.mul_(second[:rows, None]).reshape(-1))
    if tail.numel():
        pieces.append(tail * first[-1] * second[-1])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _to_fixed(flat: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``round(flat * 2**shift)`` per block as int64, exactly (see :func:`_scaled`)."""
    return _scaled(flat, shift).round_().to(torch.int64)


def exact_sum(
    gradients: Sequence[tuple[int, torch.Tensor]],
    *,
    num_logical_workers: int,
    group: dist.ProcessGroup | None = None,
    local: bool = False,
) -> torch.Tensor:
    """The exact sum over all logical workers of their gradients.

    ``gradients`` are this process's logical workers as ``(logical worker id, gradient)``,
    every gradient of the same shape (and the same shape on every process of ``group``);
    ``num_logical_workers`` counts them on all processes together. Without an initialized
    process group (or with ``group`` None and one process) it reduces locally. Returns a
    tensor of the gradients' shape and dtype, bitwise the same on every process and for
    every grouping of the logical workers onto processes. NonFiniteGradient on every
    process when any logical worker's gradient is not finite.
    """
    if not gradients:
        raise ValueError("a process must host at least one logical worker")
    shape, dtype = gradients[0][1].shape, gradients[0][1].dtype
    if any(g.shape != shape for _, g in gradients):
        raise ValueError("every logical worker's gradient must have the same shape")
    distributed = not local and dist.is_available() and dist.is_initialized()
    numel = gradients[0][1].numel()
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)

    flats = [g.detach().reshape(-1).to(torch.float32) for _, g in gradients]
    maxima = torch.stack([_block_max(flat) for flat in flats])
    # Non-finite values before anything else: they would poison the exponent and the sum.
    # A block's maximum is NaN or Inf exactly when the block holds one (max propagates NaN).
    bad = torch.zeros(num_logical_workers, dtype=torch.int32)
    for (worker, _), worker_max in zip(gradients, maxima, strict=True):
        if not bool(torch.isfinite(worker_max).all()):
            bad[worker] = 1
    exponent = _exponents(torch.nan_to_num(maxima.amax(dim=0), nan=0.0, posinf=0.0))
    if distributed:
        # One MAX all-reduce carries both: the flags and the blocks' exponents.
        both = torch.cat([bad, exponent])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        bad, exponent = both[:num_logical_workers], both[num_logical_workers:]
    if bool(bad.any()):
        raise NonFiniteGradient([i for i in range(num_logical_workers) if bad[i]])
    bits = fraction_bits(num_logical_workers)
    shift = bits - exponent.to(torch.int64)  # scale each block by 2**(F - e)
    total = _to_fixed(flats[0], shift)
    for flat in flats[1:]:
        total += _to_fixed(flat, shift)
    if distributed:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    # Back once: the integer sum rounds to float32 once, then the power of two is undone.
    return _scaled(total.to(torch.float32), -shift).to(dtype).view(shape)


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
    flattens into buckets too); the model itself exists once.
    """

    def __init__(self, params: Sequence[torch.Tensor], num_logical_workers: int) -> None:
        if num_logical_workers < 1:
            raise ValueError(f"num_logical_workers must be >= 1, got {num_logical_workers}")
        self.params = list(params)
        self.num_logical_workers = num_logical_workers
        self.kept: list[tuple[int, torch.Tensor]] = []

    def keep(self, logical_worker: int) -> None:
        """Move the current gradients out as ``logical_worker``'s and zero them."""
        if not 0 <= logical_worker < self.num_logical_workers:
            raise ValueError(
                f"logical worker {logical_worker} not in 0..{self.num_logical_workers - 1}"
            )
        if any(w == logical_worker for w, _ in self.kept):
            raise ValueError(f"logical worker {logical_worker} ran twice in one step")
        pieces = []
        for p in self.params:
            if p.grad is None:
                pieces.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
            else:
                pieces.append(p.grad.detach().reshape(-1).clone())
                p.grad.zero_()
        self.kept.append((logical_worker, torch.cat(pieces) if pieces else torch.zeros(0)))

    def reduce(self, group: dist.ProcessGroup | None = None, *, local: bool = False) -> None:
        """Set every parameter's gradient to the mean over all logical workers, exactly.

        Collective over ``group`` (the data-parallel group): every process must call it with
        its own kept logical workers. Raises NonFiniteGradient (on every process) before
        anything is written when a logical worker's gradient holds NaN or Inf. ``local``:
        this process's kept logical workers only, no communication (see :func:`exact_sum`).
        """
        assert self.kept, "reduce() before any logical worker was kept"
        try:
            total = exact_sum(
                self.kept, num_logical_workers=self.num_logical_workers, group=group, local=local
            )
        finally:
            self.kept = []
        # One multiplication after the exact sum: the same bits on every process.
        total.mul_(1.0 / self.num_logical_workers)
        offset = 0
        for p in self.params:
            n = p.numel()
            piece = total[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
            offset += n
        assert offset == total.numel()
