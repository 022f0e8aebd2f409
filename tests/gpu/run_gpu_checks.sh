#!/usr/bin/env bash
# The GPU checks and issue 5's benchmarks, in one go, on the lent GPU machine (repo root as the
# working directory; see docs/gpu.md for the one-line device command):
#   bash tests/gpu/run_gpu_checks.sh
# Steps, in order, each under its own timeout and all under one overall budget (BUDGET_S,
# default 540 s: a step that would start with under 30 s left is skipped):
#   pytest      pytest -m gpu tests/gpu (not gpu_compile, not gpu_moe) -> pytest.txt, junit.xml
#               (attention: test_gpu_triton_attention.py, and the fp8 KV cache's kernels and
#               engine in test_gpu_fp8_kv_cache.py; the int4 W4A16 GEMM against its torch
#               reference at 8B-Llama shapes in test_gpu_triton_int4.py)
#   throughput  (a)+(c) nano-vllm workload on the Qwen3-0.6B preset, chassis and HF
#                                                            -> throughput.txt/.json
#   latency     (b)+(c) batch 1, 128-token prompt, 256 new tokens, chassis and HF; then
#               chassis with --no-async-scheduling           -> latency*.txt/.json
#   gemv        the opt-in Triton GEMV (CHASSIS_TRITON_GEMV=1): tests/gpu/bench_triton_gemv.py
#               --sweep (cuBLAS vs the GEMV per Qwen3-0.6B layer and 1-8 rows), then (b) chassis
#               only with CHASSIS_TRITON_GEMV=1, next to latency's -> bench_gemv.txt,
#               latency_gemv.txt/.json
#   fused_attn  (b) chassis only with CHASSIS_FUSED_DECODE_ATTENTION=1 (decode steps' K/V
#               write and split-KV merge inside the attention kernel), next to latency's;
#               then (b) and (a) with both opt-ins (the GEMV too): every launch saving at once
#                       -> latency_fused_attn.txt/.json, latency_fused.txt/.json,
#                          throughput_fused.txt/.json
#   profile     chassis bench step --profile at batch 1 and PROFILE_BATCH, async and sync
#               (PROFILE_MODES; mode "fused": async with both opt-ins):
#               host time per engine-core call, device busy/idle, top kernels
#                                                            -> profile_*.txt, profile_*/
#   sync        (a) chassis only, --no-async-scheduling      -> throughput_sync.txt/.json
#   serve       (d) chassis serve + chassis bench serve, 64 concurrent streams
#                                                            -> server.txt, serve.txt/.json
#   eager       (b) chassis only, with --enforce-eager       -> latency_eager.txt/.json
#   kernels     (b) chassis only, the layers' torch code instead of the Triton layer kernels
#               (CHASSIS_LAYER_KERNELS=0)                    -> latency_torch_ops.txt/.json
#   compile     pytest -m gpu_compile, then (b) chassis only with --torch-compile
#                                                -> pytest_compile.txt, latency_compile.txt/.json
#   moe         pytest -m gpu_moe: the Triton fused MoE (plain, and gpt-oss's biases and clamped
#               SwiGLU at gpt-oss-20b's shape) and MoE engines (Qwen3-MoE, gpt-oss) with graphs
#                                                            -> pytest_moe.txt, junit_moe.xml
#   gpt_oss     (only when named in STEPS) the gpt-oss part of moe alone
#                                                    -> pytest_gpt_oss.txt, junit_gpt_oss.xml
#   attn        tests/gpu/bench_triton_attention.py (decodes with bf16 and fp8 KV caches;
#               28-layer decode graphs, separate kernels vs fused)  -> bench.txt
#   tune        (only when named in STEPS) tests/gpu/tune_triton_attention.py -> tune.txt
# STEPS="throughput serve" runs a subset; PYTEST_FILES (default tests/gpu) and PYTEST_LIMIT
# (default 220 s) narrow the pytest step; PROFILE_MODES (default "async sync") the profile
# step. HF_NUM_PROMPTS (default 8): HF runs only the first N of the 256 throughput requests,
# and the throughput ratio compares chassis and HF on those same N request shapes (see
# docs/gpu.md). Writes env.txt and summary.txt (one line per step:
# name, exit status, seconds). Everything is packed into $OUT/results.tgz (default OUT:
# /tmp/chassis-gpu), next to a copy of summary.txt.
# Exit status: 0 when every step that ran passed, else 1.
# A dry run of the benchmark steps on a CPU, with a tiny config directory:
#   STEPS="throughput latency gemv fused_attn serve profile sync eager kernels" MODEL=/tmp/tiny \
#   NUM_PROMPTS=4 \
#   HF_NUM_PROMPTS=2 LENS=4:8 LAT_INPUT=8 LAT_OUTPUT=4 VOCAB=512 PROFILE_CONTEXT=64 \
#   PROFILE_BATCH=8 ENGINE_ARGS="--num-kv-blocks 64" bash tests/gpu/run_gpu_checks.sh
# (the tiny config holds 512 positions: the profile's default 600-token context does not fit)
set -u
# The device tool brings back at most 8 files from $OUT, so every step writes into a work
# folder, and after each step the folder is packed into $OUT/results.tgz (with summary.txt
# beside it): what ran before a time-out still comes back.
FINAL_OUT="${OUT:-/tmp/chassis-gpu}"
OUT="${RESULTS_DIR:-/tmp/chassis-gpu-results}"
rm -rf "$OUT"
mkdir -p "$OUT" "$FINAL_OUT"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-pytest throughput latency gemv fused_attn profile sync serve eager kernels compile moe attn}"
BUDGET_S="${BUDGET_S:-540}"
HF_NUM_PROMPTS="${HF_NUM_PROMPTS:-8}"
PORT="${PORT:-8123}"
# The benchmark model: Qwen3-0.6B shapes, random weights, no tokenizer (the shipped config,
# what `--model-preset qwen3-0.6b` names).
MODEL="${MODEL:-serve/bench_models/qwen3-0.6b}"
NUM_PROMPTS="${NUM_PROMPTS:-256}"
LENS="${LENS:-100:1024}"
LAT_INPUT="${LAT_INPUT:-128}"
LAT_OUTPUT="${LAT_OUTPUT:-256}"
CONCURRENCY="${CONCURRENCY:-64}"
# the profile step's decode batch and prompt length (the throughput workload's scale)
PROFILE_BATCH="${PROFILE_BATCH:-256}"
PROFILE_CONTEXT="${PROFILE_CONTEXT:-600}"
# token ids of the serving benchmark's random prompts are drawn from [0, VOCAB) (nano-vllm's)
VOCAB="${VOCAB:-10000}"
# nano-vllm's engine settings (max_model_len 4096, 16384-token steps); half the GPU for the
# KV cache (256 x 2048 tokens of Qwen3-0.6B need 56 GiB), so HF's model fits beside whatever
# the allocator still holds. Decode steps replay CUDA graphs (the default); if the first
# benchmark fails with graphs, the rest run with --enforce-eager (summary.txt says so).
ENGINE_ARGS="${ENGINE_ARGS:---max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.5}"
read -r -a ENGINE <<<"$ENGINE_ARGS"
MODEL_ARGS=("$MODEL" --load-format dummy --skip-tokenizer-init)
CHASSIS=("$PY" -m chassis.serve.cli)
# Every pytest call's own options: no cache folder, and the run this script asks for whatever
# pyproject's addopts say (`-o addopts=`: README's `-n 2` would need pytest-xdist, and workers
# would split one GPU between processes); `-p no:xdist` keeps xdist, where installed, unloaded.
PYTEST=("$PY" -m pytest -p no:cacheprovider -o addopts= -p no:xdist)
START=$SECONDS
STATUS=0

