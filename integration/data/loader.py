"""Any corpus a run names, loaded: token rows, text or instruction records.

Above :mod:`spotline.data.corpus` (text) and :mod:`spotline.data.instructions` (which builds
on it), so that the one entry point that chooses between them imports both.
"""

from __future__ import annotations

from spotline.config import InstructionLayout
from spotline.data.corpus import (
    ROWS_SUFFIX,
    PackedCorpus,
    data_name,
    load_records,
    load_rows,
    load_tokenizer,
    pack_sequences,
    text_dataset,
)
from spotline.data.instructions import instruction_corpus
from spotline.errors import UserError


def load_corpus(
    data: str | None,
    tokenizer_spec: str | None,
    seq_len: int,
    *,
    min_sequences: int,
    instruction_layout: InstructionLayout = "pack",
) -> PackedCorpus:
    """Read, tokenize and pack ``data``; fail early when it cannot fill ``min_sequences`` rows.

    ``min_sequences`` is what one training step consumes (the sampler's samples per step).
    Text records are packed by :func:`pack_sequences`; instruction records (prompt/completion
    or messages) become an :class:`spotline.data.instructions.InstructionCorpus` laid out as
    ``instruction_layout`` says.
    """
    if data is not None and str(data).endswith(ROWS_SUFFIX):
        # Rows a Hugging Face script already tokenized (spotline.hf): read as they are.
        corpus: PackedCorpus = load_rows(data, seq_len)
        if len(corpus) < min_sequences:
            raise UserError(
                f"the training dataset has {len(corpus)} rows, fewer than the {min_sequences} "
                "one training step needs; use more data or a smaller batch"
            )
        return corpus
    records = load_records(data)
    name = data_name(data)
    if records.format == "text":
        dataset = text_dataset(records, name)
        tokenizer = load_tokenizer(tokenizer_spec)
        corpus = PackedCorpus(pack_sequences(dataset, tokenizer, seq_len))
    else:
        tokenizer = load_tokenizer(tokenizer_spec)
        corpus = instruction_corpus(
            records, tokenizer, seq_len, instruction_layout, tokenizer_name=tokenizer_spec or "byte"
        )
    if len(corpus) < min_sequences:
        raise UserError(
            f"corpus {name!r} packs to {len(corpus)} sequences of {seq_len} tokens, fewer than "
            f"the {min_sequences} one training step needs; use a larger corpus or a smaller "
            "--seq-len/batch"
        )
    return corpus
