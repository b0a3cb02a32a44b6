"""The coordinator's loop in parts, each run alone: no process is started.

The parts are made and wired as a run makes them (``spotline.launch.control.parts.assemble``,
its store a TCPStore served in this process), with stand-ins for the worker processes: what a
watch turn, the stop protocol, admission and an etcd takeover decide is read back from the
store and the run's events, as the workers and ``summary.json`` read it."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import small_config
from test_control import DictStore

from spotline.config import parse_config
from spotline.launch.control.admission import no_workers_message
from spotline.launch.control.checkpoints import CheckpointCommits
from spotline.launch.control.entry_points import AGENT_MODULE, WORKER_MODULE
from spotline.launch.control.job_state import JobState
from spotline.launch.control.job_takeover import adopt, adoptable
from spotline.launch.control.local_agent import LocalAgent
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.outcomes import (
    FailureCount,
    GenerationEnd,
    classify,
    take_reports,
)
from spotline.launch.control.parts import JobParts, assemble
from spotline.launch.control.stopping import StopProtocol, stop_target
from spotline.launch.control.supervisor import JobError, WorkerProc, missed_heartbeats
from spotline.launch.control.watch import StallWatch, no_progress_message
from spotline.plan.layout import initial_layout
from spotline.wire.protocol import (
    JOB_END_KEY,
    PlanMessage,
    Report,
    abort_key,
    abort_watch_key,
    exit_key,
    heartbeat_key,
    joined_key,
    loss_key,
    lr_key,
    plan_key,
    progress_key,
    stop_checkpoint_key,
    stop_key,
)

MEMBERS = ["w0", "w1", "w2", "w3"]


@dataclass
class FakeProc:
    """A worker process as the supervisor sees it (``poll``, ``send_signal``)."""

    machine: str = "local"
    returncode: int | None = None
    signals: list[int] = field(default_factory=list)

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


@pytest.fixture
def parts(tmp_path: Path) -> JobParts:
    """One ``spotline train`` job's parts on 2 stages x 2 pipelines, its generation 0
    running on w0..w3 (stand-ins), each of which has just written a heartbeat."""
    cfg = parse_config(small_config(topology={"stages": 2, "workers": 4}, training={"steps": 20}))
    made = assemble(cfg, tmp_path / "config.json", tmp_path, env={}, listen=None, token_file=None)
    layout = initial_layout(2, 2, MEMBERS, elastic=True)
    assert layout is not None
    made.state.layout = layout
    made.state.included.update(MEMBERS)
    for w in MEMBERS:
        add_worker(made, w)
    return made


def add_worker(parts: JobParts, wid: str) -> FakeProc:
    proc = FakeProc()
    proc_any: Any = proc
    parts.supervisor.workers[wid] = WorkerProc(wid, proc_any, 0.0)
    parts.store.set(heartbeat_key(wid), repr(time.time()))
    return proc


def proc_of(parts: JobParts, wid: str) -> FakeProc:
    proc = parts.supervisor[wid].proc
    assert isinstance(proc, FakeProc)
    return proc


def kinds(parts: JobParts) -> list[str]:
    return [e.kind for e in parts.metrics.events]


def test_the_worker_and_agent_named_by_the_control_plane_are_the_modules_it_runs() -> None:
    """The control plane starts them by name (it must not import them): the names are
    the modules' own, so a rename or a move fails here, not in a run."""
    from spotline.launch import agent, elastic_worker

    assert elastic_worker.__name__ == WORKER_MODULE and callable(elastic_worker.main)
    assert agent.__name__ == AGENT_MODULE and callable(agent.main)
    assert agent.DEFAULT_PRELOAD == WORKER_MODULE  # the spawner preloads what it forks


def test_a_heartbeat_older_than_the_limit_is_missed_and_none_yet_is_not() -> None:
    beats = {"w0": 100.0, "w1": 94.5, "w2": None, "w3": 97.0}
    assert missed_heartbeats(beats, now=101.0, limit_s=4.0) == {"w1": 6.5}  # w3: 4 s, not more
    assert missed_heartbeats(beats, now=101.0, limit_s=3.5) == {"w1": 6.5, "w3": 4.0}
    assert missed_heartbeats(beats, now=101.0, limit_s=10.0) == {}


