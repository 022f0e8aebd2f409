"""``HunYuanDenseV1ForCausalLM`` against HF transformers on tiny random float32 checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16 and norm weights
(the layer norms and the per-head ``query_layernorm``/``key_layernorm``, applied after RoPE)
randomized around 1. The default one has the released checkpoints' RoPE scaling,
``{"type": "dynamic", "alpha": 1000, "factor": 1, ...}`` (a fixed NTK-alpha base change),
q/k/v/o biases and a tied head, as Hunyuan-0.5B ties it; a second one has plain RoPE, no
biases and an untied head. Logits must match HF's (batched prefill, a decode, a chunk over a
cached prefix), and must not with the q/k norms moved before RoPE; greedy tokens through
``LLM`` must be HF's ``generate``'s for prompts longer than a KV block, with and without
chunked prefill, and on two tensor-parallel ranks.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, allocate_block_tables, save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner, check_parity, hf_logits, load_hf
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.hunyuan_v1_dense import (
    HunYuanAttention,
    HunYuanDenseV1ForCausalLM,
)
from chassis.core import parallel_state
from chassis.core.layers.rotary import RotaryEmbedding, ntk_alpha_base
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

#: the released checkpoints' rope_scaling (Hunyuan-0.5B/1.8B/4B/7B-Instruct), as config.json has it
NTK_ALPHA = {
    "alpha": 1000.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "type": "dynamic",
}
#: name -> HunYuanDenseV1Config fields over :func:`hunyuan_config`'s
CONFIGS: dict[str, dict[str, Any]] = {
    "ntk-alpha-biases-tied": {},
    "plain-rope-untied": {
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
}


def hunyuan_config(**overrides: Any) -> Any:
    """A 2-layer, hidden-64 Hunyuan config with the SmolLM2 vocabulary, the released
    checkpoints' NTK-alpha RoPE, q/k/v/o biases and a tied head."""
    from transformers import HunYuanDenseV1Config

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "head_dim": 16,
        "attention_bias": True,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "rope_scaling": NTK_ALPHA,
    }
    fields.update(overrides)
    # copies: the config standardizes its RoPE dict in place
    fields = {key: dict(v) if isinstance(v, dict) else v for key, v in fields.items()}
    return HunYuanDenseV1Config(**fields)


def write_checkpoint(directory: Path, seed: int = 7, **overrides: Any) -> Path:
    return save_tiny_checkpoint(hunyuan_config(**overrides), directory, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_hunyuan"))


def build(config: Any, dtype: torch.dtype = torch.float32) -> HunYuanDenseV1ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=dtype)
    return HunYuanDenseV1ForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    directory = model_dir if not CONFIGS[name] else write_checkpoint(tmp_path, **CONFIGS[name])
    check_parity(directory, TOKEN_PROMPTS, atol=1e-4)


def test_norms_before_rope_would_not_match(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parity test can fail on the order: the same model normalizing q and k before
    RoPE (as Qwen3 does) is off HF's logits."""

    def norms_first(self, positions, hidden_states, ctx):
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = self.query_layernorm(q.reshape(len(positions), self.num_heads, self.head_dim))
        k = self.key_layernorm(k.reshape(len(positions), self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))

    runner = Runner(model_dir)
    prompt = TOKEN_PROMPTS[0]
    tables = allocate_block_tables([len(prompt)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    monkeypatch.setattr(HunYuanAttention, "forward", norms_first)
    logits = runner.step([prompt], [len(prompt)], tables)
    assert (logits - hf_logits(load_hf(model_dir), prompt)).abs().max() > 1e-3


def test_the_config_is_read(model_dir: Path) -> None:
    model = Runner(model_dir).model
    attn = model.model.layers[1].self_attn
    assert isinstance(attn, HunYuanAttention)
    assert attn.query_layernorm.weight.shape == attn.key_layernorm.weight.shape == (16,)
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    assert model.model.layers[1].mlp.gate_up_proj.bias is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert attn.attn.backend.sliding_window is None
    base = attn.rotary_emb.cos_cache[1, 1].acos()  # angle of pair 1 at position 1
    assert base.item() == pytest.approx((1e4 * 1000 ** (16 / 14)) ** (-2 / 16), rel=1e-4)


# -- NTK-alpha RoPE ---------------------------------------------------------------------------


def test_ntk_alpha_tables_are_hf_hunyuans() -> None:
    """The rotary layer's ``ntk_alpha`` type: HF's Hunyuan inverse frequencies and cos/sin
    bit for bit (a base of ``rope_theta * alpha ** (D / (D - 2))``), and not the unscaled
    ones: HF's own logits move without the alpha."""
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import (
        HunYuanDenseV1RotaryEmbedding,
    )

    config = hunyuan_config(max_position_embeddings=64)
    hf_rotary = HunYuanDenseV1RotaryEmbedding(config)
    assert hf_rotary.rope_type == "ntk_alpha"
    rotary = build(config).model.layers[0].self_attn.rotary_emb
    params = {"rope_type": "ntk_alpha", "rope_theta": 10000.0, "alpha": 1000.0}
    assert ntk_alpha_base(16, params) == 10000.0 * 1000.0 ** (16 / 14)
    standalone = RotaryEmbedding(16, 64, params)
    positions = torch.arange(64)
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    for table in (rotary, standalone):
        assert torch.equal(table.cos_cache, cos[0, :, :8])
        assert torch.equal(table.sin_cache, sin[0, :, :8])
    plain = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    assert (plain.cos_cache - rotary.cos_cache).abs().max() > 0.1


def test_ntk_alpha_needs_a_positive_alpha() -> None:
    for alpha in (None, 0, -2.0, True):
        with pytest.raises(ValueError, match="rope_type 'ntk_alpha' needs a positive alpha"):
            RotaryEmbedding(16, 8, {"rope_type": "ntk_alpha", "rope_theta": 1e4, "alpha": alpha})


# -- refused options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_type 'dynamic' without alpha",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            None,  # a type the rotary tables implement: the control case
        ),
        ({"rope_scaling": {"type": "llama4", "factor": 2.0}}, "rope_type 'llama4'"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 is not supported"),
        ({"use_cla": True}, "use_cla True is not supported"),
        ({"use_qk_norm": False}, "use_qk_norm False is not supported"),
    ],
    ids=["hidden_act", "dynamic", "yarn", "llama4", "partial", "use_cla", "use_qk_norm"],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], message: str | None) -> None:
    config = hunyuan_config(**overrides)
    if message is None:
        build(config)
        return
    with pytest.raises(ValueError, match=message):
        build(config)


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    with torch.device("meta"):
        model = build(hunyuan_config(), torch.bfloat16)
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


def test_each_rank_loads_whole_head_norms(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two simulated ranks: the per-head q/k norms are whole on each, every parameter
    fills."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.self_attn.key_layernorm.weight"
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = build(config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        assert torch.equal(model.get_parameter(name), tensors[name])


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dir: Path) -> None:
    """Two real ranks: half the heads (one KV head each, normalized after RoPE by whole
    norms) and half the MLP columns each; HF's greedy tokens."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
