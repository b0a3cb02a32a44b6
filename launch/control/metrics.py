"""Run metrics: what the coordinator counts and records, and the run's summary.

:class:`RunMetrics` holds the run's counters (preemptions, recoveries, checkpoint
fallbacks, steps redone), its events and timeline (``spotline.reports.timeline``), the per-step
losses, learning rates and step times, and what each worker measured (its last
:class:`~spotline.wire.protocol.Report`), and the evaluations rank 0 reports
(:class:`~spotline.wire.protocol.EvalResult`). It prints the progress lines (a line every tenth
of the run, one per evaluation) and builds ``summary.json`` (:meth:`RunMetrics.summary`)
and the wandb log.

What the timeline needs of the job at each event (the step reached, the live workers and
what each does) comes from a ``snapshot`` callable the coordinator gives it (called only
once the run has started).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotline.config import RunConfig
from spotline.plan.evaluation import eval_steps
from spotline.plan.grid import Layout
from spotline.plan.placement import Exposure
from spotline.reports.timeline import (
    HUNG_EVENTS,
    THROUGHPUT_EVERY_S,
    Timeline,
    TimelineRow,
    summarize_recoveries,
)
from spotline.reports.tracking import Tracker, eval_fields, eval_line
from spotline.wire.protocol import (
    FINAL_HASH_KEY,
    CheckpointWriteError,
    EvalResult,
    Report,
    Store,
    WorkerStats,
    eval_key,
    loss_key,
    loss_scale_key,
    lr_key,
    skipped_key,
)

# The heavy modules a process may hold, listed in summary.json as those the coordinator's
# process loaded ("coordinator_heavy_modules"): torch alone, and only for the job store
# (torch.distributed's TCPStore; the etcd store subclasses its Store). The coordinator never
# trains, so it never loads the others (a slow test checks it at the end of a real run).
HEAVY_MODULES = (
    "torch",
    "deepspeed",
    "transformers",
    "spotline.checkpointing.checkpoint",
    "spotline.pipeline.engine",
    "spotline.models.layers",
)


def row_to_json(row: TimelineRow) -> dict[str, Any]:
    return {**dataclasses.asdict(row), "placement": [list(pair) for pair in row.placement]}


def row_from_json(raw: Mapping[str, Any]) -> TimelineRow:
    placement = tuple((str(w), str(s)) for w, s in raw["placement"])
    return TimelineRow(**{**raw, "placement": placement})


Snapshot = Callable[[], tuple[int, int, Mapping[str, str]]]
"""(the step reached, live workers, placement: worker -> what it runs) at this moment."""


@dataclass(frozen=True)
class Event:
    t_s: float
    kind: str
    detail: Mapping[str, Any] = field(default_factory=dict)
    # The step the job had reached when it happened: where wandb logs it.
    at_step: int = 0

    def to_json(self) -> dict[str, Any]:
        """As ``summary.json``'s ``events`` list it."""
        return {"t_s": round(self.t_s, 3), "kind": self.kind, **self.detail}

    def to_record(self) -> dict[str, Any]:
        return {"t_s": self.t_s, "kind": self.kind, "detail": dict(self.detail), "at": self.at_step}

    @staticmethod
    def from_record(raw: Mapping[str, Any]) -> Event:
        return Event(float(raw["t_s"]), str(raw["kind"]), dict(raw["detail"]), int(raw["at"]))


@dataclass(frozen=True)
class RunPart:
    """One part of a run: a start (step 0, or a ``--resume``'s checkpoint) to an end
    (``how``: "finished", "stopped" (a Ctrl-C at a boundary), "interrupted" (a second
    Ctrl-C) or "failed"), the steps it had trained then and its wall time."""

    from_step: int
    reached_step: int
    how: str
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> RunPart:
        return RunPart(
            int(raw["from_step"]), int(raw["reached_step"]), str(raw["how"]), float(raw["wall_s"])
        )


