"""Which data-parallel rank owns which parameter under a sharded optimizer state (pure, no communication).

A sharded Muon gives each parameter to exactly one rank of its data-parallel group (the expert-data-parallel
group for routed experts): that rank keeps the parameter's optimizer state and fp32 main copy, computes its
update (for a Muon matrix, the one Newton–Schulz of the whole group), and the updated parameter reaches the
other ranks.  The training optimizer and the planner (memory per rank) both call :func:`assign_owners`, so
the bytes the planner predicts are the bytes the optimizer holds.

Rule (deterministic: the same on every rank and every run, independent of dict or hash order):

- Muon matrices are balanced by their Newton–Schulz cost (:func:`newton_schulz_cost`), the AdamW
  parameters of the same group by their element count, in two separate passes, so that both the
  orthogonalisation FLOPs and the state bytes are balanced.
- Each pass is greedy "largest first onto the least loaded rank" (LPT): items sorted by cost descending,
  ties by their index in the caller's order; the least loaded rank wins, ties to the lowest rank.  The
  largest rank load is then at most the even split plus the largest single item.
"""

from __future__ import annotations

import heapq
import math
from typing import List, Sequence

__all__ = ["assign_owners", "newton_schulz_cost"]


def newton_schulz_cost(shape: Sequence[int], steps: int = 5) -> int:
    """Multiply-adds of ``steps`` quintic Newton–Schulz iterations on a matrix of ``shape``.

    The matrix is ``m × n`` with ``m <= n`` after the transpose Newton–Schulz applies (leading dimensions,
    if any, are a batch of matrices).  One iteration forms ``A = X Xᵀ`` (m·m·n), ``B = b·A + c·A·A``
    (m·m·m) and ``B X`` (m·m·n): ``2·m²·n + m³`` multiply-adds.
    """
    if len(shape) < 2:
        raise ValueError(f"newton_schulz_cost: a matrix has at least 2 dimensions, got shape {tuple(shape)}")
    m, n = sorted((int(shape[-2]), int(shape[-1])))
    batch = math.prod(int(s) for s in shape[:-2])
    return steps * batch * (2 * m * m * n + m ** 3)


def assign_owners(costs: Sequence[float], group_size: int) -> List[int]:
    """The owning rank (``0 .. group_size-1``) of each item, balancing the summed cost (greedy LPT)."""
    if group_size < 1:
        raise ValueError(f"assign_owners: group_size must be >= 1, got {group_size}")
    owners = [0] * len(costs)
    if group_size == 1:
        return owners
    order = sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))
    loads = [(0.0, r) for r in range(group_size)]  # (load, rank): heap order breaks ties by rank
    heapq.heapify(loads)
    for i in order:
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + float(costs[i]), rank))
    return owners
