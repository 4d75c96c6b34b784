"""Choosing k per step (glm5.engine.spec_policy) and what a step without drafts costs (the MTP backlog of
glm5.engine.spec_batched)."""

from __future__ import annotations

import json

import pytest

from glm5.config import ModelConfig
from glm5.engine.spec_policy import (AcceptanceTracker, AdaptiveK, SpecCostModel, WeightBytes, expected_tokens,
                                     round_bytes, touched_experts)
from oracle import ScriptedK, engine, greedy, random_prompt


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


def test_decisions_are_worked_out_once_per_acceptance_estimate(tmp_path, real_cfg, monkeypatch):
    """The policy runs on every decode step: the byte model is evaluated once per (batch, k), and the best k and
    whether the MTP layer could pay are derived again only when a verification changed the acceptance estimate
    (a step at k = 0 decides by lookups), yet still follow it when it changes."""
    calls = []
    model = SpecCostModel(real_cfg)
    modelled = model.modelled_s
    monkeypatch.setattr(model, "modelled_s", lambda b, k: (calls.append((b, k)), modelled(b, k))[1])
    assert model.round_s(5, 2) == model.round_s(5, 2) and calls == [(5, 2)]
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 0.6, 8: 0.4, 64: 0.05}), real_cfg)
    policy = AdaptiveK(3, cost, tracker=AcceptanceTracker(3, prior=0.2))
    rates = []
    monkeypatch.setattr(policy.tracker, "rates", lambda r=policy.tracker.rates: (rates.append(1), r())[1])
    assert [policy.choose(1) for _ in range(5)] == [0] * 5 and len(rates) == policy.k_max + 1  # one best()
    assert policy.keeps_mtp(1) == policy.keeps_mtp(1)
    for _ in range(40):   # every draft accepted: the estimate moves and the choice with it
        policy.observe_step([(3, 3)])
    assert policy.best(1) == 3 and len(rates) == 2 * (policy.k_max + 1)


def _drive(policy: AdaptiveK, steps: int, batch: int, plain_s: float, probe_step_s: float) -> list[int]:
    """The engine's calls per step: choose the next k, then the step's wall time (a probe's two steps, its
    catch-up + drafts and its verification, take ``probe_step_s`` each)."""
    picks, prev = [], 0
    for _ in range(steps):
        k = policy.choose(batch)
        busy = bool(k or prev)
        policy.observe_time(probe_step_s if busy else plain_s, batch, plain=not busy)
        picks.append(k)
        prev = k
    return picks


def test_adaptive_k_probes_within_its_exploration_budget_and_follows_acceptance(real_cfg, tmp_path):
    """While k = 0 pays best, the probes (one draft) cost at most ``explore_fraction`` of the step time: the
    first waits until 2 % of the elapsed time covers the model's estimate (2 x a k = 1 round), later ones
    are spaced by the measured cost; once drafts pass, speculation comes back."""
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 0.8, 8: 0.4, 64: 0.05}), real_cfg)
    policy = AdaptiveK(3, cost, probe_every=4, tracker=AcceptanceTracker(3, prior=0.2))
    picks = _drive(policy, 3000, 1, plain_s=0.01, probe_step_s=0.03)
    probes = [i for i, k in enumerate(picks) if k]
    assert set(picks) == {0, 1} and policy.probes == len(probes) >= 5
    # first probe: 2 % of the elapsed 0.01 s steps covers 2 x 0.018 s (the k = 1 round) after 180 steps
    assert 179 <= probes[0] <= 181
    # each probe then costs 2 x (0.03 - 0.01) s beyond plain steps: 2 % of the time covers one per 100+ steps
    assert all(b - a >= 100 for a, b in zip(probes, probes[1:]))
    assert policy.probe_spent_s == pytest.approx(0.04 * len(probes))
    assert policy.probe_spent_s <= 0.02 * policy.elapsed_s + policy.probe_cost_s(1)   # at most one probe ahead
    for _ in range(200):  # drafts start passing: the estimate follows and speculation comes back
        policy.observe_step([(3, 3)] * 4)
    assert policy.tracker.rates()[0] > 0.95 and policy.choose(1) == 3
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0 and expected_tokens([0.5, 0.5], 2) == 1.75


