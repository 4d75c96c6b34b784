"""Write canonical tensors back to a safetensors checkpoint (original or HF-packed key layout).

Used by tests and tools to produce checkpoints the loader must accept: the original layout is what
transformers' ``save_pretrained`` and the published checkpoint use (per-expert keys, ``hc_*``,
``q/k/v_conv1d``, ``model.language_model.`` prefix); the packed layout is HF's in-memory
``state_dict()`` naming. Optionally sharded with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from glm5.weights.files import INDEX_FILE, SINGLE_FILE
from glm5.weights.names import SCALE_SUFFIX, original_checkpoint_key

_EXPERT_RE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
# fp8 block scales of a stacked expert tensor ([E, ...]): saved per expert beside each expert's weight
_EXPERT_SCALE_RE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)" + SCALE_SUFFIX + "$")
_CONV_RE = re.compile(r"^(layers\.\d+\.self_attn)\.([qkv])_conv1d\.weight$")
_HC_RE = re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$")
_FORGET_RE = re.compile(r"^(layers\.\d+\.self_attn)\.(f_[ab]_proj\.weight(?:_scale_inv)?|dt_bias|A_log)$")


def to_original_layout(weights: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint key, tensor)`` in the original layout: per-expert ``.weight`` keys (and
    ``.weight_scale_inv`` for fp8 experts), prefixes."""
    for name, t in weights.items():
        m = _EXPERT_RE.match(name)
        ms = _EXPERT_SCALE_RE.match(name)
        if m:
            for e in range(t.shape[0]):
                yield original_checkpoint_key(f"{m.group(1)}.{e}.{m.group(2)}.weight"), t[e]
        elif ms:
            for e in range(t.shape[0]):
                yield original_checkpoint_key(f"{ms.group(1)}.{e}.{ms.group(2)}.weight{SCALE_SUFFIX}"), t[e]
        else:
            yield original_checkpoint_key(name), t


def to_packed_layout(weights: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` as HF's in-memory ``state_dict()`` names them (``experts.gate_up_proj``,
    ``attn_hc.fn``, one ``conv1d.weight``, ``forget_gate.*``)."""
    done: set[str] = set()
    for name, t in weights.items():
        if name in done:
            continue
        m = _EXPERT_RE.match(name) or _EXPERT_SCALE_RE.match(name)
        if m and m.group(2) in ("gate_proj", "up_proj"):
            sfx = SCALE_SUFFIX if name.endswith(SCALE_SUFFIX) else ""
            gate, up = weights[f"{m.group(1)}.gate_proj{sfx}"], weights[f"{m.group(1)}.up_proj{sfx}"]
            if sfx and weights[f"{m.group(1)}.gate_proj"].shape[1] % 128:
                raise ValueError(f"{m.group(1)}: fp8 experts with {weights[m.group(1) + '.gate_proj'].shape[1]} "
                                 "rows per projection cannot be packed (gate_up_proj's 128-row scale blocks would "
                                 "straddle gate and up); save in the original layout")
            done.update({f"{m.group(1)}.gate_proj{sfx}", f"{m.group(1)}.up_proj{sfx}"})
            yield original_checkpoint_key(f"{m.group(1)}.gate_up_proj{sfx}"), torch.cat([gate, up], dim=1)
            continue
        m = _CONV_RE.match(name)
        if m:
            parts = [f"{m.group(1)}.{x}_conv1d.weight" for x in "qkv"]
            done.update(parts)
            yield original_checkpoint_key(f"{m.group(1)}.conv1d.weight"), torch.cat([weights[p] for p in parts])
            continue
        m = _HC_RE.match(name)
        if m:
            yield original_checkpoint_key(f"{m.group(1)}.{m.group(2)}_hc.{m.group(3)}"), t
            continue
        m = _FORGET_RE.match(name)
        if m:
            yield original_checkpoint_key(f"{m.group(1)}.forget_gate.{m.group(2)}"), t
            continue
        yield original_checkpoint_key(name), t


def save_weights(weights: dict[str, torch.Tensor], path: str | Path, layout: str = "original",
                 max_shard_bytes: int | None = None) -> list[Path]:
    """Write canonical ``weights`` into directory ``path`` in ``layout`` ("original" or "packed").

    With ``max_shard_bytes`` the tensors are split over ``model-0000i-of-0000n.safetensors`` shards
    plus ``model.safetensors.index.json``; otherwise one ``model.safetensors``. Returns the files.
    """
    if layout not in ("original", "packed"):
        raise ValueError(f"layout={layout!r}: use 'original' (published checkpoint keys) or 'packed' "
                         "(HF in-memory state_dict keys)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    items = to_original_layout(weights) if layout == "original" else to_packed_layout(weights)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in items}
    if max_shard_bytes is None:
        save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
        return [path / SINGLE_FILE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nb = v.numel() * v.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nb
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        files.append(path / fname)
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
    return files
