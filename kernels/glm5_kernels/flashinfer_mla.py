"""Sparse NoPE MLA decode through FlashInfer's ``BatchMLAPagedAttentionWrapper`` (optional GPU backend).

Same computation as :func:`glm5_kernels.sparse_mla_decode.sparse_mla_decode_ref`: query row ``n``
(a decode token or one speculative-verification token) attends, per head, to the latent rows
``latent[idx[n, j]]`` picked by the indexer. FlashInfer's MLA kernel is a paged-attention kernel, so
the selection is expressed as a page table with ``page_size = 1``: every query row becomes its own
CSR "request" (``qo_len = 1``) whose page list is its selected slots and whose ``kv_len`` is its
valid count. ``head_dim_kpe = 0`` (GLM-5.3-Flash's MLA has no rope part): FlashInfer 0.7's FA2/FA3
MLA accept kpe = 0 natively, so no dummy rope columns are needed; the packed ``[.., 512]`` query
and ``[S, 1, 512]`` cache are split by the wrapper into a 512-wide part and an empty rope view.

Why the plan/run split matters (CUDA graphs):

* ``plan(counts)`` runs on the host, outside graph capture. The wrapper bakes each row's KV length
  into a host-computed work schedule (copied to device buffers it owns), so lengths must be exact:
  a planned length that reaches into the ``-1`` tail would make the kernel read row ``-1`` (illegal
  address). The counts are known on the host from positions (``min(position + 1, topk + pool
  tail)``), so planning needs no device sync. One plan serves every MLA layer of a step because
  the counts depend only on positions.
* ``run(q_lat, latent, idx)`` is device-only and capturable: a tiny Triton kernel compacts each
  row's valid prefix of ``idx`` into the CSR ``kv_indices`` buffer at the offsets the plan wrote
  (FlashInfer 0.7 requires ``kv_indptr`` to be the exact prefix sums of the lengths, so rows cannot
  keep a fixed stride with gaps), then the FA3 (SM90) or FA2 kernel runs. All buffers have fixed
  addresses (``use_cuda_graph=True`` with caller-reserved metadata buffers sized for ``max_rows``),
  so a graph captured once replays correctly after every re-plan.
* Rows past the planned ``n`` are padded as empty requests (``qo_len = 0``) so the wrapper's batch
  size - and with it the workspace layout a captured graph relies on - never changes.

Conventions: ``idx`` rows hold their valid slots first, then ``-1``; ``counts[n]`` is the number of
leading valid entries. A count of 0 (a CUDA-graph padding row) is planned as 1 and reads slot 0, so
the row's output is finite but meaningless; entries inside the planned length that are ``-1`` are
read as slot 0 instead of faulting. Output: ``[N, H, R]`` in the query dtype (bf16), not fp32 like
the Triton kernel - cast if needed.

Warm-up (JIT): ``python -m glm5_kernels.flashinfer_mla --warmup`` compiles the modules into
``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (see docs/gpu.md, "FlashInfer (optional)").
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

#: Float workspace for split-KV partial outputs; FlashInfer documents 128 MiB as the usual size.
WORKSPACE_BYTES = 128 * 1024 * 1024
#: Version this module was written and measured against (docs/gpu.md; pyproject ``gpu`` extra).
FLASHINFER_VERSION_TESTED = "0.7.2.post1"


@triton.jit
def _pack_indices_kernel(idx_ptr, stride_idx, k, indptr_ptr, lens_ptr, out_ptr, BLOCK: tl.constexpr):
    """kv_indices[indptr[r] + j] = max(idx[r, j], 0) for j < planned_len[r] (sync-free compaction)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    start = tl.load(indptr_ptr + row)
    n = tl.load(lens_ptr + row)
    mask = (cols < n) & (cols < k)
    slot = tl.load(idx_ptr + row.to(tl.int64) * stride_idx + cols, mask=mask, other=0)
    tl.store(out_ptr + start + cols, tl.maximum(slot, 0).to(tl.int32), mask=mask)


def flashinfer_mla_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """``None`` if FlashInfer's MLA can run on ``device`` (default: the current CUDA device), else why not."""
    try:
        import flashinfer.mla  # noqa: F401
    except Exception as e:  # ImportError, or a missing dependency such as tvm_ffi
        return f"flashinfer does not import ({type(e).__name__}: {e})"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return f"device {dev} is not a CUDA device"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"GPU capability ({major}, {minor}) < (8, 0): FlashInfer's MLA needs SM80+ (FA3 path SM90)"
    return None


