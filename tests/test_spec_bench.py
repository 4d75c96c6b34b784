"""bench/spec_bench.py's derived numbers (speed-up per batch and acceptance, the cost table the adaptive policy
reads) and their rendering by bench/render_results.py; the GPU part itself runs on the H200."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import spec_bench  # noqa: E402


def _rounds() -> list[dict]:
    rows = []
    for b, plain, extra in ((1, 0.010, 0.8), (64, 0.020, 0.1)):
        for k in range(4):
            all_acc = plain * (1 + extra * k)
            rows.append({"batch": b, "ctx": 1024, "k": k, "plain_step_s": plain, "step_s": all_acc,
                         "step_s_none_accepted": plain * (1 + 0.6 * extra * k) if k else plain,
                         "bytes": {"total": 1e9 * (k + 1)}, "roofline_fraction": 0.5})
    return rows


def test_speedup_interpolates_the_round_cost_by_expected_acceptance():
    acc = [{"k": 3, "draft_vocab": 640, "vocab": 640, "conditional_acceptance": [0.78, 0.84, 0.70]}]
    rows = {(r["batch"], r["acceptance"]): r for r in spec_bench.speedups(_rounds(), acc)}
    assert set(rows) == {(b, a) for b in (1, 64) for a in ("0.6", "0.8", "0.9", "measured")}
    # batch 1, k = 3 at 0.9: E = 3.439 tokens; the round cost is interpolated at 2.439 of 3 accepted drafts
    e = 1 + 0.9 + 0.81 + 0.729
    lo, hi = 0.010 * (1 + 0.48 * 3), 0.010 * (1 + 0.8 * 3)
    want = e / (lo + (hi - lo) * (e - 1) / 3) * 0.010
    assert rows[(1, "0.9")]["speedup_per_k"][3] == pytest.approx(want, rel=1e-3)
    # cheap drafts at batch 64 pay at every level; at batch 1 low acceptance makes k = 0 the best choice
    assert all(rows[(64, a)]["best_k"] == 3 and rows[(64, a)]["speedup"] > 1 for a in ("0.6", "0.8", "0.9"))
    assert rows[(1, "0.6")]["best_k"] == 0 and rows[(1, "0.6")]["speedup"] == 1.0
    assert rows[(1, "measured")]["rates"] == [0.78, 0.84, 0.70]


def test_cost_table_is_what_the_adaptive_policy_reads(tmp_path, real_config_path):
    from glm5.config import ModelConfig
    from glm5.engine.spec_policy import SpecCostModel

    path = tmp_path / "cost.json"
    path.write_text(json.dumps(spec_bench.cost_table(_rounds(), "H200")))
    cost = SpecCostModel.load(path, ModelConfig.from_pretrained(str(real_config_path)))
    assert cost.round_s(1, 3) == pytest.approx(0.010 * 3.4) and cost.round_s(64, 0) == pytest.approx(0.020)


def test_render_shows_the_speculative_section(tmp_path):
    res = json.loads((ROOT / "bench" / "results" / "results.json").read_text())
    acc = [{"k": 3, "draft_vocab": 640, "vocab": 640, "steps": 200, "mean_accepted_tokens": 2.89,
            "acceptance_per_position": [0.78, 0.69, 0.5], "conditional_acceptance": [0.78, 0.84, 0.70],
            "tokens_equal_k0": True}]
    res["speculative"] = {"date": "2026-12-01T00:00:00+00:00", "gpu": "NVIDIA H200", "command": "bench/spec_bench.py",
                          "rounds": _rounds(), "acceptance": acc, "speedup": spec_bench.speedups(_rounds(), acc)}
    (tmp_path / "results.json").write_text(json.dumps(res))
    md = tmp_path / "out.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "render_results.py"), str(tmp_path / "results.json"),
                           "--out", str(md), "--plot", str(tmp_path / "p.png")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = md.read_text()
    assert "## Speculative decoding (MTP)" in text
    assert "| 1 | 1024 | 3 | 34.00 | 24.40 | 10.00 | 4.00 | 50.0% |" in text
    assert "| 64 | 0.9 | 3 |" in text and "| 3 | 640 / 640 | 2.89 | 0.78 / 0.69 / 0.50 | yes |" in text


def test_round_timing_runs_every_k_and_mode_on_the_cpu(tiny_checkpoint_dir):
    """A dry run of the GPU part's machinery on the tiny checkpoint (eager, CPU): every k gets its plain,
    none-accepted and all-accepted step times, the bytes of its round, and the all-accepted mode really
    accepts every draft (the catch-up then covers k+1 rows)."""
    import torch

    from glm5.config import ModelConfig
    from glm5.engine.spec_batched import BatchedSpeculation
    from glm5.weights import load_weights

    cfg_dict = json.loads((tiny_checkpoint_dir / "config.json").read_text())
    weights = load_weights(str(tiny_checkpoint_dir), ModelConfig.from_dict(cfg_dict), device="cpu",
                           dtype=torch.float32, progress=False)
    seen: list[int] = []
    orig = BatchedSpeculation._catch_up

    def catch_up(self, entries, drafting):
        seen.append(max(h.shape[0] for _, _, h, _ in entries))
        return orig(self, entries, drafting)
    BatchedSpeculation._catch_up = catch_up
    try:
        rows = spec_bench.run_rounds(cfg_dict, weights, 2, 24, 2, lambda r: None, device="cpu")
    finally:
        BatchedSpeculation._catch_up = orig
    assert [r["k"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["plain_step_s"] == rows[0]["plain_step_s"] > 0 and r["step_s"] > 0
        assert r["bytes"]["total"] == sum(v for k, v in r["bytes"].items() if k != "total")
    assert all(r["step_s_none_accepted"] > 0 for r in rows[1:])
    assert spec_bench.K_MAX + 1 in seen   # all accepted: k+1 rows to catch up


def test_round_timing_refuses_steps_that_verified_nothing(tiny_checkpoint_dir, monkeypatch):
    """Where the k > 0 steps run no speculative round (here nobody is given drafts), the round timing raises
    rather than record plain steps as rounds."""
    import torch

    from glm5.config import ModelConfig
    from glm5.engine.llm_engine import LLMEngine
    from glm5.weights import load_weights

    cfg_dict = json.loads((tiny_checkpoint_dir / "config.json").read_text())
    weights = load_weights(str(tiny_checkpoint_dir), ModelConfig.from_dict(cfg_dict), device="cpu",
                           dtype=torch.float32, progress=False)
    monkeypatch.setattr(LLMEngine, "_num_drafts", lambda self, seq: 0)
    with pytest.raises(RuntimeError, match="k=3 .*verified requests"):
        spec_bench.run_rounds(cfg_dict, weights, 2, 24, 2, lambda r: None, device="cpu")
