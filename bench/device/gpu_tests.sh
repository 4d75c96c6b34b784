# Every gpu-marked test, kernels first (one log per group under $OUT).
source bench/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
timeout 300 python3 -m pytest -m gpu -q -rA tests/test_kernels_fused_moe.py tests/test_kernels_mhc.py \
    tests/test_kernels_kpool_indexer.py tests/test_kernels_sparse_mla.py 2>&1 | tail -60 | tee "$OUT/gpu_kernels.log"
timeout 280 python3 -m pytest -m gpu -q -rA -s tests/test_gpu_engine.py 2>&1 | tail -60 | tee "$OUT/gpu_engine.log"
