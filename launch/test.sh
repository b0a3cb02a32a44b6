#!/usr/bin/env bash
# Set up, then run the whole test suite (the slow multi-process tests included).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. launch/setup.sh
# The etcd store's tests start their own etcd (Debian's etcd-server) on loopback. Without
# it those tests fail, naming it, unless SPOTLINE_ALLOW_SKIP lists etcd (tests/components.py).
if ! command -v etcd >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server
fi
export WANDB_MODE=offline WANDB_SILENT=true OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
ruff check .
ruff format --check .
mypy
# pytest exits 5 when it collected no test: that is a failure here too.
exec python -m pytest "$@"
