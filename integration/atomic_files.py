"""Files written whole or not at all: a reader sees the old file or the whole new one.

The bottom floor of the package (it imports nothing of Spotline): the checkpoints, the
summary, the reports and the benches all write through it.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temp file beside it, fsync, rename.

    A reader sees the old file or the whole new one, never a part. ``open(..., "xb")`` rather
    than mkstemp, so the file gets the umask's mode (mkstemp's is 0600).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp_path, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON so a reader sees either the old file or the whole new one, never a part."""
    write_bytes_atomic(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())
