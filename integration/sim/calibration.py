"""Simulator calibration: prices, delays and step times, read from a JSON table.

Tables ship as named calibrations (:data:`NAMED_CALIBRATIONS`; the default,
:data:`DEFAULT_CALIBRATION`, is Bamboo's earlier 8-stage GPT-2 table); each table's
``sources`` section says where each number comes from. :func:`load_calibration` validates a
table and :meth:`ModelCalibration.step_time_s` answers "how long is one training step with
this many active pipelines, degraded or not" for the pipeline counts the table covers: a
measured row, or an interpolation between the two measured rows around it. A pipeline count
outside the measured rows is refused (:class:`OutsideCalibration`); the simulator, which may
have to plan one, asks :meth:`ModelCalibration.step_time_bound_s` instead and reports the
time it trained on such a bound.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotline.errors import UserError

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

NAMED_CALIBRATIONS: dict[str, Path] = {
    # Bamboo's simulator, GPT-2 at 8 stages x 1-3 pipelines, 264 samples a step (the table
    # of uclasystem/bamboo at 1057ba8; its authors later replaced it).
    "bamboo-gpt2-8stage": _ASSETS / "calibration-bamboo.json",
    # The later 12-stage GPT-2 table (1-4 pipelines); see its file's sources for what is
    # and is not known of its provenance.
    "bamboo-gpt2-12stage": _ASSETS / "calibration-bamboo-gpt2-12stage.json",
}
"""The calibrations shipped with Spotline, by name (``spotline simulate --calibration``)."""

DEFAULT_CALIBRATION = "bamboo-gpt2-8stage"
"""The calibration used when none is named."""

DEFAULT_CALIBRATION_PATH = NAMED_CALIBRATIONS[DEFAULT_CALIBRATION]


class OutsideCalibration(UserError):
    """A step time was asked for a pipeline count outside the calibration's measured rows
    (a UserError: an entry point prints it as one line and exits 2)."""


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

    The non-degraded rows of ``num_stages`` stages are the pipeline counts the calibration
    covers (:attr:`pipeline_range`); step times between them are interpolated, outside them
    refused (see :meth:`step_time_s`). ``degraded_slowdown`` is copied from the enclosing
    :class:`Calibration`.
    """

    name: str
    num_stages: int
    samples_per_step: int
    checkpoint_save_s: float
    checkpoint_load_s: float
    step_times: tuple[StepTimeRow, ...]
    degraded_slowdown: float
    # The measured non-degraded rows of num_stages stages: (pipelines, seconds), ascending.
    _rows: tuple[tuple[int, float], ...] = field(init=False, repr=False, compare=False)
    # Memo of step_time_bound_s, a pure function of the fields.
    _cache: dict[tuple[int, bool], tuple[float, bool]] = field(
        init=False, repr=False, compare=False, hash=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        seen: dict[tuple[int, int, bool], float] = {}
        for row in self.step_times:
            key = (row.num_stages, row.num_pipelines, row.degraded)
            if key in seen and seen[key] != row.step_time_s:
                raise ValueError(
                    f"model {self.name!r}: two step times for {row.num_stages} stages x "
                    f"{row.num_pipelines} pipelines (degraded {row.degraded}): "
                    f"{seen[key]} and {row.step_time_s}"
                )
            seen[key] = row.step_time_s
        rows = tuple(
            sorted(
                (pipelines, seconds)
                for (stages, pipelines, degraded), seconds in seen.items()
                if stages == self.num_stages and not degraded
            )
        )
        if not rows:
            raise ValueError(
                f"model {self.name!r}: the step-time table has no non-degraded row for "
                f"{self.num_stages} stages"
            )
        object.__setattr__(self, "_rows", rows)

    @property
    def pipeline_range(self) -> tuple[int, int]:
        """The fewest and the most pipelines with a measured (non-degraded) step time."""
        return self._rows[0][0], self._rows[-1][0]

    @property
    def measured_pipelines(self) -> tuple[int, ...]:
        """The pipeline counts with a measured (non-degraded) step time, ascending."""
        return tuple(pipelines for pipelines, _ in self._rows)

    def covers(self, num_pipelines: int) -> bool:
        """Whether ``num_pipelines`` lies within the measured rows (inclusive)."""
        low, high = self.pipeline_range
        return low <= num_pipelines <= high

    def step_time_s(self, num_pipelines: int, degraded: bool) -> float:
        """Seconds per training step with ``num_pipelines`` active pipelines.

        A measured row wins. Between two measured pipeline counts the non-degraded time is
        interpolated linearly in 1/P; a degraded step is its own row where the table has
        one, otherwise the non-degraded time times ``degraded_slowdown``. Outside the
        measured rows: :class:`OutsideCalibration` (one line naming the range).
        """
        seconds, inside = self.step_time_bound_s(num_pipelines, degraded)
        if not inside:
            low, high = self.pipeline_range
            raise OutsideCalibration(
                f"model {self.name!r} has step times for {low}-{high} pipelines of "
                f"{self.num_stages} stages, not {num_pipelines}; measure that pipeline count "
                "(spotline calibrate --pipelines) or plan within the measured rows"
            )
        return seconds

    def step_time_bound_s(self, num_pipelines: int, degraded: bool) -> tuple[float, bool]:
        """``(seconds, inside)``: :meth:`step_time_s` where the rows cover ``num_pipelines``
        (``inside`` True); otherwise a bound that never flatters (``inside`` False).

        With a fixed global batch a step's time is a part that does not shrink with the
        pipeline count plus per-pipeline work that shrinks as 1/P, so it never grows with P
        and falls at most as 1/P. Above the most pipelines measured, the bound is that
        count's time (no speed-up assumed); below the fewest, that count's time scaled by
        fewest / P (as if nothing of the step were fixed: the slowest a step can get). Both
        understate throughput; the simulator reports the time spent on them.
        """
        cached = self._cache.get((num_pipelines, degraded))
        if cached is not None:
            return cached
        if num_pipelines < 1:
            raise ValueError(f"num_pipelines must be >= 1, got {num_pipelines}")
        value = self._bound(num_pipelines, degraded)
        self._cache[(num_pipelines, degraded)] = value
        return value

    def _bound(self, num_pipelines: int, degraded: bool) -> tuple[float, bool]:
        if degraded:
            for row in self.step_times:
                if (row.num_stages, row.num_pipelines, row.degraded) == (
                    self.num_stages,
                    num_pipelines,
                    True,
                ):
                    return row.step_time_s, True
            base, inside = self.step_time_bound_s(num_pipelines, False)
            return base * self.degraded_slowdown, inside
        rows = self._rows
        low, high = rows[0], rows[-1]
        if num_pipelines < low[0]:
            return low[1] * low[0] / num_pipelines, False
        if num_pipelines > high[0]:
            return high[1], False
        for (p0, t0), (p1, t1) in zip(rows, rows[1:], strict=False):
            if p0 <= num_pipelines <= p1:
                return _interpolate(num_pipelines, p0, t0, p1, t1), True
        # A single row: low == high == num_pipelines (the loop above had nothing to pair).
        assert low[0] == num_pipelines == high[0], (num_pipelines, rows)
        return low[1], True


def _interpolate(pipelines: int, p0: int, t0: float, p1: int, t1: float) -> float:
    """The step time at ``pipelines`` on the line through (1/p0, t0) and (1/p1, t1).

    Linear in 1/P, not in P: with a fixed global batch a step is a fixed part plus
    per-pipeline work proportional to 1/P, so between two measured counts step time is
    affine in 1/P; the neighbours' rows are reproduced exactly at their own counts.
    """
    if pipelines == p0:
        return t0
    if pipelines == p1:
        return t1
    weight = (1.0 / pipelines - 1.0 / p0) / (1.0 / p1 - 1.0 / p0)
    return t0 + (t1 - t0) * weight


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
    # The shipped name it was loaded by (see NAMED_CALIBRATIONS); "" for a file.
    name: str = ""

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


def resolve_calibration(name_or_path: str | Path | None) -> tuple[str, Path]:
    """``(name, path)`` of a calibration given by shipped name or by file (None: the
    default); the name is "" for a file. An unknown name is a one-line UserError."""
    if name_or_path is None:
        return DEFAULT_CALIBRATION, NAMED_CALIBRATIONS[DEFAULT_CALIBRATION]
    text = str(name_or_path)
    if text in NAMED_CALIBRATIONS:
        return text, NAMED_CALIBRATIONS[text]
    path = Path(name_or_path)
    # A bare word that is no file is a mistyped name, not a missing file.
    if not path.exists() and path.suffix != ".json" and len(path.parts) == 1:
        known = ", ".join(NAMED_CALIBRATIONS)
        raise UserError(
            f"unknown calibration {text!r}; use one of {known} or a calibration JSON file"
        )
    return "", path


def load_calibration(name_or_path: str | Path | None = None) -> Calibration:
    """Read and validate a calibration table, named (:data:`NAMED_CALIBRATIONS`) or a file
    (the default, :data:`DEFAULT_CALIBRATION`, when None). Any problem is a UserError naming
    the file and the offending key."""
    shipped_name, path = resolve_calibration(name_or_path)
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
        name=shipped_name,
    )
