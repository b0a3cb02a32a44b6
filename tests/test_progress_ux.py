"""What a user sees: the summary and progress of a run, the words of its errors, and how
workers end when their coordinator is lost (issue 10, points 4-6).

One real `spotline train` run with an injected kill is checked by several assertions; the
coordinator's SIGKILL is a second real run; the rest is pure logic."""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, child_env, file_stamps, run_spotline, small_config, write_config

from spotline.config import parse_config

pytestmark = pytest.mark.timeout(600)


def test_the_builtin_default_takes_preemptions_over_in_memory() -> None:
    assert parse_config({}).spotline.redundancy.mode == "lazy"


def test_recovery_lines_say_what_happened_and_nothing_more() -> None:
    from spotline.launch.run_summary import recovery_lines

    one = {"preemptions": 1, "checkpoint_fallbacks": 0}
    event = {"generation": 1, "resume_step": 3, "recovery_s": 0.7, "in_memory": True}
    assert recovery_lines({**one, "recovery_events": [event]}) == [
        "  1 preemption survived in memory in 0.70 s (no checkpoint read)"
    ]
    two = {**one, "preemptions": 2, "recovery_events": [event, {**event, "recovery_s": 0.8}]}
    assert recovery_lines(two) == [
        "  2 preemptions survived in memory (2 takeovers: 0.70 s, 0.80 s; no checkpoint read)"
    ]
    restored = {**event, "in_memory": False}
    mixed = {**two, "checkpoint_fallbacks": 1, "recovery_events": [event, restored]}
    assert recovery_lines(mixed) == [
        "  1 takeover in memory in 0.70 s; 1 fallback(s) to a checkpoint"
    ]
    # A worker killed as hung (its heartbeat missed) is a loss survived, not a preemption:
    # said as one, by the summary's count ("the loss" alone read as the training loss).
    hung = {**one, "preemptions": 0, "hung_workers": 1, "recovery_events": [event]}
    assert recovery_lines(hung) == [
        "  1 hung worker survived in memory in 0.70 s (no checkpoint read)"
    ]
    both = {**two, "hung_workers": 1, "preemptions": 1}
    assert recovery_lines(both) == [
        "  1 preemption and 1 hung worker survived in memory (2 takeovers: 0.70 s, 0.80 s; "
        "no checkpoint read)"
    ]
    # Nothing survived in memory (no preemption, or only checkpoint restores): no line.
    assert recovery_lines({**one, "preemptions": 0, "recovery_events": []}) == []
    assert recovery_lines({**one, "recovery_events": [restored]}) == []


COUNT_KEYS = {
    "preemptions": "preemptions",
    "hung workers": "hung_workers",
    "recoveries": "recoveries",
    "checkpoint fallbacks": "checkpoint_fallbacks",
    "steps redone": "steps_redone",
}


