"""CPU checks behind two GPU-test failures of the first H200 run (docs/performance.md, "GPU
tests of that day"); no GPU needed:

  python tests/perf/hf_reference_checks.py gemma2     # HF's logits with and without the cap
  TRITON_INTERPRET=1 python tests/perf/hf_reference_checks.py deepseek

``gemma2``: at the tiny Gemma 2 of ``tests/gpu/test_gpu_engine.py`` (seed 2, the 17-token
prompt) eager HF's two best last-position logits with the attention soft cap, without it
(what HF's default GPU attention gave on the H200: [2.1781, 2.1669] for ids [49, 263]), and
with float32 matmul inputs rounded to TF32 (to nearest, then towards zero).

``deepseek``: greedy tokens of ``tests/gpu/test_gpu_mla.py``'s tiny DeepSeek-V2 prompts from
HF (eager and SDPA) and from the engine with ``torch_paged`` and ``triton_paged`` (the Triton
kernels under the interpreter when ``TRITON_INTERPRET=1``), each against eager HF's.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "gpu"), str(TESTS)]

from test_gpu_engine import (  # noqa: E402  (after the path)
    NEW_TOKENS,
    PROMPT_LENS,
    VOCAB,
    hf_greedy,
    write_tiny_gemma2,
)


def _to_tf32(x: torch.Tensor, nearest: bool) -> torch.Tensor:
    """``x`` (float32) with its mantissa cut to TF32's 10 bits."""
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    if nearest:
        bits = bits + 0x0FFF + ((bits >> 13) & 1)
    return (bits & ~0x1FFF).view(torch.float32)


def gemma2() -> None:
    from transformers import AutoModelForCausalLM

    directory = Path(tempfile.mkdtemp(prefix="gemma2-"))
    write_tiny_gemma2(directory)
    rng = random.Random(2)
    prompt = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS][1]

    def top2(**overrides: object) -> str:
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager", **overrides
        )
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        top = logits.topk(2)
        return f"{[round(v, 4) for v in top.values.tolist()]} for ids {top.indices.tolist()}"

    print("with the soft cap:   ", top2())
    print("without the soft cap:", top2(attn_logit_softcapping=None))
    linear, matmul = F.linear, torch.matmul
    for nearest in (True, False):
        F.linear = lambda x, w, b=None, n=nearest: linear(_to_tf32(x, n), _to_tf32(w, n), b)
        torch.matmul = lambda a, b, n=nearest: matmul(_to_tf32(a, n), _to_tf32(b, n))
        try:
            rounding = "to nearest" if nearest else "towards zero"
            print(f"TF32 ({rounding}):", top2())
        finally:
            F.linear, torch.matmul = linear, matmul


def deepseek() -> None:
    from test_deepseek_models import write_checkpoint

    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    directory = write_checkpoint("v2_lite", Path(tempfile.mkdtemp(prefix="deepseek-")) / "m")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(directory, prompts, "cpu")  # eager
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.inference_mode():
        got = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = sdpa.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            got.append(out[0, len(prompt) :].tolist())
    print("HF sdpa equals HF eager:", got == expected)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for backend in ("torch_paged", "triton_paged"):
        llm = LLM(
            str(directory),
            skip_tokenizer_init=True,
            dtype="float32",
            attention_backend=backend,
            max_model_len=256,
            max_num_batched_tokens=32,
            num_kv_blocks=64,
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens = [o.outputs[0].token_ids for o in outputs]
        print(f"engine with {backend} equals HF eager:", tokens == expected)
        del llm


if __name__ == "__main__":
    checks = {"gemma2": gemma2, "deepseek": deepseek}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(checks)}")
    checks[sys.argv[1]]()