def test_adaptive_k_calibrates_the_plain_step_from_measured_times(real_cfg, tmp_path):
    """Steps twice as slow as the table's plain round: the probe's excess is measured against the calibrated
    plain step (so a probe step of 2.5x the table counts 0.5x, not 1.5x)."""
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 0.8, 8: 0.4, 64: 0.05}), real_cfg)
    policy = AdaptiveK(3, cost, probe_every=4, tracker=AcceptanceTracker(3, prior=0.2))
    picks = _drive(policy, 600, 1, plain_s=0.02, probe_step_s=0.025)
    assert policy.probes >= 2 and policy._plain_ratio == pytest.approx(2.0, rel=1e-3)
    assert policy.probe_spent_s == pytest.approx(2 * 0.005 * policy.probes, rel=1e-3)
    assert picks.index(1) == pytest.approx(90, abs=2)   # 2 x 0.018 s covered by 2 % of 0.02 s steps


def test_cost_table_errors_name_the_fix(tmp_path, real_cfg):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rounds": [{"batch": 1, "k": "x"}]}))
    with pytest.raises(ValueError, match="round_s"):
        SpecCostModel.load(bad, real_cfg)
    bad.write_text("{}")
    with pytest.raises(ValueError, match="spec_bench"):
        SpecCostModel.load(bad, real_cfg)


@pytest.mark.parametrize("schedule,drained", [([0, 0, 3, 0, 0, 0, 3], False), ([0] * 11 + [3], True)])
def test_steps_without_drafts_skip_the_mtp_layer_and_catch_up_later(tiny_checkpoint_dir, monkeypatch, schedule,
                                                                     drained):
    """k = 0 steps do not run the MTP layer; the next drafting step catches up on every held-back row (a
    backlog longer than k_max + 1 rows per request in graph-shaped drain passes first), after which the
    drafts are those of an engine whose MTP layer saw every step (same cache)."""
    from glm5.engine.spec_batched import DRAIN_ROWS
    from glm5.engine.spec_forwards import SpecForwards
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
        drains = []
        orig_drain = SpecForwards.mtp_drain

        def drain(self, rows, hidden, padded_requests, t):
            assert len(rows.tokens) <= padded_requests * t and t == DRAIN_ROWS
            drains.append(len(rows.tokens))
            return orig_drain(self, rows, hidden, padded_requests, t)
        monkeypatch.setattr(MTPLayer, "forward", fwd)
        monkeypatch.setattr(SpecForwards, "mtp_drain", drain)
        monkeypatch.setattr(type(eng), "step", step)
        out = [o.token_ids for o in eng.generate(prompts, greedy(16))]
        monkeypatch.undo()
        return out, drafts, step.mtp_runs, eng, drains

    out_s, drafts_s, runs_s, eng_s, drains_s = run(ScriptedK(schedule))
    out_f, drafts_f, _, _, drains_f = run(None)
    assert out_s == ref and out_f == ref
    assert 0 in runs_s[1:]                                   # some decode steps ran no MTP pass at all
    assert not drains_f and bool(drains_s) == drained   # 11 rows held back: the first 8 in a drain pass
    common = [(r, p) for r in drafts_s for p in drafts_s[r] if p in drafts_f.get(r, {})]
    assert len(common) >= 3
    for r, p in common:
        assert drafts_s[r][p] == drafts_f[r][p], (r, p)
    assert all(s.mtp_backlog is None for s in eng_s.scheduler.running)
    # the policy's clock saw the decode steps only (3 prompts of 5-37 tokens: their prefill steps are not
    # timed), and a plain step only where nothing was verified or drafted
    timed = eng_s.k_policy.timed
    assert 0 < len(timed) <= 16 and all(0 < b <= 3 for b, _ in timed)
    assert any(p for _, p in timed) and not all(p for _, p in timed)


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


