"""Periodic, atomic, checksummed checkpoints: the fallback for fatal losses only.

Spotline survives ordinary preemptions from in-memory replicas; a checkpoint is read only
after a fatal loss (a stage's owner and its replica holder both gone). So writing must cost
training as little as possible, and reading must never trust a half-written file.

Layout under ``root``::

    step-00000120/
        s0.pt              one file per rank label (e.g. a stage or rank name), torch.save
        s0.meta.json       its size and SHA-256, written after s0.pt is in place
        ...
        MANIFEST.json      every file's name, size and SHA-256, the step, the time

Protocol (several processes write into one step directory):

1. Every rank calls :meth:`CheckpointWriter.save_async` for the step: tensors are copied to
   CPU before it returns (training may change them at once), the file is written by a
   background thread (temp file, fsync, ``os.replace``), then its ``.meta.json`` sidecar.
2. Every rank calls :meth:`CheckpointWriter.wait`, then the ranks meet at a barrier.
3. One process that the caller designates (e.g. rank 0), and only that one, calls
   :meth:`CheckpointWriter.commit` with every expected label. It writes ``MANIFEST.json``
   atomically once every sidecar exists; **the manifest's presence marks a complete
   checkpoint**. Then it prunes.

Pruning rule (in :meth:`CheckpointWriter.commit`, after a manifest is written): the newest
``keep`` complete checkpoints stay; older complete ones are deleted; an incomplete directory
(no manifest) older than the newest complete checkpoint is abandoned and deleted; an
incomplete directory newer than the newest complete checkpoint is never touched, since
another rank may still be writing it.

Reading: :func:`latest_complete` finds the newest checkpoint whose every file verifies (size
and SHA-256), skipping corrupt or partial ones with a logged warning; :func:`load` and
:func:`load_all` verify again on the bytes they read and raise :class:`CheckpointError` on
a mismatch.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from spotline.tracking import write_bytes_atomic

log = logging.getLogger(__name__)

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


def _check_label(rank_label: str) -> None:
    if not _LABEL_RE.match(rank_label) or rank_label.upper() == "MANIFEST":
        raise ValueError(
            f"rank label {rank_label!r} must be a plain file name (letters, digits, '_', '-', "
            "'.'; not starting with '.'; not 'MANIFEST'), e.g. 'rank0' or 's1'"
        )


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")


def _to_cpu(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor detached and copied to CPU."""
    if isinstance(value, torch.Tensor):
        # clone() even on CPU: the caller may update the tensor in place right after.
        return value.detach().to("cpu", copy=True)
    if isinstance(value, OrderedDict):
        return OrderedDict((key, _to_cpu(item)) for key, item in value.items())
    if isinstance(value, dict):
        # A plain dict for every other mapping type: torch.load(weights_only=True) reads
        # dict and OrderedDict only.
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(item) for item in value)
    return copy.deepcopy(value)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(path: Path) -> Path:
    """A fresh hidden name beside ``path``, unique across processes and threads. Opened with
    ``open(..., "xb")`` rather than mkstemp, so the file gets the umask's mode (not 0600)."""
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` atomically (temp file, fsync, rename), then fsync the directory."""
    write_bytes_atomic(path, data)
    _fsync_dir(path.parent)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-*`` directory under ``root``, oldest step first."""
    if not Path(root).is_dir():
        return []
    found = []
    for entry in Path(root).iterdir():
        match = _STEP_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


class CheckpointWriter:
    """Writes this process's checkpoint files in the background and, in the one process the
    caller designates, commits and prunes them (protocol in the module docstring).

    ``keep`` (>= 1) complete checkpoints are kept. Errors of a background write are raised
    by the next :meth:`wait` or :meth:`commit`, unless ``on_error`` is given: then each is
    handed to it at once, from the writing thread, as ``on_error(step, path, error)``, and
    never raised. Pairs with :func:`latest_complete`, :func:`load` and :func:`load_all`.
    """

    def __init__(
        self,
        root: Path,
        keep: int,
        *,
        on_error: Callable[[int, Path, Exception], None] | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self.root = Path(root)
        self.keep = keep
        self.on_error = on_error
        # One thread: writes of this process land in the order they were asked for, and at
        # most one serialised state is in flight besides the CPU copies queued behind it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotline-ckpt")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def save_async(self, step: int, rank_label: str, state: dict[str, torch.Tensor | Any]) -> None:
        """Copy ``state``'s tensors to CPU now, write ``root/step-{step:08d}/{rank_label}.pt``
        and its ``.meta.json`` (size, SHA-256) in the background. Returns once the copy is
        made; the caller may change its tensors from then on."""
        _check_step(step)
        _check_label(rank_label)
        snapshot = _to_cpu(state)
        future = self._executor.submit(self._write_reporting, step, rank_label, snapshot)
        with self._lock:
            self._pending.append(future)

    def _write_reporting(self, step: int, rank_label: str, snapshot: Any) -> None:
        try:
            self._write_rank_file(step, rank_label, snapshot)
        except Exception as error:
            if self.on_error is None:
                raise
            self.on_error(step, step_dir(self.root, step) / f"{rank_label}.pt", error)

    def _write_rank_file(self, step: int, rank_label: str, snapshot: Any) -> None:
        directory = step_dir(self.root, step)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{rank_label}.pt"
        # A sidecar left by an earlier attempt at this step (a resumed run redoing it) must
        # not vouch for this attempt's file if this one fails.
        (directory / f"{rank_label}.meta.json").unlink(missing_ok=True)
        tmp_path = _temp_path(path)
        try:
            # Serialised in memory first: torch.save's own writer turns a short write (a full
            # disk) into "enforce fail ... unexpected pos", where a plain write says ENOSPC.
            buffer = io.BytesIO()
            torch.save(snapshot, buffer)
            with open(tmp_path, "xb") as handle:
                handle.write(buffer.getbuffer())
                handle.flush()
                os.fsync(handle.fileno())
            # Hash what is on disk (from the page cache), not what we meant to write.
            sha256 = _sha256_file(tmp_path)
            size = os.path.getsize(tmp_path)
            os.replace(tmp_path, path)
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise
        _fsync_dir(directory)
        # The sidecar comes last: its presence means the .pt file is complete.
        meta = {"file": path.name, "size": size, "sha256": sha256}
        _write_atomic(directory / f"{rank_label}.meta.json", json.dumps(meta).encode())

    def wait(self) -> None:
        """Block until every write asked of this writer is on disk; re-raise the first error."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors = []
        for future in pending:
            error = future.exception()
            if error is not None:
                errors.append(error)
        if errors:
            raise errors[0]

    def commit(
        self,
        step: int,
        expected_labels: Collection[str],
        *,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Write ``step``'s MANIFEST.json if every expected rank's file is in place, then prune.

        Joins this process's own pending writes first. Returns False (and writes nothing)
        when some expected label has no file yet; True once the manifest is written (or was
        already there). Call it in one designated process only, after a barrier that follows
        every rank's :meth:`wait`. ``metadata`` (JSON) is kept in the manifest, read back by
        :func:`read_metadata`.
        """
        _check_step(step)
        labels = sorted(set(expected_labels))
        if not labels:
            raise ValueError("commit needs at least one expected rank label")
        for label in labels:
            _check_label(label)
        self.wait()
        directory = step_dir(self.root, step)
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
        _write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
        self._prune()
        return True

    def _prune(self) -> None:
        dirs = _step_dirs(self.root)
        complete = [(step, path) for step, path in dirs if (path / MANIFEST).exists()]
        if not complete:
            return
        newest_complete = complete[-1][0]
        kept = {step for step, _ in complete[-self.keep :]}
        for step, path in dirs:
            is_complete = (path / MANIFEST).exists()
            if (is_complete and step not in kept) or (not is_complete and step < newest_complete):
                # Remove the manifest first: a crash mid-delete leaves an incomplete
                # directory, never a "complete" one with files missing.
                (path / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Wait for pending writes and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def _read_manifest(root: Path, step: int) -> dict[str, Any]:
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
    metadata: dict[str, Any] = _read_manifest(root, step).get("metadata", {})
    return metadata


def verify_checkpoint(root: Path, step: int) -> list[str]:
    """What is wrong with ``step``'s checkpoint: an empty list when its manifest exists and
    every listed file has the recorded size and SHA-256."""
    try:
        manifest = _read_manifest(root, step)
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
        elif _sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest")
    return problems


def latest_complete(root: Path) -> int | None:
    """The newest step under ``root`` whose manifest exists and whose files verify; None if
    there is none. Partial (no manifest) and corrupt checkpoints are skipped, each with a
    warning on this module's logger."""
    for step, path in reversed(_step_dirs(root)):
        problems = verify_checkpoint(root, step)
        if not problems:
            return step
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


def load(root: Path, step: int, rank_label: str, *, weights_only: bool = True) -> dict[str, Any]:
    """Read one rank's state of ``step``, checking its SHA-256 against the manifest.

    Raises :class:`CheckpointError` on a missing manifest or file, or a checksum mismatch.
    ``weights_only`` is passed to ``torch.load`` (True accepts tensors and plain Python
    containers and numbers; set it False only for files you trust that hold other objects).
    """
    _check_label(rank_label)
    manifest = _read_manifest(root, step)
    entry = manifest["files"].get(rank_label)
    if entry is None:
        raise CheckpointError(
            f"checkpoint step {step} under {root} has no rank {rank_label!r}; it holds "
            f"{', '.join(sorted(manifest['files']))}"
        )
    path = step_dir(root, step) / entry["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: listed in the manifest but missing") from None
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"{path}: SHA-256 does not match the manifest; the file is corrupt, "
            f"use an older checkpoint (latest_complete skips corrupt ones)"
        )
    state: dict[str, Any] = torch.load(
        io.BytesIO(data), map_location="cpu", weights_only=weights_only
    )
    return state


def load_all(root: Path, step: int, *, weights_only: bool = True) -> dict[str, dict[str, Any]]:
    """Every rank's state of ``step``, by rank label, each verified as in :func:`load`."""
    manifest = _read_manifest(root, step)
    return {
        label: load(root, step, label, weights_only=weights_only)
        for label in sorted(manifest["files"])
    }


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """The Young/Daly checkpoint interval ``sqrt(2 * C * MTBF)`` in seconds: the period that
    minimises checkpoint cost plus expected lost work, for a checkpoint that costs
    ``checkpoint_cost_s`` and fatal losses ``mtbf_s`` apart on average."""
    for name, value in (("checkpoint_cost_s", checkpoint_cost_s), ("mtbf_s", mtbf_s)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and > 0, got {value}")
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def interval_steps(step_time_s: float, checkpoint_cost_s: float, mtbf_s: float) -> int:
    """The Young/Daly interval in whole steps: ``floor(interval / step_time_s)``, at least 1
    (rounding down checkpoints no later than the optimum)."""
    if not math.isfinite(step_time_s) or step_time_s <= 0:
        raise ValueError(f"step_time_s must be finite and > 0, got {step_time_s}")
    return max(1, math.floor(young_daly_interval_s(checkpoint_cost_s, mtbf_s) / step_time_s))
