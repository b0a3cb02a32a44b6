"""A Hugging Face fine-tuning script under Spotline: :class:`Trainer` with the names of
``transformers.Trainer`` (``model``, ``args``, ``train_dataset``, ``eval_dataset``,
``data_collator``, ``processing_class``).

The constructor turns what the script built into a *job*: the model as a
``save_pretrained`` directory, the datasets as token rows (``spotline.data.corpus.RowsCorpus``:
``input_ids`` and unshifted ``labels``, -100 where nothing is learned) and the
:class:`TrainingArguments` as Spotline config keys (:func:`job_keys`). What runs next
depends on how the script was started:

- ``python SCRIPT.py``: the job is written to ``output_dir/hf-job`` and :meth:`Trainer.train`
  trains it in this one process (``spotline.worker.launched.run_worker`` with one worker and one
  stage: the pipeline engine every entry point runs), into ``output_dir``.
- ``spotline run SCRIPT.py``: the command runs the script once in a child with
  :data:`MODE_ENV` set to :data:`DESCRIBE`; the constructor writes the job where
  :data:`JOB_ENV` says, with the script's path, arguments and working directory, and ends
  the script there (:class:`JobDescribed`). The command then runs the job as ``spotline
  train`` runs a config: coordinator, workers, recoveries. Every worker runs the script
  again (:func:`run_script_in_worker`, :data:`MODE_ENV` :data:`WORKER`): its constructor
  checks that the script built, in this process, exactly the job described (the same keys,
  rows and weights: a script whose data or model differ from one run to the next is refused
  in one line), and its :meth:`Trainer.train` is the elastic worker's run, through every
  generation until the job ends; what the script does after it runs in every worker. The
  workers train the job's files (what they checked against), and the run writes the model
  once, to ``OUTPUT/model``.

The math is the job's logical topology (``spotline.elasticity.logical_workers``, the batch,
the seed), never the number of processes: the plain run and ``spotline run`` of one job with
the same logical workers give the same ``param_sha256`` and losses.

A user's mistake is one line and exit 2 under plain python as under ``spotline run``: importing
this module installs a ``sys.excepthook`` that reports an uncaught UserError that way. The
:class:`TrainingArguments` are checked when they are parsed, and :func:`pretrained_source`
says at once when a model is neither a local directory nor on the hub (both in
``spotline.hf_script``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spotline.config import RunConfig, parse_config, with_overrides
from spotline.data.corpus import IGNORE_LABEL, ROWS_SUFFIX
from spotline.errors import UserError

# A script imports the model's source from here with the Trainer; importing it installs the
# one-line report of a plain-python script's mistakes.
from spotline.hf_script import pretrained_source as pretrained_source
from spotline.run_dir import refuse_earlier_run

# How the script was started: unset (plain python), DESCRIBE (spotline run's child) or
# WORKER (a worker of spotline run).
MODE_ENV = "SPOTLINE_HF_MODE"
DESCRIBE = "describe"
WORKER = "worker"
# Where the describing child writes the job (a directory).
JOB_ENV = "SPOTLINE_HF_JOB"
# The job's directory in the output directory, and its files.
JOB_DIR = "hf-job"
JOB_FILE = "job.json"
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"
TRAIN_ROWS = "train" + ROWS_SUFFIX
EVAL_ROWS = "eval" + ROWS_SUFFIX

# Hugging Face scheduler name -> DeepSpeed scheduler (None: the constant rate).
_SCHEDULERS: dict[str, str | None] = {
    "constant": None,
    "constant_with_warmup": "WarmupLR",
    "linear": "WarmupDecayLR",
    "cosine": "WarmupCosineLR",
}
# Keys the TrainingArguments and the script's data decide (a key or a key under one of
# these): a --config or flag value for them must agree (precedence: the script's).
OWNED_KEYS = frozenset(
    {
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "bf16",
        "fp16",
        "spotline.training.steps",
        "spotline.training.seed",
        "spotline.model.name",
        "spotline.model.seq_len",
        "spotline.data.path",
        "spotline.data.tokenizer",
        "spotline.evaluation.data",
        "spotline.evaluation.interval_steps",
        "spotline.checkpoints.interval_steps",
    }
)


@dataclass(frozen=True)
class TrainingArguments:
    """The fields of ``transformers.TrainingArguments`` Spotline honours, with their names and
    defaults (``HfArgumentParser`` reads it). An HF ``TrainingArguments`` object works as well
    (its fields are read by name); a value Spotline cannot honour is a UserError."""

    output_dir: str
    max_steps: int = -1
    num_train_epochs: float = 3.0
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    eval_strategy: str = "no"
    eval_steps: int | None = None
    save_strategy: str = "steps"
    save_steps: int = 500
    seed: int = 42
    optim: str = "adamw_torch"
    fp16: bool = False
    bf16: bool = False
    label_smoothing_factor: float = 0.0

    def __post_init__(self) -> None:
        # Refused as the arguments are parsed (as transformers' own are checked), before the
        # script loads its model and data.
        job_keys(self)


class JobDescribed(BaseException):
    """Ends the script in ``spotline run``'s describing child once the job is written (a
    BaseException: a script's ``except Exception`` must not swallow it)."""


