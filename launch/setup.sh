#!/usr/bin/env bash
# Create .venv (if missing) and install Spotline into it. Sourced by run-default.sh and test.sh.
#
# torch is pinned to the CPU build (2.13.0): an unpinned `torch` would pull a CUDA build of
# several GB. GPU users set SPOTLINE_TORCH to their build, e.g.
#   SPOTLINE_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip >/dev/null
# shellcheck disable=SC2086
python -m pip install --quiet ${SPOTLINE_TORCH:-torch==2.13.0}
python -m pip install --quiet -e '.[test]'
