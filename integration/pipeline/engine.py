"""Spotline's subclass of DeepSpeed's ``PipelineEngine`` and how to construct it.

``deepspeed.initialize()`` hard-codes the pipeline engine class, so :func:`build_engine`
repeats what ``initialize`` does for a ``PipelineModule`` (a ``DeepSpeedConfig`` built with
the module's grid, the optimizer flags, the same constructor arguments) with a class of our
choosing. Everything else is DeepSpeed's own engine.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed import set_optimizer_flags
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.schedule import PipeInstruction

from spotline.config_precision import precision_of
from spotline.exact.reduction import LogicalGradients
from spotline.pipeline.clipping import apply_clip, clip_coefficient, per_layer_sq_norms
from spotline.pipeline.loss_scaling import LossScaler, has_overflow, job_overflow, unscale
from spotline.pipeline.lr_schedule import StepSchedule
from spotline.plan import pipe_instructions as pi
from spotline.plan.loss_scale import NO_SCALING, LossScaleState, LossScaling
from spotline.plan.lowering import lower_logical_step
from spotline.plan.pipe_instructions import GradPart
from spotline.plan.schedule import Schedule, num_pipe_buffers, train_schedule
from spotline.runtime import derive_seed, reseed_torch, seed_logical_worker

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RngContext:
    """Who owns the randomness of the forward pass being run: (seed, step, worker, micro-batch).

    Dropout masks are drawn from a generator seeded by this context and the global layer
    index, so they do not depend on which process runs the layer, how many forwards that
    process ran before, or how the layers are partitioned into stages.
    """

    seed: int
    step: int
    logical_worker: int
    micro_batch: int


# The plan's type for each of DeepSpeed's own instructions, and DeepSpeed's class: the
# engine runs them with the handler DeepSpeed's own map names (or its override).
_DEEPSPEED_CLASSES: dict[type[pi.Instruction], type[PipeInstruction]] = {
    pi.LoadMicroBatch: ds_schedule.LoadMicroBatch,
    pi.ForwardPass: ds_schedule.ForwardPass,
    pi.BackwardPass: ds_schedule.BackwardPass,
    pi.SendActivation: ds_schedule.SendActivation,
    pi.RecvActivation: ds_schedule.RecvActivation,
    pi.SendGrad: ds_schedule.SendGrad,
    pi.RecvGrad: ds_schedule.RecvGrad,
    pi.ReduceTiedGrads: ds_schedule.ReduceTiedGrads,
    pi.ReduceGrads: ds_schedule.ReduceGrads,
    pi.OptimizerStep: ds_schedule.OptimizerStep,
}
assert set(_DEEPSPEED_CLASSES) == set(pi.DEEPSPEED_INSTRUCTIONS)

# What DeepSpeed's ``_exec_schedule`` calls for an instruction: a function of the engine and
# the instruction's kwargs (it binds the function to the engine itself, with MethodType).
Handler = Callable[..., None]


@dataclass(frozen=True)
class StepScale:
    """The loss scaler before a step, and whether the job's overflow skipped the step."""

    state: LossScaleState
    skipped: bool

    @property
    def scale(self) -> float:
        return self.state.scale


class LoweredSchedule:
    """One optimizer step for one pipeline position, in the shape ``_exec_schedule`` runs:
    ``lower_logical_step`` of a plan Schedule, lowered once per (engine, number of hosted
    logical workers); each step a list of typed instructions (``spotline.plan.pipe_instructions``),
    which DeepSpeed dispatches by type and calls with their ``kwargs``."""

    def __init__(
        self,
        schedule: Schedule,
        position: int,
        num_hosted: int,
        *,
        send_untied_early: bool = False,
        stream_untied: bool = False,
    ) -> None:
        self.schedule = schedule
        self.position = position
        self._steps = lower_logical_step(
            schedule,
            position,
            num_hosted,
            send_untied_early=send_untied_early,
            stream_untied=stream_untied,
        )

    def num_pipe_buffers(self) -> int:
        return num_pipe_buffers(
            self.schedule.num_stages, self.schedule.num_micro_batches, self.position
        )

    def instruction_types(self) -> set[type[pi.Instruction]]:
        """The types of the instructions it holds (each needs a handler)."""
        return {type(instruction) for step in self._steps for instruction in step}

    def __iter__(self) -> Iterator[list[pi.Instruction]]:
        return iter(self._steps)


