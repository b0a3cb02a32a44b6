"""The worker processes: a generation's engine, its state, its training loop.

- :mod:`.elastic`: ``spotline train``'s worker, which survives the loss of its peers (the
  conductor of the parts below);
- :mod:`.holdings`: what an elastic worker holds between generations (pack, assemble,
  roll forward);
- :mod:`.state_transfer`: who sends which stage, shard or replica to whom, and loading it;
- :mod:`.liveness`: the heartbeat, the abort watch, the coordinator's loss, SIGTERM;
- :mod:`.worker_checkpoints`: an elastic worker's checkpoints and restore;
- :mod:`.generation`: a generation's process group and its hooks on the step loop;
- :mod:`.launched`: the worker of ``deepspeed launch/train.py`` (fixed membership);
- :mod:`.engine_builder`: the process settings, sampler and engine both build;
- :mod:`.loop`: the one step loop both run;
- :mod:`.validator`: the eval set's exact loss and the best model;
- :mod:`.export`: the model out of a pipeline (the final one, its hash; the best).
"""
