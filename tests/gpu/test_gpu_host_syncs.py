"""No per-step host stalls (issue 5, item 4): a decode step of the whole engine on a GPU makes
one device-to-host synchronization, the read of the sampled token ids, with CUDA graphs and
without. torch's sync debug mode warns on every synchronizing CUDA call; the test counts them.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from test_gpu_engine import VOCAB, write_tiny_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

DECODE_STEPS = 6


def _syncs_per_decode_step(directory, **engine: object) -> list[int]:
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    llm = LLM(
        str(directory), skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=256, **engine
    )
    core = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, length in enumerate((7, 30, 12)):
        prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
        for request in llm.input_processor.process(prompt, params, f"r{i}"):
            core.add_request(request)
    for _ in range(3):  # prefill, then warm the decode path (and its graph)
        core.step()
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(DECODE_STEPS):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                core.step()
            counts.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return counts


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_decode_step_syncs_once(tmp_path, enforce_eager):
    write_tiny_qwen3(tmp_path)
    counts = _syncs_per_decode_step(tmp_path, enforce_eager=enforce_eager)
    assert counts == [1] * DECODE_STEPS, f"synchronizing calls per decode step: {counts}"
