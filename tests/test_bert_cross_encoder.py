"""BERT-family sequence classifiers (``BertForSequenceClassification``,
``XLMRobertaForSequenceClassification``): cross-encoder ``LLM.score`` and ``LLM.classify``
against HF transformers' ``AutoModelForSequenceClassification`` (float32, tiny random
checkpoints, tolerance 1e-5), BERT's pairs with their token types; and one real server's
``/v1/embeddings`` and ``/rerank`` for BERT checkpoints."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from bert_checkpoints import hf_hidden_states, write_bert, write_xlm_roberta
from server_process import running_server

from chassis.core.llm import LLM
from chassis.core.pooling_params import PoolingParams

TOL = 1e-5
QUERY = "what is the capital of france?"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "hello", "a good movie"]


@pytest.fixture(scope="module")
def bert_ce_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bert(tmp_path_factory.mktemp("bert_ce"), num_labels=1, seed=2)


@pytest.fixture(scope="module")
def xlmr_ce_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_xlm_roberta(tmp_path_factory.mktemp("xlmr_ce"), num_labels=1, seed=3)


def _hf_logits(model_dir: Path, first: str, second: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    encoded = tokenizer(first, second, return_tensors="pt")  # BERT: token types 0 then 1
    with torch.inference_mode():
        return model.eval()(**encoded).logits[0]


@pytest.mark.parametrize("arch", ["bert", "xlmr"])
def test_cross_encoder_scores_match_hf(arch: str, bert_ce_dir: Path, xlmr_ce_dir: Path) -> None:
    model_dir = bert_ce_dir if arch == "bert" else xlmr_ce_dir
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=32)
    assert llm.config.runner == "pooling" and llm.pooler_config.pooling_type == "CLS"
    outputs = llm.score(QUERY, DOCUMENTS)
    raw = llm.score(QUERY, DOCUMENTS, pooling_params=PoolingParams(use_activation=False))
    scores = []
    for output, logit, document in zip(outputs, raw, DOCUMENTS, strict=True):
        expected = _hf_logits(model_dir, QUERY, document)[0]
        assert logit.outputs.score == pytest.approx(float(expected), abs=TOL)
        assert output.outputs.score == pytest.approx(float(torch.sigmoid(expected)), abs=TOL)
        scores.append(logit.outputs.score)
    assert max(scores) - min(scores) > 0.1  # the pairs differ: not a constant head


def test_bert_pairs_use_token_types(bert_ce_dir: Path) -> None:
    """The second text's token types matter (a BERT cross-encoder reads them): the score
    differs from the one of the same tokens all typed 0, which HF gives too."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bert_ce_dir)
    model = AutoModelForSequenceClassification.from_pretrained(bert_ce_dir, dtype=torch.float32)
    encoded = tokenizer(QUERY, DOCUMENTS[0], return_tensors="pt")
    with torch.inference_mode():
        all_zero = model.eval()(input_ids=encoded.input_ids).logits[0, 0]
    llm = LLM(str(bert_ce_dir), dtype="float32")
    raw = llm.score(QUERY, DOCUMENTS[0], pooling_params=PoolingParams(use_activation=False))
    assert abs(raw[0].outputs.score - float(all_zero)) > 1e-3
    # a single text (its only [SEP] ends it) is all type 0, as HF's
    single = llm.classify([QUERY], PoolingParams(use_activation=False))
    torch.testing.assert_close(
        torch.tensor(single[0].outputs.probs), _hf_logits(bert_ce_dir, QUERY), atol=TOL, rtol=0
    )


def test_classify_matches_hf(tmp_path: Path) -> None:
    model_dir = write_xlm_roberta(tmp_path / "xlmr3", num_labels=3, seed=4)
    bert_dir = write_bert(tmp_path / "bert3", num_labels=3, seed=5)
    texts = ["a wonderful movie", "bad", " ".join(["the long sentence"] * 4)]
    for directory in (model_dir, bert_dir):
        llm = LLM(str(directory), dtype="float32", max_num_batched_tokens=32)
        for output, text in zip(llm.classify(texts), texts, strict=True):
            expected = torch.softmax(_hf_logits(directory, text), dim=0)
            torch.testing.assert_close(
                torch.tensor(output.outputs.probs), expected, atol=TOL, rtol=0
            )


def test_server_embeddings(tmp_path: Path) -> None:
    """A real server of the BERT embedding model: ``/v1/embeddings`` (mean pooling from
    ``--pooler-config``) against HF, and a too-long input refused (400)."""
    model_dir = write_bert(tmp_path / "bert")
    (tmp_path / "serve").mkdir()
    texts = ["hello world", "the cat sat on the mat"]
    extra = ["--pooler-config", '{"pooling_type": "MEAN"}', "--max-num-batched-tokens", "64"]
    with running_server(
        model_dir, tmp_path / "serve", extra_args=extra, max_model_len=64
    ) as server:
        response = httpx.post(
            f"{server.base}/v1/embeddings",
            json={"model": server.model, "input": texts},
            headers=server.headers,
            timeout=60,
        )
        assert response.status_code == 200, response.text
        data = response.json()
        too_long = httpx.post(
            f"{server.base}/v1/embeddings",
            json={"model": server.model, "input": " ".join(["hello world"] * 40)},
            headers=server.headers,
            timeout=60,
        )
    assert too_long.status_code == 400 and "maximum context length is 64" in too_long.text
    for item, states in zip(data["data"], hf_hidden_states(model_dir, texts), strict=True):
        expected = torch.nn.functional.normalize(states.mean(dim=0), dim=0)
        torch.testing.assert_close(torch.tensor(item["embedding"]), expected, atol=TOL, rtol=0)
    assert data["usage"]["prompt_tokens"] == 4 + 8
