"""Prompts given as embeddings beyond the Llama decoder's models: OLMo 2's decoder (OLMo 2,
EXAONE 4), whose forward passes the residual stream itself from layer to layer, and Falcon-H1,
whose HF forward scales only the embeddings it computes itself (``embedding_multiplier``), not
given ``inputs_embeds``. HF's embedding rows of each prompt answer as HF
``generate(inputs_embeds=...)`` does on tiny random float32 checkpoints, which for OLMo 2 and
EXAONE 4 is also the token prompt's answer (tests/test_prompt_embeds_scaled.py's check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import save_tiny_checkpoint
from test_exaone4_model import tiny_config as exaone4_config
from test_falcon_h1 import tiny_config as falcon_h1_config
from test_olmo2_granite_models import write_checkpoint as write_olmo2
from test_prompt_embeds_scaled import MAX_TOKENS, TEXTS, hf_greedy_from_rows

from chassis import LLM, SamplingParams


def hf_greedy_by_forward(hf: Any, rows: torch.Tensor) -> list[int]:
    """HF's greedy continuation of ``rows`` by whole forwards (HF's Falcon-H1 ``generate``
    takes no ``inputs_embeds``): each generated token embedded as HF's forward embeds ids
    (times ``embedding_multiplier``), as a step past the prompt runs on the model's own
    embeddings."""
    scale = float(hf.config.embedding_multiplier)
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            logits = hf(inputs_embeds=rows[None], use_cache=False).logits[0, -1]
            tokens.append(int(logits.argmax()))
            new = hf.get_input_embeddings()(torch.tensor(tokens[-1:])) * scale
            rows = torch.cat([rows, new])
    return tokens


def write(arch: str, directory: Path) -> Path:
    if arch == "exaone4":
        return save_tiny_checkpoint(exaone4_config(), directory, seed=3)
    if arch == "falcon_h1":
        return save_tiny_checkpoint(falcon_h1_config("released"), directory, seed=11)
    return write_olmo2(arch, directory)


@pytest.mark.parametrize("arch", ["olmo2", "exaone4", "falcon_h1"])
def test_rows_answer_as_hf_inputs_embeds(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = write(arch, tmp_path / arch)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
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
        greedy = hf_greedy_by_forward if arch == "falcon_h1" else hf_greedy_from_rows
        expected = [greedy(hf, r) for r in rows]
        if arch != "falcon_h1":  # (its given rows are not its own embeddings, scaled)
            by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], params)
            assert [o.outputs[0].token_ids for o in by_ids] == expected
        got = llm.generate([{"prompt_embeds": r} for r in rows], params)
        assert [o.outputs[0].token_ids for o in got] == expected
        other = llm.generate({"prompt_embeds": rows[0] * 0.05}, params)[0]
        assert other.outputs[0].token_ids != expected[0]
    finally:
        llm.shutdown()
