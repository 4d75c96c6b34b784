"""Where tritonserver and the Python backend are, and the backend directory ``glm5 serve`` builds.

Two server installations are supported:

* a ``tritonserver`` binary on ``PATH`` (the NGC ``tritonserver`` container, where the Dockerfile
  puts our backend under ``/opt/tritonserver/backends/glm5``);
* the 2.51 binary bundled in the ``nvidia-pytriton`` wheel. That wheel ships the Python backend
  (``libtriton_python.so`` + ``triton_python_backend_utils.py``) and one stub per Python version
  but no backend directory in the layout tritonserver expects, so we assemble one in a cache
  directory: ``python/`` (library, utils, the stub for *this* interpreter's version) and
  ``glm5/model.py`` (our python-based backend). The wheel's shared libraries live in
  ``nvidia_pytriton.libs`` and are found through ``LD_LIBRARY_PATH``; the stub's own RPATH is
  relative to its wheel location and breaks once the stub is linked elsewhere.

The stub embeds the *system* libpython and ignores ``PYTHONPATH`` (see
``docs/serving.md``, engine settings), so the launcher writes a runtime copy of the model repository
whose ``config.pbtxt`` files carry a ``python_path`` parameter (this interpreter's site-packages and
the project's source folders) and also exports ``GLM5_PYTHON_PATH``; ``backend/model.py`` and
the preprocess model put those entries on ``sys.path`` before importing anything else.

Nothing here starts a process: :mod:`glm5.serving.server_process` runs the server and
:mod:`glm5.serving.launcher` is the ``glm5 serve`` command.
"""

from __future__ import annotations

import logging
import os
import shutil
import site
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: Environment variable through which the launcher hands ``sys.path`` entries to the stub.
PYTHON_PATH_ENV = "GLM5_PYTHON_PATH"
#: Models of the shipped repository, in load order.
DEFAULT_MODELS = ("glm5", "preprocess", "glm5_multimodal")
#: Where the NGC image (and our Dockerfile) keep backends.
NGC_BACKEND_DIR = Path("/opt/tritonserver/backends")


class LauncherError(RuntimeError):
    """The server could not be prepared or did not become ready; the message says why."""


# ---------------------------------------------------------------------------------------------
# Locating files
# ---------------------------------------------------------------------------------------------

def project_root() -> Path | None:
    """The source checkout holding ``backend/glm5`` (editable installs), or None for a wheel."""
    import glm5

    root = Path(glm5.__file__).resolve().parents[2]
    return root if (root / "backend" / "model.py").is_file() else None


def default_model_repository() -> Path:
    """The shipped ``model_repository/`` (source checkout, or ``/opt/glm5/model_repository``)."""
    candidates = []
    root = project_root()
    if root is not None:
        candidates.append(root / "model_repository")
    candidates.append(Path("/opt/glm5/model_repository"))
    for c in candidates:
        if (c / "glm5" / "config.pbtxt").is_file():
            return c
    raise LauncherError(
        f"no model repository found (looked in {', '.join(map(str, candidates))}); "
        "pass --model-repository DIR")


def backend_model_py() -> Path:
    """The python-based backend ``model.py`` (``backend/model.py`` of the checkout or the NGC copy)."""
    candidates = []
    root = project_root()
    if root is not None:
        candidates.append(root / "backend" / "model.py")
    candidates.append(NGC_BACKEND_DIR / "glm5" / "model.py")
    for c in candidates:
        if c.is_file():
            return c
    raise LauncherError(
        f"backend model.py not found (looked in {', '.join(map(str, candidates))}); run from a source "
        "checkout of glm5-triton or in the project's Docker image")


def python_path_entries() -> list[str]:
    """``sys.path`` entries the stub needs: this interpreter's site-packages + project sources.

    Site-packages come first so that numpy<2 from the venv shadows anything else the stub's
    system interpreter might find (numpy 2 crashes the 2.51 stub on BYTES tensors).
    """
    entries: list[str] = []
    for p in list(site.getsitepackages()) + [site.getusersitepackages()]:
        if p and os.path.isdir(p) and p not in entries:
            entries.append(p)
    root = project_root()
    if root is not None:
        for sub in ("backend", "kernels", "client"):
            p = str(root / sub)
            if os.path.isdir(p) and p not in entries:
                entries.append(p)
    return entries


@dataclass
class TritonInstallation:
    """A runnable tritonserver: binary, extra library dir, and the Python backend's files."""

    binary: Path
    lib_dir: Path | None            # nvidia_pytriton.libs for the wheel build; None for NGC
    python_backend_dir: Path        # holds libtriton_python.so + triton_python_backend_utils.py
    stub: Path | None               # stub for this Python version (wheel build); NGC ships its own
    source: str                     # "path" or "nvidia-pytriton"


