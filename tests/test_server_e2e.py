"""End to end: a real ``chassis serve`` process on a tiny random Llama, driven by the official
``openai`` client over real HTTP.

One server (module scope) serves every test; its teardown sends SIGTERM and checks a clean
exit. The model is random, so tests check structure and consistency (greedy runs agree,
streamed text equals the non-streamed text), not words.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import API_KEY, ServerProcess, running_server

openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 256
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("serve"),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
    ) as server:
        yield server


def test_models_and_auth(server: ServerProcess) -> None:
    assert [m.id for m in server.client().models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(server.base + "/health").status_code == 200  # no key needed


def test_greedy_completion_is_deterministic_and_streams_the_same(server: ServerProcess) -> None:
    client = server.client()
    kwargs = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8}
    first = client.completions.create(temperature=0, **kwargs)
    second = client.completions.create(temperature=0, **kwargs)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.completion_tokens <= 8 and first.usage.prompt_tokens > 0
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(temperature=0, stream=True, **kwargs)
        if chunk.choices
    )
    assert streamed == first.choices[0].text


def test_completion_batch_n_logprobs(server: ServerProcess) -> None:
    response = server.client().completions.create(
        model="tiny", prompt=["a", "b"], n=2, max_tokens=3, logprobs=2, seed=7
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    for choice in response.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
        assert all(lp <= 0 for lp in logprobs.token_logprobs)


def test_prompt_logprobs(server: ServerProcess) -> None:
    response = server.client().completions.create(
        model="tiny", prompt="Hello big world", max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    prompt_logprobs = response.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == response.usage.prompt_tokens
    assert prompt_logprobs[0] is None
    for position in prompt_logprobs[1:]:
        assert all(entry["logprob"] <= 0 for entry in position.values())


def test_echo_logprobs_score_the_prompt_as_hf_transformers_does(
    server: ServerProcess, tiny_llama_dir: Path
) -> None:
    """What an evaluation harness sends to score a text (``echo``, ``logprobs``,
    ``max_tokens: 0``): each prompt token's logprob under the model, as HF computes it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The capital of France is Paris"
    response = server.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = response.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(prompt).input_ids
    assert len(choice.logprobs.tokens) == len(ids) == response.usage.prompt_tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert choice.logprobs.token_logprobs[0] is None
    torch.testing.assert_close(
        torch.tensor(choice.logprobs.token_logprobs[1:]), expected, atol=1e-3, rtol=1e-3
    )
    greedy = logits.argmax(-1).tolist()
    for position, top in enumerate(choice.logprobs.top_logprobs[1:]):
        # the most likely token and the prompt's own (one entry when they are the same)
        assert len(top) == (1 if greedy[position] == ids[position + 1] else 2)


def test_streamed_echo_gives_every_choice_the_prompt_logprobs(server: ServerProcess) -> None:
    """Found serving SmolLM2: with ``n: 2`` the engine's first output may hold only the
    first choice (with the prompt logprobs); the second's echo then had ``null`` logprobs."""
    client = server.client()
    kwargs = dict(model="tiny", prompt="Hello big world", max_tokens=3, n=2, echo=True)
    whole = client.completions.create(**kwargs, logprobs=1, temperature=0)
    expected = whole.choices[0].logprobs.token_logprobs[: whole.usage.prompt_tokens]
    assert expected[0] is None and None not in expected[1:]
    for _ in range(3):  # the choices' first tokens may or may not come in one step
        firsts: dict[int, Any] = {}
        for chunk in client.completions.create(**kwargs, logprobs=1, stream=True, seed=1):
            for choice in chunk.choices:
                firsts.setdefault(choice.index, choice)
        assert sorted(firsts) == [0, 1]
        for choice in firsts.values():
            assert choice.logprobs.token_logprobs[: len(expected)] == pytest.approx(expected)
    # prompt_logprobs keeps to what it asked for, though echo has 3 computed
    response = client.completions.create(**kwargs, logprobs=3, extra_body={"prompt_logprobs": 1})
    for choice in response.choices:
        prompt_logprobs = choice.model_extra["prompt_logprobs"]
        assert all(len(position) <= 2 for position in prompt_logprobs[1:])
        assert any(len(top) >= 3 for top in choice.logprobs.top_logprobs[1:4])


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: ServerProcess) -> None:
    client = server.client()
    prompt = "one two three four five six seven eight nine ten " * 40  # past the context
    response = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert response.usage.prompt_tokens == 5
    tokens = httpx.post(
        server.base + "/tokenize", json={"prompt": prompt}, headers=server.headers
    ).json()["tokens"]
    detok = httpx.post(
        server.base + "/detokenize", json={"tokens": tokens[-5:]}, headers=server.headers
    )
    assert response.choices[0].text == detok.json()["prompt"]  # the kept end, echoed
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN - 2},
    )
    assert chat.usage.prompt_tokens == MAX_MODEL_LEN - 2  # the most that leaves room for 2
    # -1 keeps the last max_model_len tokens (vLLM's meaning): no room left for a completion
    with pytest.raises(openai.BadRequestError, match=r"-1 keeps 256 prompt tokens.*at most 254"):
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, extra_body={"truncate_prompt_tokens": -1}
        )
    # above max_model_len: a 400 whatever the prompt's length (vLLM's rule)
    with pytest.raises(
        openai.BadRequestError, match=r"value \(257\) is greater than max_model_len"
    ):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"truncate_prompt_tokens": 257}
        )
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"truncate_prompt_tokens": 0}
        )