def test_probe_credit_does_not_pile_up_and_one_stall_does_not_stop_probing(real_cfg, tmp_path):
    """Time with speculation on earns no probe credit, and the credit never holds more than two of the dearer of
    a probe and a drain, so a policy that turns off after a long speculative stretch does not burst into
    back-to-back probes; one probe
    slowed by a stall (a first-call compilation, say) counts at most 8 k = 1 rounds, so probing resumes."""
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 0.8, 8: 0.4, 64: 0.05}), real_cfg)
    on = AdaptiveK(3, cost, probe_every=4, tracker=_tracker(0.95))
    assert on.best(1) > 0
    _drive(on, 20000, 1, plain_s=0.01, probe_step_s=0.03)
    assert on.elapsed_s == 0 and on.credit_s == 0
    policy = AdaptiveK(3, cost, probe_every=4, tracker=AcceptanceTracker(3, prior=0.2))
    _drive(policy, 100000, 1, plain_s=0.01, probe_step_s=0.01)   # probes that cost nothing: credit caps
    assert policy.credit_s <= 2 * max(policy.probe_cost_s(1), policy.drain_cost_s(1)) + 1e-12
    stalled = AdaptiveK(3, cost, probe_every=4, tracker=AcceptanceTracker(3, prior=0.2))
    picks, prev = [], 0
    for i in range(4000):
        k = stalled.choose(1)
        busy = bool(k or prev)
        secs = (5.0 if stalled.probes == 1 else 0.03) if busy else 0.01   # the first probe stalls for 5 s
        stalled.observe_time(secs, 1, plain=not busy)
        picks.append(k)
        prev = k
    assert stalled.probes >= 3 and stalled.probe_cost_s(1) < 8.5 * cost.round_s(1, 1)
    with pytest.raises(ValueError, match="round_s must be > 0"):
        (tmp_path / "zero.json").write_text(json.dumps({"rounds": [{"batch": 1, "k": 0, "round_s": 0}]}))
        SpecCostModel.load(tmp_path / "zero.json", real_cfg)


def _funded(policy: AdaptiveK, batch: int) -> AdaptiveK:
    """``policy`` after enough plain k = 0 steps at ``batch`` that its exploration credit covers a drain."""
    for _ in range(100_000):
        if policy.credit_s >= policy.drain_cost_s(batch):
            return policy
        policy.observe_time(policy.cost.round_s(batch, 0), batch, plain=True)
    raise AssertionError(f"the credit never covers a drain: {policy.credit_s} < {policy.drain_cost_s(batch)}")


