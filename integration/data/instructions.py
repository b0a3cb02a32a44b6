"""Instruction data: prompt/completion pairs or chats, the loss counting the answer only.

``--data`` records with ``prompt`` and ``completion`` strings, or with ``messages`` (a list of
``{"role", "content"}``, the last one the assistant's), become one *example* each: the
prompt's tokens, then the completion's tokens and the tokenizer's eos. The loss counts the
completion and its eos; every other label is :data:`IGNORE_INDEX`, which
``torch.nn.functional.cross_entropy`` (``spotline.models.layers.causal_lm_loss``) skips, so the
loss of a micro-batch is the mean over its counted tokens.

- **prompt/completion**: the two strings are tokenized separately (no special tokens), so
  the boundary between what is read and what is learned is exact.
- **messages**: rendered by the tokenizer's own chat template (``--tokenizer DIR``, saved by
  ``save_pretrained`` with a ``chat_template``). The prompt is the render of every message
  but the last with ``add_generation_prompt=True``; it must be a token prefix of the render
  of the whole chat, and the completion is the rest (the final assistant turn and whatever
  the template closes it with), with the eos appended unless the render ends with it.
  Earlier assistant turns are context, not counted.

Rows hold ``seq_len + 1`` tokens, like the text path's (``spotline.data.corpus.PackedCorpus``):
inputs ``row[:-1]``, labels ``row[1:]``, a label counted where its token is a completion
token. Layouts (``spotline.data.instruction_layout``):

- ``pack`` (default): whole examples one after another, in record order, a row closed (its
  rest padded) when the next example does not fit. An example never spans two rows, so its
  completion is always learned with its whole prompt in view. Examples sharing a row attend
  to each other, as packed documents do on the text path.
- ``pad``: one example a row, the rest padded.

Padding is the tokenizer's pad token (its eos when it has none); its labels never count.

**Truncation.** An example longer than a row is cut to ``seq_len + 1`` tokens: the prompt
loses tokens from its start (the end of a prompt, next to the answer, matters most, and a
chat template's generation prompt sits there); only when the completion with its eos
alone would not leave one prompt token is the completion cut, at its end (its eos first).
So every example keeps at least one prompt token and one counted token, and no record
vanishes. Each truncated record is counted (``truncated_records``, and those whose
completion was cut in ``completion_truncated_records``), in ``summary.json``'s ``data`` and
in one line ``spotline train`` prints.

**No micro-batch without a counted label.** Every example keeps a counted token and every
row holds at least one example, so every row, hence every micro-batch, has a label the loss
counts: the mean never divides by zero, and no NaN reaches the optimizer
(:class:`InstructionCorpus` asserts it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spotline.config import InstructionLayout
from spotline.data.corpus import TOKENIZE_BATCH, PackedCorpus, RecordFormat, Records, error_reason
from spotline.errors import UserError

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
"""The label the loss skips (``cross_entropy``'s default ``ignore_index``)."""


@dataclass(frozen=True)
class Example:
    """One record tokenized: what the model reads, then what it learns (eos included)."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclass(frozen=True)
class Fitted:
    """An example cut to a row (see the module's docstring), and what was cut."""

    example: Example
    truncated: bool
    completion_cut: bool


def fit(example: Example, row_len: int) -> Fitted:
    """``example`` in at most ``row_len`` tokens: the prompt cut from its start, the
    completion at its end only when it alone would leave no prompt token."""
    assert row_len >= 2 and example.prompt and example.completion
    if len(example) <= row_len:
        return Fitted(example, truncated=False, completion_cut=False)
    keep_completion = min(len(example.completion), row_len - 1)
    keep_prompt = row_len - keep_completion
    cut = Example(
        prompt=example.prompt[len(example.prompt) - keep_prompt :],
        completion=example.completion[:keep_completion],
    )
    return Fitted(cut, truncated=True, completion_cut=keep_completion < len(example.completion))


@dataclass(frozen=True)
class InstructionStats:
    """What the instruction data turned into: ``summary.json``'s ``data``."""

    format: RecordFormat
    layout: InstructionLayout
    seq_len: int
    records: int
    rows: int
    counted_tokens: int
    truncated_records: int
    completion_truncated_records: int

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "layout": self.layout,
            "seq_len": self.seq_len,
            "records": self.records,
            "rows": self.rows,
            "counted_tokens": self.counted_tokens,
            "truncated_records": self.truncated_records,
            "completion_truncated_records": self.completion_truncated_records,
        }


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (a template writes its own)."""
    out: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        batch = list(texts[start : start + TOKENIZE_BATCH])
        out.extend(list(ids) for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])
    return out


def _eos_id(tokenizer: Any) -> int:
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UserError(
            "the tokenizer has no eos token, which ends each completion; save one with "
            "an eos_token or use the built-in 'byte' tokenizer"
        )
    return int(eos_id)


def _string_field(records: Records, index: int, field: str) -> str:
    value = records.columns[field][index]
    if not isinstance(value, str):
        raise UserError(f"{records.where(index)}: {field!r} is {value!r}; expected a string")
    return value


def prompt_completion_examples(records: Records, tokenizer: Any) -> list[Example]:
    """Examples of ``prompt``/``completion`` records: the two tokenized apart, eos after the
    completion. An empty prompt or completion is a UserError naming the record."""
    assert records.format == "prompt-completion"
    eos_id = _eos_id(tokenizer)
    prompts = [_string_field(records, i, "prompt") for i in range(len(records))]
    completions = [_string_field(records, i, "completion") for i in range(len(records))]
    examples = []
    for i, (prompt, completion) in enumerate(
        zip(_encode(tokenizer, prompts), _encode(tokenizer, completions), strict=True)
    ):
        _check_parts(records, i, prompt, completion)
        examples.append(Example(tuple(prompt), (*completion, eos_id)))
    return examples


def _check_parts(records: Records, index: int, prompt: list[int], completion: list[int]) -> None:
    what = "completion" if records.format == "prompt-completion" else "final assistant message"
    if not completion:
        raise UserError(
            f"{records.where(index)} has an empty {what} (no tokens); give it the text the "
            "model should learn to answer, or drop the record"
        )
    if not prompt:
        # The first completion token needs a token before it to be predicted from.
        raise UserError(
            f"{records.where(index)} has an empty prompt (no tokens); give it one, or make "
            "the record a 'text' document"
        )


def _messages(records: Records, index: int) -> list[dict[str, str]]:
    """Record ``index``'s chat, checked: role/content strings, the last turn the assistant's."""
    where = records.where(index)
    raw = records.columns["messages"][index]
    if not isinstance(raw, list) or len(raw) < 2:
        raise UserError(
            f"{where}: 'messages' must list at least two messages (a prompt, then the "
            "assistant's reply the loss counts)"
        )
    chat = []
    for turn, message in enumerate(raw, start=1):
        # The JSON builder gives every message every key any message has (None if unset).
        fields = (
            {k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else {}
        )
        if not isinstance(fields.get("role"), str) or not isinstance(fields.get("content"), str):
            raise UserError(
                f"{where}: message {turn} is {message!r}; give each message a 'role' and a "
                "'content' string"
            )
        chat.append(fields)
    if chat[-1]["role"] != "assistant":
        raise UserError(
            f"{where}: the last message's role is {chat[-1]['role']!r}; end the chat with the "
            "'assistant' reply the loss counts"
        )
    return chat


def _render(
    tokenizer: Any, records: Records, index: int, chat: list[dict[str, str]]
) -> tuple[str, str]:
    """(prompt, whole chat) as the template writes them."""
    try:
        prompt = tokenizer.apply_chat_template(
            chat[:-1], tokenize=False, add_generation_prompt=True
        )
        whole = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception as exc:  # a template raises whatever its Jinja code raises
        raise UserError(
            f"{records.where(index)}: the tokenizer's chat template fails on this chat "
            f"({error_reason(exc)}); fix the record or the template"
        ) from exc
    return str(prompt), str(whole)


def chat_examples(records: Records, tokenizer: Any, tokenizer_name: str) -> list[Example]:
    """Examples of ``messages`` records rendered by the tokenizer's chat template: the prompt
    is the chat before its last message with the generation prompt, the completion the rest
    of the whole chat's render (then eos, unless the render ends with it)."""
    assert records.format == "messages"
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"--data holds chat 'messages' but the tokenizer {tokenizer_name!r} has no chat "
            "template to render them; pass --tokenizer DIR saved with a chat_template, or "
            "write 'prompt'/'completion' records"
        )
    eos_id = _eos_id(tokenizer)
    prompts: list[str] = []
    wholes: list[str] = []
    for i in range(len(records)):
        prompt, whole = _render(tokenizer, records, i, _messages(records, i))
        prompts.append(prompt)
        wholes.append(whole)
    examples = []
    for i, (prompt_ids, whole_ids) in enumerate(
        zip(_encode(tokenizer, prompts), _encode(tokenizer, wholes), strict=True)
    ):
        if whole_ids[: len(prompt_ids)] != prompt_ids:
            raise UserError(
                f"{records.where(index=i)}: the chat template's render of the chat does not "
                "start with its render of the prompt (the chat before the last message, with "
                "the generation prompt), so the reply's tokens cannot be told apart; use a "
                "template whose generation prompt opens the assistant turn, or "
                "'prompt'/'completion' records"
            )
        completion = whole_ids[len(prompt_ids) :]
        _check_parts(records, i, prompt_ids, completion)
        if completion[-1] != eos_id:
            completion.append(eos_id)
        examples.append(Example(tuple(prompt_ids), tuple(completion)))
    return examples


