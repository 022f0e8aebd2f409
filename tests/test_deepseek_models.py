"""DeepSeek-V2 and DeepSeek-V3 against HF transformers on tiny random float32 checkpoints.

Each checkpoint has 2 layers of hidden 64 and 4 heads: layer 0 a dense MLP
(``first_k_dense_replace`` 1), layer 1 a mixture of 8 experts (top 2) with shared experts;
norm weights (``q_a_layernorm`` and ``kv_a_layernorm`` included) and biases randomized.
The variants cover every structural feature:

- ``v2_lite``: V2 with ``q_proj`` (no ``q_lora_rank``), ``greedy`` routing, biases on
  ``kv_a_proj_with_mqa``/``o_proj`` (``attention_bias``) and on the dense and shared MLPs
  (``mlp_bias``), values wider than keys (``v_head_dim`` 32 > 16 + 8: q and k padded);
- ``v2``: V2 with the low-rank q path, ``group_limited_greedy`` (1 of 4 groups of 2:
  with fewer groups than ``num_experts_per_tok`` the limit binds), DeepSeek
  YaRN (``mscale`` 0.9 / ``mscale_all_dim`` 0.7: both the cos/sin factor and the softmax
  scale correction), ``routed_scaling_factor`` 1.5;
- ``v3``: V3 ``noaux_tc`` (sigmoid scores, a randomized ``e_score_correction_bias``, 1 of 2
  groups, ``norm_topk_prob``, ``routed_scaling_factor`` 2.5), YaRN, interleaved RoPE;
- ``v3_halves``: V3 with ``rope_interleave`` false, ``q_proj``, one group, no
  ``norm_topk_prob``.

Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix); greedy
tokens through ``LLM`` must be HF's ``generate``'s for prompts longer than a KV block, with
and without chunked prefill, and on two tensor-parallel ranks (also expert-parallel).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_models_parity
import torch
from fixtures_models import TINY_CONFIG_FIELDS, new_kv_caches, save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity, hf_logits, load_hf
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    MultiHeadLatentAttention,
    mscale_correction,
)
from chassis.builtin_plugins.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Router
from chassis.core import parallel_state
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
}

COMMON: dict[str, Any] = {
    **TINY_CONFIG_FIELDS,
    "num_key_value_heads": 4,  # MLA has a key and a value per head
    "tie_word_embeddings": False,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_shared_experts": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "v2_lite": (
        "v2",
        {
            "q_lora_rank": None,
            "topk_method": "greedy",
            "attention_bias": True,
            "mlp_bias": True,
            "v_head_dim": 32,
        },
    ),
    "v2": (
        "v2",
        {
            "q_lora_rank": 24,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "rope_parameters": YARN,
        },
    ),
    "v3": (
        "v3",
        {
            "q_lora_rank": 24,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rope_parameters": YARN,
        },
    ),
    "v3_halves": (
        "v3",
        {
            "q_lora_rank": None,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "rope_interleave": False,
        },
    ),
}

CORRECTION_BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def tiny_config(variant: str, **overrides: Any) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    version, fields = VARIANTS[variant]
    config_cls = DeepseekV2Config if version == "v2" else DeepseekV3Config
    return config_cls(**{**COMMON, **fields, **overrides})


def write_checkpoint(variant: str, directory: Path, seed: int = 3, **overrides: Any) -> Path:
    """The tiny checkpoint; V3's ``e_score_correction_bias`` (a buffer HF initializes to 0,
    which ``save_tiny_checkpoint`` leaves alone) randomized so that it moves the choice."""
    model_dir = save_tiny_checkpoint(tiny_config(variant, **overrides), directory, seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    if CORRECTION_BIAS in tensors:
        generator = torch.Generator().manual_seed(seed)
        tensors[CORRECTION_BIAS] = 0.2 * torch.randn(8, generator=generator)
        save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {v: write_checkpoint(v, tmp_path_factory.mktemp(f"tiny_{v}")) for v in VARIANTS}


class MlaRunner(Runner):
    """``Runner`` with the KV cache sized as the engine sizes it: by the model's
    ``hf_config`` (one KV head, the latent), not HF's."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model_dir, dtype)
        num_blocks, block_size = test_models_parity.NUM_BLOCKS, test_models_parity.BLOCK_SIZE
        self.kv_caches = new_kv_caches(self.model.hf_config, num_blocks, block_size, dtype)


