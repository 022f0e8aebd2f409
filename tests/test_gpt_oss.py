"""gpt-oss (``GptOssForCausalLM``) against HF transformers, and its parts: YaRN RoPE, the
MXFP4 dequantization of its released checkpoints, and the model's refusal of an attention
backend without sinks.

The tiny checkpoint (written by transformers, float32): 2 layers (the first sliding with a
window of 4, so windows matter on short prompts; the second full), hidden 64, 4 heads of 32
(the CPU kernels' vectorized paths) over 2 KV heads, 4 experts of intermediate 96 (not the
hidden size, so a transposed expert matrix cannot load), top 2, ``swiglu_limit`` 1.5 (so
the clamps bind), YaRN RoPE, and every sink, bias and norm weight randomized (HF initializes
expert biases to 0 and sinks small).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, make_attention_metadata, new_kv_caches
from hf_gpt_oss_swiglu import hf_reads_swiglu_config, make_hf_read_swiglu_config
from safetensors.torch import load_file, save_file
from test_gemma_models import copy_without
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity, hf_logits, load_hf

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.gpt_oss import GptOssExperts, GptOssForCausalLM
from chassis.core.config import EngineConfig
from chassis.core.layers.rotary import (
    RotaryEmbedding,
    _yarn_inverse_frequencies,
    rope_parameters,
    yarn_attention_factor,
)
from chassis.core.model_loader import build_model, load_hf_config
from chassis.core.quantized_weights import (
    E2M1_VALUES,
    check_quantization,
    dequantize_mxfp4,
    dequantized_weights,
)

#: YaRN as gpt-oss configures it (truncate off), over a 64-position original context
TINY_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 8.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}


def tiny_gpt_oss_config(**overrides: Any) -> Any:
    from transformers import GptOssConfig

    fields: dict[str, Any] = dict(
        TINY_CONFIG_FIELDS,
        intermediate_size=96,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=1.5,
        rope_parameters=dict(TINY_ROPE),
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return GptOssConfig(**fields)


def write_tiny_gpt_oss(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random float32 gpt-oss checkpoint (SmolLM2's tokenizer) in ``directory``: sinks
    ``randn``, biases ``0.1 randn``, norm weights ``1 + 0.1 randn``."""
    from transformers import AutoModelForCausalLM

    from chassis.core.gguf_checkpoint import embedded_model_dir

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_gpt_oss_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif "bias" in name:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, Path(directory) / name)
    return Path(directory)


