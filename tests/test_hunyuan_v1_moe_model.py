"""``HunYuanMoEV1ForCausalLM`` (Hunyuan-A13B) against HF transformers on tiny random float32
checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16, and in every layer
a mixture of 8 SwiGLU experts of ``intermediate_size`` 32 plus the ungated shared MLP; the
router weights are scaled up (so that the softmax is far from uniform and the choice of
experts matters) and the norm weights (layer norms and the per-head q/k norms, applied after
RoPE) randomized around 1. The default checkpoint has the released checkpoints' NTK-alpha
RoPE (``{"type": "dynamic", "alpha": 1000, ...}``), q/k/v/o biases, an untied head and a
top-k per layer (``moe_topk`` ``[2, 3]``, as the released configs give a list); a second has
plain RoPE, no biases, a tied head and one top-k.

Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix), and must
not without the top-k renormalization or the shared MLP; greedy tokens through ``LLM`` must
be HF's ``generate``'s for prompts longer than a KV block, with and without chunked
prefill, and on two tensor-parallel ranks.
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
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner, check_parity, hf_logits, load_hf
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.hunyuan_v1_dense import HunYuanAttention
from chassis.builtin_plugins.models.hunyuan_v1_moe import (
    HunYuanMoeBlock,
    HunYuanMoEV1ForCausalLM,
    HunYuanRouter,
)
from chassis.core import parallel_state
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

#: the released checkpoints' rope_scaling, as config.json has it
NTK_ALPHA = {
    "alpha": 1000.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "type": "dynamic",
}
#: name -> HunYuanMoEV1Config fields over :func:`hunyuan_moe_config`'s
CONFIGS: dict[str, dict[str, Any]] = {
    "ntk-alpha-biases-topk-per-layer": {},
    "plain-rope-tied-one-topk": {
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "moe_topk": 2,
    },
}
#: how much the router weights are scaled over HF's random initialization
ROUTER_SCALE = 40.0


def hunyuan_moe_config(**overrides: Any) -> Any:
    """A 2-layer, hidden-64 Hunyuan MoE config with the SmolLM2 vocabulary (see the module
    docstring)."""
    from transformers import HunYuanMoEV1Config

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "head_dim": 16,
        "intermediate_size": 32,
        "num_experts": 8,
        "moe_topk": [2, 3],
        "attention_bias": True,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rope_scaling": NTK_ALPHA,
    }
    fields.update(overrides)
    # copies: the config standardizes its RoPE dict in place
    fields = {key: dict(v) if isinstance(v, dict) else v for key, v in fields.items()}
    return HunYuanMoEV1Config(**fields)


def write_checkpoint(directory: Path, seed: int = 11, **overrides: Any) -> Path:
    """The tiny checkpoint, router weights scaled by :data:`ROUTER_SCALE`."""
    model_dir = save_tiny_checkpoint(hunyuan_moe_config(**overrides), directory, seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(".mlp.gate.wg.weight"):
            tensors[name] = tensors[name] * ROUTER_SCALE
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_hunyuan_moe"))


def build(config: Any, dtype: torch.dtype = torch.float32) -> HunYuanMoEV1ForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=dtype)
    return HunYuanMoEV1ForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    directory = model_dir if not CONFIGS[name] else write_checkpoint(tmp_path, **CONFIGS[name])
    check_parity(directory, TOKEN_PROMPTS, atol=1e-4)


def _router_without_renormalization(self, x):
    probs = torch.softmax(torch.nn.functional.linear(x.float(), self.wg.weight), dim=-1)
    return torch.topk(probs, self.top_k, dim=-1)


def _block_without_shared_mlp(self, x):
    weights, ids = self.gate(x)
    return self.experts(x, weights, ids)


@pytest.mark.parametrize(
    ("cls", "forward"),
    [
        (HunYuanRouter, _router_without_renormalization),
        (HunYuanMoeBlock, _block_without_shared_mlp),
    ],
    ids=["no-renormalization", "no-shared-mlp"],
)
def test_the_parity_check_sees_the_moe_details(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, cls: type, forward: Any
) -> None:
    """The same model without the top-k renormalization, or without the shared MLP, is off
    HF's logits: the checkpoint exercises both."""
    runner = Runner(model_dir)
    prompt = TOKEN_PROMPTS[0]
    tables = allocate_block_tables([len(prompt)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    monkeypatch.setattr(cls, "forward", forward)
    logits = runner.step([prompt], [len(prompt)], tables)
    assert (logits - hf_logits(load_hf(model_dir), prompt)).abs().max() > 1e-3


def test_the_config_is_read(model_dir: Path) -> None:
    model = Runner(model_dir).model
    for layer_idx, top_k in ((0, 2), (1, 3)):
        layer = model.model.layers[layer_idx]
        assert isinstance(layer.self_attn, HunYuanAttention)
        block = layer.mlp
        assert isinstance(block, HunYuanMoeBlock)
        assert block.gate.top_k == block.experts.top_k == top_k
        assert block.gate.wg.weight.dtype == torch.float32
        assert block.gate.wg.weight.shape == (8, 64)
        assert block.experts.w13.shape == (8, 64, 64) and block.experts.w2.shape == (8, 64, 32)
        assert block.shared_mlp.gate_up_proj.weight.shape == (64, 64)
        assert block.shared_mlp.gate_up_proj.bias is None
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    assert model.lm_head.weight is not model.model.embed_tokens.weight


# -- refused options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' without"),
        ({"use_cla": True}, "use_cla True is not supported"),
        ({"use_mixed_mlp_moe": False}, "use_mixed_mlp_moe False is not supported"),
        ({"num_shared_expert": [1, 2]}, "num_shared_expert 2 is not supported"),
        ({"moe_intermediate_size": 64}, "moe_intermediate_size 64 is not supported"),
        ({"moe_topk": [2, 9]}, r"moe_topk 9 must be in \[1, 8\]"),
        ({"moe_topk": [2, 2, 2]}, "moe_topk has 3 entries"),
        ({"moe_intermediate_size": [32, 32], "num_shared_expert": 1}, None),  # the control
    ],
    ids=[
        "hidden_act",
        "dynamic",
        "use_cla",
        "mixed",
        "shared",
        "moe_inter",
        "topk",
        "topk-len",
        "accepted",
    ],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], message: str | None) -> None:
    if "rope_scaling" in overrides:  # standardized by the config
        config = hunyuan_moe_config(**overrides)
    else:
        config = hunyuan_moe_config()
        for field, value in overrides.items():  # set afterwards: the config checks types
            setattr(config, field, value)
    if message is None:
        build(config)
        return
    with pytest.raises(ValueError, match=message):
        build(config)


