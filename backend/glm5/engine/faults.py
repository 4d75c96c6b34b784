"""Fault injection for tests of the engine's failure handling (off unless ``EngineArgs.test_faults`` is set).

Failure handling cannot be tested through a real server with real faults: validation stops every bad
input we know of, and a CPU has no CUDA context to lose. ``test_faults`` makes a step fail the way a
real fault would, *after* the model has run (so the caches of every request in the step have been
written, as in a failure deep inside a kernel), triggered by a token id that a test puts in one
request's prompt:

* ``request_error_token_id``: a step containing that token raises a plain ``RuntimeError``, the kind
  a request-specific bug raises; the engine must fail only that request.
* ``fatal_error_token_id``: a step containing it raises what torch raises after an illegal memory
  access (``"CUDA error: an illegal memory access was encountered"``); the engine must declare
  itself dead.

The hook only ever raises; it reads nothing and changes nothing. Production configs leave it unset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm5.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class FaultInjection:
    request_error_token_id: int | None = None
    fatal_error_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "FaultInjection | None":
        if not d:
            return None
        known = {"request_error_token_id", "fatal_error_token_id"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"test_faults: unknown key(s) {unknown}; valid: {sorted(known)}")
        return cls(**{k: None if v is None else int(v) for k, v in d.items()})

    def check(self, sched: SchedulerOutput) -> None:
        """Raise the configured fault when a scheduled chunk's tokens contain its trigger token."""
        tokens: set[int] = set()
        for c in sched.chunks:
            s = c.seq
            tokens.update(s.tokens(s.num_computed_tokens, s.num_computed_tokens + c.num_tokens))
        if self.fatal_error_token_id is not None and self.fatal_error_token_id in tokens:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by test_faults)")
        if self.request_error_token_id is not None and self.request_error_token_id in tokens:
            raise RuntimeError("injected request fault (test_faults.request_error_token_id)")