@dataclass(frozen=True)
class Job:
    """What a script's Trainer described: the config keys its arguments decide (no paths),
    the rows' length, which optional parts it has, its output_dir and Spotline config."""

    keys: dict[str, Any]
    seq_len: int
    has_eval: bool
    has_tokenizer: bool
    output_dir: str
    spotline_config: str | None
    # The script that described it (spotline run's workers run it again): None for a plain
    # run's job.
    script: ScriptCall | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def read(job_dir: Path) -> Job:
        raw = json.loads((job_dir / JOB_FILE).read_text())
        call = raw.pop("script", None)
        return Job(**raw, script=None if call is None else ScriptCall.from_json(call))


@dataclass(frozen=True)
class ScriptCall:
    """How a script was run: its absolute path, its arguments and the working directory
    (its relative paths, the data's included, mean what they meant there)."""

    path: str
    args: tuple[str, ...]
    cwd: str

    @staticmethod
    def of_this_process() -> ScriptCall:
        import sys

        return ScriptCall(os.path.abspath(sys.argv[0]), tuple(sys.argv[1:]), os.getcwd())

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> ScriptCall:
        return ScriptCall(str(raw["path"]), tuple(raw["args"]), str(raw["cwd"]))


def _arg(args: Any, name: str) -> Any:
    default = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}.get(name)
    value = getattr(args, name, default)
    # HF's enums (IntervalStrategy, SchedulerType) are str subclasses: their value.
    return getattr(value, "value", value)


def _warmup(args: Any, steps: int) -> int:
    warmup = int(_arg(args, "warmup_steps"))
    ratio = float(_arg(args, "warmup_ratio"))
    return warmup if warmup > 0 else math.ceil(ratio * steps)


def _scheduler_keys(args: Any, steps: int) -> dict[str, Any]:
    name = str(_arg(args, "lr_scheduler_type"))
    if name not in _SCHEDULERS:
        raise UserError(
            f"lr_scheduler_type {name!r} is not one Spotline runs exactly; use one of "
            + ", ".join(_SCHEDULERS)
        )
    kind = _SCHEDULERS[name]
    warmup = _warmup(args, steps)
    if kind is None:
        if warmup:
            raise UserError(
                "lr_scheduler_type 'constant' with warm-up steps; use constant_with_warmup"
            )
        return {}
    if warmup < 2:
        # DeepSpeed's warm-up schedulers need at least 2 warm-up steps.
        raise UserError(
            f"lr_scheduler_type {name!r} needs warmup_steps >= 2 (DeepSpeed's "
            f"{kind}); set --warmup_steps or use lr_scheduler_type constant"
        )
    lr = float(_arg(args, "learning_rate"))
    params: dict[str, Any] = {"warmup_num_steps": warmup, "warmup_type": "linear"}
    if kind == "WarmupCosineLR":
        params.update(total_num_steps=steps, warmup_min_ratio=0.0, cos_min_ratio=0.0)
    else:
        params.update(warmup_min_lr=0.0, warmup_max_lr=lr)
        if kind == "WarmupDecayLR":
            params["total_num_steps"] = steps
    return {"scheduler.type": kind, **{f"scheduler.params.{k}": v for k, v in params.items()}}


