# One command serves the default model, one runs the tests (README). Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
SERVE_ARGS ?=
# the OpenAI-compatible API (docs/openai.md) that `make serve` starts beside Triton
OPENAI_PORT ?= 9000

.PHONY: setup test serve gpu-test clean

setup: $(VENV)/.installed

# CPU torch is pinned first (2.13.0, a CPU build on these machines): a bare `torch` requirement
# would otherwise pull a multi-GB CUDA build. The project then installs with the test + serve + openai extras.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,serve,openai]"
	touch $@

test: setup
	$(PY) -m pytest -m "not gpu" -q $(PYTEST_ARGS)

serve: setup
	$(VENV)/bin/glm5 serve --openai-port $(OPENAI_PORT) $(SERVE_ARGS)

# On a CUDA machine (the H200): the GPU-marked tests.
gpu-test:
	python3 -m pytest -m gpu -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
