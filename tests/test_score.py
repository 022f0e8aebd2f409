"""Score and rerank for embedding models (bi-encoder: the cosine of two texts' embeddings).

``LLM.score`` and a real ``chassis serve --runner pooling`` process (``/score``, ``/v1/score``,
``/rerank``, ``/v1/rerank``, ``/v2/rerank``) on a tiny random Llama, checked against the
cosine similarity of HF transformers' pooled embeddings (``AutoModel``'s last hidden state,
pooled as the engine pools, in float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fixtures_pooling_server import *  # noqa: F403
from server_process import ServerProcess
from test_embeddings import pooling_llm

from chassis.core.llm import LLM
from chassis.core.pooler import finish_vector, pool_reference
from chassis.core.pooling_params import PoolingParams
from chassis.core.pooling_score import (
    ScoringOutput,
    ScoringRequestOutput,
    score_outputs,
    score_pairs,
)

openai = pytest.importorskip("openai")

TOLERANCE = 1e-5
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "The capital of Brazil is Brasilia.",
    "The capital of France is Paris.",
    "Cats sleep most of the day, and dogs bark at the mail carrier every morning.",
]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Any:
    """``reference(text or ids, pooling_type="LAST") -> (ids, vector)``: HF's pooled
    embedding (normalized; the cosine does not depend on it)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def embed(item: str | list[int], pooling_type: str = "LAST") -> tuple[list[int], torch.Tensor]:
        ids = tokenizer(item).input_ids if isinstance(item, str) else item
        with torch.inference_mode():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return ids, finish_vector(pool_reference(hidden, pooling_type), None, True)

    return embed


def _cosine(reference: Any, first: Any, second: Any, pooling_type: str = "LAST") -> float:
    _, a = reference(first, pooling_type)
    _, b = reference(second, pooling_type)
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return pooling_llm(tiny_llama_dir)


# -- offline: LLM.score ---------------------------------------------------------------------


def test_pairing_rules() -> None:
    assert score_pairs(1, 1) == [(0, 0)]
    assert score_pairs(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert score_pairs(2, 2) == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        score_pairs(2, 3)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        score_pairs(3, 1)  # N:1 is not a form (as in vLLM)
    with pytest.raises(ValueError, match="text_1 is empty"):
        score_pairs(0, 2)
    with pytest.raises(ValueError, match="text_2 is empty"):
        score_pairs(2, 0)


def test_llm_score_one_to_n_matches_hf(llm: LLM, reference: Any) -> None:
    outputs = llm.score(QUERY, DOCUMENTS)
    assert len(outputs) == len(DOCUMENTS)
    tokenizer = llm.get_tokenizer()
    for output, document in zip(outputs, DOCUMENTS, strict=True):
        assert isinstance(output, ScoringRequestOutput)
        assert isinstance(output.outputs, ScoringOutput) and output.finished
        assert type(output.outputs.score) is float
        expected = _cosine(reference, QUERY, document)
        assert abs(output.outputs.score - expected) < TOLERANCE
        # vLLM's join: the pad token between the two texts (the SmolLM2 tokenizer has one)
        assert tokenizer.pad_token_id is not None
        assert output.prompt_token_ids == (
            [*tokenizer(QUERY).input_ids, tokenizer.pad_token_id, *tokenizer(document).input_ids]
        )
    assert len({o.request_id for o in outputs}) == len(outputs)


def test_llm_score_one_to_one_and_n_to_n(llm: LLM, reference: Any) -> None:
    [one] = llm.score("Hello world", "Goodbye world")
    assert abs(one.outputs.score - _cosine(reference, "Hello world", "Goodbye world")) < TOLERANCE
    firsts = ["first text", [5, 6, 7, 8], {"prompt_token_ids": [9, 10]}]
    seconds = ["a different text", "second", [11, 12, 13]]
    outputs = llm.score(firsts, seconds)
    as_ids: list[Any] = ["first text", [5, 6, 7, 8], [9, 10]]
    for output, first, second in zip(outputs, as_ids, seconds, strict=True):
        assert abs(output.outputs.score - _cosine(reference, first, second)) < TOLERANCE
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="empty"):
        llm.score("a", [])
    # ids that are not all integers: embed's ValueError (the de-duplication key used to
    # hash the nested list first: an unhashable-type TypeError)
    with pytest.raises(ValueError, match="integer"):
        llm.score("a", ["b", [1, [2]]])  # type: ignore[list-item]
    # one PoolingParams for all texts (per-prompt params cannot follow the de-duplication)
    with pytest.raises(ValueError, match="one PoolingParams"):
        llm.score("a", ["b", "c"], pooling_params=[PoolingParams()] * 3)  # type: ignore[arg-type]


