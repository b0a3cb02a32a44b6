"""Instruction data: records detected by their fields, the loss on completion tokens only,
packed or padded rows, truncation counted, chat templates, and each bad input as one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from conftest import NO_DROPOUT, read_summary, run_spotline, small_config, write_config

from spotline.config import parse_config, with_overrides
from spotline.data import corpus as data
from spotline.data.instructions import IGNORE_INDEX, Example, InstructionCorpus, fit
from spotline.data.loader import load_corpus
from spotline.errors import UserError
from spotline.launch.dev import tiny_instructions
from spotline.launch.flags import FLAG_KEYS
from spotline.models import layers as models
from spotline.reference import train_reference

EOS, PAD = 256, 257
TINY = Path(data.__file__).resolve().parents[1] / "assets" / "instructions" / "tiny.jsonl"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_jsonl(path: Path, records: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_tokenizer(directory: Path, template: str = CHAT_TEMPLATE) -> str:
    """The built-in byte-level tokenizer with a chat template, saved to ``directory``."""
    tokenizer = data.byte_level_tokenizer()
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return str(directory)


PAIRS = [
    {"prompt": "Reverse: cat\n", "completion": "tac"},
    {"prompt": "Add: 2 + 3\n", "completion": "5"},
    {"prompt": "Opposite: hot\n", "completion": "cold"},
]


def test_pad_layout_masks_every_prompt_and_pad_label(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    corpus = load_corpus(path, None, 20, min_sequences=1, instruction_layout="pad")
    assert isinstance(corpus, InstructionCorpus)
    assert len(corpus) == 3 and corpus.seq_len == 20
    input_ids, labels = corpus.batch([0, 1, 2])
    for row, pair in enumerate(PAIRS):
        prompt, completion = byte_ids(pair["prompt"]), byte_ids(pair["completion"]) + [EOS]
        example = prompt + completion
        pads = 21 - len(example)
        assert corpus.tokens[row].tolist() == example + [PAD] * pads
        assert input_ids[row].tolist() == (example + [PAD] * pads)[:-1]
        # Label t is token t + 1: -100 for the prompt's tokens after the first, then the
        # completion and its eos, then -100 over the padding.
        expected = [IGNORE_INDEX] * (len(prompt) - 1) + completion + [IGNORE_INDEX] * pads
        assert labels[row].tolist() == expected
    assert corpus.summary() == {
        "format": "prompt-completion",
        "layout": "pad",
        "seq_len": 20,
        "records": 3,
        "rows": 3,
        "counted_tokens": sum(len(p["completion"]) + 1 for p in PAIRS),
        "truncated_records": 0,
        "completion_truncated_records": 0,
    }
    assert corpus.notes() == []


def test_pack_layout_keeps_examples_whole_and_in_order(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    # 17 + 13 tokens share a row of 31; the third example (19) opens the next one.
    corpus = load_corpus(path, None, 30, min_sequences=1)
    assert corpus.summary()["layout"] == "pack" and len(corpus) == 2
    first = byte_ids(PAIRS[0]["prompt"] + PAIRS[0]["completion"]) + [EOS]
    second = byte_ids(PAIRS[1]["prompt"] + PAIRS[1]["completion"]) + [EOS]
    third = byte_ids(PAIRS[2]["prompt"] + PAIRS[2]["completion"]) + [EOS]
    assert corpus.tokens[0].tolist() == first + second + [PAD]
    assert corpus.tokens[1].tolist() == third + [PAD] * (31 - len(third))
    _, labels = corpus.batch([0])
    counted = [int(t) for t in labels[0].tolist() if t != IGNORE_INDEX]
    assert counted == byte_ids("tac") + [EOS] + byte_ids("5") + [EOS]
    # The counted mask sits on the tokens the labels take: the completions and eos.
    assert (corpus.labels == np.where(corpus.counted[:, 1:], corpus.tokens[:, 1:], -100)).all()


@pytest.mark.parametrize(
    ("prompt", "completion", "row_len", "kept_prompt", "kept_completion", "cut"),
    [
        (5, 3, 8, 5, 3, (False, False)),  # fits exactly
        (5, 3, 6, 3, 3, (True, False)),  # the prompt loses its first two tokens
        (5, 9, 6, 1, 5, (True, True)),  # the completion alone is too long: one prompt token
        (1, 1, 2, 1, 1, (False, False)),
    ],
)
def test_truncation_cuts_the_prompt_start_first(
    prompt, completion, row_len, kept_prompt, kept_completion, cut
) -> None:
    example = Example(tuple(range(prompt)), tuple(range(100, 100 + completion)))
    fitted = fit(example, row_len)
    assert (fitted.truncated, fitted.completion_cut) == cut
    assert fitted.example.prompt == example.prompt[prompt - kept_prompt :]
    assert fitted.example.completion == example.completion[:kept_completion]
    assert len(fitted.example) <= row_len


@pytest.mark.parametrize("layout", ["pack", "pad"])
def test_long_records_are_truncated_and_counted_never_dropped(tmp_path: Path, layout) -> None:
    records = [
        *PAIRS,
        {"prompt": "A long question about many things?\n", "completion": "ok"},
        {"prompt": "Q\n", "completion": "an answer far longer than the row"},
    ]
    path = write_jsonl(tmp_path / "long.jsonl", records)
    corpus = load_corpus(path, None, 15, min_sequences=1, instruction_layout=layout)
    assert isinstance(corpus, InstructionCorpus)
    stats = corpus.summary()
    assert stats["records"] == 5
    assert (stats["truncated_records"], stats["completion_truncated_records"]) == (4, 1)
    # Every record kept its counted tokens: the first tokens of each completion survive.
    counted = corpus.tokens[:, 1:][corpus.counted[:, 1:]].tolist()
    assert bytes(t for t in counted if t < 256).startswith(b"tac5coldokan answer far")
    # No row (so no micro-batch) without a counted label: the loss never divides by zero.
    assert (corpus.labels != IGNORE_INDEX).any(axis=1).all()
    (note,) = corpus.notes()
    assert "4 of 5 instruction records" in note and "--seq-len 15" in note
    assert "1 also lost the end of the completion" in note and "\n" not in note


def test_prompt_tokens_contribute_nothing_to_the_loss(tmp_path: Path) -> None:
    """The acceptance: changing a prompt token's label leaves the loss bitwise unchanged,
    changing a completion token's label changes it."""
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    corpus = load_corpus(path, None, 30, min_sequences=1, instruction_layout="pad")
    assert isinstance(corpus, InstructionCorpus)
    hf_config = models.load_hf_config("gpt2-tiny", NO_DROPOUT)
    model = models.reference_model(hf_config, seed=3)
    rows = [0, 1, 2]
    input_ids, labels = corpus.batch(rows)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    loss = models.causal_lm_loss(logits, labels)
    counted = labels != IGNORE_INDEX
    # The mean over counted tokens only, as Hugging Face computes it.
    per_token = torch.nn.functional.cross_entropy(
        logits[counted].reshape(-1, logits.shape[-1]), labels[counted], reduction="sum"
    )
    assert torch.allclose(loss, per_token / counted.sum())

    def loss_with_token(row: int, position: int, value: int) -> torch.Tensor:
        """The loss on the same inputs when token ``position`` of ``row`` (the label of
        position - 1) is ``value``."""
        tokens = corpus.tokens.copy()
        tokens[row, position] = value
        changed = InstructionCorpus(tokens, corpus.counted, corpus.stats)
        return models.causal_lm_loss(logits, changed.batch(rows)[1])

    prompt_position = 4  # a prompt token of row 1 ("Add: 2 + 3\n"), the label of position 3
    assert not corpus.counted[1, prompt_position]
    assert torch.equal(loss_with_token(1, prompt_position, 7), loss)
    completion_position = int(np.flatnonzero(corpus.counted[1])[0])
    assert not torch.equal(loss_with_token(1, completion_position, 7), loss)
    # Without the mask the same prompt change would have moved the loss.
    plain = data.PackedCorpus(corpus.tokens)
    tokens = corpus.tokens.copy()
    tokens[1, prompt_position] = 7
    assert not torch.equal(
        models.causal_lm_loss(logits, plain.batch(rows)[1]),
        models.causal_lm_loss(logits, data.PackedCorpus(tokens).batch(rows)[1]),
    )


