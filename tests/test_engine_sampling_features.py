"""Engine sampling features behind vLLM's keys: prompt logprobs (against transformers), logit_bias,
allowed_token_ids, truncate_prompt_tokens, and n / best_of fan-out parameters."""

from __future__ import annotations

import pytest
import torch

from oracle import engine, make_pair, random_prompt

from glm5.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("sampling_features"), seed=5)


def test_prompt_logprobs_match_transformers_across_prefill_chunks(pair):
    """Chunked prefill (budget 16 < prompt 45) scores every prompt token exactly once, with the
    log-softmax of transformers' logits at the previous position, its rank and the top-k."""
    ckpt, hf = pair
    eng = engine(ckpt, max_num_batched_tokens=16)
    vocab = hf.config.text_config.vocab_size
    ids = random_prompt(45, vocab, seed=11)
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    out = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3))[0]
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for p in range(1, len(ids)):
        rec = lps[p]
        assert rec["token_id"] == ids[p]
        assert rec["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        assert rec["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        top_ids = [t for t, _ in rec["top"]]
        assert len(top_ids) == 3 and top_ids[0] == int(ref[p - 1].argmax())
    # without the key, nothing is computed or returned; generation is unchanged by it
    plain = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids


def test_logit_bias_and_allowed_token_ids_steer_greedy_decoding(pair):
    ckpt, hf = pair
    eng = engine(ckpt)
    vocab = hf.config.text_config.vocab_size
    ids = random_prompt(9, vocab, seed=2)
    base = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids
    target = next(t for t in range(vocab) if t not in base)
    biased = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                logit_bias={target: 100.0}))[0].token_ids
    assert biased == [target] * 4
    banned = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                logit_bias={t: -100.0 for t in set(base)}))[0].token_ids
    assert not set(banned) & set(base)
    allowed = [3, 17, 29]
    got = eng.generate([ids], SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True,
                                             allowed_token_ids=allowed))[0].token_ids
    assert set(got) <= set(allowed)


def test_truncate_prompt_tokens_keeps_the_last_tokens(pair):
    ckpt, hf = pair
    eng = engine(ckpt)
    ids = random_prompt(30, hf.config.text_config.vocab_size, seed=4)
    g = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    cut = eng.generate([ids], SamplingParams(truncate_prompt_tokens=10, **g))[0]
    assert cut.prompt_token_ids == ids[-10:]
    assert cut.token_ids == eng.generate([ids[-10:]], SamplingParams(**g))[0].token_ids


def test_engine_rejects_n_and_vocab_bad_ids(pair):
    ckpt, _ = pair
    eng = engine(ckpt)
    with pytest.raises(ValueError, match="for_sequence"):
        eng.add_request("r", [1, 2, 3], SamplingParams(n=2))
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("r", [1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        eng.add_request("r", [1, 2, 3], SamplingParams(allowed_token_ids=[10**6]))


def test_for_sequence_gives_each_sequence_its_own_seed():
    p = SamplingParams(n=3, seed=7, temperature=0.8)
    kids = [p.for_sequence(i) for i in range(3)]
    assert [k.seed for k in kids] == [7, 8, 9] and all(k.n == 1 and k.best_of is None for k in kids)
    assert SamplingParams(n=2).for_sequence(1).seed is None
    assert SamplingParams(n=2, best_of=4).num_sequences == 4
    with pytest.raises(ValueError):
        p.for_sequence(3)


@pytest.mark.gpu
def test_prompt_logprobs_and_logit_bias_on_gpu_with_decode_graphs(pair):
    """On CUDA (decode CUDA graphs on): requests with prompt logprobs leave the graph path only while
    their prompt is scored; their records match the CPU engine and a biased request in the same
    batch still decodes the biased token."""
    ckpt, hf = pair
    vocab = hf.config.text_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (37, 12, 60)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    cpu = engine(ckpt).generate(prompts, params)
    gpu = engine(ckpt, device="cuda", max_num_batched_tokens=32).generate(prompts, params)
    assert gpu[1].token_ids == [7] * 6
    assert gpu[0].token_ids == cpu[0].token_ids and gpu[2].token_ids == cpu[2].token_ids
    for a, b in zip(cpu[0].prompt_logprobs[1:], gpu[0].prompt_logprobs[1:]):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=2e-3)


def test_bad_words_ban_the_word_in_context(tiny_checkpoint_dir):
    """vLLM's rule: a word's last token is banned where the output ends with the word's other tokens."""
    from oracle import engine as make_engine
    from glm5.sampler import apply_bad_words

    logits = torch.zeros(2, 10)
    apply_bad_words(logits, [[[3], [1, 2]], None], [[5, 1], [1]])
    assert torch.isinf(logits[0, 3]) and torch.isinf(logits[0, 2]) and not torch.isinf(logits[1]).any()
    fresh = apply_bad_words(torch.zeros(1, 10), [[[4, 2]]], [[5, 1]])
    assert not torch.isinf(fresh).any()      # the output does not end with 4: this word leaves 2 allowed
    short = apply_bad_words(torch.zeros(1, 10), [[[7, 8, 9]]], [[8]])
    assert not torch.isinf(short).any()      # an output shorter than the word's other tokens ends with none of them

    eng = make_engine(tiny_checkpoint_dir)
    g = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = eng.generate(["The quick brown fox"], SamplingParams(**g))[0]
    word = eng.tokenizer.decode(base.token_ids[:1]).strip() or eng.tokenizer.decode(base.token_ids[:2]).strip()
    assert word
    banned = eng.generate(["The quick brown fox"], SamplingParams(bad_words=[word], **g))[0]
    seqs = [eng.tokenizer.encode(t, add_special_tokens=False) for t in (word, " " + word)]
    for ids in seqs:
        for i in range(len(banned.token_ids) - len(ids) + 1):
            assert banned.token_ids[i:i + len(ids)] != ids
    assert banned.token_ids != base.token_ids
