"""Choosing how many tokens to draft per step: a cost model of a speculative round and the running
acceptance rate.

A round with ``k`` drafts costs one verification pass over ``k + 1`` rows per request, the MTP catch-up
over the accepted rows and ``k − 1`` more MTP steps, and yields ``1 + a₁ + a₁a₂ + …`` tokens per request
(``a_j`` = the rate at which draft ``j`` is accepted once draft ``j − 1`` was). On a 288-expert MoE the
verification rows of a small batch touch up to ``(k + 1)×`` the routed experts of a plain step, and every
draft step reads the LM head again, so at batch 1 a ``k = 3`` round moves several times a plain step's
bytes and speculation can lose: :class:`AdaptiveK` picks, before each step, the ``k`` (``0`` included)
with the most tokens per second.

Round times come from a table the bench measures (``bench/spec_bench.py`` writes it,
:meth:`SpecCostModel.load`), interpolated in the batch size; without one, from the bytes a round must move
(:func:`round_bytes`) over an assumed bandwidth plus a fixed cost per forward pass. ``k = 0`` costs a
plain step: the MTP layer then does not run (the target's hidden rows wait for the next drafting step, see
:mod:`glm5.engine.spec_batched`), so turning speculation down costs nothing beyond the plain step.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from glm5.config import ModelConfig, TextConfig

logger = logging.getLogger(__name__)

#: Byte-model defaults: the H200's measured device copy bandwidth (bench/results/results.json ceilings,
#: ~4.3e12 B/s, rounded down for the gather-heavy decode kernels) and a CUDA-graph replay plus the host work
#: around it per forward pass (the b1 decode step's non-kernel time in bench/results/step_anatomy.json).
DEFAULT_BANDWIDTH = 4.0e12
DEFAULT_PASS_OVERHEAD_S = 60e-6


def touched_experts(rows: int, n_experts: int, top_k: int) -> float:
    """Expected distinct experts ``rows`` tokens route to under uniform routing: ``E·(1 − (1 − k/E)^rows)``."""
    if n_experts <= 0 or rows <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


@dataclass
class WeightBytes:
    """The byte sizes a step reads, split the way a decode step touches them."""

    target_nonrouted: int   # every target weight but the routed experts, the embedding table and the LM head
    per_expert: int         # one routed expert of one MoE layer (gate + up + down)
    target_moe_layers: int
    lm_head: int
    mtp_nonrouted: int      # the MTP layer without its routed experts (its LM head is the target's)
    mtp_moe: bool
    n_experts: int
    top_k: int

    @classmethod
    def from_config(cls, cfg: ModelConfig, elem_bytes: int = 2) -> "WeightBytes":
        from glm5.weights.names import expected_weight_shapes

        t = cfg.text
        shapes = expected_weight_shapes(cfg, include_mtp=bool(t.mtp_layer_ids))
        mtp_prefixes = tuple(f"layers.{i}." for i in t.mtp_layer_ids)

        def size(shape) -> int:
            n = 1
            for s in shape:
                n *= s
            return n * elem_bytes

        routed = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
        moe_ids = [i for i, kind in enumerate(t.mlp_kinds) if kind == "moe"]
        sample = f"layers.{moe_ids[0]}." if moe_ids else None  # every MoE layer's experts have one shape
        target, mtp, per_expert = 0, 0, 0
        for name, shape in shapes.items():
            if name in ("embed_tokens.weight", "lm_head.weight") or name.startswith("visual."):
                continue
            if name.endswith(routed):
                if sample is not None and name.startswith(sample):
                    per_expert += size(shape[1:])
                continue
            if name.startswith(mtp_prefixes):
                mtp += size(shape)
            else:
                target += size(shape)
        return cls(target, per_expert, len(moe_ids), size(shapes["lm_head.weight"]), mtp,
                   bool(t.mtp_layer_ids) and t.mtp_mlp_kind() == "moe", t.n_routed_experts, t.num_experts_per_tok)


def _attention_bytes(t: TextConfig, rows: int, ctx: int, mla_layers: int, elem: int) -> float:
    selected = min(ctx + 1, t.index_topk + t.index_kpool - 1)
    return mla_layers * rows * (selected * t.kv_lora_rank + (ctx + 1) // t.index_kpool * t.index_head_dim) * elem


def round_bytes(cfg: ModelConfig, weights: WeightBytes, batch: int, k: int, ctx: int,
                draft_vocab: int | None = None, touched_target: float | None = None,
                touched_mtp: float | None = None, elem: int = 2) -> dict[str, float]:
    """Bytes one speculative round with ``k`` drafts per request must move at ``batch`` requests of context
    ``ctx`` (``k = 0``: a plain decode step), by part. ``touched_*``: measured distinct experts summed over the
    MoE layers (per pass), instead of the uniform-routing expectation; ``draft_vocab``: rows of a reduced
    draft LM head (``None``: the full vocabulary)."""
    t = cfg.text
    rows = batch * (k + 1)
    state = t.linear_num_heads * t.linear_head_dim ** 2 * 4
    d = t.linear_num_heads * t.linear_head_dim
    conv = (t.linear_conv_kernel_dim - 1) * 3 * d * elem
    if touched_target is None:
        touched_target = weights.target_moe_layers * touched_experts(rows, weights.n_experts, weights.top_k)
    parts = {
        "target_weights": weights.target_nonrouted + weights.lm_head,
        "target_experts": touched_target * weights.per_expert,
        # plain: read + write the state; verification: read it, then the commit reads and writes it
        "kda_state": len(t.kda_layer_ids) * batch * ((3 if k else 2) * state + 2 * conv),
        "attention": _attention_bytes(t, rows, ctx, len(t.mla_layer_ids), elem),
    }
    if k:
        head = weights.lm_head if draft_vocab is None else weights.lm_head * draft_vocab / t.vocab_size
        if touched_mtp is None:
            per_pass = [touched_experts(rows, weights.n_experts, weights.top_k)] + \
                [touched_experts(batch, weights.n_experts, weights.top_k)] * (k - 1)
            touched_mtp = sum(per_pass) if weights.mtp_moe else 0.0
        parts["mtp_weights"] = k * weights.mtp_nonrouted
        parts["mtp_experts"] = touched_mtp * weights.per_expert
        parts["draft_head"] = k * head
        parts["mtp_attention"] = _attention_bytes(t, rows + batch * (k - 1), ctx, 1, elem)
    parts["total"] = sum(parts.values())
    return parts


def forward_passes(k: int) -> int:
    """Graph replays (and host hand-offs) of a round: plain 1; else verify, commit, catch-up, k-1 drafts."""
    return 1 if k == 0 else 2 + k


@dataclass
class SpecCostModel:
    """Seconds of one round per (batch, k): measured points, else the byte model.

    The model does not change once made, so each ``(batch, k)`` is worked out once (:meth:`round_s` runs on
    every decode step, several times: the byte model alone costs tens of µs of host time per call)."""

    cfg: ModelConfig
    measured: dict[int, list[tuple[int, float]]] = field(default_factory=dict)   # k -> sorted (batch, seconds)
    bandwidth: float = DEFAULT_BANDWIDTH
    pass_overhead_s: float = DEFAULT_PASS_OVERHEAD_S
    ctx: int = 1024
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        self.weights = WeightBytes.from_config(self.cfg)
        self._rounds: dict[tuple[int, int], float] = {}

    def modelled_s(self, batch: int, k: int) -> float:
        b = round_bytes(self.cfg, self.weights, batch, k, self.ctx, self.draft_vocab)["total"]
        return b / self.bandwidth + forward_passes(k) * self.pass_overhead_s

    def round_s(self, batch: int, k: int) -> float:
        key = (batch, k)
        secs = self._rounds.get(key)
        if secs is None:
            secs = self._rounds[key] = self._round_s(batch, k)
        return secs

    def _round_s(self, batch: int, k: int) -> float:
        pts = self.measured.get(k)
        if not pts:
            return self.modelled_s(batch, k)
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, batch)
        if i < len(xs) and xs[i] == batch:
            return pts[i][1]
        if i == 0:
            return pts[0][1] * self.modelled_s(batch, k) / self.modelled_s(xs[0], k)
        if i == len(xs):
            return pts[-1][1] * self.modelled_s(batch, k) / self.modelled_s(xs[-1], k)
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)

    @classmethod
    def load(cls, path: str | Path, cfg: ModelConfig, **kw) -> "SpecCostModel":
        """Read a table written by the bench: ``{"rounds": [{"batch": B, "k": k, "round_s": s}, ...]}``
        (``k = 0`` rows are plain steps)."""
        data = json.loads(Path(path).read_text())
        rows = data.get("rounds")
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{path}: expected a JSON object with a non-empty 'rounds' list of "
                             "{batch, k, round_s} (bench/spec_bench.py --cost-table writes one)")
        measured: dict[int, list[tuple[int, float]]] = {}
        for r in rows:
            try:
                batch, k, secs = int(r["batch"]), int(r["k"]), float(r["round_s"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: bad round entry {r!r}: needs integer batch, k and a round_s") from e
            if not secs > 0 or batch < 1 or k < 0:
                raise ValueError(f"{path}: bad round entry {r!r}: round_s must be > 0 seconds, batch >= 1, k >= 0")
            measured.setdefault(k, []).append((batch, secs))
        return cls(cfg, {k: sorted(v) for k, v in measured.items()}, **kw)


class AcceptanceTracker:
    """Running conditional acceptance per draft position (exponentially weighted, prior ``prior``).

    ``version`` counts the steps that changed the estimate: a policy keeps what it derived from the rates
    until it changes (most decode steps at ``k = 0`` verify nothing)."""

    def __init__(self, k_max: int, decay: float = 0.98, prior: float = 0.5, prior_weight: float = 2.0):
        self.k_max, self.decay, self.prior, self.prior_weight = k_max, decay, prior, prior_weight
        self.proposed = [0.0] * k_max
        self.accepted = [0.0] * k_max
        self.version = 0

    def observe_step(self, results: list[tuple[int, int]]) -> None:
        """One verification step: ``(drafts, accepted)`` per request."""
        if not results:
            return
        self.version += 1
        self.proposed = [p * self.decay for p in self.proposed]
        self.accepted = [a * self.decay for a in self.accepted]
        for drafts, accepted in results:
            for j in range(min(drafts, accepted + 1, self.k_max)):  # draft j is tried only if j-1 passed
                self.proposed[j] += 1
                self.accepted[j] += j < accepted

    def rates(self) -> list[float]:
        return [(a + self.prior * self.prior_weight) / (p + self.prior_weight)
                for a, p in zip(self.accepted, self.proposed)]

    def optimistic_rates(self) -> list[float]:
        """The rates with a prior of full acceptance (same weight as the prior of :meth:`rates`), each capped
        by the one before it: 1.0 where nothing was observed at all, close to the observed rate once many drafts
        were. The cap assumes that a deeper draft is not accepted more often than a shallower one (the MTP
        layer drafts each from the one before), so a position never tried (probes draft one token) does not
        count as certain once the first has been measured."""
        out, cap = [], 1.0
        for a, p in zip(self.accepted, self.proposed):
            cap = min(cap, (a + self.prior_weight) / (p + self.prior_weight))
            out.append(cap)
        return out


def expected_tokens(rates: list[float], k: int) -> float:
    """Tokens a request emits per round with ``k`` drafts: ``1 + Σ_j Π_{i≤j} a_i``."""
    total, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


class AdaptiveK:
    """Per step: the ``k`` in ``0..k_max`` with the most tokens per second at the current batch size.

    While speculation is off, the acceptance estimate goes stale, so the policy now and then *probes*: one
    step drafts one token. A probe is not free - it catches the MTP layer up on the rows that waited while
    it was off, then verifies two rows per request - so probes are paid from a credit (a token bucket): each
    decode step at ``k = 0`` adds ``explore_fraction`` of its wall time (:meth:`observe_time`, from the
    engine), up to two probes' worth; a probe runs when the credit covers its expected cost and then takes off
    what it measured beyond plain steps (clipped to 8 ``k = 1`` rounds of the cost model: one compilation stall
    must not stop probing for hours). The expected cost is that excess in ``k = 1`` rounds (smoothed), scaled
    to the batch size; before the first probe, 2 rounds. No probe runs where no acceptance
    could pay (:meth:`can_pay`), within ``probe_every`` steps of the last one, or on a step the engine does
    not time (``may_probe``: a prefill step).

    Keeping the MTP layer's history while speculation is off is exploration too: every ``MAX_BACKLOG`` steps a
    request's backlog is drained (replays of the MTP layer over it) so that a later probe or a return to
    ``k > 0`` can draft. Drains are paid from the same credit (:meth:`keeps_mtp`; the first runs on credit),
    so probes and drains together cost about ``explore_fraction`` of the time spent at ``k = 0``; a full
    backlog the credit cannot pay for is dropped (that request drafts no more; new requests start with the MTP
    layer following them). Carrying a backlog costs host work on every step too, so none is carried at all
    where it would only be dropped (:meth:`holds_mtp`). The credit holds up to two of the dearer of a probe
    and a drain."""

    MAX_COST_ROUNDS = 8.0
    #: steps at k = 0 after the last speculative step (or probe) during which rows are still held back for the
    #: MTP layer although a full backlog would not be drained now: the batch may shrink back to a size where
    #: speculation runs (the engine's backlog cap, glm5.engine.spec_batched.MAX_BACKLOG)
    HOLD_STEPS = 64

    def __init__(self, k_max: int, cost: SpecCostModel, probe_every: int = 16,
                 tracker: AcceptanceTracker | None = None, explore_fraction: float = 0.02):
        self.k_max, self.cost, self.probe_every = k_max, cost, probe_every
        self.explore_fraction = explore_fraction
        self.tracker = tracker or AcceptanceTracker(k_max)
        self._steps_at_zero = 0                    # steps at k = 0 since the last choice with drafts (or probe)
        self._drafted = False                      # any choice with drafts (or probe) yet
        self.elapsed_s = 0.0        # decode step time observed while speculation was off
        self.probe_spent_s = 0.0    # probes' time beyond what plain steps would have taken
        self.probes = 0
        self.credit_s = 0.0
        self._off = True                           # the last choice had k = 0 on the merits (probes included)
        self._cost_rounds = 2.0                    # a probe's excess in k = 1 rounds (smoothed)
        self._probe_batch = 0
        self._probe_steps = 0                      # steps of the running probe still to observe
        self._probe_acc = 0.0
        self._plain_ratio = 1.0                    # measured plain step / the cost model's plain round
        self._drain_rounds = 2.0                   # a drain step's excess in k = 1 rounds (smoothed)
        self.drains = 0
        self.drain_spent_s = 0.0    # drain steps' time beyond what plain steps would have taken
        # per batch size, what depends on the acceptance estimate alone (best k, whether the MTP layer could
        # pay), kept while the tracker's version stays the same: a step at k = 0 then decides by dict lookups
        self._derived: dict[tuple[str, int], object] = {}
        self._derived_version: tuple[int, int] | None = None   # (the tracker's id, its version)

    def throughput(self, batch: int, k: int) -> float:
        """Tokens per second per request the model predicts for ``k`` drafts at ``batch`` requests."""
        return expected_tokens(self.tracker.rates(), k) / self.cost.round_s(batch, k)

    def best(self, batch: int) -> int:
        return self._per_version("best", batch, lambda: max(range(self.k_max + 1),
                                                            key=lambda k: (self.throughput(batch, k), -k)))

    def _per_version(self, what: str, batch: int, compute):
        """``compute()``, kept per ``(what, batch)`` until the acceptance estimate changes."""
        version = (id(self.tracker), self.tracker.version)
        if self._derived_version != version:
            self._derived.clear()
            self._derived_version = version
        key = (what, batch)
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def can_pay(self, batch: int, rates: list[float] | None = None) -> bool:
        """Whether any ``k > 0`` would beat ``k = 0`` at this batch size at acceptance ``rates`` (default: every
        draft accepted, ``k + 1`` tokens per round); at full acceptance, when none would, probing the acceptance
        only costs time."""
        plain = self.cost.round_s(batch, 0)
        rates = rates if rates is not None else [1.0] * self.k_max
        return any(expected_tokens(rates, k) / self.cost.round_s(batch, k) > 1.0 / plain
                   for k in range(1, self.k_max + 1))

    def keeps_mtp(self, batch: int) -> bool:
        """Whether a request's full backlog is worth draining (the MTP layer keeps following it) rather than
        dropping (it drafts no more): some ``k > 0`` beats ``k = 0`` at the optimistic acceptance
        (:meth:`AcceptanceTracker.optimistic_rates`), and the exploration credit covers a drain
        (:meth:`drain_cost_s`) or none has run yet. Before any draft was verified the optimistic acceptance is
        full acceptance, and the first drain runs on credit (it also measures what a drain costs); once the
        observed drafts say that no ``k`` could pay even with the benefit of the doubt, the drains stop.
        Without the credit test a model on which speculation pays only near full acceptance, probed too rarely
        to learn otherwise, drained every backlog (one drain per ``MAX_BACKLOG`` steps; the adaptive engine
        decoded at 0.91x of one without MTP at b1 on an H100, trained tiny checkpoint, 2026-12-06)."""
        return self._drain_funded(batch, 0.0) and self._could_pay(batch)

    def holds_mtp(self, batch: int) -> bool:
        """Whether rows are held back for the MTP layer at all at ``batch`` requests (each request's backlog
        grows, a copy of the step's hidden rows per step): within :attr:`HOLD_STEPS` steps of the last
        speculative step or probe (the batch may shrink back to where speculation runs, and then the
        requests draft after one catch-up), or where a backlog started now would be drained when full
        (:meth:`keeps_mtp` with the credit the ``HOLD_STEPS`` steps at ``k = 0`` until then will have earned).
        Otherwise a backlog would be carried until it is full only to be dropped then: the engine stops the
        MTP layer following the requests at once (a k = 0 step then costs what a plain step costs)."""
        if self._drafted and self._steps_at_zero < self.HOLD_STEPS:
            return True
        earned = self.explore_fraction * self._plain_ratio * self.cost.round_s(batch, 0) * self.HOLD_STEPS
        return self._drain_funded(batch, earned) and self._could_pay(batch)

    def _drain_funded(self, batch: int, earned_s: float) -> bool:
        return self.drains == 0 or self.credit_s + earned_s >= self.drain_cost_s(batch)

    def _could_pay(self, batch: int) -> bool:
        return self._per_version("keeps", batch, lambda: self.can_pay(batch, self.tracker.optimistic_rates()))

    def drain_cost_s(self, batch: int) -> float:
        """What a drain step at ``batch`` requests is expected to cost beyond a plain step."""
        return self._drain_rounds * self.cost.round_s(batch, 1)

    def probe_cost_s(self, batch: int) -> float:
        """What the next probe at ``batch`` requests is expected to cost beyond plain steps."""
        return self._cost_rounds * self.cost.round_s(batch, 1)

    def _may_probe(self, batch: int) -> bool:
        # (``choose(may_probe=False)`` where no running request could draft: the engine's, when the MTP layer
        # follows none of them, so that a probe that cannot verify anything neither runs nor holds rows back)
        if not self.probe_every or self._steps_at_zero < self.probe_every or self._probe_steps:
            return False
        return self.credit_s >= self.probe_cost_s(batch) and self._per_version("pays", batch,
                                                                                 lambda: self.can_pay(batch))

    def choose(self, batch: int, may_probe: bool = True) -> int:
        """The next step's k (class docstring: the probes while it is 0)."""
        if batch <= 0:
            return 0
        k = self.best(batch)
        self._off = k == 0
        if k > 0:
            self._steps_at_zero, self._drafted = 0, True
            return k
        self._steps_at_zero += 1
        if may_probe and self._may_probe(batch):
            self._steps_at_zero, self._drafted = 0, True
            self._probe_steps, self._probe_acc, self._probe_batch = 2, 0.0, batch  # catch-up + drafts, verify
            self.probes += 1
            return 1
        return 0

    def observe_step(self, results: list[tuple[int, int]]) -> None:
        self.tracker.observe_step(results)

    def observe_time(self, seconds: float, batch: int, plain: bool, mtp_only: bool = False) -> None:
        """One decode step's wall time at ``batch`` requests, after the step chose the next ``k``. ``plain``:
        it verified and drafted nothing and ran no MTP pass (it calibrates what a plain step costs here).
        ``mtp_only``: it verified and drafted nothing but ran the MTP layer (a backlog drain, or a catch-up
        of a request's last rows); outside a probe its time beyond a plain step is paid from the credit."""
        if batch <= 0:
            return
        expected_plain = self._plain_ratio * self.cost.round_s(batch, 0)
        if self._probe_steps:
            self._probe_acc += max(0.0, seconds - expected_plain)
            self._probe_steps -= 1
            if not self._probe_steps:
                self.probe_spent_s += self._probe_acc
                rounds = self._charge(self._probe_acc, self._probe_batch)
                self._cost_rounds = 0.5 * self._cost_rounds + 0.5 * rounds if self.probes > 1 else rounds
        elif plain:
            ratio = seconds / self.cost.round_s(batch, 0)
            self._plain_ratio = 0.9 * self._plain_ratio + 0.1 * ratio
        elif mtp_only:
            excess = max(0.0, seconds - expected_plain)
            self.drains += 1
            self.drain_spent_s += excess
            self._drain_rounds = 0.5 * self._drain_rounds + 0.5 * self._charge(excess, batch)
        if self._off:
            self.elapsed_s += seconds
            cap = 2.0 * max(self.probe_cost_s(batch), self.drain_cost_s(batch))   # room for either to run
            self.credit_s = min(self.credit_s + self.explore_fraction * seconds, cap)

    def _charge(self, excess_s: float, batch: int) -> float:
        """Take ``excess_s`` (a probe's or a drain's time beyond plain steps at ``batch`` requests) off the
        credit, in ``k = 1`` rounds of the cost model clipped to :data:`MAX_COST_ROUNDS` (a stall, a first-call
        compilation say, is not the exploration's); returns the rounds charged."""
        round1 = self.cost.round_s(batch, 1)
        rounds = min(excess_s / round1, self.MAX_COST_ROUNDS)
        self.credit_s -= rounds * round1
        return rounds


class FixedK:
    """Always ``k`` drafts (vLLM's behaviour; ``num_speculative_tokens`` with the fixed policy)."""

    def __init__(self, k: int):
        self.k_max = k
        self.tracker = AcceptanceTracker(max(k, 1))

    def choose(self, batch: int, may_probe: bool = True) -> int:
        return self.k_max

    def keeps_mtp(self, batch: int) -> bool:
        """A fixed ``k > 0`` always speculates, so the MTP layer's history is always kept."""
        return self.k_max > 0

    def holds_mtp(self, batch: int) -> bool:
        return self.k_max > 0

    def observe_step(self, results: list[tuple[int, int]]) -> None:
        self.tracker.observe_step(results)

    def observe_time(self, seconds: float, batch: int, plain: bool, mtp_only: bool = False) -> None:
        pass


__all__ = ["AcceptanceTracker", "AdaptiveK", "DEFAULT_BANDWIDTH", "DEFAULT_PASS_OVERHEAD_S", "FixedK",
           "SpecCostModel", "WeightBytes", "expected_tokens", "forward_passes", "round_bytes", "touched_experts"]
