#!/usr/bin/env bash
# genai-perf against a real tritonserver serving the tiny checkpoint on this (CPU) machine.
# What it measures: TTFT, inter-token latency, request latency and token/request throughput of the
# whole serving pipeline (gRPC streaming -> tritonserver -> the glm5 python-based backend -> engine) at
# concurrency 1, 24 requests of 64 input / 32 output tokens. On the tiny random model on a CPU the numbers
# show that the pipeline works under load; they are not a speed claim.
#
# Usage: bench/cpu_genai_perf.sh [BENCH_VENV] [OUT_DIR]
#   BENCH_VENV  venv with genai-perf==0.0.16, tritonclient[grpc]==2.51.0 (its wheel carries perf_analyzer)
#               and nvidia-cuda-runtime-cu12 (docs/benchmarks.md); default .venv-bench
#   OUT_DIR     default bench/out/genai_perf: server.log, genai_perf_c1.txt, the genai-perf artifacts
#               (c1/, with the JSON export recorded as bench/results/cpu_genai_perf_c1.json) and metrics.txt
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
BENCH_VENV=${1:-.venv-bench}
OUT=${2:-bench/out/genai_perf}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$(echo "$BENCH_VENV"/lib/python3*/site-packages/nvidia/cuda_runtime/lib):${LD_LIBRARY_PATH:-}"
CKPT=$(.venv/bin/python -c "from glm5.tiny_checkpoint import ensure_default_checkpoint; print(ensure_default_checkpoint())")
PORTS=$(.venv/bin/python -c "from glm5.serving.launcher import find_free_port as f; print(f(), f(), f())")
read -r HTTP GRPC METRICS <<<"$PORTS"
# perf_analyzer reads the model config: leave model-config open on this loopback-only benchmark server.
.venv/bin/glm5 --log-level WARNING serve --model "$CKPT" --text-only --http-port "$HTTP" --grpc-port "$GRPC" \
  --metrics-port "$METRICS" --max-num-seqs 16 --restricted-apis model-repository,shared-memory,logging,statistics,trace \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "127.0.0.1:$HTTP/v2/models/glm5/ready" >/dev/null && break; sleep 1; done
for c in 1; do   # at concurrency 4 perf_analyzer did not declare its measurement stable within 10 min
  PATH="$BENCH_VENV/bin:$PATH" genai-perf profile -m glm5 --backend vllm --endpoint-type kserve --streaming \
    -u "127.0.0.1:$GRPC" --tokenizer "$CKPT" --synthetic-input-tokens-mean 64 --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean 32 --output-tokens-stddev 0 --output-tokens-mean-deterministic --concurrency "$c" \
    --num-prompts 32 --request-count 24 --warmup-request-count 2 --random-seed 0 \
    --artifact-dir "$OUT/c$c" 2>&1 | tee "$OUT/genai_perf_c$c.txt"
done
curl -s "127.0.0.1:$METRICS/metrics" | grep '^glm5:' > "$OUT/metrics.txt" || true
