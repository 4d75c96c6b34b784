"""Speculative decoding on the batched, sync-free path (the one CUDA graphs capture), on the CPU.

* greedy with k = 1, 2, 3 gives k = 0's tokens, and transformers' — with drafts forced to every acceptance
  length (the tiny checkpoint's MTP layer is random, so its own drafts are almost never accepted);
* the commit after verification leaves exactly the cache a plain decode of the accepted tokens leaves:
  KDA conv and recurrent states, kpool tails (pool boundaries crossed by accepted and by rejected rows);
* the batched MTP proposal drafts what the per-request one drafts;
* seeded sampling is reproducible across batch compositions and orders;
* the rollback scheme's memory at the real shape fits the budget for batch 64 with k = 3.
"""

from __future__ import annotations

import pytest
import torch

from glm5.config import ModelConfig
from glm5.engine.spec_batched import BatchedSpeculation, MTPBacklog, take_backlogs
from glm5.layers.batch import HostCopy
from glm5.layers.speculative import kda_state_bytes, per_row_state_bytes, verify_buffer_bytes
from glm5.sampler import bad_word_token_ids
from glm5.sampling_params import SamplingParams
from oracle import ScriptedK, engine, greedy, hf_greedy, make_pair, random_prompt

VOCAB = 600


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # kpool 4, topk 16: positions past 18 select sparsely; 8 layers (5 KDA, 3 MLA), 1 MTP layer
    return make_pair(tmp_path_factory.mktemp("specb"), seed=31)


def _force_drafts(monkeypatch, ref: dict[str, list[int]], pattern):
    """After every proposal, replace each request's drafts by its reference continuation with the first
    ``pattern(request, step)`` drafts right and the next one wrong (so that many are accepted)."""
    orig = BatchedSpeculation.propose
    calls = {"n": 0}

    def propose(self, live, res, ensure_blocks, **kw):
        orig(self, live, res, ensure_blocks, **kw)
        calls["n"] += 1
        forced = []
        for _, seq, want in live:
            cont = ref[seq.request_id][len(seq.output_token_ids):]
            right = min(pattern(seq.request_id, calls["n"]), want, len(cont))
            drafts = cont[:right] + [(t + 1) % VOCAB for t in cont[right:want]]
            forced.append(drafts[:want])
        width = max(map(len, forced), default=0)
        # odd rounds: one batched proposal the verification reads on the device (as propose leaves it);
        # even rounds: host lists (as a mixed step's per-request proposal leaves them)
        batched = HostCopy(torch.tensor([d + [VOCAB - 1] * (width - len(d)) for d in forced]))
        for row, ((_, seq, _), drafts) in enumerate(zip(live, forced)):
            if calls["n"] % 2:
                seq.set_pending_drafts(batched, row, len(drafts))
            else:
                seq.draft_tokens = drafts
    monkeypatch.setattr(BatchedSpeculation, "propose", propose)
    return calls


def test_greedy_k123_equals_k0_and_transformers_at_every_acceptance_length(pair, monkeypatch):
    ckpt, hf = pair
    prompts = [random_prompt(n, VOCAB, seed=500 + n) for n in (1, 6, 19, 22, 41)]
    n_new = 14
    ref = [o.token_ids for o in engine(ckpt, decode_path="batched").generate(prompts, greedy(n_new))]
    for p, r in zip(prompts[1::2], ref[1::2]):
        assert hf_greedy(hf, p, n_new) == r
    for k in (1, 2, 3):
        eng = engine(ckpt, decode_path="batched", num_speculative_tokens=k)
        assert eng.spec is not None
        by_id = {f"gen-{i}": r for i, r in enumerate(ref)}  # generate() names requests gen-0, gen-1, ...
        calls = _force_drafts(monkeypatch, by_id, lambda rid, step: (int(rid.split("-")[1]) + step) % (k + 1))
        out = [o.token_ids for o in eng.generate(prompts, greedy(n_new))]
        assert out == ref, f"k={k}"
        stats = eng.spec_stats
        assert calls["n"] > 0 and stats.steps > 0
        assert 0 < sum(stats.accepted) < sum(stats.proposed), stats.to_dict()  # full, partial and no acceptance
        assert eng.blocks.num_used == 0 and eng.slots.num_free == eng.slots.capacity
        monkeypatch.undo()


