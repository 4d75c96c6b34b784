"""Shared pytest fixtures.

``tiny_checkpoint_dir`` builds the default tiny GLM-5.3-Flash checkpoint (seed 0, fp32) once per
test session; tests must treat it as read-only (copy it if they need to modify files).
``real_config_path`` is the GLM-5.3-Flash ``config.json`` fixture (model-spec §1.1).
``trained_checkpoint`` is the trained tiny checkpoint (confident predictions, trained MTP layer), built
once per session (a few minutes on 2 cores); read-only as well.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Tiny models on a 2-core CI box: torch's OpenMP threads spin-wait, and with tritonserver stubs and
# CLI subprocesses running beside the test process, one thread each is several times faster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A tritonserver a test starts inherits this: a model whose initialize hangs writes its stacks to the server
# log (glm5.serving.stub_logging.stacks_if_slow) before the test's 240 s readiness wait gives up.
os.environ.setdefault("GLM5_INIT_STACK_DUMP_S", "150")
# A server whose model load stalls (neither ready nor exiting by the readiness timeout) is reported with its
# stubs' stacks and started once more (glm5.serving.server_process.start_attempts_from_env).
os.environ.setdefault("GLM5_SERVER_START_ATTEMPTS", "2")
sys.path.insert(0, str(Path(__file__).parent))  # tests import their helpers (oracle.py) by name

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the default tiny checkpoint (``make_tiny_checkpoint(dir)``), built once."""
    from glm5.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_glm5") / "ckpt")


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained tiny checkpoint (``glm5.trained_tiny_checkpoint``, seed 0, default steps, MTP layer
    trained too), built once per test session and shared by the modules that need it; read-only."""
    from glm5 import trained_tiny_checkpoint as trained_tiny

    return trained_tiny.train_tiny_checkpoint(tmp_path_factory.mktemp("tiny_trained") / "ckpt")


@pytest.fixture(scope="session")
def real_config_path() -> Path:
    """Path of the real GLM-5.3-Flash ``config.json`` reconstructed from model-spec §1.1."""
    return FIXTURES / "glm5_3_flash_config.json"
