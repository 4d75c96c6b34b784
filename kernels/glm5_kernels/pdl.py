"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and newer.

A decode step at batch 1 is ~200 kernels of 1-60 µs replayed from one CUDA graph; between two graph nodes the
GPU drains the first kernel's last wave, then launches and ramps up the second. A kernel launched with PDL
(``launch_pdl=True``) may be scheduled while its predecessor still runs: its programs start, do what does not
depend on the predecessor (read weights), then block in ``griddepcontrol.wait`` until the predecessor has
finished and its writes are visible. Measured on the H200 (2026-12-02, CUDA-graph chains): 1.27 -> 0.91 µs per
node for tiny kernels; a 4096 x 4096 fp8 GEMV 6.58 -> 5.72 µs when it loads its first weight tile before the
wait; a cuBLAS GEMV followed by a small Triton kernel 15.1 -> 14.2 µs per pair.

The rule that keeps it correct: a kernel launched with PDL executes :func:`pdl_enter` in every program before it
touches memory that an earlier kernel may write (or read: a later write must not overtake it), and before it can
exit, so that its completion still implies its predecessor's. Each kernel takes a ``USE_PDL`` constexpr; its
launcher passes :func:`pdl_kwargs`, which sets that constexpr and the launch flag together.

It is on by default on GPUs of compute capability >= 9.0 (never under the Triton interpreter); ``GLM5_PDL=0``
turns it off. Separate runs disagreed on its effect end to end (leases and minutes apart differ by more than
PDL moves a step), so ``bench/pdl_ab.py`` captures the decode step with and without it on one Setup and times
the two graphs in alternating pairs: on the H200 (2026-12-03) PDL made the batch-1 step 2.2 % (bf16) and 4.9 %
(fp8) faster and left batch 64 within 0.5 % (bench/results/pdl_ab_h200.json).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glm5_kernels.device import compute_capability, interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # Triton before 3.4 has no griddepcontrol wrappers: PDL stays off, the kernels still load
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

ENV = "GLM5_PDL"


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: not turned off (``GLM5_PDL=0``), a CUDA device of compute capability
    >= 9.0, a Triton with the griddepcontrol wrappers (3.4 and newer), and not the interpreter."""
    if not HAVE_GDC or device.type != "cuda" or os.environ.get(ENV, "1") == "0" or interpreting():
        return False
    cap = compute_capability(device)
    return cap is not None and cap[0] >= 9


def pdl_kwargs(device: torch.device) -> dict[str, bool]:
    """The launch keywords for a kernel with a ``USE_PDL`` constexpr: the constexpr and Triton's ``launch_pdl``
    together, or nothing (the kernel's default ``USE_PDL=False``, an ordinary launch)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the preceding kernel (its writes visible), then let the next PDL kernel be scheduled: that one
    waits for this whole grid in turn, so releasing it at the start is safe and overlaps its launch with our
    work."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


__all__ = ["ENV", "HAVE_GDC", "pdl_enabled", "pdl_enter", "pdl_kwargs"]
