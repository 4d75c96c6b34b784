#!/usr/bin/env bash
# The GPU check: the `gpu`-marked tests, the engine benchmark, the kernel micro-benchmarks and the
# speculative-decoding benchmark on one CUDA machine (built for the H200), from a checkout, offline.
#
# Usage: scripts/gpu_check.sh [tests|bench|kernels|fp8|spec|all] [OUTDIR]     (default: all, bench/out/gpu_check)
#   tests    pytest -m gpu over the tests/ modules that have gpu-marked tests -> OUTDIR/gpu_tests.log and
#            OUTDIR/gpu_tests.xml (JUnit);
#            the per-layer bf16 diagnostic -> OUTDIR/bf16_layer_errors.json
#   bench    bench/bench.py -> OUTDIR/bench/ (results.json, profile_*.txt, bench.log, stdout.log), rendered
#            to OUTDIR/bench/RESULTS.md by bench/render_results.py (docs/benchmarks.md: how to record it)
#   kernels  bench/kernel_bench.py, bench/kernel_check.py (-> OUTDIR/kernels/check/) and, when flashinfer
#            imports, bench/flashinfer_bench.py -> OUTDIR/kernels/
#   fp8      bench/fp8_check.py --write-table (fp8 kernels vs references, GEMV/_scaled_mm/bf16 timings, the
#            per-shape choice table), bench/tune_fused_moe.py --fp8 and bench/gemv16_table.py --write-table (the
#            bf16 streaming GEMV against cuBLAS) -> OUTDIR/fp8/ and kernels/glm5_kernels/configs/
#   spec     bench/spec_bench.py --profile -> OUTDIR/spec/ (spec_results.json, cost_table.json for
#            speculative_cost_table, profile_spec_*.txt, SPEC.md: the section rendered; docs/speculative.md)
#   all      the five in that order; OUTDIR/device.txt always records the GPU, driver and versions
# Exit status: non-zero when a stage fails (the later stages still run).
#
# Setup it does first (each step only when needed):
#   * wheels in $WHEEL_DIR (default .whl; e.g. fla_core-0.6.0 and transformers-5.23.0, fetched elsewhere
#     with `pip download --no-deps`) whose name and version are not installed go into $SITE
#     (default /tmp/glm5-site) with `pip install --no-index --no-deps --target`, and $SITE joins PYTHONPATH;
#   * $FI_DIR (default .fi, written by scripts/flashinfer_bundle.sh) is unpacked into $SITE when flashinfer
#     does not import, and its prebuilt JIT modules (.fi/prebuilt/*.so) are installed;
#   * the project's source folders (backend, kernels, client) join PYTHONPATH when glm5 does not import.
# Environment: PYTHON (default python3), GLM5_TRAINED_CKPT (a checkpoint from
#   `python -m glm5.trained_tiny_checkpoint DIR`; default .gpuref/trained when present, else the bf16 test
#   trains one on the GPU), PYTEST_ARGS (extra pytest arguments, e.g. -k or -x), BENCH_ARGS (default
#   --profile-prefill; e.g. --quick --skip-hf), TESTS_TIMEOUT / BENCH_TIMEOUT / KERNELS_TIMEOUT /
#   SPEC_TIMEOUT / CHECK_TIMEOUT (kernel_check.py) in seconds (defaults 1200 / 900 / 300 / 600 / 480),
#   FP8_TIMEOUT (default 600 per tool; fp8_check --budget-s 240, the MoE tuner's 150 s, gemv16_table's 120 s).
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi

