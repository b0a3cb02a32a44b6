"""Bamboo's redundant computation inside DeepSpeed's pipeline engine.

Every stage ``s`` also holds a replica of its successor ``(s + 1) mod S`` (the last stage
holds stage 0): the successor's layers and optimizer state, kept bitwise equal to the
owner's after every step. The schedule (``spotline.plan.schedule``, pure data) adds the
replica's instructions (``spotline.plan.pipe_instructions``) to DeepSpeed's 1F1B
``TrainSchedule``; this engine executes them, each type with the handler of
:meth:`RedundantPipelineEngine.instruction_handlers`.

How the replica stays exact: after the data-parallel reduction each stage sends its reduced
gradients to its predecessor (one ring exchange per step, batched so that no send waits on
a send), and the predecessor applies the *same* update to the replica with the same
optimizer class and hyper-parameters, the same clip coefficient and the same learning rate.
AdamW's update is element-wise, so identical gradients and state give identical bits.

When it applies it: in lazy mode, in the next step's first bubble (the schedule's
``ReplicaStep`` there; :class:`PendingReplicaStep` keeps the step's rate and clip
coefficient until then), so the update leaves the step's critical path. The replica must
equal its owner only at the next commit: a failure before the update finds the received
gradients of a committed step, which the holder reports as ready and a recovery applies
(``spotline.worker.holdings.roll_forward``). A run's end and a digest check apply a waiting update
first (:meth:`RedundantPipelineEngine.flush_replica_step`). In eager mode the update follows
the commit at once: the redundant forwards of the next step read the replica.

Modes:

- ``lazy``: nothing redundant runs in steady state; the stage keeps what a replay of its
  successor needs (the successor's inputs, i.e. its own outputs; the last stage keeps
  stage 0's input ids) and the gradients of its own inputs (which its predecessor's
  replica holder needs).
- ``eager``: as lazy, plus the successor's forward pass runs in the pipeline bubbles with
  its autograd graph kept, so a takeover only has to run the backward pass (Bamboo's eager
  FRC; it costs memory, measured by the benchmark).

The replica lives outside ``engine.module`` (a plain attribute DeepSpeed does not walk), so
DeepSpeed's optimizer, gradient reduction, clipping and checkpoints never see it.

Replicas (``spotline.redundancy.replica``):

- ``full``: the holder keeps its successor's whole state.
- ``sharded``: with ``D`` physical pipelines the ``D`` holders of a stage (its predecessor
  in every pipeline) keep one shard each: the holder in pipeline ``p`` keeps, of each
  logical stage of its successor, shard ``p`` of ``D``: an equal range of the stage's
  elements (``spotline.plan.shards``), kept as flat pieces of the tensors it covers, each a
  1-D tensor of its own; its owner sends it only those elements' gradients and it steps
  only them (AdamW is element-wise: a piece steps to the owner's bits). It cannot replay
  its successor (lazy only, no stashes): a stage whose owners are all lost is assembled
  from the shards of every pipeline.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.torch_autocast import autocast_if_enabled

from spotline.config import ReplicaDevice
from spotline.exact.reduction import LogicalGradients
from spotline.pipeline.clipping import apply_clip
from spotline.pipeline.engine import Batch, Handler, SpotlinePipelineEngine, replica_messages
from spotline.pipeline.group_setup import wait_p2p
from spotline.pipeline.loss_scaling import unscale
from spotline.pipeline.memory import model_state_bytes
from spotline.pipeline.replay_inputs import ReplayInputs, exchange_replay_inputs
from spotline.pipeline.replica import (
    PendingReplicaStep,
    Replica,
    StepStash,
    piece_of,
    pieces_digest,
    shard_pieces_of,
    state_digest,
)
from spotline.pipeline.replica_transport import (
    REPLICA_GRAD_TAG,
    GradStream,
    ReplicaSender,
    joined_view,
    streams_untied,
)
from spotline.plan import pipe_instructions as pi
from spotline.plan.pipe_instructions import GradPart
from spotline.plan.redundancy_mode import RedundancyMode, redundancy_on
from spotline.plan.schedule import add_redundancy, train_schedule
from spotline.plan.schedule_rules import validate
from spotline.plan.shards import Piece, ReplicaKind
from spotline.wire.protocol import ModelStateBytes


def _unpack(saved: torch.Tensor) -> torch.Tensor:
    return saved


def _grad(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, which a replayed or received step has always set."""
    assert param.grad is not None
    return param.grad


