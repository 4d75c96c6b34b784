"""The Python-backend stubs' diagnostics (glm5.serving.stub_logging): a model initialize that is still running
after ``$GLM5_INIT_STACK_DUMP_S`` seconds writes every thread's stack to the server log."""

from __future__ import annotations

import time

import pytest

from glm5.serving.stub_logging import INIT_STACK_DUMP_ENV, stacks_if_slow


def _slow_initialize(seconds: float) -> None:
    time.sleep(seconds)


def test_a_slow_block_leaves_its_stack_and_goes_on(tmp_path):
    out = tmp_path / "server.log"
    with out.open("w") as f:
        with stacks_if_slow(0.2, file=f):
            _slow_initialize(0.8)
        done = True
    text = out.read_text()
    assert done and "Timeout (0:00:00.200000)!" in text and "_slow_initialize" in text


def test_a_fast_block_leaves_nothing_and_the_timer_is_cancelled(tmp_path):
    out = tmp_path / "server.log"
    with out.open("w") as f:
        with stacks_if_slow(0.3, file=f):
            pass
        time.sleep(0.6)
    assert out.read_text() == ""


def test_the_guard_is_off_unless_the_variable_asks(monkeypatch, tmp_path):
    out = tmp_path / "server.log"
    monkeypatch.setenv(INIT_STACK_DUMP_ENV, "")
    with out.open("w") as f, stacks_if_slow(file=f):
        _slow_initialize(0.3)
    assert out.read_text() == ""
    monkeypatch.setenv(INIT_STACK_DUMP_ENV, "soon")
    with pytest.raises(ValueError, match="GLM5_INIT_STACK_DUMP_S='soon': give seconds"):
        with stacks_if_slow():
            pass
