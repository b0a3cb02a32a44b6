"""DeepSpeed's plain data-parallel engine with the exact reduction over logical workers.

``deepspeed.initialize(model=<HF model>)`` returns a ``DeepSpeedEngine`` whose gradient
all-reduce is a float sum over processes: its bits depend on how many processes there are.
:class:`ExactDataParallelEngine` is that engine with one change: at the gradient
accumulation boundary, ``allreduce_gradients`` runs ``LogicalGradients.reduce`` (the exact
fixed-order mean over all ``N`` logical workers, :mod:`spotline.exact.reduction`) instead of DeepSpeed's
bucketed float all-reduce. A job of ``N`` logical workers then trains to the same bits on
any number ``M`` of processes, each hosting some of the logical workers and running them in
turn (EasyScale's determinism).

How DeepSpeed's own counters carry it (:func:`initialize` sets them up):

- The config the user writes describes the logical job: ``train_micro_batch_size_per_gpu``
  is the micro-batch size, ``gradient_accumulation_steps`` the micro-batches per logical
  worker and step (``m``), ``train_batch_size`` (optional) ``micro x m x N``. DeepSpeed is
  given what the process runs: ``gradient_accumulation_steps = k x m`` for ``k`` hosted
  logical workers, ``train_batch_size = micro x m x N`` (so ``global_samples`` counts the
  real global batch, whatever ``M``). DeepSpeed's micro-step counter then reaches its
  boundary, and applies the optimizer, exactly once per logical step.
- ``backward`` scales the loss by ``1/m`` (the logical worker's own accumulation), not by
  DeepSpeed's ``1/(k x m)``, which would depend on ``k``.
- DeepSpeed calls ``allreduce_gradients`` after every backward. The override, from the
  micro-step counter, moves the gradients aside (``LogicalGradients.keep``) after each
  logical worker's last micro-batch, and at the boundary reduces them exactly. Nothing is
  reduced in between.
- ``clip_fp32_gradients`` computes the norm locally from the reduced gradients (the same on
  every process). DeepSpeed's ``clip_grad_norm_`` averages the norm over the data-parallel
  group (``norm / M`` summed over ``M`` ranks), which changes its bits with ``M``.

Only plain fp32 data parallelism is supported: ZeRO (any stage: stage 1 reduces through its
own partitioned optimizer, stage 2/3 during backward), fp16, bf16, AMP, torch autocast,
unmanaged gradient accumulation, gradient pre-scaling, sparse gradients and pipeline modules
are refused with a ValueError naming the config key.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from deepspeed import set_optimizer_flags
from deepspeed.runtime import zero
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE, DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule

from spotline.exact.reduction import LogicalGradients
from spotline.runtime import seed_logical_worker

LossFn = Callable[["ExactDataParallelEngine", Any], torch.Tensor]

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _section_enabled(config: Mapping[str, Any], key: str) -> bool:
    section = config.get(key)
    if isinstance(section, Mapping):
        return bool(section.get("enabled", False))
    return bool(section)


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse what the exact reduction does not cover; ValueError naming the config key."""
    zero_cfg = config.get("zero_optimization")
    stage = 0
    if isinstance(zero_cfg, Mapping):
        stage = int(zero_cfg.get("stage", 0))
    elif zero_cfg:  # the legacy boolean form means stage 1
        stage = 1
    if stage >= 1:
        raise ValueError(
            f"zero_optimization.stage={stage} is not supported by ExactDataParallelEngine: "
            "ZeRO reduces gradients through its own partitioned optimizer (and ZeRO-2/3 during "
            "backward); use stage 0 (plain fp32 data parallelism)"
        )
    for key in ("fp16", "bf16", "bfloat16", "amp", "torch_autocast"):
        if _section_enabled(config, key):
            raise ValueError(
                f"{key}.enabled is not supported by ExactDataParallelEngine: the exact "
                "reduction covers plain fp32 training only"
            )
    if config.get("managed_gradient_accumulation", True) is not True:
        raise ValueError(
            "managed_gradient_accumulation=false is not supported by ExactDataParallelEngine: "
            "its micro-step counter decides which logical worker a micro-batch belongs to"
        )
    if config.get("gradient_allreduce_op", "mean") != "mean":
        raise ValueError(
            "gradient_allreduce_op must be 'mean' for ExactDataParallelEngine (the exact "
            "reduction computes the mean over logical workers)"
        )
    if config.get("prescale_gradients", False):
        raise ValueError("prescale_gradients is not supported by ExactDataParallelEngine")
    if float(config.get("gradient_predivide_factor", 1.0)) != 1.0:
        raise ValueError("gradient_predivide_factor is not supported by ExactDataParallelEngine")
    if config.get("sparse_gradients", False):
        raise ValueError("sparse_gradients is not supported by ExactDataParallelEngine")
    if _section_enabled(config, "hybrid_engine"):
        raise ValueError("hybrid_engine.enabled is not supported by ExactDataParallelEngine")
    if int(config.get("sequence_parallel_size", 1)) != 1:
        raise ValueError("sequence_parallel_size is not supported by ExactDataParallelEngine")


