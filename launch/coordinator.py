"""The coordinator: the on-demand process that owns membership and never trains.

It hosts the job's store (torch.distributed's TCPStore; the elastic machinery's
rendezvous store), starts the worker processes, watches them (process exit, heartbeats),
delivers the preemptions of a trace, of a random process or of ``--inject`` flags, and for
each generation publishes a plan computed by ``spotline.plan.layout`` from what the live
workers report they hold. Workers keep their state in memory across generations; only a
fatal loss (a stage held by no live worker) reads the last checkpoint.

Store keys (all under one TCPStore):

- ``plan/<g>``: the plan of generation g (JSON); ``entry/<worker>``: the first generation
  a worker reads.
- ``report/<g>/<worker>``: what a worker holds at the end of generation g (JSON).
- ``hb/<worker>``, ``progress/<worker>``, ``leaving/<worker>``, ``joined/<worker>``.
- ``stop/<g>``: members of generation g stop at this step (arrivals and departures).
- ``stop-checkpoint/<g>``: the job stops (a Ctrl-C) at this step boundary of generation g;
  members write a checkpoint of it there unless the interval did (same value as ``stop/<g>``).
- ``ready/<g>/<worker>``, ``final/param_sha256``, ``abort/<g>``.
- ``loss/<step>``, ``lr/<step>``: the step's loss and learning rate (rank 0 writes them).
- ``checkpoint-errors``: a counter (``add``); ``checkpoint-error/<n>`` (n = 1, 2, ...): a
  checkpoint file a worker could not write (JSON: step, path, error, worker).
- ``error/<worker>``: why a worker exited with an error outside a generation (one line); an
  error inside one is its report's outcome "error". Either stops the job with that error.

A worker that exits with an error, or reports one, is not a preemption: the job stops and
says why (``JobError``). A first Ctrl-C (``request_stop``) stops the job at the next step
boundary that has a checkpoint (``Stopped``); the second one is the caller's to handle.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from spotline.config import RunConfig
from spotline.elastic import layout_to_json
from spotline.plan.chaos import (
    ScaleTo,
    TimedEvent,
    TraceReplay,
    parse_injections,
    parse_rescales,
    random_preemptions,
    replay_trace,
    trace_cycle,
)
from spotline.plan.layout import (
    FatalLoss,
    GenerationPlan,
    Holding,
    Layout,
    WorkerReport,
    choose_layout,
    initial_layout,
    pipeline_name,
    plan_generation,
)
from spotline.plan.logical import assign_logical_workers, worth_moving
from spotline.plan.traces import load_trace
from spotline.report import Timeline, summarize_recoveries

THROUGHPUT_EVERY_S = 1.0
POLL_S = 0.02


class JobError(RuntimeError):
    """The job cannot go on (a worker's error, a checkpoint that could not be written)."""


class Stopped(Exception):
    """The job stopped as asked (a Ctrl-C); ``step`` is where a resume starts (None: none
    was committed, a resume starts from step 0)."""

    def __init__(self, step: int | None, stopped_at: int) -> None:
        super().__init__(f"stopped at step {stopped_at}")
        self.step = step
        self.stopped_at = stopped_at


@dataclass
class WorkerProc:
    wid: str
    proc: subprocess.Popen[bytes]
    started: float
    alive: bool = True
    fate: str = "running"  # running, killed, terminated, left, exited
    # Started ahead of a trace arrival (recovery.warm_workers): not a node of the trace until
    # an arrival takes it, so it is neither counted, preempted nor planned before then.
    warm: bool = False


@dataclass
class Event:
    t_s: float
    kind: str
    detail: dict[str, Any] = field(default_factory=dict)


class Coordinator:
    def __init__(
        self,
        cfg: RunConfig,
        config_path: Path,
        output: Path,
        *,
        env: dict[str, str],
        resume_from: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.sl = cfg.spotline
        self.config_path = config_path
        self.output = output
        self.env = env
        self.t0 = time.monotonic()
        from spotline.stores import host_store

        rec = self.sl.recovery
        self.store, self.store_spec = host_store(
            rec.store, etcd_endpoint=rec.etcd_endpoint, timeout=timedelta(seconds=60)
        )
        self.store_addr = self.store_spec.to_arg()
        self.workers: dict[str, WorkerProc] = {}
        self.next_index = 0
        self.generation = 0
        self.events: list[Event] = []
        self.timeline = Timeline()
        self.injections = parse_injections(self.sl.recovery.inject)
        self.done_add_steps: set[int] = set()
        self.replay: TraceReplay | None = None
        self.replay_cycle = 0
        self.timed: list[TimedEvent] = self._timed_events()
        self.interval_steps = self.checkpoint_interval()
        self.rng = random.Random(self._preempt_seed())
        self.preemptions = 0
        self.recoveries = 0
        self.fallbacks = 0
        self.steps_redone = 0
        self.recovery_events: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        self.learning_rates: dict[int, float] = {}
        self.step_times: dict[int, float] = {}
        self.peaks: dict[str, float] = {}
        self.pending_failure_t: float | None = None
        self.layout: Layout | None = None
        self.resume_step = 0
        self.ckpt_committed: set[int] = set()
        self.first_step_t: float | None = None
        self.included: set[str] = set()
        self.boundary_for_joiners: set[str] = set()
        self.awaited_joiners: set[str] = set()
        self.clock_t: float | None = None
        self.clock_steps = 0  # step clock (recovery.trace_clock "steps"): steps started
        self.clock_progress: int | None = None
        self.clock_skip_s = 0.0
        self.initial_ids: list[str] = []
        self.worker_stats: dict[str, dict[str, Any]] = {}
        self.shown_progress = 0
        self.rate_mark: tuple[float, int] | None = None  # (time, step) of the last rate row
        self.best_progress = 0  # the furthest step ever started: redone steps are not new
        self.last_commit_check = 0.0
        self.rescales: list[ScaleTo] = list(parse_rescales(self.sl.elasticity.rescale))
        self.placements: list[dict[str, Any]] = []  # per generation: pipelines' logical workers
        self.reconfigurations: list[dict[str, Any]] = []  # generation changes without a failure
        self.generation_end_t: float | None = None
        self.failures_without_loss = 0
        # --resume: the stopped run's committed checkpoint the first generation restores.
        self.resume_from = resume_from
        self.checkpoint_write_errors: list[dict[str, Any]] = []
        self.ckpt_errors_seen = 0  # checkpoint-error/<n> keys read
        self.ckpt_failed: set[int] = set()  # steps with a file that failed: never committed
        self.ckpt_extra: set[int] = set()  # checkpoints written off the interval (a stop)
        self.stop_requested = False
        self.stop_target: int | None = None
        self.stop_applied: set[int] = set()  # generations told about the stop
        if resume_from is not None:
            from spotline.checkpoint import read_metadata

            root = cfg.checkpoint_root(output)
            metadata = read_metadata(root, resume_from)
            for step, loss in metadata.get("losses", {}).items():
                self.losses[int(step)] = loss
            for step, lr in metadata.get("learning_rates", {}).items():
                self.learning_rates[int(step)] = lr
        # No-progress watch (recovery.no_progress_timeout_s): the last progress seen, when a
        # step last committed, and the preemption and start counts at that moment.
        self.stall_progress = 0
        self.stall_since = time.monotonic()
        self.stall_marks = (0, 0)

    # -- time and events --------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def _placement(self) -> dict[str, str]:
        """What each live worker does now, for the timeline ("p0:s1", "standby", "joining")."""
        placement = {}
        if self.layout is not None:
            for w in self.live_ids():
                placement[w] = (
                    self.layout.describe(w)
                    if w in self.layout.members or w in self.layout.standby
                    else "joining"
                )
        return placement

    def _event(self, kind: str, **detail: Any) -> None:
        self.events.append(Event(self.now(), kind, detail))
        self.timeline.record(
            self.now(),
            kind,
            self.max_progress(),
            len(self.live_ids()),
            self._placement(),
            None,
            ";".join(f"{k}:{v}" for k, v in detail.items()).replace("=", ":"),
        )
        print(
            f"spotline: [{self.now():7.2f}s] {kind} {detail if detail else ''}",
            file=sys.stderr,
            flush=True,
        )

    def checkpoint_interval(self) -> int:
        """Steps between checkpoints: given, or Young/Daly for the checkpoint-restart baseline.

        Young/Daly: sqrt(2 * checkpoint cost * MTBF), with the MTBF of the replayed trace (or
        of the random preemption rate) in wall seconds, converted to steps.
        """
        given = self.sl.checkpoints.interval_steps
        rec = self.sl.recovery
        if given > 0 or rec.mode != "checkpoint-restart":
            return given
        removals = [e for e in self.timed if e.kind == "remove"]
        if removals:
            span = max(e.at_s for e in removals)
            mtbf = span / max(1, len(removals))
        elif rec.preempt_rate > 0:
            mtbf = 3600.0 / (rec.preempt_rate * self.cfg.num_workers) / rec.time_scale
        else:
            return 0
        from spotline.checkpoint import interval_steps

        return interval_steps(rec.step_time_estimate_s, rec.checkpoint_cost_s, max(mtbf, 1e-3))

    def _preempt_seed(self) -> int:
        seed = self.sl.recovery.preempt_seed
        return self.sl.training.seed if seed is None else seed

    def _timed_events(self) -> list[TimedEvent]:
        rec = self.sl.recovery
        cap = rec.max_workers or self.cfg.num_workers
        if rec.trace:
            replay = replay_trace(
                load_trace(rec.trace),
                max_workers=cap,
                time_scale=rec.time_scale,
                removal=rec.trace_removal,
            )
            self.trace_initial = replay.initial_workers
            self.replay = replay
            return list(replay.events)
        if rec.preempt_rate > 0:
            # A horizon long enough for the run; events past the end are never reached.
            return random_preemptions(
                rec.preempt_rate,
                self.cfg.num_workers,
                3600.0 * 24,
                self._preempt_seed(),
                rec.time_scale,
                rec.replace_after_s,
                removal=rec.trace_removal,
            )
        return []

    # -- workers ----------------------------------------------------------------------
    def spawn(self, entry_generation: int | None, *, warm: bool = False) -> str:
        """Start a worker. With ``entry_generation`` None it is included in a plan only once
        it has joined (imports and data loaded), so members never wait on its start-up."""
        wid = f"w{self.next_index}"
        self.next_index += 1
        if entry_generation is not None:
            self.include(wid, entry_generation)
        logs = self.output / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"{wid}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spotline.elastic",
                "--config",
                str(self.config_path),
                "--output",
                str(self.output),
                "--worker-id",
                wid,
                "--store",
                self.store_addr,
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session (so its own process group): a Ctrl-C at the terminal reaches the
            # coordinator only, which decides how the workers stop (no KeyboardInterrupt
            # tracebacks in them). Not process_group=0: that needs Python 3.11.
            start_new_session=True,
        )
        log.close()
        self.workers[wid] = WorkerProc(wid, proc, self.now(), warm=warm)
        return wid

    def _keep_warm(self) -> None:
        """Keep ``recovery.warm_workers`` processes started ahead of timed arrivals.

        A trace records when a cloud node became available, and its clock is compressed by
        ``time_scale``; a local process start-up (seconds of imports) is not. Without warm
        workers a replay at a high time scale kills arrivals before they finish starting and
        the run makes no progress."""
        if not self.timed and self.replay is None:
            return
        for _ in range(self.sl.recovery.warm_workers - len(self.warm_ids())):
            self.spawn(None, warm=True)

    def include(self, wid: str, generation: int) -> None:
        self.included.add(wid)
        self.store.set(f"entry/{wid}", str(generation))

    def joined_waiting(self) -> list[str]:
        """Live workers that finished starting up and are not in any plan yet."""
        return [
            w
            for w in self.live_ids()
            if w not in self.included and self.store.check([f"joined/{w}"])
        ]

    def live_ids(self) -> list[str]:
        """Live workers that are nodes of the run (warm workers not yet arrived excluded)."""
        return [w for w, p in self.workers.items() if p.alive and not p.warm]

    def warm_ids(self) -> list[str]:
        """Live workers started ahead of an arrival that no arrival has taken yet."""
        return [w for w, p in self.workers.items() if p.alive and p.warm]

    def signal_worker(self, wid: str, how: str) -> None:
        proc = self.workers[wid]
        if not proc.alive:
            return
        self.preemptions += 1
        self.pending_failure_t = self.pending_failure_t or self.now()
        if how == "kill":
            proc.proc.send_signal(signal.SIGKILL)
            proc.fate = "killed"
        else:
            proc.proc.send_signal(signal.SIGTERM)
            proc.fate = "terminated"
        self._event("preempted", worker=wid, signal=how)

    def max_progress(self) -> int:
        """The highest step a member of the current generation has started."""
        best = self.resume_step
        for w in self.live_ids():
            key = f"progress/{self.generation}/{w}"
            if self.store.check([key]):
                best = max(best, int(self.store.get(key).decode()))
                if self.first_step_t is None:
                    self.first_step_t = time.monotonic()
        return best

    def _poll_processes(self) -> list[str]:
        died = []
        for w, p in self.workers.items():
            if p.alive and p.proc.poll() is not None:
                p.alive = False
                code = p.proc.returncode
                if p.fate == "running" and code in (-signal.SIGKILL, -signal.SIGTERM):
                    # Killed by an --inject fault the worker delivered to itself.
                    self.preemptions += 1
                    self.pending_failure_t = self.pending_failure_t or self.now()
                    p.fate = "killed"
                    self._event("preempted", worker=w, signal="kill")
                elif p.fate == "running":
                    p.fate = "exited" if code == 0 else "crashed"
                if code not in (0, -signal.SIGKILL, -signal.SIGTERM) and self.store.check(
                    [f"error/{w}"]
                ):
                    # An error, not a lost process: redoing the work would only repeat it.
                    raise JobError(self.store.get(f"error/{w}").decode())
                died.append(w)
                if code not in (0, -signal.SIGKILL, -signal.SIGTERM):
                    self._event("worker-exit", worker=w, code=code)
        return died

    def _check_heartbeats(self) -> None:
        limit = self.sl.recovery.heartbeat_timeout_s
        now = time.time()
        for w in self.live_ids():
            key = f"hb/{w}"
            if self.store.check([key]):
                last = float(self.store.get(key).decode())
                if now - last > limit:
                    self._event("heartbeat-missed", worker=w)
                    self.workers[w].proc.send_signal(signal.SIGKILL)
                    self.workers[w].fate = "killed"

    def _deliver_timed_events(self) -> None:
        # Trace time 0 is when the initial workers have started up (start-up is not part of
        # the trace), or the first training step, whichever comes first.
        if self.clock_t is None:
            self.max_progress()
            started = all(
                self.store.check([f"joined/{w}"]) or not self.workers[w].alive
                for w in self.initial_ids
            )
            if self.first_step_t is None and not started:
                return
            self.clock_t = self.first_step_t or time.monotonic()
        elapsed = self._trace_elapsed()
        if self.replay is not None and not self.timed and self.replay.duration_s > 0:
            # The run outlasts the trace: replay it again (spotline.plan.chaos.trace_cycle).
            self.replay_cycle += 1
            self.timed = list(trace_cycle(self.replay, self.replay_cycle))
            self._event("trace-repeated", cycle=self.replay_cycle)
        while self.timed and self.timed[0].at_s <= elapsed:
            ev = self.timed.pop(0)
            if ev.kind == "remove":
                members = [w for w in self.live_ids() if self.workers[w].fate == "running"]
                for wid in self.rng.sample(members, min(ev.count, max(0, len(members)))):
                    self.signal_worker(wid, ev.how or "kill")
            else:
                cap = self.sl.recovery.max_workers or self.cfg.num_workers
                for _ in range(ev.count):
                    if len(self.live_ids()) < cap:
                        self._arrival()

    def _trace_elapsed(self) -> float:
        """Seconds of replay (wall seconds; trace seconds are these times ``time_scale``).

        With ``recovery.trace_clock`` "wall" it is the wall time since the clock started. With
        "steps" each training step started counts ``step_time_estimate_s`` (redone steps too,
        they are training time), and time spent unable to train is skipped: the events then
        land on the same steps on any machine, so a replay is reproducible event for event.
        """
        assert self.clock_t is not None
        if self.sl.recovery.trace_clock == "wall":
            return time.monotonic() - self.clock_t
        progress = self.max_progress()
        if self.clock_progress is not None and progress > self.clock_progress:
            self.clock_steps += progress - self.clock_progress
        # After a checkpoint fallback progress goes back; the redone steps count again.
        self.clock_progress = progress
        return self.clock_steps * self.sl.recovery.step_time_estimate_s + self.clock_skip_s

    def _skip_idle_time(self) -> None:
        """Step clock: nothing can train and nobody is starting, so jump to the next event."""
        if self.sl.recovery.trace_clock != "steps" or self.clock_t is None or not self.timed:
            return
        self.clock_skip_s += max(0.0, self.timed[0].at_s - self._trace_elapsed())

    def _deliver_step_injections(self) -> None:
        """``add:STEP`` and phase-less ``kill|term:STEP:WORKER`` (delivered together when a
        member starts that step); injections with a phase are delivered by the worker itself."""
        progress = self.max_progress()
        for inj in self.injections:
            if inj.signal == "add" and id(inj) not in self.done_add_steps:
                # Started ahead of time; members stop at the step and wait for it to join,
                # so "add:STEP" means: trains from STEP on.
                self.done_add_steps.add(id(inj))
                wid = self.spawn(None)
                self.awaited_joiners.add(wid)
                self._event("arrived", worker=wid, at_step=inj.step)
                key = f"stop/{self.generation}"
                if not self.store.check([key]):
                    self.store.set(key, str(max(inj.step, progress + 2)))
                continue
            if inj.step > progress or id(inj) in self.done_add_steps:
                continue
            if inj.phase is None:
                self.done_add_steps.add(id(inj))
                wid = f"w{inj.worker}"
                if wid in self.workers and self.workers[wid].alive:
                    self.signal_worker(wid, inj.signal)

    def _deliver_rescales(self) -> None:
        """``--rescale STEP:M``: from step STEP on, M worker processes train.

        Growth starts the new processes a little ahead (as ``--inject add:STEP`` does): the
        members stop at STEP and wait for them to join. A removal waits until the last
        growth's processes have joined, then SIGKILLs, once a member has started STEP, what
        costs least first: processes outside the layout (standby), then whole pipelines
        from the last one."""
        if not self.rescales:
            return
        due = self.rescales[0]
        progress = self.max_progress()
        live = [w for w in self.live_ids() if self.workers[w].fate == "running"]
        if due.num_workers > len(live):
            # Not while the last change is still being recovered from: its generation must
            # train before this one replaces it.
            if progress < due.step - 2 or self.pending_failure_t is not None:
                return
            self.rescales.pop(0)
            self._event("rescale", at_step=due.step, workers=due.num_workers, live=len(live))
            for _ in range(due.num_workers - len(live)):
                self._arrival(awaited=True, at_step=due.step)
            return
        if progress < due.step or self.awaited_joiners:
            return
        members = self._members()
        if not all(self.store.check([f"ready/{self.generation}/{w}"]) for w in members):
            return  # the generation is still being set up: remove from a training one
        self.rescales.pop(0)
        self._event("rescale", at_step=due.step, workers=due.num_workers, live=len(live))
        layout = self.layout

        def loss_cost(w: str) -> tuple[int, int, int]:
            if layout is None or w not in layout.members:
                return (0, 0, 0)
            pipeline, stage = layout.slot_of(w)
            return (1, -pipeline, -stage)

        for w in sorted(live, key=loss_cost)[: len(live) - due.num_workers]:
            self.signal_worker(w, "kill")

    def _arrival(self, *, awaited: bool = False, at_step: int | None = None) -> None:
        warm = self.warm_ids()
        # A warm worker that has finished starting first; else the oldest still starting.
        joined = [w for w in warm if self.store.check([f"joined/{w}"])]
        if joined or warm:
            wid = (joined or warm)[0]
            self.workers[wid].warm = False
        else:
            wid = self.spawn(None)
        self._event("arrived", worker=wid)
        if awaited or self.sl.recovery.trace_clock == "steps":
            # Members stop a little ahead and wait for it, as for "--inject add:STEP": its
            # start-up must not decide at which step it trains.
            self.awaited_joiners.add(wid)
            self._request_boundary(at_step)
        self._keep_warm()

    def _admit_joiners(self) -> None:
        """A started worker that has joined: members stop at the next boundary to let it in."""
        for wid in self.joined_waiting():
            if wid not in self.boundary_for_joiners:
                self.boundary_for_joiners.add(wid)
                self._event("joined", worker=wid)
                # A step boundary a little ahead, so that every member sees it in time.
                self._request_boundary()

    def _request_boundary(self, at_step: int | None = None) -> None:
        """Ask the members to stop at a step boundary (``at_step``, or a little ahead so that
        every member sees it in time)."""
        key = f"stop/{self.generation}"
        if not self.store.check([key]):
            ahead = self.max_progress() + 2
            self.store.set(key, str(ahead if at_step is None else max(at_step, ahead)))

    # -- generations ------------------------------------------------------------------
    def _publish(self, generation: int, plan: dict[str, Any]) -> None:
        if plan["action"] != "finish":
            self._stop_keys(generation)  # a stop chosen earlier holds for this one too
        self.store.set(f"plan/{generation}", json.dumps(plan))

    def _plan_json(
        self,
        action: str,
        layout: Layout | None,
        resume: int,
        holders: dict[int, list[str]],
        sources: Any,
        **extra: Any,
    ) -> dict[str, Any]:
        return {
            "action": action,
            "layout": layout_to_json(layout) if layout is not None else None,
            "logical": self._logical_assignment(layout),
            "resume_step": resume,
            "holders": {str(k): v for k, v in holders.items()},
            "sources": [list(x) for x in sources],
            "checkpoint_interval": self.interval_steps,
            **extra,
        }

    def _logical_assignment(self, layout: Layout | None) -> dict[str, list[int]] | None:
        """Which logical pipelines each physical pipeline of ``layout`` runs, in proportion to
        the speeds its members measured (a pipeline is as fast as its slowest member; one
        never measured counts as the median). Nothing moves with them but their ids: every
        pipeline holds all the state of its stages. The workers rebalance as they measure."""
        if layout is None:
            return None
        seconds: dict[str, float] = {}
        for w, stats in self.worker_stats.items():
            measured = stats.get("seconds_per_logical_worker")
            if measured:
                seconds[w] = float(measured)
        known = sorted(seconds.values())
        typical = known[len(known) // 2] if known else 1.0
        speeds = {
            pipeline_name(p): 1.0 / max(seconds.get(w, typical) for w in row)
            for p, row in enumerate(layout.slots)
        }
        even = assign_logical_workers(self.cfg.num_pipelines, dict.fromkeys(speeds, 1.0))
        assignment = assign_logical_workers(self.cfg.num_pipelines, speeds)
        if not worth_moving(even, assignment, speeds):
            # Measurements are noisy: an even split unless speeds clearly differ.
            assignment = even
        self.placements.append(
            {
                "generation": self.generation,
                "pipelines": [
                    {"workers": list(row), "logical_workers": list(assignment[pipeline_name(p)])}
                    for p, row in enumerate(layout.slots)
                ],
            }
        )
        return {p: list(ws) for p, ws in assignment.items()}

    def run(self) -> dict[str, Any]:
        S, P = self.cfg.num_stages, self.cfg.num_pipelines
        initial = getattr(self, "trace_initial", None) or self.cfg.num_workers
        initial = min(initial, self.sl.recovery.max_workers or self.cfg.num_workers)
        ids = [self.spawn(0) for _ in range(initial)]
        self.initial_ids = list(ids)
        self._keep_warm()
        self.layout = initial_layout(S, P, ids, elastic=True)
        if self.resume_from is None:
            self._publish(0, self._plan_json("train", self.layout, 0, {}, []))
        else:
            # Every member reads every stage from the checkpoint: no transfers.
            step = self.resume_from
            self.resume_step = step
            holders = {s: list(ids) for s in range(S)}
            self._publish(
                0,
                self._plan_json("restore", self.layout, step, holders, [], checkpoint_step=step),
            )
        self._event("start", workers=len(ids), step=self.resume_step)
        t_start = time.monotonic()
        while True:
            outcome = self._run_generation()
            if outcome in ("done", "stopped"):
                break
        if outcome == "stopped":
            self._stop_workers()
            raise Stopped(self.last_committed(), self.stop_target or self.max_progress())
        end = time.monotonic()
        self._show_progress(done=self.sl.training.steps)
        wall = end - t_start
        # Training time: from the first step to the last commit, recoveries included.
        self.train_wall_s = end - (self.first_step_t or t_start)
        self._publish(self.generation + 1, {"action": "finish"})
        for w in self.live_ids() + self.warm_ids():
            if w not in self.included:
                # Started but never planned (warm, or arrived at the end): let it read "finish".
                self.store.set(f"entry/{w}", str(self.generation + 1))
        for p in self.workers.values():
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        starts = [
            st["train_start_t"] for st in self.worker_stats.values() if st.get("train_start_t")
        ]
        ends = [st["train_end_t"] for st in self.worker_stats.values() if st.get("train_end_t")]
        if starts and ends:
            # Training time from the workers' clocks: first step start to last step end
            # (recoveries included, start-up and the final export excluded).
            self.train_wall_s = max(ends) - min(starts)
        self._poll_checkpoint_errors()  # those of the last steps, told as the workers exited
        self._commit_checkpoints(upto=self.sl.training.steps)
        summary = self._summary(wall)
        self.release_store()
        return summary

    def _stop_workers(self) -> None:
        """After a stop at a boundary: every worker exits, its checkpoint writes done; the
        stop's checkpoint is committed."""
        self._publish(self.generation + 1, {"action": "finish"})
        for w in self.live_ids() + self.warm_ids():
            if w not in self.included:
                self.store.set(f"entry/{w}", str(self.generation + 1))
        for p in self.workers.values():
            try:
                p.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        self._poll_checkpoint_errors()
        self._commit_checkpoints(upto=self.stop_target)
        self.release_store()

    def last_committed(self) -> int | None:
        """The newest checkpoint this job committed (or resumed from): where a resume starts."""
        known = set(self.ckpt_committed)
        if self.resume_from is not None:
            known.add(self.resume_from)
        return max(known, default=None)

    # -- stopping and errors ----------------------------------------------------------
    def request_stop(self) -> None:
        """A first Ctrl-C (called from a signal handler: it only sets a flag)."""
        self.stop_requested = True

    def _apply_stop(self) -> None:
        """After a first Ctrl-C: choose where the job stops, the next step boundary that has
        a checkpoint (the interval's, or one written there), a little ahead so that every
        member sees it in time, and tell the current generation."""
        if not self.stop_requested or self.stop_target is not None:
            return
        ahead = self.max_progress() + 2
        interval = self.interval_steps
        target = -(-ahead // interval) * interval if interval > 0 else ahead
        self.stop_target = min(target, self.sl.training.steps)
        if self.stop_target < self.sl.training.steps:
            line = f"stopping at step {self.stop_target} after its checkpoint"
        else:
            line = f"the run ends at step {self.stop_target} before a checkpoint would: finishing"
        print(f"spotline: {line} (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        self._stop_keys(self.generation)

    def _stop_keys(self, g: int) -> None:
        """``stop-checkpoint/<g>`` and ``stop/<g>`` for the stop chosen by ``_apply_stop``
        (generations planned after it get them before their plan is published)."""
        if self.stop_target is None or g in self.stop_applied:
            return
        self.stop_applied.add(g)
        target = max(self.stop_target, self.resume_step)
        if target >= self.sl.training.steps:
            return  # the run ends first: it finishes as usual
        if self.interval_steps <= 0 or target % self.interval_steps != 0:
            self.ckpt_extra.add(target)
        # Set before stop/<g>: a member that sees the stop must see where to checkpoint.
        self.store.set(f"stop-checkpoint/{g}", str(target))
        key = f"stop/{g}"
        if not self.store.check([key]) or int(self.store.get(key).decode()) > target:
            # An arrival's boundary that comes later moves to the stop (no member has
            # passed it: the target is ahead of every member).
            self.store.set(key, str(target))

    def _poll_checkpoint_errors(self) -> None:
        """Report each checkpoint file a worker could not write, at once, on one line."""
        while self.store.check([f"checkpoint-error/{self.ckpt_errors_seen + 1}"]):
            self.ckpt_errors_seen += 1
            key = f"checkpoint-error/{self.ckpt_errors_seen}"
            self._checkpoint_write_failed(json.loads(self.store.get(key).decode()))

    def _checkpoint_write_failed(self, entry: dict[str, Any]) -> None:
        """Every failed file goes into the summary; the terminal hears once per step."""
        self.checkpoint_write_errors.append(entry)
        step = int(entry["step"])
        if step in self.ckpt_failed:
            return
        self.ckpt_failed.add(step)
        line = f"checkpoint of step {step} not written: {entry['path']}: {entry['error']}"
        if self.sl.checkpoints.on_write_error == "stop":
            raise JobError(line)
        print(
            f"spotline: warning: {line}; training goes on without it "
            '(checkpoints.on_write_error "continue")',
            file=sys.stderr,
            flush=True,
        )

    def _members(self) -> list[str]:
        if self.layout is None:
            return []
        return list(self.layout.members)

    def _record_throughput(self) -> None:
        """A timeline row of committed samples/s every ``THROUGHPUT_EVERY_S`` (0 while the
        job waits or redoes steps it had already trained: they add nothing new)."""
        now = self.now()
        if self.rate_mark is None:
            self.rate_mark = (now, self.max_progress())
            return
        since, step = self.rate_mark
        if now - since < THROUGHPUT_EVERY_S:
            return
        progress = self.max_progress()
        new_steps = max(0, progress - max(step, self.best_progress))
        self.best_progress = max(self.best_progress, progress, step)
        samples = new_steps * self.cfg.samples_per_step
        self.timeline.record(
            now,
            "throughput",
            progress,
            len(self.live_ids()),
            self._placement(),
            samples / (now - since),
            "",
        )
        self.rate_mark = (now, progress)

    def _show_progress(self, done: int | None = None) -> None:
        """A line every tenth of the run, with its loss (the coordinator is the one process at
        the terminal, and the only one that prints progress). ``done``: steps committed
        (default: those before the step a member has started)."""
        if not self.sl.tracking.progress:
            return
        steps = self.sl.training.steps
        done = self.max_progress() if done is None else done
        tenth = max(1, steps // 10)
        mark = steps if done >= steps else done - done % tenth  # the last step always shows
        if mark <= self.shown_progress:
            return
        key = f"loss/{mark - 1}"
        if not self.store.check([key]):
            return  # rank 0 writes the loss just after the step: the next poll shows it
        self.shown_progress = mark
        loss = float(self.store.get(key).decode())
        print(f"spotline: step {mark}/{steps} loss {loss:.4f}", file=sys.stderr, flush=True)

    def _check_stalled(self) -> None:
        """Stop a run that cannot progress: no step committed for no_progress_timeout_s while
        workers were preempted (on the wall clock, faster than they start and join)."""
        limit = self.sl.recovery.no_progress_timeout_s
        progress = self.max_progress()
        now = time.monotonic()
        if progress > self.stall_progress:
            # Starting a step means the one before it committed (a redone one too).
            self.stall_since, self.stall_marks = now, (self.preemptions, self.next_index)
        self.stall_progress = progress  # after a fallback progress goes back: from there
        preempted = self.preemptions - self.stall_marks[0]
        if limit <= 0 or now - self.stall_since < limit or preempted == 0:
            return
        started = self.next_index - self.stall_marks[1]
        raise RuntimeError(
            no_progress_message(limit, preempted, started, clock=self.sl.recovery.trace_clock)
        )

    def _wait_for_joiners(self) -> list[str]:
        """Block until a started worker has joined (trace arrivals, replacements)."""
        while True:
            self._check_stalled()
            self._record_throughput()
            self._poll_processes()
            self._deliver_timed_events()
            self._deliver_step_injections()
            self._deliver_rescales()
            joiners = self.joined_waiting()
            if joiners:
                return joiners
            starting = [w for w in self.live_ids() if not self.store.check([f"joined/{w}"])]
            if not starting:
                self._skip_idle_time()
            if not starting and not self.timed:
                raise RuntimeError(
                    no_workers_message(
                        len(self.live_ids()),
                        crashed=sorted(w for w, p in self.workers.items() if p.fate == "crashed"),
                        trace=self.replay is not None,
                        random_preemptions=self.sl.recovery.preempt_rate > 0,
                    )
                )
            time.sleep(POLL_S)

    def _run_generation(self) -> str:
        g = self.generation
        expected = {w for w in self.live_ids() if w in self.included}
        if not expected:
            # Everyone in the last plan is gone: wait for new workers, then restore.
            self._event("waiting-for-workers", live=0)
            joiners = self._wait_for_joiners()
            self.generation = g + 1
            self._plan_next(
                [WorkerReport(w) for w in joiners], failure=True, reached=self.max_progress() + 1
            )
            return "continue"
        first_report_t: float | None = None
        reports: dict[str, dict[str, Any]] = {}
        while True:
            died = self._poll_processes()
            for w in died:
                if self.workers[w].fate in ("killed", "crashed") and w in self._members():
                    self.pending_failure_t = self.pending_failure_t or self.now()
                    # Members waiting in the commit barrier leave it at once.
                    self.store.set(f"abort/{g}", w)
            self._check_heartbeats()
            self._check_stalled()
            self._deliver_timed_events()
            self._deliver_step_injections()
            self._deliver_rescales()
            self._admit_joiners()
            self._apply_stop()
            self._poll_checkpoint_errors()
            self._show_progress()
            self._record_throughput()
            if time.monotonic() - self.last_commit_check > 0.5:
                # Checkpoints are committed while a generation runs, not only when it ends.
                self.last_commit_check = time.monotonic()
                self._commit_checkpoints()
            for w in self.live_ids():
                if self.store.check([f"leaving/{w}"]) and self.workers[w].fate in (
                    "running",
                    "terminated",
                ):
                    if self.workers[w].fate == "running":
                        self.preemptions += 1  # a SIGTERM the worker delivered to itself
                    self.workers[w].fate = "left"
                    self._event("leaving", worker=w)
                    self._request_boundary()
            for w in list(expected | set(self.live_ids())):
                key = f"report/{g}/{w}"
                if w not in reports and self.store.check([key]):
                    reports[w] = json.loads(self.store.get(key).decode())
                    if w in self._members():
                        # Only a member's report means the generation has ended: a standby
                        # reports at once and must not start the clock on the members,
                        # who may rightly train for hours.
                        first_report_t = first_report_t or self.now()
            waiting_on = [w for w in expected if self.workers[w].alive and w not in reports]
            if not waiting_on and expected:
                break
            if (
                first_report_t is not None
                and waiting_on
                and self.now() - first_report_t > self.sl.recovery.collective_timeout_s + 5
            ):
                for w in waiting_on:  # hung: its peers reported long ago
                    self._event("unresponsive", worker=w)
                    self.workers[w].proc.send_signal(signal.SIGKILL)
                    self.workers[w].fate = "killed"
            time.sleep(POLL_S)
        for rep in reports.values():
            for k, v in rep.get("losses", {}).items():
                self.losses[int(k)] = v
            for k, v in rep.get("step_times", {}).items():
                self.step_times[int(k)] = v
            w = rep["worker"]
            self.peaks[w] = max(self.peaks.get(w, 0.0), rep.get("peak_rss_mib", 0.0))
            self.worker_stats[w] = rep
        self.generation_end_t = first_report_t
        outcomes = {w: r["outcome"] for w, r in reports.items()}
        failed = sorted(
            f"worker {w}: {r['error']}" for w, r in reports.items() if r.get("outcome") == "error"
        )
        if failed:
            # Not a lost process: a full disk, an export error, a bug. Redoing the work
            # would repeat it; stop with the cause.
            raise JobError(failed[0])
        self._poll_checkpoint_errors()
        errors = sorted({r["error"] for r in reports.values() if r.get("outcome") == "non-finite"})
        if errors:
            # Not a failure to recover from: the same step would give the same gradients.
            raise RuntimeError(
                f"{errors[0]}; the step was not applied. Lower the learning rate, enable "
                "gradient_clipping or check the data"
            )
        members = self._members()
        if members and all(outcomes.get(w) == "done" for w in members):
            return "done"
        if (
            self.stop_target is not None
            and members
            and all(outcomes.get(w) == "boundary" for w in members)
            and self.max_progress() >= self.stop_target
        ):
            return "stopped"
        # A generation ended early: failure, arrival or departure.
        # The step in flight when the generation ended (started, maybe not committed).
        reached = self.max_progress() + 1
        self._commit_checkpoints()
        live_reports = [
            WorkerReport(
                worker=w,
                holdings=tuple(
                    Holding(int(s), int(v), bool(r)) for s, v, r in reports[w]["holdings"]
                )
                if w in reports
                else (),
                previous_slot=tuple(reports[w]["previous_slot"])
                if w in reports and reports[w]["previous_slot"]
                else None,
            )
            for w in self.live_ids()
            if self.workers[w].fate == "running"
            and (w in self.included or w in self.joined_waiting())
        ]
        failure = any(o == "failed" for o in outcomes.values())
        if failure and self.pending_failure_t is None:
            # Every member failed but no process was lost: an error in the training itself
            # (a model or optimizer error), which redoing the step would only repeat.
            self.failures_without_loss += 1
            if self.failures_without_loss >= 2:
                error = next((r["error"] for r in reports.values() if r.get("error")), "unknown")
                raise RuntimeError(f"training failed twice with no process lost: {error}")
        elif failure:
            self.failures_without_loss = 0
        self.generation = g + 1
        self._plan_next(live_reports, failure=failure, reached=reached)
        return "continue"

    def _commit_checkpoints(self, upto: int | None = None) -> None:
        """Commit every due checkpoint whose files are all there: the interval's up to the
        step in flight (or ``upto``, once the workers have exited) and any written off it."""
        interval = self.interval_steps
        due = set(self.ckpt_extra)
        last = self.max_progress() + 1 if upto is None else upto
        if interval > 0:
            due.update(range(interval, last + 1, interval))
        due -= self.ckpt_committed | self.ckpt_failed
        if not due:
            return
        from spotline.checkpoint import CheckpointWriter, step_dir

        root = self.cfg.checkpoint_root(self.output)
        writer = CheckpointWriter(root, self.sl.checkpoints.keep)
        labels = [f"stage-{s}" for s in range(self.cfg.num_stages)]
        for step in sorted(due):
            directory = step_dir(root, step)
            if not all((directory / f"{label}.meta.json").exists() for label in labels):
                continue  # not written yet (commit would say so, after the losses' lookups)
            # Rank 0 stores a step's loss before its own checkpoint file: every loss before
            # ``step`` is in the store once the files are. Kept with the checkpoint, so
            # that a resumed run's summary has every step's loss.
            self._collect_step_values(step)
            metadata = {
                name: {str(s): values[s] for s in range(step) if s in values}
                for name, values in (
                    ("losses", self.losses),
                    ("learning_rates", self.learning_rates),
                )
            }
            try:
                if writer.commit(step, labels, metadata=metadata):
                    self.ckpt_committed.add(step)
            except OSError as exc:
                path = step_dir(root, step) / "MANIFEST.json"
                self._checkpoint_write_failed(
                    {"step": step, "path": str(path), "error": str(exc), "worker": "coordinator"}
                )

    def _plan_next(self, reports: list[WorkerReport], *, failure: bool, reached: int) -> None:
        S, P = self.cfg.num_stages, self.cfg.num_pipelines
        g = self.generation
        # Injected arrivals are waited for (they were started ahead of their step).
        deadline = time.monotonic() + 180
        while self.awaited_joiners and time.monotonic() < deadline:
            self._check_stalled()
            self._poll_processes()
            ready = [
                w
                for w in self.awaited_joiners
                if self.store.check([f"joined/{w}"]) or not self.workers[w].alive
            ]
            for w in ready:
                self.awaited_joiners.discard(w)
                if self.workers[w].alive and w not in {r.worker for r in reports}:
                    reports = [*reports, WorkerReport(w)]
            if self.awaited_joiners:
                time.sleep(POLL_S)
        # A change without a failure is timed from here: everyone has stopped and every
        # awaited arrival has finished starting (its start-up is the cloud's boot time).
        ready_t = self.now()
        if self.sl.recovery.mode == "checkpoint-restart" and failure:
            self._restart_all(reports, reached)
            return
        result: GenerationPlan | FatalLoss = plan_generation(g, S, P, reports, elastic=True)
        never_trained = (
            self.resume_step == 0
            and not any(r.holdings for r in reports)
            and not self.ckpt_committed
        )
        if isinstance(result, FatalLoss) and never_trained:
            # Nothing was trained yet: every worker builds the initial weights itself.
            layout = choose_layout(S, P, reports, usable={}, elastic=True)
            for r in reports:
                if r.worker not in self.included:
                    self.include(r.worker, g)
            self.layout = layout
            self._publish(g, self._plan_json("train", layout, 0, {}, []))
            self._event("plan", generation=g, stages="fresh start" if layout else "waiting")
            if layout is None:
                self._wait_for_joiners()
            return
        if isinstance(result, FatalLoss):
            self._event("fatal-loss", stages=list(result.lost_stages))
            self._restore(reports, g, reached)
            return
        layout = result.layout
        for r in reports:
            if r.worker not in self.included:
                self.include(r.worker, g)
        holders: dict[int, list[str]] = {s: [] for s in range(S)}
        for r in reports:
            for h in r.holdings:
                if h.version == result.resume_step or (
                    h.version == result.resume_step - 1 and h.ready
                ):
                    holders[h.stage].append(r.worker)
        if layout is None:
            self._event("waiting-for-workers", live=len(reports))
            self.layout = None
            self._publish(g, self._plan_json("train", None, result.resume_step, holders, ()))
            # Nothing trains until a worker arrives and joins: wait for one.
            self._wait_for_joiners()
            return
        if failure:
            self.steps_redone += max(0, reached - result.resume_step)
        self.layout = layout
        self.resume_step = result.resume_step
        self._publish(
            g, self._plan_json("train", layout, result.resume_step, holders, result.sources)
        )
        self._event(
            "plan",
            generation=g,
            stages="/".join("+".join(map(str, gr)) for gr in layout.groups),
            resume=result.resume_step,
        )
        if failure:
            self.recoveries += 1
            started = self.pending_failure_t or self.now()
            self._await_recovered(g, started)
        elif self.generation_end_t is not None:
            self._await_recovered(g, max(ready_t, self.generation_end_t), failure=False)
        self.pending_failure_t = None

    def _await_recovered(
        self, g: int, started: float, *, failure: bool = True, in_memory: bool = True
    ) -> None:
        """Recovery time: from the preemption to the first step committed after it. For a
        change without a failure (an arrival, a departure at a boundary): from the end of
        the last generation to the first step the new one commits."""
        target = self.resume_step + 1
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            died = self._poll_processes()
            if died:
                break
            if self.max_progress() >= target or all(
                self.store.check([f"report/{g}/{w}"]) for w in self._members()
            ):
                break
            time.sleep(POLL_S)
        seconds = self.now() - started
        if not failure:
            self.reconfigurations.append(
                {"generation": g, "resume_step": self.resume_step, "reconfigure_s": seconds}
            )
            self._event("reconfigured", generation=g, seconds=round(seconds, 3))
            return
        self.recovery_events.append(
            {
                "generation": g,
                "resume_step": self.resume_step,
                "recovery_s": seconds,
                # A takeover from replicas in memory, or a restore from a checkpoint.
                "in_memory": in_memory,
            }
        )
        self._event("recovered", generation=g, seconds=round(seconds, 3))

    def _restore(self, reports: list[WorkerReport], g: int, reached: int = 0) -> None:
        from spotline.checkpoint import latest_complete

        root = self.cfg.checkpoint_root(self.output)
        step = latest_complete(root) if root.exists() else None
        S, P = self.cfg.num_stages, self.cfg.num_pipelines
        everyone = [WorkerReport(r.worker, (), r.previous_slot) for r in reports]
        for r in reports:
            if r.worker not in self.included:
                self.include(r.worker, g)
        if not everyone:
            self.layout = None
            # Without a checkpoint resume_step stays where training was, so that once workers
            # arrive this is a restart from scratch (steps redone counted), not a first start.
            if step is not None:
                self.resume_step = step
            self._publish(g, self._plan_json("train", None, self.resume_step, {}, ()))
            return
        if step is None:
            # No checkpoint yet: the only consistent state is the start.
            layout = choose_layout(S, P, everyone, usable={}, elastic=True)
            self.steps_redone += reached
            self.layout, self.resume_step = layout, 0
            self._publish(g, self._plan_json("train", layout, 0, {}, []))
            # Counted where a layout is published: a total loss with nobody left to restore
            # onto comes back here once workers have arrived, and is one fallback.
            self.fallbacks += 1
            self._event("restart-from-scratch")
            if layout is None:
                self._wait_for_joiners()
                return
        else:
            usable = {s: [r.worker for r in reports] for s in range(S)}
            layout = choose_layout(S, P, everyone, usable=usable, elastic=True)
            self.steps_redone += max(0, reached - step)
            self.layout, self.resume_step = layout, step
            holders = {s: list(usable[s]) for s in range(S)}
            sources = [(s, layout.members[0]) for s in range(S)] if layout else []
            self._publish(
                g, self._plan_json("restore", layout, step, holders, sources, checkpoint_step=step)
            )
            self.fallbacks += 1
            self._event("checkpoint-fallback", step=step)
            if layout is None:
                self._wait_for_joiners()
                return
        self._await_recovered(g, self.pending_failure_t or self.now(), in_memory=False)
        self.pending_failure_t = None

    def _restart_all(self, reports: list[WorkerReport], reached: int) -> None:
        """Checkpoint-restart baseline: every worker is replaced and reads the checkpoint."""
        survivors = [r.worker for r in reports]
        for w in survivors:
            self.workers[w].proc.send_signal(signal.SIGKILL)
            self.workers[w].fate = "restarted"
        for w in survivors:
            self.workers[w].proc.wait()
            self.workers[w].alive = False
        fresh = [self.spawn(self.generation) for _ in survivors]
        self._event("restart-all", workers=len(fresh))
        self._restore([WorkerReport(w) for w in fresh], self.generation, reached)

    def _collect_step_values(self, steps: int, *, refresh: bool = False) -> None:
        """Read the loss and learning rate of steps ``0..steps-1`` from the store.

        Rank 0 of each generation writes them as it goes (a worker killed later cannot take
        them along); a redone step writes the same values again. Without ``refresh`` a
        step already read is not read again."""
        for s in range(steps):
            for prefix, values in (("loss", self.losses), ("lr", self.learning_rates)):
                key = f"{prefix}/{s}"
                if (refresh or s not in values) and self.store.check([key]):
                    values[s] = float(self.store.get(key).decode())

    # -- summary ----------------------------------------------------------------------
    def _summary(self, wall: float) -> dict[str, Any]:
        steps = self.sl.training.steps
        self._collect_step_values(steps, refresh=True)
        # A step committed while its loss was being aggregated has no reported loss (None).
        losses = [self.losses.get(s) for s in range(steps)]
        learning_rates = [self.learning_rates.get(s) for s in range(steps)]
        key = "final/param_sha256"
        param_hash = self.store.get(key).decode() if self.store.check([key]) else None
        samples = steps * self.cfg.samples_per_step
        self.timeline.write_csv(self.output / "timeline.csv")
        try:
            self.timeline.plot_png(self.output / "timeline.png", f"spotline: {self.sl.model.name}")
        except Exception as exc:  # a plot is a convenience; never fail a finished run on it
            print(f"spotline: timeline plot skipped: {exc}", file=sys.stderr)
        rec = summarize_recoveries(self.timeline.rows)
        times = sorted(self.step_times.values())
        # Per-rank figures in the rank order of the last layout (the workers that finished).
        ranked = list(self.layout.members) if self.layout is not None else sorted(self.worker_stats)
        stats = [self.worker_stats.get(w, {}) for w in ranked]
        mismatches = [
            m for st in self.worker_stats.values() for m in st.get("replica_mismatches", [])
        ]
        return {
            "steps": steps,
            "losses": losses,
            "learning_rates": learning_rates,
            "final_loss": losses[-1],
            # Committed samples per second of training (first step to last, recoveries
            # included): the goodput. wall_s also counts process start-up.
            "samples_per_s": samples / self.train_wall_s,
            "goodput_samples_per_s": samples / self.train_wall_s,
            "train_wall_s": self.train_wall_s,
            "wall_s": wall,
            "step_time_s": times[len(times) // 2] if times else None,
            # Each step's time as its last run measured it (None: never reported).
            "step_times_s": [self.step_times.get(s) for s in range(steps)],
            "workers": self.cfg.num_workers,
            "stages": self.cfg.num_stages,
            "pipelines": self.cfg.num_physical_pipelines,
            "logical_workers": self.cfg.num_pipelines,
            # Which physical pipeline (its workers) ran which logical pipelines, per generation,
            # and the moves the workers made as they measured speeds (step, per pipeline).
            "logical_placements": self.placements,
            "logical_rebalances": [
                json.loads(text)
                for text in sorted(
                    {
                        json.dumps(entry, sort_keys=True)
                        for st in self.worker_stats.values()
                        for entry in st.get("rebalances", [])
                    }
                )
            ],
            "micro_batch_size": self.cfg.micro_batch_size,
            "micro_batches": self.cfg.num_micro_batches,
            "model": self.sl.model.name,
            "seed": self.sl.training.seed,
            "deterministic": self.sl.determinism.enabled,
            "redundancy": self.sl.redundancy.mode,
            "recovery_mode": self.sl.recovery.mode,
            "checkpoint_interval_steps": self.interval_steps,
            "checkpoint_write_errors": self.checkpoint_write_errors,
            "resumed_from_step": self.resume_from,
            "param_sha256": param_hash,
            "peak_rss_mib_per_worker": self.peaks,
            "peak_rss_mib_per_rank": [self.peaks.get(w, 0.0) for w in ranked],
            "redundant_compute_s_per_rank": [st.get("redundant_compute_s", 0.0) for st in stats],
            "replica_sync_s_per_rank": [st.get("replica_sync_s", 0.0) for st in stats],
            "replica_checks": max((st.get("replica_checks", 0) for st in stats), default=0),
            "replica_mismatches": mismatches,
            "preemptions": self.preemptions,
            "recoveries": self.recoveries,
            "checkpoint_fallbacks": self.fallbacks,
            "steps_redone": self.steps_redone,
            "recovery_events": self.recovery_events,
            "reconfigurations": self.reconfigurations,
            "recovery_summary": rec,
            "generations": self.generation + 1,
            "events": [{"t_s": round(e.t_s, 3), "kind": e.kind, **e.detail} for e in self.events],
        }

    def release_store(self) -> None:
        """An etcd job's keys are deleted when it ends (a TCPStore goes with the process)."""
        if self.store_spec.backend == "etcd":
            from spotline.stores import delete_etcd_prefix

            delete_etcd_prefix(self.store_spec)

    def shutdown(self) -> None:
        """Stop every worker (Ctrl-C or a coordinator error): nothing is left running."""
        for p in self.workers.values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGKILL)
        for p in self.workers.values():
            p.proc.wait()

    def log_to_wandb(self, summary: dict[str, Any]) -> None:
        """Per-step losses and the recovery events, to wandb (offline unless configured)."""
        tracking = self.sl.tracking
        if tracking.wandb == "disabled":
            return
        from spotline.tracking import Tracker

        tracker = Tracker(
            # Progress was shown live by _show_progress; replaying the steps into wandb
            # must not print every line a second time.
            dataclasses.replace(tracking, progress=False),
            enabled=True,
            output_dir=self.output,
            total_steps=len(summary["losses"]),
            run_config=self.cfg.to_json(),
        )
        for step, (loss, lr) in enumerate(
            zip(summary["losses"], summary["learning_rates"], strict=True)
        ):
            if loss is not None:
                metrics = {"loss": loss, "step_time_s": self.step_times.get(step, 0.0)}
                tracker.log_step(step, metrics if lr is None else {**metrics, "lr": lr})
        for event in summary["events"]:
            tracker.log_event(event["kind"], {k: v for k, v in event.items() if k != "kind"})
        tracker.finish(summary)


def no_progress_message(limit_s: float, preempted: int, started: int, *, clock: str) -> str:
    """One line: the run stalls because preemptions outpace start-ups, and what to change."""
    advice = (
        "replay on the step clock (--trace-clock steps), lower --time-scale, or start more "
        "warm workers (--warm-workers)"
        if clock == "wall"
        else "lower --time-scale or --preempt-rate, or start more warm workers (--warm-workers)"
    )
    return (
        f"no step committed in {limit_s:g} s while {preempted} worker(s) were preempted and "
        f"{started} started: preemptions outpace start-ups, so the run would never progress; "
        f"{advice} (recovery.no_progress_timeout_s sets the limit)"
    )


def no_workers_message(
    live: int, *, crashed: list[str], trace: bool, random_preemptions: bool
) -> str:
    """Why a run that can no longer train stops: the real cause, not a guess at one."""
    head = f"{live} worker(s) left, too few to train, and"
    if crashed:
        return f"{head} {len(crashed)} worker(s) ({', '.join(crashed)}) exited with an error"
    if trace:
        return f"{head} none is scheduled to arrive (the trace has ended)"
    if random_preemptions:
        return f"{head} no replacement is scheduled (--preempt-rate's arrivals have ended)"
    return (
        f"{head} nothing in this run adds a worker (no --trace, --preempt-rate, "
        "--inject add:STEP or --rescale growth left); start more workers than you preempt"
    )


def child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    # torch's C++ warnings come with a C++ stack: a store or gloo peer that goes away (the
    # failures Spotline survives, or a lost coordinator, which the worker reports in one
    # line) filled the worker logs with them. Set it to WARNING to see them again.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env