@pytest.fixture(autouse=True)
def _hf_reads_swiglu_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF as the reference at the tiny model's ``swiglu_limit`` of 1.5, also where
    transformers (5.17) fixes the limit at 7 (tests/hf_gpt_oss_swiglu.py)."""
    make_hf_read_swiglu_config(monkeypatch)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gpt_oss(tmp_path_factory.mktemp("tiny_gpt_oss"))


# -- the model against HF ----------------------------------------------------------------------


def test_logits_match_transformers(gpt_oss_dir: Path) -> None:
    """Batched prefill, decodes over the paged cache, a chunk over a cached prefix (torch_paged,
    float32); prompts of up to 13 tokens pass the window of 4."""
    check_parity(gpt_oss_dir, TOKEN_PROMPTS, atol=1e-4)


@pytest.mark.parametrize(
    "engine",
    [
        {},  # the CPU platform's default backend, cpu_paged (its compiled kernels)
        {"attention_backend": "torch_paged"},
        {"max_num_batched_tokens": 16, "block_size": 4},  # chunked prefill, prefix cache
    ],
    ids=["cpu_paged", "torch_paged", "chunked-prefill"],
)
def test_greedy_tokens_match_transformers(gpt_oss_dir: Path, engine: dict[str, Any]) -> None:
    expected = hf_greedy(gpt_oss_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(gpt_oss_dir, PROMPTS, MAX_TOKENS, **engine) == expected


def test_the_hf_reference_clamps_at_the_configured_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where transformers fixes the SwiGLU constants at 1.702 and 7 (5.17; mimicked here on
    whatever is installed), the helper makes HF's experts take the config's ``swiglu_limit``
    (alpha where the config has none: HF's 1.702), so the parity tests compare the same model."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

    reading_init = HfExperts.__init__

    def fixing_init(self: Any, config: Any) -> None:
        reading_init(self, config)
        self.alpha, self.limit = 1.702, 7.0

    monkeypatch.setattr(HfExperts, "__init__", fixing_init)
    assert not hf_reads_swiglu_config()
    assert make_hf_read_swiglu_config(monkeypatch)
    assert hf_reads_swiglu_config()
    experts = HfExperts(tiny_gpt_oss_config())
    assert experts.limit == 1.5 and experts.alpha == 1.702
    assert not make_hf_read_swiglu_config(monkeypatch)  # nothing left to patch


def test_what_makes_gpt_oss_changes_the_logits(gpt_oss_dir: Path) -> None:
    """The tiny model exercises each gpt-oss feature: without the sinks, the window or the
    clamps the logits move (so the parity tests above check each of them)."""
    runner = Runner(gpt_oss_dir)
    prompt = TOKEN_PROMPTS[0]

    def logits() -> torch.Tensor:
        return runner.step([prompt], [len(prompt)], [list(range(8))])

    reference = logits()
    layers = runner.model.model.layers
    assert layers[0].self_attn.attn.backend.sliding_window == 4
    assert layers[1].self_attn.attn.backend.sliding_window is None
    changes = {}
    for feature in ("sinks", "window", "clamp"):
        saved = [
            (layer.self_attn.sinks.data.clone(), layer.self_attn.attn.backend.sliding_window)
            for layer in layers
        ]
        for layer in layers:
            if feature == "sinks":
                layer.self_attn.sinks.data.fill_(float("-inf"))  # a sink of weight 0
            elif feature == "window":
                layer.self_attn.attn.backend.sliding_window = None
            else:
                layer.mlp.experts.limit = 1e9
        changes[feature] = float((logits() - reference).abs().max())
        for layer, (sinks, window) in zip(layers, saved, strict=True):
            layer.self_attn.sinks.data.copy_(sinks)
            layer.self_attn.attn.backend.sliding_window = window
            layer.mlp.experts.limit = 1.5
    assert all(change > 0.1 for change in changes.values()), changes
    torch.testing.assert_close(logits(), reference)


def test_bfloat16_on_cpu_paged_is_close_to_transformers(gpt_oss_dir: Path) -> None:
    """bfloat16 through the CPU kernels with sinks (the tiled prefill kernel where the CPU has
    AVX512-BF16, the bf16 row kernel for the decode): within bfloat16 rounding of HF's
    bfloat16 model (whose own distance from float32 is about as large)."""
    from transformers import AutoModelForCausalLM

    from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
    from chassis.core.attention import ForwardContext

    hf_model = AutoModelForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.bfloat16).eval()
    hf_config = load_hf_config(gpt_oss_dir)
    config = EngineConfig(model=str(gpt_oss_dir))
    model = build_model(config, hf_config, gpt_oss_dir, CpuPagedAttention, "cpu", torch.bfloat16)
    kv_caches = new_kv_caches(hf_config, 8, 16, torch.bfloat16)
    prompt = TOKEN_PROMPTS[0]
    steps = [(prompt, len(prompt)), ([77], len(prompt) + 1)]  # a prefill, then a decode
    with torch.no_grad():
        for tokens, seq_len in steps:
            metadata = make_attention_metadata([len(tokens)], [seq_len], [[3, 1]], 16)
            positions = torch.arange(seq_len - len(tokens), seq_len)
            ctx = ForwardContext(metadata, kv_caches)
            logits = model.compute_logits(model(torch.tensor(tokens), positions, ctx))
            expected = hf_model(torch.tensor([[*prompt, 77]])).logits[0, positions].float()
            torch.testing.assert_close(logits, expected, atol=0.1, rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_match_transformers(gpt_oss_dir: Path) -> None:
    """Each rank: 2 of the 4 heads (and their sinks), 1 KV head, half of every expert's
    columns and biases (the down bias on rank 0 only), the whole router."""
    expected = hf_greedy(gpt_oss_dir, PROMPTS[:3], 6)
    assert chassis_greedy(gpt_oss_dir, PROMPTS[:3], 6, tensor_parallel_size=2) == expected


def test_a_backend_without_sinks_is_refused(gpt_oss_dir: Path) -> None:
    class NoSinks(TorchPagedAttention):
        supports_attention_sinks = False

    hf_config = load_hf_config(gpt_oss_dir)
    config = EngineConfig(model=str(gpt_oss_dir))
    with pytest.raises(ValueError, match="NoSinks does not support attention sinks"):
        build_model(config, hf_config, gpt_oss_dir, NoSinks, "cpu", torch.float32)


def test_experts_block_graph_capture_and_check_shapes(gpt_oss_dir: Path) -> None:
    model = Runner(gpt_oss_dir).model
    assert isinstance(model, GptOssForCausalLM)
    reason = model.graph_capture_blocker()
    assert reason is not None and "reads expert counts on the host" in reason
    with pytest.raises(ValueError, match=r"experts.down_proj has shape \(4, 64, 96\)"):
        model.load_weights([("model.layers.0.mlp.experts.down_proj", torch.zeros(4, 64, 96))])


def test_experts_allow_graph_capture_with_a_platform_kernel(
    gpt_oss_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the platform's kernels offer ``fused_moe_clamped_swiglu`` (CUDA/ROCm's
    TritonLayerKernels) the experts block nothing; the kernel against the torch path is
    tests/test_triton_moe_bias.py, on a GPU tests/gpu/test_gpu_triton_moe_gpt_oss.py."""
    from chassis.core.layers.triton_ops import TritonLayerKernels

    model = Runner(gpt_oss_dir).model
    monkeypatch.setattr(
        "chassis.builtin_plugins.models.gpt_oss.kernels_for", lambda x: TritonLayerKernels()
    )
    assert model.graph_capture_blocker() is None


