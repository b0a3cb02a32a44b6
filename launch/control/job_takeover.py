"""Taking over an etcd job: a coordinator restarted with the same ``--output`` goes on with
the job its predecessor ran (the store outlived it; the workers trained on meanwhile).

- :func:`open_job_store` hosts the job's store: for ``spotline coordinator`` over etcd, under
  the key directory of the job named in the output's job file (:data:`ETCD_JOB_NAME`) if a
  predecessor left one, and writes that file for a successor.
- :func:`adoptable` tells whether the store holds a job that was started and not ended;
  :func:`adopt` takes it over: the machines admitted, the workers started, the generation
  running and its plan, the losses so far. The generation loop goes on from there.
- :func:`release_store` ends the job's keys (etcd's; a TCPStore goes with the process) and
  the job file; :func:`forget_job` only the file (a job stopped by an error or Ctrl-C is
  not one a successor should take over).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from spotline.atomic_files import write_json_atomic
from spotline.config import RecoverySection
from spotline.launch.control.job_state import JobState, Progress
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.supervisor import Supervisor
from spotline.run_dir import ETCD_JOB_NAME
from spotline.wire.auth import RawStore
from spotline.wire.protocol import JOB_END_KEY, PlanMessage, Store, entry_key, plan_key

if TYPE_CHECKING:
    from spotline.wire.stores import StoreSpec

STORE_TIMEOUT = timedelta(seconds=60)


def open_job_store(
    rec: RecoverySection, output: Path, listen: tuple[str, int] | None
) -> tuple[RawStore, StoreSpec]:
    """The job's store, and what workers connect with. ``listen``: ``spotline
    coordinator``'s address (None: ``spotline train``, on 127.0.0.1)."""
    # Imported here, not above: spotline.wire.stores imports torch (the store is
    # torch.distributed's), the one thing the coordinator's process loads it for; the
    # control plane's modules import none of it (a test checks it).
    from spotline.wire.stores import host_store

    previous = read_job_file(output) if listen is not None and rec.store == "etcd" else None
    raw_store, spec = host_store(
        rec.store,
        etcd_endpoint=rec.etcd_endpoint,
        timeout=STORE_TIMEOUT,
        listen=listen or ("127.0.0.1", 0),
        etcd_prefix=previous.prefix if previous is not None else None,
    )
    if spec.backend == "etcd":
        write_job_file(output, spec)
    return raw_store, spec


def write_job_file(output: Path, spec: StoreSpec) -> None:
    write_json_atomic(output / ETCD_JOB_NAME, {"store": spec.to_arg()})


def read_job_file(output: Path) -> StoreSpec | None:
    """The etcd job a coordinator with this ``--output`` ran and did not end (None: none)."""
    from spotline.wire.stores import parse_store_arg  # torch, as above

    path = output / ETCD_JOB_NAME
    if not path.exists():
        return None
    spec = parse_store_arg(json.loads(path.read_text())["store"])
    return spec if spec.backend == "etcd" else None


def adoptable(store: Store) -> bool:
    """Whether this store holds a job a predecessor started and did not end."""
    return store.check([plan_key(0)]) and not store.check([JOB_END_KEY])


def adopt(
    store: Store,
    supervisor: Supervisor,
    state: JobState,
    metrics: RunMetrics,
    progress: Progress,
    *,
    steps: int,
) -> None:
    """Take the running job over from the store into ``state`` (see the module docstring);
    ``steps``: the run's steps (their losses and learning rates so far are read)."""
    supervisor.adopt()
    g = 0
    while store.check([plan_key(g + 1)]):
        g += 1
    plan = PlanMessage.decode(store.get(plan_key(g)))
    if plan.action == "finish":  # it died as the job ended: end it again
        g, plan = g - 1, PlanMessage.decode(store.get(plan_key(g - 1)))
    state.generation = g
    state.layout, state.resume_step = plan.layout, plan.resume_step
    state.included.update(w for w in supervisor.workers if store.check([entry_key(w)]))
    # Each key on its own: rank 0 writes a step's loss, then its learning rate, and one
    # killed between the two leaves a loss without its rate for good (a step not redone).
    metrics.collect_step_values(steps)
    metrics.collect_evaluations()
    metrics.event(
        "adopted",
        generation=g,
        step=progress.max_progress(),
        workers=len(supervisor.live_ids()),
        machines=len(supervisor.machines.joined),
    )


def release_store(spec: StoreSpec, output: Path) -> None:
    """An etcd job's keys are deleted when it ends (a TCPStore goes with the process)."""
    if spec.backend == "etcd":
        from spotline.wire.stores import delete_etcd_prefix  # torch, as above

        delete_etcd_prefix(spec)
    forget_job(output)  # nothing left to take over


def forget_job(output: Path) -> None:
    """No successor takes this job over."""
    (output / ETCD_JOB_NAME).unlink(missing_ok=True)
