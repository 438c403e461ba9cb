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
write's term handed over by :mod:`.triton_ops`' write) and dW, db, dα by deterministic reductions.

    byte budget:  N·C·s + C·s  (+ 4·(EW + 2·(RA + PA) + NP + 8) per token)

Column layouts (powers of two, so ``tl.dot`` and ``tl.reshape`` apply for N ≤ 16, k ≤ 16, K ≤ 8):
entry ``EW = max(16, 2·NP)`` columns, router logit i at i, pre logit i at NP + i (NP = next power of
two ≥ max(N, 4)); active: res ``RA = KP²`` columns (i·KP + q is H_res[i, q], row i·k + q of W_res) then
post ``PA = KP·SP`` columns (j·SP + s is H_post[j, s], row j·K + s of W_post), KP = next power of two
≥ max(k, 4), SP = next power of two ≥ max(K, 4).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels.mhc_common import _cast, mm, pick, place
from xhc.kernels.mhc_pre import _sig
from xhc.kernels.triton_ops import OWNER_CLASSES, _state_key, sinkhorn_tile, sinkhorn_tile_bwd


def layout(n: int, k: int, K: int):
    """(NP, EW, KP, SP, RA, PA) for N = n streams, k active, K write components."""
    NP = cm.np_of(n)
    KP = max(4, triton.next_power_of_2(int(k)))
    SP = max(4, triton.next_power_of_2(int(K)))
    return NP, max(16, 2 * NP), KP, SP, KP * KP, KP * SP


def warps(KP: int) -> int:
    """8 warps from k > 4 on: the [BT, KP, KP] Sinkhorn tiles and [BT, KP, NP] routing tiles then fit
    the registers without spills on sm_90 (``tools.triton_aot resources``)."""
    return 8 if KP >= 8 else 4


# ------------------------------------------------------------------------------------------------
@triton.jit
def w_entry_tile(WR, WPRE, kk, kmask, N, D, NP: tl.constexpr, EW: tl.constexpr, HAS_R: tl.constexpr,
                 CDT: tl.constexpr):
    """[W_router; W_pre] as ``[EW, BK]`` in the entry layout, columns ``kk`` of vec X."""
    mr = tl.arange(0, EW)[:, None]
    km = kmask[None, :]
    mp = mr - NP
    w = tl.load(WPRE + mp.to(tl.int64) * D + kk[None, :], mask=(mp >= 0) & (mp < N) & km, other=0.0).to(CDT)
    if HAS_R:
        w += tl.load(WR + mr.to(tl.int64) * D + kk[None, :], mask=(mr < N) & km, other=0.0).to(CDT)
    return w


@triton.jit
def w_res_act_tile(WRES, j, c, cmask, k, C, KP: tl.constexpr, RA: tl.constexpr, CDT: tl.constexpr):
    """W_res columns of slot ``j`` (``j·C + c``) as ``[RA, BC]`` in the res layout."""
    r = tl.arange(0, RA)[:, None]
    i = r // KP
    q = r % KP
    return tl.load(WRES + (i * k + q).to(tl.int64) * (k * C) + (j * C + c)[None, :],
                   mask=(i < k) & (q < k) & cmask[None, :], other=0.0).to(CDT)


@triton.jit
def w_post_act_tile(WPOST, j, c, cmask, k, K, C, SP: tl.constexpr, PA: tl.constexpr, CDT: tl.constexpr):
    """W_post columns of slot ``j`` as ``[PA, BC]`` in the post layout."""
    r = tl.arange(0, PA)[:, None]
    jj = r // SP
    s = r % SP
    return tl.load(WPOST + (jj * K + s).to(tl.int64) * (k * C) + (j * C + c)[None, :],
                   mask=(jj < k) & (s < K) & cmask[None, :], other=0.0).to(CDT)


