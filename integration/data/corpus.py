"""Training data: records in, fixed-length token sequences out.

``load_records`` reads ``--data`` and tells its format from the records' fields: ``text``
(documents), ``prompt``/``completion`` or ``messages`` (instruction data; one format for
all records). The text path is ``load_text_dataset`` (a ``datasets.Dataset`` with a
``text`` column) -> ``pack_sequences`` (every document tokenized, an eos after each, all
concatenated and cut into rows of ``seq_len + 1`` tokens) -> ``PackedCorpus`` (rows by
index, as input ids and next-token labels). Instruction records go to
``spotline.data.instructions`` (the loss on completion tokens only). ``spotline.data.loader.load_corpus`` runs the
whole path. Which rows a micro-batch reads is decided by
``spotline.plan.sampler.GlobalSampler``, never here, so the data a logical worker sees does
not depend on the processes. Everything works offline: the default tokenizer is built in
code and the default corpus ships with the package.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from spotline.errors import UserError

if TYPE_CHECKING:
    import datasets
    import torch
    import transformers

DEFAULT_CORPUS: pathlib.Path = pathlib.Path(__file__).resolve().parents[1] / "assets" / "corpus"
"""The English corpus shipped with the package (a few ``.txt`` files, one document a line)."""

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
NUM_BYTE_TOKENS = 256

_TEXT_SUFFIXES = frozenset({".txt"})
_JSON_SUFFIXES = frozenset({".json", ".jsonl"})
# Files `Dataset.save_to_disk` writes next to the arrow shards.
_SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TOKENIZE_BATCH = 1024


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
            f"cannot load a tokenizer from {str(path)!r} ({error_reason(exc)}); pass a folder written by "
            "save_pretrained, or 'byte' for the built-in byte-level tokenizer"
        ) from exc


def error_reason(exc: BaseException) -> str:
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


RecordFormat = Literal["text", "prompt-completion", "messages"]
"""What the records hold: documents (``text``), ``prompt``/``completion`` pairs, or chat
``messages``; decided from the records' fields."""

# The fields that decide a record's format, by format.
_FORMAT_FIELDS: dict[RecordFormat, tuple[str, ...]] = {
    "text": ("text",),
    "prompt-completion": ("prompt", "completion"),
    "messages": ("messages",),
}
_KNOWN_FIELDS = frozenset(f for fields in _FORMAT_FIELDS.values() for f in fields)
_FORMAT_HINT = (
    "give each record a 'text' string, or 'prompt' and 'completion' strings, or a 'messages' list"
)


@dataclass(frozen=True)
class RecordSource:
    """Where records ``start .. start + count - 1`` of a :class:`Records` came from."""

    name: str
    start: int
    count: int
    # The JSON file read, for line numbers in messages (text runs and saved datasets have
    # none: their records are named by number).
    json_file: pathlib.Path | None

    def where(self, offset: int) -> str:
        """The record ``offset`` of this source, as a user finds it: a line of a JSON Lines
        file, else its 1-based number."""
        assert 0 <= offset < self.count
        if self.json_file is not None:
            text = self.json_file.read_text(encoding="utf-8")
            lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
            # The builder skips blank lines: one object a line is JSON Lines, a record a line.
            # Anything else (a JSON array) has no line per record.
            if len(lines) == self.count and all(line.lstrip().startswith("{") for _, line in lines):
                return f"{self.name} line {lines[offset][0]}"
        return f"{self.name} record {offset + 1}"


@dataclass(frozen=True)
class Records:
    """The records of ``--data``, all of one format, in the order they were read.

    ``columns`` holds the format's fields (``_FORMAT_FIELDS``), one value per record (None
    where a record lacks the field: text records without text are dropped later).
    """

    format: RecordFormat
    columns: dict[str, list[Any]]
    sources: tuple[RecordSource, ...]

    def __len__(self) -> int:
        return sum(s.count for s in self.sources)

    def where(self, index: int) -> str:
        """Record ``index`` named by its file and line (or record number)."""
        for source in self.sources:
            if source.start <= index < source.start + source.count:
                return source.where(index - source.start)
        raise AssertionError(f"record {index} is outside the {len(self)} records read")


