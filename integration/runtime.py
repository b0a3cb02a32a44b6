"""Process-level set-up shared by every Spotline worker: threads, determinism, torch.distributed.

Kept apart from the trainer so that tests, benchmarks and the stock-DeepSpeed baseline set up
a process exactly the same way.
"""

from __future__ import annotations

import hashlib
import os
import random
import resource
import struct
from collections.abc import Mapping

import numpy as np
import torch


def configure_process(*, intra_op_threads: int, deterministic: bool) -> None:
    """Fix the thread count and kernel choice before any tensor work.

    One intra-op thread per process is both the fast setting on a shared CPU (the default
    oversubscribes the cores, about 10x slower) and part of determinism: the thread count
    changes how reductions inside a kernel are split, hence the bits.
    """
    os.environ["OMP_NUM_THREADS"] = str(intra_op_threads)
    torch.set_num_threads(intra_op_threads)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def init_distributed(backend: str | None = None) -> None:
    """Initialise DeepSpeed's communication layer from RANK/WORLD_SIZE/MASTER_* variables."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    # Without these DeepSpeed falls back to MPI discovery and fails on a missing mpi4py.
    assert not missing, f"worker started without {missing}"
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    import deepspeed
    import deepspeed.ops

    # The shared-memory inference all-reduce would JIT-compile for about a minute on first
    # use of init_distributed; training never uses it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and Python versions."""
    digest = hashlib.sha256(struct.pack(f"<{len(parts)}q", *parts)).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def reseed_torch(seed: int) -> None:
    """Seed torch's generators as ``torch.manual_seed`` does, at a fraction of the cost.

    ``torch.manual_seed`` also queues a seeding of CUDA (and XPU, MTIA) generators for when
    they are initialized, recording a Python stack trace each time: about 0.4 ms per call on
    a machine without them, and the engine reseeds before every layer's forward (measured:
    the traces were a fifth of a tiny model's CPU step). The CPU generator gives the same
    numbers either way; an initialized CUDA device's current generator is seeded too.
    """
    torch.default_generator.manual_seed(seed)
    # torch leaves cuda.is_initialized unannotated
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed(seed)


def seed_logical_worker(*coordinates: int) -> None:
    """Seed torch, numpy and Python's ``random`` from a logical worker's coordinates (seed,
    step, logical worker, ...): whatever a model or a loss draws belongs to the logical
    worker, not to the process that happens to run it."""
    seed = derive_seed(*coordinates)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    reseed_torch(seed)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def param_sha256(named: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every parameter, in order of name, as contiguous fp32 bytes.

    Names are the Hugging Face model's parameter names, so the same parameters give the
    same hash whichever stage, process or placement held them (and a plain transformers
    model can be hashed the same way).
    """
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
