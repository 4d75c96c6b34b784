"""fp8 weights on the CPU: the block format, loading in each ``quantization`` mode, the fp8 linear types, and
the engine running with fp8 storage.

The fp8 checkpoints are made here: the tiny checkpoint's weights quantized to e4m3 with 128 x 128 block scales
(:func:`glm5.weights.quantize_weights`) and written under the published key names (``x.weight`` float8_e4m3fn
beside ``x.weight_scale_inv`` float32), in the original and the HF-packed layouts.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.engine import EngineArgs, LLMEngine
from glm5.layers.linear import ConcatMethod, Fp8BlockMethod, HeadLinear, Linear, MultiOutputLinear, UnquantizedMethod, \
    split_heads
from glm5.sampling_params import SamplingParams
from glm5.weights import (
    SCALE_SUFFIX,
    CheckpointError,
    is_fp8_linear_weight,
    load_weights,
    quantize_weights,
    save_weights,
)
from glm5_kernels.fp8_ref import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_block,
    fp8_head_linear_ref,
    fp8_linear_ref,
    per_token_group_quant_fp8_ref,
    quantize_fp8_block,
    w8a8_linear_ref,
)

PFX = "model.language_model."


# ------------------------------------------------------------------------------------------------
# the block format
# ------------------------------------------------------------------------------------------------
def _e4m3_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound of |dequant(quant(w)) - w|: half an e4m3 ulp, i.e. 2^-4 |w| in the normal range and
    2^-10 · s (half the subnormal spacing 2^-9, in scaled units) below it."""
    s = scale.repeat_interleave(128, -2)[..., : w.shape[-2], :].repeat_interleave(128, -1)[..., : w.shape[-1]]
    return w.abs() * 2.0 ** -4 + s * 2.0 ** -10


@pytest.mark.parametrize("shape", [(300, 260), (128, 4096), (64, 96), (3, 200, 130)])
def test_online_quantization_round_trips_within_the_e4m3_bound(shape):
    g = torch.Generator().manual_seed(sum(shape))
    # magnitudes spread over four decades so tiles differ in scale and some entries are subnormal in e4m3
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2.0)
    q, s = quantize_fp8_block(w)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert tuple(s.shape) == (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    back = dequantize_fp8_block(q, s)
    err = (back - w).abs()
    assert (err <= _e4m3_bound(w, s)).all(), float((err / _e4m3_bound(w, s)).max())
    # the scale is the tile's absmax / 448, so each tile's largest entry is stored exactly at ±448
    tile = w[..., :128, :128]
    assert torch.allclose(s[..., 0, 0], tile.abs().amax(dim=(-2, -1)) / FP8_MAX)
    assert q[..., :128, :128].float().abs().amax() == FP8_MAX
    # an all-zero tile gets exact zeros back (no NaN from a zero scale)
    z = torch.zeros(130, 130)
    zq, zs = quantize_fp8_block(z)
    assert torch.equal(dequantize_fp8_block(zq, zs), z)


def test_activation_group_quantization_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=g) * 3
    q, s = per_token_group_quant_fp8_ref(x)
    assert q.shape == x.shape and tuple(s.shape) == (5, 3)
    back = q.float() * s.repeat_interleave(128, 1)[:, :300]
    assert (back - x).abs().le(x.abs() * 2 ** -4 + s.repeat_interleave(128, 1)[:, :300] * 2 ** -10).all()
    # w8a8 reference = weight-only reference up to the activation rounding (3 mantissa bits)
    w = torch.randn(70, 300, generator=g)
    wq, ws = quantize_fp8_block(w)
    a, b = w8a8_linear_ref(x, wq, ws), fp8_linear_ref(x, wq, ws)
    assert float((a - b).norm() / b.norm()) < 2 ** -4


