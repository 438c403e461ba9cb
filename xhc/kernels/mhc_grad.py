"""mHC backward: the state's gradient in one write, the weights' gradients by deterministic reductions.

:func:`_mhc_dx_kernel` (a program per BT tokens × BC columns, a loop over the N rows):

    dX_j = DP·W'[:, j·C + c] + coef·X_j + h_pre[j]·du + Σ_i H_res[i, j]·dX'_i

(the GEMM's gradient, the norm's, the read's and the write's terms; dX' is the write's output
gradient that :mod:`.mhc_post` handed over).  byte budget, per token:  N·C·s (X) + N·C·s (dX') +
C·s (du) + N·C·s (dX written once)  (+ W', 4·(RP + PP)·N·C bytes, read once per BT tokens).

:func:`_mhc_dw_kernel` (a program per BK columns of vec X × S token splits): partial dW'[s] =
Σ_{t in split s} DP[t]ᵀ·vec X[t] with ``tl.dot``.  byte budget: N·C·s per token (X) + the partials
4·S·(RP + PP)·N·C.

:func:`_mhc_dw_reduce_kernel` (a program per BK columns): dW' = Σ_s partials (a fixed order: no
atomics, the same bits every run), dW = dW' ⊙ g, dg = Σ_m dW'⊙W; program 0 also sums db and dα over
the tokens.  byte budget: the partials + W + dW.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels.common import cast, tl_dtype
from xhc.kernels.mhc_common import dw_pair_add, dw_pair_store, dw_pair_sum, mm, w_pp_tile, w_res_tile


@triton.jit
def _mhc_dx_kernel(X, DU, DXP, HPRE, HRES, DP, COEF, WPRE, WPOST, WRES, G, DX, T, N, C,
                   HAS_DU: tl.constexpr, HAS_DXP: tl.constexpr, HAS_G: tl.constexpr, NP: tl.constexpr,
                   RP: tl.constexpr, PP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr,
                   PREC: tl.constexpr, CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cmk = c < C
    m2 = tm[:, None] & cmk[None, :]
    D = N * C
    W = RP + PP
    cr = tl.arange(0, RP)
    cp = tl.arange(0, PP)
    dpr = tl.load(DP + t[:, None] * W + cr[None, :], mask=tm[:, None], other=0.0).to(CDT)
    dpp = tl.load(DP + t[:, None] * W + RP + cp[None, :], mask=tm[:, None], other=0.0).to(CDT)
    coef = tl.load(COEF + t, mask=tm, other=0.0).to(CDT)
    i = tl.arange(0, NP)
    im = i < N
    if HAS_DU:
        du = tl.load(DU + t[:, None] * C + c[None, :], mask=m2, other=0.0).to(CDT)
    if HAS_DXP:
        d3 = tl.load(DXP + t[:, None, None] * D + i[None, :, None] * C + c[None, None, :],
                     mask=tm[:, None, None] & im[None, :, None] & cmk[None, None, :], other=0.0).to(CDT)
    for j in range(0, N):
        k = j * C + c
        acc = mm(dpr, w_res_tile(WRES, G, k, cmk, N, D, NP, RP, HAS_G, CDT), USE_DOT, PREC)
        acc += mm(dpp, w_pp_tile(WPRE, WPOST, G, k, cmk, N, D, NP, PP, HAS_G, CDT), USE_DOT, PREC)
        xj = tl.load(X + t[:, None] * D + k[None, :], mask=m2, other=0.0).to(CDT)
        acc += coef[:, None] * xj
        if HAS_DU:
            hj = tl.load(HPRE + t * N + j, mask=tm, other=0.0).to(CDT)
            acc += hj[:, None] * du
        if HAS_DXP:
            hc = tl.load(HRES + t[:, None] * N * N + i[None, :] * N + j, mask=tm[:, None] & im[None, :],
                         other=0.0).to(CDT)
            acc += tl.sum(hc[:, :, None] * d3, 1)
        tl.store(DX + t[:, None] * D + k[None, :], cast(acc, DX), mask=m2)


@triton.jit
def _mhc_dw_kernel(X, DP, PART, T, D, TS, RP: tl.constexpr, PP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   USE_DOT: tl.constexpr, PREC: tl.constexpr, CDT: tl.constexpr):
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    s = tl.program_id(1)
    km = k < D
    W = RP + PP
    acc_r = tl.zeros([RP, BK], dtype=CDT)
    acc_p = tl.zeros([PP, BK], dtype=CDT)
    t_lo = s * TS
    t_hi = tl.minimum(t_lo + TS, T)
    for t0 in range(t_lo, t_hi, BT):
        t = (t0 + tl.arange(0, BT)).to(tl.int64)
        tm = t < t_hi
        x = tl.load(X + t[:, None] * D + k[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(CDT)
        acc_r, acc_p = dw_pair_add(DP, W, t, tm, x, acc_r, acc_p, RP, PP, USE_DOT, PREC, CDT)
    dw_pair_store(PART + s.to(tl.int64) * W * D, acc_r, acc_p, k, km, D, RP, PP)


@triton.jit
def _mhc_dw_reduce_kernel(PART, WPRE, WPOST, WRES, G, DWPRE, DWPOST, DWRES, DG, DZ, DA, DBPRE, DBPOST, DBRES,
                          DAPRE, DAPOST, DARES, S, T, N, D, HAS_G: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr,
                          PP: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, CDT: tl.constexpr):
    pid = tl.program_id(0)
    k = pid * BK + tl.arange(0, BK)
    km = k < D
    W = RP + PP
    cr = tl.arange(0, RP)
    cp = tl.arange(0, PP)
    dwr, dwp = dw_pair_sum(PART, S, k, km, D, RP, PP, BK, CDT)  # a fixed order over the splits
    if HAS_G:
        wr = w_res_tile(WRES, G, k, km, N, D, NP, RP, False, CDT)
        wp = w_pp_tile(WPRE, WPOST, G, k, km, N, D, NP, PP, False, CDT)
        dg = tl.sum(dwr * wr, 0) + tl.sum(dwp * wp, 0)
        tl.store(DG + k, dg, mask=km)
        g = tl.load(G + k, mask=km, other=0.0).to(CDT)[None, :]
        dwr = dwr * g
        dwp = dwp * g
    ri = cr[:, None] // NP
    rj = cr[:, None] % NP
    tl.store(DWRES + (ri * N + rj).to(tl.int64) * D + k[None, :], dwr, mask=(ri < N) & (rj < N) & km[None, :])
    mp = cp[:, None]
    tl.store(DWPRE + mp.to(tl.int64) * D + k[None, :], dwp, mask=(mp < N) & km[None, :])
    mq = mp - NP
    tl.store(DWPOST + mq.to(tl.int64) * D + k[None, :], dwp, mask=(mq >= 0) & (mq < N) & km[None, :])
    if pid == 0:  # db = Σ_t dz, dα = Σ_t partials, in a fixed order
        dbr = tl.zeros([RP], dtype=CDT)
        dbp = tl.zeros([PP], dtype=CDT)
        da = tl.zeros([4], dtype=CDT)
        a4 = tl.arange(0, 4)
        for t0 in range(0, T, BT):
            t = (t0 + tl.arange(0, BT)).to(tl.int64)
            tm = t < T
            dbr += tl.sum(tl.load(DZ + t[:, None] * W + cr[None, :], mask=tm[:, None], other=0.0).to(CDT), 0)
            dbp += tl.sum(tl.load(DZ + t[:, None] * W + RP + cp[None, :], mask=tm[:, None], other=0.0).to(CDT), 0)
            da += tl.sum(tl.load(DA + t[:, None] * 3 + a4[None, :], mask=tm[:, None] & (a4 < 3)[None, :],
                                 other=0.0).to(CDT), 0)
        bi = cr // NP
        bj = cr % NP
        tl.store(DBRES + bi * N + bj, dbr, mask=(bi < N) & (bj < N))
        tl.store(DBPRE + cp, dbp, mask=cp < N)
        tl.store(DBPOST + (cp - NP), dbp, mask=(cp >= NP) & (cp - NP < N))
        tl.store(DAPRE + a4 * 0, da, mask=a4 == 0)
        tl.store(DAPOST + a4 * 0, da, mask=a4 == 1)
        tl.store(DARES + a4 * 0, da, mask=a4 == 2)


def state_grad(Xc, du, dXp, hpre, H, DP, COEF, W_pre, W_post, W_res, gain):
    """dX ``[T, N, C]`` (X's dtype) of the fused mHC sublayer in one pass (module docstring)."""
    T, N, C = Xc.shape
    NP, RP, PP = cm.groups(N)
    cdt = DP.dtype
    BT = cm.blocks("mhc_dx", N, C)["BT"]
    BC = cm.block_c(BT, NP, C)
    dX = torch.empty_like(Xc)
    if T > 0:
        _mhc_dx_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
            Xc, du, dXp, hpre, H, DP, COEF, W_pre, W_post, W_res, gain, dX, T, N, C, HAS_DU=du is not None,
            HAS_DXP=dXp is not None, HAS_G=gain is not None, NP=NP, RP=RP, PP=PP, BT=BT, BC=BC,
            USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt))
    return dX


