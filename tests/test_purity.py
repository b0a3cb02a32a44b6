"""Pure planning code imports neither torch nor DeepSpeed: it runs (and is tested) anywhere."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import spotline.plan
import spotline.sim

PURE = (
    ["spotline.config", "spotline.errors"]
    + [f"spotline.plan.{m.name}" for m in pkgutil.iter_modules(spotline.plan.__path__)]
    + [f"spotline.sim.{m.name}" for m in pkgutil.iter_modules(spotline.sim.__path__)]
    # The simulator's timed sweep, moved out of spotline.sim (it is an entry point), stays pure.
    + ["spotline.launch.bench.sim_sweep"]
)


def test_pure_modules_do_not_import_torch_or_deepspeed() -> None:
    assert "spotline.plan.schedule" in PURE and "spotline.plan.layout" in PURE
    code = (
        "import importlib, sys\n"
        f"for name in {PURE!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
