"""Make the engine's ``logging`` records visible from inside a Triton Python-backend stub.

The stub is a plain embedded interpreter: nothing configures ``logging`` there, so the engine's
INFO lines (the kernel backends it chose, the size of the hybrid cache) were dropped. The stub's
stderr is tritonserver's, which ``glm5 serve`` shows (and scans for those lines), so one handler
on the ``glm5`` logger is enough. The level comes from the model's ``log_level`` parameter.

:func:`stacks_if_slow` guards a model's ``initialize``: a load still running after
``$GLM5_INIT_STACK_DUMP_S`` seconds writes every thread's Python stack to the same stderr, so a model that
never becomes ready leaves where it waits in the server log (the test suite sets it; off by default, a
real checkpoint may legitimately load for many minutes).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
from collections.abc import Iterator
from typing import TextIO

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_glm5_stub_handler"


def configure_stub_logging(level: str | None = "INFO") -> None:
    """Attach one stderr handler to the ``glm5`` logger (idempotent: a second call only sets the level)."""
    name = (level or "INFO").strip().upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        raise ValueError(f"log_level={level!r}: use DEBUG, INFO, WARNING or ERROR")
    root = logging.getLogger("glm5")
    root.setLevel(numeric)
    if not any(getattr(h, _MARK, False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        setattr(handler, _MARK, True)
        root.addHandler(handler)


INIT_STACK_DUMP_ENV = "GLM5_INIT_STACK_DUMP_S"


@contextlib.contextmanager
def stacks_if_slow(seconds: float | None = None, file: TextIO | None = None) -> Iterator[None]:
    """If the block still runs after ``seconds`` (default ``$GLM5_INIT_STACK_DUMP_S``; unset, empty or 0:
    off), every thread's stack goes to ``file`` (stderr) once, from faulthandler's watchdog thread, and the
    block goes on. One timer per process (faulthandler's), which is one per Python-backend stub."""
    if seconds is None:
        raw = os.environ.get(INIT_STACK_DUMP_ENV, "").strip()
        try:
            seconds = float(raw) if raw else 0.0
        except ValueError:
            raise ValueError(f"{INIT_STACK_DUMP_ENV}={raw!r}: give seconds (e.g. 120) or leave it unset") from None
    if seconds <= 0:
        yield
        return
    try:
        faulthandler.dump_traceback_later(seconds, repeat=False, file=file or sys.stderr, exit=False)
    except (AttributeError, ValueError, OSError) as e:  # a stderr without a file descriptor: no dump, still load
        logging.getLogger(__name__).warning("%s=%s ignored: faulthandler cannot write to stderr (%s)",
                                            INIT_STACK_DUMP_ENV, seconds, e)
        yield
        return
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
