"""Train the tiny GLM-5.3-Flash checkpoint so its greedy predictions have real margins.

Why: the default tiny checkpoint (``glm5.tiny_checkpoint.make_tiny_checkpoint``) has every
parameter random, so its top-1/top-2 logit margins are tiny and bf16 rounding flips greedy
tokens within a few steps — transformers' own model keeps 0/20 prompts of its fp32 tokens in bf16
(``bench/bf16_diag.py`` measures it). A bf16-vs-fp32 agreement test only says something about the
engine on a model whose predictions are confident, i.e. a trained one.

Recipe: start from ``make_tiny_checkpoint(seed)`` (same architecture, tokenizer, chat template,
processor files), load it into transformers' ``Glm5NextForConditionalGeneration`` (fp32, eager,
the oracle's model), and train the language model with AdamW in fp32 on the tokenizer's own
built-in corpus (``glm5.tiny_checkpoint.CORPUS``, ~1.1k tokens, fixed text in this repository:
offline and deterministic) read as one cyclic stream, so every next token is determined by its
context and a trained model is confidently right. Windows are drawn from a generator seeded by
``seed``. The trained weights are written back through ``save_pretrained`` (which produces the
original key layout, per-expert tensors included), then every tensor of the original file is
replaced by its trained value under the SAME name and dtype; the vision tower keeps its random
values. The MTP layer (``layers.{L}.*``, not modelled by transformers) is then trained against the
frozen target by ``glm5.tiny_mtp_training`` (``mtp_steps``; 0 leaves it random), which also writes
``draft_vocab.json``. ``glm5.engine`` therefore loads the result unchanged.

The tests that need it (``tests/test_bf16_agreement.py`` on the CPU, ``tests/test_gpu_bf16.py`` on a GPU)
build it in a fixture; ``scripts/gpu_check.sh`` uses a prebuilt one from ``$GLM5_TRAINED_CKPT``.

CLI: ``python -m glm5.trained_tiny_checkpoint OUT_DIR [--steps N] [--mtp-steps N] [--seed S] [--device cpu|cuda]
[--agreement]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["TrainReport", "DEFAULT_STEPS", "N_AGREE", "corpus_ids", "train_tiny_checkpoint", "logit_margins",
           "agreement_prompts", "greedy_tokens", "load_transformers_model", "main"]

#: Default optimisation steps: enough for a mean top1-top2 margin of several logits on the
#: corpus (see the report in ``train_report.json``) while staying well under a minute on 2 cores.
DEFAULT_STEPS = 120
SEQ_LEN = 64
BATCH = 8
LR = 1e-2
WARMUP = 10
NOISE_ROWS = 2      # rows per batch that start with random ids (see _batch)
MAX_NOISE = 48
IGNORE = -100
REPORT_FILE = "train_report.json"
#: The reference (torch) chunked KDA in transformers is exact for any chunk length; 16 instead of its
#: default 64 makes a CPU training step ~2.4x faster (its intra-chunk work is O(chunk^2)). Passed on
#: CPU only: on CUDA transformers uses fla's kernel when installed, which has its own chunking.
TRAIN_FORWARD_KWARGS = {"chunk_size": 16}


@dataclass
class TrainReport:
    """What training did: the figures the bf16 note quotes."""

    steps: int
    seed: int
    device: str
    seconds: float
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    margin_before: float = 0.0      # mean top1-top2 logit margin over the corpus (teacher forced)
    margin_after: float = 0.0
    accuracy_before: float = 0.0    # next-token top-1 accuracy over the corpus
    accuracy_after: float = 0.0
    mtp: dict = field(default_factory=dict)  # glm5.tiny_mtp_training's report (empty: MTP layer left random)


def corpus_ids() -> list[int]:
    """The training stream: the tiny tokenizer's built-in corpus, tokenized by that tokenizer."""
    from glm5.tiny_checkpoint import CORPUS, build_tokenizer

    return build_tokenizer().encode(CORPUS).ids


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Rows ``stream[s : s + length]`` of the stream read cyclically (wraps past the end)."""
    idx = (starts[:, None] + torch.arange(length)[None, :]) % stream.numel()
    return stream[idx]


def _batch(stream: torch.Tensor, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch: ``BATCH - NOISE_ROWS`` corpus windows at random offsets, then
    ``NOISE_ROWS`` rows of 1..``MAX_NOISE`` noise tokens (alternately uniform random ids and
    corpus tokens in random order) followed by the corpus from its start.

    The noise rows teach the model one confident answer to context it cannot read (random ids,
    unfamiliar text): restart the corpus. Without them a prompt from outside the corpus gets
    near-uniform, low-margin predictions for its first tokens, exactly where bf16 rounding flips
    greedy choices. Every position inside the random ids is also trained to predict the corpus's
first token, so "unreadable context -> start the corpus" is learned from dense supervision.
    """
    starts = torch.randint(0, stream.numel(), (BATCH - NOISE_ROWS,), generator=gen)
    clean = _windows(stream, starts, SEQ_LEN + 1)
    noisy, noisy_targets = [], []
    for i in range(NOISE_ROWS):
        r = int(torch.randint(1, MAX_NOISE + 1, (1,), generator=gen))
        if i % 2 == 0:  # uniformly random ids (any of the vocabulary, specials included)
            noise = torch.randint(0, vocab, (r,), generator=gen)
        else:  # corpus tokens in random order: text-like context the model cannot follow either
            noise = stream[torch.randint(0, stream.numel(), (r,), generator=gen)]
        row = torch.cat([noise, stream[: SEQ_LEN + 1 - r]])
        tgt = row[1:].clone()
        tgt[: r - 1] = stream[0]
        noisy.append(row[:-1])
        noisy_targets.append(tgt)
    rows = torch.cat([clean[:, :-1], torch.stack(noisy)])
    targets = torch.cat([clean[:, 1:], torch.stack(noisy_targets)])
    return rows, targets


