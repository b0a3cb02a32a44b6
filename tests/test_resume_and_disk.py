"""Issue 10, points 2 and 3: a full disk, Ctrl-C and ``spotline train --resume``.

The pure parts (which config keys a resume must keep, the checkpoint writer's error
callback) are tested without processes; one scenario each runs real processes: a run
stopped by Ctrl-C and resumed (against the uninterrupted run's hash and losses), a run
stopped at once by two Ctrl-Cs, and runs whose output is on a 3 MB tmpfs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from components import missing
from conftest import (
    file_stamps,
    interrupt_run,
    read_summary,
    run_spotline,
    small_config,
    write_config,
)
from wandb_records import logged

from spotline.checkpointing.checkpoint import MANIFEST, CheckpointWriter, latest_complete, step_dir
from spotline.config import parse_config

# -- pure: what a resume must keep -----------------------------------------------------


def _cfg(**sections: Any) -> Any:
    raw = small_config(topology={"workers": 4, "stages": 2})
    for key, value in sections.items():
        if key in ("optimizer", "gradient_clipping", "train_micro_batch_size_per_gpu"):
            raw[key] = value
        else:
            raw["spotline"][key] = {**raw["spotline"].get(key, {}), **value}
    return parse_config(raw)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"training": {"seed": 8}}, "spotline.training.seed"),
        ({"model": {"seq_len": 16}}, "spotline.model.seq_len"),
        ({"model": {"overrides": {"resid_pdrop": 0.0}}}, "spotline.model.overrides"),
        ({"data": {"path": "other.txt"}}, "spotline.data.path"),
        ({"determinism": {"enabled": False}}, "spotline.determinism.enabled"),
        ({"topology": {"stages": 4, "workers": 4}}, "spotline.topology.stages"),
        ({"elasticity": {"logical_workers": 4}}, "spotline.elasticity.logical_workers"),
        ({"gradient_clipping": 1.0}, "gradient_clipping"),
        ({"train_micro_batch_size_per_gpu": 2}, "train_micro_batch_size_per_gpu"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}},
            "optimizer.params.",
        ),
        ({"training": {"steps": 3}}, "spotline.training.steps"),
    ],
)
def test_a_resume_refuses_a_change_of_the_math_naming_the_key(change, key) -> None:
    from spotline.config_resume import resume_mismatch

    problem = resume_mismatch(_cfg(), _cfg(**change))
    assert problem is not None and key in problem
    assert "\n" not in problem


@pytest.mark.parametrize(
    "change",
    [
        # 2 workers of 2 stages running the stopped run's 2 logical workers: same math.
        {"topology": {"workers": 2}, "elasticity": {"logical_workers": 2}},
        {"redundancy": {"mode": "lazy"}},
        {"recovery": {"mode": "checkpoint-restart", "inject": ["kill:4:1"]}},
        {"checkpoints": {"interval_steps": 5, "on_write_error": "continue"}},
        {"training": {"steps": 40}},  # extends the run
        {"elasticity": {"slow_worker": 0, "slow_factor": 3.0}},
        {"tracking": {"wandb": "offline"}},
    ],
)
def test_a_resume_may_change_placement_recovery_and_length(change) -> None:
    from spotline.config_resume import resume_mismatch

    assert resume_mismatch(_cfg(), _cfg(**change)) is None


def test_a_failed_checkpoint_write_is_handed_over_at_once_and_never_committed(
    tmp_path: Path,
) -> None:
    from spotline.checkpointing.checkpoint import read_metadata

    failures: list[tuple[int, Path, Exception]] = []
    writer = CheckpointWriter(
        tmp_path, keep=2, on_error=lambda step, path, exc: failures.append((step, path, exc))
    )
    writer.save_async(1, "s0", {"w": 1})
    writer.wait()
    assert writer.commit(1, ["s0"], metadata={"losses": {"0": 2.5}})
    assert read_metadata(tmp_path, 1) == {"losses": {"0": 2.5}}
    # Step 2's directory cannot be created (a file is in the way), and an earlier attempt's
    # sidecar of step 3 must not vouch for a file this attempt fails to write.
    step_dir(tmp_path, 2).write_text("in the way")
    step_dir(tmp_path, 3).mkdir()
    (step_dir(tmp_path, 3) / "s0.meta.json").write_text('{"file": "s0.pt", "size": 1}')
    (step_dir(tmp_path, 3) / "s0.pt").mkdir()  # os.replace onto a directory fails
    writer.save_async(2, "s0", {"w": 2})
    writer.save_async(3, "s0", {"w": 3})
    writer.wait()  # handed to on_error, not raised
    assert [(step, path.name) for step, path, _ in failures] == [(2, "s0.pt"), (3, "s0.pt")]
    assert all(isinstance(exc, OSError) for _, _, exc in failures)
    assert writer.commit(3, ["s0"]) is False
    assert not (step_dir(tmp_path, 3) / MANIFEST).exists()
    assert latest_complete(tmp_path) == 1
    writer.close()


# -- real processes ----------------------------------------------------------------------

STEPS = 16
INTERVAL = 2
# Dropout on: a resume must also restore where every dropout mask comes from.
CONFIG = small_config(
    topology={"workers": 2, "stages": 2},
    training={"steps": STEPS},
    checkpoints={"interval_steps": INTERVAL},
)
# A learning-rate schedule too: a resumed run must go on where the schedule was.
SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {"warmup_max_lr": 0.004, "warmup_num_steps": 4, "total_num_steps": STEPS},
}
CONFIG["scheduler"] = SCHEDULER
# In fp16 (fp32 master weights, autocast compute, a loss scale that overflows at once and
# grows back every 2 clean steps): a resume restores the master weights and the loss
# scaler's state, and continues with the same compute (fp32's and bf16's checkpoint restores
# are the fallback tests').
FP16 = {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2}
CONFIG["fp16"] = FP16
# The interrupted runs: worker w0 sleeps after its share of each step (the math is the
# same), so that a Ctrl-C sent once the first checkpoint is committed lands mid-run.
SLOW = small_config(
    topology={"workers": 2, "stages": 2},
    training={"steps": STEPS},
    checkpoints={"interval_steps": INTERVAL},
    elasticity={"slow_worker": 0, "slow_factor": 4.0},
)
SLOW["scheduler"] = SCHEDULER
SLOW["fp16"] = FP16
# A kill before the stop (worker 1, in the first step, before the first checkpoint): the
# resumed run's record must still count it.
SLOW_KILLED = {
    **SLOW,
    "spotline": {**SLOW["spotline"], "recovery": {"inject": ["kill:1:1:forward"]}},
}


def _with_wandb(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` logging to wandb (offline): tracking is not part of the math."""
    return {**config, "spotline": {**config["spotline"], "tracking": {"wandb": "offline"}}}


