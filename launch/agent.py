"""``spotline agent``: one per machine. It joins the job, starts and signals the workers the
coordinator orders on this machine, and reports how each ended.

The agent talks to the coordinator only through the job's store (``spotline.protocol``): it
registers its machine (:class:`~spotline.protocol.MachineInfo`: name, slots, the address its
peers reach it at), heartbeats, reads its orders (:class:`~spotline.protocol.Order`, numbered
``order/<machine>/1, 2, ...``) and writes each worker's exit status (``exit/<w>``). Workers
are forked by a :class:`~spotline.launch.control.spawner.Spawner` that imported the training
stack once, so an order's worker starts in a fraction of a second.

Three ways it ends:

- the job ends (``job-end``) and its workers have exited: exit 0;
- a preemption notice (SIGTERM to the agent, as a cloud's interruption notice reaches a
  machine's init system): every worker gets SIGTERM, leaves at its next step boundary, and
  the agent exits 0 once they have (it starts no worker after the notice);
- the store (the coordinator's machine) is unreachable for longer than ``--lost-after``
  seconds: it SIGKILLs its workers, says so in one line and exits
  :data:`EXIT_COORDINATOR_LOST`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotline.errors import UserError
from spotline.launch.control.spawner import ForkedProcess, Spawner
from spotline.protocol import (
    JOB_END_KEY,
    MACHINES_COUNTER,
    MachineInfo,
    Order,
    Store,
    agent_heartbeat_key,
    exit_key,
    machine_key,
    order_key,
)

if TYPE_CHECKING:
    from spotline.stores import StoreSpec

EXIT_COORDINATOR_LOST = 3  # as a worker that loses its coordinator (spotline.elastic)
# An order (a kill a test or a trace delivers at a step) reaches the worker within this.
POLL_S = 0.01
DEFAULT_PRELOAD = "spotline.launch.elastic_worker"
LOCAL_MACHINE = "local"
SPAWNER_READY_WAIT_S = 300.0
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


class Agent:
    """One machine's agent over the job's store (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        machine: MachineInfo,
        start_process: Callable[[str, str, list[str], dict[str, str], Path], ForkedProcess],
        *,
        env: dict[str, str],
        logs: Path,
    ) -> None:
        self.store = store
        self.machine = machine
        self.start_process = start_process
        self.env = env
        self.logs = logs
        self.workers: dict[str, ForkedProcess] = {}
        self.reported: set[str] = set()
        self.next_order = 1
        self.leaving = False

    def join(self) -> None:
        n = self.store.add(MACHINES_COUNTER, 1)
        self.store.set(machine_key(n), self.machine.encode())

    def live(self) -> list[str]:
        return [w for w in self.workers if w not in self.reported]

    def serve_once(self) -> bool:
        """Heartbeat, apply new orders, report exits; whether the agent goes on."""
        self.store.set(agent_heartbeat_key(self.machine.name), repr(time.time()))
        while self.store.check([order_key(self.machine.name, self.next_order)]):
            raw = self.store.get(order_key(self.machine.name, self.next_order))
            self.next_order += 1
            self._apply(Order.decode(raw))
        for w in self.live():
            code = self.workers[w].poll()
            if code is not None:
                self.store.set(exit_key(w), str(code))
                self.reported.add(w)
        if self.live():
            return True
        return not (self.leaving or self.store.check([JOB_END_KEY]))

    def _apply(self, order: Order) -> None:
        if order.kind == "signal":
            assert order.signal is not None  # Order checks it
            if order.worker in self.workers:
                self.workers[order.worker].send_signal(SIGNALS[order.signal])
            return
        if self.leaving:
            # After a preemption notice this machine takes no work: the worker "left" at
            # once, as a SIGTERMed worker that had not started a step would.
            self.store.set(exit_key(order.worker), str(-signal.SIGTERM))
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        self.workers[order.worker] = self.start_process(
            order.worker,
            order.module,
            list(order.argv),
            dict(self.env, SPOTLINE_MACHINE=self.machine.name),
            self.logs / f"{order.worker}.log",
        )

    def notice(self) -> None:
        """A preemption notice: every worker leaves at its next step boundary."""
        self.leaving = True
        for w in self.live():
            self.workers[w].send_signal(signal.SIGTERM)

    def kill_all(self) -> None:
        for w in self.live():
            self.workers[w].kill()
        for w in self.live():
            self.workers[w].wait()


def _serve(agent: Agent, lost_after_s: float) -> int:
    """The agent's loop; returns its exit code."""
    last_contact = time.monotonic()
    while True:
        try:
            go_on = agent.serve_once()
            last_contact = time.monotonic()
        except RuntimeError:  # torch's store errors (DistNetworkError, DistStoreError)
            if time.monotonic() - last_contact > lost_after_s:
                agent.kill_all()
                print(
                    f"spotline agent {agent.machine.name}: lost the coordinator (its store "
                    f"did not answer for {lost_after_s:g} s); stopped "
                    f"{len(agent.workers) - len(agent.reported)} worker(s), exiting",
                    file=sys.stderr,
                    flush=True,
                )
                return EXIT_COORDINATOR_LOST
            go_on = True
        if not go_on:
            return 0
        time.sleep(POLL_S)


