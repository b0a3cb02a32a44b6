"""One rank of the failover-replay test (tests/test_redundancy.py).

Trains ``steps - 1`` steps normally, then runs the last step with every replica holder
*replaying* its successor's step (forward and backward from the replica, the stashed
inputs and the output gradients kept by the next stage) instead of receiving the owner's
gradients, applies the update, and reports whether the replayed gradients and the
resulting replica state equal the owner's bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

from spotline.config import load_config
from spotline.worker.launched import setup_worker


def main() -> None:
    config_path, out_dir = sys.argv[1], sys.argv[2]
    cfg = load_config(config_path)
    worker = setup_worker(cfg)
    steps = cfg.spotline.training.steps
    for step in range(steps - 1):
        worker.train_step(step)
    worker.engine.replay_replica_steps()
    before = worker.engine.replica_digest()
    worker.train_step(steps - 1)
    result = {
        "stage": worker.engine.stage_id,
        "replica_stage": worker.engine.replica.stage,
        "replayed_grads_equal_owner": worker.engine.replay_matched_owner_grads,
        "replica_changed": before != worker.engine.replica_digest(),
        "mismatched_stages": worker.replica_mismatches(),
    }
    with open(os.path.join(out_dir, f"rank{worker.ident.rank}.json"), "w") as f:
        json.dump(result, f)
    # Tear the group down before the interpreter does: gloo's threads must not be left to
    # static destruction at exit (an occasional "terminate called" abort there).
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
