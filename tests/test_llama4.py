"""Llama 4 against HF transformers on tiny random float32 checkpoints.

The text checkpoint has 4 layers of hidden 64 (4 heads, 2 KV heads of 16) with chunks of 8:
layer 0 RoPE, chunked attention and a dense MLP; layer 1 NoPE (queries scaled by position,
``floor_scale`` 4), full attention and MoE; layer 2 RoPE, chunked, MoE; layer 3 NoPE, dense.
RoPE is ``llama3``-scaled, q/k L2-normed on the RoPE layers; 4 experts, top 1, and a shared
expert. Logits must match HF's (batched prefill, decode, chunks over a cached prefix and
decodes, all across chunk boundaries); greedy tokens and logprobs through ``LLM`` must be
HF's ``generate``'s with and without chunked prefill and prefix caching. The multimodal
checkpoint's language model loads as text only.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import check_parity, hf_logits, load_hf
from test_sliding_window_models import check_window_parity
from test_tensor_parallel import wait_for_no_workers

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.llama4 import (
    Llama4ForCausalLM,
    Llama4MoE,
    chunked_layers,
    moe_layers,
)
from chassis.core.layers.moe import experts_on_weighted_input, fused_experts_ref
from chassis.core.model_interface import ModelBuildContext

CHUNK = 8


def text_fields(**overrides: Any) -> dict[str, Any]:
    return {
        **TINY_CONFIG_FIELDS,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "intermediate_size": 32,
        "intermediate_size_mlp": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "no_rope_layers": [1, 0, 1, 0],
        "moe_layers": [1, 2],
        "attention_chunk_size": CHUNK,
        "floor_scale": 4,
        "attn_scale": 0.5,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        **overrides,
    }


def tiny_config(**overrides: Any) -> Any:
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**text_fields(**overrides))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny_llama4"), seed=4)


def build(config: Any, **ctx: Any) -> Llama4ForCausalLM:
    build_ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32, **ctx)
    return Llama4ForCausalLM(config, build_ctx)


# -- logits -----------------------------------------------------------------------------------


def test_logits_match_transformers(model_dir: Path) -> None:
    """Prefill of 13 and 3 tokens together, a decode, a chunk over the cached prefix; then
    chunks of 11 and 9 tokens and decodes to 24 (three attention chunks): HF's logits."""
    check_parity(model_dir, TOKEN_PROMPTS, atol=1e-4)
    runner = check_window_parity(model_dir)
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.attention_chunk_size for layer in layers] == [
        CHUNK,
        None,
        CHUNK,
        None,
    ]
    assert [layer.self_attn.use_rope for layer in layers] == [True, False, True, False]
    assert [isinstance(layer.mlp, Llama4MoE) for layer in layers] == [False, True, True, False]


def test_each_option_changes_the_logits(model_dir: Path) -> None:
    """Not vacuous: HF's own logits move without the chunks, without the NoPE temperature,
    and with the experts' weight on their output instead of their input."""
    tokens = list(range(100, 124))
    reference = hf_logits(load_hf(model_dir), tokens)

    hf_model = load_hf(model_dir)
    hf_model.config.layer_types = ["full_attention"] * 4
    full = hf_logits(hf_model, tokens)
    torch.testing.assert_close(full[:CHUNK], reference[:CHUNK], atol=1e-5, rtol=1e-5)
    assert (full[-1] - reference[-1]).abs().max() > 1e-3

    hf_model = load_hf(model_dir)
    for layer in hf_model.model.layers:
        layer.self_attn.attn_temperature_tuning = False
    assert (hf_logits(hf_model, tokens)[-1] - reference[-1]).abs().max() > 1e-3


def test_input_weighted_experts_match_a_direct_loop() -> None:
    """``experts_on_weighted_input`` (top 1 and top 2) is ``sum_j expert_j(p_j x)``, which
    differs from the output-weighted form."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=gen)
    w13 = torch.randn(4, 2 * 8, 16, generator=gen) * 0.3
    w2 = torch.randn(4, 16, 8, generator=gen) * 0.3
    for top_k in (1, 2):
        ids = torch.stack([torch.randperm(4, generator=gen)[:top_k] for _ in range(7)])
        weights = torch.rand(7, top_k, generator=gen)
        out = experts_on_weighted_input(
            x, weights, ids, lambda rows, w, e: fused_experts_ref(rows, w13, w2, w, e)
        )
        expected = torch.zeros_like(x)
        for t in range(7):
            for j in range(top_k):
                e = int(ids[t, j])
                gate, up = (w13[e] @ (weights[t, j] * x[t])).chunk(2)
                expected[t] += w2[e] @ (torch.nn.functional.silu(gate) * up)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        output_weighted = fused_experts_ref(x, w13, w2, weights, ids)
        assert not torch.allclose(out, output_weighted, atol=1e-3)


# -- what the config says ---------------------------------------------------------------------


def test_defaults_derive_the_layers_as_transformers_does() -> None:
    """Without ``layer_types`` / ``moe_layers`` the same layers as HF's derived lists."""
    from transformers import Llama4TextConfig

    for step in (1, 2):
        hf_config = Llama4TextConfig(num_hidden_layers=8, interleave_moe_layer_step=step)
        assert moe_layers(hf_config) == frozenset(hf_config.moe_layers)
        hf_config.moe_layers = None
        assert moe_layers(hf_config) == frozenset(range(step - 1, 8, step))
        expected = {i for i, kind in enumerate(hf_config.layer_types) if kind != "full_attention"}
        assert chunked_layers(hf_config) == expected == {0, 1, 2, 4, 5, 6}
        hf_config.layer_types = None
        assert chunked_layers(hf_config) == expected