def layout_rows(
    examples: Sequence[Example], row_len: int, layout: InstructionLayout, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, counted)``, both ``[rows, row_len]``: token ids (int64) and whether each
    token is one the loss learns (bool). Every example must fit a row (see :func:`fit`)."""
    groups: list[list[Example]] = []
    if layout == "pad":
        groups = [[example] for example in examples]
    else:
        used = row_len  # no open row yet
        for example in examples:
            assert len(example) <= row_len
            if used + len(example) > row_len:
                groups.append([])
                used = 0
            groups[-1].append(example)
            used += len(example)
    tokens = np.full((len(groups), row_len), pad_id, dtype=np.int64)
    counted = np.zeros((len(groups), row_len), dtype=bool)
    for row, group in enumerate(groups):
        at = 0
        for example in group:
            tokens[row, at : at + len(example.prompt)] = example.prompt
            at += len(example.prompt)
            tokens[row, at : at + len(example.completion)] = example.completion
            counted[row, at : at + len(example.completion)] = True
            at += len(example.completion)
    return tokens, counted


class InstructionCorpus(PackedCorpus):
    """Rows of instruction examples: :class:`PackedCorpus` whose labels are
    :data:`IGNORE_INDEX` where the token is not one the loss learns (prompt, padding)."""

    def __init__(self, tokens: np.ndarray, counted: np.ndarray, stats: InstructionStats) -> None:
        super().__init__(tokens)
        if counted.shape != self.tokens.shape or counted.dtype != np.bool_:
            raise ValueError(
                f"the counted mask must be bool {self.tokens.shape}, got {counted.dtype} "
                f"{counted.shape}"
            )
        # The first token of a row is never a label; every row has one the loss counts, so
        # no micro-batch divides by zero (see the module's docstring).
        assert not counted[:, 0].any() and bool(counted[:, 1:].any(axis=1).all())
        self.counted: np.ndarray = np.ascontiguousarray(counted)
        self.labels: np.ndarray = np.where(self.counted[:, 1:], self.tokens[:, 1:], IGNORE_INDEX)
        self.stats = stats

    def summary(self) -> dict[str, Any]:
        return self.stats.to_json()

    def notes(self) -> list[str]:
        """The one line saying how many records were truncated (none if none was)."""
        st = self.stats
        if not st.truncated_records:
            return []
        cut = (
            f"; {st.completion_truncated_records} also lost the end of the completion"
            if st.completion_truncated_records
            else ""
        )
        return [
            f"{st.truncated_records} of {st.records} instruction records do not fit a row of "
            f"--seq-len {st.seq_len} + 1 tokens and were truncated, the prompt from its "
            f"start{cut} (summary.json: data.truncated_records)"
        ]

    def select(self, rows: Sequence[int]) -> InstructionCorpus:
        """Rows ``rows`` with their masks, as :meth:`PackedCorpus.select`; the stats count
        this split's rows and tokens (its records and truncations are the whole data's)."""
        picked = self._rows(rows)
        counted = self.counted[picked]
        stats = dataclasses.replace(self.stats, rows=len(picked), counted_tokens=int(counted.sum()))
        return InstructionCorpus(self.tokens[picked], counted, stats)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` as :meth:`PackedCorpus.batch`, labels not counted set to
        :data:`IGNORE_INDEX`."""
        import torch

        rows = self._rows(indices)
        return (
            torch.from_numpy(self.tokens[rows, :-1]).contiguous(),
            torch.from_numpy(self.labels[rows]).contiguous(),
        )


def instruction_corpus(
    records: Records,
    tokenizer: Any,
    seq_len: int,
    layout: InstructionLayout,
    *,
    tokenizer_name: str = "byte",
) -> InstructionCorpus:
    """Tokenize, truncate (counting) and lay out instruction ``records`` in rows of
    ``seq_len + 1`` tokens."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise UserError(f"--seq-len must be a positive integer, got {seq_len!r}")
    if records.format == "prompt-completion":
        examples = prompt_completion_examples(records, tokenizer)
    else:
        examples = chat_examples(records, tokenizer, tokenizer_name)
    row_len = seq_len + 1
    fitted = [fit(example, row_len) for example in examples]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_id(tokenizer)
    tokens, counted = layout_rows([f.example for f in fitted], row_len, layout, int(pad_id))
    stats = InstructionStats(
        format=records.format,
        layout=layout,
        seq_len=seq_len,
        records=len(examples),
        rows=int(tokens.shape[0]),
        counted_tokens=int(counted.sum()),
        truncated_records=sum(f.truncated for f in fitted),
        completion_truncated_records=sum(f.completion_cut for f in fitted),
    )
    return InstructionCorpus(tokens, counted, stats)
