"""Gemma, Gemma 2 and Gemma 3 (text) against HF transformers on tiny random checkpoints.

Each checkpoint has 2 layers of hidden 64 and ``head_dim`` 32 (not hidden / heads); Gemma 2
and 3 have a sliding layer (window 4 and 5) and a full one, so prompts of 13+ tokens and the
decodes after them cross the window. Gemma 2 has small attention and final soft caps (so they
change the scores), Gemma 3 linear RoPE scaling on its full layer and another base on its
sliding one. Float32 logits must match HF's (prefill, chunked prefill over a cached prefix,
decodes); greedy generation through ``LLM`` must give HF's tokens.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import (
    TINY_CONFIG_FIELDS,
    allocate_block_tables,
    hf_greedy_tokens,
    new_kv_caches,
    save_tiny_checkpoint,
)
from safetensors.torch import load_file, save_file
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, hf_logits
from test_models_parity import Runner as ParityRunner
from transformers import AutoConfig, AutoModelForCausalLM

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.gemma import GemmaForCausalLM
from chassis.builtin_plugins.models.gemma3 import Gemma3ForCausalLM
from chassis.core.config import EngineConfig
from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.layers.activation import GeluAndMul
from chassis.core.layers.norm import GemmaRMSNorm
from chassis.core.model_interface import ModelBuildContext
from chassis.core.model_loader import build_model, load_hf_config
from chassis.core.tokenizer import load_tokenizer

ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A 2-layer, hidden-64 config of ``arch`` with the SmolLM2 tokenizer's vocabulary."""
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

    common: dict[str, Any] = {
        **TINY_CONFIG_FIELDS,
        "head_dim": 32,
        "max_position_embeddings": 256,
    }
    if arch == "gemma":
        common.update(hidden_act="gelu")  # the legacy name, which HF reads as the tanh form
        common.update(overrides)
        return GemmaConfig(**common)
    if arch == "gemma2":
        common.update(
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        )
        common.update(overrides)
        return Gemma2Config(**common)
    if arch == "gemma3":
        common.update(
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        )
        common.update(overrides)
        return Gemma3TextConfig(**common)
    raise ValueError(f"unknown architecture {arch!r}")


