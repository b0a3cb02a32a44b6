"""A checkpoint's manifest and step directories: the half of :mod:`spotline.checkpointing.checkpoint` that
reads and writes no tensor, so that the coordinator commits, finds and times checkpoints
without importing torch (checked by ``tests/test_purity.py``).

Layout, protocol and pruning rule: :mod:`spotline.checkpointing.checkpoint`'s docstring. Here: where a
step's files go (:func:`step_dir`), the manifest's commit (:func:`commit_manifest`, which
writes ``MANIFEST.json`` once every expected sidecar is there, then prunes), reading it back
(:func:`read_metadata`, :func:`verify_checkpoint`, :func:`latest_complete`) and the Young/Daly
interval (:func:`interval_steps`). :mod:`spotline.checkpointing.checkpoint` re-exports every public name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from spotline.atomic_files import write_bytes_atomic

# The checkpoints' one logger, whichever half logs: what users filter on is spotline.checkpointing.checkpoint.
log = logging.getLogger("spotline.checkpointing.checkpoint")
# The skipped checkpoints already told (path, problems): a run looks for its newest
# checkpoint more than once (a --resume before it starts, each fallback), and one partial
# checkpoint is one line, not one a look-up.
_told_skipped: set[tuple[str, str]] = set()

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
_STEP_DIR_RE = re.compile(r"^step-([0-9]{8,})$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
_HASH_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


def step_dir(root: Path, step: int) -> Path:
    """The directory of ``step``'s checkpoint: ``root/step-{step:08d}``."""
    return Path(root) / f"step-{step:08d}"


def check_label(rank_label: str) -> None:
    """Refuse a rank label that is not a plain file name (it names ``{label}.pt``)."""
    if not _LABEL_RE.match(rank_label) or rank_label.upper() == "MANIFEST":
        raise ValueError(
            f"rank label {rank_label!r} must be a plain file name (letters, digits, '_', '-', "
            "'.'; not starting with '.'; not 'MANIFEST'), e.g. 'rank0' or 's1'"
        )


def check_step(step: int) -> None:
    """Refuse a step that is not an integer >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")


def sha256_file(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s directory entries: a rename is durable only once they are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` atomically (temp file, fsync, rename), then fsync the directory."""
    write_bytes_atomic(path, data)
    fsync_dir(path.parent)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-*`` directory under ``root``, oldest step first."""
    if not Path(root).is_dir():
        return []
    found = []
    for entry in Path(root).iterdir():
        match = _STEP_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def commit_manifest(
    root: Path,
    step: int,
    expected_labels: Collection[str],
    *,
    keep: int,
    metadata: dict[str, Any] | None = None,
) -> bool:
    """Write ``step``'s MANIFEST.json if every expected rank's file is in place, then prune
    to the newest ``keep`` complete checkpoints.

    Returns False (and writes nothing) when some expected label has no sidecar yet; True
    once the manifest is written (or was already there). Call it in one designated process
    only, after every rank's writes are done. ``metadata`` (JSON) is kept in the manifest,
    read back by :func:`read_metadata`.
    """
    check_step(step)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
    labels = sorted(set(expected_labels))
    if not labels:
        raise ValueError("commit needs at least one expected rank label")
    for label in labels:
        check_label(label)
    directory = step_dir(root, step)
    if (directory / MANIFEST).exists():
        return True
    files: dict[str, dict[str, Any]] = {}
    for label in labels:
        meta_path = directory / f"{label}.meta.json"
        if not meta_path.exists():
            return False
        meta = json.loads(meta_path.read_text())
        data_path = directory / meta["file"]
        # A size check is cheap; the full hash is verified by readers.
        if not data_path.exists() or data_path.stat().st_size != meta["size"]:
            raise CheckpointError(
                f"{data_path}: size differs from its sidecar {meta_path.name}; "
                "the file was changed after it was written"
            )
        files[label] = {"file": meta["file"], "size": meta["size"], "sha256": meta["sha256"]}
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "time": time.time(),
        "files": files,
        "metadata": metadata or {},
    }
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    _prune(root, keep)
    return True


def _prune(root: Path, keep: int) -> None:
    dirs = step_dirs(root)
    complete = [(step, path) for step, path in dirs if (path / MANIFEST).exists()]
    if not complete:
        return
    newest_complete = complete[-1][0]
    kept = {step for step, _ in complete[-keep:]}
    for step, path in dirs:
        is_complete = (path / MANIFEST).exists()
        if (is_complete and step not in kept) or (not is_complete and step < newest_complete):
            # Remove the manifest first: a crash mid-delete leaves an incomplete
            # directory, never a "complete" one with files missing.
            (path / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)


def read_manifest(root: Path, step: int) -> dict[str, Any]:
    """``step``'s manifest; :class:`CheckpointError` if it is missing or not one."""
    path = step_dir(root, step) / MANIFEST
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint step {step} under {root} has no {MANIFEST}: it is incomplete"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable manifest: {error}") from None
    if manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: manifest is not a manifest of step {step}")
    return manifest


def read_metadata(root: Path, step: int) -> dict[str, Any]:
    """The ``metadata`` committed with ``step``'s manifest (empty if none was given)."""
    metadata: dict[str, Any] = read_manifest(root, step).get("metadata", {})
    return metadata


def verify_checkpoint(root: Path, step: int) -> list[str]:
    """What is wrong with ``step``'s checkpoint: an empty list when its manifest exists and
    every listed file has the recorded size and SHA-256."""
    try:
        manifest = read_manifest(root, step)
    except CheckpointError as error:
        return [str(error)]
    problems = []
    directory = step_dir(root, step)
    for label, entry in sorted(manifest["files"].items()):
        path = directory / entry["file"]
        if not path.exists():
            problems.append(f"{path}: missing (rank {label})")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {entry['size']}")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest")
    return problems


def latest_complete(root: Path) -> int | None:
    """The newest step under ``root`` whose manifest exists and whose files verify; None if
    there is none. Partial (no manifest) and corrupt checkpoints are skipped, each with a
    warning on the ``spotline.checkpointing.checkpoint`` logger (once a process)."""
    for step, path in reversed(step_dirs(root)):
        problems = verify_checkpoint(root, step)
        if not problems:
            return step
        told = (str(path), "; ".join(problems))
        if told not in _told_skipped:
            _told_skipped.add(told)
            log.warning("skipping checkpoint %s: %s", *told)
    return None