def test_builds_under_a_non_cpu_default_device() -> None:
    """What ``build_model`` does on a GPU: every parameter and buffer (sinks, expert
    biases, the YaRN tables computed on the CPU) follows the default device."""
    from chassis.core.model_interface import ModelBuildContext

    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = GptOssForCausalLM(tiny_gpt_oss_config(), ctx)
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    assert devices == {"meta"}


def test_missing_sinks_are_reported(gpt_oss_dir: Path, tmp_path: Path) -> None:
    broken = copy_without(gpt_oss_dir, tmp_path, "model.layers.1.self_attn.sinks")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.sinks"):
        Runner(broken)


def test_experts_load_deinterleaved_and_transposed() -> None:
    """HF's ``gate_up_proj [E, H, 2I]`` holds gate in even columns and up in odd ones."""
    experts = GptOssExperts(2, 3, 2, alpha=1.702, limit=7.0)
    gate_up = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    assert experts.load("gate_up_proj", gate_up) == "w13"
    # expert 0: gate columns 0, 2 and up columns 1, 3 of [3, 4], as rows of [4, 3]
    expected = torch.stack([gate_up[0, :, 0], gate_up[0, :, 2], gate_up[0, :, 1], gate_up[0, :, 3]])
    assert torch.equal(experts.w13[0], expected)
    bias = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]])
    experts.load("gate_up_proj_bias", bias)
    assert experts.b13.tolist() == [[0.0, 2.0, 1.0, 3.0], [4.0, 6.0, 5.0, 7.0]]
    down = torch.randn(2, 2, 3)
    experts.load("down_proj", down)
    assert torch.equal(experts.w2, down.transpose(1, 2))


# -- YaRN -------------------------------------------------------------------------------------


def _yarn_configs() -> list[Any]:
    from transformers import LlamaConfig

    def llama(**rope: Any) -> Any:
        return LlamaConfig(
            hidden_size=128,
            num_attention_heads=2,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope},
        )

    return [
        tiny_gpt_oss_config(),
        tiny_gpt_oss_config(rope_parameters=None),  # gpt-oss's own defaults (truncate off)
        llama(factor=4.0, original_max_position_embeddings=2048),  # truncate on (default)
        llama(
            factor=40.0,
            original_max_position_embeddings=2048,
            beta_fast=16,
            mscale=1.0,
            mscale_all_dim=0.707,
        ),  # DeepSeek-style attention factor
        llama(factor=None, original_max_position_embeddings=2048),  # factor from lengths
        llama(factor=2.0, original_max_position_embeddings=4096, attention_factor=0.9),
    ]


@pytest.mark.parametrize("index", range(6))
def test_yarn_matches_transformers_rope_init(index: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = _yarn_configs()[index]
    params = rope_parameters(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or 64
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    assert torch.equal(_yarn_inverse_frequencies(head_dim, params), inv_freq)
    assert yarn_attention_factor(params) == pytest.approx(attention_factor, rel=1e-12)
    # the tables: HF multiplies cos and sin by the factor in float32
    rotary = RotaryEmbedding(head_dim, 300, params)
    freqs = torch.outer(torch.arange(300).float(), inv_freq)
    torch.testing.assert_close(rotary.cos_cache, freqs.cos() * attention_factor, atol=0, rtol=0)
    torch.testing.assert_close(rotary.sin_cache, freqs.sin() * attention_factor, atol=0, rtol=0)


# -- MXFP4 ------------------------------------------------------------------------------------


def test_mxfp4_codes_and_scales_by_hand() -> None:
    """One row of 32 values: bytes 0x10, 0x32, ... put codes 2j (low nibble) and 2j + 1 (high)
    of the e2m1 table in order; scales 127 (x1), 129 (x4), 126 (x0.5), 0 (x2^-127)."""
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert list(E2M1_VALUES) == table
    codes = list(range(16)) * 2  # element i of the group has code i % 16
    row = bytes(codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16))
    assert row[:3] == b"\x10\x32\x54"
    blocks = torch.tensor(list(row) * 4, dtype=torch.uint8).reshape(1, 4, 1, 16)  # [E, N, G, 16]
    scales = torch.tensor([127, 129, 126, 0], dtype=torch.uint8).reshape(1, 4, 1)
    out = dequantize_mxfp4(blocks, scales)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 32, 4)  # [E, K, N]: transposed
    for n, factor in enumerate([1.0, 4.0, 0.5, 2.0**-127]):
        expected = torch.tensor([table[i % 16] * factor for i in range(32)])
        assert torch.equal(out[0, :, n].float(), expected), n


