"""fp16's loss scaler inside DeepSpeed's engine, with one overflow decision for the whole job.

DeepSpeed runs fp16 under ``torch_autocast`` with a ``torch.amp.GradScaler``
(``engine.torch_autocast_z0_gradscaler``): it scales the loss in ``backward`` and, in
``_take_model_step``, unscales, steps unless *this process's* gradients overflowed, and
updates the scale. Under pipeline parallelism each stage would then decide alone: one
stage skips a step another applies, and the scales part ways. :class:`LossScaler` takes
the GradScaler's place (the methods DeepSpeed calls) with Spotline's state
(``spotline.plan.loss_scale``) and a decision taken before the commit point from every
stage's reduced gradients (:func:`job_overflow`). The reduced gradients are the same
whatever the placement (the exact reduction), so the decision, the scale and the skipped
steps are too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from spotline.plan.loss_scale import LossScaleState, LossScaling


class LossScaler:
    """The scale of the step in progress, and whether its gradients overflowed.

    ``state`` is the scaler before the step (a new generation's load sets it from the
    holdings); the engine's ``prepare_update`` sets ``overflow`` before the commit, and
    :meth:`update` advances ``state`` after it (DeepSpeed's GradScaler protocol: ``scale``,
    ``unscale_``, ``step``, ``update``)."""

    def __init__(self, scaling: LossScaling) -> None:
        self.scaling = scaling
        self.state: LossScaleState = scaling.initial()
        self.overflow = False

    @property
    def inverse(self) -> float:
        """What the reduced gradients are multiplied by to unscale them."""
        return 1.0 / self.state.scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward pass starts from."""
        return loss * self.state.scale if self.scaling.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: Spotline unscales before the commit (the engine's ``prepare_update``), so
        that a replica and a roll-forward get the owner's unscaled gradients' recipe."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step, skipped when the job's gradients overflowed."""
        if not self.overflow:
            optimizer.step()

    def update(self) -> None:
        """After the step: the scaler's state for the next one."""
        self.state = self.scaling.after(self.state, self.overflow)
        self.overflow = False


def has_overflow(grads: Iterable[torch.Tensor | None]) -> bool:
    """Whether any of ``grads`` holds an inf or a NaN."""
    return any(g is not None and not bool(torch.isfinite(g).all()) for g in grads)


def job_overflow(local: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether any stage overflowed: ``local`` (this stage's reduced gradients) OR-ed over
    ``group`` (the pipeline's stages: data-parallel peers hold the same gradients, so every
    pipeline reaches the same answer)."""
    flag = torch.tensor([1.0 if local else 0.0])
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def unscale(grads: Iterable[torch.Tensor | None], inverse: float) -> None:
    """Multiply ``grads`` by ``inverse`` in place (the same op on the owner and its replica)."""
    if inverse == 1.0:
        return
    for grad in grads:
        if grad is not None:
            grad.mul_(inverse)
