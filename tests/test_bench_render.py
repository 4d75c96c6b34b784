"""bench/render_results.py on the committed H200 run: the tables of bench/RESULTS.md and the decode plot
(which is drawn from bench/results.json rather than committed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_render_results_writes_the_tables_and_draws_the_plot(tmp_path):
    results = tmp_path / "results.json"
    shutil.copy(ROOT / "bench" / "results.json", results)   # render writes the finalized JSON back
    md, png = tmp_path / "RESULTS.md", tmp_path / "decode.png"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "render_results.py"), str(results),
                           "--out", str(md), "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    res = json.loads(results.read_text())
    text = md.read_text()
    assert f"Run {res['date']} on {res['gpu']}" in text
    for r in res["decode"]:   # one table row per decode point, with its graph step time and roofline share
        assert f"| {r['batch']} | {r['ctx']} | {r['step_s'] * 1e3:.2f} |" in text
        assert f"{100 * r['roofline_fraction']:.1f}% |" in text
    for r in res["prefill"]:
        assert f"| {r['tokens']} | {r['chunk']} | {r['time_s']:.3f} |" in text
    assert f"**{res['hf']['step_s'] * 1e3:.1f} ms**" in text
    # the committed RESULTS.md is what this renderer makes of the committed results
    assert text == (ROOT / "bench" / "RESULTS.md").read_text()
