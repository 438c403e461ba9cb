"""Fused active mappings of a Flash window's write (``xhc_active``): H_res, H_post and P = diag(p)·H_post
from the carried active streams X_a in one kernel, with a Flash-4sub sublayer's split read in the same
pass (docs/math.md §3.4, §4.1, §4.2 "Writes").

Every write inside an xHC-Flash or Flash-4sub window generates its mappings from the *current*
carried X_a ``[T, k, C]`` (not from the window-entry state), so they cannot come from the window's
entry kernel.  In Flash-4sub the sublayer's read u_t = base_t + Σ_j h_t[I_j]·X_a[j] (docs/math.md §4.2)
reads the same X_a (nothing changes it before the write), so the kernel runs at the read and gives u_t
too; the state keeps the mappings for the write.

Forward (:func:`_xhc_active_fwd_kernel`, a program per BT tokens): one pass over X_a — the GEMM
``vec(X_a)·[W_res; W_post]ᵀ`` (``tl.dot``, fp32 accumulation) with Σx² (and the read) in the same loads —
then in registers the RMSNorm applied after the GEMM (r_a = rsqrt(mean x² + ε)), H_res =
clamp_rows(Sinkhorn(α·r_a·proj + b)) (the shared tile of :func:`.sinkhorn_ops.sinkhorn_tile`), H_post =
2σ(α·r_a·proj + b) and P = diag(p)·H_post.

    byte budget, per token, state dtype s:  k·C·s (X_a, once)  + 4·(k² + 2·k·K) (H_res, H_post, P)
                                            + 4·(RA + PA + 1) saved for the backward
                                            [read: + C·4 (base) + C·s (u)]
    (the weights, 4·(k² + k·K)·k·C bytes, are read once per BT tokens)

Backward (:func:`_xhc_active_bwd_kernel`, a program per BT tokens): P's product rule (dp, dH_post),
σ', the Sinkhorn adjoint (per-step sums in a per-token scratch) give the GEMM's output gradient GA,
the logits' gradients (for db) and the α partials; then a pass over X_a writes
dX_a = GA·W_a + a·X_a (a: the RMSNorm's term) [+ h_t[I_j]·du] [+ the write's dX_a, handed over by the
write that took P (:func:`.state_grad.claim_carried`): X_a's gradient is written once], and gives
dh_t[I_j] = Σ_c du·X_a[j], written as row t of the window entry's read-weight gradient buffer
(:mod:`.xhc_entry`).  dW: :mod:`.xhc_grad`'s ``_xhc_dw_kernel`` and ``_xhc_dw_reduce_kernel`` on the
active columns only (X_a read directly): per-split partials summed in a fixed order, deterministic.

    byte budget:  2·k·C·s (X_a in, dX_a out) + 4·(k² + 2·k·K + RA + PA + 1)  (+ k·C·s per token for dW)
                  [+ k·C·s (the write's dX_a)]  [read: + C·s (du) + 4·TM·N (dh)]

Column layout: :func:`.xhc_entry.layout` (res ``RA = KP²`` columns, post ``PA = KP·SP``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, tl_dtype
from xhc.kernels.mhc_common import mm, sig
from xhc.kernels.sinkhorn_ops import sinkhorn_tile, sinkhorn_tile_bwd
from xhc.kernels.xhc_common import active_logits, layout, post_adjoint, w_post_act_tile, w_res_act_tile, warps


@triton.jit
def _post_logits(accp, ra, BPOST, APOST, tm, k, K, BT: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
                 CDT: tl.constexpr):
    """(z_post [BT, KP, SP], pmask3) without a res group."""
    i3 = tl.arange(0, KP)[None, :, None]
    s3 = tl.arange(0, SP)[None, None, :]
    pmask3 = tm[:, None, None] & (i3 < k) & (s3 < K)
    apost = tl.load(APOST).to(CDT)
    bpost = tl.load(BPOST + i3 * K + s3, mask=(i3 < k) & (s3 < K), other=0.0).to(CDT)
    return apost * ra[:, None, None] * tl.reshape(accp, [BT, KP, SP]) + bpost, pmask3


@triton.jit
def _xhc_active_fwd_kernel(XA, PR, WRES, BRES, ARES, WPOST, BPOST, APOST, HRES, HPOST, PW, PAC, RAS,
                           BASE, IDX, HR, U, T, C, k, K, norm_eps, t_max, sk_eps, N, ROW, TMN, BSTRIDE,
                           HAS_RES: tl.constexpr, HAS_READ: tl.constexpr, ROW_LAST: tl.constexpr, KP: tl.constexpr,
                           SP: tl.constexpr,
                           RA: tl.constexpr, PA: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                           USE_DOT: tl.constexpr, PREC: tl.constexpr, CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    KC = k * C
    accr = tl.zeros([BT, RA], dtype=CDT)
    accp = tl.zeros([BT, PA], dtype=CDT)
    ss = tl.zeros([BT], dtype=CDT)
    kq = tl.arange(0, KP)
    if HAS_READ:  # the read weights at the active streams, h[ROW, I_j]
        km2 = tm[:, None] & (kq[None, :] < k)
        Iv = tl.load(IDX + t[:, None] * k + kq[None, :], mask=km2, other=0)
        hr = tl.load(HR + t[:, None] * TMN + ROW * N + Iv, mask=km2, other=0.0).to(CDT)  # [BT, KP]
    for c0 in range(0, C, BC):  # the GEMM, Σx² (and the read) in one pass over X_a
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        m2 = tm[:, None] & cmk[None, :]
        if HAS_READ:  # u = base + Σ_j h[ROW, I_j]·X_a[j]
            u = tl.load(BASE + t[:, None] * BSTRIDE + c[None, :], mask=m2, other=0.0).to(CDT)
        for j in range(0, k):
            xa = tl.load(XA + t[:, None] * KC + j * C + c[None, :], mask=m2, other=0.0).to(CDT)
            ss += tl.sum(xa * xa, 1)
            if HAS_RES:
                accr += mm(xa, tl.trans(w_res_act_tile(WRES, j, c, cmk, k, C, KP, RA, CDT)), USE_DOT, PREC)
            accp += mm(xa, tl.trans(w_post_act_tile(WPOST, j, c, cmk, k, K, C, SP, PA, CDT)), USE_DOT, PREC)
            if HAS_READ:
                u += tl.sum(tl.where(kq[None, :] == j, hr, 0.0), 1)[:, None] * xa
        if HAS_READ:
            tl.store(U + t[:, None] * C + c[None, :], cast(u, U), mask=m2)
    ra = 1.0 / tl.sqrt(ss / KC + norm_eps)
    AW = RA + PA
    tl.store(PAC + t[:, None] * AW + tl.arange(0, RA)[None, :], accr, mask=tm[:, None])
    tl.store(PAC + t[:, None] * AW + RA + tl.arange(0, PA)[None, :], accp, mask=tm[:, None])
    tl.store(RAS + t, ra, mask=tm)
    i3 = tl.arange(0, KP)[None, :, None]
    q3 = tl.arange(0, KP)[None, None, :]
    s3 = tl.arange(0, SP)[None, None, :]
    if HAS_RES:
        zres, mask3, zpost, pmask3 = active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT, KP, SP,
                                                    CDT)
        M = sinkhorn_tile(zres, mask3, t_max, sk_eps, ROW_LAST, True)  # the row-sum clamp is always on in xHC
        tl.store(HRES + t[:, None, None] * k * k + i3 * k + q3, M, mask=mask3)
    else:
        zpost, pmask3 = _post_logits(accp, ra, BPOST, APOST, tm, k, K, BT, KP, SP, CDT)
    p = tl.load(PR + t[:, None] * k + kq[None, :], mask=tm[:, None] & (kq[None, :] < k), other=0.0).to(CDT)
    hpost = 2.0 * sig(zpost)
    tl.store(HPOST + t[:, None, None] * k * K + i3 * K + s3, hpost, mask=pmask3)
    tl.store(PW + t[:, None, None] * k * K + i3 * K + s3, p[:, :, None] * hpost, mask=pmask3)


@triton.jit
def _xhc_active_bwd_kernel(XA, DHRES, DHPOST, DPW, PR, PAC, RAS, WRES, BRES, ARES, WPOST, BPOST, APOST, S,
                           DXIN, DXA, DPR, GA, DZA, DA, DU, IDX, HR, DH, DBASE, T, C, k, K, t_max, sk_eps,
                           N, ROW, TM, TMN,
                           HAS_RES: tl.constexpr, HAS_DHRES: tl.constexpr, HAS_DHPOST: tl.constexpr,
                           HAS_DPW: tl.constexpr, NEED_DXA: tl.constexpr, HAS_DXIN: tl.constexpr,
                           HAS_DU: tl.constexpr, HAS_DBASE: tl.constexpr, DH_ALL: tl.constexpr, NPR: tl.constexpr,
                           ROW_LAST: tl.constexpr,
                           NS: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, RA: tl.constexpr, PA: tl.constexpr,
                           BT: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
                           CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    KC = k * C
    AW = RA + PA
    cra = tl.arange(0, RA)
    cpa = tl.arange(0, PA)
    accr = tl.load(PAC + t[:, None] * AW + cra[None, :], mask=tm[:, None], other=0.0).to(CDT)
    accp = tl.load(PAC + t[:, None] * AW + RA + cpa[None, :], mask=tm[:, None], other=0.0).to(CDT)
    ra = tl.load(RAS + t, mask=tm, other=0.0).to(CDT)
    i3 = tl.arange(0, KP)[None, :, None]
    q3 = tl.arange(0, KP)[None, None, :]
    kq = tl.arange(0, KP)
    km2 = tm[:, None] & (kq[None, :] < k)
    if HAS_RES:
        zres, mask3, zpost, pmask3 = active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT, KP, SP,
                                                    CDT)
    else:
        zpost, pmask3 = _post_logits(accp, ra, BPOST, APOST, tm, k, K, BT, KP, SP, CDT)
    p = tl.load(PR + t[:, None] * k + kq[None, :], mask=km2, other=0.0).to(CDT)
    dzpost, dp = post_adjoint(zpost, pmask3, p, DHPOST, DPW, t, k, K, HAS_DHPOST, HAS_DPW, BT, KP, SP, CDT)
    tl.store(DPR + t[:, None] * k + kq[None, :], dp, mask=km2)
    dzp2 = tl.reshape(dzpost, [BT, PA])
    apost = tl.load(APOST).to(CDT)
    gpost = tl.sum(dzp2 * accp, 1)
    gap = apost * ra[:, None] * dzp2
    gres = tl.zeros([BT], dtype=CDT)
    gar = tl.zeros([BT, RA], dtype=CDT)
    dzr2 = tl.zeros([BT, RA], dtype=CDT)
    ares = apost * 0.0
    if HAS_RES:
        if HAS_DHRES:  # the Sinkhorn adjoint (xhc.doubly_stochastic.sinkhorn_backward), per-step sums in S
            Gd = tl.load(DHRES + t[:, None, None] * k * k + i3 * k + q3, mask=mask3, other=0.0).to(CDT)
            dzres = sinkhorn_tile_bwd(zres, mask3, Gd, S, t[:, None] * NS * KP, t_max, sk_eps, ROW_LAST, True, NS, KP)
            dzr2 += tl.reshape(dzres, [BT, RA])
        ares = tl.load(ARES).to(CDT)
        gres = tl.sum(dzr2 * accr, 1)
        gar = ares * ra[:, None] * dzr2
    tl.store(GA + t[:, None] * AW + cra[None, :], gar, mask=tm[:, None])
    tl.store(GA + t[:, None] * AW + RA + cpa[None, :], gap, mask=tm[:, None])
    tl.store(DZA + t[:, None] * AW + cra[None, :], dzr2, mask=tm[:, None])
    tl.store(DZA + t[:, None] * AW + RA + cpa[None, :], dzp2, mask=tm[:, None])
    a4 = tl.arange(0, 4)[None, :]  # dα partials in the xhc_grad layout: (pre = 0, res, post)
    da = tl.where(a4 == 1, (gres * ra)[:, None], 0.0) + tl.where(a4 == 2, (gpost * ra)[:, None], 0.0)
    tl.store(DA + t[:, None] * 3 + a4, da, mask=tm[:, None] & (a4 < 3))
    if HAS_DU:  # the fused read: h[ROW, I_j]
        Iv = tl.load(IDX + t[:, None] * k + kq[None, :], mask=km2, other=0)
        hr = tl.load(HR + t[:, None] * TMN + ROW * N + Iv, mask=km2, other=0.0).to(CDT)  # [BT, KP]
    dhr = tl.zeros([BT, KP], dtype=CDT)  # Σ_c du·X_a[j]
    if NEED_DXA or HAS_DU:  # dX_a = GA·W_a − (α_res·g_res + α_post·g_post)·r_a³/(kC)·X_a (the RMSNorm's term)
        a1a = -(ares * gres + apost * gpost) * ra * ra * ra / KC  # [+ the read's h·du] [+ the write's]
        for j in range(0, k):
            for c0 in range(0, C, BC):
                c = c0 + tl.arange(0, BC)
                cmk = c < C
                m2 = tm[:, None] & cmk[None, :]
                xa = tl.load(XA + t[:, None] * KC + j * C + c[None, :], mask=m2, other=0.0).to(CDT)
                g = mm(gap, w_post_act_tile(WPOST, j, c, cmk, k, K, C, SP, PA, CDT), USE_DOT, PREC)
                if HAS_RES:
                    g += mm(gar, w_res_act_tile(WRES, j, c, cmk, k, C, KP, RA, CDT), USE_DOT, PREC)
                g += a1a[:, None] * xa
                if HAS_DU:
                    du = tl.load(DU + t[:, None] * C + c[None, :], mask=m2, other=0.0).to(CDT)
                    g += tl.sum(tl.where(kq[None, :] == j, hr, 0.0), 1)[:, None] * du
                    dhr += tl.where(kq[None, :] == j, tl.sum(du * xa, 1)[:, None], 0.0)
                    if HAS_DBASE:
                        if j == 0:  # the base readout's gradient, in its own dtype
                            tl.store(DBASE + t[:, None] * C + c[None, :], cast(du, DBASE), mask=m2)
                if HAS_DXIN:  # the write's dX_a, handed over (state_grad.claim_carried)
                    g += tl.load(DXIN + t[:, None] * KC + j * C + c[None, :], mask=m2, other=0.0).to(CDT)
                if NEED_DXA:
                    tl.store(DXA + t[:, None] * KC + j * C + c[None, :], cast(g, DXA), mask=m2)
    if HAS_DU:  # dh[ROW, I_j] = Σ_c du·X_a[j]: row ROW of the read weights' gradient (DH_ALL: the other rows 0)
        n = tl.arange(0, NPR)
        row = tl.zeros([BT, NPR], dtype=CDT)  # [BT, NPR] tiles only (a [BT, KP, NPR] one spilled 8 bytes on sm_90)
        for j in range(0, k):
            Ij = tl.sum(tl.where(kq[None, :] == j, Iv, 0), 1)
            dj = tl.sum(tl.where(kq[None, :] == j, dhr, 0.0), 1)
            row += tl.where(Ij[:, None] == n[None, :], dj[:, None], 0.0)
        nm = tm[:, None] & (n[None, :] < N)
        tl.store(DH + t[:, None] * TMN + ROW * N + n[None, :], cast(row, DH), mask=nm)
        if DH_ALL:
            for r in range(0, TM):
                if r != ROW:
                    tl.store(DH + t[:, None] * TMN + r * N + n[None, :], cast(row * 0.0, DH), mask=nm)


# ------------------------------------------------------------------------------------------------
def _blocks(k: int, C: int, RA: int, PA: int):
    """(BT, BC): BT tokens a program (``mhc_common`` blocks ``xhc_active``, autotuned); weight tiles
    ``[RA + PA, BC]`` of at most 2048 values beside the X_a tile and the [BT, KP, KP] Sinkhorn tiles
    (sm_90: 16 bytes spilled at BC = 128, k = 4)."""
    BT = int(cm.blocks("xhc_active", k, C)["BT"])
    pow2 = 1 << (max(2048 // (RA + PA), 1).bit_length() - 1)  # the power of two ≤ 2048 / (RA + PA)
    return BT, max(16, min(triton.next_power_of_2(int(C)), pow2))


class XHCActive(torch.autograd.Function):
    """(H_res or None, H_post, P, u or None) of a Flash window's write from the carried X_a, with the
    sublayer's read when ``base`` is given; see :func:`xhc_active`."""

    @staticmethod
    def forward(ctx, Xa, p, W_res, b_res, a_res, W_post, b_post, a_post, base, I, h, cfg):
        K, norm_eps, t_max, sk_eps, order, row, u_dtype = cfg
        k, C = Xa.shape[-2:]
        lead = Xa.shape[:-2]
        T = math.prod(lead)
        _, _, KP, SP, RA, PA = layout(k, k, K)
        cdt = compute_dtype(Xa, W_post)
        Xc, pc = Xa.reshape(T, k, C).contiguous(), p.reshape(T, k).contiguous()
        dev = Xa.device
        e = lambda *s: torch.empty(*s, dtype=cdt, device=dev)  # noqa: E731
        has_res, has_read = W_res is not None, base is not None
        H = e(T, k, k) if has_res else None
        Hpost, PW, PAC, RAS = e(T, k, K), e(T, k, K), e(T, RA + PA), e(T)
        TM, N = h.shape[-2:] if has_read else (1, 1)
        basec = Ic = hc = u = None
        if has_read:
            basec = base.reshape(T, C)  # a window's base readout is a slice of the entry's [T, TM, C]: read in place
            if basec.stride(-1) != 1:
                basec = basec.contiguous()
            Ic, hc = I.reshape(T, k).contiguous(), h.reshape(T, TM, N).contiguous()
            u = torch.empty(T, C, dtype=u_dtype, device=dev)
        BT, BC = _blocks(k, C, RA, PA)
        if T > 0:
            _xhc_active_fwd_kernel[(triton.cdiv(T, BT),)](
                Xc, pc, W_res, b_res, a_res, W_post, b_post, a_post, H, Hpost, PW, PAC, RAS, basec, Ic, hc, u, T, C, k,
                K, norm_eps, t_max, sk_eps, N, row, TM * N, basec.stride(0) if has_read else 0, HAS_RES=has_res,
                HAS_READ=has_read, ROW_LAST=order == "row_last", KP=KP, SP=SP, RA=RA, PA=PA, BT=BT,
                BC=BC, USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt), num_warps=warps(KP))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(Xa, p, W_res, b_res, a_res, W_post, b_post, a_post, PAC, RAS, I, h)
        ctx.cfg, ctx.base_dtype = cfg, None if base is None else base.dtype
        # the owner of X_a's gradient: the write that takes P hands its dX_a over (state_grad.claim_carried),
        # so dX_a is written once, here; the read weights' gradient goes to the window entry's buffer
        ctx._xa_key, ctx._claims, ctx._pending = sg.state_key(Xa), {}, {}
        ctx.h_owner = _claim_read_rows(h, row) if has_read else None
        view = lambda x, *s: None if x is None else x.view(*lead, *s)  # noqa: E731
        return view(H, k, k), view(Hpost, k, K), view(PW, k, K), view(u, C)

    @staticmethod
    def backward(ctx, dH, dHpost, dPW, du):
        from xhc.kernels import xhc_grad

        Xa, p, W_res, b_res, a_res, W_post, b_post, a_post, PAC, RAS, I, h = ctx.saved_tensors
        K, norm_eps, t_max, sk_eps, order, row, _ = ctx.cfg
        k, C = Xa.shape[-2:]
        T = math.prod(Xa.shape[:-2])
        _, _, KP, SP, RA, PA = layout(k, k, K)
        cdt = PAC.dtype
        dev = Xa.device
        has_res = W_res is not None
        Xc, pc = Xa.reshape(T, k, C).contiguous(), p.reshape(T, k).contiguous()
        c = lambda g, *s: None if g is None else g.reshape(*s).contiguous()  # noqa: E731
        dHc, dHpostc, dPWc = c(dH if has_res else None, T, k, k), c(dHpost, T, k, K), c(dPW, T, k, K)
        BT, BC = _blocks(k, C, RA, PA)
        grid = triton.cdiv(T, BT)
        NS = 2 * t_max + (1 if order == "row_last" else 0) + 1
        e = lambda *s: torch.empty(*s, dtype=cdt, device=dev)  # noqa: E731
        S = e(grid * BT, NS, KP) if has_res and dHc is not None else None
        need_dxa = ctx.needs_input_grad[0]
        dXa = torch.empty_like(Xc) if need_dxa else None
        task = torch._C._current_graph_task_id()
        pend = ctx._pending.pop("dxa", None)
        ctx._pending.clear()
        dxin = pend[1] if pend is not None and pend[0] == task else None
        dp, GA, DZA, DA = e(T, k), e(T, RA + PA), e(T, RA + PA), e(T, 3)
        duc = c(du, T, C) if ctx.base_dtype is not None else None
        if duc is not None:  # the read's du and dh tiles beside X_a's: half the columns (sm_90: 8-16 bytes spilled)
            BC = max(16, BC // 2)
        TM, N = h.shape[-2:] if duc is not None else (1, 1)
        dbase = dh = None
        own_dh = True
        if duc is not None:
            # the base readout's gradient is du itself (written by the kernel only to change its dtype)
            dbase = duc if duc.dtype == ctx.base_dtype else torch.empty(T, C, dtype=ctx.base_dtype, device=dev)
            owner = ctx.h_owner if ctx.needs_input_grad[10] else None
            own_dh = owner is None
            dh = torch.empty(T, TM, N, dtype=h.dtype, device=dev) if own_dh else owner._dh_buf
        if T > 0:
            _xhc_active_bwd_kernel[(grid,)](
                Xc, dHc, dHpostc, dPWc, pc, PAC, RAS, W_res, b_res, a_res, W_post, b_post, a_post, S,
                dxin, dXa, dp, GA, DZA, DA, duc, None if duc is None else I.reshape(T, k).contiguous(),
                None if duc is None else h.reshape(T, TM, N).contiguous(), dh, dbase, T, C, k, K, t_max, sk_eps,
                N, row, TM, TM * N, HAS_RES=has_res, HAS_DHRES=dHc is not None,
                HAS_DHPOST=dHpostc is not None, HAS_DPW=dPWc is not None, NEED_DXA=need_dxa,
                HAS_DXIN=need_dxa and dxin is not None, HAS_DU=duc is not None,
                HAS_DBASE=duc is not None and dbase is not duc, DH_ALL=own_dh, NPR=max(2, triton.next_power_of_2(N)),
                ROW_LAST=order == "row_last", NS=NS, KP=KP, SP=SP, RA=RA, PA=PA, BT=BT, BC=BC,
                USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt), num_warps=warps(KP))
        if duc is not None and not own_dh:  # row `row` of the entry's read-weight gradient is in its buffer
            sg.hand_over(ctx.h_owner, f"dh{row}", True)
            dh = None
        grads = [None] * 6
        if any(ctx.needs_input_grad[2:8]):
            grads = xhc_grad.active_param_grads(Xc, GA, DZA, DA, W_res, W_post, k, K)
        return (None if dXa is None else dXa.view(Xa.shape), dp.view(p.shape).to(p.dtype), *grads,
                None if dbase is None else dbase.view(du.shape), None, None if dh is None else dh.view(h.shape), None)


