"""``chassis bench throughput`` and ``chassis bench latency``: offline, optionally against HF.

Both engines get the same workload in the same run, in the same dtype, greedy, with
``ignore_eos`` (every request generates exactly its output length). HF runs ``generate`` on
one left-padded batch; its throughput counts only the tokens each request asked for.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from chassis.core.config import EngineConfig
from chassis.serve.bench_workload import BenchRequest, parse_length, random_workload


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def line(self) -> str:
        return (
            f"{self.backend:>8}: {self.num_requests} requests in {self.elapsed_s:.2f} s, "
            f"{self.output_tokens_per_s:.1f} output tok/s, "
            f"{self.total_tokens_per_s:.1f} total tok/s, "
            f"{self.num_requests / self.elapsed_s:.2f} req/s"
        )


def run_chassis(
    config: EngineConfig, workload: list[BenchRequest], warmup: bool = True
) -> tuple[ThroughputResult, Any]:
    """Run the workload through ``LLM``; returns the result and the LLM (for its config)."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    llm = LLM(**config.to_dict())
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload
    ]
    if warmup:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return (
        ThroughputResult(
            "chassis",
            len(workload),
            elapsed,
            sum(len(r.prompt_token_ids) for r in workload),
            produced,
        ),
        llm,
    )


def load_hf_model(config: EngineConfig, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    assert config.model is not None
    if config.load_format == "dummy":
        hf_config = AutoConfig.from_pretrained(config.model)
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def run_hf(
    model: Any, workload: list[BenchRequest], pad_token_id: int, batch_size: int
) -> ThroughputResult:
    """HF ``generate`` over left-padded batches of ``batch_size``; counts requested tokens."""
    device = next(model.parameters()).device
    elapsed = 0.0
    for first in range(0, len(workload), batch_size):
        chunk = workload[first : first + batch_size]
        width = max(len(r.prompt_token_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        max_new = max(r.output_len for r in chunk)
        start = time.perf_counter()
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
    return ThroughputResult(
        "hf",
        len(workload),
        elapsed,
        sum(len(r.prompt_token_ids) for r in workload),
        sum(r.output_len for r in workload),
    )


def throughput(args: Any, config: EngineConfig) -> dict[str, Any]:
    """Run the throughput benchmark described by CLI ``args``; print and return results."""
    from chassis.core.engine_setup import finalize_config
    from chassis.core.tokenizer import load_tokenizer

    hf_config = finalize_config(config)
    assert config.tokenizer is not None
    tokenizer = load_tokenizer(config.tokenizer)
    workload = random_workload(
        args.num_prompts,
        parse_length(args.input_len),
        parse_length(args.output_len),
        int(hf_config.vocab_size),
        set(tokenizer.all_special_ids),
        seed=args.seed,
    )
    report: dict[str, Any] = {"workload": _describe(args), "results": []}
    chassis_result, llm = run_chassis(config, workload)
    print(chassis_result.line())
    report["results"].append(_as_dict(chassis_result))
    dtype = llm.engine.executor.worker.dtype
    report["dtype"] = str(dtype).removeprefix("torch.")
    if args.backend == "hf":
        device = llm.engine.executor.worker.device
        del llm
        gc.collect()
        model = load_hf_model(config, dtype).to(device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        hf_result = run_hf(model, workload, pad, args.hf_batch_size or len(workload))
        print(hf_result.line())
        ratio = chassis_result.output_tokens_per_s / hf_result.output_tokens_per_s
        print(f"   ratio: chassis / hf = {ratio:.2f}x output tokens/s")
        report["results"].append(_as_dict(hf_result))
        report["ratio"] = ratio
    _maybe_write(args, report)
    return report


def latency(args: Any, config: EngineConfig) -> dict[str, Any]:
    """Batch-``args.batch_size`` end-to-end latency of one generation, averaged over iterations."""
    from chassis.core.engine_setup import finalize_config
    from chassis.core.tokenizer import load_tokenizer

    hf_config = finalize_config(config)
    assert config.tokenizer is not None
    tokenizer = load_tokenizer(config.tokenizer)
    input_len, output_len = int(args.input_len), int(args.output_len)
    workload = random_workload(
        args.batch_size,
        (input_len, input_len),
        (output_len, output_len),
        int(hf_config.vocab_size),
        set(tokenizer.all_special_ids),
        seed=args.seed,
    )
    report: dict[str, Any] = {"workload": _describe(args), "results": []}
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    # Prefix caching off: every iteration must recompute the same prompt.
    config.enable_prefix_caching = False
    llm = LLM(**config.to_dict())
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params)
    times = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    chassis_latency = sum(times) / len(times)
    tok_s = args.batch_size * output_len / chassis_latency
    print(
        f" chassis: latency {chassis_latency:.3f} s, {tok_s:.1f} output tok/s (batch {args.batch_size})"
    )
    report["results"].append(
        {"backend": "chassis", "latency_s": chassis_latency, "output_tokens_per_s": tok_s}
    )
    if args.backend == "hf":
        dtype = llm.engine.executor.worker.dtype
        device = llm.engine.executor.worker.device
        del llm
        gc.collect()
        model = load_hf_model(config, dtype).to(device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        for _ in range(args.num_iters_warmup):
            run_hf(model, workload, pad, args.batch_size)
        hf_times = [
            run_hf(model, workload, pad, args.batch_size).elapsed_s for _ in range(args.num_iters)
        ]
        hf_latency = sum(hf_times) / len(hf_times)
        hf_tok_s = args.batch_size * output_len / hf_latency
        print(f"      hf: latency {hf_latency:.3f} s, {hf_tok_s:.1f} output tok/s")
        print(f"   ratio: chassis / hf = {tok_s / hf_tok_s:.2f}x output tokens/s")
        report["results"].append(
            {"backend": "hf", "latency_s": hf_latency, "output_tokens_per_s": hf_tok_s}
        )
        report["ratio"] = tok_s / hf_tok_s
    _maybe_write(args, report)
    return report


def _describe(args: Any) -> dict[str, Any]:
    keys = ("num_prompts", "input_len", "output_len", "batch_size", "seed", "backend")
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}


def _as_dict(result: ThroughputResult) -> dict[str, Any]:
    data = asdict(result)
    data["output_tokens_per_s"] = result.output_tokens_per_s
    data["total_tokens_per_s"] = result.total_tokens_per_s
    return data


def _maybe_write(args: Any, report: dict[str, Any]) -> None:
    if getattr(args, "output_json", None):
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
