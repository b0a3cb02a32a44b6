"""The worker spawner: real forks of a real zygote process, answered like subprocess.Popen.

The children here run small modules written by the test (the zygote preloads only ``json``),
so these are process tests that take a fraction of a second each; the training tests run
every worker through the same spawner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotline.launch.control.spawner import Spawner

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("SPAWN_TEST"),
                      "pgid": os.getpgid(0) == os.getpid(), "sid": os.getsid(0),
                      "main": __name__}), flush=True)
    mode = sys.argv[1]
    if mode == "sleep":
        time.sleep(60)
    if mode == "raise":
        raise RuntimeError("a bug in the worker")
    sys.exit(int(sys.argv[2]))
    """
)


@pytest.fixture()
def spawner(tmp_path: Path) -> Iterator[tuple[Spawner, dict[str, str], Path]]:
    (tmp_path / "spawn_child.py").write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    sp = Spawner(["json"], env, tmp_path / "logs" / "spawner.log")
    try:
        yield sp, env, tmp_path
    finally:
        sp.close()


def _first_line(log: Path) -> str:
    return log.read_text().splitlines()[0]


def test_a_forked_worker_runs_its_module_with_its_argv_env_log_and_exit_code(spawner) -> None:
    sp, env, tmp = spawner
    log = tmp / "w0.log"
    proc = sp.start("w0", "spawn_child", ["exit", "3"], dict(env, SPAWN_TEST="w0's"), log)
    assert proc.wait(timeout=30) == 3
    assert proc.poll() == 3 and proc.returncode == 3
    seen = _first_line(log)
    assert '"argv": ["exit", "3"]' in seen and '"env": "w0\'s"' in seen
    # Its own process group (a signal to it reaches it alone), in the zygote's session: the
    # machine's workers are one scheduling group under the kernel's autogroup, not one each.
    assert '"pgid": true' in seen
    assert f'"sid": {os.getsid(sp.zygote_pid)}' in seen and os.getsid(sp.zygote_pid) != os.getsid(0)
    assert '"main": "__main__"' in seen  # run as ``python -m``


def test_signals_exceptions_and_timeouts_read_as_popen_s(spawner) -> None:
    sp, env, tmp = spawner
    killed = sp.start("a", "spawn_child", ["sleep"], env, tmp / "a.log")
    termed = sp.start("b", "spawn_child", ["sleep"], env, tmp / "b.log")
    bug = sp.start("c", "spawn_child", ["raise"], env, tmp / "c.log")
    assert len({killed.pid, termed.pid, bug.pid}) == 3
    with pytest.raises(subprocess.TimeoutExpired):
        killed.wait(timeout=0.2)
    assert killed.poll() is None
    killed.kill()
    termed.send_signal(signal.SIGTERM)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    assert termed.wait(timeout=30) == -signal.SIGTERM
    assert bug.wait(timeout=30) == 1
    assert "RuntimeError: a bug in the worker" in (tmp / "c.log").read_text()
    killed.send_signal(signal.SIGKILL)  # after its exit: nothing is signalled, no error
    sp.close()
    assert killed.poll() == -signal.SIGKILL  # still answered after the spawner is closed


def test_the_zygote_exits_with_its_supervisor_and_leaves_its_workers_to_find_out(tmp_path) -> None:
    """A supervisor that goes away (here: closes its end, as its death would) takes the
    zygote with it; a worker still running is not killed by that (a coordinator's workers
    notice on their own that their store is gone)."""
    (tmp_path / "spawn_child.py").write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    sp = Spawner(["json"], env, tmp_path / "spawner.log")
    child = sp.start("w", "spawn_child", ["sleep"], env, tmp_path / "w.log")
    zygote = sp._zygote
    try:
        sp._requests.close()  # as if the supervisor died
        assert zygote.wait(timeout=30) == 0
        os.kill(child.pid, 0)  # still running (raises if not)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        sp._replies.close()


def test_a_preloaded_module_that_fails_to_import_is_reported(tmp_path) -> None:
    sp = Spawner(["no_such_module_here"], dict(os.environ), tmp_path / "spawner.log")
    with pytest.raises(RuntimeError, match="spawner exited"):
        sp.start("w", "json.tool", [], dict(os.environ), tmp_path / "w.log")
    sp.close()
    assert "No module named 'no_such_module_here'" in (tmp_path / "spawner.log").read_text()


@pytest.mark.timeout(60)
def test_a_worker_whose_zygote_was_killed_is_waited_for_without_spinning(tmp_path) -> None:
    """The zygote killed (its machine's processes killed by hand, or in another order than
    the agent's): no exit comes on its pipe, whose end select reports at once. poll() and
    wait() then ask the kernel for the pid: a live worker reads as running, a gone one as
    killed, and wait() returns (it spun on the pipe's end forever, at 80% of a core)."""
    from spotline.launch.control.spawner import LOST_EXIT_CODE

    (tmp_path / "spawn_child.py").write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    sp = Spawner(["json"], env, tmp_path / "spawner.log")
    child = sp.start("w", "spawn_child", ["sleep"], env, tmp_path / "w.log")
    try:
        sp._zygote.kill()
        sp._zygote.wait(timeout=30)
        assert child.poll() is None  # running still
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.3)
        start = os.times()
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == LOST_EXIT_CODE
        assert sp.zygote_gone
        assert child.poll() == LOST_EXIT_CODE
        # Waited by sleeping, not by spinning on the pipe (CPU seconds, not wall time).
        used = os.times()
        assert used.user + used.system - start.user - start.system < 0.5
    finally:
        if child.returncode is None:
            os.kill(child.pid, signal.SIGKILL)
        sp.close()
