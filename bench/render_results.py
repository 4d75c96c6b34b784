"""Render a ``bench/bench.py`` results JSON as the markdown tables of ``bench/results/RESULTS.md``.

What it shows: for the recorded H200 run (date, GPU, torch, command, backends), the measured ceilings,
decode step time against the memory roofline per batch and context, prefill throughput against the
bf16 matmul peak, transformers' decode in the same run, and (when present) the decode-attention backend
comparison, the sparse-MLA kernel side-by-side and the speculative-decoding rounds, speed-ups and acceptance
(``bench/spec_bench.py``), each labelled with the run it came from.

``finalize(res)`` adds the derived per-row fields (``step_ms``, ``roofline_fraction``, ``peak_fraction``)
so the JSON is self-describing; ``render`` writes the markdown and ``plot_decode`` draws
``bench/results/decode.png`` (generated, not committed). The hand-written "what limits it" analysis of the
recorded numbers lives in ``bench/results/limits.md`` (beside the JSON) and is appended verbatim.

Usage: ``python bench/render_results.py [RESULTS_JSON] [--hf RUN.json] [--flashinfer RUN.json]
[--mla-kernels FLASHINFER_BENCH.json] [--speculative SPEC_RESULTS.json]`` (default
``bench/results/results.json``; the flags copy transformers' rows, the per-backend decode rows, the kernel
side-by-side or the speculative section from another run into it).
This module imports nothing from ``bench.py`` (``bench.py`` imports it), so the two never import each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NOTES_FILE = "limits.md"   # beside the results JSON


def _decode_rooflines(rows: list[dict], copy_bw: float) -> None:
    """Each measured decode row's step in ms, its roofline (bytes / ``copy_bw``) and the share of it reached."""
    for r in rows:
        if "error" not in r:
            r["step_ms"] = r["step_s"] * 1e3
            r["roofline_ms"] = r["bytes"]["total"] / copy_bw * 1e3
            r["roofline_fraction"] = r["roofline_ms"] / r["step_ms"]


def finalize(res: dict) -> dict:
    peak = res["ceilings"]["matmul_bf16_flops"]
    for r in res.get("decode_flashinfer", []):  # rows merged from another run: no roofline against this one's
        if "error" not in r:
            r["step_ms"] = r["step_s"] * 1e3
    _decode_rooflines(res.get("decode", []), res["ceilings"]["copy_bw_Bps"])
    if off := res.get("pdl_off"):
        _decode_rooflines(off["decode"], off["ceilings"]["copy_bw_Bps"])  # its own run's ceiling
    for r in res.get("prefill", []):
        if "error" not in r:
            r["peak_fraction"] = r["tflops"] * 1e12 / peak
    hf = res.get("hf")
    if hf and "step_s" in hf:
        hf["tok_s"] = hf.get("batch", 1) / hf["step_s"]
    return res


def _table(head: list[str], align: str, rows: list[dict], cells, lead) -> list[str]:
    """Markdown table: ``cells(r)`` per row; a row holding ``error`` shows ``lead(r)`` then the error."""
    out = ["| " + " | ".join(head) + " |", align]
    for r in rows:
        if "error" in r:
            row = [*lead(r), f"error: {r['error'][:80]}"]
            row += [""] * (len(head) - len(row))
        else:
            row = cells(r)
        out.append("| " + " | ".join(row) + " |")
    return out


_WEIGHT_NAMES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}


def _has_weight_dtype(rows: list[dict]) -> bool:
    """Runs that measured several weight storages carry ``weight_dtype`` per row (older runs: bf16 only)."""
    return any("weight_dtype" in r for r in rows)


def _decode_cells(r: dict) -> list[str]:
    touched = sum(r["experts_touched"]) / max(len(r["experts_touched"]), 1)
    return [str(r["batch"]), str(r["ctx"]), f"{r['step_ms']:.2f}", f"{r['eager_step_s'] * 1e3:.1f}",
            f"{r['tok_s']:.0f}", f"{touched:.0f}", f"{r['bytes']['total'] / 1e9:.2f}", f"{r['roofline_ms']:.2f}",
            f"{100 * r['roofline_fraction']:.1f}%"]


