"""Prefix caching through the engine (CPU, fp32, tiny hybrid checkpoint: KDA, MLA, MLA, KDA).

Every test runs the same requests with the cache on and off and requires token-identical greedy
(and seeded) outputs; where the oracle applies, transformers gives the same tokens. Hits are placed
at every offset modulo the block size (8) and kpool (4): a hit resumes mid-block from a snapshot
holding the partial block's rows and the kpool tail. After every test all blocks, state slots and
snapshot slots are free again (cached data counts as free: it lives in the free pool).
"""

from __future__ import annotations

import pytest
import torch

from glm5.cache.snapshot_pool import StateSnapshotPool
from glm5.engine import LLMEngine, PromptInput
from glm5.sampling_params import SamplingParams
from oracle import engine, greedy, hf_greedy, make_pair, random_prompt

BS = 8          # block size = 2 x kpool
VOCAB = 600     # prompt ids below the tiny tokenizer's special tokens
#: KDA, two consecutive MLA layers, KDA; topk 8 = 2 pools, so prompts past ~12 tokens are sparse;
#: 16 index heads avoid ReLU-zero score ties (see test_engine_oracle_more.NO_TIES)
STACK = {"layer_types": ["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                         "linear_attention"], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
         "num_hidden_layers": 4, "index_n_heads": 16, "index_topk": 8}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("prefix") / "ckpt", seed=1, text_overrides=STACK)


def make(ckpt, on: bool = True, snapshots: int = 64, **kw) -> LLMEngine:
    args = dict(block_size=BS, num_cache_blocks=160, enable_prefix_caching=on, max_model_len=512)
    args.update(kw)
    eng = engine(ckpt, **args)
    if on and snapshots:  # resize the pool to ``snapshots`` slots (the byte budget an operator would set)
        per = StateSnapshotPool.bytes_per_snapshot(eng.runner.cache)
        eng = engine(ckpt, prefix_cache_snapshot_memory_gb=(snapshots + 0.5) * per / 2**30, **args)
        assert eng.kv.snapshots.capacity == snapshots
    return eng


def assert_pools_idle(eng: LLMEngine) -> None:
    """Every block, state slot and snapshot slot is free (cached blocks / snapshots count as free)."""
    kv = eng.kv
    assert not eng.has_unfinished()
    assert kv.blocks.num_free == kv.blocks.num_blocks and all(r == 0 for r in kv.blocks.ref_count)
    assert kv.slots.num_free == kv.slots.capacity
    if kv.snapshots is not None:
        assert kv.snapshots.num_free == kv.snapshots.capacity


