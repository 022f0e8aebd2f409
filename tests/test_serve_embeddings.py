"""``POST /v1/embeddings``: a real ``chassis serve --runner pooling`` process on a tiny random
Llama, driven by the official ``openai`` client; vectors checked against HF transformers
(``AutoModel``'s last hidden state at the last token, L2-normalized)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fixtures_pooling_server import *  # noqa: F403
from server_process import ServerProcess

from chassis.core.pooler import finish_vector, pool_reference

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Any:
    """``reference(text or ids) -> (ids, vector)``: what HF computes for an input."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def embed(item: str | list[int]) -> tuple[list[int], torch.Tensor]:
        ids = tokenizer(item).input_ids if isinstance(item, str) else item
        with torch.inference_mode():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return ids, finish_vector(pool_reference(hidden, "LAST"), None, True)

    return embed


def _assert_close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=0)


def test_openai_client_embeddings_match_hf(server: ServerProcess, reference: Any) -> None:
    client = server.client()
    long_ids = list(range(100, 200))  # three steps of the token budget
    inputs: list[Any] = [
        "Hello world",
        ["The quick brown fox", "jumps over the lazy dog and keeps running"],
        [5, 6, 7],
        [long_ids, [8, 9]],
    ]
    for item in inputs:
        # the openai client asks for base64 unless told otherwise, and decodes it
        for encoding in ("float", None):
            kwargs = {"encoding_format": encoding} if encoding else {}
            response = client.embeddings.create(model="tiny", input=item, **kwargs)
            batch = [item] if isinstance(item, str) or isinstance(item[0], int) else item
            assert response.object == "list" and response.model == "tiny"
            assert [d.index for d in response.data] == list(range(len(batch)))
            num_tokens = 0
            for data, one in zip(response.data, batch, strict=True):
                assert data.object == "embedding"
                ids, expected = reference(one)
                num_tokens += len(ids)
                assert len(data.embedding) == 64
                _assert_close(data.embedding, expected)
            assert response.usage.prompt_tokens == num_tokens
            assert response.usage.total_tokens == num_tokens
    server.wait_idle()


def test_response_shape_and_base64(server: ServerProcess) -> None:
    def post(body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(
            server.base + "/v1/embeddings", json=body, headers=server.headers, timeout=30
        )
        assert response.status_code == 200, response.text
        return response.json()

    floats = post({"model": "tiny", "input": ["a b c", "d"]})
    assert set(floats) == {"id", "object", "created", "model", "data", "usage"}
    assert floats["object"] == "list" and floats["model"] == "tiny"
    assert set(floats["usage"]) == {"prompt_tokens", "total_tokens"}
    assert [set(d) for d in floats["data"]] == [{"object", "index", "embedding"}] * 2
    encoded = post({"input": ["a b c", "d"], "encoding_format": "base64"})
    for as_float, as_b64 in zip(floats["data"], encoded["data"], strict=True):
        vector = np.frombuffer(base64.b64decode(as_b64["embedding"]), dtype="<f4")
        # (two runs of the same input: equal up to the order of float sums in the batch)
        np.testing.assert_allclose(vector, as_float["embedding"], atol=1e-6, rtol=0)
    # vLLM's extra fields: normalize, truncate_prompt_tokens
    raw = post({"input": [1, 2, 3, 4, 5], "normalize": False, "truncate_prompt_tokens": 3})
    assert raw["usage"]["prompt_tokens"] == 3
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1.0) > 1e-3
    # newer vLLM's name for normalize
    renamed = post({"input": [3, 4, 5], "use_activation": False})
    np.testing.assert_allclose(
        renamed["data"][0]["embedding"], raw["data"][0]["embedding"], atol=1e-6, rtol=0
    )
    conflict = httpx.post(
        server.base + "/v1/embeddings",
        json={"input": "a", "normalize": True, "use_activation": False},
        headers=server.headers,
        timeout=30,
    )
    assert conflict.status_code == 400
    assert conflict.json()["error"]["param"] == "use_activation"


def test_invocations_answers_an_embeddings_body(server: ServerProcess) -> None:
    """SageMaker's route on an embedding server: ``input`` is an embeddings request;
    generation bodies fit no route of a pooling server."""

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(server.base + path, json=body, headers=server.headers, timeout=30)

    body = {"input": ["a b c", "d"], "encoding_format": "float"}
    via, direct = post("/invocations", body), post("/v1/embeddings", body)
    assert via.status_code == 200, via.text
    assert via.json()["object"] == "list" and via.json()["usage"] == direct.json()["usage"]
    for got, expected in zip(via.json()["data"], direct.json()["data"], strict=True):
        np.testing.assert_allclose(got["embedding"], expected["embedding"], atol=1e-6, rtol=0)
    chat = post("/invocations", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["data"][0]["object"] == "embedding"
    refused = post("/invocations", {"prompt": "Hello"})
    assert refused.status_code == 400
    assert "a server of a pooling model takes" in refused.json()["error"]["message"]
    server.wait_idle()


def test_errors(server: ServerProcess) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka") as info:
        client.embeddings.create(model="tiny", input="text", dimensions=16)
    assert info.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.embeddings.create(model="tiny", input=[])
    with pytest.raises(openai.BadRequestError, match="must not contain empty"):
        client.embeddings.create(model="tiny", input=["a", ""])
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.embeddings.create(model="tiny", input=[list(range(3, 300))])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="text")
    # a pooling server serves no text
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    server.wait_idle()


def test_a_generating_server_refuses_embeddings() -> None:
    from fake_engine import FakeAsyncLLM
    from fastapi.testclient import TestClient

    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        response = client.post("/v1/embeddings", json={"input": "hello"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--runner pooling" in error["message"] and error["param"] == "model"
