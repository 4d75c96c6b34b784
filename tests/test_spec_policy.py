"""Choosing k per step (glm5.engine.spec_policy) and what a step without drafts costs (the MTP backlog of
glm5.engine.spec_batched)."""

from __future__ import annotations

import json

import pytest

from glm5.config import ModelConfig
from glm5.engine.spec_policy import (AcceptanceTracker, AdaptiveK, SpecCostModel, WeightBytes, expected_tokens,
                                     round_bytes, touched_experts)
from oracle import engine, greedy, random_prompt


@pytest.fixture(scope="module")
def real_cfg(real_config_path):
    return ModelConfig.from_pretrained(str(real_config_path))


def test_byte_model_of_a_round_at_the_real_shape(real_cfg):
    """The issue's arithmetic: at batch 1 the 4 rows of a k = 3 round touch ~31 experts per MoE layer instead
    of 8 and every draft step reads the 1.27 GB LM head, so the round moves ~2.6x a plain step; at batch 256
    every expert is touched anyway and the round costs little more than a plain step."""
    w = WeightBytes.from_config(real_cfg)
    assert w.n_experts == 288 and w.top_k == 8 and w.target_moe_layers == 42
    assert abs(w.lm_head - 154880 * 4096 * 2) == 0
    assert 30 < touched_experts(4, 288, 8) < 32
    plain = round_bytes(real_cfg, w, 1, 0, 1024)["total"]
    k3 = round_bytes(real_cfg, w, 1, 3, 1024)
    assert 2.4 < k3["total"] / plain < 2.8
    assert k3["draft_head"] == 3 * w.lm_head
    assert round_bytes(real_cfg, w, 256, 3, 1024)["total"] / round_bytes(real_cfg, w, 256, 0, 1024)["total"] < 1.2
    small = round_bytes(real_cfg, w, 1, 3, 1024, draft_vocab=32768)
    assert small["draft_head"] == pytest.approx(3 * w.lm_head * 32768 / 154880)


def _table(tmp_path, plain_s: float, per_draft: dict[int, float], batches=(1, 8, 64)) -> str:
    rows = [{"batch": b, "k": 0, "round_s": plain_s * b ** 0.5} for b in batches]
    rows += [{"batch": b, "k": k, "round_s": plain_s * b ** 0.5 * (1 + per_draft[b] * k)}
             for b in batches for k in (1, 2, 3)]
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"rounds": rows}))
    return str(path)


def _tracker(rate: float, k_max: int = 3) -> AcceptanceTracker:
    t = AcceptanceTracker(k_max, prior=rate, prior_weight=1e6)  # pinned to ``rate``
    assert t.rates() == pytest.approx([rate] * k_max)
    return t


def test_adaptive_k_picks_zero_where_speculation_loses(tmp_path, real_cfg):
    # measured-like costs: at batch 1 each draft adds 80 % of a plain step (experts + LM head), at 64 only 5 %
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 0.8, 8: 0.4, 64: 0.05}), real_cfg)
    low, high = AdaptiveK(3, cost, tracker=_tracker(0.3)), AdaptiveK(3, cost, tracker=_tracker(0.9))
    assert low.best(1) == 0 and high.best(1) >= 1          # 1.3 tokens for 1.8x the cost loses, 1.9 for 1.8x wins
    assert low.best(64) >= 1 and high.best(64) == 3
    for policy in (low, high):  # the choice is never slower than plain decoding under the model
        for b in (1, 4, 8, 30, 64, 100):
            assert policy.throughput(b, policy.best(b)) >= policy.throughput(b, 0)
    assert cost.round_s(8, 2) == pytest.approx(0.01 * 8 ** 0.5 * 1.8)
    between = cost.round_s(30, 1)
    assert cost.round_s(8, 1) < between < cost.round_s(64, 1)


def test_adaptive_k_probes_while_off_and_follows_acceptance(real_cfg, tmp_path):
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 0.8, 8: 0.4, 64: 0.05}), real_cfg)
    policy = AdaptiveK(3, cost, probe_every=4, tracker=AcceptanceTracker(3, prior=0.2))
    picks = [policy.choose(1) for _ in range(8)]
    assert picks == [0, 0, 0, 1, 0, 0, 0, 1]
    for _ in range(200):  # drafts start passing: the estimate follows and speculation comes back
        policy.observe_step([(3, 3)] * 4)
    assert policy.tracker.rates()[0] > 0.95 and policy.choose(1) == 3
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0 and expected_tokens([0.5, 0.5], 2) == 1.75