def _state(eng, seq) -> dict[str, torch.Tensor]:
    c, s = eng.runner.cache, seq.state_slot
    out = {f"conv{i}": c.conv[i][s].clone() for i in c.conv}
    out |= {f"rec{i}": c.recurrent[i][s].clone() for i in c.recurrent}
    kp = c.kpool
    fill = seq.num_computed_tokens % kp  # tail rows beyond the pool's fill are never read
    out |= {f"tail{i}": c.tail[i][s][:fill].clone() for i in eng.model_config.text.mla_layer_ids}
    return out


@pytest.mark.parametrize("prompt_len", [21, 30])
def test_commit_equals_plain_decode_of_the_accepted_tokens(pair, prompt_len):
    """One verification step with a chosen number of right drafts: tokens, and every KDA state and kpool tail
    afterwards, equal those of decoding the accepted tokens one by one (pool boundaries inside the rows)."""
    ckpt, _ = pair
    k = 3
    prompts = [random_prompt(prompt_len, VOCAB, seed=9), random_prompt(prompt_len + 2, VOCAB, seed=10)]
    ref_eng = engine(ckpt, decode_path="batched")
    ref = [o.token_ids for o in ref_eng.generate(prompts, greedy(8))]
    for accepted in range(k + 1):
        eng = engine(ckpt, decode_path="batched", num_speculative_tokens=k)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, greedy(8))
        eng.step()  # prefill (per-request path) + first drafts
        seqs = [eng.scheduler.find(f"r{i}") for i in range(2)]
        for i, s in enumerate(seqs):  # request 1 accepts one fewer (one more rejected row)
            a = max(accepted - i, 0)
            cont = ref[i][1:]
            s.draft_tokens = cont[:a] + [(t + 1) % VOCAB for t in cont[a:k]]
        outs = {o.request_id: o.token_ids for o in eng.step()}
        assert eng.spec_stats.steps == 2
        for i, s in enumerate(seqs):
            a = max(accepted - i, 0)
            assert outs[f"r{i}"] == ref[i][1: a + 2], (accepted, i)
            plain = engine(ckpt, decode_path="batched")
            plain.add_request(f"r{i}", prompts[i], greedy(8))
            other = plain.scheduler.waiting[0]
            while other.num_computed_tokens < s.num_computed_tokens:
                plain.step()
            assert other.num_computed_tokens == s.num_computed_tokens
            got, want = _state(eng, s), _state(plain, other)
            for name in want:
                err = (got[name] - want[name]).abs().max().item() if want[name].numel() else 0.0
                assert torch.allclose(got[name], want[name], atol=2e-5, rtol=1e-4), (accepted, i, name, err)


def test_batched_proposal_drafts_what_the_per_request_path_drafts(pair, monkeypatch):
    ckpt, _ = pair
    prompts = [random_prompt(n, VOCAB, seed=70 + n) for n in (3, 33, 45)]
    seen: dict[str, dict[str, list]] = {}
    from glm5.engine import llm_engine

    def recorder(path):
        def record(self, *a, **kw):
            out = orig_step(self, *a, **kw)
            for seq in list(self.scheduler.running):
                seen[path].setdefault(seq.request_id, []).append((seq.num_computed_tokens, list(seq.draft_tokens)))
            return out
        return record
    orig_step = llm_engine.LLMEngine.step
    for path in ("batched", "per_request"):
        seen[path] = {}
        monkeypatch.setattr(llm_engine.LLMEngine, "step", recorder(path))
        engine(ckpt, decode_path=path, num_speculative_tokens=3).generate(prompts, greedy(10))
        monkeypatch.undo()
    assert seen["batched"] and seen["batched"] == seen["per_request"]


