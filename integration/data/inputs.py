"""What a run trains on, resolved and checked before any worker starts.

``spotline train`` runs :func:`prepare_inputs` in a short-lived child before any process
starts (``spotline.launch.control.input_check``), and every worker runs it again to build its
corpus. It needs the model's config, the tokenizer and the data, not DeepSpeed or the
model's code: seconds of imports per run that the check does not pay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotline.config import RunConfig
from spotline.data import corpus as sl_data
from spotline.data.corpus import PackedCorpus
from spotline.data.instructions import IGNORE_INDEX
from spotline.data.loader import load_corpus
from spotline.errors import UserError
from spotline.models.model_config import check_sequence, check_stages, load_hf_config
from spotline.plan.evaluation import EvalBatches, holdout_split

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Inputs:
    """What a run trains on: the model's config, the rows the sampler draws from
    (``corpus``: without a held-out fraction) and the eval set (None: no evaluation).
    ``data``: the whole data as loaded (its summary and notes are the run's)."""

    hf_config: Any
    corpus: sl_data.PackedCorpus
    eval_set: EvalSet | None
    data: sl_data.PackedCorpus

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s ``data``: what the data became, and the eval set's part."""
        out = self.data.summary()
        if self.eval_set is not None:
            out["eval"] = dict(self.eval_set.description)
        return out


def prepare_inputs(cfg: RunConfig) -> Inputs:
    """Resolve the model config, corpus and eval set; raises UserError on bad input.

    The launcher calls this before starting any worker so that a user mistake is reported
    once, as one line, with no process started and nothing written.
    """
    sl = cfg.spotline
    hf_config = load_hf_config(sl.model.name, sl.model.overrides)
    check_stages(hf_config, cfg.num_stages)
    check_sequence(hf_config, sl.model.seq_len)
    samples_per_step = cfg.samples_per_step
    corpus = load_corpus(
        sl.data.path,
        sl.data.tokenizer,
        sl.model.seq_len,
        min_sequences=samples_per_step,
        instruction_layout=sl.data.instruction_layout,
    )
    train, eval_set = prepare_eval_set(cfg, corpus)
    return Inputs(hf_config=hf_config, corpus=train, eval_set=eval_set, data=corpus)


@dataclass(frozen=True)
class EvalSet:
    """The rows evaluated (``corpus``, in order), their micro-batches, and what they are
    (``description``: ``summary.json``'s ``data.eval``)."""

    corpus: PackedCorpus
    batches: EvalBatches
    description: Mapping[str, Any]

    def batch(self, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of eval micro-batch ``micro_batch``: its rows, topped up
        to the micro-batch size with copies of its first row whose labels are all
        :data:`IGNORE_INDEX` (they add nothing to the loss sum or the count, and keep the
        pipeline's buffer shapes)."""
        import torch

        rows = list(self.batches.rows(micro_batch))
        input_ids, labels = self.corpus.batch(rows)
        missing = self.batches.micro_batch_size - len(rows)
        if missing:
            input_ids = torch.cat([input_ids, input_ids[:1].expand(missing, -1)])
            ignored = torch.full((missing, labels.shape[1]), IGNORE_INDEX, dtype=labels.dtype)
            labels = torch.cat([labels, ignored])
        return input_ids.contiguous(), labels.contiguous()


def prepare_eval_set(cfg: RunConfig, corpus: PackedCorpus) -> tuple[PackedCorpus, EvalSet | None]:
    """The rows to train on and the eval set of ``cfg`` (None: evaluation is off).

    A held-out fraction is removed from ``corpus``; an eval file leaves it whole. Raises
    UserError (one line) when the eval set cannot fill one micro-batch, when the rows left
    cannot fill one training step, or when the eval file cannot be read."""
    ev = cfg.spotline.evaluation
    if not ev.enabled:
        return corpus, None
    description: dict[str, Any]
    if ev.holdout_fraction is not None:
        split = holdout_split(len(corpus), ev.holdout_fraction, cfg.spotline.training.seed)
        train = corpus.select(split.train)
        if len(train) < cfg.samples_per_step:
            raise UserError(
                f"--eval-holdout {ev.holdout_fraction} holds out {len(split.held_out)} of the "
                f"{len(corpus)} rows of --data, leaving {len(train)}, fewer than the "
                f"{cfg.samples_per_step} one training step needs; hold out less or use more data"
            )
        evaluated = corpus.select(split.held_out) if split.held_out else None
        where = f"--eval-holdout {ev.holdout_fraction} ({len(split.held_out)} rows)"
        description = {
            "source": "holdout",
            "holdout_fraction": ev.holdout_fraction,
            "held_out_rows": len(split.held_out),
            "train_rows": len(train),
        }
    else:
        assert ev.data is not None  # enabled: a file or a fraction
        train = corpus
        evaluated = _load_eval_file(cfg, ev.data)
        where = f"--eval-data {ev.data!r} ({len(evaluated)} rows)"
        description = {"source": "file", "path": ev.data, **evaluated.summary()}
    available = 0 if evaluated is None else len(evaluated)
    rows = available if ev.max_samples is None else min(ev.max_samples, available)
    size = cfg.micro_batch_size
    if evaluated is None or rows < size:
        limit = f", limited to {ev.max_samples} by --eval-max-samples" if rows < available else ""
        raise UserError(
            f"the evaluation set {where}{limit} is smaller than one micro-batch of {size} "
            f"rows of --seq-len {cfg.spotline.model.seq_len} + 1 tokens; use a larger "
            "evaluation set or a smaller --micro-batch-size"
        )
    if rows < available:
        evaluated = evaluated.select(range(rows))
    batches = EvalBatches(rows, size)
    description.update(rows=rows, micro_batches=batches.num_micro_batches)
    return train, EvalSet(evaluated, batches, description)


def _load_eval_file(cfg: RunConfig, path: str) -> PackedCorpus:
    """``--eval-data`` through the loader ``--data`` goes through (same tokenizer, seq_len
    and instruction layout); its size is checked by the caller."""
    sl = cfg.spotline
    if not Path(path).expanduser().exists():
        # Said here: the loader's own message is --data's (its advice names --data).
        raise UserError(
            f"--eval-data {path} does not exist; pass a .txt/.json/.jsonl file or a folder "
            "to evaluate on, or hold out a share of the training rows with --eval-holdout "
            "FRACTION"
        )
    try:
        return load_corpus(
            path,
            sl.data.tokenizer,
            sl.model.seq_len,
            min_sequences=0,
            instruction_layout=sl.data.instruction_layout,
        )
    except UserError as exc:
        raise UserError(f"--eval-data {path}: {exc}") from None
