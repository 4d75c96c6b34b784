"""Expert-parallel load balancing (EPLB): redundant copies of hot experts and the logical → physical map.

Vocabulary (vLLM's): the model has ``E`` *logical* experts per MoE layer; a deployment holds ``P = E + R``
*physical* experts (``R`` = ``num_redundant_experts``), ``P / EP`` per rank, physical id ``p`` on rank
``p // (P / EP)``. Each physical expert is a copy of one logical expert (``physical_to_logical``); a logical
expert has one or more replicas (``logical_to_physical``, ``replica_count``). The router still picks logical
experts; each (token, slot) pair is sent to replica ``(token + slot) % replica_count`` of its expert, which
spreads a hot expert's tokens over its copies. Replicas hold identical weights, so outputs do not depend on
the placement (up to the order in which the ranks' partial sums are added).

Rebalancing (every ``eplb_step_interval`` engine steps): the per-physical-expert token counts since the last
rebalance give each logical expert's load; :func:`rebalance` gives the ``R`` extra replicas to the experts with
the highest load per replica, then packs the replicas onto ranks heaviest first, each to the least-loaded rank
with a free slot, keeping a replica in its current slot where it can (fewer bytes to move).
:func:`exchange_expert_weights` then moves weights between ranks (point-to-point) and rewrites the local expert
tensors in place, so CUDA graphs that read them stay valid. Every rank computes the same plan from the same
counts (routing is replicated, so every rank counts every token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def initial_placement(num_logical: int, num_redundant: int) -> list[int]:
    """Physical → logical at start: ``p % E`` (the redundant slots copy experts 0 .. R-1)."""
    return [p % num_logical for p in range(num_logical + num_redundant)]


@dataclass
class ExpertMap:
    """The device tensors one MoE layer routes with (updated in place by a rebalance)."""

    physical_to_logical: torch.Tensor   # int64 [P]
    logical_to_physical: torch.Tensor   # int64 [E, max_replicas], -1 padded
    replica_count: torch.Tensor         # int64 [E]
    local_of_physical: torch.Tensor     # int64 [P]: local slot on this rank, -1 elsewhere
    load: torch.Tensor                  # int64 [P]: (token, slot) pairs routed to each physical expert
    ep_rank: int
    per_rank: int

    @classmethod
    def build(cls, p2l: list[int], num_logical: int, ep_rank: int, ep_size: int,
              device: torch.device) -> "ExpertMap":
        p = len(p2l)
        max_rep = p - num_logical + 1
        m = cls(physical_to_logical=torch.zeros(p, dtype=torch.int64, device=device),
                logical_to_physical=torch.full((num_logical, max_rep), -1, dtype=torch.int64, device=device),
                replica_count=torch.zeros(num_logical, dtype=torch.int64, device=device),
                local_of_physical=torch.full((p,), -1, dtype=torch.int64, device=device),
                load=torch.zeros(p, dtype=torch.int64, device=device), ep_rank=ep_rank, per_rank=p // ep_size)
        m.set(p2l)
        local = torch.arange(m.per_rank, device=device)
        m.local_of_physical[ep_rank * m.per_rank:(ep_rank + 1) * m.per_rank] = local
        return m

    def set(self, p2l: list[int]) -> None:
        """Rewrite the maps for a new placement, in place."""
        l2p: dict[int, list[int]] = {}
        for phys, log in enumerate(p2l):
            l2p.setdefault(log, []).append(phys)
        n_log, max_rep = self.logical_to_physical.shape
        missing = [e for e in range(n_log) if e not in l2p]
        if missing:
            raise ValueError(f"placement leaves logical experts {missing[:8]} without a physical copy")
        table = torch.full((n_log, max_rep), -1, dtype=torch.int64)
        counts = torch.zeros(n_log, dtype=torch.int64)
        for e, phys in l2p.items():
            table[e, : len(phys)] = torch.tensor(phys)
            counts[e] = len(phys)
        self.physical_to_logical.copy_(torch.tensor(p2l))
        self.logical_to_physical.copy_(table)
        self.replica_count.copy_(counts)

    def to_physical(self, logical: torch.Tensor, count_load: bool) -> torch.Tensor:
        """Physical expert of every (token, slot) pair ``logical [T, k]``: replica ``(token + slot) % count``."""
        t, k = logical.shape
        spread = (torch.arange(t, device=logical.device)[:, None] + torch.arange(k, device=logical.device)[None, :])
        replica = spread % self.replica_count[logical]
        phys = torch.gather(self.logical_to_physical[logical], 2, replica.unsqueeze(-1)).squeeze(-1)
        if count_load:
            self.load.index_add_(0, phys.reshape(-1), torch.ones(phys.numel(), dtype=torch.int64, device=phys.device))
        return phys

    def placement(self) -> list[int]:
        return [int(x) for x in self.physical_to_logical.tolist()]


def rebalance(logical_load: list[float], current: list[int], num_ranks: int) -> list[int]:
    """New physical → logical placement (same length as ``current``) for per-logical-expert ``logical_load``.

    Replicas: every expert keeps one; the ``P - E`` redundant slots go one at a time to the expert with the
    highest load per replica. Packing: replicas heaviest first, each onto the rank with the least load among
    ranks with a free slot, preferring (at equal load) a rank that already holds that expert in the current
    placement; within a rank, experts already there keep their slot. When the result's heaviest rank is no
    lighter than the current placement's, the current placement is kept (nothing moves). Deterministic (ties by
    expert id, rank id).
    """
    n_log, n_phys = len(logical_load), len(current)
    if n_phys % num_ranks:
        raise ValueError(f"{n_phys} physical experts do not split over {num_ranks} ranks")
    per = n_phys // num_ranks
    replicas = [1] * n_log
    for _ in range(n_phys - n_log):
        e = max(range(n_log), key=lambda i: (logical_load[i] / replicas[i], -i))
        replicas[e] += 1
    items = sorted(((logical_load[e] / replicas[e], e) for e in range(n_log) for _ in range(replicas[e])),
                   key=lambda it: (-it[0], it[1]))
    held = [set(current[r * per:(r + 1) * per]) for r in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for w, e in items:
        free = [r for r in range(num_ranks) if len(members[r]) < per and e not in members[r]]
        if not free:  # only possible when an expert has more replicas than there are ranks
            free = [r for r in range(num_ranks) if len(members[r]) < per]
        r = min(free, key=lambda r: (rank_load[r], e not in held[r], r))
        members[r].append(e)
        rank_load[r] += w
    out = [-1] * n_phys
    packed = [e for m in members for e in m]
    if _max_rank_load(logical_load, current, num_ranks) <= _max_rank_load(logical_load, packed, num_ranks) * (1 + 1e-9):
        return list(current)  # no better than what is there: move nothing
    for r in range(num_ranks):
        slots = list(range(r * per, (r + 1) * per))
        todo = list(members[r])
        for s in slots:  # keep experts where they are
            if current[s] in todo:
                out[s] = current[s]
                todo.remove(current[s])
        for s in slots:
            if out[s] == -1:
                out[s] = todo.pop(0)
    return out


def _max_rank_load(logical_load: list[float], placement: list[int], num_ranks: int) -> float:
    """Heaviest rank's tokens when each expert's load is shared evenly by its copies."""
    copies = {e: placement.count(e) for e in set(placement)}
    per = len(placement) // num_ranks
    return max(sum(logical_load[e] / copies[e] for e in placement[r * per:(r + 1) * per]) for r in range(num_ranks))


def transfers(old: list[int], new: list[int], num_ranks: int) -> list[tuple[int, int, int, int]]:
    """``(src rank, src local slot, dst rank, dst local slot)`` for every new slot whose expert is not already on
    its rank (the source is the lowest rank holding it before). Local moves within a rank are not listed."""
    per = len(old) // num_ranks
    out = []
    for d in range(num_ranks):
        mine = old[d * per:(d + 1) * per]
        for j in range(per):
            e = new[d * per + j]
            if e in mine:
                continue
            s = next(r for r in range(num_ranks) if e in old[r * per:(r + 1) * per])
            out.append((s, old[s * per:(s + 1) * per].index(e), d, j))
    return out


def exchange_expert_weights(tensors: list[torch.Tensor], old: list[int], new: list[int], rank: int,
                            num_ranks: int, group) -> int:
    """Rewrite this rank's local expert ``tensors`` (each ``[per_rank, ...]``) for placement ``new``, receiving
    experts it lacks from their old holders. Every rank calls it with the same arguments. Returns the bytes
    this rank received."""
    import torch.distributed as dist

    per = len(old) // num_ranks
    mine_old = old[rank * per:(rank + 1) * per]
    snapshot = [t.clone() for t in tensors]
    plan = transfers(old, new, num_ranks)
    ops, recv_bufs = [], {}
    for s, ks, d, j in plan:
        if rank == s and rank != d:
            ops += [dist.P2POp(dist.isend, snapshot[i][ks].contiguous(), d, group) for i in range(len(tensors))]
        if rank == d:
            bufs = [torch.empty_like(t[j]) for t in tensors]
            recv_bufs[j] = bufs
            ops += [dist.P2POp(dist.irecv, b, s, group) for b in bufs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    received = 0
    for j in range(per):
        e = new[rank * per + j]
        if j in recv_bufs:
            for t, b in zip(tensors, recv_bufs[j]):
                t[j].copy_(b)
                received += b.numel() * b.element_size()
        else:
            k = mine_old.index(e)
            if k != j:
                for t, snap in zip(tensors, snapshot):
                    t[j].copy_(snap[k])
    return received
