"""xHC entry backward: the state's gradient in one write, the weights' gradients by deterministic reductions.

:func:`_xhc_dx_kernel` (a program per BT tokens × BC columns, a loop over the N rows):

    dX_i = GE·W_e[:, i·C + c] + a0 + a1·X_i + h_pre[i]·du                          (every row)
         + GA·W_a[:, j·C + c] + a1a·X_i + Σ_q H_res[q, j]·dX'_{I_q}     (i = I_j, an active row)
         + dX'_i                                                           (i outside I)

(the entry GEMM's and both norms' terms, the read's, the active GEMM's and the write's; dX' is the
write's output gradient that :mod:`.write_ops` handed over).  byte budget, per token:
N·C·s (X) + N·C·s (dX') + C·s (du) + N·C·s (dX written once) (+ the weights, read once per BT tokens).

:func:`_xhc_dw_kernel` (a program per BK columns of vec X or of vec X_a × S token splits): partial
dW_e[s] = Σ_t GEᵀ·vec X (router rows: vec X − μ, the LayerNorm's centring) and dW_a[s] = Σ_t GAᵀ·vec X_a
(X_a = X[I] read row by row from X).  byte budget: (N + k)·C·s per token + the partials.

:func:`_xhc_dw_reduce_kernel` (a program per BK columns): the partials summed in a fixed order (no
atomics: the same bits every run); program 0 also sums db and dα over the tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels.common import cast, tl_dtype
from xhc.kernels.mhc_common import dw_pair_add, dw_pair_store, dw_pair_sum, mm
from xhc.kernels.xhc_common import layout, w_entry_tile, w_post_act_tile, w_res_act_tile


@triton.jit
def _read_term(HPRE, DU, t, i, c, m2, tm, isact, N, C, TM: tl.constexpr, tt: tl.constexpr, NONACT: tl.constexpr,
               CDT: tl.constexpr):
    """h_tt[i]·du_tt (``NONACT``: 0 on an active row) ``[BT, BC]``."""
    hi = tl.load(HPRE + t * TM * N + tt * N + i, mask=tm, other=0.0).to(CDT)
    if NONACT:
        hi = tl.where(isact, 0.0, hi)
    du = tl.load(DU + t[:, None] * TM * C + tt * C + c[None, :], mask=m2, other=0.0).to(CDT)
    return hi[:, None] * du


@triton.jit
def _xhc_dx_kernel(X, DU, DOUT, DXA, HPRE, IDX, HRES, GE, GA, COEF, WR, WP0, WP1, WP2, WP3, WRES, WPOST, DX,
                   T, N, C, k, K,
                   HAS_DU: tl.constexpr, HAS_DOUT: tl.constexpr, DOUT_MIX: tl.constexpr, DOUT_H: tl.constexpr,
                   HAS_DXA: tl.constexpr, HAS_R: tl.constexpr,
                   TM: tl.constexpr, NONACT: tl.constexpr, HAS_ACT: tl.constexpr, NP: tl.constexpr,
                   EW: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, RA: tl.constexpr, PA: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
                   CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cmk = c < C
    m2 = tm[:, None] & cmk[None, :]
    D = N * C
    AW = RA + PA
    ce = tl.arange(0, EW)
    ge = tl.load(GE + t[:, None] * EW + ce[None, :], mask=tm[:, None], other=0.0).to(CDT)
    a0 = tl.load(COEF + t * 4, mask=tm, other=0.0).to(CDT)
    a1 = tl.load(COEF + t * 4 + 1, mask=tm, other=0.0).to(CDT)
    a1a = tl.load(COEF + t * 4 + 2, mask=tm, other=0.0).to(CDT)
    kq = tl.arange(0, KP)
    km2 = tm[:, None] & (kq[None, :] < k)
    Iv = tl.load(IDX + t[:, None] * k + kq[None, :], mask=km2, other=-1)  # [BT, KP]
    slot = tl.zeros([BT, KP, BC], dtype=CDT)  # the active rows' terms, by slot
    if HAS_ACT:
        gar = tl.load(GA + t[:, None] * AW + tl.arange(0, RA)[None, :], mask=tm[:, None], other=0.0).to(CDT)
        gap = tl.load(GA + t[:, None] * AW + RA + tl.arange(0, PA)[None, :], mask=tm[:, None], other=0.0).to(CDT)
    for j in range(0, k):
        if HAS_ACT:
            gj = mm(gar, w_res_act_tile(WRES, j, c, cmk, k, C, KP, RA, CDT), USE_DOT, PREC)
            gj += mm(gap, w_post_act_tile(WPOST, j, c, cmk, k, K, C, SP, PA, CDT), USE_DOT, PREC)
            slot += tl.where(kq[None, :, None] == j, gj[:, None, :], 0.0)
        if HAS_DXA:  # a Flash window's gathered X_a: dX_{I_j} += dX_a[j]
            dxa = tl.load(DXA + t[:, None] * k * C + j * C + c[None, :], mask=m2, other=0.0).to(CDT)
            slot += tl.where(kq[None, :, None] == j, dxa[:, None, :], 0.0)
        if HAS_DOUT and DOUT_MIX:  # the write's mixing: dX_{I_q} += H_res[j, q]·dX'_{I_j} (H None: identity)
            Ij = tl.sum(tl.where(kq[None, :] == j, Iv, 0), 1)
            dn = tl.load(DOUT + t[:, None] * D + Ij[:, None] * C + c[None, :], mask=m2, other=0.0).to(CDT)
            if DOUT_H:
                hj = tl.load(HRES + t[:, None] * k * k + j * k + kq[None, :], mask=km2, other=0.0).to(CDT)
                slot += hj[:, :, None] * dn[:, None, :]
            else:
                slot += tl.where(kq[None, :, None] == j, dn[:, None, :], 0.0)
    for i in range(0, N):
        kk = i * C + c
        acc = mm(ge, w_entry_tile(WR, WP0, WP1, WP2, WP3, kk, cmk, N, D, NP, EW, HAS_R, TM, CDT), USE_DOT, PREC)
        xi = tl.load(X + t[:, None] * D + kk[None, :], mask=m2, other=0.0).to(CDT)
        act = Iv == i  # [BT, KP]
        isact = tl.sum(tl.where(act, 1, 0), 1) > 0
        acc += a0[:, None] + (a1 + tl.where(isact, a1a, 0.0))[:, None] * xi
        acc += tl.sum(tl.where(act[:, :, None], slot, 0.0), 1)
        if HAS_DU:  # the reads' term Σ_t h_t[i]·du_t
            acc += _read_term(HPRE, DU, t, i, c, m2, tm, isact, N, C, TM, 0, NONACT, CDT)
            if TM > 1:
                acc += _read_term(HPRE, DU, t, i, c, m2, tm, isact, N, C, TM, 1, NONACT, CDT)
            if TM > 2:
                acc += _read_term(HPRE, DU, t, i, c, m2, tm, isact, N, C, TM, 2, NONACT, CDT)
            if TM > 3:
                acc += _read_term(HPRE, DU, t, i, c, m2, tm, isact, N, C, TM, 3, NONACT, CDT)
        if HAS_DOUT:  # rows outside I: the write copied them
            acc += tl.load(DOUT + t[:, None] * D + kk[None, :], mask=m2 & (isact == 0)[:, None], other=0.0).to(CDT)
        tl.store(DX + t[:, None] * D + kk[None, :], cast(acc, DX), mask=m2)


@triton.jit
def _dw_entry_part(X, GE, STAT, PARTE, pid, s, t_lo, t_hi, D, EW: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr, CDT: tl.constexpr):
    """Partial dW_e of split ``s``, columns ``pid``·BK… of vec X."""
    kk = pid * BK + tl.arange(0, BK)
    km = kk < D
    ce = tl.arange(0, EW)
    acc = tl.zeros([EW, BK], dtype=CDT)
    corr = tl.zeros([EW], dtype=CDT)
    for t0 in range(t_lo, t_hi, BT):
        t = (t0 + tl.arange(0, BT)).to(tl.int64)
        tm = t < t_hi
        x = tl.load(X + t[:, None] * D + kk[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(CDT)
        ge = tl.load(GE + t[:, None] * EW + ce[None, :], mask=tm[:, None], other=0.0).to(CDT)
        mu = tl.load(STAT + t * 4, mask=tm, other=0.0).to(CDT)
        acc += mm(tl.trans(ge), x, USE_DOT, PREC)
        corr += tl.sum(ge * mu[:, None], 0)
    acc -= tl.where(ce < NP, corr, 0.0)[:, None]  # router rows: Σ_t g·(x − μ)
    tl.store(PARTE + s.to(tl.int64) * EW * D + ce[:, None] * D + kk[None, :], acc, mask=km[None, :])


@triton.jit
def _dw_active_part(X, IDX, GA, PARTA, pa, s, t_lo, t_hi, D, C, k, RA: tl.constexpr, PA: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, USE_DOT: tl.constexpr,
                    PREC: tl.constexpr, CDT: tl.constexpr):
    """Partial dW_a of split ``s``, columns ``pa``·BK… of vec X_a (slot j = column // C)."""
    AW = RA + PA
    KC = k * C
    kk = pa * BK + tl.arange(0, BK)
    km = kk < KC
    j = kk // C
    cc = kk % C
    accr = tl.zeros([RA, BK], dtype=CDT)
    accp = tl.zeros([PA, BK], dtype=CDT)
    for t0 in range(t_lo, t_hi, BT):
        t = (t0 + tl.arange(0, BT)).to(tl.int64)
        tm = t < t_hi
        m2 = tm[:, None] & km[None, :]
        if ROWS:  # X_a = X[I], row by row from the state
            Ij = tl.load(IDX + t[:, None] * k + j[None, :], mask=m2, other=0)
            xa = tl.load(X + t[:, None] * D + Ij * C + cc[None, :], mask=m2, other=0.0).to(CDT)
        else:  # X is X_a itself, [T, k, C] (a Flash window's carried streams, .xhc_active)
            xa = tl.load(X + t[:, None] * KC + kk[None, :], mask=m2, other=0.0).to(CDT)
        accr, accp = dw_pair_add(GA, AW, t, tm, xa, accr, accp, RA, PA, USE_DOT, PREC, CDT)
    dw_pair_store(PARTA + s.to(tl.int64) * AW * KC, accr, accp, kk, km, KC, RA, PA)


@triton.jit
def _xhc_dw_kernel(X, IDX, GE, GA, STAT, PARTE, PARTA, T, N, C, k, NE, TS, EW: tl.constexpr, NP: tl.constexpr,
                   RA: tl.constexpr, PA: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, HAS_E: tl.constexpr,
                   HAS_A: tl.constexpr, ROWS: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
                   CDT: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    D = N * C
    t_lo = s * TS
    t_hi = tl.minimum(t_lo + TS, T)
    if HAS_E:  # NE programs for the entry columns of vec X, then the active columns of vec X_a
        if HAS_A:
            if pid < NE:
                _dw_entry_part(X, GE, STAT, PARTE, pid, s, t_lo, t_hi, D, EW, NP, BT, BK, USE_DOT, PREC, CDT)
            else:
                _dw_active_part(X, IDX, GA, PARTA, pid - NE, s, t_lo, t_hi, D, C, k, RA, PA, BT, BK, ROWS, USE_DOT,
                                PREC, CDT)
        else:  # the entry columns only (a Flash window's entry, .xhc_entry.window_entry)
            _dw_entry_part(X, GE, STAT, PARTE, pid, s, t_lo, t_hi, D, EW, NP, BT, BK, USE_DOT, PREC, CDT)
    else:  # the active columns only (.xhc_active)
        _dw_active_part(X, IDX, GA, PARTA, pid, s, t_lo, t_hi, D, C, k, RA, PA, BT, BK, ROWS, USE_DOT, PREC, CDT)


@triton.jit
def _store_pre_rows(DW, acc, mr, kk, km, N, D):
    tl.store(DW + mr.to(tl.int64) * D + kk[None, :], acc, mask=(mr >= 0) & (mr < N) & km[None, :])


@triton.jit
def _reduce_entry_part(PARTE, DWR, DWP0, DWP1, DWP2, DWP3, pid, S, N, D, HAS_R: tl.constexpr, TM: tl.constexpr,
                       EW: tl.constexpr, NP: tl.constexpr, BK: tl.constexpr, CDT: tl.constexpr):
    """dW_r and every dW_pre (pre-map t at rows (1 + t)·NP + i), columns ``pid``·BK…: the splits summed in a
    fixed order."""
    kk = pid * BK + tl.arange(0, BK)
    km = kk < D
    ce = tl.arange(0, EW)
    acc = tl.zeros([EW, BK], dtype=CDT)
    for s in range(0, S):  # a fixed order over the splits
        acc += tl.load(PARTE + s * EW * D + ce[:, None] * D + kk[None, :], mask=km[None, :], other=0.0).to(CDT)
    mr = ce[:, None]
    if HAS_R:
        tl.store(DWR + mr.to(tl.int64) * D + kk[None, :], acc, mask=(mr < N) & km[None, :])
    _store_pre_rows(DWP0, acc, mr - NP, kk, km, N, D)
    if TM > 1:
        _store_pre_rows(DWP1, acc, mr - 2 * NP, kk, km, N, D)
    if TM > 2:
        _store_pre_rows(DWP2, acc, mr - 3 * NP, kk, km, N, D)
    if TM > 3:
        _store_pre_rows(DWP3, acc, mr - 4 * NP, kk, km, N, D)


@triton.jit
def _reduce_active_part(PARTA, DWRES, DWPOST, pa, S, C, k, K, HAS_RES: tl.constexpr, KP: tl.constexpr,
                        SP: tl.constexpr, RA: tl.constexpr, PA: tl.constexpr, BK: tl.constexpr, CDT: tl.constexpr):
    """dW_res, dW_post columns ``pa``·BK…: the splits summed in a fixed order."""
    AW = RA + PA
    KC = k * C
    kk = pa * BK + tl.arange(0, BK)
    km = kk < KC
    cra = tl.arange(0, RA)
    cpa = tl.arange(0, PA)
    accr, accp = dw_pair_sum(PARTA, S, kk, km, KC, RA, PA, BK, CDT)
    ri = cra[:, None] // KP
    rq = cra[:, None] % KP
    if HAS_RES:
        tl.store(DWRES + (ri * k + rq).to(tl.int64) * KC + kk[None, :], accr, mask=(ri < k) & (rq < k) & km[None, :])
    pj = cpa[:, None] // SP
    ps = cpa[:, None] % SP
    tl.store(DWPOST + (pj * K + ps).to(tl.int64) * KC + kk[None, :], accp, mask=(pj < k) & (ps < K) & km[None, :])


@triton.jit
def _pre_bias(DZE, DBP, DAP, da, T, N, TM: tl.constexpr, tt: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
              DW: tl.constexpr, CDT: tl.constexpr):
    """db and dα of pre-map tt (db = Σ_t dz in a fixed order; dα from the summed partials ``da``)."""
    jn = tl.arange(0, NP)
    dbe = tl.zeros([NP], dtype=CDT)
    for t0 in range(0, T, BT):
        t = (t0 + tl.arange(0, BT)).to(tl.int64)
        tm = t < T
        dbe += tl.sum(tl.load(DZE + t[:, None] * TM * NP + tt * NP + jn[None, :], mask=tm[:, None],
                              other=0.0).to(CDT), 0)
    tl.store(DBP + jn, dbe, mask=jn < N)
    tl.store(DAP, tl.sum(tl.where(tl.arange(0, DW) == tt, da, 0.0), 0))


@triton.jit
def _xhc_dw_reduce_kernel(PARTE, PARTA, DZE, DZA, DA, DWR, DWP0, DWP1, DWP2, DWP3, DWRES, DWPOST, DBP0, DBP1, DBP2,
                          DBP3, DBRES, DBPOST, DAP0, DAP1, DAP2, DAP3, DARES, DAPOST, S, T, N, C, k, K, NE,
                          HAS_R: tl.constexpr, HAS_E: tl.constexpr, HAS_RES: tl.constexpr, HAS_A: tl.constexpr,
                          TM: tl.constexpr, EW: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
                          RA: tl.constexpr, PA: tl.constexpr, DW: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                          CDT: tl.constexpr):
    pid = tl.program_id(0)
    D = N * C
    AW = RA + PA
    if HAS_E:  # NE programs for the entry columns, then the active columns
        if HAS_A:
            if pid < NE:
                _reduce_entry_part(PARTE, DWR, DWP0, DWP1, DWP2, DWP3, pid, S, N, D, HAS_R, TM, EW, NP, BK, CDT)
            else:
                _reduce_active_part(PARTA, DWRES, DWPOST, pid - NE, S, C, k, K, HAS_RES, KP, SP, RA, PA, BK, CDT)
        else:
            _reduce_entry_part(PARTE, DWR, DWP0, DWP1, DWP2, DWP3, pid, S, N, D, HAS_R, TM, EW, NP, BK, CDT)
    else:  # the active columns only (.xhc_active)
        _reduce_active_part(PARTA, DWRES, DWPOST, pid, S, C, k, K, HAS_RES, KP, SP, RA, PA, BK, CDT)
    if pid == 0:  # db = Σ_t dz, dα = Σ_t partials, in a fixed order; DA holds TM pre columns, res, post
        cra = tl.arange(0, RA)
        cpa = tl.arange(0, PA)
        dbr = tl.zeros([RA], dtype=CDT)
        dbp = tl.zeros([PA], dtype=CDT)
        a4 = tl.arange(0, DW)
        da = tl.zeros([DW], dtype=CDT)
        for t0 in range(0, T, BT):
            t = (t0 + tl.arange(0, BT)).to(tl.int64)
            tm = t < T
            if HAS_A:
                dbr += tl.sum(tl.load(DZA + t[:, None] * AW + cra[None, :], mask=tm[:, None], other=0.0).to(CDT), 0)
                dbp += tl.sum(tl.load(DZA + t[:, None] * AW + RA + cpa[None, :], mask=tm[:, None],
                                      other=0.0).to(CDT), 0)
            da += tl.sum(tl.load(DA + t[:, None] * (TM + 2) + a4[None, :], mask=tm[:, None] & (a4 < TM + 2)[None, :],
                                 other=0.0).to(CDT), 0)
        if HAS_E:
            _pre_bias(DZE, DBP0, DAP0, da, T, N, TM, 0, NP, BT, DW, CDT)
            if TM > 1:
                _pre_bias(DZE, DBP1, DAP1, da, T, N, TM, 1, NP, BT, DW, CDT)
            if TM > 2:
                _pre_bias(DZE, DBP2, DAP2, da, T, N, TM, 2, NP, BT, DW, CDT)
            if TM > 3:
                _pre_bias(DZE, DBP3, DAP3, da, T, N, TM, 3, NP, BT, DW, CDT)
        if HAS_A:
            bi = cra // KP
            bq = cra % KP
            if HAS_RES:
                tl.store(DBRES + bi * k + bq, dbr, mask=(bi < k) & (bq < k))
                tl.store(DARES, tl.sum(tl.where(a4 == TM, da, 0.0), 0))
            pj = cpa // SP
            ps = cpa % SP
            tl.store(DBPOST + pj * K + ps, dbp, mask=(pj < k) & (ps < K))
            tl.store(DAPOST, tl.sum(tl.where(a4 == TM + 1, da, 0.0), 0))


def _pad4(v):
    return list(v) + [None] * (4 - len(v))


def state_grad(Xc, du, write, hpre, I, GE, GA, COEF, W_r, W_pres, W_res, W_post, k: int, K: int, TM: int = 1,
               nonact: bool = False, dXa=None):
    """dX ``[T, N, C]`` (X's dtype) of the fused xHC sublayer, or of a Flash window's entry (TM pre-maps,
    no active mappings: ``GA`` None, ``dXa`` the gathered X_a's gradient), in one pass (module docstring).
    ``write``: the write's handed-over terms (dX', H, I, k, zero_active) or None.  ``W_pres``: the
    pre-maps' weights (a list, 1 to 4)."""
    T, N, C = Xc.shape
    NP, EW, KP, SP, RA, PA = layout(N, k, K, TM)
    cdt = GE.dtype
    b = cm.blocks("xhc_dx", N, C)
    BT = b["BT"]
    # the [BT, KP, BC] slot tile and the [EW, BC] entry-weight tile (EW grows with TM) of ≤ 2048 values: no spills
    BC = max(16, min(triton.next_power_of_2(C), 2048 // (BT * KP), 1024 // EW))
    # the write's terms: its dX', its mixing (None: identity) and whether X's active rows get nothing (a
    # window's carried write replaced them); same I as the entry's routing
    dout, Hw, _, _, zero_active = write if write is not None else (None, None, None, k, False)
    dX = torch.empty_like(Xc)
    if T > 0:
        _xhc_dx_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
            Xc, du, dout, dXa, hpre, I, Hw, GE, GA, COEF, W_r, *_pad4(W_pres), W_res, W_post, dX, T, N, C, k, K,
            HAS_DU=du is not None, HAS_DOUT=dout is not None, DOUT_MIX=not zero_active, DOUT_H=Hw is not None,
            HAS_DXA=dXa is not None, HAS_R=W_r is not None,
            TM=TM, NONACT=nonact, HAS_ACT=GA is not None, NP=NP, EW=EW, KP=KP, SP=SP,
            RA=RA, PA=PA, BT=BT, BC=BC, USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt))
    return dX


def _dw_blocks(b: dict, T: int, AW: int):
    """(BT, BK, S, TS): the dW kernel's blocks with ``[AW, BK]`` fp32 accumulators in registers (sm_90: no
    spills) and S token splits of TS tokens (a multiple of BT)."""
    pow2 = lambda x: 1 << (max(int(x), 1).bit_length() - 1)  # noqa: E731  (the power of two ≤ x)
    BK = min(b["BK"], max(16, pow2(2048 // AW)))
    BT = min(b["BT"], max(16, pow2(4096 // AW)))
    S = max(1, min(int(b["S"]), triton.cdiv(max(T, 1), BT)))
    TS = triton.cdiv(triton.cdiv(max(T, 1), S), BT) * BT
    return BT, BK, triton.cdiv(max(T, 1), TS), TS


def param_grads(Xc, I, GE, GA, DZE, DZA, DA, STAT, W_r, W_pres, W_res, W_post, k: int, K: int, TM: int = 1):
    """(dW_r, [dW_pre], [db_pre], [dα_pre], dW_res, db_res, dα_res, dW_post, db_post, dα_post), deterministic:
    one entry per pre-map in the lists; the active ones None without active mappings (``GA`` None)."""
    T, N, C = Xc.shape
    D, KC = N * C, k * C
    NP, EW, KP, SP, RA, PA = layout(N, k, K, TM)
    cdt = GE.dtype
    dev = Xc.device
    has_a = GA is not None
    BT, BK, S, TS = _dw_blocks(cm.blocks("xhc_dw", N, C), T, max(EW, RA + PA) if has_a else EW)
    e = lambda *s: torch.empty(*s, dtype=cdt, device=dev)  # noqa: E731
    parte, parta = e(S, EW, D), (e(S, RA + PA, KC) if has_a else None)
    dWr = None if W_r is None else e(N, D)
    dWp, dbp, dap = [e(N, D) for _ in range(TM)], [e(N) for _ in range(TM)], [e(1) for _ in range(TM)]
    dWres, dbres, dares = (e(k * k, KC), e(k * k), e(1)) if has_a else (None, None, None)
    dWpost, dbpost, dapost = (e(k * K, KC), e(k * K), e(1)) if has_a else (None, None, None)
    NE = triton.cdiv(D, BK)
    _xhc_dw_kernel[(NE + (triton.cdiv(KC, BK) if has_a else 0), S)](
        Xc, I, GE, GA, STAT, parte, parta, T, N, C, k, NE, TS, EW=EW, NP=NP, RA=RA, PA=PA, BT=BT, BK=BK,
        HAS_E=True, HAS_A=has_a, ROWS=True, USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt))
    BKR = cm.blocks("xhc_dw_reduce", N, C)["BK"]
    NER = triton.cdiv(D, BKR)
    _xhc_dw_reduce_kernel[(NER + (triton.cdiv(KC, BKR) if has_a else 0),)](
        parte, parta, DZE, DZA, DA, dWr, *_pad4(dWp), dWres, dWpost, *_pad4(dbp), dbres, dbpost, *_pad4(dap), dares,
        dapost, S, T, N, C, k, K, NER, HAS_R=W_r is not None, HAS_E=True, HAS_RES=has_a, HAS_A=has_a, TM=TM, EW=EW,
        NP=NP, KP=KP, SP=SP, RA=RA, PA=PA, DW=triton.next_power_of_2(TM + 2), BK=BKR, BT=64, CDT=tl_dtype(cdt))
    return [dWr, dWp, dbp, dap, dWres, dbres, dares, dWpost, dbpost, dapost]


def active_param_grads(Xa, GA, DZA, DA, W_res, W_post, k: int, K: int):
    """(dW_res, db_res, dα_res, dW_post, db_post, dα_post) of :mod:`.xhc_active` (res None when ``W_res``
    is None) from X_a ``[T, k, C]`` and the backward's GA, DZA, DA: the active columns of
    :func:`_xhc_dw_kernel` and :func:`_xhc_dw_reduce_kernel`, deterministic."""
    T, _, C = Xa.shape
    KC = k * C
    _, _, KP, SP, RA, PA = layout(k, k, K)
    cdt = GA.dtype
    dev = Xa.device
    BT, BK, S, TS = _dw_blocks(cm.blocks("xhc_dw", k, C), T, RA + PA)
    e = lambda *s: torch.empty(*s, dtype=cdt, device=dev)  # noqa: E731
    parta = e(S, RA + PA, KC)
    has_res = W_res is not None
    dWres, dbres, dares = (e(k * k, KC), e(k * k), e(1)) if has_res else (None, None, None)
    dWpost, dbpost, dapost = e(k * K, KC), e(k * K), e(1)
    _xhc_dw_kernel[(triton.cdiv(KC, BK), S)](
        Xa, None, None, GA, None, None, parta, T, k, C, k, 0, TS, EW=16, NP=4, RA=RA, PA=PA, BT=BT, BK=BK,
        HAS_E=False, HAS_A=True, ROWS=False, USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt))
    BKR = cm.blocks("xhc_dw_reduce", k, C)["BK"]
    _xhc_dw_reduce_kernel[(triton.cdiv(KC, BKR),)](
        None, parta, None, DZA, DA, None, None, None, None, None, dWres, dWpost, None, None, None, None, dbres, dbpost,
        None, None, None, None, dares, dapost, S, T, k, C, k, K, 0, HAS_R=False, HAS_E=False, HAS_RES=has_res,
        HAS_A=True, TM=1, EW=16, NP=4, KP=KP, SP=SP, RA=RA, PA=PA, DW=4, BK=BKR, BT=64, CDT=tl_dtype(cdt))
    return [dWres, dbres, dares, dWpost, dbpost, dapost]
