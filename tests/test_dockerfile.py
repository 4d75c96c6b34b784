"""The Dockerfile, checked without docker: base image, its declared Python and CUDA, COPY sources,
and a ``pip install --dry-run`` of the image's requirement set for the image's Python and platform
(needs the package index; skipped, saying so, only when the index cannot be reached)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
#: NGC tritonserver releases whose Python fits transformers >= 5.23 (Requires-Python >= 3.11), from the
#: NGC release notes ("Contents of the Triton Inference Server container"); 24.10 (2.51) has 3.10.
NGC_RELEASES = {"24.12": {"triton": "2.53.0", "python": "3.12", "cuda": "12.6"}}
#: Wheel platforms the image (Ubuntu 24.04, glibc 2.39, x86_64) runs. pip takes ``--platform`` literally,
#: so the older manylinux tags that glibc also satisfies are listed too (numpy 1.26 ships only 2_17 wheels).
PLATFORMS = ["manylinux_2_28_x86_64", *[f"manylinux_2_{v}_x86_64" for v in range(27, 4, -1)],
             "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Could not fetch URL", "Temporary failure in name",
                  "Network is unreachable", "ConnectTimeout", "ProxyError", "getaddrinfo failed")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def args() -> dict[str, str]:
    found = {}
    for word, rest in instructions():
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            found[k.strip()] = v.strip().strip('"')
    return found


def test_base_image_is_an_ngc_release_with_python_311_or_newer():
    froms = [rest for word, rest in instructions() if word == "FROM"]
    assert len(froms) == 1, froms
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3", froms[0])
    assert m, f"base image {froms[0]!r} is not an NGC tritonserver release"
    release = NGC_RELEASES.get(m.group(1))
    assert release, f"{m.group(1)} is not a release whose Python is known to be >= 3.11: {sorted(NGC_RELEASES)}"
    declared = args()
    assert declared["PYTHON_VERSION"] == release["python"] and Version(declared["PYTHON_VERSION"]) >= Version("3.11")
    assert declared["CUDA_VERSION"] == release["cuda"]
    # the declaration is checked against the real interpreter during the build
    run = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert "sys.version_info" in run and "${PYTHON_VERSION}" in run and "torch.version.cuda" in run


def test_every_copy_source_exists():
    copies = [rest for word, rest in instructions() if word in ("COPY", "ADD")]
    assert copies
    for rest in copies:
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"COPY source {src} does not exist"


def test_image_installs_no_second_tritonserver_and_locks_down_by_default():
    text = DOCKERFILE.read_text()
    installs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert ".[gpu,serving,openai]" in installs and "serve]" not in installs and "pytriton" not in installs.replace(
        'import pytriton', '')
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("pytriton" in r for r in extras["serving"] + extras["gpu"] + extras["openai"])
    cmd = [rest for word, rest in instructions() if word == "CMD"][-1]
    assert json.loads(cmd) == ["glm5", "serve"]          # loopback + restricted APIs: the launcher's defaults
    assert "0.0.0.0" not in cmd and "--restricted-apis" not in text


def image_requirements(python_version: str) -> list[str]:
    """The project's dependencies plus the extras the image installs (gpu, serving, openai), and the pinned torch.

    Markers are evaluated here for the image's Python: pip evaluates ``python_version`` markers
    against the interpreter running it, not against ``--python-version``.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    env = {"python_version": python_version, "python_full_version": python_version + ".0",
           "sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux",
           "implementation_name": "cpython", "os_name": "posix", "extra": ""}
    reqs = []
    for r in list(project["dependencies"]) + extras["gpu"] + extras["serving"] + extras["openai"]:
        req = Requirement(r)
        if req.name == project["name"] or req.name == "torch" or (req.marker and not req.marker.evaluate(env)):
            continue
        req.marker = None
        reqs.append(str(req))
    return reqs + [f"torch=={args()['TORCH_VERSION']}"]


def test_requirement_markers_pick_the_client_of_each_server():
    client = {r for r in image_requirements("3.12") if r.startswith("tritonclient")}
    assert client == {"tritonclient[grpc,http]==2.53.0", "tritonclient[grpc]==2.53.0"}   # = the image's tritonserver
    assert {r.split("==")[1] for r in image_requirements("3.11") if r.startswith("tritonclient")} == {"2.51.0"}


@pytest.mark.slow
def test_image_requirements_resolve_for_its_python_and_cuda(tmp_path: Path):
    declared = args()
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "--python-version", declared["PYTHON_VERSION"], "--only-binary=:all:",
           *[a for tag in PLATFORMS for a in ("--platform", tag)], "--target", str(tmp_path / "t"),
           "--retries", "1", "--timeout", "15", "--extra-index-url", declared["TORCH_INDEX_URL"],
           *image_requirements(declared["PYTHON_VERSION"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        if any(e in proc.stderr for e in NETWORK_ERRORS) and "No matching distribution" in proc.stderr + proc.stdout:
            pytest.skip(f"package index unreachable: {proc.stderr.strip().splitlines()[-1][:200]}")
        pytest.fail(f"the image's requirements do not resolve for Python {declared['PYTHON_VERSION']}:\n"
                    f"{proc.stderr[-3000:]}")
    resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert Version(resolved["torch"]).base_version == declared["TORCH_VERSION"]
    # torch's CUDA build shows in the runtime wheel it pins: it must be the image's CUDA
    assert resolved["nvidia-cuda-runtime-cu12"].startswith(declared["CUDA_VERSION"] + "."), resolved
    assert Version(resolved["numpy"]) < Version("2")
    assert Version(resolved["transformers"]) >= Version("5.23")
    for needed in ("fla-core", "flashinfer-python", "starlette", "uvicorn", "httpx", "psutil", "fastapi"):
        assert needed in resolved, needed
    assert resolved["tritonclient"] == NGC_RELEASES["24.12"]["triton"]
    assert "nvidia-pytriton" not in resolved