@triton.jit
def _active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT: tl.constexpr, KP: tl.constexpr,
                   SP: tl.constexpr, CDT: tl.constexpr):
    """(z_res [BT, KP, KP], mask3, z_post [BT, KP, SP], pmask3) from the active GEMM's outputs."""
    i3 = tl.arange(0, KP)[None, :, None]
    q3 = tl.arange(0, KP)[None, None, :]
    s3 = tl.arange(0, SP)[None, None, :]
    mask3 = tm[:, None, None] & (i3 < k) & (q3 < k)
    pmask3 = tm[:, None, None] & (i3 < k) & (s3 < K)
    ares = tl.load(ARES).to(CDT)
    apost = tl.load(APOST).to(CDT)
    bres = tl.load(BRES + i3 * k + q3, mask=(i3 < k) & (q3 < k), other=0.0).to(CDT)
    bpost = tl.load(BPOST + i3 * K + s3, mask=(i3 < k) & (s3 < K), other=0.0).to(CDT)
    zres = ares * ra[:, None, None] * tl.reshape(accr, [BT, KP, KP]) + bres
    zpost = apost * ra[:, None, None] * tl.reshape(accp, [BT, KP, SP]) + bpost
    return zres, mask3, zpost, pmask3


@triton.jit
def _xhc_entry_fwd_kernel(X, WR, WPRE, BPRE, APRE, WRES, BRES, ARES, WPOST, BPOST, APOST,
                          U, IDX, PR, SCORE, HPRE, HRES, HPOST, PW, PE, PAC, STAT, WSUM,
                          T, N, C, k, m, K, norm_eps, t_max, sk_eps,
                          HAS_R: tl.constexpr, ROW_LAST: tl.constexpr, NP: tl.constexpr, EW: tl.constexpr,
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
            w = w_entry_tile(WR, WPRE, kk, cmk, N, D, NP, EW, HAS_R, CDT)
            wsum += tl.sum(w, 1)
            acc += mm(x, tl.trans(w), USE_DOT, PREC)
    nu = tl.sum(ssr, 1) / D  # 2. the entry epilogue
    mu = sx / D
    r = 1.0 / tl.sqrt(nu + norm_eps)
    rl = 1.0 / tl.sqrt(tl.maximum(nu - mu * mu, 0.0) + norm_eps)
    valid = tm[:, None] & jm[None, :]
    projp = pick(acc, ce, NP, NP)
    apre = tl.load(APRE).to(CDT)
    bpre = tl.load(BPRE + jn, mask=jm, other=0.0).to(CDT)
    hpre = tl.where(valid, _sig(apre * r[:, None] * projp + bpre[None, :]), 0.0)
    if HAS_R:
        wsr = pick(wsum[None, :], ce, NP, 0)
        zr = rl[:, None] * (pick(acc, ce, NP, 0) - mu[:, None] * wsr)
        score = _sig(zr)
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
    tl.store(HPRE + t[:, None] * N + jn[None, :], hpre, mask=valid)
    tl.store(PE + t[:, None] * EW + ce[None, :], acc, mask=tm[:, None])
    tl.store(STAT + t * 4, mu, mask=tm)
    tl.store(STAT + t * 4 + 1, r, mask=tm)
    tl.store(STAT + t * 4 + 2, rl, mask=tm)
    tl.store(STAT + t * 4 + 3, ra, mask=tm)
    if pid == 0:
        tl.store(WSUM + ce, wsum)
    accr = tl.zeros([BT, RA], dtype=CDT)
    accp = tl.zeros([BT, PA], dtype=CDT)
    for c0 in range(0, C, BC):  # 3. the read and the active GEMM
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        x3 = tl.load(X + t[:, None, None] * D + jn[None, :, None] * C + c[None, None, :],
                     mask=valid[:, :, None] & cmk[None, None, :], other=0.0).to(CDT)
        u = tl.sum(hpre[:, :, None] * x3, 1)
        tl.store(U + t[:, None] * C + c[None, :], _cast(u, U), mask=tm[:, None] & cmk[None, :])
        for j in range(0, k):
            aj = (seli == 1) & (rank == j)
            xa = tl.sum(tl.where(aj[:, :, None], x3, 0.0), 1)  # X_a[j]: [BT, BC]
            accr += mm(xa, tl.trans(w_res_act_tile(WRES, j, c, cmk, k, C, KP, RA, CDT)), USE_DOT, PREC)
            accp += mm(xa, tl.trans(w_post_act_tile(WPOST, j, c, cmk, k, K, C, SP, PA, CDT)), USE_DOT, PREC)
    AW = RA + PA  # 4. the active epilogue
    tl.store(PAC + t[:, None] * AW + tl.arange(0, RA)[None, :], accr, mask=tm[:, None])
    tl.store(PAC + t[:, None] * AW + RA + tl.arange(0, PA)[None, :], accp, mask=tm[:, None])
    zres, mask3, zpost, pmask3 = _active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT, KP, SP, CDT)
    M = sinkhorn_tile(zres, mask3, t_max, sk_eps, ROW_LAST, True)  # the row-sum clamp is always on in xHC
    i3 = tl.arange(0, KP)[None, :, None]
    q3 = tl.arange(0, KP)[None, None, :]
    s3 = tl.arange(0, SP)[None, None, :]
    tl.store(HRES + t[:, None, None] * k * k + i3 * k + q3, M, mask=mask3)
    hpost = 2.0 * _sig(zpost)
    tl.store(HPOST + t[:, None, None] * k * K + i3 * K + s3, hpost, mask=pmask3)
    tl.store(PW + t[:, None, None] * k * K + i3 * K + s3, p[:, :, None] * hpost, mask=pmask3)


