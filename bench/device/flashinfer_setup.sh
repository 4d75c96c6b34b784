# Sourced after setup.sh when .fi/ (scripts/flashinfer_bundle.sh) was carried: unpack the pruned
# flashinfer package, install apache-tvm-ffi, and install the prebuilt JIT modules if present.
if [ -d .fi ]; then
  tar -xJf .fi/flashinfer-*-pruned.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fi/apache_tvm_ffi-*.whl
  export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  if ls .fi/prebuilt/*.so >/dev/null 2>&1; then
    python3 -m glm5_kernels.flashinfer_mla --install-prebuilt .fi/prebuilt/*.so
  fi
fi
