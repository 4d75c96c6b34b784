"""Bytes one rank holds for a config and parallel layout: weights by part of the model, cache per token / request.

Counted from the same tables the engine loads with (:func:`glm5.weights.expected_weight_shapes` for the names
and shapes, :class:`glm5.distributed.sharding.WeightSharding` for each rank's slice), so the plan in
``docs/parallelism.md`` is what a rank actually allocates. ``python -m glm5.weights.memory_plan CONFIG`` prints
the tables of that page.

Weight formats: ``bf16`` — every tensor in bf16 except the fp32 set (mHC, KDA decay, router bias, kpool ape);
``fp8`` — what the fp8 checkpoint stores as e4m3 with one fp32 scale per 128×128 block (routed and shared
experts, dense MLPs, the MLA projections and the indexer's ``wk``; model-spec §10), the rest as in ``bf16``. The
MTP layer is counted like a decoder layer in both.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from glm5.config import ModelConfig
from glm5.distributed.parallel_state import ParallelConfig, Ranks
from glm5.distributed.sharding import WeightSharding
from glm5.weights.names import expected_weight_shapes, is_fp32_weight

FP8_BLOCK = 128
#: Canonical names stored as block-scaled e4m3 in the fp8 checkpoint.
_FP8 = re.compile(r"\.mlp\.(experts\.(gate_proj|up_proj|down_proj)$|(shared_experts\.)?(gate_proj|up_proj|down_proj)"
                  r"\.weight$)|\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$"
                  r"|\.self_attn\.indexer\.wk\.weight$")
_KDA_ONLY = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|[qkv]_conv1d|f_a_proj|f_b_proj|g_a_proj|g_b_proj|b_proj"
                       r"|A_log|dt_bias|o_norm)")
PARTS = ("KDA attention", "MLA attention + indexer", "dense MLP", "shared experts", "routed experts",
         "embedding + LM head", "norms, mHC, router, MTP eh_proj", "vision tower")


def is_fp8_weight(name: str, cfg: ModelConfig) -> bool:
    """True if ``name`` is e4m3 + block scales in the fp8 checkpoint (MLA ``o_proj`` too; KDA's and the vision
    tower's stay bf16)."""
    if name.startswith("visual."):
        return False
    if _FP8.search(name):
        return True
    m = re.match(r"^layers\.(\d+)\.self_attn\.o_proj\.weight$", name)
    return bool(m) and (int(m.group(1)) >= cfg.text.num_hidden_layers or
                        cfg.text.layer_kinds[int(m.group(1))] == "mla")


def part_of(name: str, cfg: ModelConfig) -> str:
    if name.startswith("visual."):
        return "vision tower"
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return "embedding + LM head"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if re.search(r"\.mlp\.(gate|up|down)_proj\.weight$", name):
        return "dense MLP"
    if ".self_attn." in name:
        return "KDA attention" if _KDA_ONLY.search(name) or _is_kda_o_proj(name, cfg) else "MLA attention + indexer"
    return "norms, mHC, router, MTP eh_proj"


def _is_kda_o_proj(name: str, cfg: ModelConfig) -> bool:
    m = re.match(r"^layers\.(\d+)\.self_attn\.o_proj\.", name)
    return bool(m) and int(m.group(1)) < cfg.text.num_hidden_layers and cfg.text.layer_kinds[int(m.group(1))] == "kda"


def tensor_bytes(name: str, shape: tuple[int, ...], cfg: ModelConfig, weight_format: str) -> int:
    n = math.prod(shape)
    if is_fp32_weight(name):
        return 4 * n
    if weight_format == "fp8" and is_fp8_weight(name, cfg):
        *lead, rows, cols = shape
        return n + 4 * math.prod(lead) * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    if weight_format not in ("bf16", "fp8"):
        raise ValueError(f"weight_format={weight_format!r}: use bf16 or fp8")
    return 2 * n


@dataclass
class RankWeights:
    """Weight bytes of one rank, by part of the model."""

    rank: int
    parts: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PARTS})

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def rank_weight_bytes(cfg: ModelConfig, pc: ParallelConfig, weight_format: str, rank: int = 0,
                      include_mtp: bool = True) -> RankWeights:
    """What ``rank`` holds of ``cfg``'s weights under ``pc`` (the vision tower only on rank 0, the driver)."""
    sharding = WeightSharding(cfg, pc, Ranks.of(rank, pc))
    out = RankWeights(rank)
    for name, shape in expected_weight_shapes(cfg, include_mtp=include_mtp).items():
        if not sharding.held(name):
            continue
        local = sharding.local_shape(name, shape)
        out.parts[part_of(name, cfg)] += tensor_bytes(name, local, cfg, weight_format)
    return out


