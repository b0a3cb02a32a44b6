"""The control plane's parts, composed by :class:`spotline.launch.coordinator.Coordinator`.

- :mod:`.supervisor`: the worker processes: spawn, exits, heartbeats, shutdown.
- :mod:`.faults`: what happens to them: a trace's or random preemptions and arrivals,
  ``--inject`` faults, ``--rescale`` changes, warm workers started ahead of arrivals.
- :mod:`.recovery`: from the live workers' reports to the next plan, and the recovery
  policies (``failover``, ``checkpoint-restart``) behind one interface.
- :mod:`.checkpoints`: committing the checkpoints the workers write, and their write errors.
- :mod:`.metrics`: the run's counters, timeline, progress lines and ``summary.json``.
- :mod:`.inputs`: the user's model and corpus, checked in a child process before any
  worker starts.

Each part talks to the workers only through :mod:`spotline.protocol`. None imports torch,
DeepSpeed or transformers (a test checks it): the coordinator is the process that never
trains. Its process loads torch only for the job store (:mod:`spotline.stores`: torch's
TCPStore, or an etcd store that subclasses torch's ``Store``).
"""
