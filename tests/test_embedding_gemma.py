"""EmbeddingGemma (a ``Gemma3TextModel`` with ``use_bidirectional_attention``) as an
embedding model: ``LLM.embed`` against HF transformers' ``AutoModel`` (float32, a tiny
random checkpoint, tolerance 1e-5), prompts of different lengths in one step and over
several, longer than the sliding layers' window (whose symmetric window is shown to
matter); its sentence-transformers folder (mean pooling, two Dense projections,
Normalize); and what is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from bert_checkpoints import hf_hidden_states
from encoder_checkpoints import GEMMA_MAX_DISTANCE, write_embedding_gemma
from safetensors.torch import save_file

import chassis.core.encoder_only as encoder_only
from chassis.core.llm import LLM

TOL = 1e-5
#: 4 to 32 tokens with <bos> and <eos>: most longer than the window (4 places each side)
PROMPTS = [
    "hello world",
    "The cat sat on the mat, the dog was good",
    " ".join(["a long and winding sentence"] * 6),
    "what is the capital of france?",
    "paris",
]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_embedding_gemma(tmp_path_factory.mktemp("embedding_gemma"))


@pytest.fixture(scope="module")
def hf_states(gemma_dir: Path) -> list[torch.Tensor]:
    return hf_hidden_states(gemma_dir, PROMPTS)


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", **kwargs)


def _pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    vector = states[-1] if pooling_type == "LAST" else states.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.mark.parametrize(
    ("pooling_type", "budget"),
    [("MEAN", 256), ("MEAN", 40), ("LAST", 256)],
    ids=["mean_one_step", "mean_several_steps", "last_one_step"],
)
def test_embeddings_match_hf(
    pooling_type: str,
    budget: int,
    gemma_dir: Path,
    hf_states: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pooler = None if pooling_type == "MEAN" else {"pooling_type": pooling_type}
    llm = _llm(gemma_dir, max_num_batched_tokens=budget, max_model_len=40, pooler_config=pooler)
    assert llm.config.runner == "pooling"  # picked from the architecture
    assert llm.pooler_config.pooling_type == pooling_type  # MEAN: the model's default
    steps: list[list[int]] = []
    original = encoder_only.whole_prompt_lengths

    def spy(metadata: Any) -> torch.Tensor:
        lengths = original(metadata)
        steps.append(lengths.tolist())
        return lengths

    monkeypatch.setattr(encoder_only, "whole_prompt_lengths", spy)
    outputs = llm.embed(PROMPTS)
    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert max(lengths) > 2 * GEMMA_MAX_DISTANCE + 1  # past the sliding window
    forwards = {tuple(step) for step in steps}  # the layout is computed once per forward
    assert sorted(n for step in forwards for n in step) == sorted(lengths)
    assert (len(forwards) == 1) == (budget == 256)
    for output, states in zip(outputs, hf_states, strict=True):
        assert len(output.prompt_token_ids) == states.shape[0]
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding),
            _pooled(states, pooling_type),
            atol=TOL,
            rtol=0,
        )


def test_sliding_window_matters(gemma_dir: Path, hf_states: list[torch.Tensor]) -> None:
    """HF's model with a window wider than every prompt gives the long prompts other hidden
    states, the short one the same: the parity above checks the symmetric window."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(gemma_dir, dtype=torch.float32, sliding_window=1000)
    assert model.config.sliding_window > 100
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    with torch.inference_mode():
        for index in (2, 4):
            encoded = tokenizer(PROMPTS[index], return_tensors="pt")
            wide = model.eval()(**encoded).last_hidden_state[0]
            difference = float((wide - hf_states[index]).abs().max())
            if wide.shape[0] > GEMMA_MAX_DISTANCE + 1:
                assert difference > 1e-2
            else:
                assert difference < 1e-6


def _write_dense(folder: Path, weight: torch.Tensor) -> None:
    folder.mkdir()
    out_features, in_features = weight.shape
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"linear.weight": weight.contiguous()}, str(folder / "model.safetensors"))


def test_sentence_transformers_folder(
    gemma_dir: Path, hf_states: list[torch.Tensor], tmp_path: Path
) -> None:
    """EmbeddingGemma's folder: Transformer, mean Pooling, Dense 768 -> 3072 -> 768 (here
    64 -> 96 -> 64, no bias, Identity), Normalize."""
    model_dir = tmp_path / "st"
    shutil.copytree(gemma_dir, model_dir)
    modules = [
        ("0", "", "Transformer"),
        ("1", "1_Pooling", "Pooling"),
        ("2", "2_Dense", "Dense"),
        ("3", "3_Dense", "Dense"),
        ("4", "4_Normalize", "Normalize"),
    ]
    (model_dir / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": n, "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (n, p, t) in enumerate(modules)
            ]
        )
    )
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 64,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": False,
                "include_prompt": True,
            }
        )
    )
    (model_dir / "4_Normalize").mkdir()
    torch.manual_seed(7)
    up, down = torch.randn(96, 64) / 8, torch.randn(64, 96) / 10
    _write_dense(model_dir / "2_Dense", up)
    _write_dense(model_dir / "3_Dense", down)
    llm = _llm(model_dir)
    assert llm.pooler_config.pooling_type == "MEAN" and llm.pooler_config.normalize
    for output, states in zip(llm.embed(PROMPTS), hf_states, strict=True):
        expected = torch.nn.functional.normalize(down @ (up @ states.mean(dim=0)), dim=0)
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), expected, atol=TOL, rtol=0
        )


def test_engine_settings(gemma_dir: Path) -> None:
    llm = _llm(gemma_dir, max_num_batched_tokens=64)
    assert not llm.config.enable_chunked_prefill and not llm.config.enable_prefix_caching
    assert llm.config.max_model_len == 64  # cut to the token budget (the model's is 128)
    assert len(llm.embed(["hello world"])[0].outputs.embedding) == 64


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 2}, "cannot be sharded"),
        ({"runner": "generate"}, "Gemma3TextModel is an encoder-only"),
        (
            {"max_model_len": 128, "max_num_batched_tokens": 64},
            r"--max-num-batched-tokens \(64\) must be >= --max-model-len \(128\)",
        ),
        (
            {"hf_overrides": {"use_bidirectional_attention": False}},
            "Gemma3TextModel without use_bidirectional_attention",
        ),
    ],
)
def test_refused(gemma_dir: Path, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _llm(gemma_dir, **settings)
