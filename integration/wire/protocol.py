"""The coordinator-worker protocol: every store key, in one place, and the workers' messages.

The coordinator and its workers talk only through the job's store (the coordinator's
TCPStore, or an etcd key directory per job: ``spotline.wire.stores``). This module is the one
place a key is spelled; both sides build keys with the functions below and read and write
messages with the dataclasses below (the machines' agents' with those of
``spotline.wire.agent_messages``). Pure: no torch (the coordinator imports it).

Keys, by who writes them (g: a generation, w: a worker id such as ``w3``):

The coordinator writes

- ``entry/<w>`` (:func:`entry_key`): the first generation worker w reads (an int).
- ``plan/<g>`` (:func:`plan_key`): the plan of generation g (:class:`PlanMessage` as JSON).
- ``stop/<g>`` (:func:`stop_key`): members of generation g stop at this step boundary (an
  int: an arrival, a departure, a stop).
- ``stop-checkpoint/<g>`` (:func:`stop_checkpoint_key`): the job stops (a Ctrl-C) at this
  step boundary of generation g; members write a checkpoint of it there unless the interval
  did (the same step as ``stop/<g>``; set before it).
- ``abort/<g>`` (:func:`abort_key`): a member of generation g is lost (the value: who); the
  members' watchdogs shut their connections so that no collective waits for it. Members
  that fail write it too, and both write ``abort-watch/<g>/<w>`` (:func:`abort_watch_key`,
  the same value) for every member w: what w's watch thread waits on
  (:class:`spotline.wire.heartbeat.AbortWatch`), so that no member polls for an abort while it
  trains. Member w writes its own with :data:`WATCH_RELEASED` when it leaves g without one.

Each worker writes

- ``joined/<w>`` (:func:`joined_key`): it has started up (imports, data) and can be planned.
- ``hb/<w>`` (:func:`heartbeat_key`): its heartbeat (``time.time()`` as text).
- ``leaving/<w>`` (:func:`leaving_key`): it got a preemption notice (SIGTERM) and leaves at
  the next step boundary.
- ``progress/<g>/<w>`` (:func:`progress_key`): the step it has started in generation g.
- ``ready/<g>/<w>`` (:func:`ready_key`): it has set generation g up (seconds it took).
- ``report/<g>/<w>`` (:func:`report_key`): what it holds at the end of generation g
  (:class:`Report` as JSON).
- ``error/<w>`` (:func:`error_key`): why it exited with an error outside a generation (one
  line); an error inside one is its report's outcome ``"error"``. Either stops the job.
- ``checkpoint-errors`` (:data:`CHECKPOINT_ERRORS_COUNTER`): a counter (``store.add``) and
  ``checkpoint-error/<n>`` (:func:`checkpoint_error_key`, n = 1, 2, ...): a checkpoint file
  it could not write (:class:`CheckpointWriteError` as JSON).

Rank 0 of a generation writes

- ``loss/<step>``, ``lr/<step>``, ``loss-scale/<step>`` (:func:`loss_key`, :func:`lr_key`,
  :func:`loss_scale_key`): the step's loss, learning rate and loss scale (``repr`` of a
  float), and ``skipped/<step>`` (:func:`skipped_key`, ``"1"``) where fp16's overflow skipped
  the step; a redone step writes the same values again.
- ``evaluation/<step>`` (:func:`eval_key`): the evaluation once ``step`` optimizer steps were
  applied (:class:`EvalResult` as JSON); written after the best model it may be is saved, so
  an evaluation seen here is complete. A replayed evaluation writes the same value again;
  the coordinator writes those a ``--resume`` carries over before the first plan.
- ``final/param_sha256`` (:data:`FINAL_HASH_KEY`): the hash of the final parameters.

Each generation's gloo process group keeps its own rendezvous keys under ``pg/<g>``
(:func:`process_group_prefix`, through ``torch.distributed.PrefixStore``).

Machines (m: a machine's name) and their agents (``spotline.launch.agent``): an agent starts
and reaps its machine's workers on the coordinator's orders.

- ``machines`` (:data:`MACHINES_COUNTER`): a counter, and ``machine/<n>``
  (:func:`machine_key`, n = 1, 2, ...): the n-th machine that joined (``MachineInfo`` of
  ``spotline.wire.agent_messages`` as JSON). Written by its agent.
- ``agent-hb/<m>`` (:func:`agent_heartbeat_key`): the agent's heartbeat (``time.time()``).
- ``orders/<m>`` (:func:`order_counter_key`), a counter, and ``order/<m>/<n>``
  (:func:`order_key`): the n-th order to machine m (``Order`` as JSON). Written by the
  coordinator.
- ``exit/<w>`` (:func:`exit_key`): how worker w's process ended (an int as
  ``subprocess.Popen.returncode``: negative for a signal). Written by its agent.
- ``job-end`` (:data:`JOB_END_KEY`): the job is over; agents exit once their workers have.
- ``admit/<n>`` (:func:`admit_key`): the coordinator's answer to ``machine/<n>``
  (``Admission`` as JSON): the name the machine is known by (a name already taken, by a
  machine lost earlier for one, gets a ``#k`` suffix: a returning machine is a new one), or
  why it was refused (no job token, a wrong one).
- ``fenced/<m>`` (:func:`fenced_key`): machine m was declared lost (its agent went quiet);
  nothing it writes is acted on any more. Its agent, if it comes back, stops its workers
  and exits; started again, it joins as a new machine.
- ``agent-leaving/<m>`` (:func:`agent_leaving_key`): m's agent got a preemption notice; no
  worker is started there any more. Written by the agent.
- ``agent-done/<m>`` (:func:`agent_done_key`): m's agent has no worker left and exits (the
  job ended, or it was leaving). Written by the agent as its last word; the coordinator
  keeps the store up until every agent it can still hear has said it, since an agent that
  finds the store gone cannot tell a job that ended from a coordinator that crashed.

Every value but counters and ``pg/<g>`` is sealed with the job token (``spotline.wire.auth``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, get_args

from spotline.plan.grid import Layout
from spotline.plan.layout import Holding, ShardSource, WorkerReport


class Store(Protocol):
    """The calls the protocol makes on the job's store (a c10d ``Store``: torch's TCPStore
    or ``spotline.wire.stores``' etcd store), typed here so that the coordinator's code needs no
    torch import to name it."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, value: int) -> int: ...


