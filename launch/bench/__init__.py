"""Benchmarks of real runs on this machine (``spotline bench``) and their rank workers.

- :mod:`~spotline.launch.bench.command`: the ``spotline bench`` command line; dispatches to
  one module per benchmark: :mod:`~spotline.launch.bench.foundation`,
  :mod:`~spotline.launch.bench.redundancy_bench`, :mod:`~spotline.launch.bench.recovery_bench`,
  :mod:`~spotline.launch.bench.reduce`, :mod:`~spotline.launch.bench.overlap`,
  :mod:`~spotline.launch.bench.easyscale`,
  :mod:`~spotline.launch.bench.cluster`, :mod:`~spotline.launch.bench.cluster_replay`.
- :mod:`~spotline.launch.bench.jobs`: what they and ``spotline calibrate`` share: settings,
  jobs started as subprocesses, interleaved rounds, medians, exit codes. It imports no
  benchmark, so no benchmark imports another's helpers through a cycle.
- Rank workers, one process each of a benchmark's gloo group (never imported by the
  command, started with ``python -m``): :mod:`~spotline.launch.bench.stock_worker` (stock
  DeepSpeed ``PipelineEngine``, for ``foundation``), :mod:`~spotline.launch.bench.dp_worker`
  (stock ``DeepSpeedEngine`` or the exact data-parallel engine, for ``easyscale``),
  :mod:`~spotline.launch.bench.reduce_worker` (for ``reduce`` and ``easyscale``),
  :mod:`~spotline.launch.bench.overlap_worker` (for ``overlap``; gloo, or NCCL on GPUs),
  :mod:`~spotline.launch.bench.transfer_worker` (for ``cluster``: one per namespace machine).
- :mod:`~spotline.launch.bench.netns`: machines as network namespaces on a private bridge
  (root only), for ``cluster``, ``cluster-replay`` and, through ``tests/netns.py``, the
  cluster tests; :mod:`~spotline.launch.bench.cluster_processes`: Spotline's coordinator and agents
  started in them, and the log watch that follows the coordinator.
- :mod:`~spotline.launch.bench.sim_sweep`: the simulator's timed preemption-rate sweep
  (``python -m spotline.launch.bench.sim_sweep``), pure Python.

Nothing here is imported by the library (``spotline``) or by ``spotline train``.
"""