def test_experts_per_layer_are_refused() -> None:
    config = hunyuan_moe_config()
    config.__dict__["num_experts"] = [8, 8]  # past the config's own type check
    with pytest.raises(ValueError, match="num_experts"):
        build(config)


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    with torch.device("meta"):
        model = build(hunyuan_moe_config(), torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert model.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32


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


def test_each_rank_loads_its_share(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two simulated ranks: every parameter fills; the router and the q/k norms are whole,
    the experts and the shared MLP hold half their intermediate columns."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = build(config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        for name in (
            "model.layers.1.mlp.gate.wg.weight",
            "model.layers.1.self_attn.key_layernorm.weight",
        ):
            assert torch.equal(model.get_parameter(name), tensors[name])
        block = model.model.layers[1].mlp
        down = tensors["model.layers.1.mlp.experts.5.down_proj.weight"]
        assert torch.equal(block.experts.w2[5], down[:, rank * 16 : (rank + 1) * 16])
        assert block.shared_mlp.down_proj.weight.shape == (64, 16)


def test_each_expert_parallel_rank_loads_its_experts(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated expert-parallel ranks: each holds 4 whole experts, reads only their
    tensors, and every parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    for rank in (0, 1):
        group = parallel_state.TensorParallelGroup(rank, 2, True)
        monkeypatch.setattr(parallel_state, "_GROUP", group)
        model = build(config)
        wanted = {n: t for n, t in tensors.items() if model.needs_checkpoint_tensor(n)}
        assert len(tensors) - len(wanted) == 4 * 3 * 2
        assert len(model.load_weights(wanted.items())) == len(list(model.parameters()))
        experts = model.model.layers[1].mlp.experts
        assert (experts.expert_start, experts.num_local_experts) == (4 * rank, 4)
        if rank == 1:
            assert torch.equal(
                experts.w2[1], tensors["model.layers.1.mlp.experts.5.down_proj.weight"]
            )


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("engine", [{}, {"enable_expert_parallel": True}], ids=["tp", "ep"])
def test_two_ranks_match_transformers(model_dir: Path, engine: dict[str, Any]) -> None:
    """Two real ranks: one KV head each (normalized after RoPE by whole norms), half of
    every expert's and the shared MLP's columns, the router whole; HF's greedy tokens. With
    ``enable_expert_parallel`` each rank holds 4 whole experts instead."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert (
        chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, **engine) == expected
    )
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
