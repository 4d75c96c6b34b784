# Session 3, H200 call 3 (the last of the session's budget, one command under 600 s): the selection
# kernel's GPU tests after the compile fix, the final benchmark with transformers in the same run (a child
# process; no batch started after the deadline), then the engine-level oracle tests on the new selection
# path with the time left. Carry .whl and .gpuref.
T0=$(date +%s)
source bench/device/setup.sh
export GLM5_TRAINED_CKPT=$PWD/.gpuref/trained
timeout 50 python3 -m pytest -m gpu -q -rA -x tests/test_kernels_kpool_indexer.py > "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED|N=|fp8:" "$OUT/gpu_tests.log" | tail -8
timeout $((T0 + 445 - $(date +%s))) python3 bench/bench.py --out "$OUT/bench" --profile-prefill \
    --hf-batches 1 8 64 --hf-deadline $((T0 + 330)) > "$OUT/bench_stdout.log" 2>&1
pkill -f hf-worker; sleep 1
grep -E "tflops|kernel_time|prefill_s|error|skipped" "$OUT/bench_stdout.log" | cut -c1-220
python3 - "$OUT/bench/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for d in r.get("decode", []):
    print(d.get("batch"), d.get("ctx"), round(d.get("step_s", 0) * 1e3, 2), d.get("error", "")[:80])
PY
rm -f "$OUT/bench/bench.log" "$OUT/bench/results_hf_worker.json"
timeout $((T0 + 588 - $(date +%s))) python3 -m pytest -m gpu -q -rA -s tests/test_gpu_engine.py tests/test_gpu_bf16.py \
    -k "graphs or batched or agrees" >> "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED|prompts" "$OUT/gpu_tests.log" | tail -8
