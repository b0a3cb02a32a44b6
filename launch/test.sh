#!/usr/bin/env bash
# Set up, then run the whole test suite (the slow multi-process tests included).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. launch/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
ruff check .
ruff format --check .
mypy
# pytest exits 5 when it collected no test: that is a failure here too.
exec python -m pytest "$@"
