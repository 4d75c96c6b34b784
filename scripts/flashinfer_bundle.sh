#!/usr/bin/env bash
# Prepare FlashInfer for a GPU machine without network: a pruned, xz-compressed copy of the
# flashinfer-python package plus the apache-tvm-ffi wheel it imports, small enough to copy along with
# a checkout.
#
# Why pruned: the flashinfer-python 0.7.2.post1 wheel is 59 MiB (426 MB unpacked, 258 MB of it CUDA
# sources under flashinfer/data/csrc for every kernel family). We keep the whole Python package and the
# header trees (cutlass, cccl, flashinfer/include, spdlog: they compress ~15x), and from data/csrc only
# the sources of the JIT modules this project builds - batch MLA (fa3 = SM90, fa2 = SM80+) and
# sampling - plus every csrc file they #include (transitively, over-approximated: every #include line
# counts, whatever #if surrounds it). Result: ~17 MiB on disk.
#
# Usage: scripts/flashinfer_bundle.sh [OUT_DIR]    (default: .fi in the repo root, git-ignored)
#   FI_PREBUILT=DIR  also copy compiled modules (*.so from `python -m glm5_kernels.flashinfer_mla --warmup
#                    --export DIR` on an H200 with the same flashinfer + CUDA 13) into OUT_DIR/prebuilt/;
#                    on the GPU machine they load with no nvcc run (saves the ~90 s first-use JIT; 6 MiB).
# On the GPU machine, scripts/gpu_check.sh unpacks .fi and installs the prebuilt modules; by hand:
#   mkdir -p /tmp/site && tar -xJf .fi/flashinfer-*-pruned.tar.xz -C /tmp/site \
#   && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fi/apache_tvm_ffi-*.whl \
#   && export PYTHONPATH=/tmp/site:$PYTHONPATH \
#   && python3 -m glm5_kernels.flashinfer_mla --install-prebuilt .fi/prebuilt/*.so
# Needs here: python3 with pip and network (pip download), tar, xz.
set -euo pipefail

FI_VERSION="${FI_VERSION:-0.7.2.post1}"
TVM_FFI_SPEC="${TVM_FFI_SPEC:-apache-tvm-ffi>=0.1.11,<0.2}"
PY_VERSION="${PY_VERSION:-3.12}"   # the H200 image's python3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/.fi}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

mkdir -p "$OUT"
echo "downloading flashinfer-python==$FI_VERSION and $TVM_FFI_SPEC (cp${PY_VERSION/./}) ..." >&2
python3 -m pip download -q --no-deps --only-binary=:all: -d "$WORK/dl" "flashinfer-python==$FI_VERSION"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WORK/dl" "$TVM_FFI_SPEC"

mkdir -p "$WORK/wheel" "$WORK/stage"
python3 - "$WORK/dl"/flashinfer_python-*.whl "$WORK/wheel" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
EOF

# Copy the package without data/csrc, then add the csrc closure of the seed sources.
python3 - "$WORK/wheel" "$WORK/stage" <<'EOF'
"""Copy flashinfer/ to the stage, keeping from data/csrc only the include-closure of the seeds."""
import re
import shutil
import sys
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
pkg = src / "flashinfer"
data = pkg / "data"
csrc = data / "csrc"
# Seeds: what flashinfer/jit/attention/modules.py (gen_batch_mla_module, fa2 + fa3) and
# flashinfer/jit/sampling.py (gen_sampling_module) compile or render.
seeds = [
    "batch_mla_config.jinja",
    "batch_mla_plan.cu", "batch_mla_run.cu", "batch_mla_binding.cu",
    "batch_mla_sm90_plan.cu", "batch_mla_sm90_run.cu", "batch_mla_sm90_binding.cu",
    "sampling.cu", "renorm.cu", "flashinfer_sampling_binding.cu",
]
search = [csrc, data / "include", data / "cutlass" / "include", data / "cutlass" / "tools" / "util" / "include",
          data / "cccl" / "cub", data / "cccl" / "libcudacxx" / "include", data / "cccl" / "thrust",
          data / "spdlog" / "include"]
inc_re = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)

keep: set[Path] = set()
todo = [csrc / s for s in seeds]
for p in todo:
    if not p.exists():
        sys.exit(f"seed {p} missing from the wheel: the module layout changed, update the seed list")
while todo:
    p = todo.pop()
    if p in keep:
        continue
    keep.add(p)
    for name in inc_re.findall(p.read_text(errors="replace")):
        for base in [p.parent, *search]:
            cand = (base / name).resolve()
            if cand.is_file():
                if csrc in cand.parents and cand not in keep:   # other trees are shipped whole
                    todo.append(cand)
                elif data in cand.parents and cand not in keep and cand.suffix in (".h", ".cuh", ".hpp", ".inc"):
                    todo.append(cand)                          # follow them: they may include csrc files
                break

def ignore(dirpath: str, names: list[str]) -> list[str]:
    return names if Path(dirpath).resolve() == csrc.resolve() else [n for n in names if n == "__pycache__"]

shutil.copytree(pkg, dst / "flashinfer", ignore=ignore)
n = 0
for p in sorted(keep):
    if csrc in p.parents:
        rel = p.relative_to(csrc)
        (dst / "flashinfer/data/csrc" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst / "flashinfer/data/csrc" / rel)
        n += 1
for d in src.glob("flashinfer_python-*.dist-info"):
    shutil.copytree(d, dst / d.name)
print(f"kept {n} csrc files: " + " ".join(sorted(str(p.relative_to(csrc)) for p in keep if csrc in p.parents)),
      file=sys.stderr)
EOF

rm -f "$OUT"/flashinfer-*-pruned.tar.xz "$OUT"/apache_tvm_ffi-*.whl
tar -C "$WORK/stage" -cf - . | xz -T0 -6 > "$OUT/flashinfer-$FI_VERSION-pruned.tar.xz"
cp "$WORK/dl"/apache_tvm_ffi-*.whl "$OUT/"
if [ -n "${FI_PREBUILT:-}" ]; then
    mkdir -p "$OUT/prebuilt" && rm -f "$OUT"/prebuilt/*.so && cp "$FI_PREBUILT"/*.so "$OUT/prebuilt/"
fi
( cd "$OUT" && sha256sum flashinfer-*-pruned.tar.xz apache_tvm_ffi-*.whl > SHA256SUMS && du -b flashinfer-*-pruned.tar.xz apache_tvm_ffi-*.whl )
echo "bundle ready in $OUT ($(du -sh "$OUT" | cut -f1)); copy it to the GPU machine's checkout as ${OUT#$ROOT/}" >&2