class FlashInferSparseMLA:
    """Planned FlashInfer MLA wrapper for sparse NoPE decode / verification rows (see the module docstring).

    Args:
        num_heads: query heads ``H`` (64 for GLM-5.3-Flash, per tensor-parallel rank).
        max_rows: most query rows one :meth:`run` takes (the largest CUDA-graph batch x rows per request).
        max_k: widest index row (``index_topk + kpool - 1`` = 2051 for GLM-5.3-Flash).
        scale: softmax scale of ``q_lat . latent`` (the model's attention scale).
        head_dim: latent width ``R`` (kv_lora_rank, 512); FA3 needs 128/256/512, FA2 a multiple of 128.
        dtype: query and cache dtype (bf16 or fp16; the kernels take no fp32).
        device: CUDA device (default: current).
        backend: ``"fa3"`` (SM90), ``"fa2"`` (SM80+) or ``None`` = fa3 on SM90, else fa2.
        workspace_bytes: float workspace size.

    Usage per decode step: ``plan(counts)`` once on the host (outside graph capture), then
    ``run(q_lat, latent, idx)`` for each MLA layer (capturable).
    """

    def __init__(self, num_heads: int, max_rows: int, max_k: int, scale: float, *, head_dim: int = 512,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 backend: str | None = None, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        reason = flashinfer_mla_unavailable_reason(dev)
        if reason is not None:
            raise RuntimeError(f"FlashInferSparseMLA cannot run: {reason}. Install flashinfer-python=="
                               f"{FLASHINFER_VERSION_TESTED} (docs/gpu.md) or use the Triton decode kernel")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype}: FlashInfer's MLA kernels take bf16 or fp16 (cast the query and cache)")
        if max_rows < 1 or max_k < 1:
            raise ValueError(f"max_rows={max_rows}, max_k={max_k}: both must be >= 1")
        if head_dim % 128:
            raise ValueError(f"head_dim={head_dim}: FlashInfer's MLA needs a multiple of 128")
        major = torch.cuda.get_device_capability(dev)[0]
        # FlashInfer's MLAPlan carves split-KV partial outputs for 2 tiles of 64 rows per SM out of the
        # workspace; below that, plan() fails deep inside the C++ planner with a generic message.
        need = 2 * torch.cuda.get_device_properties(dev).multi_processor_count * 64 * (head_dim * 2 + 4) + (1 << 20)
        if workspace_bytes < need:
            raise ValueError(f"workspace_bytes={workspace_bytes} < {need} needed for split-KV partials on this GPU "
                             f"(keep the default {WORKSPACE_BYTES})")
        if backend is None:
            backend = "fa3" if major == 9 else "fa2"
        if backend not in ("fa2", "fa3"):
            raise ValueError(f"backend={backend!r}: use 'fa3' (SM90) or 'fa2' (SM80+)")
        if backend == "fa3" and major != 9:
            raise ValueError(f"backend='fa3' needs an SM90 GPU, this one is SM{major}x; use backend='fa2'")
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.num_heads, self.max_rows, self.max_k, self.scale = num_heads, max_rows, max_k, float(scale)
        self.head_dim, self.dtype, self.device, self.backend = head_dim, dtype, dev, backend
        i32 = dict(dtype=torch.int32, device=dev)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
        # Caller-reserved metadata buffers: the wrapper copies each plan into them, so their addresses
        # (baked into captured graphs) never change. kv_indices starts at 0 and only ever receives
        # clamped (>= 0) slots, so a stale entry can never be an illegal address.
        self._qo_indptr = torch.zeros(max_rows + 1, **i32)
        self._kv_indptr = torch.zeros(max_rows + 1, **i32)
        self._kv_indices = torch.zeros(max_rows * max_k, **i32)
        self._kv_lens = torch.zeros(max_rows, **i32)
        self.wrapper = BatchMLAPagedAttentionWrapper(
            self._workspace, use_cuda_graph=True, qo_indptr=self._qo_indptr, kv_indptr=self._kv_indptr,
            kv_indices=self._kv_indices, kv_len_arr=self._kv_lens, backend=backend)
        # Host staging (pageable on purpose: a pinned buffer could be rewritten by the next plan while
        # the previous non-blocking copy is still in flight).
        self._arange = torch.arange(max_rows + 1, dtype=torch.int32)
        self._qo_host = torch.empty(max_rows + 1, dtype=torch.int32)
        self._kv_host = torch.zeros(max_rows + 1, dtype=torch.int32)
        self._len_host = torch.zeros(max_rows, dtype=torch.int32)
        self.rows = 0  # rows covered by the current plan; run() must get exactly this many
        logger.info("FlashInfer sparse MLA: backend=%s heads=%d R=%d max_rows=%d max_k=%d dtype=%s",
                    backend, num_heads, head_dim, max_rows, max_k, dtype)

    def plan(self, counts: Sequence[int] | torch.Tensor) -> None:
        """Schedule the next :meth:`run` calls for ``len(counts)`` rows (host only, not capturable).

        ``counts[n]``: valid (leading, non ``-1``) entries of ``idx[n]``; 0 marks a padding row.
        Must be a list or a CPU tensor: a CUDA tensor would force a device sync here.
        """
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlashInferSparseMLA.plan() was called during CUDA-graph capture: plan before "
                               "capturing/replaying; only run() is capturable")
        if isinstance(counts, torch.Tensor):
            if counts.device.type != "cpu":
                raise ValueError(f"counts is on {counts.device}: pass host counts (derived from positions); "
                                 "reading a device tensor would sync the step")
            c = counts.to(torch.int32).reshape(-1)
        else:
            c = torch.tensor(list(counts), dtype=torch.int32)
        n = c.numel()
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"{n} rows planned: must be in [1, max_rows={self.max_rows}] (raise max_rows)")
        lo, hi = int(c.min()), int(c.max())
        if lo < 0 or hi > self.max_k:
            raise ValueError(f"counts span [{lo}, {hi}]: each must be in [0, max_k={self.max_k}]")
        torch.clamp(self._arange, max=n, out=self._qo_host)          # rows >= n: empty requests
        self._len_host.zero_()
        self._len_host[:n] = c.clamp(min=1)                           # 0 = padding row, read 1 slot
        torch.cumsum(self._len_host, dim=0, out=self._kv_host[1:])
        total = int(self._kv_host[-1])
        from flashinfer.mla import MLAPlanMetadata

        self.wrapper.plan(
            metadata=MLAPlanMetadata.csr(self._qo_host, self._kv_host, self._kv_indices[:total], self._len_host),
            num_heads=self.num_heads, head_dim_ckv=self.head_dim, head_dim_kpe=0, page_size=1, causal=False,
            sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        self.rows = n

    def run(self, q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """``q_lat [N, H, R]``, ``latent [S, R]``, ``idx [N, K]`` (int, -1 padded) -> ``[N, H, R]`` (query dtype).

        Device-only and CUDA-graph capturable (checks use shapes, never values). ``N`` must equal the
        planned row count; ``idx``'s valid prefixes must match the planned counts.
        """
        if self.rows == 0:
            raise RuntimeError("FlashInferSparseMLA.run() before plan(): call plan(counts) for this step first")
        n, h, r = q_lat.shape
        if n != self.rows or h != self.num_heads or r != self.head_dim:
            raise ValueError(f"q_lat shape {tuple(q_lat.shape)} != planned ({self.rows}, {self.num_heads}, "
                             f"{self.head_dim}); re-plan with one count per query row")
        if latent.dim() != 2 or latent.shape[1] != r or latent.stride(1) != 1:
            raise ValueError(f"latent shape {tuple(latent.shape)} stride {latent.stride()}: need [S, {r}] with "
                             "contiguous rows")
        if q_lat.dtype != self.dtype or latent.dtype != self.dtype:
            raise ValueError(f"q_lat {q_lat.dtype} / latent {latent.dtype} must both be {self.dtype} (as planned)")
        if idx.dim() != 2 or idx.shape[0] != n or idx.shape[1] > self.max_k:
            raise ValueError(f"idx shape {tuple(idx.shape)}: need [{n}, K <= max_k={self.max_k}]")
        if idx.stride(1) != 1:
            idx = idx.contiguous()
        k = idx.shape[1]
        block = 256
        _pack_indices_kernel[(n, triton.cdiv(k, block))](idx, idx.stride(0), k, self._kv_indptr, self._kv_lens,
                                                         self._kv_indices, BLOCK=block, num_warps=4)
        return self.wrapper.run(query=q_lat.contiguous(), kv_cache=latent.unsqueeze(1), out=out)

    __call__ = run


# ------------------------------------------------------------------------------------------- warm-up
def jit_cache_dir() -> Path:
    """Where FlashInfer puts compiled modules (``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<ver>/<arch>``)."""
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_WORKSPACE_DIR)


def built_modules() -> list[Path]:
    """Compiled JIT module files (``cached_ops/<name>/<name>.so``) currently in the cache."""
    from flashinfer.jit import env as jit_env

    root = Path(jit_env.FLASHINFER_JIT_DIR)
    return sorted(p for p in root.glob("*/*.so") if p.stem == p.parent.name) if root.exists() else []


def install_prebuilt(so_files: Sequence[str | Path]) -> list[Path]:
    """Copy compiled modules into flashinfer's ``data/aot/<name>/<name>.so`` so they load without nvcc.

    FlashInfer loads an AOT artifact at that path before trying to JIT (``jit/core.py: try_load``).
    The files must come from the same flashinfer version, CUDA major and GPU arch.
    """
    from flashinfer.jit import env as jit_env

    placed = []
    for f in map(Path, so_files):
        if f.suffix != ".so":
            raise ValueError(f"{f}: expected a compiled module named <module>.so")
        dest = Path(jit_env.FLASHINFER_AOT_DIR) / f.stem / f.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
        placed.append(dest)
    return placed


def warmup(device: torch.device | str = "cuda", mla_backends: Sequence[str] = ("auto",),
           sampling: bool = True, num_heads: int = 64, head_dim: int = 512,
           dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Build (or load) every FlashInfer module this project uses, in parallel; returns seconds per module.

    Goes through the same public calls the engine makes (a real plan + run, a real sampling call), so
    the compiled variants are exactly the ones needed later. First run on a fresh machine compiles with
    nvcc (minutes); later runs load the cached ``.so`` in well under a second.
    """
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device(dev.type, torch.cuda.current_device())
    major = torch.cuda.get_device_capability(dev)[0]
    backends = ["fa3" if major == 9 else "fa2" if b == "auto" else b for b in mla_backends]
    times: dict[str, float] = {}
    errors: list[BaseException] = []

    def mla(backend: str) -> None:
        t0 = time.perf_counter()
        try:
            torch.cuda.set_device(dev)
            m = FlashInferSparseMLA(num_heads, 1, 4, head_dim ** -0.5, head_dim=head_dim, dtype=dtype,
                                    device=dev, backend=backend)
            m.plan([3])
            q = torch.randn(1, num_heads, head_dim, device=dev, dtype=dtype)
            lat = torch.randn(8, head_dim, device=dev, dtype=dtype)
            m.run(q, lat, torch.tensor([[1, 5, 2, -1]], device=dev, dtype=torch.int32))
            torch.cuda.synchronize(dev)
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
        times[f"mla_{backend}"] = time.perf_counter() - t0

    def samp() -> None:
        t0 = time.perf_counter()
        try:
            torch.cuda.set_device(dev)
            import flashinfer.sampling as fs  # one JIT module ("sampling") holds every sampling kernel

            logits = torch.randn(2, 64, device=dev)
            fs.top_k_top_p_sampling_from_logits(logits, torch.tensor([5, 64], device=dev, dtype=torch.int32),
                                                torch.tensor([0.9, 1.0], device=dev))
            torch.cuda.synchronize(dev)
        except BaseException as e:
            errors.append(e)
        times["sampling"] = time.perf_counter() - t0

    threads = [threading.Thread(target=mla, args=(b,)) for b in backends]
    if sampling:
        threads.append(threading.Thread(target=samp))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times["total"] = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm5_kernels.flashinfer_mla",
                                description="Warm FlashInfer's JIT cache for the modules glm5 uses.")
    p.add_argument("--warmup", action="store_true", help="build/load the MLA and sampling modules, print timings")
    p.add_argument("--mla-backends", default="auto", help="comma list of fa3,fa2 (auto = fa3 on SM90, else fa2)")
    p.add_argument("--no-sampling", action="store_true", help="skip the sampling module")
    p.add_argument("--export", metavar="DIR", help="after warm-up, copy the compiled .so files (flat) into DIR")
    p.add_argument("--install-prebuilt", nargs="+", metavar="SO",
                   help="copy previously exported .so files into flashinfer's AOT dir (no nvcc needed)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.install_prebuilt:
        for dest in install_prebuilt(args.install_prebuilt):
            logger.info("installed %s", dest)
    if not args.warmup:
        if not args.install_prebuilt:
            p.error("nothing to do: pass --warmup and/or --install-prebuilt")
        return 0
    logger.info("FlashInfer JIT cache: %s (FLASHINFER_WORKSPACE_BASE=%s)", jit_cache_dir(),
                os.environ.get("FLASHINFER_WORKSPACE_BASE", "~"))
    times = warmup(mla_backends=args.mla_backends.split(","), sampling=not args.no_sampling)
    for name, sec in times.items():
        logger.info("warm-up %-10s %.1f s", name, sec)
    mods = built_modules()
    for so in mods:
        logger.info("module %s (%.1f MiB)", so, so.stat().st_size / 2**20)
    if args.export:
        out = Path(args.export)
        out.mkdir(parents=True, exist_ok=True)
        for so in mods:
            shutil.copy2(so, out / so.name)
        logger.info("exported %d modules to %s", len(mods), out)
    print({k: round(v, 2) for k, v in times.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