def test_adaptive_k_does_not_probe_where_no_acceptance_could_pay(real_cfg, tmp_path):
    """A round dearer than (k + 1) plain steps for every k (host-bound small models on a GPU: the H200 run of
    test_gpu_spec measured k = 1 at 2.4x a plain step at batch 8) loses even with every draft accepted, so
    the policy stays at k = 0 without probing; where perfect acceptance would win, it still probes."""
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 1.6, 8: 1.2, 64: 0.05}), real_cfg)
    policy = AdaptiveK(3, cost, probe_every=4, tracker=AcceptanceTracker(3, prior=0.2))
    assert not policy.can_pay(1) and not policy.can_pay(8) and policy.can_pay(64)
    assert [policy.choose(8) for _ in range(64)] == [0] * 64
    assert 1 in [policy.choose(64) for _ in range(8)] or policy.best(64) > 0


def test_cost_table_errors_name_the_fix(tmp_path, real_cfg):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rounds": [{"batch": 1, "k": "x"}]}))
    with pytest.raises(ValueError, match="round_s"):
        SpecCostModel.load(bad, real_cfg)
    bad.write_text("{}")
    with pytest.raises(ValueError, match="spec_bench"):
        SpecCostModel.load(bad, real_cfg)


class _Scripted:
    """A policy that drafts 0 or k by a fixed schedule (steps without drafts leave an MTP backlog)."""

    def __init__(self, schedule):
        self.schedule, self.i = schedule, 0

    def choose(self, batch):
        self.i += 1
        return self.schedule[self.i % len(self.schedule)]

    def observe_step(self, results):
        pass


def test_steps_without_drafts_skip_the_mtp_layer_and_catch_up_later(tiny_checkpoint_dir, monkeypatch):
    """k = 0 steps do not run the MTP layer; the next drafting step catches up on every held-back row, after
    which the drafts are those of an engine whose MTP layer saw every step (same cache)."""
    from glm5.layers.mtp import MTPLayer

    prompts = [random_prompt(n, 640, seed=80 + n) for n in (5, 26, 37)]
    ref_eng = engine(tiny_checkpoint_dir, decode_path="batched")
    ref = [o.token_ids for o in ref_eng.generate(prompts, greedy(16))]

    def run(policy):
        eng = engine(tiny_checkpoint_dir, decode_path="batched", num_speculative_tokens=3)
        if policy is not None:
            eng.k_policy = policy
        calls, drafts = [], {}
        orig_fwd, orig_step = MTPLayer.forward, type(eng).step

        def fwd(self, batch, hidden, cache):
            calls.append(hidden.shape[0])
            return orig_fwd(self, batch, hidden, cache)

        def step(self):
            before = len(calls)
            out = orig_step(self)
            for seq in self.scheduler.running:
                if seq.draft_tokens:
                    drafts.setdefault(seq.request_id, {})[seq.num_computed_tokens] = list(seq.draft_tokens)
            step.mtp_runs.append(len(calls) - before)
            return out
        step.mtp_runs = []
        monkeypatch.setattr(MTPLayer, "forward", fwd)
        monkeypatch.setattr(type(eng), "step", step)
        out = [o.token_ids for o in eng.generate(prompts, greedy(16))]
        monkeypatch.undo()
        return out, drafts, step.mtp_runs, eng

    out_s, drafts_s, runs_s, eng_s = run(_Scripted([0, 0, 3, 0, 0, 0, 3]))
    out_f, drafts_f, _, _ = run(None)
    assert out_s == ref and out_f == ref
    assert 0 in runs_s[1:]                                   # some decode steps ran no MTP pass at all
    common = [(r, p) for r in drafts_s for p in drafts_s[r] if p in drafts_f.get(r, {})]
    assert len(common) >= 3
    for r, p in common:
        assert drafts_s[r][p] == drafts_f[r][p], (r, p)
    assert all(s.mtp_backlog is None for s in eng_s.scheduler.running)


def test_above_the_speculative_batch_cap_steps_decode_without_drafts(tiny_checkpoint_dir):
    """More running requests than speculative_max_batch: no drafts (plain batched decode, MTP layer deferred);
    speculation resumes when the batch shrinks; tokens are k = 0's throughout."""
    prompts = [random_prompt(n, 640, seed=60 + n) for n in (4, 12, 30)]
    params = [greedy(n) for n in (6, 14, 14)]
    ref = [o.token_ids for o in engine(tiny_checkpoint_dir, decode_path="batched").generate(prompts, params)]
    eng = engine(tiny_checkpoint_dir, decode_path="batched", num_speculative_tokens=2, speculative_max_batch=2)
    for i, (p, q) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, q)
    drafted_at: list[int] = []
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        if any(s.draft_tokens for s in eng.scheduler.running):
            drafted_at.append(len(eng.scheduler.running))
    assert [outs[f"r{i}"] for i in range(3)] == ref
    assert drafted_at and max(drafted_at) <= 2 and eng.spec_stats.steps > 0
