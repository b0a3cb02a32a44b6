"""Training data: text in, fixed-length token sequences out.

The path is ``load_text_dataset`` (a ``datasets.Dataset`` with a ``text`` column) ->
``pack_sequences`` (every document tokenized, an eos after each, all concatenated and cut
into rows of ``seq_len + 1`` tokens) -> ``PackedCorpus`` (rows by index, as input ids and
next-token labels). ``load_corpus`` runs the whole path. Which rows a micro-batch reads is
decided by ``spotline.plan.sampler.GlobalSampler``, never here, so the data a logical worker
sees does not depend on the processes. Everything works offline: the default tokenizer is
built in code and the default corpus ships with the package.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spotline.errors import UserError

if TYPE_CHECKING:
    import datasets
    import torch
    import transformers

DEFAULT_CORPUS: pathlib.Path = pathlib.Path(__file__).resolve().parent / "assets" / "corpus"
"""The English corpus shipped with the package (a few ``.txt`` files, one document a line)."""

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
NUM_BYTE_TOKENS = 256

_TEXT_SUFFIXES = frozenset({".txt"})
_JSON_SUFFIXES = frozenset({".json", ".jsonl"})
# Files `Dataset.save_to_disk` writes next to the arrow shards.
_SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_TOKENIZE_BATCH = 1024


def _byte_to_char() -> list[str]:
    """One printable character per byte value, the mapping byte-level tokenizers use.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, ...) are shifted
    to code points from 256 up. ``tokenizers``' ByteLevel pre-tokenizer and decoder use this
    same table, which is why the vocabulary below must be spelled with it.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars: list[str] = []
    shifted = 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(NUM_BYTE_TOKENS + shifted))
            shifted += 1
    return chars


def byte_level_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A tokenizer whose ids are the UTF-8 bytes of the text, built locally (no download).

    Ids 0-255 are the byte values, ``<|endoftext|>`` is 256 (bos and eos) and ``<|pad|>`` is
    257: 258 ids, within the model presets' vocabulary of 260. ``encode(text)`` equals
    ``list(text.encode("utf-8"))`` and decoding gives the text back.
    """
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in enumerate(_byte_to_char())}
    # A BPE without merges over the byte alphabet: each byte stays its own token.
    model = models.BPE(vocab=vocab, merges=[])
    backend = tokenizers.Tokenizer(model)
    # use_regex=False: no GPT-2 word split, so nothing but the byte mapping happens.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    assert backend.token_to_id(EOS_TOKEN) == NUM_BYTE_TOKENS
    assert backend.token_to_id(PAD_TOKEN) == NUM_BYTE_TOKENS + 1
    # transformers leaves this constructor unannotated.
    return transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1 << 30,
    )


def load_tokenizer(spec: str | None) -> Any:
    """The tokenizer named by ``--tokenizer``: None or ``"byte"`` is ``byte_level_tokenizer()``;
    anything else is a local directory saved by ``save_pretrained`` (never downloaded)."""
    if spec is None or spec == "byte":
        return byte_level_tokenizer()
    path = pathlib.Path(spec).expanduser()
    if not path.is_dir():
        raise UserError(
            f"tokenizer directory {str(path)!r} does not exist; pass a folder written by "
            "save_pretrained, or 'byte' for the built-in byte-level tokenizer"
        )
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a tokenizer from {str(path)!r} ({_reason(exc)}); pass a folder written by "
            "save_pretrained, or 'byte' for the built-in byte-level tokenizer"
        ) from exc


def _reason(exc: BaseException) -> str:
    """The first line of the innermost cause: the builders wrap the useful message."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__  # type: ignore[assignment]
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide the builders' per-call progress bars (noise for small corpora), then restore them."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _is_saved_dataset(path: pathlib.Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _SAVED_DATASET_MARKERS)


