"""Sinkhorn kernels (the ``triton`` backend's :func:`xhc.kernels.sinkhorn` and
:func:`xhc.kernels.sinkhorn_deepseek`, docs/kernels.md): one program per block of matrices, the
iterations in registers.

=========================  ==============================================================================
:func:`sinkhorn`           the paper's Sinkhorn–Knopp (docs/math.md §1.4): row-max shift, ``t_max``
                           iterations in either order, denominators clamped at ε; backward: recompute keeping
                           the per-step denominators (a small scratch buffer), then the adjoint of
                           :func:`xhc.doubly_stochastic.sinkhorn_backward`
:func:`sinkhorn_deepseek`  DeepSeek-V4's comb (§2.h): softmax + ε start, column first, + ε denominators
=========================  ==============================================================================

:func:`sinkhorn_tile` / :func:`sinkhorn_tile_bwd` are the paper map on a ``[BT, NP, NP]`` tile in
registers, which the fused mHC and xHC kernels call in their epilogues; :func:`ds_start`, :func:`ds_step`
and :func:`ds_step_bwd` are DeepSeek-V4's steps, shared by the standalone kernels and the fused mHC
epilogue (:mod:`.mhc_pre`).  Both maps start from :func:`sk_start` (the row-max shifted exponentials).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels.common import cast, np2, tl_dtype


# ================================================================================================
# Sinkhorn
# ================================================================================================
@triton.jit
def _sk_load(Z, T, n, BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    mask = (t < T) & (i < n) & (j < n)
    offs = t * n * n + i * n + j
    z = tl.load(Z + offs, mask=mask, other=0.0).to(CDT)
    return z, mask, offs


@triton.jit
def _sinkhorn_fwd_kernel(Z, OUT, T, n, t_max, eps, ROW_LAST: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr,
                         CDT: tl.constexpr):
    z, mask, offs = _sk_load(Z, T, n, BT, NP, CDT)
    M = sinkhorn_tile(z, mask, t_max, eps, ROW_LAST, False)
    tl.store(OUT + offs, cast(M, OUT), mask=mask)


@triton.jit
def _sk_row_fwd(M, S, base, k, eps, NS: tl.constexpr, NP: tl.constexpr):
    s = tl.sum(M, 2)  # [BT, NP] over i
    tl.store(S + base + k * NP + tl.arange(0, NP)[None, :], s)
    return M / tl.maximum(s, eps)[:, :, None]


@triton.jit
def _sk_col_fwd(M, S, base, k, eps, NS: tl.constexpr, NP: tl.constexpr):
    s = tl.sum(M, 1)  # [BT, NP] over j
    tl.store(S + base + k * NP + tl.arange(0, NP)[None, :], s)
    return M / tl.maximum(s, eps)[:, None, :]


@triton.jit
def _sk_row_bwd(G, M, S, base, k, eps, NP: tl.constexpr):
    s = tl.load(S + base + k * NP + tl.arange(0, NP)[None, :])[:, :, None]
    d = tl.maximum(s, eps)
    dot = tl.sum(G * M, 2)[:, :, None]
    G = (G - tl.where(s >= eps, dot, 0.0)) / d
    return G, M * d


@triton.jit
def _sk_col_bwd(G, M, S, base, k, eps, NP: tl.constexpr):
    s = tl.load(S + base + k * NP + tl.arange(0, NP)[None, :])[:, None, :]
    d = tl.maximum(s, eps)
    dot = tl.sum(G * M, 1)[:, None, :]
    G = (G - tl.where(s >= eps, dot, 0.0)) / d
    return G, M * d


@triton.jit
def sk_start(z, mask):
    """(row max, exp(z − row max)) of a logit tile, 0 on the padding: Sinkhorn's positive start."""
    zm = tl.where(mask, z, float("-inf"))
    zmax = tl.max(zm, 2)[:, :, None]
    zmax = tl.where(zmax == float("-inf"), 0.0, zmax)
    return zmax, tl.where(mask, tl.exp(z - zmax), 0.0)


