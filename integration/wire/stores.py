"""The job's key-value store: torch.distributed's TCPStore or an etcd-backed store.

The coordinator hosts the store (``host_store``) and hands workers a ``StoreSpec`` as one
command-line argument (``StoreSpec.to_arg`` / ``parse_store_arg``); each worker connects
with ``connect_store``. Both backends are c10d ``Store`` objects, so they also back each
generation's gloo process group through ``dist.PrefixStore``.

The etcd backend (``EtcdV3Store``) speaks etcd's v3 API through its JSON gateway with the
``etcd3gw`` client (etcd 3.4 and later; 3.6 has no v2 API); ``start_local_etcd`` runs a
private etcd on loopback for tests and demos.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

import torch.distributed as dist

from spotline.errors import UserError

Backend = Literal["tcp", "etcd"]
BACKENDS: tuple[Backend, ...] = ("tcp", "etcd")
ETCD_BINARY = "/usr/bin/etcd"
DEFAULT_TIMEOUT = timedelta(seconds=60)
# An AbortableStore's wait polls at most this far apart: a rendezvous key's arrival is seen
# within it (a generation's set-up waits on a few dozen keys).
ABORTABLE_POLL_MAX_S = 0.02


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


def _etcd3gw() -> Any:
    try:
        import etcd3gw
        import etcd3gw.exceptions
    except ModuleNotFoundError:
        raise UserError(
            "the etcd store backend needs the etcd3gw package: pip install 'etcd3gw>=2.7,<3'"
        ) from None
    return etcd3gw


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _as_bytes(data: str | bytes) -> bytes:
    # c10d hands a Python store str keys and bytes values; callers in Python pass either.
    return data.encode() if isinstance(data, str) else bytes(data)


def _one_line(exc: BaseException) -> str:
    # etcd3gw keeps the cause in ``detail_text`` (its str() is often empty).
    text = str(getattr(exc, "detail_text", None) or exc) or type(exc).__name__
    return " ".join(text.split())[:300]


class EtcdV3Store(dist.Store):
    """A c10d ``Store`` over etcd's v3 API (its JSON gateway, through ``etcd3gw``).

    The job's keys are ``/<prefix>/<key>`` (raw bytes, readable with ``etcdctl get --prefix``);
    values are bytes. The semantics are the TCPStore's: ``add`` is atomic (one transaction
    that compares the key's mod revision, retried when another client won), ``get`` and
    ``wait`` block until the keys exist or the timeout passes and then raise
    ``dist.DistStoreError``, ``add(key, 0)`` reads a counter (creating it as 0), and
    ``compare_set`` answers like the TCPStore's. A lost etcd raises ``dist.DistNetworkError``
    (one line), as a lost TCPStore does. Waits use a watch from the revision of the failed
    check, so no write between the check and the watch is missed and nothing polls.
    """

    def __init__(self, client: Any, prefix: str, timeout: timedelta) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.client = client
        self.prefix = f"/{prefix}/".encode()
        self.set_timeout(timeout)

    def _timeout(self) -> timedelta:
        # The base class's timeout, which PrefixStore.set_timeout also sets (a pybind
        # property that torch's stub leaves out).
        timeout: timedelta = self.timeout  # type: ignore[attr-defined]
        return timeout

    # -- requests ----------------------------------------------------------------------
    def _where(self) -> str:
        return f"etcd at {self.client.host}:{self.client.port}"

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        errors = _etcd3gw().exceptions
        try:
            reply = self.client.post(self.client.get_url(path), json=payload)
        except (errors.ConnectionFailedError, errors.ConnectionTimeoutError) as exc:
            raise dist.DistNetworkError(
                f"cannot reach {self._where()} ({_one_line(exc)})"
            ) from None
        except errors.Etcd3Exception as exc:
            raise dist.DistStoreError(f"{self._where()}: {_one_line(exc)}") from None
        assert isinstance(reply, dict), reply
        return reply

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix + _as_bytes(key)

    def _range(self, key: bytes) -> tuple[bytes, int] | None:
        """The key's value and mod revision, or None when it is absent."""
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])

    def _all_present(self, keys: Sequence[str | bytes]) -> tuple[bool, int]:
        """Whether every key exists, and the store's revision when that was read.

        One read-only transaction (etcd serves it without a raft write): a missing key's
        create revision compares as 0."""
        compare = [
            {
                "key": _b64(self._key(k)),
                "target": "CREATE",
                "result": "GREATER",
                "create_revision": 0,
            }
            for k in keys
        ]
        reply = self._post("/kv/txn", {"compare": compare, "success": [], "failure": []})
        # The gateway leaves out fields with default values (a false ``succeeded``).
        return bool(reply.get("succeeded", False)), int(reply["header"]["revision"])

    def _watch(self, keys: Sequence[str | bytes], start_revision: int, seconds: float) -> None:
        """Return when a put to a key in the keys' span happens at or after ``start_revision``
        (or the watch ends or ``seconds`` pass); the caller checks again either way."""
        import requests

        span = sorted(self._key(k) for k in keys)
        request = {
            "create_request": {
                "key": _b64(span[0]),
                "range_end": _b64(span[-1] + b"\0"),
                "start_revision": start_revision,
                "filters": ["NODELETE"],
            }
        }
        url = self.client.get_url("/watch")
        try:
            with self.client.session.post(
                url, json=request, stream=True, timeout=(self.client.timeout, seconds)
            ) as reply:
                if reply.status_code == 200:
                    for line in reply.iter_lines(chunk_size=None):
                        if not line.strip():
                            continue
                        result = json.loads(line).get("result", {})
                        if result.get("events"):
                            return
                        if not result.get("created", False):
                            break  # canceled (a compaction) or an error: look again
        except (requests.RequestException, ValueError):
            pass  # a read timeout, or etcd gone: the check that follows tells which
        # Not woken by a write: a short pause, so that a watch refused at once (the check
        # after it succeeding) cannot spin until the deadline.
        time.sleep(min(seconds, 0.05))

    # -- the Store interface -----------------------------------------------------------
    def set(self, key: str | bytes, value: str | bytes) -> None:
        self._post("/kv/put", {"key": _b64(self._key(key)), "value": _b64(_as_bytes(value))})

    def get(self, key: str) -> bytes:
        while True:
            found = self._range(self._key(key))
            if found is not None:
                return found[0]
            self.wait([key])

    def add(self, key: str | bytes, num: int) -> int:
        k = _b64(self._key(key))
        value, revision = 0, 0  # an absent key: etcd compares its mod revision as 0
        if num == 0:
            # add(key, 0) is how a barrier polls a counter: a read, not a raft write.
            found = self._range(self._key(key))
            if found is not None:
                return int(found[0])
        while True:
            new = str(value + num).encode()
            reply = self._post(
                "/kv/txn",
                {
                    "compare": [
                        {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": revision}
                    ],
                    "success": [{"request_put": {"key": k, "value": _b64(new)}}],
                    "failure": [{"request_range": {"key": k}}],
                },
            )
            if reply.get("succeeded", False):
                return value + num
            # Another client wrote first: retry from the value and revision it left.
            kvs = reply["responses"][0]["response_range"].get("kvs", [])
            if kvs:
                value, revision = int(_unb64(kvs[0].get("value", ""))), int(kvs[0]["mod_revision"])
            else:
                value, revision = 0, 0

    def check(self, keys: list[str]) -> bool:
        return self._all_present(keys)[0]

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        timeout = self._timeout() if override_timeout is None else override_timeout
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            present, revision = self._all_present(keys)
            if present:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(
                    f"etcd store: wait timeout after {timeout}, keys: {list(keys)}"
                )
            self._watch(keys, revision + 1, left)

    def compare_set(
        self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        k, expected, desired = (
            _b64(self._key(key)),
            _as_bytes(expected_value),
            _as_bytes(desired_value),
        )
        # The TCPStore's rule: an empty expected value means "the key is absent".
        compare: dict[str, Any]
        if expected:
            compare = {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        else:
            compare = {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        reply = self._post(
            "/kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": {"key": k, "value": _b64(desired)}}],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        if reply.get("succeeded", False):
            return desired
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        # An absent key with a non-empty expected value: the TCPStore answers the expected one.
        return _unb64(kvs[0].get("value", "")) if kvs else expected

    def delete_key(self, key: str | bytes) -> bool:
        reply = self._post("/kv/deleterange", {"key": _b64(self._key(key))})
        return int(reply.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        reply = self._post(
            "/kv/range",
            {
                "key": _b64(self.prefix),
                "range_end": _b64(_prefix_end(self.prefix)),
                "count_only": True,
            },
        )
        return int(reply.get("count", 0))


class AbortableStore(dist.Store):
    """A store whose blocking waits end as soon as ``aborted`` is set: a generation's
    rendezvous store (gloo's and every subgroup's, as DeepSpeed creates them).

    A member lost while a generation sets up (a machine cut off before it wrote its
    rendezvous address) leaves its peers blocked in the store's ``get``/``wait`` for that
    address, for the whole process-group timeout, once per subgroup: shutting their sockets
    (``abort_connections``) does not reach a store wait. Here a wait is a poll of ``check``
    (from 1 ms, backing off to :data:`ABORTABLE_POLL_MAX_S`), which looks at ``aborted``
    between polls and raises ``DistNetworkError`` when it is set. Polling, not the inner
    store's own timed ``wait``: a TCPStore client's wait that times out would leave its
    answer on the connection. Every other call goes to ``inner`` unchanged.
    """

    def __init__(self, inner: dist.Store, aborted: threading.Event, timeout: timedelta) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.inner = inner
        self.aborted = aborted
        self.set_timeout(timeout)

    def _timeout(self) -> timedelta:
        timeout: timedelta = self.timeout  # type: ignore[attr-defined]  # as EtcdV3Store's
        return timeout

    def set(self, key: str | bytes, value: str | bytes) -> None:
        self.inner.set(key, value)  # type: ignore[arg-type]  # both kinds accepted at runtime

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def add(self, key: str | bytes, num: int) -> int:
        return self.inner.add(key, num)  # type: ignore[arg-type]

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        # gloo passes its group's timeout, which is only the pair connect's while a generation
        # sets up (spotline.pipeline.group_setup): a slow but live member is waited for as long as a
        # collective would be, and a lost one ends the wait through ``aborted``.
        own = self._timeout()
        timeout = own if override_timeout is None else max(own, override_timeout)
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.001
        while not self.inner.check(keys):
            if self.aborted.is_set():
                raise dist.DistNetworkError(f"the generation was aborted while waiting for {keys}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {timeout}, keys: {list(keys)}")
            time.sleep(pause)
            pause = min(pause * 2, ABORTABLE_POLL_MAX_S)

    def compare_set(
        self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        return self.inner.compare_set(key, expected_value, desired_value)  # type: ignore[arg-type]

    def delete_key(self, key: str | bytes) -> bool:
        return self.inner.delete_key(key)  # type: ignore[arg-type]

    def num_keys(self) -> int:
        return self.inner.num_keys()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    assert prefix and prefix[-1] < 0xFF, prefix  # a job prefix ends with "/"
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"etcd endpoint {endpoint!r} must be HOST:PORT, e.g. 127.0.0.1:2379")
    return host, int(port)


def _etcd_client(spec: StoreSpec) -> Any:
    """An etcd3gw client of the etcd in ``spec``, checked to answer etcd's v3 API."""
    etcd3gw = _etcd3gw()
    # timeout bounds plain requests; a wait's watch passes its own read timeout.
    client = etcd3gw.Etcd3Client(host=spec.host, port=spec.port, protocol="http", timeout=30)
    try:
        client.status()
    except (
        etcd3gw.exceptions.ConnectionFailedError,
        etcd3gw.exceptions.ConnectionTimeoutError,
    ) as exc:
        raise UserError(
            f"cannot reach etcd at {spec.host}:{spec.port} ({_one_line(exc)}); start etcd "
            "there or choose another endpoint"
        ) from None
    except (etcd3gw.exceptions.Etcd3Exception, ValueError, KeyError) as exc:
        # Something answers HTTP there, but not etcd's v3 gateway (/version, /v3/...).
        raise UserError(
            f"{spec.host}:{spec.port} does not serve etcd's v3 API ({_one_line(exc)}); give "
            "the client URL of an etcd 3.4 or later"
        ) from None
    return client


def _etcd_store(spec: StoreSpec, timeout: timedelta) -> dist.Store:
    return EtcdV3Store(_etcd_client(spec), spec.prefix, timeout)


def _listen(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise UserError(
            f"cannot listen on {host}:{port} ({exc.strerror}); give an address of this machine "
            "and a free port (0 lets the system choose)"
        ) from None
    listener.listen(1024)
    return listener


def host_store(
    backend: Backend,
    *,
    etcd_endpoint: str | None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    listen: tuple[str, int] = ("127.0.0.1", 0),
    etcd_prefix: str | None = None,
) -> tuple[dist.Store, StoreSpec]:
    """The coordinator's store and the spec workers connect with (``connect_store``).

    "tcp": a master TCPStore listening on ``listen`` only (default: 127.0.0.1 and a port the
    OS picks). "etcd": a store under ``etcd_prefix`` (a restarted coordinator's job) or a
    fresh prefix ``spotline/job-<hex>`` on the etcd at ``etcd_endpoint`` (HOST:PORT).
    """
    if backend == "tcp":
        if etcd_endpoint is not None:
            raise UserError("an etcd endpoint was given but the store backend is tcp")
        host, port = listen
        listener = _listen(host, port)
        # TCPStore's own server listens on every interface; handed a socket bound to the one
        # address it is given, it serves that address only (the TCP store has no
        # authentication of its own).
        tcp = dist.TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=listener.detach(),  # the store owns the socket from here on
        )
        return tcp, StoreSpec("tcp", host, tcp.port, "")
    if backend == "etcd":
        if etcd_endpoint is None:
            raise UserError("the etcd store backend needs an etcd endpoint (HOST:PORT)")
        host, port = _split_endpoint(etcd_endpoint)
        spec = StoreSpec("etcd", host, port, etcd_prefix or f"spotline/job-{uuid.uuid4().hex}")
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
    prefix = f"/{spec.prefix}/".encode()
    client = _etcd_client(spec)
    client.post(
        client.get_url("/kv/deleterange"),
        json={"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))},
    )


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
    """Start a single-member etcd on 127.0.0.1 (v3 API only), wait until healthy.

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