def test_backlogs_are_kept_until_the_observed_acceptance_says_no_k_can_pay(tmp_path, real_cfg):
    """keeps_mtp (drain a full backlog, or drop it), with the exploration credit covering a drain: before any
    draft was verified the benefit of the doubt is full acceptance, so where a k could pay at full acceptance the
    history is kept; once verified drafts show an acceptance at which no k pays, even optimistically, backlogs
    are dropped; a high observed acceptance keeps them; and where no k pays even at full acceptance nothing is
    kept from the start."""
    # at batch 8 a draft adds 80 % of a plain step: k = 3 pays at full acceptance (4 tokens for 3.4x the cost of a
    # plain step) but no k pays at 0.8 per position (k = 1: 1.8 tokens for 1.8x, k = 3: 2.95 for 3.4x)
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 2.0, 8: 0.8, 64: 0.05}), real_cfg)
    fresh = _funded(AdaptiveK(3, cost), 8)
    assert fresh.tracker.optimistic_rates() == [1.0, 1.0, 1.0]
    assert fresh.keeps_mtp(8) and fresh.can_pay(8)
    assert not fresh.keeps_mtp(1) and not fresh.can_pay(1)      # 4 tokens for 7x the cost: never pays

    def observed(rate: float, steps: int) -> AdaptiveK:
        """k = 3 rounds of 8 requests, each draft accepted with probability ``rate`` once the one before was."""
        import random
        rng = random.Random(0)
        policy = AdaptiveK(3, cost)
        for _ in range(steps):
            results = []
            for _ in range(8):
                accepted = 0
                while accepted < 3 and rng.random() < rate:
                    accepted += 1
                results.append((3, accepted))
            policy.observe_step(results)
        return _funded(policy, 8)
    low, high = observed(0.4, 20), observed(0.95, 20)
    assert max(low.tracker.optimistic_rates()) < 0.75
    assert not low.keeps_mtp(8)
    assert low.can_pay(8)            # probing (paid from its budget) still may: full acceptance could pay
    assert high.keeps_mtp(8)
    # a k = 1 probe measures the first position only; the later ones are capped by it (a deeper draft is not
    # taken to be accepted more often than a shallower one)
    probe = _funded(AdaptiveK(3, cost), 8)
    probe.observe_step([(1, 1)] * 6 + [(1, 0)] * 2)
    rates = probe.tracker.optimistic_rates()
    assert rates == pytest.approx([0.8, 0.8, 0.8])
    assert not probe.keeps_mtp(8)    # k = 3: 1 + 0.8 + 0.64 + 0.51 = 2.95 tokens for 3.4x the cost
    probe.observe_step([(1, 1)] * 8)
    assert probe.keeps_mtp(8)        # 14 of 16 probes accepted, 0.89 optimistic: k = 2 gives 2.68 tokens for 2.6x


def test_drains_are_paid_from_the_exploration_credit(tmp_path, real_cfg):
    """A drain step (the MTP layer ran, nothing verified or drafted, no probe) takes its excess over a plain step
    off the credit that also pays the probes. The first drain runs on credit (nothing else would measure what a
    drain costs); after it, full backlogs are dropped even where a k could pay at full acceptance, until enough
    k = 0 time has refilled the credit. A verifying step (speculation switching off) is no drain."""
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 2.0, 8: 0.8, 64: 0.05}), real_cfg)
    policy = AdaptiveK(3, cost)
    assert policy.can_pay(8, policy.tracker.optimistic_rates())
    assert policy.credit_s == 0 and policy.keeps_mtp(8)          # the first drain, on credit
    assert policy.choose(8, may_probe=False) == 0                 # off: the next step drafts nothing
    plain, round1 = cost.round_s(8, 0), cost.round_s(8, 1)
    policy.observe_time(plain + 4 * round1, 8, plain=False)       # verified drafts: not a drain
    assert policy.drains == 0 and policy.credit_s > 0
    policy.observe_time(plain + 3 * round1, 8, plain=False, mtp_only=True)   # a drain: 3 rounds beyond plain
    assert policy.drains == 1 and policy.drain_spent_s == pytest.approx(3 * round1)
    assert policy.drain_cost_s(8) == pytest.approx(2.5 * round1)  # smoothed from 2 rounds
    assert policy.credit_s < 0 and not policy.keeps_mtp(8)
    steps = 0
    while not policy.keeps_mtp(8):
        policy.observe_time(plain, 8, plain=True)
        steps += 1
    # the credit grows by explore_fraction of each k = 0 step: from below zero to one drain's worth
    assert steps * plain * policy.explore_fraction >= policy.drain_cost_s(8)
    # the credit can hold two drains even where a drain costs more than a probe
    policy.observe_time(plain + 8 * round1, 8, plain=False, mtp_only=True)
    assert policy.drain_cost_s(8) > policy.probe_cost_s(8)
    for _ in range(100_000):
        policy.observe_time(plain, 8, plain=True)
    assert policy.credit_s == pytest.approx(2 * policy.drain_cost_s(8)) and policy.keeps_mtp(8)


