"""The learning rate (and OneCycle's momentum) as a pure function of the step.

DeepSpeed's schedulers keep their position in the scheduler object (``last_batch_iteration``,
advanced once per optimizer step). Spotline builds a new engine for every generation, rolls
committed steps forward outside any engine and steps replicas with an optimizer of their own,
so a position kept in one object would restart at zero after every takeover, and a replica
stepped after its owner's scheduler moved on would use the next step's rate. Instead, every
optimizer update of step ``k`` (an owner's, a replica's, a roll-forward's) takes its
hyper-parameters from :meth:`StepSchedule.at` ``(k)``: the values DeepSpeed's own scheduler
gives the optimizer for step ``k`` of an undisturbed run, computed by that scheduler class on
a one-parameter optimizer moved straight to the position.

That is exact because DeepSpeed's five schedulers (``SUPPORTED_SCHEDULERS`` in
``spotline.config``) compute the rate from ``last_batch_iteration`` alone, so ``step(k - 1)``
from a fresh scheduler equals ``k`` calls of ``step()``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from deepspeed.runtime import lr_schedules

# The group keys a DeepSpeed scheduler writes: the rate, and OneCycle's cycled momentum
# (``betas`` for Adam-style optimizers, ``momentum`` for SGD-style ones).
SCHEDULED_KEYS = ("lr", "betas", "momentum")


@contextlib.contextmanager
def _without_not_started_warning() -> Iterator[None]:
    """DeepSpeed's warm-up schedulers warn "Attempting to get learning rate from scheduler
    before it has started" from their own constructor; for the throw-away scheduler that
    computes a step's rate it says nothing, so it is filtered out while one is built."""

    def keep(record: logging.LogRecord) -> bool:
        return "before it has started" not in record.getMessage()

    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.addFilter(keep)
    try:
        yield
    finally:
        ds_logger.removeFilter(keep)


def constructor_hyper(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The hyper-parameters that rebuild ``optimizer``'s class with the same settings
    (``defaults`` can hold keys the constructor derives itself, e.g. AdamW's
    ``decoupled_weight_decay``, which its constructor does not accept)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


class StepSchedule:
    """What DeepSpeed's scheduler ``name`` sets on the optimizer for each step.

    ``defaults`` are the optimizer's constructor hyper-parameters (``optimizer.defaults``:
    the configured rate before any scheduler touched it); with ``name`` None the
    hyper-parameters are those defaults at every step.
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        name: str | None,
        params: dict[str, Any],
    ) -> None:
        self.optimizer_cls = optimizer_cls
        self.defaults = dict(defaults)
        self.name = name
        self.params = dict(params)
        self._cache: dict[int, dict[str, Any]] = {}

    @classmethod
    def of_engine(cls, engine: Any) -> StepSchedule:
        """The schedule of a DeepSpeed engine's configured scheduler and optimizer."""
        optimizer = engine.optimizer
        return cls(
            type(optimizer),
            constructor_hyper(optimizer),
            engine.scheduler_name(),
            dict(engine.scheduler_params() or {}),
        )

    def at(self, step: int) -> dict[str, Any]:
        """The scheduled group hyper-parameters for optimizer step ``step`` (0-based)."""
        assert step >= 0, step
        if step not in self._cache:
            self._cache[step] = self._compute(step)
        return self._cache[step]

    def _compute(self, step: int) -> dict[str, Any]:
        dummy = torch.nn.Parameter(torch.zeros(1))
        optimizer = self.optimizer_cls([dummy], **self.defaults)
        if self.name is not None:
            with _without_not_started_warning():
                scheduler = getattr(lr_schedules, self.name)(optimizer, **self.params)
            if step > 0:
                # Step k runs with the rate set after step k-1's update (DeepSpeed steps its
                # scheduler after each optimizer step; step 0 uses the initial value).
                scheduler.step(step - 1)
        group = optimizer.param_groups[0]
        return {key: group[key] for key in SCHEDULED_KEYS if key in group}

    def apply(self, param_groups: Iterable[dict[str, Any]], step: int) -> None:
        """Set step ``step``'s hyper-parameters on every group (other keys untouched)."""
        values = self.at(step)
        for group in param_groups:
            for key, value in values.items():
                if key in group:
                    group[key] = value

    def position(self, scheduler: Any, step: int) -> None:
        """Move DeepSpeed's own scheduler object to where an undisturbed run has it before
        step ``step`` (what ``engine.get_lr()`` and DeepSpeed's logging read)."""
        if scheduler is not None and step > 0:
            scheduler.step(step - 1)
