"""One rank of ``deepspeed launch/train.py`` (started by DeepSpeed's launcher; ``spotline
train``'s workers are another kind of process, ``launch/elastic_worker.py``).

Reads its rank from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and a
resolved config file, and trains with ``spotline.worker.launched.run_worker`` (the shared step loop,
no recovery). A user mistake found here is printed once, by rank 0, and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from spotline.errors import UserError
from spotline.run_dir import refuse_earlier_run


def run(config_path: str | None, output: str, overrides: dict[str, object]) -> int:
    from spotline.config import load_config, with_overrides

    rank = int(os.environ.get("RANK", "0"))
    try:
        # Every rank checks before any writes: rank 0 writes only once the ranks have met
        # (the engine's process group), after every rank passed this check.
        refuse_earlier_run(Path(output), resume=None)
        cfg = with_overrides(load_config(config_path), overrides)
        from spotline.worker.launched import run_worker

        summary = run_worker(cfg, Path(output))
        if summary is not None:  # rank 0: the same summary as `spotline train` prints
            from spotline.launch.run_summary import format_summary

            print(format_summary(summary, Path(output)), flush=True)
    except UserError as exc:
        if rank == 0:
            print(f"spotline: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as exc:  # spotline.exact.reduction.NonFiniteGradient, on every rank
        if rank == 0:
            print(
                f"spotline: error: {exc}; the step was not applied. Lower the learning rate, "
                "enable gradient_clipping or check the data",
                file=sys.stderr,
                flush=True,
            )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spotline-worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    return run(args.config, args.output, {})


if __name__ == "__main__":
    sys.exit(main())