# ------------------------------------------------------------------------------------------------
# the linear types
# ------------------------------------------------------------------------------------------------
def _fp8_linear(n: int, k: int, seed: int) -> tuple[Linear, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    q, s = quantize_fp8_block(w)
    return Linear(Fp8BlockMethod(q, s)), dequantize_fp8_block(q, s)


def test_fp8_linear_applies_the_dequantized_weight():
    lin, wd = _fp8_linear(200, 260, 0)
    x = torch.randn(7, 260)
    assert lin.quantized and lin.out_features == 200 and lin.in_features == 260
    assert torch.equal(lin(x), torch.nn.functional.linear(x, wd))
    assert torch.equal(lin.dequantized(torch.float32), wd)
    with pytest.raises(AttributeError, match="dequantized"):
        _ = lin.weight
    with pytest.raises(ValueError, match="do not fit the weight"):
        Fp8BlockMethod(lin.method.weight, torch.ones(1, 1))


def test_concat_merges_fp8_parts_when_only_the_last_is_a_partial_block():
    """The KDA input projection shape: q|k|v (256 rows each here), f_a|g_a (128), b (64 rows, partial)."""
    parts = [_fp8_linear(n, 256, i) for i, n in enumerate((256, 256, 256, 128, 128, 64))]
    cat = Linear.concat([p for p, _ in parts])
    assert isinstance(cat.method, Fp8BlockMethod) and cat.out_features == 1088
    x = torch.randn(3, 256)
    assert torch.equal(cat(x), torch.nn.functional.linear(x, torch.cat([w for _, w in parts])))


def test_concat_of_unalignable_parts_runs_one_gemm_per_run():
    a, wa = _fp8_linear(64, 128, 1)      # ends inside a scale block: b's tiles would straddle a and b
    b, wb = _fp8_linear(128, 128, 2)
    c = Linear(torch.randn(32, 128))     # another storage format
    cat = Linear.concat([a, b, c])
    assert isinstance(cat.method, ConcatMethod) and len(cat.method.parts) == 3
    x = torch.randn(4, 128)
    want = torch.nn.functional.linear(x, torch.cat([wa, wb, c.weight]))
    assert torch.allclose(cat(x), want, atol=1e-5, rtol=1e-5)
    plain = Linear.concat([Linear(torch.randn(5, 8)), Linear(torch.randn(3, 8))])
    assert isinstance(plain.method, UnquantizedMethod) and plain.out_features == 8


def test_multi_output_linear_merges_what_can_share_a_weight_and_returns_each_part():
    """MLA's x projections in fp8: q_a | kv_a | wk (whole 128-row blocks) merge into one fp8 GEMM, the bf16
    compress gate is a second; each part's output is a view of its GEMM's output, equal to the part alone."""
    parts = [_fp8_linear(n, 256, i) for i, n in enumerate((256, 128, 128))]
    gate = torch.randn(96, 256)
    fused = MultiOutputLinear([p for p, _ in parts] + [Linear(gate)])
    assert [len(sizes) for _, sizes in fused.runs] == [3, 1]
    assert isinstance(fused.runs[0][0].method, Fp8BlockMethod) and fused.out_features == (256, 128, 128, 96)
    x = torch.randn(5, 256)
    outs = fused(x)
    for got, want in zip(outs, [w for _, w in parts] + [gate]):
        assert torch.equal(got, torch.nn.functional.linear(x, want))
    assert outs[1].data_ptr() == outs[0].data_ptr() + 256 * 4       # a column view, not a copy
    # a partial fp8 block ends a run; plain weights of one dtype always merge
    a, wa = _fp8_linear(64, 128, 7)
    b, wb = _fp8_linear(128, 128, 8)
    assert [len(sz) for _, sz in MultiOutputLinear([a, b]).runs] == [1, 1]
    plain = MultiOutputLinear([Linear(torch.randn(5, 8)), Linear(torch.randn(3, 8))])
    assert len(plain.runs) == 1 and plain.out_features == (5, 3)
    with pytest.raises(ValueError, match="one input width"):
        MultiOutputLinear([Linear(torch.randn(5, 8)), Linear(torch.randn(3, 9))])
    biased = MultiOutputLinear([Linear(torch.randn(5, 8), torch.randn(5)), Linear(torch.randn(3, 8), torch.randn(3))])
    x = torch.randn(2, 8)
    assert len(biased.runs) == 1 and all(torch.allclose(got, p(x)) for got, p in zip(biased(x), [
        Linear(biased.runs[0][0].weight[:5], biased.runs[0][0].bias[:5]),
        Linear(biased.runs[0][0].weight[5:], biased.runs[0][0].bias[5:])]))


def test_absorbed_kv_b_views_stay_fp8_when_head_dims_are_whole_blocks():
    heads, dk, dv, r = 3, 128, 256, 200
    lin, wd = _fp8_linear(heads * (dk + dv), r, 5)
    w_uk_t, w_uv = split_heads(lin, heads, (dk, dv), torch.float32)
    assert w_uk_t.quantized and w_uv.quantized
    assert w_uk_t.weight.dtype == FP8_DTYPE and tuple(w_uk_t.weight.shape) == (heads, r, dk)
    kv = wd.view(heads, dk + dv, r)
    q = torch.randn(5, heads, dk)
    # the transposed fp8 copy carries the transposed scale tiles: exactly the transposed dequantized weight
    assert torch.allclose(w_uk_t(q), torch.einsum("nhd,hdr->nhr", q, kv[:, :dk]), atol=1e-5, rtol=1e-5)
    o = torch.randn(5, heads, r)
    assert torch.allclose(w_uv(o), torch.einsum("nhr,hdr->nhd", o, kv[:, dk:]), atol=1e-5, rtol=1e-5)
    assert torch.equal(w_uv(o), fp8_head_linear_ref(o, w_uv.weight, w_uv.scale_inv))
    # head dims that are not whole blocks: dequantized once, in the model dtype
    lin2, wd2 = _fp8_linear(2 * (32 + 32), 64, 6)
    uk, uv = split_heads(lin2, 2, (32, 32), torch.float32)
    assert not uk.quantized and uk.weight.dtype == torch.float32
    assert torch.equal(uv.weight, wd2.view(2, 64, 64)[:, 32:])
    with pytest.raises(ValueError, match="per-head fp8 scales"):
        HeadLinear(w_uv.weight, torch.ones(1, 1, 1))


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_checkpoint_dir, tmp_path_factory):
    """The tiny checkpoint's weights quantized (online set) and saved as an fp8 checkpoint (original layout:
    its 32-row experts cannot be packed in fp8, see test_packed_fp8_experts_keep_their_chunks)."""
    dense = load_weights(tiny_checkpoint_dir, progress=False)
    quant = quantize_weights(dense)
    d = tmp_path_factory.mktemp("fp8ck") / "original"
    shutil.copytree(tiny_checkpoint_dir, d)
    (d / "model.safetensors").unlink()
    save_weights(quant, d, layout="original")
    with pytest.raises(ValueError, match="cannot be packed"):
        save_weights(quant, d.parent / "packed", layout="packed")
    return dense, quant, {"original": d}


