"""Periodic checkpoints: atomic, checksummed, pruned; the fallback for fatal losses."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from pathlib import Path

import pytest
import torch

from spotline.checkpointing.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointWriter,
    latest_complete,
    load,
    load_all,
    step_dir,
    verify_checkpoint,
)
from spotline.plan.checkpoint_interval import interval_steps, young_daly_interval_s


def state_of(seed: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(4, 3, generator=generator),
        "optimizer": {"exp_avg": [torch.randn(5, generator=generator)], "step": seed},
        "rng": torch.get_rng_state(),
        "python_rng": random.Random(seed).getstate(),
        "note": f"seed {seed}",
    }


def write_step(writer: CheckpointWriter, step: int, labels: tuple[str, ...] = ("s0", "s1")) -> None:
    for index, label in enumerate(labels):
        writer.save_async(step, label, state_of(step * 10 + index))
    writer.wait()
    assert writer.commit(step, labels)


def assert_same(loaded: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor)
        assert loaded.dtype == expected.dtype and torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert isinstance(loaded, dict) and loaded.keys() == expected.keys()
        for key in expected:
            assert_same(loaded[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(loaded) is type(expected) and len(loaded) == len(expected)
        for item, expected_item in zip(loaded, expected, strict=True):
            assert_same(item, expected_item)
    else:
        assert loaded == expected


def test_round_trip_is_exact_and_the_snapshot_is_taken_at_save_time(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=2)
    states = {"s0": state_of(1), "s1": state_of(2)}
    expected = {label: state_of(seed) for label, seed in (("s0", 1), ("s1", 2))}
    for label, state in states.items():
        writer.save_async(7, label, state)
    # Training changes its tensors right after save_async returns: the checkpoint must not.
    for state in states.values():
        state["weight"].add_(1.0)  # type: ignore[union-attr]
        state["optimizer"]["exp_avg"][0].zero_()  # type: ignore[index]
    writer.wait()
    assert writer.commit(7, ["s0", "s1"])
    writer.close()
    assert latest_complete(tmp_path) == 7
    assert_same(load(tmp_path, 7, "s1"), expected["s1"])
    loaded = load_all(tmp_path, 7)
    assert sorted(loaded) == ["s0", "s1"]
    for label in loaded:
        assert_same(loaded[label], expected[label])
    manifest = json.loads((step_dir(tmp_path, 7) / MANIFEST).read_text())
    assert manifest["step"] == 7
    data = (step_dir(tmp_path, 7) / "s0.pt").read_bytes()
    assert manifest["files"]["s0"] == {
        "file": "s0.pt",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    # No temp file is left behind.
    assert not [p.name for p in step_dir(tmp_path, 7).iterdir() if p.name.startswith(".")]


def test_commit_waits_for_every_expected_rank(tmp_path: Path) -> None:
    # Two writers stand for two processes writing into one step directory.
    rank0, rank1 = CheckpointWriter(tmp_path, keep=3), CheckpointWriter(tmp_path, keep=3)
    rank0.save_async(4, "s0", state_of(0))
    assert rank0.commit(4, ["s0", "s1"]) is False
    assert not (step_dir(tmp_path, 4) / MANIFEST).exists()
    assert latest_complete(tmp_path) is None
    rank1.save_async(4, "s1", state_of(1))
    rank1.wait()
    assert rank0.commit(4, ["s0", "s1"]) is True
    assert rank0.commit(4, ["s0", "s1"]) is True  # idempotent
    assert latest_complete(tmp_path) == 4
    rank0.close()
    rank1.close()


def test_corrupt_checkpoint_is_detected_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = CheckpointWriter(tmp_path, keep=3)
    write_step(writer, 1)
    write_step(writer, 2)
    writer.close()
    path = step_dir(tmp_path, 2) / "s1.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    path.write_bytes(bytes(data))
    assert verify_checkpoint(tmp_path, 1) == []
    assert "SHA-256" in verify_checkpoint(tmp_path, 2)[0]
    with caplog.at_level(logging.WARNING, logger="spotline.checkpointing.checkpoint"):
        assert latest_complete(tmp_path) == 1
    assert "skipping checkpoint" in caplog.text and "step-00000002" in caplog.text
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        load(tmp_path, 2, "s1")
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        load_all(tmp_path, 2)
    assert_same(load(tmp_path, 2, "s0"), state_of(20))  # the intact file still loads


def test_truncated_file_is_skipped(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=3)
    write_step(writer, 1)
    write_step(writer, 2)
    writer.close()
    path = step_dir(tmp_path, 2) / "s0.pt"
    path.write_bytes(path.read_bytes()[:-10])
    assert "bytes, manifest says" in verify_checkpoint(tmp_path, 2)[0]
    assert latest_complete(tmp_path) == 1


def test_partial_checkpoint_without_manifest_is_ignored(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=3)
    write_step(writer, 3)
    writer.save_async(5, "s0", state_of(0))
    writer.save_async(5, "s1", state_of(1))
    writer.wait()  # every file is there, but nobody committed step 5
    assert latest_complete(tmp_path) == 3
    with pytest.raises(CheckpointError, match="incomplete"):
        load(tmp_path, 5, "s0")
    with pytest.raises(CheckpointError, match="no rank 's9'"):
        load(tmp_path, 3, "s9")
    writer.close()


def test_a_skipped_checkpoint_is_one_spotline_line_however_often_it_is_looked_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In the command's voice (``spotline: ...``, as its every line) and once: a run looks
    for its newest checkpoint before it starts (``--resume``) and again at a fallback, and
    printed a bare ``skipping checkpoint ...`` each time."""
    from spotline.launch.cli import say_warnings

    writer = CheckpointWriter(tmp_path, keep=3)
    write_step(writer, 3)
    writer.save_async(5, "s0", state_of(0))  # never committed: no manifest
    writer.wait()
    writer.close()
    say_warnings()
    assert latest_complete(tmp_path) == 3 and latest_complete(tmp_path) == 3
    told = [line for line in capsys.readouterr().err.splitlines() if "skipping" in line]
    assert len(told) == 1 and told[0].startswith("spotline: skipping checkpoint "), told
    assert "step-00000005" in told[0]


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=2)
    write_step(writer, 1)
    # An abandoned partial checkpoint older than a complete one is removed by the next commit;
    # a partial one newer than every complete one may still be being written and stays.
    writer.save_async(2, "s0", state_of(0))
    writer.wait()
    write_step(writer, 3)
    write_step(writer, 4)
    writer.save_async(9, "s0", state_of(0))
    writer.wait()
    write_step(writer, 5)
    writer.close()
    remaining = sorted(path.name for path in tmp_path.iterdir())
    assert remaining == ["step-00000004", "step-00000005", "step-00000009"]
    assert latest_complete(tmp_path) == 5


