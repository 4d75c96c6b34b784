"""One backend choice against another in one process: two CUDA graphs of the same decode step, timed in turn.

``python bench/backend_ab.py OUT.json --backend overlap [--modes inline stream] [--batches 1 8 64 256]
[--ctx 1024] [--reps 200] [--weight-dtypes bfloat16,float8_e4m3fn]`` (CUDA GPU, bench config of ``bench.py``).
The layers read their backend (:mod:`glm5.layers.backends`) when the step is captured, so the step is captured
once per mode on one Setup (e.g. ``overlap=inline`` and ``overlap=stream``: the side-stream branches of
:mod:`glm5.layers.overlap`; ``gemv=torch`` and ``gemv=triton``: cuBLAS or the streaming GEMV for bf16 linears),
and ``reps`` steps of each are timed in pairs of alternating order (:func:`pdl_ab.paired_steps`). Writes the
medians, the median of the per-pair ratios (second mode over first) and each graph's step times.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Setup, captured_decode  # noqa: E402
from pdl_ab import _median, paired_steps, run_ab  # noqa: E402


def ab_of(backend: str, modes: tuple[str, str]):
    """The A/B of one backend's two ``modes`` for :func:`pdl_ab.run_ab`."""
    def ab(s: Setup, batch: int, ctx: int, reps: int) -> dict:
        from glm5.layers.backends import backends_set
        graphs = []
        for mode in modes:
            with backends_set(**{backend: mode}):
                graphs.append(captured_decode(s, batch, ctx))
        steps, ratios = paired_steps(graphs[0], graphs[1], reps)
        a, b = modes
        return {"batch": batch, "ctx": ctx, "weight_dtype": s.weight_dtype, "reps": reps, "backend": backend,
                f"{a}_ms": _median(steps[0]) * 1e3, f"{b}_ms": _median(steps[1]) * 1e3,
                f"{b}_over_{a}_median_pair": _median(ratios), f"steps_{a}_s": steps[0], f"steps_{b}_s": steps[1]}
    return ab


#: The two modes compared when ``--modes`` is not given.
DEFAULT_MODES = {"overlap": ("inline", "stream"), "gemv": ("torch", "triton")}


def _add_args(ap) -> None:
    ap.add_argument("--backend", default="overlap", help="the glm5.layers.backends setting to vary")
    ap.add_argument("--modes", nargs=2, help=f"its two values (defaults: {DEFAULT_MODES})")


def _make_ab(args):
    from glm5.layers.backends import backends_set
    modes = tuple(args.modes) if args.modes else DEFAULT_MODES.get(args.backend)
    if modes is None:
        raise SystemExit(f"--backend {args.backend}: give the two --modes to compare")
    for mode in modes:   # a misspelt backend or mode fails here, before the Setup is built
        try:
            with backends_set(**{args.backend: mode}):
                pass
        except (TypeError, ValueError) as e:
            raise SystemExit(f"--backend {args.backend} --modes {' '.join(modes)}: {e}") from None
    return ab_of(args.backend, modes)


def main(argv: list[str] | None = None) -> int:
    return run_ab(_make_ab, __doc__.split("\n\n")[0], "backend_ab.py", [1, 8, 64, 256], argv, _add_args)


if __name__ == "__main__":
    raise SystemExit(main())
