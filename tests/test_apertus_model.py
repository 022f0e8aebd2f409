"""``ApertusForCausalLM`` against HF transformers on tiny random float32 checkpoints.

Each checkpoint has 2 layers of hidden 64, 4 heads and 2 KV heads of 16, the non-gated xIELU
MLP (``up_proj`` 64 -> 128) and Llama-3 RoPE scaling. Norm weights (the layer norms under
Apertus's names and the per-head q/k norms) are randomized around 1, xIELU's learned
``alpha_p``/``alpha_n`` around 0, and the checkpoint's ``beta``/``eps`` buffers are rewritten
away from HF's defaults (a different pair per layer), so that each is seen to be read. The
default checkpoint has q/k/v/o biases and an untied head; a second one has neither. Logits
must match HF's (batched prefill, a decode, a chunk over a cached prefix); greedy tokens
through ``LLM`` must be HF's ``generate``'s for prompts longer than a KV block, with and
without chunked prefill, and on two tensor-parallel ranks.
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
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.apertus import (
    XIELU,
    XIELUMLP,
    ApertusDecoderLayer,
    ApertusForCausalLM,
)
from chassis.core import parallel_state
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
#: per layer: the (beta, eps) written into the checkpoint (HF's defaults are 0.5, -1e-6)
XIELU_BUFFERS = [(0.3, -1e-6), (0.65, -0.05)]
#: name -> ApertusConfig fields over :func:`apertus_config`'s
CONFIGS: dict[str, dict[str, Any]] = {
    "biases-untied": {},
    "no-bias-tied": {"attention_bias": False, "tie_word_embeddings": True},
}


def apertus_config(**overrides: Any) -> Any:
    from transformers import ApertusConfig

    fields: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "rope_parameters": LLAMA3,
    }
    fields.update(overrides)
    # copies: the config standardizes its RoPE dict in place
    fields = {key: dict(v) if isinstance(v, dict) else v for key, v in fields.items()}
    return ApertusConfig(**fields)


def write_checkpoint(directory: Path, seed: int = 6, **overrides: Any) -> Path:
    """A tiny checkpoint whose xIELU ``beta``/``eps`` are :data:`XIELU_BUFFERS`."""
    directory = save_tiny_checkpoint(apertus_config(**overrides), directory, seed)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for layer, (beta, eps) in enumerate(XIELU_BUFFERS):
        prefix = f"model.layers.{layer}.mlp.act_fn."
        assert tensors[prefix + "beta"].shape == ()  # HF's 0-d buffers, saved
        tensors[prefix + "beta"] = torch.tensor(beta)
        tensors[prefix + "eps"] = torch.tensor(eps)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_apertus"))


def build(config: Any, dtype: torch.dtype = torch.float32) -> ApertusForCausalLM:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=dtype)
    return ApertusForCausalLM(config, ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    directory = model_dir if not CONFIGS[name] else write_checkpoint(tmp_path, **CONFIGS[name])
    check_parity(directory, TOKEN_PROMPTS, atol=1e-4)


def test_the_checkpoint_is_read(model_dir: Path) -> None:
    """xIELU's four scalars per layer are the checkpoint's (HF reads the same ones, and its
    logits move with ``beta``); the norms carry Apertus's names; no gate, no MLP bias."""
    model = Runner(model_dir).model
    hf_model = load_hf(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    for i, (beta, eps) in enumerate(XIELU_BUFFERS):
        act = model.model.layers[i].mlp.act_fn
        assert isinstance(act, XIELU)
        assert (act.beta.item(), act.eps.item()) == pytest.approx((beta, eps))
        assert hf_model.model.layers[i].mlp.act_fn.beta.item() == pytest.approx(beta)
        prefix = f"model.layers.{i}.mlp.act_fn."
        assert torch.equal(act.alpha_p, tensors[prefix + "alpha_p"])
        assert torch.equal(act.alpha_n, tensors[prefix + "alpha_n"])
    layer = model.model.layers[1]
    assert isinstance(layer, ApertusDecoderLayer) and isinstance(layer.mlp, XIELUMLP)
    assert layer.mlp.up_proj.weight.shape == (128, 64) and layer.mlp.up_proj.bias is None
    names = {name for name, _ in model.named_parameters()}
    assert not any("gate" in name for name in names)
    for norm in ("attention_layernorm", "feedforward_layernorm", "self_attn.q_norm"):
        assert f"model.layers.1.{norm}.weight" in names
    assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.o_proj.bias is not None
    # not vacuous: HF's logits depend on the beta the checkpoint carries
    tokens = TOKEN_PROMPTS[0]
    reference = hf_logits(hf_model, tokens)
    with torch.no_grad():
        hf_model.model.layers[0].mlp.act_fn.beta.fill_(0.5)
    assert (hf_logits(hf_model, tokens) - reference).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_is_hf_xielu(dtype: torch.dtype) -> None:
    """:class:`XIELU` equals HF's ``XIELUActivation`` bit for bit, both branches and the
    ``eps`` clamp, in bfloat16 too."""
    from transformers.activations import XIELUActivation

    torch.manual_seed(0)
    x = torch.cat([torch.randn(4, 64) * 3, torch.linspace(-0.1, 0.1, 64)[None]]).to(dtype)
    ours = XIELU().to(dtype)
    hf = XIELUActivation(dtype=dtype)
    with torch.no_grad():
        for name, value in (("alpha_p", 0.3), ("alpha_n", -0.4), ("beta", 0.4), ("eps", -0.05)):
            getattr(ours, name).fill_(value)
            getattr(hf, name).fill_(value)
        assert torch.equal(ours(x), hf(x))
    # HF's initial values are ours too (what a model built without weights computes with)
    fresh, hf_fresh = XIELU(), XIELUActivation(dtype=torch.float32)
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        assert torch.equal(getattr(fresh, name), getattr(hf_fresh, name))


# -- refused options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'dynamic' is not supported",
        ),
    ],
    ids=["hidden_act", "rope_type"],
)
def test_unsupported_options_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(apertus_config(**overrides))


def test_model_builds_on_a_non_cpu_default_device() -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device (xIELU's
    scalars included)."""
    with torch.device("meta"):
        model = build(apertus_config(), torch.bfloat16)
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


def test_each_rank_holds_its_columns_and_every_xielu_scalar(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks: ``up_proj`` rows and ``down_proj`` columns are the rank's half;
    xIELU's scalars and the per-head norms are whole; every parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    prefix = "model.layers.1."
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = build(config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        rows = slice(64 * rank, 64 * (rank + 1))
        up = model.get_parameter(prefix + "mlp.up_proj.weight")
        assert torch.equal(up, tensors[prefix + "mlp.up_proj.weight"][rows])
        down = model.get_parameter(prefix + "mlp.down_proj.weight")
        assert torch.equal(down, tensors[prefix + "mlp.down_proj.weight"][:, rows])
        for name in ("mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n", "self_attn.q_norm.weight"):
            assert torch.equal(model.get_parameter(prefix + name), tensors[prefix + name])
        assert model.get_buffer(prefix + "mlp.act_fn.beta").item() == pytest.approx(0.65)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dir: Path) -> None:
    """Two real ranks: half the heads (one KV head each) and half the xIELU MLP columns
    each, the down projection's partial sums all-reduced; HF's greedy tokens."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
