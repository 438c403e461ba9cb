"""Fused mHC write (``mhc_post``): X' = H_res·X + h_post ⊗ y, one kernel forward, one backward.

Forward (:func:`_mhc_post_fwd_kernel`, a program per BT tokens × BC columns): reads X (N·C), y (C) and
the per-token coefficients (N² + N fp32), writes X' (N·C).

    byte budget, per token, state dtype of s bytes:  2·N·C·s + C·s  (+ 4·(N² + N) coefficients)

Backward (:func:`_mhc_post_bwd_kernel`, a program per BT tokens, a loop over C): reads dX' (N·C), X (N·C)
and y (C), writes dy (C), dh_post (N) and dH_res (N²) — the reductions over C stay in registers, so
they are deterministic.  The state's term H_resᵀ·dX' is *not* written here when the state's
coefficients came from :mod:`.mhc_pre` on the same X (the usual case): dX' is handed to that op's
backward, whose :mod:`.mhc_grad` kernel writes dX once for the whole sublayer.

    byte budget:  2·N·C·s + 2·C·s  (+ N·C·s for dX when there is no mhc_pre owner)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels.common import cast, compute_dtype, tl_dtype


@triton.jit
def _mhc_post_fwd_kernel(X, HRES, HPOST, Y, OUT, T, N, C, NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cmk = c < C
    i = tl.arange(0, NP)
    im = i < N
    m2 = tm[:, None] & cmk[None, :]
    hp = tl.load(HPOST + t[:, None] * N + i[None, :], mask=tm[:, None] & im[None, :], other=0.0).to(CDT)
    y = tl.load(Y + t[:, None] * C + c[None, :], mask=m2, other=0.0).to(CDT)
    acc = hp[:, :, None] * y[:, None, :]  # [BT, NP, BC]
    for j in range(0, N):
        xj = tl.load(X + t[:, None] * N * C + j * C + c[None, :], mask=m2, other=0.0).to(CDT)
        hc = tl.load(HRES + t[:, None] * N * N + i[None, :] * N + j, mask=tm[:, None] & im[None, :], other=0.0).to(CDT)
        acc += hc[:, :, None] * xj[:, None, :]
    offs = t[:, None, None] * N * C + i[None, :, None] * C + c[None, None, :]
    tl.store(OUT + offs, cast(acc, OUT), mask=tm[:, None, None] & im[None, :, None] & cmk[None, None, :])


@triton.jit
def _mhc_post_bwd_kernel(X, HRES, HPOST, Y, DOUT, DY, DHPOST, DHRES, DX, T, N, C, NEED_DX: tl.constexpr,
                         NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    i = tl.arange(0, NP)
    im = i < N
    hmask = tm[:, None] & im[None, :]
    hp = tl.load(HPOST + t[:, None] * N + i[None, :], mask=hmask, other=0.0).to(CDT)
    dhp = tl.zeros([BT, NP], dtype=CDT)
    dH = tl.zeros([BT, NP, NP], dtype=CDT)
    jn3 = tl.arange(0, NP)[None, None, :]
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmk = c < C
        m2 = tm[:, None] & cmk[None, :]
        m3 = tm[:, None, None] & im[None, :, None] & cmk[None, None, :]
        d3 = tl.load(DOUT + t[:, None, None] * N * C + i[None, :, None] * C + c[None, None, :], mask=m3,
                     other=0.0).to(CDT)
        y = tl.load(Y + t[:, None] * C + c[None, :], mask=m2, other=0.0).to(CDT)
        tl.store(DY + t[:, None] * C + c[None, :], cast(tl.sum(hp[:, :, None] * d3, 1), DY), mask=m2)
        dhp += tl.sum(d3 * y[:, None, :], 2)
        for j in range(0, N):
            xj = tl.load(X + t[:, None] * N * C + j * C + c[None, :], mask=m2, other=0.0).to(CDT)
            col = tl.sum(d3 * xj[:, None, :], 2)  # dH[:, i, j] over this block
            dH += tl.where(jn3 == j, col[:, :, None], 0.0)
            if NEED_DX:
                hc = tl.load(HRES + t[:, None] * N * N + i[None, :] * N + j, mask=hmask, other=0.0).to(CDT)
                tl.store(DX + t[:, None] * N * C + j * C + c[None, :], cast(tl.sum(hc[:, :, None] * d3, 1), DX),
                         mask=m2)
    tl.store(DHPOST + t[:, None] * N + i[None, :], dhp, mask=hmask)
    jj = tl.arange(0, NP)
    tl.store(DHRES + t[:, None, None] * N * N + i[None, :, None] * N + jj[None, None, :], dH,
             mask=hmask[:, :, None] & (jj < N)[None, None, :])


def _meta(kernel: str, N: int, C: int):
    NP = cm.np_of(N)
    BT = cm.blocks(kernel, N, C)["BT"]
    return NP, BT, cm.block_c(BT, NP, C)


class MHCPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, H, h_post, y):
        from xhc.kernels.mhc_pre import owner_of

        N, C = X.shape[-2:]
        lead = X.shape[:-2]
        T = math.prod(lead)
        Xc, Hc = X.reshape(T, N, C).contiguous(), H.reshape(T, N, N).contiguous()
        hpc, yc = h_post.reshape(T, N).contiguous(), y.reshape(T, C).contiguous()
        out = torch.empty(T, N, C, dtype=X.dtype, device=X.device)
        NP, BT, BC = _meta("mhc_post_fwd", N, C)
        cdt = tl_dtype(compute_dtype(X, H))
        if T > 0:
            _mhc_post_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](Xc, Hc, hpc, yc, out, T, N, C, NP=NP,
                                                                          BT=BT, BC=BC, CDT=cdt)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(X, H, h_post, y)
        ctx.owner = owner_of(X, H, h_post)
        return out.view(X.shape)

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return None, None, None, None
        X, H, h_post, y = ctx.saved_tensors
        N, C = X.shape[-2:]
        T = math.prod(X.shape[:-2])
        Xc, Hc = X.reshape(T, N, C).contiguous(), H.reshape(T, N, N).contiguous()
        hpc, yc = h_post.reshape(T, N).contiguous(), y.reshape(T, C).contiguous()
        doutc = dout.reshape(T, N, C).contiguous()
        cdt = compute_dtype(X, H)
        dy = torch.empty(T, C, dtype=y.dtype, device=y.device)
        dhp = torch.empty(T, N, dtype=cdt, device=X.device)
        dH = torch.empty(T, N, N, dtype=cdt, device=X.device)
        defer = ctx.owner is not None and ctx.needs_input_grad[0]
        need_dx = ctx.needs_input_grad[0] and not defer
        dX = torch.empty(T, N, C, dtype=X.dtype, device=X.device) if need_dx else None
        NP, BT, BC = _meta("mhc_post_bwd", N, C)
        if T > 0:
            _mhc_post_bwd_kernel[(triton.cdiv(T, BT),)](Xc, Hc, hpc, yc, doutc, dy, dhp, dH, dX, T, N, C,
                                                        NEED_DX=need_dx, NP=NP, BT=BT, BC=BC, CDT=tl_dtype(cdt))
        if defer:  # H_resᵀ·dX' joins the sublayer's one write of dX (mhc_pre's backward)
            ctx.owner._pending = (torch._C._current_graph_task_id(), doutc)
        return (None if dX is None else dX.view(X.shape), dH.view(H.shape).to(H.dtype),
                dhp.view(h_post.shape).to(h_post.dtype), dy.view(y.shape))


def mhc_post(X: torch.Tensor, H: torch.Tensor, h_post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """X' = H·X + h_post ⊗ y: ``X`` ``[..., N, C]``, ``H`` ``[..., N, N]``, ``h_post`` ``[..., N]``,
    ``y`` ``[..., C]`` -> ``[..., N, C]`` in X's dtype (fp32 accumulation)."""
    lead = X.shape[:-2]
    N = X.shape[-2]
    fit = lambda t, *s: t if t.shape == (*lead, *s) else t.expand(*lead, *s)  # noqa: E731  (keeps grad_fn)
    return MHCPost.apply(X, fit(H, N, N), fit(h_post, N), fit(y, X.shape[-1]))
