"""The model ladder and the figures every benchmark reports with it, without processes:
rung overrides, spreads over rounds, the ladder table, model-state bytes by storage."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from spotline.config import load_config, with_overrides
from spotline.errors import UserError
from spotline.launch.bench import jobs, ladder
from spotline.models.model_config import PRESETS
from spotline.pipeline.memory import storage_bytes
from spotline.wire.protocol import ModelStateBytes


def test_every_rung_is_a_preset_and_every_ladder_grows() -> None:
    assert set(ladder.RUNGS) <= set(PRESETS)
    for family, models in ladder.LADDERS.items():
        assert all(m.startswith(family) and m in ladder.RUNGS for m in models)
        sizes = [ladder.parameters(m) for m in models]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), (family, sizes)


def test_a_rung_brings_its_batch_shape_and_other_models_keep_the_config() -> None:
    base = load_config(None)
    cfg = with_overrides(base, ladder.model_overrides("gpt2-big"))
    assert (cfg.spotline.model.name, cfg.spotline.model.seq_len, cfg.micro_batch_size) == (
        "gpt2-big",
        128,
        2,
    )
    other = with_overrides(base, ladder.model_overrides("neox-tiny"))
    assert other.spotline.model.name == "neox-tiny"
    assert (other.spotline.model.seq_len, other.micro_batch_size) == (
        base.spotline.model.seq_len,
        base.micro_batch_size,
    )
    with pytest.raises(UserError, match="no such ladder"):
        ladder.ladder_models("gpt3")


def test_round_ratios_pair_interleaved_rounds() -> None:
    results = {
        "a": [{"step_time_s": 2.0}, {"step_time_s": 3.3}, {"step_time_s": 1.0}],
        "b": [{"step_time_s": 1.0}, {"step_time_s": 3.0}, {"step_time_s": 1.0}],
    }
    ratios = jobs.round_ratios(results, "a", "b")
    assert ratios == [2.0, 3.3 / 3.0, 1.0]
    s = jobs.spread(ratios)
    assert (s["min"], s["median"], s["max"]) == (1.0, 3.3 / 3.0, 2.0)
    assert jobs.format_spread(s) == "1.100 (1.000-2.000)"


def test_the_median_interval_is_the_narrowest_order_statistic_pair_of_90_percent() -> None:
    def level(n: int, k: int) -> float:  # P(k <= rounds below the median <= n - k)
        return sum(math.comb(n, i) for i in range(k, n - k + 1)) / 2**n

    for n in range(1, 25):
        values = [10.0 + i for i in range(n)][::-1]  # any order
        low, high, got = jobs.median_interval(values)
        k = int(low - 10.0) + 1
        assert high == 10.0 + n - k and got == level(n, k), n
        if n >= 5:
            assert got >= jobs.MEDIAN_LEVEL > level(n, k + 1), n
        else:  # too few rounds for 90%: the whole range, at what it is worth
            assert (low, high) == (10.0, 10.0 + n - 1), n
    assert jobs.median_interval([1.0] * 8 + [5.0] * 4)[:2] == (1.0, 5.0)
    s = jobs.spread([1.03, 0.95, 1.07, 1.01, 1.02, 1.04, 0.99, 1.05])
    assert jobs.format_median_interval(s) == "0.990-1.050 at 93%"


def test_the_ladder_table_has_a_row_per_rung_and_headline(tmp_path: Path) -> None:
    spread = {"min": 1.01, "median": 1.02, "max": 1.05}
    report = ladder.ladder_report(
        "foundation",
        [
            ("gpt2-tiny", 224_896, {"spread": {"step_time_s": spread, "off_step_time_s": spread}}),
            (
                "gpt2-big",
                14_345_472,
                {"spread": {"step_time_s": spread, "off_step_time_s": spread}},
            ),
        ],
    )
    table = ladder.format_ladder(report)
    assert "| gpt2-big | 14,345,472 | spotline / stock step | 1.020 | 1.010 | 1.050 |" in table
    assert len([line for line in table.splitlines() if line.startswith("| gpt2")]) == 4
    png = tmp_path / "ladder.png"
    ladder.plot_ladder(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_state_bytes_count_each_storage_once() -> None:
    weight = torch.zeros(10, 4)
    view = weight[2:]  # a view of the same storage: not counted again
    other = torch.zeros(3, dtype=torch.float64)
    assert storage_bytes([weight, view, None, other]) == 10 * 4 * 4 + 3 * 8


def test_model_state_peak_and_json() -> None:
    a = ModelStateBytes(parameters=10, gradients=10, stash=5)
    b = ModelStateBytes(parameters=10, gradients=0, stash=7, eager_graph=3)
    peak = a.peak(b)
    assert (peak.parameters, peak.gradients, peak.stash, peak.eager_graph) == (10, 10, 7, 3)
    assert peak.total == 30
    assert ModelStateBytes.from_json(peak.to_json()) == peak


def test_a_takeover_is_split_into_redo_setup_and_state() -> None:
    from spotline.launch.bench.takeover import takeover_phases

    def setup(generation: int, join: float, build: float, state: float, nbytes: int) -> dict:
        return {
            "generation": generation,
            "join_s": join,
            "build_s": build,
            "state_s": state,
            "state_bytes": nbytes,
        }

    summary = {
        "recovery_events": [{"generation": 1, "resume_step": 2, "recovery_s": 3.0}],
        "step_times_s": [0.5, 0.5, 1.25, 0.5],
        "generation_setups": {
            # Generation 0 is not the takeover's; the slowest member of each phase is.
            "w0": [setup(0, 9.0, 9.0, 9.0, 1), setup(1, 0.25, 0.5, 0.75, 100)],
            "w2": [setup(0, 9.0, 9.0, 9.0, 1), setup(1, 0.5, 0.25, 0.5, 60)],
        },
    }
    assert takeover_phases(summary) == {
        "recovery_s": 3.0,
        "redo_s": 1.25,
        "takeover_s": 1.75,
        "join_s": 0.5,
        "build_s": 0.5,
        "state_s": 0.75,
        "over_state_s": 1.0,
        "state_bytes": 160.0,
    }
