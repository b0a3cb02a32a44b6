"""``spotline run`` of a Hugging Face script (``spotline.hf.Trainer``), its plain ``python``
run, its bad inputs, and the wandb run a resume continues."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import NO_DROPOUT, REPO, child_env, run_spotline

SCRIPT = "launch/examples/finetune_clm.py"
TINY = "integration/assets/instructions/tiny.jsonl"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny GPT-2 saved with save_pretrained (with the byte-level tokenizer) and a Spotline
    config for what TrainingArguments do not say (2 logical workers, exact kernels)."""
    import transformers

    from spotline import data, models

    root = tmp_path_factory.mktemp("hf")
    model_dir = root / "model"
    config = models.load_hf_config("gpt2-tiny", NO_DROPOUT)
    transformers.set_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    data.byte_level_tokenizer().save_pretrained(model_dir)
    spotline_config = root / "spotline.json"
    spotline_config.write_text(
        json.dumps(
            {
                "spotline": {
                    "elasticity": {"logical_workers": 2},
                    "determinism": {"enabled": True},
                    "tracking": {"wandb": "offline", "progress": False},
                }
            }
        )
    )
    return {"model": model_dir, "config": spotline_config}


def script_args(job: dict[str, Path], output: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(job["model"]),
        "--train_file", TINY,
        "--validation_split_percentage", "10",
        "--block_size", "48",
        "--max_steps", "6",
        "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "2",
        "--learning_rate", "3e-3",
        "--lr_scheduler_type", "constant",
        "--eval_strategy", "steps",
        "--eval_steps", "3",
        "--spotline_config", str(job["config"]),
        "--output_dir", str(output),
        *extra,
    ]  # fmt: skip


def summary_of(output: Path) -> dict[str, Any]:
    return dict(json.loads((output / "summary.json").read_text()))