def test_seeded_sampling_reproducible_across_batch_compositions(pair, monkeypatch):
    ckpt, _ = pair
    prompts = [random_prompt(n, VOCAB, seed=300 + n) for n in (4, 20, 35, 9)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    # drafts from the model's own proposal (distributions q included); some are accepted at this temperature
    alone = [engine(ckpt, decode_path="batched", num_speculative_tokens=2).generate([p], [q])[0].token_ids
             for p, q in zip(prompts[:2], params[:2])]
    eng = engine(ckpt, decode_path="batched", num_speculative_tokens=2)
    together = [o.token_ids for o in eng.generate(prompts, params)]
    eng2 = engine(ckpt, decode_path="batched", num_speculative_tokens=2, max_num_seqs=2)
    reordered = [o.token_ids for o in eng2.generate(prompts[::-1], params[::-1])][::-1]
    assert together[:2] == alone and reordered == together
    assert eng.spec_stats.steps > 0
    # another seed gives other tokens (the streams do follow the seed)
    other = SamplingParams(temperature=0.8, top_p=0.9, seed=999, max_tokens=12, ignore_eos=True)
    assert engine(ckpt, decode_path="batched", num_speculative_tokens=2).generate([prompts[0]], [other])[0].token_ids \
        != alone[0]


def test_rollback_memory_fits_batch64_k3_at_the_real_shape(real_config_path):
    """The verify buffers (this scheme) at GLM-5.3-Flash's shape for 64 requests with k = 3 stay under 10 % of
    the KDA state those requests hold anyway; keeping every verified row's state would not fit."""
    cfg = ModelConfig.from_pretrained(str(real_config_path)).text
    budget = 0.10 * kda_state_bytes(cfg, 64)
    ours = verify_buffer_bytes(cfg, 64, 3)
    assert ours <= budget, (ours / 2**20, budget / 2**20)
    assert per_row_state_bytes(cfg, 64, 3) > 10 * budget  # 34 layers x 4 rows x 4 MiB per request
    # per request: (3D + D + H) per KDA layer and row + 2 index dims per MLA layer and row, bf16; plus the tails
    d = 64 * 128
    per_request = (34 * (4 * d + 64) + 11 * 256) * 4 * 2 + 11 * 4 * 256 * 2
    assert verify_buffer_bytes(cfg, 1, 3) == per_request
    assert abs(verify_buffer_bytes(cfg, 1, 3) / 2**20 - 8.5) < 0.2  # ~8.5 MiB per request


class _ReplayByRerun:
    """Stands in for a CUDA graph on the CPU: replay re-runs the captured function and writes its results into
    the tensors capture returned — what a replay does — so a pass that read anything but the fixed input
    buffers, or handed out anything but the fixed outputs, gives different tokens than eager."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        _copy_into(self.out, self.fn())


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif dst is not None and hasattr(dst, "__dataclass_fields__"):
        for name in dst.__dataclass_fields__:
            _copy_into(getattr(dst, name), getattr(src, name))


def _simulate_graphs(monkeypatch) -> None:
    """SpecGraphs captures on the CPU: each pass becomes a :class:`_ReplayByRerun` (``.key``: its graph key)."""
    import contextlib

    from glm5.engine import spec_forwards

    class _Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def capture(self, key, fn, stream):
        out = fn()
        graph = _ReplayByRerun(fn, out)
        graph.key = key
        self.graphs[key] = (graph, out)
    monkeypatch.setattr(spec_forwards.SpecGraphs, "_capture", capture)


def test_graph_shaped_replay_equals_eager_on_cpu(pair, monkeypatch):
    """The captured-graph dispatch of speculative steps (glm5.engine.spec_forwards.SpecGraphs) with replays
    simulated by re-running the captured passes: same tokens and acceptance as the eager passes."""
    _simulate_graphs(monkeypatch)
    ckpt, _ = pair
    prompts = [random_prompt(n, VOCAB, seed=900 + n) for n in (2, 23, 37)]
    ref = [o.token_ids for o in engine(ckpt, decode_path="batched").generate(prompts, greedy(12))]
    by_id = {f"gen-{i}": r for i, r in enumerate(ref)}
    replays = []
    orig = _ReplayByRerun.replay
    monkeypatch.setattr(_ReplayByRerun, "replay", lambda self: (replays.append(1), orig(self)))
    _force_drafts(monkeypatch, by_id, lambda rid, step: (int(rid.split("-")[1]) + step) % 4)
    results = {}
    for graphs in (False, True):
        eng = engine(ckpt, decode_path="batched", num_speculative_tokens=3, max_num_seqs=4)
        if graphs:
            eng.spec.capture_cuda_graphs(4)
            assert {k[0] for k in eng.spec.fwd.graphs} == {"verify", "commit", "catchup", "draft", "drain"}
        replays.clear()
        results[graphs] = ([o.token_ids for o in eng.generate(prompts, greedy(12))], eng.spec_stats.to_dict())
        assert bool(replays) == graphs
    assert results[True] == results[False] and results[True][0] == ref


def test_backlog_drains_replay_their_graphs_and_draft_as_eager_on_cpu(pair, monkeypatch):
    """k = 0 at 40 of every 41 choices, k = 3 at the 41st, twice: the held-back rows go through DRAIN_ROWS-row drain
    passes before the drafting catch-up; graph-simulated and eager engines give the same tokens, drafts and
    acceptance, the drain graphs are replayed, and the tokens are k = 0's."""
    from glm5.engine.spec_batched import DRAIN_ROWS, MAX_BACKLOG

    _simulate_graphs(monkeypatch)
    ckpt, _ = pair
    prompts = [random_prompt(n, VOCAB, seed=700 + n) for n in (3, 20, 31)]
    n_new = 90
    ref = [o.token_ids for o in engine(ckpt, decode_path="batched").generate(prompts, greedy(n_new))]
    replays: list[tuple] = []
    orig = _ReplayByRerun.replay
    monkeypatch.setattr(_ReplayByRerun, "replay", lambda self: (replays.append(self.key), orig(self)))
    assert DRAIN_ROWS < 40 - 3 < MAX_BACKLOG   # 41 rows at the catch-up, 4 kept for it: two drain passes
    runs = {}
    for graphs in (False, True):
        eng = engine(ckpt, decode_path="batched", num_speculative_tokens=3, max_num_seqs=4)
        eng.k_policy = ScriptedK([0] * 40 + [3])
        if graphs:
            eng.spec.capture_cuda_graphs(4)
        drafts: list[list[int]] = []
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, greedy(n_new))
        outs: dict[str, list[int]] = {}
        replays.clear()
        while eng.has_unfinished():
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
            drafts += [list(s.draft_tokens) for s in eng.scheduler.running if s.draft_tokens]
        runs[graphs] = ([outs[f"r{i}"] for i in range(3)], drafts, eng.spec_stats.to_dict(),
                        [k for k in replays if k[0] == "drain"])
    assert runs[True][0] == runs[False][0] == ref
    assert runs[True][1] == runs[False][1] and runs[True][2] == runs[False][2]
    assert runs[True][2]["steps"] > 0 and len(runs[True][1]) >= 2
    assert len(runs[True][3]) >= 4 and all(k[2] == DRAIN_ROWS for k in runs[True][3])   # two rounds x 2 passes
    assert not runs[False][3]


