"""Host work on a decode step's critical path: staging the step's inputs and detokenizing its tokens.

Both run on the host between CUDA-graph replays. Timed on the CPU (no GPU needed):

* ``DecodeStager.stage`` per batch size and context, for requests whose block tables stay the same lists from
  step to step (as a decoding batch's do), and with a fresh copy of every table each step (what a stager that
  cannot skip unchanged entries pays, and what worker ranks that receive pickled rows pay). The buffers are
  plain CPU tensors, so the host-to-device copy becomes a synchronous memcpy of the whole table width (on a
  GPU it is an asynchronous copy); the default width is therefore the largest context's, as ``bench.py``'s
  Setup has, not a long ``max_model_len``.
* ``IncrementalDetokenizer.add_tokens`` per token, through ``tokenizers``' streaming decoder (a fast HF
  tokenizer) and through the window path (two HF ``decode`` calls per token), on random token ids of the
  tokenizer's vocabulary (``--tokenizer DIR``; default: the tiny checkpoint's, made in a temporary folder).

Usage: ``python bench/host_cost.py [--out OUT.json] [--batches 1 64 256] [--contexts 1024 8192]
[--max-model-len N] [--block-size 64] [--steps 200] [--tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
try:
    from glm5.engine.cuda_graph import DecodeRows, DecodeStager
except ImportError:  # run from a checkout without the package installed
    sys.path[:0] = [str(ROOT / "backend"), str(ROOT / "kernels")]
    from glm5.engine.cuda_graph import DecodeRows, DecodeStager


def time_stage(batch: int, ctx: int, max_blocks: int, block_size: int, steps: int, fresh: bool) -> float:
    """Median µs of one ``stage`` call over ``steps`` calls (after 10 warm-up calls)."""
    cache = types.SimpleNamespace(block_size=block_size, scratch_block=0, scratch_slot=0)
    stager = DecodeStager(cache, batch, max_blocks, torch.device("cpu"))
    held = ctx // block_size + 1
    tables = [list(range(1 + i * held, 1 + (i + 1) * held)) for i in range(batch)]

    def rows() -> DecodeRows:
        bt = [list(t) for t in tables] if fresh else tables
        return DecodeRows(tokens=[1] * batch, positions=[ctx] * batch, state_slots=list(range(batch)),
                          block_tables=bt)
    for _ in range(10):
        stager.stage(rows(), batch)
    times = []
    for _ in range(steps):
        r = rows()
        t0 = time.perf_counter()
        stager.stage(r, batch)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def time_detokenizer(tokenizer_dir: str | None, tokens: int = 3000) -> dict:
    """µs per token of the streaming and the window detokenizer on random ids (prompt tail as context)."""
    import random
    import tempfile

    from transformers import AutoTokenizer

    from glm5.detokenizer import IncrementalDetokenizer
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer_dir is None:
            from glm5.tiny_checkpoint import make_tiny_checkpoint
            make_tiny_checkpoint(Path(tmp) / "ckpt")
            tokenizer_dir = str(Path(tmp) / "ckpt")
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    class WindowOnly:  # no backend_tokenizer: the window path
        def decode(self, *a, **kw):
            return tok.decode(*a, **kw)
    rng = random.Random(0)
    ids = [rng.randrange(len(tok)) for _ in range(tokens)]
    out = {"tokenizer": tokenizer_dir if tokenizer_dir and not tokenizer_dir.startswith(tempfile.gettempdir())
           else "tiny checkpoint", "vocab": len(tok), "tokens": tokens}
    for name, t in (("stream_us_per_token", tok), ("window_us_per_token", WindowOnly())):
        d = IncrementalDetokenizer(t, ids[:20])
        t0 = time.perf_counter()
        for i in ids:
            d.add_tokens([i])
        out[name] = (time.perf_counter() - t0) / tokens * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="sets the stager's block-table width (default: the largest context + 2 blocks)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokenizer", help="tokenizer folder for the detokenizer timing (default: the tiny checkpoint's)")
    args = ap.parse_args(argv)
    max_len = args.max_model_len or max(args.contexts) + 2 * args.block_size
    max_blocks = -(-max_len // args.block_size)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
           "command": " ".join(["bench/host_cost.py", *(argv if argv is not None else sys.argv[1:])]),
           "max_blocks": max_blocks, "stage": []}
    for ctx in args.contexts:
        for b in args.batches:
            row = {"batch": b, "ctx": ctx, "blocks_per_request": ctx // args.block_size + 1,
                   "same_lists_us": time_stage(b, ctx, max_blocks, args.block_size, args.steps, fresh=False),
                   "fresh_lists_us": time_stage(b, ctx, max_blocks, args.block_size, args.steps, fresh=True)}
            out["stage"].append(row)
            print(json.dumps(row), flush=True)
    out["detokenizer"] = time_detokenizer(args.tokenizer)
    print(json.dumps(out["detokenizer"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
