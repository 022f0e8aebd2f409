"""``Glm4ForCausalLM`` against HF transformers on tiny random float32 checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16, q/k/v biases and
all four norms of a layer randomized around 1 (so a norm loaded into the wrong place, or the
post-attention/post-MLP norms left out, changes the logits). The default checkpoint rotates
the first 8 of 16 dimensions of each head (GLM-4's ``partial_rotary_factor`` 0.5) in the
interleaved layout; a second one rotates whole heads interleaved, without biases. Logits must
match HF's (batched prefill, a decode, a chunk over a cached prefix), and a rotate-half table
in place of the interleaved one must not; greedy tokens through ``LLM`` must be HF's
``generate``'s for prompts longer than a KV block, with and without chunked prefill, and on
two tensor-parallel ranks.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, allocate_block_tables, save_tiny_checkpoint
from safetensors.torch import load_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner, check_parity, hf_logits, load_hf
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.glm4 import Glm4DecoderLayer, Glm4ForCausalLM
from chassis.core import parallel_state
from chassis.core.layers.rotary import RotaryEmbedding, rope_parameters
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

#: name -> Glm4Config fields over the tiny ones
CONFIGS: dict[str, dict[str, Any]] = {
    "partial_rotary": {},  # the config's defaults: factor 0.5, attention_bias true
    "whole_head": {"partial_rotary_factor": 1.0, "attention_bias": False},
}


def glm4_config(**overrides: Any) -> Any:
    """A 2-layer, hidden-64 GLM-4 config (untied LM head) with the SmolLM2 vocabulary
    (``head_dim`` 16: the config's default is 128, whatever the hidden size)."""
    from transformers import Glm4Config

    fields = {**TINY_CONFIG_FIELDS, "head_dim": 16, "tie_word_embeddings": False}
    return Glm4Config(**{**fields, **overrides})


def write_checkpoint(directory: Path, seed: int = 3, **overrides: Any) -> Path:
    return save_tiny_checkpoint(glm4_config(**overrides), directory, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_glm4"))


def build_context() -> ModelBuildContext:
    return ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    directory = model_dir if not CONFIGS[name] else write_checkpoint(tmp_path, **CONFIGS[name])
    check_parity(directory, TOKEN_PROMPTS, atol=1e-4)


def test_the_rotate_half_layout_would_not_match(model_dir: Path) -> None:
    """The parity test can fail on the layout: the same model with its rotary table switched
    to Llama's rotate-half pairing is far from HF's logits."""
    runner = Runner(model_dir)
    prompt = TOKEN_PROMPTS[0]
    tables = allocate_block_tables([len(prompt)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    runner.model.model.layers[0].self_attn.rotary_emb.interleaved = False  # shared by both
    logits = runner.step([prompt], [len(prompt)], tables)
    assert (logits - hf_logits(load_hf(model_dir), prompt)).abs().max() > 1e-2


def test_the_config_is_read(model_dir: Path) -> None:
    model = Runner(model_dir).model
    layer = model.model.layers[1]
    assert isinstance(layer, Glm4DecoderLayer)
    rotary = layer.self_attn.rotary_emb
    assert (rotary.head_dim, rotary.rotary_dim, rotary.interleaved) == (16, 8, True)
    assert layer.self_attn.qkv_proj.bias is not None
    assert layer.self_attn.o_proj.bias is None
    assert layer.mlp.gate_up_proj.bias is None
    assert layer.self_attn.attn.backend.sliding_window is None
    names = {name for name, _ in model.named_parameters()}
    for norm in (
        "input_layernorm",
        "post_self_attn_layernorm",
        "post_attention_layernorm",
        "post_mlp_layernorm",
    ):
        assert f"model.layers.1.{norm}.weight" in names


@pytest.mark.parametrize("partial", [0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rotary_is_hf_glm4s(partial: float, dtype: torch.dtype) -> None:
    """The interleaved table against HF's ``Glm4RotaryEmbedding`` and ``apply_rotary_pos_emb``
    (bit for bit, also in bfloat16); whole heads too, where the torch code stands in for the
    platform's rotate-half kernel."""
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding, apply_rotary_pos_emb

    config = glm4_config(partial_rotary_factor=partial, max_position_embeddings=64)
    params = {**rope_parameters(config), "interleaved": True}
    ours = RotaryEmbedding(16, 64, params)
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 5, 17, 63, 2])
    q = torch.randn(6, 4, 16, dtype=dtype)
    k = torch.randn(6, 2, 16, dtype=dtype)
    cos, sin = Glm4RotaryEmbedding(config)(q, positions[None])
    # HF: [batch, heads, seq, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q.clone(), k.clone())
    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))
    half = RotaryEmbedding(16, 64, rope_parameters(config))
    assert not torch.allclose(half(positions, q.clone(), k.clone())[0], q_out)


# -- refused options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'dynamic' is not supported",
        ),
    ],
    ids=["hidden_act", "rope_type"],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Glm4ForCausalLM(glm4_config(**overrides), build_context())


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = Glm4ForCausalLM(glm4_config(), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(model_dir: Path, engine: dict[str, Any]) -> None:
    """All prompts in one ``generate`` (one batch), on the CPU's default backend and block
    size, then with prefills chunked to at most 16 tokens over blocks of 4."""
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


def test_each_rank_loads_its_rows_of_the_fused_gate_up(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks (64 of the 128 MLP columns each): a rank's ``gate_up_proj`` is its
    rows of the checkpoint's gate half, then its rows of the up half; every parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    fused = tensors["model.layers.1.mlp.gate_up_proj.weight"]
    gate, up = fused[:128], fused[128:]
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = Glm4ForCausalLM(config, build_context())
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        rows = slice(64 * rank, 64 * rank + 64)
        expected = torch.cat([gate[rows], up[rows]])
        assert torch.equal(model.get_parameter("model.layers.1.mlp.gate_up_proj.weight"), expected)


def test_lora_on_the_fused_gate_up_is_refused_under_tensor_parallelism(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    model = Glm4ForCausalLM(config, build_context())
    name = "model.layers.0.mlp.gate_up_proj"
    [whole] = model.lora_slices(name, model.get_submodule(name))
    assert (whole.hf_module, whole.out_features) == (name, 256)
    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(0, 2))
    model = Glm4ForCausalLM(config, build_context())
    with pytest.raises(ValueError, match="gate_up_proj are not supported"):
        model.lora_slices(name, model.get_submodule(name))


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(tmp_path: Path) -> None:
    """Two real ranks: half the heads, half of each of gate and up (cut from the fused
    tensor) and of the biased q/k/v rows each. HF's greedy tokens."""
    model_dir = write_checkpoint(tmp_path / "glm4", seed=4)
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
