#!/usr/bin/env bash
# Set up, then train the embedded default: tiny GPT-2 on the shipped corpus, 4 worker
# processes (2 stages x 2 pipelines, lazy redundancy), with one worker SIGKILLed in the
# forward pass of step 11 to show what Spotline is for: its predecessor takes the stage
# over from the replica in memory, and the summary says so. Extra flags are passed on.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. launch/setup.sh
export WANDB_MODE="${WANDB_MODE:-offline}"
exec spotline train --output runs/default --inject kill:11:2:forward "$@"
