"""Granite MoE and Granite MoE Shared against HF transformers on tiny random float32
checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16, Granite's four
multipliers far from 1 (embedding 12, residual 0.22, attention 0.0156, logits scaling 8, as
tests/test_olmo2_granite_models.py, which checks that each one moves HF's logits), and in
every layer experts of intermediate 32 of which each token takes 2, stored stacked as HF
saves them (``block_sparse_moe.input_linear``/``output_linear``, ``router.layer``). Granite
MoE has 5 experts (split 3 + 2 over two expert-parallel ranks); Granite MoE Shared has 4,
a shared MLP of intermediate 48 (checked: HF's logits move without it) and biases on q, k, v
and o. Norm weights are randomized around 1. Logits must match HF's (batched prefill, a
decode, a chunk over a cached prefix); greedy tokens through ``LLM`` must be HF's
``generate``'s for prompts longer than a KV block, with and without chunked prefill, on two
tensor-parallel ranks and on two expert-parallel ranks.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from safetensors.torch import load_file
from test_expert_parallel import simulated_rank
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity, hf_logits, load_hf
from test_olmo2_granite_models import GRANITE_MULTIPLIERS
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.granite import GraniteDecoderLayer
from chassis.builtin_plugins.models.granitemoe import GraniteMoeBlock, GraniteMoeForCausalLM
from chassis.builtin_plugins.models.granitemoeshared import GraniteMoeSharedForCausalLM
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

ARCHITECTURES = ("granitemoe", "granitemoeshared")
MODEL_CLASSES = {
    "granitemoe": GraniteMoeForCausalLM,
    "granitemoeshared": GraniteMoeSharedForCausalLM,
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import GraniteMoeConfig, GraniteMoeSharedConfig

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        **GRANITE_MULTIPLIERS,
        "tie_word_embeddings": False,
        "intermediate_size": 32,
        "num_experts_per_tok": 2,
    }
    if arch == "granitemoe":
        return GraniteMoeConfig(**{**fields, "num_local_experts": 5, **overrides})
    if arch == "granitemoeshared":
        fields.update(num_local_experts=4, shared_intermediate_size=48, attention_bias=True)
        return GraniteMoeSharedConfig(**{**fields, **overrides})
    raise ValueError(f"unknown architecture {arch!r}")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_tiny_checkpoint(tiny_config(arch), tmp_path_factory.mktemp(arch), seed=3)
        for arch in ARCHITECTURES
    }


def build(arch: str, config: Any) -> Any:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return MODEL_CLASSES[arch](config, ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dirs[arch], TOKEN_PROMPTS, atol=1e-4)


def test_the_shared_mlp_changes_the_logits(model_dirs: dict[str, Path]) -> None:
    """The parity test can fail: HF's logits without the shared MLPs are more than 100
    times its tolerance away from those with them (the logits are small: divided by 8)."""
    hf_model = load_hf(model_dirs["granitemoeshared"])
    reference = hf_logits(hf_model, TOKEN_PROMPTS[0])
    for layer in hf_model.model.layers:
        layer.shared_mlp = None
    assert (hf_logits(hf_model, TOKEN_PROMPTS[0]) - reference).abs().max() > 0.01


def test_the_configs_are_read(model_dirs: dict[str, Path]) -> None:
    for arch, experts, shared in (("granitemoe", 5, None), ("granitemoeshared", 4, 48)):
        model = Runner(model_dirs[arch]).model
        layer = model.model.layers[1]
        assert isinstance(layer, GraniteDecoderLayer) and layer.residual_multiplier == 0.22
        assert layer.self_attn.attn.backend.scale == 0.0156
        assert (model.multipliers.embedding, model.multipliers.logits_scaling) == (12.0, 8.0)
        block = layer.mlp
        assert isinstance(block, GraniteMoeBlock)
        # top-k softmax == renormalized top-k of the full softmax, rounded to the model dtype
        assert (block.experts.num_experts, block.experts.top_k) == (experts, 2)
        assert block.experts.renormalize and block.experts.round_weights_to_model_dtype
        if shared is None:
            assert block.shared_mlp is None
        else:
            assert tuple(block.shared_mlp.gate_up_proj.weight.shape) == (2 * shared, 64)
            assert layer.self_attn.qkv_proj.bias is not None
            assert layer.self_attn.o_proj.bias is not None


def test_a_shared_intermediate_size_of_zero_is_plain_granite_moe(tmp_path: Path) -> None:
    """HF builds no shared MLP then; neither do we, and the logits still match."""
    config = tiny_config("granitemoeshared", shared_intermediate_size=0)
    model_dir = save_tiny_checkpoint(config, tmp_path, seed=6)
    runner_model = Runner(model_dir).model
    assert all(layer.mlp.shared_mlp is None for layer in runner_model.model.layers)
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_stacked_tensors_of_the_wrong_shape_are_refused(model_dirs: dict[str, Path]) -> None:
    tensors = load_file(model_dirs["granitemoeshared"] / "model.safetensors")
    model = build("granitemoeshared", tiny_config("granitemoeshared"))
    name = "model.layers.0.block_sparse_moe.input_linear.weight"
    with pytest.raises(
        ValueError, match=r"block_sparse_moe\.input_linear\.weight' has shape \(3, 64, 64\)"
    ):
        model.load_weights([(name, tensors[name][:3])])
    name = "model.layers.0.block_sparse_moe.output_linear.weight"
    with pytest.raises(ValueError, match=r"expected \(4, 64, 32\)"):
        model.load_weights([(name, tensors[name][:, :, :16])])
    name = "model.layers.0.shared_mlp.input_linear.weight"
    with pytest.raises(ValueError, match="expected 2 \\* shared_intermediate_size = 96"):
        model.load_weights([(name, tensors[name][:48])])
    # Granite MoE has no shared MLP: the tensor has no counterpart
    plain = build("granitemoe", tiny_config("granitemoe"))
    with pytest.raises(ValueError, match="no counterpart"):
        plain.load_weights([(name, tensors[name])])


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        build("granitemoe", tiny_config("granitemoe", hidden_act="gelu"))
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        build("granitemoeshared", tiny_config("granitemoeshared", rope_parameters=rope))
    with pytest.raises(ValueError, match="logits_scaling is 0"):
        build("granitemoe", tiny_config("granitemoe", logits_scaling=0.0))
    with (
        simulated_rank(0, 2),
        pytest.raises(ValueError, match=r"shared_intermediate_size \(45\) is not divisible"),
    ):
        build("granitemoeshared", tiny_config("granitemoeshared", shared_intermediate_size=45))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_models_build_on_a_non_cpu_default_device(arch: str) -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = MODEL_CLASSES[arch](tiny_config(arch), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_each_rank_loads_its_share_of_the_stacked_experts(model_dirs: dict[str, Path]) -> None:
    """Two simulated ranks of Granite MoE Shared: each expert's gate and up rows and down
    columns of the rank (tensor parallel), or 2 whole experts each (expert parallel); the
    shared MLP's gate and up halves split by columns either way. Every parameter fills."""
    from transformers import AutoConfig

    model_dir = model_dirs["granitemoeshared"]
    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    prefix = "model.layers.1."
    stacked_in = tensors[prefix + "block_sparse_moe.input_linear.weight"]  # [4, 64, 64]
    stacked_out = tensors[prefix + "block_sparse_moe.output_linear.weight"]  # [4, 64, 32]
    shared_in = tensors[prefix + "shared_mlp.input_linear.weight"]  # [96, 64]
    for rank in (0, 1):
        cols = slice(16 * rank, 16 * rank + 16)
        for expert_parallel in (False, True):
            with simulated_rank(rank, 2, expert_parallel=expert_parallel):
                model = build("granitemoeshared", config)
                filled = model.load_weights(tensors.items())
            assert len(filled) == len(list(model.parameters()))
            w13 = model.get_parameter(prefix + "mlp.experts.w13")
            w2 = model.get_parameter(prefix + "mlp.experts.w2")
            if expert_parallel:
                e = 2 * rank + 1  # the rank's second expert, whole
                assert torch.equal(w13[1], stacked_in[e]) and torch.equal(w2[1], stacked_out[e])
            else:
                gate, up = stacked_in[3].split(32)
                assert torch.equal(w13[3], torch.cat([gate[cols], up[cols]]))
                assert torch.equal(w2[3], stacked_out[3][:, cols])
            shared = model.get_parameter(prefix + "mlp.shared_mlp.gate_up_proj.weight")
            gate, up = shared_in.split(48)
            half = slice(24 * rank, 24 * rank + 24)
            assert torch.equal(shared, torch.cat([gate[half], up[half]]))


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(
    model_dirs: dict[str, Path], arch: str, engine: dict[str, Any]
) -> None:
    """All prompts in one ``generate``, on the CPU's default backend and block size, then
    with prefills chunked to at most 16 tokens over blocks of 4."""
    model_dir = model_dirs[arch]
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor", "expert"])
def test_two_ranks_match_transformers(
    model_dirs: dict[str, Path], arch: str, expert_parallel: bool
) -> None:
    """Two real ranks: half the heads and half of every expert's columns, or with
    ``--enable-expert-parallel`` whole experts (Granite MoE's 5 as 3 + 2); the shared MLP
    split by columns either way. HF's greedy tokens."""
    model_dir = model_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    got = chassis_greedy(
        model_dir,
        PROMPTS,
        MAX_TOKENS,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    assert got == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
