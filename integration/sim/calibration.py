"""Simulator calibration: prices, delays and step times, read from a JSON table.

The default table is ``spotline/assets/calibration-bamboo.json``; its ``sources`` section
says where each number comes from. :func:`load_calibration` validates a table and
:meth:`ModelCalibration.step_time_s` answers "how long is one training step with this many
active pipelines, degraded or not", which is all the simulator needs of a model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotline.errors import UserError

DEFAULT_CALIBRATION_PATH = (
    Path(__file__).resolve().parent.parent / "assets" / "calibration-bamboo.json"
)


@dataclass(frozen=True)
class StepTimeRow:
    """One measured step time: ``num_stages`` x ``num_pipelines``, degraded or not."""

    num_stages: int
    num_pipelines: int
    degraded: bool
    step_time_s: float


@dataclass(frozen=True)
class ModelCalibration:
    """What the simulator knows of one model: its pipeline depth, its fixed global batch
    (``samples_per_step``), checkpoint costs and a table of step times.

    Step times not in the table are derived (see :meth:`step_time_s`). ``degraded_slowdown``
    is copied from the enclosing :class:`Calibration`.
    """

    name: str
    num_stages: int
    samples_per_step: int
    checkpoint_save_s: float
    checkpoint_load_s: float
    step_times: tuple[StepTimeRow, ...]
    degraded_slowdown: float
    _fit: tuple[float, float] = field(init=False, repr=False, compare=False)
    # Memo of step_time_s, a pure function of the fields.
    _cache: dict[tuple[int, bool], float] = field(
        init=False, repr=False, compare=False, hash=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        rows = [
            row for row in self.step_times if row.num_stages == self.num_stages and not row.degraded
        ]
        if not rows:
            raise ValueError(
                f"model {self.name!r}: the step-time table has no non-degraded row for "
                f"{self.num_stages} stages"
            )
        # Least-squares fit of step_time = a + b / P (fixed global batch: per-pipeline work
        # shrinks as 1/P, ``a`` is what does not shrink). One row: all of it scales.
        if len({row.num_pipelines for row in rows}) == 1:
            fit = (0.0, rows[0].step_time_s * rows[0].num_pipelines)
        else:
            xs = [1.0 / row.num_pipelines for row in rows]
            ys = [row.step_time_s for row in rows]
            mean_x = sum(xs) / len(xs)
            mean_y = sum(ys) / len(ys)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
                (x - mean_x) ** 2 for x in xs
            )
            fit = (mean_y - slope * mean_x, slope)
        object.__setattr__(self, "_fit", fit)

    def step_time_s(self, num_pipelines: int, degraded: bool) -> float:
        """Seconds per training step with ``num_pipelines`` active pipelines.

        A table row for (num_stages, num_pipelines, degraded) wins; otherwise the
        non-degraded time is the table's row for that pipeline count or the a + b / P fit,
        and a degraded step is that times ``degraded_slowdown``.
        """
        cached = self._cache.get((num_pipelines, degraded))
        if cached is not None:
            return cached
        if num_pipelines < 1:
            raise ValueError(f"num_pipelines must be >= 1, got {num_pipelines}")
        value = self._step_time_s(num_pipelines, degraded)
        self._cache[(num_pipelines, degraded)] = value
        return value

    def _step_time_s(self, num_pipelines: int, degraded: bool) -> float:
        for row in self.step_times:
            if (row.num_stages, row.num_pipelines, row.degraded) == (
                self.num_stages,
                num_pipelines,
                degraded,
            ):
                return row.step_time_s
        base = self.step_time_s(num_pipelines, False) if degraded else None
        if base is not None:
            return base * self.degraded_slowdown
        intercept, slope = self._fit
        return intercept + slope / num_pipelines

    @property
    def fit(self) -> tuple[float, float]:
        """The (a, b) of the step_time = a + b / P extrapolation."""
        return self._fit


@dataclass(frozen=True)
class Calibration:
    """Cluster-wide numbers (prices per node-hour, delays in seconds) and the models."""

    spot_price_per_node_hour: float
    on_demand_price_per_node_hour: float
    node_ready_s: float
    fatal_rendezvous_s: float
    reconfigure_s: float
    degraded_slowdown: float
    preemption_notice_s: tuple[tuple[str, float], ...]
    spotline_checkpoint_interval_s: float
    models: tuple[ModelCalibration, ...]
    source: str
    sources: tuple[tuple[str, str], ...]
    # A generation change in which a worker receives state it does not hold costs this much
    # more than ``reconfigure_s`` (measured by spotline calibrate; Bamboo's reconfigure time
    # already includes it, so its table leaves it out: 0).
    state_transfer_s: float = 0.0

    def model(self, name: str) -> ModelCalibration:
        """The calibration of model ``name``; UserError naming the known models otherwise."""
        for model in self.models:
            if model.name == name:
                return model
        known = ", ".join(model.name for model in self.models)
        raise UserError(f"unknown model {name!r} in calibration {self.source}; use one of {known}")


def _number(table: dict[str, Any], key: str, where: str, *, positive: bool = False) -> float:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(f"calibration {where}: {key!r} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise UserError(f"calibration {where}: {key!r} must be {'>' if positive else '>='} 0")
    return float(value)


def _count(table: dict[str, Any], key: str, where: str) -> int:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"calibration {where}: {key!r} must be an integer >= 1, got {value!r}")
    return value


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read and validate a calibration table (the Bamboo-derived default when ``path`` is
    None). Any problem is a UserError naming the file and the offending key."""
    path = DEFAULT_CALIBRATION_PATH if path is None else Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"calibration file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read calibration file {path}: {error}") from None
    where = str(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict) or not raw["models"]:
        raise UserError(f"calibration {where}: expected an object with a non-empty 'models' table")
    slowdown = _number(raw, "degraded_slowdown", where, positive=True)
    models: list[ModelCalibration] = []
    for name, table in sorted(raw["models"].items()):
        model_where = f"{where} model {name!r}"
        if not isinstance(table, dict) or not isinstance(table.get("step_times"), list):
            raise UserError(f"calibration {model_where}: expected a 'step_times' list")
        rows: list[StepTimeRow] = []
        for index, row in enumerate(table["step_times"]):
            row_where = f"{model_where} step_times[{index}]"
            if not isinstance(row, dict) or not isinstance(row.get("degraded"), bool):
                raise UserError(f"calibration {row_where}: expected a row with a 'degraded' bool")
            rows.append(
                StepTimeRow(
                    _count(row, "num_stages", row_where),
                    _count(row, "num_pipelines", row_where),
                    row["degraded"],
                    _number(row, "step_time_s", row_where, positive=True),
                )
            )
        try:
            models.append(
                ModelCalibration(
                    name=name,
                    num_stages=_count(table, "num_stages", model_where),
                    samples_per_step=_count(table, "samples_per_step", model_where),
                    checkpoint_save_s=_number(table, "checkpoint_save_s", model_where),
                    checkpoint_load_s=_number(table, "checkpoint_load_s", model_where),
                    step_times=tuple(rows),
                    degraded_slowdown=slowdown,
                )
            )
        except ValueError as error:
            raise UserError(f"calibration {where}: {error}") from None
    notice = raw.get("preemption_notice_s", {})
    if not isinstance(notice, dict):
        raise UserError(f"calibration {where}: 'preemption_notice_s' must be an object")
    sources = raw.get("sources", {})
    return Calibration(
        spot_price_per_node_hour=_number(raw, "spot_price_per_node_hour", where),
        on_demand_price_per_node_hour=_number(raw, "on_demand_price_per_node_hour", where),
        node_ready_s=_number(raw, "node_ready_s", where),
        fatal_rendezvous_s=_number(raw, "fatal_rendezvous_s", where),
        reconfigure_s=_number(raw, "reconfigure_s", where),
        degraded_slowdown=slowdown,
        preemption_notice_s=tuple(
            (str(cloud), _number(notice, cloud, where)) for cloud in sorted(notice)
        ),
        spotline_checkpoint_interval_s=_number(
            raw, "spotline_checkpoint_interval_s", where, positive=True
        ),
        models=tuple(models),
        source=where,
        sources=tuple((str(k), str(v)) for k, v in sorted(sources.items()))
        if isinstance(sources, dict)
        else (),
        state_transfer_s=_number(raw, "state_transfer_s", where)
        if "state_transfer_s" in raw
        else 0.0,
    )
