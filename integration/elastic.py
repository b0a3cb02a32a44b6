"""A worker that survives the loss of its peers: generations, in-memory state, takeover.

A worker lives through *generations*. Each generation is one torch.distributed process
group over the members the coordinator chose (``spotline.plan.layout``), one DeepSpeed
engine built for that layout, and a run of training steps. A generation ends when a peer
fails (gloo reports a dead peer as an exception within a fraction of a second), when the
coordinator asks every member to stop at a step boundary (an arrival, a departure) or when
training is done. Then the worker:

1. copies what it holds out of the engine into plain tensors: its own logical stages and
   its replica's, each with its optimizer state, the number of steps applied, and the
   final gradients of the step in progress if it got past the commit barrier;
2. drops every reference to the engine and destroys the process group, so that peers
   blocked on it see closed connections at once instead of waiting for a timeout;
3. reports its holdings to the coordinator's store and waits for the next plan;
4. rolls forward the step if the plan says it was committed, joins the next generation's
   process group, builds the engine for the new layout and loads its stages, receiving
   any it does not hold from the member the plan names (in memory, never from disk), then
   rebuilds replicas by a ring transfer from their owners;
5. resumes at the committed step, in the step loop every entry point runs
   (``spotline.loop.train_engine``) with this worker's hooks: progress and stop checks,
   rebalancing, losses to the store, evaluations (``spotline.evaluation``; first the one
   due at the resume step, if a loss cut it short), checkpoints. The sampler, the dropout seeds and every
   reduction are functions of the logical topology, so the result is bitwise what an
   undisturbed run gives (and what ``deepspeed launch/train.py`` gives).

The process entry point is ``launch/elastic_worker.py``.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotline import models
from spotline.auth import TOKEN_ENV, AuthStore, ForgedValue, JobToken
from spotline.checkpoint import CheckpointWriter, load_all
from spotline.config import RunConfig
from spotline.engine import build_engine, deepspeed_config_for
from spotline.errors import UserError, one_line
from spotline.evaluation import Evaluator
from spotline.exact import NonFiniteGradient
from spotline.group_setup import connected_new_groups, init_generation_group, wait_p2p
from spotline.heartbeat import AbortWatch, Heartbeat
from spotline.instruction_profile import (
    InstructionProfile,
    instrument,
    profile_dir,
    write_profile,
)
from spotline.loop import EngineLog, StepDone, StepHooks, slow_machine, train_engine
from spotline.lr_schedule import StepSchedule, constructor_hyper
from spotline.plan import logical
from spotline.plan.chaos import parse_injections
from spotline.plan.evaluation import eval_steps
from spotline.plan.layout import Holding, Layout, ShardSource, pipeline_name
from spotline.plan.sampler import GlobalSampler
from spotline.plan.shards import Piece, shard_pieces
from spotline.protocol import (
    CHECKPOINT_ERRORS_COUNTER,
    FINAL_HASH_KEY,
    WATCH_RELEASED,
    CheckpointWriteError,
    EvalResult,
    GenerationSetup,
    ModelStateBytes,
    Outcome,
    Plan,
    Rebalance,
    Report,
    WorkerStats,
    abort_entries,
    abort_key,
    abort_watch_key,
    checkpoint_error_key,
    entry_key,
    eval_key,
    joined_key,
    leaving_key,
    loss_key,
    lr_key,
    plan_key,
    process_group_prefix,
    progress_key,
    ready_key,
    report_key,
    stop_checkpoint_key,
    stop_key,
)
from spotline.redundancy import RedundantPipelineEngine, piece_of, stage_of_name
from spotline.runtime import configure_process, peak_rss_mib, seed_everything

OPT_KEYS = ("step", "exp_avg", "exp_avg_sq")
# A worker whose coordinator is gone exits with this code (nobody is left to read it, but a
# supervisor or a test can tell it from a crash).
EXIT_COORDINATOR_LOST = 3
# How long a member waits for its abort watch's thread to end after writing its release.
ABORT_WATCH_JOIN_S = 5.0


class CoordinatorLost(Exception):
    """The coordinator's store no longer accepts connections: no plan will ever come."""


@dataclass
class StageState:
    """One logical stage's parameters and optimizer state, by global parameter name."""

    version: int
    params: dict[str, torch.Tensor]
    opt: dict[str, dict[str, torch.Tensor]]
    grads: dict[str, torch.Tensor] | None = None  # final gradients of step `version`
    clip: float = 1.0
    # The part held: shard ``shard`` of ``shards`` (a sharded replica: only that shard's
    # pieces, 1-D tensors by piece key, spotline.plan.shards); 0 of 1: the whole stage.
    shard: int = 0
    shards: int = 1


@dataclass
class Holdings:
    """Everything this worker holds between generations."""

    stages: dict[int, StageState] = field(default_factory=dict)

    def report(self) -> list[Holding]:
        return [
            Holding(
                stage=s,
                version=st.version,
                ready=st.grads is not None,
                shard=st.shard,
                shards=st.shards,
            )
            for s, st in sorted(self.stages.items())
        ]


