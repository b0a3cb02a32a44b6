"""fp16's dynamic loss scale as data: the scaler's settings, its state, and one step's update.

In fp16 the loss is multiplied by a scale before the backward pass so that small gradients
do not flush to zero; a step whose gradients overflowed (an inf or a NaN anywhere in the
job) is skipped and the scale shrinks, and after ``window`` clean steps it grows again. The
state (the scale, where the last overflow was, the hysteresis left, the steps skipped)
changes the math of every later step, so it is part of a committed step's state like the
optimizer's: it is held with every stage, travels with it (a takeover, a rescale's
transfer, a checkpoint, ``--resume``) and is advanced by the same function on every rank,
from an overflow decision every rank shares (``spotline.pipeline.loss_scaling``).

:meth:`LossScaling.after` is DeepSpeed's ``DynamicLossScaler.update_scale`` (its
``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``; checked against it
in tests/test_loss_scale.py) with one change: at the minimum scale an overflow skips the
step and keeps the scale, where DeepSpeed's default raises and ends the run. A static scale
(``fp16.loss_scale`` > 0) never changes; an overflowed step is still skipped (DeepSpeed's
static scaler would apply the inf).

The learning-rate schedule does not advance over a skipped step (DeepSpeed and Hugging
Face's Trainer both hold the scheduler back): the rate of step ``k`` is the schedule's at
:meth:`LossScaleState.schedule_position`, ``k`` less the steps skipped before it.

Pure: no torch or DeepSpeed import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# A state packs into float32 messages (spotline.worker.holdings.pack): its integers must be
# exact there.
_FLOAT32_EXACT = 2**24


@dataclass(frozen=True)
class LossScaleState:
    """The scaler before a step. ``iteration`` counts the steps it has seen (0-based index of
    the next), ``last_overflow`` the index of the last overflowed step (-1: none yet)."""

    scale: float
    iteration: int = 0
    last_overflow: int = -1
    hysteresis: int = 1
    skipped: int = 0

    def schedule_position(self, step: int) -> int:
        """The learning-rate schedule's position for step ``step`` (skipped steps held back)."""
        assert step >= self.skipped, (step, self.skipped)
        return step - self.skipped

    def to_floats(self) -> tuple[float, ...]:
        """The state as float32-exact numbers (:meth:`from_floats` reads them back)."""
        ints = (self.iteration, self.last_overflow, self.hysteresis, self.skipped)
        assert all(abs(v) < _FLOAT32_EXACT for v in ints), ints
        return (self.scale, *(float(v) for v in ints))

    @classmethod
    def from_floats(cls, values: tuple[float, ...] | list[float]) -> LossScaleState:
        scale, iteration, last_overflow, hysteresis, skipped = values
        return cls(float(scale), int(iteration), int(last_overflow), int(hysteresis), int(skipped))


FLOATS = len(LossScaleState(1.0).to_floats())
"""How many numbers :meth:`LossScaleState.to_floats` gives."""


@dataclass(frozen=True)
class LossScaling:
    """The scaler's settings: DeepSpeed's ``fp16`` section, or none (``enabled`` False: fp32
    and bf16, whose scale stays 1 and whose steps are never skipped)."""

    enabled: bool = False
    dynamic: bool = True
    initial_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        assert self.initial_scale > 0 and self.min_scale > 0 and self.window >= 1
        assert self.hysteresis >= 1

    def initial(self) -> LossScaleState:
        """The state before step 0."""
        return LossScaleState(self.initial_scale, hysteresis=self.hysteresis)

    def after(self, state: LossScaleState, overflow: bool) -> LossScaleState:
        """The state after a step whose gradients did (``overflow``) or did not overflow."""
        if not self.enabled:
            assert not overflow, "only fp16 checks for overflow"
            return state  # nothing to count: every holding of every step has this state
        skipped = state.skipped + int(overflow)
        nxt = state.iteration + 1
        if not self.dynamic:
            return replace(state, iteration=nxt, skipped=skipped)
        scale, hysteresis, last = state.scale, state.hysteresis, state.last_overflow
        if overflow:
            if self.hysteresis == 1 or hysteresis == 1:
                scale = max(scale / 2.0, self.min_scale)
            else:
                hysteresis -= 1
            last = state.iteration
        else:
            if self.consecutive_hysteresis:
                hysteresis = self.hysteresis
            stable = state.iteration - last - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    hysteresis = self.hysteresis
                scale *= 2.0
        return LossScaleState(scale, nxt, last, hysteresis, skipped)


NO_SCALING = LossScaling()
"""fp32 and bf16: a scale of 1 that never changes."""
