"""Entry point for DeepSpeed's launcher.

    deepspeed --num_gpus 4 launch/train.py --deepspeed_config configs/default.json --steps 20

(``--num_accelerators`` on CPU-only machines; DS_ACCELERATOR=cpu). The launcher sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK and appends ``--local_rank``; the number
of workers is the launcher's world size. Each rank runs ``spotline.worker.launched.run_worker``
(through ``launch/worker.py``): the same config, flags, engine (``spotline.pipeline.engine``,
``spotline.pipeline.redundancy``), global sampler, step loop (``spotline.worker.loop``) and summary as
``spotline train``, with none of its recovery hooks (DeepSpeed's launcher kills every rank
when one exits).
"""

from __future__ import annotations

import argparse
import os
import sys

# Run as a script, this file's folder (launch/) heads sys.path; the package is imported by
# its installed name, so nothing here may shadow a top-level module name.
from spotline.launch.flags import add_run_flags, overrides_from_args
from spotline.launch.worker import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/train.py", description=__doc__.splitlines()[1])
    parser.add_argument(
        "--deepspeed_config", "--config", dest="config", help="DeepSpeed config JSON"
    )
    parser.add_argument("--output", default="runs/deepspeed-launcher", help="output directory")
    parser.add_argument(
        "--local_rank", type=int, default=None, help="set by the deepspeed launcher"
    )
    parser.add_argument(
        "--deepspeed", action="store_true", help="accepted for DeepSpeed compatibility"
    )
    add_run_flags(parser, with_workers=False)
    args = parser.parse_args(argv)
    overrides = overrides_from_args(args)
    overrides["spotline.topology.workers"] = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return run(args.config, args.output, overrides)


if __name__ == "__main__":
    sys.exit(main())
