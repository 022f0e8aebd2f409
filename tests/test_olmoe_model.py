"""OLMoE against HF transformers on tiny random float32 checkpoints.

The main checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16, and in every
layer 8 experts of intermediate 32 of which each token takes 2, with OLMoE-1B-7B's
``norm_topk_prob: false``; ``clip_qkv`` 1.5 clips some q, k and v values (checked: HF's own
logits move without it). Its norm weights (the whole-projection q/k norms included) are
randomized around 1, so a per-head q/k norm, a post-norm layout or a norm loaded into the
wrong place changes the logits. A second checkpoint has ``norm_topk_prob: true``, biases on
q, k, v and o, no clamp and tied embeddings. Logits must match HF's (batched prefill, a
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
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.llama import LlamaDecoderLayer
from chassis.builtin_plugins.models.olmoe import OlmoeForCausalLM, OlmoeProjectionRMSNorm
from chassis.builtin_plugins.models.sparse_moe import SparseMoeBlock
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

CLIP_QKV = 1.5


def tiny_config(**overrides: Any) -> Any:
    from transformers import OlmoeConfig

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "tie_word_embeddings": False,
        "intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "clip_qkv": CLIP_QKV,
    }
    return OlmoeConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_olmoe"), seed=3)


def build(config: Any) -> OlmoeForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return OlmoeForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_the_clamp_changes_the_logits(model_dir: Path) -> None:
    """The parity test can fail: HF's logits without ``clip_qkv`` are far from those with
    it, on the same weights."""
    hf_model = load_hf(model_dir)
    clipped = hf_logits(hf_model, TOKEN_PROMPTS[0])
    hf_model.config.clip_qkv = None
    assert (hf_logits(hf_model, TOKEN_PROMPTS[0]) - clipped).abs().max() > 0.05


def test_renormalized_routing_with_biases_and_tied_embeddings(tmp_path: Path) -> None:
    config = tiny_config(
        norm_topk_prob=True, attention_bias=True, clip_qkv=None, tie_word_embeddings=True
    )
    model_dir = save_tiny_checkpoint(config, tmp_path, seed=5)
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)


def test_the_config_is_read(model_dir: Path) -> None:
    model = Runner(model_dir).model
    layer = model.model.layers[1]
    # pre-norm layers, as Llama's
    assert isinstance(layer, LlamaDecoderLayer) and hasattr(layer, "input_layernorm")
    # one norm over all 4 q heads and one over both KV heads, not per head
    attn = layer.self_attn
    assert isinstance(attn.q_norm, OlmoeProjectionRMSNorm)
    assert (attn.q_norm.weight.shape, attn.k_norm.weight.shape) == ((64,), (32,))
    assert attn.clip_qkv == CLIP_QKV
    assert isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.shared_expert is None
    experts = layer.mlp.experts
    assert (experts.num_experts, experts.top_k, experts.renormalize) == (8, 2, False)
    assert experts.round_weights_to_model_dtype
    assert tuple(experts.w13.shape) == (8, 64, 64)


def test_projection_norm_is_hf_olmoe_norm_in_bfloat16() -> None:
    """Cast to bfloat16, then scale, as HF's ``OlmoeRMSNorm``: equal bit for bit."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 3
    ours = OlmoeProjectionRMSNorm(64, 1e-5).to(torch.bfloat16)
    hf = OlmoeRMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
        assert torch.equal(ours(x), hf(x))


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        build(tiny_config(hidden_act="gelu"))
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        build(tiny_config(rope_parameters=rope))
    with pytest.raises(ValueError, match="config head_dim 32 is not supported for OLMoE"):
        build(tiny_config(head_dim=32))


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = OlmoeForCausalLM(tiny_config(), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_each_rank_loads_its_share(model_dir: Path) -> None:
    """Two simulated tensor-parallel ranks: ``q_norm``/``k_norm`` hold their heads'
    columns, each expert its intermediate columns; with expert parallelism, whole experts
    (4 each). Every parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    prefix = "model.layers.1."
    for rank in (0, 1):
        with simulated_rank(rank, 2, expert_parallel=False):
            model = build(config)
            assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        q_norm = tensors[prefix + "self_attn.q_norm.weight"]
        k_norm = tensors[prefix + "self_attn.k_norm.weight"]
        got = model.get_parameter
        assert torch.equal(got(prefix + "self_attn.q_norm.weight"), q_norm[32 * rank :][:32])
        assert torch.equal(got(prefix + "self_attn.k_norm.weight"), k_norm[16 * rank :][:16])
        up = tensors[prefix + "mlp.experts.6.up_proj.weight"]
        w13 = got(prefix + "mlp.experts.w13")
        assert torch.equal(w13[6, 16:], up[16 * rank :][:16])
        with simulated_rank(rank, 2):
            model = build(config)
            assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        down = tensors[prefix + f"mlp.experts.{4 * rank + 1}.down_proj.weight"]
        assert torch.equal(model.get_parameter(prefix + "mlp.experts.w2")[1], down)


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


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor", "expert"])
def test_two_ranks_match_transformers(model_dir: Path, expert_parallel: bool) -> None:
    """Two real ranks: half the heads (one KV head each), the q/k norms' mean square over
    the whole projections (an all-reduce per layer), and half of every expert's columns,
    or with ``--enable-expert-parallel`` 4 whole experts each. HF's greedy tokens."""
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