def test_fp8_checkpoint_uses_the_published_names(fp8_checkpoints):
    _, _, dirs = fp8_checkpoints
    raw = load_file(str(dirs["original"] / "model.safetensors"))
    key = PFX + "layers.3.self_attn.kv_b_proj.weight"
    assert raw[key].dtype == FP8_DTYPE and raw[key + SCALE_SUFFIX].dtype == torch.float32
    assert raw[PFX + "layers.2.mlp.experts.5.down_proj.weight"].dtype == FP8_DTYPE
    assert PFX + "layers.2.mlp.experts.5.down_proj.weight_scale_inv" in raw
    assert raw[PFX + "layers.2.mlp.gate.weight"].dtype == torch.float32  # the router stays unquantized
    assert raw[PFX + "embed_tokens.weight"].dtype == torch.float32


def test_load_fp8_checkpoint_in_each_quantization_mode(fp8_checkpoints):
    dense, quant, dirs = fp8_checkpoints
    d = dirs["original"]
    fp8_names = {n for n in quant if n + SCALE_SUFFIX in quant}
    assert "layers.2.mlp.experts.gate_proj" in fp8_names and "layers.0.self_attn.b_proj.weight" in fp8_names

    none = load_weights(d, progress=False, quantization="none")
    assert set(none) == set(dense) and not any(t.dtype == FP8_DTYPE for t in none.values())
    for n in fp8_names:  # dequantized in fp32: exactly W8 · s
        assert torch.equal(none[n], dequantize_fp8_block(quant[n], quant[n + SCALE_SUFFIX])), n

    for mode in ("auto", "fp8"):
        kept = load_weights(d, progress=False, quantization=mode)
        assert set(kept) == set(quant), mode
        for n in fp8_names:  # the checkpoint's fp8 bytes and scales, untouched (no model-dtype copy)
            assert kept[n].dtype == FP8_DTYPE and torch.equal(kept[n].view(torch.uint8), quant[n].view(torch.uint8))
            assert torch.equal(kept[n + SCALE_SUFFIX], quant[n + SCALE_SUFFIX])
        for n in set(dense) - fp8_names:
            assert torch.equal(kept[n], dense[n]), n

    bf16 = load_weights(d, progress=False, quantization="none", dtype=torch.bfloat16)
    n = "layers.3.self_attn.q_b_proj.weight"
    assert torch.equal(bf16[n], none[n].to(torch.bfloat16))