# `chassis` is the repository root; install it editable. Without the install there is no
# package metadata, so no entry points, so no built-in platform or model: stop here.
if ! "$PY" -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.txt" 2>&1; then
    echo "install rc=1: pip install -e . failed (install.txt)" | tee "$OUT/summary.txt"
    tail -n 30 "$OUT/install.txt"
    cp "$OUT/summary.txt" "$FINAL_OUT/summary.txt"
    tar czf "$FINAL_OUT/results.tgz" -C "$OUT" .
    exit 1
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'hip', torch.version.hip)"
    "$PY" -c "import fastapi, uvicorn, zmq, msgspec; print('server deps ok')"
    # float32 matmul precision as the image sets it (TF32 moves the float32 engine tests' logits)
    "$PY" -c "import torch; print('tf32: matmul', torch.backends.cuda.matmul.allow_tf32, 'cudnn', torch.backends.cudnn.allow_tf32, 'precision', torch.get_float32_matmul_precision())"
    env | grep -i -E "tf32|cublas|nvidia_tf32" || echo "no TF32 variables in the environment"
    # the serving step's HTTP parser and event loop (h11 and asyncio's loop without them)
    "$PY" -c "import httptools, uvloop; print('httptools', httptools.__version__, 'uvloop', uvloop.__version__)"
} >"$OUT/env.txt" 2>&1
: >"$OUT/summary.txt"

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

