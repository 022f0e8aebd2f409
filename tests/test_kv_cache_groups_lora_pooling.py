"""LoRA adapters and pooling (embeddings) on a model with KV cache groups.

The tiny Gemma 2 of ``test_sliding_window_groups`` (4 layers alternating a window of 4 and
full attention: two KV cache groups, the window group releasing blocks) runs

- greedy generation with an adapter, in a batch mixing it with the base model, against HF
  with the adapter's deltas merged into the weights (``fixtures_lora.hf_merged_model``);
- embeddings (last-token and mean pooling, chunked prefill over a token budget below the
  prompts) against HF's decoder hidden states pooled the same way, with and without an
  adapter.

Every prompt is longer than the window, so the window group's block tables hold released
(null) entries while these run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import hf_greedy, hf_merged_model, write_peft_adapter
from test_embeddings import pooling_llm, random_prompts
from test_gemma_models import load_hf
from test_gemma_models import write_checkpoint as write_gemma

from chassis.core.llm import LLM
from chassis.core.lora import LoRARequest
from chassis.core.pooler import finish_vector, pool_reference
from chassis.core.sampling_params import SamplingParams

SLIDING, FULL = "sliding_attention", "full_attention"
#: a grouped engine's block ids hold one group's layers: twice the ids of a single table
GROUPED = {
    "max_model_len": 128,
    "num_kv_blocks": 128,
    "block_size": 4,
    "attention_backend": "torch_paged",
}
NEW_TOKENS = 10
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2, 4 layers alternating a window of 4 and full attention: 2 groups of 2."""
    return write_gemma(
        "gemma2",
        tmp_path_factory.mktemp("gemma2_groups_lora"),
        num_hidden_layers=4,
        layer_types=[SLIDING, FULL] * 2,
    )


@pytest.fixture(scope="module")
def adapter(gemma2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rank 8 on every projection of every layer (both groups' layers)."""
    return write_peft_adapter(tmp_path_factory.mktemp("gemma2_adapter"), gemma2_dir, seed=3)


def assert_grouped(llm: LLM) -> None:
    assert llm.engine.kv_cache_manager.group_windows == [None, 4]


def test_an_adapter_on_a_grouped_model_matches_the_merged_weights(
    gemma2_dir: Path, adapter: Path
) -> None:
    prompts = random_prompts([17, 30, 9, 23], seed=5)
    prompts[1] = prompts[0]  # the same prompt with and without the adapter: no shared blocks
    loras = [LoRARequest("a", 1, str(adapter)), None] * 2
    llm = LLM(
        str(gemma2_dir),
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_num_batched_tokens=16,  # chunked prefill
        **GROUPED,
    )
    try:
        assert_grouped(llm)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests, params, lora_request=loras)
        got = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()
    merged = hf_merged_model(gemma2_dir, adapter, load=load_hf)
    base = load_hf(gemma2_dir)
    expected = [
        hf_greedy(merged if lora else base, p, NEW_TOKENS)
        for p, lora in zip(prompts, loras, strict=True)
    ]
    assert got == expected
    # the adapter changes the output (else the test could not fail)
    assert got[0] != hf_greedy(base, prompts[0], NEW_TOKENS)


def _hf_pooled(decoder: Any, token_ids: list[int], pooling_type: str) -> torch.Tensor:
    """HF's ``pooling_type`` pooled, L2-normalized hidden states of ``token_ids``."""
    with torch.inference_mode():
        hidden = decoder(torch.tensor([token_ids])).last_hidden_state[0]
    return finish_vector(pool_reference(hidden, pooling_type), None, True)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embeddings_of_a_grouped_model_match_hf(gemma2_dir: Path, pooling_type: str) -> None:
    prompts = random_prompts([40, 9, 29, 61], seed=7)  # BUDGET 24: several steps each
    llm = pooling_llm(gemma2_dir, pooler_config={"pooling_type": pooling_type}, **GROUPED)
    try:
        assert_grouped(llm)
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts])
        again = llm.embed([{"prompt_token_ids": p} for p in prompts])  # prefix-cache hits
    finally:
        llm.shutdown()
    decoder = load_hf(gemma2_dir).model
    for prompt, output, repeat in zip(prompts, outputs, again, strict=True):
        expected = _hf_pooled(decoder, prompt, pooling_type)
        for got in (output, repeat):
            torch.testing.assert_close(
                torch.tensor(got.outputs.embedding), expected, atol=TOLERANCE, rtol=0
            )


def test_embeddings_with_an_adapter_on_a_grouped_model_match_the_merged_weights(
    gemma2_dir: Path, adapter: Path
) -> None:
    prompts = random_prompts([33, 12, 50], seed=9)
    lora = LoRARequest("a", 1, str(adapter))
    llm = pooling_llm(gemma2_dir, enable_lora=True, max_loras=1, **GROUPED)
    try:
        assert_grouped(llm)
        outputs = llm.embed(
            [{"prompt_token_ids": p} for p in prompts], lora_request=[lora, None, lora]
        )
    finally:
        llm.shutdown()
    merged = hf_merged_model(gemma2_dir, adapter, load=load_hf).model
    base = load_hf(gemma2_dir).model
    for prompt, output, decoder in zip(prompts, outputs, [merged, base, merged], strict=True):
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding),
            _hf_pooled(decoder, prompt, "LAST"),
            atol=TOLERANCE,
            rtol=0,
        )
