"""``glm5 serve`` refuses bad settings in one line, within seconds, before tritonserver starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


def serve(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "glm5.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stderr, time.monotonic() - t0


def assert_one_line_error(rc: int, stderr: str, elapsed: float, *needles: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert rc == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("glm5 serve: error:"), stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert elapsed < 30, f"took {elapsed:.1f}s"


def test_missing_model_directory_fails_fast_naming_the_path(tmp_path: Path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    assert_one_line_error(*serve("--model", str(missing)), str(missing), "no such directory")


def test_directory_without_config_json_fails_fast(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(*serve("--model", str(tmp_path)), str(tmp_path), "config.json")


def test_model_path_that_is_a_file_fails_fast(tmp_path: Path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    assert_one_line_error(*serve("--model", str(f)), str(f), "is a file")


@pytest.mark.parametrize("args,needle", [
    (["--media-caps", '{"max_imagez": 1}'], "max_imagez"),
    (["--engine-arg", "media_caps={not json"], "media_caps is not valid JSON"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--engine-arg", "no_such_setting=1"], "no_such_setting"),
    (["--admin-key", "short"], "at least 16 characters"),
    (["--restricted-apis", "model-repository,everything"], "everything"),
    (["--no-http-front", "--host", "0.0.0.0"], "--no-http-front"),
])
def test_bad_settings_fail_before_the_server_starts(tiny_checkpoint_dir: Path, args: list[str], needle: str,
                                                    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """In-process (the same ``main`` as the command), with the server start made impossible to miss."""
    from glm5 import cli
    from glm5.serving import server_process

    def no_start(self):
        raise AssertionError("tritonserver was started")
    monkeypatch.setattr(server_process.TritonServerProcess, "start", no_start)
    t0 = time.monotonic()
    rc = cli.main(["serve", "--model", str(tiny_checkpoint_dir), *args])
    assert_one_line_error(rc, capsys.readouterr().err, time.monotonic() - t0, needle)
