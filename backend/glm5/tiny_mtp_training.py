"""Train the MTP layer of a trained tiny checkpoint, so that speculative decoding on it has real acceptance.

Why: transformers does not model the MTP layer, so ``glm5.trained_tiny_checkpoint`` trains the decoder and
leaves ``layers.{L}.*`` random; its drafts would almost never be accepted, and acceptance-dependent numbers
(mean accepted tokens, whether speculation pays, the reduced draft vocabulary's cost) would say nothing.

Recipe (self-distillation, as MTP heads are trained): the trained target, frozen, runs over windows of the
tiny tokenizer's corpus; the MTP layer (model-spec §8, built from transformers' own MLA + kpool indexer and
MoE modules carrying the MTP weights, as the tests' MTP oracle does) learns to predict, at row ``p``, from
token ``p+1`` and the target's hidden state at ``p``, the token the target itself predicts at ``p+1`` — the
token a greedy draft must match to be accepted. AdamW in fp32; the trained tensors replace the MTP tensors of
``model.safetensors`` under the same names and dtypes. Also writes ``draft_vocab.json`` (the corpus's token
frequencies, :mod:`glm5.engine.draft_vocab`), so a reduced draft vocabulary can be measured on it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DEFAULT_MTP_STEPS = 120
WINDOWS = 48
WINDOW_LEN = 96
BATCH = 8
LR = 5e-3


def _modules(cfg, weights: dict[str, torch.Tensor], prefix: str):
    """transformers' attention (MLA + indexer) and MoE modules with the MTP layer's weights, plus the small
    tensors of the MTP block, all trainable fp32."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextMoE

    attn = Glm5NextTextAttention(cfg, cfg.layer_types.index("indexed_attention")).float()
    moe = Glm5NextTextMoE(cfg).float()
    sa = prefix + "self_attn."
    attn.load_state_dict({k[len(sa):]: v.float() for k, v in weights.items() if k.startswith(sa)})
    n_exp = cfg.n_routed_experts
    ex = prefix + "mlp.experts."
    gate = torch.stack([weights[f"{ex}{e}.gate_proj.weight"] for e in range(n_exp)])
    up = torch.stack([weights[f"{ex}{e}.up_proj.weight"] for e in range(n_exp)])
    down = torch.stack([weights[f"{ex}{e}.down_proj.weight"] for e in range(n_exp)])
    mlp = {k[len(prefix + "mlp."):]: v for k, v in weights.items() if k.startswith(prefix + "mlp.") and ex not in k}
    mlp |= {"experts.gate_up_proj": torch.cat([gate, up], dim=1), "experts.down_proj": down}
    moe.load_state_dict({k: v.float() for k, v in mlp.items()})
    small = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(weights[prefix + n].float().clone())
                                    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                              "input_layernorm.weight", "post_attention_layernorm.weight",
                                              "shared_head.norm.weight")})
    return attn, moe, small


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mtp_logits(hf, attn, moe, small, cfg, next_tokens: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Model-spec §8 over whole windows: ``next_tokens [B, L]`` (token p+1), ``hidden [B, L, H]`` (target at
    p). Returns (logits, the post-norm hidden a later draft step recycles)."""
    eps = cfg.rms_norm_eps
    w = {k.replace("__", "."): v for k, v in small.items()}
    e = hf.get_input_embeddings()(next_tokens).clone()
    e[:, 0] = 0.0  # position 0
    u = F.linear(torch.cat([_rms(e, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], -1),
                 w["eh_proj.weight"])
    mask = torch.ones(u.shape[0], u.shape[1], dtype=torch.bool, device=u.device)
    u = u + attn(_rms(u, w["input_layernorm.weight"], eps), attention_mask=mask)[0]
    u = u + moe(_rms(u, w["post_attention_layernorm.weight"], eps))
    h = _rms(u, w["shared_head.norm.weight"], eps)
    return hf.lm_head(h), h


def _write(ckpt: Path, attn, moe, small, cfg, prefix: str) -> int:
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    full = "model.language_model." + prefix
    new = {full + "self_attn." + k: v for k, v in attn.state_dict().items()}
    sd = moe.state_dict()
    inter = sd["experts.gate_up_proj"].shape[1] // 2
    for e in range(cfg.n_routed_experts):
        new[f"{full}mlp.experts.{e}.gate_proj.weight"] = sd["experts.gate_up_proj"][e, :inter]
        new[f"{full}mlp.experts.{e}.up_proj.weight"] = sd["experts.gate_up_proj"][e, inter:]
        new[f"{full}mlp.experts.{e}.down_proj.weight"] = sd["experts.down_proj"][e]
    new |= {full + "mlp." + k: v for k, v in sd.items() if not k.startswith("experts.")}
    new |= {full + k.replace("__", "."): v.detach() for k, v in small.items()}
    missing = sorted(set(new) - set(tensors))
    if missing:
        raise RuntimeError(f"MTP tensors {missing[:5]} are not in {path}: the checkpoint layout changed")
    for name, value in new.items():
        old = tensors[name]
        if value.shape != old.shape:
            raise RuntimeError(f"{name}: trained shape {tuple(value.shape)} != {tuple(old.shape)}")
        tensors[name] = value.detach().to(old.dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return len(new)


@torch.no_grad()
def _targets(hf, stream: torch.Tensor, gen: torch.Generator, device: str):
    """Windows of the corpus stream through the frozen target: (MTP input tokens, target hidden, labels)."""
    starts = torch.randint(0, stream.numel(), (WINDOWS,), generator=gen)
    idx = (starts[:, None] + torch.arange(WINDOW_LEN + 1)[None, :]) % stream.numel()
    ids = stream[idx].to(device)
    hidden, greedy = [], []
    for chunk in ids.split(BATCH):
        h = hf.model.language_model(input_ids=chunk).last_hidden_state.float()
        hidden.append(h[:, :-1])
        greedy.append(hf.lm_head(h).argmax(-1))
    greedy = torch.cat(greedy)
    # row p: token p+1 and hidden p -> the target's own prediction at p+1 (its choice for token p+2)
    return ids[:, 1:], torch.cat(hidden), greedy[:, 1:]


def train_mtp_layer(ckpt: str | Path, hf, steps: int = DEFAULT_MTP_STEPS, seed: int = 0, device: str = "cpu") -> dict:
    """Train ``ckpt``'s MTP layer in place (module docstring) against ``hf``, transformers' model of the same
    checkpoint on ``device`` (``glm5.trained_tiny_checkpoint.load_transformers_model``); returns the report
    (draft top-1 agreement with the target's greedy token before / after, teacher forced on corpus windows)."""
    from safetensors.torch import load_file

    from glm5.engine.draft_vocab import frequent_tokens, save_draft_vocab
    from glm5.tiny_checkpoint import CORPUS, build_tokenizer

    ckpt = Path(ckpt)
    hf = hf.eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    cfg = hf.config.text_config
    layer = cfg.num_hidden_layers
    prefix = f"layers.{layer}."
    raw = load_file(str(ckpt / "model.safetensors"))
    weights = {k[len("model.language_model."):]: v for k, v in raw.items()
               if k.startswith("model.language_model." + prefix)}
    if not weights:
        raise ValueError(f"{ckpt} has no MTP layer ({prefix}*): build it with num_mtp_layers >= 1")
    attn, moe, small = (m.to(device) for m in _modules(cfg, weights, prefix))
    stream = torch.tensor(build_tokenizer().encode(CORPUS).ids)
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, labels = _targets(hf, stream, gen, device)

    def agreement() -> float:
        with torch.no_grad():
            logits, _ = _mtp_logits(hf, attn, moe, small, cfg, tokens, hidden)
        return float((logits.argmax(-1) == labels).float().mean())

    before = agreement()
    params = list(attn.parameters()) + list(moe.parameters()) + list(small.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    curve = []
    for step in range(steps):
        pick = torch.randint(0, WINDOWS, (BATCH,), generator=gen).to(device)
        logits, h = _mtp_logits(hf, attn, moe, small, cfg, tokens[pick], hidden[pick])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[pick].reshape(-1))
        # second draft depth: row p+1 gets row p's recycled hidden instead of the target's (what draft steps
        # after the first see); the other rows' context is recycled too, an approximation of the catch-up
        recycled = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        logits2, _ = _mtp_logits(hf, attn, moe, small, cfg, tokens[pick], recycled)
        loss = loss + F.cross_entropy(logits2[:, 1:].reshape(-1, logits2.shape[-1]).float(),
                                      labels[pick][:, 1:].reshape(-1))
        for g in opt.param_groups:
            g["lr"] = LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1))))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            curve.append((step, round(loss.item(), 4)))
            logger.info("mtp step %d/%d loss %.4f", step, steps, loss.item())
    after = agreement()
    n = _write(ckpt, attn.cpu(), moe.cpu(), small.cpu(), cfg, prefix)
    save_draft_vocab(ckpt / "draft_vocab.json",
                     frequent_tokens([stream.tolist()], int(cfg.vocab_size), always=_eos(ckpt)))
    report = {"steps": steps, "tensors": n, "loss_curve": curve, "draft_agreement_before": round(before, 4),
              "draft_agreement_after": round(after, 4)}
    logger.info("MTP layer trained: %d tensors, draft agreement %.3f -> %.3f", n, before, after)
    return report


def _eos(ckpt: Path) -> list[int]:
    eos = json.loads((ckpt / "config.json").read_text())["text_config"].get("eos_token_id") or []
    return [eos] if isinstance(eos, int) else list(eos)


__all__ = ["DEFAULT_MTP_STEPS", "train_mtp_layer"]
