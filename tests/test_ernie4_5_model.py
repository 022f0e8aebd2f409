"""``Ernie4_5ForCausalLM`` against HF transformers on tiny random float32 checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16 and norm weights
randomized around 1. The default one has ``use_bias`` (a bias on q, k, v, o, gate, up and
down, all randomized) and the LM head tied to the embedding, as the released checkpoints
tie it; a second one has no biases, an untied head and YaRN scaling (whose attention factor
scales HF's float32 tables). RoPE is interleaved in both. Logits must match HF's (batched
prefill, a decode, a chunk over a cached prefix), and must not with Llama's rotate-half
pairing in its place; greedy tokens through ``LLM`` must be HF's ``generate``'s for prompts
longer than a KV block, with and without chunked prefill, and on two tensor-parallel ranks.
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
from chassis.builtin_plugins.models import ernie4_5
from chassis.builtin_plugins.models.ernie4_5 import (
    Ernie4_5Attention,
    Ernie4_5ForCausalLM,
    rotate_ernie,
)
from chassis.core.layers.rotary import RotaryEmbedding
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}
#: name -> Ernie4_5Config fields over :func:`ernie_config`'s
CONFIGS: dict[str, dict[str, Any]] = {
    "biases-tied": {},
    "untied-yarn": {"use_bias": False, "tie_word_embeddings": False, "rope_parameters": YARN},
}


def ernie_config(**overrides: Any) -> Any:
    """A 2-layer, hidden-64 ERNIE 4.5 config with the SmolLM2 vocabulary, ``use_bias`` and a
    tied head (``head_dim`` 16: the config's default is 128, whatever the hidden size)."""
    from transformers import Ernie4_5Config

    fields = {
        **TINY_CONFIG_FIELDS,
        "head_dim": 16,
        "use_bias": True,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    fields.update(overrides)
    # copies: the config standardizes its RoPE dict in place
    fields = {key: dict(v) if isinstance(v, dict) else v for key, v in fields.items()}
    return Ernie4_5Config(**fields)


def write_checkpoint(directory: Path, seed: int = 5, **overrides: Any) -> Path:
    return save_tiny_checkpoint(ernie_config(**overrides), directory, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_ernie4_5"))


def build(config: Any, dtype: torch.dtype = torch.float32) -> Ernie4_5ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=dtype)
    return Ernie4_5ForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    directory = model_dir if not CONFIGS[name] else write_checkpoint(tmp_path, **CONFIGS[name])
    check_parity(directory, TOKEN_PROMPTS, atol=1e-4)


def test_the_rotate_half_layout_would_not_match(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parity test can fail on the layout: the same model rotating Llama's halves
    instead of interleaved pairs is far from HF's logits."""

    def rotate_halves(rotary: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor):
        cos = rotary.cos_cache[positions].unsqueeze(1)
        sin = rotary.sin_cache[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    runner = Runner(model_dir)
    prompt = TOKEN_PROMPTS[0]
    tables = allocate_block_tables([len(prompt)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    monkeypatch.setattr(ernie4_5, "rotate_ernie", rotate_halves)
    logits = runner.step([prompt], [len(prompt)], tables)
    assert (logits - hf_logits(load_hf(model_dir), prompt)).abs().max() > 1e-2


def test_the_config_is_read(model_dir: Path) -> None:
    """``use_bias`` puts a bias on all seven projections; the head shares the embedding."""
    model = Runner(model_dir).model
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn, Ernie4_5Attention)
    assert layer.self_attn.rotary_emb.interleaved
    for module in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert module.bias is not None and module.bias.abs().sum() > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert layer.self_attn.attn.backend.sliding_window is None
    untied = build(ernie_config(use_bias=False, tie_word_embeddings=False))
    assert untied.model.layers[0].mlp.down_proj.bias is None
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_hf_ernie_rope(dtype: torch.dtype) -> None:
    """:func:`rotate_ernie` equals HF's ``apply_rotary_pos_emb`` with HF's tables bit for
    bit, in bfloat16 too (float32 tables, q and k cast up and back once)."""
    from transformers.models.ernie4_5.modeling_ernie4_5 import (
        Ernie4_5RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = ernie_config(max_position_embeddings=64, rope_parameters=YARN)
    rotary = build(config).model.layers[0].self_attn.rotary_emb
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 5, 17, 63, 2])
    q = torch.randn(6, 4, 16, dtype=dtype)
    k = torch.randn(6, 2, 16, dtype=dtype)
    cos, sin = Ernie4_5RotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(rotate_ernie(rotary, positions, q), hf_q[0].transpose(0, 1))
    assert torch.equal(rotate_ernie(rotary, positions, k), hf_k[0].transpose(0, 1))


# -- refused options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'dynamic' is not supported",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            r"partial_rotary_factor 0\.5 is not supported",
        ),
    ],
    ids=["hidden_act", "rope_type", "partial_rotary_factor"],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(ernie_config(**overrides))


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    with torch.device("meta"):
        model = build(ernie_config(), torch.bfloat16)
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


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dir: Path) -> None:
    """Two real ranks: half the heads (one KV head each), half the MLP columns and of every
    column-parallel bias, the o/down biases added once, half the tied vocabulary each; HF's
    greedy tokens."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