def _fp16_keys(args: Any) -> dict[str, Any]:
    """``fp16=True``: DeepSpeed's fp16 loss scaler with the settings of the scaler Hugging
    Face's Trainer runs (torch's GradScaler defaults: 2**16, halved at every overflow,
    doubled after 2,000 clean steps, counted as DeepSpeed's DynamicLossScaler counts them)."""
    if not _arg(args, "fp16"):
        return {"fp16.enabled": False}
    return {
        "fp16.enabled": True,
        "fp16.initial_scale_power": 16,
        "fp16.loss_scale_window": 2000,
        "fp16.hysteresis": 1,
    }


def _refuse_unsupported(args: Any) -> None:
    if _arg(args, "fp16") and _arg(args, "bf16"):
        raise UserError("fp16=True and bf16=True: one run trains in one precision; drop one")
    if _arg(args, "optim") not in ("adamw_torch", "adamw_hf"):
        raise UserError(f"optim {_arg(args, 'optim')!r}: Spotline runs torch's AdamW only")
    if float(_arg(args, "label_smoothing_factor")) != 0.0:
        raise UserError("label_smoothing_factor: Spotline's loss has no label smoothing; use 0")
    if int(_arg(args, "max_steps")) <= 0:
        raise UserError(
            "max_steps is not set: Spotline trains a number of steps, not epochs; pass --max_steps"
        )
    for name, allowed in (("eval_strategy", ("no", "steps")), ("save_strategy", ("no", "steps"))):
        if _arg(args, name) not in allowed:
            raise UserError(f"{name} {_arg(args, name)!r}: use one of {', '.join(allowed)}")


def job_keys(args: Any) -> dict[str, Any]:
    """The config keys (dotted, leaves) the TrainingArguments ``args`` decide."""
    _refuse_unsupported(args)
    steps = int(_arg(args, "max_steps"))
    keys: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(_arg(args, "per_device_train_batch_size")),
        "gradient_accumulation_steps": int(_arg(args, "gradient_accumulation_steps")),
        "optimizer.type": "AdamW",
        "optimizer.params.lr": float(_arg(args, "learning_rate")),
        "optimizer.params.betas": [
            float(_arg(args, "adam_beta1")),
            float(_arg(args, "adam_beta2")),
        ],
        "optimizer.params.eps": float(_arg(args, "adam_epsilon")),
        "optimizer.params.weight_decay": float(_arg(args, "weight_decay")),
        "gradient_clipping": float(_arg(args, "max_grad_norm")),
        "bf16.enabled": bool(_arg(args, "bf16")),
        **_fp16_keys(args),
        "spotline.training.steps": steps,
        "spotline.training.seed": int(_arg(args, "seed")),
        "spotline.checkpoints.interval_steps": (
            int(_arg(args, "save_steps")) if _arg(args, "save_strategy") == "steps" else 0
        ),
        **_scheduler_keys(args, steps),
    }
    if _arg(args, "eval_strategy") == "steps":
        every = _arg(args, "eval_steps")
        if every is None:
            raise UserError("eval_strategy 'steps' needs --eval_steps")
        keys["spotline.evaluation.interval_steps"] = int(every)
    return keys


def _features(dataset: Any) -> list[Any]:
    return [dataset[i] for i in range(len(dataset))]


def _matrix(values: Any, what: str) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.int64)
    except ValueError:
        raise UserError(
            f"{what} has rows of different lengths; group the texts into blocks of one length "
            "(as run_clm's group_texts) or pass a data_collator that pads"
        ) from None
    if array.ndim != 2 or array.shape[1] < 2:
        raise UserError(f"{what} must be rows of at least 2 token ids, got shape {array.shape}")
    return array


