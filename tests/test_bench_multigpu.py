"""bench/multigpu.py end to end at world size 1 on the CPU (tiny shapes, 2 layers + MTP): every stage runs and
the results carry the fields issue 19 names; the renderer turns them into markdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_multigpu_dry_run_writes_every_field(tmp_path):
    out = tmp_path / "results_multigpu.json"
    cmd = [sys.executable, str(ROOT / "bench" / "multigpu.py"), "--device", "cpu", "--gpus", "1", "--layers", "2",
           "--tiny-shapes", "--weight-dtype", "bf16", "--batches", "1", "2", "--ctxs", "64", "--prefill", "128",
           "--chunk", "64", "--cache-blocks", "32", "--reps", "2", "--mtp-batches", "1", "--mtp-ctx", "64",
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("gpus", "num_hidden_layers", "weight_dtype", "tensor_parallel_size", "expert_parallel"):
        assert key in r
    assert r["num_hidden_layers"] == 2 and r["tiny_shapes"] is True
    assert [(d["batch"], d["ctx"]) for d in r["decode"]] == [(1, 64), (2, 64)]
    for d in r["decode"]:
        assert d["step_s"] > 0 and d["tok_s"] > 0 and d["bytes"]["total"] > 0
    assert r["prefill"][0]["tokens"] == 128 and r["prefill"][0]["time_s"] > 0 and r["prefill"][0]["tflops"] > 0
    assert r["mtp"][0]["mtp_step_s"] > 0 and r["memory"][0]["weights"] > 0 and r["init"]["ranks"][0]["load_s"] >= 0
    render = subprocess.run([sys.executable, str(ROOT / "bench" / "multigpu.py"), "--render", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert render.returncode == 0, render.stderr[-2000:]
    md = (tmp_path / "RESULTS_MULTIGPU.md").read_text()
    assert "Dry run at the tiny checkpoint's shapes" in md and "| 2 | 64 |" in md
