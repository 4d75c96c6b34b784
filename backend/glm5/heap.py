"""Short full garbage collections in a long-running engine process.

A process that has imported torch, transformers and the engine and built a model holds several hundred
thousand objects that Python's cyclic garbage collector tracks. A full (oldest-generation) collection walks
all of them (~240 ms on a 2-core CPU host for the tiny checkpoint's engine, ``bench/host_cost.py``'s ``gc``
row) and runs on whichever thread allocates when the collector's thresholds are crossed: in a server that is
usually the engine loop between two decode steps, so every stream stalls for it, and on one rank of a
distributed engine it stalls the whole world. The objects made at start-up (modules, weights' wrappers, the
tokenizer, captured graphs) live as long as the process, so they are moved to the permanent generation
(``gc.freeze``), which collections skip; what requests allocate is still collected as before. vLLM's engine
core does the same once it has started.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left unreachable, then freeze every object alive now. Call it once the engine is
    built (weights loaded, CUDA graphs captured), before serving. Returns the number of frozen objects."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("start-up heap frozen: %d objects out of the garbage collector's walk (%.0f ms)", frozen,
                (time.perf_counter() - t0) * 1e3)
    return frozen


def unfreeze_heap() -> None:
    """Hand the frozen objects back to the collector, at shutdown: the interpreter's last collection then
    finalizes them (extension objects left to exit unfinalized are reported as leaks by nanobind, Triton's
    binding library)."""
    gc.unfreeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """:func:`freeze_startup_heap` for the block (yields the frozen count), :func:`unfreeze_heap` after it: for a
    benchmark or test that times engines built in its own process as a server process runs them (a full
    collection of the unfrozen heap inside a timed pass of a few hundred ms is noise of the same size). Not
    nested: the inner block's end would unfreeze the outer block's objects too (``gc.unfreeze`` is global)."""
    try:
        yield freeze_startup_heap()
    finally:
        unfreeze_heap()


__all__ = ["freeze_startup_heap", "frozen_heap", "unfreeze_heap"]
