"""``chassis bench throughput`` and ``chassis bench latency``: offline, optionally against HF.

Both engines get the same workload in the same run, in the same dtype, greedy, with
``ignore_eos`` (every request generates exactly its output length). HF runs ``generate`` on
one left-padded batch; its throughput counts only the tokens each request asked for.

Workloads are random token ids drawn with the engine seed (``--seed``, default 0), so a run
is reproducible. ``--skip-tokenizer-init`` (with ``--load-format dummy``, e.g. the shipped
``--model-preset qwen3-0.6b``) benchmarks a model that has no tokenizer files: special ids to
avoid come from the model config, and HF pads with id 0.
"""

from __future__ import annotations

import gc
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from chassis.core.config import EngineConfig
from chassis.core.heap import frozen_heap
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


def _greedy(max_tokens: int) -> Any:
    from chassis.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def time_chassis(llm: Any, workload: list[BenchRequest]) -> ThroughputResult:
    """Time one ``llm.generate`` over the whole workload (every request greedy, ignore_eos)."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [_greedy(r.output_len) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputResult(
        "chassis", len(workload), elapsed, sum(len(r.prompt_token_ids) for r in workload), produced
    )


def run_chassis(
    config: EngineConfig,
    workload: list[BenchRequest],
    warmup: list[BenchRequest] | None = None,
) -> tuple[ThroughputResult, Any]:
    """Run ``warmup`` (untimed: kernel compilation), then time the workload through ``LLM``;
    returns the result and the LLM (for its config and further runs)."""
    from chassis.core.llm import LLM

    llm = LLM(**config.to_dict())
    if warmup:
        llm.generate(
            [{"prompt_token_ids": r.prompt_token_ids} for r in warmup],
            [_greedy(r.output_len) for r in warmup],
        )
    with frozen_heap():  # no 100 ms full collection inside the timed run
        return time_chassis(llm, workload), llm


def with_fresh_ids(
    requests: list[BenchRequest], vocab_size: int, excluded_ids: set[int], seed: int
) -> list[BenchRequest]:
    """The same request shapes (prompt and output lengths) with new random prompt ids.

    Speed depends on the shapes only (random weights, ``ignore_eos``); new ids keep a re-run
    from hitting the prefix cache the previous run filled.
    """
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded_ids]
    return [
        BenchRequest([rng.choice(allowed) for _ in r.prompt_token_ids], r.output_len)
        for r in requests
    ]


def load_hf_model(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> Any:
    """HF's model of ``config.model`` on ``device`` in ``dtype``, for the comparison runs:
    random weights for ``--load-format dummy`` (initialized on the device, not drawn on the
    host and copied: on the H200 about 40 s of a latency step went to HF's untimed set-up,
    which the host's random init of 0.6B parameters would explain), else the checkpoint's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    assert config.model is not None
    if config.load_format == "dummy":
        hf_config = AutoConfig.from_pretrained(
            config.model, trust_remote_code=config.trust_remote_code
        )
        torch.manual_seed(config.seed)
        with device:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=dtype, trust_remote_code=config.trust_remote_code
        ).to(device)
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


