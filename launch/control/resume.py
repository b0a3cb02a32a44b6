"""What a ``--resume`` carries over from the stopped run: from the checkpoint it restores
(its manifest's losses, learning rates, evaluations and record) and from the record the
last part saved as it ended (``run-record.json``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotline.checkpointing.manifest import read_metadata
from spotline.launch.control.checkpoints import EVALUATIONS, RECORD
from spotline.launch.control.metrics import RunMetrics
from spotline.run_dir import RECORD_NAME
from spotline.wire.protocol import EvalResult, Store, eval_key


def carry_over(metrics: RunMetrics, store: Store, root: Path, output: Path, step: int) -> None:
    """Into ``metrics`` (and ``store``), what the resumed run had at checkpoint ``step``
    (under ``root``, the checkpoints of the run in ``output``)."""
    metadata = read_metadata(root, step)
    for name, (_, values) in metrics.step_series().items():
        for at, value in metadata.get(name, {}).items():
            values[int(at)] = value
    for raw in metadata.get(EVALUATIONS, {}).values():
        # The stopped run's evaluations: in the summary, and in the store, where rank 0
        # reads the earlier ones to tell whether a new one is the best.
        result = EvalResult.from_json(raw)
        metrics.evaluations[result.step] = result
        store.set(eval_key(result.step), result.encode())
    metrics.part_from = step  # also for a checkpoint without a record
    record = earlier_record(output, metadata.get(RECORD))
    if record is not None:
        metrics.continue_record(record, resume_step=step)


def earlier_record(output: Path, committed: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The record a resume continues: the one the last part saved as it ended, or the one
    committed with the checkpoint (``committed``) where that one has more parts (the last
    part ended without saving one: a crash, a lost coordinator). None: neither (a run from
    before records were kept)."""
    path = output / RECORD_NAME
    saved: dict[str, Any] | None = json.loads(path.read_text()) if path.is_file() else None
    if committed is None or (saved is not None and len(saved["parts"]) >= len(committed["parts"])):
        return saved
    return dict(committed)