@pytest.mark.parametrize("word_tokens", [1, 2])
@pytest.mark.parametrize("decode_path", ["batched", "per_request"])
def test_bad_words_hold_in_verified_and_plain_rows(pair, monkeypatch, decode_path, word_tokens):
    """``bad_words`` with MTP speculation on: k = 3 gives k = 0's tokens under the same bad words, in a batch of a
    request with bad words (it drafts; each verification row bans the words against its output plus the drafts
    before it), one with logprobs (no drafts: the plain sampler of a verification step) and a plain one; and with
    the policy at k = 0 (the whole step on the plain sampler). Batched path: the drafts are forced from the
    reference, so most are accepted and a verification row decides the first token the ban changes. The word is
    one token of the free output (banned anywhere), or two consecutive ones (the second banned after the first,
    which a verification row may have seen as a draft)."""
    import glm5.engine.llm_engine as llm_engine

    ckpt, _ = pair
    prompts = [random_prompt(n, VOCAB, seed=700 + n) for n in (5, 17, 23)]
    n_new = 16
    base = engine(ckpt, decode_path=decode_path)
    free = base.generate(prompts[:1], greedy(n_new))[0].token_ids
    if word_tokens == 1:   # a word one of whose tokenizations is a single token of the free output past its start
        word = next(w for t in free[4:] if (w := base.tokenizer.decode([t]).strip()) and w.isalpha()
                    and [t] in bad_word_token_ids(base.tokenizer, [w]))
        banned = bad_word_token_ids(base.tokenizer, [word])
    else:                  # the engine's tokenization of the word replaced by two tokens of the free output
        word, banned = "pair", [free[6:8]]

    def ban() -> None:
        if word_tokens == 2:
            monkeypatch.setattr(llm_engine, "bad_word_token_ids", lambda tok, words: banned if words == [word] else [])
    ban()
    params = [SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, bad_words=[word]),
              SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, logprobs=1), greedy(n_new)]
    ref = [o.token_ids for o in engine(ckpt, decode_path=decode_path).generate(prompts, params)]
    assert ref[0] != free
    assert not any(ref[0][i:i + len(ids)] == ids for ids in banned for i in range(len(ref[0])))
    for k_policy in ("k3", "k0"):
        ban()
        eng = engine(ckpt, decode_path=decode_path, num_speculative_tokens=3)
        if k_policy == "k0":
            eng.k_policy = ScriptedK([0])
        elif decode_path == "batched":
            by_id = {f"gen-{i}": r for i, r in enumerate(ref)}
            _force_drafts(monkeypatch, by_id, lambda rid, step: 3 if rid == "gen-0" else step % 4)
        wanted: dict[str, int] = {}   # drafts asked per request over the run
        ask = eng._num_drafts
        eng._num_drafts = lambda seq: wanted.__setitem__(seq.request_id, wanted.get(seq.request_id, 0) + (
            n := ask(seq))) or n
        out = eng.generate(prompts, params)
        assert [o.token_ids for o in out] == ref, k_policy
        assert len(out[1].logprobs) == n_new
        if k_policy == "k3":   # the bad-words request drafts, the logprobs one does not
            assert wanted["gen-0"] > 0 and wanted["gen-1"] == 0 and eng.spec_stats.steps > 0
            if decode_path == "batched":
                assert eng.spec_stats.accepted[2] > 0
        else:
            assert eng.spec_stats.steps == 0
        monkeypatch.undo()


