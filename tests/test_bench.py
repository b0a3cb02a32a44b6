"""``spotline bench``: the redundancy benchmark end to end (smoke size) and its bad input.

Timings are never asserted (a shared 2-core machine); only the shape of the report and the
values that come from the pure schedule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_spotline

from spotline.launch.bench import command, jobs


@pytest.fixture(scope="module")
def quick_redundancy(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """``spotline bench redundancy --quick --cases 2x2``, run once: (the JSON, stdout)."""
    out = tmp_path_factory.mktemp("bench")
    proc = run_spotline(
        ["bench", "redundancy", "--quick", "--cases", "2x2", "--output", str(out)], timeout=540
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "bench-redundancy.json").read_text()), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_redundancy_quick_first_case(quick_redundancy: tuple[dict[str, Any], str]) -> None:
    report, stdout = quick_redundancy
    assert report["steps"] == command.QUICK_STEPS and report["repeats"] == command.QUICK_REPEATS
    [case] = report["cases"]
    assert (case["case"], case["stages"], case["workers"], case["micro_batches"]) == (
        "2x2",
        2,
        2,
        2,
    )
    # From the pure schedule: with 2 stages x 2 micro-batches every redundant forward fits a bubble.
    assert case["hidden_fraction"] == 1.0
    assert case["modes"]["eager"]["num_extra_steps"] == 0
    assert set(case["modes"]) == {"off", "lazy", "eager"}
    for mode, m in case["modes"].items():
        assert m["step_time_s"] > 0, mode
        assert len(m["peak_rss_mib_per_rank"]) == 2 and min(m["peak_rss_mib_per_rank"]) > 0, mode
    assert case["modes"]["off"]["step_time_ratio_to_off"] == 1.0
    # Redundancy never changes the math: every mode ends on the same parameters.
    hashes = {tuple(m["param_sha256"]) for m in case["modes"].values()}
    assert len(hashes) == 1 and len(next(iter(hashes))) == 1
    # The table and the eager grid reached stdout.
    assert "| 2x2 (2 procs) | eager |" in stdout
    assert "rank 0" in stdout and "1RF0" in stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_redundancy_reports_redundant_compute_and_sync(
    quick_redundancy: tuple[dict[str, Any], str],
) -> None:
    """The per-rank seconds come from the training summary; only eager runs redundant forwards."""
    report, _ = quick_redundancy
    assert report["missing_fields"] == []
    modes = report["cases"][0]["modes"]
    assert modes["off"]["redundant_compute_s_per_step_per_rank"] == [0.0, 0.0]
    assert modes["off"]["replica_sync_s_per_step_per_rank"] == [0.0, 0.0]
    assert modes["lazy"]["redundant_compute_s_per_step_per_rank"] == [0.0, 0.0]
    assert min(modes["lazy"]["replica_sync_s_per_step_per_rank"]) > 0
    assert min(modes["eager"]["redundant_compute_s_per_step_per_rank"]) > 0
    # Model state counted from the tensors: a replica's state on top of its own.
    assert modes["off"]["model_state_ratio_to_off_max_rank"] == 1.0
    assert modes["lazy"]["model_state_ratio_to_off_max_rank"] > 1.5
    for mode in ("off", "lazy", "eager"):
        spread = modes[mode]["spread_to_off"]
        assert spread["min"] <= spread["median"] <= spread["max"], mode


def test_per_worker_summaries_become_per_rank_lists() -> None:
    summary = {"peak_rss_mib_per_worker": {"w10": 3.0, "w2": 2.0, "w0": 1.0}, "steps": 4}
    out = jobs.with_per_rank_lists(summary)
    assert out["peak_rss_mib_per_rank"] == [1.0, 2.0, 3.0]
    assert "redundant_compute_s_per_rank" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ["nope"],
        [],
        ["foundation", "--steps", "0"],
        ["redundancy", "--repeats", "0"],
        ["redundancy", "--cases", "2by2"],
        ["redundancy", "--cases", "1x4"],
        ["redundancy", "--pipelines", "0"],
        ["redundancy", "--modes", "lazy,fast"],
        ["redundancy", "--modes", "lazy-sharded"],
        ["redundancy", "--modes", ","],
        ["redundancy", "--alternate", "0"],
        ["redundancy", "--alternate", "5"],
        ["foundation", "--alternate", "5"],
        ["foundation", "--alternate", "-1"],
        ["foundation", "--cases", "2x2"],
        ["reduce", "--ranks", "2", "--logical-workers", "3"],
        ["reduce", "--elements", "0"],
        ["easyscale", "--workers", "0"],
        ["foundation", "--ladder", "gpt2", "--model", "gpt2-big"],
        ["foundation", "--ladder", "nope"],
        ["cluster", "--ladder", "gpt2"],
        ["reduce", "--model", "gpt2-big", "--elements", "5"],
        ["reduce", "--model", "no-such-model"],
        ["overlap", "--ranks", "1"],
        ["overlap", "--elements", "0"],
        ["overlap", "--model", "gpt2-big", "--elements", "5"],
        ["overlap", "--device", "tpu"],
        ["takeover", "--kill-at", "0"],
        ["takeover", "--steps", "5", "--kill-at", "5"],
        ["foundation", "--stages", "3"],
        ["profile", "--stages", "four"],
        ["takeover", "--stages", "4"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    assert command.main([*argv, "--output", str(out)] if argv else argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("spotline: error: "), captured.err
    assert captured.out == ""
    assert not out.exists()


def test_cli_dispatches_bench_bad_input() -> None:
    proc = run_spotline(["bench", "redundancy", "--steps", "0"], timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "spotline: error: --steps 0: use at least 1 step"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reduce_compares_the_exact_sum_with_a_float_all_reduce(tmp_path: Path) -> None:
    proc = run_spotline(
        ["bench", "reduce", "--elements", "20000", "--steps", "3", "--output", str(tmp_path)],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench-reduce.json").read_text())
    assert (report["ranks"], report["logical_workers"], report["elements"]) == (2, 4, 20000)
    assert report["plain_ms"] > 0 and report["exact_ms"] > 0
    # Sent per rank, each hosting 2 of the 4: the sharded sum's all-to-all (its 2 workers'
    # halves for the other rank) and all-gather (its half of the sum), float32; the MAX's
    # int32 ring (which rank hosts each logical worker).
    assert report["plain_bytes"] == 4 * 20000
    assert report["exact_bytes"] == 4 * (2 * 10000 + 10000) + 4 * 4
    assert "exact (fixed order)" in proc.stdout


def test_overlap_times_the_exchange_the_step_and_both(tmp_path: Path) -> None:
    """Three ranks, so that each sends to one neighbour and receives from the other; every
    rank checks it received its successor's gradient bit for bit (a rank that did not exits
    non-zero and fails the bench)."""
    proc = run_spotline(
        ["bench", "overlap", "--elements", "30000", "--ranks", "3", "--steps", "3"]
        + ["--output", str(tmp_path)],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench-overlap.json").read_text())
    assert (report["ranks"], report["elements"], report["backend"]) == (3, 30000, "gloo")
    assert report["bytes_sent_per_rank"] == 4 * 30000
    rounds = report["rounds_ms"]
    variants = ("exchange", "step", "both", "beside_idle")
    assert [len(rounds[v]) for v in variants] == [3, 3, 3, 3]
    for variant, key in (
        ("both", "hidden_fractions"),
        ("beside_idle", "hidden_fractions_beside_idle"),
    ):
        assert report[key] == [
            (e + s - b) / e
            for e, s, b in zip(rounds["exchange"], rounds["step"], rounds[variant], strict=True)
        ]
    assert "hidden fraction of the exchange" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_parallel_baseline_and_exact_engine_run_side_by_side(tmp_path: Path) -> None:
    """The easyscale bench's step-time pair: stock DeepSpeedEngine and spotline.exact.dp_engine on
    the same 2 processes (smoke size; timings are reported, never asserted)."""
    from conftest import small_config, write_config

    from spotline.launch.bench.easyscale import run_dp

    config = write_config(tmp_path / "c.json", small_config(topology={"stages": 1, "workers": 2}))
    for mode in ("stock", "exact"):
        result = run_dp(mode, config, 2, 3, tmp_path / mode)
        assert result["mode"] == mode and result["step_time_s"] > 0
        assert len(result["peak_rss_mib_per_rank"]) == 2


def test_two_pipelines_add_the_sharded_mode_with_its_flags_and_schedule() -> None:
    """``--pipelines 2``: each case runs 2 pipelines and benches lazy-sharded beside the
    three modes, as lazy with ``--replica sharded``, on lazy's schedule without its replay
    stashes; one pipeline benches the three modes only."""
    from spotline.launch.bench.redundancy_bench import MODE_FLAGS, parse_cases, schedule_facts

    [one] = parse_cases("2x4")
    [two] = parse_cases("2x4", pipelines=2)
    assert (one.num_workers, two.num_workers) == (2, 4)
    assert one.modes == ("off", "lazy", "eager")
    assert two.modes == ("off", "lazy", "eager", "lazy-sharded")
    assert MODE_FLAGS["lazy-sharded"] == ("--redundancy", "lazy", "--replica", "sharded")
    facts = schedule_facts(two)
    assert "lazy-sharded" not in schedule_facts(one)["num_schedule_steps"]
    # The same steps as lazy: only the stashes (no steps of their own) are left out.
    assert facts["num_schedule_steps"]["lazy-sharded"] == facts["num_schedule_steps"]["lazy"]
    assert facts["num_extra_steps"]["lazy-sharded"] == 0


def test_modes_choose_what_runs_beside_off_in_a_fixed_order() -> None:
    """``--modes``: only the modes named run, always beside off (every ratio is over it), in
    the bench's own order whatever order they were named in."""
    from spotline.errors import UserError
    from spotline.launch.bench.ladder import _redundancy
    from spotline.launch.bench.redundancy_bench import parse_cases

    [two] = parse_cases("2x4", pipelines=2, modes="lazy-sharded, LAZY")
    assert two.modes == ("off", "lazy", "lazy-sharded")
    [one] = parse_cases("2x4", modes="off")
    assert one.modes == ("off",)
    [every] = parse_cases("2x4", modes=None)
    assert every.modes == ("off", "lazy", "eager")
    with pytest.raises(UserError, match="needs --pipelines 2"):
        parse_cases("2x4", modes="lazy-sharded")
    # The ladder's table takes the modes a case ran.
    spread = {"min": 1.0, "median": 1.0, "max": 1.0}
    report = {
        "cases": [{"case": "2x4", "modes": {m: {"spread_to_off": spread} for m in two.modes}}]
    }
    assert sorted(_redundancy(report)) == ["lazy / off step, 2x4", "lazy-sharded / off step, 2x4"]