class RedundantPipelineEngine(SpotlinePipelineEngine):
    """``SpotlinePipelineEngine`` plus Bamboo replicas and redundant computation."""

    def __init__(
        self,
        *args: Any,
        redundancy: RedundancyMode = "off",
        replica_device: ReplicaDevice = "host",
        replica: ReplicaKind = "full",
        logical_parts: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        """``redundancy``, ``replica_device``, ``replica``: the settings of the config's
        ``spotline.redundancy`` section, typed and checked there (``replica``: ``"full"`` or
        ``"sharded"``, see the module docstring); ``logical_parts``: the logical stages'
        layer boundaries, which shards are made by (None: the physical stages are the
        logical ones)."""
        super().__init__(*args, **kwargs)
        # One stage cannot hold a replica of another: nothing redundant to do.
        self.redundancy: RedundancyMode = redundancy if self.num_stages > 1 else "off"
        device = torch.device("cpu") if replica_device == "host" else self.device
        logical = list(logical_parts) if logical_parts is not None else list(self.module.parts)
        # Sharded over the physical pipelines; with one, the one shard is the whole.
        shards = int(self.grid.get_data_parallel_world_size()) if replica == "sharded" else 1
        shard = int(self.grid.data_parallel_id) if shards > 1 else 0
        self.replica: Replica | None = None
        # The pieces of this stage's parameters its sharded replica holder keeps (this
        # pipeline's shard): what this stage sends it and is compared with. None: the holder
        # keeps every tensor whole.
        self.held_by_predecessor: tuple[Piece, ...] | None = None
        if redundancy_on(self.redundancy):
            self.replica = Replica(
                self,
                (self.stage_id + 1) % self.num_stages,
                device,
                shard=shard,
                shards=shards,
                logical=logical,
            )
            if shards > 1:
                self.held_by_predecessor = shard_pieces_of(
                    list(self.module.named_parameters()), logical, shard, shards
                )
        self._plan = add_redundancy(self._plan, self.redundancy, replay=shards == 1)
        validate(self._plan)
        # The messages of this stage's reduced gradients to its holder, in send order.
        self._replica_messages = replica_messages(
            self.gradient_sizes, self.tied_names, streamed=self._streams_untied()
        )
        # Stage 0 sends its untied gradients during its last backward pass, a layer once
        # autograd has made all of its gradients final (StreamUntiedGrads): each parameter's
        # layer, and a hook on each that reports it final.
        self._stream: GradStream | None = None
        self._stream_layer: dict[int, int] = {}
        self._stream_counts: list[int] = []  # parameters in each streamed layer
        self._sender: ReplicaSender | None = None
        # Messages sent from inside a backward pass, while autograd still ran (a measure).
        self.sends_in_backward = 0
        if self._streams_untied():
            for layer, span in enumerate(self.streamed_layers):
                params = self.logical_gradients.span_params(span)
                self._stream_counts.append(len(params))
                for param in params:
                    self._stream_layer[id(param)] = layer
            # A weak reference: the module's parameters must not keep the engine alive.
            engine = weakref.ref(self)

            def on_final(param: torch.Tensor) -> None:
                owner = engine()
                if owner is not None:
                    owner._on_grad_final(param)

            for param in self.logical_gradients.params:
                param.register_post_accumulate_grad_hook(on_final)  # type: ignore[no-untyped-call]
            self._sender = ReplicaSender()
            weakref.finalize(self, self._sender.close)
        # A committed update the replica has yet to apply (lazy: until the next step's
        # bubble); None when the replica is up to date with its owner's last commit.
        self.replica_pending: PendingReplicaStep | None = None
        self.stash = StepStash()
        self.replica_grads_from = "owner"  # or "replay": a test of the takeover path
        # The replica exchange in flight: this stage's sends (with the tensors they read)
        # and the receive ReplicaGradPost posted; ReplicaGradRecv waits for both.
        self._pending_sends: list[tuple[dist.Work | Future[dist.Work], torch.Tensor]] = []
        self._posted_recvs: list[dist.Work] = []
        self._replica_recv: torch.Tensor | None = None
        self.redundant_s = 0.0
        self.replica_sync_s = 0.0
        self.model_state = ModelStateBytes()
        self.replay_s = 0.0
        self._pre_tied_grads: dict[str, torch.Tensor] = {}
        # What the last replay inputs exchange brought (replay_replica_steps only).
        self.replay_inputs = ReplayInputs({}, {})
        # Commit bookkeeping (what a survivor reports after a failure): optimizer steps
        # applied to the own stage and to the replica, and whether this step's final
        # gradients are held (the step can still be applied without communication).
        self.applied_steps = 0
        self.replica_applied_steps = 0
        self.own_ready = False
        self.replica_ready = False
        # Called with a phase name (spotline.plan.chaos.PHASES: "forward", ..., "optimizer"
        # as each instruction starts, "committed" once past the commit point): fault
        # injection and progress reporting hook in here.
        self.phase_hook: Callable[[str], None] | None = None
        # The commit barrier; the elastic worker replaces it with one over the job's store
        # that also watches for an abort (a gloo barrier can wait on a failed peer whose
        # sockets stay open until the process group times out).
        self.commit_barrier: Callable[[], None] = dist.barrier

    @classmethod
    def instruction_handlers(cls) -> dict[type, Handler]:
        return {
            **super().instruction_handlers(),
            pi.StashOutput: cls._exec_stash_output,
            pi.StashInputGrad: cls._exec_stash_input_grad,
            pi.ReplicaLoad: cls._exec_replica_load,
            pi.RedundantForward: cls._exec_redundant_forward,
            pi.ReplicaGradPost: cls._exec_replica_grad_post,
            pi.ReplicaGradSend: cls._exec_replica_grad_send,
            pi.ReplicaGradRecv: cls._exec_replica_grad_recv,
            pi.StreamUntiedGrads: cls._exec_stream_untied_grads,
            pi.ReplicaStep: cls._exec_replica_step,
        }

    def begin_step(self, *, seed: int, step: int, logical_worker: int) -> None:
        super().begin_step(seed=seed, step=step, logical_worker=logical_worker)
        self.stash = StepStash()

    def _exec_begin_logical_worker(self, index: int) -> None:
        super()._exec_begin_logical_worker(index)
        # Stashes are by micro-batch: a replay covers the logical worker that ran last.
        self.stash = StepStash()

    def _phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name)

    def _exec_forward_pass(self, buffer_id: int) -> None:
        self._phase("forward")
        super()._exec_forward_pass(buffer_id)

    def _exec_backward_pass(self, buffer_id: int) -> None:
        self._phase("backward")
        try:
            super()._exec_backward_pass(buffer_id)
        finally:
            stream, self._stream = self._stream, None
        if stream is not None:
            # A layer with a parameter the pass gave no gradient (an unused one) goes now.
            self._send_final_layers(stream, flush=True)
            if stream.error is not None:
                raise stream.error

    def _exec_send_activations(self, buffer_id: int) -> None:
        self._phase("send")
        super()._exec_send_activations(buffer_id)

    def _exec_send_grads(self, buffer_id: int) -> None:
        self._phase("send")
        super()._exec_send_grads(buffer_id)

    def _exec_recv_activations(self, buffer_id: int) -> None:
        self._phase("recv")
        super()._exec_recv_activations(buffer_id)

    def _exec_recv_grads(self, buffer_id: int) -> None:
        self._phase("recv")
        super()._exec_recv_grads(buffer_id)

    # -- the commit ---------------------------------------------------------------------------
    def _exec_optimizer_step(self, lr_kwargs: Any = None) -> None:
        """Prepare, commit, apply: the optimizer step is the step's commit point.

        Every rank first finishes everything that needs communication (tied and data
        parallel reductions, the replica gradient exchange, fp16's overflow decision, the
        clip norm: ``prepare_update``), then passes a global barrier. A rank that applies
        the step therefore knows every rank held its final gradients, so after a failure
        the survivors can all apply the step (or, if
        no one passed the barrier, all redo it): no step is lost or applied twice.
        """
        self._phase("optimizer")
        self.prepare_update()
        self.aggregate_loss_before_commit()
        self.own_ready = True
        self.replica_ready = self.replica is not None and self.replica.flat_grads is not None
        # Every kind of state is alive here (this step's gradients and stashes, the
        # replica's received gradients): the per-kind peak is taken at this point.
        self.model_state = self.model_state.peak(
            model_state_bytes(self.module, self.optimizer, self.replica, self.stash)
        )
        self.commit_barrier()
        self._phase("committed")
        super()._exec_optimizer_step(lr_kwargs)
        self.applied_steps += 1
        self.own_ready = False
        if self.replica is not None and self.replica.flat_grads is not None:
            # The owner's rate and coefficient of this step, for the ReplicaStep that
            # applies it (maybe in the next step, after both have moved on).
            stepped = self.stepped_with
            self.replica_pending = PendingReplicaStep(
                self.rng_step, self.last_clip_coefficient, stepped.state, stepped.skipped
            )

    def _peer(self, stage: int) -> int:
        return int(self.grid.stage_to_global(stage_id=stage % self.num_stages))

    def _batch(self, micro_batch: int) -> Batch:
        assert self.batch_source is not None, "set engine.batch_source before training"
        return self.batch_source(self.rng_step, self.rng_logical_worker, micro_batch)

    # -- stashes ------------------------------------------------------------------------
    def _exec_stash_output(self, buffer_id: int, micro_batch_id: int) -> None:
        out = self.pipe_buffers["outputs"][buffer_id]
        assert torch.is_tensor(out), "Spotline layers pass one tensor between stages"
        self.stash.outputs[micro_batch_id] = out.detach().clone()

    def _exec_stash_input_grad(self, buffer_id: int, micro_batch_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        assert torch.is_tensor(inputs) and inputs.grad is not None
        self.stash.input_grads[micro_batch_id] = inputs.grad.detach().clone()

    def _exec_replica_load(self, micro_batch_id: int) -> None:
        self.stash.replica_inputs[micro_batch_id] = self._batch(micro_batch_id)[0].to(self.device)

    def _replica_input(self, micro_batch: int) -> torch.Tensor:
        assert self.replica is not None
        if self.replica.stage == 0:
            return self.stash.replica_inputs[micro_batch]
        return self.stash.outputs[micro_batch]

    # -- redundant forward --------------------------------------------------------------
    def _replica_forward(self, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The successor's forward (and loss, for the last stage) with the owner's RNG context."""
        assert self.replica is not None
        source = self._replica_input(micro_batch)
        leaf = source.detach()
        if leaf.is_floating_point():
            leaf.requires_grad_(True)
        self._rng_micro_batch = micro_batch
        # The weights and the input (a stash) are counted as what they are, not as graph.
        weights = {p.untyped_storage().data_ptr() for p in self.replica.params}
        weights.add(leaf.untyped_storage().data_ptr())
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(
                partial(self.stash.count_saved, exclude=weights), _unpack
            ),
        ):
            # The owner's layers run under DeepSpeedEngine.forward's autocast and its loss
            # outside it (PipelineEngine takes the loss after forward returns): the same here.
            with autocast_if_enabled(self):
                out = self.replica.forward(leaf)
            if self.replica.is_last:
                labels = self._batch(micro_batch)[1].to(self.device)
                out = self.replica.loss_fn(out, labels)
        return leaf, out

    def _exec_redundant_forward(self, micro_batch_id: int) -> None:
        t0 = time.perf_counter()
        self.stash.redundant[micro_batch_id] = self._replica_forward(micro_batch_id)
        self.redundant_s += time.perf_counter() - t0

    # -- tied weights: remember the unreduced gradients a replay adds to ---------------
    def _exec_reduce_tied_grads(self) -> None:
        # Only a replay adds to them, and a sharded replica never replays.
        if self.replica is not None and not self.replica.sharded:
            params = dict(self.module.named_parameters())
            self._pre_tied_grads = {
                name: params[name].grad.detach().clone()
                for pair in self.tied_pairs
                for name in (pair.original, pair.copy)
                if name in params and params[name].grad is not None
            }
        super()._exec_reduce_tied_grads()

    # -- replica synchronisation ------------------------------------------------------------
    def _sends_untied_early(self) -> bool:
        # A sharded replica's holder takes its pieces in one message, after every reduction.
        return (
            self.replica is not None
            and self.held_by_predecessor is None
            and self.untied_elements is not None
        )

    def _streams_untied(self) -> bool:
        return (
            self.replica is not None
            and bool(self.streamed_layers)
            and streams_untied(
                self.stage_id,
                self.num_stages,
                self.grid.get_data_parallel_world_size(),
                sharded=self.held_by_predecessor is not None,
            )
        )

    def _message_spans(self, part: GradPart) -> list[tuple[int, int]]:
        """The flat gradient elements of each message this stage sends for ``part``, in
        order: those of ``replica_messages`` (the holder's receives, ``Replica.message_spans``,
        are the same) that ``part`` covers."""
        if self.held_by_predecessor is not None:
            assert part is GradPart.ALL, part
            return [self.grad_span(GradPart.ALL)]
        lo, hi = self.grad_span(part)
        return [(a, b) for a, b in self._replica_messages if lo <= a and b <= hi]

    def _exec_stream_untied_grads(self, index: int) -> None:
        assert self._stream is None and self.replica is not None
        self._stream = GradStream(self.hosted_logical_workers[index], list(self._stream_counts))

    def _on_grad_final(self, param: torch.Tensor) -> None:
        """Autograd made ``param``'s gradient of this backward pass final (a hook)."""
        stream = self._stream
        layer = self._stream_layer.get(id(param))
        if stream is None or layer is None:
            return  # not the streamed pass, or a tied layer's (after ReduceTiedGrads)
        # Each parameter is used once in a layer's graph: a second gradient would come after
        # its layer was sent.
        assert id(param) not in stream.final, "a parameter's gradient made final twice"
        stream.final.add(id(param))
        stream.remaining[layer] -= 1
        self._send_final_layers(stream, flush=False)

    def _send_final_layers(self, stream: GradStream, *, flush: bool) -> None:
        """Keep, reduce (locally: one pipeline) and send each streamed layer whose gradients
        are all final (``flush``: every one left), in ``streamed_layers`` order, the order
        the holder posted its receives in. An error is raised after the backward pass, not
        through autograd."""
        layers = self.streamed_layers
        while stream.error is None and stream.sent < len(layers):
            if not flush and stream.remaining[stream.sent] > 0:
                return
            span = layers[stream.sent]
            stream.sent += 1
            try:
                self.logical_gradients.keep(stream.logical_worker, zero=False, span=span)
                self.logical_gradients.reduce(group=self.grid.get_data_parallel_group(), span=span)
                self._send_span(span)
                if not flush:
                    self.sends_in_backward += 1
            except Exception as exc:  # noqa: BLE001  # re-raised by _exec_backward_pass
                stream.error = exc

    def _send_span(self, span: tuple[int, int]) -> None:
        """Post the send of this stage's reduced gradients in ``span`` to its holder."""
        self._send([_grad(p).reshape(-1) for p in self.logical_gradients.span_params(span)])

    def _send(self, tensors: list[torch.Tensor]) -> None:
        """Post the send of ``tensors``, as one message, to this stage's replica holder."""
        t0 = time.perf_counter()
        # Sent from the sum's buffer itself where the gradients are its views in this order
        # (whole replicas): nothing writes them before ReplicaGradRecv waits.
        joined = joined_view(tensors)
        flat = joined if joined is not None else torch.cat(tensors)
        holder = self._peer(self.stage_id - 1)
        work: dist.Work | Future[dist.Work] | None
        if self._sender is not None:
            work = self._sender.post(flat, holder)
        else:
            work = dist.isend(flat, holder, tag=REPLICA_GRAD_TAG)
            assert work is not None  # the world group: every rank is in it
        self._pending_sends.append((work, flat))
        self.replica_sync_s += time.perf_counter() - t0

    def _exec_replica_grad_post(self) -> None:
        assert self.replica is not None and not self._posted_recvs
        # The previous update must be applied before this exchange overwrites its gradients
        # (the schedule's rule replica-step-before-exchange).
        assert self.replica_pending is None, "the replica's previous update was never applied"
        t0 = time.perf_counter()
        numel = sum(p.numel() for p in self.replica.params)
        # Kept across steps (the replica's gradients are views of it until its step drops
        # them): a fresh buffer of a real stage's size faults in fresh pages every step.
        flat = self._replica_recv
        if flat is None or flat.numel() != numel:
            flat = self._replica_recv = torch.empty(numel, dtype=self.replica.params[0].dtype)
        successor = self._peer(self.stage_id + 1)
        for start, stop in self.replica.message_spans:
            work = dist.irecv(flat[start:stop], successor, tag=REPLICA_GRAD_TAG)
            assert work is not None  # the world group: every rank is in it
            self._posted_recvs.append(work)
        self.replica_sync_s += time.perf_counter() - t0

    def _exec_replica_grad_send(self, part: GradPart = GradPart.ALL) -> None:
        if self.held_by_predecessor is None:
            for span in self._message_spans(part):
                self._send_span(span)
        else:
            # A sharded replica's holder gets only its pieces' gradients, in their order.
            params = dict(self.module.named_parameters())
            self._send([piece_of(_grad(params[x.name]), x) for x in self.held_by_predecessor])

    def _exec_replica_grad_recv(self) -> None:
        assert self.replica is not None and self._posted_recvs and self._pending_sends
        t0 = time.perf_counter()
        for work in self._posted_recvs:
            wait_p2p(work)
        for send, _ in self._pending_sends:
            # A send posted by the sender thread: its error (a lost peer) is raised here.
            wait_p2p(send.result() if isinstance(send, Future) else send)
        self._posted_recvs, self._pending_sends = [], []
        self.replica.flat_grads = self._replica_recv
        self.replica_sync_s += time.perf_counter() - t0
        if self.replica_grads_from == "replay":
            self.exchange_replay_inputs()

    def _exec_replica_step(self) -> None:
        assert self.replica is not None
        pending = self.replica_pending
        if pending is None:
            # The first step since the replica was built or loaded: no commit to apply yet.
            assert self.replica.flat_grads is None
            return
        self._apply_replica_step(pending)

    def flush_replica_step(self) -> bool:
        """Apply the committed update still waiting for the next step's bubble, if any (at a
        run's end, before a digest check or a planned hand-over of the state). Local: no
        communication. Returns whether there was one."""
        if self.replica_pending is None:
            return False
        self._apply_replica_step(self.replica_pending)
        return True

    def replay_replica_steps(self) -> None:
        """From the next step on, compute the replica's gradients by replaying the successor
        (a test of the takeover path) instead of using the received ones. The replay needs
        the step's own stashes, so the update then follows the commit at once."""
        assert self.held_by_predecessor is None, "a sharded replica cannot replay"
        self.flush_replica_step()
        self.replica_grads_from = "replay"
        self._plan = add_redundancy(
            train_schedule(self.num_stages, self.micro_batches),
            self.redundancy,
            replica_step_in_bubble=False,
        )
        validate(self._plan)
        self._lowered.clear()

    def _apply_replica_step(self, pending: PendingReplicaStep) -> None:
        assert self.replica is not None and self.replica.flat_grads is not None
        t0 = time.perf_counter()
        if self.replica_grads_from == "replay":
            # The replay reads this step's stashes: only right after this step's commit.
            assert pending.step == self.rng_step
            received = self.replica.flat_grads
            self.replay_successor(pending.loss_scale.scale)
            replayed = torch.cat([_grad(p).reshape(-1) for p in self.replica.params])
            self.replay_matched_owner_grads = torch.equal(replayed, received)
        else:
            self.replica.set_grads_from_flat(self.replica.flat_grads)
        if not pending.skip:  # an fp16 step the job's overflow skipped: nothing to apply
            # The owner's scale and coefficient, applied with the same ops to the same
            # gradients.
            unscale((p.grad for p in self.replica.params), 1.0 / pending.loss_scale.scale)
            if self.gradient_clipping() > 0:
                apply_clip((p.grad for p in self.replica.params), pending.clip)
            # The owner's rate for that step: not read from the owner's optimizer, whose
            # scheduler has already moved on (ReplicaStep follows OptimizerStep).
            self.step_schedule.apply(
                self.replica.optimizer.param_groups,
                pending.loss_scale.schedule_position(pending.step),
            )
            self.replica.optimizer.step()
        self.replica.zero_grad()
        self.replica.flat_grads = None
        self.replica_applied_steps += 1
        assert self.replica_applied_steps == pending.step + 1
        self.replica_ready = False
        self.replica_pending = None
        self.replica_sync_s += time.perf_counter() - t0

    # -- failover replay (Bamboo's lazy backward redundant computation) -----------------
    def replay_successor(self, loss_scale: float = 1.0) -> None:
        """Recompute the successor's gradients for this step from what this process holds.

        Inputs: the replica (parameters as of the previous step), the successor's inputs
        (this stage's stashed outputs, or stage 0's token ids), the successor's output
        gradients (``replay_inputs.output_grads``, kept by the stage after it until the step
        commits) and, for a tied weight, the partner's unreduced gradient. Leaves the
        replica's ``.grad`` equal to what the owner's reduced gradient was.
        """
        assert self.replica is not None
        t0 = time.perf_counter()
        replica = self.replica
        replica.zero_grad()
        for micro_batch in range(self.micro_batches):
            if micro_batch in self.stash.redundant:
                # Eager: the forward already ran in a bubble; only the backward remains.
                _, out = self.stash.redundant[micro_batch]
            else:
                _, out = self._replica_forward(micro_batch)
            self._rng_micro_batch = micro_batch
            if replica.is_last:
                # DeepSpeedEngine.backward: the loss divided by the micro-batch count, then
                # scaled by the step's loss scale (fp16; 1 otherwise).
                loss = out / self.micro_batches
                (loss * loss_scale if self.loss_scaler.scaling.enabled else loss).backward()
            else:
                # torch leaves Tensor.backward unannotated
                out.backward(gradient=self.replay_inputs.output_grads[micro_batch])  # type: ignore[no-untyped-call]
        params = dict(replica.named_params)
        for pair in self.tied_pairs:
            for mine, partner in ((pair.original, pair.copy), (pair.copy, pair.original)):
                if mine in params:
                    held = _grad(params[mine])
                    other = self.replay_inputs.partner_grads[partner]
                    # The original's gradient first, as in _exec_reduce_tied_grads.
                    summed = held + other if mine == pair.original else other + held
                    held.copy_(summed)
        if self.num_logical_workers == 1:
            # The owner's gradients went through the exact reduction (of its one logical
            # worker); the replayed ones take the same path, locally.
            exact = LogicalGradients(
                replica.params, 1, finite_only=not self.loss_scaler.scaling.enabled
            )
            exact.keep(0)
            exact.reduce(local=True)
        self.replay_s += time.perf_counter() - t0

    def exchange_replay_inputs(self) -> None:
        """Gather what a replay of the successor needs from other stages (every stage at
        once: a test of the takeover path; ``spotline.pipeline.replay_inputs``)."""
        self.replay_inputs = exchange_replay_inputs(
            self, self.stash, self.replica, self._pre_tied_grads
        )

    # -- exactness checks -------------------------------------------------------------------
    def own_digest(self) -> str:
        """This stage's state as its replica holder keeps it (its shard's pieces, when
        sharded)."""
        named = list(self.module.named_parameters())
        if self.held_by_predecessor is None:
            return state_digest(named, self.optimizer)
        return pieces_digest(named, self.optimizer, self.held_by_predecessor)

    def replica_digest(self) -> str:
        assert self.replica is not None
        return state_digest(self.replica.named_params, self.replica.optimizer)
