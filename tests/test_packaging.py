"""The built wheel ships every package and imports without the source tree.

Guards against the upstream failure mode "a subpackage without ``__init__.py`` was missing from
the built wheel": setuptools' package discovery silently skips such a directory, and an editable
install hides the loss because it imports from the source tree. So this test builds the wheel
from a copy of the sources, checks its file list against the source tree, installs it into a
fresh venv that cannot see the source tree (dependencies come from the main venv through a plain
``.pth`` path, which does not run the editable finder hook) and imports every module there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("backend", "kernels", "client")  # pyproject: packages.find where = these


def _source_package_files(repo: Path) -> dict[str, set[str]]:
    """``{package dir (wheel-relative, '/'-separated): {its .py files}}`` for every directory below
    a source root that holds Python files (top-level files of a root, like the Triton
    ``backend/model.py``, belong to no package and are not shipped in the wheel)."""
    out: dict[str, set[str]] = {}
    for root in SOURCE_ROOTS:
        base = repo / root
        for py in base.rglob("*.py"):
            rel = py.relative_to(base)
            if "__pycache__" in rel.parts or len(rel.parts) < 2:
                continue
            out.setdefault(rel.parent.as_posix(), set()).add(rel.as_posix())
    return out


def _packaging_problems(source: dict[str, set[str]], wheel_names: set[str]) -> list[str]:
    problems = []
    for pkg, files in sorted(source.items()):
        if f"{pkg}/__init__.py" not in wheel_names:
            problems.append(f"package {pkg!r} is not in the wheel (add {pkg}/__init__.py)")
        missing = sorted(f for f in files if f not in wheel_names)
        if missing:
            problems.append(f"{pkg}: files missing from the wheel: {missing}")
    return problems


def test_problem_detection_flags_a_subpackage_without_init() -> None:
    source = {"glm5": {"glm5/__init__.py", "glm5/a.py"}, "glm5/sub": {"glm5/sub/b.py"}}
    wheel = {"glm5/__init__.py", "glm5/a.py"}  # what setuptools builds when glm5/sub lacks __init__.py
    problems = _packaging_problems(source, wheel)
    assert any("glm5/sub" in p and "__init__.py" in p for p in problems)
    assert _packaging_problems({"glm5": {"glm5/__init__.py"}}, {"glm5/__init__.py"}) == []


def _copy_sources(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dst / name)
    for root in SOURCE_ROOTS:
        shutil.copytree(REPO / root, dst / root, ignore=ignore)


_IMPORT_ALL = r"""
import importlib, json, sys, traceback
from pathlib import Path
repo, venv, modules = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
source_dirs = [Path(repo).resolve()] + [Path(repo, r).resolve() for r in ("backend", "kernels", "client")]
def _shows_sources(entry):
    p = Path(entry or ".").resolve()
    return p == source_dirs[0] or any(p == d or p.is_relative_to(d) for d in source_dirs[1:])
bad_paths = [p for p in sys.path if _shows_sources(p)]
assert not bad_paths, f"source tree visible on sys.path: {bad_paths}"
finders = [repr(f) for f in sys.meta_path
           if "editable" in ((getattr(f, "__module__", "") or "") + type(f).__module__).lower()]
assert not finders, f"editable finder active: {finders}"
failures = {}
for m in modules:
    try:
        mod = importlib.import_module(m)
    except BaseException:
        failures[m] = traceback.format_exc(limit=3)
        continue
    f = getattr(mod, "__file__", None) or ""
    if not Path(f).resolve().is_relative_to(Path(venv).resolve()):
        failures[m] = f"imported from {f}, not from the fresh venv"
print(json.dumps(failures))
"""


def test_wheel_contains_every_package_and_imports_in_clean_venv(tmp_path: Path) -> None:
    src, dist, venv = tmp_path / "src", tmp_path / "dist", tmp_path / "venv"
    src.mkdir()
    _copy_sources(src)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    wheels = list(dist.glob("glm5_triton-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())

    source = _source_package_files(REPO)
    assert "glm5" in source and "glm5_kernels" in source and "glm5_client" in source
    problems = _packaging_problems(source, names)
    assert not problems, "\n".join(problems)
    assert "glm5/chat_template.jinja" in names  # package data travels with the code

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "--no-index", "-q",
         str(wheels[0])],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    venv_site = Path(subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    # Dependencies (torch, transformers, ...) from the main venv as a plain path: .pth files in
    # that directory (the editable install's finder hook) are NOT processed for such entries.
    main_site = sysconfig.get_paths()["purelib"]
    (venv_site / "zz_main_venv_deps.pth").write_text(main_site + "\n")

    modules = sorted({n[:-3].replace("/", ".").removesuffix(".__init__")
                      for n in names if n.endswith(".py") and ".dist-info/" not in n})
    assert "glm5.tiny_checkpoint" in modules and "glm5_client" in modules
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run([str(vpy), "-c", _IMPORT_ALL, str(REPO), str(venv), __import__("json").dumps(modules)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    failures = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"{m}: {e}" for m, e in failures.items())


if __name__ == "__main__":  # pragma: no cover - manual run
    sys.exit(pytest.main([__file__, "-q"]))