pack() {
    cp "$OUT/summary.txt" "$FINAL_OUT/summary.txt"
    tar czf "$FINAL_OUT/results.tgz.part" -C "$OUT" . && mv "$FINAL_OUT/results.tgz.part" "$FINAL_OUT/results.tgz"
}

# step NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, what the budget has left), output to
# $OUT/NAME.txt, and record the result in summary.txt.
step() {
    local name=$1 limit=$2 left rc t0
    shift 2
    left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 30)); then
        echo "$name skipped (budget spent)" | tee -a "$OUT/summary.txt"
        STATUS=1
        return 1
    fi
    ((limit > left)) && limit=$left
    t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$OUT/summary.txt"
    tail -n 15 "$OUT/$name.txt"
    pack
    ((rc == 0)) || STATUS=1
    return $rc
}

if wanted pytest; then
    # PYTEST_FILES narrows the step to some files (a first, short call: the engine tests),
    # PYTEST_LIMIT its time limit
    read -r -a pytest_files <<<"${PYTEST_FILES:-tests/gpu}"
    step pytest "${PYTEST_LIMIT:-220}" "${PYTEST[@]}" -m "gpu and not gpu_compile and not gpu_moe" \
        "${pytest_files[@]}" -q -rfEs --junitxml="$OUT/junit.xml"
fi

if wanted throughput; then
    # (a) 256 requests, input and output lengths uniform in 100..1024 (seed 0), ignore_eos;
    # (c) HF generate on the first $HF_NUM_PROMPTS of them, one left-padded batch.
    throughput() {
        step "$1" 200 "${CHASSIS[@]}" bench throughput "${MODEL_ARGS[@]}" "${ENGINE[@]}" \
            --num-prompts "$NUM_PROMPTS" --input-len "$LENS" --output-len "$LENS" \
            --backend hf --hf-num-prompts "$HF_NUM_PROMPTS" --output-json "$OUT/$1.json"
    }
    # a time-out (rc 124) is HF's generate running long, not a failure of the graphs
    throughput throughput
    rc=$?
    if ((rc != 0 && rc != 124)) && [[ " ${ENGINE[*]} " != *" --enforce-eager "* ]]; then
        echo "throughput failed with CUDA graphs: retrying, and running the rest, eager" | tee -a "$OUT/summary.txt"
        ENGINE+=(--enforce-eager)
        throughput throughput_eager
    fi
fi

if wanted latency; then
    # (b) batch-1 decode: 128-token prompt, 256 new tokens; (c) HF on the same.
    step latency 110 "${CHASSIS[@]}" bench latency "${MODEL_ARGS[@]}" "${ENGINE[@]}" \
        --input-len "$LAT_INPUT" --output-len "$LAT_OUTPUT" --batch-size 1 \
        --num-iters 2 --num-iters-warmup 1 --backend hf --output-json "$OUT/latency.json"
    # the same synchronous (chassis only): what async scheduling, the default on CUDA and ROCm,
    # gains by overlapping host and device
    step latency_sync 60 "${CHASSIS[@]}" bench latency "${MODEL_ARGS[@]}" "${ENGINE[@]}" \
        --no-async-scheduling --input-len "$LAT_INPUT" --output-len "$LAT_OUTPUT" --batch-size 1 \
        --num-iters 2 --num-iters-warmup 1 --output-json "$OUT/latency_sync.json"
fi