def _opt_state(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, *, clone: bool = True
) -> dict[str, torch.Tensor]:
    """``p``'s AdamW state: copies, or (``clone`` False, for a caller that copies it at
    once) the optimizer's own tensors."""
    state = optimizer.state.get(p, {})
    if not state:
        # AdamW creates zeros at its first step: the same as loading zeros with step 0.
        return {
            "step": torch.zeros(()),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return {k: state[k].detach().clone() if clone else state[k].detach() for k in OPT_KEYS}


def _set_opt_state(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, state: dict[str, torch.Tensor]
) -> None:
    """Hand ``p``'s AdamW state to ``optimizer``. The state of a tensor never stepped (step
    0: the zeros :func:`_opt_state` packs for it) stays empty, as in a fresh optimizer: it
    steps to the same bits either way, and an owner and its replica, compared by their
    state's digest (``redundancy.verify_replicas``), must not differ in its form."""
    if float(state["step"]) == 0:
        optimizer.state.pop(p, None)
        return
    optimizer.state[p] = state


def extract_holdings(engine: RedundantPipelineEngine, logical: list[int]) -> Holdings:
    """Take the own stages and the replica out of the engine, which is dropped next.

    Parameters and optimizer state are taken, not copied (a copy of a stage and its replica
    was most of a takeover's time at 14M parameters): only the engine's optimizer step
    writes them, and the engine runs no step again. Gradients are copied: their buffers are
    the ones the next step's reduction and exchange would write into."""
    out = Holdings()
    named = [(n, p) for n, p in engine.module.named_parameters()]
    for name, p in named:
        stage = stage_of_name(name, logical)
        # Own gradients are clipped in place before the commit barrier: clip 1.0 here.
        st = out.stages.setdefault(
            stage, StageState(engine.applied_steps, {}, {}, {} if engine.own_ready else None, 1.0)
        )
        st.params[name] = p.detach()
        st.opt[name] = _opt_state(engine.optimizer, p, clone=False)
        if st.grads is not None:
            assert p.grad is not None
            st.grads[name] = p.grad.detach().clone()
    replica = engine.replica
    if replica is not None:
        grads: dict[str, torch.Tensor] | None = None
        if engine.replica_ready and replica.flat_grads is not None:
            grads = {}
            offset = 0
            for name, p in replica.named_params:
                n = p.numel()
                grads[name] = replica.flat_grads[offset : offset + n].view_as(p).clone()
                offset += n
        own_stages = set(out.stages)
        # Every logical stage of the replica's physical stage, a sharded replica's empty
        # shard of one included: the planner needs every shard of a stage reported.
        replica_stages = [
            stage
            for stage in range(len(logical) - 1)
            if replica.start <= logical[stage] < replica.stop and stage not in own_stages
        ]
        # The coefficient of the step the received gradients are of: a lazy replica's
        # update waits for the next step's bubble, kept with its own coefficient.
        pending = engine.replica_pending
        clip = engine.last_clip_coefficient if pending is None else pending.clip
        for stage in replica_stages:
            out.stages[stage] = StageState(
                engine.replica_applied_steps,
                {},
                {},
                {} if grads is not None else None,
                clip,
                replica.shard,
                replica.shards,
            )
        for name, p in replica.named_params:
            stage = stage_of_name(name, logical)
            if stage in own_stages:
                continue  # never: a replica holds another physical stage's layers
            st = out.stages[stage]
            st.params[name] = p.detach()
            st.opt[name] = _opt_state(replica.optimizer, p, clone=False)
            if st.grads is not None and grads is not None:
                st.grads[name] = grads[name]
    return out


def roll_forward(
    st: StageState,
    optimizer_cls: type[torch.optim.Optimizer],
    hyper: dict[str, Any],
    schedule: StepSchedule,
) -> None:
    """Apply the committed step this stage holds final gradients for (no communication)."""
    assert st.grads is not None
    names = sorted(st.params)
    params = [torch.nn.Parameter(st.params[n].clone()) for n in names]
    optimizer = optimizer_cls(params, **hyper)
    # The step being applied is step ``st.version`` (0-based): its rate, whatever any
    # scheduler object did since.
    schedule.apply(optimizer.param_groups, st.version)
    for n, p in zip(names, params, strict=True):
        optimizer.state[p] = {k: v.clone() for k, v in st.opt[n].items()}
        p.grad = st.grads[n].clone()
        if st.clip < 1.0:
            p.grad.mul_(st.clip)
    optimizer.step()
    for n, p in zip(names, params, strict=True):
        st.params[n] = p.detach().clone()
        st.opt[n] = {k: optimizer.state[p][k].detach().clone() for k in OPT_KEYS}
    st.version += 1
    st.grads = None


def pack(
    st_names: list[tuple[str, torch.Size]], st: StageState, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A stage's parameters and optimizer state as one flat float32 tensor (into ``out``,
    of ``packed_numel`` elements, when given: one copy, not one more of a concatenation)."""
    parts = [st.params[n].reshape(-1) for n, _ in st_names]
    for key in ("exp_avg", "exp_avg_sq"):
        parts += [st.opt[n][key].reshape(-1) for n, _ in st_names]
    parts += [st.opt[n]["step"].reshape(1).to(torch.float32) for n, _ in st_names]
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def packed_views(
    st_names: list[tuple[str, torch.Size]], flat: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The parameters and optimizer state :func:`pack` wrote into ``flat``, as views of it
    (the caller copies what it keeps)."""
    params: dict[str, torch.Tensor] = {}
    opt: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    sizes = [(n, shape, int(torch.Size(shape).numel())) for n, shape in st_names]
    for n, shape, k in sizes:
        params[n] = flat[offset : offset + k].view(shape)
        offset += k
    for key in ("exp_avg", "exp_avg_sq"):
        for n, shape, k in sizes:
            opt.setdefault(n, {})[key] = flat[offset : offset + k].view(shape)
            offset += k
    for n, _, _ in sizes:
        opt[n]["step"] = flat[offset]
        offset += 1
    assert offset == flat.numel()
    return params, opt


def unpack(st_names: list[tuple[str, torch.Size]], flat: torch.Tensor, version: int) -> StageState:
    """A stage :func:`pack` wrote, every tensor its own copy (a holding owns its tensors)."""
    params, opt = packed_views(st_names, flat)
    return StageState(
        version,
        {n: t.clone() for n, t in params.items()},
        {n: {k: t.clone() for k, t in state.items()} for n, state in opt.items()},
    )


def piece_state(st: StageState, pieces: Sequence[Piece]) -> StageState:
    """``pieces`` of the whole stage ``st`` as a stage of its own, by piece key: views of
    its tensors (each piece with its tensor's step count)."""
    return StageState(
        st.version,
        {x.key: piece_of(st.params[x.name], x) for x in pieces},
        {
            x.key: {k: v if k == "step" else piece_of(v, x) for k, v in st.opt[x.name].items()}
            for x in pieces
        },
    )


def piece_names(pieces: Sequence[Piece]) -> list[tuple[str, torch.Size]]:
    """``pieces`` as a holding of them lists its tensors (by key: :func:`pack`'s order)."""
    return sorted((x.key, torch.Size([x.numel])) for x in pieces)


def assemble(
    st_names: list[tuple[str, torch.Size]],
    parts: Sequence[tuple[Sequence[Piece], StageState]],
    version: int,
) -> StageState:
    """The whole stage ``st_names`` from every shard's pieces (``parts``: each shard's pieces
    and the stage of them, :func:`piece_state`): each tensor its pieces concatenated in
    start order, its own copy."""
    by_name: dict[str, list[tuple[Piece, StageState]]] = {}
    for pieces, st in parts:
        assert st.version == version and sorted(st.params) == sorted(x.key for x in pieces)
        for x in pieces:
            by_name.setdefault(x.name, []).append((x, st))
    assert set(by_name) <= {n for n, _ in st_names}, sorted(by_name)
    # An empty tensor has no piece: its step is any piece's (a stage's tensors step together).
    any_step = next(
        (st.opt[x.key]["step"] for pieces, st in parts for x in pieces), torch.zeros(())
    )
    whole = StageState(version, {}, {})
    for name, shape in st_names:
        got = sorted(by_name.get(name, []), key=lambda item: item[0].start)
        # Every element exactly once: the pieces tile [0, numel) end to end.
        bounds = [0, *(x.stop for x, _ in got)]
        assert [x.start for x, _ in got] == bounds[:-1] and bounds[-1] == shape.numel(), name
        steps = {float(st.opt[x.key]["step"]) for x, st in got}
        assert len(steps) <= 1, (name, steps)  # a tensor's pieces were stepped together
        whole.params[name] = _joined([st.params[x.key] for x, st in got], shape)
        whole.opt[name] = {
            key: _joined([st.opt[x.key][key] for x, st in got], shape)
            for key in ("exp_avg", "exp_avg_sq")
        }
        step = got[0][1].opt[got[0][0].key]["step"] if got else any_step
        whole.opt[name]["step"] = step.detach().clone()
    return whole


def _joined(tensors: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """``tensors`` concatenated (a copy) and viewed as ``shape``; none: an empty tensor."""
    return (torch.cat(tensors) if tensors else torch.empty(0)).view(shape)


def abort_connections(keep_port: int) -> int:
    """Shut down this process's TCP connections except those to the store (port ``keep_port``).

    Gloo has no abort: after a failure, a peer blocked on a receive from this process (or
    this process blocked on one) waits for the process group's timeout unless the socket
    closes, and a failed process group's sockets can outlive ``destroy_process_group``.
    Shutting them down ends every pending operation at once, on both sides; the file
    descriptors stay owned by gloo, which closes them when its context goes away.
    """
    import socket

    count = 0
    for fd_name in os.listdir("/proc/self/fd"):
        fd = int(fd_name)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                # Not connected: listening (gloo's listener, kept), or still connecting: a
                # connect to a machine gone silent waits out the whole collective timeout
                # (SYNs unanswered), so it is shut too (Linux aborts a SYN_SENT on shutdown).
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                peer = ("", -1)
            local = sock.getsockname()
            if peer[1] == keep_port or local[1] == keep_port:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


def packed_numel(st_names: list[tuple[str, torch.Size]]) -> int:
    return sum(3 * int(torch.Size(s).numel()) + 1 for _, s in st_names)


def worker_token() -> JobToken:
    """The job token this worker's agent handed it."""
    text = os.environ.get(TOKEN_ENV)
    if not text:
        raise UserError(
            f"no job token in {TOKEN_ENV}: a worker is started by `spotline agent`, which "
            "hands it the token"
        )
    try:
        return JobToken.from_text(text)
    except ValueError:
        raise UserError(f"{TOKEN_ENV} is not a job token (64 hex digits)") from None


class ElasticWorker:
    """One preemptible worker process, driven by plans from the coordinator's store."""

    def __init__(self, cfg: RunConfig, worker_id: str, store_addr: str, output: Path) -> None:
        self.cfg = cfg
        self.wid = worker_id
        self.index = int(worker_id.lstrip("w"))
        from spotline.stores import connect_store, parse_store_arg, store_port

        self.store_spec = parse_store_arg(store_addr)
        self.port = store_port(self.store_spec)  # kept open by abort_connections
        timeout = timedelta(seconds=max(60.0, cfg.spotline.recovery.heartbeat_timeout_s * 4))
        # Every value is sealed with the job token its agent handed it (spotline.auth):
        # what someone without the token writes is never acted on.
        self.token = worker_token()
        self.raw_store = connect_store(self.store_spec, timeout=timeout)
        self.store = AuthStore(self.raw_store, self.token)
        self.output = output
        self.holdings = Holdings()
        self.leaving = False
        self.injections = parse_injections(cfg.spotline.recovery.inject)
        # Losses, times, rates and replica checks of every step this worker ran (all
        # generations): what the shared loop records, reported to the coordinator.
        self.log = EngineLog()
        self.heartbeat: Heartbeat | None = None  # started once the worker has its data
        self._lost_lock = threading.Lock()
        self._lost_said = False
        self.checkpoints: CheckpointWriter | None = None
        self.checkpoint_interval = cfg.spotline.checkpoints.interval_steps
        self.checkpoint_from = 0
        self._training_generation: int | None = None
        # Set when the training generation is aborted: ends its rendezvous store's waits.
        self._generation_aborted = threading.Event()
        # The training generation's members and its abort watch (None outside a generation).
        self._members: tuple[str, ...] = ()
        self._abort_watch: AbortWatch | None = None
        self.train_start_t = float("inf")
        self.train_end_t = 0.0
        self.redundant_s = 0.0
        self.replica_sync_s = 0.0
        self.replica_sends_in_backward = 0
        self.model_state = ModelStateBytes()
        # Seconds by schedule instruction, over every engine of this worker (only when
        # SPOTLINE_INSTRUCTION_PROFILE names a folder: spotline bench profile).
        self.instruction_profile = InstructionProfile() if profile_dir() else None
        # Speed measurement: seconds per logical worker on this rank since the last rebalance.
        self._lw_seconds = 0.0
        self._lw_count = 0
        self.seconds_per_logical_worker: float | None = None
        self.rebalances: list[Rebalance] = []  # moves within a generation (rank 0)
        self.setups: list[GenerationSetup] = []
        self._state_bytes = 0  # sent and received by this generation's state load
        self._measuring = False
        self.error: str | None = None
        self._engine: RedundantPipelineEngine | None = None  # the generation's, while it runs
        # The evaluations (spotline.evaluation), once the data is loaded; None: none asked.
        self.evaluator: Evaluator | None = None
        # Checkpoint writes that failed (from the writer's thread), not yet told to the store.
        self._ckpt_errors: list[CheckpointWriteError] = []
        self._ckpt_errors_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------
    def _connect_store(self) -> AuthStore:
        """A new client of the job's store: a client is one thread's."""
        from spotline.stores import connect_store

        return AuthStore(connect_store(self.store_spec, timeout=timedelta(seconds=30)), self.token)

    def _start_heartbeat(self) -> None:
        def coordinator_lost() -> None:
            # The main thread may be blocked in a collective with live peers for as long
            # as the collective timeout: exit from here, now.
            self.say_coordinator_lost()
            os._exit(EXIT_COORDINATOR_LOST)

        timeout_s = self.cfg.spotline.recovery.heartbeat_timeout_s
        interval_s = max(0.02, min(0.1, timeout_s / 10))
        self.heartbeat = Heartbeat(
            self.wid,
            self._connect_store,
            interval_s=interval_s,
            # A beat a second at most (five in the default 5 s timeout). Each turn of
            # interval_s re-shuts the connections of an aborted generation; it asks the
            # store for the abort only when the abort watch cannot wait for it.
            beat_every=max(1, round(min(1.0, timeout_s / 5) / interval_s)),
            timeout_s=timeout_s,
            note=self._note,
            coordinator_lost=self.coordinator_lost,
            on_coordinator_lost=coordinator_lost,
            each_beat=self._each_beat,
        )
        self.heartbeat.start()

    def _each_beat(self, hb_store: AuthStore) -> None:
        """The heartbeat thread's work besides the beat: the leaving flag, and the abort of
        the generation this worker trains in."""
        if self.leaving:
            hb_store.set(leaving_key(self.wid), "1")
        training = self._training_generation
        aborted = self._generation_aborted
        watch = self._abort_watch
        # The abort watch waits for it on the store; only a watch that could not wait is
        # polled for here, once a beat.
        polled = watch is None or not watch.watching
        if training is not None and (
            aborted.is_set() or (polled and hb_store.check([abort_key(training)]))
        ):
            # A peer failed: unblock whatever gloo operation this process waits in, and
            # again at every beat until the main thread has left the generation: gloo
            # retries a failed connect (to a machine gone silent, each try would wait out
            # the whole timeout).
            aborted.set()
            abort_connections(self.port)

    def coordinator_lost(self, patience_s: float = 1.0) -> bool:
        """Whether the coordinator's TCPStore is gone (called after a store operation failed).

        A dying process's sockets close one by one: a worker whose store connection was just
        reset may still connect to the listening socket for a moment, so the store is probed
        until a connection is refused or ``patience_s`` has passed. An etcd store outlives
        the coordinator by design: it is never taken for lost here."""
        if self.store_spec.backend != "tcp":
            return False
        import socket

        deadline = time.monotonic() + patience_s
        while True:
            try:
                with socket.create_connection((self.store_spec.host, self.store_spec.port), 2.0):
                    pass
            except OSError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def say_coordinator_lost(self) -> None:
        """One line, once: the heartbeat thread and the main thread may both find out."""
        with self._lost_lock:
            if self._lost_said:
                return
            self._lost_said = True
        spec = self.store_spec
        print(
            f"spotline worker {self.wid}: lost the coordinator at {spec.host}:{spec.port}; exiting",
            flush=True,
        )

    def _on_term(self, signum: int, frame: Any) -> None:
        # A preemption notice: finish the step, leave at the next boundary, and in any
        # case exit within the grace time.
        self.leaving = True
        grace = self.cfg.spotline.recovery.term_grace_s
        threading.Timer(grace, lambda: os._exit(0)).start()

    def _wait_value(self, key: str) -> bytes:
        """Wait for a key as long as it takes (a standby may wait for minutes)."""
        while True:
            try:
                self.store.wait([key], timedelta(seconds=30))
                return self.store.get(key)
            except dist.DistStoreError:
                continue
            except ForgedValue:
                time.sleep(0.05)  # not the coordinator's: wait for its own value

    # -- main loop --------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        sl = self.cfg.spotline
        configure_process(
            intra_op_threads=sl.determinism.intra_op_threads, deterministic=sl.determinism.enabled
        )
        seed_everything(sl.training.seed)
        from spotline.trainer import prepare_inputs, quiet_libraries

        quiet_libraries()
        inputs = prepare_inputs(self.cfg)
        self.hf_config, self.corpus = inputs.hf_config, inputs.corpus
        if inputs.eval_set is not None:
            self.evaluator = Evaluator(
                self.cfg,
                inputs.eval_set,
                self.hf_config,
                self.output,
                earlier=self._earlier_evaluations,
                report=self._report_evaluation,
            )
        self.logical = models.logical_parts(self.hf_config, self.cfg.num_stages)
        self.sampler = GlobalSampler(
            num_samples=len(self.corpus),
            num_logical_workers=self.cfg.num_pipelines,
            micro_batch_size=self.cfg.micro_batch_size,
            num_micro_batches=self.cfg.num_micro_batches,
            seed=sl.training.seed,
        )
        self._start_heartbeat()
        self.store.set(joined_key(self.wid), "1")
        generation = int(self._wait_value(entry_key(self.wid)).decode())
        while True:
            plan = Plan.decode(self._wait_value(plan_key(generation)))
            if plan.action == "finish":
                break
            outcome: Outcome = "standby"
            # The coordinator decides the interval (given, or Young/Daly for the baseline, or
            # shorter from an exposed plan's first committed step: spotline.plan.exposure).
            self.checkpoint_interval = plan.checkpoint_interval
            self.checkpoint_from = plan.checkpoint_from
            layout = plan.layout
            if plan.action == "restore":
                assert plan.checkpoint_step is not None  # Plan's invariant
                self._restore_checkpoint(plan.checkpoint_step)
            if layout is not None and self.wid in layout.members:
                outcome = self._run_generation(generation, plan, layout)
            self._report(generation, outcome, layout)
            if self.leaving:
                break
            generation += 1
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.checkpoints is not None:
            self.checkpoints.close()
        self._publish_checkpoint_errors()  # the coordinator reads them once we have exited
        return 0

    def deliver_injections(self, step: int, phase: str | None, own_only: bool = False) -> None:
        """The ``--inject`` faults this worker delivers to itself at ``step`` in ``phase``
        (None: the step boundary, where only ``stop`` is its own: the coordinator signals
        phase-less kills and notices, several at once). ``stop`` hangs the whole process,
        heartbeat thread included: a worker alive and silent, until the coordinator's
        heartbeat timeout kills it."""
        numbers = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
        for inj in self.injections:
            if own_only and inj.signal != "stop":
                continue
            if (
                inj.signal in numbers
                and inj.phase == phase
                and inj.worker == self.index
                and inj.step == step
            ):
                os.kill(os.getpid(), numbers[inj.signal])

    def _checkpoint_failed(self, step: int, path: Path, error: Exception) -> None:
        """The checkpoint writer's thread: a file of ``step`` could not be written."""
        with self._ckpt_errors_lock:
            self._ckpt_errors.append(CheckpointWriteError(step, str(path), str(error), self.wid))
        self._note(f"checkpoint of step {step} not written: {path}: {error}")

    def _publish_checkpoint_errors(self) -> None:
        """Tell the coordinator of failed checkpoint writes: ``checkpoint-error/<n>`` (n from
        the ``checkpoint-errors`` counter, 1, 2, ...). Only this (main) thread uses the store
        connection."""
        with self._ckpt_errors_lock:
            errors, self._ckpt_errors = self._ckpt_errors, []
        for entry in errors:
            n = self.store.add(CHECKPOINT_ERRORS_COUNTER, 1)
            self.store.set(checkpoint_error_key(n), entry.encode())

    def _report(self, generation: int, outcome: Outcome, layout: Layout | None) -> None:
        self._publish_checkpoint_errors()
        previous = None
        if layout is not None and self.wid in layout.members:
            previous = layout.slot_of(self.wid)
        stats = WorkerStats(
            train_start_t=self.train_start_t if self.train_start_t != float("inf") else None,
            train_end_t=self.train_end_t or None,
            replica_checks=self.log.replica_checks,
            replica_mismatches=tuple(self.log.replica_mismatches),
            redundant_compute_s=self.redundant_s,
            replica_sync_s=self.replica_sync_s,
            replica_sends_in_backward=self.replica_sends_in_backward,
            seconds_per_logical_worker=(
                self._lw_seconds / self._lw_count
                if self._lw_count
                else self.seconds_per_logical_worker
            ),
            rebalances=tuple(self.rebalances),
            model_state=self.model_state,
            setups=tuple(self.setups),
        )
        report = Report(
            worker=self.wid,
            outcome=outcome if not self.leaving else "leaving",
            holdings=tuple(self.holdings.report()),
            previous_slot=previous,
            losses=dict(self.log.losses),
            step_times=dict(self.log.step_times),
            step_ends=dict(self.log.step_ends),
            peak_rss_mib=peak_rss_mib(),
            stats=stats,
            error=self.error,
        )
        self.store.set(report_key(generation, self.wid), report.encode())

    # -- one generation ---------------------------------------------------------------
    def _run_generation(self, generation: int, plan: Plan, layout: Layout) -> Outcome:
        resume = plan.resume_step
        self._roll_forward_to(resume)
        rank = layout.rank_of(self.wid)
        world = len(layout.members)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        t0 = time.perf_counter()
        # Watched from here on: a peer lost while the group, the engine or the state transfer
        # is being set up must unblock this process as it would mid-step.
        self._generation_aborted = threading.Event()  # before the watchdog can see g
        self._training_generation = generation
        self._members = tuple(layout.members)
        self._abort_watch = self._watch_for_abort(generation)
        outcome: Outcome = "failed"
        self.error = None
        try:
            self._join_process_group(generation, rank, world)
            joined = time.perf_counter()
            # Every group's pairs connected at its creation: see spotline.group_setup.
            with connected_new_groups(self._collective_timeout()):
                engine = self._build_engine(layout)
            built = time.perf_counter()
            assert plan.logical is not None  # a plan with a layout assigns logical workers
            self._place_logical_workers(engine, plan.logical)
            self._state_bytes = 0
            self._load_state(engine, layout, plan)
            loaded = time.perf_counter()
            self.setups.append(
                GenerationSetup(
                    generation,
                    join_s=joined - t0,
                    build_s=built - joined,
                    state_s=loaded - built,
                    state_bytes=self._state_bytes,
                )
            )
            self.store.set(ready_key(generation, self.wid), repr(loaded - t0))
            outcome = self._train(engine, generation, resume)
        except NonFiniteGradient as exc:
            # Every rank raises it (the exact reduction's flags are all-reduced) before the
            # step is applied: nothing to recover, the job must stop and say why.
            self.error = f"step {self._engine_step()}: {exc}"
            outcome = "non-finite"
        except (RuntimeError, dist.DistBackendError, ConnectionError, TimeoutError) as exc:
            # A store error (not a gloo one) may mean the coordinator is gone, not a peer.
            store_error = isinstance(exc, (dist.DistNetworkError, dist.DistStoreError))
            if store_error and self.coordinator_lost():
                raise CoordinatorLost from None
            # A peer died or left mid-step; what this process holds survives in memory.
            self.error = one_line(exc)
            self._note(f"generation {generation}: {self.error}")
            outcome = "failed"
            self._abort_generation(generation)
        except Exception as exc:
            # Not a lost peer (a full disk at the export, a bug): the job must stop with this
            # error, not recover from it. The traceback goes to this worker's log.
            self.error = one_line(exc)
            self._note(f"generation {generation}: error:\n{traceback.format_exc()}")
            outcome = "error"
            self._abort_generation(generation)
        # Outside the except block: the traceback (and the engine it references) is gone.
        self._training_generation = None
        self._release_abort_watch(generation)
        self._teardown()
        return outcome

    def _watch_for_abort(self, generation: int) -> AbortWatch:
        """Start generation ``generation``'s abort watch: an abort sets its event (which ends
        the rendezvous store's waits) and shuts this process's connections at once; the
        heartbeat shuts them again at each beat until this process has left the generation."""
        aborted = self._generation_aborted

        def on_abort(lost: str) -> None:
            if self._training_generation == generation:
                aborted.set()
                abort_connections(self.port)

        watch = AbortWatch(
            self._connect_store,
            abort_watch_key(generation, self.wid),
            WATCH_RELEASED,
            on_abort,
            self._note,
        )
        watch.start()
        return watch

    def _release_abort_watch(self, generation: int) -> None:
        """End the generation's abort watch: an aborted one has ended by itself (or waits on
        a key that the abort wrote); otherwise this member writes its own release."""
        watch, self._abort_watch = self._abort_watch, None
        if watch is None or not watch.watching:
            return
        try:
            self.store.set(abort_watch_key(generation, self.wid), WATCH_RELEASED)
        except Exception:
            return  # the store is gone: so is the watch's connection, and its thread
        watch.join(ABORT_WATCH_JOIN_S)

    def _join_process_group(self, generation: int, rank: int, world: int) -> None:
        """The generation's gloo group (``pg/<g>`` in the store), and DeepSpeed's view of it."""
        from spotline.stores import AbortableStore

        # Abortable: a member lost before it wrote its rendezvous address must not hold the
        # others in a store wait for the whole timeout (see AbortableStore). Held here: a
        # Python store that only C++ references loses its methods (pybind's trampoline).
        self._generation_store = AbortableStore(
            self.raw_store, self._generation_aborted, self._collective_timeout()
        )
        init_generation_group(
            # gloo's rendezvous reads and writes the store itself (its keys are not sealed).
            dist.PrefixStore(process_group_prefix(generation), self._generation_store),
            rank,
            world,
            collective=self._collective_timeout(),
        )
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)

    def _collective_timeout(self) -> timedelta:
        return timedelta(seconds=self.cfg.spotline.recovery.collective_timeout_s)

    def _abort_generation(self, generation: int) -> None:
        """Tell every member at once (their watchdogs unblock them), and unblock our peers."""
        self._training_generation = None
        self._generation_aborted.set()
        for key, value in abort_entries(generation, self._members, self.wid):
            self.store.set(key, value)
        abort_connections(self.port)

    def _engine_step(self) -> int:
        engine = self._engine
        return int(engine.rng_step) if engine is not None else -1

    def _note(self, text: str) -> None:
        try:
            print(f"[spotline {self.wid} {time.time():.2f}] {text}", flush=True)
        except OSError:  # the log is on a full disk: the store still carries what matters
            pass

    def _build_engine(self, layout: Layout) -> RedundantPipelineEngine:
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

        sl = self.cfg.spotline
        topology = PipeDataParallelTopology(
            num_pp=layout.num_physical_stages, num_dp=layout.num_pipelines
        )
        from spotline.trainer import pretrained_dir_of

        module = models.build_pipeline_module(
            self.hf_config,
            layout.num_physical_stages,
            seed=sl.training.seed,
            # A save_pretrained directory's weights are step 0's (a later generation loads
            # its stages over them from memory, a peer or a checkpoint).
            pretrained_dir=pretrained_dir_of(sl.model.name),
            activation_checkpoint_interval=sl.model.activation_checkpoint_interval,
            topology=topology,
            parts=models.physical_parts(self.logical, layout.groups),
        )
        ds_config = deepspeed_config_for(self.cfg.deepspeed, num_pipelines=layout.num_pipelines)
        engine = build_engine(
            module,
            ds_config,
            RedundantPipelineEngine,
            redundancy=sl.redundancy.mode,
            replica_device=sl.redundancy.replica_device,
            replica=sl.redundancy.replica,
            logical_parts=self.logical,
        )
        # build_engine returns DeepSpeed's (untyped) PipelineEngine; it built the class asked.
        assert isinstance(engine, RedundantPipelineEngine)
        if self.instruction_profile is not None:
            instrument(engine, self.instruction_profile)
        engine.batch_source = lambda step, worker, mb: self.corpus.batch(
            self.sampler.indices(step, worker, mb)
        )
        self._engine = engine
        return engine

    def _optimizer_recipe(
        self, engine: RedundantPipelineEngine
    ) -> tuple[type[torch.optim.Optimizer], dict[str, Any], StepSchedule]:
        opt = engine.optimizer
        return type(opt), constructor_hyper(opt), engine.step_schedule

    def _roll_forward_to(self, resume: int) -> None:
        recipe = getattr(self, "_recipe", None)
        for stage, st in sorted(self.holdings.stages.items()):
            if st.version == resume - 1 and st.grads is not None:
                assert recipe is not None
                roll_forward(st, *recipe)
            if st.version != resume:
                # Stale (older than the committed step): useless, drop it.
                del self.holdings.stages[stage]
            else:
                st.grads = None

    def _load_state(self, engine: RedundantPipelineEngine, layout: Layout, plan: Plan) -> None:
        """Own stages from memory or from the plan's source; replicas by a ring transfer."""
        self._recipe = self._optimizer_recipe(engine)
        # Generation 0 (no holders): everyone starts from the initial weights.
        if plan.holders:
            self._receive_own_stages(engine, layout, plan)
            self._load_own_stages(engine)
        resume = plan.resume_step
        engine.applied_steps = resume
        engine.global_steps = resume
        # DeepSpeed's scheduler object starts at zero in every new engine: move it to the
        # committed step (the rate each update uses comes from engine.step_schedule anyway).
        engine.step_schedule.position(engine.lr_scheduler, resume)
        if engine.replica is not None:
            self._load_replica(engine, resume)
        self.holdings = Holdings()  # the engine holds it all now

    def _receive_own_stages(
        self, engine: RedundantPipelineEngine, layout: Layout, plan: Plan
    ) -> None:
        """Send the stages the plan's members lack from their sources (this worker among
        them) and receive this worker's into its holdings. Every member computes the same
        transfer list from the plan."""
        own_names = self._names_by_stage(engine.module.named_parameters())
        holders = plan.holders
        sources = dict(plan.sources)
        by_shard: dict[int, list[ShardSource]] = {}
        for part in plan.shard_sources:
            by_shard.setdefault(part.stage, []).append(part)
        ops: list[dist.P2POp] = []
        incoming: list[tuple[int, torch.Tensor]] = []
        # A stage no member holds whole: (each shard's pieces, the buffer or the holding
        # they come from), assembled once every transfer is done.
        pieces: dict[int, list[tuple[tuple[Piece, ...], torch.Tensor | StageState]]] = {}
        for member in layout.members:
            for stage in layout.stages_of(member):
                if member in holders[stage]:
                    continue
                if stage in by_shard:
                    self._shard_transfers(
                        stage, member, by_shard[stage], own_names, layout, ops, pieces
                    )
                    continue
                src = sources[stage]
                if src == self.wid:
                    names = self._names_for_stage_from_holdings(stage)
                    ops.append(
                        dist.P2POp(
                            dist.isend,
                            pack(names, self.holdings.stages[stage]),
                            layout.rank_of(member),
                        )
                    )
                if member == self.wid:
                    buf = torch.empty(packed_numel(own_names[stage]))
                    ops.append(dist.P2POp(dist.irecv, buf, layout.rank_of(src)))
                    incoming.append((stage, buf))
        if ops:
            self._state_bytes += sum(op.tensor.nbytes for op in ops)
            for work in dist.batch_isend_irecv(ops):
                wait_p2p(work)
        for stage, buf in incoming:
            self.holdings.stages[stage] = unpack(own_names[stage], buf, plan.resume_step)
        for stage, parts in pieces.items():
            shards: list[tuple[tuple[Piece, ...], StageState]] = []
            for shard, got in parts:
                if isinstance(got, torch.Tensor):
                    # Views of the buffer: assembling copies each tensor once.
                    got = StageState(plan.resume_step, *packed_views(piece_names(shard), got))
                shards.append((shard, got))
            self.holdings.stages[stage] = assemble(own_names[stage], shards, plan.resume_step)

    def _shard_transfers(
        self,
        stage: int,
        member: str,
        parts: Sequence[ShardSource],
        own_names: Mapping[int, list[tuple[str, torch.Size]]],
        layout: Layout,
        ops: list[dist.P2POp],
        pieces: dict[int, list[tuple[tuple[Piece, ...], torch.Tensor | StageState]]],
    ) -> None:
        """``member`` lacks ``stage``, which no member holds whole: each shard's source sends
        it its shard (``pack`` of that shard's pieces), ``member`` receives each (its own
        shard, if it holds one, is taken as it is). The member knows each shard's pieces
        from its own list of the stage's tensors (``shard_pieces``)."""
        for part in parts:
            if part.worker == self.wid and member != self.wid:
                st = self.holdings.stages[stage]
                assert (st.shard, st.shards) == (part.shard, part.shards), (stage, part)
                names = self._names_for_stage_from_holdings(stage)
                if names:  # a stage with fewer elements than shards leaves some empty
                    ops.append(dist.P2POp(dist.isend, pack(names, st), layout.rank_of(member)))
            if member == self.wid:
                numels = sorted((n, int(shape.numel())) for n, shape in own_names[stage])
                shard = shard_pieces(numels, part.shard, part.shards)
                if part.worker == self.wid:
                    pieces.setdefault(stage, []).append((shard, self.holdings.stages[stage]))
                elif shard:
                    buf = torch.empty(packed_numel(piece_names(shard)))
                    ops.append(dist.P2POp(dist.irecv, buf, layout.rank_of(part.worker)))
                    pieces.setdefault(stage, []).append((shard, buf))

    def _load_own_stages(self, engine: RedundantPipelineEngine) -> None:
        """Copy the held own stages' parameters into the engine and hand it their optimizer
        state. Handed, not copied: a holding's tensors belong to no live engine (taken
        from the dropped one, received or read from a checkpoint) and the holdings are
        dropped once the state is loaded; a generation that fails before its first step
        leaves them unchanged."""
        params = dict(engine.module.named_parameters())
        for stage, names in self._names_by_stage(engine.module.named_parameters()).items():
            st = self.holdings.stages[stage]
            for name, _ in names:
                with torch.no_grad():
                    params[name].copy_(st.params[name])
                _set_opt_state(engine.optimizer, params[name], dict(st.opt[name]))

    def _load_replica(self, engine: RedundantPipelineEngine, resume: int) -> None:
        """Replicas: each physical stage sends its whole state (a sharded replica's holder: its
        shard's pieces) to its predecessor."""
        assert engine.replica is not None
        my_state = self._engine_stage_state(engine, clone=False)  # packed at once: one copy
        held = engine.held_by_predecessor
        if held is None:
            mine = self._names_by_stage(engine.module.named_parameters())
        else:
            # A sharded replica's holder gets only its pieces: slices of the stage's state.
            by_stage = {
                s: [x for x in held if stage_of_name(x.name, self.logical) == s] for s in my_state
            }
            my_state = {s: piece_state(my_state[s], by_stage[s]) for s in by_stage}
            mine = {s: piece_names(by_stage[s]) for s in by_stage}
        flat_out = torch.empty(sum(packed_numel(mine[s]) for s in sorted(mine)))
        offset = 0
        for s in sorted(mine):
            n = packed_numel(mine[s])
            pack(mine[s], my_state[s], out=flat_out[offset : offset + n])
            offset += n
        rep_names = self._names_by_stage(engine.replica.named_params)
        flat_in = torch.empty(sum(packed_numel(rep_names[s]) for s in sorted(rep_names)))
        pred = engine._peer(engine.stage_id - 1)
        succ = engine._peer(engine.stage_id + 1)
        self._state_bytes += flat_out.nbytes + flat_in.nbytes
        for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, flat_out, pred), dist.P2POp(dist.irecv, flat_in, succ)]
        ):
            wait_p2p(work)
        offset = 0
        rparams = dict(engine.replica.named_params)
        for stage in sorted(rep_names):
            n = packed_numel(rep_names[stage])
            # Copied straight out of the received buffer (once, into tensors of their own).
            got_params, got_opt = packed_views(rep_names[stage], flat_in[offset : offset + n])
            offset += n
            for name, _ in rep_names[stage]:
                with torch.no_grad():
                    rparams[name].copy_(got_params[name])
                _set_opt_state(
                    engine.replica.optimizer,
                    rparams[name],
                    {k: v.clone() for k, v in got_opt[name].items()},
                )
        engine.replica_applied_steps = resume

    def _names_by_stage(self, named: Any) -> dict[int, list[tuple[str, torch.Size]]]:
        out: dict[int, list[tuple[str, torch.Size]]] = {}
        for name, p in named:
            out.setdefault(stage_of_name(name, self.logical), []).append((name, p.shape))
        return {s: sorted(v) for s, v in out.items()}

    def _names_for_stage_from_holdings(self, stage: int) -> list[tuple[str, torch.Size]]:
        st = self.holdings.stages[stage]
        return sorted((n, t.shape) for n, t in st.params.items())

    def _engine_stage_state(
        self, engine: RedundantPipelineEngine, *, clone: bool = True
    ) -> dict[int, StageState]:
        out: dict[int, StageState] = {}
        for name, p in engine.module.named_parameters():
            st = out.setdefault(
                stage_of_name(name, self.logical), StageState(engine.applied_steps, {}, {})
            )
            st.params[name] = p.detach()
            st.opt[name] = _opt_state(engine.optimizer, p, clone=clone)
        return out

    def _train(self, engine: RedundantPipelineEngine, generation: int, resume: int) -> Outcome:
        """The shared loop (``spotline.loop``) plus this worker's hooks, from ``resume``."""
        sl = self.cfg.spotline
        hooks = _GenerationHooks(self, engine, generation, resume)
        engine.phase_hook = hooks.inject
        engine.on_logical_worker_done = self._measure_logical_worker
        factor = sl.elasticity.slow_factor
        if self.index == sl.elasticity.slow_worker and factor > 1:
            engine.on_logical_worker_done = slow_machine(factor, self._measure_logical_worker)
        self._lw_seconds, self._lw_count = 0.0, 0
        self._evaluate_if_missing(engine, resume)
        # The commit barrier stays gloo's: if a peer fails while others wait in it, the
        # watchdog (heartbeat thread) sees the abort and shuts this process's connections.
        end = train_engine(
            engine,
            seed=sl.training.seed,
            start=resume,
            stop=sl.training.steps,
            log=self.log,
            verify_replicas=sl.redundancy.verify_replicas,
            hooks=[hooks],
        )
        if end.stopped_at is not None:
            self._checkpoint_at_stop(engine, generation, end.stopped_at)
            self._save_holdings(engine)
            return "boundary"
        self._save_holdings(engine)
        self._finish(engine, generation)
        return "done"

    # -- evaluation -----------------------------------------------------------------------
    def _evaluate_if_missing(self, engine: RedundantPipelineEngine, resume: int) -> None:
        """The evaluation due at the step this generation resumes from, unless one was
        reported (a generation evaluates after each step it runs, so only an evaluation cut
        short by a loss, or a run resumed before its first step, is missing). Collective."""
        evaluator = self.evaluator
        if evaluator is None or resume == 0 or not evaluator.due(resume):
            return
        missing = torch.tensor([int(not self.store.check([eval_key(resume)]))])
        # Every member must make the same choice (the evaluation is collective): one that
        # does not see the result makes them all evaluate again (the same numbers).
        dist.all_reduce(missing, op=dist.ReduceOp.MAX)
        if int(missing[0]):
            evaluator.run(engine, resume)

    def _earlier_evaluations(self) -> dict[int, float]:
        """Every evaluation reported so far, by step (rank 0 asks, to tell the best): the
        store keeps them across generations, and a ``--resume`` puts the stopped run's
        there before the first plan."""
        ev = self.cfg.spotline.evaluation
        out: dict[int, float] = {}
        for step in eval_steps(ev.interval_steps, self.cfg.spotline.training.steps):
            key = eval_key(step)
            if self.store.check([key]):
                out[step] = EvalResult.decode(self.store.get(key)).loss
        return out

    def _report_evaluation(self, result: EvalResult) -> None:
        """Rank 0: the result to the store, once its best model (if it is one) is saved."""
        self.store.set(eval_key(result.step), result.encode())

    # -- logical workers (EasyScale) ----------------------------------------------------
    def _place_logical_workers(
        self,
        engine: RedundantPipelineEngine,
        assignment: Mapping[str, Sequence[int]],
        rebalanced_at: int | None = None,
    ) -> None:
        """Host the logical workers the assignment gives this rank's pipeline. A move made
        within a generation (``rebalanced_at``: the step) is recorded for the summary; the
        coordinator records the placement each generation starts with."""
        pipeline = pipeline_name(int(engine.grid.data_parallel_id))
        engine.set_logical_workers(self.cfg.num_pipelines, tuple(assignment[pipeline]))
        self._assignment = {p: tuple(ws) for p, ws in assignment.items()}
        if rebalanced_at is not None and dist.get_rank() == 0:
            step = rebalanced_at
            self.rebalances.append(
                Rebalance(step, tuple(self._assignment[p] for p in sorted(assignment)))
            )

    def _measure_logical_worker(self, worker: int, seconds: float) -> None:
        """``engine.on_logical_worker_done``: this rank's speed, for the next rebalance."""
        if self._measuring:
            self._lw_seconds += seconds
            self._lw_count += 1

    def _rebalance(self, engine: RedundantPipelineEngine, step: int) -> None:
        """Measure every pipeline's speed and move logical workers if that pays off.

        Collective: every rank gathers every rank's seconds per logical worker since the
        last measurement; a pipeline is as fast as its slowest rank. Every rank computes the
        same assignment from the same numbers (pure functions), so no one has to announce it;
        nothing but the ids moves (every pipeline holds all the state its stages need)."""
        mine = torch.tensor([self._lw_seconds / max(1, self._lw_count)], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        self._lw_seconds, self._lw_count = 0.0, 0
        num_pipelines = int(engine.grid.get_data_parallel_world_size())
        slowest = [0.0] * num_pipelines
        for rank, seconds in enumerate(gathered):
            pipeline = rank % num_pipelines  # DeepSpeed's pipe-major ranks: stage * P + pipeline
            slowest[pipeline] = max(slowest[pipeline], float(seconds))
        self.seconds_per_logical_worker = float(mine)
        if num_pipelines == 1 or min(slowest) <= 0:
            return
        speeds = {pipeline_name(p): 1.0 / slowest[p] for p in range(num_pipelines)}
        proposed = logical.rebalance(self._assignment, speeds)
        if logical.worth_moving(self._assignment, proposed, speeds):
            self._place_logical_workers(
                engine, {p: list(ws) for p, ws in proposed.items()}, rebalanced_at=step
            )

    def _should_stop(self, generation: int, step: int) -> bool:
        key = stop_key(generation)
        if self.store.check([key]):
            return step >= int(self.store.get(key).decode())
        return False

    def _save_holdings(self, engine: RedundantPipelineEngine) -> None:
        self.holdings = extract_holdings(engine, self.logical)
        self._recipe = self._optimizer_recipe(engine)

    def _teardown(self) -> None:
        """Copy state out (if the engine still exists), then release every group reference."""
        engine = self._engine
        if engine is not None:
            self.redundant_s += engine.redundant_s
            self.replica_sync_s += engine.replica_sync_s
            self.replica_sends_in_backward += engine.sends_in_backward
            self.model_state = self.model_state.peak(engine.model_state)
            if self.instruction_profile is not None:
                write_profile(self.instruction_profile, self.wid)
            if not self.holdings.stages:
                self.holdings = extract_holdings(engine, self.logical)
                self._recipe = self._optimizer_recipe(engine)
            self._engine = None
            del engine
        from deepspeed.runtime.pipe import p2p

        p2p._groups = None
        p2p._grid = None
        try:
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()
        except Exception:
            if dist.is_initialized():
                dist.destroy_process_group()
        gc.collect()

    def _checkpoint_at_stop(
        self, engine: RedundantPipelineEngine, generation: int, step: int
    ) -> None:
        """``stop-checkpoint/<g>``: the job stops at this boundary (a Ctrl-C) and resumes from
        a checkpoint of it. Written here unless the interval wrote it already; waited for, so
        that the coordinator can commit it once the members have reported."""
        key = stop_checkpoint_key(generation)
        if not self.store.check([key]) or int(self.store.get(key).decode()) != step:
            return
        if not self._checkpoint_due(step):
            self._write_checkpoint(engine, step)
        if self.checkpoints is not None:
            self.checkpoints.wait()  # errors went to _checkpoint_failed, never raised here
        self._publish_checkpoint_errors()

    def _checkpoint_due(self, step: int) -> bool:
        """Whether the plan's schedule checkpoints committed step ``step`` (``Plan``)."""
        interval, start = self.checkpoint_interval, self.checkpoint_from
        return interval > 0 and step >= start and (step - start) % interval == 0

    def _maybe_checkpoint(self, engine: RedundantPipelineEngine, step: int) -> None:
        if self._checkpoint_due(step):
            self._write_checkpoint(engine, step)

    def _write_checkpoint(self, engine: RedundantPipelineEngine, step: int) -> None:
        if self.checkpoints is None:
            self.checkpoints = CheckpointWriter(
                self.cfg.checkpoint_root(self.output),
                self.cfg.spotline.checkpoints.keep,
                on_error=self._checkpoint_failed,
            )
        if engine.grid.data_parallel_id != 0:
            return  # data-parallel peers hold identical state: pipeline 0 writes it
        state = self._engine_stage_state(engine)
        for stage, st in state.items():
            # What a restore must agree with: everything else a logical worker owns (its
            # samples, its dropout seeds) is a function of (seed, step, logical worker).
            payload: dict[str, Any] = {
                "version": st.version,
                "logical_workers": self.cfg.num_pipelines,
                "seed": self.cfg.spotline.training.seed,
            }
            for name in st.params:
                payload[f"param/{name}"] = st.params[name]
                for key, value in st.opt[name].items():
                    payload[f"{key}/{name}"] = value
            # Written by a background thread; the coordinator commits the step (writes its
            # manifest) once every stage's file is there.
            self.checkpoints.save_async(step, f"stage-{stage}", payload)

    def _restore_checkpoint(self, step: int) -> None:
        """Fatal loss: every logical stage from the last complete checkpoint on disk."""
        files = load_all(self.cfg.checkpoint_root(self.output), step)
        self.holdings = Holdings()
        for label, payload in files.items():
            stage = int(label.split("-")[1])
            st = StageState(int(payload["version"]), {}, {})
            for key, expected in (
                ("logical_workers", self.cfg.num_pipelines),
                ("seed", self.cfg.spotline.training.seed),
            ):
                if payload.get(key, expected) != expected:
                    raise RuntimeError(
                        f"checkpoint {label} of step {step} was written with {key} "
                        f"{payload[key]}, this run has {expected}: it is another job's"
                    )
            for key, value in payload.items():
                if key in ("version", "logical_workers", "seed"):
                    continue
                kind, name = key.split("/", 1)
                if kind == "param":
                    st.params[name] = value
                else:
                    st.opt.setdefault(name, {})[kind] = value
            self.holdings.stages[stage] = st

    def _finish(self, engine: RedundantPipelineEngine, generation: int) -> None:
        """Rank 0 of the last generation gathers the parameters, hashes and exports them."""
        from spotline.trainer import export_final_model

        digest = export_final_model(engine, self.hf_config, self.output, self.cfg)
        if digest is not None:
            self.store.set(FINAL_HASH_KEY, digest)
        dist.barrier()


class _GenerationHooks(StepHooks):
    """What an elastic worker adds to the shared loop (``spotline.loop``) in one generation:
    its progress and the stop check at each boundary, rebalancing, losses and rates to the
    store (rank 0), its clocks, checkpoints; and the phase-timed fault injections."""

    def __init__(
        self, worker: ElasticWorker, engine: RedundantPipelineEngine, generation: int, resume: int
    ) -> None:
        self.worker = worker
        self.engine = engine
        self.generation = generation
        self.resume = resume
        self.step = resume

    def inject(self, phase: str) -> None:
        """``engine.phase_hook``: a kill or SIGTERM injection timed at this step's ``phase``.
        Phase-less injections are the coordinator's (at a step boundary, several at once)."""
        self.worker.deliver_injections(self.step, phase)

    def before_step(self, step: int) -> bool:
        w = self.worker
        self.step = step
        w.store.set(progress_key(self.generation, w.wid), str(step))
        w.deliver_injections(step, None, own_only=True)
        if w._should_stop(self.generation, step):
            return True
        every = w.cfg.spotline.elasticity.rebalance_every
        if every > 0 and step > self.resume and (step - self.resume) % every == 0:
            w._rebalance(self.engine, step)
        # A generation's first step pays one-off costs (allocations, first collectives):
        # not a measure of speed.
        w._measuring = step > self.resume
        return False

    def after_step(self, done: StepDone) -> None:
        w = self.worker
        if dist.get_rank() == 0:
            w.store.set(loss_key(done.step), repr(done.loss))
            w.store.set(lr_key(done.step), repr(w.log.learning_rates[done.step]))
        w.train_start_t = min(w.train_start_t, time.time() - done.seconds)
        w.train_end_t = time.time()
        # Before the checkpoint of this boundary: a checkpoint's files imply that every
        # evaluation up to its step is in the store (the coordinator keeps them with it).
        if w.evaluator is not None and w.evaluator.due(done.step + 1):
            w.evaluator.run(self.engine, done.step + 1)
        w._maybe_checkpoint(self.engine, done.step + 1)
        w._publish_checkpoint_errors()
