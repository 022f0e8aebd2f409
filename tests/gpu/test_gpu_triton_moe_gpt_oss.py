"""gpt-oss's experts on the Triton fused MoE (``fused_moe_clamped_swiglu``: biases, clamped
SwiGLU) on a real GPU, run by tests/gpu/run_gpu_checks.sh (marker ``gpu_moe``: its ``moe``
step; ``STEPS=gpt_oss`` runs this file alone).

At gpt-oss-20b's expert shape (32 experts, top 4, hidden 2880, intermediate 2880) in
bfloat16, against the model's torch path (``experts_reference``): 1 to 512 tokens; a call
captured in a CUDA graph and replayed with routings that fill the groups very differently;
no synchronizing CUDA call; ``GptOssExperts`` taking the kernel and no longer blocking graph
capture. Then a tiny random gpt-oss checkpoint in the engine: decode graphs are captured
(the experts no longer block them) and greedy tokens with graphs equal the eager engine's
and HF ``generate``'s (float32).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from hf_gpt_oss_swiglu import make_hf_read_swiglu_config
from test_gpu_engine import NEW_TOKENS, PROMPT_LENS, TINY_QWEN3, VOCAB, divergence_report, hf_greedy

from chassis.builtin_plugins.models.gpt_oss import GptOssExperts, experts_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_moe,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4
ALPHA, LIMIT = 1.702, 7.0
#: gate and up of about this many standard deviations: some pass the limit of 7 (about 4%
#: of gates, 8% of ups), so both clamps bind
GAIN = 4.0
#: outputs have an rms of about 1.5; a float32 computation rounded once is within 2**-5 of
#: the bfloat16 torch path at this shape (measured on the CPU), the kernel is nearer
TOL = 2**-5


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=TOL, rtol=TOL)


@pytest.fixture(scope="module")
def experts() -> tuple[torch.Tensor, ...]:
    """``(w13, b13, w2, b2)`` in bfloat16 at gpt-oss-20b's shape."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=g)).bfloat16()

    return (
        randn(EXPERTS, 2 * INTER, HIDDEN, scale=GAIN / HIDDEN**0.5),
        randn(EXPERTS, 2 * INTER, scale=0.5),
        randn(EXPERTS, HIDDEN, INTER, scale=0.25 / INTER**0.5),
        randn(EXPERTS, HIDDEN, scale=0.5),
    )


def _inputs(tokens: int, seed: int, skew: float = 0.0) -> tuple[torch.Tensor, ...]:
    """``(x, weights, ids)``: gpt-oss's routing (softmax over the top-4 logits, rounded to
    bfloat16). ``skew`` adds to the logits of experts 0..3, crowding every token into the
    same groups."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    logits[:, :TOP_K] += skew
    top, ids = torch.topk(logits, TOP_K)
    return x, torch.softmax(top, dim=-1).bfloat16(), ids


def _fused(x, experts, weights, ids) -> torch.Tensor:
    from chassis.core.layers.triton_moe import fused_moe_clamped_swiglu

    w13, b13, w2, b2 = experts
    return fused_moe_clamped_swiglu(x, w13, b13, w2, b2, weights, ids, ALPHA, LIMIT)


def _reference(x, experts, weights, ids) -> torch.Tensor:
    w13, b13, w2, b2 = experts
    return experts_reference(x, w13, b13, w2, b2, weights, ids, ALPHA, LIMIT)


@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
def test_matches_the_torch_path_at_gpt_oss_20b_shape(experts, tokens: int) -> None:
    x, weights, ids = _inputs(tokens, seed=tokens)
    _close(_fused(x, experts, weights, ids), _reference(x, experts, weights, ids))


@pytest.mark.parametrize("tokens", [7, 64])
def test_a_captured_call_replays_with_new_inputs(experts, tokens: int) -> None:
    static = [t.clone() for t in _inputs(tokens, seed=100)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels, warm the allocator, off the graph
        _fused(static[0], experts, static[1], static[2])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(static[0], experts, static[1], static[2])
    # spread routings, then every token crowded into experts 0..3 (many blocks per group)
    for seed, skew in ((1, 0.0), (2, 50.0), (3, 0.0)):
        new = _inputs(tokens, seed=seed, skew=skew)
        for buffer, value in zip(static, new, strict=True):
            buffer.copy_(value)
        graph.replay()
        _close(out, _reference(new[0], experts, new[1], new[2]))


def test_a_call_makes_no_synchronizing_cuda_call(experts) -> None:
    x, weights, ids = _inputs(64, seed=5)
    _fused(x, experts, weights, ids)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _fused(x, experts, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _close(out, _reference(x, experts, weights, ids))


def test_the_experts_run_the_triton_kernel_on_the_gpu(experts) -> None:
    """GptOssExperts on CUDA tensors takes the platform's kernel (bit for bit what the kernel
    gives) and blocks no graph capture; its torch path stays available as the reference."""
    with torch.device("meta"):
        module = GptOssExperts(EXPERTS, HIDDEN, INTER, ALPHA, LIMIT)
    for name, value in zip(("w13", "b13", "w2", "b2"), experts, strict=True):
        setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    assert module.graph_capture_blocker() is None
    x, weights, ids = _inputs(33, seed=9)
    with torch.no_grad():
        got = module(x, weights, ids)
        expected = module.forward_reference(x, weights, ids)
    assert torch.equal(got, _fused(x, experts, weights, ids))
    _close(got, expected)


# -- a tiny gpt-oss in the engine -----------------------------------------------------------------


def write_tiny_gpt_oss(directory) -> None:
    """A tiny random gpt-oss (float32): the tiny Qwen3's shapes, 8 experts of intermediate 96,
    top 4, the first layer sliding with a window of 8, ``swiglu_limit`` 1.5 (the clamps
    bind), YaRN, and sinks, biases and norm weights randomized (HF initializes expert biases
    to 0 and sinks small)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **{**TINY_QWEN3, "intermediate_size": 96},
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=8,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif "bias" in name:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)


def _engine_greedy(directory, prompts: list[list[int]], **engine) -> list[list[int]]:
    """Greedy tokens of the engine on the GPU; with graphs, also checks that decode graphs
    were captured and replayed (nothing blocked them)."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    llm = LLM(
        str(directory),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,  # the 40-token prompt is prefilled in two chunks
        gpu_memory_utilization=0.2,
        **engine,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    graphs = llm.engine.executor.worker.runner.graphs
    if not engine.get("enforce_eager"):
        assert graphs is not None, "decode graphs were not captured"
        assert graphs.num_replays > 0
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outputs]


def test_tiny_gpt_oss_decodes_in_graphs_as_eager_and_hf(tmp_path, monkeypatch) -> None:
    """The experts run the fused kernel in both engines (prompts longer than the window of
    8, chunked prefills mixed with decodes); graph replay gives the eager tokens, and both
    give HF's (at the checkpoint's ``swiglu_limit``, also on a transformers that fixes it at
    7: tests/hf_gpt_oss_swiglu.py)."""
    make_hf_read_swiglu_config(monkeypatch)
    write_tiny_gpt_oss(tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    eager = _engine_greedy(tmp_path, prompts, enforce_eager=True)
    graphs = _engine_greedy(tmp_path, prompts)
    assert graphs == eager
    expected = hf_greedy(tmp_path, prompts, "cuda")
    assert eager == expected, divergence_report(tmp_path, prompts, expected, eager)