def decode_table(rows: list[dict]) -> list[str]:
    head = ["batch", "ctx", "step ms (graph)", "step ms (eager)", "tok/s", "experts / MoE layer", "GB/step",
            "roofline ms", "% of roofline"]
    if not _has_weight_dtype(rows):
        return _table(head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|", rows, _decode_cells,
                      lambda r: [str(r.get("batch")), str(r.get("ctx"))])

    def dt(r: dict) -> str:
        return _WEIGHT_NAMES.get(r.get("weight_dtype", "bfloat16"), str(r.get("weight_dtype")))
    return _table(["weights", *head], "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", rows,
                  lambda r: [dt(r), *_decode_cells(r)], lambda r: [dt(r), str(r.get("batch")), str(r.get("ctx"))])


def fp8_decode_table(rows: list[dict]) -> list[str]:
    """fp8 against bf16 weights per (batch, ctx) of the same run: tok/s ratio and each one's roofline fraction."""
    by = {(r.get("weight_dtype", "bfloat16"), r["batch"], r["ctx"]): r for r in rows if "error" not in r}
    out = ["| batch | ctx | bf16 tok/s | fp8 tok/s | fp8 / bf16 | bf16 % of roofline | fp8 % of roofline | "
           "fp8 GB/step |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (w, b, c), f in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if w != "float8_e4m3fn" or ("bfloat16", b, c) not in by:
            continue
        h = by[("bfloat16", b, c)]
        out.append(f"| {b} | {c} | {h['tok_s']:.0f} | {f['tok_s']:.0f} | {f['tok_s'] / h['tok_s']:.2f}× | "
                   f"{100 * h['roofline_fraction']:.1f}% | {100 * f['roofline_fraction']:.1f}% | "
                   f"{f['bytes']['total'] / 1e9:.2f} |")
    return out


def pdl_table(res: dict) -> list[str]:
    """Decode with programmatic dependent launch (this run) against the ``pdl_off`` run, per shared row."""
    off = {(r.get("weight_dtype"), r["batch"], r["ctx"]): r for r in res["pdl_off"]["decode"] if "error" not in r}
    out = [f"{res['pdl_off']['date']}, `{res['pdl_off']['command']}`: {res['pdl_off'].get('note', '')}. Copy "
           f"bandwidth there {res['pdl_off']['ceilings']['copy_bw_Bps'] / 1e12:.2f} TB/s, bf16 matmul "
           f"{res['pdl_off']['ceilings']['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s (this run: "
           f"{res['ceilings']['copy_bw_Bps'] / 1e12:.2f} / {res['ceilings']['matmul_bf16_flops'] / 1e12:.0f}).", "",
           "| weights | batch | ctx | step ms, PDL on (this run) | step ms, PDL off | on / off | % of roofline on | "
           "% of roofline off |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["decode"]:
        key = (r.get("weight_dtype"), r.get("batch"), r.get("ctx"))
        if "error" in r or key not in off:
            continue
        o = off[key]
        out.append(f"| {_WEIGHT_NAMES.get(key[0], key[0])} | {key[1]} | {key[2]} | {r['step_ms']:.3f} | "
                   f"{o['step_ms']:.3f} | {r['step_ms'] / o['step_ms']:.3f} | {100 * r['roofline_fraction']:.1f}% | "
                   f"{100 * o['roofline_fraction']:.1f}% |")
    return out


def memory_table_md(mem: dict) -> list[str]:
    """Weights per GPU of the full model at TP = EP = 1, 2, 4, 8 (``glm5.weights.memory``)."""
    sizes = sorted({r["tp_ep"] for r in mem["rows"]})
    out = ["| weights | " + " | ".join(f"TP=EP={n}" for n in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for v in dict.fromkeys(r["weights"] for r in mem["rows"]):
        out.append(f"| {v} | " + " | ".join(f"{r['GB_per_gpu']:.1f} GB" for r in mem["rows"] if r["weights"] == v)
                   + " |")
    return out


def prefill_table(res: dict) -> list[str]:
    def cells(r: dict) -> list[str]:
        return [str(r["tokens"]), str(r["chunk"]), f"{r['time_s']:.3f}", f"{r['tok_s']:.0f}",
                f"{r['flops'] / 1e12:.1f}", f"{r['tflops']:.1f}", f"{100 * r['peak_fraction']:.1f}%"]
    head = ["tokens", "chunk", "time s", "tok/s", "model TFLOP", "TFLOP/s", "% of matmul peak"]
    if not _has_weight_dtype(res["prefill"]):
        return _table(head, "|---:|---:|---:|---:|---:|---:|---:|", res["prefill"], cells, lambda r: [str(r["tokens"])])

    def dt(r: dict) -> str:
        return _WEIGHT_NAMES.get(r.get("weight_dtype", "bfloat16"), str(r.get("weight_dtype")))
    return _table(["weights", *head], "|---|---:|---:|---:|---:|---:|---:|---:|", res["prefill"],
                  lambda r: [dt(r), *cells(r)], lambda r: [dt(r), str(r["tokens"])])


def backend_table(rows: list[dict]) -> list[str]:
    return _table(["decode attention", "batch", "ctx", "step ms (graph)", "tok/s", "step ms (eager)"],
                  "|---|---:|---:|---:|---:|---:|", rows,
                  lambda r: [r["decode_attn"], str(r["batch"]), str(r["ctx"]), f"{r['step_ms']:.2f}",
                             f"{r['tok_s']:.0f}", f"{r['eager_step_s'] * 1e3:.1f}"],
                  lambda r: [str(r.get("decode_attn"))])


def mla_kernel_table(k: dict) -> list[str]:
    when = f"Run {k['date']} on {k['device']}" if k.get("date") else f"Run on {k['device']}"
    out = [f"{when} (`{k.get('command', 'bench/flashinfer_bench.py')}`, FlashInfer {k['flashinfer']} "
           f"`{k['flashinfer_backend']}`): "
           f"64 heads x 512 latent, 2051 selected rows per query from a {k['rows'][0]['cache_rows'] // 2**20}M-row "
           "bf16 cache; µs per call in CUDA-graph replay; relative error vs the fp32 torch reference.", "",
           "| queries | Triton µs | GB/s | FlashInfer µs | GB/s | FlashInfer plan µs (host) | rel err Triton / FlashInfer |",
           "|---:|---:|---:|---:|---:|---:|---|"]
    for r in k["rows"]:
        e = r["rel_err_vs_ref"]
        out.append(f"| {r['n']} | {r['triton_graph_us']:.1f} | {r['triton_GBps']:.0f} | {r['flashinfer_graph_us']:.1f} | "
                   f"{r['flashinfer_GBps']:.0f} | {r['flashinfer_plan_us']:.0f} | {e['triton']:.1e} / {e['flashinfer']:.1e} |")
    return out


def speculative_tables(spec: dict) -> list[str]:
    """The ``speculative`` section (``bench/spec_bench.py``): round cost per batch and k, the speed-up per
    batch at each acceptance level, and the trained tiny checkpoint's acceptance."""
    out = [f"Run {spec['date']} on {spec['gpu']} (`{spec['command']}`); bench config plus its MTP layer, CUDA graphs; "
           "a round = one engine step (verify k+1 rows, accept, commit, MTP catch-up, k-1 draft steps).", ""]
    for m in spec.get("merged_runs", []):  # rows of a later run (each row's plain step is from its own run)
        out += [f"Batch {', '.join(str(b) for b in m['batches'])}: run {m['date']} (`{m['command']}`), merged; "
                "its rows carry `run`.", ""]
    rounds = spec.get("rounds", [])
    if rounds:
        out += _table(["batch", "ctx", "k", "round ms (all accepted)", "round ms (none accepted)", "plain step ms",
                       "GB / round", "% of roofline"], "|---:|---:|---:|---:|---:|---:|---:|---:|", rounds,
                      lambda r: [str(r["batch"]), str(r["ctx"]), str(r["k"]), f"{r['step_s'] * 1e3:.2f}",
                                 f"{r.get('step_s_none_accepted', r['step_s']) * 1e3:.2f}",
                                 f"{r['plain_step_s'] * 1e3:.2f}", f"{r['bytes']['total'] / 1e9:.2f}",
                                 f"{100 * r['roofline_fraction']:.1f}%"],
                      lambda r: [str(r.get("batch")), str(r.get("ctx")), str(r.get("k", ""))])
        out += ["", "Bytes: `glm5.engine.spec_policy.round_bytes` (verify rows' and MTP passes' touched experts under "
                "uniform routing, the draft steps' MTP weights and LM head reads, KDA state read twice + written, "
                "attention) over the copy bandwidth of the same run.", ""]
    if spec.get("speedup"):
        out += _table(["batch", "acceptance / position", "best k", "decode speed-up vs k = 0", "per k"],
                      "|---:|---|---:|---:|---|", spec["speedup"],
                      lambda r: [str(r["batch"]), r["acceptance"] if r["acceptance"] != "measured"
                                 else "measured " + "/".join(f"{x:.2f}" for x in r["rates"]), str(r["best_k"]),
                                 f"{r['speedup']:.2f}x", ", ".join(f"k={k}: {v:.2f}" for k, v in r["speedup_per_k"].items())],
                      lambda r: [str(r.get("batch"))])
        out += [""]
    if spec.get("acceptance"):
        out += ["Acceptance on the trained tiny checkpoint (its 20 agreement prompts, greedy, 32 tokens):", ""]
        out += _table(["k", "draft vocabulary", "mean accepted tokens / round", "acceptance per position",
                       "tokens = k 0"], "|---:|---:|---:|---|---|", spec["acceptance"],
                      lambda r: [str(r["k"]), f"{r['draft_vocab']} / {r['vocab']}", f"{r['mean_accepted_tokens']:.2f}",
                                 " / ".join(f"{x:.2f}" for x in r["acceptance_per_position"]),
                                 "yes" if r["tokens_equal_k0"] else "**no**"],
                      lambda r: [str(r.get("k"))])
        out += [""]
    return out


def render(res: dict, path: Path, notes: Path | None = None) -> None:
    """Write the markdown for ``res`` to ``path``; ``notes`` (a markdown file) is appended verbatim."""
    c = res["ceilings"]
    b = res.get("backends", {})
    lines = [
        "# Benchmark results (H200)", "",
        f"Run {res['date']} on {res['gpu']} (torch {res['torch']}); backends: "
        + ", ".join(f"{k} `{v}`" for k, v in b.items()) + ".", "",
        f"Command: `{res['command']}` (bench config in the `bench/bench.py` docstring: "
        "model-spec §1.1 per-layer shapes, 8 layers = 6 KDA + 2 MLA, 3 dense + 5 MoE, dummy bf16 weights).", "",
        f"Ceilings measured in the same run: device copy **{c['copy_bw_Bps'] / 1e12:.2f} TB/s** (bytes read + "
        f"written), bf16 8192³ matmul **{c['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s**.", "",
        "## Decode (one step = one token per request; caches filled with random context)", "",
        "The engine's step is the CUDA-graph replay (`graph`); `eager` is the same batched path launched op by op.", "",
        *decode_table(res["decode"]), "",
        "Roofline = bytes the step must move (non-routed text weights incl. LM head, not the vision tower or "
        "the embedding table; the routed experts this "
        "step's routing touched, fp32 KDA state read+write, selected latent rows, pooled index keys "
        "scanned) / measured copy bandwidth. Plot (engine vs roofline tok/s, not committed): "
        "`python bench/render_results.py` draws `bench/results/decode.png` from `bench/results/results.json` "
        "(needs matplotlib).", "",
        "## Prefill (one request, chunked by 4096 tokens)", "",
        *prefill_table(res), "",
    ]
    if any(r.get("weight_dtype") == "float8_e4m3fn" for r in res["decode"]):
        lines += ["## fp8 vs bf16 weights (same run)", "",
                  "fp8 = every projection e4m3 with 128x128 block scales (docs/fp8.md); its roofline counts one byte "
                  "per weight plus the fp32 scales.", "", *fp8_decode_table(res["decode"]), ""]
    if res.get("pdl_off"):
        lines += ["## Programmatic dependent launch on and off", "", *pdl_table(res), ""]
    if res.get("memory"):
        lines += ["## Weight memory of the full model per GPU (computed from the config)", "",
                  *memory_table_md(res["memory"]), "", res["memory"].get("note", ""), ""]
    if res.get("decode_flashinfer"):
        src = res.get("decode_flashinfer_run", "this run")
        lines += ["## Decode attention backends end to end (CUDA graphs)", "",
                  f"Same weights, cache and staged inputs, one process: {src}.", "",
                  *backend_table(res["decode_flashinfer"]), ""]
    if res.get("mla_kernels"):
        lines += ["## Sparse NoPE MLA decode kernel: Triton vs FlashInfer (same inputs)", "",
                  *mla_kernel_table(res["mla_kernels"]), ""]
    hf = res.get("hf")
    if hf and "step_s" in hf:
        engine = {r["batch"]: r for r in res["decode"] if r.get("ctx") == hf["ctx"] and "error" not in r
                  and r.get("weight_dtype", "bfloat16") == "bfloat16"}
        lines += [f"## transformers' glm5_next, same config, context {hf['ctx']}", "",
                  f"{res.get('hf_run', 'this run')}: transformers decode step **{hf['step_s'] * 1e3:.1f} ms** at "
                  f"batch 1 ({hf['tok_s']:.1f} tok/s); its 1K prefill took {hf['prefill_s']:.0f} s (first-call kernel "
                  "compilation and autotuning included).", ""]
        if 1 in engine and res.get("hf_run") is None:
            lines += [f"Engine at batch 1 in this run: {engine[1]['tok_s']:.0f} tok/s = **"
                      f"{engine[1]['tok_s'] / hf['tok_s']:.1f}×** transformers.", ""]
        for r in hf.get("batches", [])[1:]:
            if "error" in r or "skipped" in r:
                lines += [f"- batch {r['batch']}: " + (f"error {r['error'][:120]}" if "error" in r else r["skipped"])]
                continue
            vs = (f"; engine {engine[r['batch']]['tok_s']:.0f} tok/s = {engine[r['batch']]['tok_s'] / r['tok_s']:.1f}×"
                  if r["batch"] in engine and res.get("hf_run") is None else "")
            lines += [f"- batch {r['batch']}: step {r['step_s'] * 1e3:.1f} ms, {r['tok_s']:.0f} tok/s{vs}"]
        if hf.get("largest_batch_survived"):
            lines += ["", f"Largest batch transformers survived (of those tried): **{hf['largest_batch_survived']}**."]
        if hf.get("batches"):
            lines += [""]
    if res.get("speculative"):
        lines += ["## Speculative decoding (MTP)", "", *speculative_tables(res["speculative"])]
    dist = res.get("distributed")
    if dist and "decode" in dist:
        lines += ["## The distributed path at world size 1 (same run)", "",
                  f"The bench config again through the distributed executor's path on one GPU ({dist['backend']} "
                  "process groups of one rank, the per-step message on the gloo control group; collectives over "
                  "one rank are the identity, as in vLLM); ratio = this step / the plain step above.", "",
                  "| batch | ctx | step ms | vs plain |", "|---:|---:|---:|---:|"]
        for r in dist["decode"]:
            if "step_s" in r:
                lines.append(f"| {r['batch']} | {r['ctx']} | {r['step_s'] * 1e3:.3f} | {r.get('vs_plain', float('nan')):.3f} |")
        forced = [r for r in dist.get("decode_collectives_launched", []) if "step_s" in r]
        if forced:
            lines += ["", "The same rows with the one-rank collectives and the step message launched anyway "
                          "(`collectives_at_size_one`): what they cost, a floor for a TP > 1 step. `message` = the "
                          "driver's step message alone (pickle + gloo broadcast); µs / collective = the rest of "
                          "the difference to the plain step per collective.", "",
                      "| batch | ctx | step ms | vs plain | message ms | collectives / step | µs / collective |",
                      "|---:|---:|---:|---:|---:|---:|---:|"]
            for r in forced:
                lines.append(f"| {r['batch']} | {r['ctx']} | {r['step_s'] * 1e3:.3f} | "
                             f"{r.get('vs_plain', float('nan')):.3f} | {r.get('message_s', float('nan')) * 1e3:.3f} | "
                             f"{r.get('collectives_per_step', '')} | {r.get('us_per_collective', float('nan')):.1f} |")
        for r in dist.get("prefill", []):
            if "time_s" in r:
                lines += ["", f"Prefill {r['tokens']} tokens: {r['time_s']:.3f} s "
                              f"({r.get('vs_plain', float('nan')):.3f} × the plain run)."]
        lines += [""]
    if notes is not None and notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    path.write_text("\n".join(lines))


def plot_decode(res: dict, path: Path) -> str | None:
    """Engine vs roofline decode tok/s per batch and context, log-log, from a results dict; ``None`` when
    drawn, else why not (matplotlib is the ``bench`` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no plot: matplotlib unavailable ({e})"
    fig, ax = plt.subplots(figsize=(7, 4))
    bw = res["ceilings"]["copy_bw_Bps"]
    series = sorted({(r.get("weight_dtype", "bfloat16"), r["ctx"]) for r in res["decode"]})
    for wdt, ctx in series:
        rs = [r for r in res["decode"] if r["ctx"] == ctx and "error" not in r
              and r.get("weight_dtype", "bfloat16") == wdt]
        tag = "" if len({w for w, _ in series}) == 1 else f" {_WEIGHT_NAMES.get(wdt, wdt)}"
        ax.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], "o-", label=f"engine{tag} ctx {ctx}")
        ax.plot([r["batch"] for r in rs], [r["batch"] * bw / r["bytes"]["total"] for r in rs], "--",
                label=f"roofline{tag} ctx {ctx}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="?", default=RESULTS_DIR / "results.json",
                    help="bench/bench.py results JSON; the finalized JSON is written back (default: %(default)s)")
    ap.add_argument("--hf", type=Path, help="take transformers' row from this results.json")
    ap.add_argument("--flashinfer", type=Path, help="take the per-backend decode rows from this results.json")
    ap.add_argument("--mla-kernels", type=Path, help="bench/flashinfer_bench.py output to include")
    ap.add_argument("--speculative", type=Path, help="bench/spec_bench.py output (spec_results.json) to include")
    ap.add_argument("--out", type=Path, help="markdown to write (default: RESULTS.md beside the results JSON)")
    ap.add_argument("--plot", type=Path, help="where to draw the decode plot (default: decode.png beside the JSON)")
    ap.add_argument("--notes", type=Path, help=f"markdown appended verbatim (default: {NOTES_FILE} beside the JSON)")
    args = ap.parse_args(argv)
    here = args.results.resolve().parent
    res = json.loads(args.results.read_text())
    for flag, key, label in ((args.hf, "hf", "hf_run"), (args.flashinfer, "decode_flashinfer", "decode_flashinfer_run")):
        if flag:
            other = json.loads(flag.read_text())
            res[key] = other[key]
            res[label] = f"run {other['date']} (`{other['command']}`)"
    if args.mla_kernels:
        res["mla_kernels"] = json.loads(args.mla_kernels.read_text())
    if args.speculative:
        res["speculative"] = json.loads(args.speculative.read_text())
    res = finalize(res)
    render(res, args.out or here / "RESULTS.md", args.notes or here / NOTES_FILE)
    note = plot_decode(res, args.plot or here / "decode.png")
    if note:
        print(note, file=sys.stderr)
    args.results.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