def test_packed_fp8_experts_keep_their_chunks(tmp_path):
    """HF's packed ``experts.gate_up_proj`` in fp8 (I = 256: gate and up are whole scale blocks): auto keeps each
    half as fp8 with its half of the scales."""
    from glm5.config import ModelConfig
    from glm5.weights import dummy_weights

    text = dict(vocab_size=32, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2, n_shared_experts=1,
                num_experts_per_tok=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
                index_topk=8, index_head_dim=8, index_n_heads=2, index_kpool=4, linear_head_dim=8, linear_num_heads=2,
                mlp_layer_types=["dense", "sparse"], hc_mult=2, num_nextn_predict_layers=0)
    cfg = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text})
    quant = quantize_weights(dummy_weights(cfg, dtype=torch.float32, seed=3, include_mtp=False))
    save_weights(quant, tmp_path, layout="packed")
    raw = load_file(str(tmp_path / "model.safetensors"))
    assert tuple(raw[PFX + "layers.1.mlp.experts.gate_up_proj" + SCALE_SUFFIX].shape) == (2, 4, 2)
    kept = load_weights(tmp_path, cfg, progress=False, quantization="auto")
    for n in ("gate_proj", "up_proj", "down_proj"):
        name = f"layers.1.mlp.experts.{n}"
        assert kept[name].dtype == FP8_DTYPE
        assert torch.equal(kept[name].view(torch.uint8), quant[name].view(torch.uint8))
        assert torch.equal(kept[name + SCALE_SUFFIX], quant[name + SCALE_SUFFIX])
    none = load_weights(tmp_path, cfg, progress=False, quantization="none")
    assert torch.equal(none["layers.1.mlp.experts.up_proj"],
                       dequantize_fp8_block(quant["layers.1.mlp.experts.up_proj"],
                                            quant["layers.1.mlp.experts.up_proj" + SCALE_SUFFIX]))


def test_dummy_weights_quantized_as_made_equal_quantizing_the_finished_dict(tiny_checkpoint_dir):
    """The bench's fp8 Setup quantizes each dummy weight as it is made (the bf16 stack never exists at once):
    the same names, codes and scales as quantizing the finished dict, and the generator's draws unchanged."""
    from glm5.config import ModelConfig
    from glm5.weights import dummy_weights

    cfg = ModelConfig.from_pretrained(tiny_checkpoint_dir)
    after = quantize_weights(dummy_weights(cfg, dtype=torch.bfloat16, seed=5, include_mtp=True))
    made = dummy_weights(cfg, dtype=torch.bfloat16, seed=5, include_mtp=True, quantize=is_fp8_linear_weight)
    assert made.keys() == after.keys()
    assert any(n.endswith(SCALE_SUFFIX) for n in made)
    for n, t in after.items():
        assert made[n].dtype == t.dtype, n
        assert torch.equal(made[n].view(torch.uint8), t.view(torch.uint8)), n