def test_a_chunk_beyond_the_longest_sequence_is_full_attention() -> None:
    model = build(tiny_config(), max_model_len=CHUNK)
    assert all(layer.self_attn.attn.attention_chunk_size is None for layer in model.model.layers)


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        build(tiny_config(hidden_act="gelu"))
    config = tiny_config()
    config.layer_types = ["sliding_attention", *config.layer_types[1:]]
    with pytest.raises(ValueError, match="layer_types has 'sliding_attention'"):
        build(config)

    class NoChunks(TorchPagedAttention):
        supports_chunked_attention = False

    ctx = ModelBuildContext(attention_backend=NoChunks, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not support chunked local attention"):
        Llama4ForCausalLM(tiny_config(), ctx)


def test_wrong_expert_shapes_are_refused(model_dir: Path) -> None:
    model = build(tiny_config())
    bad = torch.zeros(4, 64, 30)
    with pytest.raises(ValueError, match=r"expected \(4, 64, 64\)"):
        model.load_weights([("model.layers.1.feed_forward.experts.gate_up_proj", bad)])
    with pytest.raises(ValueError, match="is the layer in moe_layers"):
        model.load_weights([("model.layers.0.feed_forward.experts.down_proj", bad)])


# -- generation through LLM -------------------------------------------------------------------


def _tokens_and_logprobs(outputs: list[Any]) -> tuple[list[list[int]], list[list[float]]]:
    """Each request's generated tokens and the logprob of each."""
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [float(step[t].logprob) for step, t in zip(o.outputs[0].logprobs, ids, strict=True)]
        for o, ids in zip(outputs, tokens, strict=True)
    ]
    return tokens, logprobs


def _generate(model_dir: Path, **engine: Any) -> tuple[list[list[int]], list[list[float]]]:
    from chassis import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=128, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    return _tokens_and_logprobs(llm.generate(PROMPTS, params))


def _hf_logprobs(model_dir: Path, tokens: list[list[int]]) -> list[list[float]]:
    from chassis.core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    hf_model = load_hf(model_dir)
    result = []
    for prompt, generated in zip(PROMPTS, tokens, strict=True):
        ids = tokenizer(prompt).input_ids
        logits = hf_logits(hf_model, ids + generated)[len(ids) - 1 : -1]
        logprobs = torch.log_softmax(logits, dim=-1)
        result.append([float(logprobs[i, t]) for i, t in enumerate(generated)])
    return result


def test_greedy_tokens_and_logprobs_match_transformers(model_dir: Path) -> None:
    """All prompts in one ``generate`` (blocks of 16, longer than two chunks), then prefills
    chunked to 16 tokens over blocks of 4 with prefix caching on (the prompts run twice: the
    second time from the cache): HF's tokens, and logprobs within 1e-4."""
    from chassis.core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * CHUNK
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    tokens, logprobs = _generate(model_dir)
    assert tokens == expected
    for ours, theirs in zip(logprobs, _hf_logprobs(model_dir, expected), strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)
    from chassis import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        max_num_batched_tokens=16,
        block_size=4,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    for run in range(2):
        outputs = llm.generate(PROMPTS, params)
        cached = sum(o.num_cached_tokens for o in outputs)
        assert cached > 0 if run else cached == 0  # the second run reads the prompts' blocks
        again_tokens, again = _tokens_and_logprobs(outputs)
        assert again_tokens == expected
        for ours, theirs in zip(again, logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


def test_reference_backend_gives_the_same_tokens(model_dir: Path) -> None:
    """``torch_paged`` (the reference) as well as the CPU's default ``cpu_paged``."""
    tokens, _ = _generate(model_dir, attention_backend="torch_paged")
    assert tokens == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_two_ranks_match_transformers(model_dir: Path, expert_parallel: bool) -> None:
    """Two real ranks (half the heads, one KV head, half of the shared expert's and the dense
    MLP's columns each, and half of every expert's columns or, with expert parallelism, two
    whole experts): HF's greedy tokens."""
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    engine = {"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel}
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()


def test_multimodal_checkpoint_serves_its_language_model(model_dir: Path, tmp_path: Path) -> None:
    """A ``Llama4ForConditionalGeneration`` checkpoint (tiny vision tower and projector,
    never read): the text-only model's greedy tokens; a chat message with an image is
    refused."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4VisionConfig

    vision = Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=28,
        patch_size=14,
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
    )
    config = Llama4Config(text_config=text_fields(), vision_config=vision.to_dict())
    config.architectures = ["Llama4ForConditionalGeneration"]
    torch.manual_seed(0)
    wrapper = Llama4ForConditionalGeneration(config).eval()
    text_model = load_hf(model_dir)
    wrapper.language_model.load_state_dict(text_model.state_dict())
    wrapper.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    from chassis import LLM, SamplingParams

    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    assert tokens == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat(with_image, params)