def test_chat_messages_count_the_final_assistant_turn(tmp_path: Path) -> None:
    tokenizer_dir = chat_tokenizer(tmp_path / "tok")
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    corpus = load_corpus(path, tokenizer_dir, 63, min_sequences=1)
    assert isinstance(corpus, InstructionCorpus) and corpus.summary()["format"] == "messages"
    prompt = "<|user|>hi\n<|assistant|>hello\n<|user|>2+2?\n<|assistant|>"
    completion = byte_ids("4\n") + [EOS]
    length = len(byte_ids(prompt)) + len(completion)
    assert corpus.tokens[0, :length].tolist() == byte_ids(prompt) + completion
    _, labels = corpus.batch([0])
    # Only the last reply (and what the template closes it with, and eos) counts; the
    # earlier assistant turn is context.
    assert [t for t in labels[0].tolist() if t != IGNORE_INDEX] == completion


def test_chat_template_whose_prompt_is_not_a_prefix_is_refused(tmp_path: Path) -> None:
    template = CHAT_TEMPLATE.replace("<|assistant|>{% endif %}", "ASSISTANT:{% endif %}")
    tokenizer_dir = chat_tokenizer(tmp_path / "tok", template)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    with pytest.raises(UserError, match=r"chat\.jsonl' line 1: .*does not start with") as caught:
        load_corpus(path, tokenizer_dir, 32, min_sequences=1)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("records", "needles"),
    [
        (
            [PAIRS[0], {"prompt": "Add: 1 + 1\n"}],
            ["bad.jsonl' line 2", "'prompt' but no 'completion'"],
        ),
        ([{"completion": "x"}], ["line 1", "'completion' but no 'prompt'"]),
        ([PAIRS[0], {"text": "a document"}], ["records mix formats", "line 2 is text"]),
        (
            [{"text": "doc", "prompt": "p", "completion": "c"}],
            ["line 1 has fields of several formats", "'completion', 'prompt', 'text'"],
        ),
        ([{"prompt": "Q\n", "completion": ""}], ["line 1 has an empty completion"]),
        ([{"prompt": "", "completion": "A"}], ["line 1 has an empty prompt"]),
        ([{"prompt": "Q\n", "completion": 5}], ["line 1: 'completion' is 5; expected a string"]),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}],
            ["line 1: 'messages' must list at least two"],
        ),
        (
            [
                {
                    "messages": [
                        {"role": "assistant", "content": "a"},
                        {"role": "user", "content": "b"},
                    ]
                }
            ],
            ["line 1: the last message's role is 'user'"],
        ),
    ],
    ids=[
        "no-completion",
        "no-prompt",
        "mixed-records",
        "mixed-fields",
        "empty-completion",
        "empty-prompt",
        "not-a-string",
        "one-message",
        "last-not-assistant",
    ],
)
def test_bad_instruction_records_are_one_line(tmp_path: Path, records, needles) -> None:
    tokenizer_dir = chat_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(UserError) as caught:
        load_corpus(path, tokenizer_dir, 32, min_sequences=1)
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_records_are_named_by_line_and_by_record(tmp_path: Path) -> None:
    """Blank lines of a JSON Lines file are skipped but counted; a saved dataset's records
    are numbered."""
    path = tmp_path / "gaps.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n\n" + json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(UserError, match=r"gaps\.jsonl' line 3 has a 'prompt'"):
        data.load_records(path)
    # A JSON array, one record a line: numbered, not given the array's lines.
    array = tmp_path / "array.json"
    array.write_text(
        "[" + json.dumps(PAIRS[0]) + ",\n" + json.dumps({"prompt": "p"}) + "]\n", encoding="utf-8"
    )
    with pytest.raises(UserError, match=r"array\.json' record 2 has a 'prompt'"):
        data.load_records(array)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"prompt": ["a", "b"], "completion": ["x", None]}).save_to_disk(
        saved
    )
    with pytest.raises(UserError, match=r"saved dataset .*saved' record 2 has a 'prompt'"):
        data.load_records(saved)
    datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["x"]}).save_to_disk(tmp_path / "ok")
    assert data.load_records(tmp_path / "ok").format == "prompt-completion"


