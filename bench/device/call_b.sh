# bf16 agreement on the trained tiny checkpoint + per-layer diagnostic, the mHC rerun, then the benchmark.
source bench/device/setup.sh
source bench/device/flashinfer_setup.sh
export GLM5_TRAINED_CKPT=$PWD/.gpuref/trained GLM5_DIAG_OUT=$OUT
timeout 150 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_bf16.py > "$OUT/gpu_bf16.log" 2>&1; tail -8 "$OUT/gpu_bf16.log"
timeout 60 python3 -m pytest -m gpu -q -rA -s tests/test_kernels_mhc.py > "$OUT/gpu_mhc.log" 2>&1; tail -4 "$OUT/gpu_mhc.log"
timeout 60 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_engine.py -k bf16_graph > "$OUT/gpu_engine3.log" 2>&1; tail -3 "$OUT/gpu_engine3.log"
timeout 420 python3 bench/bench.py --out "$OUT/bench" --flashinfer > "$OUT/bench_stdout.log" 2>&1; tail -40 "$OUT/bench_stdout.log" | cut -c1-300