@triton.jit
def _xhc_entry_bwd_kernel(X, DU, DHPRE, DPR, DHRES, DHPOST, DPW, IDX, PR, PE, PAC, STAT, WSUM,
                          BPRE, APRE, BRES, ARES, BPOST, APOST, S,
                          GE, GA, DZE, DZA, DA, COEF, T, N, C, k, m, K, t_max, sk_eps,
                          HAS_DU: tl.constexpr, HAS_DHPRE: tl.constexpr, HAS_DPR: tl.constexpr,
                          HAS_DHRES: tl.constexpr, HAS_DHPOST: tl.constexpr, HAS_DPW: tl.constexpr,
                          HAS_R: tl.constexpr, ROW_LAST: tl.constexpr, NS: tl.constexpr, NP: tl.constexpr,
                          EW: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, RA: tl.constexpr, PA: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    D = N * C
    jn = tl.arange(0, NP)
    jm = jn < N
    valid = tm[:, None] & jm[None, :]
    ce = tl.arange(0, EW)
    dhpre = tl.zeros([BT, NP], dtype=CDT)
    if HAS_DU:  # dh_pre = Σ_c du·X_i
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            cmk = c < C
            x3 = tl.load(X + t[:, None, None] * D + jn[None, :, None] * C + c[None, None, :],
                         mask=valid[:, :, None] & cmk[None, None, :], other=0.0).to(CDT)
            du = tl.load(DU + t[:, None] * C + c[None, :], mask=tm[:, None] & cmk[None, :], other=0.0).to(CDT)
            dhpre += tl.sum(x3 * du[:, None, :], 2)
    if HAS_DHPRE:
        dhpre += tl.load(DHPRE + t[:, None] * N + jn[None, :], mask=valid, other=0.0).to(CDT)
    pe = tl.load(PE + t[:, None] * EW + ce[None, :], mask=tm[:, None], other=0.0).to(CDT)
    mu = tl.load(STAT + t * 4, mask=tm, other=0.0).to(CDT)
    r = tl.load(STAT + t * 4 + 1, mask=tm, other=0.0).to(CDT)
    rl = tl.load(STAT + t * 4 + 2, mask=tm, other=0.0).to(CDT)
    ra = tl.load(STAT + t * 4 + 3, mask=tm, other=0.0).to(CDT)
    projp = pick(pe, ce, NP, NP)
    apre = tl.load(APRE).to(CDT)
    bpre = tl.load(BPRE + jn, mask=jm, other=0.0).to(CDT)
    s = _sig(apre * r[:, None] * projp + bpre[None, :])
    dzpre = tl.where(valid, dhpre * s * (1.0 - s), 0.0)
    kq = tl.arange(0, KP)
    km2 = tm[:, None] & (kq[None, :] < k)
    AW = RA + PA
    cra = tl.arange(0, RA)
    cpa = tl.arange(0, PA)
    accr = tl.load(PAC + t[:, None] * AW + cra[None, :], mask=tm[:, None], other=0.0).to(CDT)
    accp = tl.load(PAC + t[:, None] * AW + RA + cpa[None, :], mask=tm[:, None], other=0.0).to(CDT)
    zres, mask3, zpost, pmask3 = _active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT, KP, SP, CDT)
    i3 = tl.arange(0, KP)[None, :, None]
    q3 = tl.arange(0, KP)[None, None, :]
    s3 = tl.arange(0, SP)[None, None, :]
    sp = _sig(zpost)
    p = tl.load(PR + t[:, None] * k + kq[None, :], mask=km2, other=0.0).to(CDT)
    dhpost = tl.zeros([BT, KP, SP], dtype=CDT)
    dp = tl.zeros([BT, KP], dtype=CDT)
    if HAS_DHPOST:
        dhpost += tl.load(DHPOST + t[:, None, None] * k * K + i3 * K + s3, mask=pmask3, other=0.0).to(CDT)
    if HAS_DPW:  # P = diag(p)·H_post
        dpw = tl.load(DPW + t[:, None, None] * k * K + i3 * K + s3, mask=pmask3, other=0.0).to(CDT)
        dhpost += p[:, :, None] * dpw
        dp += tl.sum(dpw * 2.0 * sp, 2)
    if HAS_DPR:
        dp += tl.load(DPR + t[:, None] * k + kq[None, :], mask=km2, other=0.0).to(CDT)
    dzpost = tl.where(pmask3, dhpost * 2.0 * sp * (1.0 - sp), 0.0)
    dzres = tl.zeros([BT, KP, KP], dtype=CDT)
    if HAS_DHRES:  # the Sinkhorn adjoint (xhc.doubly_stochastic.sinkhorn_backward), per-step sums in S
        Gd = tl.load(DHRES + t[:, None, None] * k * k + i3 * k + q3, mask=mask3, other=0.0).to(CDT)
        dzres = sinkhorn_tile_bwd(zres, mask3, Gd, S, t[:, None] * NS * KP, t_max, sk_eps, ROW_LAST, True, NS, KP)
    dzr = tl.zeros([BT, NP], dtype=CDT)
    zr = tl.zeros([BT, NP], dtype=CDT)
    wsr = tl.zeros([1, NP], dtype=CDT)
    if HAS_R:  # dp reaches the router through the routed slots' scores
        Iv = tl.load(IDX + t[:, None] * k + kq[None, :], mask=km2, other=-1)
        A = Iv[:, :, None] == jn[None, None, :]  # [BT, KP, NP]
        dscore = tl.sum(tl.where(A, dp[:, :, None], 0.0), 1)
        wsr = pick(tl.load(WSUM + ce).to(CDT)[None, :], ce, NP, 0)
        zr = rl[:, None] * (pick(pe, ce, NP, 0) - mu[:, None] * wsr)
        sc = _sig(zr)
        dzr = tl.where(valid & (jn[None, :] >= m), dscore * sc * (1.0 - sc), 0.0)
    ares = tl.load(ARES).to(CDT)
    apost = tl.load(APOST).to(CDT)
    dzr2 = tl.reshape(dzres, [BT, RA])
    dzp2 = tl.reshape(dzpost, [BT, PA])
    tl.store(GE + t[:, None] * EW + ce[None, :],
             place(rl[:, None] * dzr, ce, NP, 0) + place(apre * r[:, None] * dzpre, ce, NP, NP), mask=tm[:, None])
    tl.store(GA + t[:, None] * AW + cra[None, :], ares * ra[:, None] * dzr2, mask=tm[:, None])
    tl.store(GA + t[:, None] * AW + RA + cpa[None, :], apost * ra[:, None] * dzp2, mask=tm[:, None])
    tl.store(DZE + t[:, None] * NP + jn[None, :], dzpre, mask=tm[:, None])
    tl.store(DZA + t[:, None] * AW + cra[None, :], dzr2, mask=tm[:, None])
    tl.store(DZA + t[:, None] * AW + RA + cpa[None, :], dzp2, mask=tm[:, None])
    gpre = tl.sum(dzpre * projp, 1)
    gres = tl.sum(dzr2 * accr, 1)
    gpost = tl.sum(dzp2 * accp, 1)
    tl.store(DA + t * 3, gpre * r, mask=tm)  # dα = Σ_t r·Σ dz·proj
    tl.store(DA + t * 3 + 1, gres * ra, mask=tm)
    tl.store(DA + t * 3 + 2, gpost * ra, mask=tm)
    dzz = tl.sum(dzr * zr, 1)
    dzw = tl.sum(dzr * wsr, 1)
    # dX = GE·W_e + a0 + a1·X (every row) + GA·W_a + a1a·X (active rows); see the module docstring
    a1 = -rl * rl * dzz / D - apre * gpre * r * r * r / D
    a0 = -rl * dzw / D + rl * rl * dzz * mu / D
    a1a = -(ares * gres + apost * gpost) * ra * ra * ra / (k * C)
    tl.store(COEF + t * 4, a0, mask=tm)
    tl.store(COEF + t * 4 + 1, a1, mask=tm)
    tl.store(COEF + t * 4 + 2, a1a, mask=tm)


