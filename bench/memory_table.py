"""Weight memory of the full GLM-5.3-Flash per GPU at TP = EP = 1, 2, 4, 8, in bf16 and in fp8 (CPU only).

``python bench/memory_table.py [--config tests/fixtures/glm5_3_flash_config.json] [--out FILE.json]``

Computed from the config alone (``glm5.weights.expected_weight_shapes``: every tensor the engine loads, the
MTP layer and the vision tower included), no weights read. Three storage variants:

* ``bfloat16`` - every tensor in bf16 except the fp32 set (mHC mixing, KDA decay, router bias, kpool ape);
* ``fp8 checkpoint`` - what the published fp8 checkpoint stores in e4m3 (model-spec §10: routed and shared
  experts, dense MLPs, MLA projections and the indexer's wq_b / wk; KDA projections stay bf16), kept as fp8
  by ``quantization=auto``: 1 byte per weight plus one fp32 scale per 128 x 128 tile;
* ``fp8 online`` - ``quantization=fp8``: every text-model projection (``glm5.weights.is_fp8_linear_weight``,
  KDA included).

Sharding model (the design's TP/EP layout): routed experts are split over EP ranks; the other 2-D weights
(attention and indexer projections, dense MLPs, shared expert, convolutions, vocab-parallel embedding and LM
head) over TP ranks; 1-D tensors (norms, biases), mHC parameters, the router and the vision tower are
replicated. Bytes per GPU = replicated + sharded / N. KV cache and activations are not included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "backend"), str(ROOT / "kernels")]

from glm5.config import ModelConfig  # noqa: E402
from glm5.weights.memory import memory_markdown, memory_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "tests" / "fixtures" / "glm5_3_flash_config.json")
    ap.add_argument("--out", type=Path, help="write the table as JSON here")
    args = ap.parse_args(argv)
    table = memory_table(ModelConfig.from_dict(json.loads(args.config.read_text())))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(memory_markdown(table), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
