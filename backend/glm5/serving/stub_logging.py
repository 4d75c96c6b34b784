"""Make the engine's ``logging`` records visible from inside a Triton Python-backend stub.

The stub is a plain embedded interpreter: nothing configures ``logging`` there, so the engine's
INFO lines (the kernel backends it chose, the size of the hybrid cache) were dropped. The stub's
stderr is tritonserver's, which ``glm5 serve`` shows (and scans for those lines), so one handler
on the ``glm5`` logger is enough. The level comes from the model's ``log_level`` parameter.
"""

from __future__ import annotations

import logging
import sys

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