# ------------------------------------------------------------------------------------------------
class XHCEntry(torch.autograd.Function):
    """(u, I, p, score, h_pre, H_res, H_post, P) of one xHC sublayer from X; see :func:`xhc_entry`."""

    @staticmethod
    def forward(ctx, X, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post, cfg):
        k, m, K, norm_eps, t_max, sk_eps, order = cfg
        N, C = X.shape[-2:]
        lead = X.shape[:-2]
        T = math.prod(lead)
        NP, EW, KP, SP, RA, PA = layout(N, k, K)
        cdt = cm._cdt(X, W_pre)
        Xc = X.reshape(T, N, C).contiguous()
        dev = X.device
        e = lambda *s, dt=cdt: torch.empty(*s, dtype=dt, device=dev)  # noqa: E731
        u = e(T, C, dt=X.dtype)
        I = e(T, k, dt=torch.int64)
        p, score, hpre = e(T, k), e(T, N), e(T, N)
        H, Hpost, PW = e(T, k, k), e(T, k, K), e(T, k, K)
        PE, PAC, STAT, WSUM = e(T, EW), e(T, RA + PA), e(T, 4), e(EW)
        b = cm.blocks("xhc_entry_fwd", N, C)
        BT, BK = b["BT"], b["BK"]
        BC = cm.block_c(BT, NP, C, budget=2048)  # [BT, NP, BC] tiles beside [BT, KP, NP]: no spills on sm_90
        if T > 0:
            _xhc_entry_fwd_kernel[(triton.cdiv(T, BT),)](
                Xc, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post,
                u, I, p, score, hpre, H, Hpost, PW, PE, PAC, STAT, WSUM, T, N, C, k, m, K, norm_eps, t_max, sk_eps,
                HAS_R=W_r is not None, ROW_LAST=order == "row_last", NP=NP, EW=EW, KP=KP, SP=SP, RA=RA, PA=PA,
                BT=BT, BK=BK, BC=BC, USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=cm._tl(cdt),
                num_warps=warps(KP))
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(I, score)
        ctx.save_for_backward(X, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post,
                              I, p, hpre, H, PE, PAC, STAT, WSUM)
        ctx.cfg = cfg
        # the owner of the state's gradient: the write that reads X_a from this X hands its term over
        # (xhc.kernels.triton_ops._claim), so dX is written once, by xhc_grad.state_grad
        ctx._x_key, ctx._x_rows, ctx._claims, ctx._pending, ctx._owner = _state_key(X), (N, C), {}, {}, None
        return (u.view(*lead, C), I.view(*lead, k), p.view(*lead, k), score.view(*lead, N), hpre.view(*lead, N),
                H.view(*lead, k, k), Hpost.view(*lead, k, K), PW.view(*lead, k, K))

    @staticmethod
    def backward(ctx, du, _dI, dp, _dscore, dhpre, dH, dHpost, dPW):
        from xhc.kernels import xhc_grad

        (X, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post,
         I, p, hpre, H, PE, PAC, STAT, WSUM) = ctx.saved_tensors
        k, m, K, norm_eps, t_max, sk_eps, order = ctx.cfg
        N, C = X.shape[-2:]
        T = math.prod(X.shape[:-2])
        NP, EW, KP, SP, RA, PA = layout(N, k, K)
        cdt = PE.dtype
        dev = X.device
        Xc = X.reshape(T, N, C).contiguous()
        c = lambda g, *s: None if g is None else g.reshape(*s).contiguous()  # noqa: E731
        duc, dpc, dhprec = c(du, T, C), c(dp, T, k), c(dhpre, T, N)
        dHc, dHpostc, dPWc = c(dH, T, k, k), c(dHpost, T, k, K), c(dPW, T, k, K)
        task = torch._C._current_graph_task_id()
        pend = ctx._pending.pop("write", None)
        ctx._pending.clear()
        write = pend[1] if pend is not None and pend[0] == task else None
        BT = cm.blocks("xhc_entry_bwd", N, C)["BT"]
        grid = triton.cdiv(T, BT)
        NS = 2 * t_max + (1 if order == "row_last" else 0) + 1
        e = lambda *s: torch.empty(*s, dtype=cdt, device=dev)  # noqa: E731
        S = e(grid * BT, NS, KP)
        GE, GA, DZE, DZA, DA, COEF = e(T, EW), e(T, RA + PA), e(T, NP), e(T, RA + PA), e(T, 3), e(T, 4)
        if T > 0:
            _xhc_entry_bwd_kernel[(grid,)](
                Xc, duc, dhprec, dpc, dHc, dHpostc, dPWc, I, p, PE, PAC, STAT, WSUM, b_pre, a_pre, b_res, a_res,
                b_post, a_post, S, GE, GA, DZE, DZA, DA, COEF, T, N, C, k, m, K, t_max, sk_eps,
                HAS_DU=duc is not None, HAS_DHPRE=dhprec is not None, HAS_DPR=dpc is not None,
                HAS_DHRES=dHc is not None, HAS_DHPOST=dHpostc is not None, HAS_DPW=dPWc is not None,
                HAS_R=W_r is not None, ROW_LAST=order == "row_last", NS=NS, NP=NP, EW=EW, KP=KP, SP=SP, RA=RA, PA=PA,
                BT=BT, BC=cm.block_c(BT, NP, C, budget=2048), CDT=cm._tl(cdt), num_warps=warps(KP))
        dX = None
        if ctx.needs_input_grad[0]:
            dX = xhc_grad.state_grad(Xc, duc, write, hpre, I, H, GE, GA, COEF, W_r, W_pre, W_res, W_post, k, K)
            dX = dX.view(X.shape)
        grads = [None] * 10
        if any(ctx.needs_input_grad[1:11]):
            grads = xhc_grad.param_grads(Xc, I, GE, GA, DZE, DZA, DA, STAT, W_r, W_pre, W_res, W_post, k, K)
        return (dX, *grads, None)