def test_online_fp8_quantizes_an_unquantized_checkpoint(tiny_checkpoint_dir):
    dense = load_weights(tiny_checkpoint_dir, progress=False)
    auto = load_weights(tiny_checkpoint_dir, progress=False, quantization="auto")
    assert not any(t.dtype == FP8_DTYPE for t in auto.values())  # auto: what the checkpoint has (fp32 here)
    online = load_weights(tiny_checkpoint_dir, progress=False, quantization="fp8")
    want = {n for n in dense if is_fp8_linear_weight(n)}
    assert {n for n, t in online.items() if t.dtype == FP8_DTYPE} == want
    assert "layers.2.mlp.experts.up_proj" in want and "layers.3.self_attn.indexer.wk.weight" in want
    assert "layers.2.mlp.gate.weight" not in want and "lm_head.weight" not in want
    assert "layers.3.self_attn.indexer.weights_proj.weight" not in want
    for n in want:
        q, s = quantize_fp8_block(dense[n])
        assert torch.equal(online[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(online[n + SCALE_SUFFIX], s)
        assert (dequantize_fp8_block(q, s) - dense[n]).abs().le(_e4m3_bound(dense[n], s)).all(), n


def _rewrite(path: Path, edit) -> None:
    t = load_file(str(path))
    edit(t)
    save_file(t, str(path))


def test_mixed_fp8_expert_stack(fp8_checkpoints, tmp_path):
    """One expert of a stack stored unquantized: auto dequantizes the stack, fp8 quantizes the odd one."""
    dense, quant, dirs = fp8_checkpoints
    d = tmp_path / "mixed"
    shutil.copytree(dirs["original"], d)
    key = PFX + "layers.2.mlp.experts.3.up_proj.weight"

    def edit(t):
        t[key] = dense["layers.2.mlp.experts.up_proj"][3].clone()
        t.pop(key + SCALE_SUFFIX)

    _rewrite(d / "model.safetensors", edit)
    auto = load_weights(d, progress=False, quantization="auto")
    up = auto["layers.2.mlp.experts.up_proj"]
    assert up.dtype == torch.float32 and "layers.2.mlp.experts.up_proj" + SCALE_SUFFIX not in auto
    assert torch.equal(up[3], dense["layers.2.mlp.experts.up_proj"][3])
    online = load_weights(d, progress=False, quantization="fp8")
    assert online["layers.2.mlp.experts.up_proj"].dtype == FP8_DTYPE
    s = online["layers.2.mlp.experts.up_proj" + SCALE_SUFFIX]
    assert torch.equal(s, quant["layers.2.mlp.experts.up_proj" + SCALE_SUFFIX])  # same values, same scales


@pytest.mark.parametrize("mode", ["auto", "fp8", "none"])
def test_bad_scale_shape_fails_at_load_with_a_clear_error(fp8_checkpoints, tmp_path, mode):
    _, _, dirs = fp8_checkpoints
    d = tmp_path / "bad"
    shutil.copytree(dirs["original"], d)
    key = PFX + "layers.3.self_attn.o_proj.weight" + SCALE_SUFFIX
    ekey = PFX + "layers.2.mlp.experts.1.gate_proj.weight" + SCALE_SUFFIX

    def edit(t):
        t[key] = torch.ones(2, 3)
        t[ekey] = t[ekey].to(torch.int32)

    _rewrite(d / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as err:
        load_weights(d, progress=False, quantization=mode)
    text = str(err.value)
    assert f"fp8 scale {key}: got (2, 3), expected (1, 1)" in text
    assert f"fp8 scale {ekey} is I32; block scales are float32" in text
    with pytest.raises(ValueError, match="quantization='int4'"):
        load_weights(d, progress=False, quantization="int4")


# ------------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------------
def _engine(ckpt: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(ckpt), device="cpu", block_size=16, num_cache_blocks=128, max_num_seqs=4,
                                max_num_batched_tokens=128, load_progress=False, **kw))


PROMPTS = [[5, 9, 13, 17], list(range(20, 90)), [3] * 7 + [200, 201, 202]]


def test_engine_greedy_in_fp8_storage_matches_the_dequantized_run(fp8_checkpoints):
    """Same checkpoint, fp8 kept (dequantized on every call by the CPU reference path) vs dequantized at load:
    the same weights reach the same GEMMs, so the greedy tokens are identical, not merely close."""
    _, _, dirs = fp8_checkpoints
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    fp8 = _engine(dirs["original"], quantization="fp8")
    model = fp8.runner.model
    mla = model.layers[3].attn
    assert mla.q_b.quantized and mla.o_proj.quantized and model.layers[0].attn.in_proj.quantized
    assert model.layers[2].mlp.scales is not None and model.layers[2].mlp.w_up.dtype == FP8_DTYPE
    assert not model.lm_head.quantized
    got = [o.token_ids for o in fp8.generate(PROMPTS, params)]
    none = _engine(dirs["original"], quantization="none")
    assert not none.runner.model.layers[3].attn.q_b.quantized
    want = [o.token_ids for o in none.generate(PROMPTS, params)]
    assert got == want


def test_auto_on_the_cpu_dequantizes_at_load(fp8_checkpoints, caplog):
    _, _, dirs = fp8_checkpoints
    args = EngineArgs(model=str(dirs["original"]), device="cpu", quantization="auto")
    assert args.load_quantization == "none"
    assert EngineArgs(model="x", device="cpu", quantization="fp8").load_quantization == "fp8"
    assert EngineArgs.from_dict({"model": "x", "quantization": "none"}).quantization == "none"
    with pytest.raises(ValueError, match="quantization='fp16'"):
        EngineArgs(model="x", quantization="fp16")
    with caplog.at_level("INFO", logger="glm5.engine.llm_engine"):
        eng = _engine(dirs["original"], quantization="auto")
    assert not eng.runner.model.layers[3].attn.q_b.quantized
    assert any("dequantized" in r.getMessage() and "quantization=fp8" in r.getMessage() for r in caplog.records)


def test_generate_cli_takes_quantization():
    import argparse

    from glm5.entrypoints.generate import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["hi", "--quantization", "fp8"]).quantization == "fp8"
    assert p.parse_args(["hi"]).quantization == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["hi", "--quantization", "int8"])


