"""StarCoder2 against HF transformers on tiny random float32 checkpoints.

The main checkpoint is starcoder2-3b shaped in miniature: 2 layers of hidden 64, 4 heads and
2 KV heads of 16, ``use_bias`` on every projection, LayerNorm weights and biases randomized
(weights around 1, biases around 0, so a norm loaded into the wrong place, or RMSNorm
computed in place of LayerNorm, changes the logits), the ``gelu_pytorch_tanh`` MLP, a
sliding window of 6 on every layer (prompts run well past it) and the LM head tied to the
embedding. A second checkpoint has the exact ``gelu``, no biases, no window and an untied
head.

Logits must match HF's (prefill, chunked prefill over a cached prefix, decodes past the
window); greedy tokens through ``LLM`` must be HF's ``generate``'s for a batch of prompts of
which some are longer than two KV blocks, with and without chunked prefill, and on two
tensor-parallel ranks.
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
from test_models_parity import Runner, check_parity, hf_logits, load_hf
from test_sliding_window_models import check_window_parity
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.starcoder2 import (
    LayerNorm,
    Starcoder2ForCausalLM,
    Starcoder2MLP,
)
from chassis.core import parallel_state
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

WINDOW = 6

#: checkpoint name -> Starcoder2Config fields over the tiny ones
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "window-bias-tied": {
        "sliding_window": WINDOW,
        "use_bias": True,
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "exact-gelu-no-bias": {
        "sliding_window": None,
        "use_bias": False,
        "hidden_act": "gelu",
        "tie_word_embeddings": False,
        "norm_epsilon": 1e-3,
    },
}


def tiny_config(**overrides: Any) -> Any:
    from transformers import Starcoder2Config

    return Starcoder2Config(
        **{**TINY_CONFIG_FIELDS, **CHECKPOINTS["window-bias-tied"], **overrides}
    )


def build(config: Any) -> Starcoder2ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return Starcoder2ForCausalLM(config, ctx)


def write_checkpoint(config: Any, directory: Path, seed: int = 3) -> Path:
    """:func:`save_tiny_checkpoint`, then the LayerNorm biases (which it randomizes around 1,
    as norm weights) redrawn around 0: a bias of about 1 on every unit of the final norm
    would make a tied head's greedy choice the same token whatever the prompt."""
    directory = save_tiny_checkpoint(config, directory, seed)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if "norm" in name and name.endswith(".bias"):
            tensors[name] = 0.1 * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_checkpoint(tiny_config(**fields), tmp_path_factory.mktemp(name))
        for name, fields in CHECKPOINTS.items()
    }


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_transformers(model_dirs: dict[str, Path], name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dirs[name], TOKEN_PROMPTS, atol=1e-4)


def test_window_logits_match_transformers(model_dirs: dict[str, Path]) -> None:
    """Sequences of up to 24 tokens over a window of 6: a batched prefill, a chunk over a
    cached prefix and decodes past the window equal HF's logits; every layer slides."""
    runner = check_window_parity(model_dirs["window-bias-tied"])
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, WINDOW]


def test_the_window_and_the_norm_biases_change_the_answer(model_dirs: dict[str, Path]) -> None:
    """Not vacuous: past the window HF's logits differ from full attention's, and zeroing the
    LayerNorm biases moves them too."""
    hf_model = load_hf(model_dirs["window-bias-tied"])
    tokens = list(range(100, 120))
    windowed = hf_logits(hf_model, tokens)
    hf_model.config.sliding_window = None
    full = hf_logits(hf_model, tokens)
    assert (windowed[-1] - full[-1]).abs().max() > 1e-2
    with torch.no_grad():
        for module in hf_model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.bias.zero_()
    assert (hf_logits(hf_model, tokens)[-1] - full[-1]).abs().max() > 1e-2


def test_the_config_is_read(model_dirs: dict[str, Path]) -> None:
    model = Runner(model_dirs["window-bias-tied"]).model
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, LayerNorm)
    assert isinstance(model.model.norm, LayerNorm) and model.model.norm.bias is not None
    assert layer.input_layernorm.eps == 1e-5
    assert isinstance(layer.mlp, Starcoder2MLP) and layer.mlp.gelu_approximate == "tanh"
    assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.o_proj.bias is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plain = Runner(model_dirs["exact-gelu-no-bias"]).model
    layer = plain.model.layers[1]
    assert layer.mlp.gelu_approximate == "none" and layer.mlp.c_fc.bias is None
    assert layer.self_attn.qkv_proj.bias is None and layer.post_attention_layernorm.eps == 1e-3
    assert layer.self_attn.attn.sliding_window is None
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight


def test_layer_norm_is_torch_layer_norm_in_bfloat16() -> None:
    """Equal bit for bit to HF's ``nn.LayerNorm`` in bfloat16, with and without the fused
    residual add."""
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 3
    residual = torch.randn(5, 64, dtype=torch.bfloat16)
    ours = LayerNorm(64, 1e-5).to(torch.bfloat16)
    hf = torch.nn.LayerNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
        hf.weight.copy_(ours.weight)
        hf.bias.copy_(ours.bias)
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"hidden_act": "silu"}, "hidden_act 'silu'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type",
        ),
    ],
    ids=["relu", "silu", "dynamic-rope"],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build(tiny_config(**overrides))


def test_the_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = Starcoder2ForCausalLM(tiny_config(), ctx)
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
    """All prompts in one ``generate`` on the CPU's default backend and block size, then with
    prefills chunked to at most 16 tokens over blocks of 4; every layer slides over 6."""
    model_dir = model_dirs["window-bias-tied"]
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


def test_each_rank_loads_its_share_of_the_mlp(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks: ``c_fc`` rows (weight and bias) and ``c_proj`` columns are cut as
    Llama's ``up_proj`` and ``down_proj``, ``c_proj``'s bias is rank 0's alone; every
    parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dirs["window-bias-tied"])
    tensors = load_file(model_dirs["window-bias-tied"] / "model.safetensors")
    prefix = "model.layers.1.mlp."
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = build(config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        rows = slice(64 * rank, 64 * (rank + 1))
        assert torch.equal(
            model.get_parameter(prefix + "c_fc.weight"), tensors[prefix + "c_fc.weight"][rows]
        )
        assert torch.equal(
            model.get_parameter(prefix + "c_fc.bias"), tensors[prefix + "c_fc.bias"][rows]
        )
        c_proj = tensors[prefix + "c_proj.weight"]
        assert torch.equal(model.get_parameter(prefix + "c_proj.weight"), c_proj[:, rows])
        bias = model.get_parameter(prefix + "c_proj.bias")
        assert torch.equal(bias, tensors[prefix + "c_proj.bias"] if rank == 0 else torch.zeros(64))
        c_fc_slice = model.lora_slices(prefix + "c_fc", model.get_submodule(prefix + "c_fc"))
        c_proj_slice = model.lora_slices(prefix + "c_proj", model.get_submodule(prefix + "c_proj"))
        assert [(s.in_features, s.out_features) for s in c_fc_slice + c_proj_slice] == [
            (64, 128),
            (128, 64),
        ]


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dirs: dict[str, Path]) -> None:
    """Two real ranks: half the heads (one KV head each) and half the MLP columns, biases
    cut or added once; HF's greedy tokens."""
    model_dir = model_dirs["window-bias-tied"]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
