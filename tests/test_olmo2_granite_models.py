"""OLMo 2 and Granite against HF transformers on tiny random float32 checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16, norm weights
randomized around 1 (so a per-head q/k norm in place of OLMo 2's whole-projection one, or a
norm loaded into the wrong place, changes the logits). Granite's multipliers are far from 1
(embedding 12, residual 0.22, attention 0.0156, logits scaling 8): a multiplier that were
ignored would change the logits (checked: HF's own logits move when any one is reset to 1).
Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix); greedy
tokens through ``LLM`` must be HF's ``generate``'s, for a batch of prompts of which some are
longer than a KV block, with and without chunked prefill, and on two tensor-parallel ranks.
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
from chassis.builtin_plugins.models.granite import GraniteForCausalLM
from chassis.builtin_plugins.models.olmo2 import Olmo2ForCausalLM, ProjectionRMSNorm
from chassis.core import parallel_state
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

ARCHITECTURES = ("olmo2", "granite")

#: Granite multipliers far enough from 1 that each one changes the logits
GRANITE_MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0156,
    "logits_scaling": 8.0,
}


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A 2-layer, hidden-64 config of ``arch`` (untied LM head) with the SmolLM2 tokenizer's
    vocabulary."""
    from transformers import GraniteConfig, Olmo2Config

    fields: dict[str, Any] = {**TINY_CONFIG_FIELDS, "tie_word_embeddings": False}
    if arch == "olmo2":
        return Olmo2Config(**{**fields, **overrides})
    if arch == "granite":
        return GraniteConfig(**{**fields, **GRANITE_MULTIPLIERS, **overrides})
    raise ValueError(f"unknown architecture {arch!r}")


def write_checkpoint(arch: str, directory: Path, seed: int = 3, **overrides: Any) -> Path:
    return save_tiny_checkpoint(tiny_config(arch, **overrides), directory, seed)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: write_checkpoint(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        for arch in ARCHITECTURES
    }


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dirs[arch], TOKEN_PROMPTS, atol=1e-4)


def test_each_granite_multiplier_changes_the_logits(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The parity test can fail: HF's logits with any one multiplier reset to 1 are far from
    those with the checkpoint's value."""
    reference = hf_logits(load_hf(model_dirs["granite"]), TOKEN_PROMPTS[0])
    for field in GRANITE_MULTIPLIERS:
        model_dir = write_checkpoint("granite", tmp_path / field, **{field: 1.0})
        changed = hf_logits(load_hf(model_dir), TOKEN_PROMPTS[0])
        assert (changed - reference).abs().max() > 0.05, field


def test_the_configs_are_read(model_dirs: dict[str, Path]) -> None:
    olmo2 = Runner(model_dirs["olmo2"]).model
    layer = olmo2.model.layers[0]
    assert isinstance(layer.self_attn.q_norm, ProjectionRMSNorm)
    # one norm over all 4 q heads and one over both KV heads, not per head
    assert layer.self_attn.q_norm.weight.shape == (64,)
    assert layer.self_attn.k_norm.weight.shape == (32,)
    assert not hasattr(layer, "input_layernorm")
    granite = Runner(model_dirs["granite"]).model
    multipliers = granite.multipliers
    assert (multipliers.embedding, multipliers.residual) == (12.0, 0.22)
    assert (multipliers.attention, multipliers.logits_scaling) == (0.0156, 8.0)
    assert granite.model.layers[1].self_attn.attn.backend.scale == 0.0156
    # the names a LoRA adapter or another Llama-based tool looks for
    for model in (olmo2, granite):
        names = {name for name, _ in model.named_parameters()}
        for leaf in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert f"model.layers.1.{leaf}.weight" in names


def test_a_logits_scaling_of_zero_is_refused() -> None:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    with pytest.raises(ValueError, match="logits_scaling is 0"):
        GraniteForCausalLM(tiny_config("granite", logits_scaling=0.0), ctx)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_models_build_on_a_non_cpu_default_device(arch: str) -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    model_cls = Olmo2ForCausalLM if arch == "olmo2" else GraniteForCausalLM
    with torch.device("meta"):
        model = model_cls(tiny_config(arch), ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_projection_norm_is_hf_olmo2_norm_in_bfloat16() -> None:
    """The scale is applied in float32 before the cast, as HF's ``Olmo2RMSNorm`` does: equal
    bit for bit in bfloat16."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 3
    ours = ProjectionRMSNorm(64, 1e-6).to(torch.bfloat16)
    hf = Olmo2RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
        assert torch.equal(ours(x), hf(x))


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": False}],
    ids=["default", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(
    model_dirs: dict[str, Path], arch: str, engine: dict[str, Any]
) -> None:
    """All prompts in one ``generate`` (one batch), on the CPU's default backend and block
    size, then with prefills chunked to at most 16 tokens over blocks of 4."""
    model_dir = model_dirs[arch]
    tokenizer = load_tokenizer(model_dir)
    block_size = engine.get("block_size", 16)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * block_size
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


# -- tensor parallel --------------------------------------------------------------------------


def test_each_rank_loads_its_share_of_the_projection_norms(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks of OLMo 2 (2 of 4 q heads and 1 of 2 KV heads each): ``q_norm``
    and ``k_norm`` hold the columns of the heads the rank holds; every parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dirs["olmo2"])
    tensors = load_file(model_dirs["olmo2"] / "model.safetensors")
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = Olmo2ForCausalLM(config, ctx)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        prefix = "model.layers.1.self_attn."
        q_norm = tensors[prefix + "q_norm.weight"]
        k_norm = tensors[prefix + "k_norm.weight"]
        assert torch.equal(model.get_parameter(prefix + "q_norm.weight"), q_norm[32 * rank :][:32])
        assert torch.equal(model.get_parameter(prefix + "k_norm.weight"), k_norm[16 * rank :][:16])


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("granite", {}), ("olmo2", {}), ("olmo2", {"num_key_value_heads": 1})],
    ids=["granite", "olmo2", "olmo2-one-kv-head"],
)
def test_two_ranks_match_transformers(tmp_path: Path, arch: str, overrides: dict[str, Any]) -> None:
    """Two real ranks: half the heads and MLP columns each; OLMo 2's q/k norms take their
    mean square over the whole projection (one all-reduce per layer), also with a single KV
    head replicated on both ranks. HF's greedy tokens."""
    model_dir = write_checkpoint(arch, tmp_path / arch, seed=4, **overrides)
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
