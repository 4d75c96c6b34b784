"""bench/host_cost.py's engine-step timing: the stubbed forward drives real text through the engine, and every
timed part of the step is reached (the numbers themselves are measured, not asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import host_cost  # noqa: E402


def test_the_stubbed_engine_emits_the_readme_text(tiny_checkpoint_dir: Path):
    eng = host_cost.decoding_engine(3, "greedy", tiny_checkpoint_dir)
    text = {f"r{i}": "" for i in range(3)}
    for _ in range(12):
        for out in eng.step():
            text[out.request_id] += out.text
    readme = (ROOT / "README.md").read_text()
    assert all(len(t) >= 12 for t in text.values()), text
    assert text["r0"].strip() in readme and text["r1"].strip() in readme and text["r0"] != text["r1"]


def test_every_part_of_the_step_is_timed(tiny_checkpoint_dir: Path):
    row = host_cost.time_engine_step(4, "seeded", 5, tiny_checkpoint_dir)
    assert row["batch"] == 4 and row["mode"] == "seeded" and row["step_ms"] > 0
    assert set(row["parts_ms"]) == {label for label, _ in host_cost.ENGINE_PARTS}
    assert all(v > 0 for v in row["parts_ms"].values()), row


def test_the_speculative_k0_comparison_times_both_engines_and_a_drain(tiny_checkpoint_dir: Path):
    """70 timed steps after 10 warm-up ones pass the 64-row backlog cap, so the MTP drain is inside the window
    (where the policy says speculation cannot pay, the MTP layer stops following the requests at the first
    step: no backlog, no drain, and from then on plain steps); no request drafts (the policy is held at k = 0)."""
    row = host_cost.time_spec_k0(4, 70, tiny_checkpoint_dir)
    assert row["batch"] == 4 and row["steps"] == 70 and row["max_backlog"] <= 70
    assert set(row["plain"]["parts_ms"]) == {label for label, _ in host_cost.ENGINE_PARTS}
    spec, drop = row["spec_k0"]["parts_ms"], row["spec_k0_drop"]["parts_ms"]
    assert set(spec) == set(drop) == {label for label, _ in host_cost.ENGINE_PARTS + host_cost.SPEC_PARTS}
    assert spec["propose"] > 0 and spec["drain"] > 0, spec
    # no backlog carried, none drained; after the warm-up's drop the steps are the plain engine's (no proposal)
    assert drop["propose"] == 0 and drop["drain"] == 0, drop
    # the dropping engine's requests lost the MTP layer at their first k = 0 step, the keeping engine's never
    assert row["spec_k0_drop"]["mtp_dropped"] == 4 and row["spec_k0"]["mtp_dropped"] == 0
    assert row["mean_ratio"] > 0 and row["drop_mean_ratio"] > 0 and row["before_first_drain_ratio"] > 0
    assert 0 < row["before_first_drain_steps"] < row["max_backlog"]
