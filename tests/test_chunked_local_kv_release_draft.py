"""A draft model beside chunk groups (tests/test_chunked_local_kv_release.py's release, with
speculative decoding): every draft layer reads the target's full group, never a chunk group
whose blocks before each request's current chunk are released, and the outputs stay HF's."""

from __future__ import annotations

from pathlib import Path

from fixtures_models import save_tiny_checkpoint
from test_llama4 import CHUNK, tiny_config
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy
from test_sliding_window_kv import make_llm, run


def test_a_draft_model_reads_the_full_group_and_keeps_outputs(tmp_path: Path) -> None:
    # the draft is the target itself (layers 0 and 2 chunked): a draft layer reading a
    # released or wrong block would disagree with the target and have a draft rejected
    model_dir = save_tiny_checkpoint(tiny_config(), tmp_path / "llama4", seed=4)
    spec = {"model": str(model_dir), "num_speculative_tokens": 3}
    llm = make_llm(model_dir, release=True, speculative_config=spec)
    kv = llm.engine.kv_cache_manager
    assert (kv.group_windows, kv.group_chunks) == ([None, None], [None, CHUNK])
    drafter = llm.engine.executor.worker.runner.drafter
    assert drafter.layer_group == [0, 0, 0, 0]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    tokens, _ = run(llm, PROMPTS)
    assert tokens == expected
    scheduler = llm.engine.scheduler
    assert scheduler.spec_num_accepted_tokens == scheduler.spec_num_draft_tokens > 0
    # again, from the prefix cache (chunk-group hits with null entries before the chunk)
    hits_before = kv.prefix_cache_hits
    again, _ = run(llm, PROMPTS)
    assert again == expected and kv.prefix_cache_hits > hits_before
    assert scheduler.spec_num_accepted_tokens == scheduler.spec_num_draft_tokens
