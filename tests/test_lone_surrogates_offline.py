"""The offline API refuses text holding a lone UTF-16 surrogate with a ``ValueError`` naming
it (core/lone_surrogates.py, the rule the server's 400 uses), not the tokenizer's
``TypeError``; nothing is submitted, and the engine serves the next call."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_embeddings import pooling_llm

from chassis.core.llm import LLM
from chassis.core.sampling_params import SamplingParams

LONE = "caf\ud800"
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one intra-op thread (``fixtures_threads``)."""


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128)


def test_generate_names_the_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^prompt holds a lone UTF-16 surrogate"):
        llm.generate(LONE, GREEDY)
    with pytest.raises(ValueError, match=r"^prompts\.1 holds a lone UTF-16 surrogate"):
        llm.generate(["fine", "\ud800"], GREEDY)
    with pytest.raises(ValueError, match=r"^prompts\.0\.prompt holds"):
        llm.generate([{"prompt": LONE}], GREEDY)
    with pytest.raises(ValueError, match=r"^prompt holds"):
        llm.beam_search(LONE, _beam_params())
    # a correct pair is one character, and nothing was left behind by the refusals
    [out] = llm.generate("caf\U0001f600", GREEDY)
    assert len(out.outputs[0].token_ids) == 2
    assert not llm.engine.has_unfinished()


def test_chat_names_the_message(llm: LLM) -> None:
    messages = [{"role": "system", "content": "ok"}, {"role": "user", "content": LONE}]
    with pytest.raises(ValueError, match=r"^messages\.1\.content holds a lone UTF-16"):
        llm.chat(messages, GREEDY, chat_template=TEMPLATE)
    parts = [{"role": "user", "content": [{"type": "text", "text": LONE}]}]
    with pytest.raises(ValueError, match=r"^messages\.1\.0\.content\.0\.text holds"):
        llm.chat([[{"role": "user", "content": "hi"}], parts], GREEDY, chat_template=TEMPLATE)


def test_embed_names_the_prompt(tiny_llama_dir: Path) -> None:
    pooling = pooling_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"^prompts\.0 holds a lone UTF-16 surrogate"):
        pooling.embed([LONE])
    with pytest.raises(ValueError, match=r"^data_2\.1 holds a lone UTF-16 surrogate"):
        pooling.score("a", ["b", LONE])
    assert len(pooling.embed("fine")) == 1


TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _beam_params():
    from chassis.core.beam_search import BeamSearchParams

    return BeamSearchParams(beam_width=2, max_tokens=2)
