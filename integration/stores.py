"""The job's key-value store: torch.distributed's TCPStore or an etcd-backed store.

The coordinator hosts the store (``host_store``) and hands workers a ``StoreSpec`` as one
command-line argument (``StoreSpec.to_arg`` / ``parse_store_arg``); each worker connects
with ``connect_store``. Both backends are c10d ``Store`` objects, so they also back each
generation's gloo process group through ``dist.PrefixStore``.

The etcd backend uses torch's ``EtcdStore`` over etcd's v2 API (etcd 3.4 serves it with
``--enable-v2=true``) through the ``python-etcd`` client; ``start_local_etcd`` runs a private
etcd on loopback for tests and demos.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import torch.distributed as dist

from spotline.errors import UserError

if TYPE_CHECKING:  # imported on first use at run time (_make_etcd_store_class)
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

Backend = Literal["tcp", "etcd"]
BACKENDS: tuple[Backend, ...] = ("tcp", "etcd")
ETCD_BINARY = "/usr/bin/etcd"
DEFAULT_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class StoreSpec:
    """Where the job's store lives: what a worker needs to connect (``connect_store``).

    ``prefix`` is the etcd key directory that holds this job's keys (unique per job, no
    leading or trailing slash); a TCPStore belongs to one job, so its prefix is empty.
    """

    backend: Backend
    host: str
    port: int
    prefix: str

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"store backend {self.backend!r} is not one of {BACKENDS}")
        if not self.host or ":" in self.host or "/" in self.host:
            raise ValueError(f"store host {self.host!r} must be a host name or IPv4 address")
        if not 0 < self.port < 65536:
            raise ValueError(f"store port {self.port} is outside 1..65535")
        if self.backend == "tcp" and self.prefix:
            raise ValueError(f"a tcp store has no key prefix, got {self.prefix!r}")
        if self.backend == "etcd":
            parts = self.prefix.split("/")
            if not self.prefix or any(not p for p in parts):
                raise ValueError(
                    f"etcd prefix {self.prefix!r} must be non-empty path segments like "
                    "'spotline/job-abc'"
                )

    def to_arg(self) -> str:
        """The worker's ``--store`` argument; ``parse_store_arg`` reads it back."""
        if self.backend == "tcp":
            return f"tcp://{self.host}:{self.port}"
        return f"etcd://{self.host}:{self.port}/{self.prefix}"


def parse_store_arg(text: str) -> StoreSpec:
    """Read a ``--store`` argument (``tcp://HOST:PORT`` or ``etcd://HOST:PORT/PREFIX``)."""
    usage = "use tcp://HOST:PORT or etcd://HOST:PORT/PREFIX"
    parts = urlsplit(text)
    if parts.scheme not in BACKENDS:
        raise UserError(f"--store {text!r}: unknown scheme {parts.scheme!r}; {usage}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a non-numeric or out-of-range port
        raise UserError(f"--store {text!r}: {exc}; {usage}") from None
    if not host or port is None or parts.query or parts.fragment or parts.username:
        raise UserError(f"--store {text!r} is not a store address; {usage}")
    prefix = parts.path.strip("/")
    if parts.scheme == "tcp" and parts.path not in ("", "/"):
        raise UserError(f"--store {text!r}: a tcp store takes no path; {usage}")
    try:
        return StoreSpec(parts.scheme, host, port, prefix)
    except ValueError as exc:
        raise UserError(f"--store {text!r}: {exc}; {usage}") from None


def _etcd_module() -> Any:
    try:
        import etcd
    except ModuleNotFoundError:
        raise UserError(
            "the etcd store backend needs the python-etcd package: pip install python-etcd"
        ) from None
    return etcd


def _etcd_store_class() -> type[EtcdStore]:
    """``_SpotlineEtcdStore``, built on first use so that the tcp backend needs no etcd."""
    global _ETCD_STORE_CLASS
    if _ETCD_STORE_CLASS is None:
        _ETCD_STORE_CLASS = _make_etcd_store_class()
    return _ETCD_STORE_CLASS


_ETCD_STORE_CLASS: type[EtcdStore] | None = None


def _make_etcd_store_class() -> type[EtcdStore]:
    etcd = _etcd_module()
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    class _SpotlineEtcdStore(EtcdStore):
        """torch's EtcdStore with the TCPStore's failure type and cheaper reads.

        EtcdStore signals a timeout with LookupError; callers written for the TCPStore catch
        ``dist.DistStoreError``, so timeouts are re-raised as that. ``check``, ``add(key, 0)``
        and a ``get`` or ``wait`` of present keys read the keys themselves: EtcdStore lists
        the job's whole key directory on every call, which grows with heartbeats and reports.
        """

        def _present(self, keys: Sequence[str | bytes]) -> dict[str, bytes] | None:
            values: dict[str, bytes] = {}
            for key in keys:
                try:
                    node = self.client.get(self.prefix + self._encode(key))
                except etcd.EtcdKeyNotFound:
                    return None
                values[node.key] = self._decode(node.value)
            return values

        def get(self, key: str | bytes) -> bytes:
            present = self._present([key])
            if present is not None:
                return next(iter(present.values()))
            try:
                return bytes(super().get(key))
            except LookupError as exc:
                raise dist.DistStoreError(f"etcd store: {exc}") from None

        def add(self, key: str | bytes, num: int) -> int:
            if num == 0:
                # add(key, 0) is how a barrier polls a counter: read it instead of a
                # compare-and-swap write (a raft commit) per poll.
                present = self._present([key])
                if present is not None:
                    return int(next(iter(present.values())))
            return int(super().add(key, num))

        def check(self, keys: list[str]) -> bool:
            return self._present(keys) is not None

        def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
            if self._present(keys) is not None:
                return
            try:
                super().wait(keys, override_timeout)
            except LookupError as exc:
                raise dist.DistStoreError(f"etcd store: {exc} {list(keys)}") from None

    return _SpotlineEtcdStore


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"etcd endpoint {endpoint!r} must be HOST:PORT, e.g. 127.0.0.1:2379")
    return host, int(port)


