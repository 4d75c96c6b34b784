# Reruns of the kernel tests that failed in the first call, the fused-MoE tuner, the new engine tests.
source bench/device/setup.sh
source bench/device/flashinfer_setup.sh
python3 -m pytest -m gpu -q -rA -s tests/test_kernels_mhc.py tests/test_kernels_kpool_indexer.py \
    > "$OUT/gpu_kernels2.log" 2>&1; tail -5 "$OUT/gpu_kernels2.log"
timeout 130 python3 bench/tune_fused_moe.py --budget-s 100 --out "$OUT/moe_configs" > "$OUT/tune.log" 2>&1; tail -25 "$OUT/tune.log"
timeout 240 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_engine.py -k "graph or batched or in_kernel" \
    > "$OUT/gpu_engine2.log" 2>&1; tail -12 "$OUT/gpu_engine2.log"
