#!/usr/bin/env bash
# The API server's CPU time per streamed token (not a test). Start a server first, e.g.
#   python tests/perf/tiny_config.py /tmp/tiny --layers 2
#   chassis serve /tmp/tiny --load-format dummy --skip-tokenizer-init --port 8199 --max-num-seqs 64 &
# then: bash tests/perf/serve_cpu_per_token.sh 8199
# It runs `chassis bench serve` (256 requests, 64 streams, 128 tokens each) and reads the
# server process's CPU time from /proc before and after (the engine core is another process).
set -euo pipefail
PORT="${1:-8199}"
PID=$(pgrep -f "chassis serve .*--port $PORT" | head -1)
cpu() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
before=$(cpu)
chassis bench serve --base-url "http://localhost:$PORT" --num-prompts 256 --input-len 64 \
    --output-len 128 --max-concurrency 64 --vocab-size 500 2>&1 | grep -E "output|TPOT"
after=$(cpu)
ticks=$(getconf CLK_TCK)
tokens=$((256 * 128))
echo "server CPU $(((after - before) * 1000 / ticks)) ms for $tokens tokens:" \
    "$(((after - before) * 1000000 / ticks / tokens)) us per token"