def locate_tritonserver(prefer: str = "auto") -> TritonInstallation:
    """Find tritonserver: ``PATH`` first (NGC container), else the nvidia-pytriton wheel's binary.

    ``prefer`` is ``auto``, ``path`` or ``pytriton``; an explicit choice that is unavailable raises
    (no silent fallback).
    """
    if prefer not in ("auto", "path", "pytriton"):
        raise LauncherError(f"unknown tritonserver source {prefer!r}; use auto, path or pytriton")
    if prefer in ("auto", "path"):
        found = shutil.which("tritonserver")
        if found:
            binary = Path(found).resolve()
            backend_dir = binary.parent.parent / "backends" / "python"
            if not backend_dir.is_dir():
                backend_dir = NGC_BACKEND_DIR / "python"
            if (backend_dir / "libtriton_python.so").is_file():
                return TritonInstallation(binary, None, backend_dir, None, "path")
            if prefer == "path":
                raise LauncherError(f"tritonserver at {binary} has no python backend at {backend_dir}")
        elif prefer == "path":
            raise LauncherError("no tritonserver on PATH; install it or use --triton pytriton")
    try:
        import pytriton  # noqa: F401  (only to find the wheel)
    except ImportError as exc:
        raise LauncherError(
            "no tritonserver on PATH and nvidia-pytriton is not installed; "
            "pip install 'glm5-triton[serve]' or run in the NGC tritonserver container") from exc
    pkg = Path(pytriton.__file__).resolve().parent
    triton_dir = pkg / "tritonserver"
    binary = triton_dir / "bin" / "tritonserver"
    lib_dir = pkg.parent / "nvidia_pytriton.libs"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton_dir / "python_backend_stubs" / ver / "triton_python_backend_stub"
    py_backend = triton_dir / "backends" / "python"
    for p in (binary, lib_dir, py_backend / "libtriton_python.so", stub):
        if not p.exists():
            raise LauncherError(f"nvidia-pytriton install is incomplete: {p} is missing "
                                f"(Python {ver} stub needed; reinstall nvidia-pytriton==0.7.0)")
    return TritonInstallation(binary, lib_dir, py_backend, stub, "nvidia-pytriton")


def system_python_for_stub() -> Path | None:
    """The interpreter whose prefix matches the system libpython the wheel's stub embeds.

    The embedded interpreter derives ``sys.prefix`` (and so its stdlib) from the first ``python3``
    on ``PATH``. Inside a venv built on another CPython (pyenv, conda) that stdlib does not match
    the system libpython: its C modules fail with undefined symbols (seen: ``_ssl`` needing
    ``_PyModule_Add``). Pointing ``PATH`` at the system interpreter of the same minor version
    keeps stdlib and libpython consistent; site-packages still come from ``python_path``.
    """
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (Path(f"/usr/bin/python{ver}"), Path(f"/usr/local/bin/python{ver}")):
        if cand.is_file():
            return cand
    return None


def _link(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    dst.symlink_to(src)


def _copy(src: Path, dst: Path) -> None:
    """Copy (not link): tritonserver resolves symlinks and rejects a backend library that
    "escapes" the backend directory."""
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    shutil.copy2(src, dst)


def assemble_backend_dir(inst: TritonInstallation, dest: Path, model_py: Path | None = None) -> Path:
    """Build ``dest`` as a ``--backend-directory``: ``python/`` and ``glm5/model.py``.

    The Python backend files and ``model.py`` are copied (about 3 MB; tritonserver refuses a
    library whose real path is outside the backend directory). For a PATH install every other
    backend of the installation is symlinked as a whole folder, so nothing is lost.
    """
    dest.mkdir(parents=True, exist_ok=True)
    py = dest / "python"
    py.mkdir(exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy(inst.python_backend_dir / name, py / name)
    stub = inst.stub or inst.python_backend_dir / "triton_python_backend_stub"
    if not stub.is_file():
        raise LauncherError(f"python backend stub not found at {stub}")
    _copy(stub, py / "triton_python_backend_stub")
    if inst.source == "path":
        for other in inst.python_backend_dir.parent.iterdir():
            if other.name not in ("python", "glm5") and not (dest / other.name).exists():
                _link(other, dest / other.name)
    g = dest / "glm5"
    g.mkdir(exist_ok=True)
    _copy((model_py or backend_model_py()).resolve(), g / "model.py")
    return dest
