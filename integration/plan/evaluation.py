"""Evaluation as pure data: the held-out rows, the eval micro-batches, when to evaluate, the
exact reduction of their losses and which evaluation is the best.

What makes an evaluation exact (the same bits on any placement, after any recovery):

- **the rows are fixed by the run**: a held-out fraction is a seeded choice of row indices
  (:func:`holdout_split`), an eval file is read in order; neither depends on processes;
- **the micro-batches are fixed by index** (:class:`EvalBatches`): eval row ``i`` is in
  micro-batch ``i // micro_batch_size`` whoever runs it, so each micro-batch's forward
  computes the same bits on any process (which pipeline runs which micro-batch,
  :meth:`EvalBatches.of_pipeline`, only spreads the work);
- **the reduction is order-free** (:func:`reduce_losses`): each micro-batch gives the sum of
  its token losses and the number of tokens counted; the sums are added by ``math.fsum``,
  the correctly rounded sum of the exact float64 values, which is the same in any order
  and any grouping; the mean divides by the (integer) token count.

Pure: no torch (the coordinator and the planner's tests import it).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HoldoutSplit:
    """Row indices of a corpus: those trained on and those held out, each ascending."""

    train: tuple[int, ...]
    held_out: tuple[int, ...]


def _holdout_seed(seed: int) -> int:
    """A stable 64-bit seed for the choice of held-out rows (Python's hash() is salted)."""
    digest = hashlib.sha256(f"spotline.holdout:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def holdout_split(num_rows: int, fraction: float, seed: int) -> HoldoutSplit:
    """Hold out ``floor(fraction * num_rows)`` of ``num_rows`` rows, chosen by a permutation
    seeded by the run's ``seed`` (its first rows are held out); the rest is trained on.

    The same (rows, fraction, seed) give the same split in every process and every run;
    the two parts are disjoint and together are every row."""
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative integer, got {num_rows!r}")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    order = list(range(num_rows))
    random.Random(_holdout_seed(seed)).shuffle(order)
    count = math.floor(fraction * num_rows)
    return HoldoutSplit(train=tuple(sorted(order[count:])), held_out=tuple(sorted(order[:count])))


def eval_steps(interval: int | None, total_steps: int) -> tuple[int, ...]:
    """The steps evaluated at (the number of optimizer steps applied when the evaluation
    runs): every multiple of ``interval`` up to ``total_steps`` (None: none), and
    ``total_steps`` itself."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    every = range(interval, total_steps, interval) if interval is not None else range(0)
    return (*every, total_steps)


def is_due(step: int, interval: int | None, total_steps: int) -> bool:
    """Whether the run evaluates once ``step`` optimizer steps are applied."""
    if step == total_steps:
        return True
    return interval is not None and 0 < step < total_steps and step % interval == 0


@dataclass(frozen=True)
class EvalBatches:
    """``num_rows`` eval rows cut, in order, into micro-batches of ``micro_batch_size``
    rows (the training's, so that the pipeline's buffers keep their shape). The last one
    may hold fewer real rows: it is topped up with rows whose every label is ignored, which
    add nothing to the loss or the token count."""

    num_rows: int
    micro_batch_size: int

    def __post_init__(self) -> None:
        assert self.num_rows >= 1 and self.micro_batch_size >= 1, self

    @property
    def num_micro_batches(self) -> int:
        return -(-self.num_rows // self.micro_batch_size)

    def rows(self, micro_batch: int) -> range:
        """The real eval rows of ``micro_batch`` (ascending)."""
        if not 0 <= micro_batch < self.num_micro_batches:
            raise ValueError(
                f"micro_batch must be in [0, {self.num_micro_batches}), got {micro_batch}"
            )
        start = micro_batch * self.micro_batch_size
        return range(start, min(start + self.micro_batch_size, self.num_rows))

    def of_pipeline(self, pipeline: int, num_pipelines: int) -> tuple[int, ...]:
        """The micro-batches physical pipeline ``pipeline`` of ``num_pipelines`` runs: every
        ``num_pipelines``-th from its own index (a pipeline may get none)."""
        if not 0 <= pipeline < num_pipelines:
            raise ValueError(f"pipeline must be in [0, {num_pipelines}), got {pipeline}")
        return tuple(range(pipeline, self.num_micro_batches, num_pipelines))


@dataclass(frozen=True)
class LossSum:
    """One micro-batch's evaluation: the sum of its counted tokens' losses, and their number."""

    micro_batch: int
    loss_sum: float
    tokens: int


def reduce_losses(parts: Sequence[LossSum], num_micro_batches: int) -> tuple[float, int]:
    """The mean token loss over every micro-batch, and the tokens counted.

    Each of ``0 .. num_micro_batches - 1`` must be given once. ``math.fsum`` adds the
    float64 sums exactly rounded, so the result does not depend on the order of ``parts``
    (nor on which process computed which)."""
    seen = sorted(part.micro_batch for part in parts)
    if seen != list(range(num_micro_batches)):
        raise ValueError(f"expected micro-batches 0..{num_micro_batches - 1} once each, got {seen}")
    tokens = sum(part.tokens for part in parts)
    if tokens < 1:
        raise ValueError("no counted token in the evaluation set: its mean loss is undefined")
    ordered = sorted(parts, key=lambda part: part.micro_batch)
    return math.fsum(part.loss_sum for part in ordered) / tokens, tokens


def perplexity(loss: float) -> float:
    """``exp(loss)``; infinite when that overflows a float (a diverged model)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def improves(loss: float, step: int, earlier: Mapping[int, float]) -> bool:
    """Whether the evaluation at ``step`` beats every one before it (a tie does not: the
    earliest of equal losses stays the best). Entries of ``earlier`` at ``step`` or later
    are ignored."""
    return all(loss < value for at, value in earlier.items() if at < step)


def best_step(losses: Mapping[int, float]) -> int | None:
    """The step of the lowest loss (the earliest on a tie); None without evaluations: the
    step :func:`improves` last said yes to."""
    if not losses:
        return None
    return min(sorted(losses), key=lambda step: losses[step])
