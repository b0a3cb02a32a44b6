#!/usr/bin/env bash
# Create .venv (if missing) and install Spotline into it. Sourced by run-default.sh and test.sh.
# Quiet when it works: pip's output goes to a log that is printed only if a step fails.
#
# torch is pinned to the CPU build (2.13.0): an unpinned `torch` would pull a CUDA build of
# several GB. GPU users set SPOTLINE_TORCH to their build, e.g.
#   SPOTLINE_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
setup_log="$(mktemp "${TMPDIR:-/tmp}/spotline-setup.XXXXXX")"
quietly() {
    if ! "$@" >>"$setup_log" 2>&1; then
        cat "$setup_log" >&2
        echo "spotline: setup failed running: $*" >&2
        echo "spotline: (the output above is also in $setup_log)" >&2
        return 1
    fi
}
if [ ! -x .venv/bin/python ]; then
    quietly python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
quietly python -m pip install --upgrade pip
# shellcheck disable=SC2086
quietly python -m pip install ${SPOTLINE_TORCH:-torch==2.13.0}
quietly python -m pip install -e '.[test]'
rm -f "$setup_log"
unset -f quietly
unset setup_log
