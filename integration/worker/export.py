"""The model out of a pipeline: pipeline 0's parameters gathered on rank 0 under Hugging Face
names, and saved as a ``save_pretrained`` directory with the run's tokenizer.

Both entry points export the final model (:func:`export_final_model`, which also gives its
``param_sha256``, the hash every run is compared by), and the evaluations save the best one
(``spotline.worker.validator.Evaluator``) with the evaluation it is from (:data:`EVAL_NOTE`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotline.config import RunConfig
from spotline.data import corpus as sl_data
from spotline.models import layers as models
from spotline.runtime import param_sha256

EVAL_NOTE = "spotline-eval.json"
"""The evaluation a saved model directory is from (``EvalResult`` as JSON)."""


def gather_hf_parameters(engine: Any, hf_config: Any) -> dict[str, torch.Tensor] | None:
    """Collect every parameter of pipeline 0 on global rank 0, under Hugging Face names.
    Collective: every rank calls it; None except on rank 0."""
    mine: dict[str, torch.Tensor] = {}
    if engine.grid.data_parallel_id == 0:
        mine = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    gathered: list[dict[str, torch.Tensor]] | None = (
        [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    )
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    return models.layer_names_to_hf(full, hf_config)


def save_model(
    hf_params: dict[str, torch.Tensor],
    hf_config: Any,
    directory: Path,
    cfg: RunConfig,
    *,
    note: str | None = None,
) -> None:
    """Write ``hf_params`` as a ``save_pretrained`` directory with the run's tokenizer (and
    ``note``, the evaluation it is from, in :data:`EVAL_NOTE`), atomically: complete and
    flushed before it is renamed into place."""
    tokenizer = sl_data.load_tokenizer(cfg.spotline.data.tokenizer)

    def also(tmp_dir: str) -> None:
        tokenizer.save_pretrained(tmp_dir)
        if note is not None:
            Path(tmp_dir, EVAL_NOTE).write_text(note)

    # The master weights are fp32; the file holds what spotline.export.dtype asks for.
    models.save_pretrained(
        models.hf_to_layer_names(hf_params, hf_config),
        hf_config,
        str(directory),
        also=also,
        dtype=getattr(torch, cfg.spotline.export.dtype),
    )


def export_final_model(engine: Any, hf_config: Any, output_dir: Path, cfg: RunConfig) -> str | None:
    """Save pipeline 0's parameters as a Hugging Face model, with the run's tokenizer, in
    ``output_dir/model``; returns their ``param_sha256`` on global rank 0 (None elsewhere):
    the fp32 master weights' hash, whatever dtype ``spotline.export.dtype`` saves.
    Collective: every rank calls it."""
    hf_params = gather_hf_parameters(engine, hf_config)
    if hf_params is None:
        return None
    save_model(hf_params, hf_config, output_dir / "model", cfg)
    return param_sha256(models.drop_tied_aliases(hf_params, hf_config))
