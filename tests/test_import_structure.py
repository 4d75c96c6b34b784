"""The import structure: dependencies point one way and no sibling packages import each other in a circle.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``): the kernels import neither the engine nor
the client; inside ``glm5`` the layers run cli → serving/entrypoints → engine → request processing → layers and
weights → cache → config; ``acyclic_siblings`` forbids import circles between sibling packages. import-linter
reads the source tree (imports inside functions count too), so a lazy import that runs back up is caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("backend", "kernels", "client"))}
    res = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                          "sys.exit(lint_imports_command())", "--no-cache", "--config", "pyproject.toml"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "Contracts: 4 kept, 0 broken." in out, out[-4000:]
