"""``skip_tokenizer_init``: engines that run on token ids only, with no tokenizer files at all.

The model is a tiny Qwen3 *config* with random weights (``load_format="dummy"``): no
safetensors and no tokenizer, the way the GPU benchmark's Qwen3-0.6B preset is shipped.
"""

from __future__ import annotations

import asyncio

import pytest
from fixtures_bench import VOCAB, write_tiny_qwen3_config

from chassis.core.llm import LLM
from chassis.core.sampling_params import SamplingParams

ENGINE = {
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "num_kv_blocks": 64,
    "max_model_len": 128,
}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return write_tiny_qwen3_config(tmp_path_factory.mktemp("tiny-qwen3"), generation_eos=[2, 7])


@pytest.fixture(scope="module")
def llm(config_dir):
    return LLM(str(config_dir), **ENGINE)


def test_generates_token_ids_with_empty_text(llm):
    assert llm.get_tokenizer() is None
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    outputs = llm.generate([[5, 6, 7], {"prompt_token_ids": [8, 9]}], params)
    for output, prompt in zip(outputs, [[5, 6, 7], [8, 9]], strict=True):
        assert output.prompt_token_ids == prompt and output.prompt is None
        completion = output.outputs[0]
        assert completion.text == "" and completion.finish_reason == "length"
        assert len(completion.token_ids) == 5
        assert all(0 <= t < VOCAB for t in completion.token_ids)
        # logprobs still work; there is no text to decode them to
        assert len(completion.logprobs) == 5
        sampled = completion.logprobs[0][completion.token_ids[0]]
        assert sampled.decoded_token is None
    # greedy and deterministic: the same prompt gives the same ids
    again = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_eos_ids_come_from_the_model_config_and_generation_config(llm):
    assert llm.input_processor.eos_token_ids == [2, 7]


def test_eos_from_config_stops_generation(llm):
    # Make the model's EOS the only possible token: generation stops on it at once.
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={2: 100.0})
    completion = llm.generate([[5, 6]], params)[0].outputs[0]
    assert completion.token_ids == [2] and completion.finish_reason == "stop"


def test_text_prompts_are_rejected(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_stop_strings_are_rejected(llm):
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, stop=["x"]))
    # stop token ids are fine
    params = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[3])
    assert llm.generate([[5, 6]], params)[0].finished


def test_ids_are_checked_against_the_model_vocabulary(llm):
    with pytest.raises(ValueError, match=r"vocabulary \[0, 512\)"):
        llm.generate([[5, VOCAB]], SamplingParams(max_tokens=2))


def test_async_llm_and_completions_route_without_tokenizer(config_dir):
    """The server path the serving benchmark uses: token-id prompts in, empty text out, and
    ``chassis bench serve``'s client counting tokens from the per-chunk usage."""
    import httpx

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.bench_serve import _one

    engine = AsyncLLM.from_engine_config(EngineConfig(model=str(config_dir), **ENGINE))
    try:
        assert engine.tokenizer is None
        app = build_app(engine)

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                plain = await client.post(
                    "/v1/completions",
                    json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
                )
                text = await client.post(
                    "/v1/completions", json={"prompt": "hello", "max_tokens": 4}
                )
                body = {
                    "prompt": [9, 10, 11, 12],
                    "max_tokens": 6,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                }
                streamed = await _one(client, "/v1/completions", {}, body, prompt_tokens=4)
            return plain, text, streamed

        plain, text, streamed = asyncio.run(main())
    finally:
        engine.shutdown_sync()
    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert plain.json()["usage"]["completion_tokens"] == 4
    assert text.status_code == 400 and "token ids" in text.json()["error"]["message"]
    assert streamed.ok, streamed.error
    assert streamed.output_tokens == 6 and streamed.ttft_s > 0
    # Chunks with empty text are timed (the per-chunk usage says they brought tokens): one
    # inter-token latency per chunk after the first, as vLLM's benchmark counts them. A
    # reader that fell behind gets several tokens in one chunk, so there are at most 5.
    assert len(streamed.itl_s) <= 5
    assert sum(streamed.itl_s) <= streamed.latency_s - streamed.ttft_s + 1e-9
