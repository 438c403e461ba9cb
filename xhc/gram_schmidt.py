"""Gram–Schmidt over the write-back components of one token (docs/math.md §3.3, §8 #20).

xHC writes K_r components V = [y, g_1, …, g_r] per token (§3.2).  Before the write they are
made mutually orthogonal along C by *modified* Gram–Schmidt, without normalising to unit length:

    v_1     = y                                                        (unchanged, bitwise)
    v_{j+1} = g_j, then for each earlier v in order:  v_{j+1} ← v_{j+1} − a·v,
              a = mean(v_{j+1}·v) / (mean(v·v) + ε)

Dot products are *means* over C, so ε sits on the same scale as the RMSNorm ε (§1.5).  The guard
gives a zero component coefficient 0 (it is passed over, not divided by), and leaves a residual
overlap of ⟨w, v⟩·ε / (mean(v²) + ε) after each projection.  In exact arithmetic and with ε = 0
this equals the classical form v_{j+1} = g_j − Σ_i (⟨g_j, v_i⟩/⟨v_i, v_i⟩)·v_i; MGS is the
reference because it is the numerically stable ordering.

The switch (``HCConfig.gram_schmidt``) lives in the caller: off under Muon ([xHC] §4.6).
"""

from __future__ import annotations

import torch

from xhc.norms import fp32

DEFAULT_GS_EPS = 1e-6


def gram_schmidt(V: torch.Tensor, eps: float = DEFAULT_GS_EPS) -> torch.Tensor:
    """Modified Gram–Schmidt over the component axis, per token (docs/math.md §3.3).

    Args:
        V: ``[..., K, C]`` components, first one ``y``; any float dtype.
        eps: guard added to each ``mean(v²)`` denominator (≥ 0).

    Returns:
        ``[..., K, C]`` in fp32 (float64 stays float64); component 0 equals ``V[..., 0, :]``
        (upcast) bit for bit.
    """
    if V.dim() < 2:
        raise ValueError(f"gram_schmidt V has shape {tuple(V.shape)}: expected [..., K, C]")
    if eps < 0:
        raise ValueError(f"gram_schmidt eps={eps}: must be >= 0")
    V = fp32(V)
    out = [V[..., 0, :]]  # v_1 = y, unchanged
    for j in range(1, V.shape[-2]):
        w = V[..., j, :]
        for v in out:  # subtract one projection at a time (modified GS)
            coef = (w * v).mean(-1, keepdim=True) / ((v * v).mean(-1, keepdim=True) + eps)
            w = w - coef * v
        out.append(w)
    return torch.stack(out, dim=-2)


def gram_schmidt_coefficients(M: torch.Tensor, eps: float = DEFAULT_GS_EPS) -> torch.Tensor:
    """The same modified Gram–Schmidt as :func:`gram_schmidt`, run on coefficient vectors: returns
    ``L`` ``[..., K, K]`` (lower triangular, unit diagonal) with ``gram_schmidt(V) = L · V`` (docs/math.md §3.3).

    ``M`` ``[..., K, K]`` is the Gram matrix of *means*, M[a, b] = mean_c(V_a · V_b).  Every
    partial vector of the MGS loop is a combination w = cᵀV of the components, so its dot products
    are mean(w · v) = cᵀ M l (v = lᵀV): the loop below performs exactly the projections and ε guards of
    :func:`gram_schmidt` on K-vectors, and never touches a C-long vector.  Equal in exact arithmetic;
    in floating point the two differ by rounding of order cond(M)·u.  Used by the fused kernels,
    where the write then applies P·L to the raw components (no orthogonalised copy of V is stored).
    """
    if M.dim() < 2 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"gram_schmidt_coefficients M has shape {tuple(M.shape)}: expected [..., K, K]")
    if eps < 0:
        raise ValueError(f"gram_schmidt_coefficients eps={eps}: must be >= 0")
    K = M.shape[-1]
    eye = torch.eye(K, dtype=M.dtype, device=M.device)
    rows = [eye[0].expand(M.shape[:-1])]  # v_1 = y
    for j in range(1, K):
        c = eye[j].expand(M.shape[:-1])
        for l in rows:
            Ml = (M * l.unsqueeze(-2)).sum(-1)  # M l
            coef = (c * Ml).sum(-1, keepdim=True) / ((l * Ml).sum(-1, keepdim=True) + eps)
            c = c - coef * l
        rows.append(c)
    return torch.stack(rows, dim=-2)
