"""``glm5 check DIR``: validate a checkpoint directory without loading it.

Reads ``config.json`` (with the engine's validation) and the safetensors headers only, so a
multi-hundred-GB checkpoint is checked in seconds; every problem is listed at once.
"""

from __future__ import annotations

import argparse
import json
import sys

from glm5.config import ConfigError, ModelConfig
from glm5.weights import CheckpointError, check_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--require-mtp", action="store_true", help="fail if the MTP layer tensors are missing "
                   "(needed for --num-speculative-tokens)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = ModelConfig.from_pretrained(args.model)
        n = check_checkpoint(args.model, cfg, allow_missing_mtp=not args.require_mtp)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"glm5 check: {e}", file=sys.stderr)
        return 1
    t = cfg.text
    print(json.dumps({"ok": True, "tensors": n, "layers": t.num_hidden_layers, "kda_layers": len(t.kda_layer_ids),
                      "mla_layers": len(t.mla_layer_ids), "mtp_layers": t.num_mtp_layers,
                      "index_kpool": t.index_kpool, "index_topk": t.index_topk,
                      "vision": cfg.vision is not None}))
    return 0