# ------------------------------------------------------------------------------------------------
# memory table and the bench's fp8 rendering
# ------------------------------------------------------------------------------------------------
def test_memory_table_of_the_real_config(real_config_path):
    import json

    from glm5.config import ModelConfig
    from glm5.weights.memory import memory_table
    from glm5.weights.names import expected_weight_shapes, is_fp32_weight

    cfg = ModelConfig.from_dict(json.loads(real_config_path.read_text()))
    table = memory_table(cfg)
    shapes = expected_weight_shapes(cfg, include_mtp=True)
    bf16 = sum(math.prod(s) * (4 if is_fp32_weight(n) else 2) for n, s in shapes.items())
    rows = {(r["weights"], r["tp_ep"]): r["bytes_per_gpu"] for r in table["rows"]}
    assert rows[("bfloat16", 1)] == bf16 and 320e9 < table["params"] < 323e9      # the 321.3 B of model-spec §1.1
    assert 0.5 < rows[("fp8 online", 1)] / bf16 < 0.51                           # 1 byte + 1/4096 of a scale
    assert rows[("fp8 online", 1)] < rows[("fp8 checkpoint", 1)] < 0.52 * bf16   # KDA bf16 in the checkpoint
    for v in ("bfloat16", "fp8 online"):
        assert rows[(v, 8)] < rows[(v, 4)] < rows[(v, 2)] < rows[(v, 1)]
        assert rows[(v, 8)] > rows[(v, 1)] / 8                                   # replicated parts stay
    assert rows[("fp8 checkpoint", 4)] < 141e9 < rows[("bfloat16", 4)]           # fits 4 x H200 only in fp8