def test_spotline_run_survives_a_kill_with_the_plain_runs_bits(
    job: dict[str, Path], tmp_path: Path
) -> None:
    """The example under plain python (one process) and under ``spotline run`` on 4 workers
    (2 stages x 2 pipelines) with worker 1 SIGKILLed at step 3: the same losses and hash,
    the evaluation loss falls, and the run's wandb records are one run."""
    plain = subprocess.run(
        [sys.executable, SCRIPT, *script_args(job, tmp_path / "plain")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    plain_hash = summary_of(tmp_path / "plain")["param_sha256"]
    assert f"finetune_clm: trained, param_sha256 {plain_hash}" in plain.stdout
    out = tmp_path / "run"
    run = run_spotline(
        ["run", "--workers", "4", "--stages", "2", "--inject", "kill:3:1:backward", "--output", str(out),
         SCRIPT, *script_args(job, tmp_path / "unused")]
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    undisturbed, disturbed = summary_of(tmp_path / "plain"), summary_of(out)
    assert disturbed["preemptions"] == 1 and disturbed["recoveries"] >= 1
    assert disturbed["losses"] == undisturbed["losses"]
    assert disturbed["param_sha256"] == undisturbed["param_sha256"]
    assert disturbed["eval"] == undisturbed["eval"]
    assert disturbed["eval"][-1]["loss"] < disturbed["eval"][0]["loss"]
    assert not (tmp_path / "unused").exists()  # --output decides where the run goes
    # The script ran in every worker, on past train() in each one the job kept to its end.
    logs = {log.stem: log.read_text() for log in (out / "logs").glob("w*.log")}
    finished = sorted(w for w, text in logs.items() if "finetune_clm: trained" in text)
    assert len(logs) == 4 and len(finished) == 3 and "w1" not in finished, sorted(logs)
    run_id = json.loads((out / "wandb-run.json").read_text())["id"]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.split("-")[3] == run_id for r in runs)


def test_wandb_run_is_resumed_not_duplicated(tmp_path: Path, monkeypatch: Any) -> None:
    """A second Tracker on the same output directory (a --resume) continues the first's wandb
    run and does not log its steps again."""
    from spotline.config import TrackingSection
    from spotline.protocol import EvalResult
    from spotline.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    logged: list[int] = []
    for steps in (3, 5):
        tracker = Tracker(
            TrackingSection(progress=False),
            enabled=True,
            output_dir=tmp_path,
            total_steps=5,
            run_config={},
        )
        real_log = tracker._run.log

        def spy(metrics: dict[str, float], step: int, real: Any = real_log) -> None:
            logged.append(step)
            real(metrics, step=step)

        tracker._run.log = spy
        for step in range(steps):
            tracker.log_step(step, {"loss": 1.0 / (step + 1)})
        tracker.log_eval(EvalResult(steps, 0.5, 1.6, 10, True))
        tracker.finish(None)
    assert logged == [0, 1, 2, 3, 3, 4, 5]
    saved = json.loads((tmp_path / "wandb-run.json").read_text())
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.split("-")[3] == saved["id"] for r in runs)
    assert saved["logged_steps"] == 5


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, stderr[-2000:]
    return errors[0]


def test_bad_input_is_one_line_and_nothing_written(job: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    missing = run_spotline(["run", "--output", str(out), str(tmp_path / "nope.py")])
    assert missing.returncode == 2 and "no such file" in one_error_line(missing.stderr)
    script = tmp_path / "no_trainer.py"
    script.write_text("print('hello')\n")
    silent = run_spotline(["run", "--output", str(out), str(script)])
    assert silent.returncode == 2
    assert "ended without constructing spotline.hf.Trainer" in one_error_line(silent.stderr)
    fp16 = run_spotline(["run", "--output", str(out), SCRIPT, *script_args(job, out, "--fp16")])
    assert fp16.returncode == 2 and "fp16" in one_error_line(fp16.stderr)
    conflict = run_spotline(
        ["run", "--steps", "9", "--output", str(out), SCRIPT, *script_args(job, out)]
    )
    assert conflict.returncode == 2
    assert "spotline.training.steps" in one_error_line(conflict.stderr)
    assert not out.exists()


def test_a_worker_whose_script_makes_another_job_is_refused(
    job: dict[str, Path], tmp_path: Path
) -> None:
    """What a worker's script builds is checked against the job spotline run described: the
    same keys, rows and weights pass; a row, a weight or an argument changed is one line."""
    import dataclasses

    import datasets
    import torch
    import transformers

    from spotline.errors import UserError
    from spotline.hf import TrainingArguments, check_job, write_job

    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"])
    rows = [list(range(3 + i, 11 + i)) for i in range(8)]
    train = datasets.Dataset.from_dict({"input_ids": rows})
    args = TrainingArguments(
        output_dir=str(tmp_path / "o"), max_steps=4, lr_scheduler_type="constant"
    )
    parts = dict(model=model, args=args, train_dataset=train, eval_dataset=None, data_collator=None)
    write_job(tmp_path / "job", **parts, processing_class=None, spotline_config=None)
    check_job(tmp_path / "job", **parts)  # the same job: no error
    other_rows = datasets.Dataset.from_dict({"input_ids": [r[::-1] for r in rows]})
    with pytest.raises(UserError, match="different train dataset"):
        check_job(tmp_path / "job", **{**parts, "train_dataset": other_rows})
    with pytest.raises(UserError, match="different TrainingArguments"):
        check_job(tmp_path / "job", **{**parts, "args": dataclasses.replace(args, seed=1)})
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(UserError, match="different model"):
        check_job(tmp_path / "job", **parts)


def test_a_data_collator_pads_rows_and_its_padding_learns_nothing() -> None:
    """Rows of different lengths through a Hugging Face collator (padding on the right, pad
    labels -100): one length, and what the attention mask hides is never learned."""
    import datasets
    import transformers

    from spotline import data
    from spotline.hf import dataset_rows

    tokenizer = data.byte_level_tokenizer()
    rows = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10], [11, 12, 13]]})
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    ids, labels = dataset_rows(rows, collator, "train_dataset")
    pad = tokenizer.pad_token_id
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, pad, pad], [11, 12, 13, pad]]
    assert labels.tolist() == [[5, 6, 7, 8], [9, 10, -100, -100], [11, 12, 13, -100]]
