"""No per-step host stalls (issue 5, item 4): a decode step of the whole engine on a GPU waits
for the device once, for the event recorded after the non-blocking copy of the sampled token
ids, and makes no other synchronizing CUDA call; with CUDA graphs and without, with async
scheduling and without. torch's sync debug mode warns on every synchronizing CUDA call; the
test counts those warnings outside the event wait, and the event waits themselves.
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


class _CountedEvent:
    """Wraps a platform event: counts its waits, and keeps their warnings apart."""

    waits = 0

    def __init__(self, event) -> None:
        self._event = event

    def query(self) -> bool:
        """Not a wait (the decode graphs' input staging asks it; ``True`` there means no
        wait follows)."""
        return self._event.query()

    def synchronize(self) -> None:
        _CountedEvent.waits += 1
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            self._event.synchronize()


def _syncs_per_decode_step(directory, monkeypatch, **engine: object) -> list[tuple[int, int]]:
    """Per decode step: (event waits, other synchronizing CUDA calls)."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    llm = LLM(
        str(directory), skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=256, **engine
    )
    core = llm.engine
    platform = core.executor.worker.runner.in_flight.platform
    record_event = platform.record_event
    monkeypatch.setattr(platform, "record_event", lambda: _CountedEvent(record_event()))
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
            waits_before = _CountedEvent.waits
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                core.step()
            other = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
            counts.append((_CountedEvent.waits - waits_before, other))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return counts


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_decode_step_waits_once(tmp_path, monkeypatch, enforce_eager, async_scheduling):
    write_tiny_qwen3(tmp_path)
    counts = _syncs_per_decode_step(
        tmp_path, monkeypatch, enforce_eager=enforce_eager, async_scheduling=async_scheduling
    )
    assert counts == [(1, 0)] * DECODE_STEPS, f"(event waits, other syncs) per step: {counts}"
