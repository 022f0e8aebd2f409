"""``POST /classify``, ``/pooling`` and cross-encoder ``/score`` and ``/rerank``: real
``chassis serve`` processes on tiny random ``*ForSequenceClassification`` checkpoints (the
runner picked from the architecture), checked against HF transformers, and the routes'
refusals on models they do not fit."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fixtures_classify import LABELS, hf_classifier
from server_process import ServerProcess, running_server

openai = pytest.importorskip("openai")

TOL = 1e-5


@pytest.fixture(scope="module")
def cls_server(
    tiny_llama_cls_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A 3-label classifier, served without --runner (auto picks pooling); a token budget
    below the longest input, which is then computed over several steps."""
    extra = ["--max-num-batched-tokens", "16"]
    log_dir = tmp_path_factory.mktemp("serve_cls")
    with running_server(tiny_llama_cls_dir, log_dir, extra_args=extra) as s:
        yield s


@pytest.fixture(scope="module")
def ce_server(
    tiny_qwen3_cls_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A one-label classifier: a cross-encoder."""
    with running_server(tiny_qwen3_cls_dir, tmp_path_factory.mktemp("serve_ce")) as s:
        yield s


def _post(server: ServerProcess, path: str, body: dict[str, Any], status: int = 200) -> Any:
    response = httpx.post(server.base + path, json=body, headers=server.headers, timeout=60)
    assert response.status_code == status, response.text
    return response.json() if status == 200 else response.json()["error"]


def _hf_logits(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    model, tokenizer = hf_classifier(model_dir), AutoTokenizer.from_pretrained(model_dir)

    def logits(text: str | list[int], pair: str | None = None) -> tuple[list[int], torch.Tensor]:
        if isinstance(text, list):
            encoded = {"input_ids": torch.tensor([text])}
        else:
            encoded = tokenizer(text, pair, return_tensors="pt")
        with torch.inference_mode():
            return encoded["input_ids"][0].tolist(), model(**encoded).logits[0]

    return logits


def test_classify_matches_hf(cls_server: ServerProcess, tiny_llama_cls_dir: Path) -> None:
    reference = _hf_logits(tiny_llama_cls_dir)
    long_text = " ".join(["a long and winding sentence"] * 6)
    for item in ["I loved it", ["I loved it", long_text, "meh"], [5, 6, 7], [[8, 9], [10]]]:
        answer = _post(cls_server, "/classify", {"model": "tiny", "input": item})
        batch = [item] if isinstance(item, str) or isinstance(item[0], int) else item
        assert set(answer) == {"id", "object", "created", "model", "data", "usage"}
        assert answer["object"] == "list" and answer["model"] == "tiny"
        assert answer["id"].startswith("classify-")
        num_tokens = 0
        for i, (data, one) in enumerate(zip(answer["data"], batch, strict=True)):
            assert set(data) == {"index", "label", "probs", "num_classes"}
            ids, logits = reference(one)
            num_tokens += len(ids)
            probs = logits.softmax(-1)
            assert data["index"] == i and data["num_classes"] == 3
            torch.testing.assert_close(torch.tensor(data["probs"]), probs, atol=TOL, rtol=0)
            assert data["label"] == LABELS[int(probs.argmax())]
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == num_tokens
    # the raw logits (and vLLM's older name of the switch), truncation
    _, logits = reference("I loved it")
    for flag in ("use_activation", "activation"):
        raw = _post(cls_server, "/classify", {"input": "I loved it", flag: False})
        torch.testing.assert_close(torch.tensor(raw["data"][0]["probs"]), logits, atol=TOL, rtol=0)
    cut = _post(cls_server, "/classify", {"input": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2})
    assert cut["usage"]["prompt_tokens"] == 2
    # SageMaker's /invocations: an input body is a classification request here
    via = _post(cls_server, "/invocations", {"input": ["I loved it", "meh"]})
    assert via["object"] == "list" and via["id"].startswith("classify-")
    assert [d["label"] for d in via["data"]] == [
        d["label"] for d in _post(cls_server, "/classify", {"input": ["I loved it", "meh"]})["data"]
    ]
    # through the official client's raw POST
    posted = cls_server.client().post(
        cls_server.base + "/classify", body={"input": "meh"}, cast_to=object
    )
    assert posted["data"][0]["label"] in LABELS
    cls_server.wait_idle()


def test_pooling_route(cls_server: ServerProcess, tiny_llama_cls_dir: Path) -> None:
    # a classifier: its probabilities (raw logits without the activation), float or base64
    _, logits = _hf_logits(tiny_llama_cls_dir)("I loved it")
    pooled = _post(cls_server, "/pooling", {"model": "tiny", "input": ["I loved it"]})
    assert set(pooled) == {"id", "object", "created", "model", "data", "usage"}
    assert pooled["data"][0]["object"] == "pooling" and pooled["data"][0]["index"] == 0
    probs = pooled["data"][0]["data"]
    torch.testing.assert_close(torch.tensor(probs), logits.softmax(-1), atol=TOL, rtol=0)
    raw = _post(cls_server, "/pooling", {"input": "I loved it", "use_activation": False})
    torch.testing.assert_close(torch.tensor(raw["data"][0]["data"]), logits, atol=TOL, rtol=0)
    encoded = _post(cls_server, "/pooling", {"input": "I loved it", "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["data"]), dtype="<f4")
    np.testing.assert_allclose(decoded, probs, atol=1e-6, rtol=0)
    # the bytes formats carry the same values (activation applied), without JSON
    raw_bytes = httpx.post(
        cls_server.base + "/pooling",
        json={"input": "I loved it", "encoding_format": "bytes_only", "endianness": "little"},
        headers=cls_server.headers,
        timeout=60,
    )
    assert raw_bytes.status_code == 200 and "metadata" not in raw_bytes.headers
    np.testing.assert_allclose(np.frombuffer(raw_bytes.content, "<f4"), probs, atol=1e-6, rtol=0)
    error = _post(cls_server, "/pooling", {"input": "a", "normalize": True}, 400)
    assert error["param"] == "normalize"
    cls_server.wait_idle()


def test_cross_encoder_score_and_rerank(ce_server: ServerProcess, tiny_qwen3_cls_dir: Path) -> None:
    reference = _hf_logits(tiny_qwen3_cls_dir)
    query, docs = "capital of France?", ["Paris is the capital.", "Bananas are yellow.", "Paris"]
    expected = []
    num_tokens = 0
    for doc in docs:
        ids, logits = reference(query, doc)
        expected.append(torch.sigmoid(logits[0]).item())
        num_tokens += len(ids)
    scored = _post(ce_server, "/v1/score", {"model": "tiny", "text_1": query, "text_2": docs})
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=TOL)
    assert scored["usage"]["prompt_tokens"] == num_tokens
    raw = _post(ce_server, "/score", {"text_1": query, "text_2": docs[0], "use_activation": False})
    assert raw["data"][0]["score"] == pytest.approx(reference(query, docs[0])[1][0].item(), abs=TOL)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reranked = _post(ce_server, path, {"query": query, "documents": docs, "top_n": 2})
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in reranked["results"]] == order
        assert [r["document"]["text"] for r in reranked["results"]] == [docs[i] for i in order]
        scores = [r["relevance_score"] for r in reranked["results"]]
        assert scores == pytest.approx([expected[i] for i in order], abs=TOL)
    # SageMaker's /invocations picks score and rerank by their keys
    via = _post(ce_server, "/invocations", {"text_1": query, "text_2": docs})
    assert [d["score"] for d in via["data"]] == pytest.approx(expected, abs=TOL)
    via = _post(ce_server, "/invocations", {"query": query, "documents": docs, "top_n": 2})
    assert [r["index"] for r in via["results"]] == sorted(range(3), key=lambda i: -expected[i])[:2]
    # one-label classification: the sigmoid of the logit
    one = _post(ce_server, "/classify", {"input": query})["data"][0]
    assert one["num_classes"] == 1 and one["label"] == "LABEL_0"
    too_long = _post(
        ce_server, "/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 999}, 400
    )
    assert too_long["param"] == "truncate_prompt_tokens"
    ce_server.wait_idle()


def test_refusals(cls_server: ServerProcess) -> None:
    client = cls_server.client()
    # more than one label: no pair scoring
    error = _post(cls_server, "/score", {"text_1": "a", "text_2": "b"}, 400)
    assert "num_labels == 1" in error["message"] and error["param"] == "model"
    assert _post(cls_server, "/rerank", {"query": "a", "documents": ["b"]}, 400)["param"]
    with pytest.raises(openai.BadRequestError, match="classification model") as info:
        client.embeddings.create(model="tiny", input="a")
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert _post(cls_server, "/classify", {"input": []}, 400)["param"] == "input"
    assert _post(cls_server, "/classify", {"input": ["a", ""]}, 400)["param"] == "input"
    too_long = _post(cls_server, "/classify", {"input": [list(range(3, 300))]}, 400)
    assert "maximum context length" in too_long["message"]
    assert _post(cls_server, "/classify", {"input": "a", "dimensions": 2}, 400)["param"]
    conflict = _post(
        cls_server, "/classify", {"input": "a", "use_activation": True, "softmax": False}, 400
    )
    assert conflict["param"] == "use_activation"
    for encoding_format in ("bytes", "bytes_only"):
        body = {"input": "a", "encoding_format": encoding_format}
        assert _post(cls_server, "/classify", body, 400)["param"] == "encoding_format"
    with pytest.raises(openai.NotFoundError):
        client.post(
            cls_server.base + "/classify", body={"model": "other", "input": "a"}, cast_to=object
        )
    cls_server.wait_idle()


def test_a_generating_server_refuses_classify_and_pooling() -> None:
    from fake_engine import FakeAsyncLLM
    from fastapi.testclient import TestClient

    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        for path in ("/classify", "/pooling"):
            response = client.post(path, json={"input": "a"})
            assert response.status_code == 400, path
            error = response.json()["error"]
            assert "text generation" in error["message"] and error["param"] == "model"


def test_an_embedding_server_refuses_classify() -> None:
    """(The route refuses before the engine is asked anything: an engine that only reports
    an embedding model's pooling stands in for one.)"""
    from fake_engine import FakeAsyncLLM
    from fastapi.testclient import TestClient

    from chassis.core.pooling_config import PoolerConfig
    from chassis.core.pooling_input import EmbeddingModelInfo
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    engine = FakeAsyncLLM()
    engine.pooler_config = PoolerConfig()
    engine.embedding_info = EmbeddingModelInfo(model_name="tiny", hidden_size=64)
    with TestClient(build_app(engine, ServerSettings())) as client:
        response = client.post("/classify", json={"input": "a"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert "embedding model" in error["message"] and error["param"] == "model"