def test_messages_without_a_chat_template_are_refused(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    with pytest.raises(UserError, match="tokenizer 'byte' has no chat template") as caught:
        load_corpus(path, None, 32, min_sequences=1)
    assert "--tokenizer" in str(caught.value)
    with pytest.raises(UserError, match="holds messages records, not documents"):
        data.load_text_dataset(path)


def test_instruction_layout_is_a_strict_config_key() -> None:
    assert FLAG_KEYS["instruction_layout"] == "spotline.data.instruction_layout"
    assert parse_config({}).spotline.data.instruction_layout == "pack"
    cfg = parse_config({"spotline": {"data": {"instruction_layout": "pad"}}})
    assert cfg.spotline.data.instruction_layout == "pad"
    with pytest.raises(UserError, match=r"spotline\.data\.instruction_layout.*\"pack\" or \"pad\""):
        parse_config({"spotline": {"data": {"instruction_layout": "padded"}}})


def test_shipped_file_is_its_generator_s_output_and_fits_64_tokens() -> None:
    assert TINY.read_text(encoding="utf-8") == "".join(tiny_instructions.lines())
    corpus = load_corpus(str(TINY), None, 64, min_sequences=64)
    stats = corpus.summary()
    assert stats["format"] == "prompt-completion" and stats["records"] >= 300
    assert stats["truncated_records"] == 0


def _check_refused(proc, output: Path, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert not output.exists()


def test_cli_refuses_a_record_without_completion_and_a_missing_template(tmp_path: Path) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], {"prompt": "Add: 1 + 1\n"}])
    out = tmp_path / "out"
    proc = run_spotline(["train", "--data", bad, "--output", str(out)])
    _check_refused(proc, out, "bad.jsonl' line 2", "no 'completion'")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    proc = run_spotline(["train", "--data", chats, "--output", str(out)])
    _check_refused(proc, out, "no chat template", "--tokenizer")


