"""Tensor and expert parallelism: how the model is split over ranks and the collectives between them.

* :mod:`glm5.distributed.parallel_state` — the parallel layout (:class:`ParallelConfig`), one rank's place in
  it (:class:`Ranks`) and the process groups plus the collectives the network calls (:class:`ParallelContext`).
* :mod:`glm5.distributed.sharding` — which slice of every canonical weight a rank holds (one table shared by
  the loader, the dummy weights and the memory plan).
* :mod:`glm5.distributed.eplb` — expert-parallel load balancing: load counters, redundant expert placement,
  the logical → physical expert map.

Processes (the driver and its workers) are the engine's business: :mod:`glm5.engine.executor`.
"""

from glm5.distributed.parallel_state import ParallelConfig, ParallelContext, Ranks

__all__ = ["ParallelConfig", "ParallelContext", "Ranks"]