@triton.jit
def sinkhorn_tile(z, mask, t_max, sk_eps, ROW_LAST: tl.constexpr, CLAMP: tl.constexpr):
    """H = Sinkhorn(z) of a ``[BT, NP, NP]`` tile of logits in registers (row-max shift, ``t_max``
    iterations in either order, denominators clamped at ε), then the row-sum clamp when ``CLAMP``
    (docs/math.md §2.f: H[i, :] / max(Σ_j H[i, j], 1)); zero on the padding."""
    zmax, M = sk_start(z, mask)
    if ROW_LAST:
        M = M / tl.maximum(tl.sum(M, 2), sk_eps)[:, :, None]
        for _ in range(t_max):
            M = M / tl.maximum(tl.sum(M, 1), sk_eps)[:, None, :]
            M = M / tl.maximum(tl.sum(M, 2), sk_eps)[:, :, None]
    else:
        for _ in range(t_max):
            M = M / tl.maximum(tl.sum(M, 2), sk_eps)[:, :, None]
            M = M / tl.maximum(tl.sum(M, 1), sk_eps)[:, None, :]
    if CLAMP:
        M = M / tl.maximum(tl.sum(M, 2), 1.0)[:, :, None]
    return M


@triton.jit
def sinkhorn_tile_bwd(z, mask, Gd, S, base, t_max, sk_eps, ROW_LAST: tl.constexpr, CLAMP: tl.constexpr,
                      NS: tl.constexpr, NP: tl.constexpr):
    """dz of :func:`sinkhorn_tile` from dH = ``Gd`` (xhc.doubly_stochastic.sinkhorn_backward): the
    forward is recomputed with its per-step sums in the scratch ``S`` at ``base``, then every step's
    adjoint in reverse; the padding is kept at 0 after each step (else it grows by 1/ε per step)."""
    zmax, M0 = sk_start(z, mask)
    M = M0
    k = 0
    if ROW_LAST:
        M = _sk_row_fwd(M, S, base, k, sk_eps, NS, NP)
        k += 1
        for _ in range(t_max):
            M = _sk_col_fwd(M, S, base, k, sk_eps, NS, NP)
            M = _sk_row_fwd(M, S, base, k + 1, sk_eps, NS, NP)
            k += 2
    else:
        for _ in range(t_max):
            M = _sk_row_fwd(M, S, base, k, sk_eps, NS, NP)
            M = _sk_col_fwd(M, S, base, k + 1, sk_eps, NS, NP)
            k += 2
    if CLAMP:
        M = _sk_row_fwd(M, S, base, k, 1.0, NS, NP)
        Gd, M = _sk_row_bwd(Gd, M, S, base, k, 1.0, NP)
        Gd = tl.where(mask, Gd, 0.0)
    if ROW_LAST:
        for _ in range(t_max):
            Gd, M = _sk_row_bwd(Gd, M, S, base, k - 1, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            Gd, M = _sk_col_bwd(Gd, M, S, base, k - 2, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            k -= 2
        Gd, M = _sk_row_bwd(Gd, M, S, base, k - 1, sk_eps, NP)
        Gd = tl.where(mask, Gd, 0.0)
    else:
        for _ in range(t_max):
            Gd, M = _sk_col_bwd(Gd, M, S, base, k - 1, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            Gd, M = _sk_row_bwd(Gd, M, S, base, k - 2, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            k -= 2
    dz = Gd * M0
    at_max = tl.where(mask & (z == zmax), 1.0, 0.0).to(dz.dtype)
    cnt = tl.maximum(tl.sum(at_max, 2), 1.0)[:, :, None]
    return tl.where(mask, dz - at_max * (tl.sum(dz, 2)[:, :, None] / cnt), 0.0)


@triton.jit
def _sinkhorn_bwd_kernel(Z, DH, DZ, S, T, n, t_max, eps, ROW_LAST: tl.constexpr, NS: tl.constexpr,
                         BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    z, mask, offs = _sk_load(Z, T, n, BT, NP, CDT)
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)[:, None]
    base = t * NS * NP  # [BT, 1]; the scratch rows of padded tokens exist (S has BT-padded rows)
    G = tl.load(DH + offs, mask=mask, other=0.0).to(CDT)
    dZ = sinkhorn_tile_bwd(z, mask, G, S, base, t_max, eps, ROW_LAST, False, NS, NP)
    tl.store(DZ + offs, cast(dZ, DZ), mask=mask)


def _sk_block(n: int) -> int:
    return max(1, 256 // (np2(n) ** 2))


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Z, t_max, eps, order):
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        out = torch.empty_like(Zc)
        BT, NP = _sk_block(n), np2(n)
        grid = (triton.cdiv(T, BT),)
        _sinkhorn_fwd_kernel[grid](Zc, out, T, n, t_max, eps, order == "row_last", BT=BT, NP=NP, CDT=tl_dtype(Z.dtype))
        ctx.save_for_backward(Z)
        ctx.cfg = (t_max, eps, order)
        return out.view(Z.shape)

    @staticmethod
    def backward(ctx, dH):
        (Z,) = ctx.saved_tensors
        t_max, eps, order = ctx.cfg
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        BT, NP = _sk_block(n), np2(n)
        NS = 2 * t_max + (1 if order == "row_last" else 0)
        grid = (triton.cdiv(T, BT),)
        S = torch.empty(grid[0] * BT, max(NS, 1), NP, dtype=Zc.dtype, device=Z.device)
        dZ = torch.empty_like(Zc)
        _sinkhorn_bwd_kernel[grid](Zc, dH.reshape(-1, n, n).to(Zc.dtype).contiguous(), dZ, S, T, n, t_max, eps,
                                   order == "row_last", NS=max(NS, 1), BT=BT, NP=NP, CDT=tl_dtype(Z.dtype))
        return dZ.view(Z.shape), None, None, None


def sinkhorn(Z: torch.Tensor, t_max: int = 20, eps: float = 1e-6, order: str = "row_last") -> torch.Tensor:
    """Sinkhorn–Knopp ``[..., n, n]`` -> fp32 (float64 stays float64); saves only Z."""
    if order not in ("row_last", "col_last"):
        raise ValueError(f"sinkhorn order={order!r}: allowed values are ('row_last', 'col_last')")
    Z = Z if Z.dtype == torch.float64 else Z.float()
    return _Sinkhorn.apply(Z, t_max, eps, order)


# ================================================================================================
# DeepSeek-V4's Sinkhorn (docs/math.md §2.h): softmax + ε start, column first, + ε denominators
# ================================================================================================
@triton.jit
def ds_start(zres, mask3, sk_eps):
    """DeepSeek-V4: p = softmax(z, −1) on the valid entries and M_0 = p + ε (zero on padding); the standalone
    kernels and the fused mHC epilogue (:mod:`.mhc_pre`) share these tiles."""
    zmax, E = sk_start(zres, mask3)
    rs = tl.sum(E, 2)
    rs = tl.where(rs == 0.0, 1.0, rs)
    p = tl.where(mask3, E / rs[:, :, None], 0.0)
    return p, tl.where(mask3, p + sk_eps, 0.0)


@triton.jit
def ds_step(M, S, base, k, sk_eps, AXIS: tl.constexpr, STORE: tl.constexpr, NS: tl.constexpr, NP: tl.constexpr):
    """One DeepSeek-V4 normalisation M / (Σ_axis M + ε) (AXIS 2: rows, 1: columns), the sums kept in S."""
    s = tl.sum(M, AXIS)
    if STORE:
        tl.store(S + base + k * NP + tl.arange(0, NP)[None, :], s)
    if AXIS == 2:
        return M / (s + sk_eps)[:, :, None]
    else:
        return M / (s + sk_eps)[:, None, :]


@triton.jit
def ds_step_bwd(G, M, S, base, k, sk_eps, AXIS: tl.constexpr, NP: tl.constexpr):
    """The adjoint of :func:`ds_step`: G ← (G − Σ_axis G⊙M) / d, M ← M·d (d = s + ε: every step passes)."""
    if AXIS == 2:
        d = tl.load(S + base + k * NP + tl.arange(0, NP)[None, :])[:, :, None] + sk_eps
        G = (G - tl.sum(G * M, 2)[:, :, None]) / d
    else:
        d = tl.load(S + base + k * NP + tl.arange(0, NP)[None, :])[:, None, :] + sk_eps
        G = (G - tl.sum(G * M, 1)[:, None, :]) / d
    return G, M * d


@triton.jit
def _skd_start(Z, T, n, eps, BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    """p = softmax(Z, −1) and M_0 = p + ε on the real entries (0 on the padding)."""
    z, mask, offs = _sk_load(Z, T, n, BT, NP, CDT)
    p, M = ds_start(z, mask, eps)
    return p, M, mask, offs


@triton.jit
def _sinkhorn_ds_fwd_kernel(Z, OUT, T, n, iters, eps, BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    p, M, mask, offs = _skd_start(Z, T, n, eps, BT, NP, CDT)
    M = ds_step(M, OUT, 0, 0, eps, 1, False, 1, NP)
    for _ in range(iters - 1):
        M = ds_step(M, OUT, 0, 0, eps, 2, False, 1, NP)
        M = ds_step(M, OUT, 0, 0, eps, 1, False, 1, NP)
    tl.store(OUT + offs, cast(M, OUT), mask=mask)


@triton.jit
def _sinkhorn_ds_bwd_kernel(Z, DH, DZ, S, T, n, iters, eps, NS: tl.constexpr, BT: tl.constexpr,
                            NP: tl.constexpr, CDT: tl.constexpr):
    p, M, mask, offs = _skd_start(Z, T, n, eps, BT, NP, CDT)
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)[:, None]
    base = t * NS * NP  # [BT, 1]
    M = ds_step(M, S, base, 0, eps, 1, True, NS, NP)
    k = 1
    for _ in range(iters - 1):
        M = ds_step(M, S, base, k, eps, 2, True, NS, NP)
        M = ds_step(M, S, base, k + 1, eps, 1, True, NS, NP)
        k += 2
    G = tl.load(DH + offs, mask=mask, other=0.0).to(CDT)
    for _ in range(iters - 1):
        G, M = ds_step_bwd(G, M, S, base, k - 1, eps, 1, NP)
        G = tl.where(mask, G, 0.0)  # padding kept at 0 (its d is ε)
        G, M = ds_step_bwd(G, M, S, base, k - 2, eps, 2, NP)
        G = tl.where(mask, G, 0.0)
        k -= 2
    G, M = ds_step_bwd(G, M, S, base, 0, eps, 1, NP)
    G = tl.where(mask, G, 0.0)
    dZ = p * (G - tl.sum(G * p, 2)[:, :, None])
    tl.store(DZ + offs, cast(dZ, DZ), mask=mask)


class _SinkhornDeepseek(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Z, iters, eps):
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        out = torch.empty_like(Zc)
        BT, NP = _sk_block(n), np2(n)
        grid = (triton.cdiv(T, BT),)
        _sinkhorn_ds_fwd_kernel[grid](Zc, out, T, n, iters, eps, BT=BT, NP=NP, CDT=tl_dtype(Z.dtype))
        ctx.save_for_backward(Z)
        ctx.cfg = (iters, eps)
        return out.view(Z.shape)

    @staticmethod
    def backward(ctx, dH):
        (Z,) = ctx.saved_tensors
        iters, eps = ctx.cfg
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        BT, NP = _sk_block(n), np2(n)
        NS = 2 * iters - 1
        grid = (triton.cdiv(T, BT),)
        S = torch.empty(grid[0] * BT, NS, NP, dtype=Zc.dtype, device=Z.device)
        dZ = torch.empty_like(Zc)
        _sinkhorn_ds_bwd_kernel[grid](Zc, dH.reshape(-1, n, n).to(Zc.dtype).contiguous(), dZ, S, T, n, iters, eps,
                                      NS=NS, BT=BT, NP=NP, CDT=tl_dtype(Z.dtype))
        return dZ.view(Z.shape), None, None


def sinkhorn_deepseek(Z: torch.Tensor, iters: int = 20, eps: float = 1e-6) -> torch.Tensor:
    """DeepSeek-V4's Sinkhorn ``[..., n, n]`` -> fp32 (float64 stays float64); saves only Z
    (:func:`xhc.doubly_stochastic.sinkhorn_deepseek`, backward as its adjoint)."""
    if iters < 1:
        raise ValueError(f"sinkhorn_deepseek iters={iters}: must be >= 1")
    Z = Z if Z.dtype == torch.float64 else Z.float()
    return _SinkhornDeepseek.apply(Z, iters, eps)
