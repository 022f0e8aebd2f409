#!/usr/bin/env bash
# A/B of the API server's CPU per streamed token (not a test): the code at REV (a git worktree,
# put first on PYTHONPATH) against the working tree, both served at once on a tiny model,
# serve_cpu_per_token.sh run ROUNDS times on each in alternation. From the repository root:
#   python tests/perf/tiny_config.py /tmp/tiny --layers 2
#   bash tests/perf/serve_cpu_ab.sh REV [ROUNDS]
set -euo pipefail
REV="$1"
ROUNDS="${2:-4}"
MODEL="${MODEL:-/tmp/tiny}"
BASE=$(mktemp -d)
git worktree add -f "$BASE/chassis" "$REV" -q
start() { # port pythonpath
  (PYTHONPATH="$2" chassis serve "$MODEL" --load-format dummy --skip-tokenizer-init \
     --port "$1" --max-num-seqs 64 > "$BASE/serve$1.log" 2>&1 &)
}
cleanup() {
  pkill -f "chassis serve $MODEL .*--port 820[12]" || true
  for _ in $(seq 60); do pgrep -f "chassis serve $MODEL .*--port 820[12]" > /dev/null || break; sleep 0.5; done
  git worktree remove --force "$BASE/chassis"
  rm -rf "$BASE"
}
trap cleanup EXIT
start 8201 "$BASE"
start 8202 ""
for port in 8201 8202; do
  for _ in $(seq 120); do curl -s "localhost:$port/health" > /dev/null && break; sleep 1; done
done
for _ in $(seq "$ROUNDS"); do
  for port in 8201 8202; do
    label=$([ "$port" = 8201 ] && echo "$REV" || echo "working tree")
    echo "$label: $(bash tests/perf/serve_cpu_per_token.sh "$port" | tr '\n' ' ')"
  done
done
