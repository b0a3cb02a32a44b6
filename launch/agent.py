"""``spotline agent``: one per machine. It joins the job, starts and signals the workers the
coordinator orders on this machine, and reports how each ended.

The agent talks to the coordinator only through the job's store (``spotline.wire.protocol``): it
registers its machine (:class:`~spotline.wire.protocol.MachineInfo`: name, slots, the address its
peers reach it at), heartbeats, reads its orders (:class:`~spotline.wire.protocol.Order`, numbered
``order/<machine>/1, 2, ...``) and writes each worker's exit status (``exit/<w>``). Workers
are forked by a :class:`~spotline.launch.control.spawner.Spawner` that imported the training
stack once, so an order's worker starts in a fraction of a second. Everything it writes is
sealed with the job token (``--token-file``, handed to its workers in ``SPOTLINE_JOB_TOKEN``;
``spotline.wire.auth``) and every order it reads must verify with it.

How it ends:

- refused at registration (no job token, or a wrong one): one line, exit
  :data:`EXIT_REFUSED`;
- declared lost by the coordinator while it was cut off (its link down longer than the
  heartbeat timeout), then back: fenced (``fenced/<m>``), it SIGKILLs its workers, whose
  work was given to others, says so in one line and exits :data:`EXIT_FENCED`;
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
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from spotline.errors import UserError
from spotline.launch.control.entry_points import WORKER_MODULE
from spotline.launch.control.spawner import ForkedProcess, Spawner
from spotline.wire.agent_messages import Admission, MachineInfo, Order
from spotline.wire.auth import (
    TOKEN_ENV,
    AuthStore,
    JobToken,
    RawStore,
    read_token_file,
    unsealed_payload,
)
from spotline.wire.protocol import (
    JOB_END_KEY,
    MACHINES_COUNTER,
    admit_key,
    agent_done_key,
    agent_heartbeat_key,
    agent_leaving_key,
    exit_key,
    fenced_key,
    machine_key,
    order_key,
)

if TYPE_CHECKING:
    from spotline.wire.net import Binding
    from spotline.wire.stores import StoreSpec

EXIT_COORDINATOR_LOST = 3  # as a worker that loses its coordinator (spotline.worker.elastic)
EXIT_FENCED = 4  # declared lost while cut off: its workers were replaced
EXIT_REFUSED = 2  # a user's mistake: no job token, or a wrong one
# How often a registration's answer is looked for.
POLL_S = 0.01
# The heartbeat (and the fence check, and a look for orders) every this many seconds: the
# coordinator's timeout is seconds, and every agent's store traffic shares the
# coordinator's machine. Between beats the agent sleeps in select() on its liveness port
# and its spawner's pipe: the coordinator connects to the port after writing an order (a
# kill a test or a trace delivers at a step reaches the worker at once), and a worker's
# exit arrives on the pipe. An agent that looked for orders every 10 ms instead took 1.8%
# of a core from the workers of a 2-core host, and the coordinator 0.5% more serving it.
HEARTBEAT_S = 0.1
# What the spawner imports once by default: the workers' own module (the coordinator orders
# every worker as ``python -m WORKER_MODULE``).
DEFAULT_PRELOAD = WORKER_MODULE
SPAWNER_READY_WAIT_S = 300.0
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


class ExitReports(Protocol):
    """Where an agent's workers' exits are reported (the spawner)."""

    def exit_pipe(self) -> IO[bytes] | None:
        """A pipe readable when a report is waiting; None once no more will come."""

    def read_replies(self, timeout_s: float) -> bool:
        """Read the waiting reports (within ``timeout_s``); whether any came."""


class Refused(Exception):
    """The coordinator refused this machine (the reason: one line)."""


class NoAnswer(Exception):
    """The coordinator gave no answer to this machine's registration in time (not a
    refusal: the store took the registration, nobody read it)."""


class Fenced(Exception):
    """The coordinator declared this machine lost while it was cut off."""


def read_admission(raw: bytes, key: str, token: JobToken | None) -> Admission:
    """The coordinator's answer to a registration. An admission is believed only when it
    verifies with this agent's token (someone else could write one); a refusal is believed
    as it is (with a wrong token, this agent cannot verify the coordinator's seal)."""
    payload = token.open(key, raw) if token is not None else None
    if payload is not None:
        return Admission.decode(payload)
    try:
        answer = Admission.decode(unsealed_payload(raw))
    except (ValueError, KeyError, TypeError, AssertionError):
        answer = Admission(refused="an unreadable answer")
    if answer.refused is None:
        return Admission(refused="an answer not sealed with this token: a wrong job token")
    return answer


class Agent:
    """One machine's agent over the job's store (see the module docstring)."""

    def __init__(
        self,
        raw_store: RawStore,
        token: JobToken | None,
        machine: MachineInfo,
        start_process: Callable[[str, str, list[str], dict[str, str], Path], ForkedProcess],
        *,
        env: dict[str, str],
        logs: Path,
        listener: socket.socket,
    ) -> None:
        self.raw_store = raw_store
        self.token = token
        # Everything after the admission is sealed and checked (an agent without a token is
        # refused before it reads anything).
        self.store = AuthStore(raw_store, token) if token is not None else None
        self.machine = machine
        self.start_process = start_process
        self.env = dict(env, **({TOKEN_ENV: token.text()} if token is not None else {}))
        self.logs = logs
        self.workers: dict[str, ForkedProcess] = {}
        self.reported: set[str] = set()
        self.next_order = 1
        self.leaving = False
        self.leaving_said = False
        self.registration = 0
        self.last_beat = -float("inf")
        self.listener = listener  # the liveness port, non-blocking
        # Where workers' exits are reported (the spawner): its pipe wakes the agent.
        self.exits: ExitReports | None = None

    def join(self) -> None:
        """Register this machine (sealed with the token, if this agent has one)."""
        self.registration = self.raw_store.add(MACHINES_COUNTER, 1)
        key = machine_key(self.registration)
        text = self.machine.encode()
        self.raw_store.set(key, self.token.seal(key, text) if self.token is not None else text)

    def admission(self) -> Admission | None:
        """The coordinator's answer, once it has given one."""
        key = admit_key(self.registration)
        if not self.raw_store.check([key]):
            return None
        return read_admission(self.raw_store.get(key), key, self.token)

    def wait_admitted(self, limit_s: float) -> None:
        """Wait for the admission; take the name the coordinator gave. Refused if refused."""
        deadline = time.monotonic() + limit_s
        while (answer := self.admission()) is None:
            if time.monotonic() > deadline:
                raise NoAnswer
            time.sleep(POLL_S * 5)
        if answer.refused is not None:
            raise Refused(answer.refused)
        assert answer.machine is not None
        self.machine = replace(self.machine, name=answer.machine)

    def live(self) -> list[str]:
        return [w for w in self.workers if w not in self.reported]

    def serve_once(self) -> bool:
        """Heartbeat, apply new orders, report exits; whether the agent goes on. Raises
        :class:`Fenced` once the coordinator has declared this machine lost."""
        store = self.store
        assert store is not None, "an agent serves only once admitted, with a token"
        name = self.machine.name
        self._answer_probes()
        now = time.monotonic()
        if now - self.last_beat >= HEARTBEAT_S:
            self.last_beat = now
            store.set(agent_heartbeat_key(name), repr(time.time()))
            if store.check([fenced_key(name)]):
                raise Fenced(name)
        if self.leaving and not self.leaving_said:
            # Written here, not in the signal handler: a store client is not reentrant.
            store.set(agent_leaving_key(name), "1")
            self.leaving_said = True
        while self.raw_store.check([order_key(name, self.next_order)]):
            key = order_key(name, self.next_order)
            self.next_order += 1
            payload = store.token.open(key, self.raw_store.get(key))
            if payload is None:
                print(f"spotline agent {name}: ignored {key}: not sealed with the job token")
                continue
            self._apply(Order.decode(payload))
        for w in self.live():
            code = self.workers[w].poll()
            if code is not None:
                store.set(exit_key(w), str(code))
                self.reported.add(w)
        if self.live() or not (self.leaving or store.check([JOB_END_KEY])):
            return True
        # The last word: the coordinator holds its store up until it has read this.
        store.set(agent_done_key(name), "1")
        return False

    def wait_for_news(self) -> None:
        """Sleep until the next heartbeat is due, or sooner: a connection to the liveness
        port (an order's poke, or a probe) or a worker's exit wakes the agent at once."""
        left = self.last_beat + HEARTBEAT_S - time.monotonic()
        if left <= 0:
            return
        watched: list[Any] = [self.listener]
        pipe = self.exits.exit_pipe() if self.exits is not None else None
        if pipe is not None:
            watched.append(pipe)
        ready, _, _ = select.select(watched, [], [], left)
        if pipe is not None and pipe in ready:
            # Read it now: with no live worker nobody else would (a pipe left readable,
            # its end above all, would make every later select return at once).
            assert self.exits is not None
            self.exits.read_replies(0.0)

    def _answer_probes(self) -> None:
        """Accept and close the coordinator's liveness probes (the connect itself is the
        answer; accepting keeps the backlog from filling)."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.close()

    def _apply(self, order: Order) -> None:
        assert self.store is not None
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
        except Fenced:
            stopped = len(agent.live())
            agent.kill_all()
            print(
                f"spotline agent {agent.machine.name}: the coordinator declared this machine "
                f"lost while it was cut off and replaced its work; stopped {stopped} "
                "worker(s), exiting (start the agent again to rejoin as a new machine)",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_FENCED
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
        agent.wait_for_news()


def _wait_reachable(host: str, port: int, limit_s: float) -> None:
    """Wait until ``host:port`` accepts a connection (OSError after ``limit_s``). A store
    client's own connect backs off for up to tens of seconds while the network is down (a
    machine that boots before its network): probing every 0.2 s joins it within a moment
    of the network coming up."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def refusal_line(reason: str, token_file: str | None) -> str:
    """What a refused agent says: the coordinator's reason and the fix."""
    if token_file is None:
        return (
            f"refused by the coordinator ({reason}): this job needs its token; pass the "
            "coordinator's job-token file (in its --output directory) with --token-file FILE"
        )
    return (
        f"refused by the coordinator ({reason}): --token-file {token_file} is not this job's "
        "token; copy the coordinator's job-token file (in its --output directory)"
    )


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
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="the job token (the coordinator's OUTPUT/job-token, or its --token-file)",
    )
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
    from spotline.wire.stores import StoreSpec, parse_store_arg

    if "://" in text:
        return parse_store_arg(text)
    host, port = _split_join(text)
    return StoreSpec("tcp", host, port, "")