def _etcd_store(spec: StoreSpec, timeout: timedelta) -> dist.Store:
    etcd = _etcd_module()
    # read_timeout bounds plain requests; EtcdStore's watches pass their own timeout.
    client = etcd.Client(
        host=spec.host, port=spec.port, protocol="http", read_timeout=30, allow_reconnect=False
    )
    try:
        client.read("/")
    except etcd.EtcdConnectionFailed as exc:
        raise UserError(
            f"cannot reach etcd at {spec.host}:{spec.port} ({exc}); start etcd there or "
            "choose another endpoint"
        ) from None
    except etcd.EtcdException as exc:
        # etcd 3.4 answers 404 on /v2/keys unless the v2 API is enabled.
        raise UserError(
            f"etcd at {spec.host}:{spec.port} does not serve the v2 API ({exc}); start it "
            "with --enable-v2=true"
        ) from None
    return _etcd_store_class()(client, "/" + spec.prefix, timeout)


def host_store(
    backend: Backend, *, etcd_endpoint: str | None, timeout: timedelta = DEFAULT_TIMEOUT
) -> tuple[dist.Store, StoreSpec]:
    """The coordinator's store and the spec workers connect with (``connect_store``).

    "tcp": a master TCPStore on 127.0.0.1 with a port the OS picks. "etcd": a store under a
    fresh prefix ``spotline/job-<hex>`` on the etcd at ``etcd_endpoint`` (HOST:PORT).
    """
    if backend == "tcp":
        if etcd_endpoint is not None:
            raise UserError("an etcd endpoint was given but the store backend is tcp")
        tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return tcp, StoreSpec("tcp", "127.0.0.1", tcp.port, "")
    if backend == "etcd":
        if etcd_endpoint is None:
            raise UserError("the etcd store backend needs an etcd endpoint (HOST:PORT)")
        host, port = _split_endpoint(etcd_endpoint)
        spec = StoreSpec("etcd", host, port, f"spotline/job-{uuid.uuid4().hex}")
        return _etcd_store(spec, timeout), spec
    raise UserError(f"store backend {backend!r} is not one of {BACKENDS}")


def connect_store(spec: StoreSpec, *, timeout: timedelta) -> dist.Store:
    """A worker's client of the store that ``host_store`` made; one per thread that uses it."""
    if spec.backend == "tcp":
        return dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
    return _etcd_store(spec, timeout)


def store_port(spec: StoreSpec) -> int:
    """The remote port of every connection to the store (the TCPStore's or etcd's client port)."""
    return spec.port


def delete_etcd_prefix(spec: StoreSpec) -> None:
    """Remove a finished job's keys from etcd (the coordinator's cleanup; tcp has none)."""
    if spec.backend != "etcd":
        raise ValueError(f"only an etcd store has keys to delete, got {spec.backend}")
    etcd = _etcd_module()
    client = etcd.Client(host=spec.host, port=spec.port, protocol="http", read_timeout=30)
    try:
        client.delete("/" + spec.prefix, recursive=True, dir=True)
    except etcd.EtcdKeyNotFound:
        pass


# -- a private etcd for tests and demos -------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdProcess:
    """A running etcd on loopback (``start_local_etcd``); ``stop`` terminates and reaps it."""

    def __init__(self, proc: subprocess.Popen[bytes], client_port: int, log_path: Path) -> None:
        self.proc = proc
        self.host = "127.0.0.1"
        self.client_port = client_port
        self.log_path = log_path

    @property
    def endpoint(self) -> str:
        """HOST:PORT, the form ``host_store(..., etcd_endpoint=...)`` takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        """Terminate etcd and wait for it (kill after 10 s); calling it again is harmless."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> EtcdProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _healthy(client_port: int) -> bool:
    url = f"http://127.0.0.1:{client_port}/health"
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return bool(json.loads(reply.read().decode()).get("health") == "true")
    except (OSError, urllib.error.URLError, ValueError):
        return False


def start_local_etcd(
    data_dir: Path, *, binary: str = ETCD_BINARY, startup_timeout_s: float = 30.0
) -> EtcdProcess:
    """Start a single-member etcd on 127.0.0.1 with the v2 API, wait until healthy.

    Ports are free ones picked now; a port taken between picking and binding makes etcd
    exit, so the start is retried (three times) with new ports. The log goes to
    ``data_dir/etcd.log``. Pair with ``EtcdProcess.stop`` (or use it as a context manager).
    """
    path = shutil.which(binary)
    if path is None:
        raise UserError(
            f"etcd binary {binary} not found; install Debian's etcd-server "
            "(apt-get install -y etcd-server)"
        )
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "etcd.log"
    for _attempt in range(3):
        client_port, peer_port = _free_port(), _free_port()
        client_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        name = f"spotline-{client_port}"
        args = [
            path,
            f"--name={name}",
            f"--data-dir={data_dir / 'data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={name}={peer_url}",
            "--initial-cluster-state=new",
            "--enable-v2=true",
            "--logger=zap",
            "--log-level=warn",
        ]
        shutil.rmtree(data_dir / "data", ignore_errors=True)  # a stale member name would clash
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
        etcd_process = EtcdProcess(proc, client_port, log_path)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if _healthy(client_port):
                return etcd_process
            time.sleep(0.1)
        etcd_process.stop()
        if time.monotonic() >= deadline:
            break  # slow, not a port clash: retrying would not help
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"etcd did not become healthy; last log lines:\n{tail}")
