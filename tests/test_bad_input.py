"""User mistakes: one clear line on stderr, exit code 2, no summary.json that looks finished."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_spotline, small_config, write_config, write_tiny_opt

pytestmark = pytest.mark.timeout(120)


def _check(proc, output: Path, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("spotline: error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert not (output / "summary.json").exists()


def test_missing_model_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_spotline(["train", "--model", str(tmp_path / "no-such-model"), "--output", str(out)])
    _check(proc, out, "no-such-model", "save_pretrained")


def test_corpus_too_small_for_one_batch(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("just a few words\n")
    out = tmp_path / "out"
    proc = run_spotline(["train", "--data", str(corpus), "--output", str(out)])
    _check(proc, out, "tiny.txt", "sequences")


def test_config_key_typo(tmp_path: Path) -> None:
    config = small_config()
    config["spotline"]["redundancy"] = {"mdoe": "eager"}
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", "--config", str(write_config(tmp_path / "c.json", config)), "--output", str(out)]
    )
    _check(proc, out, "spotline.redundancy.mdoe", "mode")


def test_more_stages_than_layers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_spotline(["train", "--stages", "8", "--workers", "8", "--output", str(out)])
    _check(proc, out, "--stages 8", "4 transformer blocks")


def test_workers_not_divisible_by_stages(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_spotline(["train", "--workers", "3", "--stages", "2", "--output", str(out)])
    _check(proc, out, "--workers 3", "--stages 2")


def test_rejected_run_leaves_the_output_directory_alone(tmp_path: Path) -> None:
    """Validation happens before anything is written: an earlier run's files stay as they were."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"earlier": true}')
    proc = run_spotline(["train", "--workers", "3", "--stages", "2", "--output", str(out)])
    assert proc.returncode == 2
    assert (out / "summary.json").read_text() == '{"earlier": true}'
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_trace_that_never_holds_enough_workers(tmp_path: Path) -> None:
    trace = tmp_path / "thin.csv"
    trace.write_text("0,add,n1\n60000,remove,n1\n120000,add,n2\n")
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", "--workers", "2", "--stages", "2", "--trace", str(trace), "--output", str(out)]
    )
    _check(proc, out, "thin.csv", "at most 1 worker", "--max-workers")


def test_negative_warm_workers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_spotline(["train", "--warm-workers", "-1", "--output", str(out)])
    _check(proc, out, "spotline.recovery.warm_workers", "negative")


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--rescale", "3"], ["--rescale '3'", "STEP:M"]),
        (["--rescale", "3:2,2:1"], ["step 2 does not come after step 3"]),
        (["--rescale", "2:0"], ["leaves no process"]),
        (["--rescale", "99:2", "--steps", "10"], ["step 99 is not inside the run"]),
        (["--rescale", "2:1", "--stages", "2", "--workers", "2"], ["cannot hold the 2 stages"]),
        (["--logical-workers", "0"], ["spotline.elasticity.logical_workers"]),
        (["--rescale", "2:3", "--max-workers", "2"], ["exceed --max-workers 2"]),
    ],
)
def test_bad_logical_workers_and_rescales(tmp_path: Path, flags, needles) -> None:
    out = tmp_path / "out"
    proc = run_spotline(["train", "--stages", "1", "--workers", "2", *flags, "--output", str(out)])
    _check(proc, out, *needles)


def test_output_naming_an_existing_file(tmp_path: Path) -> None:
    """Refused before any work (no model or corpus is loaded), the file left alone."""
    out = tmp_path / "a-file"
    out.write_text("mine")
    proc = run_spotline(["train", "--output", str(out)])
    _check(proc, tmp_path / "nowhere", f"--output {out}", "is a file")
    assert out.read_text() == "mine"


def test_output_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    out = blocker / "run"
    proc = run_spotline(["train", "--output", str(out)])
    _check(proc, tmp_path / "nowhere", f"--output {out}", "cannot be created", str(blocker))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_resume_of_a_directory_without_a_run(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    proc = run_spotline(["train", "--resume", str(out)])
    _check(proc, out, f"--resume {out}", "config.resolved.json")
    assert list(out.iterdir()) == []


def test_fewer_logical_workers_than_pipelines_is_one_rule_for_both_launchers(
    tmp_path: Path,
) -> None:
    """4 processes on 1 stage form 4 pipelines: 3 logical workers would leave one idle.
    `spotline train` trained that way while DeepSpeed's launcher refused it; both refuse."""
    import subprocess
    import sys

    from conftest import REPO, child_env

    flags = ["--logical-workers", "3", "--stages", "1"]
    out = tmp_path / "out"
    proc = run_spotline(["train", "--workers", "4", *flags, "--output", str(out)])
    _check(proc, out, "--logical-workers 3", "4 pipelines", "at least 4 logical workers")
    # DeepSpeed's launcher: rank 0 of 4 (the world size is the number of processes); the
    # config is refused before any process group is formed.
    env = child_env()
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4")
    launcher = subprocess.run(
        [sys.executable, "launch/train.py", *flags, "--output", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    _check(launcher, out, "--logical-workers 3", "4 pipelines")
    assert launcher.stderr.strip() == proc.stderr.strip()  # the same rule, the same words


def test_more_than_one_stage_of_a_model_of_no_family(tmp_path: Path) -> None:
    model = write_tiny_opt(tmp_path / "opt")
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", "--model", model, "--stages", "2", "--workers", "2", "--output", str(out)]
    )
    _check(proc, out, "--stages 2", "opt", "--stages 1", "gpt2, gpt_neox, llama")
    assert not out.exists()


# -- messages that name the flag at fault, and refusals that leave nothing ---------------------


def test_a_missing_eval_file_is_named_as_eval_data_not_data(tmp_path: Path) -> None:
    """The loader's message was --data's ("omit --data for the built-in corpus")."""
    out = tmp_path / "out"
    missing = tmp_path / "my-eval.jsonl"
    proc = run_spotline(["train", "--eval-data", str(missing), "--output", str(out)])
    _check(proc, out, f"--eval-data {missing} does not exist", "--eval-holdout")
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    assert "--data" not in error, error
    assert not out.exists()


def test_more_stages_than_blocks_and_indivisible_workers_are_said_at_once(
    tmp_path: Path,
) -> None:
    """`--workers 4 --stages 8`: "use a multiple of 8 workers" alone led straight to the
    next refusal ("--stages 8 is more than the model's 4 transformer blocks")."""
    out = tmp_path / "out"
    proc = run_spotline(["train", "--workers", "4", "--stages", "8", "--output", str(out)])
    _check(proc, out, "--stages 8", "4 transformer blocks", "--workers 4", "--stages 4 --workers 4")
    assert not out.exists()


def test_a_coordinator_that_cannot_listen_writes_nothing(tmp_path: Path) -> None:
    """An address this machine does not have (TEST-NET-1: binding fails locally, no packet
    is sent): refused before the config and the job token are written."""
    out = tmp_path / "out"
    proc = run_spotline(
        ["coordinator", "--listen", "192.0.2.1:29400", "--output", str(out)], timeout=60
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    # Neither config.resolved.json nor job-token (nor the directory) is left behind.
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    _check(proc, out, "--listen 192.0.2.1:29400", "cannot listen", "an address of this machine")
