"""Fused hyper-connection ops in plain torch: the ``compile`` backend (docs/kernels.md).

Each op is one :class:`torch.autograd.Function` with a hand-written backward that saves only
the op's inputs in their own dtype (a bf16 state is never saved as an fp32 copy), and is
traceable by ``torch.compile(fullgraph=True)`` — under compile the casts and contractions fuse
into one loop per op.  The ``*_reference`` functions are the unfused autograd forms (``eager``).

Compute dtype: fp32, or float64 when any input is float64 (gradcheck, reference tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from xhc.norms import fp32, layer_norm_flat, rms_norm_flat


def _cdt(*ts) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


# ------------------------------------------------------------------------------------------------
# read: u_t = Σ_j h[t, j] X_j
# ------------------------------------------------------------------------------------------------
def read_reference(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Eager form: ``einsum`` on an fp32 copy of X (as :func:`xhc.hyper_connection.read_streams`)."""
    single = h.dim() == X.dim() - 1
    hh = h.unsqueeze(-2) if single else h
    u = torch.einsum("...tn,...nc->...tc", hh.to(_cdt(h, X)), X.to(_cdt(h, X)))
    u = u.squeeze(-2) if single else u
    return u if out_dtype is None else u.to(out_dtype)


class _Read(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, X, out_dtype):
        cdt = _cdt(h, X)
        ctx.save_for_backward(h, X)
        u = torch.einsum("...tn,...nc->...tc", h.to(cdt), X.to(cdt))
        return u.to(out_dtype)

    @staticmethod
    def backward(ctx, du):
        h, X = ctx.saved_tensors
        cdt = _cdt(h, X)
        du = du.to(cdt)
        dh = dX = None
        if ctx.needs_input_grad[0]:
            dh = torch.einsum("...tc,...nc->...tn", du, X.to(cdt)).to(h.dtype)
            dh = _unbroadcast(dh, h)
        if ctx.needs_input_grad[1]:
            dX = torch.einsum("...tn,...tc->...nc", h.to(cdt), du).to(X.dtype)
            dX = _unbroadcast(dX, X)
        return dh, dX, None


