"""Side-stream overlap on and off in one process: two CUDA graphs of the same decode step, timed in turn.

``python bench/overlap_ab.py OUT.json [--batches 1 8 64 256] [--ctx 1024] [--reps 200]
[--weight-dtypes bfloat16,float8_e4m3fn]`` (CUDA GPU, bench config of ``bench.py``). The layers fork their
independent branches onto a second stream (:mod:`glm5.layers.overlap`) when the ``overlap`` backend says so at
capture time, so the step is captured twice on one Setup, once with ``overlap=inline`` and once with
``overlap=stream``, and ``reps`` steps of each are timed in pairs of alternating order
(:func:`pdl_ab.paired_steps`). Writes the medians, the median of the per-pair ratios and each graph's step times.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Setup, captured_decode  # noqa: E402
from pdl_ab import _median, paired_steps, run_ab  # noqa: E402


def ab(s: Setup, batch: int, ctx: int, reps: int) -> dict:
    from glm5.layers import backends
    graphs = {}
    try:
        for mode in ("inline", "stream"):
            backends.set_backends(overlap=mode)
            graphs[mode] = captured_decode(s, batch, ctx)
    finally:
        backends.set_backends(overlap="auto")
    steps, ratios = paired_steps(graphs["inline"], graphs["stream"], reps)
    return {"batch": batch, "ctx": ctx, "weight_dtype": s.weight_dtype, "reps": reps,
            "inline_ms": _median(steps[0]) * 1e3, "stream_ms": _median(steps[1]) * 1e3,
            "stream_over_inline_median_pair": _median(ratios), "steps_inline_s": steps[0],
            "steps_stream_s": steps[1]}


def main(argv: list[str] | None = None) -> int:
    return run_ab(ab, __doc__.split("\n\n")[0], "overlap_ab.py", [1, 8, 64, 256], argv)


if __name__ == "__main__":
    raise SystemExit(main())
