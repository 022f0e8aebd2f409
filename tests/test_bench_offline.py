"""``chassis bench throughput|latency`` end to end, as the GPU benchmark runs them: a Qwen3
config with random weights (``--load-format dummy``) and no tokenizer
(``--skip-tokenizer-init``), with and without the HF comparison, in a child process."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from fixtures_bench import write_tiny_qwen3_config

from chassis.platforms import cpu_kernels
from chassis.serve.cli_bench import _apply_preset, model_presets, preset_dir

#: tiny and quick on 2 cores: a few requests of a few tokens, a small fixed KV cache
COMMON = ["--load-format", "dummy", "--skip-tokenizer-init", "--num-kv-blocks", "64"]


def run_bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chassis.serve.cli", "--log-level", "WARNING", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen3_config(tmp_path_factory.mktemp("bench-qwen3"))


@pytest.mark.parametrize("backend", ["chassis", "hf"])
def test_throughput(model_dir, tmp_path, backend):
    out = tmp_path / "throughput.json"
    extra = ["--hf-num-prompts", "2"] if backend == "hf" else []
    proc = run_bench(
        "throughput",
        str(model_dir),
        *COMMON,
        "--num-prompts",
        "4",
        "--input-len",
        "4:8",
        "--output-len",
        "4:8",
        "--backend",
        backend,
        *extra,
        "--output-json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workload"]["skip_tokenizer_init"] is True
    assert report["workload"]["seed"] == 0
    full = report["results"][0]
    assert full["backend"] == "chassis" and full["num_requests"] == 4
    assert 4 * 4 <= full["output_tokens"] <= 4 * 8 and full["output_tokens_per_s"] > 0
    if backend == "chassis":
        assert len(report["results"]) == 1 and "ratio" not in report
        return
    # chassis again on the shapes of the 2 requests HF runs, then HF; ratio of those two
    same, hf = report["results"][1:]
    assert (same["backend"], hf["backend"]) == ("chassis", "hf")
    assert same["num_requests"] == hf["num_requests"] == 2
    assert same["output_tokens"] == hf["output_tokens"]
    assert same["prompt_tokens"] == hf["prompt_tokens"]
    assert report["ratio"] == pytest.approx(same["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert "same 2 request shapes" in report["ratio_basis"]


@pytest.mark.parametrize("backend", ["chassis", "hf"])
def test_latency(model_dir, tmp_path, backend):
    out = tmp_path / "latency.json"
    proc = run_bench(
        "latency",
        str(model_dir),
        *COMMON,
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-iters",
        "2",
        "--num-iters-warmup",
        "0",
        "--backend",
        backend,
        "--output-json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    backends = [r["backend"] for r in report["results"]]
    assert backends == (["chassis", "hf"] if backend == "hf" else ["chassis"])
    for result in report["results"]:
        assert len(result["iteration_latencies_s"]) == 2
        assert result["output_tokens_per_s"] == pytest.approx(4 / result["latency_s"])
    if backend == "hf":
        assert report["ratio"] > 0


@pytest.mark.parametrize("kind", ["throughput", "latency"])
def test_hf_comparison_with_ray_ranks_is_refused_before_anything_runs(model_dir, kind):
    # HF runs on the engine's device in this process; Ray's ranks are all actors
    proc = run_bench(
        kind, str(model_dir), *COMMON, "--backend", "hf", "--distributed-executor-backend", "ray"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--backend hf" in proc.stderr and "--distributed-executor-backend ray" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_settings_end_with_a_message_and_status_2():
    proc = run_bench("latency", "--model-preset", "nope")
    assert proc.returncode == 2
    assert "unknown --model-preset 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_qwen3_preset_is_shipped_with_the_benchmark_shapes():
    from transformers import AutoConfig

    assert "qwen3-0.6b" in model_presets()
    config = AutoConfig.from_pretrained(preset_dir("qwen3-0.6b"))
    assert config.architectures == ["Qwen3ForCausalLM"]
    shapes = (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.max_position_embeddings,
    )
    assert shapes == (1024, 28, 16, 8, 128, 3072, 151936, 40960)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-6


def test_preset_stands_for_model_and_implies_dummy_weights_without_tokenizer():
    args = argparse.Namespace(
        model=None,
        model_flag=None,
        model_preset="qwen3-0.6b",
        load_format=None,
        skip_tokenizer_init=None,
    )
    _apply_preset(args)
    assert args.model == str(preset_dir("qwen3-0.6b"))
    assert args.load_format == "dummy" and args.skip_tokenizer_init is True
    for bad, match in (
        ({"model": "x"}, "not both"),
        ({"load_format": "safetensors"}, "needs --load-format dummy"),
        ({"model_preset": "nope"}, "known: qwen3-0.6b"),
    ):
        values = {**vars(args), "model": None, "load_format": None, **bad}
        with pytest.raises(ValueError, match=match):
            _apply_preset(argparse.Namespace(**values))


#: ``chassis bench step`` on the tiny Llama (after its path): small, quick steps
STEP_ARGS = [
    "--dtype", "float32",
    "--max-model-len", "256",
    "--num-kv-blocks", "64",
    "--context-len", "8",
    "--num-steps", "2",
    "--repeats", "1",
]  # fmt: skip


def test_step_bench_times_decode_and_prefill_steps(tiny_llama_dir):
    proc = run_bench(
        "step", str(tiny_llama_dir), *STEP_ARGS, "--batch-size", "2", "--prefill-tokens", "16"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"decode step, batch 2, context ~8: [0-9.]+ ms", lines[-2])
    assert re.fullmatch(r"prefill step, 16 tokens in one request: [0-9]+ ms", lines[-1])


def test_step_bench_profile_shows_host_phases_and_top_ops(tiny_llama_dir, tmp_path):
    proc = run_bench(
        "step",
        str(tiny_llama_dir),
        *STEP_ARGS,
        "--batch-size", "1", "3",
        "--async-scheduling",
        "--profile",
        "--profile-dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for batch in (1, 3):
        assert re.search(rf"decode step, batch {batch}, context ~8: [0-9.]+ ms", out)
        assert json.loads((tmp_path / f"trace_batch{batch}.json").read_text())["traceEvents"]
    host = re.findall(r"host: [0-9.]+ ms per step \((.*)\)", out)
    assert len(host) == 2
    for phases in host:
        names = [part.split()[0] for part in phases.split(", ")]
        assert names == ["schedule", "execute_model_async", "update_from_output", "other"]
    # The CPU platform records no device activity; the top ops are the host's.
    assert out.count("no device activity recorded") == 2
    assert re.search(r"top \d+ by CPU self time per step:\n +[0-9.]+ ms +[0-9.]+x  \S+", out)


def test_kernel_bench_times_every_linear_and_attention_variant():
    proc = run_bench(
        "kernels",
        "--hidden", "64", "--intermediate", "128",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--layers", "2", "--rows", "1,7", "--batch", "1,3", "--context", "20",
        "--repeats", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # chassis_cpu::linear exists only on CPUs with AVX512-BF16; elsewhere the bench says so
    if cpu_kernels.load().bf16_linear_available():
        names = ("oneDNN packed", "F.linear", "chassis_cpu::linear")
    else:
        names = ("oneDNN packed", "F.linear")
        assert "chassis_cpu::linear: not built for this CPU (it needs AVX512-BF16)" in out
    for rows in (1, 7):
        for name in names:
            assert re.search(rf"rows +{rows}  {re.escape(name)} +[0-9.]+ ms +[0-9]+ GFLOP/s", out)
    for batch in (1, 3):
        for name in ("decode_attention", "SDPA fallback"):
            assert re.search(rf"batch +{batch}  {name} +[0-9.]+ us per layer", out)
