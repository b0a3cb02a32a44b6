"""``spotline train``'s one machine: an agent process on this one, and every agent's end.

``spotline train`` runs its workers through the same code as a cluster: one agent
(``spotline agent``, :data:`~.entry_points.AGENT_MODULE`) started as the coordinator's child
and named :data:`LOCAL_MACHINE`, joined over 127.0.0.1. Its life, in
:class:`LocalAgent`:

- :meth:`~LocalAgent.start`: started once, early (the CLI starts it while a child checks
  the inputs, so that its spawner imports the training stack meanwhile), else when the run
  starts;
- :meth:`~LocalAgent.wait_joined`: the run starts once it has joined;
- :meth:`~LocalAgent.check`: it must outlive the job (its exit stops the job, pointing at
  its log);
- :meth:`~LocalAgent.end`: at the job's end it exits once its workers have (killed if it
  does not in time); :meth:`~LocalAgent.abandon`: a job that never started stops it.

:func:`end_agents` ends every agent's part in the job (``job-end``), the local one's too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from spotline.launch.control.entry_points import AGENT_MODULE
from spotline.launch.control.machines import Machines
from spotline.launch.control.supervisor import JobError
from spotline.run_dir import LOGS_DIR

LOCAL_MACHINE = "local"
# The local agent outlives a lost coordinator by this much: its workers find out first
# and say so in their own line (spotline.worker.elastic), then the agent stops what is left.
LOCAL_AGENT_LOST_AFTER_S = 10.0
AGENT_JOIN_WAIT_S = 120.0
AGENT_EXIT_WAIT_S = 30.0
JOIN_POLL_S = 0.02


def start_local_agent(
    store_arg: str,
    *,
    slots: int,
    logs: Path,
    env: dict[str, str],
    lost_after_s: float,
    token_file: Path,
) -> subprocess.Popen[bytes]:
    """An agent process on this machine (named :data:`LOCAL_MACHINE`), joined to the
    coordinator's store ``store_arg``; its output goes to ``logs/agent.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "agent.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", AGENT_MODULE, "--join", store_arg]
            + ["--slots", str(slots), "--name", LOCAL_MACHINE, "--logs", str(logs)]
            + ["--lost-after", f"{lost_after_s:g}", "--token-file", str(token_file)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C at the terminal reaches the coordinator only.
            start_new_session=True,
        )


class LocalAgent:
    """The local agent's process, if started (see the module docstring)."""

    def __init__(self, output: Path) -> None:
        self.logs = output / LOGS_DIR
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, store_arg: str, *, slots: int, env: dict[str, str], token_file: Path) -> None:
        """Start it (once), with a slot for each starting worker."""
        if self.proc is not None:
            return
        self.proc = start_local_agent(
            store_arg,
            slots=slots,
            logs=self.logs,
            env=env,
            lost_after_s=LOCAL_AGENT_LOST_AFTER_S,
            token_file=token_file,
        )

    def wait_joined(self, machines: Machines) -> None:
        """Wait until it has joined (RuntimeError if it exits, or does not in time)."""
        assert self.proc is not None, "started first"
        deadline = time.monotonic() + AGENT_JOIN_WAIT_S
        while not (machines.refresh() or LOCAL_MACHINE in machines.joined):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the local agent did not join (exit {self.proc.poll()}); see "
                    f"{self.logs}/agent.log"
                )
            time.sleep(JOIN_POLL_S)

    def check(self) -> None:
        """JobError if it exited (it must outlive the job); nothing if none was started."""
        if self.proc is not None and self.proc.poll() is not None:
            raise JobError(
                f"the local agent exited ({self.proc.returncode}); see {self.logs}/agent.log"
            )

    def end(self) -> None:
        """The job is over: wait for it to exit (it does once its workers have)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=AGENT_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def abandon(self) -> None:
        """Stop it at once (a job that does not start; a store gone at a shutdown). Its
        spawner exits on its own when the agent's pipe closes."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def end_agents(machines: Machines, local: LocalAgent) -> None:
    """The job is over: every agent exits once its workers have."""
    unheard = machines.end_job()
    if unheard:
        print(
            f"spotline: the agent(s) of {', '.join(unheard)} did not confirm the job's end; "
            "they will stop on their own once they find the coordinator gone",
            file=sys.stderr,
            flush=True,
        )
    local.end()
