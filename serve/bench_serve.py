"""``chassis bench serve``: drive a running server over HTTP and report latency percentiles.

Sends streaming ``/v1/completions`` (or, ``--endpoint``, ``/v1/chat/completions``) requests
at a request rate (Poisson arrivals) or with a fixed number in flight
(``--max-concurrency``): random-token prompts (``--dataset-name random``, the default) or
ShareGPT's conversations (``--dataset-name sharegpt --dataset-path FILE``,
:mod:`chassis.serve.bench_sharegpt`). vLLM's spellings of the workload flags (``--host``/
``--port``, ``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``) are
accepted. It measures per request the time to first token (TTFT), time per output token
after the first (TPOT), and every inter-token latency (ITL): the gap before each chunk that
brought tokens, as vLLM's serving benchmark counts it (a server that falls behind sends
several tokens in one chunk; TPOT counts tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from chassis.serve.bench_sharegpt import (
    add_dataset_args,
    load_sharegpt,
    server_token_counter,
    sharegpt_workload,
)
from chassis.serve.bench_workload import parse_length, random_workload


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def add_serve_bench_parser(kinds: Any) -> None:
    p = kinds.add_parser("serve", help="benchmark a running chassis (or OpenAI-compatible) server")
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server, without /v1 (default: http://127.0.0.1:8000)",
    )
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)"
    )
    p.add_argument(
        "--host",
        default=None,
        help="vLLM's way to name the server: --host and --port make the base URL",
    )
    p.add_argument("--port", type=int, default=None, help="with --host (default: 8000)")
    p.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="/v1/completions",
        help="the streamed route each request goes to (default: /v1/completions); chat sends "
        "each prompt as one user message, so it takes text prompts (--dataset-name sharegpt)",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send (default: 64)")
    add_dataset_args(p, "sent as text")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ShareGPT: generate the full output length past EOS (random prompts always do)",
    )
    p.add_argument(
        "--input-len", default=None, help="prompt tokens: N or MIN:MAX (uniform; default 128)"
    )
    p.add_argument(
        "--output-len", default=None, help="output tokens: N or MIN:MAX (uniform; default 128)"
    )
    p.add_argument("--random-input-len", type=int, default=None, help="vLLM's --input-len N")
    p.add_argument("--random-output-len", type=int, default=None, help="vLLM's --output-len N")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="vLLM's: random lengths uniform in [N*(1-R), N*(1+R)] around the random lengths "
        "(default: 0, exactly N)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts and arrivals (default: 0)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="random prompts' token ids are drawn from [0, N) (default: 1000)",
    )
    p.add_argument("--output-json", default=None, help="write the results here as JSON")
    p.set_defaults(run=run)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def workload_lengths(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int]]:
    """The random workload's (input, output) length ranges from chassis' flags or vLLM's
    (``--random-input-len`` with ``--random-range-ratio``); ``ValueError`` when both name
    one length, or for a range that is not one."""
    ratio = args.random_range_ratio
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1); got {ratio}")

    def one(spec: str | None, vllm_value: int | None, name: str) -> tuple[int, int]:
        if spec is not None and vllm_value is not None:
            raise ValueError(f"give --{name}-len or --random-{name}-len, not both")
        if vllm_value is None:
            return parse_length(spec or "128")
        low, high = int(vllm_value * (1 - ratio)), int(vllm_value * (1 + ratio))
        return parse_length(f"{max(low, 1)}:{max(high, 1)}")

    return (
        one(args.input_len, args.random_input_len, "input"),
        one(args.output_len, args.random_output_len, "output"),
    )


#: the routes ``--endpoint`` may name: completions take the prompt, chat one user message
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def prompt_fields(endpoint: str, prompt: str | list[int]) -> dict[str, Any]:
    """The body fields that carry ``prompt`` to ``endpoint``: a completion's ``prompt``, or a
    chat request's one user message (a text prompt: :func:`_workload` checks)."""
    if endpoint == "/v1/completions":
        return {"prompt": prompt}
    return {"messages": [{"role": "user", "content": prompt}]}


def base_url(args: argparse.Namespace) -> str:
    """``--base-url``, or vLLM's ``--host``/``--port``."""
    if args.host is None and args.port is None:
        return str(args.base_url)
    return f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"


async def _one(
    client: Any, url: str, headers: dict[str, str], body: dict[str, Any], prompt_tokens: int
) -> RequestResult:
    result = RequestResult(ok=False, prompt_tokens=prompt_tokens)
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                had = result.output_tokens
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                # A token arrived when the per-chunk usage grew (continuous usage stats), or,
                # from a server that sends no per-chunk usage, when the chunk has text.
                # Counting tokens, not text, also times servers that stream ids with empty
                # text (--skip-tokenizer-init).
                choice = chunk["choices"][0]
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if not (result.output_tokens > had or text):
                    continue
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.latency_s = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # a benchmark reports failures, it does not stop on them
        result.error = f"{type(exc).__name__}: {exc}"
    return result