def _prepare(config: EngineConfig) -> tuple[Any, set[int], int]:
    """Finalize ``config``; return the HF config, the token ids random prompts avoid (special
    tokens) and the pad id for HF. Without a tokenizer (``skip_tokenizer_init``) both come
    from the model config (its bos/eos/pad ids; pad 0)."""
    from chassis.core.engine_setup import finalize_config

    hf_config = finalize_config(config)
    if config.skip_tokenizer_init:
        declared = (
            getattr(hf_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        )
        special: set[int] = set()
        for value in declared:
            special.update([value] if isinstance(value, int) else value or [])
        return hf_config, special, 0
    from chassis.core.tokenizer import engine_tokenizer

    tokenizer = engine_tokenizer(config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return hf_config, set(tokenizer.all_special_ids), pad


def _check_backend(args: Any, config: EngineConfig) -> None:
    """Refuse, before anything runs, an HF comparison that cannot be made: HF runs in this
    process on the device the engine used here, and with Ray every rank (rank 0 included) is
    an actor, so this process holds no device and the cluster's devices are Ray's."""
    if args.backend == "hf" and config.distributed_executor_backend == "ray":
        raise ValueError(
            "--backend hf runs HF on the engine's device in this process, but with "
            "--distributed-executor-backend ray every rank runs in a Ray actor and this process "
            "holds no device; compare with HF without Ray (--tensor-parallel-size N runs rank 0 "
            "here), or drop --backend hf"
        )


def _engine_dtype_device(llm: Any) -> tuple[torch.dtype, torch.device | None]:
    """The engine's dtype and the device of this process it ran on (``None`` when its ranks
    are Ray actors); the caller then drops its last reference to ``llm``."""
    executor = llm.engine.executor
    return executor.model_dtype(), executor.local_device()


def _release_memory(device: torch.device) -> None:
    # The engine's KV cache is garbage once its LLM is gone; hand it back before HF allocates.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def throughput(args: Any, config: EngineConfig) -> dict[str, Any]:
    """Run the throughput benchmark described by CLI ``args``; print and return results.

    With ``--backend hf``, HF runs the first ``--hf-num-prompts`` requests (default: all);
    when that is fewer than all, chassis is also timed on requests of exactly those shapes
    (fresh ids, so no prefix-cache hits), and the ratio compares those two runs
    (``report["ratio_basis"]``). Otherwise it compares the full runs.
    """
    _check_backend(args, config)
    hf_config, special, pad = _prepare(config)
    if getattr(args, "dataset_name", "random") == "sharegpt":
        workload = _sharegpt_workload(args, config)
    else:
        workload = random_workload(
            args.num_prompts,
            parse_length(args.input_len),
            parse_length(args.output_len),
            int(hf_config.vocab_size),
            special,
            seed=config.seed,
        )
    num_hf = getattr(args, "hf_num_prompts", None) or len(workload)
    if not 1 <= num_hf <= len(workload):
        raise ValueError(f"--hf-num-prompts must be in [1, {len(workload)}]; got {num_hf}")
    vocab_size = int(hf_config.vocab_size)
    report: dict[str, Any] = {"workload": _describe(args, config), "results": []}
    # Warm-up: a mixed prefill/decode batch shaped like the first requests, other ids.
    warmup = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, 16))
        for r in with_fresh_ids(workload[:16], vocab_size, special, config.seed + 1)
    ]
    chassis_result, llm = run_chassis(config, workload, warmup)
    report["workload"]["async_scheduling"] = llm.config.async_scheduling  # (as resolved)
    print(chassis_result.line())
    report["results"].append(_as_dict(chassis_result))
    dtype, device = _engine_dtype_device(llm)
    report["dtype"] = str(dtype).removeprefix("torch.")
    if args.backend == "hf":
        hf_workload = workload[:num_hf]
        same = chassis_result
        if num_hf < len(workload):
            # The shapes HF runs, with ids the cache has not seen (HF caches nothing either).
            same = time_chassis(
                llm, with_fresh_ids(hf_workload, vocab_size, special, config.seed + 2)
            )
            print(same.line() + f"  (the shapes of the first {num_hf}, which HF runs)")
            report["results"].append(_as_dict(same))
        assert device is not None  # _check_backend refused engines without one
        del llm
        _release_memory(device)
        model = load_hf_model(config, dtype, device)
        batch = args.hf_batch_size or len(hf_workload)
        run_hf(model, [BenchRequest(hf_workload[0].prompt_token_ids, 4)], pad, 1)  # warm-up
        hf_result = run_hf(model, hf_workload, pad, batch)
        print(hf_result.line())
        ratio = same.output_tokens_per_s / hf_result.output_tokens_per_s
        basis = f"chassis / hf output tokens/s on the same {num_hf} request shapes"
        print(f"   ratio: {basis} = {ratio:.2f}x")
        report["results"].append(_as_dict(hf_result))
        report["ratio"] = ratio
        report["ratio_basis"] = basis
    _maybe_write(args, report)
    return report