@dataclass(frozen=True)
class _Part:
    """What one source holds before its format is known: every known field it has."""

    name: str
    columns: dict[str, list[Any]]
    count: int
    json_file: pathlib.Path | None


def _part_of(name: str, dataset: datasets.Dataset, json_file: pathlib.Path | None) -> _Part:
    fields = [c for c in dataset.column_names if c in _KNOWN_FIELDS]
    if not fields:
        raise UserError(
            f"records in {name} have no 'text' field (nor 'prompt'/'completion' or "
            f"'messages'; fields: {', '.join(dataset.column_names) or 'none'}); {_FORMAT_HINT}"
        )
    columns = {f: list(dataset[f]) for f in fields}
    return _Part(name=name, columns=columns, count=len(dataset), json_file=json_file)


def _load_files(files: list[pathlib.Path], cache_dir: str) -> list[_Part]:
    """Load files with the ``datasets`` text/json builders, keeping the given file order.

    Consecutive ``.txt`` files go through one builder call; each JSON file is read by itself
    so that a record's file (and line) can be named.
    """
    import datasets

    runs: list[tuple[str, list[pathlib.Path]]] = []
    for f in files:
        builder = "text" if f.suffix in _TEXT_SUFFIXES else "json"
        if runs and runs[-1][0] == builder == "text":
            runs[-1][1].append(f)
        else:
            runs.append((builder, [f]))
    parts = []
    for builder, paths in runs:
        name = ", ".join(repr(str(p)) for p in paths)
        try:
            part = datasets.load_dataset(
                builder,
                data_files=[str(p) for p in paths],
                split="train",
                cache_dir=cache_dir,
                # In memory, so the temporary cache folder can go once this returns.
                keep_in_memory=True,
            )
        except Exception as exc:  # the builders raise many types for one bad input file
            raise UserError(
                f"cannot read {name} as {builder} ({error_reason(exc)}); fix the file or pass "
                "another --data"
            ) from exc
        parts.append(_part_of(name, part, paths[0] if builder == "json" else None))
    return parts