def console_counts(stdout: str) -> dict[str, int]:
    """The counts of the console summary's count line, by their summary.json keys."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("  preemptions ")]
    fields = [field.strip() for field in line.split("  ") if field.strip()]
    counts = {}
    for field in fields:
        name, _, value = field.rpartition(" ")
        counts[COUNT_KEYS[name]] = int(value)
    return counts


def test_the_console_summary_says_summary_json_s_counts_in_plain_words() -> None:
    """Each count the console shows is summary.json's of that name (a hung worker's run said
    "preemptions 0  recoveries 1" and nothing of the hang), and the header counts in words
    ("4 stages x 1 pipelines", "1 stages x 2 pipelines")."""
    from spotline.launch.run_summary import format_summary

    event = {"generation": 1, "resume_step": 3, "recovery_s": 0.7, "in_memory": True}
    summary = {
        "model": "gpt2-tiny",
        "steps": 20,
        "workers": 4,
        "stages": 4,
        "pipelines": 1,
        "logical_workers": 1,
        "redundancy": "lazy",
        "losses": [5.0],
        "final_loss": 4.0,
        "samples_per_s": 10.0,
        "wall_s": 3.0,
        "preemptions": 1,
        "hung_workers": 1,
        "recoveries": 3,
        "checkpoint_fallbacks": 1,
        "steps_redone": 2,
        "recovery_events": [event, event, {**event, "in_memory": False}],
        "param_sha256": "ab",
    }
    text = format_summary(summary, Path("runs/x"))
    assert "for 20 steps on 4 workers (4 stages x 1 pipeline running 1 logical," in text
    counts = console_counts(text)
    assert counts == {key: summary[key] for key in COUNT_KEYS.values()}
    small = {**summary, "steps": 1, "workers": 2, "stages": 1, "pipelines": 2, "hung_workers": 0}
    text = format_summary(small, Path("runs/x"))
    assert "for 1 step on 2 workers (1 stage x 2 pipelines running" in text
    assert "hung workers" not in text  # shown when there were any
    assert console_counts(text) == {
        key: small[key] for key in COUNT_KEYS.values() if key != "hung_workers"
    }


def _short_lived_trace(path: Path) -> Path:
    """Two nodes live at a time, each for 60 s of trace time, replaced at once."""
    rows = []
    for k in range(3):
        t_ms = 60_000 * k
        if k:
            rows += [f"{t_ms},remove,n{2 * k - 1}", f"{t_ms},remove,n{2 * k}"]
        rows += [f"{t_ms},add,n{2 * k + 1}", f"{t_ms},add,n{2 * k + 2}"]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_node_lifetimes_are_compared_with_the_start_up(tmp_path: Path) -> None:
    from spotline.errors import UserError
    from spotline.plan.chaos import check_node_lifetimes, median_node_lifetime_s
    from spotline.plan.traces import load_trace

    trace = load_trace(_short_lived_trace(tmp_path / "short.csv"))
    # Four nodes removed after 60 s; the last two live until the end (120 s to 120 s: 0 s).
    assert median_node_lifetime_s(trace, max_workers=2) == 60.0
    check_node_lifetimes(trace, max_workers=2, time_scale=10, startup_s=5.0, name="short.csv")
    with pytest.raises(UserError) as refused:
        check_node_lifetimes(trace, max_workers=2, time_scale=60, startup_s=5.0, name="s.csv")
    message = str(refused.value)
    assert "median 1.00 s on the wall clock" in message and "5.0 s a worker takes" in message
    assert "--trace-clock steps" in message and "--time-scale 3 or lower" in message


def test_a_stall_stops_with_one_line_naming_what_to_change() -> None:
    from spotline.launch.control.watch import no_progress_message

    line = no_progress_message(300.0, 271, 272, clock="wall")
    assert "\n" not in line
    assert "no step committed in 300 s while 271 worker(s) were preempted and 272 started" in line
    for change in ("--trace-clock steps", "--time-scale", "--warm-workers"):
        assert change in line
    assert "--trace-clock" not in no_progress_message(300.0, 3, 3, clock="steps")
    with pytest.raises(Exception, match="no_progress_timeout_s' is negative"):
        parse_config({"spotline": {"recovery": {"no_progress_timeout_s": -1}}})
    assert parse_config({}).spotline.recovery.no_progress_timeout_s > 0


def test_a_trace_whose_nodes_die_before_workers_start_is_refused(tmp_path: Path) -> None:
    trace = _short_lived_trace(tmp_path / "short.csv")
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", "--workers", "2", "--stages", "2", "--trace", str(trace)]
        + ["--time-scale", "1000", "--output", str(out)]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("spotline: error:") == 1 and "Traceback" not in proc.stderr
    assert "--trace-clock steps" in proc.stderr and "median 0.06 s" in proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_preemptions_faster_than_start_ups_stop_the_run(tmp_path: Path) -> None:
    """Every worker is preempted within milliseconds of wall time (a rate of one per second
    of trace time, 100x): nothing can ever commit, and the run says so instead of spinning."""
    config = small_config(recovery={"no_progress_timeout_s": 15.0})
    cfg = write_config(tmp_path / "c.json", config)
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", "--config", str(cfg), "--workers", "2", "--stages", "2", "--max-workers"]
        + ["3", "--preempt-rate", "3600", "--time-scale", "100", "--output", str(out)]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    assert "no step committed in 15 s while" in error and "preemptions outpace start-ups" in error
    assert "--trace-clock steps" in error and "Traceback" not in proc.stderr
    assert not (out / "summary.json").exists()


def test_a_run_without_workers_names_the_real_cause() -> None:
    from spotline.launch.control.admission import no_workers_message

    plain = no_workers_message(0, crashed=[], trace=False, random_preemptions=False)
    assert "trace" not in plain.replace("--trace", "") and "nothing in this run adds" in plain
    assert "the trace has ended" in no_workers_message(
        1, crashed=[], trace=True, random_preemptions=False
    )
    rate = no_workers_message(0, crashed=[], trace=False, random_preemptions=True)
    assert "--preempt-rate" in rate and "trace has ended" not in rate
    crashed = no_workers_message(0, crashed=["w0", "w1"], trace=True, random_preemptions=False)
    assert "2 worker(s) (w0, w1) exited with an error" in crashed
    assert "trace" not in crashed
    # One live worker that the memory limit alone keeps from 4 stages: the key to raise.
    limited = no_workers_message(
        1, crashed=[], trace=False, random_preemptions=False, num_stages=4, stages_per_worker=2
    )
    assert "too few for 4 stages at most 2 a worker" in limited
    assert "spotline.redundancy.stages_per_worker" in limited
    assert "stages_per_worker" not in no_workers_message(
        2, crashed=[], trace=False, random_preemptions=False, num_stages=4, stages_per_worker=2
    )


@pytest.mark.slow
def test_a_killed_last_worker_without_a_trace_is_not_blamed_on_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.json", small_config())
    proc = run_spotline(
        ["train", "--config", str(cfg), "--workers", "1", "--stages", "1"]
        + ["--inject", "kill:2:0", "--output", str(out)]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    assert "trace has ended" not in error and "nothing in this run adds a worker" in error, error
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_default_job_survives_a_kill_in_memory_and_says_so(tmp_path: Path) -> None:
    """The built-in default (no --config), shortened, with a worker SIGKILLed mid-step:
    the takeover is in memory, the summary says so, each progress line appears once."""
    out = tmp_path / "out"
    proc = run_spotline(
        ["train", "--steps", "10", "--inject", "kill:5:2:forward", "--output", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["redundancy"] == "lazy"
    assert summary["checkpoint_fallbacks"] == 0 and summary["recoveries"] == 1
    (event,) = summary["recovery_events"]
    assert event["in_memory"] is True
    assert "  1 preemption survived in memory in " in proc.stdout
    assert "(no checkpoint read)" in proc.stdout
    # The console's counts are summary.json's, and recoveries is one number throughout.
    counts = console_counts(proc.stdout)
    assert counts == {key: summary[key] for key in counts}, (counts, proc.stdout)
    assert summary["recovery_summary"]["num_recoveries"] == summary["recoveries"]
    # kill:5 hits step 5 as the progress lines count it: the run resumes after 4 steps, and
    # the line "step 5/10" comes only after the kill.
    assert event["resume_step"] == 4
    lines = proc.stderr.splitlines()
    killed = next(i for i, line in enumerate(lines) if "] preempted {" in line)
    fifth = next(i for i, line in enumerate(lines) if line.startswith("spotline: step 5/10 "))
    assert killed < fifth, lines
    progress = [line for line in proc.stderr.splitlines() if line.startswith("spotline: step ")]
    # Each line once (wandb is on here: replaying the steps into it printed every line a
    # second time, then with the loss), in order, each with its step's loss, to the end.
    steps = [int(line.split()[2].split("/")[0]) for line in progress]
    assert steps == sorted(set(steps)) and steps[-1] == 10, progress
    for k, line in zip(steps, progress, strict=True):
        assert line == f"spotline: step {k}/10 loss {summary['losses'][k - 1]:.4f}"


@pytest.mark.slow
def test_deepspeed_s_launcher_prints_the_same_summary(tmp_path: Path) -> None:
    """One rank of `launch/train.py` as DeepSpeed's launcher starts it (env, one process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = child_env()
    env.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    cfg = write_config(tmp_path / "c.json", small_config(training={"steps": 2}))
    out = tmp_path / "out"
    command = [sys.executable, "launch/train.py", "--config", str(cfg), "--stages", "1"]
    command += ["--output", str(out)]
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    header = "spotline: trained gpt2-tiny for 2 steps on 1 worker (1 stage x 1 pipeline "
    assert header in proc.stdout
    assert f"param_sha256 {summary['param_sha256']}" in proc.stdout
    # What every run writes, as spotline train writes it: the one placement, no
    # rebalances, ...
    assert summary["logical_placements"] == [
        {"generation": 0, "pipelines": [{"workers": ["w0"], "logical_workers": [0]}]}
    ]
    assert summary["logical_rebalances"] == []
    # ... the timeline's rows (no plot: timeline_png is false here) ...
    rows = list(csv.DictReader((out / "timeline.csv").open()))
    assert [(r["event"], r["step"], r["placement"]) for r in rows] == [
        ("start", "0", "w0=p0:s0"),
        ("throughput", "2", "w0=p0:s0"),
    ]
    assert float(rows[1]["samples_per_s"]) > 0 and rows[1]["live_workers"] == "1"
    assert not (out / "timeline.png").exists()
    # ... and each rank's output, stdout and stderr, in its log as on the console.
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["w0.log"]
    log = (out / "logs" / "w0.log").read_text()
    assert f"param_sha256 {summary['param_sha256']}" in log
    assert "spotline: step 2/2 loss" in proc.stderr and "spotline: step 2/2 loss" in log
    # The same command again: the finished run's directory is refused, left as it was.
    before = file_stamps(out)
    again = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert again.returncode == 2, again.stderr[-3000:]
    (error,) = [line for line in again.stderr.splitlines() if line.strip()]
    assert error.startswith(f"spotline: error: --output {out} holds a finished run"), error
    assert file_stamps(out) == before


def test_the_install_is_quiet_unless_it_fails(tmp_path: Path) -> None:
    """`launch/setup.sh` on an installed tree prints nothing, and the package builds without
    a setuptools warning (the deprecated `license` table; assets folders outside `packages`)."""
    setup = subprocess.run(
        ["bash", "-c", ". launch/setup.sh"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert setup.returncode == 0, setup.stderr[-3000:]
    assert setup.stdout == "" and setup.stderr == ""
    # Built from a copy: a build writes build/ and *.egg-info beside its sources.
    import shutil

    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("integration", "launch", "patches"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), "."],
        cwd=source,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert "BuildBackendWarning" not in build.stdout + build.stderr
    assert "SetuptoolsDeprecationWarning" not in build.stdout + build.stderr
