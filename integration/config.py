"""Spotline's settings, kept in the ``"spotline"`` section of a DeepSpeed config JSON.

One JSON file configures both DeepSpeed (its usual top-level keys) and Spotline (the
``"spotline"`` object, with one sub-section per concern). Parsing is strict
(``spotline.config_reader``): an unknown key or a value of the wrong type is a
:class:`~spotline.errors.UserError` that names the key path and the expected form, because a
typo that silently falls back to a default is the most expensive kind of bug on a cluster.
Whether a config may continue a stopped run: ``spotline.config_resume``.

This module is pure (no torch, no DeepSpeed): the launcher validates a config before any
worker process starts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from spotline.config_precision import Precision, enabled, loss_scaling_of, precision_of
from spotline.config_reader import parse_section
from spotline.errors import UserError
from spotline.models.model_config import preset_blocks
from spotline.plan.capacity import DEFAULT_STAGES_PER_WORKER, Capacity
from spotline.plan.chaos import parse_rescales
from spotline.plan.loss_scale import LossScaling
from spotline.plan.policies import RecoveryMode
from spotline.plan.redundancy_mode import RedundancyMode, redundancy_on
from spotline.plan.shards import ReplicaKind
from spotline.run_dir import CHECKPOINTS_DIR

ReplicaDevice = Literal["accelerator", "host"]
StoreBackend = Literal["tcp", "etcd"]
OnWriteError = Literal["stop", "continue"]
WandbMode = Literal["offline", "online", "disabled"]
# How instruction records fill rows of seq_len + 1 tokens (spotline.data.instructions).
InstructionLayout = Literal["pack", "pad"]
# The dtype of the exported save_pretrained model (spotline.export.dtype).
ExportDtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelSection:
    """Which transformers model to train: a preset name or a ``save_pretrained`` directory."""

    name: str = "gpt2-tiny"
    # Attribute overrides applied to the transformers config, e.g. {"resid_pdrop": 0.0}.
    overrides: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 32
    # 0 disables activation checkpointing; k checkpoints every k layers of a stage.
    activation_checkpoint_interval: int = 0


@dataclass(frozen=True)
class DataSection:
    """The text corpus and tokenizer; ``None`` means the shipped corpus / byte tokenizer."""

    path: str | None = None
    tokenizer: str | None = None
    # Instruction records only: "pack" puts whole examples one after another in a row,
    # "pad" one example a row (spotline.data.instructions). Text records ignore it.
    instruction_layout: InstructionLayout = "pack"


@dataclass(frozen=True)
class EvaluationSection:
    """The evaluation set and when it is evaluated (``spotline.evaluation``); off while
    neither ``data`` nor ``holdout_fraction`` is set.

    ``data``: a file or folder read like ``spotline.data.path`` (text or instruction
    records, the same tokenizer, ``seq_len`` and layout); ``holdout_fraction``: that share of
    the training data's rows, chosen with the run's seed and never trained on. Evaluated
    every ``interval_steps`` steps (None: only at the end) and after the last step, on its
    first ``max_samples`` rows (None: all of them)."""

    data: str | None = None
    holdout_fraction: float | None = None
    interval_steps: int | None = None
    max_samples: int | None = None

    @property
    def enabled(self) -> bool:
        return self.data is not None or self.holdout_fraction is not None


@dataclass(frozen=True)
class TopologySection:
    """The logical topology's shape and how many local worker processes run it."""

    stages: int = 2
    workers: int = 4
    # Workers the run starts with (None: ``workers``): ``spotline coordinator`` starts once
    # machines with this many slots have joined, and later machines join at step boundaries
    # up to ``workers`` (a spot cluster rarely has every machine up at once). A replayed
    # trace's first nodes decide instead.
    start_workers: int | None = None
    # GiB one worker slot may hold (None: no limit): a run whose memory estimate
    # (spotline.plan.memory_estimate) exceeds it is refused before any worker starts.
    memory_per_slot_gb: float | None = None


@dataclass(frozen=True)
class TrainingSection:
    steps: int = 20
    seed: int = 1234


