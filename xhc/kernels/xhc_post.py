"""Fused xHC MLP write (``xhc_post``): the temporal components, their Gram–Schmidt coefficients and the
sparse write of one xHC sublayer in one kernel (docs/math.md §3.2, §3.3, §3.5).

Forward (:func:`_xhc_post_fwd_kernel`, a program per token):

1. a pass over C: the components V = [y, g_1, …, g_r] with g_j[t] = Σ_i w_j[i]·y[t − i] (causal,
   tap i dropped where the token is fewer than i rows into the sequence or its document), and their
   Gram matrix of means M = V·Vᵀ / C;
2. in registers: the modified Gram–Schmidt coefficients L (:func:`xhc.gram_schmidt.gram_schmidt_coefficients`,
   gram_schmidt(V) = L·V) and the folded branch weights P' = P·L;
3. a second pass: X'[I_j] = Σ_q H_res[j, q]·X[I_q] + Σ_t P'[j, t]·V_t (V recomputed from the taps of y,
   never stored), the other rows copied.

    byte budget, per token, state dtype s:  N·C·s (X: k rows read, N − k copied) + N·C·s (X') + C·s (y,
    its κ_max − 1 earlier rows come from L2)  (+ 4·(k² + k·K + K²) coefficients)

Backward: :func:`_xhc_post_bwd_kernel` (a program per token): dH_res, dP' in a pass over dX' (and X, V);
the adjoints of the fold and of the Gram–Schmidt loop (a hand-written reverse of its ≤ 6 steps, each
step's input recomputed) give dP and dM; a second pass writes dV = P'ᵀ·dX'_a + (dM + dMᵀ)·V / C.
The state's term is handed to the entry's backward (:mod:`.xhc_grad`; a Flash window's last write:
dX' on the rows outside I, to the window entry), or written here when no entry op owns the state.  :func:`_xhc_conv_bwd_kernel` (a program per BC columns, every token in
order: deterministic, no partials) writes dy = dV_0 + Σ_j Σ_i w_j[i]·dV_j[t + i] and dw_j[i] = Σ_t dV_j[t]·y[t − i].

    byte budget:  2·N·C·s (dX' in, X's active rows) + 4·K·C (dV) + C·s (y) + C·s (dy)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, np2, tl_dtype

MAX_KERNELS = 3  # r ≤ 3 temporal kernels (K ≤ 4 components): the fused write's limit


def covers(temporal, X: torch.Tensor, y: torch.Tensor, seq) -> bool:
    """Whether the fused write covers a write with the temporal components of ``temporal`` (the xHC MLP
    sublayer, a Flash window's writes): an augmented write with at most :data:`MAX_KERNELS` kernels,
    ``[s, b, ·]`` tensors (``X`` the state or the carried X_a) and a sequence held whole by this rank (no
    halo exchange, segments or decode cache: those keep the separate ops)."""
    whole = seq is None or (seq.group is None and seq.segments is None and seq.decode_cache is None)
    return (temporal is not None and 0 < len(temporal.conv) <= MAX_KERNELS and whole and X.dim() == 4
            and y.dim() == 3)


@triton.jit
def _components(Y, W1, W2, W3, t, si, pos, B, C, c, cmk, k1, k2, k3, kmax, R: tl.constexpr, SP: tl.constexpr,
                HAS_POS: tl.constexpr, CDT: tl.constexpr):
    """V ``[SP, BC]``: row 0 y[t], row j the causal conv g_j[t] (taps i with si ≥ i and pos ≥ i)."""
    sr = tl.arange(0, SP)[:, None]
    y0 = tl.load(Y + t * C + c, mask=cmk, other=0.0).to(CDT)
    V = tl.where(sr == 0, y0[None, :], 0.0)
    if R > 0:
        for i in range(0, kmax):
            ok = cmk & (c * 0 + si >= i)  # vectors: the interpreter takes no 0-d masks here
            if HAS_POS:
                ok = ok & (c * 0 + pos >= i)
            yi = tl.load(Y + (t - i * B) * C + c, mask=ok, other=0.0).to(CDT)
            w1 = tl.load(W1 + i * C + c, mask=cmk & (c * 0 + i < k1), other=0.0).to(CDT)
            g = tl.where(sr == 1, (w1 * yi)[None, :], 0.0)
            if R > 1:
                w2 = tl.load(W2 + i * C + c, mask=cmk & (c * 0 + i < k2), other=0.0).to(CDT)
                g += tl.where(sr == 2, (w2 * yi)[None, :], 0.0)
            if R > 2:
                w3 = tl.load(W3 + i * C + c, mask=cmk & (c * 0 + i < k3), other=0.0).to(CDT)
                g += tl.where(sr == 3, (w3 * yi)[None, :], 0.0)
            V += g
    return V


@triton.jit
def _mgs_step(L, M, eps, j: tl.constexpr, i: tl.constexpr, SP: tl.constexpr):
    """One projection of modified Gram–Schmidt on coefficient rows: L[j] ← L[j] − coef·L[i]."""
    ar = tl.arange(0, SP)[:, None]
    c = tl.sum(tl.where(ar == j, L, 0.0), 0)
    lv = tl.sum(tl.where(ar == i, L, 0.0), 0)
    Ml = tl.sum(M * lv[None, :], 1)
    coef = tl.sum(c * Ml, 0) / (tl.sum(lv * Ml, 0) + eps)
    return tl.where(ar == j, (c - coef * lv)[None, :], L)


@triton.jit
def _mgs(M, eps, K: tl.constexpr, NSTEPS: tl.constexpr, SP: tl.constexpr):
    """L after the first ``NSTEPS`` projections (step (j, i) is number j(j−1)/2 + i), from L = I."""
    ar = tl.arange(0, SP)
    L = tl.where(ar[:, None] == ar[None, :], 1.0, 0.0).to(M.dtype)
    for j in tl.static_range(1, K):
        for i in tl.static_range(0, j):
            if j * (j - 1) // 2 + i < NSTEPS:
                L = _mgs_step(L, M, eps, j, i, SP)
    return L


@triton.jit
def _mgs_step_bwd(M, gL, gM, eps, K: tl.constexpr, j: tl.constexpr, i: tl.constexpr, SP: tl.constexpr):
    """The adjoint of projection (j, i) of :func:`_mgs`, its input recomputed: (gL, gM) updated."""
    ar = tl.arange(0, SP)[:, None]
    L = _mgs(M, eps, K, j * (j - 1) // 2 + i, SP)
    c = tl.sum(tl.where(ar == j, L, 0.0), 0)
    lv = tl.sum(tl.where(ar == i, L, 0.0), 0)
    Ml = tl.sum(M * lv[None, :], 1)
    num = tl.sum(c * Ml, 0)
    den = tl.sum(lv * Ml, 0) + eps
    coef = num / den
    gnew = tl.sum(tl.where(ar == j, gL, 0.0), 0)
    gc = gnew
    gl = -coef * gnew
    gcoef = -tl.sum(gnew * lv, 0)
    gnum = gcoef / den
    gden = -gcoef * num / (den * den)
    gc += gnum * Ml
    gMl = gnum * c
    gl += gden * Ml
    gMl += gden * lv
    gM += gMl[:, None] * lv[None, :]
    gl += tl.sum(M * gMl[:, None], 0)
    gL = tl.where(ar == j, gc[None, :], gL)
    gL = tl.where(ar == i, gL + gl[None, :], gL)
    return gL, gM


@triton.jit
def _mgs_bwd(M, gL, eps, K: tl.constexpr, SP: tl.constexpr):
    """dM from dL for :func:`_mgs` with every step: the steps in reverse (≤ 6 for K ≤ 4)."""
    gM = tl.zeros([SP, SP], dtype=M.dtype)
    for jr in tl.static_range(1, K):
        for ir in tl.static_range(0, K - jr):
            gL, gM = _mgs_step_bwd(M, gL, gM, eps, K, K - jr, K - jr - 1 - ir, SP)
    return gM


@triton.jit
def _xhc_post_fwd_kernel(X, XA, I, H, P, Y, W1, W2, W3, POS, OUT, MS, N, k, K, C, B, k1, k2, k3, kmax, gs_eps,
                         R: tl.constexpr, GS: tl.constexpr, HAS_POS: tl.constexpr, CARRIED: tl.constexpr,
                         EXIT: tl.constexpr, HAS_H: tl.constexpr, NP: tl.constexpr,
                         KP: tl.constexpr, SP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    si = t // B
    pos = 0
    if HAS_POS:
        pos = tl.load(POS + t)
    jr = tl.arange(0, KP)[:, None]
    qc = tl.arange(0, KP)[None, :]
    sc = tl.arange(0, SP)[None, :]
    sr = tl.arange(0, SP)[:, None]
    p = tl.load(P + t * k * K + jr * K + sc, mask=(jr < k) & (sc < K), other=0.0).to(CDT)  # [KP, SP]
    if GS:  # 1. the Gram matrix of means, 2. L and P' = P·L
        M = tl.zeros([SP, SP], dtype=CDT)
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            V = _components(Y, W1, W2, W3, t, si, pos, B, C, c, c < C, k1, k2, k3, kmax, R, SP, HAS_POS, CDT)
            M += tl.sum(V[:, None, :] * V[None, :, :], 2)
        M = M / C
        tl.store(MS + t * SP * SP + sr * SP + sc, M)
        L = _mgs(M, gs_eps, R + 1, (R + 1) * R // 2, SP)
        p = tl.sum(p[:, :, None] * L[None, :, :], 1)
    if HAS_H:  # else no mixing (a Flash carried write before the window's last): H = I_k
        h = tl.load(H + t * k * k + jr * k + qc, mask=(jr < k) & (qc < k), other=0.0).to(CDT)
    rows = jr
    keep = jr < 0
    nr = tl.arange(0, NP)[:, None]
    if EXIT:
        rows = tl.load(I + t * k + jr, mask=jr < k, other=0)
        idx_row = tl.load(I + t * k + qc, mask=qc < k, other=-1)
        keep = (nr < N) & (tl.sum(tl.where(nr == idx_row, 1, 0), 1)[:, None] == 0)
    for c0 in range(0, C, BC):  # 3. the write
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        V = _components(Y, W1, W2, W3, t, si, pos, B, C, c, cmk, k1, k2, k3, kmax, R, SP, HAS_POS, CDT)
        if CARRIED:  # X_a carried by a Flash window, [T, k, C]
            xa = tl.load(XA + t * k * C + jr * C + c[None, :], mask=(jr < k) & cmk[None, :], other=0.0).to(CDT)
        else:
            xa = tl.load(X + t * N * C + rows * C + c[None, :], mask=(jr < k) & cmk[None, :], other=0.0).to(CDT)
        new = tl.sum(p[:, :, None] * V[None, :, :], 1)
        if HAS_H:
            new += tl.sum(h[:, :, None] * xa[None, :, :], 1)
        else:
            new += xa
        if EXIT:
            tl.store(OUT + t * N * C + rows * C + c[None, :], cast(new, OUT), mask=(jr < k) & cmk[None, :])
            x = tl.load(X + t * N * C + nr * C + c[None, :], mask=keep & cmk[None, :], other=0.0)
            tl.store(OUT + t * N * C + nr * C + c[None, :], x, mask=keep & cmk[None, :])
        else:
            tl.store(OUT + t * k * C + jr * C + c[None, :], cast(new, OUT), mask=(jr < k) & cmk[None, :])


@triton.jit
def _xhc_post_bwd_kernel(DOUT, X, XA, I, H, P, Y, W1, W2, W3, POS, MS, DX, DXA, DH, DP, DV, N, k, K, C, B, k1, k2, k3,
                         kmax, gs_eps, R: tl.constexpr, GS: tl.constexpr, HAS_POS: tl.constexpr, NEED_DX: tl.constexpr,
                         NEED_DXA: tl.constexpr, CARRIED: tl.constexpr, EXIT: tl.constexpr, HAS_H: tl.constexpr,
                         NP: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    si = t // B
    pos = 0
    if HAS_POS:
        pos = tl.load(POS + t)
    jr = tl.arange(0, KP)[:, None]
    qc = tl.arange(0, KP)[None, :]
    sc = tl.arange(0, SP)[None, :]
    sr = tl.arange(0, SP)[:, None]
    pmask = (jr < k) & (sc < K)
    p = tl.load(P + t * k * K + jr * K + sc, mask=pmask, other=0.0).to(CDT)  # [KP, SP]
    pf = p
    if GS:
        M = tl.load(MS + t * SP * SP + sr * SP + sc).to(CDT)
        L = _mgs(M, gs_eps, R + 1, (R + 1) * R // 2, SP)
        pf = tl.sum(p[:, :, None] * L[None, :, :], 1)
    hmask = (jr < k) & (qc < k)
    if HAS_H:  # else H = I_k
        h = tl.load(H + t * k * k + jr * k + qc, mask=hmask, other=0.0).to(CDT)
    rows = jr  # the rows of dX' that hold the new X_a: I (window exit, xHC) or 0..k-1 (carried)
    ostride = k * C
    if EXIT:
        rows = tl.load(I + t * k + jr, mask=jr < k, other=0)
        ostride = N * C
    dh = tl.zeros([KP, KP], dtype=CDT)
    dpf = tl.zeros([KP, SP], dtype=CDT)
    for c0 in range(0, C, BC):  # dH_res, dP' = Σ_c dX'_a ⊗ (X_a, V)
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        V = _components(Y, W1, W2, W3, t, si, pos, B, C, c, cmk, k1, k2, k3, kmax, R, SP, HAS_POS, CDT)
        dn = tl.load(DOUT + t * ostride + rows * C + c[None, :], mask=(jr < k) & cmk[None, :], other=0.0).to(CDT)
        if HAS_H:
            if CARRIED:
                xa = tl.load(XA + t * k * C + jr * C + c[None, :], mask=(jr < k) & cmk[None, :], other=0.0).to(CDT)
            else:
                xa = tl.load(X + t * N * C + rows * C + c[None, :], mask=(jr < k) & cmk[None, :], other=0.0).to(CDT)
            dh += tl.sum(dn[:, None, :] * xa[None, :, :], 2)
        dpf += tl.sum(dn[:, None, :] * V[None, :, :], 2)
    if HAS_H:
        tl.store(DH + t * k * k + jr * k + qc, dh, mask=hmask)
    if GS:  # P' = P·L: dP = dP'·Lᵀ, dL = Pᵀ·dP'; then the Gram–Schmidt adjoint gives dM
        dp = tl.sum(dpf[:, None, :] * L[None, :, :], 2)
        dL = tl.sum(p[:, :, None] * dpf[:, None, :], 0)
        gM = _mgs_bwd(M, dL, gs_eps, R + 1, SP)
        G2 = (gM + tl.trans(gM)) / C
    else:
        dp = dpf
    tl.store(DP + t * k * K + jr * K + sc, dp, mask=pmask)
    nr = tl.arange(0, NP)[:, None]
    outside = nr < 0
    if EXIT:
        idx_row = tl.load(I + t * k + qc, mask=qc < k, other=-1)
        outside = (nr < N) & (tl.sum(tl.where(nr == idx_row, 1, 0), 1)[:, None] == 0)
    for c0 in range(0, C, BC):  # dV = P'ᵀ·dX'_a (+ the Gram matrix's term); dX when no entry op owns it
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        dn = tl.load(DOUT + t * ostride + rows * C + c[None, :], mask=(jr < k) & cmk[None, :], other=0.0).to(CDT)
        dv = tl.sum(pf[:, :, None] * dn[:, None, :], 0)  # [SP, BC]
        if GS:
            V = _components(Y, W1, W2, W3, t, si, pos, B, C, c, cmk, k1, k2, k3, kmax, R, SP, HAS_POS, CDT)
            dv += tl.sum(G2[:, :, None] * V[None, :, :], 1)
        tl.store(DV + t * SP * C + sr * C + c[None, :], dv, mask=cmk[None, :])
        if NEED_DXA:  # carried: dX_a = H_resᵀ·dX'_a
            if HAS_H:
                dxa = tl.sum(h[:, :, None] * dn[:, None, :], 0)  # [KP(q), BC]
            else:
                dxa = dn
            tl.store(DXA + t * k * C + jr * C + c[None, :], cast(dxa, DXA), mask=(jr < k) & cmk[None, :])
        if NEED_DX:
            g = tl.load(DOUT + t * N * C + nr * C + c[None, :], mask=outside & cmk[None, :], other=0.0)
            if CARRIED:  # the entry state's active rows were replaced, not read: 0 there, dX' elsewhere
                tl.store(DX + t * N * C + nr * C + c[None, :], cast(g.to(CDT), DX), mask=(nr < N) & cmk[None, :])
            else:
                dxa = tl.sum(h[:, :, None] * dn[:, None, :], 0)  # [KP(q), BC]
                tl.store(DX + t * N * C + rows * C + c[None, :], cast(dxa, DX), mask=(jr < k) & cmk[None, :])
                tl.store(DX + t * N * C + nr * C + c[None, :], cast(g.to(CDT), DX), mask=outside & cmk[None, :])


@triton.jit
def _xhc_conv_bwd_kernel(DV, Y, W1, W2, W3, POS, DY, DW1, DW2, DW3, T, C, B, k1, k2, k3, kmax,
                         R: tl.constexpr, HAS_POS: tl.constexpr, SP: tl.constexpr, KMP: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    cmk = c < C
    ti = tl.arange(0, KMP)[:, None]
    acc1 = tl.zeros([KMP, BC], dtype=CDT)
    acc2 = tl.zeros([KMP, BC], dtype=CDT)
    acc3 = tl.zeros([KMP, BC], dtype=CDT)
    for t0 in range(0, T, BT):  # every token in order: the same sums every run
        t = (t0 + tl.arange(0, BT)).to(tl.int64)
        tm = t < T
        si = t // B
        m2 = tm[:, None] & cmk[None, :]
        dy = tl.load(DV + t[:, None] * SP * C + c[None, :], mask=m2, other=0.0).to(CDT)  # dV_0
        for i in range(0, kmax):
            # dy[t] += Σ_j w_j[i]·dV_j[t + i] where the later token keeps tap i
            tn = t + i * B
            ok = tm & (tn < T)
            if HAS_POS:
                ok = ok & (tl.load(POS + tn, mask=ok, other=0) >= i)
            okm = ok[:, None] & cmk[None, :]
            # dw_j[i] += Σ_t dV_j[t]·y[t − i] where token t keeps tap i
            back = tm & (si >= i)
            if HAS_POS:
                back = back & (tl.load(POS + t, mask=tm, other=0) >= i)
            bm = back[:, None] & cmk[None, :]
            yb = tl.load(Y + (t - i * B)[:, None] * C + c[None, :], mask=bm, other=0.0).to(CDT)
            w1 = tl.load(W1 + i * C + c, mask=cmk & (c * 0 + i < k1), other=0.0).to(CDT)
            d1 = tl.load(DV + tn[:, None] * SP * C + C + c[None, :], mask=okm, other=0.0).to(CDT)
            dy += w1[None, :] * d1
            v1 = tl.load(DV + t[:, None] * SP * C + C + c[None, :], mask=bm, other=0.0).to(CDT)
            acc1 += tl.where(ti == i, tl.sum(v1 * yb, 0)[None, :], 0.0)
            if R > 1:
                w2 = tl.load(W2 + i * C + c, mask=cmk & (c * 0 + i < k2), other=0.0).to(CDT)
                d2 = tl.load(DV + tn[:, None] * SP * C + 2 * C + c[None, :], mask=okm, other=0.0).to(CDT)
                dy += w2[None, :] * d2
                v2 = tl.load(DV + t[:, None] * SP * C + 2 * C + c[None, :], mask=bm, other=0.0).to(CDT)
                acc2 += tl.where(ti == i, tl.sum(v2 * yb, 0)[None, :], 0.0)
            if R > 2:
                w3 = tl.load(W3 + i * C + c, mask=cmk & (c * 0 + i < k3), other=0.0).to(CDT)
                d3 = tl.load(DV + tn[:, None] * SP * C + 3 * C + c[None, :], mask=okm, other=0.0).to(CDT)
                dy += w3[None, :] * d3
                v3 = tl.load(DV + t[:, None] * SP * C + 3 * C + c[None, :], mask=bm, other=0.0).to(CDT)
                acc3 += tl.where(ti == i, tl.sum(v3 * yb, 0)[None, :], 0.0)
        tl.store(DY + t[:, None] * C + c[None, :], cast(dy, DY), mask=m2)
    tl.store(DW1 + ti * C + c[None, :], acc1, mask=(ti < k1) & cmk[None, :])
    if R > 1:
        tl.store(DW2 + ti * C + c[None, :], acc2, mask=(ti < k2) & cmk[None, :])
    if R > 2:
        tl.store(DW3 + ti * C + c[None, :], acc3, mask=(ti < k3) & cmk[None, :])


def _meta(N: int, k: int, K: int, C: int):
    NP, KP, SP = np2(N), max(2, np2(k)), 4
    BC = max(16, min(triton.next_power_of_2(C), 2048 // max(NP, KP * SP)))
    return NP, KP, SP, BC


class XHCPost(torch.autograd.Function):
    """The fused MLP write; modes (module docstring): the xHC sublayer (``Xa`` None: X_a = X[I], the
    exit into X), a Flash window's carried write (``Xa`` given; ``X`` None: the new X_a) and its last
    write (``Xa`` and ``X``: the new X_a scattered into the window-entry state X).  ``H`` None: no mixing."""

    @staticmethod
    def forward(ctx, X, Xa, I, H, P, y, w1, w2, w3, pos, gs, gs_eps):
        lead = P.shape[:-2]
        s, B = lead
        k, K = P.shape[-2:]
        C = y.shape[-1]
        carried, exit_ = Xa is not None, X is not None
        if not (carried or (exit_ and H is not None and I is not None)):
            raise ValueError("xhc_post: the xHC sublayer's write needs X, I and H_res (a write without Xa)")
        N = X.shape[-2] if exit_ else k
        T = s * B
        ws = [w for w in (w1, w2, w3) if w is not None]
        R = len(ws)
        ks = [w.shape[0] for w in ws] + [0] * (3 - R)
        kmax = max(ks + [1])
        cdt = compute_dtype(*(t for t in (X, Xa, H, P, y) if t is not None))
        c = lambda t, *sh: None if t is None else t.reshape(*sh).contiguous()  # noqa: E731
        Xc, Xac, Ic = c(X, T, N, C), c(Xa, T, k, C), c(I, T, k)
        Hc, Pc, yc = c(H, T, k, k), c(P, T, k, K), c(y, T, C)
        posc = c(pos, T)
        ref = X if exit_ else Xa
        out = torch.empty(T, N if exit_ else k, C, dtype=ref.dtype, device=ref.device)
        NP, KP, SP, BC = _meta(N, k, K, C)
        GS = bool(gs) and R > 0
        MS = torch.empty(T, SP, SP, dtype=cdt, device=ref.device) if GS else None
        if T > 0:
            _xhc_post_fwd_kernel[(T,)](Xc, Xac, Ic, Hc, Pc, yc, *(ws + [None] * (3 - R)), posc, out, MS, N, k, K, C, B,
                                       *ks, kmax, gs_eps, R=R, GS=GS, HAS_POS=posc is not None, CARRIED=carried,
                                       EXIT=exit_, HAS_H=H is not None, NP=NP, KP=KP, SP=SP, BC=BC, CDT=tl_dtype(cdt))
        ctx.save_for_backward(X, Xa, I, H, P, y, w1, w2, w3, pos, MS)
        ctx.meta = (GS, gs_eps, R, ks, kmax, N)
        # the entry op on this state writes dX (xHC sublayer: X' mixes X's active rows; a window's last
        # write: X' copies X's rows outside I, the carried X_a replaced the rest), so dX is written once
        ctx.owner = sg.claim(X, "write", (H, P)) if exit_ else None
        # a window's carried X_a: the op that made P from it adds this write's dX_a (state_grad.claim_carried)
        ctx.xa_owner = sg.claim_carried(Xa, P) if carried else None
        return out.view(*lead, N if exit_ else k, C)

    @staticmethod
    def backward(ctx, dout):
        X, Xa, I, H, P, y, w1, w2, w3, pos, MS = ctx.saved_tensors
        GS, gs_eps, R, ks, kmax, N = ctx.meta
        s, B = P.shape[:-2]
        k, K = P.shape[-2:]
        C = y.shape[-1]
        carried, exit_ = Xa is not None, X is not None
        T = s * B
        ws = [w for w in (w1, w2, w3) if w is not None]
        cdt = compute_dtype(*(t for t in (X, Xa, H, P, y) if t is not None))
        c = lambda t, *sh: None if t is None else t.reshape(*sh).contiguous()  # noqa: E731
        Xc, Xac, Ic = c(X, T, N, C), c(Xa, T, k, C), c(I, T, k)
        Hc, Pc, yc = c(H, T, k, k), c(P, T, k, K), c(y, T, C)
        posc = c(pos, T)
        doutc = dout.reshape(T, N if exit_ else k, C).contiguous()
        NP, KP, SP, BC = _meta(N, k, K, C)
        if carried:  # X_a's and dX_a's tiles beside dX' (sm_90: 16-24 bytes spilled at BC = 64)
            BC = max(16, min(BC // 2, 32))
        dev = y.device
        defer = ctx.owner is not None and ctx.needs_input_grad[0]
        need_dx = exit_ and ctx.needs_input_grad[0] and not defer
        xa_defer = ctx.xa_owner is not None and ctx.needs_input_grad[1]
        xa_as_dout = xa_defer and not exit_ and H is None  # dX_a = dX' itself: nothing to compute
        need_dxa = carried and ctx.needs_input_grad[1] and not xa_as_dout
        dX = torch.empty(T, N, C, dtype=X.dtype, device=dev) if need_dx else None
        dXa = torch.empty(T, k, C, dtype=Xa.dtype, device=dev) if need_dxa else None
        dH = torch.empty(T, k, k, dtype=cdt, device=dev) if H is not None else None
        dP = torch.empty(T, k, K, dtype=cdt, device=dev)
        dV = torch.empty(T, SP, C, dtype=cdt, device=dev)
        dy = torch.empty(T, C, dtype=y.dtype, device=dev)
        dws = [torch.empty(w.shape, dtype=cdt, device=w.device) for w in ws]
        wargs = ws + [None] * (3 - R)
        if T > 0:  # 2 warps: no spills on sm_90 (4 warps spilled 16-24 bytes at N = 16)
            _xhc_post_bwd_kernel[(T,)](doutc, Xc, Xac, Ic, Hc, Pc, yc, *wargs, posc, MS, dX, dXa, dH, dP, dV, N, k, K,
                                       C, B, *ks, kmax, gs_eps, R=R, GS=GS, HAS_POS=posc is not None, NEED_DX=need_dx,
                                       NEED_DXA=need_dxa, CARRIED=carried, EXIT=exit_, HAS_H=H is not None,
                                       NP=NP, KP=KP, SP=SP, BC=BC, CDT=tl_dtype(cdt), num_warps=2)
            BCc = max(16, min(triton.next_power_of_2(C), 32))
            _xhc_conv_bwd_kernel[(triton.cdiv(C, BCc),)](
                dV, yc, *wargs, posc, dy, *(dws + [None] * (3 - R)), T, C, B, *ks, kmax, R=R,
                HAS_POS=posc is not None, SP=SP, KMP=max(2, triton.next_power_of_2(kmax)), BT=16, BC=BCc,
                CDT=tl_dtype(cdt))
        if defer:
            sg.hand_over(ctx.owner, "write", (doutc, None if carried else Hc, Ic, k, carried))
        if xa_defer:
            sg.hand_over(ctx.xa_owner, "dxa", doutc if xa_as_dout else dXa)
            dXa = None
        dwo = [dw.to(w.dtype) for dw, w in zip(dws, ws)] + [None] * (3 - R)
        return (None if dX is None else dX.view(X.shape), None if dXa is None else dXa.view(Xa.shape), None,
                None if dH is None else dH.view(H.shape), dP.view(P.shape), dy.view(y.shape), *dwo, None, None, None)


def xhc_post(X, I, H, P, y, weights, pos, gram_schmidt: bool, gs_eps: float, Xa=None):
    """X' ``[s, b, N, C]`` of an xHC MLP sublayer: X'[I_j] = Σ_q H[j, q]·X_a[q] + Σ_t (P·L)[j, t]·V_t with
    V = [y, g_1, …, g_r] (the causal convs ``weights`` ``[κ_j, C]``, taps reset by ``pos`` ``[s, b]``
    or None) and L its Gram–Schmidt coefficients (identity when ``gram_schmidt`` is off); the rows
    outside I copied.  ``X`` ``[s, b, N, C]``; ``I`` ``[s, b, k]``; ``H`` ``[s, b, k, k]`` or None (no
    mixing); ``P`` = diag(p)·H_post ``[s, b, k, r + 1]``; ``y`` ``[s, b, C]``; r ≤ :data:`MAX_KERNELS`.

    ``Xa`` None: X_a = X[I] (the xHC sublayer).  ``Xa`` ``[s, b, k, C]``: a Flash window's carried
    active streams; with ``X`` None the result is the new X_a ``[s, b, k, C]`` (a write inside the
    window), with ``X`` (the window-entry state) and ``I`` it is scattered into X (the window exit)."""
    ws = list(weights) + [None] * (MAX_KERNELS - len(weights))
    return XHCPost.apply(X, Xa, I, H, P, y, *ws, pos, bool(gram_schmidt), float(gs_eps))
