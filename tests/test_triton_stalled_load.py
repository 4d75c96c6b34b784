"""A model load that stalls (tritonserver neither ready nor exiting) is reported and retried: the launcher
names the processes and the model-load lines, the stubs write their threads' stacks to the server log,
and ``start_attempts`` starts the server again. Real tritonserver with a Python model whose
``initialize`` never returns (it registers the stack signal as our models do)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from glm5.serving.launcher import LauncherError, TritonServerProcess
from glm5.serving.server_diagnosis import group_processes, model_load_line
from glm5.serving.server_process import START_ATTEMPTS_ENV, LoadStalledError, start_attempts_from_env

STALLING_MODEL = """
import faulthandler, os, signal, sys, threading
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.path[:0] = [p for p in os.environ.get("GLM5_PYTHON_PATH", "").split(os.pathsep) if p]


class TritonPythonModel:
    def initialize(self, args):
        self.wait_for_a_weight_file_that_never_comes()

    def wait_for_a_weight_file_that_never_comes(self):
        threading.Event().wait()

    def execute(self, requests):
        return []
"""
STALLING_CONFIG = """name: "stalls"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


@pytest.fixture()
def stalling_repository(tmp_path: Path) -> Path:
    model = tmp_path / "repo" / "stalls"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(STALLING_CONFIG)
    (model / "1" / "model.py").write_text(STALLING_MODEL)
    return tmp_path / "repo"


def test_a_stalled_load_is_reported_with_stub_stacks_and_started_again(stalling_repository: Path, tmp_path: Path):
    log = tmp_path / "server.log"
    srv = TritonServerProcess(model_repository=stalling_repository, prepare_repository=False, log_file=log,
                              ready_timeout_s=10, start_attempts=2, http_front=False)
    t0 = time.monotonic()
    with pytest.raises(LoadStalledError) as err:
        srv.start()
    took = time.monotonic() - t0
    assert srv.proc is None and srv.work_dir is None          # stopped and cleaned up after the last attempt
    msg = str(err.value)
    assert "did not finish loading its models within 10s and has not exited" in msg
    # the report: the server's processes (the stub among them) and how far the load got
    assert "tritonserver state" in msg and "triton_python_b state" in msg, msg
    assert '"loading: stalls:1"' in msg and "ModelInstanceInitialize: stalls_0_0" in msg, msg
    assert "asked 1 Python-backend stub(s)" in msg and "successfully loaded" not in msg
    text = log.read_text(errors="replace")
    assert text.count('"loading: stalls:1"') == 2, "the second attempt did not start"
    # each attempt's stub answered the stack request: where initialize waits, by name
    assert text.count("in wait_for_a_weight_file_that_never_comes") == 2, text[-3000:]
    assert took < 2 * 10 + 60


def test_start_attempts_from_the_environment(monkeypatch):
    monkeypatch.delenv(START_ATTEMPTS_ENV, raising=False)
    assert start_attempts_from_env() == 1
    monkeypatch.setenv(START_ATTEMPTS_ENV, "3")
    assert start_attempts_from_env() == 3 and TritonServerProcess().start_attempts == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(START_ATTEMPTS_ENV, bad)
        with pytest.raises(LauncherError, match=f"{START_ATTEMPTS_ENV}='{bad}': give a whole number"):
            start_attempts_from_env()


def test_model_load_lines_and_this_process_group():
    line = 'I1201 22:14:20.532804 28667 model_lifecycle.cc:472] "loading: glm5:1"'
    assert model_load_line(line) == '"loading: glm5:1"'
    assert model_load_line('I1201 22:14:29.074186 28667 http_server.cc:4713] "Started HTTPService at '
                           '127.0.0.1:52573"') == '"Started HTTPService at 127.0.0.1:52573"'
    assert model_load_line("2026-12-01 22:06:30,219 INFO glm5.engine.model_runner: hybrid cache: 1466 blocks") is None
    me = [p for p in group_processes(os.getpgid(0)) if p.pid == os.getpid()]
    assert len(me) == 1 and me[0].state in "RS" and me[0].cpu_s > 0 and not me[0].is_stub
