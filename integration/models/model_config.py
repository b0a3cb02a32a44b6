"""Model configs: the presets and ``save_pretrained`` directories, resolved without DeepSpeed.

What ``spotline train`` checks before any process starts (``spotline.data.inputs``) needs only a
model's config; ``spotline.models.layers``, which builds the pipeline stages, imports DeepSpeed
(seconds of imports the check does not need).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spotline.errors import UserError

if TYPE_CHECKING:  # imported where a config is built: the presets' shapes need no import
    import transformers

# Byte-level vocabulary: 256 byte values plus a few specials (256 = bos/eos).
_BYTE_VOCAB_SIZE = 260
_BOS_EOS_ID = 256


def _gpt2(n_layer: int, n_embd: int, n_head: int, n_positions: int) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "n_positions": n_positions,
        "vocab_size": _BYTE_VOCAB_SIZE,
        "bos_token_id": _BOS_EOS_ID,
        "eos_token_id": _BOS_EOS_ID,
        "tie_word_embeddings": True,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
    }


def _llama(layers: int, hidden: int, heads: int, intermediate: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "intermediate_size": intermediate,
        "vocab_size": _BYTE_VOCAB_SIZE,
        "max_position_embeddings": 128,
        "bos_token_id": _BOS_EOS_ID,
        "eos_token_id": _BOS_EOS_ID,
        "tie_word_embeddings": True,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-tiny": _gpt2(n_layer=4, n_embd=64, n_head=4, n_positions=128),
    "gpt2-small-test": _gpt2(n_layer=8, n_embd=128, n_head=4, n_positions=256),
    # The benchmark ladder (spotline.launch.bench.ladder): sized so that a step at sequence
    # length 128 takes about 0.3 s (mid, ~2.7M parameters) and 2 s (big, ~14M) on a 2-core
    # CPU host, where Spotline's fixed per-step costs weigh less than on the tiny models.
    "gpt2-mid": _gpt2(n_layer=6, n_embd=192, n_head=6, n_positions=128),
    "gpt2-big": _gpt2(n_layer=8, n_embd=384, n_head=6, n_positions=128),
    # Real sizes (the byte-level corpus uses the first 260 rows of the larger vocabularies).
    # GPT-2 small as published: 12 blocks, width 768, 12 heads, 50257 tokens, 124M parameters.
    "gpt2-small": {
        **_gpt2(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
        "vocab_size": 50257,
    },
    # A Llama of the same size: grouped-query attention (12 query heads, 4 key/value heads),
    # a 32000-token vocabulary and an untied head, 124.7M parameters.
    "llama-small": {
        **_llama(layers=12, hidden=768, heads=12, intermediate=2048),
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    "llama-tiny": _llama(layers=4, hidden=64, heads=4, intermediate=128),
    "llama-mid": _llama(layers=6, hidden=192, heads=6, intermediate=512),
    "llama-big": _llama(layers=8, hidden=384, heads=6, intermediate=1024),
    # The families people fine-tune, tiny (tests and demos; a save_pretrained directory of
    # the real thing trains the same way): Qwen2 with its q/k/v biases, Mistral with a
    # sliding window (as long as the preset's positions), Phi-3, Gemma with its tied head.
    "qwen2-tiny": {**_llama(layers=4, hidden=64, heads=4, intermediate=128), "model_type": "qwen2"},
    "mistral-tiny": {
        **_llama(layers=4, hidden=64, heads=4, intermediate=128),
        "model_type": "mistral",
        "sliding_window": 128,
    },
    "phi3-tiny": {
        **_llama(layers=4, hidden=64, heads=4, intermediate=128),
        "model_type": "phi3",
        "pad_token_id": _BOS_EOS_ID,
    },
    "gemma-tiny": {
        **_llama(layers=4, hidden=64, heads=4, intermediate=128),
        "model_type": "gemma",
        "head_dim": 16,
        "pad_token_id": _BOS_EOS_ID,
    },
    "neox-tiny": {
        "model_type": "gpt_neox",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 256,
        "vocab_size": _BYTE_VOCAB_SIZE,
        "max_position_embeddings": 128,
        "bos_token_id": _BOS_EOS_ID,
        "eos_token_id": _BOS_EOS_ID,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class _Arch:
    """Where an architecture keeps its parts, as HF submodule paths (None: has no such part)."""

    tok_embed: str
    pos_embed: str | None
    embed_dropout: str | None
    blocks: str
    rotary: str | None
    final_norm: str
    lm_head: str


_LLAMA_LAYOUT = _Arch(
    tok_embed="model.embed_tokens",
    pos_embed=None,
    embed_dropout=None,
    blocks="model.layers",
    rotary="model.rotary_emb",
    final_norm="model.norm",
    lm_head="lm_head",
)

_ARCHS: dict[str, _Arch] = {
    "gpt2": _Arch(
        tok_embed="transformer.wte",
        pos_embed="transformer.wpe",
        embed_dropout="transformer.drop",
        blocks="transformer.h",
        rotary=None,
        final_norm="transformer.ln_f",
        lm_head="lm_head",
    ),
    "llama": _LLAMA_LAYOUT,
    # Llama's layout, with their own blocks (each family's decoder layer class) and
    # embedding: Qwen2's q/k/v biases, Mistral's sliding window (check_sequence), Phi-3's
    # fused qkv and gate/up projections, Gemma's scaled embedding module and tied head.
    "qwen2": _LLAMA_LAYOUT,
    "mistral": _LLAMA_LAYOUT,
    "phi3": _LLAMA_LAYOUT,
    "gemma": _LLAMA_LAYOUT,
    "gpt_neox": _Arch(
        tok_embed="gpt_neox.embed_in",
        pos_embed=None,
        embed_dropout="gpt_neox.emb_dropout",
        blocks="gpt_neox.layers",
        rotary="gpt_neox.rotary_emb",
        final_norm="gpt_neox.final_layer_norm",
        lm_head="lm_head",
    ),
}


def is_family(hf_config: transformers.PretrainedConfig) -> bool:
    """Whether Spotline splits this model into pipeline stages (an ``_ARCHS`` family).

    Any other decoder-only causal LM trains whole, as one pipeline layer: ``--stages 1``
    only (data parallelism over logical workers).
    """
    return bool(hf_config.model_type in _ARCHS)


def arch_of(hf_config: transformers.PretrainedConfig) -> _Arch:
    """Where a family keeps its parts; only for a model :func:`is_family` accepts."""
    assert is_family(hf_config), f"model type {hf_config.model_type!r} has no pipeline layout"
    return _ARCHS[hf_config.model_type]


def families() -> str:
    """The model types Spotline splits into stages, for messages: ``"gpt2, gpt_neox, llama"``."""
    return ", ".join(sorted(_ARCHS))


def _check_causal_lm(hf_config: transformers.PretrainedConfig) -> None:
    """Refuse a model that is not a decoder-only causal LM (UserError, one line)."""
    if is_family(hf_config):
        return
    # Names only (no model class is imported); AutoConfig has already loaded this module.
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = hf_config.model_type
    # An encoder (BERT, RoBERTa) has a causal-LM class too, but it attends both ways unless
    # its config says is_decoder: trained on shifted labels it would read the tokens it is
    # asked to predict.
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
        hf_config, "is_decoder", False
    )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder:
        raise UserError(
            f"model type {model_type!r} is not supported: it is not a decoder-only causal LM "
            "(transformers' AutoModelForCausalLM); use a model of the families "
            f"{families()} or another decoder-only causal LM (opt, qwen2, mistral, phi, ...)"
        )


def check_stages(hf_config: transformers.PretrainedConfig, num_stages: int) -> None:
    """UserError (one line) when the model cannot be split into ``num_stages`` stages."""
    if is_family(hf_config):
        blocks = num_blocks(hf_config)
        if num_stages > blocks:
            raise UserError(
                f"--stages {num_stages} is more than the model's {blocks} transformer blocks; "
                f"use at most {blocks} stages or a deeper model"
            )
    elif num_stages > 1:
        raise UserError(
            f"--stages {num_stages}: a model of type {hf_config.model_type!r} trains whole, with "
            "--stages 1 (data parallelism over logical workers); the families split into "
            f"pipeline stages are {families()}"
        )


def attention_window(hf_config: transformers.PretrainedConfig) -> int | None:
    """The sliding window a split family's blocks attend within (None: the whole causal
    prefix): Mistral's ``sliding_window``; Qwen2's where a layer's type says so."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or not is_family(hf_config):
        return None
    if hf_config.model_type == "mistral":
        return int(window)
    layer_types = getattr(hf_config, "layer_types", None) or ()
    return int(window) if "sliding_attention" in layer_types else None


