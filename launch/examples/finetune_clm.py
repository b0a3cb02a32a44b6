"""Fine-tune a causal language model on a text or instruction file, in the style of Hugging
Face's ``run_clm.py``, with ``spotline.hf.Trainer`` in place of ``transformers.Trainer``.

    python launch/examples/finetune_clm.py --model_name_or_path DIR --train_file F.jsonl \\
        --block_size 64 --max_steps 20 --output_dir runs/ft          # one process
    spotline run --workers 4 --stages 2 launch/examples/finetune_clm.py ...same args...

``--train_file``: ``.txt`` or ``.json``/``.jsonl`` with ``text`` records (concatenated and
cut into blocks of ``--block_size``, as run_clm's group_texts), or instruction records
(``prompt``/``completion``: one example a row, padded on the right, the loss on the
completion and an eos only). ``--validation_file`` or ``--validation_split_percentage``
gives the eval set. The tokenizer is the one saved in the model's directory. A mistake in
the arguments (a missing file or model, a value Spotline cannot honour) is one line and exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import datasets
import transformers

from spotline.errors import UserError
from spotline.hf import Trainer, TrainingArguments, pretrained_source

IGNORE = -100


@dataclass(frozen=True)
class ModelArguments:
    model_name_or_path: str


@dataclass(frozen=True)
class DataArguments:
    train_file: str
    validation_file: str | None = None
    validation_split_percentage: int = 0
    block_size: int = 64
    # A Spotline config for what TrainingArguments do not say (topology, logical workers,
    # redundancy, recovery, tracking); `spotline run --config` replaces it.
    spotline_config: str | None = None

    def __post_init__(self) -> None:
        # Checked as the arguments are parsed (as run_clm's are), not after the model loads.
        for flag, path in (
            ("--train_file", self.train_file),
            ("--validation_file", self.validation_file),
            ("--spotline_config", self.spotline_config),
        ):
            if path is not None and not Path(path).is_file():
                raise UserError(f"{flag} {path}: no such file; pass the path of an existing file")


def load_raw(data: DataArguments, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    def read(path: str) -> datasets.Dataset:
        kind = "text" if path.endswith(".txt") else "json"
        return datasets.load_dataset(kind, data_files=path, split="train")

    train = read(data.train_file)
    if data.validation_file is not None:
        return train, read(data.validation_file)
    if data.validation_split_percentage > 0:
        split = train.train_test_split(test_size=data.validation_split_percentage / 100, seed=seed)
        return split["train"], split["test"]
    return train, None


def tokenize(raw: datasets.Dataset, tokenizer: Any, block_size: int) -> datasets.Dataset:
    if "prompt" in raw.column_names:
        return raw.map(
            lambda r: instruction_row(r, tokenizer, block_size), remove_columns=raw.column_names
        )
    ids = raw.map(lambda r: tokenizer(r["text"]), batched=True, remove_columns=raw.column_names)
    return ids.map(lambda b: group_texts(b, block_size), batched=True)


def instruction_row(record: dict[str, str], tokenizer: Any, block_size: int) -> dict[str, Any]:
    prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
    completion = completion + [tokenizer.eos_token_id]
    ids = (prompt + completion)[-block_size:]  # a long prompt loses its start
    labels = ([IGNORE] * len(prompt) + completion)[-block_size:]
    pad = block_size - len(ids)
    return {
        "input_ids": ids + [tokenizer.pad_token_id] * pad,
        "labels": labels + [IGNORE] * pad,
        "attention_mask": [1] * len(ids) + [0] * pad,
    }


def group_texts(batch: dict[str, list[list[int]]], block_size: int) -> dict[str, Any]:
    joined = {k: list(chain(*batch[k])) for k in batch}
    total = (len(joined["input_ids"]) // block_size) * block_size
    blocks = {
        k: [v[i : i + block_size] for i in range(0, total, block_size)] for k, v in joined.items()
    }
    blocks["labels"] = [list(b) for b in blocks["input_ids"]]
    return blocks


def main() -> None:
    # transformers annotates its dataclass types with a NewType no class matches.
    parser = transformers.HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)  # type: ignore[arg-type]
    )
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    source = pretrained_source(model_args.model_name_or_path, what="--model_name_or_path")
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    raw_train, raw_eval = load_raw(data_args, training_args.seed)
    train = tokenize(raw_train, tokenizer, data_args.block_size)
    evaluation = None if raw_eval is None else tokenize(raw_eval, tokenizer, data_args.block_size)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        spotline_config=data_args.spotline_config,
    )
    summary = trainer.train()
    trainer.save_model()
    # Under spotline run every worker gets here once the job has ended, with {} (the run's
    # summary.json is written by the coordinator); a plain run gets its summary.
    print(f"finetune_clm: trained, param_sha256 {summary.get('param_sha256', 'in summary.json')}")


if __name__ == "__main__":
    main()
