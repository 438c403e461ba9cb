"""xHC-Flash attention write with the MLP read's correction (``flash_attn``) in one kernel
(docs/math.md §4.1).

Inside an xHC-Flash window the attention sublayer writes the carried active streams without mixing,
and the MLP's input is the window entry's readout corrected by what that write added:

    X_a' = X_a + P·V                      P = diag(p)·H_post^A ``[k, K]``, V the components ``[K, C]``
    u_M  = inp_M + Σ_t β_t·V_t            β_t = Σ_j h^M[I_j]·P[j, t]

(:func:`xhc.flash.flash_mlp_input`).  Both read V and P, so one kernel does both; h^M is read at the
active streams from the entry's read weights ``[T, TM, N]`` (no gather, no scatter in the backward).

Forward (:func:`_flash_attn_fwd_kernel`, a program per token, a loop over C):

    byte budget, per token, state dtype s:  2·k·C·s (X_a in, X_a' out) + K·C·v (V, its dtype v)
                                            + C·4 (inp_M) + C·s (u_M)  (+ 4·(k·K + k) coefficients)

Backward (:func:`_flash_attn_bwd_kernel`, a program per token): dP = dX_a'·Vᵀ + h^M_a ⊗ (du·Vᵀ),
dV = Pᵀ·dX_a' + β ⊗ du, d inp_M = du, dh^M at the active streams (the other read weights' rows 0),
in one pass over dX_a', du and V.  dX_a = dX_a' needs no kernel: it is handed, as it is, to the op
that made P from the same X_a (:mod:`.xhc_active`, :func:`.state_grad.claim_carried`), which writes dX_a
once; without that op it goes back to autograd.

    byte budget:  k·C·s (dX_a') + C·s (du) + 2·K·C·v (V in, dV out) + C·4 (d inp_M)  (+ 4·TM·N dh)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, np2, tl_dtype


@triton.jit
def _coefs(I, HPRE, P, t, k, K, N, ROW, TMN, KP: tl.constexpr, SP: tl.constexpr, CDT: tl.constexpr):
    """(I_j [KP], h^M at I_j [KP], P [KP, SP], β [SP]) of token t."""
    kq = tl.arange(0, KP)
    sq = tl.arange(0, SP)
    km = kq < k
    Iv = tl.load(I + t * k + kq, mask=km, other=0)
    hm = tl.load(HPRE + t * TMN + ROW * N + Iv, mask=km, other=0.0).to(CDT)
    pm = km[:, None] & (sq[None, :] < K)
    Pm = tl.load(P + t * k * K + kq[:, None] * K + sq[None, :], mask=pm, other=0.0).to(CDT)
    beta = tl.sum(hm[:, None] * Pm, 0)
    return Iv, hm, Pm, beta


@triton.jit
def _flash_attn_fwd_kernel(XA, P, V, INP, I, HPRE, OUT, U, k, K, C, N, ROW, TMN, INP_STRIDE,
                           KP: tl.constexpr, SP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _, _, Pm, beta = _coefs(I, HPRE, P, t, k, K, N, ROW, TMN, KP, SP, CDT)
    kq = tl.arange(0, KP)[:, None]
    sq = tl.arange(0, SP)[:, None]
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cm = c < C
        v = tl.load(V + t * K * C + sq * C + c[None, :], mask=(sq < K) & cm[None, :], other=0.0).to(CDT)  # [SP, BC]
        xm = (kq < k) & cm[None, :]
        xa = tl.load(XA + t * k * C + kq * C + c[None, :], mask=xm, other=0.0).to(CDT)  # [KP, BC]
        new = xa + tl.sum(Pm[:, :, None] * v[None, :, :], 1)
        tl.store(OUT + t * k * C + kq * C + c[None, :], cast(new, OUT), mask=xm)
        u = tl.load(INP + t * INP_STRIDE + c, mask=cm, other=0.0).to(CDT) + tl.sum(beta[:, None] * v, 0)
        tl.store(U + t * C + c, cast(u, U), mask=cm)


@triton.jit
def _flash_attn_bwd_kernel(DOUT, DU, P, V, I, HPRE, DP, DV, DINP, DH, k, K, C, N, ROW, TM, TMN,
                           HAS_DOUT: tl.constexpr, HAS_DU: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
                           TP: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    Iv, hm, Pm, beta = _coefs(I, HPRE, P, t, k, K, N, ROW, TMN, KP, SP, CDT)
    kq = tl.arange(0, KP)[:, None]
    sq = tl.arange(0, SP)[:, None]
    dpa = tl.zeros([KP, SP], dtype=CDT)  # Σ_c dX_a'·V
    g = tl.zeros([SP], dtype=CDT)  # Σ_c du·V
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cm = c < C
        vm = (sq < K) & cm[None, :]
        v = tl.load(V + t * K * C + sq * C + c[None, :], mask=vm, other=0.0).to(CDT)  # [SP, BC]
        dv = tl.zeros([SP, BC], dtype=CDT)
        if HAS_DOUT:
            dn = tl.load(DOUT + t * k * C + kq * C + c[None, :], mask=(kq < k) & cm[None, :], other=0.0).to(CDT)
            dpa += tl.sum(dn[:, None, :] * v[None, :, :], 2)
            dv += tl.sum(Pm[:, :, None] * dn[:, None, :], 0)
        if HAS_DU:
            du = tl.load(DU + t * C + c, mask=cm, other=0.0).to(CDT)
            g += tl.sum(du[None, :] * v, 1)
            dv += beta[:, None] * du[None, :]
            tl.store(DINP + t * C + c, cast(du, DINP), mask=cm)
        tl.store(DV + t * K * C + sq * C + c[None, :], cast(dv, DV), mask=vm)
    pm = (kq < k) & (tl.arange(0, SP)[None, :] < K)
    tl.store(DP + t * k * K + kq * K + tl.arange(0, SP)[None, :], cast(dpa + hm[:, None] * g[None, :], DP), mask=pm)
    dhm = tl.sum(Pm * g[None, :], 1)  # [KP]: dh^M at I_j
    n = tl.arange(0, NP)
    row = tl.sum(tl.where((Iv[:, None] == n[None, :]) & (tl.arange(0, KP)[:, None] < k), dhm[:, None], 0.0), 0)
    r = tl.arange(0, TP)[:, None]
    dh = tl.where(r == ROW, row[None, :], 0.0)  # the other read weights' rows: 0
    tl.store(DH + t * TMN + r * N + n[None, :], cast(dh, DH), mask=(r < TM) & (n[None, :] < N))


def _meta(k: int, K: int, C: int):
    KP, SP = np2(k), np2(K)
    return KP, SP, max(16, min(triton.next_power_of_2(int(C)), 2048 // (KP * SP)))


class FlashAttn(torch.autograd.Function):
    """(X_a', u_M) of the xHC-Flash attention write; see :func:`flash_attn`."""

    @staticmethod
    def forward(ctx, Xa, P, V, inp, I, h, row, u_dtype):
        k, C = Xa.shape[-2:]
        lead = Xa.shape[:-2]
        K = V.shape[-2]
        TM, N = h.shape[-2:]
        T = math.prod(lead)
        c = lambda x, *s: x.reshape(*s).contiguous()  # noqa: E731
        Xac, Pc, Vc, Ic, hc = c(Xa, T, k, C), c(P, T, k, K), c(V, T, K, C), c(I, T, k), c(h, T, TM, N)
        inpc = inp.reshape(T, C)  # a window's readout is a slice of the entry's [T, TM, C]: read in place
        if inpc.stride(-1) != 1:
            inpc = inpc.contiguous()
        out = torch.empty(T, k, C, dtype=Xa.dtype, device=Xa.device)
        u = torch.empty(T, C, dtype=u_dtype, device=Xa.device)
        KP, SP, BC = _meta(k, K, C)
        if T > 0:
            _flash_attn_fwd_kernel[(T,)](Xac, Pc, Vc, inpc, Ic, hc, out, u, k, K, C, N, row, TM * N, inpc.stride(0),
                                         KP=KP, SP=SP,
                                         BC=BC, CDT=tl_dtype(compute_dtype(Xa, P, V, inp, h)))
        ctx.save_for_backward(P, V, I, h)
        ctx.meta = (row, inp.dtype, Xa.dtype, tl_dtype(compute_dtype(Xa, P, V, inp, h)))
        ctx.set_materialize_grads(False)
        # X_a's gradient is dX_a' itself: the op that made P from this X_a adds it (state_grad.claim_carried)
        ctx.xa_owner = sg.claim_carried(Xa, P)
        return out.view(*lead, k, C), u.view(*lead, C)

    @staticmethod
    def backward(ctx, dout, du):
        P, V, I, h = ctx.saved_tensors
        row, inp_dtype, xa_dtype, cdt = ctx.meta
        k, K = P.shape[-2:]
        C = V.shape[-1]
        TM, N = h.shape[-2:]
        lead = P.shape[:-2]
        T = math.prod(lead)
        c = lambda x, *s: None if x is None else x.reshape(*s).contiguous()  # noqa: E731
        doutc, duc = c(dout, T, k, C), c(du, T, C)
        Pc, Vc, Ic, hc = c(P, T, k, K), c(V, T, K, C), c(I, T, k), c(h, T, TM, N)
        dev = V.device
        dP = torch.empty(T, k, K, dtype=P.dtype, device=dev)
        dV = torch.empty(T, K, C, dtype=V.dtype, device=dev)
        dinp = torch.empty(T, C, dtype=inp_dtype, device=dev) if duc is not None else None
        dh = torch.empty(T, TM, N, dtype=h.dtype, device=dev)
        KP, SP, BC = _meta(k, K, C)
        if T > 0:
            _flash_attn_bwd_kernel[(T,)](doutc, duc, Pc, Vc, Ic, hc, dP, dV, dinp, dh, k, K, C, N, row, TM, TM * N,
                                         HAS_DOUT=doutc is not None, HAS_DU=duc is not None, KP=KP, SP=SP,
                                         TP=np2(TM), NP=np2(N), BC=BC, CDT=cdt)
        dXa = None if doutc is None else doutc.view(*lead, k, C)
        if dXa is not None and ctx.xa_owner is not None and ctx.needs_input_grad[0]:
            sg.hand_over(ctx.xa_owner, "dxa", doutc)
            dXa = None
        return (dXa, dP.view(P.shape), dV.view(V.shape), None if dinp is None else dinp.view(*lead, C), None,
                dh.view(h.shape), None, None)


def flash_attn(Xa, P, V, inp, I, h, row: int = 1, u_dtype=None):
    """(X_a' = X_a + P·V ``[..., k, C]`` in X_a's dtype, u_M = inp + Σ_t β_t·V_t ``[..., C]`` in ``u_dtype``
    (default X_a's)) with β_t = Σ_j h[row, I_j]·P[j, t] (module docstring).  ``Xa`` ``[..., k, C]``; ``P``
    ``[..., k, K]``; ``V`` ``[..., K, C]`` (any float dtype); ``inp`` ``[..., C]``; ``I`` ``[..., k]``; ``h`` the
    window entry's read weights ``[..., TM, N]`` (the MLP's at row ``row``)."""
    return FlashAttn.apply(Xa, P, V, inp, I, h, int(row), u_dtype or Xa.dtype)
