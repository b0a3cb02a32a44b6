"""The data path: byte tokenizer, the four input forms, packing, PackedCorpus, user errors."""

import json

import datasets
import numpy as np
import pytest
import torch

from spotline.data import corpus as data
from spotline.data.loader import load_corpus
from spotline.errors import UserError

EOS = 256
DOCS = ["The first document.", "Second: naïve café, 日本語 🙂", "third"]


@pytest.fixture(scope="module")
def tokenizer():
    return data.byte_level_tokenizer()


@pytest.mark.parametrize(
    "text", ["Hello, world!\n\tTabs  and  spaces ", "naïve café — 日本語 🙂", "<|pad", ""]
)
def test_byte_tokenizer_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials(tokenizer) -> None:
    assert len(tokenizer) == 258
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == EOS
    assert tokenizer.pad_token_id == 257
    # The plain call adds nothing: packing appends the eos itself.
    assert tokenizer("ab")["input_ids"] == [97, 98]
    assert tokenizer.decode([104, 105, EOS], skip_special_tokens=True) == "hi"


def test_load_tokenizer(tmp_path, tokenizer) -> None:
    assert data.load_tokenizer(None).eos_token_id == EOS
    assert data.load_tokenizer("byte").eos_token_id == EOS
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = data.load_tokenizer(str(tmp_path / "tok"))
    assert loaded.encode("é", add_special_tokens=False) == [0xC3, 0xA9]
    with pytest.raises(UserError, match="tokenizer directory .*missing"):
        data.load_tokenizer(str(tmp_path / "missing"))


def test_load_txt_file(tmp_path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(DOCS[:2]) + "\n\n   \n" + DOCS[2] + "\n", encoding="utf-8")
    assert list(data.load_text_dataset(path)["text"]) == DOCS


def test_load_jsonl_file(tmp_path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)),
        encoding="utf-8",
    )
    dataset = data.load_text_dataset(str(path))
    assert dataset.column_names == ["text"]
    assert list(dataset["text"]) == DOCS


def test_load_directory_in_sorted_order(tmp_path) -> None:
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": DOCS[1]}) + "\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text(DOCS[0] + "\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text(DOCS[2] + "\n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored\n", encoding="utf-8")
    assert list(data.load_text_dataset(tmp_path)["text"]) == DOCS


def test_load_saved_dataset(tmp_path) -> None:
    datasets.Dataset.from_dict({"text": DOCS, "n": [1, 2, 3]}).save_to_disk(tmp_path / "saved")
    assert list(data.load_text_dataset(tmp_path / "saved")["text"]) == DOCS


def test_load_errors(tmp_path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        data.load_text_dataset(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n  \n", encoding="utf-8")
    with pytest.raises(UserError, match="no non-empty document"):
        data.load_text_dataset(tmp_path / "empty.txt")
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="no 'text' field"):
        data.load_text_dataset(tmp_path / "other.jsonl")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match="cannot read"):
        data.load_text_dataset(tmp_path / "bad.json")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="holds no .txt"):
        data.load_text_dataset(tmp_path / "empty_dir")
    with pytest.raises(UserError) as caught:
        data.load_text_dataset(tmp_path / "nope.txt")
    assert "\n" not in str(caught.value)  # one line, as entry points print it


def test_pack_sequences(tokenizer) -> None:
    dataset = datasets.Dataset.from_dict({"text": DOCS})
    stream = []
    for text in DOCS:
        stream += list(text.encode("utf-8")) + [EOS]
    packed = data.pack_sequences(dataset, tokenizer, seq_len=7)
    assert packed.dtype == np.int64
    assert packed.shape == (len(stream) // 8, 8)
    assert packed[0].tolist() == stream[:8]
    assert packed.reshape(-1).tolist() == stream[: packed.size]
    # The first eos sits right after the first document.
    first_eos = len(DOCS[0].encode("utf-8"))
    assert packed.reshape(-1)[first_eos] == EOS
    assert np.array_equal(packed, data.pack_sequences(dataset, tokenizer, seq_len=7))


def test_packed_corpus_batch() -> None:
    tokens = np.arange(5 * 9, dtype=np.int64).reshape(5, 9)
    corpus = data.PackedCorpus(tokens)
    assert len(corpus) == 5 and corpus.seq_len == 8
    input_ids, labels = corpus.batch([3, 0])
    assert input_ids.dtype == labels.dtype == torch.int64
    assert input_ids.is_contiguous() and labels.is_contiguous()
    assert torch.equal(input_ids, torch.tensor(tokens[[3, 0], :-1]))
    assert torch.equal(labels, torch.tensor(tokens[[3, 0], 1:]))
    with pytest.raises(ValueError):
        corpus.batch([5])


def test_load_corpus_too_small(tmp_path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"packs to 0 sequences of 32 tokens, fewer than the 64"):
        load_corpus(str(path), None, 32, min_sequences=64)
    corpus = load_corpus(str(path), "byte", 4, min_sequences=3)
    assert len(corpus) == 3  # 16 bytes + eos = 17 tokens -> three rows of 5


def test_default_corpus_is_large_enough() -> None:
    assert data.DEFAULT_CORPUS.is_dir()
    corpus = load_corpus(None, None, 32, min_sequences=3000)
    assert len(corpus) >= 3000
    assert int(corpus.tokens.max()) < 260  # the model presets' vocabulary
    # Packing is deterministic: a second load gives the same bits.
    again = load_corpus(None, "byte", 32, min_sequences=1)
    assert np.array_equal(corpus.tokens, again.tokens)
