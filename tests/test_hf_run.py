"""``spotline run`` of a Hugging Face script (``spotline.hf.Trainer``), its plain ``python``
run, its bad inputs, and the wandb run a resume continues."""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import NO_DROPOUT, REPO, child_env, file_stamps, run_spotline

SCRIPT = "launch/examples/finetune_clm.py"
TINY = "integration/assets/instructions/tiny.jsonl"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny GPT-2 saved with save_pretrained (with the byte-level tokenizer) and a Spotline
    config for what TrainingArguments do not say (2 logical workers, exact kernels)."""
    import transformers

    from spotline.data import corpus as data
    from spotline.models import layers as models

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
                    # No timeline.png, as in conftest.small_config: a plot costs a second.
                    "tracking": {"wandb": "offline", "progress": False, "timeline_png": False},
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


def run_plain_python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` from the repository, which must succeed."""
    plain = subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    return plain


def summary_of(output: Path) -> dict[str, Any]:
    return dict(json.loads((output / "summary.json").read_text()))


def test_spotline_run_survives_a_kill_with_the_plain_runs_bits(
    job: dict[str, Path], tmp_path: Path
) -> None:
    """The example under plain python (one process) and under ``spotline run`` on 4 workers
    (2 stages x 2 pipelines) with worker 1 SIGKILLed in step 4: the same losses and hash,
    the evaluation loss falls, and the run's wandb records are one run."""
    plain = run_plain_python(SCRIPT, *script_args(job, tmp_path / "plain"))
    plain_hash = summary_of(tmp_path / "plain")["param_sha256"]
    assert f"finetune_clm: trained, param_sha256 {plain_hash}" in plain.stdout
    # The plain run writes what every run writes: its one placement (one worker running
    # both logical workers), no rebalances, the timeline's rows (no plot: timeline_png is
    # false here) and its output, from train() on, in its log as on the console.
    plain_summary = summary_of(tmp_path / "plain")
    assert plain_summary["logical_placements"] == [
        {"generation": 0, "pipelines": [{"workers": ["w0"], "logical_workers": [0, 1]}]}
    ]
    assert plain_summary["logical_rebalances"] == []
    rows = list(csv.DictReader((tmp_path / "plain" / "timeline.csv").open()))
    assert rows[0]["event"] == "start" and rows[-1]["event"] in ("throughput", "eval")
    assert {r["placement"] for r in rows} == {"w0=p0:s0"}
    assert max(int(r["step"]) for r in rows if r["event"] == "throughput") == 6
    evals = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["event"] == "eval"]
    assert evals == [(e["step"], e["loss"]) for e in plain_summary["eval"]]
    assert not (tmp_path / "plain" / "timeline.png").exists()
    assert sorted(p.name for p in (tmp_path / "plain" / "logs").iterdir()) == ["w0.log"]
    plain_log = (tmp_path / "plain" / "logs" / "w0.log").read_text()
    assert f"finetune_clm: trained, param_sha256 {plain_hash}" in plain_log
    out = tmp_path / "run"
    run = run_spotline(
        ["run", "--workers", "4", "--stages", "2", "--inject", "kill:4:1:backward", "--output", str(out),
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
    # The plain run's placements and timeline have spotline run's shape.
    first = disturbed["logical_placements"][0]
    assert sorted(first) == sorted(plain_summary["logical_placements"][0])
    assert sorted(first["pipelines"][0]) == ["logical_workers", "workers"]
    header = (out / "timeline.csv").read_text().splitlines()[0]
    assert header == (tmp_path / "plain" / "timeline.csv").read_text().splitlines()[0]
    # The script ran in every worker, on past train() in each one the job kept to its end.
    logs = {log.stem: log.read_text() for log in (out / "logs").glob("w*.log")}
    finished = sorted(w for w, text in logs.items() if "finetune_clm: trained" in text)
    assert len(logs) == 4 and len(finished) == 3 and "w1" not in finished, sorted(logs)
    run_id = json.loads((out / "wandb-run.json").read_text())["id"]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.split("-")[3] == run_id for r in runs)

    # Each finished run's directory is its record: the same commands again, and a resume,
    # are refused in one line before anything is written, and nothing in them changes.
    before = {d: file_stamps(d) for d in (tmp_path / "plain", out)}
    again = subprocess.run(
        [sys.executable, SCRIPT, *script_args(job, tmp_path / "plain")],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert again.returncode == 2, again.stderr[-3000:]
    assert one_error_line(again.stderr).startswith(
        f"spotline: error: --output_dir {tmp_path / 'plain'} holds a finished run"
    )
    rerun = run_spotline(["run", "--output", str(out), SCRIPT, *script_args(job, out)])
    assert rerun.returncode == 2, rerun.stderr[-3000:]
    error = one_error_line(rerun.stderr)
    assert error.startswith(f"spotline: error: --output {out} holds a finished run"), error
    resumed = run_spotline(["run", "--resume", str(out)])
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    error = one_error_line(resumed.stderr)
    assert error.startswith(f"spotline: error: --resume {out}: that run finished"), error
    assert {d: file_stamps(d) for d in before} == before


def test_wandb_run_is_resumed_not_duplicated(tmp_path: Path, monkeypatch: Any) -> None:
    """A second Tracker on the same output directory (a --resume) continues the first's wandb
    run and does not log its steps again."""
    from spotline.config import TrackingSection
    from spotline.reports.tracking import Tracker
    from spotline.wire.protocol import EvalResult

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
    both = [*script_args(job, out, "--fp16"), "--bf16"]
    fp16 = run_spotline(["run", "--output", str(out), SCRIPT, *both])
    assert fp16.returncode == 2 and "fp16=True and bf16=True" in one_error_line(fp16.stderr)
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

    from spotline.data import corpus as data
    from spotline.hf import dataset_rows

    tokenizer = data.byte_level_tokenizer()
    rows = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10], [11, 12, 13]]})
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    ids, labels = dataset_rows(rows, collator, "train_dataset")
    pad = tokenizer.pad_token_id
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, pad, pad], [11, 12, 13, pad]]
    assert labels.tolist() == [[5, 6, 7, 8], [9, 10, -100, -100], [11, 12, 13, -100]]


UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class UnavailableHub:
    """A local "hub" that answers every request "503 Service Unavailable" and hangs up,
    keeping each request's first line: a request there fails, nothing leaves this machine,
    and the lines say what the client asked (``from_pretrained`` asks for one file after
    another, and retries an unreachable hub for most of a minute: 12 requests here)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = int(self.server.getsockname()[1])
        self.requests: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                connection, _ = self.server.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(5)
                request = connection.recv(65536)
                if request:  # one request: its first bytes hold its first line
                    self.requests.append(request.split(b"\r\n", 1)[0].decode(errors="replace"))
                    connection.sendall(UNAVAILABLE)

    def close(self) -> list[str]:
        """Stop serving; the first line of every request it answered."""
        self.done.set()
        self.thread.join()
        self.server.close()
        return self.requests


def without(args: list[str], flag: str) -> list[str]:
    at = args.index(flag)
    return args[:at] + args[at + 2 :]


def plain_mistakes(
    args: list[str], scratch: Path, hub_port: int
) -> dict[str, tuple[list[str], dict[str, str], tuple[str, ...]]]:
    """A plain run's mistakes: the arguments, the environment, what the one line names."""
    online = {  # at a local port that answers 503: never the real hub
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_ENDPOINT": f"http://127.0.0.1:{hub_port}",
    }
    name = ["--model_name_or_path"]
    return {
        "epochs": (
            [*without(args, "--max_steps"), "--num_train_epochs", "1"],
            {},
            ("max_steps is not set", "--max_steps"),
        ),
        "fp16 and bf16": ([*args, "--fp16", "--bf16"], {}, ("fp16=True and bf16=True", "drop one")),
        "missing train file": (
            [*args, "--train_file", str(scratch / "nope.jsonl")],
            {},
            ("--train_file", "nope.jsonl", "no such file"),
        ),
        "missing model directory": (
            [*args, *name, str(scratch / "my-model")],
            {},
            ("--model_name_or_path", "my-model", "no such local directory", "save_pretrained"),
        ),
        "hub name offline": (
            [*args, *name, "my-model"],
            {},
            ("'my-model'", "no such local directory", "HF_HUB_OFFLINE"),
        ),
        "hub name unreachable": (
            [*args, *name, "my-model"],
            online,
            ("'my-model'", "neither a local directory nor reachable on the hub", "127.0.0.1"),
        ),
    }