def test_the_no_progress_watch_stops_a_run_preempted_faster_than_it_progresses() -> None:
    reads = iter([(3, 2, 5)])
    stall = StallWatch(10.0, "wall", read=lambda: next(reads), clock=lambda: 10.0)
    assert stall.observe(3, 0, 4, now=0.0) is None  # step 3 started at 0 s, 4 workers started
    assert stall.observe(3, 2, 4, now=9.0) is None  # preempted, within the limit
    # The limit reached with 2 preemptions and 1 start since step 3: the run stalls.
    expected = no_progress_message(10.0, 2, 1, clock="wall")
    with pytest.raises(RuntimeError) as stalled:
        stall.check()
    assert str(stalled.value) == expected
    assert stall.observe(4, 2, 5, now=11.0) is None  # a step started: the clock restarts
    assert stall.observe(4, 2, 5, now=30.0) is None  # no preemption since: only slow
    assert stall.observe(4, 3, 5, now=30.0) == no_progress_message(10.0, 1, 0, clock="wall")
    off = StallWatch(0.0, "steps", read=lambda: (0, 0, 0), clock=lambda: 0.0)
    assert off.observe(0, 9, 9, now=1e6) is None  # recovery.no_progress_timeout_s 0: never


def test_a_watch_turn_kills_a_hung_worker_and_aborts_its_generation_once_it_is_gone(
    parts: JobParts,
) -> None:
    """w1's last heartbeat is 60 s old (its machine's agent beats on): a full turn kills it
    (``heartbeat-missed``). Once its exit is reported, the next turn sees a member lost: its
    generation is aborted (``abort/0`` and every member's watch key name w1) and the
    recovery clock starts."""
    store, watch = parts.store, parts.watch
    store.set(heartbeat_key("w1"), repr(time.time() - 60.0))
    store.set(progress_key(0, "w0"), "3")
    assert watch.turn() is True  # the first turn is a full one; progress 3 is new
    missed = [e for e in parts.metrics.events if e.kind == "heartbeat-missed"]
    assert [e.detail["worker"] for e in missed] == ["w1"]
    w1 = parts.supervisor["w1"]
    assert w1.fate == "killed" and proc_of(parts, "w1").signals == [signal.SIGKILL]
    assert all(proc_of(parts, w).signals == [] for w in ("w0", "w2", "w3"))
    assert not store.check([abort_key(0)]) and parts.metrics.pending_failure_t is None
    assert watch.turn() is None  # nothing added to the store since: a quiet turn
    proc_of(parts, "w1").returncode = -signal.SIGKILL
    store.set(exit_key("w1"), str(-signal.SIGKILL))  # its agent reports the exit
    assert watch.turn() is True
    assert not w1.alive and parts.metrics.pending_failure_t is not None
    assert store.get(abort_key(0)) == b"w1"
    assert all(store.get(abort_watch_key(0, w)) == b"w1" for w in MEMBERS)


