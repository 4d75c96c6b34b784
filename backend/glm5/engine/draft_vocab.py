"""The reduced draft vocabulary: the tokens an MTP draft may propose, most frequent first.

A draft step reads the LM head (1.27 GB at GLM-5.3-Flash's 154,880 × 4096 in bf16) once per step; drafting
over the ``N`` most frequent tokens reads ``N / vocab`` of it (EAGLE-3 trains with a 32K draft vocabulary).
Verification keeps the full head, so outputs are unchanged; a draft that needs a token outside the set is
simply rejected. The set comes from token counts over text like the traffic the server sees.

``python -m glm5.engine.draft_vocab MODEL_DIR CORPUS_FILE... [--size N] [--out FILE]`` counts tokens with
the checkpoint's tokenizer and writes ``MODEL_DIR/draft_vocab.json`` (what ``draft_vocab_size`` reads by
default).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch


def frequent_tokens(token_streams: Iterable[Iterable[int]], vocab_size: int, always: Iterable[int] = ()) -> list[int]:
    """All token ids ``< vocab_size`` ordered by count in ``token_streams`` (ties: lower id first), ``always``
    (e.g. EOS and stop tokens) first, then the tokens never seen, in id order: a prefix of any length is a
    draft vocabulary."""
    counts: Counter[int] = Counter()
    for stream in token_streams:
        counts.update(int(t) for t in stream)
    first = [int(t) for t in dict.fromkeys(always) if 0 <= int(t) < vocab_size]
    seen = sorted((t for t in counts if 0 <= t < vocab_size and t not in first), key=lambda t: (-counts[t], t))
    rest = [t for t in range(vocab_size) if t not in counts and t not in first]
    return first + seen + rest


def save_draft_vocab(path: str | Path, token_ids: list[int]) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"token_ids": [int(t) for t in token_ids]}) + "\n")
    return path


def load_draft_vocab(path: str | Path, size: int, vocab_size: int) -> torch.Tensor:
    """The first ``size`` ids of the file written by :func:`save_draft_vocab` (int64 tensor)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"draft_vocab_size={size} needs a draft vocabulary file, but {path} does not exist; build "
                         "one with `python -m glm5.engine.draft_vocab MODEL_DIR CORPUS_FILE...` or set "
                         "draft_vocab_file (or draft_vocab_size=0 for the full vocabulary)")
    data = json.loads(path.read_text())
    ids = data.get("token_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"{path}: expected {{\"token_ids\": [int, ...]}} (most frequent first)")
    if size > len(ids):
        raise ValueError(f"draft_vocab_size={size} but {path} lists only {len(ids)} tokens")
    out = ids[:size]
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad or len(set(out)) != len(out):
        raise ValueError(f"{path}: token ids must be distinct and in [0, {vocab_size}); bad or repeated: {bad[:5]}")
    return torch.tensor(out, dtype=torch.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint directory (its tokenizer counts the tokens; the file goes there)")
    ap.add_argument("corpus", nargs="+", help="text files like the expected traffic")
    ap.add_argument("--out", help="output file (default MODEL/draft_vocab.json)")
    args = ap.parse_args(argv)
    from glm5.config import ModelConfig
    from glm5.tokenizer import load_tokenizer

    cfg = ModelConfig.from_pretrained(args.model)
    tok = load_tokenizer(Path(args.model))
    streams = (tok.encode(Path(f).read_text(), add_special_tokens=False) for f in args.corpus)
    ids = frequent_tokens(streams, cfg.text.vocab_size, always=cfg.eos_token_ids)
    out = save_draft_vocab(args.out or Path(args.model) / "draft_vocab.json", ids)
    print(f"wrote {out} ({len(ids)} tokens, most frequent first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
