"""Typed engine configuration read from a GLM-5.3-Flash checkpoint's ``config.json``.

The checkpoint's own schema is kept verbatim (so transformers and this engine read the same
file); this module parses it with the same defaults and remapping rules as transformers'
``Glm5NextConfig`` / ``Glm5NextTextConfig`` and derives what the engine needs per layer
(attention kind, MLP kind, MTP layers). Defaults are HF's, not the real checkpoint's: the real
``index_kpool`` is 4 while HF's default is 16, so a config that omits it gets 16 here too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

AttentionKind = Literal["kda", "mla"]
MlpKind = Literal["dense", "moe"]

_KDA_LAYER_TYPES = {"linear_attention"}
_MLA_LAYER_TYPES = {"full_attention", "indexed_attention", "deepseek_sparse_attention"}


class ConfigError(ValueError):
    """A checkpoint config that the engine cannot run; the message names field, value and fix."""


def _bad(field_name: str, value: Any, why: str, fix: str) -> ConfigError:
    return ConfigError(f"config field {field_name!r} = {value!r}: {why}. Fix: {fix}.")


#: Checkpoint keys that select a variant of the math (in transformers or in the original
#: checkpoint's definition) of which the engine implements exactly the listed values. Anything else
#: is refused at load: running a different model silently is worse than not starting. Keys absent
#: from ``config.json`` take the supported default. ``attention_bias`` is refused rather than
#: implemented: transformers adds biases to MLA ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``,
#: which the engine's absorbed-MLA kernels do not take, and no GLM-5.3-Flash checkpoint has them.
_TEXT_SUPPORTED_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "attention_bias": ((False,), "MLA projection biases (q_a_proj, kv_a_proj_with_mqa, o_proj) are not "
                                 "implemented"),
    "hidden_act": (("silu", "swish"), "the dense MLPs, the experts and the KDA short convolution use SiLU only"),
    "scoring_func": (("sigmoid",), "the MoE router scores experts with a sigmoid only"),
    "topk_method": (("noaux_tc",), "experts are chosen by bias-corrected top-k (noaux_tc) only"),
    "moe_router_dtype": (("float32",), "the router runs in float32 only"),
    "mla_use_nope": ((True,), "MLA attention is NoPE (no rope dims) only"),
    "index_kpool_compress": ((True,), "the indexer compresses keys into kpool pools only"),
}
_VISION_SUPPORTED_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "attention_bias": ((True,), "the vision tower applies its qkv/proj/MLP biases always"),
    "hidden_act": (("silu", "swish"), "the vision MLP uses SiLU only"),
    "in_channels": ((3,), "the image processor produces RGB patches only"),
}
#: The vision tower's 2-D rope base (transformers reads ``rope_parameters["rope_theta"]``).
VISION_ROPE_THETA = 10000.0


def check_supported_values(d: dict[str, Any], table: dict[str, tuple[tuple[Any, ...], str]], prefix: str) -> None:
    """Refuse present keys whose value the engine does not implement (see ``_TEXT_SUPPORTED_VALUES``)."""
    for key, (allowed, why) in table.items():
        if key in d and d[key] not in allowed:
            shown = " or ".join(repr(a) for a in allowed)
            raise _bad(f"{prefix}{key}", d[key], f"not supported: {why}",
                       f"use {shown} (the GLM-5.3-Flash value), or run this checkpoint with transformers")


@dataclass
class VisionConfig:
    """``vision_config`` of the checkpoint (HF ``Glm5NextVisionConfig`` defaults)."""

    depth: int = 24
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_heads: int = 16
    in_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    attention_bias: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        check_supported_values(d, _VISION_SUPPORTED_VALUES, "vision_config.")
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", VISION_ROPE_THETA)
        if rope.get("rope_type", "axial") != "axial" or theta != VISION_ROPE_THETA:
            raise _bad("vision_config.rope_parameters", rope, "not supported: the vision tower implements axial "
                       f"2-D rope with rope_theta={VISION_ROPE_THETA:g} only",
                       "drop rope_parameters or use the GLM-5.3-Flash values")
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in d.items() if k in known}
        if "num_attention_heads" in d and "num_heads" not in d:
            kwargs["num_heads"] = d["num_attention_heads"]
        if "num_hidden_layers" in d and "depth" not in d:
            kwargs["depth"] = d["num_hidden_layers"]
        return cls(**kwargs)


@dataclass
class TextConfig:
    """``text_config`` of the checkpoint with the engine's per-layer derivations."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 154820
    eos_token_id: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    index_share_for_mtp_iteration: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    mhc: bool = True
    num_nextn_predict_layers: int = 0
    # derived per layer (length num_hidden_layers)
    layer_kinds: list[AttentionKind] = field(default_factory=list)
    mlp_kinds: list[MlpKind] = field(default_factory=list)

    # ------------------------------------------------------------------ derived helpers
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "kda"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "mla"]

    @property
    def mtp_layer_ids(self) -> list[int]:
        """MTP layers are stored after the decoder layers: ``L .. L + n_mtp - 1``."""
        n = self.num_hidden_layers
        return list(range(n, n + self.num_nextn_predict_layers))

    def mtp_mlp_kind(self) -> MlpKind:
        """The MTP layer's MLP follows the last ``mlp_layer_types`` entry (MoE on the real model)."""
        return self.mlp_kinds[-1] if self.mlp_kinds else "moe"

    @property
    def index_pools_selected(self) -> int:
        """Number of pools an indexer query keeps: ``index_topk / index_kpool``."""
        return self.index_topk // self.index_kpool

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TextConfig":
        check_supported_values(d, _TEXT_SUPPORTED_VALUES, "")
        known = set(cls.__dataclass_fields__) - {"layer_kinds", "mlp_kinds", "eos_token_id"}
        kwargs = {k: v for k, v in d.items() if k in known}
        cfg = cls(**kwargs)
        eos = d.get("eos_token_id")
        cfg.eos_token_id = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if cfg.num_key_value_heads is None:
            cfg.num_key_value_heads = cfg.num_attention_heads
        cfg.num_nextn_predict_layers = int(d.get("num_nextn_predict_layers") or 0)

        lac = d.get("linear_attn_config")
        if lac is not None:
            cfg.linear_head_dim = lac.get("head_dim", cfg.linear_head_dim)
            cfg.linear_num_heads = lac.get("num_heads", cfg.linear_num_heads)
            cfg.linear_conv_kernel_dim = lac.get("short_conv_kernel_size", cfg.linear_conv_kernel_dim)
            cfg.linear_lower_bound = lac.get("gate_lower_bound", cfg.linear_lower_bound)
            if lac.get("safe_gate", True) and cfg.linear_lower_bound is None:
                cfg.linear_lower_bound = -5.0

        n = cfg.num_hidden_layers
        layer_types = d.get("layer_types")
        if layer_types is None:
            layer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if len(layer_types) != n:
            raise _bad("layer_types", f"<{len(layer_types)} entries>", f"needs one entry per layer ({n})",
                       "list exactly num_hidden_layers attention kinds")
        kinds: list[AttentionKind] = []
        for i, t in enumerate(layer_types):
            if t in _KDA_LAYER_TYPES:
                kinds.append("kda")
            elif t in _MLA_LAYER_TYPES:
                kinds.append("mla")
            else:
                raise _bad(f"layer_types[{i}]", t, "unknown attention kind",
                           f"use one of {sorted(_KDA_LAYER_TYPES | _MLA_LAYER_TYPES)}")
        cfg.layer_kinds = kinds
        if lac is not None and lac.get("kda_layers") is not None:
            declared = sorted(int(i) for i in lac["kda_layers"])
            if declared != cfg.kda_layer_ids:
                raise _bad("linear_attn_config.kda_layers", declared,
                           f"disagrees with layer_types (KDA at {cfg.kda_layer_ids}); GLM-5.3-Flash lists are "
                           "0-based (Kimi-Linear's are 1-based)", "make kda_layers match layer_types")

        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            first_dense = d.get("first_k_dense_replace")
            first_dense = min(3, n) if first_dense is None else int(first_dense)
            mlp_types = ["dense"] * first_dense + ["sparse"] * (n - first_dense)
        if len(mlp_types) != n:
            raise _bad("mlp_layer_types", f"<{len(mlp_types)} entries>", f"needs one entry per layer ({n})",
                       "list exactly num_hidden_layers MLP kinds ('dense' or 'sparse')")
        mk: list[MlpKind] = []
        for i, t in enumerate(mlp_types):
            if t == "dense":
                mk.append("dense")
            elif t in ("sparse", "moe"):
                mk.append("moe")
            else:
                raise _bad(f"mlp_layer_types[{i}]", t, "unknown MLP kind", "use 'dense' or 'sparse'")
        cfg.mlp_kinds = mk

        indexer_types = d.get("indexer_types")
        if indexer_types is None:
            # HF derives the schedule from `index_topk_pattern` ("F"/"S") or the freq/offset rule;
            # GLM-5.2-style keys (freq 4) would silently produce "shared" layers otherwise.
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = ([{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
                                 if isinstance(pattern, str) else list(pattern))
            else:
                freq = max(int(d.get("index_topk_freq", 1) or 1), 1)
                offset = int(d.get("index_skip_topk_offset", 2))
                indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        if any(t != "full" for t in indexer_types):
            raise _bad("indexer_types", indexer_types,
                       "'shared' DSA layers need the previous layer's top-k, which KDA layers do not produce",
                       "use 'full' for every layer (or omit the field)")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.num_attention_heads != self.num_key_value_heads:
            raise _bad("num_key_value_heads", self.num_key_value_heads,
                       f"MLA needs as many KV heads as query heads ({self.num_attention_heads})",
                       "set num_key_value_heads = num_attention_heads")
        if self.q_lora_rank is None:
            raise _bad("q_lora_rank", None, "the DSA indexer reads the q LoRA latent", "set q_lora_rank (1536 on the real model)")
        if self.qk_rope_head_dim != 0:
            raise _bad("qk_rope_head_dim", self.qk_rope_head_dim, "GLM-5.3-Flash attention is NoPE",
                       "set qk_rope_head_dim = 0")
        if self.index_kpool < 1:
            raise _bad("index_kpool", self.index_kpool, "pool size must be positive", "set index_kpool >= 1 (4 on the real model)")
        if self.index_topk % self.index_kpool != 0:
            raise _bad("index_topk", self.index_topk, f"must be a multiple of index_kpool ({self.index_kpool})",
                       f"use e.g. index_topk = {max(1, self.index_topk // self.index_kpool) * self.index_kpool}")
        if not self.index_kpool_always_select_tail:
            raise _bad("index_kpool_always_select_tail", False, "only the always-select-tail variant is implemented",
                       "set it to true (the GLM-5.3-Flash value)")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise _bad("num_experts_per_tok", self.num_experts_per_tok,
                       f"exceeds n_routed_experts ({self.n_routed_experts})", "lower num_experts_per_tok")
        if self.n_routed_experts % self.n_group != 0:
            raise _bad("n_group", self.n_group, f"must divide n_routed_experts ({self.n_routed_experts})",
                       "choose a divisor of n_routed_experts")
        if self.topk_group > self.n_group:
            raise _bad("topk_group", self.topk_group, f"exceeds n_group ({self.n_group})", "set topk_group <= n_group")
        if self.hc_mult < 1:
            raise _bad("hc_mult", self.hc_mult, "needs at least one residual stream", "set hc_mult >= 1 (4)")
        if not self.mhc:
            raise _bad("mhc", False, "only the mHC residual variant is implemented", "set mhc: true")


@dataclass
class ModelConfig:
    """The whole checkpoint config: text, optional vision, multimodal token ids."""

    text: TextConfig
    vision: VisionConfig | None
    image_token_id: int = 154854
    video_token_id: int = 154855
    image_start_token_id: int = 154830
    image_end_token_id: int = 154831
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.text.eos_token_id)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in (None, "glm5_next", "glm5_next_text"):
            raise _bad("model_type", model_type, "this engine serves GLM-5.3-Flash only", "use a glm5_next checkpoint")
        if "text_config" in d and d["text_config"] is not None:
            text_d = dict(d["text_config"])
        else:  # flat, text-only config: every text field at the top level (as HF accepts it)
            text_d = {k: v for k, v in d.items() if k not in ("vision_config",)}
        # top-level values the composite config carries (eos ids live there in some exports)
        for key in ("eos_token_id", "pad_token_id", "num_nextn_predict_layers", "tie_word_embeddings"):
            if key not in text_d and key in d:
                text_d[key] = d[key]
        text = TextConfig.from_dict(text_d)
        vision = VisionConfig.from_dict(d["vision_config"]) if d.get("vision_config") else None
        if vision is not None and vision.out_hidden_size != text.hidden_size:
            raise _bad("vision_config.out_hidden_size", vision.out_hidden_size,
                       f"vision embeddings replace text embeddings of width hidden_size ({text.hidden_size})",
                       f"set vision_config.out_hidden_size = {text.hidden_size}")
        ids = {k: d[k] for k in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                                 "video_start_token_id", "video_end_token_id") if k in d}
        return cls(text=text, vision=vision, raw=d, **ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ConfigError(f"no config.json at {cfg_file}: pass a checkpoint directory (e.g. one made by "
                              "`glm5 make-tiny DIR`)")
        try:
            d = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON ({e}); fix or re-export the checkpoint") from e
        cfg = cls.from_dict(d)
        gen = path / "generation_config.json" if path.is_dir() else None
        if gen is not None and gen.is_file() and not cfg.text.eos_token_id:
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                cfg.text.eos_token_id = [eos] if isinstance(eos, int) else list(eos)
        logger.info("config: %d layers (%d KDA, %d MLA), %d MTP, kpool=%d topk=%d",
                    cfg.text.num_hidden_layers, len(cfg.text.kda_layer_ids), len(cfg.text.mla_layer_ids),
                    cfg.text.num_mtp_layers, cfg.text.index_kpool, cfg.text.index_topk)
        return cfg