@pytest.mark.parametrize("decode_path", ["batched", "per_request"])
@pytest.mark.parametrize("pays_for, holds", [(0, False), (12, False), (0, True)])
def test_mtp_stops_following_where_speculation_cannot_pay(pair, monkeypatch, decode_path, pays_for, holds):
    """A policy that says no k > 0 can pay (after ``pays_for`` decode steps that held rows back). ``holds``
    False: no backlog is carried from then on - the MTP layer stops following every request at the next k = 0
    step, well before a backlog would fill. ``holds`` True (speculation ran lately): the rows wait until the
    backlog is full, which is then dropped. Either way no drain and no MTP pass after the prompts, the requests
    draft nothing even when the policy asks for k = 3, and the tokens are k = 0's. Once the MTP layer follows
    nobody, every step is the plain engine's: no batched verification, no per-request rows for a proposal."""
    from glm5.engine.model_runner import ModelRunner
    from glm5.engine.spec_batched import MAX_BACKLOG, BatchedSpeculation
    from glm5.engine.spec_forwards import SpecForwards
    from glm5.layers.mtp import MTPLayer

    ckpt, _ = pair
    prompts = [random_prompt(n, VOCAB, seed=900 + n) for n in (4, 19)]
    n_new = MAX_BACKLOG + 16
    ref = [o.token_ids for o in engine(ckpt, decode_path=decode_path).generate(prompts, greedy(n_new))]
    eng = engine(ckpt, decode_path=decode_path, num_speculative_tokens=3, max_num_seqs=4)
    eng.k_policy = ScriptedK([0] * (MAX_BACKLOG + 4) + [3], pays=pays_for > 0, holds=holds or pays_for > 0)
    mtp_rows, drains = [], []
    orig_fwd, orig_drain = MTPLayer.forward, SpecForwards.mtp_drain
    monkeypatch.setattr(MTPLayer, "forward", lambda self, b, h, c: (mtp_rows.append(h.shape[0]), orig_fwd(self, b, h, c))[1])
    monkeypatch.setattr(SpecForwards, "mtp_drain", lambda self, *a: (drains.append(1), orig_drain(self, *a))[1])
    paths = []   # per step: "verify" (the batched speculative path) or the plain path's mtp_rows
    orig_exec, orig_verify = ModelRunner.execute, BatchedSpeculation.verify
    monkeypatch.setattr(ModelRunner, "execute",
                        lambda self, sched, mtp_rows=True: (paths.append(mtp_rows), orig_exec(self, sched, mtp_rows))[1])
    monkeypatch.setattr(BatchedSpeculation, "verify",
                        lambda self, sched: (paths.append("verify"), orig_verify(self, sched))[1])
    proposals = []   # per step that asked the MTP layer for a proposal: the number of steps before it
    orig_propose = eng._propose
    eng._propose = lambda *a: (proposals.append(len(paths)), orig_propose(*a))[1]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(n_new))
    outs: dict[str, list[int]] = {}
    off_at, decode_steps, held = None, 0, 0
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        running = eng.scheduler.running
        if running and all(len(s.output_token_ids) > 1 for s in running):   # a step that decoded everyone
            decode_steps += 1
            if decode_steps == pays_for:
                held = min(len(s.mtp_backlog) for s in running)
                eng.k_policy.pays = eng.k_policy.holds = False
            elif decode_steps > pays_for and not holds:   # the first k = 0 step told not to hold drops
                assert all(s.mtp_off and s.mtp_backlog is None for s in running)
            elif holds and decode_steps < MAX_BACKLOG - 20:   # rows wait until the backlog is full
                assert not any(s.mtp_off for s in running) and all(s.mtp_backlog for s in running)
        if off_at is None and running and all(s.mtp_off for s in running):
            off_at = len(mtp_rows)
            probes_from, plain_from = len(eng.k_policy.may_probe), len(paths)
        assert not any(s.draft_tokens for s in running if s.mtp_off)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == ref
    # no probe is allowed once the MTP layer follows nobody (it could verify nothing)
    assert any(eng.k_policy.may_probe) and not any(eng.k_policy.may_probe[probes_from:])
    if pays_for:
        assert 0 < held < MAX_BACKLOG   # the rows were held back while speculation could pay
    st = eng.spec_stats.to_dict()
    assert st["mtp_dropped"] == len(prompts) and st["steps"] == 0   # nobody drafted, even at the k = 3 choice
    assert not drains and off_at is not None and len(mtp_rows) == off_at   # no MTP pass after the drop
    assert all(n > 1 for n in mtp_rows)    # the only MTP passes were the prompts' (and the per-request path's
    #                                        clones keep no backlog rows past the drop)
    assert len(paths) > plain_from and not any(paths[plain_from:])   # plain steps, no rows listed for the MTP layer
    assert proposals and max(proposals) <= plain_from   # ... and no proposal asked for
    assert ("verify" if decode_path == "batched" else True) in paths[:plain_from]   # (unlike before the drop)


