"""The control plane's parts, conducted by :class:`spotline.launch.coordinator.Coordinator`.

The job and its generations:

- :mod:`.parts`: every part of one job, made and wired together (which part gets what).
- :mod:`.job_state`: what was published (the generation in flight, its layout, resume step
  and included workers) and how far its members got; every part reads it.
- :mod:`.watch`: one turn after another over a running generation: quiet turns, exits and
  lost machines, heartbeats, the no-progress limit, departures, until every member reported.
- :mod:`.outcomes`: how a generation ended (a typed :class:`~.outcomes.GenerationEnd`), from
  its reports; the errors that stop the job.
- :mod:`.recovery`: from the live workers' reports to the next plan (the recovery policies
  are :mod:`spotline.sim.recovery_policies`).
- :mod:`.admission`: machines and workers that join, and the waits for them.
- :mod:`.stopping`: the stop a first Ctrl-C asks for, at a checkpointed step boundary.
- :mod:`.takeover`: the job's store, and a restarted coordinator taking an etcd job over.
- :mod:`.resume`: what a ``--resume`` carries over from the stopped run.

The processes:

- :mod:`.supervisor`: the worker processes: spawn, exits, heartbeats, shutdown.
- :mod:`.machines`: the agents' machines: admission by token, heartbeats, fencing, orders.
- :mod:`.liveness`: whether a quiet machine's agent is dead, asked of its kernel.
- :mod:`.local_agent`: ``spotline train``'s one machine, an agent process on this one.
- :mod:`.spawner`: on each machine, a process that imported the workers' libraries once and
  forks each worker.
- :mod:`.entry_points`: the modules those processes run, by name.
- :mod:`.faults`: what happens to the workers: a trace's or random preemptions and arrivals,
  ``--inject`` faults, ``--rescale`` changes, warm workers started ahead of arrivals.

And:

- :mod:`.checkpoints`: committing the checkpoints the workers write, and their write errors.
- :mod:`.metrics`: the run's counters, timeline, progress lines and ``summary.json``.
- :mod:`.input_check`: the user's model and corpus, checked in a child process before any
  worker starts.

Each part talks to the workers only through :mod:`spotline.wire.protocol`. None imports torch,
DeepSpeed or transformers (a test checks it): the coordinator is the process that never
trains. Its process loads torch only for the job store (:mod:`spotline.wire.stores`: torch's
TCPStore, or an etcd store that subclasses torch's ``Store``).
"""
