"""A stand-in bench for the alternation tests: two rank groups of stand-in ranks
(``agent_child sleep``, which never ends) take turns under ``run_guarded`` until the bench
is terminated. ``python -m alternating_bench WORK_DIR``; needs this folder on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spotline.launch.bench.alternate import Launcher, run_alternated_rounds
from spotline.launch.bench.jobs import run_guarded
from spotline.launch.bench.rank_group import finish_rank_group, start_rank_group

SLEEPERS = Launcher(
    start=lambda run_dir: start_rank_group("agent_child", ["sleep"], 2, run_dir),
    ready=lambda run_dir: lambda: True,
    finish=lambda proc, run_dir: finish_rank_group(proc, run_dir, "stand-in"),
)


def work(args: argparse.Namespace) -> int:
    run_alternated_rounds({"a": SLEEPERS, "b": SLEEPERS}, 1, Path(args.work), 0.5, "stand-in", 1)
    return 0


parser = argparse.ArgumentParser(prog="alternating_bench")
parser.add_argument("work")
sys.exit(run_guarded("stand-in", parser, sys.argv[1:], work))