def test_backlog_keeps_its_row_count_and_order():
    """The backlog's length is kept as rows arrive (asked of every request on every k = 0 step), and ``take``
    returns the rows in arrival order followed by the extra ones."""
    rows = [torch.full((n, 3), float(i)) for i, n in enumerate((1, 2, 1))]
    b = MTPBacklog(7, rows[:1])
    assert len(b) == 1 and b.first_position == 7
    for r in rows[1:]:
        b.append(r)
    assert len(b) == 4 == sum(n for _, _, n in b.pieces)
    got = b.take(torch.full((2, 3), 9.0))
    assert got[:, 0].tolist() == [0.0, 1.0, 1.0, 2.0, 9.0, 9.0]
    assert len(MTPBacklog(0, [torch.zeros(5, 3), torch.zeros(2, 3)])) == 7


def test_backlogs_hold_references_into_step_outputs_and_are_gathered_together():
    """k = 0 steps add (step tensor, row, count) references; take_backlogs returns each request's rows in
    order from one gather over the distinct step tensors, with the extra rows appended."""
    steps = [torch.arange(3 * 4, dtype=torch.float32).view(3, 4) + 100 * s for s in range(3)]
    a, b = MTPBacklog(10), MTPBacklog(20)
    for h in steps:
        a.append(h, 0, 1)
        b.append(h, 2, 1)
    b.append(steps[2], 1, 2)          # a verification step's emitted rows (two of them)
    assert (len(a), len(b)) == (3, 5)
    got_a, got_b = take_backlogs([a, b], [None, torch.full((1, 4), -1.0)])
    assert torch.equal(got_a, torch.stack([h[0] for h in steps]))
    assert torch.equal(got_b, torch.cat([torch.stack([h[2] for h in steps]), steps[2][1:3], torch.full((1, 4), -1.0)]))
    assert torch.equal(a.take(), got_a)
    extra = torch.ones(2, 4)
    assert torch.equal(MTPBacklog(3).take(extra), extra)          # nothing held: the extra rows alone
    with pytest.raises(ValueError, match="no rows"):
        MTPBacklog(3).take()