def test_latest_complete_of_an_empty_or_missing_root(tmp_path: Path) -> None:
    assert latest_complete(tmp_path) is None
    assert latest_complete(tmp_path / "nowhere") is None


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointWriter(tmp_path, keep=0)
    writer = CheckpointWriter(tmp_path, keep=1)
    with pytest.raises(ValueError, match="rank label"):
        writer.save_async(1, "../escape", {})
    with pytest.raises(ValueError, match="rank label"):
        writer.save_async(1, "MANIFEST", {})
    with pytest.raises(ValueError, match="step"):
        writer.save_async(-1, "s0", {})
    with pytest.raises(ValueError, match="at least one"):
        writer.commit(1, [])
    writer.close()


def test_young_daly() -> None:
    assert young_daly_interval_s(2.0, 3600.0) == math.sqrt(14400.0) == 120.0
    assert young_daly_interval_s(8.0, 2.0) == math.sqrt(32.0)
    assert interval_steps(1.5, 2.0, 3600.0) == 80  # 120 s / 1.5 s
    assert interval_steps(7.0, 2.0, 3600.0) == 17  # floor(17.14)
    assert interval_steps(500.0, 2.0, 3600.0) == 1  # at least one step
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            young_daly_interval_s(bad, 3600.0)
        with pytest.raises(ValueError):
            young_daly_interval_s(2.0, bad)
        with pytest.raises(ValueError):
            interval_steps(bad, 2.0, 3600.0)
