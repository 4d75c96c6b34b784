"""Weight memory of a model per GPU under tensor/expert parallelism, from its config alone (no weights read).

Storage variants: ``bfloat16`` (every tensor in bf16 except the fp32 set), ``fp8 checkpoint`` (what the
published GLM-5.3-Flash fp8 checkpoint stores as e4m3, model-spec §10: routed and shared experts, dense MLPs,
MLA projections and the indexer's wq_b / wk; KDA projections stay bf16; kept by ``quantization=auto``) and
``fp8 online`` (``quantization=fp8``: every :func:`~glm5.weights.names.is_fp8_linear_weight` projection).
fp8 counts 1 byte per weight plus one fp32 scale per 128 x 128 tile.

Sharding model (the design's TP/EP layout): routed experts split over EP ranks; the other 2-D weights
(attention and indexer projections, dense MLPs, shared expert, convolutions, vocab-parallel embedding and LM
head) over TP ranks; 1-D tensors (norms, biases), mHC parameters, the router and the vision tower replicated.
Bytes per GPU = replicated + sharded / N. KV cache and activations are not included.
"""

from __future__ import annotations

import re

from glm5.config import ModelConfig
from glm5.weights.names import expected_weight_shapes, is_fp8_linear_weight, is_fp32_weight

#: What the published fp8 checkpoint stores as e4m3 (model-spec §10); KDA projections stay bf16 there.
_CHECKPOINT_FP8_RE = re.compile(r"\.(?:mlp\.|self_attn\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|"
                                r"indexer\.wq_b|indexer\.wk)\.weight$)")
VARIANTS = ("bfloat16", "fp8 checkpoint", "fp8 online")
TP_SIZES = (1, 2, 4, 8)


def _is_checkpoint_fp8(name: str, kda_layers: set[int]) -> bool:
    if not is_fp8_linear_weight(name):
        return False
    m = re.match(r"^layers\.(\d+)\.", name)
    if m and int(m.group(1)) in kda_layers and ".self_attn." in name:
        return False
    return _CHECKPOINT_FP8_RE.search(name) is not None or name.endswith("eh_proj.weight")


def tensor_bytes(name: str, shape: tuple[int, ...], variant: str, kda_layers: set[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    fp8 = (variant == "fp8 online" and is_fp8_linear_weight(name)) or \
          (variant == "fp8 checkpoint" and _is_checkpoint_fp8(name, kda_layers))
    if fp8:
        *lead, rows, cols = shape
        tiles = -(-rows // 128) * -(-cols // 128)
        for s in lead:
            tiles *= s
        return n + 4 * tiles
    return n * (4 if is_fp32_weight(name) else 2)


def placement(name: str, shape: tuple[int, ...]) -> str:
    """``ep`` (split over expert-parallel ranks), ``tp`` (split over tensor-parallel ranks) or ``replicated``."""
    if name.startswith("visual."):
        return "replicated"
    if ".mlp.experts." in name:
        return "ep"
    if len(shape) == 1 or ".hc_" in name or name.endswith("mlp.gate.weight") or "index_kpool_compress_ape" in name:
        return "replicated"
    return "tp"


def memory_table(cfg: ModelConfig) -> dict:
    """``{"params", "parts_bytes": {variant: {ep, tp, replicated}}, "rows": [{weights, tp_ep, bytes_per_gpu, ...}]}``."""
    shapes = expected_weight_shapes(cfg, include_mtp=True)
    kda = set(cfg.text.kda_layer_ids)
    totals = {v: {"ep": 0, "tp": 0, "replicated": 0} for v in VARIANTS}
    params = 0
    for name, shape in shapes.items():
        where = placement(name, shape)
        for v in VARIANTS:
            totals[v][where] += tensor_bytes(name, shape, v, kda)
        n = 1
        for s in shape:
            n *= s
        params += n
    rows = []
    for v in VARIANTS:
        t = totals[v]
        for size in TP_SIZES:
            per_gpu = t["replicated"] + (t["tp"] + t["ep"]) / size
            rows.append({"weights": v, "tp_ep": size, "bytes_per_gpu": int(per_gpu), "GB_per_gpu": per_gpu / 1e9,
                         "GiB_per_gpu": per_gpu / 2**30})
    return {"params": params, "parts_bytes": totals, "rows": rows,
            "note": "weights only (MTP layer and vision tower included); KV cache and activations excluded"}


def memory_markdown(table: dict, hbm_gb: float = 141.0) -> str:
    lines = [f"Weights per GPU, GLM-5.3-Flash ({table['params'] / 1e9:.1f} B parameters incl. MTP and vision), "
             "GB (1e9 bytes); (no) = more than a 141 GB H200 holds:", "",
             "| weights | TP=EP=1 | 2 | 4 | 8 |", "|---|---:|---:|---:|---:|"]
    for v in VARIANTS:
        cells = []
        for r in (r for r in table["rows"] if r["weights"] == v):
            cells.append(f"{r['GB_per_gpu']:.1f}" + ("" if r["GB_per_gpu"] < hbm_gb else " (no)"))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"



__all__ = ["TP_SIZES", "VARIANTS", "memory_markdown", "memory_table", "placement", "tensor_bytes"]