# -- keys ----------------------------------------------------------------------------------

KEY_PREFIXES = (
    "entry",
    "plan",
    "stop",
    "stop-checkpoint",
    "abort",
    "joined",
    "hb",
    "leaving",
    "progress",
    "ready",
    "report",
    "error",
    "checkpoint-error",
    "loss",
    "lr",
    "evaluation",
    "final",
    "pg",
    "machine",
    "agent-hb",
    "orders",
    "order",
    "exit",
    "admit",
    "fenced",
    "agent-leaving",
    "agent-done",
)
"""The first component of every key with a ``/`` (tests check that no other module spells one)."""

CHECKPOINT_ERRORS_COUNTER = "checkpoint-errors"
FINAL_HASH_KEY = "final/param_sha256"
MACHINES_COUNTER = "machines"
JOB_END_KEY = "job-end"


def entry_key(worker: str) -> str:
    return f"entry/{worker}"


def plan_key(generation: int) -> str:
    return f"plan/{generation}"


def stop_key(generation: int) -> str:
    return f"stop/{generation}"


def stop_checkpoint_key(generation: int) -> str:
    return f"stop-checkpoint/{generation}"


def abort_key(generation: int) -> str:
    return f"abort/{generation}"


def abort_watch_key(generation: int, worker: str) -> str:
    return f"abort-watch/{generation}/{worker}"


# The value of ``abort-watch/<g>/<w>`` that ends w's watch without an abort (any other value
# names who was lost).
WATCH_RELEASED = "released"


def abort_entries(generation: int, members: Iterable[str], lost: str) -> list[tuple[str, str]]:
    """The keys and values an abort of generation ``generation`` writes, by whoever writes
    it: ``abort/<g>`` and each member's ``abort-watch/<g>/<w>``, each naming ``lost``."""
    assert lost != WATCH_RELEASED, lost
    watches = [(abort_watch_key(generation, m), lost) for m in members]
    return [(abort_key(generation), lost), *watches]


