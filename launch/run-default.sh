#!/usr/bin/env bash
# Set up, then train the embedded default: tiny GPT-2 on the shipped corpus, 4 worker
# processes (2 stages x 2 pipelines), and print the run's summary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. launch/setup.sh
export WANDB_MODE="${WANDB_MODE:-offline}"
exec spotline train --output runs/default "$@"
