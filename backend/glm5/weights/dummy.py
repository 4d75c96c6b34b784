"""Random, correctly shaped weights created directly on the target device (for benchmarks).

Magnitudes are chosen so a forward pass stays numerically sane through many layers: norm weights
near 1, matrices ~ N(0, 1/sqrt(fan_in)) (unit-variance activations stay unit variance), small
biases, and KDA decay / mHC parameters in the ranges HF initializes them to. No file is touched,
so even a full-size layer stack can be materialized without a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from glm5.config import ModelConfig
from glm5.distributed.sharding import WeightSharding
from glm5.weights.fp8 import quantize_tensor
from glm5.weights.names import SCALE_SUFFIX, expected_weight_shapes, is_fp32_weight


def _fan_in(name: str, shape: tuple[int, ...]) -> int:
    if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
        return shape[-1]  # stacked [E, out, in]
    return math.prod(shape[1:]) if len(shape) > 1 else shape[0]


def _is_norm_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and "norm" in parts[-2]


def dummy_weights(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0, include_mtp: bool = True,
                  sharding: WeightSharding | None = None, fp8: bool = False,
                  quantize: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Random canonical weights for ``cfg`` on ``device``: same names and shapes as
    :func:`glm5.weights.expected_weight_shapes`, ``dtype`` except the fp32 set. Deterministic for a
    given ``seed`` and device type. ``sharding``: only this rank's shard of each tensor, created directly at
    its local shape (a rank never materialises the whole model); the values are the rank's own draws, not
    slices of the unsharded weights (benchmarks only need the shapes).

    ``fp8``: the tensors the fp8 checkpoint stores block-scaled (:func:`glm5.weights.memory_plan.is_fp8_weight`)
    are made as ``float8_e4m3fn`` with fp32 scales per 128×128 block under ``<name>_scale_inv`` (``[E, ...]``
    for stacked experts), the checkpoint's format, with the same effective magnitudes.

    ``quantize``: the tensors it selects are drawn in ``dtype`` as usual and quantized as each is made
    (:func:`glm5.weights.fp8.quantize_tensor`, online fp8's format: the same values as quantizing the finished
    dict), so the peak is the quantized model plus one ``dtype`` tensor: the bench config's 80 GB of bf16 weights
    never exist at once, and its fp8 model fits an 80 GB GPU."""
    from glm5.weights.memory_plan import is_fp8_weight
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def randn(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=dt)

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.rand(shape, generator=gen, device=dev, dtype=torch.float32)

    for name, shape in expected_weight_shapes(cfg, include_mtp=include_mtp).items():
        if sharding is not None:
            if not sharding.held(name):
                continue
            fan_in = _fan_in(name, shape)  # the full layer's fan-in keeps activations at unit variance
            shape = sharding.local_shape(name, shape)
        else:
            fan_in = _fan_in(name, shape)
        dt = torch.float32 if is_fp32_weight(name) else dtype
        if name.endswith(("hc_attn_scale", "hc_ffn_scale")):  # mHC gates on the dynamic part: HF inits 1
            t = torch.ones(shape, device=dev, dtype=dt)
        elif name.endswith(("hc_attn_base", "hc_ffn_base")):  # mHC static mixing logits
            t = randn(shape, dt).mul_(0.1)
        elif name.endswith(".A_log"):  # decay rate exp(A_log) in ~[1, 16] (FLA's init range)
            t = torch.log(1.0 + 15.0 * rand(shape)).to(dt)
        elif name.endswith(".dt_bias"):  # inverse softplus of dt, dt log-uniform in [1e-3, 1e-1]
            dtv = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * rand(shape))
            t = (dtv + torch.log(-torch.expm1(-dtv))).to(dt)
        elif name.endswith(".e_score_correction_bias"):
            t = randn(shape, dt).mul_(0.01)
        elif name.endswith(".index_kpool_compress_ape"):
            t = randn(shape, dt).mul_(0.1)
        elif _is_norm_weight(name):  # RMSNorm / LayerNorm gains (norm1, enorm, q_a_layernorm, ...)
            t = randn(shape, dt).mul_(0.02).add_(1.0)
        elif len(shape) == 1:  # biases
            t = randn(shape, dt).mul_(0.02)
        elif fp8 and is_fp8_weight(name, cfg):
            *lead, rows, cols = shape
            out[name] = randn(shape, torch.bfloat16).mul_(64.0).clamp_(-448, 448).to(torch.float8_e4m3fn)
            out[f"{name}_scale_inv"] = torch.full((*lead, -(-rows // 128), -(-cols // 128)),
                                                  1.0 / (64.0 * math.sqrt(fan_in)), device=dev, dtype=torch.float32)
            continue
        else:
            t = randn(shape, dt).mul_(1.0 / math.sqrt(fan_in))
        out[name] = t
        if quantize is not None and quantize(name):
            out[name], out[name + SCALE_SUFFIX] = quantize_tensor(t)
            del t
    return out