def joined_key(worker: str) -> str:
    return f"joined/{worker}"


def heartbeat_key(worker: str) -> str:
    return f"hb/{worker}"


def leaving_key(worker: str) -> str:
    return f"leaving/{worker}"


def progress_key(generation: int, worker: str) -> str:
    return f"progress/{generation}/{worker}"


def ready_key(generation: int, worker: str) -> str:
    return f"ready/{generation}/{worker}"


def report_key(generation: int, worker: str) -> str:
    return f"report/{generation}/{worker}"


def error_key(worker: str) -> str:
    return f"error/{worker}"


def checkpoint_error_key(n: int) -> str:
    assert n >= 1, "the checkpoint-errors counter starts at 1"
    return f"checkpoint-error/{n}"


def loss_key(step: int) -> str:
    return f"loss/{step}"


def lr_key(step: int) -> str:
    return f"lr/{step}"


def loss_scale_key(step: int) -> str:
    return f"loss-scale/{step}"


def skipped_key(step: int) -> str:
    return f"skipped/{step}"


def eval_key(step: int) -> str:
    return f"evaluation/{step}"


def process_group_prefix(generation: int) -> str:
    return f"pg/{generation}"


def machine_key(n: int) -> str:
    assert n >= 1, "the machines counter starts at 1"
    return f"machine/{n}"


def agent_heartbeat_key(machine: str) -> str:
    return f"agent-hb/{machine}"


def order_counter_key(machine: str) -> str:
    return f"orders/{machine}"


def order_key(machine: str, n: int) -> str:
    assert n >= 1, "a machine's orders counter starts at 1"
    return f"order/{machine}/{n}"


def exit_key(worker: str) -> str:
    return f"exit/{worker}"


def admit_key(n: int) -> str:
    assert n >= 1, "the machines counter starts at 1"
    return f"admit/{n}"


def fenced_key(machine: str) -> str:
    return f"fenced/{machine}"


def agent_leaving_key(machine: str) -> str:
    return f"agent-leaving/{machine}"


def agent_done_key(machine: str) -> str:
    return f"agent-done/{machine}"


# -- messages ------------------------------------------------------------------------------

PlanAction = Literal["train", "restore", "finish"]
"""``train``: members train from ``resume_step`` with state in memory (or, with no holders,
from the initial weights); ``restore``: every holder first reads ``checkpoint_step`` from
disk; ``finish``: the job is over, workers exit."""

Outcome = Literal["standby", "done", "boundary", "failed", "error", "non-finite", "leaving"]
"""How a generation ended for a worker: ``standby`` (not a member), ``done`` (the last
step), ``boundary`` (a stop at a step boundary), ``failed`` (a peer was lost), ``error``
(not a lost peer: the job stops), ``non-finite`` (gradients: the job stops), ``leaving``
(it got a preemption notice and exits)."""

OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)