def test_mxfp4_layout_matches_transformers_integration() -> None:
    """Random bytes through ours and transformers' ``convert_moe_packed_tensors``: identical."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == theirs.shape == (3, 128, 10)
    assert torch.equal(ours, theirs)


def test_mxfp4_errors() -> None:
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.float(), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"must be \[\.\.\., N, G, 16\]"):
        dequantize_mxfp4(blocks, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN in e8m0"):
        dequantize_mxfp4(blocks, torch.full((2, 1), 255, dtype=torch.uint8))
    config = {"quantization_config": {"quant_method": "mxfp4"}}

    class Config:
        quantization_config = config["quantization_config"]

    check_quantization(Config())  # accepted
    with pytest.raises(ValueError, match="without their blocks or scales"):
        list(dequantized_weights([("a.experts.down_proj_blocks", blocks)], Config()))
    pairs = [
        ("x_scales", torch.zeros(2, 1, dtype=torch.uint8)),
        ("x_blocks", blocks),
        ("b", blocks),
    ]
    names = [name for name, _ in dequantized_weights(pairs, Config())]
    assert names == ["x", "b"]  # the pair in either order; other tensors pass through


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The test's own MXFP4 quantizer for an HF expert tensor ``[E, K, N]``: blocks
    ``[E, N, K/32, 16]``, scales ``[E, N, K/32]`` and the value they stand for (``[E, K, N]``),
    computed here from codes and exponents without the code under test."""
    table = torch.tensor(E2M1_VALUES[:8])
    packed = weight.transpose(1, 2).float()  # [E, N, K], quantized along K
    groups = packed.unflatten(-1, (-1, 32))  # [E, N, G, 32]
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # largest magnitude fits under 6
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs()[..., None] - table).abs().argmin(-1)  # nearest, [E, N, G, 32]
    codes = magnitude + 8 * (scaled < 0)
    value = table[magnitude] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exponent)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    scales = (exponent[..., 0] + 127).to(torch.uint8)
    return blocks, scales, value.flatten(-2).transpose(1, 2).contiguous()


@pytest.fixture(scope="module")
def mxfp4_dirs(gpt_oss_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model with its experts in MXFP4 (as the released checkpoints), and its
    float32 twin holding the values the MXFP4 tensors stand for."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    quantized, twin = root / "mxfp4", root / "twin"
    for directory in (quantized, twin):
        shutil.copytree(gpt_oss_dir, directory)
    tensors = load_file(str(gpt_oss_dir / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, value = quantize_mxfp4(tensor)
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dequantized[name] = value
            assert not torch.equal(value, tensor)  # the quantization is not the identity
        else:
            packed[name] = dequantized[name] = tensor
    save_file(packed, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin


def test_mxfp4_checkpoint_runs_as_its_dequantized_twin(mxfp4_dirs: tuple[Path, Path]) -> None:
    """chassis on the MXFP4 checkpoint: HF's logits and greedy tokens on the twin."""
    quantized, twin = mxfp4_dirs
    runner = Runner(quantized)
    hf_model = load_hf(twin)
    for prompt in TOKEN_PROMPTS:
        logits = runner.step([prompt], [len(prompt)], [list(range(8))])
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
    expected = hf_greedy(twin, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(quantized, PROMPTS, MAX_TOKENS) == expected


def test_transformers_reads_the_mxfp4_checkpoint_as_we_do(mxfp4_dirs: tuple[Path, Path]) -> None:
    """transformers dequantizes the same MXFP4 checkpoint to the twin's expert weights: the
    test's quantizer writes the layout it reads. Dequantizing is asked for: transformers
    before 5.25 chose it itself on a CPU, but from 5.25 (with triton and ``kernels``
    installed) it keeps MXFP4 and fetches its triton kernels from the hub, which a test
    never reaches."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quantized, twin = mxfp4_dirs
    hf_quantized = AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    hf_twin = load_hf(twin)
    for name, param in hf_twin.named_parameters():
        if "experts" in name:
            theirs = dict(hf_quantized.named_parameters())[name]
            assert torch.equal(theirs.float(), param), name