def one_by_one(eng: LLMEngine, prompts, params) -> list:
    """Each prompt as its own request after the previous finished (so it can hit what they left)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    return [eng.generate([p], sp)[0] for p, sp in zip(prompts, plist)]


# ---------------------------------------------------------------------------------------------
# 1. shared system prompt: the third request resumes exactly where the shared part ends
# ---------------------------------------------------------------------------------------------
def shared_prompts(shared: int, seed: int, n: int = 3, unique: int = 5) -> list[list[int]]:
    head = random_prompt(shared, VOCAB, seed)
    tails = [random_prompt(unique, VOCAB, seed * 100 + i) for i in range(n)]
    for i, t in enumerate(tails):  # distinct first tokens: the requests diverge exactly at `shared`
        t[0] = (head[-1] + 1 + i) % VOCAB
    return [head + t for t in tails]


def test_shared_prefix_hits_at_every_offset_mod_block_size_and_kpool(pair):
    ckpt, hf = pair
    on, off = make(ckpt), make(ckpt, on=False)
    checked_oracle = 0
    for r in range(BS):                      # shared length 24 + r: the hit at every offset mod 8 (and 4)
        shared = 3 * BS + r
        prompts = shared_prompts(shared, seed=r + 1)
        got = one_by_one(on, prompts, greedy(6))
        ref = one_by_one(off, prompts, greedy(6))
        assert [g.token_ids for g in got] == [x.token_ids for x in ref], f"shared={shared}"
        # request 2 finds no snapshot yet and plants one at the junction; request 3 resumes there
        assert [g.num_cached_tokens for g in got] == [0, 0, shared], f"shared={shared}"
        assert all(x.num_cached_tokens == 0 for x in ref)
        if r in (0, 5):
            assert got[2].token_ids == hf_greedy(hf, prompts[2], 6), f"shared={shared}: transformers"
            checked_oracle += 1
    assert checked_oracle == 2
    assert on.kv.saved_by_kind["junction"] == BS and on.kv.hits_by_kind["junction"] == sum(3 * BS + r for r in range(BS))
    s = on.stats()
    assert s.prefix_cache_hits == on.kv.hits > 0 and s.prefix_cache_queries >= s.prefix_cache_hits
    assert off.stats().prefix_cache_queries == off.stats().prefix_cache_hits == 0
    assert_pools_idle(on)
    assert_pools_idle(off)


def test_mid_block_shared_system_prompt_reuses_90_percent_from_the_third_request(pair):
    ckpt, _ = pair
    shared = 45                                # ends 5 tokens into block 5
    prompts = shared_prompts(shared, seed=77, n=6, unique=7)
    on, off = make(ckpt), make(ckpt, on=False)
    got, ref = one_by_one(on, prompts, greedy(4)), one_by_one(off, prompts, greedy(4))
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    for i, g in enumerate(got[2:], start=3):
        assert g.num_cached_tokens >= 0.9 * shared, f"request {i} reused {g.num_cached_tokens} of {shared}"
    assert_pools_idle(on)


def test_checkpoint_interval_lets_the_second_request_hit(pair):
    ckpt, _ = pair
    shared = 3 * BS + 3
    prompts = shared_prompts(shared, seed=91)
    on = make(ckpt, prefix_cache_checkpoint_interval=1)   # a snapshot at every block boundary of a prefill
    got = one_by_one(on, prompts, greedy(4))
    ref = one_by_one(make(ckpt, on=False), prompts, greedy(4))
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    # the junction lies less than a block past the interval snapshot: not worth a split, so none is planted
    assert [g.num_cached_tokens for g in got] == [0, 3 * BS, 3 * BS]
    assert on.kv.hits_by_kind["interval"] == 2 * 3 * BS and on.kv.saved_by_kind["junction"] == 0
    assert_pools_idle(on)


# ---------------------------------------------------------------------------------------------
# 2. multi-turn chat: a follow-up turn resumes at the end of the previous turn's tokens
# ---------------------------------------------------------------------------------------------
def conversation(eng: LLMEngine, first: list[int], turns: int, params) -> list:
    hist, outs = list(first), []
    for t in range(turns):
        o = eng.generate([hist], params)[0]
        outs.append(o)
        hist = hist + o.token_ids + random_prompt(5 + t, VOCAB, 300 + t)
    return outs


def test_follow_up_turns_reuse_the_previous_prompt_and_answer(pair):
    ckpt, hf = pair
    first = random_prompt(19, VOCAB, 5)
    on, off = make(ckpt), make(ckpt, on=False)
    got, ref = conversation(on, first, 4, greedy(7)), conversation(off, first, 4, greedy(7))
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    for prev, cur in zip(got, got[1:]):
        previous = len(prev.prompt_token_ids) + len(prev.token_ids)
        # the last generated token was never fed to the model: the state ends one before it
        assert cur.num_cached_tokens == previous - 1 and cur.num_cached_tokens >= 0.9 * previous
    assert got[-1].token_ids == hf_greedy(hf, got[-1].prompt_token_ids, 7)
    assert on.kv.hits_by_kind["request_end"] > 0
    assert_pools_idle(on)


def test_a_full_snapshot_pool_keeps_every_conversations_next_turn(pair):
    """Each turn saves a prompt-end and a request-end snapshot; with room for one per conversation plus
    one, the superseded ones (the turn's prompt end, the previous turn's end) must be those evicted."""
    ckpt, _ = pair
    convs = 3
    eng = make(ckpt, snapshots=convs + 1)
    hists = [random_prompt(20 + c, VOCAB, 40 + c) for c in range(convs)]
    for turn in range(3):
        for c in range(convs):            # round robin: every other conversation's snapshots come in between
            out = eng.generate([hists[c]], greedy(5))[0]
            if turn:
                assert out.num_cached_tokens == len(hists[c]) - 7, f"conversation {c} turn {turn} missed"  # 6 new, 1 unfed
            hists[c] = hists[c] + out.token_ids + random_prompt(6, VOCAB, 500 + 10 * turn + c)
    assert eng.kv.saved_by_kind["prompt_end"] == eng.kv.saved_by_kind["request_end"] == 3 * convs
    assert_pools_idle(eng)


def test_seeded_sampling_multi_turn_is_identical_with_and_without_the_cache(pair):
    ckpt, _ = pair
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=6, ignore_eos=True)
    first = random_prompt(30, VOCAB, 8)
    got = conversation(make(ckpt), first, 3, params)
    ref = conversation(make(ckpt, on=False), first, 3, params)
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    assert got[1].num_cached_tokens > 0 and got[2].num_cached_tokens > 0


# ---------------------------------------------------------------------------------------------
# 3. chunked prefill, preemption, speculative decoding, batching
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [3, 5, 11])
def test_chunked_prefill_with_hits_and_junction_splits(pair, budget):
    ckpt, _ = pair
    prompts = shared_prompts(2 * BS + 3, seed=budget, n=4, unique=9)
    on = make(ckpt, max_num_batched_tokens=budget)
    starts: dict[str, list[tuple[int, int]]] = {}
    orig = on.scheduler.schedule

    def schedule():
        out = orig()
        for c in out.chunks:
            starts.setdefault(c.seq.request_id, []).append((c.seq.num_computed_tokens, c.num_tokens))
        return out

    on.scheduler.schedule = schedule
    got = one_by_one(on, prompts, greedy(5))
    ref = one_by_one(make(ckpt, on=False, max_num_batched_tokens=budget), prompts, greedy(5))
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    assert [g.num_cached_tokens for g in got] == [0, 0, 2 * BS + 3, 2 * BS + 3]
    second = starts[got[1].request_id]
    assert any(a + n == 2 * BS + 3 for a, n in second), "the second request's prefill did not stop at the junction"
    assert starts[got[2].request_id][0][0] == 2 * BS + 3, "the third request did not start at its hit"
    assert_pools_idle(on)


def log_admissions(eng: LLMEngine) -> list[tuple[str, int, int]]:
    """(request id, preemptions so far, tokens resumed from the cache) for every admission."""
    log: list[tuple[str, int, int]] = []
    orig = eng.kv.admit

    def admit(seq, match, end):
        log.append((seq.request_id, seq.metrics.num_preemptions, match.num_cached_tokens))
        return orig(seq, match, end)

    eng.kv.admit = admit
    return log


def test_preempted_requests_re_admit_through_the_cache(pair):
    ckpt, _ = pair
    shared = 2 * BS + 5
    prompts = shared_prompts(shared, seed=13, n=5, unique=6)
    params = [greedy(20) if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    small, off = make(ckpt, num_cache_blocks=16, max_num_batched_tokens=64), make(ckpt, on=False)
    one_by_one(small, prompts[:2], greedy(2))   # the second plants the junction snapshot at the shared part's end
    log = log_admissions(small)
    got = small.generate(prompts, params)       # all at once, in a cache too small for all of them
    ref = off.generate(prompts, params)
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    assert small.stats().preempted_total > 0, "the small cache was meant to force preemptions"
    readmissions = [hit for _, preempted, hit in log if preempted]
    assert readmissions and all(hit >= shared for hit in readmissions), log
    assert all(g.num_cached_tokens >= shared for g in got)
    assert_pools_idle(small)


def test_a_preempted_request_resumes_at_its_preemption_point(pair):
    ckpt, _ = pair
    prompt = random_prompt(29, VOCAB, 17)
    eng = make(ckpt)
    log = log_admissions(eng)
    eng.add_request("r", prompt, greedy(12))
    tokens = []
    for step in range(40):
        if step == 6:
            seq = eng.scheduler.running[0]
            at = seq.num_computed_tokens
            eng.scheduler._preempt(seq)          # what the scheduler does under cache pressure
        tokens += [t for o in eng.step() for t in o.token_ids]
        if not eng.has_unfinished():
            break
    assert tokens == make(ckpt, on=False).generate([prompt], greedy(12))[0].token_ids
    assert log == [("r", 0, 0), ("r", 1, at)] and at > len(prompt)
    assert eng.kv.hits_by_kind["preempted"] == at
    assert_pools_idle(eng)


def record_mtp_logits(eng: LLMEngine) -> dict:
    """MTP logits of every one-row MTP call (decode catch-up and draft steps), keyed by (prompt tail, position)."""
    logs: dict = {}
    orig = eng.runner.mtp_forward

    def forward(entries, hidden, want, shared):
        logits, h = orig(entries, hidden, want, shared)
        seq, lo, nxt = entries[0]
        if len(entries) == 1 and len(nxt) == 1 and logits.numel():
            logs[(tuple(seq.prompt_token_ids[-6:]), lo)] = logits.clone()
        return logits, h

    eng.runner.mtp_forward = forward
    return logs


def test_speculative_decoding_with_the_cache_is_exact_and_drafts_the_same(pair):
    """With MTP the MTP layer's own cache rows are part of every block and snapshot, one token ahead
    (its row p reads token p+1). Identical drafts, and MTP logits equal to rounding, prove they are
    restored exactly: treating the rows as depending on their own block only moves the logits by ~0.1."""
    ckpt, _ = pair
    prompts = shared_prompts(3 * BS + 2, seed=21, n=4, unique=6)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)
    results = {}
    for on in (True, False):
        eng = make(ckpt, on=on, num_speculative_tokens=2)
        logits = record_mtp_logits(eng)
        outs = one_by_one(eng, prompts, greedy(9)) + conversation(eng, prompts[0], 3, seeded)
        results[on] = ([o.token_ids for o in outs], [o.num_cached_tokens for o in outs], eng.spec_stats.to_dict(),
                       logits)
        if on:
            assert eng.kv.lookahead == 1
            assert_pools_idle(eng)
    assert results[True][0] == results[False][0]
    assert results[True][2] == results[False][2], "drafts differ: the MTP layer's cached rows are not exact"
    assert sum(results[True][2]["accepted"]) > 0, "no draft accepted: the comparison above would be toothless"
    lon, loff = results[True][3], results[False][3]
    common = set(lon) & set(loff)
    assert len(common) > 20
    worst = max((lon[k] - loff[k]).abs().max().item() for k in common)
    assert worst < 1e-4, f"MTP logits differ by {worst:.2e} with the cache on"
    # the hit stops one token short of the shared part: a cached MTP row needs the token after it
    assert results[True][1][2] == results[True][1][3] == 3 * BS + 1
    assert results[True][1][5] > 0 and results[True][1][6] > 0


def test_stop_inside_accepted_drafts_leaves_an_exact_end_snapshot(pair):
    """A verification step can accept drafts past the output's end (a stop token among them): the
    end-of-request snapshot must hold the state at the last kept token, so the next turn is still exact."""
    ckpt, _ = pair
    first = random_prompt(26, VOCAB, 31)
    # sampled (not greedy): on this random checkpoint rejection sampling accepts most drafts, argmax matching few
    sampling = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    plain = make(ckpt, on=False, num_speculative_tokens=3).generate([first], SamplingParams(**sampling))[0].token_ids
    trimmed = []
    for j in (2, 4, 7, 9):   # stop at the token the plain run produced at position j
        params = SamplingParams(stop_token_ids=[plain[j]], **sampling)
        res = {}
        for on in (True, False):
            eng = make(ckpt, on=on, num_speculative_tokens=3)
            if on:
                orig = eng._trim_to_output
                eng._trim_to_output = lambda *a, orig=orig: trimmed.append(orig(*a)) or trimmed[-1]
            res[on] = [o.token_ids for o in conversation(eng, first, 3, params)]
            if on:
                assert_pools_idle(eng)
        assert res[True] == res[False], f"stop at {j}"
    assert any(n > 0 for n in trimmed), "no verification step accepted rows past the output's end"


def test_batched_requests_sharing_a_prefix_match_running_them_alone(pair):
    ckpt, _ = pair
    prompts = shared_prompts(4 * BS + 1, seed=55, n=6, unique=4)
    on = make(ckpt)
    one_by_one(on, prompts[:2], greedy(3))    # the second leaves the junction snapshot at 33
    together = on.generate(prompts, greedy(6))
    alone = [make(ckpt, on=False).generate([p], greedy(6))[0] for p in prompts]
    assert [g.token_ids for g in together] == [a.token_ids for a in alone]
    assert all(g.num_cached_tokens >= 4 * BS for g in together)
    assert_pools_idle(on)


def test_abort_leaves_a_snapshot_and_frees_everything(pair):
    ckpt, _ = pair
    eng = make(ckpt)
    prompt = random_prompt(30, VOCAB, 61)
    eng.add_request("a", prompt, greedy(50))
    for _ in range(5):
        eng.step()
    assert eng.abort("a")
    eng.step()
    assert eng.kv.saved_by_kind["request_end"] == 1
    follow = eng.generate([prompt + [1, 2, 3]], greedy(3))[0]
    assert follow.num_cached_tokens == len(prompt)
    assert follow.token_ids == make(ckpt, on=False).generate([prompt + [1, 2, 3]], greedy(3))[0].token_ids
    assert_pools_idle(eng)


def test_a_failing_step_frees_finished_requests_without_snapshotting_them(pair):
    ckpt, _ = pair
    eng = make(ckpt)
    eng.add_request("x", random_prompt(20, VOCAB, 81), greedy(1))   # finishes in its first step

    def broken(seq):
        raise RuntimeError("boom")

    eng.kv.after_step = broken
    outs = eng.step()      # the engine isolates a failing step (only unfinished requests are re-run)
    assert [o.finished for o in outs if o.request_id == "x"] == [True]
    assert eng.kv.saved_by_kind["request_end"] == 0 and eng.kv.snapshots.num_saved == 0
    assert eng.kv.blocks.num_used == 0 and eng.kv.slots.num_free == eng.kv.slots.capacity


def test_a_one_snapshot_pool_stays_correct_under_eviction(pair):
    ckpt, _ = pair
    prompts = shared_prompts(2 * BS + 6, seed=71, n=4) + shared_prompts(3 * BS + 1, seed=72, n=4)
    on = make(ckpt, snapshots=1)
    got = one_by_one(on, prompts, greedy(4))
    ref = one_by_one(make(ckpt, on=False), prompts, greedy(4))
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    assert on.kv.snapshots.num_saved == 1
    assert_pools_idle(on)


def test_snapshot_budget_below_one_snapshot_is_a_clear_error(pair):
    ckpt, _ = pair
    with pytest.raises(ValueError, match="prefix_cache_snapshot_memory_gb=.* holds no state snapshot"):
        engine(ckpt, block_size=BS, prefix_cache_snapshot_memory_gb=1e-9)


# ---------------------------------------------------------------------------------------------
# 4. images: media content is part of the keys
# ---------------------------------------------------------------------------------------------
def test_image_prefix_hits_only_for_the_same_image(pair):
    from test_engine_oracle_more import MMPrompts, mm_request

    ckpt, hf = pair
    b = MMPrompts(ckpt, hf)
    img, other = b.image(56, 56, seed=1), b.image(56, 56, seed=2)   # same size: same placeholder ids
    head = b.text(5, 1)
    image_part = b.image_tokens(img[1])
    shared = len(head) + len(image_part) + 4
    tail = b.text(4, 2)

    def req(image, seed: int):
        return mm_request(head + image_part + tail + b.text(6, seed), images=[image])

    reqs = [req(img, 10), req(img, 11), req(img, 12), req(other, 13)]
    on, off = make(ckpt), make(ckpt, on=False)
    got = one_by_one(on, [p for p, _ in reqs], greedy(5))
    ref = one_by_one(off, [p for p, _ in reqs], greedy(5))
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    assert got[2].num_cached_tokens == shared, "the third request with the same image resumes past it"
    assert got[3].num_cached_tokens < len(head) + 1, "a different image must not hit past its first placeholder"
    p, kw = reqs[2]
    assert got[2].token_ids == hf_greedy(hf, p.mm_inputs["input_ids"].tolist(), 5, **kw)
    assert_pools_idle(on)


def test_video_prefix_hits_only_for_the_same_video(pair):
    from test_engine_oracle_more import MMPrompts, mm_request

    ckpt, hf = pair
    b = MMPrompts(ckpt, hf)
    vid, other = b.video(2, 4, 4, seed=3), b.video(2, 4, 4, seed=4)   # same grid: same placeholder ids
    head, video_part, tail = b.text(4, 1), b.video_tokens(vid[1]), b.text(3, 2)
    shared = len(head) + len(video_part) + len(tail)
    reqs = [mm_request(head + video_part + tail + b.text(5, 20 + i), video=v)
            for i, v in enumerate([vid, vid, vid, other])]
    got = one_by_one(make(ckpt), [p for p, _ in reqs], greedy(4))
    ref = one_by_one(make(ckpt, on=False), [p for p, _ in reqs], greedy(4))
    assert [g.token_ids for g in got] == [x.token_ids for x in ref]
    assert got[2].num_cached_tokens == shared
    first_placeholder = head + video_part
    assert got[3].num_cached_tokens <= first_placeholder.index(b.ids["<|image|>"])
    p, kw = reqs[2]
    assert got[2].token_ids == hf_greedy(hf, p.mm_inputs["input_ids"].tolist(), 4, **kw)


def test_prompt_input_text_and_cache_off_by_argument(pair):
    ckpt, _ = pair
    eng = make(ckpt, on=False)
    assert eng.kv.snapshots is None and not eng.kv.enabled
    out = eng.generate([PromptInput(token_ids=random_prompt(12, VOCAB, 1))] * 3, greedy(2))
    assert all(o.num_cached_tokens == 0 for o in out)
