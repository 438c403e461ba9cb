"""Residual-mixing parameterisations H_res = Φ(z_res) (docs/math.md §1.4, §2.b–§2.f).

Every map takes fp32 logits with arbitrary leading dimensions and returns ``[..., n, n]``.
Rows index *output* streams: the write is X' = H_res · X (docs/math.md §1.3, convention 1).

=====================  =====================================  =========================
function               logits shape                           H_res property
=====================  =====================================  =========================
:func:`sinkhorn`       ``[..., n, n]``                        rows exact, columns ≈ 1
:func:`sinkhorn_deepseek` ``[..., n, n]`` (DeepSeek-V4, §2.h)  columns ≈ 1 − ε, rows ≈ 1
:func:`mhc_lite_mix`   ``[..., n!]`` (permutations, lexic.)    exactly doubly stochastic
:func:`kromhc_mix`     ``[..., 2·log2 n]`` ([id, swap] pairs)  exactly doubly stochastic
:func:`identity_mix`   none                                   I_n
:func:`clamp_rows`     applied after Φ (xHC, App. A)          rows ≤ 1
=====================  =====================================  =========================
"""

from __future__ import annotations

import itertools
import math

import torch

from xhc.norms import fp32

SINKHORN_ORDERS = ("row_last", "col_last")
MHC_LITE_MAX_N = 6


# ----------------------------------------------------------------------------------------------
# Sinkhorn–Knopp (docs/math.md §1.4, [mHC] Eq. 9)
# ----------------------------------------------------------------------------------------------
def _sinkhorn_iterations(Z: torch.Tensor, t_max: int, eps: float, order: str) -> torch.Tensor:
    """The reference loop on fp32 logits ``Z``: ``[..., n, n]`` -> ``[..., n, n]``."""
    M = torch.exp(Z - Z.amax(-1, keepdim=True))  # row-max shift: every row holds a 1
    if order == "row_last":
        M = M / M.sum(-1, keepdim=True).clamp_min(eps)  # initial T_r (= row softmax)
        for _ in range(t_max):
            M = M / M.sum(-2, keepdim=True).clamp_min(eps)  # T_c
            M = M / M.sum(-1, keepdim=True).clamp_min(eps)  # T_r, always last
    else:  # "col_last" parity option: t_max × (T_r, T_c), no initial T_r
        for _ in range(t_max):
            M = M / M.sum(-1, keepdim=True).clamp_min(eps)
            M = M / M.sum(-2, keepdim=True).clamp_min(eps)
    return M


def _sinkhorn_steps(Z: torch.Tensor, t_max: int, order: str):
    """The normalisation axes of the reference loop, in order (-1: T_r, -2: T_c)."""
    if order == "row_last":
        return [-1] + [-2, -1] * t_max
    return [-1, -2] * t_max


def sinkhorn_backward(Z: torch.Tensor, grad_out: torch.Tensor, t_max: int, eps: float, order: str) -> torch.Tensor:
    """Hand-written adjoint of :func:`_sinkhorn_iterations` (docs/math.md §1.4): dL/dZ from dL/dH.

    Recomputes the iterations keeping only each step's denominators s_k (``[..., n]``, not the
    matrices), then walks back.  One step M' = M / d, d = max(s, ε), s = Σ_axis M:

        dM = (G' − [s ≥ ε] · Σ_axis(G' ⊙ M')) / d,      M = M' ⊙ d  (rebuilt, not stored)

    and the entry M_0 = exp(Z − max_row Z): dZ = G_0 ⊙ M_0, minus the row sum of that on the row
    maxima (shared equally among ties, as autograd's ``amax``).  Same values as autograd through
    the unrolled loop up to rounding; no autograd inside.  ``Z``, ``grad_out``: ``[..., n, n]``.
    """
    Z = fp32(Z)
    G = grad_out.to(Z.dtype)
    zmax = Z.amax(-1, keepdim=True)
    M0 = torch.exp(Z - zmax)
    M, sums = M0, []
    for axis in _sinkhorn_steps(Z, t_max, order):
        s = M.sum(axis, keepdim=True)
        sums.append(s)
        M = M / s.clamp_min(eps)
    for axis, s in zip(reversed(_sinkhorn_steps(Z, t_max, order)), reversed(sums)):
        d = s.clamp_min(eps)
        dot = (G * M).sum(axis, keepdim=True)
        G = (G - dot * (s >= eps).to(G.dtype)) / d
        M = M * d
    dZ = G * M0
    at_max = (Z == zmax).to(Z.dtype)
    return dZ - at_max * (dZ.sum(-1, keepdim=True) / at_max.sum(-1, keepdim=True))