OWNER_CLASSES.append(XHCEntry._backward_cls)


def xhc_entry(X, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post, k: int, m: int, K: int,
              norm_eps: float, t_max: int, sk_eps: float, order: str):
    """The fused xHC entry from ``X`` ``[..., N, C]`` (docs/math.md §3.4–§3.5; module docstring) ->
    (u ``[..., C]`` in X's dtype, I long ``[..., k]``, p, score ``[..., N]``, h_pre ``[..., N]``,
    H_res ``[..., k, k]``, H_post ``[..., k, K]``, P = diag(p)·H_post ``[..., k, K]``), fp32 coefficients.

    The sigmoid router (``W_r`` ``[N, N·C]``, or None when k = m), the dense read (``W_pre`` ``[N, N·C]``),
    H_res (``W_res`` ``[k², k·C]``) and H_post (``W_post`` ``[k·K, k·C]``) with their biases and gates;
    every weight fp32 (float64 for the reference tests).  I and score carry no gradient."""
    f = lambda t: None if t is None else t.contiguous()  # noqa: E731
    return XHCEntry.apply(X, f(W_r), f(W_pre), f(b_pre), f(a_pre), f(W_res), f(b_res), f(a_res), f(W_post),
                          f(b_post), f(a_post), (int(k), int(m), int(K), float(norm_eps), int(t_max), float(sk_eps),
                                                 order))
