"""vLLM's additions to ``POST /v1/embeddings`` on a real ``chassis serve --runner pooling``
(the run's shared pooling server): chat-style ``messages`` input, ``embed_dtype`` /
``endianness`` / ``encoding_format: "bytes"``, and the per-request metrics of pooling
requests. Encoded vectors are compared bit for bit with the float answer cast to the type."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fixtures_pooling_server import *  # noqa: F403
from server_process import ServerProcess

from chassis.serve.embedding_encoding import (
    TORCH_DTYPES,
    bytes_body,
    decode_vector,
    encode_vector,
)
from chassis.serve.errors import APIError
from chassis.serve.openai_embeddings import EmbeddingRequest, encoded

openai = pytest.importorskip("openai")

ENDIANNESS = ("native", "big", "little")

MESSAGES = [
    {"role": "system", "content": "You embed text."},
    {"role": "user", "content": "The cat sat on the mat."},
    {"role": "assistant", "content": "A feline rested on a rug."},
]


def _post(server: ServerProcess, body: dict[str, Any], route: str = "/v1/embeddings") -> Any:
    return httpx.post(server.base + route, json=body, headers=server.headers, timeout=60)


def _ok(server: ServerProcess, body: dict[str, Any], route: str = "/v1/embeddings") -> Any:
    response = _post(server, body, route)
    assert response.status_code == 200, response.text
    return response.json()


def _error(server: ServerProcess, body: dict[str, Any], route: str = "/v1/embeddings") -> Any:
    response = _post(server, body, route)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) >= {"message", "param"}
    return error


def _same_bits(got: torch.Tensor, floats: list[float], embed_dtype: str) -> None:
    expected = torch.tensor(floats, dtype=torch.float32).to(TORCH_DTYPES[embed_dtype])
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_messages_embed_the_rendered_template(server: ServerProcess, tokenizer: Any) -> None:
    cases: list[dict[str, Any]] = [
        {},  # vLLM's defaults: no generation prompt, no special tokens added
        {"add_generation_prompt": True},
        {"continue_final_message": True},
        {"add_special_tokens": True},
    ]
    for options in cases:
        text = tokenizer.apply_chat_template(
            MESSAGES,
            tokenize=False,
            add_generation_prompt=bool(options.get("add_generation_prompt")),
            continue_final_message=bool(options.get("continue_final_message")),
        )
        chat = _ok(server, {"model": "tiny", "messages": MESSAGES, **options})
        plain = _ok(
            server,
            {
                "model": "tiny",
                "input": text,
                "add_special_tokens": bool(options.get("add_special_tokens")),
            },
        )
        assert len(chat["data"]) == 1
        assert chat["data"][0]["embedding"] == plain["data"][0]["embedding"], options
        assert chat["usage"] == plain["usage"]
        expected_ids = tokenizer(
            text, add_special_tokens=bool(options.get("add_special_tokens"))
        ).input_ids
        assert chat["usage"]["prompt_tokens"] == len(expected_ids)
    # the options change the prompt, so the vector
    default = _ok(server, {"model": "tiny", "messages": MESSAGES})["data"][0]["embedding"]
    prompted = _ok(server, {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True})
    assert prompted["data"][0]["embedding"] != default
    # /pooling takes messages too (the same vector for an embedding model)
    pooled = _ok(server, {"model": "tiny", "messages": MESSAGES}, "/pooling")
    assert pooled["data"][0]["data"] == default
    server.wait_idle()


# Exact comparisons use one input per request: the server then computes it alone every time
# (the same steps), while a batch's vectors may differ in the last bits with how its inputs
# share steps.


def test_base64_embed_dtype_and_endianness(server: ServerProcess) -> None:
    client = server.client()
    texts = ["The quick brown fox jumps over the lazy dog and keeps running"]
    floats = [d.embedding for d in client.embeddings.create(
        model="tiny", input=texts, encoding_format="float"
    ).data]  # fmt: skip
    # the client's default (base64 it decodes as float32) is the float answer
    default = client.embeddings.create(model="tiny", input=texts)
    assert [d.embedding for d in default.data] == floats
    for embed_dtype in TORCH_DTYPES:
        for endianness in ENDIANNESS:
            response = client.embeddings.create(
                model="tiny",
                input=texts,
                encoding_format="base64",
                extra_body={"embed_dtype": embed_dtype, "endianness": endianness},
            )
            for data, vector in zip(response.data, floats, strict=True):
                raw = base64.b64decode(data.embedding)
                _same_bits(decode_vector(raw, embed_dtype, endianness), vector, embed_dtype)
    # float ignores embed_dtype (as vLLM): float32 values
    loose = _ok(server, {"model": "tiny", "input": texts, "embed_dtype": "float16"})
    assert [d["embedding"] for d in loose["data"]] == floats
    # big-endian float32 is the little-endian bytes reversed value by value
    big = _ok(
        server,
        {"input": texts[0], "encoding_format": "base64", "endianness": "big"},
    )["data"][0]["embedding"]
    little = _ok(
        server,
        {"input": texts[0], "encoding_format": "base64", "endianness": "little"},
    )["data"][0]["embedding"]
    big_raw, little_raw = base64.b64decode(big), base64.b64decode(little)
    assert big_raw != little_raw
    assert all(big_raw[i : i + 4] == little_raw[i : i + 4][::-1] for i in range(0, len(big_raw), 4))
    server.wait_idle()


def test_bytes_encoding(server: ServerProcess) -> None:
    def check(inputs: list[str], embed_dtype: str, endianness: str, exact: bool) -> None:
        floats = _ok(server, {"model": "tiny", "input": inputs})
        vectors = [d["embedding"] for d in floats["data"]]
        body = {
            "model": "tiny",
            "input": inputs,
            "encoding_format": "bytes",
            "embed_dtype": embed_dtype,
            "endianness": endianness,
        }
        response = _post(server, body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/octet-stream"
        metadata = json.loads(response.headers["metadata"])
        assert metadata["id"].startswith("embd-") and metadata["model"] == "tiny"
        assert isinstance(metadata["created"], int)
        assert metadata["usage"] == floats["usage"]
        width = torch.empty(0, dtype=TORCH_DTYPES[embed_dtype]).element_size()
        offset = 0
        for index, (item, vector) in enumerate(zip(metadata["data"], vectors, strict=True)):
            assert item == {
                "index": index,
                "embed_dtype": embed_dtype,
                "endianness": endianness,
                "start": offset,
                "end": offset + width * len(vector),
                "shape": [len(vector)],
            }
            chunk = response.content[item["start"] : item["end"]]
            got = decode_vector(chunk, embed_dtype, endianness)
            if exact:
                _same_bits(got, vector, embed_dtype)
            else:
                torch.testing.assert_close(got, torch.tensor(vector), atol=1e-5, rtol=0)
            offset = item["end"]
        assert len(response.content) == offset

    for embed_dtype in TORCH_DTYPES:
        for endianness in ENDIANNESS:
            check(["The quick brown fox"], embed_dtype, endianness, exact=True)
    check(["Hello world", "Hi", "The quick brown fox"], "float32", "big", exact=False)
    server.wait_idle()


def test_bytes_only_and_the_bytes_formats_on_pooling(server: ServerProcess) -> None:
    """``bytes_only``: the ``bytes`` body without its ``metadata`` header; ``/pooling``
    serves both (vLLM's), its vectors being the ones it sends as floats."""
    for route in ("/v1/embeddings", "/pooling"):
        key = "embedding" if route == "/v1/embeddings" else "data"
        # one input per request: bit for bit
        floats = _ok(server, {"model": "tiny", "input": "The quick brown fox"}, route)
        vector = floats["data"][0][key]
        for encoding_format in ("bytes", "bytes_only"):
            body = {
                "model": "tiny",
                "input": "The quick brown fox",
                "encoding_format": encoding_format,
                "embed_dtype": "float16",
                "endianness": "big",
            }
            response = _post(server, body, route)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == "application/octet-stream"
            assert ("metadata" in response.headers) == (encoding_format == "bytes")
            _same_bits(decode_vector(response.content, "float16", "big"), vector, "float16")
            if encoding_format == "bytes":
                metadata = json.loads(response.headers["metadata"])
                tokens = floats["usage"]["prompt_tokens"]
                assert metadata["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
                assert metadata["data"][0]["shape"] == [len(vector)]
        # a batch: the vectors one after the other, in input order
        texts = ["Hello world", "The cat sat on the mat."]
        batch = _ok(server, {"model": "tiny", "input": texts}, route)
        body = {"model": "tiny", "input": texts, "encoding_format": "bytes_only"}
        response = _post(server, body, route)
        assert response.status_code == 200 and "metadata" not in response.headers
        got = decode_vector(response.content, "float32", "native").view(len(texts), -1)
        expected = torch.tensor([d[key] for d in batch["data"]])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    server.wait_idle()


def test_errors(server: ServerProcess) -> None:
    both = _error(server, {"model": "tiny", "input": "hi", "messages": MESSAGES})
    assert "exactly one of 'input'" in both["message"] and both["param"] == "messages"
    neither = _error(server, {"model": "tiny"})
    assert "exactly one of 'input'" in neither["message"] and neither["param"] == "input"
    assert _error(server, {"model": "tiny", "messages": []})["param"] == "messages"
    for field in ("embed_dtype", "endianness", "encoding_format"):
        error = _error(server, {"model": "tiny", "input": "hi", field: "bad_value"})
        assert error["message"].startswith(f"{field}: Input should be") and error["param"] == field
    template = _error(
        server, {"messages": MESSAGES, "chat_template": "{{ messages[0]['content'] }}"}
    )
    assert template["param"] == "chat_template"
    assert "--trust-request-chat-template" in template["message"]
    hidden = _error(server, {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "x"}})
    assert hidden["param"] == "chat_template_kwargs.chat_template"
    both_prompts = _error(
        server,
        {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
    )
    assert both_prompts["param"] == "continue_final_message"
    bad_dtype = {"input": "hi", "encoding_format": "bytes_only", "embed_dtype": "fp16"}
    assert _error(server, bad_dtype, "/pooling")["param"] == "embed_dtype"
    # none of these reached the engine
    server.wait_idle()


def test_a_vector_beyond_the_dtype_range_is_a_400() -> None:
    vector = [0.5, 70000.0, -1.0]  # 70000 > float16's 65504
    with pytest.raises(ValueError, match="float16"):
        encode_vector(vector, "float16", "native")
    with pytest.raises(ValueError, match="fp8_e4m3"):
        encode_vector([500.0], "fp8_e4m3", "native")  # would be clamped to 448
    body = EmbeddingRequest(input="x", encoding_format="base64", embed_dtype="float16")
    with pytest.raises(APIError) as caught:
        encoded(body, vector)
    assert caught.value.status == 400 and caught.value.param == "embed_dtype"
    # float32 and bfloat16 hold it
    assert decode_vector(encode_vector(vector, "float32", "big"), "float32", "big").tolist() == (
        vector
    )
    encode_vector(vector, "bfloat16", "little")


def test_pooling_requests_count_in_the_metrics(server: ServerProcess) -> None:
    server.wait_idle()
    before = server.metrics()
    response = _ok(server, {"model": "tiny", "input": [[9, 10, 11], [5, 6, 7, 8]]})
    chat = _ok(server, {"model": "tiny", "messages": MESSAGES})
    pooled = _ok(server, {"model": "tiny", "input": "one more"}, "/pooling")
    _error(server, {"model": "tiny", "input": [""]})  # refused before the engine: not counted
    after = server.wait_idle()
    tokens = sum(r["usage"]["prompt_tokens"] for r in (response, chat, pooled))

    def change(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    success = 'chassis:request_success_total{finished_reason="stop"}'
    assert change(success) == 4  # one per input: every input is an engine request
    assert change("chassis:prompt_tokens_total") == tokens
    assert change("chassis:e2e_request_latency_seconds_count") == 4
    assert change("chassis:request_queue_time_seconds_count") == 4
    # nothing generated: no generated tokens, no time to first token
    assert change("chassis:generation_tokens_total") == 0
    assert change("chassis:time_to_first_token_seconds_count") == 0
    assert change('chassis:request_success_total{finished_reason="abort"}') == 0


def test_bytes_metadata_states_endianness_as_requested() -> None:
    """vLLM's metadata echoes the request's ``endianness``: ``native`` stays ``"native"``
    (the server's order, ``sys.byteorder``), the bytes being those of ``sys.byteorder``."""
    import sys

    for endianness in ("native", sys.byteorder):
        body, header = bytes_body(
            [[1.0, -2.5]],
            "float32",
            endianness,
            request_id="embd-1",
            created=0,
            model="m",
            num_prompt_tokens=2,
        )
        assert json.loads(header)["data"][0]["endianness"] == endianness
        order = "<" if sys.byteorder == "little" else ">"
        assert body == torch.tensor([1.0, -2.5]).numpy().astype(f"{order}f4").tobytes()
