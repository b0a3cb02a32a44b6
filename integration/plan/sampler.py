"""The global sampler: (seed, epoch, step, logical worker, micro-batch) -> sample indices.

Training reads its micro-batches from here and from nowhere else. The answer depends only on
the logical topology (number of logical workers, micro-batch size, micro-batches per logical
worker per step) and the seed, never on how many processes run those logical workers, so a
rescale or a failover changes who reads a micro-batch but not which samples it holds. Each
sample of an epoch is read exactly once in that epoch. Pairs with ``spotline.plan.logical``
(which process runs which logical worker) and ``spotline.data.corpus.PackedCorpus.batch`` (which
turns the indices into tensors).
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass


def _check_count(name: str, value: int) -> None:
    # bool is an int subclass; True as a count is a caller's mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_index(name: str, value: int, bound: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
        raise ValueError(f"{name} must be an integer in [0, {bound}), got {value!r}")


def _epoch_seed(seed: int, epoch: int) -> int:
    """A stable 64-bit seed for one epoch's permutation (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"spotline.sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(num_samples))
    random.Random(_epoch_seed(seed, epoch)).shuffle(order)
    return tuple(order)


@dataclass(frozen=True)
class GlobalSampler:
    """Which samples each (step, logical worker, micro-batch) trains on.

    Every epoch is one seeded permutation of ``range(num_samples)``; a step takes the next
    ``samples_per_step`` entries of it, split logical-worker-major: logical worker ``w``'s
    micro-batch ``m`` is the slice at ``(w * num_micro_batches + m) * micro_batch_size``.
    The last ``num_samples % samples_per_step`` entries of each permutation are dropped, so
    every step is full. Constructing a sampler whose corpus cannot fill one step raises
    ValueError.
    """

    num_samples: int
    num_logical_workers: int
    micro_batch_size: int
    num_micro_batches: int
    seed: int

    def __post_init__(self) -> None:
        _check_count("num_samples", self.num_samples)
        _check_count("num_logical_workers", self.num_logical_workers)
        _check_count("micro_batch_size", self.micro_batch_size)
        _check_count("num_micro_batches", self.num_micro_batches)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.num_samples < self.samples_per_step:
            raise ValueError(self._too_small_message())

    def _too_small_message(self) -> str:
        return (
            f"{self.num_samples} samples cannot fill one step of {self.samples_per_step} "
            f"({self.num_logical_workers} logical workers x {self.num_micro_batches} "
            f"micro-batches x {self.micro_batch_size} samples); use more samples or a "
            "smaller batch"
        )

    @property
    def samples_per_step(self) -> int:
        """Samples one optimizer step consumes over all logical workers and micro-batches."""
        return self.num_logical_workers * self.num_micro_batches * self.micro_batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Full steps in one epoch (the remainder of the permutation is dropped)."""
        num_steps = self.num_samples // self.samples_per_step
        if num_steps == 0:
            raise ValueError(self._too_small_message())
        return num_steps

    def epoch_of(self, step: int) -> int:
        """The epoch that global step ``step`` (counted from 0) falls in."""
        self._check_step(step)
        return step // self.steps_per_epoch

    def epoch_permutation(self, epoch: int) -> tuple[int, ...]:
        """The order in which epoch ``epoch`` visits the samples (all of them, tail included)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        return _epoch_permutation(self.num_samples, self.seed, epoch)

    def indices(self, step: int, logical_worker: int, micro_batch: int) -> tuple[int, ...]:
        """The ``micro_batch_size`` sample indices of one micro-batch of one logical worker."""
        self._check_step(step)
        _check_index("logical_worker", logical_worker, self.num_logical_workers)
        _check_index("micro_batch", micro_batch, self.num_micro_batches)
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        slot = logical_worker * self.num_micro_batches + micro_batch
        start = step_in_epoch * self.samples_per_step + slot * self.micro_batch_size
        return self.epoch_permutation(epoch)[start : start + self.micro_batch_size]

    def _check_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
