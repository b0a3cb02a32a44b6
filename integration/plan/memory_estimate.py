"""What each worker will hold, estimated from the config before anything starts. Pure.

A worker of logical stage ``s`` holds (fp32 master weights whatever the compute precision):

- its stage's parameters, their gradients and Adam's two moments (4 + 4 + 8 bytes an
  element, and a step count a tensor);
- with redundancy on, the same for its successor's stage (``s + 1``, the last stage's is
  stage 0's), a ``1 / pieces`` share of it with sharded replicas, with the replica's
  received flat gradient (its ``.grad`` are views of it);
- the stash a replay needs: its outputs (stage ``s + 1``'s inputs) and, but on stage 0, the
  gradients of its inputs, one a micro-batch; on the last stage, stage 0's token ids;
- one flat fp32 gradient copy a hosted logical worker (the exact reduction keeps each
  logical worker's gradient, in buffers kept across steps; the sum it writes is the
  gradients' own storage);
- activations (a formula, not a count): 1F1B keeps ``min(M, S - s)`` micro-batches in
  flight on stage ``s``, each block's saved tensors ``s b h (34 + 5 a s / h)`` bytes in 16
  bits (Korthikanti et al., 2022) or twice that in fp32, only the block inputs with
  activation checkpointing (plus one block's during its recomputation), and the last
  stage's logits; half-precision autocast (bf16 or fp16) also caches a 16-bit copy of each
  weight during a forward.

The model-state fields are the ones the workers count from their tensors
(``spotline.pipeline.memory.model_state_bytes``, ``summary.json``'s
``model_state_bytes_per_rank``); tests/test_redundancy.py checks the two agree within 5%.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

GIB = 1 << 30
# The kinds the workers count from their tensors too (ModelStateBytes has them and the
# eager graph; the estimate has them, the logical workers' copies and the activations).
COUNTED_KINDS = (
    "parameters",
    "gradients",
    "optimizer",
    "replica_parameters",
    "replica_gradients",
    "replica_optimizer",
    "stash",
)
_FP32 = 4
_TOKEN_ID = 8  # int64 token ids


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of the model and the batch."""

    stage_parameters: tuple[int, ...]  # parameter elements of each logical stage
    stage_tensors: tuple[int, ...]  # parameter tensors of each (Adam's step counts)
    stage_blocks: tuple[int, ...]  # transformer blocks of each
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    micro_batch_size: int
    num_micro_batches: int


@dataclass(frozen=True)
class MemoryPlan:
    """How the job runs, as far as memory goes."""

    redundancy: bool
    replica_pieces: int  # 1: full replicas; k: each holder keeps 1/k of its successor's
    half_precision: bool  # bf16 or fp16 autocast (the master weights are fp32 either way)
    activation_checkpoint_interval: int
    hosted_logical_workers: int  # the most logical workers one pipeline runs


@dataclass(frozen=True)
class StageMemory:
    """One worker's estimated bytes, by kind (the first eight as the workers count them)."""

    parameters: int
    gradients: int
    optimizer: int
    replica_parameters: int
    replica_gradients: int
    replica_optimizer: int
    stash: int
    logical_gradients: int
    activations: int

    @property
    def model_state(self) -> int:
        return self.total - self.activations

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _adam_bytes(elements: int, tensors: int) -> int:
    return 2 * _FP32 * elements + _FP32 * tensors  # two moments, a step count a tensor