def dataset_rows(dataset: Any, collator: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``labels`` (unshifted) of every row of ``dataset``, through
    ``collator`` when given (all rows at once, so padding is to one length)."""
    if dataset is None or len(dataset) == 0:
        raise UserError(f"{what} is empty")
    features = _features(dataset)
    if collator is not None:
        batch = collator(features)
        ids = _matrix(batch["input_ids"], what)
        labels = _matrix(batch["labels"], what) if "labels" in batch else ids.copy()
        mask = batch.get("attention_mask")
    else:
        if not isinstance(features[0], Mapping) or "input_ids" not in features[0]:
            raise UserError(f"{what}'s rows have no input_ids; tokenize the dataset first")
        ids = _matrix([f["input_ids"] for f in features], what)
        has_labels = "labels" in features[0]
        labels = _matrix([f["labels"] for f in features], what) if has_labels else ids.copy()
        has_mask = "attention_mask" in features[0]
        mask = [f["attention_mask"] for f in features] if has_mask else None
    if labels.shape != ids.shape:
        raise UserError(f"{what}: labels and input_ids differ in shape")
    if mask is not None:
        attend = _matrix(mask, what) != 0
        # The model reads no attention mask: only padding after a row's tokens is exact.
        if bool((~attend[:, :-1] & attend[:, 1:]).any()):
            raise UserError(f"{what} is padded on the left; pad on the right (padding_side)")
        labels = np.where(attend, labels, IGNORE_LABEL)
    counted = (labels[:, 1:] != IGNORE_LABEL).any(axis=1)
    if not bool(counted.all()):
        raise UserError(
            f"{what}: {int((~counted).sum())} row(s) have no label to learn after the first "
            "token (all -100); drop them"
        )
    return ids, labels


def write_job(
    job_dir: Path,
    *,
    model: Any,
    args: Any,
    train_dataset: Any,
    eval_dataset: Any,
    data_collator: Any,
    processing_class: Any,
    spotline_config: str | None,
    script: ScriptCall | None = None,
) -> Job:
    """Write the job of a Trainer's arguments into ``job_dir`` (new or emptied)."""
    from spotline.data.corpus import save_rows

    keys, train, evaluation = _job_parts(args, train_dataset, eval_dataset, data_collator)
    seq_len = int(train[0].shape[1])
    if job_dir.exists():
        shutil.rmtree(job_dir)
    job_dir.mkdir(parents=True)
    model.save_pretrained(str(job_dir / MODEL_DIR))
    if processing_class is not None:
        processing_class.save_pretrained(str(job_dir / TOKENIZER_DIR))
    save_rows(job_dir / TRAIN_ROWS, *train)
    if evaluation is not None:
        save_rows(job_dir / EVAL_ROWS, *evaluation)
    job = Job(
        keys=keys,
        seq_len=seq_len,
        has_eval=evaluation is not None,
        has_tokenizer=processing_class is not None,
        output_dir=str(_arg(args, "output_dir")),
        spotline_config=spotline_config,
        script=script,
    )
    (job_dir / JOB_FILE).write_text(json.dumps(job.to_json(), indent=2))
    return job


Rows = tuple[np.ndarray, np.ndarray]


def _job_parts(
    args: Any, train_dataset: Any, eval_dataset: Any, data_collator: Any
) -> tuple[dict[str, Any], Rows, Rows | None]:
    """The config keys and the token rows (train, eval) a Trainer's arguments make."""
    keys = job_keys(args)
    train = dataset_rows(train_dataset, data_collator, "train_dataset")
    evaluation = (
        None if eval_dataset is None else dataset_rows(eval_dataset, data_collator, "eval_dataset")
    )
    seq_len = int(train[0].shape[1])
    if evaluation is not None and evaluation[0].shape[1] != seq_len:
        raise UserError(
            f"eval_dataset's rows are {evaluation[0].shape[1]} tokens, train_dataset's {seq_len}"
        )
    return keys, train, evaluation


def check_job(
    job_dir: Path,
    *,
    model: Any,
    args: Any,
    train_dataset: Any,
    eval_dataset: Any,
    data_collator: Any,
) -> None:
    """UserError unless a Trainer's arguments make exactly the job in ``job_dir``: the same
    config keys, token rows and model weights (a worker of ``spotline run`` trains the job's
    files; this is what makes them the script's)."""
    import torch
    from safetensors.torch import load_file

    job = Job.read(job_dir)
    keys, train, evaluation = _job_parts(args, train_dataset, eval_dataset, data_collator)
    differs = "the script made a different {} in this worker than when spotline run described it"
    hint = "; make the script deterministic (seed every random choice of data and model)"
    if keys != job.keys:
        raise UserError(differs.format("TrainingArguments") + hint)
    saved_rows = [(TRAIN_ROWS, train)] + ([] if evaluation is None else [(EVAL_ROWS, evaluation)])
    if (evaluation is not None) != job.has_eval:
        raise UserError(differs.format("eval_dataset") + hint)
    for name, (ids, labels) in saved_rows:
        with np.load(job_dir / name) as saved:  # as spotline.data.corpus.save_rows wrote them
            same = np.array_equal(saved["input_ids"], ids) and np.array_equal(
                saved["labels"], labels
            )
        if not same:
            raise UserError(differs.format(name.split(".")[0] + " dataset") + hint)
    state = model.state_dict()
    for weights in sorted((job_dir / MODEL_DIR).glob("*.safetensors")):
        for name, tensor in load_file(str(weights)).items():
            if name not in state or not torch.equal(state[name], tensor):
                raise UserError(differs.format(f"model (weight {name})") + hint)


def _leaves(raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_leaves(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _owned(key: str) -> bool:
    parts = key.split(".")
    return any(".".join(parts[: n + 1]) in OWNED_KEYS for n in range(len(parts)))


def build_config(
    job: Job,
    job_dir: Path,
    *,
    config_path: str | None,
    flags: Mapping[str, Any],
    plain: bool,
) -> RunConfig:
    """The run's config: ``config_path`` (or the default) with ``flags`` on top for what
    the script does not decide (topology, logical workers, redundancy, recovery, tracking),
    and the job's keys for what it does. A --config or flag value of a key the script decides
    that differs from the script's is a UserError (the script's arguments are the math).
    ``plain``: one process, one stage (the logical workers stay what the config says)."""
    raw: dict[str, Any] = {}
    if config_path is not None:
        if not Path(config_path).is_file():
            raise UserError(f"config file '{config_path}' does not exist")
        raw = json.loads(Path(config_path).read_text())
    keys = dict(job.keys)
    keys["spotline.model.name"] = str(job_dir / MODEL_DIR)
    keys["spotline.model.seq_len"] = job.seq_len
    keys["spotline.data.path"] = str(job_dir / TRAIN_ROWS)
    if job.has_tokenizer:
        keys["spotline.data.tokenizer"] = str(job_dir / TOKENIZER_DIR)
    if job.has_eval:
        keys["spotline.evaluation.data"] = str(job_dir / EVAL_ROWS)
    explicit = {**_leaves(raw), **_leaves_of_flags(flags)}
    for key, value in sorted(explicit.items()):
        if _owned(key) and keys.get(key) != value and not _same_path(key, value, keys):
            raise UserError(
                f"{key} is {json.dumps(value)} in --config or a flag but the script's "
                f"arguments make it {json.dumps(keys.get(key))}; the script decides it: "
                "drop it from --config and the flags"
            )
    cfg = with_overrides(parse_config(raw, source=config_path or "<built-in default>"), flags)
    cfg = with_overrides(cfg, keys)
    if plain:
        cfg = with_overrides(cfg, {"spotline.topology.workers": 1, "spotline.topology.stages": 1})
    return cfg


def _leaves_of_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flags.items() if v is not None}


def _same_path(key: str, value: Any, keys: Mapping[str, Any]) -> bool:
    # The model directory given again as a path to the same place is no contradiction.
    return (
        key == "spotline.model.name"
        and isinstance(value, str)
        and Path(value).resolve() == Path(str(keys[key])).resolve()
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Trainer:
    """Spotline's trainer for a Hugging Face script (see the module's docstring)."""

    def __init__(
        self,
        model: Any,
        args: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        data_collator: Any = None,
        processing_class: Any = None,
        spotline_config: str | None = None,
    ) -> None:
        parts: dict[str, Any] = dict(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator,
            processing_class=processing_class,
            spotline_config=spotline_config,
        )
        mode = os.environ.get(MODE_ENV)
        self.summary: dict[str, Any] | None = None
        if mode == DESCRIBE:
            write_job(Path(os.environ[JOB_ENV]), **parts, script=ScriptCall.of_this_process())
            raise JobDescribed
        if mode == WORKER:
            del parts["processing_class"], parts["spotline_config"]  # saved, not part of the math
            check_job(Path(os.environ[JOB_ENV]), **parts)
            self.output = Path(os.environ[JOB_ENV]).parent
            return
        self.output = Path(str(_arg(args, "output_dir")))
        # A plain run trains in one go (no --resume): an earlier run there is never reused.
        refuse_earlier_run(self.output, flag="--output_dir", resume=None)
        job_dir = self.output / JOB_DIR
        made_output = not self.output.exists()
        try:
            job = write_job(job_dir, **parts)
            self.cfg = build_config(job, job_dir, config_path=spotline_config, flags={}, plain=True)
            # The mistakes spotline run reports before any process starts, reported here too.
            from spotline.data.inputs import prepare_inputs

            prepare_inputs(self.cfg)
        except UserError:
            # A mistake leaves no half-written output (a job there would be an earlier run's
            # to the next try).
            shutil.rmtree(self.output if made_output else job_dir, ignore_errors=True)
            raise

    def train(self) -> dict[str, Any]:
        """Train in this process (one worker, one stage); returns summary.json's contents.

        In a worker of ``spotline run``: this worker's part of the job, through every
        generation until the job ends; returns ``{}`` (the run's summary.json is the
        coordinator's, written once every worker is done). A worker that must stop (its
        machine lost, an error) ends the script here with its exit code."""
        if os.environ.get(MODE_ENV) == WORKER:
            return _worker_train()
        from spotline.worker.launched import run_worker

        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        for name, value in env.items():
            os.environ[name] = value
        os.environ["MASTER_PORT"] = str(_free_port())
        summary = run_worker(self.cfg, self.output)
        assert summary is not None  # the only rank is rank 0
        self.summary = summary
        return summary

    def save_model(self, output_dir: str | None = None) -> None:
        """Copy the trained model (``output_dir/model``, with its tokenizer) to ``output_dir``.

        In a worker of ``spotline run`` nothing: the run writes the model once, to
        ``OUTPUT/model``."""
        if os.environ.get(MODE_ENV) == WORKER:
            return
        assert self.summary is not None, "save_model() comes after train()"
        if output_dir is None or Path(output_dir).resolve() == (self.output / "model").resolve():
            return
        shutil.copytree(self.output / "model", output_dir, dirs_exist_ok=True)


def describe_script(script: str, script_args: Sequence[str]) -> None:
    """Run ``script`` as ``__main__`` with ``script_args`` (in the describing child)."""
    import runpy
    import sys

    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


@dataclass
class _WorkerRun:
    """The script's run in a worker: the elastic worker's run its Trainer.train() is, and
    what came of it."""

    train: Callable[[], int]
    code: int | None = None


_worker_run: _WorkerRun | None = None


def run_script_in_worker(job_dir: Path, train: Callable[[], int]) -> int:
    """Run the script that described ``job_dir``'s job in this worker (``spotline run``):
    its Trainer checks the job and its ``train()`` calls ``train`` (the elastic worker's
    run). The worker's exit code; UserError if the script ends without calling train()."""
    global _worker_run
    job = Job.read(job_dir)
    assert job.script is not None, "a spotline run job names its script"
    _worker_run = _WorkerRun(train)
    os.environ[MODE_ENV] = WORKER
    os.environ[JOB_ENV] = str(job_dir)
    os.chdir(job.script.cwd)
    try:
        describe_script(job.script.path, job.script.args)
    except SystemExit as exc:
        if _worker_run.code is None or _worker_run.code == 0:
            # The script's own exit (sys.exit, argparse): its code, as python would give.
            return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        return _worker_run.code
    if _worker_run.code is None:
        raise UserError(
            f"{job.script.path} ended in a worker without calling Trainer.train(); call it "
            "once the Trainer is built"
        )
    return _worker_run.code


def _worker_train() -> dict[str, Any]:
    run = _worker_run
    assert run is not None, "a worker's Trainer runs inside run_script_in_worker"
    assert run.code is None, "train() runs once in a worker"
    run.code = run.train()
    if run.code != 0:
        # The worker must stop (the job failed, its machine was lost): not the script's
        # code after train(), which expects a trained model.
        raise SystemExit(run.code)
    return {}