def test_speculative_steps_copy_host_lists_without_blocking(pair, monkeypatch):
    """The batched speculative step and the sampler's penalties hand host lists to the device through
    ``host_to_device`` (pinned memory, an asynchronous copy), never ``torch.tensor(list, device=...)``: on CUDA that
    copy waits for every queued kernel, and eight of them per round kept the GPU waiting on the host (a k = 3
    round at batch 1 took 8.9 ms with them and 6.9 ms without on the H200, bench/results/limits.md)."""
    import sys

    from glm5.layers.batch import host_to_device

    ckpt, _ = pair
    watched = ("spec_batched.py", "sampler.py")
    blocking, real_tensor = [], torch.tensor

    def tensor(*args, **kw):
        caller = sys._getframe(1).f_code.co_filename
        if kw.get("device") is not None and caller.endswith(watched):
            blocking.append(f"{caller}:{sys._getframe(1).f_lineno}")
        return real_tensor(*args, **kw)

    prompts = [random_prompt(n, VOCAB, seed=700 + n) for n in (5, 23, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={7: 3.0}),
              SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True,
                             repetition_penalty=1.2, presence_penalty=0.3),
              SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True, frequency_penalty=0.2,
                             top_k=50, top_p=0.9, min_p=0.01, allowed_token_ids=list(range(0, VOCAB, 2)))]
    eng = engine(ckpt, decode_path="batched", num_speculative_tokens=3)
    monkeypatch.setattr(torch, "tensor", tensor)
    out = eng.generate(prompts, params)
    monkeypatch.undo()
    assert eng.spec_stats.steps > 0 and all(len(o.token_ids) == 10 for o in out)
    assert not blocking, blocking
    # the helper itself: values and dtype as torch.tensor gives them, a CPU tensor passed through with its dtype
    assert torch.equal(host_to_device([3, 1, 2], "cpu"), torch.tensor([3, 1, 2]))
    assert host_to_device([0.5], "cpu", torch.float32).dtype == torch.float32
    assert host_to_device(torch.arange(3, dtype=torch.int32), "cpu").dtype == torch.int32


