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

What reads and writes no tensor (step directories, the manifest's commit and checks, the
Young/Daly interval) is :mod:`spotline.checkpointing.manifest`, re-exported here: the
coordinator imports that half only, so that it never loads torch for its checkpoints.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from spotline.checkpointing.manifest import (
    MANIFEST,
    MANIFEST_FORMAT,
    CheckpointError,
    check_label,
    check_step,
    commit_manifest,
    fsync_dir,
    latest_complete,
    read_manifest,
    read_metadata,
    sha256_file,
    step_dir,
    verify_checkpoint,
    write_atomic,
)

__all__ = [
    "MANIFEST",
    "MANIFEST_FORMAT",
    "CheckpointError",
    "CheckpointWriter",
    "latest_complete",
    "load",
    "load_all",
    "read_metadata",
    "step_dir",
    "verify_checkpoint",
]


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


def _temp_path(path: Path) -> Path:
    """A fresh hidden name beside ``path``, unique across processes and threads. Opened with
    ``open(..., "xb")`` rather than mkstemp, so the file gets the umask's mode (not 0600)."""
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


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
        check_step(step)
        check_label(rank_label)
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
            sha256 = sha256_file(tmp_path)
            size = os.path.getsize(tmp_path)
            os.replace(tmp_path, path)
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise
        fsync_dir(directory)
        # The sidecar comes last: its presence means the .pt file is complete.
        meta = {"file": path.name, "size": size, "sha256": sha256}
        write_atomic(directory / f"{rank_label}.meta.json", json.dumps(meta).encode())

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

        Joins this process's own pending writes first, then is
        :func:`~spotline.checkpointing.manifest.commit_manifest` with this writer's ``keep``:
        returns False (and writes nothing) when some expected label has no file yet; True
        once the manifest is written (or was already there). Call it in one designated
        process only, after a barrier that follows every rank's :meth:`wait`. ``metadata``
        (JSON) is kept in the manifest, read back by :func:`read_metadata`.
        """
        check_step(step)
        labels = sorted(set(expected_labels))
        if not labels:
            raise ValueError("commit needs at least one expected rank label")
        for label in labels:
            check_label(label)
        self.wait()
        return commit_manifest(self.root, step, labels, keep=self.keep, metadata=metadata)

    def close(self) -> None:
        """Wait for pending writes and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def load(root: Path, step: int, rank_label: str, *, weights_only: bool = True) -> dict[str, Any]:
    """Read one rank's state of ``step``, checking its SHA-256 against the manifest.

    Raises :class:`CheckpointError` on a missing manifest or file, or a checksum mismatch.
    ``weights_only`` is passed to ``torch.load`` (True accepts tensors and plain Python
    containers and numbers; set it False only for files you trust that hold other objects).
    """
    check_label(rank_label)
    manifest = read_manifest(root, step)
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
    manifest = read_manifest(root, step)
    return {
        label: load(root, step, label, weights_only=weights_only)
        for label in sorted(manifest["files"])
    }
