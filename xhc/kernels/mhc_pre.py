"""Fused mHC read (``mhc_pre``): the coefficient GEMM, its epilogue and the read in one kernel.

Forward (:func:`_mhc_pre_fwd_kernel`, a program per BT tokens):

1. the GEMM ``p = vec(X)·(W ⊙ g)ᵀ`` for the pre, post and res groups with Σ vec(X)² in the same pass
   (``tl.dot``, fp32 accumulation; W and the norm gain g fp32);
2. the epilogue in registers: r = rsqrt(Σx²/(N·C) + ε), z = α·r·p + b, h_pre = σ(z_pre),
   h_post = 2σ(z_post), H_res = Sinkhorn(z_res) (row-max shift, ``t_max`` iterations, either order,
   the row clamp); or DeepSeek-V4's convention (constexpr ``DS``): h_pre = σ + ε, H_res = combᵀ;
3. the read u = Σ_j h_pre[j]·X_j, a second pass over the program's tokens (BT·N·C elements, which
   the first pass has just brought into L2).

    byte budget, per token, state dtype of s bytes:  N·C·s (X, once from DRAM) + C·s (u)
                                                    + 4·(2N + N² + RP + PP + 1) coefficients/saved logits
    (the weights, 4·(2N + N²)·N·C bytes, are read once per BT tokens)

Backward (:func:`_mhc_pre_bwd_kernel`, a program per BT tokens): dh_pre = Σ_c du·X_j (one pass over X
and du), then the epilogue's adjoint in registers — σ', the Sinkhorn adjoint (the per-step
denominators recomputed into a small per-token scratch), the norm — giving the GEMM's gradient
``DP``, the logits' gradient ``DZ`` (for db), per-token α partials and the coefficient of X in dX.
:mod:`.mhc_grad` then writes dX in one pass and dW, dg, db, dα by deterministic reductions.

    byte budget:  N·C·s + C·s  (+ 4·(2·(RP + PP) + 4) per token)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, tl_dtype
from xhc.kernels.mhc_common import mm, pick, place, sig, w_pp_tile, w_res_tile
from xhc.kernels.sinkhorn_ops import ds_start, ds_step, ds_step_bwd, sinkhorn_tile, sinkhorn_tile_bwd


@triton.jit
def _logits(P, RS, BPRE, BPOST, BRES, APRE, APOST, ARES, t, tm, N, NP: tl.constexpr, RP: tl.constexpr,
            PP: tl.constexpr, CDT: tl.constexpr):
    """(p_r [BT, RP], p_p [BT, PP], r [BT], z_pre, z_post [BT, NP], z_res [BT, NP, NP], mask3) from the
    saved GEMM outputs P and the norm factors RS."""
    cr = tl.arange(0, RP)
    cp = tl.arange(0, PP)
    W = RP + PP
    pr = tl.load(P + t[:, None] * W + cr[None, :], mask=tm[:, None], other=0.0).to(CDT)
    pp = tl.load(P + t[:, None] * W + RP + cp[None, :], mask=tm[:, None], other=0.0).to(CDT)
    r = tl.load(RS + t, mask=tm, other=0.0).to(CDT)
    return pr, pp, r


@triton.jit
def _epilogue(pr, pp, r, BPRE, BPOST, BRES, APRE, APOST, ARES, tm, N, NP: tl.constexpr, RP: tl.constexpr,
              PP: tl.constexpr, BT: tl.constexpr, CDT: tl.constexpr):
    jn = tl.arange(0, NP)
    jm = jn < N
    cp = tl.arange(0, PP)
    apre = tl.load(APRE).to(CDT)
    apost = tl.load(APOST).to(CDT)
    ares = tl.load(ARES).to(CDT)
    zpre = apre * r[:, None] * pick(pp, cp, NP, 0) + tl.load(BPRE + jn, mask=jm, other=0.0).to(CDT)[None, :]
    zpost = apost * r[:, None] * pick(pp, cp, NP, NP) + tl.load(BPOST + jn, mask=jm, other=0.0).to(CDT)[None, :]
    i3 = tl.arange(0, NP)[None, :, None]
    j3 = tl.arange(0, NP)[None, None, :]
    mask3 = tm[:, None, None] & (i3 < N) & (j3 < N)
    bres = tl.load(BRES + i3 * N + j3, mask=(i3 < N) & (j3 < N), other=0.0).to(CDT)
    zres = ares * r[:, None, None] * tl.reshape(pr, [BT, NP, NP]) + bres
    return zpre, zpost, zres, mask3


@triton.jit
def _mhc_pre_fwd_kernel(X, WPRE, WPOST, WRES, G, BPRE, BPOST, BRES, APRE, APOST, ARES,
                        U, HPRE, HPOST, HRES, P, RS, T, N, C, norm_eps, t_max, sk_eps,
                        HAS_G: tl.constexpr, ROW_LAST: tl.constexpr, CLAMP: tl.constexpr, DS: tl.constexpr,
                        NP: tl.constexpr,
                        RP: tl.constexpr, PP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                        USE_DOT: tl.constexpr, PREC: tl.constexpr, CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    D = N * C
    acc_r = tl.zeros([BT, RP], dtype=CDT)
    acc_p = tl.zeros([BT, PP], dtype=CDT)
    ss = tl.zeros([BT], dtype=CDT)
    for k0 in range(0, D, BK):  # 1. the GEMM and Σx² in one pass
        k = k0 + tl.arange(0, BK)
        km = k < D
        x = tl.load(X + t[:, None] * D + k[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(CDT)
        ss += tl.sum(x * x, 1)
        acc_r += mm(x, tl.trans(w_res_tile(WRES, G, k, km, N, D, NP, RP, HAS_G, CDT)), USE_DOT, PREC)
        acc_p += mm(x, tl.trans(w_pp_tile(WPRE, WPOST, G, k, km, N, D, NP, PP, HAS_G, CDT)), USE_DOT, PREC)
    r = 1.0 / tl.sqrt(ss / D + norm_eps)  # 2. the epilogue
    cr = tl.arange(0, RP)
    cp = tl.arange(0, PP)
    tl.store(P + t[:, None] * (RP + PP) + cr[None, :], acc_r, mask=tm[:, None])
    tl.store(P + t[:, None] * (RP + PP) + RP + cp[None, :], acc_p, mask=tm[:, None])
    tl.store(RS + t, r, mask=tm)
    zpre, zpost, zres, mask3 = _epilogue(acc_r, acc_p, r, BPRE, BPOST, BRES, APRE, APOST, ARES, tm, N, NP, RP,
                                         PP, BT, CDT)
    jn = tl.arange(0, NP)
    jm = jn < N
    hmask = tm[:, None] & jm[None, :]
    if DS:  # DeepSeek-V4: h_pre = σ(z) + ε
        hpre = tl.where(hmask, sig(zpre) + sk_eps, 0.0)
    else:
        hpre = tl.where(hmask, sig(zpre), 0.0)
    tl.store(HPRE + t[:, None] * N + jn[None, :], hpre, mask=hmask)
    tl.store(HPOST + t[:, None] * N + jn[None, :], 2.0 * sig(zpost), mask=hmask)
    i3 = tl.arange(0, NP)[None, :, None]
    j3 = tl.arange(0, NP)[None, None, :]
    if DS:  # DeepSeek-V4 (docs/math.md §2.h): comb = softmax + ε, a column step, (t_max − 1) × (row, column); H = combᵀ
        p, M = ds_start(zres, mask3, sk_eps)
        M = ds_step(M, P, 0, 0, sk_eps, 1, False, 1, NP)
        for _ in range(t_max - 1):
            M = ds_step(M, P, 0, 0, sk_eps, 2, False, 1, NP)
            M = ds_step(M, P, 0, 0, sk_eps, 1, False, 1, NP)
        tl.store(HRES + t[:, None, None] * N * N + j3 * N + i3, M, mask=mask3)
    else:
        M = sinkhorn_tile(zres, mask3, t_max, sk_eps, ROW_LAST, CLAMP)
        tl.store(HRES + t[:, None, None] * N * N + i3 * N + j3, M, mask=mask3)
    for c0 in range(0, C, BC):  # 3. the read
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        x3 = tl.load(X + t[:, None, None] * D + jn[None, :, None] * C + c[None, None, :],
                     mask=hmask[:, :, None] & cmk[None, None, :], other=0.0).to(CDT)
        u = tl.sum(hpre[:, :, None] * x3, 1)
        tl.store(U + t[:, None] * C + c[None, :], cast(u, U), mask=tm[:, None] & cmk[None, :])


@triton.jit
def _mhc_pre_bwd_kernel(X, DU, DHPRE, DHPOST, DHRES, P, RS, BPRE, BPOST, BRES, APRE, APOST, ARES, S,
                        DP, DZ, DA, COEF, T, N, C, t_max, sk_eps,
                        HAS_DU: tl.constexpr, HAS_DHPRE: tl.constexpr, HAS_DHPOST: tl.constexpr,
                        HAS_DHRES: tl.constexpr, ROW_LAST: tl.constexpr, CLAMP: tl.constexpr, DS: tl.constexpr,
                        NS: tl.constexpr, NP: tl.constexpr,
                        RP: tl.constexpr, PP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    D = N * C
    jn = tl.arange(0, NP)
    jm = jn < N
    hmask = tm[:, None] & jm[None, :]
    dhpre = tl.zeros([BT, NP], dtype=CDT)
    if HAS_DU:  # dh_pre = Σ_c du·X_j
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            cmk = c < C
            x3 = tl.load(X + t[:, None, None] * D + jn[None, :, None] * C + c[None, None, :],
                         mask=hmask[:, :, None] & cmk[None, None, :], other=0.0).to(CDT)
            du = tl.load(DU + t[:, None] * C + c[None, :], mask=tm[:, None] & cmk[None, :], other=0.0).to(CDT)
            dhpre += tl.sum(x3 * du[:, None, :], 2)
    if HAS_DHPRE:
        dhpre += tl.load(DHPRE + t[:, None] * N + jn[None, :], mask=hmask, other=0.0).to(CDT)
    pr, pp, r = _logits(P, RS, BPRE, BPOST, BRES, APRE, APOST, ARES, t, tm, N, NP, RP, PP, CDT)
    zpre, zpost, zres, mask3 = _epilogue(pr, pp, r, BPRE, BPOST, BRES, APRE, APOST, ARES, tm, N, NP, RP, PP, BT,
                                         CDT)
    s = sig(zpre)
    dzpre = tl.where(hmask, dhpre * s * (1.0 - s), 0.0)
    dzpost = tl.zeros([BT, NP], dtype=CDT)
    if HAS_DHPOST:
        s = sig(zpost)
        dhpost = tl.load(DHPOST + t[:, None] * N + jn[None, :], mask=hmask, other=0.0).to(CDT)
        dzpost = tl.where(hmask, dhpost * 2.0 * s * (1.0 - s), 0.0)
    dzres = tl.zeros([BT, NP, NP], dtype=CDT)
    i3 = tl.arange(0, NP)[None, :, None]
    j3 = tl.arange(0, NP)[None, None, :]
    if HAS_DHRES and DS:  # xhc.doubly_stochastic.sinkhorn_deepseek_backward; dcomb = dHᵀ
        base = t[:, None] * NS * NP
        p, M = ds_start(zres, mask3, sk_eps)
        k = 0
        M = ds_step(M, S, base, k, sk_eps, 1, True, NS, NP)
        k += 1
        for _ in range(t_max - 1):
            M = ds_step(M, S, base, k, sk_eps, 2, True, NS, NP)
            M = ds_step(M, S, base, k + 1, sk_eps, 1, True, NS, NP)
            k += 2
        Gd = tl.load(DHRES + t[:, None, None] * N * N + j3 * N + i3, mask=mask3, other=0.0).to(CDT)
        for _ in range(t_max - 1):
            Gd, M = ds_step_bwd(Gd, M, S, base, k - 1, sk_eps, 1, NP)
            Gd = tl.where(mask3, Gd, 0.0)  # padding stays 0 (else it grows by 1/ε per step)
            Gd, M = ds_step_bwd(Gd, M, S, base, k - 2, sk_eps, 2, NP)
            Gd = tl.where(mask3, Gd, 0.0)  # padding stays 0 (else it grows by 1/ε per step)
            k -= 2
        Gd, M = ds_step_bwd(Gd, M, S, base, k - 1, sk_eps, 1, NP)
        Gd = tl.where(mask3, Gd, 0.0)  # padding stays 0 (else it grows by 1/ε per step)
        dzres = tl.where(mask3, p * (Gd - tl.sum(Gd * p, 2)[:, :, None]), 0.0)
    if HAS_DHRES and not DS:  # the Sinkhorn adjoint (xhc.doubly_stochastic.sinkhorn_backward), sums in S
        Gd = tl.load(DHRES + t[:, None, None] * N * N + i3 * N + j3, mask=mask3, other=0.0).to(CDT)
        dzres = sinkhorn_tile_bwd(zres, mask3, Gd, S, t[:, None] * NS * NP, t_max, sk_eps, ROW_LAST, CLAMP, NS, NP)
    apre = tl.load(APRE).to(CDT)
    apost = tl.load(APOST).to(CDT)
    ares = tl.load(ARES).to(CDT)
    cp = tl.arange(0, PP)
    cr = tl.arange(0, RP)
    ppre = pick(pp, cp, NP, 0)
    ppost = pick(pp, cp, NP, NP)
    dzr = tl.reshape(dzres, [BT, RP])
    dz_p = place(dzpre, cp, NP, 0) + place(dzpost, cp, NP, NP)
    W = RP + PP
    tl.store(DZ + t[:, None] * W + cr[None, :], dzr, mask=tm[:, None])
    tl.store(DZ + t[:, None] * W + RP + cp[None, :], dz_p, mask=tm[:, None])
    dp_p = r[:, None] * (place(dzpre * apre, cp, NP, 0) + place(dzpost * apost, cp, NP, NP))
    tl.store(DP + t[:, None] * W + cr[None, :], dzr * (ares * r[:, None]), mask=tm[:, None])
    tl.store(DP + t[:, None] * W + RP + cp[None, :], dp_p, mask=tm[:, None])
    ga_pre = tl.sum(dzpre * ppre, 1)
    ga_post = tl.sum(dzpost * ppost, 1)
    ga_res = tl.sum(dzr * pr, 1)
    tl.store(DA + t * 3, ga_pre * r, mask=tm)  # dα_g = Σ_t r·Σ_m dz·p
    tl.store(DA + t * 3 + 1, ga_post * r, mask=tm)
    tl.store(DA + t * 3 + 2, ga_res * r, mask=tm)
    dr = apre * ga_pre + apost * ga_post + ares * ga_res  # dL/dr; dr/dx = −r³·x/D
    tl.store(COEF + t, -dr * r * r * r / D, mask=tm)


def owner_of(X, H, h_post):
    """The backward node of the :class:`MHCPre` op that computed ``H`` and ``h_post`` from this very
    ``X``, or None (the write then returns its own dX)."""
    node = getattr(H, "grad_fn", None)
    if node is None or not isinstance(node, MHCPre._backward_cls) or getattr(h_post, "grad_fn", None) is not node:
        return None
    key = sg.state_key(X)
    return node if key is not None and getattr(node, "_x_key", None) == key else None


class MHCPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W_pre, W_post, W_res, b_pre, b_post, b_res, a_pre, a_post, a_res, gain, cfg):
        norm_eps, t_max, sk_eps, order, clamp, ds = cfg
        N, C = X.shape[-2:]
        lead = X.shape[:-2]
        T = math.prod(lead)
        NP, RP, PP = cm.groups(N)
        cdt = compute_dtype(X, W_pre)
        Xc = X.reshape(T, N, C).contiguous()
        dev = X.device
        u = torch.empty(T, C, dtype=X.dtype, device=dev)
        hpre, hpost = torch.empty(T, N, dtype=cdt, device=dev), torch.empty(T, N, dtype=cdt, device=dev)
        H = torch.empty(T, N, N, dtype=cdt, device=dev)
        P = torch.empty(T, RP + PP, dtype=cdt, device=dev)
        RS = torch.empty(T, dtype=cdt, device=dev)
        b = cm.blocks("mhc_pre_fwd", N, C)
        BT, BK = b["BT"], b["BK"]
        BC = cm.block_c(BT, NP, C)
        if T > 0:
            _mhc_pre_fwd_kernel[(triton.cdiv(T, BT),)](
                Xc, W_pre, W_post, W_res, gain, b_pre, b_post, b_res, a_pre, a_post, a_res, u, hpre, hpost, H, P, RS,
                T, N, C, norm_eps, t_max, sk_eps, HAS_G=gain is not None, ROW_LAST=order == "row_last", CLAMP=clamp, DS=ds, NP=NP, RP=RP,
                PP=PP, BT=BT, BK=BK, BC=BC, USE_DOT=cm.dot_ok(cdt), PREC=cm.dot_precision(), CDT=tl_dtype(cdt))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros launched)
        ctx.save_for_backward(X, W_pre, W_post, W_res, b_pre, b_post, b_res, a_pre, a_post, a_res, gain, hpre, H, P, RS)
        ctx.cfg = cfg
        ctx._x_key, ctx._pending = sg.state_key(X), None
        return u.view(*lead, C), hpre.view(*lead, N), hpost.view(*lead, N), H.view(*lead, N, N)

    @staticmethod
    def backward(ctx, du, dhpre, dhpost, dH):
        from xhc.kernels import mhc_grad

        X, W_pre, W_post, W_res, b_pre, b_post, b_res, a_pre, a_post, a_res, gain, hpre, H, P, RS = ctx.saved_tensors
        norm_eps, t_max, sk_eps, order, clamp, ds = ctx.cfg
        N, C = X.shape[-2:]
        T = math.prod(X.shape[:-2])
        NP, RP, PP = cm.groups(N)
        cdt = compute_dtype(X, W_pre)
        dev = X.device
        Xc = X.reshape(T, N, C).contiguous()
        c = lambda g, *s: None if g is None else g.reshape(*s).contiguous()  # noqa: E731
        duc, dhprec, dhpostc, dHc = c(du, T, C), c(dhpre, T, N), c(dhpost, T, N), c(dH, T, N, N)
        pend, ctx._pending = ctx._pending, None
        dXp = pend[1] if pend is not None and pend[0] == torch._C._current_graph_task_id() else None
        BT = cm.blocks("mhc_pre_bwd", N, C)["BT"]
        grid = triton.cdiv(T, BT)
        NS = max(1, 2 * t_max - 1) if ds else max(1, 2 * t_max + (1 if order == "row_last" else 0) + (1 if clamp else 0))
        S = torch.empty(grid * BT, NS, NP, dtype=cdt, device=dev)
        DP, DZ = torch.empty(T, RP + PP, dtype=cdt, device=dev), torch.empty(T, RP + PP, dtype=cdt, device=dev)
        DA, COEF = torch.empty(T, 3, dtype=cdt, device=dev), torch.empty(T, dtype=cdt, device=dev)
        if T > 0:
            _mhc_pre_bwd_kernel[(grid,)](
                Xc, duc, dhprec, dhpostc, dHc, P, RS, b_pre, b_post, b_res, a_pre, a_post, a_res, S, DP, DZ, DA, COEF,
                T, N, C, t_max, sk_eps, HAS_DU=duc is not None, HAS_DHPRE=dhprec is not None,
                HAS_DHPOST=dhpostc is not None, HAS_DHRES=dHc is not None, ROW_LAST=order == "row_last", CLAMP=clamp, DS=ds, NS=NS,
                NP=NP, RP=RP, PP=PP, BT=BT, BC=cm.block_c(BT, NP, C), CDT=tl_dtype(cdt))
        dX = None
        if ctx.needs_input_grad[0]:
            dX = mhc_grad.state_grad(Xc, duc, dXp, hpre, H, DP, COEF, W_pre, W_post, W_res, gain).view(X.shape)
        grads = [None] * 10
        if any(ctx.needs_input_grad[1:11]):
            grads = mhc_grad.param_grads(Xc, DP, DZ, DA, W_pre, W_post, W_res, gain)
        return (dX, *grads, None)


def mhc_pre(X, W_pre, W_post, W_res, b_pre, b_post, b_res, a_pre, a_post, a_res, gain, norm_eps: float, t_max: int,
            sk_eps: float, order: str, clamp: bool = False, convention: str = "paper"):
    """(u ``[..., C]`` in X's dtype, h_pre ``[..., N]``, h_post ``[..., N]``, H_res ``[..., N, N]``) of
    the dynamic mHC map (docs/math.md §2.0) from ``X`` ``[..., N, C]``: RMSNorm of vec X with gain
    ``gain`` (or None), z = α·x̂Wᵀ + b, h_pre = σ, h_post = 2σ, H_res = Sinkhorn (then the row-sum
    clamp when ``clamp``); u = Σ_j h_pre[j]·X_j.  ``convention="deepseek_v4"`` (docs/math.md §2.h):
    h_pre = σ + ε, H_res = combᵀ with DeepSeek-V4's Sinkhorn (ε = ``sk_eps``; no clamp, no order).
    Every weight fp32 (``W_*`` ``[d, N·C]``, ``b_*`` ``[d]``, ``a_*`` ``[1]``)."""
    f = lambda t: None if t is None else t.contiguous()  # noqa: E731
    return MHCPre.apply(X, f(W_pre), f(W_post), f(W_res), f(b_pre), f(b_post), f(b_res), f(a_pre), f(a_post),
                        f(a_res), f(gain),
                        (norm_eps, t_max, sk_eps, order, bool(clamp) and convention != "deepseek_v4",
                         convention == "deepseek_v4"))
