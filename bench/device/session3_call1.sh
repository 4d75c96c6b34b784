# Session 3, H200 call 1 (written at the end of session 2): the GPU per-layer bf16 diagnostic, the two
# FlashInfer engine tests, and a bench run with transformers in the same run plus a profile of one 8K
# prefill. BENCH_ARGS / BENCH_TIMEOUT adjust the bench (call 1 used --quick --hf-batches 1 8 64).
# Carry .whl, .fi and .gpuref (.gpuref/trained from `python bench/train_tiny.py .gpuref/trained`).
source bench/device/setup.sh
source bench/device/flashinfer_setup.sh
export GLM5_TRAINED_CKPT=$PWD/.gpuref/trained GLM5_DIAG_OUT=$OUT
timeout 120 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_bf16.py -k layer > "$OUT/gpu_bf16_diag.log" 2>&1; tail -4 "$OUT/gpu_bf16_diag.log"
timeout 80 python3 -m pytest -m gpu -q -rA -s tests/test_flashinfer.py -k engine > "$OUT/gpu_flashinfer_engine.log" 2>&1; tail -4 "$OUT/gpu_flashinfer_engine.log"
timeout ${BENCH_TIMEOUT:-330} python3 bench/bench.py --out "$OUT/bench" --profile-prefill ${BENCH_ARGS:-} > "$OUT/bench_stdout.log" 2>&1; tail -20 "$OUT/bench_stdout.log" | cut -c1-250