class _SinkhornRecompute(torch.autograd.Function):
    """Sinkhorn as one op that saves only the logits; backward by :func:`sinkhorn_backward`.

    Memory is O(n²) per token instead of O(t_max · n²): needed at N = 16 (docs/math.md §1.4).  No
    autograd call inside backward, so ``torch.compile(fullgraph=True)`` traces it whole.
    """

    @staticmethod
    def forward(ctx, Z, t_max, eps, order):
        ctx.save_for_backward(Z)
        ctx.cfg = (t_max, eps, order)
        return _sinkhorn_iterations(Z, t_max, eps, order)

    @staticmethod
    def backward(ctx, grad_out):
        (Z,) = ctx.saved_tensors
        return sinkhorn_backward(Z, grad_out, *ctx.cfg), None, None, None


def sinkhorn(
    Z: torch.Tensor,
    t_max: int = 20,
    eps: float = 1e-6,
    order: str = "row_last",
    recompute: bool = False,
) -> torch.Tensor:
    """Sinkhorn–Knopp projection of logits onto (approximately) doubly stochastic matrices.

    Args:
        Z: logits ``[..., n, n]``; any float dtype, computed in fp32 (bf16 inputs are upcast).
        t_max: number of (T_c, T_r) iteration pairs; 0 gives the row softmax.
        eps: clamp on every denominator (clamped, not added).
        order: ``"row_last"`` (default, rows exact) or ``"col_last"`` (parity option).
        recompute: use the memory-saving autograd function (same values and gradients).

    Returns:
        fp32 ``[..., n, n]``, entries ≥ 0, finite for any finite logits.
    """
    if order not in SINKHORN_ORDERS:
        raise ValueError(f"sinkhorn order={order!r}: allowed values are {SINKHORN_ORDERS}")
    if t_max < 0:
        raise ValueError(f"sinkhorn t_max={t_max}: must be >= 0")
    Z = fp32(Z)
    if recompute and torch.is_grad_enabled() and Z.requires_grad:
        return _SinkhornRecompute.apply(Z, t_max, eps, order)
    return _sinkhorn_iterations(Z, t_max, eps, order)


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4's Sinkhorn (docs/math.md §2.h): softmax + ε start, column first, + ε denominators
# ----------------------------------------------------------------------------------------------
def _sinkhorn_deepseek_iterations(Z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The reference loop on fp32 logits ``Z`` ``[..., n, n]``: M = softmax(Z, −1) + ε, one column
    normalisation, then (iters − 1) × (row, column), each M / (Σ M + ε)."""
    M = torch.softmax(Z, -1) + eps
    M = M / (M.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        M = M / (M.sum(-1, keepdim=True) + eps)
        M = M / (M.sum(-2, keepdim=True) + eps)
    return M


def _sinkhorn_deepseek_steps(iters: int):
    """The normalisation axes of :func:`_sinkhorn_deepseek_iterations`, in order (-1: row, -2: column)."""
    return [-2] + [-1, -2] * (iters - 1)


def sinkhorn_deepseek_backward(Z: torch.Tensor, grad_out: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Hand-written adjoint of :func:`_sinkhorn_deepseek_iterations`: dL/dZ from dL/dM.

    As :func:`sinkhorn_backward`, with d = s + ε (so every step passes its gradient):
    dM = (G' − Σ_axis(G' ⊙ M')) / d, M = M' ⊙ d; at the start M_0 = p + ε, p = softmax(Z):
    dZ = p ⊙ (G_0 − Σ_row(G_0 ⊙ p)).  ``Z``, ``grad_out``: ``[..., n, n]``.
    """
    Z = fp32(Z)
    G = grad_out.to(Z.dtype)
    p = torch.softmax(Z, -1)
    M, sums = p + eps, []
    steps = _sinkhorn_deepseek_steps(iters)
    for axis in steps:
        s = M.sum(axis, keepdim=True)
        sums.append(s)
        M = M / (s + eps)
    for axis, s in zip(reversed(steps), reversed(sums)):
        d = s + eps
        G = (G - (G * M).sum(axis, keepdim=True)) / d
        M = M * d
    return p * (G - (G * p).sum(-1, keepdim=True))


class _SinkhornDeepseekRecompute(torch.autograd.Function):
    """:func:`sinkhorn_deepseek` as one op saving only the logits (backward: :func:`sinkhorn_deepseek_backward`)."""

    @staticmethod
    def forward(ctx, Z, iters, eps):
        ctx.save_for_backward(Z)
        ctx.cfg = (iters, eps)
        return _sinkhorn_deepseek_iterations(Z, iters, eps)

    @staticmethod
    def backward(ctx, grad_out):
        (Z,) = ctx.saved_tensors
        return sinkhorn_deepseek_backward(Z, grad_out, *ctx.cfg), None, None


def sinkhorn_deepseek(Z: torch.Tensor, iters: int = 20, eps: float = 1e-6, recompute: bool = False) -> torch.Tensor:
    """DeepSeek-V4's ``comb`` from its logits (docs/math.md §2.h; transformers' ``DeepseekV4HyperConnection``).

    comb = softmax(Z, −1) + ε; comb /= Σ_rows comb + ε (columns); then (iters − 1) × (rows, columns),
    each with + ε in the denominator.  The write uses combᵀ (§2.h): H_res = combᵀ.

    Args:
        Z: logits ``[..., n, n]`` (already α·proj + b), computed in fp32 (float64 stays float64).
        iters: ``hc_sinkhorn_iters`` (≥ 1).
        eps: ``hc_eps``, added (not clamped) to the start and to every denominator.
        recompute: the memory-saving op (same values; backward by :func:`sinkhorn_deepseek_backward`).

    Returns:
        ``[..., n, n]``, entries > 0; columns sum to s/(s + ε) < 1 after the last step.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn_deepseek iters={iters}: must be >= 1 (the first column normalisation)")
    Z = fp32(Z)
    if recompute and torch.is_grad_enabled() and Z.requires_grad:
        return _SinkhornDeepseekRecompute.apply(Z, iters, eps)
    return _sinkhorn_deepseek_iterations(Z, iters, eps)


# ----------------------------------------------------------------------------------------------
# mHC-lite (docs/math.md §2.c): convex combination of all n! permutation matrices
# ----------------------------------------------------------------------------------------------
_PERMUTATIONS: dict = {}  # n -> [n!, n, n] (a plain dict: torch.compile traces a lookup, not an lru_cache)


def _permutation_matrices_cpu(n: int) -> torch.Tensor:
    P = _PERMUTATIONS.get(n)
    if P is not None:
        return P
    perms = list(itertools.permutations(range(n)))  # lexicographic; r = 0 is the identity
    # built as a normal tensor even when the first call comes under torch.inference_mode(): a cached
    # inference tensor could not be used by a later forward that autograd records
    with torch.inference_mode(False):
        P = torch.zeros(len(perms), n, n)
        for r, pi in enumerate(perms):
            P[r, torch.arange(n), torch.tensor(pi)] = 1.0  # P_r[i, π_r(i)] = 1
    _PERMUTATIONS[n] = P
    return P


def permutation_matrices(n: int, device=None) -> torch.Tensor:
    """All n! permutation matrices ``[n!, n, n]`` in itertools order; ``(P_r X)_i = X_{π_r(i)}``."""
    if n > MHC_LITE_MAX_N:
        raise ValueError(
            f"mhc_lite n={n}: n! = {math.factorial(n)} permutations is too many; "
            f"use n <= {MHC_LITE_MAX_N} or variant='kromhc'"
        )
    return _permutation_matrices_cpu(n).to(device)


def mhc_lite_mix(logits: torch.Tensor, n: int) -> torch.Tensor:
    """H_res = Σ_r softmax(z)_r · P_r.  ``logits``: ``[..., n!]`` -> fp32 ``[..., n, n]``."""
    P = permutation_matrices(n, logits.device).to(fp32(logits).dtype)
    if logits.shape[-1] != P.shape[0]:
        raise ValueError(f"mhc_lite logits have {logits.shape[-1]} entries, expected n! = {P.shape[0]}")
    a = torch.softmax(fp32(logits), dim=-1)
    return torch.einsum("...r,rij->...ij", a, P)


# ----------------------------------------------------------------------------------------------
# KromHC (docs/math.md §2.d): Kronecker product of log2(n) 2×2 doubly stochastic factors
# ----------------------------------------------------------------------------------------------
def kromhc_num_factors(n: int) -> int:
    """log2(n); raises a clear error unless n is a power of two ≥ 2."""
    if n < 2 or (n & (n - 1)) != 0:
        raise ValueError(f"kromhc n={n}: n must be a power of two >= 2 (2, 4, 8, 16, ...)")
    return n.bit_length() - 1


def kromhc_factors(logits: torch.Tensor) -> torch.Tensor:
    """2×2 factors U_t = p_t·I + q_t·S.  ``logits``: ``[..., 2K]`` -> ``[..., K, 2, 2]``."""
    K = logits.shape[-1] // 2
    pq = torch.softmax(fp32(logits).unflatten(-1, (K, 2)), dim=-1)  # [..., K, 2] = (p, q)
    p, q = pq[..., 0], pq[..., 1]
    row0 = torch.stack([p, q], -1)
    row1 = torch.stack([q, p], -1)
    return torch.stack([row0, row1], -2)


def kromhc_mix(logits: torch.Tensor, n: int) -> torch.Tensor:
    """H_res = U_0 ⊗ … ⊗ U_{K−1} (U_0 on the most significant bit).

    ``logits``: ``[..., 2·log2 n]`` (pairs [identity, swap]) -> fp32 ``[..., n, n]``.
    """
    K = kromhc_num_factors(n)
    if logits.shape[-1] != 2 * K:
        raise ValueError(f"kromhc logits have {logits.shape[-1]} entries, expected 2*log2(n) = {2 * K}")
    U = kromhc_factors(logits)
    H = U[..., 0, :, :]
    for t in range(1, K):
        Ut = U[..., t, :, :]
        # batched Kronecker product: (H ⊗ Ut)[(a,c),(b,d)] = H[a,b]·Ut[c,d]
        H = (H[..., :, None, :, None] * Ut[..., None, :, None, :]).flatten(-4, -3).flatten(-2, -1)
    return H


# ----------------------------------------------------------------------------------------------
# Identity and the row-sum clamp
# ----------------------------------------------------------------------------------------------
def identity_mix(n: int, batch_shape=(), device=None) -> torch.Tensor:
    """H_res = I_n, broadcast to ``[*batch_shape, n, n]``."""
    return torch.eye(n, device=device).expand(*batch_shape, n, n)


def clamp_rows(H: torch.Tensor) -> torch.Tensor:
    """Row-sum clamp (docs/math.md §2.f): H[i,:] ← H[i,:] / max(Σ_j H[i,j], 1).  ``[..., n, n]``."""
    return H / H.sum(-1, keepdim=True).clamp_min(1.0)