def test_verification_reads_the_drafts_on_the_device_without_waiting_for_them(pair, monkeypatch):
    """A decode round's drafts stay on the device: the next verification is staged and launched before the
    host reads them (``HostCopy.tolist`` waits for the draft passes on CUDA), and gives the tokens that host
    drafts give (greedy k = 3 equals k = 0 with the MTP layer's own drafts)."""
    from glm5.engine.spec_forwards import SpecForwards

    ckpt, _ = pair
    prompts = [random_prompt(n, VOCAB, seed=800 + n) for n in (4, 21, 33)]
    ref = [o.token_ids for o in engine(ckpt, decode_path="batched").generate(prompts, greedy(12))]
    # ("round", the proposal's HostCopy or None) / ("launch", drafts on the device) / ("read", HostCopy): the
    # copies themselves, not their ids (a freed copy's id is reused by a later one)
    events = []
    orig_verify, orig_tolist = BatchedSpeculation.verify, HostCopy.tolist
    orig_fwd = SpecForwards.verify

    def verify(self, sched):
        pending = sched.chunks[0].seq.pending_drafts
        events.append(("round", pending[0] if pending else None))
        return orig_verify(self, sched)

    def fwd_verify(self, rows, t, padded, drafts=None):
        events.append(("launch", drafts is not None))
        return orig_fwd(self, rows, t, padded, drafts)

    def tolist(self):
        events.append(("read", self))
        return orig_tolist(self)

    monkeypatch.setattr(BatchedSpeculation, "verify", verify)
    monkeypatch.setattr(SpecForwards, "verify", fwd_verify)
    monkeypatch.setattr(HostCopy, "tolist", tolist)
    eng = engine(ckpt, decode_path="batched", num_speculative_tokens=3)
    assert [o.token_ids for o in eng.generate(prompts, greedy(12))] == ref
    rounds = [i for i, e in enumerate(events) if e[0] == "round" and e[1] is not None]
    assert len(rounds) >= 3, events
    for i in rounds:   # the proposal's copy is read only after the verification that uses it was launched
        launch = events.index(("launch", True), i)
        first_read = min((j for j, e in enumerate(events) if e[0] == "read" and e[1] is events[i][1]),
                         default=len(events))
        assert launch < first_read, events


@pytest.mark.parametrize("decode_path", ["batched", "per_request"])
def test_requests_re_run_after_a_failed_step_leave_their_mtp_history_behind(pair, decode_path):
    """Requests holding MTP backlogs when a step fails are evicted and re-run from their tokens (the failing
    request is isolated by bisection, glm5.engine.llm_engine): their backlogs and dropped-MTP marks go with
    their caches, so their recomputed prompts do not take stale rows along, and they finish with k = 0's tokens."""
    ckpt, _ = pair
    poison = 11
    prompts = [[t for t in random_prompt(5 + 3 * i, VOCAB, seed=700 + i) if t != poison] for i in range(3)]
    n_new = 12
    ref = [o.token_ids for o in engine(ckpt, decode_path=decode_path).generate(prompts, greedy(n_new))]
    eng = engine(ckpt, decode_path=decode_path, num_speculative_tokens=3, max_num_seqs=8,
                 test_faults={"request_error_token_id": poison})
    eng.k_policy = ScriptedK([0], pays=True)   # nobody drafts: every decoding request holds a backlog
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(n_new))
    outs: dict[str, list] = {}
    for _ in range(4):
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert all(s.mtp_backlog is not None for s in eng.scheduler.running)
    eng.scheduler.running[-1].mtp_off = True   # one the MTP layer no longer follows
    re_run = []
    trial = eng._trial

    def spy(part, outputs):   # what the bisection re-runs: evicted requests, their caches freed
        re_run.extend((s.request_id, s.mtp_backlog, s.mtp_off) for s in part)
        return trial(part, outputs)
    eng._trial = spy
    eng.add_request("poison", [3, poison, 4], greedy(n_new))
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["poison"][-1].finish_reason == "error" and eng.stats().failed_total == 1
    assert {r for r, *_ in re_run} >= {f"r{i}" for i in range(len(prompts))}
    assert all(b is None and not off for _, b, off in re_run), re_run
    for i in range(len(prompts)):
        o = outs[f"r{i}"]
        assert o[-1].finish_reason == "length" and o[-1].error is None, (i, o[-1].error)
        assert [t for x in o for t in x.token_ids] == ref[i], i
