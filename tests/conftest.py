"""Shared pytest fixtures.

``tiny_checkpoint_dir`` builds the default tiny GLM-5.3-Flash checkpoint (seed 0, fp32) once per
test session; tests must treat it as read-only (copy it if they need to modify files).
``real_config_path`` is the GLM-5.3-Flash ``config.json`` fixture (model-spec §1.1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the default tiny checkpoint (``make_tiny_checkpoint(dir)``), built once."""
    from glm5.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_glm5") / "ckpt")


@pytest.fixture(scope="session")
def real_config_path() -> Path:
    """Path of the real GLM-5.3-Flash ``config.json`` reconstructed from model-spec §1.1."""
    return FIXTURES / "glm5_3_flash_config.json"