def write_checkpoint(arch: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random float32 checkpoint with the SmolLM2 tokenizer; 1-D weights (the norms, offsets
    from 1 in Gemma) are randomized around 0, so a norm loaded into the wrong place changes
    the logits."""
    config = tiny_config(arch, **overrides)
    return save_tiny_checkpoint(config, directory, seed, norm_base=0.0, scale=0.2)


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: write_checkpoint(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        for arch in ARCHITECTURES
    }


def load_hf(model_dir: Path) -> Any:
    """HF's model of ``model_dir`` in float32, eager attention (HF's SDPA path cannot soft-cap;
    Gemma 2 refuses it anyway). Gemma 1's legacy ``gelu`` as the tanh form, as transformers
    5.24 and chassis read it (5.17, the H200 image's, would run the exact form)."""
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type == "gemma" and config.hidden_act == "gelu":
        config.hidden_act = "gelu_pytorch_tanh"
    return AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()


class Runner(ParityRunner):
    """:class:`test_models_parity.Runner` on another backend, dtype or ``--max-model-len``."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype = torch.float32,
        backend: type = TorchPagedAttention,
        max_model_len: int | None = None,
    ) -> None:
        self.hf_config = load_hf_config(model_dir)
        config = EngineConfig(model=str(model_dir), max_model_len=max_model_len)
        self.model = build_model(config, self.hf_config, model_dir, backend, "cpu", dtype)
        self.kv_caches = new_kv_caches(self.hf_config, NUM_BLOCKS, BLOCK_SIZE, dtype)
        self.generator = torch.Generator().manual_seed(0)


LONG = [1, 504, 3458, 282, 4649, 314, 17, 250, 9001, 48000, 3, 4, 5, 77, 812]
SHORT = [7, 8000, 42, 9, 310, 66]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(gemma_dirs: dict[str, Path], arch: str) -> None:
    """Batched prefill, a chunk over a cached prefix, then decodes, all past the window."""
    runner = Runner(gemma_dirs[arch])
    hf_model = load_hf(gemma_dirs[arch])
    tables = allocate_block_tables([40, 40, 40], BLOCK_SIZE, NUM_BLOCKS, runner.generator)

    # 1. Request 0 (15 tokens) and request 1 (6) prefilled together, and request 2's first
    #    9 tokens of LONG: every position's logits.
    logits = runner.step([LONG, SHORT, LONG[:9]], [15, 6, 9], tables)
    assert_close(logits[:15], hf_logits(hf_model, LONG))
    assert_close(logits[15:21], hf_logits(hf_model, SHORT))
    assert_close(logits[21:], hf_logits(hf_model, LONG[:9]))

    # 2. Request 2's remaining 6 tokens as one chunk over its cached 9 (crossing the window),
    #    beside a decode of request 1.
    logits = runner.step([[11], LONG[9:]], [7, 15], [tables[1], tables[2]])
    assert_close(logits[0], hf_logits(hf_model, [*SHORT, 11])[-1])
    assert_close(logits[1:], hf_logits(hf_model, LONG)[9:])

    # 3. Greedy decodes of requests 0 and 2 (the same sequence, from different caches).
    sequence = list(LONG)
    for _ in range(6):
        expected = hf_logits(hf_model, sequence)[-1]
        sequence.append(int(expected.argmax()))
        n = len(sequence)
        logits = runner.step([[sequence[-1]], [sequence[-1]]], [n, n], [tables[0], tables[2]])
        expected = hf_logits(hf_model, sequence)[-1]
        assert_close(logits[0], expected)
        assert_close(logits[1], expected)


def test_options_read_from_the_configs(gemma_dirs: dict[str, Path]) -> None:
    gemma = Runner(gemma_dirs["gemma"]).model
    assert gemma.options.gelu_approximate == "tanh"
    # the legacy name means tanh whatever transformers left in the config; others as named
    hf_config = load_hf_config(gemma_dirs["gemma"])
    for hidden_act, approximate in [("gelu", "tanh"), ("gelu_pytorch_tanh", "tanh")]:
        hf_config.hidden_act = hidden_act
        assert GemmaForCausalLM.gemma_options(hf_config).gelu_approximate == approximate
    hf_config.hidden_act = "relu"
    with pytest.raises(ValueError, match="'relu' is not supported"):
        GemmaForCausalLM.gemma_options(hf_config)
    assert gemma.options.attn_scale == 32**-0.5
    assert gemma.model.embedding_multiplier == 8.0
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight
    gemma2 = Runner(gemma_dirs["gemma2"]).model
    attn = [layer.self_attn.attn for layer in gemma2.model.layers]
    assert [a.sliding_window for a in attn] == [4, None]
    assert [a.logits_soft_cap for a in attn] == [2.0, 2.0]
    assert attn[0].backend.scale == 24**-0.5
    assert gemma2.options.final_logit_softcap == 3.0
    gemma3 = Runner(gemma_dirs["gemma3"]).model
    layers = gemma3.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 5]
    assert layers[0].self_attn.attn.logits_soft_cap is None
    assert isinstance(layers[0].self_attn.q_norm, GemmaRMSNorm)
    # separate RoPE tables: the full layer's is linearly scaled with another base
    assert layers[0].self_attn.rotary_emb is not layers[1].self_attn.rotary_emb
    assert gemma3.options.final_logit_softcap is None


def test_a_window_no_sequence_outgrows_is_full_attention(gemma_dirs: dict[str, Path]) -> None:
    """With --max-model-len at most the window (5), the sliding layer attends to everything,
    which is the same and runs on any backend."""
    for max_model_len, window in [(5, None), (6, 5)]:
        model = Runner(gemma_dirs["gemma3"], max_model_len=max_model_len).model
        assert model.model.layers[1].self_attn.attn.sliding_window == window
    # without --max-model-len: the config's max_position_embeddings (256) bounds the window
    hf_config = load_hf_config(gemma_dirs["gemma3"])
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    for sliding_window, window in [(256, None), (255, 255)]:
        hf_config.sliding_window = sliding_window
        model = Gemma3ForCausalLM(hf_config, ctx)
        assert model.model.layers[1].self_attn.attn.sliding_window == window


def test_gemma_norm_and_activation_are_hf_formulas() -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HfNorm

    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    residual = torch.randn(5, 64, dtype=torch.bfloat16)
    ours = GemmaRMSNorm(64, 1e-6).to(torch.bfloat16)
    hf = HfNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, hf(x + residual))
    gate_up = torch.randn(3, 8)
    expected = torch.nn.functional.gelu(gate_up[:, :4], approximate="tanh") * gate_up[:, 4:]
    assert torch.equal(GeluAndMul("tanh")(gate_up), expected)
    with pytest.raises(ValueError, match="approximate"):
        GeluAndMul("sigmoid")


# -- whole generations through LLM -----------------------------------------------------------

PROMPTS = [
    "Hello",
    "The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
]
MAX_TOKENS = 10


def hf_greedy(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    return hf_greedy_tokens(load_hf(model_dir), load_tokenizer(model_dir), prompts, max_tokens)


#: KV blocks for --max-model-len 128: Gemma 2/3's sliding and full layers are two KV cache
#: groups, each block holding one layer, so a request may hold a block of each per position
#: (the memory of 64 blocks of both layers)
NUM_KV_BLOCKS = 128


def chassis_greedy(model_dir: Path, prompts: list[str], max_tokens: int, **engine: Any):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=NUM_KV_BLOCKS,
        **engine,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()  # a tensor-parallel engine's worker must go before the next engine


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_transformers(gemma_dirs: dict[str, Path], arch: str) -> None:
    """On ``torch_paged``: the prompts twice in one engine, the second time mostly from the
    prefix cache (blocks of 4, so cached blocks lie before and inside the window); then
    chunked prefill with chunks of at most 8 tokens."""
    model_dir = gemma_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=4,
        attention_backend="torch_paged",
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        first = llm.generate(PROMPTS, params)
        again = llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in again] == expected
    assert again[-1].num_cached_tokens >= 16
    chunked = {"max_num_batched_tokens": 8, "block_size": 4, "enable_prefix_caching": False}
    got = chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, attention_backend="torch_paged", **chunked)
    assert got == expected


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_default_cpu_backend(gemma_dirs: dict[str, Path], arch: str) -> None:
    """Gemma 1 needs nothing special: it runs on the CPU's default backend. Gemma 2/3 need a
    sliding window (and Gemma 2 a soft cap): on a backend without them the model refuses to
    build, naming the backend; once the backend declares them, its tokens must be HF's."""
    model_dir = gemma_dirs[arch]
    needs_window = arch != "gemma"
    needs_cap = arch == "gemma2"
    supported = (not needs_window or CpuPagedAttention.supports_sliding_window) and (
        not needs_cap or CpuPagedAttention.supports_logits_soft_cap
    )
    if supported:
        expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
        assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS) == expected
    else:
        with pytest.raises(ValueError, match=r"CpuPagedAttention.*--attention-backend"):
            Runner(model_dir, backend=CpuPagedAttention)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bfloat16_build_runs(gemma_dirs: dict[str, Path], arch: str) -> None:
    """A bf16 model builds, keeps its weights in bf16 and gives logits near float32's."""
    runner = Runner(gemma_dirs[arch], dtype=torch.bfloat16)
    weight = runner.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    assert weight.dtype == torch.bfloat16
    tables = allocate_block_tables([20], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    logits = runner.step([LONG], [15], tables)
    logits = torch.cat([logits, runner.step([[5]], [16], tables)])
    reference = Runner(gemma_dirs[arch])
    expected = reference.step([LONG], [15], tables)
    expected = torch.cat([expected, reference.step([[5]], [16], tables)])
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())
    assert (logits - expected).abs().max() < 0.1
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= 0.8


