"""Canonical in-engine weight names and shapes, and the mapping from checkpoint keys to them.

The canonical names are the original GLM-5.3-Flash checkpoint names with the
``model.language_model.`` prefix stripped (``model.visual.`` becomes ``visual.``; ``lm_head.weight``
is unchanged), except routed experts, which are stacked per layer into
``layers.{i}.mlp.experts.{gate,up,down}_proj`` ([E, I, H] / [E, I, H] / [E, H, I], no ``.weight``).
Every other part of the engine consumes exactly these names, so the shapes derived here from the
config are the single source of truth that loader, dummy weights and model agree on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from glm5.config import MlpKind, ModelConfig, TextConfig, VisionConfig
from glm5_kernels.fp8_ref import SCALE_SUFFIX  # noqa: F401  (re-exported: "x.weight" -> "x.weight_scale_inv")

Shape = tuple[int, ...]

#: Canonical-name suffixes of tensors that stay fp32 whatever compute dtype is requested: the mHC
#: mixing parameters, the KDA decay parameters, the router's selection bias and the kpool position
#: bias. They feed exp/sigmoid/Sinkhorn or score comparisons where bf16 rounding visibly changes
#: routing and mixing (HF keeps the same set in fp32).
FP32_WEIGHT_SUFFIXES: tuple[str, ...] = (
    ".hc_attn_fn",
    ".hc_attn_base",
    ".hc_attn_scale",
    ".hc_ffn_fn",
    ".hc_ffn_base",
    ".hc_ffn_scale",
    ".self_attn.A_log",
    ".self_attn.dt_bias",
    ".mlp.gate.e_score_correction_bias",
    ".indexer.index_kpool_compress_ape",
)


def is_fp32_weight(name: str) -> bool:
    """True if the canonical tensor ``name`` must be kept in fp32 (see :data:`FP32_WEIGHT_SUFFIXES`)."""
    return name.endswith(FP32_WEIGHT_SUFFIXES)


#: Canonical names of the stacked routed-expert tensors end with one of these (no ``.weight``).
EXPERT_PROJS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")


# The text model's projections: what online fp8 quantisation (quantization="fp8") stores in fp8. Left in the
# model dtype on purpose: the router (routing is a comparison of scores), embeddings and LM head (the published
# fp8 checkpoint keeps them bf16), the indexer's head weights and kpool compression gate (they steer top-k
# selection; 32 and 128 rows, a few hundred KB per layer), norms, convolutions and the vision tower.
_FP8_LINEAR_RE = re.compile(
    r"^layers\.\d+\.(?:"
    r"self_attn\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|q_proj|k_proj|v_proj|f_a_proj|f_b_proj"
    r"|g_a_proj|g_b_proj|b_proj|indexer\.wq_b|indexer\.wk)\.weight"
    r"|mlp\.(?:shared_experts\.)?(?:gate_proj|up_proj|down_proj)\.weight"
    r"|mlp\.experts\.(?:gate_proj|up_proj|down_proj)"
    r"|eh_proj\.weight)$")


_LINEAR_ONLY_RE = re.compile(r"^(?:lm_head\.weight|layers\.\d+\.self_attn\.indexer\.weights_proj\.weight)$")


def is_fp8_linear_weight(name: str) -> bool:
    """True if online fp8 quantisation stores the canonical tensor ``name`` as block-scaled fp8 (see
    :data:`_FP8_LINEAR_RE` for what stays in the model dtype and why)."""
    return _FP8_LINEAR_RE.match(name) is not None


def can_stay_fp8(name: str) -> bool:
    """True if the engine applies ``name`` through a :class:`glm5.layers.linear.Linear` (or the fused MoE), so an
    fp8 copy in the checkpoint can stay fp8: the online set plus the LM head and the indexer's head weights.
    Anything else a checkpoint stores in fp8 (an embedding, the router) is dequantized at load."""
    return is_fp8_linear_weight(name) or _LINEAR_ONLY_RE.match(name) is not None


# ---------------------------------------------------------------------------------------------
# expected shapes
# ---------------------------------------------------------------------------------------------
def _hc_shapes(p: str, t: TextConfig) -> dict[str, Shape]:
    n = t.hc_mult
    rows = (2 + n) * n
    out: dict[str, Shape] = {}
    for site in ("attn", "ffn"):
        out[f"{p}hc_{site}_fn"] = (rows, n * t.hidden_size)
        out[f"{p}hc_{site}_base"] = (rows,)
        out[f"{p}hc_{site}_scale"] = (3,)
    return out


def _kda_shapes(p: str, t: TextConfig) -> dict[str, Shape]:
    h, d, heads = t.hidden_size, t.linear_head_dim, t.linear_num_heads
    qkv = heads * d
    a = f"{p}self_attn."
    out: dict[str, Shape] = {}
    for x in "qkv":
        out[f"{a}{x}_proj.weight"] = (qkv, h)
    for x in "qkv":
        out[f"{a}{x}_conv1d.weight"] = (qkv, 1, t.linear_conv_kernel_dim)
    out.update({
        f"{a}f_a_proj.weight": (d, h),
        f"{a}f_b_proj.weight": (qkv, d),
        f"{a}g_a_proj.weight": (d, h),
        f"{a}g_b_proj.weight": (qkv, d),
        f"{a}b_proj.weight": (heads, h),
        f"{a}A_log": (heads,),
        f"{a}dt_bias": (qkv,),
        f"{a}o_norm.weight": (d,),
        f"{a}o_proj.weight": (h, qkv),
    })
    return out


def _mla_shapes(p: str, t: TextConfig) -> dict[str, Shape]:
    h, heads = t.hidden_size, t.num_attention_heads
    assert t.q_lora_rank is not None  # TextConfig.validate guarantees it
    a = f"{p}self_attn."
    out: dict[str, Shape] = {
        f"{a}q_a_proj.weight": (t.q_lora_rank, h),
        f"{a}q_a_layernorm.weight": (t.q_lora_rank,),
        f"{a}q_b_proj.weight": (heads * t.qk_head_dim, t.q_lora_rank),
        f"{a}kv_a_proj_with_mqa.weight": (t.kv_lora_rank + t.qk_rope_head_dim, h),
        f"{a}kv_a_layernorm.weight": (t.kv_lora_rank,),
        f"{a}kv_b_proj.weight": (heads * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank),
        f"{a}o_proj.weight": (h, heads * t.v_head_dim),
    }
    if t.attention_bias:  # HF puts a bias on q_a, kv_a and o only
        out[f"{a}q_a_proj.bias"] = (t.q_lora_rank,)
        out[f"{a}kv_a_proj_with_mqa.bias"] = (t.kv_lora_rank + t.qk_rope_head_dim,)
        out[f"{a}o_proj.bias"] = (h,)
    ix, idim = f"{a}indexer.", t.index_head_dim
    out.update({
        f"{ix}wq_b.weight": (t.index_n_heads * idim, t.q_lora_rank),
        f"{ix}wk.weight": (idim, h),
        f"{ix}k_norm.weight": (idim,),
        f"{ix}k_norm.bias": (idim,),
        f"{ix}weights_proj.weight": (t.index_n_heads, h),
        f"{ix}index_kpool_compress_gate": (idim, h),
        f"{ix}index_kpool_compress_ape": (t.index_kpool, idim),
    })
    return out


def _mlp_shapes(p: str, t: TextConfig, kind: MlpKind) -> dict[str, Shape]:
    h = t.hidden_size
    m = f"{p}mlp."
    if kind == "dense":
        i = t.intermediate_size
        return {f"{m}gate_proj.weight": (i, h), f"{m}up_proj.weight": (i, h), f"{m}down_proj.weight": (h, i)}
    e, i = t.n_routed_experts, t.moe_intermediate_size
    out: dict[str, Shape] = {
        f"{m}gate.weight": (e, h),
        f"{m}gate.e_score_correction_bias": (e,),
        f"{m}experts.gate_proj": (e, i, h),
        f"{m}experts.up_proj": (e, i, h),
        f"{m}experts.down_proj": (e, h, i),
    }
    si = i * t.n_shared_experts
    if si > 0:
        out.update({
            f"{m}shared_experts.gate_proj.weight": (si, h),
            f"{m}shared_experts.up_proj.weight": (si, h),
            f"{m}shared_experts.down_proj.weight": (h, si),
        })
    return out


def _vision_shapes(v: VisionConfig) -> dict[str, Shape]:
    hid, out_h, m = v.hidden_size, v.out_hidden_size, v.spatial_merge_size
    bias = v.attention_bias  # HF uses it for qkv, proj and the block MLP
    out: dict[str, Shape] = {
        "visual.patch_embed.proj.weight": (hid, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "visual.patch_embed.proj.bias": (hid,),
    }
    for b in range(v.depth):
        p = f"visual.blocks.{b}."
        out[f"{p}norm1.weight"] = (hid,)
        out[f"{p}norm2.weight"] = (hid,)
        out[f"{p}attn.qkv.weight"] = (3 * hid, hid)
        out[f"{p}attn.q_norm.weight"] = (v.head_dim,)
        out[f"{p}attn.k_norm.weight"] = (v.head_dim,)
        out[f"{p}attn.proj.weight"] = (hid, hid)
        out[f"{p}mlp.gate_proj.weight"] = (v.intermediate_size, hid)
        out[f"{p}mlp.up_proj.weight"] = (v.intermediate_size, hid)
        out[f"{p}mlp.down_proj.weight"] = (hid, v.intermediate_size)
        if bias:
            out[f"{p}attn.qkv.bias"] = (3 * hid,)
            out[f"{p}attn.proj.bias"] = (hid,)
            out[f"{p}mlp.gate_proj.bias"] = (v.intermediate_size,)
            out[f"{p}mlp.up_proj.bias"] = (v.intermediate_size,)
            out[f"{p}mlp.down_proj.bias"] = (hid,)
    pi = v.projection_intermediate_size
    out.update({
        "visual.post_layernorm.weight": (hid,),
        "visual.downsample.weight": (out_h, hid, m, m),
        "visual.downsample.bias": (out_h,),
        "visual.merger.proj.weight": (out_h, out_h),
        "visual.merger.post_projection_norm.weight": (out_h,),
        "visual.merger.post_projection_norm.bias": (out_h,),
        "visual.merger.gate_proj.weight": (pi, out_h),
        "visual.merger.up_proj.weight": (pi, out_h),
        "visual.merger.down_proj.weight": (out_h, pi),
    })
    return out


def mtp_weight_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Shapes of the MTP layers' tensors (``layers.{L}.*`` for every L in ``cfg.text.mtp_layer_ids``)."""
    t = cfg.text
    h = t.hidden_size
    out: dict[str, Shape] = {}
    for layer in t.mtp_layer_ids:
        p = f"layers.{layer}."
        out[f"{p}enorm.weight"] = (h,)
        out[f"{p}hnorm.weight"] = (h,)
        out[f"{p}eh_proj.weight"] = (h, 2 * h)
        out[f"{p}shared_head.norm.weight"] = (h,)
        out[f"{p}input_layernorm.weight"] = (h,)
        out[f"{p}post_attention_layernorm.weight"] = (h,)
        out.update(_mla_shapes(p, t))
        out.update(_mlp_shapes(p, t, t.mtp_mlp_kind()))
    return out


