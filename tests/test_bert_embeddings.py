"""BERT-family encoders (``BertModel``, ``XLMRobertaModel``) as embedding models:
``LLM.embed`` against HF transformers' ``AutoModel`` (float32, tiny random checkpoints,
tolerance 1e-5) for CLS and mean pooling, prompts of different lengths in one step and over
several; a sentence-transformers folder read; a ``bert.``-prefixed checkpoint; the engine
settings an encoder needs (whole prompts: no chunked prefill, no prefix cache) and what is
refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from bert_checkpoints import hf_hidden_states, write_bert, write_xlm_roberta
from safetensors.torch import load_file, save_file

import chassis.builtin_plugins.models.bert as bert_module
from chassis.core.attention import AttentionMetadata
from chassis.core.encoder_only import bidirectional_attention, whole_prompt_lengths
from chassis.core.llm import LLM

TOL = 1e-5
#: prompts of 3 to 32 tokens (BERT tokenizer; the long one is 32 with [CLS] and [SEP])
PROMPTS = [
    "hello world",
    "The cat sat on the mat, the dog was good",
    " ".join(["a long and winding sentence"] * 6),
    "paris",
    "what is the capital of france?",
]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_xlm_roberta(tmp_path_factory.mktemp("xlmr"))


@pytest.fixture(scope="module")
def model_dirs(bert_dir: Path, xlmr_dir: Path) -> dict[str, Path]:
    return {"bert": bert_dir, "xlmr": xlmr_dir}


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", **kwargs)


def _pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    vector = states[0] if pooling_type == "CLS" else states.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


def _spy_steps(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record each forward's request lengths (the model's whole-prompt check)."""
    steps: list[list[int]] = []

    def spy(metadata: AttentionMetadata) -> torch.Tensor:
        lengths = whole_prompt_lengths(metadata)
        steps.append(lengths.tolist())
        return lengths

    monkeypatch.setattr(bert_module, "whole_prompt_lengths", spy)
    return steps


@pytest.mark.parametrize("arch", ["bert", "xlmr"])
@pytest.mark.parametrize("pooling_type", ["CLS", "MEAN"])
@pytest.mark.parametrize("budget", [256, 40], ids=["one_step", "several_steps"])
def test_embeddings_match_hf(
    arch: str,
    pooling_type: str,
    budget: int,
    model_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir = model_dirs[arch]
    llm = _llm(
        model_dir,
        max_num_batched_tokens=budget,
        max_model_len=40,
        pooler_config={"pooling_type": pooling_type},
    )
    assert llm.config.runner == "pooling"  # picked from the architecture
    steps = _spy_steps(monkeypatch)
    outputs = llm.embed(PROMPTS)
    lengths = [len(o.prompt_token_ids) for o in outputs]
    # every prompt computed whole, in one step; with the small budget over several steps
    assert sorted(n for step in steps for n in step) == sorted(lengths)
    assert all(sum(step) <= budget for step in steps)
    assert (len(steps) == 1) == (budget == 256)
    for output, states in zip(outputs, hf_hidden_states(model_dir, PROMPTS), strict=True):
        assert len(output.prompt_token_ids) == states.shape[0]
        expected = _pooled(states, pooling_type)
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), expected, atol=TOL, rtol=0
        )