def param_grads(Xc, DP, DZ, DA, W_pre, W_post, W_res, gain):
    """(dW_pre, dW_post, dW_res, db_pre, db_post, db_res, dα_pre, dα_post, dα_res, dgain), deterministic."""
    T, N, C = Xc.shape
    D = N * C
    NP, RP, PP = cm.groups(N)
    cdt = DP.dtype
    dev = Xc.device
    b = cm.blocks("mhc_dw", N, C)
    BT, BK = b["BT"], b["BK"]
    S = max(1, min(int(b["S"]), triton.cdiv(max(T, 1), BT)))
    TS = triton.cdiv(triton.cdiv(max(T, 1), S), BT) * BT  # tokens per split, a multiple of BT
    S = triton.cdiv(max(T, 1), TS)
    e = lambda *s: torch.empty(*s, dtype=cdt, device=dev)  # noqa: E731
    part = e(S, RP + PP, D)
    out = [e(N, D), e(N, D), e(N * N, D), e(N), e(N), e(N * N), e(1), e(1), e(1), None if gain is None else e(D)]
    use_dot = cm.dot_ok(cdt)
    _mhc_dw_kernel[(triton.cdiv(D, BK), S)](Xc, DP, part, T, D, TS, RP=RP, PP=PP, BT=BT, BK=BK, USE_DOT=use_dot,
                                            PREC=cm.dot_precision(), CDT=tl_dtype(cdt))
    BKR = cm.blocks("mhc_dw_reduce", N, C)["BK"]
    _mhc_dw_reduce_kernel[(triton.cdiv(D, BKR),)](
        part, W_pre, W_post, W_res, gain, out[0], out[1], out[2], out[9], DZ, DA, out[3], out[4], out[5], out[6],
        out[7], out[8], S, T, N, D, HAS_G=gain is not None, NP=NP, RP=RP, PP=PP, BK=BKR, BT=64, CDT=tl_dtype(cdt))
    return out