def _split_join(text: str) -> tuple[str, int]:
    """``--join HOST:PORT``'s host and port (a UserError naming the form if it is not)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--join {text!r} is not HOST:PORT; give the coordinator's --listen")
    return host, int(port)


def run_agent(args: argparse.Namespace) -> int:
    if args.slots < 1:
        raise UserError(f"--slots {args.slots}: a machine has at least one slot; use --slots 1")
    name = args.name or socket.gethostname()
    if "/" in name or "#" in name or not name:
        raise UserError(f"--name {name!r}: a machine name has no '/' or '#'; choose another")
    token = read_token_file(args.token_file) if args.token_file is not None else None
    from spotline.launch.control.supervisor import child_environment

    # The workers' environment, and this process's own before torch reads it at import
    # (TORCH_CPP_LOG_LEVEL: a lost store is one line here, not pages of C++ warnings).
    env = child_environment()
    os.environ.update(env)
    # The agent turns every store failure into its own one line (a connect timeout is
    # logged at ERROR level by c10d): only its fatal messages stay.
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    # Bad input is one line before anything starts (a store URL is checked with torch, next).
    if "://" not in args.join:
        _split_join(args.join)
    from spotline.wire.net import resolve

    explicit: Binding | None = None
    if args.address is not None or args.iface is not None:
        explicit = resolve(address=args.address, iface=args.iface)
    logs = Path(args.logs or f"spotline-agent/{name}")
    # The spawner imports the training stack (seconds) from now on, while this process
    # imports torch and reaches the coordinator (a machine that boots before its network is
    # up, or before the coordinator, is ready to fork workers the moment it joins). Its
    # environment is its imports'; each worker gets the agent's, gloo's interface included.
    spawner = Spawner(args.preload or [DEFAULT_PRELOAD], dict(env), logs / "spawner.log")
    try:
        return _bind_join_and_serve(args, name, token, env, logs, spawner, explicit)
    finally:
        spawner.close()


def _bind_join_and_serve(
    args: argparse.Namespace,
    name: str,
    token: JobToken | None,
    env: dict[str, str],
    logs: Path,
    spawner: Spawner,
    explicit: Binding | None,
) -> int:
    """The rest of :func:`run_agent` once the spawner imports: the store, this machine's
    binding (``explicit``: --address or --iface), the join and the loop."""
    spec = _parse_join(args.join)  # imports torch (spotline.wire.stores)
    from spotline.wire.net import gloo_environment, resolve

    # Else the interface that routes to the coordinator.
    binding = explicit or resolve(address=local_address(spec.host, spec.port))
    if not binding.ip.startswith("127."):
        # gloo (NCCL on GPUs) binds where the peers reach this machine, not where its
        # host name happens to resolve. One machine's `spotline train` (loopback) keeps
        # gloo's default.
        env.update(gloo_environment(binding.ifname))
    # The liveness port (see spotline.launch.control.liveness_probe): while this process lives,
    # the kernel completes connects to it; once it is gone, they are refused.
    listener = socket.create_server((binding.ip, 0), backlog=16)
    listener.setblocking(False)
    machine = MachineInfo(name, args.slots, binding.ip, binding.ifname, listener.getsockname()[1])
    try:
        return _join_and_serve(args, name, token, machine, spawner, env, logs, spec, listener)
    finally:
        listener.close()


def _join_and_serve(
    args: argparse.Namespace,
    name: str,
    token: JobToken | None,
    machine: MachineInfo,
    spawner: Spawner,
    env: dict[str, str],
    logs: Path,
    spec: StoreSpec,
    listener: socket.socket,
) -> int:
    from spotline.wire.stores import connect_store

    try:
        _wait_reachable(spec.host, spec.port, args.lost_after)
        store: Any = connect_store(spec, timeout=timedelta(seconds=args.lost_after))
    except (RuntimeError, UserError, OSError) as exc:
        print(
            f"spotline agent {name}: cannot reach the coordinator at {spec.host}:{spec.port} "
            f"within {args.lost_after:g} s ({str(exc).splitlines()[0]}); exiting",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_COORDINATOR_LOST
    agent = Agent(store, token, machine, spawner.start, env=env, logs=logs, listener=listener)
    agent.exits = spawner
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
        try:
            agent.wait_admitted(args.lost_after)
        except Refused as exc:
            print(
                f"spotline agent {name}: {refusal_line(str(exc), args.token_file)}",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_REFUSED
        except NoAnswer:
            print(
                f"spotline agent {name}: the coordinator at {args.join} took this "
                f"machine's registration but did not answer it within {args.lost_after:g} s "
                "(a coordinator that is not running a job, or stopped mid-run); exiting (wait "
                "longer with --lost-after S)",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_COORDINATOR_LOST
        return _serve(agent, args.lost_after)
    finally:
        if agent.live():
            agent.kill_all()


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