def _eval_windows(stream: torch.Tensor) -> torch.Tensor:
    """Fixed evaluation windows covering the whole stream once (every position predicted once)."""
    starts = torch.arange(0, stream.numel(), SEQ_LEN)
    return _windows(stream, starts, SEQ_LEN + 1)


@torch.no_grad()
def logit_margins(model, rows: torch.Tensor) -> tuple[float, float]:
    """Mean top1-top2 logit margin and top-1 accuracy of ``model`` on ``rows`` (teacher forced).

    Rows are run one at a time without an attention mask: the model's mask-free path is the one
    the oracle and the engine use (see ``tests/oracle.py``).
    """
    margins, hits, n = 0.0, 0, 0
    for row in rows:
        logits = model(input_ids=row[None, :-1].to(model.device)).logits[0].float()
        top2 = logits.topk(2, dim=-1).values
        margins += float((top2[:, 0] - top2[:, 1]).sum())
        hits += int((logits.argmax(-1).cpu() == row[1:]).sum())
        n += logits.shape[0]
    return margins / n, hits / n


def _lr(step: int, steps: int) -> float:
    """Linear warm-up then cosine decay to 10 %: stable start from random weights, low final noise."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def load_transformers_model(ckpt: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """transformers' model on ``ckpt`` as the oracle builds it (eager attention), MTP-tensor warnings muted."""
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the MTP tensors are reported as UNEXPECTED: expected, HF has no MTP
    try:
        model = Glm5NextForConditionalGeneration.from_pretrained(str(ckpt), dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.text_config._attn_implementation = "eager"
    return model.to(device)


def _write_trained(model, src: Path, out: Path) -> int:
    """Write ``model``'s weights into ``out/model.safetensors`` under the names and dtypes of ``src``'s.

    ``save_pretrained`` reverses transformers' load-time conversions (fused experts back to
    per-expert tensors), so its keys are the original layout; they must be exactly ``src``'s keys
    minus the MTP layer, otherwise the layout changed and the engine would not load the result.
    """
    from safetensors.torch import load_file, save_file

    original = load_file(str(src / "model.safetensors"))
    n_layers = int(json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"])
    with tempfile.TemporaryDirectory() as tmp:
        from transformers.utils import logging as hf_logging

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.to("cpu").save_pretrained(tmp)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        saved: dict[str, torch.Tensor] = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            saved.update(load_file(str(shard)))
    mtp = tuple(f"model.language_model.layers.{i}." for i in range(n_layers, n_layers + 64))
    expected = {k for k in original if not k.startswith(mtp)}
    if set(saved) != expected:
        raise RuntimeError(
            f"save_pretrained wrote a different key set than the tiny checkpoint: missing "
            f"{sorted(expected - set(saved))[:5]}, extra {sorted(set(saved) - expected)[:5]}; the installed "
            "transformers changed its glm5_next checkpoint conversion — pin the version the tiny checkpoint uses")
    changed = 0
    out_tensors: dict[str, torch.Tensor] = {}
    for name, value in original.items():
        new = saved.get(name, value)
        if new.shape != value.shape:
            raise RuntimeError(f"{name}: trained shape {tuple(new.shape)} != original {tuple(value.shape)}")
        new = new.to(value.dtype).contiguous()
        changed += int(not torch.equal(new, value))
        out_tensors[name] = new
    save_file(out_tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return changed


def train_tiny_checkpoint(out_dir: str | Path, steps: int = DEFAULT_STEPS, seed: int = 0,
                          device: str = "cpu", mtp_steps: int | None = None) -> Path:
    """Write a trained tiny checkpoint to ``out_dir`` and return its path.

    ``out_dir`` receives every file of ``make_tiny_checkpoint(seed=seed)`` with ``model.safetensors``
    replaced by the trained weights (same tensor names and dtypes), plus ``train_report.json``
    (:class:`TrainReport`: loss curve, margins and accuracy before/after, wall time). The same
    ``seed``, ``steps``, device and torch build give the same weights. ``mtp_steps`` (default
    ``glm5.tiny_mtp_training.DEFAULT_MTP_STEPS``) trains the MTP layer afterwards.
    """
    from glm5.tiny_checkpoint import make_tiny_checkpoint
    from glm5.tiny_mtp_training import DEFAULT_MTP_STEPS, train_mtp_layer

    mtp_steps = DEFAULT_MTP_STEPS if mtp_steps is None else mtp_steps

    if steps < 1:
        raise ValueError(f"steps = {steps}: must be >= 1")
    out = Path(out_dir)
    t0 = time.perf_counter()
    make_tiny_checkpoint(out, seed=seed)
    torch.manual_seed(seed)  # nothing random is drawn from the global RNG; set for any dropout-like path
    model = load_transformers_model(out, device)
    stream = torch.tensor(corpus_ids())
    vocab = int(model.config.text_config.vocab_size)
    eval_rows = _eval_windows(stream)
    model.eval()
    margin_before, acc_before = logit_margins(model, eval_rows)

    params = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("model.visual.")]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    fwd_kwargs = TRAIN_FORWARD_KWARGS if torch.device(device).type == "cpu" else {}
    report = TrainReport(steps=steps, seed=seed, device=device, seconds=0.0)
    model.train()
    for step in range(steps):
        rows, targets = _batch(stream, vocab, gen)
        logits = model(input_ids=rows.to(device), **fwd_kwargs).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(device).reshape(-1),
                               ignore_index=IGNORE)
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            value = loss.item()
            report.loss_curve.append((step, round(value, 4)))
            logger.info("step %d/%d loss %.4f", step, steps, value)
    model.eval()
    report.margin_after, report.accuracy_after = logit_margins(model, eval_rows)
    report.margin_before, report.accuracy_before = margin_before, acc_before
    changed = _write_trained(model, out, out)
    del model, opt
    if mtp_steps > 0:
        report.mtp = train_mtp_layer(out, load_transformers_model(out, device), steps=mtp_steps, seed=seed,
                                     device=device)
    report.seconds = round(time.perf_counter() - t0, 2)
    (out / REPORT_FILE).write_text(json.dumps(asdict(report), indent=1) + "\n")
    logger.info("trained tiny checkpoint in %s: %d tensors updated, %.1f s, margin %.3f -> %.3f, acc %.3f -> %.3f",
                out, changed, report.seconds, margin_before, report.margin_after, acc_before, report.accuracy_after)
    return out


#: Greedy tokens compared per prompt by the bf16-vs-fp32 agreement checks.
N_AGREE = 32
_OOD_TEXTS = (
    "Write a short poem about the sea and the wind.",
    "<|user|>Explain how a compiler works, step by step.<|assistant|>",
    "int main(void) { return 42; }",
    "Zebras graze quietly near the river at dawn.",
    "1 1 2 3 5 8 13 21 34 55 89",
)


def agreement_prompts(vocab_size: int) -> list[list[int]]:
    """The 20 prompts of the bf16-vs-fp32 agreement checks (3..200 tokens, all distinct).

    Ten are corpus windows (the training distribution, lengths 3..200 at spread offsets, the
    longer ones in the sparse-attention regime of the tiny indexer); five are uniformly random
    ids (5..200 tokens, specials included) and five are text the corpus does not contain, so the
    check also covers context the model cannot follow.
    """
    from glm5.tiny_checkpoint import build_tokenizer

    ids = corpus_ids()
    twice = ids + ids
    prompts = [twice[(97 * i) % len(ids):][:n] for i, n in enumerate((3, 8, 16, 30, 50, 80, 110, 140, 170, 200))]
    for i, n in enumerate((5, 40, 90, 150, 200)):
        g = torch.Generator().manual_seed(7000 + i)
        prompts.append(torch.randint(0, vocab_size, (n,), generator=g).tolist())
    tok = build_tokenizer()
    prompts += [tok.encode(t).ids for t in _OOD_TEXTS]
    return prompts


def greedy_tokens(ckpt: str | Path, prompts: list[list[int]], dtype: str, device: str = "cpu",
                  n: int = N_AGREE, **engine_kw) -> list[list[int]]:
    """Greedy tokens of ``glm5.engine`` on ``ckpt`` (all prompts batched, EOS ignored)."""
    from glm5.engine import EngineArgs, LLMEngine
    from glm5.sampling_params import SamplingParams

    args = dict(model=str(ckpt), device=device, dtype=dtype, block_size=16, num_cache_blocks=256,
                max_num_seqs=16, max_num_batched_tokens=256, load_progress=False)
    args.update(engine_kw)
    eng = LLMEngine(EngineArgs(**args))
    return [o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n,
                                                                      ignore_eos=True))]