def _load_saved(path: pathlib.Path) -> _Part:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as exc:  # corrupt or foreign folders fail in many ways
        raise UserError(
            f"cannot load the saved dataset {str(path)!r} ({error_reason(exc)}); write it again with "
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
    return _part_of(f"saved dataset {str(path)!r}", loaded, None)


def _record_format(part: _Part, offset: int) -> RecordFormat:
    """The format of record ``offset`` of ``part``, from the known fields it sets."""
    present = {f for f, values in part.columns.items() if values[offset] is not None}
    formats = [fmt for fmt, fields in _FORMAT_FIELDS.items() if present & set(fields)]
    source = RecordSource(part.name, 0, part.count, part.json_file)
    if not formats:
        raise UserError(
            f"{source.where(offset)} has none of the fields 'text', 'prompt'/'completion' and "
            f"'messages'; {_FORMAT_HINT}"
        )
    if len(formats) > 1:
        found = ", ".join(repr(f) for f in sorted(present))
        raise UserError(
            f"{source.where(offset)} has fields of several formats ({found}); {_FORMAT_HINT}"
        )
    fmt = formats[0]
    if fmt == "prompt-completion" and present != {"prompt", "completion"}:
        (has,) = present
        (lacks,) = {"prompt", "completion"} - present
        raise UserError(
            f"{source.where(offset)} has a {has!r} but no {lacks!r}; give every instruction "
            "record both strings (the loss counts the completion's tokens)"
        )
    return fmt


def _part_format(part: _Part) -> RecordFormat:
    """The format of every record of ``part``; raises UserError on a record of another
    format or with half a prompt/completion pair."""
    if set(part.columns) == {"text"}:
        # Plain documents, as ever: a record without text is an empty document.
        return "text"
    first = _record_format(part, 0) if part.count else "text"
    for offset in range(1, part.count):
        fmt = _record_format(part, offset)
        if fmt != first:
            where = RecordSource(part.name, 0, part.count, part.json_file).where
            raise UserError(
                f"records mix formats: {where(0)} is {first}, {where(offset)} is {fmt}; "
                "use one format for all of --data"
            )
    return first


def _records(parts: list[_Part]) -> Records:
    """One format over all parts, its fields concatenated in order."""
    formats: list[RecordFormat] = []
    sources: list[RecordSource] = []
    start = 0
    for part in parts:
        fmt = _part_format(part)
        source = RecordSource(part.name, start, part.count, part.json_file)
        if formats and fmt != formats[0] and part.count:
            raise UserError(
                f"records mix formats: {sources[0].where(0)} is {formats[0]}, "
                f"{source.where(0)} is {fmt}; use one format for all of --data"
            )
        if part.count:
            formats.append(fmt)
            sources.append(source)
            start += part.count
    fmt = formats[0] if formats else "text"
    columns: dict[str, list[Any]] = {field: [] for field in _FORMAT_FIELDS[fmt]}
    for part in parts:
        for field, values in columns.items():
            values.extend(part.columns.get(field, [None] * part.count))
    return Records(format=fmt, columns=columns, sources=tuple(sources))


def load_records(path: str | os.PathLike[str] | None) -> Records:
    """The records of ``--data``, read offline, with their format.

    ``path`` is None (the shipped ``DEFAULT_CORPUS``), a ``.txt`` file (one document a
    line), a ``.json``/``.jsonl`` file of records, a folder of such files (read recursively
    in sorted path order), or a folder written by ``Dataset.save_to_disk``. Records hold
    ``text`` (documents), ``prompt`` and ``completion`` strings, or ``messages`` (a chat);
    one format for all of them. A missing path, records of none or of several formats, or a
    prompt without its completion raise UserError naming the file and line.
    """
    resolved = DEFAULT_CORPUS if path is None else pathlib.Path(path).expanduser()
    if not resolved.exists():
        raise UserError(
            f"data path {str(resolved)!r} does not exist; pass a .txt/.json/.jsonl file, a "
            "folder of them or a Dataset.save_to_disk folder (omit --data for the built-in corpus)"
        )
    if _is_saved_dataset(resolved):
        with _quiet_progress_bars():
            parts = [_load_saved(resolved)]
    else:
        files = _data_files(resolved)
        with (
            tempfile.TemporaryDirectory(prefix="spotline-datasets-") as cache_dir,
            _quiet_progress_bars(),
        ):
            parts = _load_files(files, cache_dir)
    return _records(parts)


def data_name(path: str | os.PathLike[str] | None) -> str:
    return str(DEFAULT_CORPUS if path is None else pathlib.Path(path).expanduser())


def text_dataset(records: Records, name: str) -> datasets.Dataset:
    """The documents of text ``records``: empty and whitespace-only ones dropped."""
    import datasets

    assert records.format == "text"
    texts = [t for t in records.columns["text"] if isinstance(t, str) and t.strip()]
    if not texts:
        raise UserError(
            f"corpus {name!r} holds no non-empty document; add text or pass another --data"
        )
    # A plain in-memory table: no reference to a cache folder, order exactly as read.
    return datasets.Dataset.from_dict({"text": texts})


def load_text_dataset(path: str | os.PathLike[str] | None) -> datasets.Dataset:
    """Documents as a ``datasets.Dataset`` with one ``text`` column, read offline.

    ``path`` as :func:`load_records` takes it, holding ``text`` records. Empty and
    whitespace-only documents are dropped; a missing path, a corpus with no document or
    records without ``text`` raise UserError.
    """
    records = load_records(path)
    if records.format != "text":
        raise UserError(
            f"corpus {data_name(path)!r} holds {records.format} records, not documents; "
            "pass a corpus of 'text' records"
        )
    return text_dataset(records, data_name(path))


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
    for start in range(0, len(texts), TOKENIZE_BATCH):
        batch = list(texts[start : start + TOKENIZE_BATCH])
        encoded = tokenizer(batch, add_special_tokens=False)["input_ids"]
        for ids in encoded:
            pieces.append(np.asarray(list(ids) + [eos_id], dtype=np.int64))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    row_len = seq_len + 1
    num_sequences = stream.size // row_len
    return np.ascontiguousarray(stream[: num_sequences * row_len].reshape(num_sequences, row_len))


class PackedCorpus:
    """Packed token rows, read by index: the tensor side of ``GlobalSampler.indices``.

    Every label counts: the plain-text path. :class:`spotline.data.instructions.InstructionCorpus`
    adds a mask of the tokens the loss counts.
    """

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

    def summary(self) -> dict[str, Any]:
        """What the run trained on, for ``summary.json``'s ``data``."""
        return {"format": "text", "rows": len(self)}

    def notes(self) -> list[str]:
        """What a run says once about its data before it trains (nothing, for text)."""
        return []

    def select(self, rows: Sequence[int]) -> PackedCorpus:
        """Rows ``rows`` of this corpus, in that order, as a corpus of their own (a split:
        the rows trained on, or the rows held out for evaluation)."""
        return PackedCorpus(self.tokens[self._rows(rows)])

    def _rows(self, indices: Sequence[int]) -> list[int]:
        rows = [int(i) for i in indices]
        if not rows:
            raise ValueError("a batch needs at least one index")
        for i in rows:
            if not 0 <= i < len(self):
                raise ValueError(f"sample index {i} is out of range for {len(self)} sequences")
        return rows

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` for rows ``indices``: each ``[len(indices), seq_len]``, int64.

        ``labels`` is ``input_ids`` shifted by one token, so the model must not shift again.
        """
        import torch

        selected = torch.from_numpy(self.tokens[self._rows(indices)])
        return selected[:, :-1].contiguous(), selected[:, 1:].contiguous()


# A file of token rows a Hugging Face script tokenized itself (written by spotline.hf).
ROWS_SUFFIX = ".rows.npz"
IGNORE_LABEL = -100


class RowsCorpus(PackedCorpus):
    """Rows given as Hugging Face gives them (``input_ids`` and ``labels`` of one length,
    labels not shifted, -100 where nothing is learned), read through the same
    ``batch(indices)``: the inputs as they are and the labels shifted by one (the last
    position learns nothing), so that the mean over counted tokens is the loss a
    transformers causal LM computes from the same row."""

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray) -> None:
        if input_ids.ndim != 2 or input_ids.shape != labels.shape or input_ids.shape[1] < 2:
            raise ValueError(
                f"rows must be input_ids and labels of one shape [rows, length >= 2], got "
                f"{input_ids.shape} and {labels.shape}"
            )
        # PackedCorpus's rows hold one token more than a sequence; that last one is never
        # read here (the labels below are this corpus's own).
        super().__init__(np.concatenate([input_ids, input_ids[:, -1:]], axis=1))
        shifted = np.full(labels.shape, IGNORE_LABEL, dtype=np.int64)
        shifted[:, :-1] = labels[:, 1:]
        self.labels: np.ndarray = np.ascontiguousarray(shifted)

    def summary(self) -> dict[str, Any]:
        return {
            "format": "rows",
            "rows": len(self),
            "counted_tokens": int((self.labels != IGNORE_LABEL).sum()),
        }

    def select(self, rows: Sequence[int]) -> RowsCorpus:
        picked = self._rows(rows)
        unshifted = np.full(self.labels.shape, IGNORE_LABEL, dtype=np.int64)[picked]
        unshifted[:, 1:] = self.labels[picked, :-1]
        return RowsCorpus(self.tokens[picked, :-1], unshifted)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        rows = self._rows(indices)
        return (
            torch.from_numpy(self.tokens[rows, :-1]).contiguous(),
            torch.from_numpy(self.labels[rows]).contiguous(),
        )


def save_rows(path: pathlib.Path, input_ids: np.ndarray, labels: np.ndarray) -> None:
    """Write rows for :func:`load_rows` (``path`` ends with :data:`ROWS_SUFFIX`)."""
    assert str(path).endswith(ROWS_SUFFIX)
    with open(path, "wb") as handle:
        np.savez(handle, input_ids=input_ids.astype(np.int64), labels=labels.astype(np.int64))


def load_rows(path: str | os.PathLike[str], seq_len: int) -> RowsCorpus:
    """Rows written by :func:`save_rows`; each must be ``seq_len`` tokens long."""
    if not pathlib.Path(path).is_file():
        raise UserError(f"rows file {str(path)!r} does not exist")
    with np.load(path) as saved:
        input_ids, labels = saved["input_ids"], saved["labels"]
    if input_ids.shape[1] != seq_len:
        raise UserError(
            f"rows file {str(path)!r} holds rows of {input_ids.shape[1]} tokens, not --seq-len "
            f"{seq_len}"
        )
    return RowsCorpus(input_ids, labels)
