"""spotline.wire.stores: the TCP and etcd backends behave alike for the keys Spotline uses.

The etcd tests start a private etcd (Debian's etcd-server) on loopback and skip only when
its binary is absent.
"""

from __future__ import annotations

import ast
import http.server
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from spotline.errors import UserError
from spotline.wire.stores import (
    AbortableStore,
    EtcdProcess,
    StoreSpec,
    connect_store,
    delete_etcd_prefix,
    host_store,
    parse_store_arg,
    start_local_etcd,
    store_port,
)

needs_etcd = pytest.mark.usefixtures("require_etcd")
SHORT = timedelta(seconds=1)


@pytest.fixture
def local_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    with start_local_etcd(tmp_path / "etcd") as etcd_process:
        yield etcd_process


def test_spec_round_trips_through_the_command_line() -> None:
    tcp = StoreSpec("tcp", "127.0.0.1", 12345, "")
    etcd = StoreSpec("etcd", "127.0.0.1", 2379, "spotline/job-abc")
    assert tcp.to_arg() == "tcp://127.0.0.1:12345"
    assert etcd.to_arg() == "etcd://127.0.0.1:2379/spotline/job-abc"
    assert parse_store_arg(tcp.to_arg()) == tcp
    assert parse_store_arg(etcd.to_arg()) == etcd
    assert store_port(tcp) == 12345 and store_port(etcd) == 2379


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1:12345",  # no scheme
        "http://127.0.0.1:2379/x",
        "tcp://127.0.0.1",  # no port
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:1/prefix",
        "etcd://127.0.0.1:2379",  # no prefix
        "etcd://127.0.0.1:2379/a//b",
    ],
)
def test_bad_store_arguments_are_user_errors(text: str) -> None:
    with pytest.raises(UserError):
        parse_store_arg(text)


def test_host_store_rejects_a_missing_or_stray_endpoint() -> None:
    with pytest.raises(UserError, match="needs an etcd endpoint"):
        host_store("etcd", etcd_endpoint=None)
    with pytest.raises(UserError, match="backend is tcp"):
        host_store("tcp", etcd_endpoint="127.0.0.1:2379")
    with pytest.raises(UserError, match="HOST:PORT"):
        host_store("etcd", etcd_endpoint="localhost")


def check_store_semantics(master: dist.Store, client: dist.Store) -> None:
    """The calls coordinator.py and elastic.py make, on the master and a worker's client."""
    master.set("plan/0", '{"action": "train"}')
    assert client.get("plan/0") == b'{"action": "train"}'
    client.set("report/0/w1", b"\x00\xffbytes")
    assert master.get("report/0/w1") == b"\x00\xffbytes"
    assert master.check(["plan/0", "report/0/w1"])
    assert not master.check(["plan/0", "report/0/w2"])
    assert not client.check(["abort/0"])
    # add: a counter that starts at 0, shared by all clients; add(key, 0) reads it.
    assert client.add("prepared/0/3", 1) == 1
    assert master.add("prepared/0/3", 1) == 2
    assert client.add("prepared/0/3", 0) == 2
    assert client.get("prepared/0/3") == b"2"
    assert client.add("prepared/0/4", 0) == 0  # add(key, 0) creates a missing counter
    assert master.check(["prepared/0/4"]) and master.get("prepared/0/4") == b"0"
    client.set("hb/w1", "1.5")
    client.set("hb/w1", "2.5")  # overwrite
    assert master.get("hb/w1") == b"2.5"
    client.wait(["plan/0", "hb/w1"], SHORT)
    # A timeout is the TCPStore's DistStoreError on both backends (elastic.py catches it).
    with pytest.raises(dist.DistStoreError):
        client.wait(["plan/1"], SHORT)
    prefixed = dist.PrefixStore("pg/0", client)
    prefixed.set("rank0", "addr")
    assert master.get("pg/0/rank0") == b"addr"
    assert prefixed.add("count", 3) == 3
    with pytest.raises(dist.DistStoreError):
        prefixed.wait(["missing"], SHORT)


def test_tcp_store_semantics() -> None:
    master, spec = host_store("tcp", etcd_endpoint=None, timeout=SHORT)
    assert spec.backend == "tcp" and spec.port == master.port
    client = connect_store(parse_store_arg(spec.to_arg()), timeout=SHORT)
    check_store_semantics(master, client)


@needs_etcd
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_etcd_store_semantics(local_etcd: EtcdProcess) -> None:
    master, spec = host_store("etcd", etcd_endpoint=local_etcd.endpoint, timeout=SHORT)
    assert spec.port == local_etcd.client_port and spec.prefix.startswith("spotline/job-")
    client = connect_store(parse_store_arg(spec.to_arg()), timeout=SHORT)
    check_store_semantics(master, client)
    # A second job on the same etcd sees none of the first job's keys.
    other, other_spec = host_store("etcd", etcd_endpoint=local_etcd.endpoint, timeout=SHORT)
    assert other_spec.prefix != spec.prefix
    assert not other.check(["plan/0"])
    assert other.add("prepared/0/3", 1) == 1
    # The rest of c10d's Store interface, which v3 adds (torch's v2 EtcdStore lacked it),
    # answering as the TCPStore does.
    assert other.num_keys() == 1
    assert other.compare_set("cas", "", "a") == b"a"  # "" expects an absent key
    assert other.compare_set("cas", "b", "c") == b"a"  # a mismatch answers the value
    assert other.compare_set("cas", "a", "d") == b"d"
    assert other.compare_set("absent", "x", "y") == b"x" and not other.check(["absent"])
    assert other.delete_key("cas") and not other.delete_key("cas")
    assert other.num_keys() == 1 and master.check(["plan/0"])
    delete_etcd_prefix(other_spec)  # the coordinator's cleanup: this job's keys only
    assert other.num_keys() == 0 and master.check(["plan/0"])


