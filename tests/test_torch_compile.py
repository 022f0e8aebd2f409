"""``--torch-compile`` on the CPU: the compiled forward generates HF transformers' greedy tokens.

One engine (tiny Qwen3, float32, chunked prefills beside decodes, async scheduling) compiles
at start-up; the test checks the tokens against HF ``generate``, that exactly two graphs were
compiled (any token count, and a single token) with no graph break, that serving requests
compiles nothing more, and that the platform's kernels and weight packing stayed out of it.
"""

from __future__ import annotations

import pytest
import torch
from test_llm_parity import PROMPTS, hf_greedy

from chassis import LLM, SamplingParams
from chassis.core.compiled_model import CompiledForward, paged_attention
from chassis.core.config import EngineConfig

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def compiled_llm(tiny_qwen3_dir):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    llm = LLM(
        str(tiny_qwen3_dir),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        block_size=4,
        max_num_batched_tokens=16,  # the longer prompts prefill in chunks beside decodes
        torch_compile=True,
        async_scheduling=True,
    )
    return llm, dict(counters["stats"]), dict(counters["graph_break"])


def test_compiled_forward_generates_hf_greedy_tokens(compiled_llm, tiny_qwen3_dir):
    from torch._dynamo.utils import counters

    llm, stats_at_start, graph_breaks = compiled_llm
    runner = llm.engine.executor.worker.runner
    assert isinstance(runner.forward, CompiledForward)
    assert runner.forward.compile_seconds > 0
    # Compiled at start-up: one graph for any token count, one for a single token.
    assert stats_at_start["unique_graphs"] == 2
    assert graph_breaks == {}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == hf_greedy(tiny_qwen3_dir, PROMPTS, MAX_TOKENS)
    assert counters["stats"]["unique_graphs"] == 2  # the steps compiled nothing more


def test_compiled_engine_leaves_platform_kernels_out(compiled_llm):
    from chassis.platforms.cpu_packed_linear import PackedLinear

    llm, _, _ = compiled_llm
    model = llm.engine.executor.worker.runner.model
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_the_attention_op_needs_a_compiled_forward():
    q = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="only inside a CompiledForward call"):
        paged_attention(q, q, q, 0)


def test_compile_and_enforce_eager_contradict():
    with pytest.raises(ValueError, match="--torch-compile and --enforce-eager"):
        EngineConfig(torch_compile=True, enforce_eager=True)
