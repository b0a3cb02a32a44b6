"""One process that runs a group of bench ranks: the root of their process tree.

``spotline bench foundation --alternate`` stops and continues a job by its process tree
(:mod:`spotline.launch.bench.alternate`); a ``spotline train`` job has its coordinator for
a root, and the stock baseline's ranks get this one::

    python -m spotline.launch.bench.rank_group --module M --ranks N --run-dir DIR -- ARGS...

It runs :func:`spotline.launch.bench.jobs.run_rank_module` (rank logs in ``DIR/logs``, rank
0's JSON in ``DIR/result.json``) and exits 0, or 1 with one line naming the failed ranks.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from spotline.launch.bench.jobs import (
    RunFailed,
    child_env,
    exit_on_sigterm,
    rank_result,
    run_rank_module,
)


def start_rank_group(
    module: str,
    args: list[str],
    num_ranks: int,
    run_dir: Path,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``num_ranks`` ranks of ``module`` under one root process (``extra_env`` added to
    their environment), its output to ``run_dir/bench.log``; :func:`finish_rank_group`
    waits for it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        __name__,
        "--module",
        module,
        "--ranks",
        str(num_ranks),
        "--run-dir",
        str(run_dir),
        "--",
        *args,
    ]
    with open(run_dir / "bench.log", "wb") as log:
        return subprocess.Popen(
            cmd, env={**child_env(), **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT
        )


def finish_rank_group(proc: subprocess.Popen[bytes], run_dir: Path, label: str) -> dict[str, Any]:
    """Wait for a group :func:`start_rank_group` started; rank 0's JSON. Raises RunFailed
    (exit 1, naming ``label``) when it failed."""
    code = proc.wait()
    return rank_result(
        run_dir, code == 0, f"{label} exited {code}; see {run_dir}/bench.log and {run_dir}/logs"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="spotline-rank-group", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--module", required=True, help="the rank's module (python -m)")
    parser.add_argument("--ranks", type=int, required=True, help="processes in the group")
    parser.add_argument("--run-dir", required=True, help="rank logs and result.json go here")
    parser.add_argument("args", nargs="*", help="the rank's arguments (after --)")
    args = parser.parse_args(argv)
    # A SIGTERM (the bench giving up on the round) must reach the ranks: as an exception,
    # run_rank_module stops them on its way out; by default this process alone would die.
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        run_rank_module(args.module, args.args, args.ranks, Path(args.run_dir), args.module)
    except RunFailed as exc:
        print(f"spotline: rank group failed: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