def test_bench_renders_fp8_rows():
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_results", Path(__file__).resolve().parent.parent
                                                  / "bench" / "render_results.py")
    rr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rr)

    def row(w, tok_s, gb):
        return {"batch": 1, "ctx": 1024, "weight_dtype": w, "step_s": 1 / tok_s, "eager_step_s": 2 / tok_s,
                "tok_s": tok_s, "experts_touched": [8], "bytes": {"weights": int(gb * 1e9), "total": int(gb * 1e9)}}
    res = rr.finalize({"ceilings": {"copy_bw_Bps": 4e12, "matmul_bf16_flops": 8e14},
                       "decode": [row("bfloat16", 300.0, 7.8), row("float8_e4m3fn", 540.0, 4.0)], "prefill": []})
    table = "\n".join(rr.fp8_decode_table(res["decode"]))
    assert "| 1 | 1024 | 300 | 540 | 1.80× |" in table
    decode = "\n".join(rr.decode_table(res["decode"]))
    assert "| bf16 | 1 | 1024 |" in decode and "| fp8 | 1 | 1024 |" in decode


@pytest.fixture(scope="module")
def aligned_fp8_checkpoint(tmp_path_factory):
    """A small checkpoint whose projections are whole 128-blocks, as on the real model: the KDA input concat merges
    into one fp8 weight (only b_proj, 2 rows, is partial and last) and MLA's absorbed kv_b views stay fp8."""
    from glm5.tiny_checkpoint import make_tiny_checkpoint

    over = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128,
                qk_nope_head_dim=128, v_head_dim=128, index_head_dim=128, index_n_heads=2, linear_num_heads=2,
                linear_head_dim=128, n_routed_experts=4, num_experts_per_tok=2)
    root = tmp_path_factory.mktemp("fp8aligned")
    src = make_tiny_checkpoint(root / "src", text_overrides=over, num_mtp_layers=0)
    d = root / "fp8"
    shutil.copytree(src, d)
    (d / "model.safetensors").unlink()
    save_weights(quantize_weights(load_weights(src, progress=False)), d)
    return d


def test_engine_fp8_on_block_aligned_shapes(aligned_fp8_checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fp8 = _engine(aligned_fp8_checkpoint, quantization="fp8")
    model = fp8.runner.model
    kda = next(layer.attn for layer in model.layers if hasattr(layer.attn, "in_proj"))
    mla = next(layer.attn for layer in model.layers if hasattr(layer.attn, "w_uk_t"))
    assert isinstance(kda.in_proj.method, Fp8BlockMethod)          # one fp8 GEMM for q|k|v|f_a|g_a|b
    # q_a | kv_a | wk: one fp8 GEMM, the bf16 compress gate a second; a SwiGLU's gate | up: one fp8 GEMM
    assert [len(sizes) for _, sizes in mla.x_proj.runs] == [3, 1]
    assert isinstance(mla.x_proj.runs[0][0].method, Fp8BlockMethod)
    mlp = model.layers[0].mlp
    assert len(mlp.gate_up.runs) == 1 and isinstance(mlp.gate_up.runs[0][0].method, Fp8BlockMethod)
    assert mla.w_uk_t.quantized and mla.w_uv.quantized              # absorbed views kept in fp8
    assert mla.w_uv.weight.data_ptr() == mla.kv_b.method.weight.data_ptr() + 128 * 128  # W_UV: a view of kv_b
    got = [o.token_ids for o in fp8.generate(PROMPTS, params)]
    want = [o.token_ids for o in _engine(aligned_fp8_checkpoint, quantization="none").generate(PROMPTS, params)]
    assert got == want
