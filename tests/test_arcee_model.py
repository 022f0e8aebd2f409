"""Arcee (AFM) against HF transformers on a tiny random float32 checkpoint.

The checkpoint has 2 layers of hidden 64 (4 heads, 2 KV heads of 16) with the ReLU² MLP
(``up_proj`` 64 -> 128, no ``gate_proj``), attention and MLP biases, norm weights
randomized around 1, an untied LM head and YaRN RoPE scaling (a scaled RoPE type).
Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix); greedy
tokens through ``LLM`` must be HF's ``generate``'s for prompts longer than a KV block, with
and without chunked prefill, and on two tensor-parallel ranks.
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
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity, hf_logits, load_hf
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.arcee import ArceeForCausalLM, ReLUSquaredMLP
from chassis.core import parallel_state
from chassis.core.model_interface import LoRASlice, ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

#: YaRN RoPE scaling on the tiny model's lengths
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}


def tiny_config(**overrides: Any) -> Any:
    from transformers import ArceeConfig

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": YARN,
    }
    return ArceeConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_arcee"), seed=3)


def build(config: Any) -> ArceeForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return ArceeForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_the_mlp_is_relu_squared(model_dir: Path, tmp_path: Path) -> None:
    """Not vacuous: HF's own logits move when the square is left out (a plain ReLU), and
    when the YaRN scaling is dropped; ours is the ReLU² MLP, with no gate."""
    hf_model = load_hf(model_dir)
    tokens = TOKEN_PROMPTS[0]
    reference = hf_logits(hf_model, tokens)
    for layer in hf_model.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    assert (hf_logits(hf_model, tokens) - reference).abs().max() > 1e-2
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    unscaled = save_tiny_checkpoint(tiny_config(rope_parameters=default_rope), tmp_path, seed=3)
    changed = hf_logits(load_hf(unscaled), tokens)
    assert (changed - reference).abs().max() > 1e-3
    model = Runner(model_dir).model
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp, ReLUSquaredMLP)
    assert (mlp.up_proj.weight.shape, mlp.down_proj.weight.shape) == ((128, 64), (64, 128))
    names = {name for name, _ in model.named_parameters()}
    assert not any("gate" in name for name in names)
    assert "model.layers.1.self_attn.qkv_proj.weight" in names


def test_lora_slices_name_up_proj_whole(model_dir: Path) -> None:
    """A LoRA adapter on ``up_proj`` adapts all of its rows (not the upper half of a merged
    gate/up layer, as Llama's would); q/k/v stay slices of ``qkv_proj``."""
    model = Runner(model_dir).model
    up = "model.layers.0.mlp.up_proj"
    assert model.lora_slices(up, model.get_submodule(up)) == [LoRASlice(up, 0, 128, 64, 128)]
    qkv = "model.layers.0.self_attn.qkv_proj"
    slices = model.lora_slices(qkv, model.get_submodule(qkv))
    assert [(s.hf_module.rpartition(".")[2], s.first_row, s.rows) for s in slices] == [
        ("q_proj", 0, 64),
        ("k_proj", 64, 32),
        ("v_proj", 96, 32),
    ]
    assert model.merged_projections.get("up_proj", "up_proj") == "up_proj"


def test_unsupported_options_are_refused() -> None:
    for act in ("silu", "relu"):
        with pytest.raises(ValueError, match=f"hidden_act '{act}' is not supported"):
            build(tiny_config(hidden_act=act))
    config = tiny_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        build(config)


def test_models_build_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = ArceeForCausalLM(tiny_config(), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(model_dir: Path, engine: dict[str, Any]) -> None:
    """All prompts in one ``generate``, on the CPU's default backend and block size, then
    with prefills chunked to at most 16 tokens over blocks of 4."""
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


def test_each_rank_loads_its_rows_of_up_proj(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks: ``up_proj`` (weight and bias) holds the rank's half of the rows,
    ``down_proj`` its half of the columns; every parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = build(config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        prefix = "model.layers.1.mlp."
        rows = slice(64 * rank, 64 * (rank + 1))
        for name in ("up_proj.weight", "up_proj.bias"):
            assert torch.equal(model.get_parameter(prefix + name), tensors[prefix + name][rows])
        down = model.get_parameter(prefix + "down_proj.weight")
        assert torch.equal(down, tensors[prefix + "down_proj.weight"][:, rows])


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dir: Path) -> None:
    """Two real ranks: half the heads, one KV head and half the ReLU² MLP columns each (the
    down projection's partial sums all-reduced): HF's greedy tokens."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