def test_score_outputs_put_the_pad_token_between_the_texts() -> None:
    from chassis.core.pooling_outputs import EmbeddingOutput, EmbeddingRequestOutput

    def out(request_id: str, ids: list[int], vector: list[float]) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), ids)

    a, b = out("a", [1, 2], [1.0, 0.0]), out("b", [3], [1.0, 1.0])
    [with_pad] = score_outputs([(a, b)], pad_token_id=0)
    assert with_pad.prompt_token_ids == [1, 2, 0, 3] and with_pad.request_id == "a_b"
    assert abs(with_pad.outputs.score - 2**-0.5) < 1e-6
    [without] = score_outputs([(a, b)])
    assert without.prompt_token_ids == [1, 2, 3]
    assert score_outputs([]) == []


def test_each_distinct_text_is_embedded_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    embedded: list[list[Any]] = []
    real_embed = llm.embed

    def spy(prompts: Any, *args: Any, **kwargs: Any) -> Any:
        embedded.append(list(prompts))
        return real_embed(prompts, *args, **kwargs)

    monkeypatch.setattr(llm, "embed", spy)
    outputs = llm.score(["same", "other", "same"], ["same", "same", "other"])
    assert embedded == [["same", "other"]]
    scores = [o.outputs.score for o in outputs]
    assert abs(scores[0] - 1.0) < TOLERANCE  # a text against itself
    assert scores[1] == scores[2]  # ("other", "same") and ("same", "other")


def test_truncation_and_pooling_params_reach_the_embeddings(
    tiny_llama_dir: Path, reference: Any
) -> None:
    # mean pooling, not normalized: the cosine is the same as of the normalized vectors
    llm = pooling_llm(tiny_llama_dir, pooler_config={"pooling_type": "MEAN", "normalize": False})
    first, second = list(range(20, 40)), list(range(60, 90))
    [output] = llm.score(first, second, truncate_prompt_tokens=8)
    pad = llm.get_tokenizer().pad_token_id
    assert output.prompt_token_ids == [*first[-8:], pad, *second[-8:]]
    expected = _cosine(reference, first[-8:], second[-8:], "MEAN")
    assert abs(output.outputs.score - expected) < TOLERANCE
    [again] = llm.score(first, second, pooling_params=PoolingParams(truncate_prompt_tokens=8))
    assert abs(again.outputs.score - output.outputs.score) < 1e-6


def test_a_generating_llm_refuses_score(tiny_llama_dir: Path) -> None:
    llm = pooling_llm(tiny_llama_dir, runner="generate")
    with pytest.raises(ValueError, match=r"runner='pooling'.*[Cc]ross-encoder"):
        llm.score("a", "b")


# -- the server -----------------------------------------------------------------------------


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers=server.headers, timeout=60)


