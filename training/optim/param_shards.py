"""Optimizer state sharded over data parallelism: which rank owns which parameter, and the exchange.

Each parameter is owned by one rank of its data-parallel group (the expert-data-parallel group for
routed experts): :func:`shard_owner_ranks` picks the owners (:mod:`training.optim.shard_owners`'s rule:
Muon matrices by their Newton–Schulz cost on the full, TP-gathered matrix, AdamW parameters by element
count), and :class:`ParamShards` sends the owners' updated parameters to the rest of the group after a
step.  Used by :mod:`training.optim` (torch backend) and :mod:`training.optim.megatron` (GPU), and by
the planner for the same owners.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

def is_expert_dp_param(p: torch.Tensor) -> bool:
    """Its grad is reduced over the expert-data-parallel group (Megatron's ``allreduce = False``: routed experts)."""
    return getattr(p, "allreduce", True) is False


def muon_matrix_shape(p: torch.Tensor, tp_size: int) -> Tuple[int, ...]:
    """The shape Newton–Schulz runs on: the full matrix of a parameter split over ``tp_size`` TP ranks."""
    shape = list(p.shape)
    if tp_size > 1 and getattr(p, "tensor_model_parallel", False):
        shape[int(p.partition_dim)] *= tp_size
    return tuple(shape)


def shard_owner_ranks(params: Sequence[Tuple[torch.Tensor, str]], dp_size: int, expert_dp_size: int,
                      tp_size: int = 1, expert_tp_size: int = 1, ns_steps: int = 5) -> List[int]:
    """The owning rank (in its data-parallel group) of each ``(param, optimizer)`` of ``params``.

    Dense parameters are shared out over the DP group (``dp_size``), routed-expert parameters
    (:func:`is_expert_dp_param`) over the expert-DP group; in each, the Muon matrices by their
    Newton–Schulz cost on the full (TP-gathered) matrix and the AdamW parameters by their local
    element count, in two passes of :func:`training.optim.shard_owners.assign_owners` (pure and
    deterministic: every rank of a group computes the same owners from the same parameter order).
    """
    from training.optim.shard_owners import assign_owners, newton_schulz_cost

    owners = [0] * len(params)
    for expert in (False, True):
        size = expert_dp_size if expert else dp_size
        tp = expert_tp_size if expert else tp_size
        for which in ("muon", "adamw"):
            idx = [i for i, (p, o) in enumerate(params) if o == which and is_expert_dp_param(p) == expert]
            if which == "muon":
                costs = [newton_schulz_cost(muon_matrix_shape(params[i][0], tp), ns_steps) for i in idx]
            else:
                costs = [params[i][0].numel() for i in idx]
            for i, r in zip(idx, assign_owners(costs, size)):
                owners[i] = r
    return owners


class ParamShards:
    """Which rank owns which parameter, and the exchange of the updated parameters after a step.

    ``groups``: ``(process group or None, params)`` for the dense and the expert parameters;
    ``owners``: the owner (rank in that group) of each parameter.  After the owners have updated
    their parameters, :meth:`sync` sends each one to the rest of its group (one broadcast of the
    owner's parameters, flattened, per rank of the group), so every rank holds the same weights.
    """

    def __init__(self, groups: Sequence[Tuple[Any, List[torch.Tensor], List[int]]]):
        self.groups = []
        self.owned: set = set()
        for group, params, owners in groups:
            size = dist.get_world_size(group) if group is not None else 1
            rank = dist.get_rank(group) if group is not None else 0
            by_rank = [[p for p, o in zip(params, owners) if o == r] for r in range(size)]
            self.owned.update(id(p) for p in by_rank[rank])
            if size > 1:
                self.groups.append((group, by_rank))

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self.owned

    @torch.no_grad()
    def sync(self) -> None:
        """Every rank's parameters at their owners' values (bitwise)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for group, by_rank in self.groups:
            for r, owned_by_r in enumerate(by_rank):
                src = dist.get_global_rank(group, r)
                for dtype in sorted({p.dtype for p in owned_by_r}, key=str):  # one buffer per dtype
                    params = [p for p in owned_by_r if p.dtype == dtype]
                    flat = _flatten_dense_tensors([p.data for p in params])
                    dist.broadcast(flat, src=src, group=group)
                    if src == dist.get_rank():
                        continue
                    for p, v in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                        p.data.copy_(v)


def dp_groups(process_groups: Optional[Mapping[str, Any]]) -> Tuple[Any, Any, int, int]:
    """(dense DP group, expert DP group, TP size, expert-TP size): ``process_groups`` keys ``dp``,
    ``expert_dp``, ``tp``, ``expert_tp`` where given, else Megatron's parallel_state (None: one rank)."""
    pg = dict(process_groups or {})
    ready = dist.is_available() and dist.is_initialized()
    ps = None
    if ready:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            ps = None

    def pick(key, fn):
        if key in pg:
            return pg[key]
        return fn() if ps is not None else None

    dp = pick("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True))
    edp = pick("expert_dp", lambda: ps.get_expert_data_parallel_group())
    tp = pick("tp", lambda: ps.get_tensor_model_parallel_group())
    etp = pick("expert_tp", lambda: ps.get_expert_tensor_parallel_group())
    size = lambda g: dist.get_world_size(g) if g is not None else 1  # noqa: E731
    return dp, edp, size(tp), size(etp)


def build_param_shards(params: Sequence[torch.Tensor], kinds: Sequence[str], ns_steps: int = 5,
                       process_groups: Optional[Mapping[str, Any]] = None) -> ParamShards:
    """The :class:`ParamShards` of the trainable parameters ``params`` (every rank the same order), each
    with its optimizer in ``kinds`` (muon | adamw); groups from ``process_groups`` (:func:`dp_groups`)."""
    dp, edp, tp, etp = dp_groups(process_groups)
    size = lambda g: dist.get_world_size(g) if g is not None else 1  # noqa: E731
    items = list(zip(params, kinds))
    owners = shard_owner_ranks(items, size(dp), size(edp), tp, etp, ns_steps)
    groups = []
    for expert, group in ((False, dp), (True, edp)):
        sel = [i for i, (p, _) in enumerate(items) if is_expert_dp_param(p) == expert]
        groups.append((group, [items[i][0] for i in sel], [owners[i] for i in sel]))
    return ParamShards(groups)