if wanted gemv; then
    # the opt-in small-batch Triton GEMV (core/layers/triton_gemv.py): kernel timings against
    # cuBLAS (the script prints and exits 0 without a GPU), then (b) with it on (chassis only,
    # async scheduling as in `latency`): compare latency_gemv.json with latency.json
    step bench_gemv 60 "$PY" tests/gpu/bench_triton_gemv.py --sweep
    step latency_gemv 60 env CHASSIS_TRITON_GEMV=1 "${CHASSIS[@]}" bench latency "${MODEL_ARGS[@]}" \
        "${ENGINE[@]}" --input-len "$LAT_INPUT" --output-len "$LAT_OUTPUT" --batch-size 1 \
        --num-iters 2 --num-iters-warmup 1 --output-json "$OUT/latency_gemv.json"
fi

if wanted fused_attn; then
    # the opt-in fused decode attention (builtin_plugins/attention/triton_paged.py): (b) with
    # each decode step's K/V write and split-KV merge inside the attention kernel, two launches
    # per layer fewer (chassis only, async scheduling as in `latency`): compare
    # latency_fused_attn.json with latency.json
    step latency_fused_attn 60 env CHASSIS_FUSED_DECODE_ATTENTION=1 "${CHASSIS[@]}" bench latency \
        "${MODEL_ARGS[@]}" "${ENGINE[@]}" --input-len "$LAT_INPUT" --output-len "$LAT_OUTPUT" \
        --batch-size 1 --num-iters 2 --num-iters-warmup 1 --output-json "$OUT/latency_fused_attn.json"
    # both opt-ins together, the candidate default: batch 1, and workload (a) to see that the
    # batch-256 steps lose nothing (compare with throughput.json)
    step latency_fused 60 env CHASSIS_TRITON_GEMV=1 CHASSIS_FUSED_DECODE_ATTENTION=1 \
        "${CHASSIS[@]}" bench latency "${MODEL_ARGS[@]}" "${ENGINE[@]}" --input-len "$LAT_INPUT" \
        --output-len "$LAT_OUTPUT" --batch-size 1 --num-iters 2 --num-iters-warmup 1 \
        --output-json "$OUT/latency_fused.json"
    step throughput_fused 120 env CHASSIS_TRITON_GEMV=1 CHASSIS_FUSED_DECODE_ATTENTION=1 \
        "${CHASSIS[@]}" bench throughput "${MODEL_ARGS[@]}" "${ENGINE[@]}" \
        --num-prompts "$NUM_PROMPTS" --input-len "$LENS" --output-len "$LENS" \
        --output-json "$OUT/throughput_fused.json"
fi

if wanted profile; then
    # Where a decode step's time goes (issue 5: "CPU vs GPU time per step, top kernels"), at
    # batch 1 and at the throughput workload's batch, async (the default) and synchronous; Chrome traces in
    # $OUT/profile*/.
    for mode in ${PROFILE_MODES:-async sync}; do
        extra=()
        opt_in=()
        [[ $mode == sync ]] && extra=(--no-async-scheduling)
        [[ $mode == fused ]] && opt_in=(CHASSIS_TRITON_GEMV=1 CHASSIS_FUSED_DECODE_ATTENTION=1)
        step "profile_$mode" 120 env "${opt_in[@]}" "${CHASSIS[@]}" bench step "${MODEL_ARGS[@]}" "${ENGINE[@]}" \
            "${extra[@]}" --batch-size 1 "$PROFILE_BATCH" --context-len "$PROFILE_CONTEXT" \
            --num-steps 10 --repeats 2 --profile --profile-dir "$OUT/profile_$mode"
    done
fi

if wanted sync; then
    # (a) again synchronous (chassis only), next to the run above with async scheduling (the
    # default on CUDA and ROCm)
    step throughput_sync 120 "${CHASSIS[@]}" bench throughput "${MODEL_ARGS[@]}" "${ENGINE[@]}" \
        --no-async-scheduling --num-prompts "$NUM_PROMPTS" --input-len "$LENS" --output-len "$LENS" \
        --output-json "$OUT/throughput_sync.json"
fi

