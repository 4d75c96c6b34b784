"""The tiny random checkpoint: determinism, layout, randomization, HF loading, tokenizer, template, CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from glm5.config import ModelConfig
from glm5.tiny_checkpoint import (
    ADDED_TEXT_TOKENS,
    SPECIAL_TOKENS,
    make_tiny_checkpoint,
    random_tensor,
)

LM = "model.language_model."


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# ------------------------------------------------------------------ determinism and size
def test_same_seed_gives_identical_files(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_checkpoint(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_checkpoint_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tiny_checkpoint_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_different_seed_changes_every_tensor(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_checkpoint(tmp_path / "seed1", seed=1)
    a, b = _tensors(tiny_checkpoint_dir), _tensors(other)
    assert a.keys() == b.keys()
    same = [k for k in a if torch.equal(a[k], b[k])]
    assert not same, same
    # only the weights depend on the seed
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tiny_checkpoint_dir / name).read_bytes() == (other / name).read_bytes()


def test_size_limit(tiny_checkpoint_dir: Path) -> None:
    total = sum(p.stat().st_size for p in tiny_checkpoint_dir.iterdir())
    assert total <= 20 * 1024 * 1024, total


# ------------------------------------------------------------------ layout
def test_original_key_layout_matches_hf_save_pretrained(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """Every non-MTP key is exactly what transformers' save_pretrained writes for this config."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    cfg = _config(tiny_checkpoint_dir)
    n = cfg["text_config"]["num_hidden_layers"]
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(**cfg))
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        hf_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ours = _tensors(tiny_checkpoint_dir)
    mtp = f"{LM}layers.{n}."
    ours_main = {k: tuple(v.shape) for k, v in ours.items() if not k.startswith(mtp)}
    assert ours_main == hf_shapes

    # original (not HF in-memory packed) names
    assert f"{LM}layers.0.self_attn.q_conv1d.weight" in ours
    assert f"{LM}layers.0.self_attn.f_a_proj.weight" in ours and f"{LM}layers.0.self_attn.A_log" in ours
    assert f"{LM}layers.0.hc_attn_fn" in ours and f"{LM}layers.0.hc_ffn_scale" in ours
    assert f"{LM}layers.3.mlp.experts.7.down_proj.weight" in ours
    assert f"{LM}layers.3.self_attn.indexer.index_kpool_compress_gate" in ours
    assert "lm_head.weight" in ours and "model.visual.merger.proj.weight" in ours
    packed = re.compile(r"experts\.(gate_up_proj|down_proj)$|attn_hc\.|ffn_hc\.|\.conv1d\.weight|forget_gate\.")
    assert not [k for k in ours if packed.search(k)]


def test_mtp_layer_tensors(tiny_checkpoint_dir: Path) -> None:
    cfg = _config(tiny_checkpoint_dir)
    text = cfg["text_config"]
    n, h = text["num_hidden_layers"], text["hidden_size"]
    assert text["num_nextn_predict_layers"] == 1
    t = _tensors(tiny_checkpoint_dir)
    p = f"{LM}layers.{n}."
    mtp = {k[len(p):]: v for k, v in t.items() if k.startswith(p)}
    assert mtp["eh_proj.weight"].shape == (h, 2 * h)
    for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight",
              "post_attention_layernorm.weight"):
        assert mtp[k].shape == (h,), k
    # NoPE MLA with its own kpool indexer, MoE with per-expert keys + router + shared expert, no mHC
    for k in ("self_attn.q_a_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.indexer.wq_b.weight",
              "self_attn.indexer.index_kpool_compress_ape", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
              "mlp.shared_experts.down_proj.weight"):
        assert k in mtp, k
    experts = {k for k in mtp if k.startswith("mlp.experts.")}
    assert len(experts) == 3 * text["n_routed_experts"]
    assert not [k for k in mtp if k.startswith("hc_") or "conv1d" in k or "shared_head.head" in k]
    # same shapes as a decoder MLA+MoE layer (layer 3)
    for k, v in mtp.items():
        ref = t.get(f"{LM}layers.3.{k}")
        if ref is not None:
            assert ref.shape == v.shape, k


# ------------------------------------------------------------------ randomization
def test_every_tensor_is_randomized(tiny_checkpoint_dir: Path) -> None:
    t = _tensors(tiny_checkpoint_dir)
    constant = [k for k, v in t.items() if not v.float().std() > 0]
    assert not constant, constant
    for k, v in t.items():
        v = v.float()
        if k.endswith("index_kpool_compress_gate"):
            assert not torch.allclose(v, torch.ones_like(v)), k  # HF init: ones
            assert v.abs().mean() < 0.2, k
        if k.endswith(("index_kpool_compress_ape", "A_log", "hc_attn_base", "hc_ffn_base", "e_score_correction_bias")):
            assert v.abs().min() > 0 and v.abs().max() > 0.05, k  # HF init: zeros
        if k.endswith(("hc_attn_scale", "hc_ffn_scale")):
            assert not torch.allclose(v, torch.ones_like(v)), k  # HF init: ones
        if k.endswith("norm.weight"):
            assert 0.8 < v.mean() < 1.2, k  # 1 + 0.1 N keeps normalised paths at scale
    # the recipe is reproducible from the name and seed alone
    name = f"{LM}layers.2.self_attn.indexer.index_kpool_compress_ape"
    assert torch.equal(t[name], random_tensor(name, t[name].shape, 0))