def expected_weight_shapes(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Shape]:
    """Every canonical tensor name the engine needs, with its shape, derived from ``cfg``.

    ``include_mtp=False`` leaves out the MTP layers (what a server without speculative decoding
    needs). Vision tensors are included iff ``cfg.vision`` is set.
    """
    t = cfg.text
    h = t.hidden_size
    out: dict[str, Shape] = {"embed_tokens.weight": (t.vocab_size, h)}
    for i in range(t.num_hidden_layers):
        p = f"layers.{i}."
        out[f"{p}input_layernorm.weight"] = (h,)
        out[f"{p}post_attention_layernorm.weight"] = (h,)
        out.update(_hc_shapes(p, t))
        out.update(_kda_shapes(p, t) if t.layer_kinds[i] == "kda" else _mla_shapes(p, t))
        out.update(_mlp_shapes(p, t, t.mlp_kinds[i]))
    out["norm.weight"] = (h,)
    out["lm_head.weight"] = (t.vocab_size, h)
    if include_mtp:
        out.update(mtp_weight_shapes(cfg))
    if cfg.vision is not None:
        out.update(_vision_shapes(cfg.vision))
    return out


def is_mtp_name(name: str, cfg: ModelConfig) -> bool:
    """True if the canonical ``name`` belongs to an MTP layer of ``cfg``."""
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) in cfg.text.mtp_layer_ids