@dataclass(frozen=True)
class RedundancySection:
    """Bamboo-style redundancy: each stage holds its successor's replica."""

    # Lazy by default: a preemption is taken over from memory, which is what Spotline is for;
    # "off" leaves only checkpoints (and a restart from scratch without them).
    mode: RedundancyMode = "lazy"
    # Where a replica's tensors live: "host" memory (room on the accelerator for the
    # stage's own work), or the "accelerator" (no copy to and from the host at a takeover).
    replica_device: ReplicaDevice = "host"
    # Compare every replica with its owner (digests of parameters and optimizer state)
    # after every step, at the replica's version (a lazy replica's update waits for the next
    # step's bubble: against the owner one step back, and once more at the run's end): a
    # correctness check that costs one small all-gather per step.
    verify_replicas: bool = False
    # Memory: room for this many logical stages on one worker (2: its stage and its
    # successor's replica, as Bamboo; a takeover runs the replica's stage in that room). The
    # planner never gives a worker more stages to run; a membership too small waits for
    # workers (or falls back to the checkpoint if a stage's state is lost). More where an
    # accelerator's memory permits.
    stages_per_worker: int = DEFAULT_STAGES_PER_WORKER
    # "full": every replica holder keeps its successor's whole state (model state 2x of
    # redundancy off). "sharded": with D pipelines the D holders of a stage (its
    # predecessor in each pipeline) keep one shard each, an equal element range: model state
    # 1 + 1/D, replica traffic and step cut by D, no replay stashes; but a stage whose
    # owners are all lost survives only while every one of its shard holders lives.
    # Lazy only (eager runs the successor's forward, which needs all its parameters).
    replica: ReplicaKind = "full"

    @property
    def on(self) -> bool:
        """Whether this run keeps replicas (every mode but ``off``)."""
        return redundancy_on(self.mode)


@dataclass(frozen=True)
class ElasticitySection:
    """EasyScale-style logical data-parallel workers: ``logical_workers`` logical pipelines
    (``None``: as many as the starting processes form), run by however many processes live."""

    logical_workers: int | None = None
    # "STEP:M[,STEP:M...]": change the number of worker processes to M at those steps
    # (removals by SIGKILL), for tests and demos.
    rescale: str | None = None
    # Steps between speed measurements that may move logical workers between pipelines
    # (0: only when the processes change).
    rebalance_every: int = 10
    # For tests and demos: worker index ``slow_worker`` (w<index>) computes ``slow_factor``
    # times slower (it sleeps after each logical worker's share of the step).
    slow_worker: int | None = None
    slow_factor: float = 1.0  # how many times slower slow_worker computes


@dataclass(frozen=True)
class CheckpointSection:
    """Periodic checkpoints, the fallback for fatal losses (0 steps: never)."""

    # Where checkpoints go (None: OUTPUT/checkpoints).
    dir: str | None = None
    interval_steps: int = 0
    # Complete checkpoints kept on disk; older ones are deleted once a newer one commits.
    keep: int = 3
    # A checkpoint that cannot be written (a full disk) is reported at once either way;
    # "stop" ends the job with that error, "continue" trains on without that checkpoint.
    on_write_error: OnWriteError = "stop"