def _sharegpt_workload(args: Any, config: EngineConfig) -> list[BenchRequest]:
    """``--dataset-name sharegpt``: ShareGPT's first turns, tokenized by the engine's
    tokenizer (:mod:`chassis.serve.bench_sharegpt`); ``ValueError`` saying what is missing."""
    from chassis.core.tokenizer import engine_tokenizer
    from chassis.serve.bench_sharegpt import tokenized_sharegpt_workload

    if config.skip_tokenizer_init:
        raise ValueError("--dataset-name sharegpt tokenizes text: drop --skip-tokenizer-init")
    return tokenized_sharegpt_workload(
        args.dataset_path,
        args.num_prompts,
        engine_tokenizer(config),
        seed=config.seed,
        fixed_output_len=args.sharegpt_output_len,
    )


def latency(args: Any, config: EngineConfig) -> dict[str, Any]:
    """Batch-``args.batch_size`` end-to-end latency of one generation, averaged over iterations."""
    _check_backend(args, config)
    hf_config, special, pad = _prepare(config)
    input_len, output_len = int(args.input_len), int(args.output_len)
    workload = random_workload(
        args.batch_size,
        (input_len, input_len),
        (output_len, output_len),
        int(hf_config.vocab_size),
        special,
        seed=config.seed,
    )
    report: dict[str, Any] = {"workload": _describe(args, config), "results": []}
    from chassis.core.llm import LLM

    # Prefix caching off: every iteration must recompute the same prompt.
    config.enable_prefix_caching = False
    llm = LLM(**config.to_dict())
    report["workload"]["async_scheduling"] = llm.config.async_scheduling  # (as resolved)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = _greedy(output_len)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params)
    times = []
    with frozen_heap():  # no 100 ms full collection inside the timed runs
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
        {
            "backend": "chassis",
            "latency_s": chassis_latency,
            "iteration_latencies_s": times,
            "output_tokens_per_s": tok_s,
        }
    )
    dtype, device = _engine_dtype_device(llm)
    report["dtype"] = str(dtype).removeprefix("torch.")
    if args.backend == "hf":
        assert device is not None  # _check_backend refused engines without one
        del llm
        _release_memory(device)
        model = load_hf_model(config, dtype, device)
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
            {
                "backend": "hf",
                "latency_s": hf_latency,
                "iteration_latencies_s": hf_times,
                "output_tokens_per_s": hf_tok_s,
            }
        )
        report["ratio"] = tok_s / hf_tok_s
        report["ratio_basis"] = "chassis / hf output tokens/s, same batch"
    _maybe_write(args, report)
    return report


def _describe(args: Any, config: EngineConfig) -> dict[str, Any]:
    keys = (
        "num_prompts",
        "input_len",
        "output_len",
        "batch_size",
        "backend",
        "hf_num_prompts",
        "hf_batch_size",
        "model_preset",
    )
    described = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    described.update(
        model=config.model,
        seed=config.seed,
        load_format=config.load_format,
        skip_tokenizer_init=config.skip_tokenizer_init,
        enforce_eager=config.enforce_eager,
        async_scheduling=config.async_scheduling,
        torch_compile=config.torch_compile,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        attention_backend=config.attention_backend,
        speculative_config=config.speculative_config,
    )
    return described


def _as_dict(result: ThroughputResult) -> dict[str, Any]:
    data = asdict(result)
    data["output_tokens_per_s"] = result.output_tokens_per_s
    data["total_tokens_per_s"] = result.total_tokens_per_s
    return data


def _maybe_write(args: Any, report: dict[str, Any]) -> None:
    if getattr(args, "output_json", None):
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
