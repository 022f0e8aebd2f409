"""Sliding-window attention in the Llama-family decoder (Mistral, Qwen2, Qwen2-MoE, Qwen3,
Mixtral) against HF transformers, with windows of 4-6 over sequences of up to 24 tokens.

Logits are compared in float32 on a batched prefill, a chunked prefill over a cached prefix
and decodes past the window; greedy generations through ``LLM`` must be token-identical to
HF's ``generate``. The windowed layers need a backend that supports windows: these tests use
``torch_paged`` (and the CPU default when it declares support).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, allocate_block_tables, save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner, hf_logits, load_hf

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.llama import DecoderSpec, LlamaForCausalLM
from chassis.builtin_plugins.models.qwen2 import Qwen2ForCausalLM
from chassis.builtin_plugins.models.qwen2_moe import Qwen2MoeForCausalLM
from chassis.builtin_plugins.models.qwen3 import Qwen3ForCausalLM
from chassis.core.model_interface import ModelBuildContext

#: the shared tiny fields, with an untied LM head
TINY = {**TINY_CONFIG_FIELDS, "tie_word_embeddings": False}

#: a random float32 checkpoint with the SmolLM2 tokenizer, biases and norm weights randomized
write_checkpoint = save_tiny_checkpoint


def tiny_config(arch: str, window: int) -> Any:
    """A tiny config of ``arch`` whose layers (some or all) attend over ``window`` positions."""
    import transformers

    if arch == "mistral":
        return transformers.MistralConfig(**TINY, sliding_window=window)
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **{**TINY, "intermediate_size": 64},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=window,
        )
    qwen = {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 1}
    if arch == "qwen2":  # layer 1 slides (>= max_window_layers), layer 0 does not
        return transformers.Qwen2Config(**TINY, **qwen)
    if arch == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=32, **qwen)
    if arch == "qwen2_moe":  # layer 0 slides (even and < max_window_layers = 2)
        return transformers.Qwen2MoeConfig(
            **TINY,
            **{**qwen, "max_window_layers": 2},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
    raise ValueError(arch)


#: arch -> (window, the layers that slide)
CASES = {
    "mistral": (4, [0, 1]),
    "mixtral": (6, [0, 1]),
    "qwen2": (5, [1]),
    "qwen3": (4, [1]),
    "qwen2_moe": (5, [0]),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: write_checkpoint(tiny_config(arch, window), tmp_path_factory.mktemp(arch), seed=3)
        for arch, (window, _) in CASES.items()
    }


def check_window_parity(
    model_dir: Path, atol: float = 1e-4, runner: Runner | None = None
) -> Runner:
    """Against HF's logits on the whole sequence so far: request A prefilled in two chunks
    (11 tokens, then 9 over the cached 11) and decoded to 24 tokens; request B prefilled
    (16 tokens) alongside A's first chunk and decoded alongside A's second. ``runner``:
    our model (default: ``Runner(model_dir)``)."""
    runner = runner or Runner(model_dir)
    hf_model = load_hf(model_dir)
    generator = torch.Generator().manual_seed(1)
    a = torch.randint(3, 49152, (24,), generator=generator).tolist()
    b = torch.randint(3, 49152, (17,), generator=generator).tolist()
    tables = allocate_block_tables([24, 17], BLOCK_SIZE, NUM_BLOCKS, runner.generator)

    def expect(tokens: list[int], rows: int) -> torch.Tensor:
        return hf_logits(hf_model, tokens)[-rows:]

    logits = runner.step([a[:11], b[:16]], [11, 16], tables)
    torch.testing.assert_close(logits[:11], expect(a[:11], 11), atol=atol, rtol=1e-4)
    torch.testing.assert_close(logits[11:], expect(b[:16], 16), atol=atol, rtol=1e-4)

    logits = runner.step([a[11:20], b[16:17]], [20, 17], tables)
    torch.testing.assert_close(logits[:9], expect(a[:20], 9), atol=atol, rtol=1e-4)
    torch.testing.assert_close(logits[9:], expect(b, 1), atol=atol, rtol=1e-4)

    for n in range(21, 25):
        logits = runner.step([[a[n - 1]]], [n], tables[:1])
        torch.testing.assert_close(logits, expect(a[:n], 1), atol=atol, rtol=1e-4)
    return runner


@pytest.mark.parametrize("arch", list(CASES))
def test_windows_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    runner = check_window_parity(model_dirs[arch])
    window, sliding = CASES[arch]
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [
        window if i in sliding else None for i in range(len(layers))
    ]


def test_the_window_changes_the_answer(model_dirs: dict[str, Path]) -> None:
    """Not vacuous: past the window, HF's windowed logits differ from full attention's."""
    hf_model = load_hf(model_dirs["mistral"])
    tokens = list(range(100, 120))
    windowed = hf_logits(hf_model, tokens)
    hf_model.config.sliding_window = None
    full = hf_logits(hf_model, tokens)
    torch.testing.assert_close(windowed[:4], full[:4], atol=1e-5, rtol=1e-5)
    assert (windowed[-1] - full[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_greedy_generation_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    engine = {"attention_backend": "torch_paged", "max_num_batched_tokens": 16, "block_size": 4}
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


def test_greedy_generation_with_the_default_backend(model_dirs: dict[str, Path]) -> None:
    from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention

    if not CpuPagedAttention.supports_sliding_window:
        pytest.skip("cpu_paged does not support sliding windows yet")
    model_dir = model_dirs["mistral"]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, block_size=4) == expected


# -- which layers slide, from the config alone ----------------------------------------------


def windows(model_cls: type[LlamaForCausalLM], **fields: Any) -> list[int | None]:
    config = SimpleNamespace(**{**TINY, "num_hidden_layers": 4, **fields})
    spec: DecoderSpec = model_cls.decoder_spec(config)
    return [spec.attention_window(i) for i in range(4)]


def test_layer_windows_follow_each_architectures_rules() -> None:
    # Mistral / Mixtral / Phi-3: every layer, when set
    assert windows(LlamaForCausalLM, sliding_window=8) == [8] * 4
    assert windows(LlamaForCausalLM, sliding_window=None) == [None] * 4
    assert windows(LlamaForCausalLM) == [None] * 4  # Llama configs have none
    # HF's Llama ignores a window in its config; Mistral's honours it
    assert windows(LlamaForCausalLM, model_type="llama", sliding_window=8) == [None] * 4
    assert windows(LlamaForCausalLM, model_type="mistral", sliding_window=8) == [8] * 4
    # a window at least as long as the model's positions is full attention
    assert windows(LlamaForCausalLM, sliding_window=512) == [None] * 4
    assert windows(LlamaForCausalLM, sliding_window=511) == [511] * 4
    # Qwen2 / Qwen3: only with use_sliding_window, then layer_types or max_window_layers
    qwen = {"sliding_window": 8, "max_window_layers": 2}
    for cls in (Qwen2ForCausalLM, Qwen3ForCausalLM):
        assert windows(cls, **qwen, use_sliding_window=False) == [None] * 4
        assert windows(cls, **qwen, use_sliding_window=True) == [None, None, 8, 8]
        types = ["sliding_attention", "full_attention"] * 2
        assert windows(cls, **qwen, use_sliding_window=True, layer_types=types) == [
            8,
            None,
            8,
            None,
        ]
    # Qwen2-MoE without layer_types: even layers below max_window_layers
    moe = {"sliding_window": 8, "max_window_layers": 3}
    assert windows(Qwen2MoeForCausalLM, **moe, use_sliding_window=True) == [8, None, 8, None]
    assert windows(Qwen2MoeForCausalLM, **moe, use_sliding_window=False) == [None] * 4
    assert windows(Qwen2MoeForCausalLM, sliding_window=0, use_sliding_window=False) == [None] * 4


def test_transformers_configs_give_the_same_layers() -> None:
    """transformers 5 derives ``layer_types``; its answer and ours agree."""
    import transformers

    common = {**TINY, "num_hidden_layers": 4, "sliding_window": 8, "use_sliding_window": True}
    for config_cls, model_cls in [
        (transformers.Qwen2Config, Qwen2ForCausalLM),
        (transformers.Qwen3Config, Qwen3ForCausalLM),
        (transformers.Qwen2MoeConfig, Qwen2MoeForCausalLM),
    ]:
        config = config_cls(**common, max_window_layers=3)
        spec = model_cls.decoder_spec(config)
        expected = [8 if kind == "sliding_attention" else None for kind in config.layer_types]
        assert [spec.attention_window(i) for i in range(4)] == expected
        assert expected.count(8) in (1, 2)  # the rules differ: both are exercised


def test_layer_types_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ValueError, match="layer_types has 1 entries for 4 layers"):
        windows(
            Qwen2ForCausalLM,
            sliding_window=8,
            use_sliding_window=True,
            layer_types=["sliding_attention"],
        )


class NoWindowAttention(TorchPagedAttention):
    supports_sliding_window = False


def test_a_backend_without_windows_is_refused_when_a_layer_slides() -> None:
    ctx = ModelBuildContext(attention_backend=NoWindowAttention, dtype=torch.float32)
    config = tiny_config("mistral", 4)
    with pytest.raises(ValueError, match="NoWindowAttention does not support sliding-window"):
        LlamaForCausalLM(config, ctx)
    # a window no sequence outgrows (--max-model-len <= window) is dropped: any backend
    short = ModelBuildContext(
        attention_backend=NoWindowAttention, dtype=torch.float32, max_model_len=4
    )
    assert LlamaForCausalLM(config, short).model.layers[0].self_attn.attn.sliding_window is None
    longer = ModelBuildContext(
        attention_backend=TorchPagedAttention, dtype=torch.float32, max_model_len=5
    )
    assert LlamaForCausalLM(config, longer).model.layers[0].self_attn.attn.sliding_window == 4
    config.sliding_window = None  # no window: any backend
    LlamaForCausalLM(config, ctx)