# -- weight loading ---------------------------------------------------------------------------


def copy_without(model_dir: Path, target: Path, *names: str) -> Path:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, target / name)
    tensors = load_file(model_dir / "model.safetensors")
    for name in names:
        del tensors[name]
    save_file(tensors, target / "model.safetensors")
    return target


def test_a_missing_tensor_is_named(gemma_dirs: dict[str, Path], tmp_path: Path) -> None:
    missing = (
        "model.layers.1.post_feedforward_layernorm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    )
    broken = copy_without(gemma_dirs["gemma3"], tmp_path, *missing)
    with pytest.raises(ValueError, match=r"k_norm\.weight.*post_feedforward_layernorm"):
        Runner(broken)


def test_unknown_and_misshapen_tensors_are_refused(gemma_dirs: dict[str, Path]) -> None:
    model = Runner(gemma_dirs["gemma2"]).model
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        model.load_weights([("model.layers.0.self_attn.q_norm.weight", torch.zeros(32))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.layers.1.pre_feedforward_layernorm.weight", torch.zeros(3))])


def test_unsupported_configs_are_refused(gemma_dirs: dict[str, Path]) -> None:
    for overrides, message in [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "silu"}, "activation 'silu'"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window is None; it must be a positive integer"),
    ]:
        hf_config = load_hf_config(gemma_dirs["gemma2"])
        for key, value in overrides.items():
            setattr(hf_config, key, value)
        with pytest.raises(ValueError, match=message):
            build_model(
                EngineConfig(load_format="dummy"),
                hf_config,
                gemma_dirs["gemma2"],
                TorchPagedAttention,
                "cpu",
                torch.float32,
            )


# -- tensor parallel --------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_two_ranks_match_transformers(gemma_dirs: dict[str, Path], arch: str) -> None:
    """Two ranks (2 of 4 heads, 1 of 2 KV heads, half the MLP and of the vocabulary each;
    whole norms, q/k norms included; the final soft cap after the logits are gathered):
    HF's greedy tokens."""
    model_dir = gemma_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    got = chassis_greedy(
        model_dir, PROMPTS, MAX_TOKENS, attention_backend="torch_paged", tensor_parallel_size=2
    )
    assert got == expected


def test_a_multimodal_gemma3_checkpoint_serves_text(tmp_path: Path) -> None:
    """gemma-3-4b-style checkpoint (``Gemma3ForConditionalGeneration``: a text config inside,
    ``language_model.model.*`` tensors next to a vision tower): text prompts get HF's
    multimodal model's greedy tokens (its images: tests/test_gemma3_images.py)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = tiny_config("gemma3")
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=49000,
        boi_token_index=49001,
        eoi_token_index=49002,
    )
    torch.manual_seed(3)
    hf = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, tmp_path / name)

    engine_config = load_hf_config(tmp_path)
    assert engine_config.architectures == ["Gemma3ForConditionalGeneration"]
    assert engine_config.num_hidden_layers == 2 and engine_config.head_dim == 32

    expected = hf_greedy_tokens(hf, load_tokenizer(tmp_path), PROMPTS, MAX_TOKENS)
    got = chassis_greedy(tmp_path, PROMPTS, MAX_TOKENS)
    assert got == expected
