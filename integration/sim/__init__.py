"""Cluster-scale simulator and cost model (pure Python, no torch or DeepSpeed).

- :mod:`spotline.sim.calibration`: prices, delays and step times from a JSON table, by
  shipped name (default ``bamboo-gpt2-8stage``, ``spotline/assets/calibration-bamboo.json``)
  or file; step times only for the pipeline counts its rows cover.
- :mod:`spotline.sim.sim_config`: a replay's set-up (:class:`~spotline.sim.sim_config.
  SimConfig`), the policy names, and the step time of a layout.
- :mod:`spotline.sim.membership`: the trace as the job sees it (when nodes are ready and
  gone) and what its nodes cost.
- :mod:`spotline.sim.results`: a policy's result on one trace;
  :func:`~spotline.sim.results.versus_references` compares each policy with the ideal and
  on-demand.
- :mod:`spotline.sim.training_run`: the training state machine every policy drives (time
  buckets, step ledger, checkpoint timer).
- :mod:`spotline.sim.canonical_plans`: the runtime's planner, :mod:`spotline.plan.layout`,
  called with canonical names and memoized: every placement, takeover and fatal-loss
  decision of a replay is the runtime's (the ideal needs none).
- :mod:`spotline.sim.replay`: the event replay of one trace under one policy
  (``SimPolicy``, ``ReplayJob``) and the rules every policy shares.
- :mod:`spotline.sim.recovery_policies`: the runtime's recovery policies, ``failover`` (the
  simulator's ``spotline``) and ``checkpoint-restart``, each one class with its runtime face
  (what the coordinator does on a loss) beside its simulator face.
- :mod:`spotline.sim.sim_only_policies`: ``spotline-rigid``, ``on-demand``, ``ideal``.
- :mod:`spotline.sim.simulator`: every policy by name and
  :func:`~spotline.sim.simulator.simulate`.
- :mod:`spotline.sim.sweep`: many seeds and preemption rates, optionally over processes.
- :mod:`spotline.sim.validate`: the simulator's prediction of a local or cluster replay.

The timed sweep benchmark is an entry point, not library code: ``python -m
spotline.launch.bench.sim_sweep`` (launch/bench/sim_sweep.py).
"""