def test_encoder_engine_settings(bert_dir: Path, xlmr_dir: Path) -> None:
    llm = _llm(bert_dir)
    # vLLM's default for BERT-like encoders: the first token, normalized
    assert llm.pooler_config.pooling_type == "CLS" and llm.pooler_config.normalize
    assert not llm.config.enable_chunked_prefill and not llm.config.enable_prefix_caching
    assert llm.config.max_model_len == 64  # BERT: max_position_embeddings
    # RoBERTa's positions start at pad_token_id + 1: 66 - 2 usable
    assert _llm(xlmr_dir).config.max_model_len == 64
    # without --max-model-len the context is cut to what one step holds
    small = _llm(bert_dir, max_num_batched_tokens=16)
    assert small.config.max_model_len == 16
    with pytest.raises(ValueError, match="maximum context length is 16"):
        small.embed([" ".join(["hello world"] * 10)])
    assert len(small.embed(["hello world"])[0].outputs.embedding) == 64


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"max_model_len": 64, "max_num_batched_tokens": 32},
            r"BertModel is an encoder: each prompt is computed whole in one step, so "
            r"--max-num-batched-tokens \(32\) must be >= --max-model-len \(64\)",
        ),
        ({"max_model_len": 65}, "exceeds the model's context length 64"),
        ({"runner": "generate"}, "BertModel is an encoder-only"),
        ({"tensor_parallel_size": 2}, "cannot be sharded"),
    ],
)
def test_refused(bert_dir: Path, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _llm(bert_dir, **settings)


def test_xlm_roberta_context_is_refused_past_its_positions(xlmr_dir: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context length 64"):
        _llm(xlmr_dir, max_model_len=66)


def test_sentence_transformers_folder(bert_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "st"
    shutil.copytree(bert_dir, model_dir)
    (model_dir / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
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
            }
        )
    )
    llm = _llm(model_dir)
    assert llm.pooler_config.pooling_type == "MEAN" and llm.pooler_config.normalize
    outputs = llm.embed(PROMPTS)
    for output, states in zip(outputs, hf_hidden_states(bert_dir, PROMPTS), strict=True):
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), _pooled(states, "MEAN"), atol=TOL, rtol=0
        )


def test_bert_prefixed_checkpoint(bert_dir: Path, tmp_path: Path) -> None:
    """A checkpoint that saves the encoder under ``bert.`` (as ``Bert*For*`` models do), with
    a masked-LM head, a pooler and a saved position-id buffer, loads as ``BertModel``."""
    model_dir = tmp_path / "prefixed"
    shutil.copytree(bert_dir, model_dir)
    tensors = load_file(str(bert_dir / "model.safetensors"))
    prefixed = {f"bert.{name}": t for name, t in tensors.items()}
    prefixed["bert.embeddings.position_ids"] = torch.arange(64)[None]
    prefixed["cls.predictions.bias"] = torch.zeros(8)
    assert "bert.pooler.dense.weight" in prefixed  # HF's BertModel saves its pooler
    (model_dir / "model.safetensors").unlink()
    save_file(prefixed, str(model_dir / "model.safetensors"))
    reference = _llm(bert_dir).embed(PROMPTS[:2])
    for output, expected in zip(_llm(model_dir).embed(PROMPTS[:2]), reference, strict=True):
        assert output.outputs.embedding == expected.outputs.embedding


def test_unknown_checkpoint_tensor_is_refused(bert_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "extra"
    shutil.copytree(bert_dir, model_dir)
    tensors = load_file(str(bert_dir / "model.safetensors"))
    tensors["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(2)
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"rotary\.weight' has no place in BertModel"):
        _llm(model_dir)


def _metadata(lengths: list[int], seq_lens: list[int] | None = None) -> AttentionMetadata:
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens if seq_lens is not None else lengths, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=sum(lengths),
        num_reqs=len(lengths),
        query_start_loc=starts,
        seq_lens=seq,
        block_table=torch.zeros((len(lengths), 1), dtype=torch.int32),
        slot_mapping=torch.full((sum(lengths),), -1, dtype=torch.int64),
        max_query_len=max(lengths),
        max_seq_len=int(seq.max()),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq,
    )


def test_bidirectional_attention_stays_within_each_request() -> None:
    lengths = [5, 1, 9, 9]
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 8) for _ in range(3))
    out = bidirectional_attention(q, k, v, _metadata(lengths), 0.3)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[part].transpose(0, 1), k[part].transpose(0, 1), v[part].transpose(0, 1), scale=0.3
        ).transpose(0, 1)
        torch.testing.assert_close(out[part], expected, atol=1e-6, rtol=0)
        start += n


def test_part_of_a_prompt_is_refused() -> None:
    """A step that holds a chunk of a prompt (seq_lens past the query) is an error."""
    with pytest.raises(RuntimeError, match="given part of a prompt"):
        whole_prompt_lengths(_metadata([4, 3], seq_lens=[4, 7]))


def test_async_scheduling_pools_as_hf(bert_dir: Path) -> None:
    llm = _llm(
        bert_dir,
        max_num_batched_tokens=40,
        max_model_len=40,
        async_scheduling=True,
        pooler_config={"pooling_type": "MEAN"},
    )
    outputs = llm.embed(PROMPTS)
    for output, states in zip(outputs, hf_hidden_states(bert_dir, PROMPTS), strict=True):
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), _pooled(states, "MEAN"), atol=TOL, rtol=0
        )