def _agreement(ckpt: Path) -> dict:
    """CPU fp32 vs CPU bf16 engine on :func:`agreement_prompts` (the figure the bf16 note quotes)."""
    vocab = int(json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"])
    prompts = agreement_prompts(vocab)
    fp32 = greedy_tokens(ckpt, prompts, "float32")
    bf16 = greedy_tokens(ckpt, prompts, "bfloat16")
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(fp32, bf16)]
    return {"agree": sum(d is None for d in first), "of": len(prompts), "first_divergence": first}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the trained checkpoint into (created if missing)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="AdamW steps (batch 8 x 64 tokens)")
    parser.add_argument("--mtp-steps", type=int, default=None,
                        help="AdamW steps for the MTP layer against the frozen target (0: leave it random)")
    parser.add_argument("--seed", type=int, default=0, help="tiny-checkpoint seed and window-sampling seed")
    parser.add_argument("--device", default="cpu", help="torch device to train on (cpu or cuda)")
    parser.add_argument("--agreement", action="store_true",
                        help="also count prompts whose 32 greedy tokens agree between the CPU bf16 and fp32 "
                             "engines, on the trained and on the random (untrained) checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = train_tiny_checkpoint(args.out_dir, steps=args.steps, seed=args.seed, device=args.device,
                                 mtp_steps=args.mtp_steps)
    result = json.loads((path / REPORT_FILE).read_text())
    if args.agreement:
        from glm5.tiny_checkpoint import make_tiny_checkpoint

        result["bf16_agreement_trained"] = _agreement(path)
        with tempfile.TemporaryDirectory() as tmp:
            result["bf16_agreement_random"] = _agreement(make_tiny_checkpoint(Path(tmp), seed=args.seed))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
