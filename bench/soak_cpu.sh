#!/usr/bin/env bash
# The recorded CPU soak: `glm5 serve --text-only` on the tiny checkpoint, then `glm5-client soak` with
# 64 streams, cancellations and the hostile mix for MINUTES minutes; the summary goes to OUT_DIR.
# Usage: bench/soak_cpu.sh [MINUTES] [OUT_DIR] [HOSTILE_KINDS]
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-10}
OUT=${2:-bench/out/soak}
KINDS=${3:-bad_params,bad_media,token_ids_out_of_range,out_of_range_params,oversized_http,huge_prompt,video_720p}
mkdir -p "$OUT"
PORTS=$(.venv/bin/python -c "from glm5.serving.launcher import find_free_port as f; print(f(), f(), f())")
read -r HTTP GRPC METRICS <<<"$PORTS"
.venv/bin/glm5 serve --text-only --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" \
  --max-num-seqs 64 > "$OUT/server.log" 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -q '^{' "$OUT/server.log" && break; kill -0 $SERVE || exit 1; sleep 1; done
PID=$(grep '^{' "$OUT/server.log" | head -1 | .venv/bin/python -c "import json,sys; print(json.load(sys.stdin)['pid'])")
.venv/bin/glm5-client soak --url "127.0.0.1:$GRPC" --http-url "127.0.0.1:$HTTP" \
  --metrics-url "http://127.0.0.1:$METRICS/metrics" --pid "$PID" --streams 64 --minutes "$MINUTES" \
  --max-tokens 32 --cancel-fraction 0.1 --hostile --hostile-kinds "$KINDS" --hostile-interval 10 \
  --warmup-seconds 60 --json | tee "$OUT/soak.json"
