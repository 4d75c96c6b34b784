"""The runtime model repository: a copy of the shipped one with this deployment's settings filled in.

tritonserver reads settings only from ``config.pbtxt``. ``glm5 serve`` therefore copies the
models it serves into a runtime repository and sets, through :mod:`glm5.serving.model_config`:

* ``python_path`` on every model that runs our Python code (the stub ignores ``PYTHONPATH``);
* ``model`` (the checkpoint directory) wherever the shipped config declares that parameter;
* the engine settings on ``glm5``;
* ``media_caps`` on *every* model that declares it (``glm5`` and ``preprocess``): one setting,
  so the ensemble path and the direct path enforce the same limits.

Serving a subset of the models (``--text-only``) means copying only those: tritonserver then
loads everything it finds at start, and model control stays off (an explicit-mode server would
accept model uploads through the repository API).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from glm5.serving import model_config as mc

#: The parameter that carries ``MediaCaps`` overrides (JSON) in every model that takes media.
MEDIA_CAPS_PARAMETER = "media_caps"


class RepositoryError(ValueError):
    """The source repository or a requested model is unusable; the message says which."""


def repository_models(src: Path) -> list[str]:
    """Names of the model folders (those holding a ``config.pbtxt``) in ``src``."""
    return sorted(p.name for p in Path(src).iterdir() if (p / "config.pbtxt").is_file())


def validate_media_caps(text: str) -> str:
    """Check a ``media_caps`` JSON value against ``MediaCaps`` now, not in a model's ``initialize``."""
    from glm5.multimodal.caps import MediaCaps

    MediaCaps.from_json(text)
    return text


def prepare_model_repository(src: Path, dest: Path, *, model_dir: str | None, python_path: list[str],
                             engine_overrides: dict[str, str] | None = None,
                             media_caps: str | None = None,
                             models: tuple[str, ...] | None = None) -> Path:
    """Copy ``src`` (only ``models`` when given) to ``dest`` and fill in the settings (module docstring).

    ``media_caps`` is a JSON object of ``MediaCaps`` fields; a ``media_caps`` entry among
    ``engine_overrides`` means the same and also goes to every model that declares the parameter.
    """
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise RepositoryError(f"model repository {src} is not a directory")
    available = repository_models(src)
    if models is not None:
        missing = sorted(set(models) - set(available))
        if missing:
            raise RepositoryError(f"model(s) {missing} not in {src} (it has {available})")
    overrides = dict(engine_overrides or {})
    if MEDIA_CAPS_PARAMETER in overrides:
        from_overrides = str(overrides.pop(MEDIA_CAPS_PARAMETER))
        if media_caps is not None and json.loads(media_caps) != json.loads(from_overrides):
            raise RepositoryError("media caps given twice with different values (--media-caps and "
                                  "--engine-arg media_caps=...); give one")
        media_caps = from_overrides
    if media_caps is not None:
        validate_media_caps(media_caps)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in available:
        if models is not None and name not in models:
            continue
        shutil.copytree(src / name, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        cfg_path = dest / name / "config.pbtxt"
        cfg = mc.read_config(cfg_path)
        if mc.runs_python(cfg):
            mc.set_parameter(cfg, "python_path", os.pathsep.join(python_path))
            if model_dir is not None and mc.get_parameter(cfg, "model") is not None:
                mc.set_parameter(cfg, "model", str(Path(model_dir).resolve()))
            if media_caps is not None and mc.get_parameter(cfg, MEDIA_CAPS_PARAMETER) is not None:
                mc.set_parameter(cfg, MEDIA_CAPS_PARAMETER, media_caps)
            if name == "glm5":
                for k, v in overrides.items():
                    mc.set_parameter(cfg, k, str(v))
        mc.write_config(cfg, cfg_path)
        # A model folder needs a version folder even when the code lives in the backend.
        (dest / name / "1").mkdir(exist_ok=True)
    return dest
