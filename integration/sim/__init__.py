"""Cluster-scale simulator and cost model (pure Python, no torch or DeepSpeed).

- :mod:`spotline.sim.calibration`: prices, delays and step times from a JSON table, by
  shipped name (default ``bamboo-gpt2-8stage``, ``spotline/assets/calibration-bamboo.json``)
  or file; step times only for the pipeline counts its rows cover.
- :mod:`spotline.sim.engine`: replays a :class:`spotline.plan.traces.Trace` under the
  ``spotline``, ``spotline-rigid``, ``checkpoint-restart`` and ``on-demand`` policies and the
  ``ideal`` bound; every placement, takeover and fatal-loss decision comes from the
  runtime's own planner, :mod:`spotline.plan.layout` (the ideal needs none); its
  :func:`~spotline.sim.engine.versus_references` compares each policy with the ideal and
  on-demand.
- :mod:`spotline.sim.sweep`: many seeds and preemption rates, optionally over processes.

The timed sweep benchmark is an entry point, not library code: ``python -m
spotline.launch.bench.sim_sweep`` (launch/bench/sim_sweep.py).
"""