def untied_prefix(params: Sequence[tuple[str, int]], tied: Collection[str]) -> int | None:
    """How many flat gradient elements (``params``: names and sizes, in order) come before a
    stage's tied copies, where those follow all its other parameters (the last stage's LM
    head): the gradients already final while the tied reduction waits. None where no such
    split exists: no tied parameter, only tied ones, or tied ones among the others."""
    flags = [name in tied for name, _ in params]
    if True not in flags:
        return None
    first = flags.index(True)
    if first == 0 or not all(flags[first:]):
        return None
    return sum(numel for _, numel in params[:first])


def streamed_layers(
    params: Sequence[tuple[str, int]], tied: Collection[str]
) -> list[tuple[int, int]]:
    """The flat gradient spans of a stage's layers that may be sent as a backward pass
    makes them final (``params``: names ``"<global layer>.<path>"`` and sizes, in order):
    every layer after the last one that holds a tied parameter, one span a layer, last
    layer first (the order backward finishes them). Empty where the stage's last layer
    holds a tied parameter (the last stage's LM head)."""
    layers: list[tuple[str, int, int, bool]] = []  # (layer, start, stop, holds a tied one)
    offset = 0
    for name, numel in params:
        layer = name.split(".", 1)[0]
        if layers and layers[-1][0] == layer:
            _, start, _, holds = layers[-1]
            layers[-1] = (layer, start, offset + numel, holds or name in tied)
        else:
            layers.append((layer, offset, offset + numel, name in tied))
        offset += numel
    tied_at = [i for i, (_, _, _, holds) in enumerate(layers) if holds]
    after = layers[tied_at[-1] + 1 :] if tied_at else layers
    return [(start, stop) for _, start, stop, _ in reversed(after) if stop > start]


def replica_messages(
    params: Sequence[tuple[str, int]], tied: Collection[str], *, streamed: bool
) -> list[tuple[int, int]]:
    """The flat spans, in send order, of the messages in which a stage sends its reduced
    gradients to its replica holder; the holder posts its receives for the same spans.
    ``streamed``: one a layer of ``streamed_layers`` during the last backward pass, then
    the rest; else the gradients before a tied suffix and the suffix (``untied_prefix``),
    or one message."""
    numel = sum(n for _, n in params)
    if streamed:
        layers = streamed_layers(params, tied)
        first = layers[-1][0] if layers else numel
        spans = [*layers, (0, first)]
    else:
        split = untied_prefix(params, tied)
        spans = [(0, numel)] if split is None else [(0, split), (split, numel)]
    return [(start, stop) for start, stop in spans if stop > start]


@dataclass(frozen=True)
class TiedPair:
    """A tied copy (e.g. the LM head's embedding) and the parameter it copies, by global name."""

    original: str
    copy: str
    original_layer: int
    copy_layer: int