def _activation_bytes(shape: ModelShape, plan: MemoryPlan, stage: int) -> int:
    num_stages = len(shape.stage_parameters)
    in_flight = min(shape.num_micro_batches, num_stages - stage)
    s, b, h, a = shape.seq_len, shape.micro_batch_size, shape.hidden_size, shape.num_heads
    per_block = s * b * h * (34 + 5 * a * s // h) * (1 if plan.half_precision else 2)
    blocks = shape.stage_blocks[stage]
    if plan.activation_checkpoint_interval > 0 and blocks:
        # Each checkpointed range keeps its input (fp32 residual stream); one range is
        # recomputed at a time, in full.
        ranges = -(-blocks // plan.activation_checkpoint_interval)
        kept = in_flight * ranges * s * b * h * _FP32
        kept += min(plan.activation_checkpoint_interval, blocks) * per_block
    else:
        kept = in_flight * blocks * per_block
    if stage == num_stages - 1:
        # Logits (16-bit under autocast, then fp32 for the loss) and their gradient.
        half = 2 if plan.half_precision else 0
        kept += in_flight * s * b * shape.vocab_size * (half + 2 * _FP32)
    if plan.half_precision:
        kept += 2 * shape.stage_parameters[stage]  # autocast's 16-bit copies of the weights
    return kept


def estimate_stage(shape: ModelShape, plan: MemoryPlan, stage: int) -> StageMemory:
    """The bytes the worker of logical stage ``stage`` holds at its peak in a step."""
    num_stages = len(shape.stage_parameters)
    own, tensors = shape.stage_parameters[stage], shape.stage_tensors[stage]
    successor = (stage + 1) % num_stages
    activation = shape.seq_len * shape.micro_batch_size * shape.hidden_size * _FP32
    replica = rep_tensors = stash = 0
    if plan.redundancy and num_stages > 1:
        replica = -(-shape.stage_parameters[successor] // plan.replica_pieces)
        rep_tensors = shape.stage_tensors[successor]
        m = shape.num_micro_batches
        if stage < num_stages - 1:
            stash += m * activation  # outputs: the successor's inputs
        if stage > 0:
            stash += m * activation  # the gradients of this stage's inputs
        if successor == 0:
            stash += m * shape.seq_len * shape.micro_batch_size * _TOKEN_ID
    return StageMemory(
        parameters=_FP32 * own,
        gradients=_FP32 * own,
        optimizer=_adam_bytes(own, tensors),
        replica_parameters=_FP32 * replica,
        replica_gradients=_FP32 * replica,  # the received flat message (.grad views it)
        replica_optimizer=_adam_bytes(replica, rep_tensors) if replica else 0,
        stash=stash,
        logical_gradients=_FP32 * own * plan.hosted_logical_workers,
        activations=_activation_bytes(shape, plan, stage),
    )


def estimate(shape: ModelShape, plan: MemoryPlan) -> list[StageMemory]:
    """:func:`estimate_stage` of every logical stage, in order."""
    return [estimate_stage(shape, plan, s) for s in range(len(shape.stage_parameters))]


def size(num_bytes: int) -> str:
    """``num_bytes`` for a reader: ``"2.66 GiB"``, ``"1.9 MiB"``."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"


def describe(estimates: Sequence[StageMemory]) -> str:
    """One line: each stage's worker's estimated bytes, model state and activations."""
    cells = [
        f"stage {s} {size(e.total)} ({size(e.model_state)} model state, "
        f"{size(e.activations)} activations)"
        for s, e in enumerate(estimates)
    ]
    return "memory estimate per worker: " + "; ".join(cells)


def over_limit(estimates: Sequence[StageMemory], limit_gb: float) -> str | None:
    """Why the plan does not fit ``limit_gb`` GiB a worker (one line), or None."""
    stage, worst = max(enumerate(estimates), key=lambda pair: pair[1].total)
    if worst.total <= limit_gb * GIB:
        return None
    kinds = sorted(asdict(worst).items(), key=lambda kv: -kv[1])[:3]
    largest = ", ".join(f"{kind} {size(n)}" for kind, n in kinds)
    return (
        f"the worker of stage {stage} needs about {size(worst.total)} (most: {largest}) "
        f"but spotline.topology.memory_per_slot_gb is {limit_gb:g}; use more stages "
        "(--stages), activation checkpointing (spotline.model.activation_checkpoint_interval), "
        'sharded replicas (spotline.redundancy.replica "sharded") or a smaller micro-batch'
    )