STAGE=${1:-all}
case "$STAGE" in tests|bench|kernels|fp8|spec|all) ;; *) echo "unknown stage '$STAGE': use tests, bench, kernels, fp8, spec or all" >&2; exit 2;; esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=$(mkdir -p "${2:-bench/out/gpu_check}" && cd "${2:-bench/out/gpu_check}" && pwd)
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/glm5-site}
WHEEL_DIR=${WHEEL_DIR:-.whl}
FI_DIR=${FI_DIR:-.fi}
mkdir -p "$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# Wheels whose distribution is missing or at another version (wheel file names: name-version-...).
if ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
  NEED=$("$PY" - "$WHEEL_DIR"/*.whl <<'PY'
import sys
from importlib import metadata
from pathlib import Path

for whl in sys.argv[1:]:
    name, version = Path(whl).name.split("-")[:2]
    try:
        if metadata.version(name.replace("_", "-")) == version:
            continue
    except metadata.PackageNotFoundError:
        pass
    print(whl)
PY
)
  if [ -n "$NEED" ]; then
    echo "installing into $SITE: $NEED" >&2
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $NEED
  fi
fi

if ! "$PY" -c "import flashinfer" >/dev/null 2>&1 && ls "$FI_DIR"/flashinfer-*-pruned.tar.xz >/dev/null 2>&1; then
  echo "unpacking the FlashInfer bundle from $FI_DIR into $SITE" >&2
  tar -xJf "$FI_DIR"/flashinfer-*-pruned.tar.xz -C "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$FI_DIR"/apache_tvm_ffi-*.whl
fi
if "$PY" -c "import flashinfer" >/dev/null 2>&1; then
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws} FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
  export MAX_JOBS=${MAX_JOBS:-16}
fi

if ! "$PY" -c "import glm5, glm5_kernels, glm5_client" >/dev/null 2>&1; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/backend:$ROOT/kernels:$ROOT/client"
fi
if ls "$FI_DIR"/prebuilt/*.so >/dev/null 2>&1 && "$PY" -c "import flashinfer" >/dev/null 2>&1; then
  "$PY" -m glm5_kernels.flashinfer_mla --install-prebuilt "$FI_DIR"/prebuilt/*.so
fi
if [ -z "${GLM5_TRAINED_CKPT:-}" ] && [ -d .gpuref/trained ]; then export GLM5_TRAINED_CKPT="$ROOT/.gpuref/trained"; fi

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 || true
  "$PY" - <<'PY' 2>&1
import importlib
for mod in ("torch", "triton", "transformers", "fla", "flashinfer"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"), m.__file__)
    except Exception as e:
        print(mod, "not importable:", type(e).__name__, e)
import torch
print("cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY
} > "$OUT/device.txt"
cat "$OUT/device.txt" >&2

FAILED=0
run_tests() {
  # only the modules with gpu-marked tests: the others import the serving stack's packages (uvicorn, openai,
  # tritonclient), which the GPU machine need not have, and a module that fails to import stops the run
  local files
  files=$(grep -l "pytest\.mark\.gpu" tests/test_*.py)
  # shellcheck disable=SC2086
  GLM5_DIAG_OUT="$OUT" timeout "${TESTS_TIMEOUT:-1200}" "$PY" -m pytest -m gpu -q -rA $files \
    --junitxml="$OUT/gpu_tests.xml" ${PYTEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1
  local rc=$?
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.log" | tail -60
  return $rc
}
run_bench() {
  mkdir -p "$OUT/bench"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-900}" "$PY" bench/bench.py --out "$OUT/bench" ${BENCH_ARGS:---profile-prefill} \
    > "$OUT/bench/stdout.log" 2>&1
  local rc=$?
  tail -5 "$OUT/bench/stdout.log" | cut -c1-300
  if [ -f "$OUT/bench/results.json" ]; then
    "$PY" bench/render_results.py "$OUT/bench/results.json" && sed -n '1,40p' "$OUT/bench/RESULTS.md"
  fi
  return $rc
}
run_kernels() {
  mkdir -p "$OUT/kernels"
  timeout "${KERNELS_TIMEOUT:-300}" "$PY" bench/kernel_bench.py "$OUT/kernels/sparse_mla.json" > "$OUT/kernels/kernel_bench.log" 2>&1 \
    && timeout "${KERNELS_TIMEOUT:-300}" "$PY" bench/kernel_bench.py --small "$OUT/kernels/decode_kernels.json" >> "$OUT/kernels/kernel_bench.log" 2>&1
  local rc=$?
  # the prefill / decode-fusion kernels against their references, and the b1 step with the fusions off and on
  timeout "${CHECK_TIMEOUT:-480}" "$PY" bench/kernel_check.py "$OUT/kernels/check" > "$OUT/kernels/kernel_check.log" 2>&1 \
    || rc=1
  if [ $rc -eq 0 ] && "$PY" -c "import flashinfer" >/dev/null 2>&1; then
    timeout "${KERNELS_TIMEOUT:-300}" "$PY" bench/flashinfer_bench.py "$OUT/kernels/flashinfer_mla_kernels.json" \
      > "$OUT/kernels/flashinfer_bench.log" 2>&1
    rc=$?
  fi
  tail -3 "$OUT/kernels/"*.log | cut -c1-300
  return $rc
}

run_fp8() {
  mkdir -p "$OUT/fp8"
  timeout "${FP8_TIMEOUT:-600}" "$PY" bench/fp8_check.py --out "$OUT/fp8" --write-table > "$OUT/fp8/fp8_check.stdout" 2>&1
  local rc=$?
  sed -n '/^checks:/,$p' "$OUT/fp8/fp8_check.stdout" | cut -c1-200
  timeout "${FP8_TIMEOUT:-600}" "$PY" bench/tune_fused_moe.py --fp8 --budget-s 150 > "$OUT/fp8/tune_fused_moe_fp8.log" 2>&1 || rc=1
  tail -18 "$OUT/fp8/tune_fused_moe_fp8.log" | cut -c1-200
  timeout "${FP8_TIMEOUT:-600}" "$PY" bench/gemv16_table.py --out "$OUT/fp8/gemv16" --budget-s 120 --write-table \
    > "$OUT/fp8/gemv16.stdout" 2>&1 || rc=1
  tail -45 "$OUT/fp8/gemv16.stdout" | cut -c1-200
  cp kernels/glm5_kernels/configs/fp8_linear_*.json kernels/glm5_kernels/configs/fused_moe_*fp8w*.json \
    kernels/glm5_kernels/configs/gemv16_*.json "$OUT/fp8/" 2>/dev/null
  return $rc
}

run_spec() {
  mkdir -p "$OUT/spec"
  timeout "${SPEC_TIMEOUT:-600}" "$PY" bench/spec_bench.py --out "$OUT/spec" --profile \
    --cost-table "$OUT/spec/cost_table.json" > "$OUT/spec/stdout.log" 2>&1
  local rc=$?
  tail -5 "$OUT/spec/stdout.log" | cut -c1-300
  if [ -f "$OUT/spec/spec_results.json" ]; then
    "$PY" - "$OUT/spec/spec_results.json" "$OUT/spec/SPEC.md" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from render_results import speculative_tables
spec = json.load(open(sys.argv[1]))
open(sys.argv[2], "w").write("\n".join(["# Speculative decoding (MTP)", "", *speculative_tables(spec)]) + "\n")
PY
    sed -n '1,60p' "$OUT/spec/SPEC.md"
  fi
  return $rc
}

for s in tests bench kernels fp8 spec; do
  if [ "$STAGE" = all ] || [ "$STAGE" = "$s" ]; then
    echo "== $s" >&2
    "run_$s" || { echo "== $s FAILED (exit $?)" >&2; FAILED=1; }
  fi
done
echo "outputs in $OUT" >&2
exit $FAILED
