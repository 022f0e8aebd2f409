"""vLLM's ``cache_salt``: cached prompt blocks are shared only between requests of the same
salt (and unsalted requests only with each other)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from fixtures_server import *  # noqa: F403

from chassis import LLM, SamplingParams

#: 40 tokens: two full blocks of 16 can be cached
PROMPT = [1, *range(300, 339)]


def test_salted_prompts_share_cached_blocks_only_with_the_same_salt(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def cached(salt: str | None) -> int:
        prompt: dict = {"prompt_token_ids": PROMPT}
        if salt is not None:
            prompt["cache_salt"] = salt
        [output] = llm.generate(prompt, params)
        return output.num_cached_tokens

    assert cached("alice") == 0
    assert cached("alice") == 32  # the two full blocks
    assert cached("bob") == 0
    assert cached(None) == 0
    assert cached(None) == 32
    assert cached("bob") == 32
    # the same tokens without a prompt dict: no salt
    assert llm.generate([PROMPT], params)[0].num_cached_tokens == 32
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt_token_ids": PROMPT, "cache_salt": ""}, params)


def test_the_routes_pass_cache_salt_to_the_engine(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "cache_salt": "tenant-1"}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json={**chat, "cache_salt": "t2"}).status_code == 200
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert engine.cache_salts == ["tenant-1", "t2", None]
    refused = client.post("/v1/completions", json={**body, "cache_salt": ""})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "cache_salt"


def test_offline_beam_search_salts_its_step_requests(tiny_llama_dir: Path) -> None:
    """LLM.beam_search gives a prompt dict's cache_salt to every step request: a later
    unsalted request of the same prompt finds none of their blocks."""
    from chassis import BeamSearchParams

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    llm.beam_search(
        [{"prompt_token_ids": PROMPT, "cache_salt": "s"}],
        BeamSearchParams(beam_width=2, max_tokens=2),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    assert llm.generate([PROMPT], params)[0].num_cached_tokens == 0
    salted = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "s"}, params)
    assert salted[0].num_cached_tokens == 32
