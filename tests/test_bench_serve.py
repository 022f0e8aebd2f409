"""``chassis bench serve`` end to end over the test double of the engine (in-process, httpx's
ASGI transport): the random workload with chassis' and vLLM's length flags, the ShareGPT
workload and its filter, and the one-line errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeAsyncLLM

from chassis.serve.app import build_app
from chassis.serve.bench_serve import _bench, base_url, run
from chassis.serve.cli import build_parser
from chassis.serve.settings import ServerSettings


def _args(*flags: str) -> Any:
    return build_parser().parse_args(["bench", "serve", *flags])


def _run(engine: FakeAsyncLLM, *flags: str) -> dict[str, Any]:
    app = build_app(engine, ServerSettings())

    async def main() -> dict[str, Any]:
        async with app.router.lifespan_context(app):
            return await _bench(_args(*flags), transport=httpx.ASGITransport(app=app))

    return asyncio.run(main())


def test_random_prompts_with_vllm_s_length_flags() -> None:
    engine = FakeAsyncLLM()
    flags = ["--num-prompts", "12", "--vocab-size", "200", "--max-concurrency", "4"]
    report = _run(
        engine, *flags, "--random-input-len", "8", "--random-output-len", "3",
        "--random-range-ratio", "0.5",
    )  # fmt: skip
    assert report["completed"] == 12 and report["failed"] == 0
    lengths = [len(ids) for _, ids, _, _ in engine.requests]
    assert all(4 <= n <= 12 for n in lengths) and len(set(lengths)) > 1
    assert {params.max_tokens for _, _, params, _ in engine.requests} <= {1, 2, 3, 4}
    assert all(params.ignore_eos for _, _, params, _ in engine.requests)
    assert report["output_token_throughput"] > 0 and report["ttft_ms"]["p50"] >= 0
    engine = FakeAsyncLLM()
    _run(engine, "--num-prompts", "3", "--vocab-size", "200", "--input-len", "5")
    assert [len(ids) for _, ids, _, _ in engine.requests] == [5, 5, 5]


CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": "What is a cat?"}, {"from": "gpt", "value": "A small feline."}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there!"}]},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "ok"}]},
    {"conversations": [{"from": "human", "value": "Only one turn"}]},
    {"conversations": [{"from": "human", "value": "Count to three."}, {"from": "gpt", "value": "1, 2, 3."}, {"from": "human", "value": "more"}]},
    {"conversations": [{"from": "human", "value": "x" * 1100}, {"from": "gpt", "value": "too long a prompt"}]},
    {"id": "no conversations"},
]  # fmt: skip


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    return str(path)


def test_sharegpt_sends_the_first_turns_that_pass_vllm_s_filter(sharegpt_file: str) -> None:
    engine = FakeAsyncLLM(max_model_len=2048)
    flags = ["--dataset-name", "sharegpt", "--dataset-path", sharegpt_file]
    report = _run(engine, *flags, "--num-prompts", "10")
    # kept: the two conversations whose prompt and reply have 4 tokens or more (one per
    # byte, plus BOS, as vLLM counts) and whose prompt is at most 1024; "Hi", the 2-byte
    # reply, the lone turn and the long prompt are not
    assert report["completed"] == 2 and report["failed"] == 0
    sent = sorted(
        (engine.tokenizer.decode(ids[1:]), p.max_tokens) for _, ids, p, _ in engine.requests
    )
    assert sent == [
        ("Count to three.", len("1, 2, 3.") + 1),
        ("What is a cat?", len("A small feline.") + 1),
    ]
    assert not any(params.ignore_eos for _, _, params, _ in engine.requests)
    # a fixed output length, EOS ignored, and fewer prompts than there are conversations
    engine = FakeAsyncLLM(max_model_len=2048)
    report = _run(
        engine, *flags, "--num-prompts", "1", "--sharegpt-output-len", "3", "--ignore-eos",
    )  # fmt: skip
    assert report["completed"] == 1
    ((_, _, params, _),) = engine.requests
    assert params.max_tokens == 3 and params.ignore_eos
    # the same conversations through the chat route, as one user message each
    engine = FakeAsyncLLM(max_model_len=2048)
    report = _run(engine, *flags, "--num-prompts", "10", "--endpoint", "/v1/chat/completions")
    assert report["completed"] == 2 and report["output_token_throughput"] > 0
    rendered = [engine.tokenizer.decode(ids) for _, ids, _, _ in engine.requests]
    assert all("<|im_start|>user\n" in text for text in rendered)
    assert report["ttft_ms"]["p50"] >= 0 and report["itl_ms"]["mean"] >= 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["--dataset-name", "sharegpt", "--dataset-path", "/no/such.json"], "cannot read it"),
        (["--input-len", "8", "--random-input-len", "8"], "not both"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1)"),
        (["--endpoint", "/v1/chat/completions"], "use --dataset-name sharegpt"),
    ],
)
def test_a_workload_that_cannot_be_made_is_one_line_and_exit_1(
    flags: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = build_app(FakeAsyncLLM(), ServerSettings())
    real_bench = _bench

    async def in_process(args: Any) -> dict[str, Any]:
        return await real_bench(args, transport=httpx.ASGITransport(app=app))

    monkeypatch.setattr("chassis.serve.bench_serve._bench", in_process)
    assert run(_args(*flags)) == 1
    err = capsys.readouterr().err
    assert err.startswith("chassis bench serve: ") and message in err and "Traceback" not in err


def test_host_and_port_name_the_server() -> None:
    assert base_url(_args()) == "http://127.0.0.1:8000"
    assert base_url(_args("--base-url", "http://h:1")) == "http://h:1"
    assert base_url(_args("--host", "10.0.0.2", "--port", "9000")) == "http://10.0.0.2:9000"
    assert base_url(_args("--port", "9001")) == "http://127.0.0.1:9001"


def test_throughput_runs_sharegpt_through_the_engine_s_tokenizer(
    tiny_llama_dir: Path, sharegpt_file: str, tmp_path: Path
) -> None:
    """``chassis bench throughput --dataset-name sharegpt``: the same conversations pass the
    filter, tokenized by the engine's tokenizer (SmolLM2's, in the tiny Llama)."""
    from chassis.serve.args import engine_config_from_args
    from chassis.serve.bench_offline import throughput

    out = tmp_path / "report.json"
    args = build_parser().parse_args(
        ["bench", "throughput", str(tiny_llama_dir), "--dtype", "float32",
         "--num-kv-blocks", "128", "--num-prompts", "10", "--dataset-name", "sharegpt",
         "--dataset-path", sharegpt_file, "--output-json", str(out)]
    )  # fmt: skip
    report = throughput(args, engine_config_from_args(args))
    (result,) = report["results"]
    # vLLM's filter over the tokenizer's own counts (BPE: the 1100 x's are far fewer tokens)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    kept = [
        (len(tokenizer(turns[0]["value"]).input_ids), len(tokenizer(turns[1]["value"]).input_ids))
        for turns in (c.get("conversations", []) for c in CONVERSATIONS)
        if len(turns) >= 2
    ]
    kept = [(n, m) for n, m in kept if n >= 4 and m >= 4 and n <= 1024 and n + m <= 2048]
    assert result["num_requests"] == len(kept) >= 2, result
    assert result["prompt_tokens"] == sum(n for n, _ in kept)
    assert result["output_tokens"] == sum(m for _, m in kept)  # ignore_eos, as vLLM's
    missing = build_parser().parse_args(
        ["bench", "throughput", str(tiny_llama_dir), "--dataset-name", "sharegpt"]
    )
    with pytest.raises(ValueError, match="needs --dataset-path"):
        throughput(missing, engine_config_from_args(missing))