def test_bf16_keeps_fp32_tensors(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    t = _tensors(ckpt)
    fp32 = {k for k, v in t.items() if v.dtype == torch.float32}
    fp32_expected = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|A_log|dt_bias|e_score_correction_bias|"
                               r"index_kpool_compress_ape)$")
    assert fp32 and all(fp32_expected.search(k) for k in fp32), sorted(fp32)[:5]
    assert t[f"{LM}embed_tokens.weight"].dtype == torch.bfloat16
    assert _config(ckpt)["text_config"]["dtype"] == "bfloat16"


# ------------------------------------------------------------------ config and overrides
def test_default_config_parses(tiny_checkpoint_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_checkpoint_dir)
    t = cfg.text
    assert t.layer_kinds == ["kda", "kda", "mla", "mla", "kda", "kda", "kda", "mla"]
    assert t.mlp_kinds == ["dense"] * 2 + ["moe"] * 6
    assert t.mtp_layer_ids == [8] and t.mtp_mlp_kind() == "moe"
    assert (t.hidden_size, t.index_kpool, t.index_topk, t.index_n_heads, t.index_head_dim) == (64, 4, 16, 16, 32)
    assert (t.linear_num_heads, t.linear_head_dim, t.linear_lower_bound) == (4, 16, -5.0)
    assert (t.num_attention_heads, t.kv_lora_rank, t.q_lora_rank, t.qk_nope_head_dim, t.v_head_dim) == (4, 32, 48, 32, 32)
    assert (t.n_routed_experts, t.num_experts_per_tok, t.n_shared_experts, t.hc_mult) == (8, 2, 1, 4)
    assert cfg.vision is not None and cfg.vision.depth == 2 and cfg.vision.out_hidden_size == t.hidden_size
    assert t.vocab_size % 64 == 0
    assert _config(tiny_checkpoint_dir)["text_config"]["linear_attn_config"]["kda_layers"] == [0, 1, 4, 5, 6]