@dataclass(frozen=True)
class RecoverySection:
    """How failures are survived, detected and (for tests and demos) injected."""

    mode: RecoveryMode = "failover"
    # The membership store: a TCPStore hosted by the coordinator, or an etcd cluster.
    store: StoreBackend = "tcp"
    etcd_endpoint: str | None = None  # host:port of etcd (v3 API) for store "etcd"
    # A worker whose heartbeat is older than this is presumed hung and is killed.
    heartbeat_timeout_s: float = 5.0
    # A preempted (SIGTERM) worker leaves at the next step boundary, or after this long.
    term_grace_s: float = 10.0
    # Bound on one collective: a peer that hangs instead of dying is caught by this.
    collective_timeout_s: float = 60.0
    # Faults: "kill|term|stop:STEP:WORKER[:PHASE]" or "add:STEP" (see spotline.plan.chaos).
    inject: list[str] = field(default_factory=list)
    trace: str | None = None
    time_scale: float = 1.0
    # "wall": trace time runs with the wall clock; "steps": each training step started is
    # step_time_estimate_s of wall time and idle time is skipped (reproducible replays).
    trace_clock: Literal["wall", "steps"] = "wall"
    # How a replayed trace removes a worker: SIGKILL ("kill", a preemption without notice)
    # or SIGTERM ("term", a notice: the worker leaves at the next step boundary).
    trace_removal: Literal["kill", "term"] = "kill"
    preempt_rate: float = 0.0  # preemptions per worker-hour of trace time
    preempt_seed: int | None = None  # None: the run's seed
    replace_after_s: float = 45.0  # trace time until a preempted worker is replaced
    max_workers: int | None = None  # local cap for trace replay (default: --workers)
    # Processes started ahead of trace (or random-preemption) arrivals, so that an arrival is
    # a started process as a cloud node is a booted machine (FaultDelivery.keep_warm, in
    # spotline.launch.control.faults).
    warm_workers: int = 1
    # checkpoint-restart with checkpoints.interval_steps 0: the Young/Daly interval
    # sqrt(2 * cost * MTBF) needs these estimates (seconds).
    checkpoint_cost_s: float = 0.05
    # A step's seconds: the Young/Daly estimate above, and a "steps" trace clock's tick.
    step_time_estimate_s: float = 0.1
    # Stop the run when no step has committed for this long while workers were being
    # preempted (faster than they start, so it would spin forever); 0: never stop.
    no_progress_timeout_s: float = 300.0


@dataclass(frozen=True)
class TrackingSection:
    """wandb runs offline unless the user configured otherwise. ``timeline_png``: draw the
    run's ``timeline.png`` at its end (matplotlib: a second or two; ``timeline.csv`` holds
    the same rows either way)."""

    wandb: WandbMode = "offline"
    project: str = "spotline"  # the wandb project
    run_name: str | None = None  # the wandb run's name (None: wandb's own)
    # Progress lines on the terminal while the run trains (steps, rates, events).
    progress: bool = True
    # Draw timeline.png at the run's end (timeline.csv holds the same rows either way).
    timeline_png: bool = True


@dataclass(frozen=True)
class DeterminismSection:
    """Deterministic kernels, fixed intra-op threads, seeds owned by the logical worker."""

    # On by default: Spotline's promise (the same bits whatever the preemptions) needs it
    # on a GPU, where a non-deterministic kernel changes the bits silently. Off, a run says
    # in its summary and last line that it is not bitwise reproducible.
    enabled: bool = True
    intra_op_threads: int = 1  # torch's intra-op threads in each worker process


@dataclass(frozen=True)
class ExportSection:
    """The model a run writes (``output/model``, a ``save_pretrained`` directory)."""

    # The master weights (fp32) cast to this dtype; param_sha256 is over the fp32 ones.
    dtype: ExportDtype = "float32"