class ServerUnusableError(RuntimeError):
    """The server cannot be benchmarked: unreachable, or its ``/v1/models`` refused (a
    wrong API key) or named no model. The message says which."""


async def served_model(client: Any, headers: dict[str, str]) -> str:
    """The first model ``GET /v1/models`` lists; :class:`ServerUnusableError` when the
    server cannot be reached or does not answer with a model."""
    import httpx

    try:
        response = await client.get("/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise ServerUnusableError(f"cannot reach {client.base_url}: {exc}") from None
    if response.status_code != 200:
        hint = " (pass the server's key with --api-key)" if response.status_code == 401 else ""
        raise ServerUnusableError(
            f"GET /v1/models answered HTTP {response.status_code}{hint}: {response.text[:200]}"
        )
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerUnusableError(
            f"GET /v1/models listed no model (pass --model): {response.text[:200]}"
        ) from None


async def _bench(args: argparse.Namespace, transport: Any = None) -> dict[str, Any]:
    """Run the workload against the server (``transport``: httpx's, for tests in-process)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=base_url(args), timeout=None, transport=transport
    ) as client:
        model = args.model
        if model is None:
            model = await served_model(client, headers)
        requests = await _workload(args, client, headers, model)
        semaphore = asyncio.Semaphore(args.max_concurrency or max(len(requests), 1))
        rng = random.Random(args.seed)

        async def limited(body: dict[str, Any], prompt_len: int) -> RequestResult:
            async with semaphore:
                return await _one(client, args.endpoint, headers, body, prompt_len)

        tasks = []
        start = time.perf_counter()
        for prompt, prompt_len, output_len, ignore_eos in requests:
            body = {
                "model": model,
                **prompt_fields(args.endpoint, prompt),
                "max_tokens": output_len,
                "temperature": 0.0,
                "ignore_eos": ignore_eos,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            tasks.append(asyncio.create_task(limited(body, prompt_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


async def _workload(
    args: argparse.Namespace, client: Any, headers: dict[str, str], model: str
) -> list[tuple[str | list[int], int, int, bool]]:
    """``(prompt, prompt tokens, output tokens, ignore_eos)`` of each request."""
    if args.endpoint != "/v1/completions" and args.dataset_name == "random":
        raise ValueError(
            f"--endpoint {args.endpoint} sends text: use --dataset-name sharegpt (random "
            "prompts are token ids, which only /v1/completions takes)"
        )
    if args.dataset_name == "sharegpt":
        workload = await sharegpt_workload(
            load_sharegpt(args.dataset_path),
            args.num_prompts,
            server_token_counter(client, headers, model),
            seed=args.seed,
            fixed_output_len=args.sharegpt_output_len,
        )
        return [(r.prompt, r.prompt_len, r.output_len, args.ignore_eos) for r in workload]
    input_len, output_len = workload_lengths(args)
    random_requests = random_workload(
        args.num_prompts, input_len, output_len, args.vocab_size or 1000, seed=args.seed
    )
    return [
        (r.prompt_token_ids, len(r.prompt_token_ids), r.output_len, True) for r in random_requests
    ]


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ms = 1000.0
    ttft = [r.ttft_s * ms for r in ok]
    tpot = [t * ms for r in ok if (t := r.tpot_s) is not None]
    itl = [x * ms for r in ok for x in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)

    def stats(values: list[float]) -> dict[str, float]:
        mean = statistics.fmean(values) if values else float("nan")
        return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99)}

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(itl),
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print its report; exit status 0, 1 when a request failed, the
    server cannot be benchmarked or the workload cannot be made (a one-line error, no
    traceback)."""
    try:
        report = asyncio.run(_bench(args))
    except (ServerUnusableError, ValueError) as exc:  # ValueError: the workload's flags or file
        print(f"chassis bench serve: {exc}", file=sys.stderr)
        return 1
    print(
        f"completed {report['completed']}, failed {report['failed']} in {report['duration_s']:.2f} s"
    )
    for error in report["errors"]:
        print(f"  error: {error}")
    print(
        f"request throughput {report['request_throughput']:.2f} req/s, "
        f"output {report['output_token_throughput']:.1f} tok/s, "
        f"total {report['total_token_throughput']:.1f} tok/s"
    )
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        s = report[key]
        print(
            f"{key[:-3].upper():>5} ms: mean {s['mean']:.1f}  p50 {s['p50']:.1f}  p99 {s['p99']:.1f}"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1