def _spotline_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "spotline.launch.cli", *args]


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (workers of a run: its output)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def _no_traceback(proc: subprocess.CompletedProcess[str], output: Path) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "KeyboardInterrupt" not in proc.stderr
    for log in (output / "logs").iterdir():
        text = log.read_text()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, (log, text[-2000:])


def _event_kinds(stderr: str) -> list[str]:
    """The events a run printed as they happened (``spotline: [   1.23s] KIND {...}``)."""
    kinds = []
    for line in stderr.splitlines():
        head, sep, rest = line.partition("s] ")
        if sep and head.startswith("spotline: ["):
            kinds.append(rest.split(" ", 1)[0])
    return kinds


def _checkpoint_files(output: Path) -> dict[str, int]:
    return {
        str(p.relative_to(output)): p.stat().st_mtime_ns
        for p in (output / "checkpoints").rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_stops_at_a_checkpoint_and_resume_ends_with_the_uninterrupted_hash(
    tmp_path: Path,
) -> None:
    fast = write_config(tmp_path / "fast.json", CONFIG)
    # The interrupted run and its resume log to one wandb run (offline).
    slow = write_config(tmp_path / "slow.json", _with_wandb(SLOW))
    fast_wandb = write_config(tmp_path / "fast-wandb.json", _with_wandb(CONFIG))
    baseline_out = tmp_path / "baseline"
    proc = run_spotline(["train", "--config", str(fast), "--output", str(baseline_out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    baseline = read_summary(baseline_out)

    # One Ctrl-C: the job stops at the next step boundary that has a checkpoint (after a
    # worker was killed and taken over).
    slow_killed = write_config(tmp_path / "slow-killed.json", _with_wandb(SLOW_KILLED))
    out = tmp_path / "stopped"
    stopped = interrupt_run(slow_killed, out, presses=1)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    _no_traceback(stopped, out)
    last = stopped.stderr.strip().splitlines()[-1]
    prefix, _, hint = last.partition("; ")
    assert prefix.startswith("spotline: stopped at step "), last
    step = int(prefix.rsplit(" ", 1)[1])
    assert hint == f"resume with: spotline train --resume {out}"
    assert 0 < step < STEPS and step % INTERVAL == 0
    assert latest_complete(out / "checkpoints") == step
    assert not (out / "summary.json").exists()
    assert not _processes_naming(str(out))
    # What was committed went to wandb at the stop: the steps before the checkpoint.
    stopped_run = json.loads((out / "wandb-run.json").read_text())
    assert stopped_run["logged_steps"] == step

    # The same command again: refused, the checkpoints left as they were.
    before = _checkpoint_files(out)
    again = run_spotline(["train", "--config", str(slow_killed), "--output", str(out)])
    assert again.returncode == 2
    (error,) = [line for line in again.stderr.splitlines() if line.strip()]
    assert error.startswith("spotline: error: ") and "--resume" in error and "--output" in error
    assert _checkpoint_files(out) == before

    # A resume that changes the math: one line naming the key.
    seed = run_spotline(["train", "--resume", str(out), "--seed", "8"])
    assert seed.returncode == 2
    (error,) = [line for line in seed.stderr.splitlines() if line.strip()]
    assert error.startswith("spotline: error: ") and "spotline.training.seed" in error
    assert _checkpoint_files(out) == before

    # The resume (without the slow worker: not part of the math) ends where the
    # uninterrupted run ended, every step's loss included.
    resumed = run_spotline(["train", "--resume", str(out), "--config", str(fast_wandb)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = read_summary(out)
    assert summary["resumed_from_step"] == step
    # The record covers the whole run: the stopped part's kill and events, then the resume's.
    assert summary["preemptions"] == 1, summary["events"]
    assert summary["recoveries"] == 1 and len(summary["recovery_events"]) == 1
    assert summary["recovery_events"][0]["in_memory"]
    kinds = [e["kind"] for e in summary["events"]]
    assert kinds == _event_kinds(stopped.stderr) + _event_kinds(resumed.stderr), kinds
    assert kinds.count("start") == 2 and "recovered" in kinds
    assert [(p["from_step"], p["reached_step"], p["how"]) for p in summary["parts"]] == [
        (0, step, "stopped"),
        (step, STEPS, "finished"),
    ]
    assert None not in summary["step_times_s"]
    assert not (out / "run-record.json").exists()  # the summary holds it now
    assert summary["param_sha256"] == baseline["param_sha256"]
    assert summary["losses"] == baseline["losses"]
    assert summary["learning_rates"] == baseline["learning_rates"]
    assert len(set(baseline["learning_rates"])) > 4  # the schedule moved the rate
    assert summary["loss_scales"] == baseline["loss_scales"]
    assert summary["skipped_steps"] == baseline["skipped_steps"]
    # Steps skipped on both sides of the stop: the scaler's state crossed it.
    assert min(baseline["skipped_steps"]) < step < max(baseline["skipped_steps"])
    assert summary["checkpoint_write_errors"] == []
    # One wandb run, continued by the resume from the step the stop had logged up to.
    resumed_run = json.loads((out / "wandb-run.json").read_text())
    assert resumed_run == {
        "id": stopped_run["id"],
        "logged_steps": STEPS,
        "logged_events": len(summary["events"]),
    }
    parts = sorted((out / "wandb").glob("offline-run-*"))
    assert len(parts) == 2 and all(p.name.endswith(f"-{stopped_run['id']}") for p in parts)
    # What wandb wrote (its files, read without Spotline): every step's loss exactly once.
    rows = logged(out)
    loss_steps = sorted(row["_step"] for row in rows if "loss" in row)
    assert loss_steps == list(range(STEPS)), loss_steps
    assert [row["loss"] for row in sorted(rows, key=lambda r: r["_step"]) if "loss" in row] == (
        summary["losses"]
    )
    assert {k.split("/")[1] for row in rows for k in row if k.startswith("event/")} == set(kinds)

    # The finished run's directory is its record: a new run into it and a resume of it are
    # refused in one line, and nothing in it changes.
    before = file_stamps(out)
    again = run_spotline(["train", "--config", str(fast), "--output", str(out)])
    assert again.returncode == 2, again.stderr[-3000:]
    (error,) = [line for line in again.stderr.splitlines() if line.strip()]
    assert error.startswith(f"spotline: error: --output {out} holds a finished run"), error
    assert "--resume" in error and "fresh --output" in error
    finished = run_spotline(["train", "--resume", str(out)])
    assert finished.returncode == 2, finished.stderr[-3000:]
    (error,) = [line for line in finished.stderr.splitlines() if line.strip()]
    assert error.startswith(f"spotline: error: --resume {out}: that run finished"), error
    assert file_stamps(out) == before

    # Two Ctrl-Cs: the job stops at once, still without a traceback, nothing left running.
    out2 = tmp_path / "stopped-twice"
    twice = interrupt_run(slow, out2, presses=2)
    assert twice.returncode == 130, twice.stderr[-3000:]
    _no_traceback(twice, out2)
    last = twice.stderr.strip().splitlines()[-1]
    assert last.startswith("spotline: stopped at once; "), last
    assert f"spotline train --resume {out2}" in last
    assert not _processes_naming(str(out2))


# -- a full disk ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MB tmpfs mounted for the test (one checkpoint of gpt2-tiny fits, two do not)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        missing(
            "tmpfs", f"cannot mount a 3 MB tmpfs here: {done.stderr.strip() or done.returncode}"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _terminal_checks(proc: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a run that stopped with an error, never taken for a preemption."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for wrong in ("Traceback", "preempted", "checkpoint-fallback", "trace has ended", "recovered"):
        assert wrong not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_full_disk_is_reported_at_once_and_stops_or_continues_as_configured(
    tmp_path: Path, small_disk: Path
) -> None:
    base = {"topology": {"workers": 2, "stages": 2}, "training": {"steps": 12}}
    # Default (checkpoints.on_write_error "stop"): the first failed write ends the job.
    out = small_disk / "stop"
    config = write_config(
        tmp_path / "stop.json", small_config(**base, checkpoints={"interval_steps": 1})
    )
    proc = run_spotline(["train", "--config", str(config), "--output", str(out)])
    error = _terminal_checks(proc)
    assert "checkpoint of step " in error and "No space left on device" in error, error
    failed = int(error.split("checkpoint of step ", 1)[1].split(" ", 1)[0])
    assert str(step_dir(out / "checkpoints", failed)) in error
    assert not (step_dir(out / "checkpoints", failed) / MANIFEST).exists()
    assert latest_complete(out / "checkpoints") in (None, *range(1, failed))
    assert not (out / "summary.json").exists()
    subprocess.run(["rm", "-rf", str(out)], check=True)

    # "continue": every failed step is reported as it happens and training goes on to the
    # end; the export of the model to the same full disk is an error that stops the job
    # once (not a preemption, not a fallback to a checkpoint).
    out = small_disk / "continue"
    config = write_config(
        tmp_path / "continue.json",
        small_config(**base, checkpoints={"interval_steps": 1, "on_write_error": "continue"}),
    )
    proc = run_spotline(["train", "--config", str(config), "--output", str(out)])
    error = _terminal_checks(proc)
    assert "No space left on device" in error and f"see {out}/logs" in error, error
    warned = [
        int(line.split("checkpoint of step ", 1)[1].split(" ", 1)[0])
        for line in proc.stderr.splitlines()
        if line.startswith("spotline: warning: checkpoint of step ")
    ]
    assert warned and warned == sorted(set(warned)) and warned[-1] == 12, proc.stderr[-3000:]
    for step in warned:
        assert not (step_dir(out / "checkpoints", step) / MANIFEST).exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_write_errors_are_in_the_summary_when_the_run_finishes(
    tmp_path: Path, small_disk: Path
) -> None:
    """Checkpoints on the full disk, the output elsewhere: the run finishes (exit 0) and its
    summary lists every checkpoint file that was not written."""
    out = tmp_path / "out"
    config = write_config(
        tmp_path / "c.json",
        small_config(
            topology={"workers": 2, "stages": 2},
            training={"steps": 6},
            checkpoints={
                "interval_steps": 1,
                "on_write_error": "continue",
                "dir": str(small_disk / "ckpt"),
            },
        ),
    )
    proc = run_spotline(["train", "--config", str(config), "--output", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(out)
    errors = summary["checkpoint_write_errors"]
    assert errors and {"step", "path", "error", "worker"} <= set(errors[0])
    assert all("No space left on device" in e["error"] for e in errors)
    committed = {
        int(p.parent.name.split("-")[1]) for p in (small_disk / "ckpt").glob(f"*/{MANIFEST}")
    }
    assert not committed & {e["step"] for e in errors}
    assert (
        json.loads((out / "config.resolved.json").read_text())["spotline"]["checkpoints"][
            "on_write_error"
        ]
        == "continue"
    )
