# GLM-5.3-Flash on Triton: the NGC Triton 24.10 image (tritonserver 2.51, Python 3.10 stub) with the
# glm5 engine installed and the python-based backend `glm5` in /opt/tritonserver/backends/glm5.
#
#   docker build -t glm5-triton .
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -v /path/to/GLM-5.3-Flash:/models/glm5 glm5-triton glm5 serve --model /models/glm5 --host 0.0.0.0
#
# Without --model, `glm5 serve` serves the tiny random checkpoint (smoke test). Plain
# `tritonserver --model-repository /opt/glm5/model_repository` also works once the `model`
# parameter of glm5/ and preprocess/ config.pbtxt points at a checkpoint.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /opt/glm5/src
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY kernels ./kernels
COPY client ./client
COPY model_repository /opt/glm5/model_repository

# The engine with its GPU kernels and the serving extras. numpy stays <2 (pinned by the project):
# the 2.51 python stub crashes on BYTES tensors with numpy 2.
RUN python3 -m pip install --upgrade pip \
 && python3 -m pip install ".[gpu,serve]" \
 && python3 -c "import numpy, glm5, glm5_client; assert numpy.__version__.startswith('1.'), numpy.__version__"

# The python-based backend: tritonserver runs /opt/tritonserver/backends/glm5/model.py for every
# model whose config.pbtxt says backend: "glm5".
RUN mkdir -p /opt/tritonserver/backends/glm5 \
 && cp backend/model.py /opt/tritonserver/backends/glm5/model.py

EXPOSE 8000 8001 8002
CMD ["glm5", "serve", "--host", "0.0.0.0"]
