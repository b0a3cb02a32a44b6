"""One worker process of ``spotline train`` (started by the coordinator's supervisor,
``launch/control/supervisor.py``, as ``python -m spotline.launch.elastic_worker``).

Runs a :class:`spotline.worker.elastic.ElasticWorker` against the coordinator's store until
the plans say finish; for ``spotline run``, inside the user's script (``spotline.hf``: its
Trainer's ``train()`` is that run). Exit codes: 0 done (or left), 2 a user mistake, 1 an
error (its cause told to the coordinator as ``error/<worker>``), 3 the coordinator is gone
(``spotline.worker.liveness.EXIT_COORDINATOR_LOST``). The processes of ``deepspeed
launch/train.py`` are another kind, started by DeepSpeed's launcher: ``launch/worker.py``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import traceback
from pathlib import Path

from spotline.config import load_config
from spotline.errors import UserError, one_line
from spotline.hf import JOB_DIR, JOB_FILE, Job, run_script_in_worker
from spotline.wire.protocol import error_key
from spotline.worker.elastic import ElasticWorker
from spotline.worker.liveness import EXIT_COORDINATOR_LOST

# What every worker imports lazily once it runs, imported here at the module's import: the
# agent's spawner imports this module once and forks the workers from it, so they share
# these instead of each importing them (about 3 s of CPU a worker, 4 workers at once on a
# start: torch._inductor.config comes from torch.use_deterministic_algorithms, datasets from
# the corpus loader, the families' transformers modules from the model's config and build).
WARM_IMPORTS = (
    "torch._inductor.config",
    "datasets",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt_neox.modeling_gpt_neox",
)
# pyarrow (under datasets) starts jemalloc's purging thread at import unless told not to,
# and the spawner forks only a process of one thread.
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
for _module in WARM_IMPORTS:
    importlib.import_module(_module)


def _tell_coordinator(worker: ElasticWorker | None, cause: str) -> None:
    """Why this worker exits with an error (``error/<worker>``): the coordinator stops the
    job with it instead of taking the exit for a preemption."""
    if worker is None:
        return
    try:
        worker.store.set(error_key(worker.wid), f"worker {worker.wid}: {cause}")
    except Exception:  # the coordinator is gone: nobody to tell
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spotline-elastic-worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--store", required=True)
    args = parser.parse_args(argv)
    worker: ElasticWorker | None = None
    try:
        # Absolute: a spotline run script runs in its own working directory.
        output = Path(args.output).resolve()
        worker = ElasticWorker(load_config(args.config), args.worker_id, args.store, output)
        job = output / JOB_DIR
        if (job / JOB_FILE).is_file() and Job.read(job).script is not None:
            # spotline run: the user's script runs here too; its Trainer.train() is this run.
            return run_script_in_worker(job, worker.run)
        return worker.run()
    except UserError as exc:
        print(f"spotline: error: {exc}", flush=True)
        _tell_coordinator(worker, str(exc))
        return 2
    except Exception as exc:
        # A store operation failed because the coordinator is gone (SIGKILLed, its machine
        # lost): one line, not a DistNetworkError traceback.
        if worker is not None and worker.liveness.coordinator_lost():
            worker.liveness.say_coordinator_lost()
            # Gloo's threads and sockets to the peers must not run interpreter teardown.
            os._exit(EXIT_COORDINATOR_LOST)
        # An error outside a generation (reading a checkpoint, loading the data): the
        # traceback to this worker's log, the cause to the coordinator (``error/<worker>``),
        # which stops the job with it instead of taking this exit for a preemption.
        try:
            traceback.print_exc()
        except OSError:  # the log is on a full disk
            pass
        _tell_coordinator(worker, one_line(exc))
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
