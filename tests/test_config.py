"""``glm5.config``: the real GLM-5.3-Flash config, flat configs, validation errors, HF agreement."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from glm5.config import ConfigError, ModelConfig

REAL_MLA_LAYERS = [i for i in range(45) if i % 4 == 3]


@pytest.fixture()
def real_dict(real_config_path: Path) -> dict[str, Any]:
    return json.loads(real_config_path.read_text())


def test_real_config_layout(real_config_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(real_config_path)
    t = cfg.text
    assert t.num_hidden_layers == 45
    assert len(t.kda_layer_ids) == 34 and len(t.mla_layer_ids) == 11
    assert t.mla_layer_ids == REAL_MLA_LAYERS
    assert t.mlp_kinds == ["dense"] * 3 + ["moe"] * 42
    assert t.num_mtp_layers == 1 and t.mtp_layer_ids == [45]
    assert t.mtp_mlp_kind() == "moe"
    assert (t.index_kpool, t.index_topk, t.index_pools_selected) == (4, 2048, 512)
    assert t.linear_lower_bound == -5.0
    assert (t.linear_num_heads, t.linear_head_dim, t.linear_conv_kernel_dim) == (64, 128, 4)
    assert (t.qk_head_dim, t.v_head_dim, t.kv_lora_rank, t.q_lora_rank) == (256, 256, 512, 1536)
    assert (t.n_routed_experts, t.num_experts_per_tok, t.n_shared_experts) == (288, 8, 1)
    assert cfg.eos_token_ids == [154820, 154827, 154829] and t.pad_token_id == 154820
    assert cfg.vision is not None and cfg.vision.depth == 24 and cfg.vision.out_hidden_size == 4096
    assert cfg.vision.head_dim == 64
    assert (cfg.image_token_id, cfg.video_token_id) == (154854, 154855)
    assert (cfg.video_start_token_id, cfg.video_end_token_id) == (154832, 154833)


def test_flat_text_only_config(real_dict: dict[str, Any]) -> None:
    flat = dict(real_dict["text_config"])
    flat["model_type"] = "glm5_next"
    cfg = ModelConfig.from_dict(flat)
    assert cfg.vision is None
    assert len(cfg.text.kda_layer_ids) == 34 and cfg.text.mtp_layer_ids == [45]
    assert cfg.text.index_kpool == 4


def test_defaults_follow_hf_when_lists_are_absent(real_dict: dict[str, Any]) -> None:
    text = real_dict["text_config"]
    for key in ("layer_types", "mlp_layer_types", "linear_attn_config", "first_k_dense_replace", "index_kpool"):
        text.pop(key)
    t = ModelConfig.from_dict(real_dict).text
    assert t.mla_layer_ids == REAL_MLA_LAYERS  # HF's default rule: i % 4 == 3
    assert t.mlp_kinds[:4] == ["dense"] * 3 + ["moe"]
    assert t.index_kpool == 16  # HF default, NOT the checkpoint's 4: never rely on defaults
    assert t.linear_lower_bound == -5.0


def _mutate(d: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    d = copy.deepcopy(d)
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "field", "hf_rejects"),
    [
        ("text_config.index_topk", 2046, "index_topk", True),
        ("text_config.index_kpool", 0, "index_kpool", True),
        ("text_config.qk_rope_head_dim", 64, "qk_rope_head_dim", True),
        ("text_config.num_key_value_heads", 8, "num_key_value_heads", True),
        ("text_config.q_lora_rank", None, "q_lora_rank", True),
        ("vision_config.out_hidden_size", 1536, "vision_config.out_hidden_size", False),
        ("text_config.layer_types.5", "sliding_attention", "layer_types[5]", False),
        ("text_config.mlp_layer_types.4", "mixture", "mlp_layer_types[4]", False),
        ("text_config.linear_attn_config.kda_layers", [i + 1 for i in range(45) if i % 4 != 3],
         "linear_attn_config.kda_layers", False),
        ("text_config.indexer_types", ["full", "shared"] * 22 + ["full"], "indexer_types", False),
        ("text_config.num_experts_per_tok", 300, "num_experts_per_tok", False),
        ("model_type", "deepseek_v3", "model_type", False),
    ],
)
def test_validation_errors_name_the_field(real_dict: dict[str, Any], path: str, value: Any, field: str,
                                          hf_rejects: bool) -> None:
    bad = _mutate(real_dict, path, value)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(bad)
    msg = str(err.value)
    assert f"'{field}'" in msg, msg
    assert "Fix:" in msg, msg
    if hf_rejects:  # the same configs are rejected by transformers' own architecture validation
        from transformers import Glm5NextConfig

        with pytest.raises(Exception):
            Glm5NextConfig(**bad)


def test_layer_types_length_mismatch(real_dict: dict[str, Any]) -> None:
    real_dict["text_config"]["layer_types"] = real_dict["text_config"]["layer_types"][:-1]
    with pytest.raises(ConfigError, match="'layer_types'"):
        ModelConfig.from_dict(real_dict)


def test_shared_indexer_schedule_from_frequency_is_rejected(real_dict: dict[str, Any]) -> None:
    # GLM-5.2-style schedule keys make HF derive "shared" DSA layers, which cannot run here.
    real_dict["text_config"]["index_topk_freq"] = 4
    with pytest.raises(ConfigError, match="'indexer_types'"):
        ModelConfig.from_dict(real_dict)
    del real_dict["text_config"]["index_topk_freq"]
    real_dict["text_config"]["index_topk_pattern"] = "FS" * 22 + "F"
    with pytest.raises(ConfigError, match="'indexer_types'"):
        ModelConfig.from_dict(real_dict)


def test_missing_config_file_is_actionable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="make-tiny"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def _assert_agrees_with_hf(d: dict[str, Any]) -> None:
    from transformers import Glm5NextConfig

    ours = ModelConfig.from_dict(d)
    hf = Glm5NextConfig(**copy.deepcopy(d))
    ht, t = hf.text_config, ours.text
    assert t.layer_kinds == ["kda" if x == "linear_attention" else "mla" for x in ht.layer_types]
    assert t.mlp_kinds == ["moe" if x == "sparse" else "dense" for x in ht.mlp_layer_types]
    assert getattr(ht, "indexer_types") == ["full"] * t.num_hidden_layers
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "index_topk", "index_kpool", "index_head_dim",
                 "index_n_heads", "index_kpool_always_select_tail", "n_routed_experts", "num_experts_per_tok",
                 "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                 "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound", "hc_mult",
                 "hc_eps", "hc_sinkhorn_iters", "rms_norm_eps", "swiglu_limit", "pad_token_id",
                 "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(t, name) == getattr(ht, name), name
    hf_eos = ht.eos_token_id
    assert t.eos_token_id == ([hf_eos] if isinstance(hf_eos, int) else list(hf_eos))
    if ours.vision is not None:
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "projection_intermediate_size", "rms_norm_eps"):
            assert getattr(ours.vision, name) == getattr(hf.vision_config, name), name
    for name in ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                 "video_start_token_id", "video_end_token_id"):
        assert getattr(ours, name) == getattr(hf, name), name


def test_agrees_with_hf_on_real_config(real_dict: dict[str, Any]) -> None:
    _assert_agrees_with_hf(real_dict)


def test_agrees_with_hf_on_tiny_config(tiny_checkpoint_dir: Path) -> None:
    _assert_agrees_with_hf(json.loads((tiny_checkpoint_dir / "config.json").read_text()))


def test_agrees_with_hf_without_optional_lists(real_dict: dict[str, Any]) -> None:
    text = real_dict["text_config"]
    for key in ("layer_types", "mlp_layer_types", "linear_attn_config", "first_k_dense_replace"):
        text.pop(key)
    text["linear_num_heads"] = 32
    _assert_agrees_with_hf(real_dict)


@pytest.mark.parametrize("path,value", [
    ("text_config.attention_bias", True),
    ("text_config.hidden_act", "gelu"),
    ("text_config.scoring_func", "softmax"),
    ("text_config.topk_method", "greedy"),
    ("text_config.moe_router_dtype", "bfloat16"),
    ("text_config.mla_use_nope", False),
    ("text_config.index_kpool_compress", False),
    ("vision_config.attention_bias", False),
    ("vision_config.hidden_act", "quick_gelu"),
    ("vision_config.in_channels", 1),
    ("vision_config.rope_parameters", {"rope_type": "axial", "rope_theta": 500000.0}),
])
def test_unimplemented_config_values_are_rejected_at_load(real_dict: dict[str, Any], path: str, value: Any) -> None:
    """A key whose value selects math the engine does not implement must stop the load, naming the
    key, the value and what is supported (these were silently ignored: attention_bias=true loaded
    the bias tensors and never applied them)."""
    bad = _mutate(real_dict, path, value)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(bad)
    msg = str(err.value)
    key = path.split(".", 1)[1]
    assert key in msg and repr(value) in msg and "not supported" in msg and "Fix:" in msg, msg


def test_supported_values_of_those_keys_still_load(real_dict: dict[str, Any]) -> None:
    text = real_dict["text_config"]
    assert (text["attention_bias"], text["hidden_act"], text["scoring_func"], text["topk_method"]) == \
        (False, "silu", "sigmoid", "noaux_tc")
    text["hidden_act"] = "swish"                 # transformers' alias of SiLU
    real_dict["vision_config"]["rope_parameters"] = {"rope_type": "axial", "rope_theta": 10000.0}
    cfg = ModelConfig.from_dict(real_dict)
    assert cfg.vision is not None and len(cfg.text.kda_layer_ids) == 34
