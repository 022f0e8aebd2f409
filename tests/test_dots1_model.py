"""dots.llm1 (``Dots1ForCausalLM``) against HF transformers on tiny random float32
checkpoints.

The checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 32: layer 0 full
attention and a dense MLP (``first_k_dense_replace`` 1), layer 1 a sliding window of 4
(``max_window_layers`` 1) and DeepSeek-V3's mixture of 8 experts (top 2 among 1 of 2 groups,
sigmoid scores with a randomized ``e_score_correction_bias``, ``norm_topk_prob``,
``routed_scaling_factor`` 2.5) with a shared expert; biases on q, k, v and o
(``attention_bias``), per-head q/k norms; norm weights and biases randomized.

Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix: prompts
longer than the window), also without biases, groups and renormalization; greedy tokens
through ``LLM`` must be HF's ``generate``'s for prompts longer than a KV block, with and
without chunked prefill, and on two tensor-parallel ranks.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.deepseek_v3 import DeepseekV3Router
from chassis.builtin_plugins.models.dots1 import Dots1ForCausalLM
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

WINDOW = 4

DOTS1_FIELDS: dict[str, Any] = {
    "tie_word_embeddings": False,
    "head_dim": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "attention_bias": True,
    "sliding_window": WINDOW,
    "max_window_layers": 1,
}

CORRECTION_BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def tiny_config(**overrides: Any) -> Any:
    from transformers import Dots1Config

    return Dots1Config(**{**TINY_CONFIG_FIELDS, **DOTS1_FIELDS, **overrides})


def write_checkpoint(directory: Path, seed: int = 3, **overrides: Any) -> Path:
    """The tiny checkpoint, with ``e_score_correction_bias`` (a buffer HF initializes to 0,
    which ``save_tiny_checkpoint`` leaves alone) randomized so that it moves the choice."""
    model_dir = save_tiny_checkpoint(tiny_config(**overrides), directory, seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    tensors[CORRECTION_BIAS] = 0.2 * torch.randn(8, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_dots1"))


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    assert max(len(p) for p in TOKEN_PROMPTS) > 2 * WINDOW
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_logits_match_without_biases_groups_and_renormalization(tmp_path: Path) -> None:
    plain = write_checkpoint(
        tmp_path / "plain",
        attention_bias=False,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )
    check_parity(plain, TOKEN_PROMPTS, atol=1e-4)


def test_the_config_is_read(model_dir: Path) -> None:
    model = Runner(model_dir).model
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, WINDOW]
    for layer in layers:
        attention = layer.self_attn
        assert attention.qk_norm and attention.q_norm.weight.shape == (32,)
        assert attention.rotary_emb.rotary_dim == 32 and not attention.rotary_emb.interleaved
        assert attention.qkv_proj.bias is not None and attention.o_proj.bias is not None
    assert type(layers[0].mlp).__name__ == "LlamaMLP"
    block = layers[1].mlp
    assert isinstance(block.gate, DeepseekV3Router)
    assert (block.gate.spec.n_group, block.gate.spec.topk_group) == (2, 1)
    assert block.gate.e_score_correction_bias.abs().max() > 0
    assert block.shared_experts is not None


def test_unsupported_options_are_refused() -> None:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    for overrides, field in (
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 3}, "n_group"),
    ):
        with pytest.raises(ValueError, match=field):
            Dots1ForCausalLM(tiny_config(**overrides), ctx)
    for field, value in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        config = tiny_config()
        setattr(config, field, value)
        with pytest.raises(ValueError, match=field):
            Dots1ForCausalLM(config, ctx)
    config = tiny_config()
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Dots1ForCausalLM(config, ctx)


def test_builds_on_a_non_cpu_default_device() -> None:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = Dots1ForCausalLM(tiny_config(), ctx)
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
def test_two_ranks_match_transformers(tmp_path: Path) -> None:
    """Two real ranks: half the heads, expert columns and shared/dense MLP columns each,
    ``o_proj``'s bias added once, the q/k norms and router whole. HF's greedy tokens."""
    model_dir = write_checkpoint(tmp_path / "dots1", seed=4)
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
