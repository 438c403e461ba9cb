"""xHC stream router: which k of the N residual streams a sublayer writes (docs/math.md §3.4, §8 #14–#16).

Shapes: ``s`` sequence, ``b`` batch, ``N`` streams, ``C`` hidden size, ``k`` active streams,
``m`` fixed (always-active) streams.  Per token, with x = vec(X) ∈ R^{N·C} (stream-major, §1.2):

=============================  ===============================================================
:func:`router_logits`          z = LayerNorm(x) W_router                          ∈ R^N
:func:`router_scores`          score = σ(z)   (``softmax`` ablation: softmax over z[m:])
:func:`topk_stable`            the (k−m) largest of score[m:], ties to the lower index
:func:`route`                  I = [0..m−1] ++ routed (ascending);  p = [1]*m ++ score[routed]
:func:`router_load`            fraction of tokens that select each stream (diagnostic)
:func:`effective_mixing`       Ĥ = Pᵀ·diag(H_res, I_{N−k})·P, the N×N mixing a sublayer applies
=============================  ===============================================================

Gradient reaches ``W_router`` only through the route weights p of routed slots: the selection
(indices) is not differentiable and the fixed slots use the constant 1 (docs/math.md §3.4).

**Softmax router (ablation, [xHC] Table 2).**  The scores of the non-fixed streams are
softmax(z[m:]) (the N−m logits compete); the top-(k−m) of those are selected and p_j is the
softmax probability itself, not renormalised over the selected streams.  The fixed streams'
entries of ``score`` are σ(z[:m]) in both modes; they are computed but never used (as in §3.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from xhc.norms import fp32, layer_norm_flat

ROUTERS = ("sigmoid", "softmax")


# ================================================================================================
# Equations
# ================================================================================================
def router_logits(x: torch.Tensor, W_router: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """z = LayerNorm(vec X) W_router  (docs/math.md §3.4, router line 1–2; LayerNorm without affine, §1.5).

    ``x``: ``[..., N·C]`` (any dtype);  ``W_router``: ``[N, N·C]`` (torch ``Linear`` layout, i.e. the
    transpose of the documented ``N·C × N``)  ->  fp32 ``[..., N]`` (float64 stays float64).
    """
    return F.linear(layer_norm_flat(x, eps), fp32(W_router))


def router_scores(z: torch.Tensor, m: int, kind: str = "sigmoid") -> torch.Tensor:
    """score = σ(z) (docs/math.md §3.4); ``softmax`` ablation: softmax over the non-fixed logits z[m:].

    ``z``: ``[..., N]`` fp32  ->  ``[..., N]``.  Entries 0..m−1 are σ(z) in both modes (unused).
    """
    if kind == "sigmoid":
        return torch.sigmoid(z)
    if kind == "softmax":
        return torch.cat([torch.sigmoid(z[..., :m]), torch.softmax(z[..., m:], dim=-1)], dim=-1)
    raise ValueError(f"router kind={kind!r}: allowed values are {', '.join(ROUTERS)}")


def topk_stable(score: torch.Tensor, n_select: int) -> torch.Tensor:
    """Indices of the ``n_select`` largest entries along the last dim, sorted ascending.

    Ties go to the lower index: a *stable* descending sort keeps equal scores in index order,
    so among equal scores the lower index comes first and is kept (``torch.topk`` gives no such
    guarantee).  ``score``: ``[..., n]``  ->  long ``[..., n_select]``.
    """
    order = torch.sort(score.detach(), dim=-1, descending=True, stable=True).indices
    return order[..., :n_select].sort(dim=-1).values


def route(score: torch.Tensor, k: int, m: int):
    """Active slots and route weights (docs/math.md §3.4 router, §8 #14–#15).

    I   = [0, 1, …, m−1] ++ (k−m largest of score[m:], offset by m, ascending)
    p_j = 1 for j < m;  p_j = score[I_j] for j ≥ m      (raw score, not renormalised)

    ``score``: ``[..., N]`` fp32  ->  (I long ``[..., k]``, p ``[..., k]`` in score's dtype).
    """
    batch = score.shape[:-1]
    fixed = torch.arange(m, device=score.device).expand(*batch, m)
    routed = topk_stable(score[..., m:], k - m) + m  # [..., k−m]
    I = torch.cat([fixed, routed], dim=-1)
    p = torch.cat([score.new_ones(*batch, m), score.gather(-1, routed)], dim=-1)
    return I, p


# ================================================================================================
# Diagnostics
# ================================================================================================
def router_load(I: torch.Tensor, n: int) -> torch.Tensor:
    """Fraction of tokens whose active set contains each stream.  ``I``: ``[..., k]`` -> fp32 ``[N]``.

    Fixed streams have load 1; the loads sum to k.
    """
    hits = torch.zeros(n, dtype=torch.float32, device=I.device)
    hits.index_add_(0, I.reshape(-1), torch.ones(I.numel(), dtype=torch.float32, device=I.device))
    tokens = max(I.numel() // max(I.shape[-1], 1), 1)
    return hits / tokens


def effective_mixing(I: torch.Tensor, H_res: torch.Tensor, n: int) -> torch.Tensor:
    """Ĥ = Pᵀ·diag(H_res, I_{N−k})·P: the N×N mixing of one xHC sublayer (docs/math.md §3.4 "global view").

    ``I``: ``[..., k]``;  ``H_res``: ``[..., k, k]``  ->  ``[..., N, N]`` (identity on inactive streams).
    For tests and logging only (it materialises N×N per token).
    """
    batch, k = I.shape[:-1], I.shape[-1]
    H = torch.eye(n, dtype=H_res.dtype, device=H_res.device).expand(*batch, n, n).clone()
    rows = I[..., :, None].expand(*batch, k, n)
    H = H.scatter(-2, rows, torch.zeros_like(rows, dtype=H.dtype))  # clear the active rows
    block = torch.zeros(*batch, k, n, dtype=H.dtype, device=H.device)
    block = block.scatter(-1, I[..., None, :].expand(*batch, k, k), H_res)  # row j: H_res[j, q] at col I_q
    return H.scatter(-2, rows, block)


# ================================================================================================
# Module
# ================================================================================================
@dataclass
class Routing:
    """One routing decision (per token)."""

    I: torch.Tensor  # [..., k] long: active streams, fixed 0..m−1 first, then routed ascending
    p: torch.Tensor  # [..., k] fp32: route weights (1 on fixed slots, score on routed slots)
    score: torch.Tensor  # [..., N] fp32: all router scores (diagnostics)


class StreamRouter(nn.Module):
    """Router of one xHC sublayer (or one Flash window).

    Parameter ``weight`` = W_router: ``[N, N·C]`` fp32 (torch ``Linear`` layout; the documented
    W_router ∈ R^{N·C×N} is its transpose), no bias, no gate; init N(0, 1/(N·C)) (docs/math.md §3.4, §8 #16).
    With k = m nothing is routed and the router has no parameter (``weight is None``).
    """

    def __init__(self, n: int, hidden_size: int, k: int, m: int, kind: str = "sigmoid", eps: float = 1e-6):
        super().__init__()
        if not 0 <= m <= k <= n:
            raise ValueError(f"StreamRouter needs 0 <= m <= k <= n, got n={n}, k={k}, m={m}")
        if kind not in ROUTERS:
            raise ValueError(f"StreamRouter kind={kind!r}: allowed values are {', '.join(ROUTERS)}")
        self.n, self.hidden_size, self.k, self.m, self.kind, self.eps = n, hidden_size, k, m, kind, eps
        self.weight = nn.Parameter(torch.empty(n, n * hidden_size)) if k > m else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.weight is not None:
            self.weight.normal_(0.0, (self.n * self.hidden_size) ** -0.5)

    def scores(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Router scores ``[..., N]`` from ``x = vec(X)``: ``[..., N·C]`` (or precomputed logits ``z``)."""
        if z is None:
            z = router_logits(x, self.weight, self.eps)
        return router_scores(z, self.m, self.kind)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> Routing:
        """``x``: ``[..., N·C]`` -> :class:`Routing`.  ``z`` lets a fused GEMM supply the logits."""
        batch = x.shape[:-1]
        if self.weight is None:  # k = m: the active set is 0..k−1 for every token
            I = torch.arange(self.k, device=x.device).expand(*batch, self.k)
            ones = torch.ones(*batch, self.k, dtype=fp32(x).dtype, device=x.device)
            return Routing(I, ones, torch.ones(*batch, self.n, dtype=ones.dtype, device=x.device))
        score = self.scores(x, z)
        I, p = route(score, self.k, self.m)
        return Routing(I, p, score)

    def extra_repr(self) -> str:
        return f"n={self.n}, k={self.k}, m={self.m}, kind={self.kind}, C={self.hidden_size}"