class SpotlinePipelineEngine(PipelineEngine):  # type: ignore[misc]  # DeepSpeed is untyped
    """DeepSpeed's pipeline engine with placement-independent math.

    What the subclass adds: a per-layer RNG reseed from :class:`RngContext` before every
    layer's forward (also during activation-checkpoint recomputation, which re-runs forwards
    inside the backward pass); logical workers (EasyScale): a pipeline hosts one or more of
    the job's ``num_logical_workers`` logical pipelines and runs them in turn
    (``lower_logical_step``); the data-parallel reduction replaced by the exact one
    over logical workers (``spotline.exact.reduction``), the loss reduced over logical workers in
    their order, tied copies kept as separate parameters, and clipping by the global norm
    over logical layers; in fp16, the loss scale's overflow decision taken over the whole
    job (``spotline.pipeline.loss_scaling``). None of it depends on how many processes run
    the job.
    """

    # DeepSpeedEngine's fp16 scaler under torch_autocast (set in its constructor).
    torch_autocast_z0_gradscaler: Any

    def __init__(self, *args: Any, loss_scaling: LossScaling = NO_SCALING, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The scaler's state before the step in progress (moved in by a generation's load).
        self.loss_scaler = LossScaler(loss_scaling)
        if loss_scaling.enabled:
            # DeepSpeed made a torch GradScaler for fp16 under torch_autocast, which would
            # skip steps on each stage's own overflow: ours takes its place (a pinned seam,
            # spotline.patches.deepspeed_seams).
            assert self.torch_autocast_z0_gradscaler is not None, "fp16 runs under torch_autocast"
            self.torch_autocast_z0_gradscaler = self.loss_scaler
        self._update_prepared = False
        # The scaler the last step ran with, and whether the job's overflow skipped it.
        self.stepped_with = StepScale(self.loss_scaler.state, skipped=False)
        # This engine's own map, read by DeepSpeed's ``_exec_schedule`` (``self.``, so the
        # instance's shadows the class's): built here, from this class's handlers.
        self._INSTRUCTION_MAP = self.instruction_handlers()
        self.rng_seed = 0
        self.rng_step = 0
        self.rng_logical_worker = self.grid.data_parallel_id
        self._num_forwards = 0
        self._num_backwards = 0
        self._rng_micro_batch = 0
        self.last_clip_coefficient = 1.0
        self._loss_before_commit: torch.Tensor | None = None
        # The rate of every step as a function of the step (spotline.pipeline.lr_schedule), so that an
        # engine built mid-run, a replica and a roll-forward all use the undisturbed run's.
        self.step_schedule = StepSchedule.of_engine(self)
        self._index_tied_copies()
        self._install_rng_hooks()
        # The plan of one logical worker's micro-batches; subclasses derive their own.
        self._plan = train_schedule(self.num_stages, self.micro_batches)
        self._lowered: dict[int, LoweredSchedule] = {}
        # Called with (logical worker, seconds its share of the step took on this rank) as
        # each hosted logical worker finishes: speed measurement (and the slow-worker demo).
        self.on_logical_worker_done: Callable[[int, float], None] | None = None
        self._logical_t0 = 0.0
        self.batch_source: Callable[[int, int, int], Batch] | None = None
        # Without a placement from the caller: one logical worker per pipeline.
        self.set_logical_workers(
            self.grid.get_data_parallel_world_size(), (self.grid.data_parallel_id,)
        )

    @classmethod
    def instruction_handlers(cls) -> dict[type, Handler]:
        """The handler of every instruction an engine of this class runs, by type.

        DeepSpeed's own classes (its ``eval_batch`` runs an ``InferenceSchedule`` of them)
        and the plan's types for them, each with the handler DeepSpeed's map names, looked
        up on ``cls`` (Trap: DeepSpeed's map holds ``PipelineEngine``'s own functions, so
        an override would never run from it); then Spotline's instructions. A subclass with
        instructions of its own adds them to this method's result.
        """
        base: dict[type, Handler] = PipelineEngine._INSTRUCTION_MAP
        deepspeed = {kind: getattr(cls, handler.__name__) for kind, handler in base.items()}
        return {
            **deepspeed,
            **{ours: deepspeed[theirs] for ours, theirs in _DEEPSPEED_CLASSES.items()},
            pi.BeginLogicalWorker: cls._exec_begin_logical_worker,
            pi.KeepLogicalGradients: cls._exec_keep_logical_gradients,
        }

    # -- logical workers ----------------------------------------------------------------
    def set_logical_workers(self, num_logical_workers: int, hosted: tuple[int, ...]) -> None:
        """Host the logical workers ``hosted`` (ids in ``0..num_logical_workers-1``) from the
        next step on. Every pipeline of the job must be told, and together they must host
        each logical worker exactly once (``spotline.plan.logical`` decides who runs which)."""
        if not hosted or list(hosted) != sorted(set(hosted)):
            raise ValueError(f"hosted logical workers must be distinct ids in order, got {hosted}")
        if hosted[-1] >= num_logical_workers or hosted[0] < 0:
            raise ValueError(f"hosted {hosted} not in 0..{num_logical_workers - 1}")
        self.num_logical_workers = num_logical_workers
        self.hosted_logical_workers = tuple(hosted)
        trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        # fp16: an overflowed sum is the loss scaler's to skip, not an error.
        self.logical_gradients = LogicalGradients(
            [p for _, p in trainable],
            num_logical_workers,
            finite_only=not self.loss_scaler.scaling.enabled,
        )
        # Names and sizes of those parameters, in that order (the replica's messages too).
        sizes = self.gradient_sizes = [(n, p.numel()) for n, p in trainable]
        # ``untied_prefix`` of those same parameters (``LogicalGradients``' order), found with
        # them, not at every end-of-step instruction.
        self.untied_elements = untied_prefix(sizes, self.tied_names)
        # And the layers stage 0 may send during its last backward pass (streamed_layers).
        self.streamed_layers = streamed_layers(sizes, self.tied_names)
        self._logical_losses: dict[int, torch.Tensor] = {}

    def _train_schedule(self) -> LoweredSchedule:
        num_hosted = len(self.hosted_logical_workers)
        if num_hosted not in self._lowered:
            self._lowered[num_hosted] = LoweredSchedule(
                self._plan,
                self.stage_id,
                num_hosted,
                send_untied_early=self._sends_untied_early(),
                stream_untied=self._streams_untied(),
            )
            # Refused here, before the step runs, not by DeepSpeed halfway through it.
            missing = self._lowered[num_hosted].instruction_types() - set(self._INSTRUCTION_MAP)
            assert not missing, f"{type(self).__name__} has no handler for {missing}"
        return self._lowered[num_hosted]

    def _sends_untied_early(self) -> bool:
        """Whether the step's last logical worker reduces and sends its untied gradients
        before the tied reduction (``lower_logical_step``): only a stage that sends
        its gradients to a replica does (a subclass's)."""
        return False

    def _streams_untied(self) -> bool:
        """Whether the step's last logical worker keeps, reduces and sends its untied
        gradients layer by layer during its last backward pass (``StreamUntiedGrads``):
        only stage 0 of a subclass that sends its gradients to a replica does."""
        return False

    def grad_span(self, part: GradPart) -> tuple[int, int]:
        """The flat gradient elements (``LogicalGradients``' order) ``part`` covers."""
        numel = self.logical_gradients.numel
        if part is GradPart.ALL:
            return (0, numel)
        if self._streams_untied():
            # The streamed layers follow the tied ones: the tied part is the prefix.
            first = self.streamed_layers[-1][0]
            return (first, numel) if part is GradPart.UNTIED else (0, first)
        split = self.untied_elements
        assert split is not None, f"{part.name} on a stage without a tied suffix"
        return (0, split) if part is GradPart.UNTIED else (split, numel)

    def train_step(self, *, seed: int, step: int) -> float:
        """Run optimizer step ``step`` for every hosted logical worker; returns the mean loss
        over all logical workers of the job (the same on every rank)."""
        assert self.batch_source is not None, "set engine.batch_source before training"
        source = self.batch_source
        self.begin_step(seed=seed, step=step, logical_worker=self.hosted_logical_workers[0])
        batches = (
            source(step, worker, micro_batch)
            for worker in self.hosted_logical_workers
            for micro_batch in range(self.micro_batches)
        )
        return float(self.train_batch(data_iter=batches))

    def evaluate(
        self,
        batches: Iterable[Batch],
        num_micro_batches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Forward ``num_micro_batches`` micro-batches through the pipeline without
        training: the last stage returns ``loss_fn(logits, labels)`` of each, in order;
        other stages an empty list.

        DeepSpeed's ``eval_batch`` (its InferenceSchedule, no grad, dropout off) with no
        reduction of its own: the caller reduces exactly (``spotline.worker.validator``).
        Collective over the job (``eval_batch`` opens with a barrier): every rank calls it,
        a pipeline given nothing to do with 0. Training is unchanged by it: every step
        reseeds every generator before it draws (``begin_step``, the per-layer hooks) and
        resets the loss it keeps; the module is back in train mode on return."""
        module: PipelineModule = self.module
        training_loss = module.loss_fn
        module.loss_fn = loss_fn
        try:
            outputs = self.eval_batch(
                iter(batches),
                compute_loss=True,
                reduce_output=None,  # each micro-batch's loss_fn output, on the last stage
                bcast_loss=False,
                num_micro_batches=num_micro_batches,
            )
        finally:
            module.loss_fn = training_loss
            module.train()
        return list(outputs) if self.is_last_stage() else []

    def _exec_begin_logical_worker(self, index: int) -> None:
        self.rng_logical_worker = self.hosted_logical_workers[index]
        # numpy and Python's random too (torch is reseeded per layer as well): anything a
        # layer or loss draws belongs to the logical worker.
        seed_logical_worker(self.rng_seed, self.rng_step, self.rng_logical_worker)
        # 1F1B runs each logical worker's forwards, and its backwards, in micro-batch order.
        self._num_forwards = 0
        self._num_backwards = 0
        self.total_loss = None
        self._logical_t0 = time.perf_counter()

    def _exec_keep_logical_gradients(self, index: int, part: GradPart = GradPart.ALL) -> None:
        worker = self.hosted_logical_workers[index]
        # The step's last logical worker: ReduceGrads follows and replaces the gradients
        # with views of the sum (a failed step is run again by a new engine, on fresh
        # gradients), so they need no zeroing.
        last = index == len(self.hosted_logical_workers) - 1
        self.logical_gradients.keep(worker, zero=not last, span=self.grad_span(part))
        if part is GradPart.UNTIED:
            return  # the worker's loss and time are recorded with its last part
        if self.is_last_stage():
            assert self.total_loss is not None
            # DeepSpeed's own scaling of the summed micro-batch losses (divided by their count).
            self._logical_losses[worker] = self._scale_loss_by_gas(self.total_loss.detach())
            self.total_loss = None
        if self.on_logical_worker_done is not None:
            self.on_logical_worker_done(worker, time.perf_counter() - self._logical_t0)

    def _exec_reduce_grads(self, part: GradPart = GradPart.ALL) -> None:
        """The exact mean over every logical worker of the job (replaces DeepSpeed's float
        all-reduce, whose result depends on how many processes take part)."""
        self.logical_gradients.reduce(
            group=self.grid.get_data_parallel_group(), span=self.grad_span(part)
        )

    def _aggregate_total_loss(self) -> torch.Tensor:
        """The step's loss, as DeepSpeed's ``train_batch`` asks for it after the schedule:
        the one :meth:`aggregate_loss_before_commit` computed, when it did."""
        if self._loss_before_commit is not None:
            loss, self._loss_before_commit = self._loss_before_commit, None
            return loss
        return self._step_loss()

    def aggregate_loss_before_commit(self) -> None:
        """Compute the step's loss now, before the step's commit point: DeepSpeed sends it to
        every stage only after the optimizer step, so a rank lost just after the commit took
        the only copy of a committed step's loss with it (the survivors, failing in that
        send, never returned it). Computed here, every rank that passes the commit holds it."""
        self._loss_before_commit = self._step_loss()

    def _step_loss(self) -> torch.Tensor:
        """The step's loss: each logical worker's mean over its micro-batches, added in
        logical-worker order and divided by their number, then sent to every stage."""
        group = self.grid.get_pipe_parallel_group()
        last = self.grid.stage_to_global(stage_id=self.num_stages - 1)
        if self.is_last_stage():
            by_worker = torch.zeros(self.num_logical_workers, dtype=torch.float32)
            for worker, loss in self._logical_losses.items():
                by_worker[worker] = loss.float()
            # Each entry is non-zero on one process only: adding zeros is exact.
            dist.all_reduce(by_worker, group=self.grid.get_data_parallel_group())
            total = by_worker[0].clone()
            for worker in range(1, self.num_logical_workers):
                total = total + by_worker[worker]
            loss = total / self.num_logical_workers if self.num_logical_workers > 1 else total
            self._logical_losses = {}
            out = torch.stack([loss, loss])
        else:
            out = torch.zeros(2, dtype=torch.float32)
        if self.num_stages > 1:
            dist.broadcast(out, src=last, group=group)
        self.dp_group_loss = out[0].clone()
        return out[1].clone()

    # -- randomness -------------------------------------------------------------------
    def _install_rng_hooks(self) -> None:
        module: PipelineModule = self.module
        for local_idx, layer in enumerate(module.forward_funcs):
            if isinstance(layer, torch.nn.Module):
                layer_idx = module._local_start + local_idx
                layer.register_forward_pre_hook(self._make_reseed_hook(layer_idx))

    def _make_reseed_hook(self, layer_idx: int) -> Callable[..., None]:
        def reseed(_module: torch.nn.Module, _inputs: Any) -> None:
            reseed_torch(
                derive_seed(
                    self.rng_seed,
                    self.rng_step,
                    self.rng_logical_worker,
                    self._rng_micro_batch,
                    layer_idx,
                )
            )

        return reseed

    def begin_step(self, *, seed: int, step: int, logical_worker: int) -> None:
        """Set the owner of this step's randomness; call before ``train_batch``."""
        self.rng_seed = seed
        self.rng_step = step
        self.rng_logical_worker = logical_worker
        self.step_schedule.apply(
            self.optimizer.param_groups, self.loss_scaler.state.schedule_position(step)
        )
        self._num_forwards = 0
        self._num_backwards = 0
        self._update_prepared = False

    # -- tied weights ---------------------------------------------------------------------
    def _index_tied_copies(self) -> None:
        """Find tied copies (layers whose class declares ``tied_to``) and build their groups.

        A tied copy is a separate parameter kept equal to its original: the two gradients
        are added once per step (``ReduceTiedGrads``), locally when one rank holds both
        layers, by an all-reduce of two ranks otherwise. Both add the same two numbers, so
        the bits do not depend on the placement (DeepSpeed's TiedLayerSpec instead shares
        one parameter when both layers sit on one stage, and autograd then adds the two
        gradients per micro-batch, which rounds differently).
        """
        module: PipelineModule = self.module
        self.tied_pairs: list[TiedPair] = []
        for layer_idx, spec in enumerate(module._layer_specs):
            for path, (orig_layer, orig_path) in getattr(spec.typename, "tied_to", {}).items():
                self.tied_pairs.append(
                    TiedPair(
                        f"{orig_layer}.{orig_path}", f"{layer_idx}.{path}", orig_layer, layer_idx
                    )
                )
        self.tied_copy_names = {pair.copy for pair in self.tied_pairs}
        # Both sides of every pair, by global name (the replica's parameters use them too).
        self.tied_names = {name for pair in self.tied_pairs for name in (pair.original, pair.copy)}
        self._tied_groups: dict[str, Any] = {}
        for pair in self.tied_pairs:
            stage_a = self.stage_of_layer(pair.original_layer)
            stage_b = self.stage_of_layer(pair.copy_layer)
            if stage_a == stage_b:
                continue
            # new_group is collective: every rank creates every pipeline's group, in order.
            for data_id in range(self.grid.get_data_parallel_world_size()):
                ranks = sorted(
                    {
                        self.grid.stage_to_global(stage_a, data=data_id),
                        self.grid.stage_to_global(stage_b, data=data_id),
                    }
                )
                group = dist.new_group(ranks=ranks)
                if data_id == self.grid.data_parallel_id:
                    self._tied_groups[pair.copy] = group

    def stage_of_layer(self, layer_idx: int) -> int:
        parts = self.module.parts
        for stage in range(self.num_stages):
            if parts[stage] <= layer_idx < parts[stage + 1]:
                return stage
        raise AssertionError(f"layer {layer_idx} is in no stage (parts {parts})")

    def _exec_reduce_tied_grads(self) -> None:
        params = dict(self.module.named_parameters())
        for pair in self.tied_pairs:
            if pair.original in params and pair.copy in params:
                summed = params[pair.original].grad + params[pair.copy].grad
                params[pair.original].grad.copy_(summed)
                params[pair.copy].grad.copy_(summed)
            elif pair.original in params or pair.copy in params:
                held = params[pair.original] if pair.original in params else params[pair.copy]
                dist.all_reduce(held.grad, group=self._tied_groups[pair.copy])

    # -- the update: loss scale, clipping -------------------------------------------------
    def prepare_update(self) -> None:
        """What the step's update needs from other ranks, once per step, before the commit:
        in fp16 the job's overflow decision and the gradients unscaled (none touched when
        the step is skipped), then clipping by the global norm."""
        if self._update_prepared:
            return
        self._update_prepared = True
        self.last_clip_coefficient = 1.0
        scaler = self.loss_scaler
        if scaler.scaling.enabled:
            grads = [p.grad for p in self.module.parameters()]
            group = self.grid.get_pipe_parallel_group() if self.num_stages > 1 else None
            scaler.overflow = job_overflow(has_overflow(grads), group)
            if not scaler.overflow:
                unscale(grads, scaler.inverse)
        if self.gradient_clipping() > 0 and not scaler.overflow:
            self._clip_by_global_norm()

    def clip_fp32_gradients(self) -> None:
        """DeepSpeed calls this from ``_take_model_step`` when ``gradient_clipping > 0``:
        done already, before the commit (:meth:`prepare_update`)."""
        self.prepare_update()

    def _exec_optimizer_step(self, lr_kwargs: Any = None) -> None:
        self.prepare_update()
        self.stepped_with = StepScale(self.loss_scaler.state, self.loss_scaler.overflow)
        super()._exec_optimizer_step(lr_kwargs)

    def _clip_by_global_norm(self) -> None:
        """Clip by the global norm over logical layers (replaces DeepSpeed's stage-0-only norm),
        after the tied and data-parallel reductions, so every pipeline computes the same value.
        """
        module = self.module
        values = per_layer_sq_norms(
            ((name, p.grad) for name, p in module.named_parameters()),
            num_layers=len(module._layer_specs),
            owned_layers=range(module._local_start, module._local_stop),
            skip=self.tied_copy_names,
        )
        if self.num_stages > 1:
            # Exact whatever the reduction order: each entry is non-zero on one rank only.
            dist.all_reduce(values, group=self.grid.get_pipe_parallel_group())
        self.last_clip_coefficient = clip_coefficient(values, self.gradient_clipping())
        apply_clip((p.grad for p in module.parameters()), self.last_clip_coefficient)

    def _exec_forward_pass(self, buffer_id: int) -> None:
        # 1F1B runs each stage's forwards, and its backwards, in micro-batch order.
        self._rng_micro_batch = self._num_forwards
        self._num_forwards += 1
        super()._exec_forward_pass(buffer_id)

    def _exec_backward_pass(self, buffer_id: int) -> None:
        # Activation checkpointing recomputes forwards here: same context as the forward.
        self._rng_micro_batch = self._num_backwards
        self._num_backwards += 1
        super()._exec_backward_pass(buffer_id)