@dataclass(frozen=True)
class SpotlineConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    topology: TopologySection = field(default_factory=TopologySection)
    training: TrainingSection = field(default_factory=TrainingSection)
    redundancy: RedundancySection = field(default_factory=RedundancySection)
    elasticity: ElasticitySection = field(default_factory=ElasticitySection)
    checkpoints: CheckpointSection = field(default_factory=CheckpointSection)
    recovery: RecoverySection = field(default_factory=RecoverySection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    determinism: DeterminismSection = field(default_factory=DeterminismSection)
    export: ExportSection = field(default_factory=ExportSection)


@dataclass(frozen=True)
class RunConfig:
    """A whole config file: DeepSpeed's own keys and Spotline's parsed section."""

    deepspeed: dict[str, Any]
    spotline: SpotlineConfig
    source: str

    @property
    def micro_batch_size(self) -> int:
        return int(self.deepspeed["train_micro_batch_size_per_gpu"])

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per pipeline per step (DeepSpeed's gradient accumulation steps)."""
        return int(self.deepspeed["gradient_accumulation_steps"])

    @property
    def precision(self) -> Precision:
        """The compute precision (DeepSpeed's ``bf16`` or ``fp16`` or ``torch_autocast``
        section); the parameters and optimizer state are fp32 whatever it is."""
        return precision_of(self.deepspeed)

    @property
    def bitwise_caveats(self) -> list[str]:
        """Why this run's bits may not be the same run's on another placement or another
        day (empty: the promise holds: the same seed and logical topology give the same
        parameters whatever preemptions, arrivals and rescales happen)."""
        caveats = []
        if not self.spotline.determinism.enabled:
            caveats.append(
                "determinism is off (spotline.determinism.enabled false, --no-deterministic): "
                "a kernel may choose a different reduction order on each run"
            )
        return caveats

    @property
    def loss_scaling(self) -> LossScaling:
        """fp16's loss scaler (DeepSpeed's ``fp16`` keys); no scaling in fp32 and bf16."""
        return loss_scaling_of(self.deepspeed)

    @property
    def activation_checkpoint_interval(self) -> int:
        """Blocks a checkpointed range holds (0: none): ``spotline.model.
        activation_checkpoint_interval``, or DeepSpeed's own key for it,
        ``pipeline.activation_checkpoint_interval`` (``validate`` refuses the two disagreeing)."""
        return self.spotline.model.activation_checkpoint_interval or _deepspeed_checkpoint_interval(
            self.deepspeed
        )

    @property
    def num_stages(self) -> int:
        return self.spotline.topology.stages

    @property
    def num_workers(self) -> int:
        return self.spotline.topology.workers

    @property
    def num_logical_workers(self) -> int:
        """Logical pipelines (EasyScale's logical workers): fixed for the whole run, whatever
        the number of processes; the sampler, the reduction and the seeds count these."""
        logical = self.spotline.elasticity.logical_workers
        return logical if logical is not None else self.num_workers // self.num_stages

    @property
    def num_physical_pipelines(self) -> int:
        """Pipelines the starting processes form (``workers // stages``)."""
        return self.num_workers // self.num_stages

    @property
    def capacity(self) -> Capacity:
        """What one worker holds at most, for the planner (``redundancy.stages_per_worker``,
        replicas counted unless ``redundancy.mode`` is off)."""
        redundancy = self.spotline.redundancy
        return Capacity(redundancy.stages_per_worker, replicas=redundancy.on)

    @property
    def samples_per_step(self) -> int:
        """Samples of one optimizer step: the global batch, fixed by the logical topology."""
        return self.micro_batch_size * self.num_micro_batches * self.num_logical_workers

    def checkpoint_root(self, output: Path) -> Path:
        """Where a run writing to ``output`` keeps its checkpoints (``checkpoints.dir``, or
        ``output/checkpoints``): the coordinator, the workers and the CLI all ask here."""
        shared = self.spotline.checkpoints.dir
        return Path(shared) if shared else output / CHECKPOINTS_DIR

    def to_json(self) -> dict[str, Any]:
        out = copy.deepcopy(self.deepspeed)
        out["spotline"] = dataclasses.asdict(self.spotline)
        return out


# The DeepSpeed keys Spotline needs; everything else in the file is DeepSpeed's to judge.
DEFAULT_DEEPSPEED: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "optimizer": {
        "type": "AdamW",
        # torch_adam: DeepSpeed's fused CPU Adam would JIT-compile for minutes.
        "params": {
            "lr": 1e-3,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.01,
            "torch_adam": True,
        },
    },
    "steps_per_print": 1000000,
    "wall_clock_breakdown": False,
}

# DeepSpeed's schedulers whose rate (and OneCycle's momentum) is a function of the step
# alone, which is what lets every engine, replica and roll-forward agree after a recovery
# (spotline.pipeline.lr_schedule). torch.optim's schedulers keep state of their own.
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
# A recovery moves Adam's state (step, exp_avg, exp_avg_sq) between processes by name.
SUPPORTED_OPTIMIZERS = ("adam", "adamw")
# DeepSpeed features that keep state across steps outside the parameters and optimizer,
# which a recovery would not carry: on, they would change the result after a takeover.
_STATEFUL_FEATURES = {
    "amp": "its loss scaler",
    "curriculum_learning": "its difficulty schedule",
    "data_efficiency": "its sampling and token-dropping state",
    "progressive_layer_drop": "its drop schedule",
    "compression_training": "its compression schedule",
}


def _indivisible_workers(workers: int, stages: int, model: str) -> UserError:
    """``--workers`` not a multiple of ``--stages``: the fix, and when the preset has fewer
    blocks than ``--stages`` that mistake too, at once ("a multiple of 8 workers" alone led
    straight to the model check's "more stages than blocks")."""
    blocks = preset_blocks(model)
    if blocks is not None and stages > blocks:
        fits = max(d for d in range(1, blocks + 1) if workers % d == 0)
        return UserError(
            f"--stages {stages} is more than the model's {blocks} transformer blocks, and "
            f"--workers {workers} is not a multiple of it; use at most {blocks} stages and "
            f"a multiple of that many workers (e.g. --stages {fits} --workers {workers})"
        )
    return UserError(
        f"--workers {workers} is not divisible by --stages {stages}; "
        f"use a multiple of {stages} workers (each pipeline needs one per stage)"
    )


def _check_recoverable(ds: Mapping[str, Any]) -> None:
    """Refuse DeepSpeed keys whose state a recovery cannot carry exactly, naming the key."""
    for key, state in _STATEFUL_FEATURES.items():
        if enabled(ds, key):
            raise UserError(
                f"config key '{key}' is enabled: {state} is state that Spotline cannot carry "
                f"across a recovery exactly; remove '{key}'"
            )
    loss_scaling_of(ds)  # the precision, and fp16's scaler keys
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if stage in (2, 3):
        raise UserError(
            f"config key 'zero_optimization.stage' is {stage}: DeepSpeed's PipelineEngine "
            "refuses ZeRO stages 2 and 3 (they partition gradients during the backward pass, "
            "which pipeline parallelism does not support); use stage 0"
        )
    if stage:
        raise UserError(
            f"config key 'zero_optimization.stage' is {json.dumps(stage)}: ZeRO-1 partitions "
            "the optimizer state over data-parallel ranks, which Spotline's recoveries do "
            "not re-cut yet; set it to 0 or remove 'zero_optimization'"
        )
    optimizer = ds.get("optimizer")
    kind = optimizer.get("type") if isinstance(optimizer, Mapping) else None
    if not isinstance(kind, str) or kind.lower() not in SUPPORTED_OPTIMIZERS:
        raise UserError(
            f"config key 'optimizer.type' is {json.dumps(kind)}: a recovery moves Adam's "
            'optimizer state between processes; use "AdamW" or "Adam"'
        )
    scheduler = ds.get("scheduler")
    if scheduler is None:
        return
    kind = scheduler.get("type") if isinstance(scheduler, Mapping) else None
    if kind not in SUPPORTED_SCHEDULERS:
        raise UserError(
            f"config key 'scheduler.type' is {json.dumps(kind)}: Spotline carries the "
            f"learning rate across recoveries only for DeepSpeed's {', '.join(SUPPORTED_SCHEDULERS)} "
            "(their rate is a function of the step); use one of them"
        )
    params = scheduler.get("params", {})
    if not isinstance(params, Mapping):
        raise UserError(
            f"config key 'scheduler.params' is {json.dumps(params)}; expected an object"
        )
    if "last_batch_iteration" in params:
        raise UserError(
            "config key 'scheduler.params.last_batch_iteration' sets the schedule's position, "
            "which Spotline derives from the step; remove it (continue a run with --resume)"
        )


def _positive(path: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"config key '{path}' is {value}; expected a positive integer")


def _check_capacity(redundancy: RedundancySection) -> None:
    """``redundancy.stages_per_worker``: at least 1, and 2 with redundancy on (a worker holds
    its own stage and its successor's replica)."""
    stages = redundancy.stages_per_worker
    if stages < 1:
        raise UserError(
            f"config key 'spotline.redundancy.stages_per_worker' is {stages}; expected an "
            "integer >= 1 (logical stages one worker holds, its own and its replicas)"
        )
    if stages < 2 and redundancy.on:
        raise UserError(
            f"config key 'spotline.redundancy.stages_per_worker' is {stages} but redundancy "
            f"mode {redundancy.mode!r} keeps a replica beside each worker's own stage; use at "
            "least 2, or set 'spotline.redundancy.mode' to \"off\""
        )


def _check_evaluation(evaluation: EvaluationSection) -> None:
    """``spotline.evaluation``: one eval set (a file or a held-out fraction), a fraction
    strictly between 0 and 1, positive counts, and no interval or limit without a set."""
    where = "spotline.evaluation"
    fraction = evaluation.holdout_fraction
    if evaluation.data is not None and fraction is not None:
        raise UserError(
            f"config keys '{where}.data' and '{where}.holdout_fraction' are both set; "
            "evaluate on a file (--eval-data) or on a held-out fraction (--eval-holdout), not both"
        )
    if fraction is not None and not 0.0 < fraction < 1.0:
        raise UserError(
            f"config key '{where}.holdout_fraction' is {fraction}; expected a number between "
            "0 and 1 (exclusive): the share of the training rows held out for evaluation"
        )
    _positive(f"{where}.interval_steps", evaluation.interval_steps)
    _positive(f"{where}.max_samples", evaluation.max_samples)
    if not evaluation.enabled:
        for key, value in (
            ("interval_steps", evaluation.interval_steps),
            ("max_samples", evaluation.max_samples),
        ):
            if value is not None:
                raise UserError(
                    f"config key '{where}.{key}' is set but there is no evaluation set; set "
                    f"'{where}.data' (--eval-data) or '{where}.holdout_fraction' (--eval-holdout)"
                )


def _deepspeed_checkpoint_interval(ds: Mapping[str, Any]) -> int:
    pipeline = ds.get("pipeline")
    value = (
        pipeline.get("activation_checkpoint_interval", 0) if isinstance(pipeline, Mapping) else 0
    )
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UserError(
            f"config key 'pipeline.activation_checkpoint_interval' is {json.dumps(value)}; "
            "expected a whole number of blocks (0: no activation checkpointing)"
        )
    return value


def _check_checkpoint_interval(cfg: RunConfig) -> None:
    ours = cfg.spotline.model.activation_checkpoint_interval
    theirs = _deepspeed_checkpoint_interval(cfg.deepspeed)
    if ours < 0:
        raise UserError(
            f"config key 'spotline.model.activation_checkpoint_interval' is {ours}; expected "
            "a whole number of blocks (0: no activation checkpointing)"
        )
    if ours and theirs and ours != theirs:
        raise UserError(
            f"config keys 'spotline.model.activation_checkpoint_interval' ({ours}) and "
            f"'pipeline.activation_checkpoint_interval' ({theirs}) disagree; set one of them"
        )


def _check_memory_limit(limit: float | None) -> None:
    if limit is not None and not limit > 0:
        raise UserError(
            f"config key 'spotline.topology.memory_per_slot_gb' is {limit}; expected a "
            "positive number of GiB (or remove it: no limit)"
        )


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that need the whole config; raise UserError on the first problem."""
    sl = cfg.spotline
    ds = cfg.deepspeed
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = ds.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(
                f"config key '{key}' is {json.dumps(value)}; expected a positive integer"
            )
    _positive("spotline.topology.stages", sl.topology.stages)
    _positive("spotline.topology.workers", sl.topology.workers)
    _positive("spotline.topology.start_workers", sl.topology.start_workers)
    start = sl.topology.start_workers
    if start is not None and start > sl.topology.workers:
        raise UserError(
            f"--start-workers {start} is more than --workers {sl.topology.workers}; the run "
            f"starts with at most its workers (use 1 to {sl.topology.workers})"
        )
    _check_memory_limit(sl.topology.memory_per_slot_gb)
    _check_checkpoint_interval(cfg)
    _positive("spotline.training.steps", sl.training.steps)
    _positive("spotline.model.seq_len", sl.model.seq_len)
    _positive("spotline.elasticity.logical_workers", sl.elasticity.logical_workers)
    _positive("spotline.determinism.intra_op_threads", sl.determinism.intra_op_threads)
    _positive("spotline.checkpoints.keep", sl.checkpoints.keep)
    _positive("spotline.recovery.max_workers", sl.recovery.max_workers)
    parse_rescales(sl.elasticity.rescale)  # its form only; the CLI checks it against the run
    _check_capacity(sl.redundancy)
    if sl.redundancy.replica == "sharded" and sl.redundancy.mode == "eager":
        raise UserError(
            "config key 'spotline.redundancy.replica' is \"sharded\" but redundancy mode "
            '"eager" runs the successor\'s forward, which needs all its parameters; use '
            'mode "lazy" or replica "full"'
        )
    _check_evaluation(sl.evaluation)
    if sl.elasticity.rebalance_every < 0:
        raise UserError(
            "config key 'spotline.elasticity.rebalance_every' is negative; use 0 (rebalance "
            "only when processes change) or a step count"
        )
    if not (sl.elasticity.slow_factor >= 1.0):
        raise UserError(
            f"config key 'spotline.elasticity.slow_factor' is {sl.elasticity.slow_factor}; "
            "expected a number >= 1 (how many times slower the slow worker computes)"
        )
    if sl.recovery.warm_workers < 0:
        raise UserError(
            "config key 'spotline.recovery.warm_workers' is negative; use 0 (arrivals start "
            "cold) or a count of processes to start ahead"
        )
    if sl.recovery.no_progress_timeout_s < 0:
        raise UserError(
            "config key 'spotline.recovery.no_progress_timeout_s' is negative; use 0 (never "
            "stop) or the seconds without a committed step after which a run stops"
        )
    if sl.checkpoints.interval_steps < 0:
        raise UserError(
            "config key 'spotline.checkpoints.interval_steps' is negative; use 0 (never) or a step count"
        )
    if sl.topology.workers % sl.topology.stages != 0:
        raise _indivisible_workers(sl.topology.workers, sl.topology.stages, sl.model.name)
    logical = sl.elasticity.logical_workers
    if logical is not None and logical < cfg.num_physical_pipelines:
        # One rule for both entry points (spotline train and DeepSpeed's launcher): a
        # pipeline with no logical worker would idle, and DeepSpeed's launcher cannot keep a
        # process out of the job as a standby.
        raise UserError(
            f"--logical-workers {logical} is fewer than the {cfg.num_physical_pipelines} "
            f"pipelines that {sl.topology.workers} worker processes form with {sl.topology.stages} "
            f"stage(s); use at least {cfg.num_physical_pipelines} logical workers or "
            f"{logical * sl.topology.stages} worker processes"
        )
    if "train_batch_size" in ds:
        expected = cfg.samples_per_step
        if ds["train_batch_size"] != expected:
            raise UserError(
                f"config key 'train_batch_size' is {ds['train_batch_size']} but micro-batch "
                f"{cfg.micro_batch_size} x gradient_accumulation_steps {cfg.num_micro_batches} x "
                f"{cfg.num_logical_workers} pipelines is {expected}; remove train_batch_size or make it {expected}"
            )
    _check_recoverable(ds)
    if "elasticity" in ds:
        raise UserError(
            "config key 'elasticity' is DeepSpeed's removed elastic feature; "
            "move elastic settings to 'spotline.elasticity'"
        )


def parse_config(raw: Mapping[str, Any], source: str = "<built-in default>") -> RunConfig:
    """Parse a DeepSpeed config dict with an optional ``"spotline"`` section."""
    if not isinstance(raw, Mapping):
        raise UserError(f"config {source}: the top level must be a JSON object")
    deepspeed_keys = copy.deepcopy({k: v for k, v in raw.items() if k != "spotline"})
    merged = copy.deepcopy(DEFAULT_DEEPSPEED)
    merged.update(deepspeed_keys)
    section = raw.get("spotline", {})
    if not isinstance(section, Mapping):
        raise UserError(f"config key 'spotline' is {json.dumps(section)}; expected an object")
    spotline = parse_section("spotline", section, SpotlineConfig)
    cfg = RunConfig(deepspeed=merged, spotline=spotline, source=source)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None) -> RunConfig:
    """Read and validate a config file; ``None`` gives the built-in default."""
    if path is None:
        return parse_config({})
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file '{p}' does not exist; pass an existing JSON file to --config")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(
            f"config file '{p}' is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    return parse_config(raw, source=str(p))


def with_overrides(cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """Apply ``{"section.key": value}`` overrides (from CLI flags) and re-validate.

    Flags override the file: the override goes through the same parser, so a flag value
    is checked exactly like a value written in the config.
    """
    raw = cfg.to_json()
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return parse_config(raw, source=cfg.source)
