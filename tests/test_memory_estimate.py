"""The memory estimate (spotline.plan.memory_estimate): pure arithmetic checked against
DeepSpeed's partition and the real models, and the refusal of a plan that does not fit.

Its agreement with the bytes the workers count from their tensors is checked on a real run
in tests/test_redundancy.py (``_check_memory_estimate``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_spotline, small_config, write_config

from spotline.config import parse_config
from spotline.models import layers as models
from spotline.models.model_config import balanced_parts
from spotline.plan.memory_estimate import GIB, estimate, over_limit
from spotline.reports.memory_report import memory_plan, model_shape


def test_balanced_parts_is_deepspeeds_partition() -> None:
    from deepspeed.runtime.utils import partition_balanced

    shapes = [[1] * n for n in range(1, 13)]
    # The families' layer weights: embeddings and head 0, blocks 1 (up to 48 blocks).
    shapes += [[0, *([1] * n), 0, 0] for n in [*range(1, 13), 24, 32, 48]]
    shapes += [[0, 0, *([1] * n), 0, 0] for n in [*range(1, 13), 24, 32, 48]]
    shapes += [[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 0], [2, 2, 1]]
    for weights in shapes:
        for parts in range(1, min(len(weights) + 2, 17)):
            expected = [int(p) for p in partition_balanced(weights=weights, num_parts=parts)]
            assert balanced_parts(weights, parts) == expected, (weights, parts)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "neox-tiny"])
def test_the_shape_counts_the_pipeline_layers_parameters(name: str) -> None:
    cfg = parse_config(small_config(model={"name": name}, topology={"stages": 2, "workers": 2}))
    hf_config = models.load_hf_config(name)
    shape = model_shape(cfg, hf_config)
    specs = models.build_layer_specs(hf_config, seed=1)
    parts = models.logical_parts(hf_config, 2)
    for stage in range(2):
        built = [specs[i].build() for i in range(parts[stage], parts[stage + 1])]
        params = [p for layer in built for p in layer.parameters()]
        assert shape.stage_parameters[stage] == sum(p.numel() for p in params)
        assert shape.stage_tensors[stage] == len(params)
    models.release_weight_source(specs)


def test_what_each_setting_changes() -> None:
    def stages(**sections) -> list:
        raw = small_config(topology={"stages": 2, "workers": 4}, **sections)
        if sections.pop("bf16", False):
            raw["bf16"] = {"enabled": True}
        cfg = parse_config(raw)
        return estimate(model_shape(cfg, models.load_hf_config("gpt2-tiny")), memory_plan(cfg))

    off = stages(redundancy={"mode": "off"})
    lazy = stages(redundancy={"mode": "lazy"})
    sharded = stages(redundancy={"mode": "lazy", "replica": "sharded"})
    checkpointed = stages(redundancy={"mode": "lazy"}, model={"activation_checkpoint_interval": 1})
    logical = stages(redundancy={"mode": "lazy"}, elasticity={"logical_workers": 6})
    for s in range(2):
        # A replica is its successor's parameters, gradient and Adam state; sharded, half.
        assert off[s].replica_parameters == 0 and lazy[s].replica_parameters > 0
        assert lazy[s].replica_parameters == lazy[1 - s].parameters
        assert lazy[s].replica_optimizer == lazy[1 - s].optimizer
        elements = lazy[s].replica_parameters // 4  # fp32
        assert sharded[s].replica_parameters == 4 * -(-elements // 2)  # 2 pipelines, 2 shards
        assert checkpointed[s].activations < lazy[s].activations
        assert checkpointed[s].model_state == lazy[s].model_state
        # A flat gradient copy a hosted logical worker: one a pipeline, or three.
        assert lazy[s].logical_gradients == lazy[s].gradients
        assert logical[s].logical_gradients == 3 * lazy[s].gradients
    assert over_limit(lazy, 1.0) is None
    line = over_limit(lazy, lazy[0].total / GIB / 2)
    assert line is not None and "spotline.topology.memory_per_slot_gb" in line
    assert "--stages" in line and "\n" not in line


def test_a_plan_over_the_memory_limit_is_one_line_and_nothing_written(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.json", small_config())
    out = tmp_path / "run"
    proc = run_spotline(
        ["train", "--config", str(config), "--output", str(out), "--memory-per-slot-gb", "0.001"]
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line.startswith("spotline: error: the worker of stage ")
    assert "memory_per_slot_gb is 0.001" in line and "activation checkpointing" in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]