@needs_etcd
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_etcd_endpoint_without_server_is_a_user_error(local_etcd: EtcdProcess) -> None:
    port = local_etcd.client_port
    local_etcd.stop()
    with pytest.raises(UserError, match="cannot reach etcd"):
        host_store("etcd", etcd_endpoint=f"127.0.0.1:{port}")


def test_an_endpoint_that_is_not_etcd_is_a_user_error() -> None:
    """An HTTP server that is not etcd's v3 gateway (an etcd 3.6 has no v2 API either)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(UserError, match="does not serve etcd's v3 API"):
            host_store("etcd", etcd_endpoint=f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


GLOO_WORKER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from spotline.wire.stores import connect_store, parse_store_arg

    rank = int(sys.argv[2])
    store = connect_store(parse_store_arg(sys.argv[1]), timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg/0", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    # Both ranks leave the barrier together and race on one counter (v3: a transaction on
    # the key's mod revision; a lost update or a repeated value would show in the results).
    seen = [store.add("race/counter", 1) for _ in range(int(sys.argv[3]))]
    dist.destroy_process_group()
    store.set(f"race/{rank}", repr(seen))
    store.set(f"result/{rank}", repr(t.tolist()))
    """
)
RACE_ADDS = 40


def _run_workers(arg: str) -> list[subprocess.CompletedProcess[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_WORKER, arg, str(rank), str(RACE_ADDS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=90)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    finally:
        for proc in procs:  # reap whatever is left after a timeout
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return results


@needs_etcd
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gloo_all_reduce_over_an_etcd_prefix_store(local_etcd: EtcdProcess) -> None:
    master, spec = host_store(
        "etcd", etcd_endpoint=local_etcd.endpoint, timeout=timedelta(seconds=30)
    )
    results = _run_workers(spec.to_arg())
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-3000:]}"
    for rank in range(2):
        assert master.get(f"result/{rank}") == b"[3.0, 30.0]"
    # Concurrent adds from two processes are exact: every total is returned exactly once.
    seen = [ast.literal_eval(master.get(f"race/{rank}").decode()) for rank in range(2)]
    assert all(values == sorted(values) for values in seen)
    assert sorted(seen[0] + seen[1]) == list(range(1, 2 * RACE_ADDS + 1))
    assert master.get("race/counter") == str(2 * RACE_ADDS).encode()


@needs_etcd
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_local_etcd_stop_leaves_no_process(tmp_path: Path) -> None:
    with start_local_etcd(tmp_path / "etcd") as etcd_process:
        pid = etcd_process.pid
        assert etcd_process.proc.poll() is None
        master, spec = host_store("etcd", etcd_endpoint=etcd_process.endpoint)
        master.set("k", "v")
    # Reaped: no zombie either (a zombie still has a /proc entry).
    assert etcd_process.proc.returncode is not None
    assert not Path(f"/proc/{pid}").exists()
    etcd_process.stop()  # a second stop is harmless


def test_missing_etcd_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="etcd-server"):
        start_local_etcd(tmp_path, binary=str(tmp_path / "no-such-etcd"))


def test_an_abortable_store_s_wait_ends_when_its_generation_is_aborted() -> None:
    """A generation's rendezvous store: a wait for a key nobody will write (a member lost
    before it wrote its address) ends at once when the generation is aborted, not after the
    timeout; keys that arrive are seen; every other call reaches the inner store."""
    inner = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    aborted = threading.Event()
    store = AbortableStore(inner, aborted, timedelta(seconds=600))
    prefixed = dist.PrefixStore("pg/1", store)  # as gloo's rendezvous holds it
    threading.Timer(0.2, lambda: inner.set("pg/1/late", "x")).start()
    assert prefixed.get("late") == b"x"  # written while waiting
    prefixed.set("k", "v")
    assert inner.get("pg/1/k") == b"v" and prefixed.add("n", 2) == 2
    # gloo passes its group's timeout, only the pair connect's while a generation sets up
    # (spotline.pipeline.group_setup): a shorter one does not cut the wait for a slow member ...
    threading.Timer(0.3, lambda: inner.set("pg/1/slow", "x")).start()
    prefixed.wait(["slow"], timedelta(seconds=0.01))
    # ... and the store's own timeout still ends a wait for a key nobody writes.
    short_store = AbortableStore(inner, aborted, timedelta(seconds=0.1))  # referenced: pybind
    with pytest.raises(dist.DistStoreError):
        dist.PrefixStore("pg/1", short_store).wait(["never"])
    threading.Timer(0.2, aborted.set).start()
    with pytest.raises(dist.DistNetworkError, match="aborted"):
        prefixed.get("never")  # the 600 s timeout is not waited out