@dataclass
class RankCache:
    """Cache bytes of one rank: per cached token (all MLA layers incl. MTP) and per running request."""

    per_token: int      # MLA latent + pooled index key share (replicated: every rank holds every token)
    per_request: int    # KDA conv + recurrent states (split by head) + kpool tails


def rank_cache_bytes(cfg: ModelConfig, pc: ParallelConfig, elem: int = 2, include_mtp: bool = True) -> RankCache:
    t = cfg.text
    mla = len(t.mla_layer_ids) + (len(t.mtp_layer_ids) if include_mtp else 0)
    heads = t.linear_num_heads // pc.tensor_parallel_size
    per_token = mla * elem * (t.kv_lora_rank + t.index_head_dim / t.index_kpool)
    kda = len(t.kda_layer_ids) * (heads * t.linear_head_dim ** 2 * 4
                                  + (t.linear_conv_kernel_dim - 1) * 3 * heads * t.linear_head_dim * elem)
    tails = mla * t.index_kpool * 2 * t.index_head_dim * elem
    return RankCache(per_token=int(per_token), per_request=int(kda + tails))


LAYOUTS = (("TP=4", dict(tensor_parallel_size=4)), ("TP=4, EP=4", dict(tensor_parallel_size=4, expert_parallel_size=4)),
           ("TP=8", dict(tensor_parallel_size=8)), ("TP=8, EP=8", dict(tensor_parallel_size=8, expert_parallel_size=8)),
           ("TP=8, EP=8, 32 redundant", dict(tensor_parallel_size=8, expert_parallel_size=8, num_redundant_experts=32,
                                            enable_eplb=True)))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render_markdown(cfg: ModelConfig) -> str:
    """The per-rank tables of ``docs/parallelism.md`` (GiB; rank 1 = every rank but the driver)."""
    lines = ["| part (GiB per rank) | " + " | ".join(f"{n} {f}" for n, _ in LAYOUTS for f in ("bf16", "fp8")) + " |",
             "|---|" + "---:|" * (2 * len(LAYOUTS))]
    rows: dict[str, list[str]] = {p: [] for p in PARTS}
    totals0, totals1 = [], []
    for _, kw in LAYOUTS:
        pc = ParallelConfig(**kw)
        for fmt in ("bf16", "fp8"):
            r0, r1 = rank_weight_bytes(cfg, pc, fmt, 0), rank_weight_bytes(cfg, pc, fmt, 1)
            for p in PARTS:
                rows[p].append(_gib(r1.parts[p]) if p != "vision tower" else _gib(r0.parts[p]) + " (rank 0)")
            totals0.append(_gib(r0.total))
            totals1.append(_gib(r1.total))
    for p in PARTS:
        lines.append(f"| {p} | " + " | ".join(rows[p]) + " |")
    lines.append("| **total, rank 0 (driver)** | " + " | ".join(totals0) + " |")
    lines.append("| **total, every other rank** | " + " | ".join(totals1) + " |")
    lines += ["", "| cache per rank (bf16) | " + " | ".join(n for n, _ in LAYOUTS) + " |",
              "|---|" + "---:|" * len(LAYOUTS)]
    caches = [rank_cache_bytes(cfg, ParallelConfig(**kw)) for _, kw in LAYOUTS]
    lines.append("| per cached token (KiB) | " + " | ".join(f"{c.per_token / 1024:.2f}" for c in caches) + " |")
    lines.append("| per running request (MiB) | " + " | ".join(f"{c.per_request / 2**20:.1f}" for c in caches) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="per-rank weight and cache bytes for a checkpoint config")
    p.add_argument("config", type=Path, help="config.json (e.g. tests/fixtures/glm5_3_flash_config.json)")
    p.add_argument("--json", action="store_true", help="per layout and format: rank totals as JSON")
    a = p.parse_args(argv)
    cfg = ModelConfig.from_pretrained(a.config)
    if a.json:
        out = {f"{n} {f}": {"rank0": rank_weight_bytes(cfg, ParallelConfig(**kw), f, 0).total,
                            "rank1": rank_weight_bytes(cfg, ParallelConfig(**kw), f, 1).total}
               for n, kw in LAYOUTS for f in ("bf16", "fp8")}
        print(json.dumps(out, indent=1))
    else:
        print(render_markdown(cfg), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