def deepspeed_config_for(run_ds: dict[str, Any], *, num_physical_pipelines: int) -> dict[str, Any]:
    """The DeepSpeed config dict for an engine: Spotline's keys removed, batch size derived,
    the precision as DeepSpeed's ``torch_autocast`` (``spotline.config.Precision``)."""
    ds = copy.deepcopy(run_ds)
    ds.pop("spotline", None)
    precision = precision_of(ds)
    # DeepSpeed's bf16 and fp16 sections would wrap the optimizer in BF16_Optimizer or
    # FP16_Optimizer (half-precision parameters, the fp32 master partitioned by the physical
    # data-parallel group); Spotline keeps the fp32 parameters as the master and autocasts
    # the compute instead (fp16's scaler: SpotlinePipelineEngine's loss_scaling).
    for key in ("bf16", "bfloat16", "fp16"):
        ds.pop(key, None)
    if precision != "fp32":
        ds["torch_autocast"] = {
            **ds.get("torch_autocast", {}),
            "enabled": True,
            "dtype": "bfloat16" if precision == "bf16" else "float16",
        }
    ds["train_batch_size"] = (
        ds["train_micro_batch_size_per_gpu"]
        * ds["gradient_accumulation_steps"]
        * num_physical_pipelines
    )
    return ds


def build_engine(
    module: PipelineModule,
    ds_config: dict[str, Any],
    engine_cls: type[PipelineEngine] = SpotlinePipelineEngine,
    **engine_kwargs: Any,
) -> PipelineEngine:
    """Construct ``engine_cls`` exactly as ``deepspeed.initialize`` constructs its pipeline engine."""
    mpu = module.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    set_optimizer_flags(config_class, module)
    engine = engine_cls(
        args=None,
        model=module,
        optimizer=None,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        training_data=None,
        lr_scheduler=None,
        mpu=mpu,
        dist_init_required=False,
        collate_fn=None,
        config=ds_config,
        config_class=config_class,
        **engine_kwargs,
    )
    return engine


def step_batches(
    get_batch: Callable[[int, int, int], Batch],
    *,
    step: int,
    logical_worker: int,
    num_micro_batches: int,
) -> Iterator[Batch]:
    """The micro-batches one pipeline consumes in one step, in micro-batch order.

    The first and the last stage each pull all of them (inputs and labels respectively).
    """
    for micro_batch in range(num_micro_batches):
        yield get_batch(step, logical_worker, micro_batch)
