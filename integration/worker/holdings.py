"""What a worker holds between generations, and the forms it travels in.

A generation's engine is dropped when the generation ends; what survives is plain tensors:
each logical stage this worker ran or held a replica of (:class:`StageState`: parameters
and AdamW state by global parameter name, the number of steps applied, and the final
gradients of the step in progress when it got past the commit barrier), together its
:class:`Holdings`. This module is tensor logic only (no process group):

- :func:`extract_holdings` takes them out of an engine, :func:`engine_stages` reads an
  engine's own stages (for a checkpoint, a replica rebuild);
- :func:`roll_forward` applies a committed step from held final gradients, and
  :func:`roll_forward_holdings` brings every holding to the step a generation resumes from;
- :func:`pack` / :func:`unpack` / :func:`packed_views`: a stage as one flat float32 tensor
  (one message), and back;
- :func:`piece_state` / :func:`assemble`: a stage cut into a sharded replica's pieces
  (``spotline.plan.shards``), and the whole stage again from every shard's pieces.

Who sends what to whom is ``spotline.worker.state_transfer``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from spotline.pipeline.loss_scaling import unscale
from spotline.pipeline.lr_schedule import StepSchedule, constructor_hyper
from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.pipeline.replica import piece_of, stage_of_name
from spotline.plan import loss_scale
from spotline.plan.layout import Holding
from spotline.plan.loss_scale import LossScaleState, LossScaling
from spotline.plan.shards import Piece

OPT_KEYS = ("step", "exp_avg", "exp_avg_sq")

# A stage's tensors as a message lists them: (name or piece key, shape), sorted by name.
Names = list[tuple[str, torch.Size]]


@dataclass
class StageState:
    """One logical stage's parameters and optimizer state, by global parameter name, and
    the loss scaler before step ``version`` (fp16's; a constant otherwise): every holding
    of a step has the same one."""

    version: int
    params: dict[str, torch.Tensor]
    opt: dict[str, dict[str, torch.Tensor]]
    grads: dict[str, torch.Tensor] | None = None  # final gradients of step `version`
    # How ``grads`` become the update (the owner's recipe for that step): unscaled from
    # ``grads_scale`` (1: they were already), clipped by ``clip``, or the step skipped
    # (``skip``: fp16's overflow).
    clip: float = 1.0
    # The part held: shard ``shard`` of ``shards`` (a sharded replica: only that shard's
    # pieces, 1-D tensors by piece key, spotline.plan.shards); 0 of 1: the whole stage.
    shard: int = 0
    shards: int = 1
    loss_scale: LossScaleState = field(kw_only=True)
    grads_scale: float = field(default=1.0, kw_only=True)
    skip: bool = field(default=False, kw_only=True)

    def names(self) -> Names:
        """Its tensors as :func:`pack` lists them."""
        return sorted((n, t.shape) for n, t in self.params.items())


@dataclass
class Holdings:
    """Everything this worker holds between generations."""

    stages: dict[int, StageState] = field(default_factory=dict)

    def report(self) -> list[Holding]:
        return [
            Holding(
                stage=s,
                version=st.version,
                ready=st.grads is not None,
                shard=st.shard,
                shards=st.shards,
            )
            for s, st in sorted(self.stages.items())
        ]


@dataclass(frozen=True)
class OptimizerRecipe:
    """How to rebuild an engine's optimizer to apply one step outside it (a roll-forward):
    its class, its constructor's hyper-parameters and the rate of every step."""

    optimizer_cls: type[torch.optim.Optimizer]
    hyper: dict[str, Any]
    schedule: StepSchedule
    loss_scaling: LossScaling

    @classmethod
    def of(cls, engine: RedundantPipelineEngine) -> OptimizerRecipe:
        opt = engine.optimizer
        return cls(
            type(opt), constructor_hyper(opt), engine.step_schedule, engine.loss_scaler.scaling
        )


def opt_state(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, *, clone: bool = True
) -> dict[str, torch.Tensor]:
    """``p``'s AdamW state: copies, or (``clone`` False, for a caller that copies it at
    once) the optimizer's own tensors."""
    state = optimizer.state.get(p, {})
    if not state:
        # AdamW creates zeros at its first step: the same as loading zeros with step 0.
        return {
            "step": torch.zeros(()),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return {k: state[k].detach().clone() if clone else state[k].detach() for k in OPT_KEYS}


def set_opt_state(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, state: dict[str, torch.Tensor]
) -> None:
    """Hand ``p``'s AdamW state to ``optimizer``. The state of a tensor never stepped (step
    0: the zeros :func:`opt_state` packs for it) stays empty, as in a fresh optimizer: it
    steps to the same bits either way, and an owner and its replica, compared by their
    state's digest (``redundancy.verify_replicas``), must not differ in its form."""
    if float(state["step"]) == 0:
        optimizer.state.pop(p, None)
        return
    optimizer.state[p] = state


def names_by_stage(
    named: Iterable[tuple[str, torch.Tensor]], logical: Sequence[int]
) -> dict[int, Names]:
    """``named`` tensors' (name, shape) by logical stage (layer boundaries ``logical``)."""
    out: dict[int, Names] = {}
    for name, p in named:
        out.setdefault(stage_of_name(name, logical), []).append((name, p.shape))
    return {s: sorted(v) for s, v in out.items()}


def engine_stages(
    engine: RedundantPipelineEngine, logical: Sequence[int], *, clone: bool = True
) -> dict[int, StageState]:
    """The engine's own logical stages at its applied step (``clone`` False: its tensors)."""
    out: dict[int, StageState] = {}
    for name, p in engine.module.named_parameters():
        st = out.setdefault(
            stage_of_name(name, logical),
            StageState(engine.applied_steps, {}, {}, loss_scale=engine.loss_scaler.state),
        )
        st.params[name] = p.detach()
        st.opt[name] = opt_state(engine.optimizer, p, clone=clone)
    return out


def extract_holdings(engine: RedundantPipelineEngine, logical: Sequence[int]) -> Holdings:
    """Take the own stages and the replica out of the engine, which is dropped next.

    Parameters and optimizer state are taken, not copied (a copy of a stage and its replica
    was most of a takeover's time at 14M parameters): only the engine's optimizer step
    writes them, and the engine runs no step again. Gradients are copied: their buffers are
    the ones the next step's reduction and exchange would write into."""
    out = Holdings()
    scaler = engine.loss_scaler
    for name, p in engine.module.named_parameters():
        stage = stage_of_name(name, logical)
        # Own gradients are unscaled and clipped in place before the commit barrier: clip
        # 1.0 and scale 1 here; the scaler is still the step's (it advances past the commit).
        st = out.stages.setdefault(
            stage,
            StageState(
                engine.applied_steps,
                {},
                {},
                {} if engine.own_ready else None,
                1.0,
                loss_scale=scaler.state,
                skip=engine.own_ready and scaler.overflow,
            ),
        )
        st.params[name] = p.detach()
        st.opt[name] = opt_state(engine.optimizer, p, clone=False)
        if st.grads is not None:
            assert p.grad is not None
            st.grads[name] = p.grad.detach().clone()
    replica = engine.replica
    if replica is not None:
        grads: dict[str, torch.Tensor] | None = None
        if engine.replica_ready and replica.flat_grads is not None:
            grads = {}
            offset = 0
            for name, p in replica.named_params:
                n = p.numel()
                grads[name] = replica.flat_grads[offset : offset + n].view_as(p).clone()
                offset += n
        own_stages = set(out.stages)
        # Every logical stage of the replica's physical stage, a sharded replica's empty
        # shard of one included: the planner needs every shard of a stage reported.
        replica_stages = [
            stage
            for stage in range(len(logical) - 1)
            if replica.start <= logical[stage] < replica.stop and stage not in own_stages
        ]
        # The recipe of the step the received gradients are of: a lazy replica's update
        # waits for the next step's bubble, kept with its own coefficient and scale.
        pending = engine.replica_pending
        if pending is None:
            clip, state, skip = engine.last_clip_coefficient, scaler.state, scaler.overflow
        else:
            clip, state, skip = pending.clip, pending.loss_scale, pending.skip
        for stage in replica_stages:
            out.stages[stage] = StageState(
                engine.replica_applied_steps,
                {},
                {},
                {} if grads is not None else None,
                clip,
                replica.shard,
                replica.shards,
                loss_scale=state,
                # The received gradients are the owner's reduced ones, still scaled.
                grads_scale=state.scale,
                skip=grads is not None and skip,
            )
        for name, p in replica.named_params:
            stage = stage_of_name(name, logical)
            if stage in own_stages:
                continue  # never: a replica holds another physical stage's layers
            st = out.stages[stage]
            st.params[name] = p.detach()
            st.opt[name] = opt_state(replica.optimizer, p, clone=False)
            if st.grads is not None and grads is not None:
                st.grads[name] = grads[name]
    return out


def roll_forward(st: StageState, recipe: OptimizerRecipe) -> None:
    """Apply the committed step this stage holds final gradients for (no communication):
    the owner's ops in its order (unscale, clip, step), or nothing where fp16's overflow
    skipped it; the loss scaler advances either way."""
    assert st.grads is not None
    if not st.skip:
        names = sorted(st.params)
        params = [torch.nn.Parameter(st.params[n].clone()) for n in names]
        optimizer = recipe.optimizer_cls(params, **recipe.hyper)
        # The step being applied is step ``st.version`` (0-based): its rate, whatever any
        # scheduler object did since.
        recipe.schedule.apply(optimizer.param_groups, st.loss_scale.schedule_position(st.version))
        for n, p in zip(names, params, strict=True):
            optimizer.state[p] = {k: v.clone() for k, v in st.opt[n].items()}
            p.grad = st.grads[n].clone()
            unscale([p.grad], 1.0 / st.grads_scale)
            if st.clip < 1.0:
                p.grad.mul_(st.clip)
        optimizer.step()
        for n, p in zip(names, params, strict=True):
            st.params[n] = p.detach().clone()
            st.opt[n] = {k: optimizer.state[p][k].detach().clone() for k in OPT_KEYS}
    st.loss_scale = recipe.loss_scaling.after(st.loss_scale, st.skip)
    st.version += 1
    st.grads = None


def roll_forward_holdings(holdings: Holdings, resume: int, recipe: OptimizerRecipe | None) -> None:
    """Bring every holding to step ``resume``: one a step behind with that step's final
    gradients applies it (:func:`roll_forward`); any other not at ``resume`` is dropped
    (stale: older than the committed step, or ahead of it, uncommitted)."""
    for stage, st in sorted(holdings.stages.items()):
        if st.version == resume - 1 and st.grads is not None:
            assert recipe is not None
            roll_forward(st, recipe)
        if st.version != resume:
            del holdings.stages[stage]
        else:
            st.grads = None


def packed_numel(st_names: Names) -> int:
    """The elements :func:`pack` writes for a stage of ``st_names``."""
    return sum(3 * int(torch.Size(s).numel()) + 1 for _, s in st_names) + loss_scale.FLOATS


def pack(st_names: Names, st: StageState, out: torch.Tensor | None = None) -> torch.Tensor:
    """A stage's parameters, optimizer state and loss scaler as one flat float32 tensor
    (into ``out``, of ``packed_numel`` elements, when given: one copy, not one more of a
    concatenation)."""
    parts = [st.params[n].reshape(-1) for n, _ in st_names]
    for key in ("exp_avg", "exp_avg_sq"):
        parts += [st.opt[n][key].reshape(-1) for n, _ in st_names]
    parts += [st.opt[n]["step"].reshape(1).to(torch.float32) for n, _ in st_names]
    parts.append(torch.tensor(st.loss_scale.to_floats(), dtype=torch.float32))
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


class PackedViews(NamedTuple):
    """What :func:`pack` wrote, as views of the flat tensor (the caller copies what it keeps)."""

    params: dict[str, torch.Tensor]
    opt: dict[str, dict[str, torch.Tensor]]
    loss_scale: LossScaleState


def packed_views(st_names: Names, flat: torch.Tensor) -> PackedViews:
    """The parameters, optimizer state and loss scaler :func:`pack` wrote into ``flat``."""
    params: dict[str, torch.Tensor] = {}
    opt: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    sizes = [(n, shape, int(torch.Size(shape).numel())) for n, shape in st_names]
    for n, shape, k in sizes:
        params[n] = flat[offset : offset + k].view(shape)
        offset += k
    for key in ("exp_avg", "exp_avg_sq"):
        for n, shape, k in sizes:
            opt.setdefault(n, {})[key] = flat[offset : offset + k].view(shape)
            offset += k
    for n, _, _ in sizes:
        opt[n]["step"] = flat[offset]
        offset += 1
    scale = LossScaleState.from_floats(flat[offset : offset + loss_scale.FLOATS].tolist())
    offset += loss_scale.FLOATS
    assert offset == flat.numel()
    return PackedViews(params, opt, scale)


def unpack(st_names: Names, flat: torch.Tensor, version: int) -> StageState:
    """A stage :func:`pack` wrote, every tensor its own copy (a holding owns its tensors)."""
    views = packed_views(st_names, flat)
    return views_state(views, version, clone=True)


def views_state(views: PackedViews, version: int, *, clone: bool = False) -> StageState:
    """The stage of ``views`` at step ``version`` (its tensors copies where ``clone``)."""

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if clone else t

    return StageState(
        version,
        {n: own(t) for n, t in views.params.items()},
        {n: {k: own(t) for k, t in state.items()} for n, state in views.opt.items()},
        loss_scale=views.loss_scale,
    )


def piece_state(st: StageState, pieces: Sequence[Piece]) -> StageState:
    """``pieces`` of the whole stage ``st`` as a stage of its own, by piece key: views of
    its tensors (each piece with its tensor's step count)."""
    return StageState(
        st.version,
        {x.key: piece_of(st.params[x.name], x) for x in pieces},
        {
            x.key: {k: v if k == "step" else piece_of(v, x) for k, v in st.opt[x.name].items()}
            for x in pieces
        },
        loss_scale=st.loss_scale,
    )


def piece_names(pieces: Sequence[Piece]) -> Names:
    """``pieces`` as a holding of them lists its tensors (by key: :func:`pack`'s order)."""
    return sorted((x.key, torch.Size([x.numel])) for x in pieces)


def assemble(
    st_names: Names, parts: Sequence[tuple[Sequence[Piece], StageState]], version: int
) -> StageState:
    """The whole stage ``st_names`` from every shard's pieces (``parts``: each shard's pieces
    and the stage of them, :func:`piece_state`): each tensor its pieces concatenated in
    start order, its own copy."""
    by_name: dict[str, list[tuple[Piece, StageState]]] = {}
    scales = {st.loss_scale for _, st in parts}
    assert len(scales) == 1, scales  # one step's shards: one scaler
    for pieces, st in parts:
        assert st.version == version and sorted(st.params) == sorted(x.key for x in pieces)
        for x in pieces:
            by_name.setdefault(x.name, []).append((x, st))
    assert set(by_name) <= {n for n, _ in st_names}, sorted(by_name)
    # An empty tensor has no piece: its step is any piece's (a stage's tensors step together).
    any_step = next(
        (st.opt[x.key]["step"] for pieces, st in parts for x in pieces), torch.zeros(())
    )
    whole = StageState(version, {}, {}, loss_scale=scales.pop())
    for name, shape in st_names:
        got = sorted(by_name.get(name, []), key=lambda item: item[0].start)
        # Every element exactly once: the pieces tile [0, numel) end to end.
        bounds = [0, *(x.stop for x, _ in got)]
        assert [x.start for x, _ in got] == bounds[:-1] and bounds[-1] == shape.numel(), name
        steps = {float(st.opt[x.key]["step"]) for x, st in got}
        assert len(steps) <= 1, (name, steps)  # a tensor's pieces were stepped together
        whole.params[name] = _joined([st.params[x.key] for x, st in got], shape)
        whole.opt[name] = {
            key: _joined([st.opt[x.key][key] for x, st in got], shape)
            for key in ("exp_avg", "exp_avg_sq")
        }
        step = got[0][1].opt[got[0][0].key]["step"] if got else any_step
        whole.opt[name]["step"] = step.detach().clone()
    return whole


def _joined(tensors: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """``tensors`` concatenated (a copy) and viewed as ``shape``; none: an empty tensor."""
    return (torch.cat(tensors) if tensors else torch.empty(0)).view(shape)