# ---------------------------------------------------------------------------------------------
# checkpoint key -> canonical name
# ---------------------------------------------------------------------------------------------
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
# Prefixes in the order they are tried; the first match is stripped (or replaced).
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", ""),
    ("model.visual.", "visual."),
    ("language_model.model.", ""),
    ("language_model.", ""),
    ("model.", ""),
)
# HF's in-memory (packed) names -> original names, applied after the prefix is stripped.
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$"), r".hc_\1_\2"),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
)
_PER_EXPERT_RE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PACKED_GATE_UP_RE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.gate_up_proj$")
_PACKED_CONV_RE = re.compile(r"^(layers\.\d+\.self_attn)\.conv1d\.weight$")


@dataclass(frozen=True)
class KeyTarget:
    """Where one checkpoint tensor goes in canonical space.

    ``kind`` is ``"whole"`` (the tensor is the canonical tensor), ``"expert"`` (row ``index`` of a
    stacked expert tensor) or ``"chunk"`` (the canonical tensor is chunk ``index`` of ``count``
    equal chunks of the checkpoint tensor along ``dim``).
    """

    name: str
    kind: str = "whole"
    index: int = 0
    count: int = 1
    dim: int = 0


def strip_prefix(key: str) -> str:
    """Remove the HF module prefix (``model.language_model.``, ``model.``...) from a checkpoint key."""
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def checkpoint_key_targets(key: str) -> list[KeyTarget]:
    """Canonical tensors a checkpoint ``key`` contributes to (either key layout, any prefix).

    Packed tensors contribute to several canonical tensors: ``experts.gate_up_proj`` [E, 2I, H]
    holds gate rows then up rows on dim 1, ``self_attn.conv1d.weight`` is q, k, v stacked on dim 0.
    """
    k = strip_prefix(key)
    for pat, rep in _RENAMES:
        k = pat.sub(rep, k)
    m = _PER_EXPERT_RE.match(k)
    if m:
        return [KeyTarget(f"{m.group(1)}.{m.group(3)}", "expert", index=int(m.group(2)))]
    m = _PACKED_GATE_UP_RE.match(k)
    if m:
        return [KeyTarget(f"{m.group(1)}.gate_proj", "chunk", 0, 2, dim=1),
                KeyTarget(f"{m.group(1)}.up_proj", "chunk", 1, 2, dim=1)]
    m = _PACKED_CONV_RE.match(k)
    if m:
        return [KeyTarget(f"{m.group(1)}.{x}_conv1d.weight", "chunk", j, 3, dim=0) for j, x in enumerate("qkv")]
    return [KeyTarget(k)]