if wanted serve; then
    # (d) the server on the same model, driven with token-id prompts at 64 concurrent streams.
    # In its own session, so the server and its engine-core child are stopped together.
    setsid "$PY" -m chassis.serve.cli serve "${MODEL_ARGS[@]}" "${ENGINE[@]}" --port "$PORT" \
        --disable-access-log >"$OUT/server.txt" 2>&1 &
    server=$!
    ready=0
    t0=$SECONDS
    while ((SECONDS - START < BUDGET_S - 40)); do
        kill -0 "$server" 2>/dev/null || break
        if "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
            ready=1
            break
        fi
        sleep 1
    done
    if ((ready)); then
        echo "server ready after $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
        step serve 150 "${CHASSIS[@]}" bench serve --base-url "http://127.0.0.1:$PORT" \
            --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" \
            --input-len "$LENS" --output-len "$LENS" --vocab-size "$VOCAB" \
            --output-json "$OUT/serve.json"
    else
        echo "serve: the server exited or was not ready within the budget (see server.txt)" | tee -a "$OUT/summary.txt"
        tail -n 30 "$OUT/server.txt"
        STATUS=1
    fi
    # SIGTERM to the server's process group (server and engine core), then SIGKILL.
    kill -TERM -- "-$server" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$server" 2>/dev/null
    wait "$server" 2>/dev/null
fi

if wanted eager && [[ " ${ENGINE[*]} " != *" --enforce-eager "* ]]; then
    # (b) without graphs (chassis only): what capture gains at batch 1
    step latency_eager 60 "${CHASSIS[@]}" bench latency "${MODEL_ARGS[@]}" "${ENGINE[@]}" \
        --enforce-eager --input-len "$LAT_INPUT" --output-len "$LAT_OUTPUT" --batch-size 1 \
        --num-iters 2 --num-iters-warmup 1 --output-json "$OUT/latency_eager.json"
fi

if wanted kernels; then
    # (b) with the layers' torch code (chassis only): what the fused Triton RMSNorm, SiLU,
    # RoPE and q/k-norm+RoPE kernels gain at batch 1
    step latency_torch_ops 60 env CHASSIS_LAYER_KERNELS=0 "${CHASSIS[@]}" bench latency \
        "${MODEL_ARGS[@]}" "${ENGINE[@]}" --input-len "$LAT_INPUT" --output-len "$LAT_OUTPUT" \
        --batch-size 1 --num-iters 2 --num-iters-warmup 1 --output-json "$OUT/latency_torch_ops.json"
fi

if wanted compile && [[ " ${ENGINE[*]} " != *" --enforce-eager "* ]]; then
    # the engine with graphs of the compiled forward against HF (tiny model), then (b)
    step pytest_compile 120 "${PYTEST[@]}" -m gpu_compile tests/gpu -q -rfEs \
        --junitxml="$OUT/junit_compile.xml"
    # (b) with --torch-compile (chassis only): start-up cost and batch-1 speed; the compile
    # seconds are in the log lines of latency_compile.txt
    step latency_compile 180 "${CHASSIS[@]}" bench latency "${MODEL_ARGS[@]}" \
        "${ENGINE[@]}" --torch-compile --input-len "$LAT_INPUT" --output-len "$LAT_OUTPUT" \
        --batch-size 1 --num-iters 2 --num-iters-warmup 1 --output-json "$OUT/latency_compile.json"
fi

if wanted moe; then
    # the mixture-of-experts path (session 8): kept out of the first step, whose budget the
    # fused-MoE kernels' compilations would eat into
    step pytest_moe 240 "${PYTEST[@]}" -m gpu_moe tests/gpu -q -rfEs \
        --junitxml="$OUT/junit_moe.xml"
fi

# Only when named (STEPS="gpt_oss"): gpt-oss's fused experts and a tiny gpt-oss engine with
# decode graphs (tests/gpu/test_gpu_triton_moe_gpt_oss.py, also part of the moe step)
if wanted gpt_oss && ! wanted moe; then
    step pytest_gpt_oss 150 "${PYTEST[@]}" tests/gpu/test_gpu_triton_moe_gpt_oss.py -q -rfEs \
        --junitxml="$OUT/junit_gpt_oss.xml"
fi

# Kernel timings last: they matter least for issue 5.
if wanted attn; then
    step bench 60 "$PY" tests/gpu/bench_triton_attention.py
fi

# Only when named (STEPS="tune"): a sweep of decode launch configs, for choosing defaults.
if wanted tune; then
    step tune 180 "$PY" tests/gpu/tune_triton_attention.py
fi

echo "total $((SECONDS - START))s, exit $STATUS" | tee -a "$OUT/summary.txt"
pack
exit $STATUS