def _data_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The text and JSON files to read, in a fixed (sorted) order."""
    if path.is_file():
        if path.suffix not in _TEXT_SUFFIXES | _JSON_SUFFIXES:
            raise UserError(
                f"data file {str(path)!r} is neither .txt nor .json/.jsonl; convert it, or pass "
                "a folder of such files or one written by Dataset.save_to_disk"
            )
        return [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix in _TEXT_SUFFIXES | _JSON_SUFFIXES
        # Skip hidden files and folders (editor swap files, .cache, ...).
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise UserError(
            f"data folder {str(path)!r} holds no .txt, .json or .jsonl file; add some, or pass "
            "a folder written by Dataset.save_to_disk"
        )
    return files


def _load_files(files: list[pathlib.Path], cache_dir: str) -> datasets.Dataset:
    """Load files with the ``datasets`` text/json builders, keeping the given file order."""
    import datasets

    # Consecutive files of one kind go through one builder call; the order stays the sorted one.
    runs: list[tuple[str, list[str]]] = []
    for f in files:
        builder = "text" if f.suffix in _TEXT_SUFFIXES else "json"
        if runs and runs[-1][0] == builder:
            runs[-1][1].append(str(f))
        else:
            runs.append((builder, [str(f)]))
    parts = []
    for builder, data_files in runs:
        try:
            part = datasets.load_dataset(
                builder,
                data_files=data_files,
                split="train",
                cache_dir=cache_dir,
                # In memory, so the temporary cache folder can go once this returns.
                keep_in_memory=True,
            )
        except Exception as exc:  # the builders raise many types for one bad input file
            raise UserError(
                f"cannot read {', '.join(repr(d) for d in data_files)} as {builder} ({_reason(exc)}); "
                "fix the file or pass another --data"
            ) from exc
        if "text" not in part.column_names:
            raise UserError(
                f"records in {', '.join(repr(d) for d in data_files)} have no 'text' field "
                f"(fields: {', '.join(part.column_names) or 'none'}); give each record a 'text' "
                "string"
            )
        parts.append(part.select_columns(["text"]))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _load_saved(path: pathlib.Path) -> datasets.Dataset:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as exc:  # corrupt or foreign folders fail in many ways
        raise UserError(
            f"cannot load the saved dataset {str(path)!r} ({_reason(exc)}); write it again with "
            "Dataset.save_to_disk or pass another --data"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise UserError(
                f"saved dataset {str(path)!r} has splits {sorted(loaded)} and none is 'train'; "
                "save the split to train on by itself"
            )
    if "text" not in loaded.column_names:
        raise UserError(
            f"saved dataset {str(path)!r} has no 'text' column (columns: "
            f"{', '.join(loaded.column_names) or 'none'}); add one holding the documents"
        )
    return loaded.select_columns(["text"])


def load_text_dataset(path: str | os.PathLike[str] | None) -> datasets.Dataset:
    """Documents as a ``datasets.Dataset`` with one ``text`` column, read offline.

    ``path`` is None (the shipped ``DEFAULT_CORPUS``), a ``.txt`` file (one document a
    line), a ``.json``/``.jsonl`` file of records with a ``text`` field, a folder of such
    files (read recursively in sorted path order), or a folder written by
    ``Dataset.save_to_disk``. Empty and whitespace-only documents are dropped; a missing path,
    a corpus with no document or records without ``text`` raise UserError.
    """
    import datasets

    resolved = DEFAULT_CORPUS if path is None else pathlib.Path(path).expanduser()
    if not resolved.exists():
        raise UserError(
            f"data path {str(resolved)!r} does not exist; pass a .txt/.json/.jsonl file, a "
            "folder of them or a Dataset.save_to_disk folder (omit --data for the built-in corpus)"
        )
    if _is_saved_dataset(resolved):
        with _quiet_progress_bars():
            dataset = _load_saved(resolved)
    else:
        files = _data_files(resolved)
        with (
            tempfile.TemporaryDirectory(prefix="spotline-datasets-") as cache_dir,
            _quiet_progress_bars(),
        ):
            dataset = _load_files(files, cache_dir)
    texts = [t for t in dataset["text"] if isinstance(t, str) and t.strip()]
    if not texts:
        raise UserError(
            f"corpus {str(resolved)!r} holds no non-empty document; add text or pass another --data"
        )
    # A plain in-memory table: no reference to a cache folder, order exactly as read.
    return datasets.Dataset.from_dict({"text": texts})


def pack_sequences(dataset: datasets.Dataset, tokenizer: Any, seq_len: int) -> np.ndarray:
    """Token rows of shape ``[num_sequences, seq_len + 1]`` (int64), deterministically.

    Every document is tokenized without special tokens and followed by the tokenizer's eos;
    the token stream is cut into consecutive rows of ``seq_len + 1`` tokens and the tail that
    does not fill a row is dropped. Row ``i`` feeds ``PackedCorpus.batch``: its first
    ``seq_len`` tokens are the inputs, its last ``seq_len`` the labels.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise UserError(f"--seq-len must be a positive integer, got {seq_len!r}")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UserError(
            "the tokenizer has no eos token, which separates documents; save one with "
            "an eos_token or use the built-in 'byte' tokenizer"
        )
    texts = dataset["text"]
    pieces: list[np.ndarray] = []
    for start in range(0, len(texts), _TOKENIZE_BATCH):
        batch = list(texts[start : start + _TOKENIZE_BATCH])
        encoded = tokenizer(batch, add_special_tokens=False)["input_ids"]
        for ids in encoded:
            pieces.append(np.asarray(list(ids) + [eos_id], dtype=np.int64))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    row_len = seq_len + 1
    num_sequences = stream.size // row_len
    return np.ascontiguousarray(stream[: num_sequences * row_len].reshape(num_sequences, row_len))