def check_sequence(hf_config: transformers.PretrainedConfig, seq_len: int) -> None:
    """UserError (one line) when a split model's stages would not compute what the model
    does at ``seq_len``: a stage's block attends causally over the whole sequence (SDPA's
    ``is_causal``, the only mask that crosses no stage boundary), which is a sliding
    window's attention only while the sequence fits in the window."""
    window = attention_window(hf_config)
    if window is not None and seq_len > window:
        raise UserError(
            f"--seq-len {seq_len}: a {hf_config.model_type!r} model attends within a sliding "
            f"window of {window} tokens, which Spotline's pipeline stages compute only for "
            f"sequences that fit in it; use --seq-len {window} or less"
        )


def is_tied(hf_config: transformers.PretrainedConfig) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


# ---------------------------------------------------------------------------------------
# Configs


def load_hf_config(
    spec: str, overrides: Mapping[str, Any] | None = None
) -> transformers.PretrainedConfig:
    """Return the HF config for a preset name or a directory written by ``save_pretrained``.

    Accepts the families (:func:`is_family`) and any other decoder-only causal LM (which
    trains whole, with one stage). Selects the SDPA attention implementation for the
    families: a transformers 5.x block built directly from a config otherwise runs without
    a causal mask. ``overrides`` sets existing config attributes (e.g. dropout
    probabilities to 0.0); an unknown one is a UserError.
    """
    import transformers

    presets = ", ".join(PRESETS)
    if spec in PRESETS:
        fields = dict(PRESETS[spec])
        model_type = fields.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **fields)
    elif os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise UserError(
                f"model directory {spec!r} has no config.json; "
                "pass a directory written by save_pretrained or one of the presets " + presets
            )
        try:
            config = transformers.AutoConfig.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            first_line = (
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            )
            raise UserError(
                f"model directory {spec!r}: config.json could not be read ({first_line}); "
                "rewrite it with save_pretrained"
            ) from exc
    else:
        raise UserError(
            f"model {spec!r}: no such preset or directory; use one of {presets} "
            "or a directory written by save_pretrained"
        )
    _check_causal_lm(config)  # an unsupported model fails here, before anything is built
    for name, value in (overrides or {}).items():
        if name.startswith("_") or not hasattr(config, name):
            raise UserError(
                f"model override {name!r}: {type(config).__name__} has no such attribute; "
                "check the spelling against the model's config.json"
            )
        setattr(config, name, value)
    if is_family(config):
        # Only the families' blocks run outside their model; a whole model builds its own
        # mask with whatever attention transformers picks for it (SDPA where it has one).
        config._attn_implementation = "sdpa"
    return config


