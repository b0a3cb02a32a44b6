"""The processes the control plane starts, named by module (``python -m MODULE``).

The coordinator starts two kinds of process: the workers (:data:`WORKER_MODULE`, ordered
onto a machine by :class:`~spotline.launch.control.supervisor.Supervisor` and forked there
by its agent's spawner, which preloads the same module) and, for ``spotline train``, one
local agent (:data:`AGENT_MODULE`, :mod:`spotline.launch.control.local_agent`).

These are the control plane's arrows to the processes it runs, and they cannot be imports:
the worker's module imports torch, DeepSpeed and transformers at import (its spawner forks
workers that share them), which the control plane must never load, and the agent's module
is a floor above this one. So each is a name here, and a test
(``tests/test_coordinator_parts.py``) imports each module and checks that its name is
this one: renaming or moving either module fails it. The coordinator imports both while
type checking only, so that readers and tools see the arrows (``tests/test_structure.py``).
"""

from __future__ import annotations

from typing import Final

WORKER_MODULE: Final = "spotline.launch.elastic_worker"
AGENT_MODULE: Final = "spotline.launch.agent"
