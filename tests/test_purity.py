"""Pure planning code imports neither torch nor DeepSpeed: it runs (and is tested) anywhere."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import spotline.plan
import spotline.sim

PURE = (
    [
        "spotline.config",
        "spotline.config_reader",
        "spotline.config_resume",
        "spotline.errors",
        "spotline.wire.protocol",
        "spotline.wire.agent_messages",
        "spotline.checkpointing.manifest",
        "spotline.wire.net",
        "spotline.wire.auth",
    ]
    + [f"spotline.plan.{m.name}" for m in pkgutil.iter_modules(spotline.plan.__path__)]
    + [f"spotline.sim.{m.name}" for m in pkgutil.iter_modules(spotline.sim.__path__)]
    # The simulator's timed sweep, moved out of spotline.sim (it is an entry point), stays pure.
    + ["spotline.launch.bench.sim_sweep"]
)


def test_pure_modules_do_not_import_torch_or_deepspeed() -> None:
    assert "spotline.plan.schedule" in PURE and "spotline.plan.layout" in PURE
    assert "spotline.plan.policies" in PURE
    assert "spotline.plan.placement" in PURE
    code = (
        "import importlib, sys\n"
        f"for name in {PURE!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_typing_folder_links_every_module_of_the_package() -> None:
    """mypy reads the package through typing/spotline (its import name differs from its
    folders): a module missing there would silently go unchecked."""
    repo = Path(__file__).resolve().parents[1]
    mirror = repo / "typing" / "spotline"
    expected = {p.name for p in (repo / "integration").iterdir() if p.name != "__pycache__"} | {
        "launch",
        "patches",
    }
    assert {p.name for p in mirror.iterdir()} == expected
    for name in expected:
        target = (repo / "integration" / name) if name not in ("launch", "patches") else repo / name
        assert (mirror / name).resolve() == target.resolve(), name


def test_the_control_plane_modules_import_no_torch() -> None:
    """The coordinator's parts and the agent load torch only when they open the job's store
    (torch.distributed's); importing them loads none of torch, DeepSpeed, transformers."""
    import spotline.launch.control

    modules = ["spotline.launch.coordinator", "spotline.launch.agent"] + [
        f"spotline.launch.control.{m.name}"
        for m in pkgutil.iter_modules(spotline.launch.control.__path__)
    ]
    assert "spotline.launch.control.recovery" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
