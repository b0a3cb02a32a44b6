"""Hugging Face causal LMs as DeepSpeed pipeline layers.

Turns a transformers GPT-style causal LM (GPT-2, Llama, GPT-NeoX, Qwen2, Mistral, Phi-3,
Gemma: ``model_config``'s families) into the flat list of
``LayerSpec`` that ``deepspeed.pipe.PipelineModule`` partitions over stages (never a
``TiedLayerSpec``: see below), and maps state between the pipeline's names and the Hugging
Face model's names.

Any other decoder-only causal LM (``model_config.is_family`` false: OPT, Phi-2, ...) is
one pipeline layer, :class:`WholeModelPipe`, the whole HF model (token ids ->
logits), and trains with one stage only (``model_config.check_stages``): data parallelism
over logical workers. Its state names are ``"0.model.<HF state name>"``; a tie (the LM head
and the input embedding) stays one shared parameter inside the module, whose gradients
autograd adds per micro-batch the same way in every placement (one stage, one layer), and
HF's alias of it counts once (:func:`drop_tied_aliases`).

Layer layout (global layer indices, the same whatever the partition)::

    0          token embedding          LayerSpec
    1          position embedding +     only for architectures that have either
               embedding dropout        (GPT-2: wpe + drop; GPT-NeoX: emb_dropout)
    k .. k+B-1 TransformerBlockPipe     one per transformer block, wrapping the real
                                        transformers block class (GPT2Block, ...)
    k+B        final norm
    k+B+1      LM head                  TiedLMHeadPipe (its own copy of the embedding
                                        weight) when the config ties word embeddings,
                                        else an untied Linear

Only one tensor, the hidden states, crosses a stage boundary: rotary embeddings are
recomputed inside each block wrapper and the causal mask comes from SDPA's ``is_causal``.

State-dict names on the pipeline side are what ``PipelineModule.state_dict()`` yields,
merged over stages: ``"<global_layer_idx>.<param path>"``, the same whatever the partition.

Tied embeddings are two parameters kept equal, never one shared parameter. DeepSpeed's
``TiedLayerSpec`` shares one module when the first and the last layer sit on the same
stage, and then autograd adds the embedding's and the head's gradient inside every
micro-batch's backward, while across stages they accumulate separately and are added once
(``ReduceTiedGrads``): the bits would change with the number of stages. Here the LM head
always holds its own copy (``TiedLMHeadPipe.tied_to`` names the original) and Spotline's
engine adds the two accumulated gradients once per step in every placement. In Hugging
Face names the copy is ``lm_head.weight``, the alias of the input embedding.

Initial weights never depend on the partition: the full HF model is built once (seeded,
or loaded from a directory) and every layer deep-copies its part from it, so a pipeline
with any number of stages starts from exactly :func:`reference_model`'s weights.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
import transformers
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import Tensor, nn

from spotline.errors import UserError
from spotline.models.activation_recompute import recomputing_checkpoint
from spotline.models.model_config import PRESETS as PRESETS  # re-exported: callers say models.*
from spotline.models.model_config import arch_of, check_stages, is_tied, layer_slots
from spotline.models.model_config import is_family as is_family
from spotline.models.model_config import load_hf_config as load_hf_config
from spotline.models.model_config import logical_parts as logical_parts
from spotline.models.model_config import num_blocks as num_blocks
from spotline.models.model_config import num_layers as num_layers

# Class name the "type:" partition method counts: only transformer blocks weigh anything.
_BLOCK_CLASS_NAME = "TransformerBlockPipe"


# ---------------------------------------------------------------------------------------
# The full HF model the layers copy their weights from


def _build_hf_model(
    hf_config: transformers.PretrainedConfig, seed: int, pretrained_dir: str | None
) -> transformers.PreTrainedModel:
    """Build the full HF model: seeded random init, or the weights in ``pretrained_dir``.

    Runs under a forked RNG so that building leaves the caller's global RNG state (which
    drives dropout) untouched, whatever the number of layers built.
    """
    config = copy.deepcopy(hf_config)
    family = is_family(config)
    if family:
        config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if pretrained_dir is None:
            model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        else:
            if not os.path.isdir(pretrained_dir):
                raise UserError(
                    f"pretrained weights {pretrained_dir!r}: no such directory; "
                    "pass a directory written by save_pretrained"
                )
            try:
                # With output_loading_info it returns (model, info); the stubs say model only.
                loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
                    pretrained_dir,
                    config=config,
                    local_files_only=True,
                    # A whole model keeps transformers' own choice (load_hf_config's).
                    attn_implementation="sdpa" if family else None,
                    output_loading_info=True,
                )
            except OSError as exc:
                raise UserError(
                    f"pretrained weights {pretrained_dir!r}: no model weights found; "
                    "pass a directory written by save_pretrained (with model.safetensors)"
                ) from exc
            # transformers fills missing weights with random ones and only logs a warning.
            model, info = loaded
            missing = sorted(info.get("missing_keys", ())) + sorted(info.get("mismatched_keys", ()))
            if missing:
                raise UserError(
                    f"pretrained weights {pretrained_dir!r} lack {len(missing)} of the model's "
                    f"tensors (first: {missing[0]}); pass a directory written by save_pretrained "
                    "for this exact model"
                )
    model.float()  # a directory saved in bf16 loads as bf16; the pipeline runs fp32
    model.train()
    return cast(transformers.PreTrainedModel, model)


class WeightSource:
    """The full HF model, built on first use and shared by every layer spec of one pipeline.

    Layers copy their weights from it, so the weights do not depend on which layers a stage
    builds. ``release()`` drops the model once the pipeline is built (PipelineModule keeps
    its specs, and with them this object).
    """

    def __init__(
        self, hf_config: transformers.PretrainedConfig, seed: int, pretrained_dir: str | None
    ) -> None:
        self.hf_config = hf_config
        self.seed = seed
        self.pretrained_dir = pretrained_dir
        self._model: transformers.PreTrainedModel | None = None

    def __repr__(self) -> str:  # LayerSpec reprs print their arguments
        return f"WeightSource({self.hf_config.model_type}, seed={self.seed}, pretrained_dir={self.pretrained_dir!r})"

    @property
    def model(self) -> transformers.PreTrainedModel:
        if self._model is None:
            self._model = _build_hf_model(self.hf_config, self.seed, self.pretrained_dir)
        return self._model

    def copy_of(self, path: str) -> nn.Module:
        """A deep copy of the HF submodule at ``path`` (own parameters, same values)."""
        return copy.deepcopy(self.model.get_submodule(path))

    def release(self) -> None:
        self._model = None


# ---------------------------------------------------------------------------------------
# Pipeline layers


class TokenEmbeddingPipe(nn.Module):
    """Token ids -> embeddings (layer 0); never the LM head.

    A tied model's head is :class:`TiedLMHeadPipe`, which holds its own copy of this weight.
    """

    def __init__(self, source: WeightSource) -> None:
        super().__init__()
        self.embedding = source.copy_of(arch_of(source.hf_config).tok_embed)

    def forward(self, input_ids: Tensor) -> Tensor:
        return cast(Tensor, self.embedding(input_ids))


class TiedLMHeadPipe(nn.Module):
    """LM head of a tied model: its own copy of the token embedding, used as HF's lm_head.

    ``tied_to`` tells the engine that ``embedding.weight`` is a copy of layer 0's
    ``embedding.weight``: their gradients are added once per step and the two stay equal.
    """

    tied_to = {"embedding.weight": (0, "embedding.weight")}

    def __init__(self, source: WeightSource) -> None:
        super().__init__()
        self.embedding = source.copy_of(arch_of(source.hf_config).tok_embed)

    def forward(self, hidden_states: Tensor) -> Tensor:
        # The same op as HF's bias-free nn.Linear lm_head.
        return F.linear(hidden_states, cast(Tensor, self.embedding.weight))


class EmbeddingPostPipe(nn.Module):
    """Adds learned position embeddings (if any) and applies the embedding dropout (if any)."""

    def __init__(self, source: WeightSource) -> None:
        super().__init__()
        arch = arch_of(source.hf_config)
        self.wpe = source.copy_of(arch.pos_embed) if arch.pos_embed else None
        self.drop = source.copy_of(arch.embed_dropout) if arch.embed_dropout else None

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.wpe is not None:
            position_ids = torch.arange(
                hidden_states.shape[1], device=hidden_states.device
            ).unsqueeze(0)
            # Same operand order as GPT2Model: inputs_embeds + position_embeds.
            hidden_states = hidden_states + self.wpe(position_ids)
        if self.drop is not None:
            hidden_states = self.drop(hidden_states)
        return hidden_states


class TransformerBlockPipe(nn.Module):
    """One real transformers block (GPT2Block, LlamaDecoderLayer, GPTNeoXLayer).

    Takes and returns only the hidden states. The causal mask is SDPA's ``is_causal``
    (attention_mask None, exactly what the HF model passes with no padding mask); rotary
    position embeddings are computed here from a copy of the model's rotary module, as the
    HF model computes them once per forward, so nothing else crosses a stage boundary.
    """

    def __init__(self, source: WeightSource, block_idx: int) -> None:
        super().__init__()
        arch = arch_of(source.hf_config)
        self.block = source.copy_of(f"{arch.blocks}.{block_idx}")
        # Non-persistent buffers only: adds nothing to the state dict.
        self.rotary = source.copy_of(arch.rotary) if arch.rotary else None

    def forward(self, hidden_states: Tensor) -> Tensor:
        seq_len = hidden_states.shape[1]
        position_ids = torch.arange(seq_len, device=hidden_states.device).unsqueeze(0)
        # HF passes position_ids to every block; only rotary blocks use them.
        kwargs: dict[str, Any] = {"position_ids": position_ids}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden_states, position_ids=position_ids)
        out = self.block(hidden_states, attention_mask=None, **kwargs)
        # transformers 5.x blocks return the hidden states, 4.x a tuple starting with them.
        if isinstance(out, tuple):
            out = out[0]
        return cast(Tensor, out)


class FinalNormPipe(nn.Module):
    """The final layer norm (GPT-2 ln_f, Llama RMSNorm, NeoX final_layer_norm)."""

    def __init__(self, source: WeightSource) -> None:
        super().__init__()
        self.norm = source.copy_of(arch_of(source.hf_config).final_norm)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return cast(Tensor, self.norm(hidden_states))


class LMHeadPipe(nn.Module):
    """Untied LM head (a bias-free Linear)."""

    def __init__(self, source: WeightSource) -> None:
        super().__init__()
        self.head = source.copy_of(arch_of(source.hf_config).lm_head)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return cast(Tensor, self.head(hidden_states))


class WholeModelPipe(nn.Module):
    """A causal LM Spotline does not split, whole, as the pipeline's only layer: token ids
    -> logits. Its tied weights stay shared inside it (see the module docstring)."""

    def __init__(self, source: WeightSource) -> None:
        super().__init__()
        self.model = source.copy_of("")  # "": the model itself (copied, ties and all)

    def forward(self, input_ids: Tensor) -> Tensor:
        return cast(Tensor, self.model(input_ids=input_ids).logits)


# ---------------------------------------------------------------------------------------
# Layout: which global layer holds which HF submodule


def tied_copies(hf_config: transformers.PretrainedConfig) -> dict[str, str]:
    """Pipeline name of each tied copy -> the name of the parameter it is a copy of.

    ``{"<last>.embedding.weight": "0.embedding.weight"}`` for a tied model of a family,
    ``{}`` otherwise (a whole model's tie is one shared parameter, not a copy). A copy is
    counted once (as its original) in norms and hashes.
    """
    if not is_family(hf_config) or not is_tied(hf_config):
        return {}
    return {f"{num_layers(hf_config) - 1}.embedding.weight": "0.embedding.weight"}


def drop_tied_aliases(
    hf_state: Mapping[str, Tensor], hf_config: transformers.PretrainedConfig
) -> dict[str, Tensor]:
    """``hf_state`` without HF's tied alias (``lm_head.weight``), which must equal the embedding.

    What remains has the names of the HF model's ``named_parameters()``: each tied weight
    once, so hashes and norms count it once. For a whole model (not a family) every alias
    transformers ties, and any buffer, is left out.
    """
    if not is_family(hf_config):
        return _whole_model_parameters(hf_state, hf_config)
    arch = arch_of(hf_config)
    alias = f"{arch.lm_head}.weight"
    out = dict(hf_state)
    if is_tied(hf_config) and alias in out:
        tensor = out.pop(alias)
        embedding = out.get(f"{arch.tok_embed}.weight")
        if embedding is not None and not torch.equal(embedding, tensor):
            raise ValueError(
                f"{alias} differs from {arch.tok_embed}.weight in a model with tied embeddings"
            )
    return out


def _whole_model_parameters(
    hf_state: Mapping[str, Tensor], hf_config: transformers.PretrainedConfig
) -> dict[str, Tensor]:
    """:func:`drop_tied_aliases` for a whole model: its ``named_parameters()`` entries of
    ``hf_state``, after checking that each tied alias given equals its original."""
    names = _hf_parameter_names(hf_config.model_type, hf_config.to_json_string())
    for alias, original in names.aliases:
        if alias in hf_state and original in hf_state:
            if not torch.equal(hf_state[alias], hf_state[original]):
                raise ValueError(f"{alias} differs from {original}, to which the model ties it")
    return {name: tensor for name, tensor in hf_state.items() if name in names.parameters}


@dataclass(frozen=True)
class _HFParameterNames:
    """A model's ``named_parameters()`` names and its tied aliases (alias, original)."""

    parameters: frozenset[str]
    aliases: tuple[tuple[str, str], ...]


@functools.lru_cache(maxsize=8)
def _hf_parameter_names(model_type: str, config_json: str) -> _HFParameterNames:
    """The names of the model a config describes, from a weightless (meta) build of it.

    Keyed by the config's model type and JSON: configs are mutable and unhashable, and the
    reference calls this every step."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type].from_dict(json.loads(config_json))
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    first: dict[int, str] = {}
    aliases: list[tuple[str, str]] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.append((name, first[id(param)]))
        else:
            first[id(param)] = name  # named_parameters() keeps this first name, as here
    return _HFParameterNames(frozenset(first.values()), tuple(aliases))


def _swap_prefix(name: str, pairs: list[tuple[str, str]], what: str) -> str:
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"{what} state name {name!r} belongs to no layer of this model")


def layer_names_to_hf(
    pipe_state: Mapping[str, Tensor], hf_config: transformers.PretrainedConfig
) -> dict[str, Tensor]:
    """Pipeline state-dict names -> HF state-dict names (same tensors, not copies).

    Works on any subset (e.g. one stage's state). The tied embedding maps to the HF input
    embedding only; HF's tied alias (``lm_head.weight``) is not produced. Inverse of
    :func:`hf_to_layer_names`.
    """
    pairs = [(slot.pipe_prefix, slot.hf_prefix) for slot in layer_slots(hf_config)]
    return {_swap_prefix(name, pairs, "pipeline"): tensor for name, tensor in pipe_state.items()}


def hf_to_layer_names(
    hf_state: Mapping[str, Tensor], hf_config: transformers.PretrainedConfig
) -> dict[str, Tensor]:
    """HF state-dict names -> pipeline state-dict names (same tensors, not copies).

    For a tied model HF's alias ``lm_head.weight`` maps to the LM head's copy; when the
    alias is absent (``named_parameters()`` omits it) the copy is the input embedding. A
    whole model's names (with or without its aliases) just gain the ``0.model.`` prefix.
    Inverse of :func:`layer_names_to_hf`.
    """
    pairs = [(slot.hf_prefix, slot.pipe_prefix) for slot in layer_slots(hf_config)]
    drop_tied_aliases(hf_state, hf_config)  # checks that a given alias equals the embedding
    out = {_swap_prefix(name, pairs, "Hugging Face"): tensor for name, tensor in hf_state.items()}
    copies = tied_copies(hf_config)  # none for a whole model, whose aliases map as they are
    if not copies:
        return out
    embedding = hf_state.get(f"{arch_of(hf_config).tok_embed}.weight")
    for copy_name in copies:
        if embedding is not None and copy_name not in out:
            out[copy_name] = embedding
    return out


# ---------------------------------------------------------------------------------------
# Pipeline


def build_layer_specs(
    hf_config: transformers.PretrainedConfig, *, seed: int, pretrained_dir: str | None = None
) -> list[LayerSpec]:
    """The pipeline layers (see the module docstring for the layout).

    Weights come from one full HF model built from ``seed`` (or loaded from
    ``pretrained_dir``) on first use, so they equal :func:`reference_model`'s whatever the
    partition. Call ``release_weight_source(specs)`` once the PipelineModule is built.
    """
    source = WeightSource(hf_config, seed, pretrained_dir)
    if not is_family(hf_config):
        return [LayerSpec(WholeModelPipe, source)]
    specs: list[LayerSpec] = []
    specs.append(LayerSpec(TokenEmbeddingPipe, source))
    arch = arch_of(hf_config)
    if arch.pos_embed or arch.embed_dropout:
        specs.append(LayerSpec(EmbeddingPostPipe, source))
    for block_idx in range(num_blocks(hf_config)):
        specs.append(LayerSpec(TransformerBlockPipe, source, block_idx))
    specs.append(LayerSpec(FinalNormPipe, source))
    if is_tied(hf_config):
        specs.append(LayerSpec(TiedLMHeadPipe, source))
    else:
        specs.append(LayerSpec(LMHeadPipe, source))
    assert len(specs) == num_layers(hf_config)
    return specs


def release_weight_source(specs: list[LayerSpec]) -> None:
    """Drop the full HF model the specs built their layers from (frees its memory)."""
    for spec in specs:
        for arg in spec.module_args:
            if isinstance(arg, WeightSource):
                arg.release()


def partition_method(hf_config: transformers.PretrainedConfig) -> str:
    """DeepSpeed partition method that spreads the transformer blocks evenly over stages.

    Only TransformerBlockPipe layers weigh anything; the embedding goes with the first stage
    and the norm and head with the last. A whole model's one layer: ``uniform``.
    """
    return f"type:{_BLOCK_CLASS_NAME}" if is_family(hf_config) else "uniform"


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the positions whose label counts; ``labels`` are already
    shifted (no shift here).

    The PipelineModule's loss_fn and the reference tests' loss. Labels -100
    (``spotline.data.instructions.IGNORE_INDEX``: prompt and padding tokens) are skipped and the
    mean is over the others, as Hugging Face's causal LM loss takes it; text data has none,
    so its loss is the plain mean. A micro-batch with no counted label would be 0/0 (NaN):
    the instruction corpora never build a row without one (``InstructionCorpus`` asserts it).
    In fp32 (a no-op for fp32 logits): bf16 logits (autocast) would round the loss to 8 bits.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def physical_parts(logical: Sequence[int], groups: Sequence[Sequence[int]]) -> list[int]:
    """Layer boundaries when contiguous logical stages are merged into physical stages.

    ``groups[i]`` lists the logical stages physical stage ``i`` runs, e.g. ``[[0], [1, 2],
    [3]]`` after stage 2's owner is lost and its predecessor took it over.
    """
    flat = [stage for group in groups for stage in group]
    assert flat == list(range(len(logical) - 1)), f"groups {groups} must cover the stages in order"
    return [logical[group[0]] for group in groups] + [logical[-1]]


class PlacedPipelineModule(PipelineModule):  # type: ignore[misc]  # DeepSpeed is untyped
    """A PipelineModule whose stage boundaries are given rather than computed.

    Spotline merges logical stages into physical stages when workers are lost; the layer
    boundaries then come from the logical partition (:func:`logical_parts`), never from a
    fresh partitioning of the layers over fewer stages (which would move layers between
    logical stages).
    """

    def __init__(self, *args: Any, parts: Sequence[int], **kwargs: Any) -> None:
        # Set before PipelineModule.__init__, which partitions the layers.
        object.__setattr__(self, "_given_parts", [int(p) for p in parts])
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self.parts = list(self._given_parts)
        assert len(self.parts) == self.num_stages + 1, (self.parts, self.num_stages)
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def build_pipeline_module(
    hf_config: transformers.PretrainedConfig,
    num_stages: int,
    *,
    seed: int,
    pretrained_dir: str | None = None,
    activation_checkpoint_interval: int = 0,
    topology: Any = None,
    parts: Sequence[int] | None = None,
    layer_specs: list[LayerSpec] | None = None,
) -> PipelineModule:
    """The model as a DeepSpeed PipelineModule over ``num_stages`` stages.

    Needs torch.distributed (deepspeed.comm) initialised. With ``topology`` its pipe
    dimension must equal ``num_stages``. ``parts`` gives the layer boundaries (default: the
    logical partition into ``num_stages`` stages). Activation checkpointing applies to the
    transformer blocks only (the reentrant checkpoint cannot take the integer token ids), so
    a whole model (no family; one layer taking the token ids) is never checkpointed.
    ``layer_specs``: the layers, one for one those of :func:`build_layer_specs` (default).
    """
    if num_stages < 1:
        raise UserError(f"--stages {num_stages}: use at least 1 stage")
    check_stages(hf_config, num_stages)
    if topology is not None and topology.get_dim("pipe") != num_stages:
        raise ValueError(
            f"topology has {topology.get_dim('pipe')} pipeline stages, num_stages is {num_stages}"
        )
    specs = (
        layer_specs
        if layer_specs is not None
        else build_layer_specs(hf_config, seed=seed, pretrained_dir=pretrained_dir)
    )
    assert len(specs) == num_layers(hf_config), (len(specs), num_layers(hf_config))
    module = PlacedPipelineModule(
        layers=specs,
        num_stages=None if topology is not None else num_stages,
        topology=topology,
        loss_fn=causal_lm_loss,
        partition_method=partition_method(hf_config),
        activation_checkpoint_interval=activation_checkpoint_interval,
        activation_checkpoint_func=recomputing_checkpoint,
        checkpointable_layers=[_BLOCK_CLASS_NAME],
        parts=parts if parts is not None else logical_parts(hf_config, num_stages),
    )
    release_weight_source(specs)
    return module


def reference_model(
    hf_config: transformers.PretrainedConfig, seed: int, pretrained_dir: str | None = None
) -> transformers.PreTrainedModel:
    """The plain HF model with exactly the pipeline's initial weights (for reference tests).

    Same ``seed`` (and ``pretrained_dir``) -> same weights as :func:`build_layer_specs`.
    Returned in train mode, like freshly built pipeline layers.
    """
    return _build_hf_model(hf_config, seed, pretrained_dir)


def save_pretrained(
    pipe_state: Mapping[str, Tensor],
    hf_config: transformers.PretrainedConfig,
    out_dir: str,
    *,
    also: Callable[[str], None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write the full pipeline state as an HF model directory (``from_pretrained`` loads it),
    its weights in ``dtype``.

    ``pipe_state`` is the pipeline's state dict merged over all stages. ``also`` writes more
    files into the directory (a tokenizer, a note) before it is complete. Written to a
    temporary directory next to ``out_dir``, flushed to disk, and renamed into place; an
    existing ``out_dir`` is replaced.
    """
    # The tied copy must equal the embedding (drop_tied_aliases checks), then counts once.
    hf_state = drop_tied_aliases(layer_names_to_hf(pipe_state, hf_config), hf_config)
    config = copy.deepcopy(hf_config)
    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    expected = set(hf_to_layer_names(model.state_dict(), hf_config))
    given = set(pipe_state)
    if expected != given:
        missing = sorted(expected - given)
        extra = sorted(given - expected)
        raise ValueError(
            f"pipeline state does not cover the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    with torch.no_grad():
        params = dict(model.named_parameters())  # tied aliases appear once
        for name, tensor in hf_state.items():
            params[name].copy_(tensor.detach().to(params[name].device))
    model.to(dtype)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        model.save_pretrained(tmp_dir)
        if also is not None:
            also(tmp_dir)
        _fsync_tree(tmp_dir)
        if os.path.exists(out_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old_dir, "d"))
            os.rename(tmp_dir, out_dir)
            shutil.rmtree(old_dir)
        else:
            os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _fsync_tree(directory: str) -> None:
    """Flush every file under ``directory``, and the directory, to disk: a rename that
    publishes it must not outrun its contents after a power loss."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
