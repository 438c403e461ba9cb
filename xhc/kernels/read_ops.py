"""The read kernels (the ``triton`` backend's :func:`xhc.kernels.read` and :func:`xhc.kernels.gather`,
docs/kernels.md): one program per token, a loop over C in blocks, fp32 accumulation in registers.

===============  ====================================================================================
:func:`read`     u[t] = Σ_j h[t, j]·X_j;  backward: dX and dh in one pass over X (dX handed to the
                 state's owner op where there is one, :mod:`.state_grad`)
:func:`gather`   X_a = X[I];  backward: dX_a handed to the state's owner op (no scatter into zeros)
===============  ====================================================================================
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, np2, row_block_c, tl_dtype


@triton.jit
def _read_fwd_kernel(H, X, U, R, n, C, RP: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, RP)[:, None]
    j = tl.arange(0, NP)[None, :]
    h = tl.load(H + t * R * n + r * n + j, mask=(r < R) & (j < n), other=0.0).to(CDT)  # [RP, NP]
    jr = tl.arange(0, NP)[:, None]
    rr = tl.arange(0, RP)[:, None]
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)[None, :]
        x = tl.load(X + t * n * C + jr * C + c, mask=(jr < n) & (c < C), other=0.0).to(CDT)  # [NP, BC]
        u = tl.sum(h[:, :, None] * x[None, :, :], 1)  # [RP, BC]
        tl.store(U + t * R * C + rr * C + c, cast(u, U), mask=(rr < R) & (c < C))


@triton.jit
def _read_bwd_kernel(H, X, DU, DH, DX, R, n, C, RP: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr,
                     CDT: tl.constexpr, NEED_DX: tl.constexpr = True):
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, RP)[:, None]
    j = tl.arange(0, NP)[None, :]
    hmask = (r < R) & (j < n)
    h = tl.load(H + t * R * n + r * n + j, mask=hmask, other=0.0).to(CDT)  # [RP, NP]
    jr = tl.arange(0, NP)[:, None]
    rr = tl.arange(0, RP)[:, None]
    dh = tl.zeros([RP, NP], dtype=CDT)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)[None, :]
        x = tl.load(X + t * n * C + jr * C + c, mask=(jr < n) & (c < C), other=0.0).to(CDT)  # [NP, BC]
        du = tl.load(DU + t * R * C + rr * C + c, mask=(rr < R) & (c < C), other=0.0).to(CDT)  # [RP, BC]
        dh += tl.sum(du[:, None, :] * x[None, :, :], 2)
        if NEED_DX:  # (else the term is deferred to the state's linear_stats op)
            dx = tl.sum(h[:, :, None] * du[:, None, :], 0)  # [NP, BC]
            tl.store(DX + t * n * C + jr * C + c, cast(dx, DX), mask=(jr < n) & (c < C))
    tl.store(DH + t * R * n + r * n + j, cast(dh, DH), mask=hmask)


class _Read(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, X, out_dtype):
        n, C = X.shape[-2:]
        R = h.shape[-2]
        hc, Xc = h.reshape(-1, R, n).contiguous(), X.reshape(-1, n, C).contiguous()
        T = Xc.shape[0]
        U = torch.empty(T, R, C, dtype=out_dtype, device=X.device)
        RP, NP = np2(R), np2(n)
        if T > 0:
            _read_fwd_kernel[(T,)](hc, Xc, U, R, n, C, RP=RP, NP=NP, BC=row_block_c(C, RP, NP), CDT=tl_dtype(compute_dtype(h, X)))
        ctx.save_for_backward(h, X)
        ctx.owner = sg.claim(X, "read", (h,))
        return U.view(*X.shape[:-2], R, C)

    @staticmethod
    def backward(ctx, dU):
        h, X = ctx.saved_tensors
        n, C = X.shape[-2:]
        R = h.shape[-2]
        hc, Xc = h.reshape(-1, R, n).contiguous(), X.reshape(-1, n, C).contiguous()
        T = Xc.shape[0]
        dUc = dU.reshape(T, R, C).contiguous()
        defer = ctx.owner is not None and ctx.needs_input_grad[1]
        dh = torch.empty_like(hc)
        dX = None if defer else torch.empty_like(Xc)
        RP, NP = np2(R), np2(n)
        if T > 0:
            _read_bwd_kernel[(T,)](hc, Xc, dUc, dh, dX, R, n, C, RP=RP, NP=NP, BC=row_block_c(C, RP, NP),
                                   CDT=tl_dtype(compute_dtype(h, X)), NEED_DX=not defer)
        if defer:  # dX[t, j] += Σ_r h[t, r, j]·du[t, r]: written by the state's linear_stats op
            sg.hand_over(ctx.owner, "read", (hc, dUc))
            return dh.view(h.shape), None, None
        return dh.view(h.shape), dX.view(X.shape), None


def read(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """u = Σ_j h[..., j]·X_j: ``h`` ``[..., n]`` or ``[..., T, n]``, ``X`` ``[..., n, C]``."""
    single = h.dim() == X.dim() - 1
    hh = h.unsqueeze(-2) if single else h
    hh = hh.expand(*X.shape[:-2], *hh.shape[-2:])
    u = _Read.apply(hh, X, out_dtype or compute_dtype(h, X))
    return u.squeeze(-2) if single else u


# ================================================================================================
# gather: X_a = X[I], its gradient handed to the state's linear_stats op
# ================================================================================================
class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, I, after):
        k, C = I.shape[-1], X.shape[-1]
        Xa = X.gather(-2, I.unsqueeze(-1).expand(*I.shape, C))
        ctx.save_for_backward(I)
        ctx.x_shape = X.shape
        ctx.owner = None if after is None else sg.claim(X, "rows", (after,))
        return Xa

    @staticmethod
    def backward(ctx, dXa):
        (I,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if ctx.owner is not None:  # dX[I_q] += dX_a[q]: written by the state's linear_stats op
            N, C = ctx.x_shape[-2:]
            k = I.shape[-1]
            sg.hand_over(ctx.owner, "rows", (dXa.reshape(-1, k, C).contiguous(), I.reshape(-1, k).contiguous()))
            return None, None, None
        dX = torch.zeros(ctx.x_shape, dtype=dXa.dtype, device=dXa.device)
        return dX.scatter_(-2, I.unsqueeze(-1).expand(*I.shape, dX.shape[-1]), dXa), None, None


def gather(X: torch.Tensor, I: torch.Tensor, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """X_a = X[..., I, :] (``I``: k distinct rows per token).  ``after``: a tensor computed from the
    state's :func:`linear_stats` op (the routing weights): the gradient dX_a is then added to X's
    rows by that op's backward instead of a scatter into a zero N·C tensor."""
    return _Gather.apply(X, I, after)