def num_blocks(hf_config: transformers.PretrainedConfig) -> int:
    """Number of transformer blocks (pipeline layers that carry the compute)."""
    return int(hf_config.num_hidden_layers)


def preset_blocks(name: str) -> int | None:
    """The transformer blocks of preset ``name`` (None: not a preset), known without
    transformers: what the config's own checks (``spotline.config``) can say of the model."""
    fields = PRESETS.get(name)
    if fields is None:
        return None
    return int(fields.get("n_layer", fields.get("num_hidden_layers", 0)))


# ---------------------------------------------------------------------------------------
# Layout: which pipeline layer holds which HF submodule


@dataclass(frozen=True)
class LayerSlot:
    """One pipeline-state prefix and the HF state prefix it maps to."""

    pipe_prefix: str
    hf_prefix: str

    @property
    def layer(self) -> int:
        """The pipeline layer (global index) the slot belongs to."""
        return int(self.pipe_prefix.split(".", 1)[0])


# The attribute of WholeModelPipe that holds the HF model: its state names' prefix.
WHOLE_PREFIX = "0.model."


def _layout(hf_config: transformers.PretrainedConfig) -> tuple[int, list[LayerSlot]]:
    """Number of pipeline layers and the name prefixes of every parameterised part."""
    if not is_family(hf_config):
        return 1, [LayerSlot(WHOLE_PREFIX, "")]
    arch = arch_of(hf_config)
    slots: list[LayerSlot] = []
    idx = 0
    slots.append(LayerSlot(f"{idx}.embedding.", f"{arch.tok_embed}."))
    idx += 1
    if arch.pos_embed or arch.embed_dropout:
        if arch.pos_embed:
            slots.append(LayerSlot(f"{idx}.wpe.", f"{arch.pos_embed}."))
        idx += 1
    for block_idx in range(num_blocks(hf_config)):
        slots.append(LayerSlot(f"{idx}.block.", f"{arch.blocks}.{block_idx}."))
        idx += 1
    slots.append(LayerSlot(f"{idx}.norm.", f"{arch.final_norm}."))
    idx += 1
    head = "embedding" if is_tied(hf_config) else "head"
    slots.append(LayerSlot(f"{idx}.{head}.", f"{arch.lm_head}."))
    idx += 1
    return idx, slots


