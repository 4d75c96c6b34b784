# GLM-5.3-Flash on Triton: the NGC Triton 24.12 image (tritonserver 2.53, Ubuntu 24.04, Python 3.12,
# CUDA 12.6.3) with the glm5 engine installed and the python-based backend `glm5` in
# /opt/tritonserver/backends/glm5. `glm5 serve` finds the image's own /opt/tritonserver (no second
# tritonserver is installed: the image gets the `serving` extra, not `serve`, which bundles one).
#
#   docker build -t glm5-triton .
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -e GLM5_ADMIN_KEY=... \
#       -v /path/to/GLM-5.3-Flash:/models/glm5 glm5-triton glm5 serve --model /models/glm5 --host 0.0.0.0
#
# Inside the container everything listens on 127.0.0.1 unless the operator passes --host (or
# --http-address / --grpc-address / --metrics-address); the administrative APIs need the admin key
# ($GLM5_ADMIN_KEY, or a random one written to WORK_DIR/admin_key and named in the start log).
# Without --model, `glm5 serve` serves the tiny random checkpoint (smoke test).
#
# Why 24.12: it is the first NGC release whose Python (3.12) satisfies transformers >= 5.23
# (Requires-Python >= 3.11); 24.10 (2.51) has 3.10. PYTHON_VERSION and CUDA_VERSION below are the
# image's, declared so tests/test_dockerfile.py can check them without pulling the image, and
# asserted during the build so a wrong declaration fails the build instead of passing silently.
FROM nvcr.io/nvidia/tritonserver:24.12-py3

ARG PYTHON_VERSION=3.12
ARG CUDA_VERSION=12.6
# torch 2.7.1 is the newest release built against CUDA 12.6 on PyPI (pulling nvidia-*-cu12 12.6
# runtime wheels); the cu126 index serves the same build as 2.7.1+cu126. It matches the image's
# CUDA toolkit, which flashinfer's JIT compiles against. fla-core 0.6 needs torch >= 2.7.
ARG TORCH_VERSION=2.7.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
LABEL org.opencontainers.image.title="glm5-triton" \
      org.glm5.python-version="${PYTHON_VERSION}" \
      org.glm5.cuda-version="${CUDA_VERSION}" \
      org.glm5.torch-version="${TORCH_VERSION}"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOKENIZERS_PARALLELISM=false

RUN python3 -c "import sys; v = '%d.%d' % sys.version_info[:2]; assert v == '${PYTHON_VERSION}', \
        f'the image has Python {v}, the Dockerfile declares ${PYTHON_VERSION}'" \
 && test -x /opt/tritonserver/bin/tritonserver

WORKDIR /opt/glm5/src
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY kernels ./kernels
COPY client ./client
COPY model_repository /opt/glm5/model_repository

# torch first, pinned to the CUDA 12.6 build; then the engine with its GPU kernels (`gpu`: fla-core,
# flashinfer), what talks to and fronts the image's tritonserver (`serving`: tritonclient, the HTTP
# front) and the OpenAI-compatible server (`openai`, for glm5 serve --openai-port). numpy stays <2
# (pinned by the project): the python stub crashes on BYTES with numpy 2.
RUN python3 -m pip install "torch==${TORCH_VERSION}" --extra-index-url "${TORCH_INDEX_URL}" \
 && python3 -m pip install ".[gpu,serving,openai]" "torch==${TORCH_VERSION}" --extra-index-url "${TORCH_INDEX_URL}" \
 && python3 -c "import numpy, torch, glm5, glm5_client; \
assert numpy.__version__.startswith('1.'), numpy.__version__; \
assert torch.version.cuda.startswith('${CUDA_VERSION}'), torch.version.cuda" \
 && ! python3 -c "import pytriton" 2>/dev/null

# The python-based backend: tritonserver runs /opt/tritonserver/backends/glm5/model.py for every
# model whose config.pbtxt says backend: "glm5".
RUN mkdir -p /opt/tritonserver/backends/glm5 \
 && cp backend/model.py /opt/tritonserver/backends/glm5/model.py

# The ports are documented, not opened: they listen on 127.0.0.1 until `--host 0.0.0.0` is given.
EXPOSE 8000 8001 8002
CMD ["glm5", "serve"]
