"""``TrainingArguments`` under Spotline: every field of Hugging Face's, honoured, ignored
with a reason, or refused in one line.

:class:`TrainingArguments` has exactly the fields of the installed
``transformers.TrainingArguments`` (names, types, defaults and help, read from it, so
``HfArgumentParser`` accepts a script's usual flags), without its device and accelerate
set-up, plus ``warmup_ratio`` for scripts written against transformers 4. A field at Hugging
Face's default says nothing; a field set to anything else is one of:

- honoured (:func:`job_keys`): mapped to the Spotline config keys that mean it
  (:data:`HONOURED`);
- ignored (:data:`IGNORED`, with why): it changes nothing Spotline computes (logging,
  data-loader workers, DDP's knobs: Spotline reduces exactly itself);
- refused: any other, one line naming the field and what to do (:data:`REFUSED` says why
  for the common ones). A field added by a later transformers is refused until it is
  placed: never silently dropped.

Under ``spotline run`` this class and ``spotline.hf.Trainer`` stand in for transformers'
own (``spotline.hf.stand_in_for_transformers``), so a script written against
``transformers.Trainer`` runs unmodified; plain ``python`` keeps Hugging Face's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import transformers

from spotline.errors import UserError

# Hugging Face scheduler name -> DeepSpeed scheduler (None: the constant rate).
_SCHEDULERS: dict[str, str | None] = {
    "constant": None,
    "constant_with_warmup": "WarmupLR",
    "linear": "WarmupDecayLR",
    "cosine": "WarmupCosineLR",
}
# Hugging Face optimizer name -> DeepSpeed's AdamW params beyond the rates (torch's AdamW:
# the replica's and a roll-forward's optimizer class is the owner's).
_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw_torch": {"torch_adam": True},
    "adamw_hf": {"torch_adam": True},
    "adamw_torch_fused": {"torch_adam": True, "fused": True},
}

HONOURED = frozenset(
    {
        "output_dir",
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "num_train_epochs",
        "max_steps",
        "learning_rate",
        "lr_scheduler_type",
        "warmup_steps",
        "warmup_ratio",
        "optim",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "label_smoothing_factor",
        "bf16",
        "fp16",
        "gradient_checkpointing",
        "eval_strategy",
        "eval_steps",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "seed",
        "full_determinism",
    }
)
"""Fields :func:`job_keys` maps to Spotline config keys."""

_LOGGING = "Spotline logs every step (spotline.tracking: wandb, the progress lines)"
_LOADER = "Spotline reads its token rows itself, by (step, logical worker, micro-batch)"
_DDP = "Spotline reduces gradients exactly itself, whatever the processes"
_MODES = "Spotline trains, then evaluates as eval_strategy says"
IGNORED: dict[str, str] = {
    **dict.fromkeys(("do_train", "do_eval", "do_predict"), _MODES),
    **dict.fromkeys(
        (
            "logging_strategy",
            "logging_steps",
            "logging_first_step",
            "logging_nan_inf_filter",
            "log_on_each_node",
            "log_level",
            "log_level_replica",
            "disable_tqdm",
            "report_to",
            "run_name",
            "project",
            "include_num_input_tokens_seen",
            "skip_memory_metrics",
        ),
        _LOGGING,
    ),
    **dict.fromkeys(
        (
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
            "dataloader_multiprocessing_context",
            "dataloader_in_order",
            "dataloader_drop_last",
            "remove_unused_columns",
            "label_names",
        ),
        _LOADER,
    ),
    **dict.fromkeys(
        (
            "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb",
            "ddp_broadcast_buffers",
            "ddp_static_graph",
            "ddp_backend",
            "ddp_timeout",
            "local_rank",
            "average_tokens_across_devices",
        ),
        _DDP,
    ),
    "use_cpu": "Spotline runs on the accelerator DeepSpeed finds (CPU here)",
    "accelerator_config": "accelerate's settings: Spotline runs DeepSpeed's engine itself",
    "tf32": "an accelerator setting outside the math Spotline checks",
    "use_cache": "no generation cache in training",
    "prediction_loss_only": "Spotline's evaluation computes the loss only",
    "eval_do_concat_batches": "Spotline's evaluation computes the loss only",
    "eval_accumulation_steps": "Spotline's evaluation computes the loss only",
    "save_only_model": "Spotline's checkpoints hold what a resume needs",
    "save_on_each_node": "one checkpoint file a logical stage, written once",
    "resume_from_checkpoint": "resume with spotline run --resume OUTPUT",
    "ignore_data_skip": "a resume continues at the next step's samples exactly",
    "debug": _LOGGING,
}
"""Fields whose value changes nothing Spotline computes, with why."""

REFUSED: dict[str, str] = {
    "push_to_hub": "a worker never uploads; upload OUTPUT/model yourself",
    "deepspeed": "Spotline runs DeepSpeed itself: pass a DeepSpeed config with --config",
    "fsdp": "Spotline runs DeepSpeed's pipeline engine, not FSDP",
    "torch_compile": "compiled kernels are not checked bitwise against the recovery paths",
    "load_best_model_at_end": "the best evaluation's model is kept in OUTPUT/best already",
    "data_seed": "the samples are drawn by seed, step and logical worker: use seed",
    "train_sampling_strategy": "Spotline draws samples uniformly by seed, step and logical worker",
    "auto_find_batch_size": "the batch is the job's math: set per_device_train_batch_size",
    "torch_empty_cache_steps": "an accelerator setting Spotline does not apply",
}
"""Why the common fields Spotline does not run are refused (any other: a general line)."""


class _ArgumentMethods:
    """What scripts call on their TrainingArguments besides reading fields: one process's
    answers (the describing child, and each worker, run the script whole)."""

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        yield

    @property
    def should_log(self) -> bool:
        return True

    @property
    def should_save(self) -> bool:
        return True

    @property
    def process_index(self) -> int:
        return 0

    @property
    def local_process_index(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def get_process_log_level(self) -> int:
        return logging.INFO

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)  # type: ignore[call-overload]
        return out

    def __post_init__(self) -> None:
        # Refused as the arguments are parsed (as transformers' own are checked), before the
        # script loads its model and data.
        job_keys(self)


def _hf_defaults() -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(transformers.TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _mirror() -> type:
    hf = transformers.TrainingArguments
    hints = typing.get_type_hints(hf)
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(hf):
        if not f.init:
            continue
        spec = dataclasses.field(
            default=f.default,
            default_factory=f.default_factory,
            metadata=f.metadata,
        )
        fields.append((f.name, hints[f.name], spec))
    if "warmup_ratio" not in {name for name, _, _ in fields}:
        help_ = "warm-up steps as a share of max_steps (transformers 4's field)"
        fields.append(
            ("warmup_ratio", float, dataclasses.field(default=0.0, metadata={"help": help_}))
        )
    cls = dataclasses.make_dataclass("TrainingArguments", fields, bases=(_ArgumentMethods,))
    cls.__module__ = __name__
    return cls


TrainingArguments: Any = _mirror()
TrainingArguments.__doc__ = (
    "Hugging Face's TrainingArguments fields, each honoured, ignored or refused by Spotline "
    "(see spotline.hf_arguments)."
)
_DEFAULTS = {**_hf_defaults(), "warmup_ratio": 0.0}


def field_value(args: Any, name: str) -> Any:
    """Field ``name`` of ``args`` (a TrainingArguments of ours or Hugging Face's, or any
    object with such fields): its value, or Hugging Face's default where it has none."""
    value = getattr(args, name, _DEFAULTS.get(name))
    # HF's enums (IntervalStrategy, SchedulerType) are str subclasses: their value.
    return getattr(value, "value", value)


