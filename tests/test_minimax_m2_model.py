"""MiniMax-M2 (``MiniMaxM2ForCausalLM``) against HF transformers on tiny random float32
checkpoints.

The checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 32, RoPE over the first
16 dimensions of each head (``rotary_dim``), RMSNorms over the whole q and k projections
(weights randomized around 1), and in every layer a mixture of 8 experts (Mixtral's
``block_sparse_moe`` names), top 2 by sigmoid scores plus a randomized
``e_score_correction_bias``, the unbiased scores renormalized.

Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix); greedy
tokens through ``LLM`` must be HF's ``generate``'s for prompts longer than a KV block, with
and without chunked prefill, and on two tensor-parallel ranks (the q/k norms' mean squares
summed over the ranks; one of the runs with a single KV head, replicated).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, allocate_block_tables, save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner, check_parity
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.deepseek_v3 import DeepseekV3Router
from chassis.builtin_plugins.models.minimax_m2 import MiniMaxM2ForCausalLM
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

MINIMAX_M2_FIELDS: dict[str, Any] = {
    "tie_word_embeddings": False,
    "head_dim": 32,
    "rotary_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}

NUM_LAYERS = TINY_CONFIG_FIELDS["num_hidden_layers"]


def tiny_config(**overrides: Any) -> Any:
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(**{**TINY_CONFIG_FIELDS, **MINIMAX_M2_FIELDS, **overrides})


def write_checkpoint(directory: Path, seed: int = 3, **overrides: Any) -> Path:
    """The tiny checkpoint, with each layer's ``e_score_correction_bias`` (a buffer HF
    initializes to 0, which ``save_tiny_checkpoint`` leaves alone) randomized so that it
    moves the choice."""
    model_dir = save_tiny_checkpoint(tiny_config(**overrides), directory, seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for layer in range(NUM_LAYERS):
        name = f"model.layers.{layer}.block_sparse_moe.e_score_correction_bias"
        assert name in tensors  # the checkpoint's own (Mixtral-style) name
        tensors[name] = 0.2 * torch.randn(8, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_minimax_m2"))


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_the_config_is_read(model_dir: Path) -> None:
    model = Runner(model_dir).model
    for layer in model.model.layers:
        attention = layer.self_attn
        assert not attention.qk_norm  # not the per-head norm: one over each projection
        assert attention.q_norm.weight.shape == (128,)
        assert attention.k_norm.weight.shape == (64,)
        assert (attention.q_norm.weight - 1).abs().max() > 0  # randomized, loaded
        assert attention.rotary_emb.rotary_dim == 16 and not attention.rotary_emb.interleaved
        assert attention.qkv_proj.bias is None and attention.o_proj.bias is None
        block = layer.mlp
        assert isinstance(block.gate, DeepseekV3Router) and block.shared_experts is None
        spec = block.gate.spec
        assert (spec.n_group, spec.norm_topk_prob, spec.routed_scaling_factor) == (1, True, 1.0)
        assert block.gate.e_score_correction_bias.abs().max() > 0


def test_the_correction_bias_changes_the_answer(tmp_path: Path, model_dir: Path) -> None:
    """Without the randomized bias the logits differ: the test checkpoint exercises it."""
    plain = save_tiny_checkpoint(tiny_config(), tmp_path / "plain", 3)
    prompt = TOKEN_PROMPTS[0]
    logits = []
    for directory in (model_dir, plain):
        runner = Runner(directory)
        tables = allocate_block_tables([len(prompt)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
        logits.append(runner.step([prompt], [len(prompt)], tables))
    biased, unbiased = logits
    assert not torch.allclose(biased, unbiased, atol=1e-3)


def test_layers_past_the_decoder_are_not_read(model_dir: Path) -> None:
    """A multi-token-prediction layer past ``num_hidden_layers`` (as the released
    checkpoints carry) is passed over, as HF passes it over."""
    model = Runner(model_dir).model
    extra = f"model.layers.{NUM_LAYERS}"
    assert not model.needs_checkpoint_tensor(f"{extra}.block_sparse_moe.experts.0.w1.weight")
    weights = [
        (f"{extra}.self_attn.q_proj.weight", torch.zeros(128, 64)),
        (f"{extra}.block_sparse_moe.e_score_correction_bias", torch.zeros(8)),
    ]
    assert model.load_weights(weights) == set()


def test_unsupported_options_are_refused() -> None:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    with pytest.raises(ValueError, match="hidden_act"):
        MiniMaxM2ForCausalLM(tiny_config(hidden_act="gelu"), ctx)
    for field, value in (
        ("scoring_func", "softmax"),
        ("use_qk_norm", False),
        ("qk_norm_type", "per_head"),
        ("use_routing_bias", False),
        ("shared_intermediate_size", 64),
        ("attn_type_list", [0, 1]),
        ("routed_scaling_factor", 2.5),
    ):
        config = tiny_config()
        setattr(config, field, value)
        with pytest.raises(ValueError, match=field):
            MiniMaxM2ForCausalLM(config, ctx)


def test_builds_on_a_non_cpu_default_device() -> None:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = MiniMaxM2ForCausalLM(tiny_config(), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(model_dir: Path, engine: dict[str, Any]) -> None:
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize(
    "overrides", [{}, {"num_key_value_heads": 1}], ids=["two-kv-heads", "one-kv-head"]
)
def test_two_ranks_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    """Two real ranks: half the heads (and q/k norm weights) and expert columns each, the
    q/k norms' mean squares summed over both, the router whole; with one KV head, that head
    and its k_norm weights replicated. HF's greedy tokens."""
    model_dir = write_checkpoint(tmp_path / "minimax_m2", seed=4, **overrides)
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
