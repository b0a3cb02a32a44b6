"""Read what an offline wandb run wrote: the history rows in its ``.wandb`` files.

The oracle of the tests that check what a run logged to wandb: the bytes wandb wrote, read
without Spotline. A ``.wandb`` file is a LevelDB-style log (a 7-byte header, ``:W&B``,
0xBEE1, version 0, then 32 KiB blocks of records, each a CRC-32, a length, a type (full,
first, middle, last) and its bytes) of ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    assert data[: len(HEADER)] == HEADER, data[:16]
    pos, parts = len(HEADER), b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        # The checksum (CRC-32C, masked) is not checked: the records are parsed as protobufs.
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        pos += 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = body
        elif kind == MIDDLE:
            parts += body
        elif kind == LAST:
            yield parts + body
            parts = b""


def history_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every history row of the offline run directory ``run_dir`` (``offline-run-*``), in
    the order written: ``_step`` and the logged keys."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(run_dir.glob("*.wandb")):
        for payload in _payloads(path.read_bytes()):
            record = pb.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") != "history":
                continue
            row: dict[str, Any] = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            rows.append(row)
    return rows


def logged(output: Path) -> list[dict[str, Any]]:
    """The history rows of every part (offline run directory) of ``output``'s wandb run, in
    the order the parts ran."""
    rows = []
    for run_dir in sorted((output / "wandb").glob("offline-run-*")):
        rows.extend(history_rows(run_dir))
    return rows
