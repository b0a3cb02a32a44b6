"""A generation's waits on gloo's operations, ended by the generation's abort.

Why: when a connection closes, gloo fails the operations it still holds queued, but not one
whose transfer has begun (``Pair::signalException`` skips an unbound buffer in its write
queue or being read): a send whose receiver was ready, its data being written or its write
refused by a socket already shut, or a receive whose data was arriving, a collective's as
well as a pipeline transfer's. So shutting a process's sockets on an abort
(``spotline.worker.liveness.abort_connections``) left such a wait to run out the whole
collectives' timeout: a recovery of a minute instead of a second (one run in three of a
SIGKILL or a rescale: a survivor's gradient send, or its tied gradients' all-reduce, to a
peer that shut its connections at that moment). Nor can the wait be cut into short ones: a
wait of gloo's that times out closes every connection of its group.

So a generation's waits run in a thread of their own (:class:`_Waiter`), and the caller
leaves on whichever comes first: the wait's end, or the generation's abort (the event
:func:`watch_abort` was given), with :class:`GenerationAborted`. A live peer still gets the
whole timeout: only the abort cuts a wait short. The blocking collectives of
torch.distributed wait so once :func:`bind_collective_waits` has run (sends and receives:
``spotline.pipeline.group_setup.wait_p2p``; an asynchronous operation's caller:
:func:`wait_work`).

An abandoned wait goes on in its thread until gloo ends it (by the timeout at the latest),
holding the operation and its tensors. An abandoned collective also holds one of its group's
threads, which destroying the group joins: the generation's groups are destroyed by that
thread once the wait ends (:func:`hold_groups_past_abort`), not by the teardown, which would
wait for it.
"""

from __future__ import annotations

import functools
import inspect
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# How often a wait looks at its generation's abort.
ABORT_POLL_S = 0.01

# torch.distributed's blocking collectives, as Spotline's code, DeepSpeed's (deepspeed.comm
# looks them up at call time) and torch's object collectives (all_gather_object, ...) call
# them: bound to wait through wait_work by bind_collective_waits.
ABORTABLE_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)

_aborted: threading.Event | None = None
"""The running generation's abort (:func:`watch_abort`); None: waits end as gloo ends them."""


class GenerationAborted(RuntimeError):
    """A wait on a send, a receive or a collective given up because its generation was
    aborted. A RuntimeError, as gloo's own failures are: a generation's recovery takes
    either alike."""


class _Job:
    """One wait handed to a :class:`_Waiter`."""

    def __init__(self, work: dist.Work, timeout: timedelta | None) -> None:
        self.work: dist.Work | None = work
        self.timeout = timeout
        self.done = threading.Event()
        self.error: Exception | None = None


class _Waiter:
    """A thread that waits on gloo's operations for the caller, one at a time. A daemon: an
    abandoned wait must not hold the process (a worker ends with ``os._exit``)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ended = False
        self._kept: list[object] = []
        threading.Thread(target=self._run, name="spotline-gloo-wait", daemon=True).start()

    def submit(self, work: dist.Work, timeout: timedelta | None) -> _Job:
        job = _Job(work, timeout)
        self._jobs.put(job)
        return job

    def retire(self) -> None:
        """End the thread once its wait has ended."""
        self._jobs.put(None)

    def keep(self, objects: list[object]) -> None:
        """Hold ``objects`` until the thread ends (nothing, if it has ended)."""
        with self._lock:
            if not self._ended:
                self._kept.extend(objects)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            assert job.work is not None
            try:
                if job.timeout is None:
                    job.work.wait()
                else:
                    job.work.wait(job.timeout)
            except Exception as exc:  # raised by the caller
                job.error = exc
            job.work = None  # the caller's to drop (a state transfer's tensors are big)
            job.done.set()
            del job
        with self._lock:
            self._ended = True
            kept, self._kept = self._kept, []
        del kept  # the groups held past an abort are destroyed here


_waiter: _Waiter | None = None
_retired: list[_Waiter] = []
"""Waiters left in a wait of the running generation, once it was aborted."""


def watch_abort(aborted: threading.Event | None) -> None:
    """From now on (a generation begins), waits end when ``aborted`` is set (its abort);
    None: as gloo ends them."""
    global _aborted, _retired
    _aborted = aborted
    _retired = []  # an earlier generation's waiters hold its groups (hold_groups_past_abort)


def wait_work(work: dist.Work, timeout: timedelta | None = None) -> None:
    """Wait for a gloo operation under ``timeout`` (None: its own, a collective's); raise
    :class:`GenerationAborted` as soon as the running generation is aborted."""
    global _waiter
    aborted = _aborted
    if aborted is None:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
        return
    if _waiter is None:
        _waiter = _Waiter()
    job = _waiter.submit(work, timeout)
    while not job.done.wait(ABORT_POLL_S):
        if aborted.is_set():
            # Not work.wait() in this thread, nor a short one: gloo does not end a transfer
            # that has begun when its socket closes, and a wait of gloo's that times out
            # closes every connection of its group, a live generation's too (see the
            # module's docstring). The waiter's thread waits on; the next wait gets another.
            _waiter.retire()
            _retired.append(_waiter)
            _waiter = None
            raise GenerationAborted("the generation was aborted while this process waited on gloo")
    if job.error is not None:
        raise job.error


def hold_groups_past_abort() -> None:
    """Called before a generation's groups are destroyed. Destroying a gloo group joins its
    threads, and an abandoned collective holds one of them until its timeout: each waiter
    still in an abandoned wait holds every group, destroyed by its thread when the wait
    ends, so that the destruction by the caller does not wait."""
    global _retired
    groups: list[object] = list(c10d._world.pg_map)
    for waiter in _retired:
        waiter.keep(groups)
    _retired = []


def _abortable(collective: Callable[..., Any]) -> Callable[..., Any]:
    """``collective``, its blocking form posted asynchronously and waited for through
    :func:`wait_work`; its asynchronous form unchanged (its caller waits)."""
    position = list(inspect.signature(collective).parameters).index("async_op")

    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > position or kwargs.get("async_op", False):
            return collective(*args, **kwargs)
        kwargs["async_op"] = True
        work = collective(*args, **kwargs)
        # None: this rank is not in the group; _IllegalWork: queued in a coalescing block.
        if work is not None and not isinstance(work, c10d._IllegalWork):
            wait_work(work)
        return None

    return call


_collectives_bound = False


def bind_collective_waits() -> None:
    """Make torch.distributed's blocking collectives (:data:`ABORTABLE_COLLECTIVES`) wait
    through :func:`wait_work`. In a worker process only, from its first generation on."""
    global _collectives_bound
    if not _collectives_bound:
        _collectives_bound = True
        for name in ABORTABLE_COLLECTIVES:
            call = _abortable(getattr(c10d, name))
            setattr(c10d, name, call)
            setattr(dist, name, call)
