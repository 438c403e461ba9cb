"""Fused xHC entry (``xhc_entry``): routing, every mapping and the read of one xHC sublayer in one kernel.

Forward (:func:`_xhc_entry_fwd_kernel`, a program per BT tokens; docs/math.md §3.4–§3.5):

1. the entry GEMM ``vec(X)·[W_router; W_pre]ᵀ`` with Σx, the per-stream Σx² and the router weights'
   row sums in the same pass (``tl.dot``, fp32 accumulation);
2. its epilogue in registers: μ, ν of vec X, the router's LayerNorm applied after the GEMM
   (z = rsqrt(ν − μ² + ε)·(x·W_rᵀ − μ·W_r1)), score = σ(z), the top-(k−m) routed streams (ties to the
   lower index, as :func:`xhc.router.topk_stable`), the active set I (fixed streams first, routed
   ascending) and the route weights p, the dense read weights h_pre = σ(α·rsqrt(ν + ε)·x·W_preᵀ + b);
3. a second pass over the program's tokens (just brought into L2): the read u = Σ_i h_pre[i]·X_i and
   the active GEMM vec(X_a)·[W_res; W_post]ᵀ, X_a = X[I] taken from the tile (no gather in memory);
4. the active epilogue: RMSNorm of vec X_a from the per-stream sums of squares, H_res =
   clamp_rows(Sinkhorn(α·r_a·p_res + b)), H_post = 2σ(α·r_a·p_post + b), P = diag(p)·H_post.

    byte budget, per token, state dtype of s bytes:  N·C·s (X, once from DRAM) + C·s (u)
                                                    + 4·(EW + RA + PA + 4 + 2N + k² + 2kK) + 12k saved
    (the weights, 4·(2N·N·C + (k² + kK)·k·C) bytes, are read once per BT tokens)

Backward (:func:`_xhc_entry_bwd_kernel`, a program per BT tokens): dh_pre = Σ_c du·X_i (one pass over X
and du), then every epilogue's adjoint in registers — σ', the Sinkhorn adjoint (per-step sums in a
small per-token scratch), the route weights' path into the router scores, both norms — giving the two
GEMMs' gradients ``GE`` ``[T, EW]`` and ``GA`` ``[T, RA + PA]``, the logits' gradients (for db), the α
partials and the norms' coefficients of X in dX.  :mod:`.xhc_grad` writes dX in one pass (with the
write's term handed over by :mod:`.write_ops`) and dW, db, dα by deterministic reductions.

    byte budget:  N·C·s + C·s  (+ 4·(EW + 2·(RA + PA) + NP + 8) per token)

**A Flash window's entry** (:func:`window_entry`, docs/math.md §4.1–§4.2) runs the same kernels with TM = 2
or 4 pre-maps (one per sublayer of the window) and no active mappings (every write of a window
generates its own from the carried X_a, :mod:`.xhc_active`): step 1's GEMM has TM pre groups, step 3
writes TM readouts R_t = Σ_i h_t[i]·X_i (Flash-4sub: over the streams outside I, its non-active bases)
and the gathered X_a ``[T, k, C]`` (the carried state) instead of the active GEMM.  The backward takes
dR (all TM in one pass over X) and dX_a (added to the active rows by :mod:`.xhc_grad`'s dX kernel);
Flash-4sub's fused split reads (:mod:`.xhc_active`) write their rows of dh into a buffer it keeps.

    byte budget (forward):  N·C·s (X) + TM·C·4 (R, fp32) + k·C·s (X_a)  (+ 4·(EW + 4 + (1 + TM)·N) saved)
    byte budget (backward): N·C·s (X) + TM·C·4 (dR)  (+ 4·(EW + TM·NP + 8) per token); dX: + k·C·s (dX_a)

Column layouts (powers of two, so ``tl.dot`` and ``tl.reshape`` apply for N ≤ 16, k ≤ 16, K ≤ 8):
entry ``EW = max(16, next power of two ≥ (1 + TM)·NP)`` columns in groups of NP, router logit i at i,
pre-map t's logit i at (1 + t)·NP + i (NP = next power of two ≥ max(N, 4)); active: res ``RA = KP²`` columns (i·KP + q is H_res[i, q], row i·k + q of W_res) then
post ``PA = KP·SP`` columns (j·SP + s is H_post[j, s], row j·K + s of W_post), KP = next power of two
≥ max(k, 4), SP = next power of two ≥ max(K, 4).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, tl_dtype
from xhc.kernels.sinkhorn_ops import sinkhorn_tile, sinkhorn_tile_bwd
from xhc.kernels.mhc_common import mm, pick, pick_group, place, place_group, sig
from xhc.kernels.xhc_common import active_logits, layout, post_adjoint, w_entry_tile, w_post_act_tile, w_res_act_tile, warps


@triton.jit
def pick_col_group(v, ce, g: tl.constexpr, G: tl.constexpr, NP: tl.constexpr):
    """Column group g of the entry layout ``[B, NP]`` (v ``[B, G·NP]``, ce its column index): through a
    ``[B, G, NP]`` view from NP = 8 on (fewer registers: moe-10b xHC N = 16 spilled 24 bytes with the
    ``[B, NP, G·NP]`` tile), the tile below (N ≤ 4: the view spilled 8 bytes on sm_90)."""
    if NP >= 8:
        return pick_group(v, g, G, NP)
    else:
        return pick(v, ce, NP, g * NP)


@triton.jit
def place_col_group(a, ce, g: tl.constexpr, G: tl.constexpr, NP: tl.constexpr):
    """The inverse of :func:`pick_col_group`: ``[B, G·NP]`` with ``a`` at column group g."""
    if NP >= 8:
        return place_group(a, g, G, NP)
    else:
        return place(a, ce, NP, g * NP)


@triton.jit
def _pre_h(acc, ce, r, AP, BP, jn, jm, valid, NP: tl.constexpr, G: tl.constexpr, GI: tl.constexpr,
           CDT: tl.constexpr):
    """h_pre = σ(α·r·proj + b) of the pre-map at column group GI of the entry GEMM ``[BT, NP]``."""
    a = tl.load(AP).to(CDT)
    b = tl.load(BP + jn, mask=jm, other=0.0).to(CDT)
    return tl.where(valid, sig(a * r[:, None] * pick_col_group(acc, ce, GI, G, NP) + b[None, :]), 0.0)


@triton.jit
def _read_out(U, h, x3, act, t, c, cmk, tm, TM, tt, C, NONACT: tl.constexpr):
    """u_tt = Σ_i h[i]·X_i (``NONACT``: the streams outside I only) into row ``tt`` of U ``[T, TM, C]``."""
    if NONACT:
        h = tl.where(act, 0.0, h)
    u = tl.sum(h[:, :, None] * x3, 1)
    tl.store(U + t[:, None] * TM * C + tt * C + c[None, :], cast(u, U), mask=tm[:, None] & cmk[None, :])


@triton.jit
def _xhc_entry_fwd_kernel(X, WR, WP0, WP1, WP2, WP3, BP0, BP1, BP2, BP3, AP0, AP1, AP2, AP3,
                          WRES, BRES, ARES, WPOST, BPOST, APOST,
                          U, XA, IDX, PR, SCORE, HPRE, HRES, HPOST, PW, PE, PAC, STAT, WSUM,
                          T, N, C, k, m, K, norm_eps, t_max, sk_eps,
                          HAS_R: tl.constexpr, ROW_LAST: tl.constexpr, TM: tl.constexpr, NONACT: tl.constexpr,
                          HAS_ACT: tl.constexpr, HAS_XA: tl.constexpr, NP: tl.constexpr, EW: tl.constexpr,
                          G: tl.constexpr,
                          KP: tl.constexpr, SP: tl.constexpr, RA: tl.constexpr, PA: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                          USE_DOT: tl.constexpr, PREC: tl.constexpr, CDT: tl.constexpr):
    pid = tl.program_id(0)
    t = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    D = N * C
    jn = tl.arange(0, NP)
    jm = jn < N
    ce = tl.arange(0, EW)
    acc = tl.zeros([BT, EW], dtype=CDT)
    ssr = tl.zeros([BT, NP], dtype=CDT)
    sx = tl.zeros([BT], dtype=CDT)
    wsum = tl.zeros([EW], dtype=CDT)
    for i in range(0, N):  # 1. the entry GEMM, Σx, the per-stream Σx² in one pass
        for c0 in range(0, C, BK):
            c = c0 + tl.arange(0, BK)
            cmk = c < C
            kk = i * C + c
            x = tl.load(X + t[:, None] * D + kk[None, :], mask=tm[:, None] & cmk[None, :], other=0.0).to(CDT)
            ssr += tl.where(jn[None, :] == i, tl.sum(x * x, 1)[:, None], 0.0)
            sx += tl.sum(x, 1)
            w = w_entry_tile(WR, WP0, WP1, WP2, WP3, kk, cmk, N, D, NP, EW, HAS_R, TM, CDT)
            wsum += tl.sum(w, 1)
            acc += mm(x, tl.trans(w), USE_DOT, PREC)
    nu = tl.sum(ssr, 1) / D  # 2. the entry epilogue
    mu = sx / D
    r = 1.0 / tl.sqrt(nu + norm_eps)
    rl = 1.0 / tl.sqrt(tl.maximum(nu - mu * mu, 0.0) + norm_eps)
    valid = tm[:, None] & jm[None, :]
    h0 = _pre_h(acc, ce, r, AP0, BP0, jn, jm, valid, NP, G, 1, CDT)  # the pre-maps' read weights
    tl.store(HPRE + t[:, None] * TM * N + jn[None, :], h0, mask=valid)
    if TM > 1:
        h1 = _pre_h(acc, ce, r, AP1, BP1, jn, jm, valid, NP, G, 2, CDT)
        tl.store(HPRE + t[:, None] * TM * N + N + jn[None, :], h1, mask=valid)
    if TM > 2:
        h2 = _pre_h(acc, ce, r, AP2, BP2, jn, jm, valid, NP, G, 3, CDT)
        tl.store(HPRE + t[:, None] * TM * N + 2 * N + jn[None, :], h2, mask=valid)
    if TM > 3:
        h3 = _pre_h(acc, ce, r, AP3, BP3, jn, jm, valid, NP, G, 4, CDT)
        tl.store(HPRE + t[:, None] * TM * N + 3 * N + jn[None, :], h3, mask=valid)
    if HAS_R:
        wsr = pick_col_group(wsum[None, :], ce, 0, G, NP)
        zr = rl[:, None] * (pick_col_group(acc, ce, 0, G, NP) - mu[:, None] * wsr)
        score = sig(zr)
        seli = tl.where(valid & (jn[None, :] < m), 1, 0)
        for _ in range(0, k - m):  # the top-(k − m) of score[m:], ties to the lower index
            cand = tl.where(valid & (jn[None, :] >= m) & (seli == 0), score, float("-inf"))
            mx = tl.max(cand, 1)
            idx = tl.min(tl.where(cand == mx[:, None], jn[None, :], NP), 1)
            seli = tl.where(jn[None, :] == idx[:, None], 1, seli)
    else:
        score = tl.where(valid, 1.0, 0.0)
        seli = tl.where(valid & (jn[None, :] < k), 1, 0)
    rank = tl.cumsum(seli, 1) - 1
    j3 = tl.arange(0, KP)[None, :, None]
    A = (seli[:, None, :] == 1) & (rank[:, None, :] == j3)  # [BT, KP, NP]: slot j holds stream i
    Iv = tl.sum(tl.where(A, jn[None, None, :], 0), 2)  # [BT, KP]
    pv = tl.where(jn[None, :] < m, 1.0, score)
    p = tl.sum(tl.where(A, pv[:, None, :], 0.0), 2)
    nua = tl.sum(tl.sum(tl.where(A, ssr[:, None, :], 0.0), 2), 1) / (k * C)
    ra = 1.0 / tl.sqrt(nua + norm_eps)
    kq = tl.arange(0, KP)
    km2 = tm[:, None] & (kq[None, :] < k)
    tl.store(IDX + t[:, None] * k + kq[None, :], Iv.to(tl.int64), mask=km2)
    tl.store(PR + t[:, None] * k + kq[None, :], p, mask=km2)
    tl.store(SCORE + t[:, None] * N + jn[None, :], score, mask=valid)
    tl.store(PE + t[:, None] * EW + ce[None, :], acc, mask=tm[:, None])
    tl.store(STAT + t * 4, mu, mask=tm)
    tl.store(STAT + t * 4 + 1, r, mask=tm)
    tl.store(STAT + t * 4 + 2, rl, mask=tm)
    tl.store(STAT + t * 4 + 3, ra, mask=tm)
    if pid == 0:
        tl.store(WSUM + ce, wsum)
    act = seli == 1
    accr = tl.zeros([BT, RA], dtype=CDT)
    accp = tl.zeros([BT, PA], dtype=CDT)
    for c0 in range(0, C, BC):  # 3. the reads, the gather and the active GEMM
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        x3 = tl.load(X + t[:, None, None] * D + jn[None, :, None] * C + c[None, None, :],
                     mask=valid[:, :, None] & cmk[None, None, :], other=0.0).to(CDT)
        _read_out(U, h0, x3, act, t, c, cmk, tm, TM, 0, C, NONACT)
        if TM > 1:
            _read_out(U, h1, x3, act, t, c, cmk, tm, TM, 1, C, NONACT)
        if TM > 2:
            _read_out(U, h2, x3, act, t, c, cmk, tm, TM, 2, C, NONACT)
        if TM > 3:
            _read_out(U, h3, x3, act, t, c, cmk, tm, TM, 3, C, NONACT)
        if HAS_ACT or HAS_XA:
            for j in range(0, k):
                aj = act & (rank == j)
                xa = tl.sum(tl.where(aj[:, :, None], x3, 0.0), 1)  # X_a[j]: [BT, BC]
                if HAS_XA:  # the gathered active streams (a Flash window carries them)
                    tl.store(XA + t[:, None] * k * C + j * C + c[None, :], cast(xa, XA), mask=tm[:, None] & cmk[None, :])
                if HAS_ACT:
                    accr += mm(xa, tl.trans(w_res_act_tile(WRES, j, c, cmk, k, C, KP, RA, CDT)), USE_DOT, PREC)
                    accp += mm(xa, tl.trans(w_post_act_tile(WPOST, j, c, cmk, k, K, C, SP, PA, CDT)), USE_DOT, PREC)
    if HAS_ACT:  # 4. the active epilogue
        AW = RA + PA
        tl.store(PAC + t[:, None] * AW + tl.arange(0, RA)[None, :], accr, mask=tm[:, None])
        tl.store(PAC + t[:, None] * AW + RA + tl.arange(0, PA)[None, :], accp, mask=tm[:, None])
        zres, mask3, zpost, pmask3 = active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT, KP, SP,
                                                    CDT)
        M = sinkhorn_tile(zres, mask3, t_max, sk_eps, ROW_LAST, True)  # the row-sum clamp is always on in xHC
        i3 = tl.arange(0, KP)[None, :, None]
        q3 = tl.arange(0, KP)[None, None, :]
        s3 = tl.arange(0, SP)[None, None, :]
        tl.store(HRES + t[:, None, None] * k * k + i3 * k + q3, M, mask=mask3)
        hpost = 2.0 * sig(zpost)
        tl.store(HPOST + t[:, None, None] * k * K + i3 * K + s3, hpost, mask=pmask3)
        tl.store(PW + t[:, None, None] * k * K + i3 * K + s3, p[:, :, None] * hpost, mask=pmask3)


@triton.jit
def _dh_term(DU, x3, t, c, cmk, tm, C, TM: tl.constexpr, tt: tl.constexpr, CDT: tl.constexpr):
    du = tl.load(DU + t[:, None] * TM * C + tt * C + c[None, :], mask=tm[:, None] & cmk[None, :], other=0.0).to(CDT)
    return tl.sum(x3 * du[:, None, :], 2)


@triton.jit
def _dh_pass(X, DU, t, jn, valid, act, tm, C, D, TM: tl.constexpr, NONACT: tl.constexpr, BT: tl.constexpr,
             NP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    """dh_t = Σ_c du_t·X_i for every pre-map t in one pass over X (``NONACT``: 0 on the active streams)."""
    dh0 = tl.zeros([BT, NP], dtype=CDT)
    dh1 = tl.zeros([BT, NP], dtype=CDT)
    dh2 = tl.zeros([BT, NP], dtype=CDT)
    dh3 = tl.zeros([BT, NP], dtype=CDT)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        x3 = tl.load(X + t[:, None, None] * D + jn[None, :, None] * C + c[None, None, :],
                     mask=valid[:, :, None] & cmk[None, None, :], other=0.0).to(CDT)
        dh0 += _dh_term(DU, x3, t, c, cmk, tm, C, TM, 0, CDT)
        if TM > 1:
            dh1 += _dh_term(DU, x3, t, c, cmk, tm, C, TM, 1, CDT)
        if TM > 2:
            dh2 += _dh_term(DU, x3, t, c, cmk, tm, C, TM, 2, CDT)
        if TM > 3:
            dh3 += _dh_term(DU, x3, t, c, cmk, tm, C, TM, 3, CDT)
    if NONACT:
        dh0 = tl.where(act, 0.0, dh0)
        dh1 = tl.where(act, 0.0, dh1)
        dh2 = tl.where(act, 0.0, dh2)
        dh3 = tl.where(act, 0.0, dh3)
    return dh0, dh1, dh2, dh3


@triton.jit
def _pre_bwd(dh, pe, ce, r, AP, BP, DHPRE, DZE, t, jn, jm, valid, tm, N, TM: tl.constexpr, tt: tl.constexpr,
             HAS_DHPRE: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, CDT: tl.constexpr):
    """Pre-map tt's adjoint: (its GE columns' values α·r·dz ``[BT, NP]``, Σ dz·proj ``[BT]``, α); dz
    stored in DZE."""
    if HAS_DHPRE:
        dh += tl.load(DHPRE + t[:, None] * TM * N + tt * N + jn[None, :], mask=valid, other=0.0).to(CDT)
    projp = pick_col_group(pe, ce, 1 + tt, G, NP)
    a = tl.load(AP).to(CDT)
    b = tl.load(BP + jn, mask=jm, other=0.0).to(CDT)
    s = sig(a * r[:, None] * projp + b[None, :])
    dz = tl.where(valid, dh * s * (1.0 - s), 0.0)
    tl.store(DZE + t[:, None] * TM * NP + tt * NP + jn[None, :], dz, mask=tm[:, None])
    return a * r[:, None] * dz, tl.sum(dz * projp, 1), a


@triton.jit
def _xhc_entry_bwd_kernel(X, DU, DHPRE, DPR, DHRES, DHPOST, DPW, IDX, PR, PE, PAC, STAT, WSUM,
                          BP0, BP1, BP2, BP3, AP0, AP1, AP2, AP3, BRES, ARES, BPOST, APOST, S,
                          GE, GA, DZE, DZA, DA, COEF, T, N, C, k, m, K, t_max, sk_eps,
                          HAS_DU: tl.constexpr, HAS_DHPRE: tl.constexpr, HAS_DPR: tl.constexpr,
                          HAS_DHRES: tl.constexpr, HAS_DHPOST: tl.constexpr, HAS_DPW: tl.constexpr,
                          HAS_R: tl.constexpr, ROW_LAST: tl.constexpr, TM: tl.constexpr, NONACT: tl.constexpr,
                          HAS_ACT: tl.constexpr, NS: tl.constexpr, NP: tl.constexpr,
                          EW: tl.constexpr, G: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, RA: tl.constexpr, PA: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    D = N * C
    jn = tl.arange(0, NP)
    jm = jn < N
    valid = tm[:, None] & jm[None, :]
    ce = tl.arange(0, EW)
    kq = tl.arange(0, KP)
    km2 = tm[:, None] & (kq[None, :] < k)
    Iv = tl.load(IDX + t[:, None] * k + kq[None, :], mask=km2, other=-1)
    A = Iv[:, :, None] == jn[None, None, :]  # [BT, KP, NP]: slot j holds stream i
    act = tl.sum(tl.where(A, 1, 0), 1) > 0
    pe = tl.load(PE + t[:, None] * EW + ce[None, :], mask=tm[:, None], other=0.0).to(CDT)
    mu = tl.load(STAT + t * 4, mask=tm, other=0.0).to(CDT)
    r = tl.load(STAT + t * 4 + 1, mask=tm, other=0.0).to(CDT)
    rl = tl.load(STAT + t * 4 + 2, mask=tm, other=0.0).to(CDT)
    ra = tl.load(STAT + t * 4 + 3, mask=tm, other=0.0).to(CDT)
    # the pre-maps: dh_t = Σ_c du_t·X_i (one pass over X for all of them), σ', their GE columns
    dh0 = tl.zeros([BT, NP], dtype=CDT)
    dh1 = tl.zeros([BT, NP], dtype=CDT)
    dh2 = tl.zeros([BT, NP], dtype=CDT)
    dh3 = tl.zeros([BT, NP], dtype=CDT)
    if HAS_DU:
        dh0, dh1, dh2, dh3 = _dh_pass(X, DU, t, jn, valid, act, tm, C, D, TM, NONACT, BT, NP, BC, CDT)
    gcol, g, a = _pre_bwd(dh0, pe, ce, r, AP0, BP0, DHPRE, DZE, t, jn, jm, valid, tm, N, TM, 0, HAS_DHPRE, NP, G, CDT)
    ge = place_col_group(gcol, ce, 1, G, NP)
    tl.store(DA + t * (TM + 2), g * r, mask=tm)  # dα = Σ_t r·Σ dz·proj
    asum = a * g
    if TM > 1:
        gcol, g, a = _pre_bwd(dh1, pe, ce, r, AP1, BP1, DHPRE, DZE, t, jn, jm, valid, tm, N, TM, 1, HAS_DHPRE, NP, G, CDT)
        ge += place_col_group(gcol, ce, 2, G, NP)
        tl.store(DA + t * (TM + 2) + 1, g * r, mask=tm)
        asum += a * g
    if TM > 2:
        gcol, g, a = _pre_bwd(dh2, pe, ce, r, AP2, BP2, DHPRE, DZE, t, jn, jm, valid, tm, N, TM, 2, HAS_DHPRE, NP, G, CDT)
        ge += place_col_group(gcol, ce, 3, G, NP)
        tl.store(DA + t * (TM + 2) + 2, g * r, mask=tm)
        asum += a * g
    if TM > 3:
        gcol, g, a = _pre_bwd(dh3, pe, ce, r, AP3, BP3, DHPRE, DZE, t, jn, jm, valid, tm, N, TM, 3, HAS_DHPRE, NP, G, CDT)
        ge += place_col_group(gcol, ce, 4, G, NP)
        tl.store(DA + t * (TM + 2) + 3, g * r, mask=tm)
        asum += a * g
    p = tl.load(PR + t[:, None] * k + kq[None, :], mask=km2, other=0.0).to(CDT)
    dp = tl.zeros([BT, KP], dtype=CDT)
    if HAS_DPR:
        dp += tl.load(DPR + t[:, None] * k + kq[None, :], mask=km2, other=0.0).to(CDT)
    a1a = ra * 0.0
    if HAS_ACT:  # the active mappings: P's product rule, σ', the Sinkhorn adjoint
        AW = RA + PA
        cra = tl.arange(0, RA)
        cpa = tl.arange(0, PA)
        accr = tl.load(PAC + t[:, None] * AW + cra[None, :], mask=tm[:, None], other=0.0).to(CDT)
        accp = tl.load(PAC + t[:, None] * AW + RA + cpa[None, :], mask=tm[:, None], other=0.0).to(CDT)
        zres, mask3, zpost, pmask3 = active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT, KP, SP,
                                                    CDT)
        i3 = tl.arange(0, KP)[None, :, None]
        q3 = tl.arange(0, KP)[None, None, :]
        dzpost, dpp = post_adjoint(zpost, pmask3, p, DHPOST, DPW, t, k, K, HAS_DHPOST, HAS_DPW, BT, KP, SP, CDT)
        dp += dpp
        dzres = tl.zeros([BT, KP, KP], dtype=CDT)
        if HAS_DHRES:  # the Sinkhorn adjoint (xhc.doubly_stochastic.sinkhorn_backward), per-step sums in S
            Gd = tl.load(DHRES + t[:, None, None] * k * k + i3 * k + q3, mask=mask3, other=0.0).to(CDT)
            dzres = sinkhorn_tile_bwd(zres, mask3, Gd, S, t[:, None] * NS * KP, t_max, sk_eps, ROW_LAST, True, NS,
                                      KP)
        ares = tl.load(ARES).to(CDT)
        apost = tl.load(APOST).to(CDT)
        dzr2 = tl.reshape(dzres, [BT, RA])
        dzp2 = tl.reshape(dzpost, [BT, PA])
        tl.store(GA + t[:, None] * AW + cra[None, :], ares * ra[:, None] * dzr2, mask=tm[:, None])
        tl.store(GA + t[:, None] * AW + RA + cpa[None, :], apost * ra[:, None] * dzp2, mask=tm[:, None])
        tl.store(DZA + t[:, None] * AW + cra[None, :], dzr2, mask=tm[:, None])
        tl.store(DZA + t[:, None] * AW + RA + cpa[None, :], dzp2, mask=tm[:, None])
        gres = tl.sum(dzr2 * accr, 1)
        gpost = tl.sum(dzp2 * accp, 1)
        tl.store(DA + t * (TM + 2) + TM, gres * ra, mask=tm)
        tl.store(DA + t * (TM + 2) + TM + 1, gpost * ra, mask=tm)
        a1a = -(ares * gres + apost * gpost) * ra * ra * ra / (k * C)
    dzr = tl.zeros([BT, NP], dtype=CDT)
    zr = tl.zeros([BT, NP], dtype=CDT)
    wsr = tl.zeros([1, NP], dtype=CDT)
    if HAS_R:  # dp reaches the router through the routed slots' scores
        dscore = tl.sum(tl.where(A, dp[:, :, None], 0.0), 1)
        wsr = pick_col_group(tl.load(WSUM + ce).to(CDT)[None, :], ce, 0, G, NP)
        zr = rl[:, None] * (pick_col_group(pe, ce, 0, G, NP) - mu[:, None] * wsr)
        sc = sig(zr)
        dzr = tl.where(valid & (jn[None, :] >= m), dscore * sc * (1.0 - sc), 0.0)
    tl.store(GE + t[:, None] * EW + ce[None, :], place_col_group(rl[:, None] * dzr, ce, 0, G, NP) + ge, mask=tm[:, None])
    dzz = tl.sum(dzr * zr, 1)
    dzw = tl.sum(dzr * wsr, 1)
    # dX = GE·W_e + a0 + a1·X (every row) + GA·W_a + a1a·X (active rows); see the module docstring
    a1 = -rl * rl * dzz / D - asum * r * r * r / D
    a0 = -rl * dzw / D + rl * rl * dzz * mu / D
    tl.store(COEF + t * 4, a0, mask=tm)
    tl.store(COEF + t * 4 + 1, a1, mask=tm)
    tl.store(COEF + t * 4 + 2, a1a, mask=tm)


# ------------------------------------------------------------------------------------------------
def _maps(pres):
    """The pre-maps' (W, b, α) as 12 kernel arguments (WP0..3, BP0..3, AP0..3), None past the last."""
    pres = list(pres) + [(None, None, None)] * (4 - len(pres))
    return [w for w, _, _ in pres] + [b for _, b, _ in pres] + [a for _, _, a in pres]