# Values that say "not set" (transformers' own __post_init__ turns some None defaults into
# empty lists or False, and builds accelerate's config object: an HF TrainingArguments
# object passed to Spotline's Trainer is compared as it was given).
_UNSET: tuple[Any, ...] = (None, "", False, [], (), {})


def _changed(args: Any) -> dict[str, Any]:
    """The fields of ``args`` set to something other than Hugging Face's default."""
    out = {}
    for name, default in _DEFAULTS.items():
        value = field_value(args, name)
        default = getattr(default, "value", default)
        unset = any(value is u or value == u for u in _UNSET if type(u) is type(value))
        if value != default and not (unset and default in _UNSET):
            out[name] = value
    return out


def _refuse_unplaced(args: Any) -> None:
    for name, value in sorted(_changed(args).items()):
        if name in HONOURED or name in IGNORED:
            continue
        why = REFUSED.get(name, "Spotline does not run it")
        raise UserError(f"TrainingArguments {name}={value!r}: {why}; remove it")


def _warmup(args: Any, steps: int) -> int:
    warmup = float(field_value(args, "warmup_steps"))
    if 0 < warmup < 1:  # transformers 5: a float below 1 is a share of the steps
        return math.ceil(warmup * steps)
    ratio = float(field_value(args, "warmup_ratio"))
    return int(warmup) if warmup > 0 else math.ceil(ratio * steps)


