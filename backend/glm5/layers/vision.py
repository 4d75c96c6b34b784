"""Vision tower: patch embed → ViT blocks with 2-D rope → 2×2 downsample conv → clamped-SwiGLU merger.

Several images and video slices (from several requests) are encoded in one call: their patches are
packed and attention stays inside each image or temporal slice (``cu_seqlens``). A video with
grid ``[t, h, w]`` is attended as ``t`` separate ``[1, h, w]`` slices, as in transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.config import VisionConfig
from glm5.layers.mlp import swiglu_mlp
from glm5_kernels.norms_ref import rms_norm

ROPE_THETA = 10000.0


def flatten_video_grid(grid_thw: torch.Tensor) -> torch.Tensor:
    """``[t, h, w]`` rows → ``t`` rows of ``[1, h, w]`` (one attention span per temporal slice)."""
    hw = torch.repeat_interleave(grid_thw[:, 1:], grid_thw[:, 0], dim=0)
    return torch.cat([torch.ones_like(hw[:, :1]), hw], dim=1)


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch, in the merge-block-major order the processors emit patches."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rc = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class VisionTower:
    def __init__(self, weights: dict[str, torch.Tensor], cfg: VisionConfig):
        self.cfg = cfg
        p = "visual"
        self.patch_w = weights[f"{p}.patch_embed.proj.weight"]
        self.patch_b = weights[f"{p}.patch_embed.proj.bias"]
        self.blocks = []
        for b in range(cfg.depth):
            bp = f"{p}.blocks.{b}"
            self.blocks.append({k: weights[f"{bp}.{k}"] for k in (
                "norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.q_norm.weight",
                "attn.k_norm.weight", "attn.proj.weight", "attn.proj.bias", "mlp.gate_proj.weight",
                "mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias", "mlp.down_proj.weight",
                "mlp.down_proj.bias")})
        self.post_norm = weights[f"{p}.post_layernorm.weight"]
        self.down_w = weights[f"{p}.downsample.weight"]
        self.down_b = weights[f"{p}.downsample.bias"]
        m = f"{p}.merger"
        self.merger = {k: weights[f"{m}.{k}"] for k in (
            "proj.weight", "post_projection_norm.weight", "post_projection_norm.bias", "gate_proj.weight",
            "up_proj.weight", "down_proj.weight")}
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, half, 2, dtype=torch.float32) / half))

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_w.dtype

    def _rope(self, grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = patch_positions(grid_thw.cpu(), self.cfg.spatial_merge_size).to(device)
        freqs = pos[..., None].float() * self.inv_freq.to(device)  # [N, 2, f]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        full = torch.cat([hw, hw], dim=-1)
        return full.cos(), full.sin()

    def _attention(self, x: torch.Tensor, blk: dict, cos: torch.Tensor, sin: torch.Tensor,
                   cu: list[int]) -> torch.Tensor:
        n, heads = x.shape[0], self.cfg.num_heads
        qkv = F.linear(x, blk["attn.qkv.weight"], blk["attn.qkv.bias"]).view(n, 3, heads, -1)
        q, k, v = qkv.unbind(1)
        eps = self.cfg.rms_norm_eps
        q, k = rms_norm(q, blk["attn.q_norm.weight"], eps), rms_norm(k, blk["attn.k_norm.weight"], eps)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        out = torch.empty_like(v)
        for a, b in zip(cu[:-1], cu[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            w = torch.softmax(qs @ ks.transpose(-1, -2) * self.cfg.head_dim ** -0.5, dim=-1, dtype=torch.float32)
            out[a:b] = (w.to(vs.dtype) @ vs).transpose(0, 1)
        return F.linear(out.reshape(n, -1), blk["attn.proj.weight"], blk["attn.proj.bias"])

    @torch.no_grad()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N_patches, C·t·p·p], grid_thw [M, 3] (already flattened per attention span)
        → merged embeddings [N_patches / merge², out_hidden_size]."""
        cfg = self.cfg
        x = pixel_values.to(self.dtype).view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                             cfg.patch_size)
        x = F.conv3d(x, self.patch_w, self.patch_b, stride=self.patch_w.shape[2:]).view(-1, cfg.hidden_size)
        cos, sin = self._rope(grid_thw, x.device)
        lens = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).tolist()
        cu = [0]
        for ln in lens:
            cu.append(cu[-1] + int(ln))
        eps = cfg.rms_norm_eps
        for blk in self.blocks:
            x = x + self._attention(rms_norm(x, blk["norm1.weight"], eps), blk, cos, sin, cu)
            x = x + swiglu_mlp(rms_norm(x, blk["norm2.weight"], eps), blk["mlp.gate_proj.weight"],
                               blk["mlp.up_proj.weight"], blk["mlp.down_proj.weight"], cfg.swiglu_limit,
                               blk["mlp.gate_proj.bias"], blk["mlp.up_proj.bias"], blk["mlp.down_proj.bias"])
        x = rms_norm(x, self.post_norm, eps)
        m = cfg.spatial_merge_size
        x = x.view(-1, m, m, x.shape[-1]).permute(0, 3, 1, 2)
        x = F.conv2d(x, self.down_w, self.down_b, stride=m).view(-1, cfg.out_hidden_size)
        mg = self.merger
        x = F.linear(x, mg["proj.weight"])
        x = F.gelu(F.layer_norm(x, (x.shape[-1],), mg["post_projection_norm.weight"],
                                mg["post_projection_norm.bias"], 1e-5))
        return swiglu_mlp(x, mg["gate_proj.weight"], mg["up_proj.weight"], mg["down_proj.weight"], cfg.swiglu_limit)