def test_rows_are_held_back_only_where_a_full_backlog_could_be_drained_or_speculation_ran_lately(tmp_path, real_cfg):
    """holds_mtp (carry backlogs at all): while a full backlog would be drained (keeps_mtp), and for HOLD_STEPS
    steps at k = 0 after the last speculative step or probe (the batch may shrink back); after that, with no
    drain paid for, a backlog would only be dropped when full, so none is carried."""
    # at 0.95 per position k = 3 pays at b1 (3.71 tokens for 1.6x a plain step) and no k pays at b8 (for 4x)
    cost = SpecCostModel.load(_table(tmp_path, 0.01, {1: 0.2, 8: 1.0, 64: 0.05}), real_cfg)
    policy = AdaptiveK(3, cost, probe_every=0, tracker=_tracker(0.95))
    plain, round1 = cost.round_s(8, 0), cost.round_s(8, 1)
    assert policy.keeps_mtp(8) and policy.holds_mtp(8)         # the first drain runs on credit: held
    policy.observe_time(plain + 3 * round1, 8, plain=False, mtp_only=True)   # a drain: the credit is spent
    assert not policy.keeps_mtp(8) and not policy.holds_mtp(8)  # no speculative step yet: not held
    assert policy.choose(1) > 0                                # speculation runs at b1 ...
    for i in range(policy.HOLD_STEPS):
        assert policy.holds_mtp(8), i                          # ... so b8's rows wait for the batch to shrink
        assert policy.choose(8, may_probe=False) == 0
    assert not policy.holds_mtp(8) and not policy.keeps_mtp(8)  # 64 steps at k = 0, no drain paid: not held
    # a backlog started now is held where the credit its 64 steps at k = 0 will earn pays its drain when full
    earned = policy.explore_fraction * policy._plain_ratio * plain * policy.HOLD_STEPS
    policy.credit_s = policy.drain_cost_s(8) - 0.5 * earned
    assert policy.holds_mtp(8) and not policy.keeps_mtp(8)
    policy.credit_s = policy.drain_cost_s(8) - 1.5 * earned
    assert not policy.holds_mtp(8)
    assert policy.choose(1) > 0 and policy.holds_mtp(8)         # a speculative step holds them again


@pytest.mark.parametrize("per_draft, held", [(7.0, False), (0.7, True)])
def test_adaptive_engine_holds_rows_back_only_where_a_k_could_pay(tiny_checkpoint_dir, tmp_path, per_draft, held):
    """The engine with the adaptive policy at k = 0: where no k could beat k = 0 even at full acceptance (each
    draft costs 7 plain steps), the MTP layer stops following the requests at their first decode step - no
    backlog is carried for 64 steps only to be dropped; where a k could pay at full acceptance (0.7 plain steps a
    draft; none pays at the prior 0.5, so the policy stays at k = 0), every request holds a backlog (before any
    draft was verified, the first drain runs on credit). Tokens are k = 0's."""
    prompts = [random_prompt(n, 640, seed=70 + n) for n in (6, 21)]
    ref = [o.token_ids for o in engine(tiny_checkpoint_dir, decode_path="batched").generate(prompts, greedy(12))]
    table = tmp_path / "cost.json"
    table.write_text(json.dumps({"rounds": [{"batch": b, "k": k, "round_s": 1e-3 * (1 + per_draft * k)}
                                            for b in (1, 2) for k in range(4)]}))
    eng = engine(tiny_checkpoint_dir, decode_path="batched", num_speculative_tokens=3,
                 speculative_policy="adaptive", speculative_cost_table=str(table))
    assert eng.k_policy.best(2) == 0 and eng.k_policy.can_pay(2) == held
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(12))
    outs: dict[str, list[int]] = {}
    checked = 0
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        running = eng.scheduler.running
        if len(running) == 2 and all(len(s.output_token_ids) > 1 for s in running):
            checked += 1
            assert all(s.mtp_off != held and (s.mtp_backlog is not None) == held for s in running)
    assert checked >= 5 and [outs[f"r{i}"] for i in range(2)] == ref
    assert eng.spec_stats.mtp_dropped == (0 if held else 2) and eng.spec_stats.steps == 0
