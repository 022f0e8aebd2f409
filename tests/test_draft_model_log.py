"""The draft model's loaded line states once, at start-up, which drafts random requests get:
drawn from the draft's distribution (``draft_sampling: "probabilistic"``) or its argmax
(one-hot, ``"greedy"``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from chassis import LLM


@pytest.mark.parametrize(
    ("draft_sampling", "kind"), [("probabilistic", "(probabilistic)"), ("greedy", "(one-hot)")]
)
def test_the_loaded_line_names_the_draft_sampling(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture, draft_sampling: str, kind: str
) -> None:
    spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    spec["draft_sampling"] = draft_sampling
    with caplog.at_level(logging.INFO, logger="chassis.core.draft_model"):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            max_model_len=64,
            num_kv_blocks=32,
            block_size=4,
            speculative_config=spec,
        )
    llm.shutdown()
    loaded = [r.getMessage() for r in caplog.records if "loaded:" in r.getMessage()]
    assert len(loaded) == 1, loaded
    assert kind in loaded[0] and f"draft_sampling {draft_sampling}" in loaded[0], loaded[0]