class RunMetrics:
    """Counters, events, timeline, per-step values and per-worker measurements of one run."""

    def __init__(
        self, cfg: RunConfig, store: Store, *, snapshot: Snapshot, t0: float | None = None
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.t0 = time.monotonic() if t0 is None else t0  # the run's clock (monotonic)
        self.elapsed_before = 0.0  # the earlier parts' time on the run's clock
        self.part_from = 0  # the step this part started from (a --resume's checkpoint)
        self.snapshot = snapshot
        self.events: list[Event] = []
        self.timeline = Timeline()
        self.preemptions = 0
        # Every recovery from a loss, in memory or from a checkpoint: one a `recovered` event,
        # so that it equals len(recovery_events) and recovery_summary's num_recoveries.
        self.recoveries = 0
        self.fallbacks = 0
        self.steps_redone = 0
        # When the loss being recovered from happened (None: none pending).
        self.pending_failure_t: float | None = None
        self.recovery_events: list[dict[str, Any]] = []
        self.reconfigurations: list[dict[str, Any]] = []  # generation changes without a failure
        self.placements: list[dict[str, Any]] = []  # per generation: pipelines' logical workers
        # The last plan's stages whose every copy is on one machine (whose loss would send
        # the run back to a checkpoint), and how many generations had any.
        self.exposed: tuple[Exposure, ...] = ()
        self.exposed_generations = 0
        self.losses: dict[int, float] = {}
        self.learning_rates: dict[int, float] = {}
        self.loss_scales: dict[int, float] = {}
        self.skipped: dict[int, float] = {}  # fp16's skipped steps (1.0 each)
        self.step_times: dict[int, float] = {}
        self.step_ends: dict[int, float] = {}
        # Every evaluation reported (rank 0 writes evaluation/<step>), each taken once by step: a
        # replayed one carries the same numbers.
        self.evaluations: dict[int, EvalResult] = {}
        self.peaks: dict[str, float] = {}
        self.worker_stats: dict[str, WorkerStats] = {}
        self.checkpoint_write_errors: list[CheckpointWriteError] = []
        self.first_step_t: float | None = None  # monotonic time a first step was seen started
        self.shown_progress = 0
        self.rate_mark: tuple[float, int] | None = None  # (time, step) of the last rate row
        self.best_progress = 0  # the furthest step ever started: redone steps are not new
        # The run's earlier parts (a --resume continues a stopped part's record).
        self.parts: list[RunPart] = []

    # -- a run in parts --------------------------------------------------------------------
    def record(self, *, reached_step: int, how: str) -> dict[str, Any]:
        """What this run has recorded so far, this part ending at ``reached_step`` (steps
        trained) as ``how`` (:class:`RunPart`; "running" in a checkpoint's manifest): what a
        ``--resume`` continues from, so that the finished run's summary covers every part
        (``summary.json``'s counters, events, timeline and step times). JSON."""
        wall = round(self.now() - self.elapsed_before, 3)
        part = RunPart(self.part_from, reached_step, how, wall)
        return {
            "parts": [p.to_json() for p in (*self.parts, part)],
            "elapsed_s": self.now(),
            "preemptions": self.preemptions,
            "recoveries": self.recoveries,
            "checkpoint_fallbacks": self.fallbacks,
            "steps_redone": self.steps_redone,
            "recovery_events": self.recovery_events,
            "reconfigurations": self.reconfigurations,
            "logical_placements": self.placements,
            "exposed_generations": self.exposed_generations,
            "checkpoint_write_errors": [e.to_json() for e in self.checkpoint_write_errors],
            "step_times_s": {str(s): t for s, t in self.step_times.items()},
            "step_ended_at_s": {str(s): t for s, t in self.step_ends.items()},
            "events": [e.to_record() for e in self.events],
            "timeline": [row_to_json(row) for row in self.timeline.rows],
        }

    def continue_record(self, record: Mapping[str, Any], *, resume_step: int) -> None:
        """Start this part where an earlier part's :meth:`record` ended, from its
        checkpoint at ``resume_step``: the counters go on, the steps it trained past
        ``resume_step`` are redone, its step times up to ``resume_step`` are kept and this
        part's clock continues its clock (its events come after the earlier ones)."""
        assert not self.events, "continued before anything of this part was recorded"
        self.part_from = resume_step
        self.parts = [RunPart.from_json(p) for p in record["parts"]]
        self.elapsed_before = float(record["elapsed_s"])
        self.t0 -= self.elapsed_before
        self.preemptions = int(record["preemptions"])
        self.recoveries = int(record["recoveries"])
        self.fallbacks = int(record["checkpoint_fallbacks"])
        reached = max(p.reached_step for p in self.parts)
        self.steps_redone = int(record["steps_redone"]) + max(0, reached - resume_step)
        self.recovery_events = list(record["recovery_events"])
        self.reconfigurations = list(record["reconfigurations"])
        self.placements = list(record["logical_placements"])
        self.exposed_generations = int(record["exposed_generations"])
        self.checkpoint_write_errors = [
            CheckpointWriteError.from_json(e) for e in record["checkpoint_write_errors"]
        ]
        for name, values in (
            ("step_times_s", self.step_times),
            ("step_ended_at_s", self.step_ends),
        ):
            values.update({int(s): t for s, t in record[name].items() if int(s) < resume_step})
        self.events = [Event.from_record(e) for e in record["events"]]
        self.timeline.rows = [row_from_json(r) for r in record["timeline"]]
        self.best_progress = resume_step

    # -- time and events --------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def note_exposure(
        self, generation: int, exposed: tuple[Exposure, ...], *, machines: int
    ) -> None:
        """A plan's exposure (``spotline.plan.placement.exposures``) on ``machines`` machines;
        an event when it changes on two or more (on one, every stage is, by necessity)."""
        if exposed:
            self.exposed_generations += 1
        if exposed != self.exposed and machines >= 2:
            self.event(
                "exposure",
                generation=generation,
                stages=[{"stage": e.stage, "machine": e.machine} for e in exposed],
            )
        self.exposed = exposed

    def event(self, kind: str, **detail: Any) -> None:
        """Record an event (events list, timeline row) and print it on stderr."""
        progress, live, placement = self.snapshot()
        self.events.append(Event(self.now(), kind, detail, progress))
        self.timeline.record(
            self.now(),
            kind,
            progress,
            live,
            placement,
            None,
            ";".join(f"{k}:{v}" for k, v in detail.items()).replace("=", ":"),
        )
        print(
            f"spotline: [{self.now():7.2f}s] {kind} {detail if detail else ''}",
            file=sys.stderr,
            flush=True,
        )

    def note_preemption(self) -> None:
        """A worker was preempted: counted, and the recovery clock starts (if not running)."""
        self.preemptions += 1
        self.pending_failure_t = self.pending_failure_t or self.now()

    def recovered(
        self, generation: int, resume_step: int, seconds: float, *, in_memory: bool
    ) -> None:
        """Training resumed after a loss (``in_memory``: a takeover, else a checkpoint read):
        the one place a recovery is counted."""
        self.recoveries += 1
        self.recovery_events.append(
            {
                "generation": generation,
                "resume_step": resume_step,
                "recovery_s": seconds,
                # A takeover from replicas in memory, or a restore from a checkpoint.
                "in_memory": in_memory,
            }
        )
        self.event("recovered", generation=generation, seconds=round(seconds, 3))

    def reconfigured(self, generation: int, resume_step: int, seconds: float) -> None:
        self.reconfigurations.append(
            {"generation": generation, "resume_step": resume_step, "reconfigure_s": seconds}
        )
        self.event("reconfigured", generation=generation, seconds=round(seconds, 3))

    # -- what workers say --------------------------------------------------------------
    def take_report(self, report: Report) -> None:
        """A worker's end-of-generation report: its losses, step times and measurements."""
        self.losses.update(report.losses)
        # A step's time and end from the same report: a pair one worker measured.
        self.step_times.update(report.step_times)
        self.step_ends.update(report.step_ends)
        w = report.worker
        self.peaks[w] = max(self.peaks.get(w, 0.0), report.peak_rss_mib)
        self.worker_stats[w] = report.stats

    def step_series(self) -> dict[str, tuple[Callable[[int], str], dict[int, float]]]:
        """Each step's values rank 0 writes, by their name in a checkpoint's metadata: the
        store key of a step's value, and the values read so far by step."""
        return {
            "losses": (loss_key, self.losses),
            "learning_rates": (lr_key, self.learning_rates),
            "loss_scales": (loss_scale_key, self.loss_scales),
            "skipped_steps": (skipped_key, self.skipped),
        }

    def collect_step_values(self, steps: int, *, refresh: bool = False) -> None:
        """Read the loss, learning rate and loss scale of steps ``0..steps-1`` (and whether
        fp16 skipped them) from the store.

        Rank 0 of each generation writes them as it goes (a worker killed later cannot take
        them along); a redone step writes the same values again. Without ``refresh`` a
        step already read is not read again."""
        series = self.step_series().values()
        for s in range(steps):
            for key_of, values in series:
                key = key_of(s)
                if (refresh or s not in values) and self.store.check([key]):
                    values[s] = float(self.store.get(key).decode())

    def collect_evaluations(self) -> None:
        """Take the evaluations reported since the last call: each once, with a timeline row
        (its loss) and a progress line. They come in step order (a generation evaluates its
        resume step first if that one is missing), so the first step not reported ends
        the look-up."""
        ev = self.cfg.spotline.evaluation
        if not ev.enabled:
            return
        steps = self.cfg.spotline.training.steps
        for step in eval_steps(ev.interval_steps, steps):
            if step in self.evaluations:
                continue
            key = eval_key(step)
            if not self.store.check([key]):
                return
            result = EvalResult.decode(self.store.get(key))
            self.evaluations[step] = result
            _, live, placement = self.snapshot()
            self.timeline.record(
                self.now(),
                "eval",
                step,
                live,
                placement,
                None,
                f"perplexity:{result.perplexity!r}",
                eval_loss=result.loss,
            )
            if self.cfg.spotline.tracking.progress:
                print(eval_line(result, steps), file=sys.stderr, flush=True)

    # -- live output ---------------------------------------------------------------------
    def record_throughput(self) -> None:
        """A timeline row of committed samples/s every ``THROUGHPUT_EVERY_S`` (0 while the
        job waits or redoes steps it had already trained: they add nothing new)."""
        now = self.now()
        if self.rate_mark is None:
            self.rate_mark = (now, self.snapshot()[0])
            return
        since, step = self.rate_mark
        if now - since < THROUGHPUT_EVERY_S:
            return
        reached, live, placement = self.snapshot()
        new_steps = max(0, reached - max(step, self.best_progress))
        self.best_progress = max(self.best_progress, reached, step)
        samples = new_steps * self.cfg.samples_per_step
        self.timeline.record(
            now, "throughput", reached, live, placement, samples / (now - since), ""
        )
        self.rate_mark = (now, reached)

    def show_progress(self, done: int) -> None:
        """A line every tenth of the run, with its loss (the coordinator is the one process at
        the terminal, and the only one that prints progress). ``done``: steps committed."""
        if not self.cfg.spotline.tracking.progress:
            return
        steps = self.cfg.spotline.training.steps
        tenth = max(1, steps // 10)
        mark = steps if done >= steps else done - done % tenth  # the last step always shows
        if mark <= self.shown_progress:
            return
        key = loss_key(mark - 1)
        if not self.store.check([key]):
            return  # rank 0 writes the loss just after the step: the next poll shows it
        self.shown_progress = mark
        loss = float(self.store.get(key).decode())
        print(f"spotline: step {mark}/{steps} loss {loss:.4f}", file=sys.stderr, flush=True)

    # -- the end -------------------------------------------------------------------------
    def train_wall_s(self, fallback_s: float) -> float:
        """Training time from the workers' clocks: first step start to last step end
        (recoveries included, start-up and the final export excluded); ``fallback_s`` when
        no worker measured it."""
        starts = [st.train_start_t for st in self.worker_stats.values() if st.train_start_t]
        ends = [st.train_end_t for st in self.worker_stats.values() if st.train_end_t]
        return max(ends) - min(starts) if starts and ends else fallback_s

    def summary(
        self,
        *,
        wall: float,
        train_wall_s: float,
        layout: Layout | None,
        generations: int,
        checkpoint_interval_steps: int,
        resumed_from_step: int | None,
        exposure_checkpoints: int = 0,
    ) -> dict[str, Any]:
        """The run's ``summary.json`` (also writes ``timeline.csv`` and ``timeline.png``)."""
        cfg, sl = self.cfg, self.cfg.spotline
        losses, learning_rates, loss_scales = self._final_values()
        steps = sl.training.steps
        param_hash = (
            self.store.get(FINAL_HASH_KEY).decode() if self.store.check([FINAL_HASH_KEY]) else None
        )
        # This part's steps (a resumed run's earlier parts trained the ones before).
        samples = (steps - self.part_from) * cfg.samples_per_step
        this_part = RunPart(self.part_from, steps, "finished", round(wall, 3))
        rec = summarize_recoveries(self.timeline.rows)
        times = sorted(self.step_times.values())
        # Per-rank figures in the rank order of the last layout (the workers that finished).
        ranked = list(layout.members) if layout is not None else sorted(self.worker_stats)
        stats = [self.worker_stats.get(w, WorkerStats()) for w in ranked]
        mismatches = [
            m.to_json() for st in self.worker_stats.values() for m in st.replica_mismatches
        ]
        return {
            "steps": steps,
            "losses": losses,
            "learning_rates": learning_rates,
            # fp16's loss scale of each step and the steps its overflow skipped (a scale of
            # 1 and none in fp32 and bf16).
            "loss_scales": loss_scales,
            "skipped_steps": sorted(self.skipped),
            "final_loss": losses[-1],
            # Committed samples per second of training (first step to last, recoveries
            # included): the goodput. wall_s also counts process start-up.
            "samples_per_s": samples / train_wall_s,
            "goodput_samples_per_s": samples / train_wall_s,
            "train_wall_s": train_wall_s,
            "wall_s": wall,
            # Every part of the run: one, or a stopped part and its --resume(s); the counters,
            # events and timeline below cover them all.
            "parts": [p.to_json() for p in (*self.parts, this_part)],
            "step_time_s": times[len(times) // 2] if times else None,
            # Each step's time as its last run measured it (None: never reported).
            "step_times_s": [self.step_times.get(s) for s in range(steps)],
            # When each step ended (Unix time, None: never reported): with step_times_s, the
            # interval it ran in (what `spotline bench redundancy --alternate` matches
            # against the turns it gave the job).
            "step_ended_at_s": [self.step_ends.get(s) for s in range(steps)],
            "workers": cfg.num_workers,
            "stages": cfg.num_stages,
            "pipelines": cfg.num_physical_pipelines,
            "logical_workers": cfg.num_logical_workers,
            # Which physical pipeline (its workers) ran which logical pipelines, per generation,
            # and the moves the workers made as they measured speeds (step, per pipeline).
            "logical_placements": self.placements,
            # One machine's loss survived in memory needs no stage with every copy on it:
            # impossible on one machine, avoided by the planner on two or more.
            "exposed_stages": [{"stage": e.stage, "machine": e.machine} for e in self.exposed],
            "exposed_generations": self.exposed_generations,
            "logical_rebalances": [
                json.loads(text)
                for text in sorted(
                    {
                        json.dumps(entry.to_json(), sort_keys=True)
                        for st in self.worker_stats.values()
                        for entry in st.rebalances
                    }
                )
            ],
            "micro_batch_size": cfg.micro_batch_size,
            "micro_batches": cfg.num_micro_batches,
            "model": sl.model.name,
            "seed": sl.training.seed,
            "deterministic": sl.determinism.enabled,
            # Whether the bitwise promise covers this run, and if not why (RunConfig's).
            "bitwise_reproducible": not cfg.bitwise_caveats,
            "bitwise_caveats": cfg.bitwise_caveats,
            "redundancy": sl.redundancy.mode,
            "recovery_mode": sl.recovery.mode,
            "checkpoint_interval_steps": checkpoint_interval_steps,
            # Checkpoints committed because a plan left a stage few copies (its first
            # committed step, then the exposed interval: spotline.plan.exposure).
            "exposure_checkpoints": exposure_checkpoints,
            "checkpoint_write_errors": [e.to_json() for e in self.checkpoint_write_errors],
            "resumed_from_step": resumed_from_step,
            "param_sha256": param_hash,
            "peak_rss_mib_per_worker": self.peaks,
            "peak_rss_mib_per_rank": [self.peaks.get(w, 0.0) for w in ranked],
            "redundant_compute_s_per_rank": [st.redundant_compute_s for st in stats],
            "replica_sync_s_per_rank": [st.replica_sync_s for st in stats],
            # Gradient messages stage 0 sent its replica holder from inside its last
            # backward pass (StreamUntiedGrads).
            "replica_sends_in_backward_per_rank": [st.replica_sends_in_backward for st in stats],
            # Counted from the tensors at each step's commit point, peak per kind
            # (spotline.pipeline.memory); RSS above also holds the interpreter and the allocator's caches.
            "model_state_bytes_per_rank": [st.model_state.to_json() for st in stats],
            # Each worker's generations as it set them up: the gloo group, the engine, the
            # state (from memory, a peer or the replica ring) and the bytes that moved.
            "generation_setups": {
                w: [g.to_json() for g in st.setups] for w, st in sorted(self.worker_stats.items())
            },
            "replica_checks": max((st.replica_checks for st in stats), default=0),
            "replica_mismatches": mismatches,
            "preemptions": self.preemptions,
            # Workers killed because they hung (a missed heartbeat, or silent long after their
            # peers reported): losses that are not preemptions.
            "hung_workers": sum(e.kind in HUNG_EVENTS for e in self.events),
            "recoveries": self.recoveries,
            "checkpoint_fallbacks": self.fallbacks,
            "steps_redone": self.steps_redone,
            "recovery_events": self.recovery_events,
            "reconfigurations": self.reconfigurations,
            "recovery_summary": rec,
            "generations": generations,
            "coordinator_heavy_modules": [m for m in HEAVY_MODULES if m in sys.modules],
            "events": [e.to_json() for e in self.events],
            **eval_fields(self.evaluations),
        }

    def _final_values(self) -> tuple[list[float | None], ...]:
        """Each step's loss, learning rate and loss scale."""
        steps = self.cfg.spotline.training.steps
        self.collect_step_values(steps, refresh=True)
        # A step committed while its loss was being aggregated has no reported loss (None).
        return tuple(
            [values.get(s) for s in range(steps)]
            for values in (self.losses, self.learning_rates, self.loss_scales)
        )

    def write_timeline(self, output: Path) -> None:
        self.timeline.write(
            output,
            png=self.cfg.spotline.tracking.timeline_png,
            title=f"spotline: {self.cfg.spotline.model.name}",
        )

    def log_to_wandb(self, summary: dict[str, Any], output: Path) -> None:
        """Per-step losses, the evaluations (at the step their parameters trained next) and
        the recovery events, to wandb (offline unless configured). A resumed run continues
        its stopped part's wandb run (spotline.tracking: one run id per output directory)
        and logs only the steps and events that part did not."""
        self._replay_to_wandb(
            output,
            self.cfg.spotline.training.steps,
            evaluations=sorted(self.evaluations),
            summary=summary,
        )

    def log_stopped_to_wandb(self, step: int, output: Path) -> None:
        """A stopped run's part (the steps before ``step``, the checkpoint ``--resume``
        continues from, their evaluations and the part's events) into the run's wandb run,
        which the resumed run continues from step ``step``."""
        self.collect_step_values(step, refresh=True)
        self.collect_evaluations()
        self._replay_to_wandb(
            output, step, evaluations=sorted(s for s in self.evaluations if s < step), summary=None
        )

    def _replay_to_wandb(
        self,
        output: Path,
        steps: int,
        *,
        evaluations: Sequence[int],
        summary: dict[str, Any] | None,
    ) -> None:
        """Log steps ``0..steps-1`` (those not logged yet), ``evaluations`` and every event
        not logged yet, each event at the step the job had reached (at most the last one:
        wandb's steps only grow, and the next part logs from ``steps`` on)."""
        tracking = self.cfg.spotline.tracking
        if tracking.wandb == "disabled":
            return
        tracker = Tracker(
            # Progress was shown live by show_progress; replaying the steps into wandb
            # must not print every line a second time.
            dataclasses.replace(tracking, progress=False),
            enabled=True,
            output_dir=output,
            total_steps=steps,
            run_config=self.cfg.to_json(),
        )
        events: dict[int, list[Event]] = {}
        for event in self.events[tracker.logged_events :]:
            events.setdefault(min(event.at_step, max(steps - 1, 0)), []).append(event)
        for step in range(max(steps, 1)):
            loss, lr = self.losses.get(step), self.learning_rates.get(step)
            if step < steps and loss is not None:
                metrics = {"loss": loss, "step_time_s": self.step_times.get(step, 0.0)}
                tracker.log_step(step, metrics if lr is None else {**metrics, "lr": lr})
            if step in self.evaluations and step in evaluations:
                tracker.log_eval(self.evaluations[step])
            for event in events.get(step, []):
                tracker.log_event(event.kind, event.detail, step=step)
        # The evaluation after the last step, at a step of its own (wandb's steps only grow).
        for step in (s for s in evaluations if s >= max(steps, 1)):
            tracker.log_eval(self.evaluations[step])
        tracker.finish(summary)
