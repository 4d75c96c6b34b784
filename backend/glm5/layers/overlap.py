"""Independent branches of a layer on a second CUDA stream.

At small batch a decode step is a chain of launches, most of them either weight streams that take every SM or
latency-bound kernels of a few microseconds that leave the memory system idle (a router, a top-k selection, a
conv step). Where a layer has two branches that do not depend on each other, the short one can run on a side
stream while the other runs on the current one, so its kernels fill the idle time instead of adding to the
chain: the MoE's shared expert beside the router and the routed experts, the MLA query path (``q_b`` and the
absorbed ``W_UK``) beside the indexer's selection, the KDA gate projections beside the conv step and the
recurrence. CUDA graphs capture the fork and the join as graph edges, so the replay keeps the overlap.

Usage (the work inside the ``with`` is issued on the side stream; everything after it on the current stream
until ``join``)::

    with overlap.branch(x) as side:
        shared = self.shared(x)
    routing = route(x, ...)
    side.join()             # the current stream waits for the branch; ``shared`` is safe to read from here

Rules the callers keep: the branch only reads tensors that stay referenced until ``join`` (the layer's input
and activations it holds), the current stream reads the branch's outputs only after ``join``, and every branch
is joined before the layer returns (a CUDA graph capture fails on an unjoined stream). Tensors the branch
allocates come from the side stream's pool; each branch starts by waiting for the current stream, so a block
the side stream reuses was released after every read the current stream had queued before the fork.

Whether a call forks is :func:`glm5.layers.backends.overlap_backend` (``GLM5_OVERLAP_BACKEND``): on CUDA for
up to :data:`~glm5.layers.backends.OVERLAP_MAX_ROWS` rows under ``auto``; otherwise the branch runs inline,
in order, with the same kernels and the same results.
"""

from __future__ import annotations

import torch

from glm5.layers.backends import overlap_backend


class Branch:
    """One forked branch (see the module docstring); inline when ``stream`` is None. Its end is an event
    recorded on the side stream when the ``with`` block closes, so two branches forked one after the other
    are joined separately: joining the first does not wait for the second."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self._ctx = None
        self._done: torch.cuda.Event | None = None

    def __enter__(self) -> "Branch":
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None
            self._done = torch.cuda.Event()
            self._done.record(self.stream)
        return False

    def join(self) -> None:
        """Make the current stream wait for the branch's work (once; later calls and inline branches do
        nothing)."""
        if self._done is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self._done)
            self._done = None


class StreamOverlap:
    """The side stream of one model (one per CUDA device it runs on, made on first use) and the choice, per
    call, of forking or running inline. A model holds one and hands it to its layers."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def branch(self, x: torch.Tensor) -> Branch:
        """A branch for work on ``x``'s rows: forked onto the side stream when :func:`overlap_backend` says so
        for ``x``'s device and row count, else inline."""
        if overlap_backend(x.device, x.shape[0] if x.dim() else 1) != "stream":
            return Branch(None)
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return Branch(stream)


__all__ = ["Branch", "StreamOverlap"]
