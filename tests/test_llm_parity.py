"""Greedy generation through ``LLM`` is token-identical to HF transformers ``generate``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_models import hf_greedy_tokens
from transformers import AutoModelForCausalLM

from chassis import LLM, SamplingParams
from chassis.core.tokenizer import load_tokenizer

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a long story about a dragon who learns to bake bread in a small village by the sea, "
    "and the friends she makes along the way.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32",
    "def fibonacci(n):",
]
MAX_TOKENS = 12


def hf_greedy(model_dir, prompts, max_tokens, dtype=torch.float32) -> list[list[int]]:
    """HF transformers' greedy tokens for ``prompts`` (a fresh list each call).

    Computed once per checkpoint (its files as written), prompts, length and dtype in a run:
    the answer is deterministic, and several tests compare different engine settings with the
    same one (tests/test_tensor_parallel.py too)."""
    files = tuple(
        (path.name, path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(Path(model_dir).iterdir())
        if path.is_file()
    )
    key = (str(model_dir), files, repr(prompts), max_tokens, str(dtype))
    if key not in _HF_GREEDY:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        _HF_GREEDY[key] = hf_greedy_tokens(model, load_tokenizer(model_dir), prompts, max_tokens)
    return [list(tokens) for tokens in _HF_GREEDY[key]]


#: :func:`hf_greedy`'s answers so far
_HF_GREEDY: dict[tuple, list[list[int]]] = {}


def chassis_greedy(model_dir, prompts, max_tokens, **engine) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=128, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny_dirs(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "engine",
    [
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16, "block_size": 4},  # forces chunked prefill
    ],
    ids=["prefix-cache", "no-prefix-cache", "chunked-prefill"],
)
def test_tiny_models_match_hf(tiny_dirs, arch, engine):
    model_dir = tiny_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **engine) == expected


def test_prefix_cache_hits_keep_outputs(tiny_llama_dir):
    """A second batch sharing long prefixes with the first hits the cache, same tokens."""
    shared = "A shared system prompt that is long enough to fill several KV cache blocks. " * 3
    prompts = [shared + "Question one?", shared + "Question two?", shared + "Three"]
    expected = hf_greedy(tiny_llama_dir, prompts, 8)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert rest[0].num_cached_tokens > 0
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 0
    assert llm.engine.kv_cache_manager.num_free_blocks == 64


def test_smollm2_matches_hf(smollm2_dir):
    prompts = ["The capital of France is", "Once upon a time", "import numpy as np\n"]
    expected = hf_greedy(smollm2_dir, prompts, 16)
    got = chassis_greedy(smollm2_dir, prompts, 16, max_num_batched_tokens=8)
    assert got == expected


def test_smollm2_chat_answers(smollm2_dir):
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, num_kv_blocks=64)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=20),
    )
    assert out[0].outputs[0].text.strip() == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
    one = SamplingParams(temperature=0.0, max_tokens=1)
    # text parts render as the plain string does (vLLM's LLM.chat, and the server)
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert llm.chat(parts, one)[0].prompt == llm.chat(joined, one)[0].prompt
    # an assistant turn to continue, and kwargs that reach the template
    prefix = [*joined, {"role": "assistant", "content": "The capital"}]
    continued = llm.chat(prefix, one, continue_final_message=True)[0].prompt
    assert continued.endswith("The capital")
    inline = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ flavour }}"
    rendered = llm.chat(joined, one, chat_template=inline, chat_template_kwargs={"flavour": "X"})
    assert rendered[0].prompt == "What is the capital\nof France?|X"
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], one)
    assert llm.chat(joined, one)[0].outputs[0].token_ids  # still serving after the error


def test_a_model_without_attention_layers_runs_and_matches_hf(tmp_path):
    """Zero decoder layers (embedding, final norm, head): no KV cache to size, which once
    divided by zero; the blocks then cost nothing and the engine still matches HF."""
    from fixtures_models import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint("llama", tmp_path / "no_layers", num_hidden_layers=0)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert got == hf_greedy(model_dir, PROMPTS[:2], 4)