def _ok(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _num_tokens(reference: Any, *texts: str) -> int:
    return sum(len(reference(text)[0]) for text in texts)


def test_score_routes_match_hf(server: ServerProcess, reference: Any) -> None:
    # 1:N, on both paths
    for path in ("/score", "/v1/score"):
        body = _ok(server, path, {"model": "tiny", "text_1": QUERY, "text_2": DOCUMENTS})
        assert set(body) == {"id", "object", "created", "model", "data", "usage"}
        assert body["object"] == "list" and body["model"] == "tiny"
        assert body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        for data, document in zip(body["data"], DOCUMENTS, strict=True):
            assert set(data) == {"index", "object", "score"} and data["object"] == "score"
            assert abs(data["score"] - _cosine(reference, QUERY, document)) < TOLERANCE
        # each pair's tokens and pad token (the query counted per pair, as vLLM counts)
        tokens = _num_tokens(reference, *DOCUMENTS) + 3 * (_num_tokens(reference, QUERY) + 1)
        assert body["usage"] == {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
        }
    # 1:1 (strings, or lists of one) and N:N
    one = _ok(server, "/v1/score", {"text_1": "Hello world", "text_2": ["Goodbye world"]})
    [data] = one["data"]
    assert abs(data["score"] - _cosine(reference, "Hello world", "Goodbye world")) < TOLERANCE
    firsts, seconds = ["a b c", "Paris is in France", "same"], ["d e f", "France", "same"]
    many = _ok(server, "/v1/score", {"text_1": firsts, "text_2": seconds})
    for data, first, second in zip(many["data"], firsts, seconds, strict=True):
        assert abs(data["score"] - _cosine(reference, first, second)) < TOLERANCE
    # vLLM's truncate_prompt_tokens reaches every text
    cut = _ok(
        server,
        "/v1/score",
        {"text_1": "a b c d e f", "text_2": "g h i j", "truncate_prompt_tokens": 2},
    )
    assert cut["usage"]["prompt_tokens"] == 5  # 2 + the pad token + 2
    server.wait_idle()


def test_rerank_routes(server: ServerProcess, reference: Any) -> None:
    expected = [_cosine(reference, QUERY, d) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _ok(server, path, {"model": "tiny", "query": QUERY, "documents": DOCUMENTS})
        assert set(body) == {"id", "model", "usage", "results"}
        assert body["id"].startswith("rerank-") and body["model"] == "tiny"
        assert [r["index"] for r in body["results"]] == order
        for result in body["results"]:
            assert set(result) == {"index", "document", "relevance_score"}
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
            assert abs(result["relevance_score"] - expected[result["index"]]) < TOLERANCE
        tokens = _num_tokens(reference, *DOCUMENTS) + 3 * (_num_tokens(reference, QUERY) + 1)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    top = _ok(
        server,
        "/v1/rerank",
        {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False},
    )
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all(r["document"] is None for r in top["results"])
    # top_n 0 (vLLM's default), negative and above the number of documents: all of them
    for top_n in (0, -1, 10):
        every = _ok(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": top_n})
        assert [r["index"] for r in every["results"]] == order
    server.wait_idle()


def test_errors(server: ServerProcess) -> None:
    def error(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = _post(server, path, body)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    mismatch = error("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert "1:1, 1:N or N:N" in mismatch["message"] and mismatch["param"] == "text_2"
    assert error("/v1/score", {"text_1": [], "text_2": "c"})["param"] == "text_1"
    assert error("/v1/score", {"text_1": "a", "text_2": ["c", ""]})["param"] == "text_2"
    assert error("/v1/rerank", {"query": "a", "documents": []})["param"] == "documents"
    assert error("/v1/rerank", {"query": "", "documents": ["b"]})["param"] == "query"
    too_long = error("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 999})
    assert too_long["param"] == "truncate_prompt_tokens"
    long_text = " ".join(["word"] * 400)
    assert (
        "maximum context length"
        in error("/v1/rerank", {"query": "a", "documents": [long_text]})["message"]
    )
    # through the official client's raw POST: the same errors as OpenAI exceptions
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.post("/score", body={"model": "other", "text_1": "a", "text_2": "b"}, cast_to=object)
    with pytest.raises(openai.BadRequestError, match="N:N"):
        client.post("/score", body={"text_1": ["a", "b"], "text_2": ["c"] * 3}, cast_to=object)
    scored = client.post("/score", body={"text_1": "a", "text_2": ["b", "c"]}, cast_to=object)
    assert [d["index"] for d in scored["data"]] == [0, 1]
    server.wait_idle()


def test_a_generating_server_refuses_score_and_rerank() -> None:
    from fake_engine import FakeAsyncLLM
    from fastapi.testclient import TestClient

    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        for path, body in (
            ("/v1/score", {"text_1": "a", "text_2": "b"}),
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/rerank", {"query": "a", "documents": ["b"]}),
            ("/v2/rerank", {"query": "a", "documents": ["b"]}),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 400, path
            error = response.json()["error"]
            assert "--runner pooling" in error["message"] and error["param"] == "model"
            assert "cross-encoder" in error["message"]