def test_a_stop_is_told_at_the_next_full_watch_turn_on_a_checkpointed_boundary(
    parts: JobParts, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checkpoints every 2 steps here (given): a Ctrl-C at progress 5 stops at step 8."""
    parts.checkpoints.interval_steps = 2
    parts.store.set(progress_key(0, "w2"), "5")
    parts.watch.turn()
    assert parts.stop.target is None and not parts.store.check([stop_key(0)])
    parts.stop.request()  # as a SIGINT handler calls it
    assert parts.watch.quiet() is False  # a stop is due: never a quiet turn
    parts.watch.turn()
    assert parts.stop.target == 8 and parts.checkpoints.extra == {8}
    assert parts.store.get(stop_checkpoint_key(0)) == b"8" and parts.store.get(stop_key(0)) == b"8"
    assert "stopping at step 8 after its checkpoint" in capsys.readouterr().err


def test_the_stop_protocol_holds_for_every_later_generation_once(tmp_path: Path) -> None:
    assert stop_target(7, 5, 100) == 10 and stop_target(8, 5, 100) == 10
    assert stop_target(7, 0, 100) == 9  # no checkpoints: two steps ahead
    assert stop_target(97, 5, 100) == 100  # the run's end comes first
    cfg = parse_config(small_config())
    store = DictStore()
    metrics = RunMetrics(cfg, store, snapshot=lambda: (0, 4, {}))
    checkpoints = CheckpointCommits(cfg, store, metrics, tmp_path, interval_steps=5)
    state = JobState(generation=3)
    said: list[str] = []
    stop = StopProtocol(store, checkpoints, state, steps=100, say=said.append)
    stop.apply(progress=7)
    assert stop.target is None and not store.data  # not requested: nothing
    stop.request()
    stop.apply(progress=7)
    assert stop.target == 10 and said == [
        "stopping at step 10 after its checkpoint (Ctrl-C again to stop at once)"
    ]
    assert store.get(stop_key(3)) == b"10" and store.get(stop_checkpoint_key(3)) == b"10"
    stop.apply(progress=9)  # chosen once
    assert stop.target == 10 and len(said) == 1
    # A later generation that resumes past the stop (a fallback went back, then on) stops
    # at its resume step; an arrival's later boundary moves to the stop, an earlier stays.
    state.resume_step = 12
    store.set(stop_key(4), "15")
    stop.stop_keys(4)
    assert store.get(stop_key(4)) == b"12" and store.get(stop_checkpoint_key(4)) == b"12"
    state.resume_step = 0
    store.set(stop_key(5), "9")
    stop.stop_keys(5)
    assert store.get(stop_key(5)) == b"9" and store.get(stop_checkpoint_key(5)) == b"10"
    store.set(stop_key(5), "11")
    stop.stop_keys(5)  # told once a generation
    assert store.get(stop_key(5)) == b"11"
    assert checkpoints.extra == {10, 12}
    # At or past the run's end: nothing is written, the run finishes as usual.
    last = StopProtocol(store, checkpoints, JobState(generation=9), steps=10, say=said.append)
    last.request()
    last.apply(progress=9)
    assert last.target == 10 and not store.check([stop_key(9)])
    assert said[-1].startswith("the run ends at step 10 before a checkpoint would")


def test_a_generation_ends_as_its_members_report() -> None:
    members = ["w0", "w1"]

    def unread() -> int:
        raise AssertionError("progress read where no stop can have been reached")

    done = {"w0": "done", "w1": "done", "w9": "standby"}
    assert classify(done, members, stop_target=None, progress=unread) is GenerationEnd.FINISHED
    at_stop: Any = {"w0": "boundary", "w1": "boundary"}
    assert classify(at_stop, members, stop_target=8, progress=lambda: 8) is GenerationEnd.STOPPED
    # At a boundary before the stop (an arrival's): a change, not the stop.
    assert classify(at_stop, members, stop_target=8, progress=lambda: 6) is GenerationEnd.CHANGED
    assert classify(at_stop, members, stop_target=None, progress=unread) is GenerationEnd.CHANGED
    failed: Any = {"w0": "failed", "w1": "boundary"}
    assert classify(failed, members, stop_target=8, progress=unread) is GenerationEnd.FAILED
    assert classify({}, [], stop_target=None, progress=unread) is GenerationEnd.CHANGED
    assert [e for e in GenerationEnd if e.ends_job] == [
        GenerationEnd.FINISHED,
        GenerationEnd.STOPPED,
    ]


def test_training_that_fails_twice_with_no_process_lost_stops_the_job() -> None:
    reports = {"w0": Report("w0", "failed", error="CUDA error: an illegal address")}
    count = FailureCount()
    count.count(reports, lost_process=False)
    count.count(reports, lost_process=True)  # a process lost in between: it starts over
    count.count(reports, lost_process=False)
    with pytest.raises(RuntimeError, match="failed twice with no process lost: CUDA error"):
        count.count(reports, lost_process=False)


def test_a_report_of_an_error_stops_the_job_and_a_late_departure_is_counted(
    parts: JobParts,
) -> None:
    sup, metrics, checkpoints = parts.supervisor, parts.metrics, parts.checkpoints
    take_reports({"w2": Report("w2", "leaving")}, sup, metrics, checkpoints)
    assert sup["w2"].fate == "left" and metrics.preemptions == 1 and kinds(parts) == ["leaving"]
    with pytest.raises(JobError, match="worker w3: disk full"):
        take_reports({"w3": Report("w3", "error", error="disk full")}, sup, metrics, checkpoints)
    nan = {"w0": Report("w0", "non-finite", error="loss is nan at step 4")}
    with pytest.raises(RuntimeError, match="loss is nan at step 4; the step was not applied"):
        take_reports(nan, sup, metrics, checkpoints)


def test_a_worker_that_joined_is_let_in_at_the_next_boundary_once(parts: JobParts) -> None:
    admission, store = parts.admission, parts.store
    add_worker(parts, "w4")
    admission.admit_joiners()
    assert admission.joined_waiting() == [] and kinds(parts) == []  # still starting up
    store.set(joined_key("w4"), "1")
    store.set(progress_key(0, "w0"), "6")
    admission.admit_joiners()
    admission.admit_joiners()
    assert admission.joined_waiting() == ["w4"] and kinds(parts) == ["joined"]
    assert store.get(stop_key(0)) == b"8"  # a little ahead of progress 6
    parts.state.included.add("w4")  # planned
    assert admission.joined_waiting() == []


def test_a_job_that_can_no_longer_train_waits_for_a_joiner_or_says_why(parts: JobParts) -> None:
    admission = parts.admission
    add_worker(parts, "w4")
    parts.store.set(joined_key("w4"), "1")
    assert admission.wait_for_joiners() == ["w4"]
    for w in [*MEMBERS, "w4"]:
        proc_of(parts, w).returncode = 1 if w == "w2" else -signal.SIGKILL
    with pytest.raises(RuntimeError) as none_left:
        admission.wait_for_joiners()
    assert str(none_left.value) == no_workers_message(
        0, crashed=["w2"], trace=False, random_preemptions=False, num_stages=2
    )


def test_an_etcd_job_is_taken_over_where_its_plans_left_it(parts: JobParts) -> None:
    """What a restarted coordinator reads back from the store (a TCPStore here: the takeover
    reads only the protocol's keys)."""
    store, state = parts.store, parts.state
    first = state.layout
    parts.supervisor.workers.clear()  # a new coordinator knows no process yet
    state.layout, state.included = None, set()
    assert not adoptable(store)  # no plan: nothing was started
    layout = initial_layout(2, 1, ["w0", "w5"], elastic=True)
    planner = parts.planner  # its plans as published (each with its logical assignment)
    store.set(plan_key(0), planner.plan("train", first, 0, {}, []).encode())
    store.set(plan_key(1), planner.plan("train", layout, 3, {}, []).encode())
    for step, (loss, lr) in {0: (2.75, 0.0), 1: (2.5, 0.001), 2: (2.25, 0.002)}.items():
        store.set(loss_key(step), str(loss))
        store.set(lr_key(step), str(lr))
    # Rank 0 killed between a step's two writes: its loss is there, its rate never comes.
    store.set(loss_key(3), "2.0")
    assert adoptable(store)
    adopt(store, parts.supervisor, state, parts.metrics, parts.progress, steps=4)
    assert (state.generation, state.layout, state.resume_step) == (1, layout, 3)
    assert parts.metrics.losses == {0: 2.75, 1: 2.5, 2: 2.25, 3: 2.0}
    assert parts.metrics.learning_rates == {0: 0.0, 1: 0.001, 2: 0.002}
    (adopted,) = parts.metrics.events
    assert adopted.kind == "adopted" and adopted.detail["generation"] == 1
    # A predecessor that died as the job ended (its "finish" published): the generation
    # before it is where the job is; one that ended it has nothing to take over.
    store.set(plan_key(2), PlanMessage.finish().encode())
    adopt(store, parts.supervisor, state, parts.metrics, parts.progress, steps=4)
    assert (state.generation, state.layout) == (1, layout)
    store.set(JOB_END_KEY, "1")
    assert not adoptable(store)


def test_a_local_agent_that_exits_stops_the_job(tmp_path: Path) -> None:
    agent = LocalAgent(tmp_path)
    agent.check()  # none started (a cluster): nothing to watch
    proc: Any = FakeProc()
    agent.proc = proc
    agent.check()
    proc.returncode = -signal.SIGKILL
    with pytest.raises(JobError, match=f"the local agent exited \\(-9\\); see {tmp_path}/logs"):
        agent.check()
