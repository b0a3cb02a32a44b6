"""A process's console output copied into a log file, the console still getting all of it.

``spotline train``'s workers write their output to ``OUTPUT/logs/<worker>.log`` alone: the
coordinator is the process at the terminal. The ranks of ``deepspeed launch/train.py`` and
the plain ``python`` run of a fine-tuning script are at the terminal themselves (DeepSpeed's
launcher shows what every rank prints), so :func:`tee_output` gives them the same log
without taking their output from the console.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The copies running in this process (one per file descriptor), by log: kept referenced
# for the process's life, and so that a second call for the same log copies nothing twice.
_COPIES: dict[Path, list[subprocess.Popen[bytes]]] = {}


def tee_output(path: Path) -> bool:
    """From now until this process exits, copy everything written to its stdout and stderr
    into ``path`` (appended; its folder is made), which still goes where it went before.

    The copy is made at the file-descriptor level, by a ``tee`` process per descriptor:
    what torch's and DeepSpeed's native code and any child process write is copied as well,
    and a crash's last words (a traceback at exit, a fatal signal's report) reach both the
    console and the log, since each ``tee`` ends only once every writer has closed its end.
    Returns False, with a line on stderr and nothing redirected, when no ``tee`` starts."""
    path = path.resolve()
    if path in _COPIES:
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    copies: list[subprocess.Popen[bytes]] = []
    try:
        for fd in (1, 2):
            # -i: a Ctrl-C at the terminal reaches the whole process group; the copy must
            # outlive it until this process has written its last line.
            copies.append(
                subprocess.Popen(["tee", "-a", "-i", str(path)], stdin=subprocess.PIPE, stdout=fd)
            )
    except OSError as exc:
        for started in copies:
            if started.stdin is not None:
                started.stdin.close()
            started.wait()
        print(f"spotline: no log at {path}: {exc}", file=sys.stderr, flush=True)
        return False
    # What Python buffered so far goes out before the descriptors change.
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, copy in zip((1, 2), copies, strict=True):
        assert copy.stdin is not None
        os.dup2(copy.stdin.fileno(), fd)
        # Now ``fd`` is the pipe's only write end here: its ``tee`` reads to the end of
        # what this process writes and exits with it.
        copy.stdin.close()
    _COPIES[path] = copies
    return True
