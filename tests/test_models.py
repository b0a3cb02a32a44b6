"""spotline.models.layers: HF causal LMs as DeepSpeed pipeline layers.

Single-process tests against a 1-process gloo group; exactness is checked with torch.equal.
The one multi-process test (2 stages on 2 processes) is marked slow.
"""

from __future__ import annotations

import os
import socket
import types

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from conftest import write_tiny_opt  # noqa: E402
from deepspeed.runtime.pipe.module import PipelineModule  # noqa: E402

from spotline.errors import UserError  # noqa: E402
from spotline.models import layers as models  # noqa: E402

NO_DROPOUT = {
    "gpt2-tiny": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama-tiny": {"attention_dropout": 0.0},
    "neox-tiny": {"attention_dropout": 0.0, "hidden_dropout": 0.0},
    "qwen2-tiny": {"attention_dropout": 0.0},
    "mistral-tiny": {"attention_dropout": 0.0},
    "phi3-tiny": {"attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    "gemma-tiny": {"attention_dropout": 0.0},
}
# Every family Spotline splits into stages, each as a tiny preset.
FAMILIES = list(NO_DROPOUT)
SEED = 1234


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def dist_world():
    """A 1-process gloo group (PipelineModule needs torch.distributed)."""
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
        # Skips a ~55 s JIT build used only by inference all-reduce.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.comm.init_distributed(dist_backend="gloo")
        created = True
    assert dist.get_world_size() == 1
    torch.set_num_threads(1)
    yield
    if created:
        deepspeed.comm.destroy_process_group()


def _tokens(seq_len: int = 19, batch: int = 3, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 260, (batch, seq_len), generator=gen)


def _perturb(params, seed: int) -> None:
    """Move weights away from the seeded init, so a test cannot pass by re-seeding."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


# ---------------------------------------------------------------------------------------
# Configs


@pytest.mark.parametrize("name", sorted(models.PRESETS))
def test_presets_build(name):
    cfg = models.load_hf_config(name)
    assert cfg._attn_implementation == "sdpa"
    # The byte-level corpus's 260 token ids fit (the real sizes have their real vocabularies).
    assert cfg.vocab_size == 260 or name.endswith("-small")
    assert 0 <= cfg.bos_token_id < cfg.vocab_size and 0 <= cfg.eos_token_id < cfg.vocab_size
    assert models.num_blocks(cfg) == cfg.num_hidden_layers >= 4
    # The layout's tie flag agrees with what transformers actually builds.
    ref = models.reference_model(cfg, SEED)
    tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    assert tied == bool(models.tied_copies(cfg))
    specs = models.build_layer_specs(cfg, seed=SEED)
    assert len(specs) == models.num_layers(cfg)


def test_preset_shapes():
    gpt2 = models.load_hf_config("gpt2-tiny")
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.n_head, gpt2.n_positions) == (4, 64, 4, 128)
    assert gpt2.resid_pdrop == gpt2.embd_pdrop == gpt2.attn_pdrop == 0.1
    assert gpt2.tie_word_embeddings
    llama = models.load_hf_config("llama-tiny")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads) == (64, 4, 4)
    assert (llama.num_key_value_heads, llama.intermediate_size) == (2, 128)
    assert llama.max_position_embeddings == 128 and llama.tie_word_embeddings
    assert not models.load_hf_config("neox-tiny").tie_word_embeddings


def test_the_real_size_presets_have_the_published_shape():
    def parameters(name):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(models.load_hf_config(name))
        return sum(p.numel() for p in model.parameters())

    gpt2 = models.load_hf_config("gpt2-small")
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.n_head, gpt2.n_positions) == (12, 768, 12, 1024)
    assert gpt2.vocab_size == 50257 and gpt2.tie_word_embeddings
    assert parameters("gpt2-small") == 124_439_808  # Hugging Face's "gpt2" checkpoint's count
    llama = models.load_hf_config("llama-small")
    assert (llama.num_attention_heads, llama.num_key_value_heads) == (12, 4)  # GQA
    assert 0.99 < parameters("llama-small") / parameters("gpt2-small") < 1.01


def test_overrides_set_attributes():
    cfg = models.load_hf_config("gpt2-tiny", NO_DROPOUT["gpt2-tiny"])
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.0
    # Presets are not mutated by overrides.
    assert models.load_hf_config("gpt2-tiny").resid_pdrop == 0.1


def _assert_one_line_user_error(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_unknown_preset_is_user_error():
    with pytest.raises(UserError) as excinfo:
        models.load_hf_config("gpt9-huge")
    _assert_one_line_user_error(excinfo, "gpt9-huge", "gpt2-tiny", "llama-tiny", "save_pretrained")


def test_missing_dir_is_user_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(UserError) as excinfo:
        models.load_hf_config(missing)
    _assert_one_line_user_error(excinfo, missing)


def test_dir_without_config_is_user_error(tmp_path):
    with pytest.raises(UserError) as excinfo:
        models.load_hf_config(str(tmp_path))
    _assert_one_line_user_error(excinfo, "config.json", str(tmp_path))


def test_unknown_override_is_user_error():
    with pytest.raises(UserError) as excinfo:
        models.load_hf_config("gpt2-tiny", {"resid_dropout_typo": 0.0})
    _assert_one_line_user_error(excinfo, "resid_dropout_typo")


def test_unsupported_architecture_is_user_error(tmp_path):
    transformers.BertConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(UserError) as excinfo:
        models.load_hf_config(str(tmp_path))
    _assert_one_line_user_error(excinfo, "bert", "gpt2")


def test_pretrained_dir_without_weights_is_user_error(tmp_path):
    cfg = models.load_hf_config("gpt2-tiny")
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UserError) as excinfo:
        models.reference_model(cfg, SEED, pretrained_dir=str(tmp_path))
    _assert_one_line_user_error(excinfo, str(tmp_path))


def test_pretrained_dir_missing_a_tensor_is_user_error(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = models.load_hf_config("gpt2-tiny")
    models.reference_model(cfg, SEED).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError) as excinfo:
        models.reference_model(cfg, SEED, pretrained_dir=str(tmp_path))
    _assert_one_line_user_error(excinfo, "transformer.h.1.mlp.c_fc.weight")


# ---------------------------------------------------------------------------------------
# The pipeline equals the HF model


@pytest.mark.parametrize("name", FAMILIES)
def test_one_stage_pipeline_equals_reference(dist_world, name):
    cfg = models.load_hf_config(name, NO_DROPOUT[name])
    module = models.build_pipeline_module(cfg, 1, seed=SEED)
    ref = models.reference_model(cfg, SEED)
    tokens = _tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits = module(inputs)
    ref_logits = ref(inputs).logits
    assert torch.equal(logits, ref_logits)

    # Loss and gradients too. A tied model's head holds its own copy of the embedding:
    # the two gradients added once equal HF's gradient of the shared weight (one
    # micro-batch: autograd adds the same two terms).
    loss = models.causal_lm_loss(logits, labels)
    ref_loss = models.causal_lm_loss(ref_logits, labels)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    ref_grads = models.hf_to_layer_names({n: p.grad for n, p in ref.named_parameters()}, cfg)
    grads = {n: p.grad for n, p in module.named_parameters()}
    for copy_name, original in models.tied_copies(cfg).items():
        grads[original] = grads[original] + grads[copy_name]
        grads[copy_name] = grads[original]
    assert set(grads) == set(ref_grads)
    for n, grad in grads.items():
        assert torch.equal(grad, ref_grads[n]), n


def test_dropout_matches_reference_for_same_rng(dist_world):
    """With dropout on, the pipeline draws random numbers in the HF model's order."""
    cfg = models.load_hf_config("gpt2-tiny")
    module = models.build_pipeline_module(cfg, 1, seed=SEED)
    ref = models.reference_model(cfg, SEED)
    inputs = _tokens()
    torch.manual_seed(5)
    logits = module(inputs)
    torch.manual_seed(5)
    assert torch.equal(logits, ref(inputs).logits)
    torch.manual_seed(6)
    assert not torch.equal(logits, ref(inputs).logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_activation_checkpointing_is_bitwise_neutral_in_fp32_and_bf16(dist_world, name):
    """The recomputation in the backward pass equals the first forward, dropout (drawn
    again from the same generator state) and bf16 autocast (restored for the recomputation)
    included; and bf16 is really in force (its loss differs from fp32's)."""
    cfg = models.load_hf_config(name)
    tokens = _tokens()
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        results = []
        for interval in (0, 1):
            module = models.build_pipeline_module(
                cfg, 1, seed=SEED, activation_checkpoint_interval=interval
            )
            # The engine does this before its first forward; without it forward() skips
            # every layer.
            module._precompute_checkpointable_values()
            torch.manual_seed(5)
            # As DeepSpeedEngine.forward runs the layers (torch_autocast) and PipelineEngine
            # takes the loss, outside it.
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                logits = module(tokens[:, :-1])
            loss = models.causal_lm_loss(logits, tokens[:, 1:])
            loss.backward()
            grads = {n: p.grad for n, p in module.named_parameters()}
            assert all(g.dtype == torch.float32 for g in grads.values())  # fp32 gradients
            results.append((loss.detach(), grads))
        (loss_a, grads_a), (loss_b, grads_b) = results
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
        losses[dtype] = loss_a
    assert losses[torch.bfloat16].dtype == torch.float32
    assert not torch.equal(losses[torch.float32], losses[torch.bfloat16])


def test_seed_decides_weights(dist_world):
    cfg = models.load_hf_config("gpt2-tiny")
    a = models.build_pipeline_module(cfg, 1, seed=1).state_dict()
    b = models.build_pipeline_module(cfg, 1, seed=1).state_dict()
    c = models.build_pipeline_module(cfg, 1, seed=2).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["2.block.attn.c_attn.weight"], c["2.block.attn.c_attn.weight"])


def test_building_leaves_global_rng_alone(dist_world):
    cfg = models.load_hf_config("gpt2-tiny")
    torch.manual_seed(9)
    expected = torch.rand(4)
    torch.manual_seed(9)
    models.build_pipeline_module(cfg, 1, seed=SEED)
    models.reference_model(cfg, SEED)
    assert torch.equal(torch.rand(4), expected)


def test_more_stages_than_blocks_is_user_error(dist_world):
    cfg = models.load_hf_config("gpt2-tiny")
    with pytest.raises(UserError) as excinfo:
        models.build_pipeline_module(cfg, 8, seed=SEED)
    _assert_one_line_user_error(excinfo, "--stages 8", "4 transformer blocks", "at most 4")


def test_module_class_is_not_treated_as_gpt_pipe(dist_world):
    module = models.build_pipeline_module(models.load_hf_config("llama-tiny"), 1, seed=SEED)
    assert type(module).__name__ not in ("GPT2ModelPipe", "GPTModelPipe")


def _deepspeed_parts(specs, method: str, num_stages: int) -> list[int]:
    """Run DeepSpeed's own partitioner without processes (a stand-in topology)."""
    fake = PipelineModule.__new__(PipelineModule)
    fake.num_stages = num_stages
    fake._layer_specs = specs
    fake.global_rank = 1  # not 0: skips the printout
    fake.loss_fn = None
    fake._topo = types.SimpleNamespace(get_coord=lambda rank: types.SimpleNamespace(pipe=0))
    PipelineModule._partition_layers(fake, method=method)
    return [int(p) for p in fake.parts]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_partition_spreads_blocks_evenly(name, num_stages):
    cfg = models.load_hf_config(name)
    specs = models.build_layer_specs(cfg, seed=SEED)
    parts = _deepspeed_parts(specs, models.partition_method(cfg), num_stages)
    assert parts[0] == 0 and parts[-1] == len(specs) and len(parts) == num_stages + 1
    is_block = [spec.typename is models.TransformerBlockPipe for spec in specs]
    per_stage = [sum(is_block[parts[s] : parts[s + 1]]) for s in range(num_stages)]
    assert per_stage == [models.num_blocks(cfg) // num_stages] * num_stages
    # The embedding opens the first stage, the head closes the last.
    assert parts[1] > 0 and parts[-2] < len(specs)


# ---------------------------------------------------------------------------------------
# Names and HF directories


@pytest.mark.parametrize("name", FAMILIES)
def test_name_mapping_is_a_bijection(dist_world, name):
    cfg = models.load_hf_config(name)
    pipe_state = models.build_pipeline_module(cfg, 1, seed=SEED).state_dict()
    ref_state = models.reference_model(cfg, SEED).state_dict()

    hf_state = models.layer_names_to_hf(pipe_state, cfg)
    assert len(hf_state) == len(pipe_state)  # injective
    # Onto the HF state names (a tied head's copy is HF's alias lm_head.weight).
    assert set(hf_state) == set(ref_state)
    for n, tensor in hf_state.items():
        assert torch.equal(tensor, ref_state[n]), n

    back = models.hf_to_layer_names(hf_state, cfg)
    assert set(back) == set(pipe_state)
    assert all(back[n] is pipe_state[n] for n in pipe_state)
    # The full HF state (with the alias) maps onto the pipeline names too.
    assert set(models.hf_to_layer_names(ref_state, cfg)) == set(pipe_state)


def test_tied_weight_names(dist_world):
    cfg = models.load_hf_config("gpt2-tiny")
    last = models.num_layers(cfg) - 1
    assert models.tied_copies(cfg) == {f"{last}.embedding.weight": "0.embedding.weight"}
    hf = models.layer_names_to_hf(
        {"0.embedding.weight": torch.zeros(1), f"{last}.embedding.weight": torch.zeros(1)}, cfg
    )
    assert list(hf) == ["transformer.wte.weight", "lm_head.weight"]
    assert list(models.drop_tied_aliases(hf, cfg)) == ["transformer.wte.weight"]
    with pytest.raises(ValueError, match="differs"):
        models.drop_tied_aliases(
            {"transformer.wte.weight": torch.zeros(1), "lm_head.weight": torch.ones(1)}, cfg
        )
    assert models.tied_copies(models.load_hf_config("neox-tiny")) == {}


def test_unknown_names_are_rejected():
    cfg = models.load_hf_config("gpt2-tiny")
    with pytest.raises(ValueError):
        models.layer_names_to_hf({"99.block.ln_1.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError):
        models.hf_to_layer_names({"transformer.h.9.ln_1.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError):
        models.hf_to_layer_names(
            {"transformer.wte.weight": torch.zeros(2), "lm_head.weight": torch.ones(2)}, cfg
        )


@pytest.mark.parametrize("name", FAMILIES)
def test_save_pretrained_loads_in_transformers(dist_world, tmp_path, name):
    cfg = models.load_hf_config(name, NO_DROPOUT[name])
    module = models.build_pipeline_module(cfg, 1, seed=SEED)
    _perturb(module.parameters(), seed=3)
    # The engine keeps a tied head's copy equal to the embedding; do the same here.
    state = module.state_dict()
    with torch.no_grad():
        for copy_name, original in models.tied_copies(cfg).items():
            state[copy_name].copy_(state[original])
    out_dir = tmp_path / "export"
    models.save_pretrained(module.state_dict(), cfg, str(out_dir))
    # Writing again replaces the directory and leaves no temporary directories behind.
    models.save_pretrained(module.state_dict(), cfg, str(out_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir))
    loaded.eval()
    module.eval()
    inputs = _tokens()
    with torch.no_grad():
        assert torch.equal(loaded(inputs).logits, module(inputs))


def test_save_pretrained_rejects_partial_state(dist_world, tmp_path):
    cfg = models.load_hf_config("gpt2-tiny")
    state = models.build_pipeline_module(cfg, 1, seed=SEED).state_dict()
    del state["1.wpe.weight"]
    with pytest.raises(ValueError):
        models.save_pretrained(state, cfg, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_directory_loads_into_pipeline(dist_world, tmp_path, name):
    cfg = models.load_hf_config(name, NO_DROPOUT[name])
    hf_model = models.reference_model(cfg, seed=77)
    _perturb(hf_model.parameters(), seed=4)
    hf_model.save_pretrained(tmp_path)

    loaded_cfg = models.load_hf_config(str(tmp_path), NO_DROPOUT[name])
    # The seed must not matter when weights come from the directory.
    module = models.build_pipeline_module(loaded_cfg, 1, seed=SEED, pretrained_dir=str(tmp_path))
    inputs = _tokens()
    with torch.no_grad():
        assert torch.equal(module(inputs), hf_model(inputs).logits)
    ref = models.reference_model(loaded_cfg, SEED, pretrained_dir=str(tmp_path))
    with torch.no_grad():
        assert torch.equal(ref(inputs).logits, hf_model(inputs).logits)


# ---------------------------------------------------------------------------------------
# Two processes, two stages


def _two_stage_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.comm.init_distributed(dist_backend="gloo")
    cfg = models.load_hf_config("gpt2-tiny")
    module = models.build_pipeline_module(cfg, 2, seed=SEED)
    is_block = [type(f).__name__ == "TransformerBlockPipe" for f in module.forward_funcs]
    torch.save(
        {
            "parts": [int(p) for p in module.parts],
            "num_blocks": sum(is_block),
            "state": module.state_dict(),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_stages_on_two_processes(dist_world, tmp_path):
    """Each of 2 stages holds 2 blocks; their merged state is the 1-stage state exactly."""
    torch.multiprocessing.start_processes(
        _two_stage_worker,
        args=(_free_port(), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["num_blocks"] for r in results] == [2, 2]
    assert results[0]["parts"] == results[1]["parts"] == [0, 4, 8]

    cfg = models.load_hf_config("gpt2-tiny")
    one_stage = models.build_pipeline_module(cfg, 1, seed=SEED).state_dict()
    # The tied embedding: the original on stage 0, the LM head's copy on stage 1.
    assert "0.embedding.weight" in results[0]["state"]
    assert "7.embedding.weight" in results[1]["state"]
    merged = {**results[0]["state"], **results[1]["state"]}
    assert set(merged) == set(one_stage)
    for r in results:
        for n, tensor in r["state"].items():
            assert torch.equal(tensor, one_stage[n]), n


# ---------------------------------------------------------------------------------------
# A causal LM of no family: one whole-model pipeline layer, one stage


def test_a_causal_lm_of_no_family_loads_as_one_whole_layer(dist_world, tmp_path):
    cfg = models.load_hf_config(write_tiny_opt(tmp_path / "opt"))
    assert not models.is_family(cfg)
    assert models.num_layers(cfg) == 1 and models.logical_parts(cfg, 1) == [0, 1]
    assert models.partition_method(cfg) == "uniform" and models.tied_copies(cfg) == {}
    module = models.build_pipeline_module(cfg, 1, seed=SEED, pretrained_dir=str(tmp_path / "opt"))
    ref = models.reference_model(cfg, SEED, pretrained_dir=str(tmp_path / "opt"))
    # The tie stays one parameter inside the layer, as in transformers.
    layer = module.forward_funcs[0]
    assert layer.model.get_output_embeddings().weight is layer.model.get_input_embeddings().weight
    module.eval()
    ref.eval()
    inputs = _tokens()
    with torch.no_grad():
        assert torch.equal(module(inputs), ref(inputs).logits)

    # Names: "0.model.<HF name>", both ways; HF's alias counts once in a hash.
    pipe_state = module.state_dict()
    hf_state = models.layer_names_to_hf(pipe_state, cfg)
    assert set(hf_state) == set(ref.state_dict()) and "lm_head.weight" in hf_state
    assert all(name.startswith("0.model.") for name in pipe_state)
    back = models.hf_to_layer_names(hf_state, cfg)
    assert set(back) == set(pipe_state) and all(back[n] is pipe_state[n] for n in pipe_state)
    assert set(models.drop_tied_aliases(hf_state, cfg)) == set(dict(ref.named_parameters()))
    with pytest.raises(ValueError, match="differs"):
        models.drop_tied_aliases(
            {**hf_state, "lm_head.weight": hf_state["lm_head.weight"] + 1}, cfg
        )

    # Exported, it loads in transformers with the same parameters.
    models.save_pretrained(pipe_state, cfg, str(tmp_path / "export"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    from spotline.runtime import param_sha256

    assert param_sha256(dict(loaded.named_parameters())) == param_sha256(
        models.drop_tied_aliases(hf_state, cfg)
    )


def test_a_sliding_window_longer_than_the_sequence_is_refused_in_one_line():
    # The stages attend causally over the whole sequence: a sliding window's attention only
    # while the sequence fits in it (Mistral's window; Qwen2's on its sliding layers).
    from spotline.models.model_config import check_sequence

    mistral = models.load_hf_config("mistral-tiny", {"sliding_window": 16})
    check_sequence(mistral, 16)
    with pytest.raises(UserError) as excinfo:
        check_sequence(mistral, 17)
    _assert_one_line_user_error(excinfo, "--seq-len 17", "'mistral'", "16 tokens", "--seq-len 16")
    layer_types = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    qwen2 = models.load_hf_config("qwen2-tiny", {"sliding_window": 8, "layer_types": layer_types})
    with pytest.raises(UserError, match="window of 8 tokens"):
        check_sequence(qwen2, 9)
    check_sequence(models.load_hf_config("qwen2-tiny"), 4096)  # no window: any length


def test_a_causal_lm_of_no_family_cannot_be_split(tmp_path):
    cfg = models.load_hf_config(write_tiny_opt(tmp_path / "opt"))
    with pytest.raises(UserError) as excinfo:
        models.logical_parts(cfg, 2)
    _assert_one_line_user_error(excinfo, "--stages 2", "opt", "--stages 1", "gpt2", "llama")


def test_a_whole_model_trains_as_the_transformers_reference(dist_world, tmp_path):
    """One process, two logical workers, the tie shared: the engine's losses and parameters
    are the single-process transformers reference's, bit for bit (dropout off)."""
    from conftest import small_config

    from spotline.config import parse_config
    from spotline.reference import train_reference
    from spotline.runtime import param_sha256
    from spotline.worker.export import gather_hf_parameters
    from spotline.worker.launched import setup_worker

    config = small_config(
        model={"name": write_tiny_opt(tmp_path / "opt")},
        training={"steps": 3},
        topology={"workers": 1, "stages": 1},
        elasticity={"logical_workers": 2},
    )
    cfg = parse_config(config)
    try:
        worker = setup_worker(cfg)
        losses = [worker.train_step(step) for step in range(3)]
        hf_params = gather_hf_parameters(worker.engine, worker.hf_config)
        reference = train_reference(cfg)
    finally:
        torch.use_deterministic_algorithms(False)  # setup_worker's, for the tests after this
    assert hf_params is not None
    assert losses == reference["losses"]
    digest = param_sha256(models.drop_tied_aliases(hf_params, worker.hf_config))
    assert digest == reference["param_sha256"]


def test_the_stock_baseline_ties_the_head_the_deepspeed_way(dist_world):
    # The foundation bench's stock model: DeepSpeed's TiedLayerSpec at both ends of a tied
    # model (one module on one stage), so it is the HF model exactly and DeepSpeed's
    # ReduceTiedGrads has the tied weight to all-reduce on more stages. Untied: unchanged.
    from deepspeed.pipe import TiedLayerSpec

    from spotline.launch.bench.stock_worker import TIED_KEY, deepspeed_tied

    cfg = models.load_hf_config("gpt2-tiny", NO_DROPOUT["gpt2-tiny"])
    specs = deepspeed_tied(models.build_layer_specs(cfg, seed=SEED))
    assert [s.key for s in specs if isinstance(s, TiedLayerSpec)] == [TIED_KEY, TIED_KEY]
    module = models.build_pipeline_module(cfg, 1, seed=SEED, layer_specs=specs)
    assert sorted(module.tied_modules) == [TIED_KEY]
    ref = models.reference_model(cfg, SEED)
    tokens = _tokens()
    logits = module(tokens[:, :-1])
    assert torch.equal(logits, ref(tokens[:, :-1]).logits)
    untied = models.load_hf_config("neox-tiny", NO_DROPOUT["neox-tiny"])
    plain = models.build_layer_specs(untied, seed=SEED)
    assert deepspeed_tied(plain) is plain
