"""A stand-in worker for the agent tests: says who it is, then exits, sleeps or leaves.

``python -m agent_child exit N``: exit with N; ``sleep``: sleep until signalled;
``leave``: on SIGTERM, exit 0 at once (a worker leaving at its step boundary).
"""

from __future__ import annotations

import os
import signal
import sys
import time

print(
    f"pid {os.getpid()} machine {os.environ.get('SPOTLINE_MACHINE')} argv {sys.argv[1:]} "
    f"token {os.environ.get('SPOTLINE_JOB_TOKEN')}",
    flush=True,
)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "leave":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
while True:
    time.sleep(0.05)
