"""``chassis bench serve``: drive a running server over HTTP and report latency percentiles.

Sends streaming ``/v1/completions`` requests with random-token prompts at a request rate
(Poisson arrivals) or with a fixed number in flight (``--max-concurrency``), and measures per
request the time to first token (TTFT), time per output token after the first (TPOT), and
every inter-token latency (ITL): the gap before each chunk that brought tokens, as vLLM's
serving benchmark counts it (a server that falls behind sends several tokens in one chunk;
TPOT counts tokens).
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
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send (default: 64)")
    p.add_argument(
        "--input-len", default="128", help="prompt tokens: N or MIN:MAX (uniform; default 128)"
    )
    p.add_argument(
        "--output-len", default="128", help="output tokens: N or MIN:MAX (uniform; default 128)"
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


async def _one(
    client: Any, url: str, headers: dict[str, str], body: dict[str, Any]
) -> RequestResult:
    result = RequestResult(ok=False, prompt_tokens=len(body["prompt"]))
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
                if not (result.output_tokens > had or chunk["choices"][0].get("text")):
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


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None) as client:
        model = args.model
        if model is None:
            model = await served_model(client, headers)
        vocab = args.vocab_size or 1000
        workload = random_workload(
            args.num_prompts,
            parse_length(args.input_len),
            parse_length(args.output_len),
            vocab,
            seed=args.seed,
        )
        semaphore = asyncio.Semaphore(args.max_concurrency or len(workload))
        rng = random.Random(args.seed)

        async def limited(body: dict[str, Any]) -> RequestResult:
            async with semaphore:
                return await _one(client, "/v1/completions", headers, body)

        tasks = []
        start = time.perf_counter()
        for request in workload:
            body = {
                "model": model,
                "prompt": request.prompt_token_ids,
                "max_tokens": request.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            tasks.append(asyncio.create_task(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


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
    """Run the benchmark and print its report; exit status 0, 1 when a request failed or
    the server cannot be benchmarked (a one-line error, no traceback)."""
    try:
        report = asyncio.run(_bench(args))
    except ServerUnusableError as exc:
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