def test_token_ids_and_restrictions_through_the_openai_client(
    server: ServerProcess, tiny_llama_dir: Path
) -> None:
    """vLLM's extras as a client sends them (extra_body): return_token_ids with a truncated
    prompt (the ids and the usage are the kept ones), allowed_token_ids and bad_words."""
    client = server.client()
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a b c d e f g h i j k l m n o p " * 4}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            "truncate_prompt_tokens": 20,
            "return_token_ids": True,
            "allowed_token_ids": [300, 301, 302],
        },
    )
    chunks = list(stream)
    assert len(chunks[0].model_extra["prompt_token_ids"]) == 20
    assert chunks[-1].usage.prompt_tokens == 20
    ids = [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []]
    assert len(ids) == 4 and set(ids) <= {300, 301, 302}

    # bad_words: a one-token word of the greedy output (as the tokenizer writes it) is gone
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    kwargs = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8}
    plain = client.completions.create(
        temperature=0, extra_body={"return_token_ids": True}, **kwargs
    )
    ids = plain.choices[0].model_extra["token_ids"]
    assert tokenizer.decode(ids) == plain.choices[0].text
    single = next(
        t for t in ids if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    avoided = client.completions.create(
        temperature=0,
        extra_body={"return_token_ids": True, "bad_words": [tokenizer.decode([single])]},
        **kwargs,
    )
    assert single not in avoided.choices[0].model_extra["token_ids"]


def test_chat_non_streaming_and_streaming_agree(server: ServerProcess) -> None:
    client = server.client()
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    message = full.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        full.usage.completion_tokens
    )
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n_and_top_logprobs(server: ServerProcess) -> None:
    response = server.client().chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, n=2, logprobs=True, top_logprobs=3
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        for token in choice.logprobs.content:
            assert len(token.top_logprobs) == 3


def test_errors(server: ServerProcess) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello " * 400, max_tokens=1)
    assert "context length" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=MAX_MODEL_LEN)


def test_tokenize_detokenize_roundtrip(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(
        server.base + "/tokenize",
        json={"prompt": "Hello world", "add_special_tokens": False},
        headers=headers,
    ).json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": tokens}, headers=headers).json()[
        "prompt"
    ]
    assert text == "Hello world"


def test_disconnect_mid_stream_frees_the_request(server: ServerProcess) -> None:
    body = {
        "model": "tiny",
        "prompt": "count",
        "max_tokens": MAX_MODEL_LEN - 10,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    generated_before = server.metric("chassis:generation_tokens_total")
    with httpx.stream(
        "POST", server.base + "/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[len("data: ") :])
                seen += 1
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
    # the engine drops the request well before it could have generated 246 tokens
    deadline = time.monotonic() + 5
    while server.metric("chassis:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the aborted request is still running"
        time.sleep(0.1)
    assert server.metric("chassis:kv_cache_usage_perc") == 0.0
    generated = server.metric("chassis:generation_tokens_total") - generated_before
    assert generated < 100, f"{generated} tokens generated: the request was not aborted"


def test_metrics_count_requests(server: ServerProcess) -> None:
    before = server.metric("chassis:generation_tokens_total")
    server.client().completions.create(
        model="tiny", prompt="x", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert server.metric("chassis:generation_tokens_total") == before + 4


def test_stop_strings_and_seeded_sampling(server: ServerProcess) -> None:
    client = server.client()
    kwargs = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12}
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    assert len(greedy) > 4
    stop = greedy[2:4]
    cut = client.completions.create(temperature=0, stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == greedy[: greedy.index(stop)]

    sampled = [
        client.completions.create(temperature=1.0, seed=1234, **kwargs).choices[0].text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]
    other = client.completions.create(temperature=1.0, seed=99, **kwargs).choices[0].text
    assert other != sampled[0]