def local_address(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (a UDP socket's
    connect picks it; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--join", required=True, metavar="HOST:PORT", help="the coordinator's store address"
    )
    parser.add_argument("--slots", type=int, required=True, help="worker processes here")
    parser.add_argument("--name", default=None, help="this machine's name (default: hostname)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--address", default=None, help="the address peers reach this machine at")
    where.add_argument("--iface", default=None, help="the interface peers reach this machine on")
    parser.add_argument("--logs", default=None, help="worker logs (default: spotline-agent/NAME)")
    parser.add_argument(
        "--lost-after",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="stop the workers and exit when the store is unreachable this long",
    )
    # The modules the spawner imports once (tests start light workers with "json").
    parser.add_argument("--preload", action="append", default=None, help=argparse.SUPPRESS)
    return parser


def _parse_join(text: str) -> StoreSpec:
    """``HOST:PORT`` (the coordinator's store) or a store URL (``tcp://HOST:PORT``,
    ``etcd://HOST:PORT/PREFIX``: what its workers are given as ``--store``)."""
    from spotline.stores import StoreSpec, parse_store_arg

    if "://" in text:
        return parse_store_arg(text)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--join {text!r} is not HOST:PORT; give the coordinator's --listen")
    return StoreSpec("tcp", host, int(port), "")


def run_agent(args: argparse.Namespace) -> int:
    if args.slots < 1:
        raise UserError(f"--slots {args.slots}: a machine has at least one slot; use --slots 1")
    name = args.name or socket.gethostname()
    if "/" in name or not name:
        raise UserError(f"--name {name!r}: a machine name has no '/'; choose another")
    from spotline.launch.control.supervisor import child_environment

    # The workers' environment, and this process's own before torch reads it at import
    # (TORCH_CPP_LOG_LEVEL: a lost store is one line here, not pages of C++ warnings).
    env = child_environment()
    os.environ.update(env)
    # The agent turns every store failure into its own one line (a connect timeout is
    # logged at ERROR level by c10d): only its fatal messages stay.
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    spec = _parse_join(args.join)  # imports torch (spotline.stores)
    host, port = spec.host, spec.port
    from spotline.stores import connect_store

    try:
        store: Any = connect_store(spec, timeout=timedelta(seconds=args.lost_after))
    except (RuntimeError, UserError) as exc:
        print(
            f"spotline agent {name}: cannot reach the coordinator at {host}:{port} within "
            f"{args.lost_after:g} s ({str(exc).splitlines()[0]}); exiting",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_COORDINATOR_LOST
    from spotline.net import gloo_environment, resolve

    if args.address is not None or args.iface is not None:
        binding = resolve(address=args.address, iface=args.iface)
    else:  # the interface that routes to the coordinator
        binding = resolve(address=local_address(host, port))
    if not binding.ip.startswith("127."):
        # gloo (NCCL on GPUs) binds where the peers reach this machine, not where its
        # host name happens to resolve. One machine's `spotline train` (loopback) keeps
        # gloo's default.
        env.update(gloo_environment(binding.ifname))
    machine = MachineInfo(name, args.slots, binding.ip, binding.ifname)
    logs = Path(args.logs or f"spotline-agent/{name}")
    spawner = Spawner(args.preload or [DEFAULT_PRELOAD], env, logs / "spawner.log")
    agent = Agent(store, machine, spawner.start, env=env, logs=logs)
    signal.signal(signal.SIGTERM, lambda signum, frame: agent.notice())
    try:
        # Joined only once a worker can be forked at once: the agent's loop (its heartbeat)
        # never waits on the imports.
        try:
            spawner.wait_ready(SPAWNER_READY_WAIT_S)
        except RuntimeError as exc:
            print(f"spotline agent {name}: {exc}; see {logs}/spawner.log", file=sys.stderr)
            return 1
        agent.join()
        return _serve(agent, args.lost_after)
    finally:
        if agent.live():
            agent.kill_all()
        spawner.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argparse.ArgumentParser(prog="spotline agent"))
    args = parser.parse_args(argv)
    try:
        return run_agent(args)
    except UserError as exc:
        print(f"spotline agent: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def start_local_agent(
    store_arg: str, *, slots: int, logs: Path, env: dict[str, str], lost_after_s: float
) -> subprocess.Popen[bytes]:
    """``spotline train``'s one machine: an agent process on this one (named ``local``),
    joined to the coordinator's store ``store_arg``; its output goes to ``logs/agent.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "agent.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "spotline.launch.agent", "--join", store_arg]
            + ["--slots", str(slots), "--name", LOCAL_MACHINE, "--logs", str(logs)]
            + ["--lost-after", f"{lost_after_s:g}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C at the terminal reaches the coordinator only.
            start_new_session=True,
        )
