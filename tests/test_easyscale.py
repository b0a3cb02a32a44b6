"""EasyScale in Spotline: N logical pipelines on any number of processes, bitwise the same.

Every test runs `spotline train` (coordinator + real worker processes on gloo) with dropout
on, and compares `param_sha256` (and every step's loss) exactly with the same logical
topology on a different number of processes. The processes change under the run by
`--rescale` (SIGKILL removals, new processes joining in place), `--inject` kills and
arrivals, a fatal loss restored from a checkpoint, and a slow process whose logical workers
are moved to a faster one.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import small_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 8
# Dropout on (gpt2-tiny's default): the logical worker, not the process, owns the masks.
CONFIG = small_config(training={"steps": STEPS})


def train(spotline_train: Any, workers: int, logical: int, *flags: str, **sections: Any) -> Any:
    config = small_config(training={"steps": STEPS}, **sections) if sections else CONFIG
    return spotline_train(
        config,
        "--workers",
        str(workers),
        "--logical-workers",
        str(logical),
        *(flags or ("--stages", "1")),
        name=f"m{workers}-n{logical}-{len(flags)}",
    )


def placement(summary: dict[str, Any], generation: int = 0) -> list[list[int]]:
    entry = next(p for p in summary["logical_placements"] if p["generation"] == generation)
    return [pipeline["logical_workers"] for pipeline in entry["pipelines"]]


@pytest.fixture(scope="module")
def four_logical_on_four(tmp_path_factory: Any) -> dict[str, Any]:
    """The static run every N=4, one-stage test compares with: one process per logical worker."""
    from conftest import read_summary, run_spotline, write_config

    root = tmp_path_factory.mktemp("n4")
    cfg = write_config(root / "c.json", CONFIG)
    proc = run_spotline(
        ["train", "--config", str(cfg), "--output", str(root / "run"), "--workers", "4"]
        + ["--stages", "1", "--logical-workers", "4"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(root / "run")
    assert placement(summary) == [[0], [1], [2], [3]]
    return summary


def same_run(summary: dict[str, Any], baseline: dict[str, Any]) -> None:
    assert summary["param_sha256"] == baseline["param_sha256"]
    assert summary["losses"] == baseline["losses"]  # exact floats, every step


def test_four_logical_workers_on_one_process_train_the_same_parameters(
    spotline_train, four_logical_on_four
) -> None:
    # One process running all four in turn; two and three processes are the rescaled run's
    # generations (test_rescaled_four_two_three_one_equals_the_static_run).
    summary = train(spotline_train, 1, 4)
    assert placement(summary) == [[0, 1, 2, 3]]  # k logical workers run in turn on one process
    assert summary["logical_workers"] == 4 and summary["pipelines"] == 1
    same_run(summary, four_logical_on_four)


def test_six_logical_workers_on_four_processes_equal_one(spotline_train) -> None:
    # Four processes hosting 1, 1, 2 and 2 of the six against one hosting all six: the two
    # placements furthest apart (six processes of one each are the four-process run's
    # single-worker hosts, already in it).
    uneven = train(spotline_train, 4, 6)
    assert sorted(len(ws) for ws in placement(uneven)) == [1, 1, 2, 2]
    same_run(train(spotline_train, 1, 6), uneven)


def test_rescaled_four_two_three_one_equals_the_static_run(
    spotline_train, four_logical_on_four
) -> None:
    summary = train(spotline_train, 4, 4, "--stages", "1", "--rescale", "2:2,4:3,6:1")
    same_run(summary, four_logical_on_four)
    # The run really went 4 -> 2 -> 3 -> 1 processes, in place: SIGKILLs, an arrival, no
    # checkpoint (none is written), no restart.
    hosted = [placement(summary, p["generation"]) for p in summary["logical_placements"]]
    assert hosted[0] == [[0], [1], [2], [3]] and hosted[-1] == [[0, 1, 2, 3]]
    # On two and three processes some process runs several logical workers in turn (the
    # static one-process run is test_four_logical_workers_on_one_process_...).
    for size in (2, 3):
        assert any(len(h) == size and max(map(len, h)) > 1 for h in hosted), hosted
    assert all(sorted(w for ws in h for w in ws) == [0, 1, 2, 3] for h in hosted), hosted
    assert summary["preemptions"] == 4
    assert summary["checkpoint_fallbacks"] == 0
    assert all(event["recovery_s"] > 0 for event in summary["recovery_events"])


def test_a_killed_process_replaced_by_a_new_one_equals_the_static_run(
    spotline_train, four_logical_on_four
) -> None:
    summary = train(
        spotline_train, 4, 4, "--stages", "1", "--inject", "kill:3:1", "--inject", "add:5"
    )
    same_run(summary, four_logical_on_four)
    assert summary["preemptions"] == 1 and summary["checkpoint_fallbacks"] == 0
    assert len(placement(summary, summary["generations"] - 1)) == 4  # back to four


@pytest.fixture(scope="module")
def two_pipelines_on_four(tmp_path_factory: Any) -> dict[str, Any]:
    """Two logical pipelines of two stages on four processes: the static run the N=2,
    two-stage tests compare with."""
    from conftest import read_summary, run_spotline, write_config

    root = tmp_path_factory.mktemp("n2s2")
    cfg = write_config(root / "c.json", CONFIG)
    proc = run_spotline(
        ["train", "--config", str(cfg), "--output", str(root / "run"), "--workers", "4"]
        + ["--stages", "2", "--logical-workers", "2"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(root / "run")
    assert placement(summary) == [[0], [1]]
    return summary


def test_two_logical_pipelines_of_two_stages_on_two_and_four_processes(
    spotline_train, two_pipelines_on_four
) -> None:
    one_pipeline = train(spotline_train, 2, 2, "--stages", "2")
    assert placement(one_pipeline) == [[0, 1]]
    same_run(one_pipeline, two_pipelines_on_four)


def test_a_fatal_loss_restored_from_a_checkpoint_on_fewer_processes_continues_bitwise(
    spotline_train, two_pipelines_on_four
) -> None:
    static = two_pipelines_on_four
    # Without redundancy (lazy is the default) both stage-0 workers hold stage 0's only
    # copies: killing both is a fatal loss; the two survivors restore from the checkpoint of
    # step 2 and run both logical pipelines on one physical pipeline.
    summary = train(
        spotline_train,
        4,
        2,
        "--stages",
        "2",
        "--redundancy",
        "off",
        "--checkpoint-interval",
        "2",
        "--inject",
        "kill:4:0",
        "--inject",
        "kill:4:1",
    )
    assert summary["checkpoint_fallbacks"] == 1
    assert placement(summary, summary["generations"] - 1) == [[0, 1]]
    same_run(summary, static)


def test_a_restart_of_every_process_from_a_checkpoint_continues_bitwise(
    spotline_train, four_logical_on_four
) -> None:
    # The checkpoint-restart policy: a SIGKILL restarts every process from the last
    # checkpoint (parameters and optimizer state by logical stage, and the step). Nothing
    # else of a logical worker is saved: its samples and seeds follow from the step.
    flags = "--stages 1 --recovery checkpoint-restart --checkpoint-interval 2 --inject kill:4:1"
    summary = train(spotline_train, 2, 4, *flags.split())
    assert summary["checkpoint_fallbacks"] == 1 and summary["steps_redone"] >= 1
    same_run(summary, four_logical_on_four)


def test_a_slow_process_is_given_fewer_logical_workers_and_the_math_holds(
    spotline_train, four_logical_on_four
) -> None:
    summary = train(
        spotline_train,
        2,
        4,
        "--stages",
        "1",
        elasticity={"slow_worker": 1, "slow_factor": 4.0, "rebalance_every": 2},
    )
    same_run(summary, four_logical_on_four)
    assert placement(summary) == [[0, 1], [2, 3]]  # nothing measured yet: an even split
    # Worker w1 (pipeline 1) computes four times slower: the workers measure it and move
    # logical workers to w0 (3 vs 1 is the proportional split of 4 at speeds 1 : 1/4).
    moves = summary["logical_rebalances"]
    assert moves, "no rebalance happened"
    assert [len(ws) for ws in moves[-1]["pipelines"]] == [3, 1]


def failed_run(tmp_path: Any, lr: float, *flags: str) -> str:
    """Run with AdamW at learning rate ``lr``; expect exit 1 and return its one error line."""
    from conftest import run_spotline, write_config

    config = small_config(training={"steps": STEPS})
    config["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True},
    }
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", "--config", str(write_config(tmp_path / "c.json", config)), "--output", str(out)]
        + ["--stages", "1", *flags]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert not (out / "summary.json").exists()
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    return line


def test_a_non_finite_gradient_stops_the_run_naming_the_step_and_logical_workers(tmp_path) -> None:
    # A learning rate of 1e30 makes every parameter overflow in the first update: the
    # second step's gradients are NaN in every logical worker. Nothing may fold them in.
    line = failed_run(tmp_path, 1e30, "--workers", "2", "--logical-workers", "4")
    assert "step 1: non-finite gradient" in line and "[0, 1, 2, 3]" in line, line


def test_an_error_in_the_training_itself_stops_the_run_instead_of_retrying(tmp_path) -> None:
    # lr 1e38 overflows inside AdamW's own update (a RuntimeError on every rank, no process
    # lost): redoing the step would fail the same way forever.
    line = failed_run(tmp_path, 1e38, "--workers", "1", "--logical-workers", "2")
    assert "no process lost" in line and "overflow" in line, line


def test_a_causal_lm_of_no_family_trains_whole_and_survives_a_kill(spotline_train, tmp_path):
    """An OPT (no family: one whole-model layer, one stage) with dropout on: two processes,
    one killed in step 3, against one process hosting both logical workers undisturbed."""
    import transformers
    from conftest import write_tiny_opt

    from spotline.runtime import param_sha256

    model = write_tiny_opt(tmp_path / "opt", dropout=0.1)
    config = small_config(model={"name": model}, training={"steps": 4})
    flags = ("--logical-workers", "2", "--stages", "1")
    killed = spotline_train(config, "--workers", "2", *flags, "--inject", "kill:3:1", name="k")
    alone = spotline_train(config, "--workers", "1", *flags, name="alone")
    same_run(killed, alone)
    assert killed["preemptions"] == 1 and killed["checkpoint_fallbacks"] == 0
    # The export is the transformers model with the run's parameters (its tie counted once).
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "k" / "model")
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert param_sha256(dict(loaded.named_parameters())) == killed["param_sha256"]