def test_text_overrides_regenerate_dependent_lists(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(
        tmp_path / "small", seed=5, num_mtp_layers=0,
        text_overrides={"num_hidden_layers": 4, "index_topk": 8, "n_group": 2, "topk_group": 1,
                        "linear_num_heads": 2},
        vision_overrides={"depth": 1},
    )
    cfg = ModelConfig.from_pretrained(ckpt)
    t = cfg.text
    assert t.layer_kinds == ["kda", "kda", "mla", "mla"] and t.mlp_kinds == ["dense", "dense", "moe", "moe"]
    assert (t.index_topk, t.n_group, t.linear_num_heads, t.num_mtp_layers) == (8, 2, 2, 0)
    assert cfg.vision is not None and cfg.vision.depth == 1
    keys = _tensors(ckpt).keys()
    assert not [k for k in keys if k.startswith(f"{LM}layers.4.")]
    assert f"{LM}layers.0.self_attn.A_log" in keys and _tensors(ckpt)[f"{LM}layers.0.self_attn.A_log"].shape == (2,)


# ------------------------------------------------------------------ transformers loads and runs it
def test_hf_loads_and_runs(tiny_checkpoint_dir: Path) -> None:
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration

    model, info = Glm5NextForConditionalGeneration.from_pretrained(tiny_checkpoint_dir, output_loading_info=True)
    n = _config(tiny_checkpoint_dir)["text_config"]["num_hidden_layers"]
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith(f"{LM}layers.{n}.") for k in info["unexpected_keys"])
    # values arrive unchanged through HF's renaming/packing
    t = _tensors(tiny_checkpoint_dir)
    exp = model.model.language_model.layers[3].mlp.experts
    gate_up = torch.cat([t[f"{LM}layers.3.mlp.experts.5.gate_proj.weight"],
                         t[f"{LM}layers.3.mlp.experts.5.up_proj.weight"]], dim=0)
    assert torch.equal(exp.gate_up_proj[5].detach(), gate_up)
    assert torch.equal(model.model.language_model.layers[0].attn_hc.base.detach(), t[f"{LM}layers.0.hc_attn_base"])

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    ids = tok("The cache keeps one latent vector per token. " * 10, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 3 * 16  # well past index_topk + kpool: the sparse regime
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], _config(tiny_checkpoint_dir)["text_config"]["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_round_trip_and_special_tokens(tiny_checkpoint_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    cfg = ModelConfig.from_pretrained(tiny_checkpoint_dir)
    for text in ["Hello world!", "naïve café, Straße", "你好，世界", "日本語 한국어", "🙂🚀👍🏽 emoji",
                 "unseen: 龘 ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🫠", "  spaces\tand\nnewlines  "]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # multi-byte characters outside the training text fall back to byte tokens
    assert len(tok.encode("龘", add_special_tokens=False)) == 3
    ids = {}
    for t in SPECIAL_TOKENS + ADDED_TEXT_TOKENS:
        enc = tok.encode(t, add_special_tokens=False)
        assert len(enc) == 1, t
        ids[t] = enc[0]
    assert len(set(ids.values())) == len(ids)
    assert max(ids.values()) < cfg.text.vocab_size and len(tok) <= cfg.text.vocab_size
    assert cfg.eos_token_ids == [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    assert tok.eos_token_id == ids["<|endoftext|>"] and tok.pad_token_id == ids["<|endoftext|>"]
    assert cfg.image_token_id == ids["<|image|>"] and cfg.video_token_id == ids["<|video|>"]
    assert (cfg.image_start_token_id, cfg.image_end_token_id) == (ids["<|begin_of_image|>"], ids["<|end_of_image|>"])
    assert (cfg.video_start_token_id, cfg.video_end_token_id) == (ids["<|begin_of_video|>"], ids["<|end_of_video|>"])
    gen = json.loads((tiny_checkpoint_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_ids
    # special tokens are dropped by skip_special_tokens, reasoning markers are kept
    enc = tok.encode("[gMASK]<sop><|user|>\nhi<think>x</think>", add_special_tokens=False)
    assert tok.decode(enc, skip_special_tokens=True) == "\nhi<think>x</think>"


# ------------------------------------------------------------------ chat template
def test_chat_template_text(tiny_checkpoint_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello!<|user|>\nAgain"
                   "<|assistant|>\n")
    assert not tok.apply_chat_template(msgs[:2], tokenize=False).endswith("<|assistant|>\n")
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_chat_template_media_parts_match_hf_processor(tiny_checkpoint_dir: Path) -> None:
    """Image/video parts render to the placeholders Glm5NextProcessor expands.

    Glm5NextProcessor cannot be constructed without torchvision (its video processor class
    requires it), so HF's own expansion methods run on an instance built without ``__init__``;
    the image side uses the real PIL image processor loaded from the checkpoint directory.
    """
    from PIL import Image
    from transformers import AutoTokenizer, Glm5NextImageProcessorPil, Glm5NextProcessor
    from transformers.video_utils import VideoMetadata

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_dir)
    ip = Glm5NextImageProcessorPil.from_pretrained(tiny_checkpoint_dir)
    proc = object.__new__(Glm5NextProcessor)
    proc.tokenizer, proc.image_processor = tok, ip
    proc.video_processor = SimpleNamespace(merge_size=2)
    proc.image_token, proc.video_token = "<|image|>", "<|video|>"
    proc.image_token_id, proc.video_token_id = tok.convert_tokens_to_ids(["<|image|>", "<|video|>"])
    proc.video_start_id, proc.video_end_id = tok.convert_tokens_to_ids(["<|begin_of_video|>", "<|end_of_video|>"])

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.count("<|image|>") == 1 and text.count("<|video|>") == 1

    img = Image.fromarray((np.random.RandomState(0).rand(100, 150, 3) * 255).astype("uint8"))
    pixels = ip([img], return_tensors="pt")
    n_img = int(pixels["image_grid_thw"][0].prod()) // 4
    grid_v = torch.tensor([[2, 4, 4]])  # 2 temporal slices of 4x4 patches -> 2 x 4 tokens
    meta = VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])
    expanded, _ = proc.get_text_with_replacements(
        [text],
        images_replacements=[proc.replace_image_token(pixels, 0)],
        videos_replacements=[proc.replace_video_token({"video_grid_thw": grid_v, "video_metadata": [meta]}, 0)],
    )
    ids = tok(expanded[0], add_special_tokens=False)["input_ids"]
    types = proc.create_mm_token_type_ids([ids])[0]
    assert sum(1 for x in types if x == 1) == n_img  # image tokens outside video spans
    assert sum(1 for x in types if x == 2) == 8  # image tokens inside <|begin_of_video|> .. <|end_of_video|>
    assert proc.video_token_id not in ids
    assert "0.0 seconds" in expanded[0] and "1.0 seconds" in expanded[0]

    # the image processor config and the vision tower agree: the tower consumes these pixels
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(tiny_checkpoint_dir).eval()
    img_text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    img_ids = tok(img_text.replace("<|image|>", proc.replace_image_token(pixels, 0)), add_special_tokens=False,
                  return_tensors="pt")["input_ids"]
    with torch.no_grad():
        with_img = model(input_ids=img_ids, pixel_values=pixels["pixel_values"],
                         image_grid_thw=pixels["image_grid_thw"]).logits
        without = model(input_ids=img_ids).logits
    assert torch.isfinite(with_img).all() and (with_img - without).abs().max() > 1e-3


# ------------------------------------------------------------------ CLI
def test_cli_make_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cli_ckpt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "glm5.cli", "make-tiny", str(out), "--seed", "3"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    t = _tensors(out)
    name = f"{LM}layers.0.hc_attn_fn"
    assert torch.equal(t[name], random_tensor(name, t[name].shape, 3))
    assert ModelConfig.from_pretrained(out).text.mtp_layer_ids == [8]