def logical_batch(config: Mapping[str, Any], num_logical_workers: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch_size, micro_batches_per_logical_worker)`` of the
    logical job: DeepSpeed's batch arithmetic with ``num_logical_workers`` in place of the
    number of processes (any two of the three keys determine the third)."""
    train, micro, gas = (config.get(k) for k in _BATCH_KEYS)
    n = num_logical_workers
    if micro is None and train is not None:
        gas = 1 if gas is None else gas
        micro = train // (n * gas)
    if micro is None:
        raise ValueError("train_micro_batch_size_per_gpu or train_batch_size must be set")
    if gas is None:
        gas = 1 if train is None else train // (n * micro)
    if train is None:
        train = micro * gas * n
    if micro < 1 or gas < 1 or train != micro * gas * n:
        raise ValueError(
            f"train_batch_size={train} must equal train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={gas} x {n} logical workers"
        )
    return int(train), int(micro), int(gas)


def _check_hosting(hosted: Sequence[int], num_logical_workers: int) -> list[int]:
    """Every process's hosted logical workers: sorted, distinct, in range, and (collectively)
    each logical worker hosted by exactly one process. Every process raises together."""
    mine = sorted(int(w) for w in hosted)
    if not mine:
        raise ValueError("hosted_logical_workers is empty: a process must host a logical worker")
    if len(set(mine)) != len(mine) or not all(0 <= w < num_logical_workers for w in mine):
        raise ValueError(
            f"hosted_logical_workers={list(hosted)} must be distinct ids in "
            f"0..{num_logical_workers - 1}"
        )
    count = torch.zeros(num_logical_workers, dtype=torch.int64)
    count[mine] = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count)  # collective: all processes reach the same verdict
    wrong = [w for w in range(num_logical_workers) if int(count[w]) != 1]
    if wrong:
        raise ValueError(
            f"logical workers {wrong} are not hosted by exactly one process "
            f"(hosting counts {count.tolist()})"
        )
    return mine


class ExactDataParallelEngine(DeepSpeedEngine):  # type: ignore[misc]
    """``DeepSpeedEngine`` whose data-parallel reduction is exact over logical workers.

    Build it with :func:`initialize`. Train with :meth:`train_logical_step`, or with the
    usual DeepSpeed loop (``loss = ...engine(...)``, ``engine.backward(loss)``,
    ``engine.step()``) feeding each hosted logical worker's ``m`` micro-batches in turn, in
    logical-worker order.
    """

    micro_steps: int  # DeepSpeed's micro-step counter (set by DeepSpeedEngine.__init__)

    def __init__(
        self,
        *args: Any,
        num_logical_workers: int,
        hosted_logical_workers: Sequence[int],
        micro_batches_per_logical_worker: int,
        **kwargs: Any,
    ) -> None:
        # DeepSpeed's constructor does not call the methods overridden here, but set the
        # attributes they read first anyway.
        self.num_logical_workers = num_logical_workers
        self.hosted_logical_workers = tuple(hosted_logical_workers)
        self.micro_batches_per_logical_worker = micro_batches_per_logical_worker
        super().__init__(*args, **kwargs)
        if self.has_moe_layers:
            raise ValueError("MoE layers are not supported by ExactDataParallelEngine")
        expected = len(self.hosted_logical_workers) * micro_batches_per_logical_worker
        assert self.gradient_accumulation_steps() == expected, "build it with initialize()"
        self.logical_gradients = LogicalGradients(
            [p for p in self.module.parameters() if p.requires_grad], num_logical_workers
        )

    # -- where a micro-batch stands in the step -------------------------------------------

    def _position(self) -> tuple[int, int]:
        """(index into hosted_logical_workers, micro-batch) of the backward being run."""
        index, micro_batch = divmod(
            self.micro_steps % int(self.gradient_accumulation_steps()),
            self.micro_batches_per_logical_worker,
        )
        return index, micro_batch

    @property
    def current_logical_worker(self) -> int:
        """The logical worker whose micro-batch the next (or running) backward belongs to."""
        return self.hosted_logical_workers[self._position()[0]]

    @property
    def data_parallel_process_group(self) -> Any:
        """The group the gradients are reduced over (DeepSpeed's own data-parallel group)."""
        return self.seq_data_parallel_group

    # -- DeepSpeed overrides ---------------------------------------------------------------

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):  # type: ignore[no-untyped-def]
        """DeepSpeed's backward, the loss scaled by ``1/m`` (micro-batches per logical
        worker) instead of ``1/gradient_accumulation_steps`` (which counts every hosted
        logical worker's micro-batches, so depends on the placement)."""
        if scale_wrt_gas:
            loss = loss / self.micro_batches_per_logical_worker
        return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    def allreduce_gradients(self, bucket_size: int = MEMORY_OPT_ALLREDUCE_SIZE) -> None:
        """Replaces DeepSpeed's float all-reduce: after a logical worker's last micro-batch,
        keep its gradients aside; at the accumulation boundary, the exact mean over all
        logical workers (collective over the data-parallel group; NonFiniteGradient on
        every process when a logical worker's gradient is not finite)."""
        index, micro_batch = self._position()
        if micro_batch == self.micro_batches_per_logical_worker - 1:
            self.logical_gradients.keep(self.hosted_logical_workers[index])
        if self.is_gradient_accumulation_boundary():
            kept = sorted(w for w, _ in self.logical_gradients.kept)
            if kept != list(self.hosted_logical_workers):
                self.logical_gradients.kept = []
                raise RuntimeError(
                    f"gradient accumulation boundary with logical workers {kept} kept, expected "
                    f"{list(self.hosted_logical_workers)}: run each hosted logical worker's "
                    f"{self.micro_batches_per_logical_worker} micro-batches (backward + step) "
                    "and leave the boundary to DeepSpeed's counter"
                )
            self.logical_gradients.reduce(group=self.data_parallel_process_group)

    def clip_fp32_gradients(self) -> None:
        """Clip by the global norm of the reduced gradients, computed locally.

        The gradients are bitwise the same on every process after the exact reduction, so
        the local norm is the global one. The arithmetic is DeepSpeed's ``clip_grad_norm_``
        without its data-parallel averaging of the norm (``norm / M`` summed over ``M``
        processes, which changes the bits with ``M``)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return
        norms = [p.grad.detach().float().norm(2.0) for p in params]
        total_norm = torch.stack(norms).pow(2.0).sum().float().pow(1.0 / 2.0)
        max_norm = torch.tensor([float(self.gradient_clipping())])
        clip_coef = torch.min(torch.tensor([1.0]), max_norm / (total_norm + 1e-6))
        for p in params:
            p.grad.detach().mul_(clip_coef)
        self._global_grad_norm = total_norm

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Refused: skipping the backward hook would skip keeping a logical worker's
        gradients, and the step's gradients would mix logical workers."""
        raise RuntimeError("no_sync() is not supported by ExactDataParallelEngine")
        yield  # pragma: no cover

    # -- one logical step ------------------------------------------------------------------

    def train_logical_step(
        self,
        step: int,
        seed: int,
        batches: Mapping[int, Sequence[Any]] | Sequence[Sequence[Any]],
        loss_fn: LossFn,
    ) -> float:
        """One optimizer step over every hosted logical worker; returns the mean loss over
        all ``N`` logical workers, the same on every process and for every placement.

        ``batches[w]`` are logical worker ``w``'s ``m`` micro-batches (only hosted ones are
        read); ``loss_fn(engine, micro_batch)`` runs the forward through the engine and
        returns the micro-batch's (unscaled) loss. Before each forward the global torch, numpy
        and Python RNGs are seeded from ``(seed, step, w, micro_batch)``
        (``spotline.runtime.seed_logical_worker``), so dropout belongs to the logical worker. An error before the optimizer step (NonFiniteGradient included)
        leaves the parameters and optimizer untouched: the gradients and DeepSpeed's
        micro-step counter are put back to the start of the step, and the error is raised;
        the step can then be run again.
        """
        if not self.enable_backward_allreduce or self.inside_no_sync_ctxt:
            raise RuntimeError("the engine's backward reduction is switched off")
        window = int(self.gradient_accumulation_steps())
        start = self.micro_steps
        if start % window != 0:
            raise RuntimeError(
                f"micro step {start} is inside a gradient accumulation window of {window}: "
                "the previous step did not finish"
            )
        m = self.micro_batches_per_logical_worker
        losses: dict[int, torch.Tensor] = {}
        try:
            for w in self.hosted_logical_workers:
                micro_batches = batches[w]
                if len(micro_batches) != m:
                    raise ValueError(
                        f"logical worker {w} has {len(micro_batches)} micro-batches, expected {m}"
                    )
                total: torch.Tensor | None = None
                for micro_batch, batch in enumerate(micro_batches):
                    assert self.current_logical_worker == w
                    seed_logical_worker(seed, step, w, micro_batch)
                    loss = loss_fn(self, batch)
                    value = loss.detach().float()
                    total = value if total is None else total + value
                    self.backward(loss)
                    self.step()
                assert total is not None
                losses[w] = total / m
        except BaseException:
            self._abandon_step(start)
            raise
        assert self.micro_steps == start + window and self.global_steps >= 1
        return self.mean_logical_loss(losses)

    def _abandon_step(self, start: int) -> None:
        """Back to the start of a step that failed before its optimizer step: no kept or
        accumulated gradients, DeepSpeed's micro-step counter at ``start``, and the timers
        an interrupted backward left running (wall_clock_breakdown) stopped."""
        self.micro_steps = start
        self.logical_gradients.kept = []
        self.zero_grad()
        for name in self.engine_timers.active_timers():
            timer = self.timers(name)
            if getattr(timer, "started_", False):
                timer.stop()

    def mean_logical_loss(self, losses: Mapping[int, torch.Tensor]) -> float:
        """The mean over all logical workers of their losses (this process gives its hosted
        ones), independent of the placement: a length-``N`` vector where each entry is set
        by exactly one process is summed over processes (adding zeros is exact), then added
        in logical-worker order and divided by ``N``."""
        vector = torch.zeros(self.num_logical_workers, dtype=torch.float32)
        for w, value in losses.items():
            vector[w] = value
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(vector, group=self.data_parallel_process_group)
        total = vector[0].clone()
        for w in range(1, self.num_logical_workers):
            total = total + vector[w]
        return float(total / self.num_logical_workers)


