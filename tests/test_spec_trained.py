"""Speculation on the trained tiny checkpoint, whose MTP layer is trained against the target: drafts are
accepted, outputs stay k = 0's, and a reduced draft vocabulary only drafts inside its set (cheaper draft
steps, fewer accepted drafts, same tokens). Plus the draft-vocabulary file's checks."""

from __future__ import annotations

import json

import pytest
import torch

from glm5 import trained_tiny_checkpoint as trained_tiny
from glm5.engine import EngineArgs, LLMEngine
from glm5.engine.draft_vocab import frequent_tokens, load_draft_vocab, save_draft_vocab
from glm5.sampling_params import SamplingParams


def _engine(ckpt, **kw) -> LLMEngine:
    args = dict(model=str(ckpt), device="cpu", dtype="float32", block_size=16, num_cache_blocks=256, max_num_seqs=16,
                max_num_batched_tokens=512, load_progress=False, decode_path="batched")
    return LLMEngine(EngineArgs(**(args | kw)))


@pytest.fixture(scope="module")
def corpus_prompts(trained_checkpoint):
    vocab = int(json.loads((trained_checkpoint / "config.json").read_text())["text_config"]["vocab_size"])
    return trained_tiny.agreement_prompts(vocab)[:10]  # the corpus windows: the checkpoint's own distribution


@pytest.fixture(scope="module")
def plain_tokens(trained_checkpoint, corpus_prompts):
    return [o.token_ids for o in _engine(trained_checkpoint).generate(corpus_prompts, _greedy())]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_trained_mtp_drafts_are_accepted_and_outputs_stay_exact(trained_checkpoint, corpus_prompts, plain_tokens):
    rep = json.loads((trained_checkpoint / trained_tiny.REPORT_FILE).read_text())["mtp"]
    assert rep["draft_agreement_before"] < 0.1 < 0.8 < rep["draft_agreement_after"], rep
    eng = _engine(trained_checkpoint, num_speculative_tokens=3)
    assert [o.token_ids for o in eng.generate(corpus_prompts, _greedy())] == plain_tokens
    st = eng.spec_stats
    print("trained tiny, k=3:", st.to_dict())
    assert st.mean_accepted_length > 2.0 and st.acceptance_rate[0] > 0.6


def test_reduced_draft_vocab_drafts_inside_its_set_and_keeps_outputs(trained_checkpoint, corpus_prompts,
                                                                     plain_tokens, monkeypatch):
    vocab = 640
    size = 160
    ids = set(load_draft_vocab(trained_checkpoint / "draft_vocab.json", size, vocab).tolist())
    drafted: list[int] = []
    from glm5.engine import llm_engine

    orig = llm_engine.LLMEngine.step

    def step(self):
        out = orig(self)
        for s in self.scheduler.running:
            drafted.extend(s.draft_tokens)
        return out
    monkeypatch.setattr(llm_engine.LLMEngine, "step", step)
    small = _engine(trained_checkpoint, num_speculative_tokens=3, draft_vocab_size=size)
    assert small.runner.mtp.draft_head.weight.shape == (size, 64)
    assert [o.token_ids for o in small.generate(corpus_prompts, _greedy())] == plain_tokens
    assert drafted and set(drafted) <= ids
    full = _engine(trained_checkpoint, num_speculative_tokens=3)
    full.generate(corpus_prompts, _greedy())
    assert 1.0 < small.spec_stats.mean_accepted_length <= full.spec_stats.mean_accepted_length


def test_draft_vocab_file_checks(tmp_path):
    ids = frequent_tokens([[5, 5, 3, 9, 5, 3], [9, 1]], 12, always=[11])
    assert ids[:4] == [11, 5, 3, 9] and sorted(ids) == list(range(12))  # a prefix of any length is a vocabulary
    path = save_draft_vocab(tmp_path / "v.json", ids)
    assert load_draft_vocab(path, 3, 12).tolist() == [11, 5, 3]
    with pytest.raises(ValueError, match="lists only 12"):
        load_draft_vocab(path, 13, 12)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        load_draft_vocab(path, 12, 8)
    with pytest.raises(ValueError, match="glm5.engine.draft_vocab"):
        load_draft_vocab(tmp_path / "missing.json", 4, 12)
    path.write_text(json.dumps({"token_ids": [1, 1, 2]}))
    with pytest.raises(ValueError, match="distinct"):
        load_draft_vocab(path, 3, 12)
    assert torch.equal(load_draft_vocab(path, 1, 12), torch.tensor([1]))
