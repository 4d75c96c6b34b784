# Sourced at the start of every device (H200) call: installs the carried wheels under /tmp/site
# (the box has no network) and puts the project on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/fla_core-0.6.0-py3-none-any.whl .whl/transformers-5.23.0-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD/backend:$PWD/kernels:$PWD/client:$PWD/tests
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