class XHCEntry(torch.autograd.Function):
    """The fused entry; see :func:`xhc_entry` (an xHC sublayer: one pre-map and the active mappings) and
    :func:`window_entry` (a Flash window: TM pre-maps, the gathered X_a, no active mappings)."""

    @staticmethod
    def forward(ctx, X, W_r, WP0, WP1, WP2, WP3, BP0, BP1, BP2, BP3, AP0, AP1, AP2, AP3, W_res, b_res, a_res,
                W_post, b_post, a_post, cfg):
        k, m, K, norm_eps, t_max, sk_eps, order, TM, nonact, has_act = cfg
        N, C = X.shape[-2:]
        lead = X.shape[:-2]
        T = math.prod(lead)
        NP, EW, KP, SP, RA, PA = layout(N, k, K, TM)
        cdt = compute_dtype(X, WP0)
        Xc = X.reshape(T, N, C).contiguous()
        dev = X.device
        e = lambda *s, dt=cdt: torch.empty(*s, dtype=dt, device=dev)  # noqa: E731
        u = e(T, TM, C, dt=X.dtype if has_act else cdt)  # a window's base readouts stay fp32 (docs/math.md §4)
        Xa = None if has_act else e(T, k, C, dt=X.dtype)
        I = e(T, k, dt=torch.int64)
        p, score, hpre = e(T, k), e(T, N), e(T, TM, N)
        H, Hpost, PW, PAC = (e(T, k, k), e(T, k, K), e(T, k, K), e(T, RA + PA)) if has_act else (None,) * 4
        PE, STAT, WSUM = e(T, EW), e(T, 4), e(EW)
        b = cm.blocks("xhc_entry_fwd", N, C)
        BT, BK = b["BT"], min(b["BK"], max(16, 2048 // EW))  # the [EW, BK] weight tile (EW grows with TM)
        if TM > 1:  # the [BT, EW] GEMM accumulator of 2 or 4 pre-maps (sm_90: 8-16 bytes spilled at BT = 16)
            BT = min(BT, 8 if TM == 2 else 4)
        BC = cm.block_c(BT, NP, C, budget=2048)  # [BT, NP, BC] tiles beside [BT, KP, NP]: no spills on sm_90
        maps = [WP0, WP1, WP2, WP3, BP0, BP1, BP2, BP3, AP0, AP1, AP2, AP3]
        if T > 0:
            _xhc_entry_fwd_kernel[(triton.cdiv(T, BT),)](
                Xc, W_r, *maps, W_res, b_res, a_res, W_post, b_post, a_post,
                u, Xa, I, p, score, hpre, H, Hpost, PW, PE, PAC, STAT, WSUM, T, N, C, k, m, K, norm_eps, t_max, sk_eps,
                HAS_R=W_r is not None, ROW_LAST=order == "row_last", TM=TM, NONACT=nonact, HAS_ACT=has_act,
                HAS_XA=Xa is not None, NP=NP, EW=EW, G=EW // NP, KP=KP, SP=SP, RA=RA, PA=PA,
                BT=BT, BK=BK, BC=BC, USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt),
                num_warps=warps(KP))
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(I, score)
        ctx.save_for_backward(X, W_r, *maps, W_res, b_res, a_res, W_post, b_post, a_post, I, p, hpre, H, PE, PAC, STAT,
                              WSUM)
        ctx.cfg = cfg
        # the owner of the state's gradient: the write that reads X_a from this X hands its term over
        # (xhc.kernels.state_grad.claim), so dX is written once, by xhc_grad.state_grad
        ctx._x_key, ctx._x_rows, ctx._claims, ctx._pending, ctx._owner = sg.state_key(X), (N, C), {}, {}, None
        # a window's read weights' gradient: each sublayer's fused read writes its row here (xhc_active.py)
        ctx._dh_buf = None if has_act else torch.empty(T, TM, N, dtype=cdt, device=dev)
        if has_act:
            return (u.view(*lead, C), I.view(*lead, k), p.view(*lead, k), score.view(*lead, N), hpre.view(*lead, N),
                    H.view(*lead, k, k), Hpost.view(*lead, k, K), PW.view(*lead, k, K))
        return (u.view(*lead, TM, C), I.view(*lead, k), p.view(*lead, k), score.view(*lead, N),
                hpre.view(*lead, TM, N), Xa.view(*lead, k, C))

    @staticmethod
    def backward(ctx, du, _dI, dp, _dscore, dhpre, *rest):
        from xhc.kernels import xhc_grad

        X, W_r, *saved = ctx.saved_tensors
        maps, saved = saved[:12], saved[12:]
        W_res, b_res, a_res, W_post, b_post, a_post, I, p, hpre, H, PE, PAC, STAT, WSUM = saved
        k, m, K, norm_eps, t_max, sk_eps, order, TM, nonact, has_act = ctx.cfg
        dH, dHpost, dPW = rest if has_act else (None, None, None)
        dXa = None if has_act else rest[0]
        N, C = X.shape[-2:]
        T = math.prod(X.shape[:-2])
        NP, EW, KP, SP, RA, PA = layout(N, k, K, TM)
        cdt = PE.dtype
        dev = X.device
        Xc = X.reshape(T, N, C).contiguous()
        c = lambda g, *s: None if g is None else g.reshape(*s).contiguous()  # noqa: E731
        duc, dpc, dhprec = c(du, T, TM, C), c(dp, T, k), c(dhpre, T, TM, N)
        dHc, dHpostc, dPWc, dXac = c(dH, T, k, k), c(dHpost, T, k, K), c(dPW, T, k, K), c(dXa, T, k, C)
        task = torch._C._current_graph_task_id()
        pend = ctx._pending.pop("write", None)
        rows = [ctx._pending.pop(f"dh{t}", None) for t in range(TM)]
        ctx._pending.clear()
        write = pend[1] if pend is not None and pend[0] == task else None
        rows = [r is not None and r[0] == task for r in rows]
        if any(rows):  # the fused reads wrote their rows of dh into the buffer: no autograd sum of TM copies
            buf = ctx._dh_buf
            for t in range(TM):
                if not rows[t]:  # a read whose output took no gradient in this pass
                    buf[:, t].zero_()
            dhprec = buf if dhprec is None else dhprec + buf
        BT = cm.blocks("xhc_entry_bwd", N, C)["BT"]
        grid = triton.cdiv(T, BT)
        NS = 2 * t_max + (1 if order == "row_last" else 0) + 1
        e = lambda *s: torch.empty(*s, dtype=cdt, device=dev)  # noqa: E731
        S = e(grid * BT, NS, KP) if has_act else None
        GE, DZE, DA, COEF = e(T, EW), e(T, TM * NP), e(T, TM + 2), e(T, 4)
        GA, DZA = (e(T, RA + PA), e(T, RA + PA)) if has_act else (None, None)
        if T > 0:
            _xhc_entry_bwd_kernel[(grid,)](
                Xc, duc, dhprec, dpc, dHc, dHpostc, dPWc, I, p, PE, PAC, STAT, WSUM, *maps[4:], b_res, a_res,
                b_post, a_post, S, GE, GA, DZE, DZA, DA, COEF, T, N, C, k, m, K, t_max, sk_eps,
                HAS_DU=duc is not None, HAS_DHPRE=dhprec is not None, HAS_DPR=dpc is not None,
                HAS_DHRES=dHc is not None, HAS_DHPOST=dHpostc is not None, HAS_DPW=dPWc is not None,
                HAS_R=W_r is not None, ROW_LAST=order == "row_last", TM=TM, NONACT=nonact, HAS_ACT=has_act, NS=NS,
                NP=NP, EW=EW, G=EW // NP, KP=KP, SP=SP, RA=RA, PA=PA, BT=BT, BC=cm.block_c(BT, NP, C, budget=2048),
                CDT=tl_dtype(cdt), num_warps=warps(KP))
        dX = None
        if ctx.needs_input_grad[0]:
            dX = xhc_grad.state_grad(Xc, duc, write, hpre, I, GE, GA, COEF, W_r, maps[:4], W_res, W_post, k, K,
                                     TM=TM, nonact=nonact, dXa=dXac)
            dX = dX.view(X.shape)
        grads = [None] * 19
        if any(ctx.needs_input_grad[1:20]):
            dWr, dWp, dbp, dap, dWres, dbres, dares, dWpost, dbpost, dapost = xhc_grad.param_grads(
                Xc, I, GE, GA, DZE, DZA, DA, STAT, W_r, maps[:4], W_res, W_post, k, K, TM=TM)
            pad = lambda v: list(v) + [None] * (4 - len(v))  # noqa: E731
            grads = [dWr, *pad(dWp), *pad(dbp), *pad(dap), dWres, dbres, dares, dWpost, dbpost, dapost]
        return (dX, *grads, None)


sg.OWNER_CLASSES.append(XHCEntry._backward_cls)


def _f(t):
    return None if t is None else t.contiguous()


def xhc_entry(X, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post, k: int, m: int, K: int,
              norm_eps: float, t_max: int, sk_eps: float, order: str):
    """The fused xHC entry from ``X`` ``[..., N, C]`` (docs/math.md §3.4–§3.5; module docstring) ->
    (u ``[..., C]`` in X's dtype, I long ``[..., k]``, p, score ``[..., N]``, h_pre ``[..., N]``,
    H_res ``[..., k, k]``, H_post ``[..., k, K]``, P = diag(p)·H_post ``[..., k, K]``), fp32 coefficients.

    The sigmoid router (``W_r`` ``[N, N·C]``, or None when k = m), the dense read (``W_pre`` ``[N, N·C]``),
    H_res (``W_res`` ``[k², k·C]``) and H_post (``W_post`` ``[k·K, k·C]``) with their biases and gates;
    every weight fp32 (float64 for the reference tests).  I and score carry no gradient."""
    return XHCEntry.apply(X, _f(W_r), *_maps([(_f(W_pre), _f(b_pre), _f(a_pre))]), _f(W_res), _f(b_res), _f(a_res),
                          _f(W_post), _f(b_post), _f(a_post),
                          (int(k), int(m), int(K), float(norm_eps), int(t_max), float(sk_eps), order, 1, False, True))


def window_entry(X, W_r, pres, k: int, m: int, norm_eps: float, nonactive: bool):
    """A Flash window's fused entry from ``X`` ``[..., N, C]`` (docs/math.md §4.1, §4.2): the routing, the
    read weights of every pre-map in ``pres`` (2 or 4 (W ``[N, N·C]``, b, α) triples), their readouts and
    the gathered active streams in one kernel -> (R ``[..., T, C]`` fp32: R_t = Σ_i h_t[i]·X_i, over the
    streams outside I when ``nonactive`` (Flash-4sub's bases), I long ``[..., k]``, p ``[..., k]``, score
    ``[..., N]``, h ``[..., T, N]``, X_a = X[I] ``[..., k, C]`` in X's dtype)."""
    if not 1 <= len(pres) <= 4:
        raise ValueError(f"window_entry takes 1 to 4 pre-maps, got {len(pres)}")
    return XHCEntry.apply(X, _f(W_r), *_maps([tuple(_f(t) for t in mp) for mp in pres]), None, None, None, None,
                          None, None, (int(k), int(m), 1, float(norm_eps), 0, 0.0, "row_last", len(pres),
                                       bool(nonactive), False))
