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
from spotline.hf_arguments import TrainingArguments as TrainingArguments
from spotline.hf_arguments import field_value
from spotline.hf_arguments import job_keys as job_keys
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
        output_dir=str(field_value(args, "output_dir")),
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


# transformers.Trainer's arguments Spotline does not run, with what to do instead: refused in
# one line when given (any value but the default).
_REFUSED_TRAINER_ARGS = {
    "callbacks": "Spotline runs no Trainer callbacks yet (its progress lines and wandb "
    "log every step); remove callbacks=",
    "compute_metrics": "Spotline's evaluation computes the loss and perplexity only; remove "
    "compute_metrics=",
    "preprocess_logits_for_metrics": "Spotline's evaluation computes the loss only; remove it",
    "model_init": "pass the model itself (model=), built once",
    "optimizers": "the optimizer and schedule come from TrainingArguments (optim, "
    "learning_rate, lr_scheduler_type); remove optimizers=",
}


class TrainOutput(dict[str, Any]):
    """What ``train()`` returns: the run's summary (a dict, as Spotline's scripts read it)
    with transformers' ``TrainOutput`` fields (``global_step``, ``training_loss``,
    ``metrics``), as Hugging Face's scripts read it."""

    @property
    def global_step(self) -> int:
        return int(self.get("steps", 0))

    @property
    def training_loss(self) -> float | None:
        return self.get("final_loss")

    @property
    def metrics(self) -> dict[str, Any]:
        if not self:
            return {}
        return {
            "train_loss": self.get("final_loss"),
            "train_samples_per_second": self.get("samples_per_s"),
        }


class Trainer:
    """Spotline's trainer for a Hugging Face script (see the module's docstring): the
    arguments of ``transformers.Trainer`` (those it does not run refused in one line)."""

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        spotline_config: str | None = None,
        **others: Any,
    ) -> None:
        for name, value in others.items():
            if name == "tokenizer" and processing_class is None:
                processing_class = value  # transformers 4's name for it
            elif name in _REFUSED_TRAINER_ARGS:
                if value is not None and value != (None, None):
                    raise UserError(f"Trainer({name}=...): {_REFUSED_TRAINER_ARGS[name]}")
            else:
                raise UserError(
                    f"Trainer({name}=...): not an argument Spotline's Trainer takes; remove it"
                )
        if model is None or args is None or train_dataset is None:
            raise UserError("Trainer needs model=, args= and train_dataset=")
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
        self.output = Path(str(field_value(args, "output_dir")))
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

    def train(self, resume_from_checkpoint: Any = None, **others: Any) -> TrainOutput:
        """Train in this process (one worker, one stage); returns summary.json's contents.

        In a worker of ``spotline run``: this worker's part of the job, through every
        generation until the job ends; returns ``{}`` (the run's summary.json is the
        coordinator's, written once every worker is done). A worker that must stop (its
        machine lost, an error) ends the script here with its exit code."""
        if resume_from_checkpoint or others:
            raise UserError(
                "Trainer.train(resume_from_checkpoint=...): a Spotline run resumes as a whole: "
                "spotline run --resume OUTPUT (no script arguments); call train() without it"
            )
        if os.environ.get(MODE_ENV) == WORKER:
            return TrainOutput(_worker_train())
        from spotline.worker.launched import run_worker

        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        for name, value in env.items():
            os.environ[name] = value
        os.environ["MASTER_PORT"] = str(_free_port())
        summary = run_worker(self.cfg, self.output)
        assert summary is not None  # the only rank is rank 0
        self.summary = summary
        return TrainOutput(summary)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The last evaluation of the trained model (the run evaluates its eval set after
        the last step), as transformers names it; ``{}`` in a worker of ``spotline run``
        (the run's evaluations are in OUTPUT/summary.json) or without an eval set."""
        if args or kwargs:
            raise UserError(
                "Trainer.evaluate(...) with arguments: Spotline evaluates the Trainer's "
                "eval_dataset; call evaluate() without them"
            )
        evaluations = (self.summary or {}).get("eval") or []
        if not evaluations:
            return {}
        last = evaluations[-1]
        return {"eval_loss": last["loss"], "perplexity": last["perplexity"]}

    def log_metrics(self, split: str, metrics: Mapping[str, Any]) -> None:
        """Print ``metrics`` as transformers' Trainer does, one line each."""
        for key, value in sorted(metrics.items()):
            print(f"  {split}_{key.removeprefix(split + '_')} = {value}")

    def save_metrics(self, split: str, metrics: Mapping[str, Any]) -> None:
        """``OUTPUT/<split>_results.json`` (a plain run; a worker's are in summary.json)."""
        if os.environ.get(MODE_ENV) == WORKER:
            return
        (self.output / f"{split}_results.json").write_text(json.dumps(dict(metrics), indent=2))

    def save_state(self) -> None:
        """Nothing: the run's state is its checkpoints and summary.json."""

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


def stand_in_for_transformers() -> None:
    """Make ``transformers.Trainer`` and ``transformers.TrainingArguments`` Spotline's in this
    process (``spotline run``'s describing child and workers, before the script runs): a
    script written against Hugging Face's Trainer runs unmodified. ``from transformers
    import Trainer`` reads the module's attribute, which transformers' lazy module then
    never resolves to its own; plain ``python SCRIPT.py`` never calls this."""
    import transformers

    transformers.Trainer = Trainer  # type: ignore[misc,assignment]
    transformers.TrainingArguments = TrainingArguments  # type: ignore[misc]


def describe_script(script: str, script_args: Sequence[str]) -> None:
    """Run ``script`` as ``__main__`` with ``script_args`` (in the describing child and in
    each worker), its transformers Trainer Spotline's."""
    import runpy
    import sys

    stand_in_for_transformers()
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
