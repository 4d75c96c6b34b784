"""The batched acceptance of speculative steps (glm5.engine.spec_sampling): exact target distribution,
greedy prefix matching, and counter-based streams that do not depend on the batch."""

from __future__ import annotations

import torch

from glm5.engine.spec_sampling import SALT_ACCEPT, SALT_DRAFT, accept_greedy, accept_sampled, race, uniforms

CHI2_DF5_P001 = 20.5   # chi-square critical value, 5 degrees of freedom, p = 0.001


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_emits_the_target_distribution_at_every_row():
    """Many independent requests (distinct seeds) verifying three drafts drawn from q: the first and the
    second emitted token are each distributed as p (the second conditionally on the first being a draft
    that passed, which here has the same p: the rows share one distribution)."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.40, 0.05, 0.20, 0.05, 0.10, 0.20])
    n, k = 30000, 3
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 + 17
    first = torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(1))
    pos = first.view(n, 1) + 1 + torch.arange(k)
    drafts = race(q.expand(n, k, 6), seeds, pos, SALT_DRAFT)                          # [n, k] drawn from q
    assert _chi2(torch.bincount(drafts[:, 0], minlength=6).float(), q * n) < CHI2_DF5_P001
    emitted, accepted = accept_sampled(p.expand(n, k + 1, 6), q.expand(n, k, 6), drafts, torch.full((n,), k),
                                       seeds, first)
    assert _chi2(torch.bincount(emitted[:, 0], minlength=6).float(), p * n) < CHI2_DF5_P001
    second = emitted[accepted >= 1, 1]
    assert _chi2(torch.bincount(second, minlength=6).float(), p * second.numel()) < CHI2_DF5_P001
    # acceptance of the first draft is sum(min(p, q)) = 0.45
    assert abs((accepted >= 1).float().mean().item() - float(torch.minimum(p, q).sum())) < 0.015
    # the test has power: emitting the draft unchecked gives q, which it rejects
    assert _chi2(torch.bincount(drafts[:, 0], minlength=6).float(), p * n) > CHI2_DF5_P001


def test_rejection_sampling_respects_num_drafts_and_draft_support():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    n = 4000
    drafts = torch.tensor([[0, 1]]).expand(n, 2)
    # one real draft, the second is padding: draft 0 passes with p/q = 0.5; then the bonus comes from row 1's p
    # (never the padding draft, which q says is certain and p allows)
    em, acc = accept_sampled(p.expand(n, 3, 3), q.expand(n, 2, 3), drafts, torch.ones(n, dtype=torch.long),
                             torch.arange(n), torch.full((n,), 10))
    assert int(acc.max()) == 1 and abs(acc.float().mean().item() - 0.5) < 0.03
    bonus = em[acc == 1, 1]
    freq = torch.bincount(bonus, minlength=3).float() / bonus.numel()
    assert torch.allclose(freq, p[1], atol=0.04), freq
    # rejected: the correction comes from norm(max(p0 - q0, 0)) = token 1
    assert bool((em[acc == 0, 0] == 1).all())
    # a draft the target gives probability 0 is always rejected and the correction never repeats it
    q2 = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for s in range(50):
        em, acc = accept_sampled(p[None], q2[None], torch.tensor([[2, 0]]), torch.tensor([2]), torch.tensor([s]),
                                 torch.tensor([3]))
        assert int(acc) == 0 and em[0, 0].item() in (0, 1)


def test_greedy_accept_is_the_longest_matching_prefix():
    target = torch.tensor([[2, 3, 1, 4], [2, 3, 1, 4], [2, 3, 1, 4], [2, 3, 1, 4]])
    drafts = torch.tensor([[2, 3, 1], [2, 0, 1], [0, 3, 1], [2, 3, 1]])
    emitted, accepted = accept_greedy(target, drafts, torch.tensor([3, 3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0, 2]  # last: only 2 real drafts
    assert torch.equal(emitted, target)


def test_counter_streams_do_not_depend_on_the_batch():
    seeds = torch.tensor([7, 8, 9, -5], dtype=torch.int64)
    pos = torch.tensor([[3, 4], [3, 4], [100, 101], [0, 1]])
    alone = torch.stack([uniforms(seeds[i:i + 1], pos[i:i + 1], SALT_ACCEPT, 50)[0] for i in range(4)])
    together = uniforms(seeds, pos, SALT_ACCEPT, 50)
    shuffled = uniforms(seeds[[2, 0, 3, 1]], pos[[2, 0, 3, 1]], SALT_ACCEPT, 50)[[1, 3, 0, 2]]
    assert torch.equal(alone, together) and torch.equal(together, shuffled)
    assert not torch.equal(together[0], together[1])                      # the seed matters
    assert not torch.equal(together[0, 0], together[0, 1])                # the position matters
    assert not torch.equal(uniforms(seeds, pos, SALT_DRAFT, 50), together)  # so does the purpose
    big = uniforms(torch.arange(64), torch.arange(64).view(64, 1), SALT_ACCEPT, 4096)
    assert 0.0 < float(big.min()) and float(big.max()) < 1.0
    assert abs(float(big.mean()) - 0.5) < 0.005 and abs(float(big.var()) - 1 / 12) < 0.002
