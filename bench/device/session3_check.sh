# Session 3, H200 call 2: GPU tests of what changed (radix-select token selection, sparse MLA valid
# counts, tf32x3 mHC projection, fla prefill with in-kernel gate/l2norm/β and fla's causal conv), the
# engine-level oracle tests, micro-benchmarks of the latency-bound decode kernels, and a quick bench
# with an 8K prefill profile. Carry .whl, .fi and .gpuref.
source bench/device/setup.sh
source bench/device/flashinfer_setup.sh > /dev/null 2>&1
export GLM5_TRAINED_CKPT=$PWD/.gpuref/trained
timeout 150 python3 -m pytest -m gpu -q -rA tests/test_kernels_kpool_indexer.py tests/test_kernels_sparse_mla.py \
    tests/test_kernels_mhc.py > "$OUT/gpu_kernels.log" 2>&1; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_kernels.log" | tail -8
timeout 200 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_engine.py tests/test_gpu_bf16.py -k "not layer" \
    > "$OUT/gpu_engine.log" 2>&1; grep -E "passed|failed|FAILED|rel |prompts|Error" "$OUT/gpu_engine.log" | tail -14
timeout 100 python3 bench/kernel_bench.py --small "$OUT/kernel_small.json" > "$OUT/kernel_small.log" 2>&1; tail -3 "$OUT/kernel_small.log" | cut -c1-300
timeout 150 python3 bench/bench.py --out "$OUT/bench" --quick --skip-hf --profile-prefill > "$OUT/bench_stdout.log" 2>&1
grep -E "tflops|step_s|kernel_time" "$OUT/bench_stdout.log" | cut -c1-200