@dataclass(frozen=True)
class PlanMessage:
    """The coordinator's plan for one generation, as the workers read it.

    ``logical``: which logical data-parallel workers each physical pipeline (by
    ``spotline.plan.layout.pipeline_name``) runs; ``holders``: per logical stage, the
    members that hold it whole at ``resume_step`` (empty: a fresh start, everyone builds the
    initial weights); ``sources``: per logical stage, the member that sends it to members
    that lack it (``shard_sources`` instead for a stage no member holds whole: each shard's
    member sends its shard); ``checkpoint_interval``: steps between checkpoints (the coordinator
    decides: given, or Young/Daly, or shorter while the plan is exposed:
    ``spotline.plan.exposure``), counted from ``checkpoint_from``: a member checkpoints each
    step ``checkpoint_from + k * checkpoint_interval`` (k >= 0) it commits (0: the multiples
    of the interval; an exposed plan's first committed step, or the step its exposure's
    interval counts from); ``checkpoint_step``: the step a ``restore`` reads."""

    action: PlanAction
    layout: Layout | None = None
    logical: Mapping[str, tuple[int, ...]] | None = None
    resume_step: int = 0
    holders: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    sources: tuple[tuple[int, str], ...] = ()
    checkpoint_interval: int = 0
    checkpoint_step: int | None = None
    checkpoint_from: int = 0
    # The stages no member holds whole, assembled from every shard of one count (sharded
    # replicas; spotline.plan.layout.GenerationPlan.shard_sources): never in ``sources``.
    shard_sources: tuple[ShardSource, ...] = ()

    def __post_init__(self) -> None:
        assert self.action in get_args(PlanAction), self.action
        assert not {s for s, _ in self.sources} & {s.stage for s in self.shard_sources}, (
            "a stage comes from one member or from its shards, not both"
        )
        assert (self.checkpoint_step is not None) == (self.action == "restore"), (
            "a restore plan, and only one, names the checkpoint step it reads"
        )
        assert (self.logical is None) == (self.layout is None), "logical workers need a layout"

    @classmethod
    def finish(cls) -> PlanMessage:
        return cls("finish")

    def to_json(self) -> dict[str, Any]:
        if self.action == "finish":
            return {"action": "finish"}
        out: dict[str, Any] = {
            "action": self.action,
            "layout": self.layout.to_json() if self.layout is not None else None,
            "logical": (
                {p: list(ws) for p, ws in self.logical.items()}
                if self.logical is not None
                else None
            ),
            "resume_step": self.resume_step,
            "holders": {str(s): list(ws) for s, ws in self.holders.items()},
            "sources": [[s, w] for s, w in self.sources],
            "checkpoint_interval": self.checkpoint_interval,
        }
        if self.shard_sources:
            out["shard_sources"] = [
                [x.stage, x.worker, x.shard, x.shards] for x in self.shard_sources
            ]
        if self.checkpoint_from:
            out["checkpoint_from"] = self.checkpoint_from
        if self.checkpoint_step is not None:
            out["checkpoint_step"] = self.checkpoint_step
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> PlanMessage:
        if raw["action"] == "finish":
            return cls.finish()
        logical = raw["logical"]
        return cls(
            action=raw["action"],
            layout=Layout.from_json(raw["layout"]) if raw["layout"] is not None else None,
            logical=(
                {str(p): tuple(int(w) for w in ws) for p, ws in logical.items()}
                if logical is not None
                else None
            ),
            resume_step=int(raw["resume_step"]),
            holders={int(s): tuple(ws) for s, ws in raw["holders"].items()},
            sources=tuple((int(s), str(w)) for s, w in raw["sources"]),
            checkpoint_interval=int(raw["checkpoint_interval"]),
            checkpoint_step=(
                int(raw["checkpoint_step"]) if raw.get("checkpoint_step") is not None else None
            ),
            checkpoint_from=int(raw.get("checkpoint_from", 0)),
            shard_sources=tuple(
                ShardSource(int(s), str(w), int(i), int(n))
                for s, w, i, n in raw.get("shard_sources", ())
            ),
        )

    def encode(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def decode(cls, text: bytes | str) -> PlanMessage:
        return cls.from_json(json.loads(text))


@dataclass(frozen=True)
class Rebalance:
    """Logical workers moved between pipelines within a generation, at ``step``: the new
    assignment, one tuple of logical workers per physical pipeline in pipeline order."""

    step: int
    pipelines: tuple[tuple[int, ...], ...]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "pipelines": [list(ws) for ws in self.pipelines]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Rebalance:
        return cls(int(raw["step"]), tuple(tuple(int(w) for w in ws) for ws in raw["pipelines"]))


@dataclass(frozen=True)
class ReplicaMismatch:
    """A replica that differed from its owner's stage after ``step`` (replica verification)."""

    step: int
    stage: int

    def to_json(self) -> dict[str, int]:
        return {"step": self.step, "stage": self.stage}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ReplicaMismatch:
        return cls(int(raw["step"]), int(raw["stage"]))


@dataclass(frozen=True)
class GenerationSetup:
    """How long a worker took to set generation ``generation`` up, phase by phase (seconds,
    its own clock): ``join_s`` the gloo group, ``build_s`` the engine (the model built and
    DeepSpeed's engine around it), ``state_s`` the state loaded into it (its own stages
    from memory or received from their holders, and the replica received from its
    successor); ``state_bytes`` what it sent and received for that state."""

    generation: int
    join_s: float
    build_s: float
    state_s: float
    state_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> GenerationSetup:
        return cls(
            int(raw["generation"]),
            float(raw["join_s"]),
            float(raw["build_s"]),
            float(raw["state_s"]),
            int(raw["state_bytes"]),
        )


@dataclass(frozen=True)
class ModelStateBytes:
    """A rank's model state in bytes, counted from its tensors (``spotline.pipeline.memory``).

    Each field is its peak over the steps measured (at the commit point, where the step's
    gradients, stashes and the replica's received gradients are all alive). ``stash``: what
    a replay keeps (this stage's outputs, its input gradients, stage 0's inputs on the last
    stage); ``eager_graph``: the tensors eager mode's kept autograd graphs hold."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    replica_parameters: int = 0
    replica_gradients: int = 0
    replica_optimizer: int = 0
    stash: int = 0
    eager_graph: int = 0

    @property
    def total(self) -> int:
        return sum(self.to_json().values())

    def peak(self, other: ModelStateBytes) -> ModelStateBytes:
        """Field by field the larger of the two."""
        mine, theirs = self.to_json(), other.to_json()
        return ModelStateBytes(**{k: max(v, theirs[k]) for k, v in mine.items()})

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ModelStateBytes:
        return cls(**{k: int(raw[k]) for k in cls().to_json()})


@dataclass(frozen=True)
class WorkerStats:
    """A worker's measurements so far (cumulative over its generations), for the summary.

    ``train_start_t``/``train_end_t``: wall-clock (``time.time()``) start of its first step
    and end of its last one (None: it never trained); ``seconds_per_logical_worker``: its
    measured speed (None: never measured); ``setups``: each generation it set up as a
    member, phase by phase."""

    train_start_t: float | None = None
    train_end_t: float | None = None
    replica_checks: int = 0
    replica_mismatches: tuple[ReplicaMismatch, ...] = ()
    redundant_compute_s: float = 0.0
    replica_sync_s: float = 0.0
    replica_sends_in_backward: int = 0
    seconds_per_logical_worker: float | None = None
    rebalances: tuple[Rebalance, ...] = ()
    model_state: ModelStateBytes = ModelStateBytes()
    setups: tuple[GenerationSetup, ...] = ()


def _holding(raw: Sequence[Any]) -> Holding:
    """A holding from its JSON list: ``[stage, version, ready]`` (the whole stage) or with
    ``shard, shards`` after it."""
    if len(raw) == 3:
        stage, version, ready = raw
        return Holding(int(stage), int(version), bool(ready))
    stage, version, ready, shard, shards = raw
    return Holding(int(stage), int(version), bool(ready), int(shard), int(shards))


@dataclass(frozen=True)
class Report:
    """What a worker says at the end of a generation (``report/<g>/<w>``).

    ``holdings``: the logical stages it holds in memory; ``previous_slot``: (pipeline,
    physical stage) it ran in this generation (None: not a member); ``losses`` and
    ``step_times``: every step it has run, by step, and ``step_ends`` when each ended (Unix
    time); ``error``: why it failed (one line)."""

    worker: str
    outcome: Outcome
    holdings: tuple[Holding, ...] = ()
    previous_slot: tuple[int, int] | None = None
    losses: Mapping[int, float] = field(default_factory=dict)
    step_times: Mapping[int, float] = field(default_factory=dict)
    step_ends: Mapping[int, float] = field(default_factory=dict)
    peak_rss_mib: float = 0.0
    stats: WorkerStats = WorkerStats()
    error: str | None = None

    def __post_init__(self) -> None:
        assert self.outcome in OUTCOMES, self.outcome

    def planner_view(self, machine: str | None = None) -> WorkerReport:
        """What the planner needs of it (``spotline.plan.layout.plan_generation``), on the
        machine the coordinator knows it runs on."""
        return WorkerReport(self.worker, self.holdings, self.previous_slot, machine)

    def to_json(self) -> dict[str, Any]:
        st = self.stats
        return {
            "worker": self.worker,
            "outcome": self.outcome,
            # The whole stage in the 3-field form (what older workers wrote); a shard adds
            # its index and count.
            "holdings": [
                [h.stage, h.version, h.ready]
                if h.whole
                else [h.stage, h.version, h.ready, h.shard, h.shards]
                for h in self.holdings
            ],
            "previous_slot": list(self.previous_slot) if self.previous_slot else None,
            "losses": {str(k): v for k, v in self.losses.items()},
            "step_times": {str(k): v for k, v in self.step_times.items()},
            "step_ends": {str(k): v for k, v in self.step_ends.items()},
            "peak_rss_mib": self.peak_rss_mib,
            "train_start_t": st.train_start_t,
            "train_end_t": st.train_end_t,
            "replica_checks": st.replica_checks,
            "replica_mismatches": [m.to_json() for m in st.replica_mismatches],
            "redundant_compute_s": st.redundant_compute_s,
            "replica_sync_s": st.replica_sync_s,
            "replica_sends_in_backward": st.replica_sends_in_backward,
            "seconds_per_logical_worker": st.seconds_per_logical_worker,
            "rebalances": [r.to_json() for r in st.rebalances],
            "model_state_bytes": st.model_state.to_json(),
            "setups": [g.to_json() for g in st.setups],
            "error": self.error,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Report:
        previous = raw["previous_slot"]
        stats = WorkerStats(
            train_start_t=raw["train_start_t"],
            train_end_t=raw["train_end_t"],
            replica_checks=int(raw["replica_checks"]),
            replica_mismatches=tuple(
                ReplicaMismatch.from_json(m) for m in raw["replica_mismatches"]
            ),
            redundant_compute_s=float(raw["redundant_compute_s"]),
            replica_sync_s=float(raw["replica_sync_s"]),
            replica_sends_in_backward=int(raw["replica_sends_in_backward"]),
            seconds_per_logical_worker=raw["seconds_per_logical_worker"],
            rebalances=tuple(Rebalance.from_json(r) for r in raw["rebalances"]),
            model_state=ModelStateBytes.from_json(raw["model_state_bytes"]),
            setups=tuple(GenerationSetup.from_json(g) for g in raw["setups"]),
        )
        return cls(
            worker=str(raw["worker"]),
            outcome=raw["outcome"],
            holdings=tuple(_holding(h) for h in raw["holdings"]),
            previous_slot=(int(previous[0]), int(previous[1])) if previous else None,
            losses={int(k): float(v) for k, v in raw["losses"].items()},
            step_times={int(k): float(v) for k, v in raw["step_times"].items()},
            step_ends={int(k): float(v) for k, v in raw["step_ends"].items()},
            peak_rss_mib=float(raw["peak_rss_mib"]),
            stats=stats,
            error=raw["error"],
        )

    def encode(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def decode(cls, text: bytes | str) -> Report:
        return cls.from_json(json.loads(text))


@dataclass(frozen=True)
class EvalResult:
    """The evaluation once ``step`` optimizer steps were applied: the mean loss over the
    eval set's counted tokens (``tokens`` of them), its ``perplexity`` (exp of the loss),
    and whether it beat every evaluation before it (``best``: the model was saved as the
    run's best; a tie keeps the earlier one)."""

    step: int
    loss: float
    perplexity: float
    tokens: int
    best: bool

    def __post_init__(self) -> None:
        assert self.step >= 1 and self.tokens >= 1, self

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss": self.loss,
            "perplexity": self.perplexity,
            "tokens": self.tokens,
            "best": self.best,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EvalResult:
        return cls(
            int(raw["step"]),
            float(raw["loss"]),
            float(raw["perplexity"]),
            int(raw["tokens"]),
            bool(raw["best"]),
        )

    def encode(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def decode(cls, text: bytes | str) -> EvalResult:
        return cls.from_json(json.loads(text))


@dataclass(frozen=True)
class CheckpointWriteError:
    """An event: a worker (or the coordinator, committing) could not write a checkpoint
    file of ``step`` at ``path``."""

    step: int
    path: str
    error: str
    worker: str

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "error": self.error, "worker": self.worker}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CheckpointWriteError:
        return cls(int(raw["step"]), str(raw["path"]), str(raw["error"]), str(raw["worker"]))

    def encode(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def decode(cls, text: bytes | str) -> CheckpointWriteError:
        return cls.from_json(json.loads(text))