def initialize(
    model: torch.nn.Module,
    config: Mapping[str, Any],
    *,
    num_logical_workers: int,
    hosted_logical_workers: Sequence[int],
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
) -> ExactDataParallelEngine:
    """Build an :class:`ExactDataParallelEngine` the way ``deepspeed.initialize`` builds its
    ``DeepSpeedEngine`` (which it hard-codes), for a job of ``num_logical_workers`` logical
    workers of which this process hosts ``hosted_logical_workers``.

    ``config`` is the DeepSpeed config of the logical job (see the module docstring for the
    batch keys); it is not modified. Initializes DeepSpeed's communication from the
    RANK/WORLD_SIZE/MASTER_* variables when needed. Collective: every process of the job
    calls it. Returns the engine (its ``optimizer`` and ``lr_scheduler`` are attributes).
    """
    if isinstance(model, PipelineModule):
        raise ValueError("ExactDataParallelEngine takes a plain module, not a PipelineModule")
    if num_logical_workers < 1:
        raise ValueError(f"num_logical_workers must be >= 1, got {num_logical_workers}")
    check_config(config)
    train_batch, micro_batch, m = logical_batch(config, num_logical_workers)

    from deepspeed import comm as ds_dist

    if not ds_dist.is_initialized():
        from spotline.runtime import init_distributed

        init_distributed()
    hosted = _check_hosting(hosted_logical_workers, num_logical_workers)

    ds_config = copy.deepcopy(dict(config))
    ds_config.pop("train_batch_size", None)
    ds_config["train_micro_batch_size_per_gpu"] = micro_batch
    ds_config["gradient_accumulation_steps"] = len(hosted) * m

    zero.partition_parameters.shutdown_init_context()
    try:
        config_class = DeepSpeedConfig(ds_config, None)
        # DeepSpeed derived micro x (k x m) x M, which is the real global batch only when
        # every process hosts k logical workers; the logical job's is micro x m x N.
        config_class.train_batch_size = train_batch
        ds_config["train_batch_size"] = train_batch
        # The same refusals on DeepSpeed's own parse (other spellings of the keys).
        if config_class.zero_enabled:
            raise ValueError("zero_optimization.stage must be 0 for ExactDataParallelEngine")
        if config_class.float16_config.enabled or config_class.bfloat16_config.enabled:
            raise ValueError(
                "fp16.enabled/bf16.enabled are not supported by ExactDataParallelEngine"
            )
        set_optimizer_flags(config_class, model)
        engine = ExactDataParallelEngine(
            args=None,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=None,
            lr_scheduler=lr_scheduler,
            mpu=None,
            dist_init_required=False,
            collate_fn=None,
            config=ds_config,
            config_class=config_class,
            num_logical_workers=num_logical_workers,
            hosted_logical_workers=hosted,
            micro_batches_per_logical_worker=m,
        )
    finally:
        zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine
