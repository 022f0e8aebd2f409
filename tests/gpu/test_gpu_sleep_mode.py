"""Sleep mode on a GPU: the device memory is really released, and the engine, its decode
graphs captured again at new addresses, still gives the same greedy tokens (run by
tests/gpu/run_gpu_checks.sh's pytest step; never run yet: no session so far had the GPU).

The tiny Qwen3 of tests/gpu/test_gpu_engine.py (no tokenizer), float32, graphs on.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from test_gpu_engine import PROMPT_LENS, VOCAB, hf_greedy, write_tiny_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

NEW_TOKENS = 8


def greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from chassis.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def test_sleep_frees_device_memory_and_wakes_with_the_same_tokens(tmp_path):
    from chassis.core.llm import LLM

    write_tiny_qwen3(tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    expected = hf_greedy(tmp_path, prompts, "cuda")
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        gpu_memory_utilization=0.2,  # a KV cache of ~28 GB on an H200: its release shows
        enable_sleep_mode=True,
    )
    assert greedy(llm, prompts) == expected
    awake = torch.cuda.memory_reserved()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    level1 = torch.cuda.memory_reserved()
    assert level1 < awake / 10, (awake, level1)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert greedy(llm, prompts) == expected  # weights back from host memory, graphs again
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])  # the RLHF order: weights first, then the KV cache
    llm.wake_up(tags=["kv_cache"])
    assert greedy(llm, prompts) == expected  # weights reloaded from the checkpoint
    print(f"reserved: awake {awake / 2**20:.0f} MiB, level 1 {level1 / 2**20:.0f} MiB")
