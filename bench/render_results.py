"""Render ``bench/results.json`` (from ``bench/bench.py``) as the markdown tables of ``bench/RESULTS.md``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def decode_table(res: dict) -> list[str]:
    bw = res["ceilings"]["copy_bw_Bps"]
    out = ["| batch | ctx | step ms | tok/s | experts touched / MoE layer (mean) | bytes/step GB | roofline ms | % of roofline |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["decode"]:
        if "error" in r:
            out.append(f"| {r['batch']} | {r['ctx']} | error: {r['error'][:80]} | | | | | |")
            continue
        tot = r["bytes"]["total"]
        roof = tot / bw
        touched = sum(r["experts_touched"]) / max(len(r["experts_touched"]), 1)
        out.append(f"| {r['batch']} | {r['ctx']} | {r['step_s'] * 1e3:.1f} | {r['tok_s']:.1f} | {touched:.0f} | "
                   f"{tot / 1e9:.2f} | {roof * 1e3:.2f} | {100 * roof / r['step_s']:.1f}% |")
    return out


def prefill_table(res: dict) -> list[str]:
    peak = res["ceilings"]["matmul_bf16_flops"]
    out = ["| tokens | chunk | time s | tok/s | model TFLOP | TFLOP/s | % of matmul peak |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["prefill"]:
        if "error" in r:
            out.append(f"| {r['tokens']} | error: {r['error'][:80]} | | | | | |")
            continue
        out.append(f"| {r['tokens']} | {r['chunk']} | {r['time_s']:.3f} | {r['tok_s']:.0f} | {r['flops'] / 1e12:.1f} | "
                   f"{r['tflops']:.1f} | {100 * r['tflops'] * 1e12 / peak:.1f}% |")
    return out


def render(res: dict, path: Path, extra: str = "") -> None:
    c = res["ceilings"]
    lines = [
        "# Benchmark results (H200)", "",
        f"Run {res['date']} on {res['gpu']} (torch {res['torch']}); backends: KDA `{res['kda_backend']}`, "
        f"MLA prefill attention `{res['attn_backend']}`.", "",
        f"Command: `{res['command']}` (through the device tool; see `bench/bench.py` docstring for the config).", "",
        f"Ceilings measured in the same run: device copy **{c['copy_bw_Bps'] / 1e12:.2f} TB/s** (bytes read + "
        f"written), bf16 8192³ matmul **{c['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s**.", "",
        "## Decode (one step = one token per request; caches filled with random context)", "",
        *decode_table(res), "",
        "Roofline = bytes the step must move (non-routed weights incl. LM head, the routed experts this "
        "step's routing touched, fp32 KDA state read+write, selected latent rows, pooled index keys "
        "scanned) / measured copy bandwidth.", "",
        "## Prefill (one request, chunked by 4096 tokens)", "",
        *prefill_table(res), "",
    ]
    if extra:
        lines += [extra, ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    render(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
