"""Shared helpers for tests that start real Spotline processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from spotline.sim.sim_config import SimConfig

# The cluster-of-namespaces fixture (tests/netns.py), for every test module.
from components import missing
from netns import netns_cluster  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def require_etcd() -> None:
    """Debian's etcd-server, which the etcd store's tests start (tests/components.py)."""
    import shutil

    from spotline.wire.stores import ETCD_BINARY

    if shutil.which(ETCD_BINARY) is None:
        missing("etcd", f"{ETCD_BINARY} is absent: apt-get install -y etcd-server")


# A tiny GPT-2 with dropout off: the computation a single-process transformers model can
# reproduce exactly.
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def small_config(**spotline_sections: Any) -> dict[str, Any]:
    """A fast config: 2 micro-batches of 4 sequences per pipeline, 4 steps, wandb off."""
    spotline: dict[str, Any] = {
        "model": {"name": "gpt2-tiny"},
        "training": {"steps": 4, "seed": 7},
        # No timeline.png (a matplotlib import and draw, ~1-2 s a run here); the test of
        # a run's plot turns it on.
        "tracking": {"wandb": "disabled", "timeline_png": False},
        "determinism": {"enabled": True},
    }
    for key, value in spotline_sections.items():
        spotline[key] = {**spotline.get(key, {}), **value}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "spotline": spotline,
    }


# A tiny OPT: a causal LM of no family Spotline splits into stages (it trains whole, with
# one stage), whose LM head is tied to its input embedding as most small causal LMs' are.
TINY_OPT = {
    "vocab_size": 260,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "ffn_dim": 64,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "word_embed_proj_dim": 32,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "eos_token_id": 256,
    "pad_token_id": 257,
}


def write_tiny_opt(directory: Path, **overrides: Any) -> str:
    """A ``save_pretrained`` directory (config and seeded weights) of :data:`TINY_OPT`."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model("opt", **{**TINY_OPT, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return str(directory)


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config))
    return path


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return env


def spotline_command(*args: str) -> list[str]:
    """The ``spotline`` command line with ``args``, run by this interpreter."""
    return [sys.executable, "-m", "spotline.launch.cli", *args]


def run_spotline(args: list[str], *, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the ``spotline`` command; the timeout bounds the test, the launcher reaps workers."""
    return subprocess.run(
        spotline_command(*args),
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def file_stamps(output: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``output``: its size and modification time (a refused command must
    leave them as they were)."""
    return {
        str(p.relative_to(output)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in output.rglob("*")
        if p.is_file()
    }


def read_summary(output: Path) -> dict[str, Any]:
    return json.loads((output / "summary.json").read_text())


@pytest.fixture
def spotline_train(tmp_path: Path):
    """``spotline_train(config, *flags) -> summary``: a successful run's summary.json."""

    def run(config: dict[str, Any], *flags: str, name: str = "run") -> dict[str, Any]:
        cfg_path = write_config(tmp_path / f"{name}.json", config)
        output = tmp_path / name
        proc = run_spotline(["train", "--config", str(cfg_path), "--output", str(output), *flags])
        assert proc.returncode == 0, proc.stderr[-4000:]
        return read_summary(output)

    return run


def run_ranks(script: Path, world_size: int, args: list[str], *, timeout: float = 240) -> list[int]:
    """Start ``world_size`` real ranks of ``script`` on one gloo group; reap them all."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(world_size):
            env = child_env()
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def sampler_strategy(
    *, max_logical_workers: int, max_micro_batch_size: int, max_steps: int, max_tail: int
):
    """A hypothesis strategy of GlobalSamplers: up to ``max_logical_workers`` logical
    workers, micro-batches of up to ``max_micro_batch_size`` samples, 1-3 micro-batches, and
    a corpus of at least one step and at most ``max_steps`` steps plus ``max_tail`` samples."""
    from hypothesis import strategies as st

    from spotline.plan.sampler import GlobalSampler

    @st.composite
    def samplers(draw: st.DrawFn) -> GlobalSampler:
        num_logical_workers = draw(st.integers(1, max_logical_workers))
        micro_batch_size = draw(st.integers(1, max_micro_batch_size))
        num_micro_batches = draw(st.integers(1, 3))
        per_step = num_logical_workers * micro_batch_size * num_micro_batches
        num_samples = draw(st.integers(per_step, per_step * max_steps + max_tail))
        seed = draw(st.integers(-(2**40), 2**40))
        return GlobalSampler(
            num_samples, num_logical_workers, micro_batch_size, num_micro_batches, seed
        )

    return samplers()


# Two stages, two pipelines on four one-slot nodes: the simulator tests' toy.
TOY = {
    "spot_price_per_node_hour": 1.0,
    "on_demand_price_per_node_hour": 3.0,
    "node_ready_s": 45.0,
    "fatal_rendezvous_s": 30.0,
    "reconfigure_s": 20.0,
    "degraded_slowdown": 1.5,
    "spotline_checkpoint_interval_s": 600.0,
    "models": {
        "toy": {
            "num_stages": 2,
            "samples_per_step": 10,
            "checkpoint_save_s": 10.0,
            "checkpoint_load_s": 5.0,
            "step_times": [
                {"num_stages": 2, "num_pipelines": 1, "degraded": False, "step_time_s": 2.0},
                {"num_stages": 2, "num_pipelines": 2, "degraded": False, "step_time_s": 1.25},
            ],
        }
    },
}


@pytest.fixture()
def toy_config(tmp_path: Path) -> SimConfig:
    """A toy simulator set-up (tests/test_sim.py, tests/test_recovery_policies.py)."""
    from spotline.sim.calibration import load_calibration
    from spotline.sim.sim_config import SimConfig

    path = tmp_path / "toy.json"
    path.write_text(json.dumps(TOY))
    calibration = load_calibration(path)
    return SimConfig(calibration, calibration.model("toy"), num_nodes=4)


def interrupt_run(config: Path, output: Path, presses: int) -> subprocess.CompletedProcess[str]:
    """Start a run as a terminal would (its own session, workers included) and press Ctrl-C
    ``presses`` times (to the process group, as a terminal does) once a checkpoint exists."""
    from spotline.checkpointing.manifest import MANIFEST

    proc = subprocess.Popen(
        spotline_command("train", "--config", str(config), "--output", str(output)),
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not list(output.glob(f"checkpoints/*/{MANIFEST}")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.05)
        for press in range(presses):
            if press:
                # The second press once the first is being acted on (it says where it stops).
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=240)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