@pytest.mark.slow
def test_spotline_train_on_instructions_equals_the_single_process_reference(
    tmp_path: Path,
) -> None:
    """Two stages, the shipped file at --seq-len 20 (some records truncated): the run
    completes, says once how many records it truncated, and its losses and parameter hash
    are those of the single-process reference (another placement of the same logical job;
    one real run instead of two keeps the test short)."""
    config = small_config(model={"name": "gpt2-tiny", "overrides": NO_DROPOUT})
    config["spotline"]["training"]["steps"] = 3
    config["spotline"]["data"] = {"path": str(TINY), "instruction_layout": "pack"}
    config["spotline"]["model"]["seq_len"] = 20
    out = tmp_path / "run"
    proc = run_spotline(
        ["train", "--config", str(write_config(tmp_path / "c.json", config))]
        + ["--workers", "2", "--stages", "2", "--output", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = read_summary(out)
    truncated = summary["data"]["truncated_records"]
    assert summary["data"]["format"] == "prompt-completion" and truncated > 0
    (line,) = [line for line in proc.stderr.splitlines() if "truncated" in line]
    assert line.startswith(f"spotline: {truncated} of 365 instruction records")
    reference = train_reference(
        with_overrides(
            parse_config(config),
            {"spotline.topology.workers": 2, "spotline.topology.stages": 2},
        )
    )
    assert summary["losses"] == reference["losses"]
    assert all(np.isfinite(summary["losses"]))
    assert summary["param_sha256"] == reference["param_sha256"]
