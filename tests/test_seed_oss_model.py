"""``SeedOssForCausalLM`` against HF transformers on tiny random float32 checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16 and norm weights
randomized around 1. Seed-OSS switches its biases with its own flags: the default checkpoint
has q/k/v biases only (``attention_bias``), the second an ``o_proj`` bias
(``attention_out_bias``) and MLP biases without q/k/v ones, the tensor-parallel one all of
them (randomized: a bias left out or loaded into the wrong place changes the logits). Logits
must match HF's (batched prefill, a decode, a chunk over a cached prefix); greedy tokens
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
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.seed_oss import SeedOssForCausalLM
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

ALL_BIASES = {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True}

#: name -> SeedOssConfig fields over the tiny ones
CONFIGS: dict[str, dict[str, Any]] = {
    "qkv_bias": {},  # the config's defaults: attention_bias true, the others false
    "out_and_mlp_bias": {"attention_bias": False, "attention_out_bias": True, "mlp_bias": True},
}


def seed_oss_config(**overrides: Any) -> Any:
    """A 2-layer, hidden-64 Seed-OSS config (untied LM head) with the SmolLM2 vocabulary
    (``head_dim`` 16: the config's default is 128, whatever the hidden size)."""
    from transformers import SeedOssConfig

    fields = {**TINY_CONFIG_FIELDS, "head_dim": 16, "tie_word_embeddings": False}
    return SeedOssConfig(**{**fields, **overrides})


def write_checkpoint(directory: Path, seed: int = 3, **overrides: Any) -> Path:
    return save_tiny_checkpoint(seed_oss_config(**overrides), directory, seed)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_checkpoint(tmp_path_factory.mktemp(f"tiny_seed_oss_{name}"), **fields)
        for name, fields in CONFIGS.items()
    }


def build_context() -> ModelBuildContext:
    return ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(model_dirs: dict[str, Path], name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dirs[name], TOKEN_PROMPTS, atol=1e-4)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_bias_flags_are_read(model_dirs: dict[str, Path], name: str) -> None:
    """Each projection has a bias exactly when its own flag says so (Llama's
    ``attention_bias`` would put one on ``o_proj`` with q/k/v)."""
    flags = {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False}
    flags.update(CONFIGS[name])
    layer = Runner(model_dirs[name]).model.model.layers[1]
    has_bias = {
        "attention_bias": layer.self_attn.qkv_proj.bias is not None,
        "attention_out_bias": layer.self_attn.o_proj.bias is not None,
        "mlp_bias": layer.mlp.gate_up_proj.bias is not None
        and layer.mlp.down_proj.bias is not None,
    }
    assert has_bias == flags


# -- refused options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor 0.5 is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'dynamic' is not supported",
        ),
    ],
    ids=["hidden_act", "partial_rotary_factor", "rope_type"],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SeedOssForCausalLM(seed_oss_config(**overrides), build_context())


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = SeedOssForCausalLM(seed_oss_config(**ALL_BIASES), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(
    model_dirs: dict[str, Path], engine: dict[str, Any]
) -> None:
    """All prompts in one ``generate`` (one batch), on the CPU's default backend and block
    size, then with prefills chunked to at most 16 tokens over blocks of 4."""
    model_dir = model_dirs["qkv_bias"]
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(tmp_path: Path) -> None:
    """Two real ranks with every bias: q/k/v and gate/up biases split with their rows,
    ``o_proj`` and ``down_proj`` biases added by rank 0 only. HF's greedy tokens."""
    model_dir = write_checkpoint(tmp_path / "seed_oss", seed=4, **ALL_BIASES)
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
