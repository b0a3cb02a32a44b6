"""The job token (spotline.wire.auth) over a real c10d store: what is written without it, or with
another, is as if never written; token files are checked with one clear line."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch.distributed as dist

from spotline.errors import UserError
from spotline.launch.agent import read_admission
from spotline.wire.agent_messages import Admission
from spotline.wire.auth import AuthStore, ForgedValue, JobToken, job_token, read_token_file
from spotline.wire.protocol import admit_key

TOKEN = JobToken(bytes(range(32)))
OTHER = JobToken(bytes(32))


def test_a_sealed_value_opens_only_with_its_token_and_under_its_key() -> None:
    sealed = TOKEN.seal("report/3/w1", '{"outcome": "done"}').encode()
    assert TOKEN.open("report/3/w1", sealed) == b'{"outcome": "done"}'
    assert OTHER.open("report/3/w1", sealed) is None  # another job's token
    assert TOKEN.open("report/4/w1", sealed) is None  # replayed under another key
    tampered = sealed[:-2] + b"1}"
    assert TOKEN.open("report/3/w1", tampered) is None
    assert TOKEN.open("report/3/w1", b'{"outcome": "done"}') is None  # never sealed


def test_the_store_treats_forged_values_as_absent_and_says_which() -> None:
    inner = dist.HashStore()
    forged: list[str] = []
    store = AuthStore(inner, TOKEN, on_forged=forged.append)
    store.set("hb/w0", "12.5")
    assert store.check(["hb/w0"]) and store.get("hb/w0") == b"12.5"
    assert inner.get("hb/w0") != b"12.5"  # what lies in the store is sealed
    inner.set("error/w1", "worker w1: stop the job")  # someone without the token
    AuthStore(inner, OTHER).set("plan/2", "{}")  # someone with another job's token
    assert not store.check(["error/w1"]) and not store.check(["hb/w0", "plan/2"])
    with pytest.raises(ForgedValue):
        store.get("plan/2")
    assert set(forged) == {"error/w1", "plan/2"}
    assert store.add("machines", 1) == 1  # counters pass through (a number has no seal)
    # read: check and get in one call, a forged or absent value as None.
    assert store.read("hb/w0") == b"12.5"
    assert store.read("error/w1") is None and store.read("hb/w9") is None
    assert store.num_keys() == inner.num_keys()


def test_the_coordinator_token_is_written_once_private_and_kept(tmp_path: Path) -> None:
    first = job_token(tmp_path / "out", None)
    path = tmp_path / "out" / "job-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert job_token(tmp_path / "out", None) == first  # a restarted coordinator keeps it
    assert read_token_file(path) == first
    given = tmp_path / "given"
    given.write_text(TOKEN.text() + "\n")
    assert job_token(tmp_path / "out", str(given)) == TOKEN
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["job-token"]  # no temp left


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--token-file {p}: no such file; copy the coordinator's job-token"),
        ("not hex at all", "--token-file {p}: not a job token (expected at least 32 hex digits"),
        ("abcd", "--token-file {p}: not a job token (expected at least 32 hex digits"),
    ],
)
def test_a_bad_token_file_is_one_clear_error(tmp_path: Path, content, message) -> None:
    p = tmp_path / "token"
    if content is not None:
        p.write_text(content)
    with pytest.raises(UserError) as err:
        read_token_file(p)
    assert str(err.value).startswith(message.format(p=p))
    assert "\n" not in str(err.value)


def test_an_agent_believes_an_admission_only_under_its_token() -> None:
    key = admit_key(3)
    admitted = TOKEN.seal(key, Admission(machine="m1#2").encode()).encode()
    refused = TOKEN.seal(key, Admission(refused="no job token").encode()).encode()
    assert read_admission(admitted, key, TOKEN) == Admission(machine="m1#2")
    # With a wrong token the coordinator's seal cannot be checked: a refusal still reads as
    # one, an admission is not believed.
    assert read_admission(refused, key, OTHER) == Admission(refused="no job token")
    assert read_admission(refused, key, None) == Admission(refused="no job token")
    assert read_admission(admitted, key, OTHER).refused is not None
    assert read_admission(b"garbage", key, None).refused == "an unreadable answer"