class PackedCorpus:
    """Packed token rows, read by index: the tensor side of ``GlobalSampler.indices``."""

    def __init__(self, tokens: np.ndarray) -> None:
        if tokens.ndim != 2 or tokens.shape[1] < 2:
            raise ValueError(
                f"packed tokens must be [num_sequences, seq_len + 1], got {tokens.shape}"
            )
        self.tokens: np.ndarray = np.ascontiguousarray(tokens, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Tokens per training sequence (a packed row holds one more, for the labels)."""
        return int(self.tokens.shape[1]) - 1

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` for rows ``indices``: each ``[len(indices), seq_len]``, int64.

        ``labels`` is ``input_ids`` shifted by one token, so the model must not shift again.
        """
        import torch

        rows = [int(i) for i in indices]
        if not rows:
            raise ValueError("a batch needs at least one index")
        for i in rows:
            if not 0 <= i < len(self):
                raise ValueError(f"sample index {i} is out of range for {len(self)} sequences")
        selected = torch.from_numpy(self.tokens[rows])
        return selected[:, :-1].contiguous(), selected[:, 1:].contiguous()


def load_corpus(
    data: str | None, tokenizer_spec: str | None, seq_len: int, *, min_sequences: int
) -> PackedCorpus:
    """Read, tokenize and pack ``data``; fail early when it cannot fill ``min_sequences`` rows.

    ``min_sequences`` is what one training step consumes (the sampler's samples per step).
    """
    dataset = load_text_dataset(data)
    tokenizer = load_tokenizer(tokenizer_spec)
    corpus = PackedCorpus(pack_sequences(dataset, tokenizer, seq_len))
    if len(corpus) < min_sequences:
        name = str(DEFAULT_CORPUS) if data is None else data
        raise UserError(
            f"corpus {name!r} packs to {len(corpus)} sequences of {seq_len} tokens, fewer than "
            f"the {min_sequences} one training step needs; use a larger corpus or a smaller "
            "--seq-len/batch"
        )
    return corpus