def _scheduler_keys(args: Any, steps: int) -> dict[str, Any]:
    name = str(field_value(args, "lr_scheduler_type"))
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
    lr = float(field_value(args, "learning_rate"))
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
    if not field_value(args, "fp16"):
        return {"fp16.enabled": False}
    return {
        "fp16.enabled": True,
        "fp16.initial_scale_power": 16,
        "fp16.loss_scale_window": 2000,
        "fp16.hysteresis": 1,
    }


def _optional_keys(args: Any) -> dict[str, Any]:
    """Keys only a field set away from its default decides."""
    keys: dict[str, Any] = {}
    if field_value(args, "gradient_checkpointing"):
        keys["spotline.model.activation_checkpoint_interval"] = 1
    if field_value(args, "save_total_limit") is not None:
        keys["spotline.checkpoints.keep"] = int(field_value(args, "save_total_limit"))
    if field_value(args, "full_determinism"):
        keys["spotline.determinism.enabled"] = True
    return keys


def _refuse_unsupported(args: Any) -> None:
    if field_value(args, "fp16") and field_value(args, "bf16"):
        raise UserError("fp16=True and bf16=True: one run trains in one precision; drop one")
    if field_value(args, "optim") not in _OPTIMIZERS:
        raise UserError(
            f"optim {field_value(args, 'optim')!r}: Spotline runs torch's AdamW only; use one of "
            + ", ".join(_OPTIMIZERS)
        )
    if float(field_value(args, "label_smoothing_factor")) != 0.0:
        raise UserError("label_smoothing_factor: Spotline's loss has no label smoothing; use 0")
    if int(field_value(args, "max_steps")) <= 0:
        raise UserError(
            "max_steps is not set: Spotline trains a number of steps, not epochs; pass --max_steps"
        )
    for name, allowed in (("eval_strategy", ("no", "steps")), ("save_strategy", ("no", "steps"))):
        if field_value(args, name) not in allowed:
            raise UserError(f"{name} {field_value(args, name)!r}: use one of {', '.join(allowed)}")
    _refuse_unplaced(args)


def job_keys(args: Any) -> dict[str, Any]:
    """The config keys (dotted, leaves) the TrainingArguments ``args`` decide."""
    _refuse_unsupported(args)
    steps = int(field_value(args, "max_steps"))
    keys: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(field_value(args, "per_device_train_batch_size")),
        "gradient_accumulation_steps": int(field_value(args, "gradient_accumulation_steps")),
        "optimizer.type": "AdamW",
        "optimizer.params.lr": float(field_value(args, "learning_rate")),
        "optimizer.params.betas": [
            float(field_value(args, "adam_beta1")),
            float(field_value(args, "adam_beta2")),
        ],
        "optimizer.params.eps": float(field_value(args, "adam_epsilon")),
        "optimizer.params.weight_decay": float(field_value(args, "weight_decay")),
        **{f"optimizer.params.{k}": v for k, v in _OPTIMIZERS[field_value(args, "optim")].items()},
        "gradient_clipping": float(field_value(args, "max_grad_norm")),
        "bf16.enabled": bool(field_value(args, "bf16")),
        **_fp16_keys(args),
        "spotline.training.steps": steps,
        "spotline.training.seed": int(field_value(args, "seed")),
        "spotline.checkpoints.interval_steps": (
            int(field_value(args, "save_steps"))
            if field_value(args, "save_strategy") == "steps"
            else 0
        ),
        **_scheduler_keys(args, steps),
        **_optional_keys(args),
    }
    if field_value(args, "eval_strategy") == "steps":
        every = field_value(args, "eval_steps")
        if every is None:
            raise UserError("eval_strategy 'steps' needs --eval_steps")
        keys["spotline.evaluation.interval_steps"] = int(every)
    return keys


def placed_fields() -> Mapping[str, str]:
    """Every field and what Spotline does with a value other than the default: "honoured",
    "ignored: why" or "refused: why" (for the docs and the tests)."""
    out = {}
    for name in sorted(_DEFAULTS):
        if name in HONOURED:
            out[name] = "honoured"
        elif name in IGNORED:
            out[name] = f"ignored: {IGNORED[name]}"
        else:
            out[name] = f"refused: {REFUSED.get(name, 'Spotline does not run it')}"
    return out