def build(variant: str, **overrides: Any) -> Any:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    version = VARIANTS[variant][0]
    model_cls = DeepseekV2ForCausalLM if version == "v2" else DeepseekV3ForCausalLM
    return model_cls(tiny_config(variant, **overrides), ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(
    model_dirs: dict[str, Path], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    monkeypatch.setattr(test_models_parity, "Runner", MlaRunner)
    check_parity(model_dirs[variant], TOKEN_PROMPTS, atol=1e-4)


def test_the_correction_bias_and_the_yarn_scale_change_the_logits(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The parity tests can fail: HF's logits move when V3's ``e_score_correction_bias`` is
    zeroed or when ``mscale_all_dim`` is dropped (no softmax scale correction)."""
    reference = hf_logits(load_hf(model_dirs["v3"]), TOKEN_PROMPTS[0])
    unbiased = write_checkpoint("v3", tmp_path / "unbiased")
    tensors = load_file(unbiased / "model.safetensors")
    tensors[CORRECTION_BIAS] = torch.zeros(8)
    save_file(tensors, unbiased / "model.safetensors", metadata={"format": "pt"})
    assert (hf_logits(load_hf(unbiased), TOKEN_PROMPTS[0]) - reference).abs().max() > 1e-3
    yarn = {k: v for k, v in YARN.items() if k != "mscale_all_dim"}
    plain = write_checkpoint("v3", tmp_path / "plain", rope_parameters=yarn)
    assert (hf_logits(load_hf(plain), TOKEN_PROMPTS[0]) - reference).abs().max() > 1e-3


def test_the_configs_are_read(model_dirs: dict[str, Path]) -> None:
    model = MlaRunner(model_dirs["v2"]).model
    attention = model.model.layers[0].self_attn
    assert isinstance(attention, MultiHeadLatentAttention)
    assert not hasattr(attention, "q_proj") and attention.q_b_proj.weight.shape == (4 * 24, 24)
    # qk_head_dim 24, mscale_all_dim's correction (0.1 * 0.7 * ln 4 + 1) ** 2
    assert attention.attn.backend.scale == pytest.approx(24**-0.5 * (0.07 * 1.3862944 + 1) ** 2)
    assert mscale_correction({"rope_type": "default", "mscale_all_dim": 1.0}) == 1.0
    assert model.model.layers[0].self_attn.rotary_emb.interleaved
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekMoE"
    # the cache: one KV head, the latent (kv_lora_rank 16 + rope 8); HF's config kept
    lite = MlaRunner(model_dirs["v2_lite"]).model
    assert (lite.hf_config.head_dim, lite.hf_config.num_key_value_heads) == (24, 1)
    assert (model.hf_config.head_dim, model.hf_config.num_key_value_heads) == (24, 1)
    assert tiny_config("v2").head_dim == 8
    halves = MlaRunner(model_dirs["v3_halves"]).model
    assert not halves.model.layers[0].self_attn.rotary_emb.interleaved
    router = MlaRunner(model_dirs["v3"]).model.model.layers[1].mlp.gate
    assert router.weight.dtype == torch.float32
    assert router.e_score_correction_bias.abs().max() > 0


def test_v3_routing_stays_in_the_chosen_groups() -> None:
    """1 of 2 groups of 4 experts: both chosen experts of a token are in one group; the
    weights are the unbiased sigmoid scores, renormalized, times the scaling factor."""
    model = build("v3")
    router: DeepseekV3Router = model.model.layers[1].mlp.gate
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_()
        x = torch.randn(64, 64)
        weights, ids = router(x)
    assert torch.equal(ids[:, 0] // 4, ids[:, 1] // 4)
    scores = torch.sigmoid(x @ router.weight.T).gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * scores / scores.sum(-1, keepdim=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_models_build_on_a_non_cpu_default_device(variant: str) -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device; in a
    bfloat16 model the router stays float32 (as HF keeps it)."""
    version, _ = VARIANTS[variant]
    model_cls = DeepseekV2ForCausalLM if version == "v2" else DeepseekV3ForCausalLM
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"), torch_default_dtype(torch.bfloat16):
        model = model_cls(tiny_config(variant), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16


@contextlib.contextmanager
def torch_default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "overrides", "field"),
    [
        ("v2", {"hidden_act": "gelu"}, "hidden_act"),
        ("v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("v2", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("v2", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("v2", {"n_group": 3}, "n_group"),
        ("v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("v3", {"topk_method": "greedy"}, "topk_method"),
        ("v3", {"n_group": 8, "topk_group": 1}, "n_group"),
        ("v3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ],
)
def test_unsupported_options_are_refused(
    variant: str, overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        build(variant, **overrides)


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(
    model_dirs: dict[str, Path], variant: str, engine: dict[str, Any]
) -> None:
    """All prompts in one ``generate``, on the CPU's default backend and block size, then
    with prefills chunked to at most 16 tokens over blocks of 4."""
    model_dir = model_dirs[variant]
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


def test_each_rank_loads_its_heads(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks of V2-Lite: 2 of 4 heads each (rows of ``q_proj`` and
    ``kv_b_proj``, columns of ``o_proj``, its bias on rank 0), the latent projection whole;
    every parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dirs["v2_lite"])
    tensors = load_file(model_dirs["v2_lite"] / "model.safetensors")
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    prefix = "model.layers.1.self_attn."
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = DeepseekV2ForCausalLM(config, ctx)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        assert model.hf_config.num_key_value_heads == 1  # the latent: every rank keeps it

        ours = {n: p for n, p in model.named_parameters() if n.startswith(prefix)}
        whole = {n: t for n, t in tensors.items() if n.startswith(prefix)}
        q_rows, kv_rows, o_cols = 2 * 24, 2 * (16 + 32), 2 * 32
        q, kv_b = whole[prefix + "q_proj.weight"], whole[prefix + "kv_b_proj.weight"]
        o, o_bias = whole[prefix + "o_proj.weight"], whole[prefix + "o_proj.bias"]
        assert torch.equal(ours[prefix + "q_proj.weight"], q[rank * q_rows :][:q_rows])
        assert torch.equal(ours[prefix + "kv_b_proj.weight"], kv_b[rank * kv_rows :][:kv_rows])
        assert torch.equal(ours[prefix + "o_proj.weight"], o[:, rank * o_cols :][:, :o_cols])
        assert torch.equal(ours[prefix + "o_proj.bias"], o_bias * (1 - rank))
        for name in (
            "kv_a_proj_with_mqa.weight",
            "kv_a_proj_with_mqa.bias",
            "kv_a_layernorm.weight",
        ):
            assert torch.equal(ours[prefix + name], whole[prefix + name])


@pytest.fixture(scope="module")
def v3_seed_4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The V3 checkpoint both parallel layouts below run: written once, so that
    ``hf_greedy`` (cached per checkpoint files) computes HF's tokens once for both."""
    return write_checkpoint("v3", tmp_path_factory.mktemp("v3_seed_4"), seed=4)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_two_ranks_match_transformers(v3_seed_4_dir: Path, expert_parallel: bool) -> None:
    """Two real ranks of V3 (grouped sigmoid routing, YaRN): half the heads and the
    shared/dense MLP columns each, the router whole, and half of every expert's columns or
    (expert parallel) 4 whole experts each. HF's greedy tokens."""
    model_dir = v3_seed_4_dir
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    engine = {"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel}
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