def source_shape(target: KeyTarget, canonical_shape: Shape) -> Shape:
    """The shape the checkpoint tensor must have to produce ``canonical_shape`` through ``target``."""
    if target.kind == "expert":
        return tuple(canonical_shape[1:])
    if target.kind == "chunk":
        s = list(canonical_shape)
        s[target.dim] *= target.count
        return tuple(s)
    return tuple(canonical_shape)


def original_checkpoint_key(name: str) -> str:
    """The original-layout checkpoint key of a non-expert canonical name (prefix re-added)."""
    if name == "lm_head.weight":
        return name
    if name.startswith("visual."):
        return "model." + name
    return "model.language_model." + name


# ---------------------------------------------------------------------------------------------
# abbreviated name lists for error messages
# ---------------------------------------------------------------------------------------------
_NUM_RE = re.compile(r"(?<=\.)(\d+)(?=\.)")


def _ranges(nums: list[int]) -> str:
    nums = sorted(set(nums))
    parts: list[str] = []
    start = prev = nums[0]
    for n in nums[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(parts)


def abbreviate_names(names: list[str] | set[str], limit: int = 30) -> str:
    """Group names that differ only in their first numeric component (layer / expert / block index).

    ``layers.3.x`` and ``layers.7.x`` become ``layers.{3,7}.x``; at most ``limit`` groups are shown,
    then ``... and N more``. Keeps error messages readable when a whole layer type is missing.
    """
    groups: dict[str, list[int]] = {}
    plain: list[str] = []
    for n in sorted(names):
        m = _NUM_RE.search(n)
        if m is None:
            plain.append(n)
            continue
        pattern = n[: m.start()] + "{}" + n[m.end():]
        groups.setdefault(pattern, []).append(int(m.group(1)))
    items = plain + [p.replace("{}", "{" + _ranges(v) + "}" if len(v) > 1 else str(v[0]))
                     for p, v in sorted(groups.items(), key=lambda kv: (min(kv[1]), kv[0]))]
    shown = items[:limit]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f", ... and {more} more groups" if more > 0 else "")
