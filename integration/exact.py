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

Step 3 runs one of two ways, chosen from how many logical workers each process hosts (the
MAX all-reduce carries those counts too, so every process chooses alike), with the same
integers summed and so the same bits:

- **sharded** (every process hosts at most ``SHARDED_MAX_HOSTED``): each process sends
  its logical workers' float32 gradients, shard by shard, to the shard's owner (one
  all-to-all); the owner converts every logical worker's values of its shard, sums the
  integers and converts back; one all-gather of the float32 sums. ``(k + 1) (P - 1) / P``
  float32 values an element sent per process hosting k, against a float ring
  all-reduce's ``2 (P - 1) / P``: the same bytes when each process hosts one, and each
  process converts back only its shard;
- **ring**: the int64 sums all-reduced (``2 (P - 1) / P`` int64 values an element sent
  per process, twice a float32 all-reduce's bytes, whatever the number hosted).

One logical worker has no sum to make order-free: its gradient is the result, bit for bit
(on its one process, no communication; a NaN or Inf refused all the same).

Costs besides: one int32 MAX all-reduce (a non-finite flag per logical worker, an exponent
per block and a count per process). Works on gloo and NCCL (both reduce int64 and run
all-to-all).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

BLOCK = 4096
# Elements converted and all-reduced at a time (a whole number of blocks). Chunks keep every
# temporary under glibc's 32 MiB mmap threshold, so the allocator reuses its pages instead
# of faulting in fresh ones for each (a 10M-element int64 temporary cost more in page faults
# than its arithmetic), and let one chunk's all-reduce run while the next is converted.
CHUNK = 256 * BLOCK
# Chunks whose all-reduce may be outstanding at once (a few chunk buffers, reused).
IN_FLIGHT = 2
# The sharded step 3 while every process hosts at most this many logical workers: it sends
# (k + 1) float32 values per element where the ring sends 2 int64 (4 float32's bytes), and
# converts back only a process's shard; at 3 the bytes are equal, the conversions fewer.
SHARDED_MAX_HOSTED = 3
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
    """Per block the largest magnitude, ``max(max, -min)``: no ``abs`` copy of the gradient
    (a fresh tensor of its size faulted in pages that cost 10x the reduction itself).
    Negation is exact, and a NaN or Inf still shows as its block's maximum. Two reductions:
    ``aminmax`` along a dimension is not vectorised on CPU, ``amax`` and ``amin`` are."""
    head, tail = _blocks(flat)
    parts = []
    if head.numel():
        parts.append(torch.maximum(head.amax(dim=1), head.amin(dim=1).neg_()))
    if tail.numel():
        parts.append(torch.maximum(tail.amax(), tail.amin().neg()).reshape(1))
    return torch.cat(parts)


def _exponents(block_max: torch.Tensor) -> torch.Tensor:
    """Per block the least ``e`` with ``max |g| < 2**e`` (int32)."""
    _, exponent = torch.frexp(block_max)  # max = m * 2**e, 0.5 <= m < 1: max < 2**e
    zero = block_max == 0
    return torch.where(zero, torch.full_like(exponent, _ZERO_BLOCK_EXPONENT), exponent).to(
        torch.int32
    )


def _scaled(
    flat: torch.Tensor, shift: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``flat * 2**shift`` per block, in float32 (into ``out`` when given).

    Multiplying by a power of two only moves the exponent, so it is exact while the result
    stays in range (to fixed point every product is below 2**62). ``2**shift`` itself may
    not fit float32 (a block of tiny values): then it is applied in two halves that do. One
    multiplication by ``2**shift`` where it fits gives the same bits as the two halves: the
    first half is exact there, so both round (if at all) once, at the same value."""
    one = torch.ones(shift.shape, dtype=torch.float32)
    # float32's normal powers of two: 2**-126 .. 2**127.
    if bool(((shift >= -126) & (shift <= 127)).all()):
        factors: tuple[torch.Tensor, ...] = (torch.ldexp(one, shift),)
    else:
        low = torch.div(shift, 2, rounding_mode="floor")
        factors = (torch.ldexp(one, low), torch.ldexp(one, shift - low))
    result = torch.empty_like(flat) if out is None else out
    head, tail = _blocks(flat)
    out_head, out_tail = _blocks(result)
    if head.numel():
        rows = head.shape[0]
        torch.mul(head, factors[0][:rows, None], out=out_head)
        for factor in factors[1:]:
            out_head.mul_(factor[:rows, None])
    if tail.numel():
        torch.mul(tail, factors[0][-1], out=out_tail)
        for factor in factors[1:]:
            out_tail.mul_(factor[-1])
    return result


def _to_fixed(flat: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``round(flat * 2**shift)`` per block as int64, exactly (see :func:`_scaled`)."""
    return _scaled(flat, shift).round_().to(torch.int64)


def exact_sum(
    gradients: Sequence[tuple[int, torch.Tensor]],
    *,
    num_logical_workers: int,
    group: dist.ProcessGroup | None = None,
    local: bool = False,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """The exact sum over all logical workers of their gradients.

    ``gradients`` are this process's logical workers as ``(logical worker id, gradient)``,
    every gradient of the same shape (and the same shape on every process of ``group``);
    ``num_logical_workers`` counts them on all processes together. Without an initialized
    process group (or with ``group`` None and one process) it reduces locally. Returns a
    tensor of the gradients' shape and dtype, bitwise the same on every process and for
    every grouping of the logical workers onto processes. NonFiniteGradient on every
    process when any logical worker's gradient is not finite. ``out``: a flat float32
    tensor of the gradients' size to write the sum into (a caller's buffer kept across
    steps; fresh pages for every step's result cost more than the sum). ``scale``: the
    float32 sum multiplied by it (``1 / num_logical_workers`` for the mean), a chunk at a
    time while it is in cache: the same bits as one multiplication of the whole sum.
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
    if num_logical_workers == 1:
        assert len(gradients) == 1, "one logical worker, hosted once"
        return _only_worker(gradients[0], out, scale).to(dtype).view(shape)
    if dtype != torch.float32 and scale != 1.0:
        # Scaled after the conversion to ``dtype``, as the caller would.
        return exact_sum(
            gradients, num_logical_workers=num_logical_workers, group=group, local=local
        ).mul_(scale)

    flats = [g.detach().reshape(-1).to(torch.float32) for _, g in gradients]
    maxima = torch.stack([_block_max(flat) for flat in flats])
    # Non-finite values before anything else: they would poison the exponent and the sum.
    # A block's maximum is NaN or Inf exactly when the block holds one (max propagates NaN).
    bad = torch.zeros(num_logical_workers, dtype=torch.int32)
    for (worker, _), worker_max in zip(gradients, maxima, strict=True):
        if not bool(torch.isfinite(worker_max).all()):
            bad[worker] = 1
    exponent = _exponents(torch.nan_to_num(maxima.amax(dim=0), nan=0.0, posinf=0.0))
    hosted: list[int] = [len(flats)]
    if distributed:
        # One MAX all-reduce carries them all: the flags, the blocks' exponents and how many
        # logical workers each process hosts (its own entry set, the others' zero).
        processes = dist.get_world_size(group)
        counts = torch.zeros(processes, dtype=torch.int32)
        counts[dist.get_rank(group)] = len(flats)
        both = torch.cat([bad, exponent, counts])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        bad = both[:num_logical_workers]
        exponent = both[num_logical_workers : both.numel() - processes]
        hosted = [int(c) for c in both[both.numel() - processes :]]
        assert sum(hosted) == num_logical_workers, (hosted, num_logical_workers)
    if bool(bad.any()):
        raise NonFiniteGradient([i for i in range(num_logical_workers) if bad[i]])
    bits = fraction_bits(num_logical_workers)
    shift = bits - exponent.to(torch.int64)  # scale each block by 2**(F - e)
    result = torch.empty(numel, dtype=torch.float32) if out is None else out
    assert result.shape == (numel,) and result.dtype == torch.float32, "out: flat float32"
    if distributed and takes_sharded_sum(hosted):
        _sharded_fixed_point_sum(flats, shift, result, group, hosted, scale)
    else:
        _fixed_point_sum(flats, shift, result, group if distributed else None, distributed, scale)
    return result.to(dtype).view(shape)


def _only_worker(
    gradient: tuple[int, torch.Tensor], out: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The sum of one logical worker: its gradient, bit for bit, wherever it runs (there is
    no grouping for the sum to depend on; the fixed-point round trip would only have
    rounded its values 2**39 and more below their block's largest). A NaN or Inf is
    refused as in the sum (``amax`` and ``amin`` propagate NaN and reach an Inf)."""
    worker, g = gradient
    flat = g.detach().reshape(-1).to(torch.float32)
    if not (bool(torch.isfinite(flat.amax())) and bool(torch.isfinite(flat.amin()))):
        raise NonFiniteGradient([worker])
    result = flat.clone() if out is None else out.copy_(flat)
    if scale != 1.0:
        result.mul_(scale)
    return result


def takes_sharded_sum(hosted: Sequence[int]) -> bool:
    """Whether step 3 is the sharded one for ``hosted[i]`` logical workers on process i."""
    return len(hosted) > 1 and max(hosted) <= SHARDED_MAX_HOSTED


def ring_bytes(payload: int, processes: int) -> int:
    """What a process sends in a ring all-reduce of ``payload`` bytes."""
    return 2 * payload * (processes - 1) // processes


def bytes_sent_per_process(numel: int, hosted: Sequence[int]) -> int:
    """What the busiest process sends for the sum of ``numel`` elements, ``hosted[i]``
    logical workers on process i (the MAX all-reduce's few values left out): the sharded
    or the ring step 3, whichever :func:`exact_sum` takes."""
    processes = len(hosted)
    if processes == 1:
        return 0
    if takes_sharded_sum(hosted):
        return 4 * (max(hosted) + 1) * numel * (processes - 1) // processes
    return ring_bytes(8 * numel, processes)


def _to_float(fixed: torch.Tensor, shift: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Step 4 into ``out``: the integer sums rounded to float32 once, the power of two
    undone, times ``scale``."""
    _scaled(fixed.to(torch.float32), -shift, out=out)
    if scale != 1.0:
        out.mul_(scale)


def _block_shift(shift: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The shifts of the blocks elements ``start..stop`` lie in (``start`` block-aligned)."""
    assert start % BLOCK == 0, start
    return shift[start // BLOCK : (stop + BLOCK - 1) // BLOCK]


def _sharded_fixed_point_sum(
    flats: Sequence[torch.Tensor],
    shift: torch.Tensor,
    result: torch.Tensor,
    group: dist.ProcessGroup | None,
    hosted: Sequence[int],
    scale: float,
) -> None:
    """Steps 2-4 sharded over the processes, a chunk at a time (see the module's text).

    A chunk is ``P`` shards of ``S`` whole blocks (the last chunk's shards may be shorter
    or empty); shard j belongs to process j. One all-to-all gives each owner every logical
    worker's float32 values of its shard, as ``hosted[i]`` consecutive runs from process i;
    it sums their integers, converts back into its part of ``result``, and one all-gather
    gives everyone every part. The next chunk's all-to-all runs while this one converts."""
    processes, me = len(hosted), dist.get_rank(group)
    mine = len(flats)
    numel = result.numel()
    shard = max(1, CHUNK // (processes * BLOCK)) * BLOCK
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
        work.wait()
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
        work.wait()
        lo, hi = parts[me]
        own = hi - lo
        if own:
            sh = _block_shift(shift, lo, hi)
            fixed = _to_fixed(recv[:own], sh)
            for c in range(1, sum(hosted)):
                fixed += _to_fixed(recv[c * own : (c + 1) * own], sh)
            _to_float(fixed, sh, result[lo:hi], scale)
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


def _fixed_point_sum(
    flats: Sequence[torch.Tensor],
    shift: torch.Tensor,
    result: torch.Tensor,
    group: dist.ProcessGroup | None,
    distributed: bool,
    scale: float,
) -> None:
    """Steps 2-4 of the module's recipe, a chunk at a time, into ``result``: to fixed point,
    the integer sum (all-reduced over ``group`` when ``distributed``), back to float32,
    times ``scale``."""
    numel = result.numel()
    pending: deque[tuple[dist.Work | None, int, int, torch.Tensor]] = deque()

    def finish() -> None:
        work, start, stop, fixed = pending.popleft()
        if work is not None:
            work.wait()
        _to_float(fixed, _block_shift(shift, start, stop), result[start:stop], scale)

    for start in range(0, numel, CHUNK):
        stop = min(start + CHUNK, numel)
        chunk_shift = _block_shift(shift, start, stop)
        fixed = _to_fixed(flats[0][start:stop], chunk_shift)
        for flat in flats[1:]:
            fixed += _to_fixed(flat[start:stop], chunk_shift)
        work = None
        if distributed:
            # Summed over the processes while the next chunk is converted.
            work = dist.all_reduce(fixed, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((work, start, stop, fixed))
        if len(pending) > IN_FLIGHT:
            finish()
    while pending:
        finish()


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

    def __init__(self, params: Sequence[torch.Tensor], num_logical_workers: int) -> None:
        if num_logical_workers < 1:
            raise ValueError(f"num_logical_workers must be >= 1, got {num_logical_workers}")
        self.params = list(params)
        self.num_logical_workers = num_logical_workers
        self.kept: list[tuple[int, torch.Tensor]] = []
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        assert all(p.dtype == self.dtype for p in self.params), "one gradient dtype"
        self._buffers: list[torch.Tensor] = []
        self._total: torch.Tensor | None = None

    def keep(self, logical_worker: int) -> None:
        """Move the current gradients out as ``logical_worker``'s and zero them."""
        if not 0 <= logical_worker < self.num_logical_workers:
            raise ValueError(
                f"logical worker {logical_worker} not in 0..{self.num_logical_workers - 1}"
            )
        if any(w == logical_worker for w, _ in self.kept):
            raise ValueError(f"logical worker {logical_worker} ran twice in one step")
        flat = self._buffer(len(self.kept))
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                flat[offset : offset + n].zero_()
            else:
                flat[offset : offset + n].copy_(p.grad.detach().reshape(-1))
                p.grad.zero_()
            offset += n
        self.kept.append((logical_worker, flat))

    def _buffer(self, index: int) -> torch.Tensor:
        """The flat gradient buffer of the ``index``-th kept logical worker of a step.

        Kept across steps (a step's kept gradients are dropped once reduced): a fresh
        tensor of a real model's size would fault in fresh pages every step.
        """
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(self.numel, dtype=self.dtype))
        return self._buffers[index]

    def reduce(self, group: dist.ProcessGroup | None = None, *, local: bool = False) -> None:
        """Set every parameter's gradient to the mean over all logical workers, exactly.

        Collective over ``group`` (the data-parallel group): every process must call it with
        its own kept logical workers. Raises NonFiniteGradient (on every process) before
        anything is written when a logical worker's gradient holds NaN or Inf. ``local``:
        this process's kept logical workers only, no communication (see :func:`exact_sum`).
        """
        assert self.kept, "reduce() before any logical worker was kept"
        if self._total is None and self.dtype == torch.float32:
            self._total = torch.empty(self.numel, dtype=torch.float32)
        try:
            # One multiplication after the exact sum: the same bits on every process.
            total = exact_sum(
                self.kept,
                num_logical_workers=self.num_logical_workers,
                group=group,
                local=local,
                out=self._total,
                scale=1.0 / self.num_logical_workers,
            )
        finally:
            self.kept = []
        # The gradients become views of the sum (no copy): keep() copies them out and zeroes
        # them before the next reduce writes the buffer again.
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p)
            offset += n
        assert offset == total.numel()