def _claim_read_rows(h: torch.Tensor, row: int):
    """The window entry's backward node that made the read weights ``h`` ``[..., TM, N]`` and keeps a
    buffer for their gradient (:mod:`.xhc_entry`, ``_dh_buf``), with row ``row`` taken; None when there is
    none (the read weights' gradient then goes back to autograd, every other row 0)."""
    node = h.grad_fn
    if node is None or getattr(node, "_dh_buf", None) is None or not h.requires_grad:
        return None
    if f"dh{row}" in node._claims or node._dh_buf.shape[1:] != h.shape[-2:]:
        return None
    node._claims[f"dh{row}"] = True
    return node


sg.XA_OWNER_CLASSES.append(XHCActive._backward_cls)


def xhc_active(Xa, p, W_res, b_res, a_res, W_post, b_post, a_post, K: int, norm_eps: float, t_max: int,
               sk_eps: float, order: str, read=None):
    """(H_res ``[..., k, k]`` or None, H_post ``[..., k, K]``, P = diag(p)·H_post ``[..., k, K]``), fp32, from
    the carried ``Xa`` ``[..., k, C]`` and the route weights ``p`` ``[..., k]`` (module docstring).
    ``W_res`` ``[k², k·C]`` (None: no H_res, a write before the window's last), ``W_post`` ``[k·K, k·C]``,
    their biases and gates; every weight fp32 (float64 for the reference tests).

    ``read`` = (base ``[..., C]``, I ``[..., k]``, h ``[..., TM, N]``, row, u dtype): also the sublayer's
    read u = base + Σ_j h[row, I_j]·X_a[j] in the same pass over X_a (a Flash-4sub window's split read,
    docs/math.md §4.2), returned fourth; without it three values."""
    f = lambda t: None if t is None else t.contiguous()  # noqa: E731
    base, I, h, row, u_dtype = read if read is not None else (None, None, None, 0, None)
    out = XHCActive.apply(Xa, p, f(W_res), f(b_res), f(a_res), f(W_post), f(b_post), f(a_post), base, I, h,
                          (int(K), float(norm_eps), int(t_max), float(sk_eps), order, int(row), u_dtype))
    return out if read is not None else out[:3]
