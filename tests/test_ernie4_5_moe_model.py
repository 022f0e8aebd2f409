"""``Ernie4_5_MoeForCausalLM`` (ERNIE-4.5-21B-A3B / 300B-A47B) against HF transformers on tiny
random float32 checkpoints.

Each checkpoint has 4 layers of hidden 64, 4 heads and 2 KV heads of 16 (interleaved
float32 RoPE, ERNIE 4.5 dense's) and a mixture of 8 SwiGLU experts of 32 (top 2) in some
layers; the router weights are scaled up (so that the softmax is far from uniform), the
routers' ``e_score_correction_bias`` is randomized (it moves the choice of experts) and the
norm weights and biases are randomized. The default checkpoint has ``use_bias`` (q, k, v, o,
the dense MLPs, the shared experts and the LM head), a tied head, two shared experts and
MoE blocks in layers 1 and 2 only (``moe_layer_start_index`` 1, ``moe_layer_end_index`` 2);
a second has no biases, an untied head, no shared experts and MoE blocks in every second
layer (``moe_layer_interval`` 2: layers 1 and 3).

Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix), and must
not without the correction bias; greedy tokens through ``LLM`` must be HF's ``generate``'s for
prompts longer than a KV block, with and without chunked prefill, and on two
tensor-parallel ranks.
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
from chassis.builtin_plugins.models.ernie4_5 import Ernie4_5Attention
from chassis.builtin_plugins.models.ernie4_5_moe import Ernie4_5_MoeBlock, Ernie4_5_MoeForCausalLM
from chassis.builtin_plugins.models.llama import LlamaMLP
from chassis.core import parallel_state
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

#: name -> Ernie4_5_MoeConfig fields over :func:`ernie_moe_config`'s
CONFIGS: dict[str, dict[str, Any]] = {
    "biases-tied-shared-start-end": {},
    "untied-no-shared-interval": {
        "use_bias": False,
        "tie_word_embeddings": False,
        "moe_num_shared_experts": 0,
        "moe_layer_start_index": 0,
        "moe_layer_end_index": -1,
        "moe_layer_interval": 2,
    },
}
#: how much the router weights are scaled over HF's random initialization
ROUTER_SCALE = 40.0


def ernie_moe_config(**overrides: Any) -> Any:
    """A 4-layer, hidden-64 ERNIE 4.5 MoE config with the SmolLM2 vocabulary (see the module
    docstring)."""
    from transformers import Ernie4_5_MoeConfig

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "num_hidden_layers": 4,
        "use_bias": True,
        "tie_word_embeddings": True,
        "moe_num_experts": 8,
        "moe_k": 2,
        "moe_intermediate_size": 32,
        "moe_num_shared_experts": 2,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 2,
        "moe_layer_interval": 1,
    }
    fields.update(overrides)
    return Ernie4_5_MoeConfig(**fields)


def write_checkpoint(directory: Path, seed: int = 13, **overrides: Any) -> Path:
    """The tiny checkpoint: router weights scaled by :data:`ROUTER_SCALE`, the correction
    biases (``[1, E]``, which ``save_tiny_checkpoint`` leaves at HF's zeros) randomized."""
    model_dir = save_tiny_checkpoint(ernie_moe_config(**overrides), directory, seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name in tensors:
        if name.endswith(".mlp.gate.weight"):
            tensors[name] = tensors[name] * ROUTER_SCALE
        elif name.endswith(".mlp.moe_statics.e_score_correction_bias"):
            tensors[name] = 0.2 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_ernie_moe"))


def build(config: Any, dtype: torch.dtype = torch.float32) -> Ernie4_5_MoeForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=dtype)
    return Ernie4_5_MoeForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    directory = model_dir if not CONFIGS[name] else write_checkpoint(tmp_path, **CONFIGS[name])
    check_parity(directory, TOKEN_PROMPTS, atol=1e-4)


def test_the_correction_bias_moves_the_choice(model_dir: Path) -> None:
    """With the correction biases zeroed the same model is off HF's logits: the checkpoint's
    biases change which experts run."""
    runner = Runner(model_dir)
    for layer in runner.model.model.layers:
        if isinstance(layer.mlp, Ernie4_5_MoeBlock):
            layer.mlp.moe_statics.e_score_correction_bias.zero_()
    prompt = TOKEN_PROMPTS[0]
    tables = allocate_block_tables([len(prompt)], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    logits = runner.step([prompt], [len(prompt)], tables)
    assert (logits - hf_logits(load_hf(model_dir), prompt)).abs().max() > 1e-3


def test_the_config_is_read(model_dir: Path, tmp_path: Path) -> None:
    model = Runner(model_dir).model
    layers = model.model.layers
    assert [isinstance(layer.mlp, Ernie4_5_MoeBlock) for layer in layers] == [
        False,
        True,
        True,
        False,
    ]
    assert isinstance(layers[0].mlp, LlamaMLP) and layers[0].mlp.gate_up_proj.bias is not None
    assert isinstance(layers[0].self_attn, Ernie4_5Attention)
    block = layers[1].mlp
    assert block.gate.top_k == 2 and block.gate.weight.dtype == torch.float32
    assert block.moe_statics.e_score_correction_bias.shape == (1, 8)
    assert block.moe_statics.e_score_correction_bias.abs().max() > 0
    assert block.experts.w13.shape == (8, 64, 64)
    assert block.shared_experts.gate_up_proj.weight.shape == (128, 64)  # 2 * 2 experts of 32
    assert block.shared_experts.down_proj.bias is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.bias is not None and model.lm_head.bias.abs().max() > 0

    other = build(ernie_moe_config(**CONFIGS["untied-no-shared-interval"]))
    sparse = [isinstance(layer.mlp, Ernie4_5_MoeBlock) for layer in other.model.layers]
    assert sparse == [False, True, False, True]
    assert other.model.layers[1].mlp.shared_experts is None
    assert other.lm_head.bias is None


def test_multi_token_prediction_tensors_are_skipped(model_dir: Path) -> None:
    """The checkpoints' ``mtp*`` tensors (HF ignores them too) load as nothing; every
    parameter still fills, and an HF in-memory ``mlp.gate.moe_statics.`` name is read."""
    from transformers import AutoConfig

    model = build(AutoConfig.from_pretrained(model_dir))
    tensors = load_file(model_dir / "model.safetensors")
    bias = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    renamed = {
        (name.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics.") if name == bias else name): t
        for name, t in tensors.items()
    }
    extra = {
        "model.mtp_block.0.mlp.gate_proj.weight": torch.zeros(4, 4),
        "model.mtp_linear_proj.0.weight": torch.zeros(4, 4),
    }
    for name in extra:
        assert not model.needs_checkpoint_tensor(name)
    filled = model.load_weights([*renamed.items(), *extra.items()])
    assert len(filled) == len(list(model.parameters()))
    assert torch.equal(model.get_parameter(bias), tensors[bias])


# -- refused options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
        ("moe_num_experts", [8, 8], "moe_num_experts"),
        ("moe_k", 9, r"moe_k 9 must be in \[1, 8\]"),
        ("moe_layer_start_index", [1, 1], "moe_layer_start_index"),
        ("moe_layer_interval", 0, "moe_layer_interval 0 is not supported"),
        ("partial_rotary_factor", 0.5, r"partial_rotary_factor 0\.5 is not supported"),
    ],
)
def test_unsupported_options_are_refused(field: str, value: Any, message: str) -> None:
    if field == "partial_rotary_factor":
        config = ernie_moe_config(
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, field: value}
        )
    else:
        config = ernie_moe_config()
        config.__dict__[field] = value  # past the config's own type check
    with pytest.raises(ValueError, match=message):
        build(config)


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    with torch.device("meta"):
        model = build(ernie_moe_config(), torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32


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
    """Two simulated ranks: every parameter fills; the router and its correction bias are
    whole, the LM head's bias holds the rank's vocabulary rows as its weight does."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    half = config.vocab_size // 2
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = build(config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        for name in (
            "model.layers.2.mlp.gate.weight",
            "model.layers.2.mlp.moe_statics.e_score_correction_bias",
        ):
            assert torch.equal(model.get_parameter(name), tensors[name])
        expected = tensors["lm_head.bias"][rank * half : (rank + 1) * half]
        assert torch.equal(model.lm_head.bias, expected)


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
        experts = model.model.layers[2].mlp.experts
        assert (experts.expert_start, experts.num_local_experts) == (4 * rank, 4)
        if rank == 1:
            assert torch.equal(
                experts.w2[1], tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
            )


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("engine", [{}, {"enable_expert_parallel": True}], ids=["tp", "ep"])
def test_two_ranks_match_transformers(model_dir: Path, engine: dict[str, Any]) -> None:
    """Two real ranks: one KV head each, half of every expert's, the shared experts' and the
    dense MLPs' columns, the router whole, the tied head and its bias split by vocabulary
    rows; HF's greedy tokens. With
    ``enable_expert_parallel`` each rank holds 4 whole experts instead."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert (
        chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2, **engine) == expected
    )
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