def read(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """u = Σ_j h[..., j]·X_j (``h`` ``[..., n]`` or ``[..., T, n]``, ``X`` ``[..., n, C]``), one op."""
    single = h.dim() == X.dim() - 1
    hh = h.unsqueeze(-2) if single else h
    u = _Read.apply(hh, X, out_dtype or _cdt(h, X))
    return u.squeeze(-2) if single else u


# ------------------------------------------------------------------------------------------------
# write: new_j = Σ_q H[j,q] Xa_q + Σ_s P[j,s] V_s, optionally scattered into X at rows I
# ------------------------------------------------------------------------------------------------
def _index(I: torch.Tensor, C: int) -> torch.Tensor:
    return I.unsqueeze(-1).expand(*I.shape, C)


def write_reference(X, I, Xa, H, P, V, out_dtype=None):
    """Eager form of :func:`xhc.kernels.write` (autograd through einsum, gather-free scatter)."""
    cdt = _cdt(Xa, H, P, V)
    Xf = Xa.to(cdt)
    mixed = Xf if H is None else torch.einsum("...jq,...qc->...jc", H.to(cdt), Xf)
    new = mixed + torch.einsum("...js,...sc->...jc", P.to(cdt), V.to(cdt))
    if I is None:
        return new.to(out_dtype or Xa.dtype)
    return X.scatter(-2, _index(I, X.shape[-1]), new.to(X.dtype)).to(out_dtype or X.dtype)


def _unbroadcast(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum ``g`` down to the shape of ``like`` (inputs may be broadcast views, e.g. expanded h)."""
    if g.shape == like.shape:
        return g
    while g.dim() > like.dim():
        g = g.sum(0)
    for d, (a, b) in enumerate(zip(g.shape, like.shape)):
        if b == 1 and a != 1:
            g = g.sum(d, keepdim=True)
    return g


class _Write(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, I, Xa, H, P, V, out_dtype):
        cdt = _cdt(Xa, H, P, V)
        Xf = Xa.to(cdt)
        mixed = Xf if H is None else torch.einsum("...jq,...qc->...jc", H.to(cdt), Xf)
        new = mixed + torch.einsum("...js,...sc->...jc", P.to(cdt), V.to(cdt))
        ctx.save_for_backward(I, Xa, H, P, V)
        ctx.has_H, ctx.has_I = H is not None, I is not None
        ctx.x_dtype = None if X is None else X.dtype
        if I is None:
            return new.to(out_dtype)
        return X.scatter(-2, _index(I, X.shape[-1]), new.to(X.dtype)).to(out_dtype)

    @staticmethod
    def backward(ctx, dout):
        I, Xa, H, P, V = ctx.saved_tensors
        cdt = _cdt(Xa, H, P, V)
        need = ctx.needs_input_grad
        dX = None
        if ctx.has_I:
            idx = _index(I, dout.shape[-1])
            dnew = dout.gather(-2, idx).to(cdt)
            if need[0]:
                dX = dout.scatter(-2, idx, torch.zeros_like(idx, dtype=dout.dtype)).to(ctx.x_dtype)
        else:
            dnew = dout.to(cdt)
        dXa = dH = dP = dV = None
        if need[2]:
            dXa = dnew if H is None else torch.einsum("...jq,...jc->...qc", H.to(cdt), dnew)
            dXa = _unbroadcast(dXa.to(Xa.dtype), Xa)
        if need[3] and H is not None:
            dH = _unbroadcast(torch.einsum("...jc,...qc->...jq", dnew, Xa.to(cdt)).to(H.dtype), H)
        if need[4]:
            dP = _unbroadcast(torch.einsum("...jc,...sc->...js", dnew, V.to(cdt)).to(P.dtype), P)
        if need[5]:
            dV = _unbroadcast(torch.einsum("...js,...jc->...sc", P.to(cdt), dnew).to(V.dtype), V)
        return dX, None, dXa, dH, dP, dV, None


def write(X, I, Xa, H, P, V, out_dtype=None):
    """One-op write (see :func:`xhc.kernels.write`); backward by hand, saves Xa, H, P, V, I."""
    if out_dtype is None:
        out_dtype = X.dtype if I is not None else Xa.dtype
    return _Write.apply(X, I, Xa, H, P, V, out_dtype)


# ------------------------------------------------------------------------------------------------
# norm folded after the GEMM
# ------------------------------------------------------------------------------------------------
def flat_moments(x: torch.Tensor):
    """(μ, ν) = (mean(x), mean(x²)) over the last dim, fp32, keepdim: the statistics of every
    flat norm of ``x`` (docs/math.md §1.5), computed once per token."""
    x = fp32(x)
    return x.mean(-1, keepdim=True), x.pow(2).mean(-1, keepdim=True)


def rms_scale(nu: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(ν + ε): the RMSNorm factor applied after the GEMM."""
    return torch.rsqrt(nu + eps)


def layer_scale(mu: torch.Tensor, nu: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(ν − μ² + ε) (variance clamped at 0): the LayerNorm factor applied after the GEMM."""
    return torch.rsqrt((nu - mu * mu).clamp_min(0.0) + eps)


def norm_linear_reference(x, W, eps=1e-6, kind="rms", gain=None):
    """Normalise, then the GEMM (the reference order)."""
    xh = rms_norm_flat(x, eps) if kind == "rms" else layer_norm_flat(x, eps)
    if gain is not None:
        xh = xh * fp32(gain)
    return F.linear(xh, fp32(W))


def norm_linear(x, W, eps=1e-6, kind="rms", gain=None):
    """The GEMM on the raw x, the norm applied to its d outputs (docs/math.md §1.5 reordering)."""
    x = fp32(x)
    Wf = fp32(W) if gain is None else fp32(W) * fp32(gain)
    proj = F.linear(x, Wf)
    mu, nu = flat_moments(x)
    if kind == "rms":
        return proj * rms_scale(nu, eps)
    if kind == "layer":
        return (proj - mu * Wf.sum(-1)) * layer_scale(mu, nu, eps)
    raise ValueError(f"norm_linear kind={kind!r}: allowed values are rms, layer")
