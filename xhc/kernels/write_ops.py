"""The write kernel (the ``triton`` backend's :func:`xhc.kernels.write`, docs/kernels.md): new = H·X_a +
P·V, scattered into X at rows I with the other rows copied in the same pass;  backward: dX_a, dH, dP, dV
(and dX, or its term handed to the state's owner op, :mod:`.state_grad`) in one pass.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, np2, row_block_c, tl_dtype


# ================================================================================================
# write: new = H·Xa + P·V, optionally scattered into X at rows I
# ================================================================================================
@triton.jit
def _write_fwd_kernel(X, I, XA, H, P, V, OUT, N, k, K, C, HAS_I: tl.constexpr, HAS_H: tl.constexpr,
                      COPY: tl.constexpr, XA_FROM_X: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr,
                      SP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    jr = tl.arange(0, KP)[:, None]  # output slot (rows)
    qc = tl.arange(0, KP)[None, :]
    sc = tl.arange(0, SP)[None, :]
    sr = tl.arange(0, SP)[:, None]
    if HAS_H:
        h = tl.load(H + t * k * k + jr * k + qc, mask=(jr < k) & (qc < k), other=0.0).to(CDT)  # [KP, KP]
    p = tl.load(P + t * k * K + jr * K + sc, mask=(jr < k) & (sc < K), other=0.0).to(CDT)  # [KP, SP]
    if HAS_I:
        rows = tl.load(I + t * k + jr, mask=jr < k, other=0)  # [KP, 1]
        nr = tl.arange(0, NP)[:, None]
        kk = tl.arange(0, KP)[None, :]
        idx_row = tl.load(I + t * k + kk, mask=kk < k, other=-1)  # [1, KP]
        active = tl.sum(tl.where(nr == idx_row, 1, 0), 1)[:, None] > 0  # [NP, 1]
        keep = (nr < N) & (active == 0)
    else:
        rows = jr
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)[None, :]
        cm = c < C
        if XA_FROM_X:  # X_a = X[I]: the active rows straight from the state
            xa = tl.load(X + t * N * C + rows * C + c, mask=(jr < k) & cm, other=0.0).to(CDT)  # [KP, BC]
        else:
            xa = tl.load(XA + t * k * C + jr * C + c, mask=(jr < k) & cm, other=0.0).to(CDT)  # [KP, BC]
        v = tl.load(V + t * K * C + sr * C + c, mask=(sr < K) & cm, other=0.0).to(CDT)  # [SP, BC]
        new = tl.sum(p[:, :, None] * v[None, :, :], 1)
        if HAS_H:
            new += tl.sum(h[:, :, None] * xa[None, :, :], 1)
        else:
            new += xa
        if HAS_I:
            tl.store(OUT + t * N * C + rows * C + c, cast(new, OUT), mask=(jr < k) & cm)
            if COPY:
                x = tl.load(X + t * N * C + nr * C + c, mask=keep & cm, other=0.0)
                tl.store(OUT + t * N * C + nr * C + c, x, mask=keep & cm)
        else:
            tl.store(OUT + t * k * C + jr * C + c, cast(new, OUT), mask=(jr < k) & cm)


@triton.jit
def _write_bwd_kernel(DOUT, X, I, XA, H, P, V, DX, DXA, DH, DP, DV, N, k, K, C, HAS_I: tl.constexpr,
                      HAS_H: tl.constexpr, NEED_DX: tl.constexpr, XA_FROM_X: tl.constexpr, NP: tl.constexpr,
                      KP: tl.constexpr, SP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr,
                      NEED_DXA: tl.constexpr = True):
    t = tl.program_id(0).to(tl.int64)
    jr = tl.arange(0, KP)[:, None]
    qc = tl.arange(0, KP)[None, :]
    sc = tl.arange(0, SP)[None, :]
    sr = tl.arange(0, SP)[:, None]
    hmask = (jr < k) & (qc < k)
    pmask = (jr < k) & (sc < K)
    if HAS_H:
        h = tl.load(H + t * k * k + jr * k + qc, mask=hmask, other=0.0).to(CDT)
    p = tl.load(P + t * k * K + jr * K + sc, mask=pmask, other=0.0).to(CDT)
    if HAS_I:
        rows = tl.load(I + t * k + jr, mask=jr < k, other=0)
        nr = tl.arange(0, NP)[:, None]
        kk = tl.arange(0, KP)[None, :]
        idx_row = tl.load(I + t * k + kk, mask=kk < k, other=-1)
        active = tl.sum(tl.where(nr == idx_row, 1, 0), 1)[:, None] > 0
        Nrows = N
    else:
        rows = jr
        Nrows = k
    dh = tl.zeros([KP, KP], dtype=CDT)
    dp = tl.zeros([KP, SP], dtype=CDT)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)[None, :]
        cm = c < C
        dn = tl.load(DOUT + t * Nrows * C + rows * C + c, mask=(jr < k) & cm, other=0.0).to(CDT)  # [KP, BC]
        if XA_FROM_X:
            xa = tl.load(X + t * N * C + rows * C + c, mask=(jr < k) & cm, other=0.0).to(CDT)
        else:
            xa = tl.load(XA + t * k * C + jr * C + c, mask=(jr < k) & cm, other=0.0).to(CDT)
        v = tl.load(V + t * K * C + sr * C + c, mask=(sr < K) & cm, other=0.0).to(CDT)
        if HAS_H:
            dxa = tl.sum(h[:, :, None] * dn[:, None, :], 0)  # [KP(q), BC]
            dh += tl.sum(dn[:, None, :] * xa[None, :, :], 2)
        else:
            dxa = dn
        if XA_FROM_X:  # dX[I[q]] = dX_a[q]; the other rows below (disjoint rows: no ordering needed)
            if NEED_DX:
                tl.store(DX + t * N * C + rows * C + c, cast(dxa, DX), mask=(jr < k) & cm)
        elif NEED_DXA:
            tl.store(DXA + t * k * C + jr * C + c, cast(dxa, DXA), mask=(jr < k) & cm)
        dv = tl.sum(p[:, :, None] * dn[:, None, :], 0)  # [SP, BC]
        tl.store(DV + t * K * C + sr * C + c, cast(dv, DV), mask=(sr < K) & cm)
        dp += tl.sum(dn[:, None, :] * v[None, :, :], 2)
        if HAS_I:
            if NEED_DX:
                if XA_FROM_X:  # rows outside I only: the active ones hold dX_a
                    pas = (nr < N) & (active == 0) & cm
                    g = tl.load(DOUT + t * N * C + nr * C + c, mask=pas, other=0.0)
                    tl.store(DX + t * N * C + nr * C + c, cast(g.to(CDT), DX), mask=pas)
                else:
                    g = tl.load(DOUT + t * N * C + nr * C + c, mask=(nr < N) & cm, other=0.0)
                    g = tl.where(active, 0.0, g.to(CDT))
                    tl.store(DX + t * N * C + nr * C + c, cast(g, DX), mask=(nr < N) & cm)
    if HAS_H:
        tl.store(DH + t * k * k + jr * k + qc, cast(dh, DH), mask=hmask)
    tl.store(DP + t * k * K + jr * K + sc, cast(dp, DP), mask=pmask)


def _write_meta(N, k, K, C):
    NP, KP, SP = np2(N), np2(k), np2(K)
    # a [NP, BC] tile at most 4096 values, [KP·SP, BC] at most 2048: no spills on sm_90 at N = 16 with k = 2
    # and with k = K = 4 (8 bytes spilled at BC = 256; tools.triton_aot resources --extra 16:1024:bfloat16)
    return NP, KP, SP, min(row_block_c(C, KP, max(KP, SP, NP // KP if NP > KP else 1)), max(16, 4096 // NP),
                           max(16, 2048 // (KP * SP)))


class _Write(torch.autograd.Function):
    """``Xa`` None (with ``I``): X_a = X[I] is read from X inside the kernels, X is saved instead of
    X_a (the read saves it anyway) and dX_a lands on X's active rows: no gather, no scatter_add."""

    @staticmethod
    def forward(ctx, X, I, Xa, H, P, V, out_dtype, inplace):
        own = Xa is None
        if own:
            k, C = I.shape[-1], X.shape[-1]
            lead = I.shape[:-1]
        else:
            k, C = Xa.shape[-2:]
            lead = Xa.shape[:-2]
        K = V.shape[-2]
        T = math.prod(lead)
        Xac = None if own else Xa.reshape(T, k, C).contiguous()
        Hc = None if H is None else H.reshape(T, k, k).contiguous()
        Pc, Vc = P.reshape(T, k, K).contiguous(), V.reshape(T, K, C).contiguous()
        cdt = tl_dtype(compute_dtype(X if own else Xa, H, P, V))
        if I is not None:
            N = X.shape[-2]
            Ic = I.reshape(T, k).contiguous()
            Xc = X.reshape(T, N, C)
            if inplace:
                out = Xc
            else:
                Xc = Xc.contiguous()
                out = torch.empty(T, N, C, dtype=out_dtype, device=X.device)
        else:
            N, Ic, Xc = k, None, None
            out = torch.empty(T, k, C, dtype=out_dtype, device=Xa.device)
        NP, KP, SP, BC = _write_meta(N, k, K, C)
        if T > 0:
            _write_fwd_kernel[(T,)](Xc, Ic, Xac, Hc, Pc, Vc, out, N, k, K, C, HAS_I=I is not None,
                                    HAS_H=H is not None, COPY=not inplace, XA_FROM_X=own, NP=NP, KP=KP, SP=SP,
                                    BC=BC, CDT=cdt)
        ctx.save_for_backward(I, X if own else Xa, H, P, V)
        ctx.meta = (None if X is None else X.dtype, N, own, k, lead)
        # the state's gradient term can be deferred when the mixed rows are the state itself: the
        # mHC-family write (Xa = X, no I) or the xHC write reading X_a from X (I, own)
        # (with I and a separate Xa: X's term is dout on the rows outside I, handed over the same way)
        ctx.owner, ctx.defer_x, ctx.xa_owner = None, I is not None, None
        if not inplace:
            ctx.owner = sg.claim(X if I is not None else Xa, "write", (H, P))
            if not own and (ctx.owner is None or ctx.defer_x):  # a window's carried X_a: its mappings' op adds dX_a
                ctx.xa_owner = sg.claim_carried(Xa, P)
        if inplace:
            ctx.mark_dirty(X)
            return X
        return out.view(*lead, N, C)

    @staticmethod
    def backward(ctx, dout):
        I, XorXa, H, P, V = ctx.saved_tensors
        x_dtype, N, own, k, lead = ctx.meta
        C = XorXa.shape[-1]
        K = V.shape[-2]
        T = math.prod(lead)
        Xc = XorXa.reshape(T, N, C).contiguous() if own else None
        Xac = None if own else XorXa.reshape(T, k, C).contiguous()
        Hc = None if H is None else H.reshape(T, k, k).contiguous()
        Pc, Vc = P.reshape(T, k, K).contiguous(), V.reshape(T, K, C).contiguous()
        Ic = None if I is None else I.reshape(T, k).contiguous()
        defer = ctx.owner is not None and ctx.needs_input_grad[0 if ctx.defer_x else 2]
        need_dx = I is not None and ctx.needs_input_grad[0] and not (defer and ctx.defer_x)
        xa_defer = ctx.xa_owner is not None and ctx.needs_input_grad[2]
        # X_a's gradient: dout itself without I and H (nothing to compute: handed over as it is)
        xa_as_dout = xa_defer and I is None and H is None
        dXa = None if own or (defer and not ctx.defer_x) or xa_as_dout else torch.empty_like(Xac)
        dV = torch.empty_like(Vc)
        dH = None if H is None else torch.empty_like(Hc)
        dP = torch.empty_like(Pc)
        dX = torch.empty(T, N, C, dtype=x_dtype, device=dout.device) if need_dx else None
        NP, KP, SP, BC = _write_meta(N, k, K, C)
        BC = max(16, min(BC, 1024 // (KP * SP)))  # dX_a, dV beside dX' (sm_90: 8 bytes spilled at BC = 128, k = K = 4)
        doutc = dout.reshape(T, N, C).contiguous()
        if T > 0:
            _write_bwd_kernel[(T,)](doutc, Xc, Ic, Xac, Hc, Pc, Vc, dX, dXa, dH, dP,
                                    dV, N, k, K, C, HAS_I=I is not None, HAS_H=H is not None, NEED_DX=need_dx,
                                    XA_FROM_X=own, NP=NP, KP=KP, SP=SP, BC=BC,
                                    CDT=tl_dtype(compute_dtype(XorXa, H, P, V)), NEED_DXA=dXa is not None)
        if defer:  # the state's term (Hᵀ·dout on the mixed rows, dout on the others): linear_stats writes it
            # (a separate Xa with I: X's active rows get nothing, X_a's gradient is dXa above)
            sg.hand_over(ctx.owner, "write", (doutc, Hc if own or I is None else None, Ic, k, not own and I is not None))
        if xa_defer:  # the carried X_a's term: added by the op that made P from it (xhc.kernels.xhc_active)
            sg.hand_over(ctx.xa_owner, "dxa", doutc if xa_as_dout else dXa)
            dXa = None
        return (None if dX is None else dX.view(*lead, N, C), None,
                None if dXa is None else dXa.view(*lead, k, C),
                None if dH is None else dH.view(H.shape), dP.view(P.shape), dV.view(V.shape), None, None)


def write(X, I, Xa, H, P, V, out_dtype=None, inplace: bool = False):
    """See :func:`xhc.kernels.write`.  ``inplace`` (only with ``I``): rows outside ``I`` are not
    copied, X is updated in place and returned (allowed when nothing saved X for backward)."""
    if Xa is None:
        if I is None:
            raise ValueError("write: Xa=None (X_a = X[I]) needs the active rows I")
        if inplace:
            raise ValueError("write(inplace=True) needs Xa: the rows it reads are the rows it overwrites")
        lead, k = X.shape[:-2], I.shape[-1]
    else:
        lead, k = Xa.shape[:-2], Xa.shape[-2]
    K = V.shape[-2]
    if H is not None:
        H = H.expand(*lead, k, k)
    P = P.expand(*lead, k, K)
    V = V.expand(*lead, *V.shape[-2:])
    if I is not None:
        I = I.expand(*lead, k)
        out_dtype = out_dtype or X.dtype
        if inplace and out_dtype != X.dtype:
            raise ValueError("write(inplace=True) needs out_dtype == X.dtype")
    else:
        out_dtype = out_dtype or Xa.dtype
        inplace = False
    return _Write.apply(X, I, Xa, H, P, V, out_dtype, inplace)
