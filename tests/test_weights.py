"""Checkpoint loader tests against transformers' own checkpoints of a tiny GLM-5.3-Flash.

HF's ``Glm5NextForConditionalGeneration`` (tiny recipe of model-spec §11.1, with a vision tower,
every parameter randomized) is the ground truth: its ``save_pretrained`` output (original layout,
single file and sharded) and its packed in-memory ``state_dict()`` must both load to canonical
tensors equal to HF's parameters. Bad checkpoints are built by editing copies of those files.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.config import ModelConfig
from glm5.weights import (
    CheckpointError,
    check_checkpoint,
    dummy_weights,
    expected_weight_shapes,
    is_fp32_weight,
    load_weights,
    save_weights,
)

TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5,
            kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=32, v_head_dim=32,
            index_topk=8, index_head_dim=32, index_n_heads=4, index_kpool=4, linear_head_dim=16,
            linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=4, pad_token_id=0,
            mlp_layer_types=["dense"] * 2 + ["sparse"] * 6)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              projection_intermediate_size=48)
N_LAYERS = TEXT["num_hidden_layers"]
PFX = "model.language_model."


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model():
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=TEXT, vision_config=VISION)).eval()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():  # HF's init makes gate/ape/decay/mHC degenerate: randomize everything
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and "norm" in name and not name.endswith("bias"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.05 * noise)
    return model


def hf_canonical(model) -> dict[str, torch.Tensor]:
    """HF's in-memory parameters renamed to the engine's canonical names (written independently of
    the loader: prefix strip, forget_gate/attn_hc renames, gate_up and conv1d splits)."""
    out: dict[str, torch.Tensor] = {}
    for key, v in model.state_dict().items():
        v = v.detach().clone()
        if key.startswith(PFX):
            n = key[len(PFX):]
        elif key.startswith("model.visual."):
            n = key[len("model."):]
        else:
            n = key
        n = n.replace(".self_attn.forget_gate.", ".self_attn.")
        for site in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                n = n.replace(f".{site}_hc.{part}", f".hc_{site}_{part}")
        if n.endswith(".mlp.experts.gate_up_proj"):
            half = v.shape[1] // 2
            stem = n[: -len("gate_up_proj")]
            out[stem + "gate_proj"], out[stem + "up_proj"] = v[:, :half], v[:, half:]
        elif n.endswith(".self_attn.conv1d.weight"):
            stem = n[: -len("conv1d.weight")]
            third = v.shape[0] // 3
            for j, x in enumerate("qkv"):
                out[f"{stem}{x}_conv1d.weight"] = v[j * third:(j + 1) * third]
        else:
            out[n] = v
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, hf_model):
    root = tmp_path_factory.mktemp("weights")
    orig, sharded, packed = root / "orig", root / "sharded", root / "packed"
    hf_model.save_pretrained(orig)
    hf_model.save_pretrained(sharded, max_shard_size="500KB")
    packed.mkdir()
    save_file({k: v.detach().clone().contiguous() for k, v in hf_model.state_dict().items()},
              str(packed / "model.safetensors"))
    shutil.copy(orig / "config.json", packed / "config.json")
    return {"orig": orig, "sharded": sharded, "packed": packed}


@pytest.fixture(scope="module")
def cfg(ckpts) -> ModelConfig:
    return ModelConfig.from_pretrained(ckpts["orig"])


@pytest.fixture(scope="module")
def reference(hf_model) -> dict[str, torch.Tensor]:
    return hf_canonical(hf_model)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def _problems(path: Path, cfg: ModelConfig, **kw) -> list[str]:
    with pytest.raises(CheckpointError) as ei:
        load_weights(path, cfg, progress=False, **kw)
    assert isinstance(ei.value, ValueError)
    for p in ei.value.problems:  # every problem is in the one message
        assert p in str(ei.value)
    return ei.value.problems


def _cfg_with(ckpt: Path, **text_overrides) -> ModelConfig:
    d = json.loads((ckpt / "config.json").read_text())
    d["text_config"].update(text_overrides)
    return ModelConfig.from_dict(d)


# ------------------------------------------------------------------------------------------------
# names, shapes, layouts
# ------------------------------------------------------------------------------------------------
def test_expected_shapes_match_hf_parameters(cfg, reference):
    expected = expected_weight_shapes(cfg)
    assert expected == {n: tuple(t.shape) for n, t in reference.items()}
    assert expected["layers.4.mlp.experts.gate_proj"] == (8, 32, 64)
    assert expected["layers.0.self_attn.q_conv1d.weight"] == (64, 1, 4)
    assert expected["layers.3.hc_attn_fn"] == (24, 4 * 64)


def test_original_checkpoint_keys_all_consumed(ckpts, cfg):
    # save_pretrained really wrote the original layout (per-expert keys, hc_*, q_conv1d, f_a_proj)
    keys = set(load_file(str(ckpts["orig"] / "model.safetensors")))
    assert PFX + "layers.4.mlp.experts.7.down_proj.weight" in keys
    assert PFX + "layers.0.hc_attn_fn" in keys and PFX + "layers.0.self_attn.f_a_proj.weight" in keys
    assert not any("gate_up_proj" in k or "attn_hc" in k or "forget_gate" in k for k in keys)
    assert check_checkpoint(ckpts["orig"], cfg) == len(expected_weight_shapes(cfg))


@pytest.mark.parametrize("layout", ["orig", "sharded", "packed"])
def test_load_equals_hf_parameters(ckpts, cfg, reference, layout):
    if layout == "sharded":
        index = json.loads((ckpts["sharded"] / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    w = load_weights(ckpts[layout], cfg, progress=False)
    assert set(w) == set(reference)
    for n, t in w.items():
        assert t.dtype == torch.float32
        assert t.is_contiguous(), n
        assert torch.equal(t, reference[n]), n


def test_bf16_load_keeps_fp32_set(ckpts, cfg, reference):
    w = load_weights(ckpts["sharded"], cfg, dtype=torch.bfloat16, progress=False)
    fp32 = {n for n, t in w.items() if t.dtype == torch.float32}
    assert {n for n, t in w.items() if t.dtype not in (torch.float32, torch.bfloat16)} == set()
    # 8 layers x 6 hc tensors, 6 KDA layers x (A_log, dt_bias), 6 MoE routers, 2 indexers' ape
    assert len(fp32) == 8 * 6 + 6 * 2 + 6 + 2
    for n in ("layers.0.hc_attn_fn", "layers.5.hc_ffn_scale", "layers.0.self_attn.A_log",
              "layers.1.self_attn.dt_bias", "layers.3.mlp.gate.e_score_correction_bias",
              "layers.7.self_attn.indexer.index_kpool_compress_ape"):
        assert n in fp32 and is_fp32_weight(n) and torch.equal(w[n], reference[n])
    for n in ("layers.3.self_attn.indexer.index_kpool_compress_gate", "layers.0.self_attn.q_conv1d.weight",
              "embed_tokens.weight", "layers.3.mlp.experts.down_proj", "visual.merger.proj.weight"):
        assert w[n].dtype == torch.bfloat16 and torch.equal(w[n], reference[n].to(torch.bfloat16))


def test_prefix_variants_load(ckpts, cfg, reference, tmp_path):
    # `model.layers.*` / bare `visual.*` / bare `layers.*` names (text-only exports) all map the same
    tensors = load_file(str(ckpts["orig"] / "model.safetensors"))
    renamed = {}
    for k, v in tensors.items():
        if k.startswith(PFX + "layers.") and int(k.split(".")[3]) % 2:
            renamed["model." + k[len(PFX):]] = v  # odd layers: model.layers.i
        elif k.startswith(PFX):
            renamed[k[len(PFX):]] = v  # bare
        elif k.startswith("model.visual."):
            renamed[k[len("model."):]] = v
        else:
            renamed[k] = v
    (tmp_path / "p").mkdir()
    save_file(renamed, str(tmp_path / "p" / "model.safetensors"))
    w = load_weights(tmp_path / "p", cfg, progress=False)
    assert set(w) == set(reference) and all(torch.equal(w[n], reference[n]) for n in w)


def test_text_only_hf_export(hf_model, reference, tmp_path):
    from transformers import Glm5NextTextConfig, Glm5NextTextModel

    text = Glm5NextTextModel(Glm5NextTextConfig(**TEXT))
    text.load_state_dict(hf_model.model.language_model.state_dict())
    text.save_pretrained(tmp_path / "t")
    tcfg = ModelConfig.from_dict(dict(TEXT))  # flat text-only config, no vision
    problems = _problems(tmp_path / "t", tcfg)  # a bare text model has no lm_head
    assert problems == ["missing tensors (1): lm_head.weight"]
    _rewrite(tmp_path / "t" / "model.safetensors",
             lambda t: t.__setitem__("lm_head.weight", reference["lm_head.weight"].clone()))
    w = load_weights(tmp_path / "t", tcfg, progress=False)
    assert set(w) == {n for n in reference if not n.startswith("visual.")}
    assert all(torch.equal(w[n], reference[n]) for n in w)


def test_tied_lm_head(ckpts, tmp_path):
    d = _copy(ckpts["orig"], tmp_path / "tied")
    _rewrite(d / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    tcfg = _cfg_with(d, tie_word_embeddings=True)
    w = load_weights(d, tcfg, progress=False)
    assert torch.equal(w["lm_head.weight"], w["embed_tokens.weight"])


def test_save_weights_roundtrip_packed_sharded(cfg, tmp_path):
    dummy = dummy_weights(cfg, dtype=torch.float32, seed=3)
    files = save_weights(dummy, tmp_path / "pk", layout="packed", max_shard_bytes=300_000)
    assert len(files) > 1 and (tmp_path / "pk" / "model.safetensors.index.json").is_file()
    keys = set()
    for f in files:
        keys |= set(load_file(str(f)))
    assert PFX + "layers.3.mlp.experts.gate_up_proj" in keys and PFX + "layers.0.attn_hc.fn" in keys
    w = load_weights(tmp_path / "pk", cfg, progress=False)
    assert set(w) == set(dummy) and all(torch.equal(w[n], dummy[n]) for n in w)


# ------------------------------------------------------------------------------------------------
# fp8
# ------------------------------------------------------------------------------------------------
def _quantize_e4m3_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nb_r, nb_c = math.ceil(rows / block), math.ceil(cols / block)
    scale = torch.empty(nb_r, nb_c, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nb_r):
        for j in range(nb_c):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = tile.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def _dequant_reference(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[sl] = q[sl].to(torch.float32) * scale[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_setup(tmp_path_factory):
    # hidden 260 / intermediate 300: every fp8 matrix has partial edge blocks in both dims
    text = dict(vocab_size=32, hidden_size=260, intermediate_size=300, moe_intermediate_size=300,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2,
                n_shared_experts=1, num_experts_per_tok=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
                v_head_dim=8, index_topk=8, index_head_dim=8, index_n_heads=2, index_kpool=4, linear_head_dim=8,
                linear_num_heads=2, mlp_layer_types=["dense", "sparse"], hc_mult=2)
    fcfg = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text})
    d = tmp_path_factory.mktemp("fp8") / "ck"
    dense = dummy_weights(fcfg, dtype=torch.float32, seed=7)
    save_weights(dense, d)
    refs: dict[str, torch.Tensor] = {}

    def quantize(t: dict[str, torch.Tensor]) -> None:
        for key in (PFX + "layers.0.mlp.gate_proj.weight", PFX + "layers.0.mlp.down_proj.weight",
                    PFX + "layers.1.mlp.experts.1.up_proj.weight"):
            q, s = _quantize_e4m3_blocks(t[key])
            t[key], t[key + "_scale_inv"] = q, s
            refs[key] = _dequant_reference(q, s)

    _rewrite(d / "model.safetensors", quantize)
    return fcfg, d, dense, refs


def test_fp8_roundtrip(fp8_setup):
    fcfg, d, dense, refs = fp8_setup
    raw = load_file(str(d / "model.safetensors"))
    assert raw[PFX + "layers.0.mlp.gate_proj.weight"].shape == (300, 260)
    assert raw[PFX + "layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert raw[PFX + "layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 3)
    w = load_weights(d, fcfg, progress=False)
    assert not any(n.endswith("_scale_inv") for n in w)  # scales consumed
    assert torch.equal(w["layers.0.mlp.gate_proj.weight"], refs[PFX + "layers.0.mlp.gate_proj.weight"])
    assert torch.equal(w["layers.0.mlp.down_proj.weight"], refs[PFX + "layers.0.mlp.down_proj.weight"])
    up = w["layers.1.mlp.experts.up_proj"]
    assert torch.equal(up[1], refs[PFX + "layers.1.mlp.experts.1.up_proj.weight"])
    assert torch.equal(up[0], dense["layers.1.mlp.experts.up_proj"][0])  # unquantized expert untouched
    # and the dequantized weight is the original up to e4m3 rounding (3 mantissa bits)
    orig = dense["layers.0.mlp.gate_proj.weight"]
    assert (w["layers.0.mlp.gate_proj.weight"] - orig).abs().max() <= orig.abs().max() * 2 ** -3
    wb = load_weights(d, fcfg, dtype=torch.bfloat16, progress=False)
    assert torch.equal(wb["layers.0.mlp.gate_proj.weight"],
                       refs[PFX + "layers.0.mlp.gate_proj.weight"].to(torch.bfloat16))


def test_fp8_without_scale_and_bad_scale(fp8_setup, tmp_path):
    fcfg, d, _, _ = fp8_setup
    bad = _copy(d, tmp_path / "bad")

    def edit(t):
        t.pop(PFX + "layers.0.mlp.gate_proj.weight_scale_inv")
        t[PFX + "layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 2)

    _rewrite(bad / "model.safetensors", edit)
    problems = _problems(bad, fcfg)
    assert len(problems) == 2
    assert any(p.startswith("fp8 weight without its scale: " + PFX + "layers.0.mlp.gate_proj.weight")
               for p in problems)
    assert any("fp8 scale " + PFX + "layers.0.mlp.down_proj.weight_scale_inv: got (2, 2), expected (3, 3)" in p
               for p in problems)


# ------------------------------------------------------------------------------------------------
# bad checkpoints
# ------------------------------------------------------------------------------------------------
def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def test_missing_shard(ckpts, cfg, tmp_path):
    d = _copy(ckpts["sharded"], tmp_path / "c")
    gone = _shards(d)[1]
    gone.unlink()
    problems = _problems(d, cfg)
    assert len(problems) == 1 and problems[0].startswith(f"missing shard file: {gone.name}")


def test_truncated_shard(ckpts, cfg, tmp_path):
    d = _copy(ckpts["sharded"], tmp_path / "c")
    victim = _shards(d)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    problems = _problems(d, cfg)
    assert len(problems) == 1
    assert problems[0].startswith(f"corrupt safetensors file {victim.name}: truncated")


def test_garbage_file(ckpts, cfg, tmp_path):
    d = _copy(ckpts["orig"], tmp_path / "c")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    problems = _problems(d, cfg)
    assert len(problems) == 1 and "corrupt safetensors file model.safetensors" in problems[0]
    assert "not valid JSON" in problems[0]


def test_wrong_shape(ckpts, cfg, tmp_path):
    d = _copy(ckpts["orig"], tmp_path / "c")
    key = PFX + "layers.3.self_attn.q_a_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: t.__setitem__(key, torch.zeros(48, 60)))
    assert _problems(d, cfg) == [
        f"wrong shape: layers.3.self_attn.q_a_proj.weight (key {key}): got (48, 60), expected (48, 64)"]


def test_missing_tensors(ckpts, cfg, tmp_path):
    d = _copy(ckpts["orig"], tmp_path / "c")

    def edit(t):
        for layer in (3, 7):
            t.pop(PFX + f"layers.{layer}.self_attn.indexer.wk.weight")
        t.pop(PFX + "layers.4.mlp.experts.5.down_proj.weight")
        t.pop("model.visual.merger.proj.weight")

    _rewrite(d / "model.safetensors", edit)
    problems = _problems(d, cfg)
    assert len(problems) == 1 and problems[0].startswith("missing tensors (4): ")
    for frag in ("layers.{3,7}.self_attn.indexer.wk.weight", "layers.4.mlp.experts.5.down_proj.weight",
                 "visual.merger.proj.weight"):
        assert frag in problems[0]


def test_missing_whole_layer_is_abbreviated(ckpts, cfg, tmp_path):
    d = _copy(ckpts["orig"], tmp_path / "c")
    _rewrite(d / "model.safetensors",
             lambda t: [t.pop(k) for k in list(t) if re.match(re.escape(PFX) + r"layers\.[4-6]\.", k)])
    _rewrite(d / "model.safetensors", lambda t: [t.pop(k) for k in list(t) if ".indexer.wq_b." in k])
    (problem,) = _problems(d, cfg)
    n_missing = 3 * len([n for n in expected_weight_shapes(cfg) if n.startswith("layers.4.")]) + 2
    assert problem == (f"missing tensors ({n_missing}): layers.{{4-6}}.* (entirely absent), "
                       "layers.{3,7}.self_attn.indexer.wq_b.weight")


def test_unexpected_tensors(ckpts, cfg, tmp_path):
    d = _copy(ckpts["orig"], tmp_path / "c")

    def edit(t):
        t[PFX + "layers.2.self_attn.rogue.weight"] = torch.zeros(2)
        t[PFX + "layers.4.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)  # only 8 experts (0-7)

    _rewrite(d / "model.safetensors", edit)
    problems = _problems(d, cfg)
    assert len(problems) == 1 and problems[0].startswith("unexpected tensors (2): ")
    assert PFX + "layers.2.self_attn.rogue.weight" in problems[0]
    assert PFX + "layers.4.mlp.experts.8.up_proj.weight" in problems[0]


def test_index_points_at_missing_key(ckpts, cfg, tmp_path):
    d = _copy(ckpts["sharded"], tmp_path / "c")
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = PFX + "layers.3.self_attn.kv_b_proj.weight"
    shard = d / index["weight_map"][key]
    _rewrite(shard, lambda t: t.pop(key))
    problems = _problems(d, cfg)
    assert problems == [f"index points at missing key: {key} (index says it is in {shard.name}, which does "
                        "not contain it)"]


def test_duplicate_layouts_rejected(ckpts, cfg, tmp_path):
    d = _copy(ckpts["orig"], tmp_path / "c")
    _rewrite(d / "model.safetensors",
             lambda t: t.__setitem__(PFX + "layers.0.attn_hc.fn", t[PFX + "layers.0.hc_attn_fn"].clone()))
    (problem,) = _problems(d, cfg)
    assert problem.startswith("tensor layers.0.hc_attn_fn is provided more than once")


def test_many_problems_listed_together(ckpts, cfg, tmp_path):
    d = _copy(ckpts["sharded"], tmp_path / "c")
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    wmap = index["weight_map"]
    shapes = {
        "wrong": PFX + "layers.0.self_attn.q_proj.weight",
        "missing": PFX + "layers.7.self_attn.q_b_proj.weight",
        "fp8": PFX + "layers.2.mlp.experts.0.gate_proj.weight",
    }
    # the shard to truncate must hold none of the keys edited above
    edited_shards = {wmap[k] for k in shapes.values()}
    victim = next(p for p in _shards(d) if p.name not in edited_shards)

    def edit_in(key, fn):
        _rewrite(d / wmap[key], fn)

    edit_in(shapes["wrong"], lambda t: t.__setitem__(shapes["wrong"], torch.zeros(64, 63)))
    edit_in(shapes["missing"], lambda t: t.pop(shapes["missing"]))
    wmap.pop(shapes["missing"])
    edit_in(shapes["fp8"], lambda t: t.__setitem__(shapes["fp8"], t[shapes["fp8"]].to(torch.float8_e4m3fn)))
    extra = PFX + "layers.1.mystery"
    edit_in(shapes["fp8"], lambda t: t.__setitem__(extra, torch.zeros(3)))
    wmap[extra] = wmap[shapes["fp8"]]
    wmap[PFX + "layers.1.ghost.weight"] = wmap[shapes["fp8"]]
    index_file.write_text(json.dumps(index))
    victim.write_bytes(victim.read_bytes()[:-100])

    problems = _problems(d, cfg)
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert f"corrupt safetensors file {victim.name}: truncated" in text
    assert "index points at missing key: " + PFX + "layers.1.ghost.weight" in text
    assert f"wrong shape: layers.0.self_attn.q_proj.weight (key {shapes['wrong']}): got (64, 63)" in text
    assert "missing tensors (1): layers.7.self_attn.q_b_proj.weight" in text
    assert "unexpected tensors (1): " + extra in text
    assert "fp8 weight without its scale: " + shapes["fp8"] in text


def test_no_weights(tmp_path, cfg):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no weights in"):
        load_weights(tmp_path / "empty", cfg, progress=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: only safetensors is supported"):
        load_weights(tmp_path / "bin", cfg, progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(tmp_path / "nope", cfg, progress=False)


# ------------------------------------------------------------------------------------------------
# MTP
# ------------------------------------------------------------------------------------------------
def _add_mtp_shard(d: Path, mtp: dict[str, torch.Tensor]) -> None:
    """Write the MTP layer in original layout (per-expert keys, full prefix) as an extra shard."""
    tensors = {}
    for n, t in mtp.items():
        m = re.match(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$", n)
        if m:
            for e in range(t.shape[0]):
                tensors[f"{PFX}{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e].clone()
        else:
            tensors[PFX + n] = t
    save_file(tensors, str(d / "mtp.safetensors"))
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in tensors})
    index_file.write_text(json.dumps(index))


def test_mtp_layer_loads(ckpts, reference, tmp_path):
    d = _copy(ckpts["sharded"], tmp_path / "c")
    mcfg = _cfg_with(d, num_nextn_predict_layers=1)
    assert mcfg.text.mtp_layer_ids == [N_LAYERS]
    mtp = {n: t for n, t in dummy_weights(mcfg, dtype=torch.float32, seed=5).items()
           if n.startswith(f"layers.{N_LAYERS}.")}
    assert "layers.8.eh_proj.weight" in mtp and "layers.8.mlp.experts.gate_proj" in mtp
    assert "layers.8.self_attn.indexer.index_kpool_compress_ape" in mtp
    assert not any(".hc_" in n for n in mtp)
    _add_mtp_shard(d, mtp)
    w = load_weights(d, mcfg, progress=False)
    assert set(w) == set(reference) | set(mtp)
    for n, t in mtp.items():
        assert torch.equal(w[n], t), n
    # also when MTP is optional: present tensors are still returned
    assert set(load_weights(d, mcfg, progress=False, allow_missing_mtp=True)) == set(w)
    # a config that does not declare MTP rejects the extra layer with the fix
    (problem,) = _problems(d, _cfg_with(d))
    assert "beyond num_hidden_layers=8" in problem and "num_nextn_predict_layers" in problem


def test_missing_mtp(ckpts, reference, tmp_path):
    mcfg = _cfg_with(ckpts["orig"], num_nextn_predict_layers=1)
    (problem,) = _problems(ckpts["orig"], mcfg)
    assert "MTP layer(s) [8]" in problem and "allow_missing_mtp=True" in problem
    w = load_weights(ckpts["orig"], mcfg, progress=False, allow_missing_mtp=True)
    assert set(w) == set(reference)
    # a partial MTP layer is corruption, not "absent": it fails even when MTP is optional
    d = _copy(ckpts["sharded"], tmp_path / "c")
    mtp = {n: t for n, t in dummy_weights(mcfg, dtype=torch.float32).items() if n.startswith("layers.8.")}
    mtp.pop("layers.8.hnorm.weight")
    _add_mtp_shard(d, mtp)
    assert _problems(d, mcfg, allow_missing_mtp=True) == ["missing tensors (1): layers.8.hnorm.weight"]


# ------------------------------------------------------------------------------------------------
# dummy weights
# ------------------------------------------------------------------------------------------------
def test_dummy_weights_names_shapes_dtypes(cfg):
    mcfg = ModelConfig.from_dict({**cfg.raw, "text_config": {**cfg.raw["text_config"], "num_nextn_predict_layers": 1}})
    w = dummy_weights(mcfg, dtype=torch.bfloat16, seed=0)
    expected = expected_weight_shapes(mcfg)
    assert {n: tuple(t.shape) for n, t in w.items()} == expected
    for n, t in w.items():
        assert t.dtype == (torch.float32 if is_fp32_weight(n) else torch.bfloat16), n
        assert t.device.type == "cpu" and torch.isfinite(t.float()).all(), n
    no_mtp = dummy_weights(mcfg, include_mtp=False)
    assert set(no_mtp) == {n for n in expected if not n.startswith("layers.8.")}
    # magnitudes: norms ~1, matrices ~N(0, 1/sqrt(fan_in)), exp(A_log) within FLA's [1, 16]
    assert (w["layers.0.input_layernorm.weight"].float() - 1).abs().max() < 0.2
    assert (w["layers.8.enorm.weight"].float() - 1).abs().max() < 0.2
    std = w["layers.3.mlp.experts.down_proj"].float().std().item()  # fan_in = moe_intermediate_size 32
    assert abs(std * math.sqrt(32) - 1) < 0.1
    std = w["layers.0.hc_attn_fn"].std().item()  # fan_in = 4 * 64
    assert abs(std * math.sqrt(256) - 1) < 0.15
    a = w["layers.0.self_attn.A_log"].exp()
    assert (a >= 1).all() and (a <= 16).all()
    assert torch.equal(w["layers.3.mlp.experts.gate_proj"], dummy_weights(mcfg, seed=0)["layers.3.mlp.experts.gate_proj"])
    assert not torch.equal(w["embed_tokens.weight"], dummy_weights(mcfg, seed=1)["embed_tokens.weight"])


# ------------------------------------------------------------------------------------------------
# the project's tiny default checkpoint (written by glm5.tiny_checkpoint, when present)
# ------------------------------------------------------------------------------------------------
def test_project_tiny_checkpoint_loads(tmp_path):
    from glm5.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny")
    tcfg = ModelConfig.from_pretrained(path)
    assert tcfg.text.mtp_layer_ids  # it carries an MTP layer
    w = load_weights(path, tcfg, dtype=torch.bfloat16, progress=False)
    assert {n: tuple(t.shape) for n, t in w.items()} == expected_weight_shapes(tcfg)
    raw = load_file(str(path / "model.safetensors"))
    mtp = tcfg.text.mtp_layer_ids[0]
    assert torch.equal(w[f"layers.{mtp}.eh_proj.weight"], raw[f"{PFX}layers.{mtp}.eh_proj.weight"].to(torch.bfloat16))
    assert torch.equal(w[f"layers.{mtp}.mlp.experts.down_proj"][1],
                       raw[f"{PFX}layers.{mtp}.mlp.experts.1.down_proj.weight"].to(torch.bfloat16))
