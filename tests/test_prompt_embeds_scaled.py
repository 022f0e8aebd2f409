"""Prompts given as embeddings for models that scale their token embeddings (Gemma 1/2/3,
Granite), against HF ``generate(inputs_embeds=...)`` on tiny random float32 checkpoints.

Given rows are HF's ``inputs_embeds``: what ``get_input_embeddings()(ids)`` returns. Gemma's
embedding layer scales by ``sqrt(hidden_size)`` itself, so its rows are taken as they are;
Granite's forward multiplies ``inputs_embeds`` by ``embedding_multiplier`` (12 here), given
ones too, so chassis scales given rows as well. Either way the rows of a prompt's ids answer
as the ids, token for token, and as HF answers the same rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_gemma_models import load_hf as load_hf_gemma
from test_gemma_models import write_checkpoint as write_gemma
from test_olmo2_granite_models import write_checkpoint as write_granite

from chassis import LLM, SamplingParams

TEXTS = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12"]
MAX_TOKENS = 8
ARCHITECTURES = ("gemma", "gemma2", "gemma3", "granite")


def write(arch: str, directory: Path) -> Path:
    return write_granite(arch, directory) if arch == "granite" else write_gemma(arch, directory)


def load_hf(arch: str, model_dir: Path) -> Any:
    if arch != "granite":
        return load_hf_gemma(model_dir)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy_from_rows(hf: Any, rows: torch.Tensor) -> list[int]:
    """HF ``generate``'s greedy continuation of a prompt given as ``inputs_embeds``."""
    with torch.inference_mode():
        gen = hf.generate(
            inputs_embeds=rows[None],
            attention_mask=torch.ones(1, rows.shape[0], dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return gen[0].tolist()  # (given only embeddings, HF returns just the new tokens)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rows_answer_as_hf_inputs_embeds(arch: str, tmp_path: Path) -> None:
    """HF's embedding rows of each prompt give HF's ``generate(inputs_embeds=...)`` tokens,
    which are also the token prompt's; rows of another scale answer otherwise (the scale
    matters, so the match is not vacuous)."""
    model_dir = write(arch, tmp_path / arch)
    hf = load_hf(arch, model_dir)
    llm = LLM(
        str(model_dir),
        enable_prompt_embeds=True,
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        tokenizer = llm.get_tokenizer()
        ids = [tokenizer(text).input_ids for text in TEXTS]
        with torch.inference_mode():
            rows = [hf.get_input_embeddings()(torch.tensor(i)).detach().clone() for i in ids]
        expected = [hf_greedy_from_rows(hf, r) for r in rows]
        by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], params)
        assert [o.outputs[0].token_ids for o in by_ids] == expected
        got = llm.generate([{"prompt_embeds": r} for r in rows], params)
        assert [o.outputs[0].token_ids for o in got] == expected
        other = llm.generate({"prompt_embeds": rows[0] * 0.05}, params)[0]
        assert other.outputs[0].token_ids != expected[0]
    finally:
        llm.shutdown()