@pytest.mark.parametrize(
    "mistake",
    [
        "epochs",
        "fp16 and bf16",
        "missing train file",
        "missing model directory",
        "hub name offline",
        "hub name unreachable",
    ],
)
def test_a_plain_runs_mistake_is_one_line_at_once(
    job: dict[str, Path], tmp_path: Path, mistake: str
) -> None:
    """Under plain python as under spotline run: a user's mistake is one line on stderr, exit
    2, no traceback, at once (one request to an unreachable hub, not a minute of retries),
    nothing in the output."""
    out = tmp_path / "out"
    hub_server = UnavailableHub()
    try:
        args, env, names = plain_mistakes(script_args(job, out), tmp_path, hub_server.port)[mistake]
        # Offline unless the case says otherwise, with an empty hub cache of its own.
        hub = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), **env}
        proc = subprocess.run(
            [sys.executable, SCRIPT, *args],
            cwd=REPO,
            env={**child_env(), **hub},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        requests = hub_server.close()
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("spotline: error: ") and "Traceback" not in proc.stderr
    assert all(n in lines[0] for n in names), lines[0]
    assert not out.exists()
    # Offline nothing is asked of the hub; online, about the model once.
    about = [line for line in requests if "my-model" in line]
    assert len(about) == (1 if mistake == "hub name unreachable" else 0), requests


def test_a_mistake_found_once_the_job_is_written_leaves_nothing(
    job: dict[str, Path], tmp_path: Path
) -> None:
    """A plain run's mistake found after its Trainer wrote the job (a Spotline config that
    contradicts the arguments) removes the job: the output holds what it held (else the job
    would be an earlier run's to the next try)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    config = tmp_path / "contradicts.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 99}))
    proc = subprocess.run(
        [sys.executable, SCRIPT, *script_args(job, out), "--spotline_config", str(config)],
        cwd=REPO,
        env={**child_env(), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("spotline: error: train_micro_batch_size_per_gpu is 99"), last
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_only_a_user_error_loses_its_traceback() -> None:
    """spotline.hf's excepthook leaves every other uncaught exception to the usual one."""
    proc = subprocess.run(
        [sys.executable, "-c", "import spotline.hf\nraise RuntimeError('a bug')"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().endswith("RuntimeError: a bug")


def test_pretrained_source_names_the_cause_without_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: dict[str, Path]
) -> None:
    """A local directory is itself; a name only a path can be is refused without the hub; a
    hub id in the hub cache is loaded from it (offline too), else refused when offline."""
    import huggingface_hub
    from huggingface_hub import constants

    from spotline.errors import UserError
    from spotline.hf import pretrained_source

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pretrained_source asked the hub")

    monkeypatch.setattr(huggingface_hub, "model_info", no_network)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert pretrained_source(str(job["model"])) == str(job["model"])
    for path in ("./my-model", "../my-model", "~/no-such-model", str(tmp_path / "my-model")):
        with pytest.raises(UserError, match="no such local directory"):
            pretrained_source(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        pretrained_source(str(tmp_path / "empty"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        pretrained_source("someone/my-model")
    # The hub cache's layout: a snapshot that refs/main names.
    cached = tmp_path / "hub" / "models--someone--my-model"
    (cached / "snapshots" / "abc").mkdir(parents=True)
    (cached / "snapshots" / "abc" / "config.json").write_text("{}")
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text("abc")
    assert pretrained_source("someone/my-model") == "someone/my-model"


def test_training_arguments_bf16_and_fp16_are_spotlines() -> None:
    from spotline.config import parse_config
    from spotline.errors import UserError
    from spotline.hf import TrainingArguments, job_keys

    def config_of(args: TrainingArguments) -> Any:
        raw: dict[str, Any] = {}
        for dotted, value in job_keys(args).items():
            *path, leaf = dotted.split(".")
            node = raw
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = value
        return parse_config(raw)

    assert (
        config_of(TrainingArguments("out", max_steps=4, warmup_steps=2, bf16=True)).precision
        == "bf16"
    )
    assert config_of(TrainingArguments("out", max_steps=4, warmup_steps=2)).precision == "fp32"
    fp16 = config_of(TrainingArguments("out", max_steps=4, warmup_steps=2, fp16=True))
    # Hugging Face's own fp16 scaler is torch's GradScaler with its defaults.
    assert fp16.precision == "fp16"
    assert (fp16.loss_scaling.initial_scale, fp16.loss_scaling.window) == (2.0**16, 2000)
    assert fp16.loss_scaling.hysteresis == 1
    with pytest.raises(UserError, match="fp16=True and bf16=True"):
        TrainingArguments("out", max_steps=4, fp16=True, bf16=True)


# A fine-tuning script as a user writes it against Hugging Face's own Trainer (run_clm.py's
# shape: HfArgumentParser, datasets, group_texts, Trainer, train, save_model, evaluate,
# log/save metrics), not an example of this project: under ``spotline run`` its
# transformers.Trainer is Spotline's, under plain python Hugging Face's.
HF_SCRIPT = """
import os
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import datasets
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a save_pretrained directory"})


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "a text file"})
    block_size: int = 32
    validation_split_percentage: int = 10


def main():
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    raw = datasets.load_dataset("text", data_files={"train": data_args.train_file})["train"]
    split = raw.train_test_split(
        test_size=data_args.validation_split_percentage / 100, seed=training_args.seed
    )
    with training_args.main_process_first(desc="tokenize"):
        tokenized = split.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = len(joined["input_ids"]) // data_args.block_size * data_args.block_size
        out = {
            k: [t[i : i + data_args.block_size] for i in range(0, total, data_args.block_size)]
            for k, t in joined.items()
        }
        out["labels"] = out["input_ids"].copy()
        return out

    blocks = tokenized.map(group_texts, batched=True)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["test"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    print("trainer class:", type(trainer).__module__, flush=True)
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    # Code after train(): under spotline run it runs in every worker that finished.
    marks = Path(training_args.output_dir) / "after-train"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / str(os.getpid())).touch()


if __name__ == "__main__":
    main()
"""


def test_an_unmodified_transformers_trainer_script_runs_under_spotline(
    job: dict[str, Path], tmp_path: Path
) -> None:
    """The script above, unedited: plain python runs Hugging Face's Trainer; spotline run
    (2 stages x 2 pipelines) runs Spotline's, and a SIGKILL mid-backward ends on the
    undisturbed spotline run's losses, evaluations and hash; what follows train() runs in
    every worker that finished."""
    script = tmp_path / "my_clm.py"
    script.write_text(HF_SCRIPT)

    def args(out: Path, *extra: str) -> list[str]:
        return [
            "--model_name_or_path", str(job["model"]),
            "--train_file", "integration/assets/corpus/01_everyday.txt",
            "--block_size", "32", "--max_steps", "6", "--learning_rate", "3e-3",
            "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "2",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--eval_strategy", "steps", "--eval_steps", "3",
            "--do_train", "--do_eval", "--logging_steps", "1", "--report_to", "none",
            "--output_dir", str(out), *extra,
        ]  # fmt: skip

    plain = run_plain_python(str(script), *args(tmp_path / "plain", "--use_cpu"))
    assert "trainer class: transformers.trainer" in plain.stdout
    runs = {}
    for name, extra in (("whole", []), ("killed", ["--inject", "kill:4:1:backward"])):
        out = tmp_path / name
        run = run_spotline(
            ["run", "--workers", "4", "--stages", "2", *extra, "--output", str(out),
             str(script), *args(out)]
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert "trainer class: spotline.hf" in (out / "logs" / "w0.log").read_text()
        runs[name] = summary_of(out)
        finished = len(list((out / "after-train").iterdir()))
        assert finished == (4 if name == "whole" else 3), finished  # the killed one never did
    whole, killed = runs["whole"], runs["killed"]
    assert killed["preemptions"] == 1 and killed["checkpoint_fallbacks"] == 0
    assert killed["losses"] == whole["losses"]
    assert killed["eval"] == whole["eval"] and len(whole["eval"]) >= 2
    assert killed["param_sha256"] == whole["param_sha256"]


def test_a_training_argument_spotline_does_not_run_is_one_line(
    job: dict[str, Path], tmp_path: Path
) -> None:
    """The unmodified script with a field Spotline refuses: one line naming it, exit 2,
    nothing written (the other fields' placement: test_every_training_argument_is_placed)."""
    script = tmp_path / "my_clm.py"
    script.write_text(HF_SCRIPT)
    out = tmp_path / "out"
    run = run_spotline(
        ["run", "--output", str(out), str(script), "--model_name_or_path", str(job["model"]),
         "--train_file", "integration/assets/corpus/01_everyday.txt", "--max_steps", "4",
         "--lr_scheduler_type", "constant", "--output_dir", str(out), "--push_to_hub"]
    )  # fmt: skip
    assert run.returncode == 2
    line = one_error_line(run.stderr)
    assert "push_to_hub=True" in line and "upload OUTPUT/model yourself" in line, line
    assert not out.exists()


def test_every_training_argument_is_placed() -> None:
    """Each field of transformers' TrainingArguments, set away from its default, is mapped
    to Spotline keys, ignored (with why), or refused in one line naming it."""
    import dataclasses

    import transformers

    from spotline.errors import UserError
    from spotline.hf_arguments import HONOURED, IGNORED, TrainingArguments, placed_fields

    hf_fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    assert hf_fields <= set(placed_fields())
    assert set(HONOURED) <= set(placed_fields()) and set(IGNORED) <= hf_fields
    base = {"output_dir": "out", "max_steps": 4, "lr_scheduler_type": "constant"}
    for name, value in (("neftune_noise_alpha", 5.0), ("torch_compile", True), ("fsdp", "full")):
        with pytest.raises(UserError) as info:
            TrainingArguments(**base, **{name: value})
        line = str(info.value)
        assert "\n" not in line and line.startswith(f"TrainingArguments {name}="), line
    # Ignored fields change nothing; honoured ones reach the config.
    quiet = TrainingArguments(**base, logging_steps=1, report_to="wandb", do_train=True)
    from spotline.hf import job_keys

    assert job_keys(quiet) == job_keys(TrainingArguments(**base))
    checkpointed = job_keys(TrainingArguments(**base, gradient_checkpointing=True))
    assert checkpointed["spotline.model.activation_checkpoint_interval"] == 1
    # transformers' own object (its __post_init__ fills in lists, flags and accelerate's
    # config) means what the same arguments mean to ours.
    theirs = transformers.TrainingArguments(**base, use_cpu=True)
    assert job_keys(theirs) == job_keys(TrainingArguments(**base))