def num_layers(hf_config: transformers.PretrainedConfig) -> int:
    """Number of pipeline layers (specs) ``spotline.models.layers.build_layer_specs`` returns."""
    return _layout(hf_config)[0]


def layer_slots(hf_config: transformers.PretrainedConfig) -> list[LayerSlot]:
    """The name prefixes of every parameterised part, pipeline and HF."""
    return _layout(hf_config)[1]


def block_weights(hf_config: transformers.PretrainedConfig) -> list[int]:
    """Each pipeline layer's weight in the split into stages: 1 a transformer block, else 0
    (a whole model: its one layer)."""
    if not is_family(hf_config):
        return [1]
    weights = [0] * num_layers(hf_config)
    for slot in layer_slots(hf_config):
        if slot.pipe_prefix.endswith(".block."):
            weights[slot.layer] = 1
    return weights


def layer_parameters(hf_config: transformers.PretrainedConfig) -> list[tuple[int, int]]:
    """Parameter elements and tensors of each pipeline layer (a tied head's copy of the
    embedding counted on its own layer, as the pipeline holds it), from the Hugging Face
    model built on the meta device: no memory, no initialisation, any model type."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    counts = [(0, 0)] * num_layers(hf_config)
    slots = layer_slots(hf_config)
    # Tied weights appear once in named_parameters; the pipeline's copy is on its own layer.
    for hf_name, param in model.named_parameters(remove_duplicate=False):
        slot = next(s for s in slots if hf_name.startswith(s.hf_prefix))
        elements, tensors = counts[slot.layer]
        counts[slot.layer] = (elements + param.numel(), tensors + 1)
    return counts


def balanced_parts(weights: Sequence[int], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``weights`` whose sums differ least
    (largest minus smallest), ties going to the later split: the partition DeepSpeed's
    ``partition_balanced`` gives (tests/test_memory_estimate.py compares the two), without
    DeepSpeed. ``[0, ..., len(weights)]``."""
    n = len(weights)
    if n <= num_parts:
        return [min(p, n) for p in range(num_parts + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[i][j]: (spread, largest, smallest, last split) of the first i items in j parts.
    best: list[list[tuple[int, int, int, int] | None]] = [
        [None] * (num_parts + 1) for _ in range(n + 1)
    ]
    best[0][0] = (0, 0, 0, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                before = best[k][j - 1]
                if before is None:
                    continue
                part = prefix[i] - prefix[k]
                largest = max(before[1], part)
                smallest = part if k == 0 else min(before[2], part)
                spread = largest - smallest
                current = best[i][j]
                if current is None or spread <= current[0]:
                    best[i][j] = (spread, largest, smallest, k)
    parts = [n]
    for j in range(num_parts, 0, -1):
        entry = best[parts[-1]][j]
        assert entry is not None
        parts.append(entry[3])
    return parts[::-1]


def logical_parts(hf_config: transformers.PretrainedConfig, num_stages: int) -> list[int]:
    """Layer boundaries of ``num_stages`` logical stages: the transformer blocks spread evenly.

    The same computation as DeepSpeed's ``type:`` partition method, done without a process
    group (or DeepSpeed), so every process, the planner and the memory estimate agree on
    which layers form logical stage s. A whole model is one stage of one layer.
    """
    check_stages(hf_config, num_stages)
    return balanced_parts(block_weights(hf_config), num_stages)
