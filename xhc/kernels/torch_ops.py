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

from xhc.norms import flat_moments, fp32, layer_norm_flat, layer_scale, rms_norm_flat, rms_scale
from xhc.streams import compute_dtype as _cdt
from xhc.streams import read_streams, scatter_active, write_streams


# ------------------------------------------------------------------------------------------------
# read: u_t = Σ_j h[t, j] X_j
# ------------------------------------------------------------------------------------------------
def read_reference(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The eager read: the reference :func:`xhc.streams.read_streams` (what :func:`read` is tested against)."""
    return read_streams(h, X, out_dtype)


UNROLL_MAX = 32  # contractions over at most this many streams/slots run as unrolled pointwise sums


def _contract_rows(W: torch.Tensor, A: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """out[..., t, c] = Σ_j W[..., t, j] · A[..., j, c] in ``cdt``.

    While ``torch.compile`` traces and for few rows (j ≤ :data:`UNROLL_MAX`) this is an unrolled
    sum of broadcast products, so that the compiler makes it one pointwise loop that reads A once and fuses with its neighbours
    (the casts, a ``where``, other gradient terms) instead of a batched GEMM with K = j; called
    eagerly (or for many rows) it is one ``einsum``.  Summation order j = 0, 1, … (the reference einsum may round differently).
    """
    n = W.shape[-1]
    if n > UNROLL_MAX or not torch.compiler.is_compiling():  # called eagerly: one batched GEMM
        return torch.einsum("...tj,...jc->...tc", W.to(cdt), A.to(cdt))
    out = None
    for j in range(n):
        term = W[..., j : j + 1].to(cdt) * A[..., j : j + 1, :].to(cdt)
        out = term if out is None else out + term
    return out


def _row_dots(A: torch.Tensor, B: torch.Tensor, cdt: torch.dtype, split: bool = False) -> torch.Tensor:
    """out[..., i, j] = Σ_c A[..., i, c] · B[..., j, c] in ``cdt``: ``[..., a, C]``, ``[..., b, C]`` -> ``[..., a, b]``.

    While ``torch.compile`` traces (few rows) a broadcast product summed over C, which the
    compiler turns into a reduction loop that shares its reads with the other per-token reductions
    of the same backward (one pass over dout, X_a, V instead of one batched GEMM each); eagerly
    one ``einsum``.  ``split`` (compile): one reduction per row of A instead (see below).
    """
    a = A.shape[-2]
    if a * B.shape[-2] > UNROLL_MAX * UNROLL_MAX or not torch.compiler.is_compiling():
        return torch.einsum("...ic,...jc->...ij", A.to(cdt), B.to(cdt))
    if not split or a > UNROLL_MAX:
        return (A.to(cdt).unsqueeze(-2) * B.to(cdt).unsqueeze(-3)).sum(-1)
    # one reduction per row of A, each of loop shape (tokens·b, C): the reductions of one backward
    # with the same b then share one loop over their common operand (the write's dH_i = dnew_i·X_a
    # and the read's dh = du·X read X once), where one reduction of shape (tokens·a·b, C) fuses with none
    Bf = B.to(cdt)
    return torch.stack([(A[..., i : i + 1, :].to(cdt) * Bf).sum(-1) for i in range(a)], -2)


def _row_dots_widened(A: torch.Tensor, B: torch.Tensor, cdt: torch.dtype, width: int) -> torch.Tensor:
    """:func:`_row_dots` (``[..., a, C]``, ``[..., b, C]`` -> ``[..., a, b]``) for b ≤ ``width``, computed
    while ``torch.compile`` traces as one reduction per row of A over B widened to ``width`` rows
    (broadcast when b = 1, zero rows appended otherwise), keeping the first b columns.

    Why: a reduction's loop is (tokens·rows of its second operand, C).  The write's dH_i = dnew_i·X_a
    (width = k rows) and the read's dh = du·X run in loops of that shape and share one pass over
    dnew and X; dP_i = dnew_i·V over V's own b < k rows would be a loop of another shape, a second
    pass over dnew.  Widened, dP_i reads dnew_i with the same index as dH_i and joins that pass (the
    extra columns cost arithmetic, not memory traffic).  Called eagerly: :func:`_row_dots`.
    """
    a, b = A.shape[-2], B.shape[-2]
    if b > width or a > UNROLL_MAX or width > UNROLL_MAX or not torch.compiler.is_compiling():
        return _row_dots(A, B, cdt)
    Bw = B.to(cdt)
    if b == 1:
        Bw = Bw.expand(*Bw.shape[:-2], width, Bw.shape[-1])
    elif b < width:
        Bw = F.pad(Bw, (0, 0, 0, width - b))
    return torch.stack([(A[..., i : i + 1, :].to(cdt) * Bw).sum(-1)[..., :b] for i in range(a)], -2)


def row_dots(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Σ_c A[..., i, c]·B[..., j, c] ``[..., a, b]`` in fp32 (float64 if either is), differentiable."""
    return _row_dots(A, B, _cdt(A, B))


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, but ``t`` itself when it has that dtype already.

    A custom autograd function must not return a no-op ``.to`` of its result: under
    ``torch.compile`` with torch 2.11, such an output (an alias of an intermediate) gets zero
    gradients (found by ``test_compiled_fused_equals_eager`` on 2.11; 2.13 is right).  The forwards
    below return through this helper so their outputs are always fresh tensors.
    """
    return t if t.dtype == dtype else t.to(dtype)


class _Read(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, X, out_dtype):
        cdt = _cdt(h, X)
        ctx.save_for_backward(h, X)
        return _cast(_contract_rows(h, X, cdt), out_dtype)

    @staticmethod
    def backward(ctx, du):
        h, X = ctx.saved_tensors
        cdt = _cdt(h, X)
        du = du.to(cdt)
        dh = dX = None
        if ctx.needs_input_grad[0]:
            dh = _row_dots(du, X, cdt).to(h.dtype)
            dh = _unbroadcast(dh, h)
        if ctx.needs_input_grad[1]:
            dX = _contract_rows(h.transpose(-1, -2), du, cdt).to(X.dtype)
            dX = _unbroadcast(dX, X)
        return dh, dX, None


def read(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """u = Σ_j h[..., j]·X_j (``h`` ``[..., n]`` or ``[..., T, n]``, ``X`` ``[..., n, C]``), one op."""
    single = h.dim() == X.dim() - 1
    hh = h.unsqueeze(-2) if single else h
    u = _Read.apply(hh, X, out_dtype or _cdt(h, X))
    return u.squeeze(-2) if single else u


# ------------------------------------------------------------------------------------------------
# gather of the active rows, with a gather-shaped backward
# ------------------------------------------------------------------------------------------------
def inverse_slots(I: torch.Tensor, n: int) -> torch.Tensor:
    """slot[..., i] = j where I[..., j] = i, and −1 for rows not in I: long ``[..., n]``.

    Lets every op on the full ``[..., n, C]`` state be written row by row (out[i] depends on
    slot[i]) — a pointwise loop over the state — instead of a scatter (docs/kernels.md).
    """
    ar = torch.arange(I.shape[-1], device=I.device, dtype=I.dtype).expand(I.shape)
    return torch.full((*I.shape[:-1], n), -1, dtype=I.dtype, device=I.device).scatter(-1, I, ar)


def take_rows(A: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A[..., idx[..., m], :]: ``A`` ``[..., r, C]``, ``idx`` long ``[..., M]``  ->  ``[..., M, C]``."""
    return A.gather(-2, idx.unsqueeze(-1).expand(*idx.shape, A.shape[-1]))


def _gather_rows_stored(A: torch.Tensor, I: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """A[..., I, :] in ``cdt`` ``[..., k, C]``, stored once when compiled.

    A gather is a pointwise read, so the compiler inlines it into every consumer, and each such
    loop then reads the whole of A (an indirect read's range is all of A).  The backward of the
    xHC write has many consumers of dout[I] (dH, dP, the components' and the conv's gradients),
    so there it is written as a contraction with the one-hot rows of I, a reduction over the N
    rows that the compiler stores: A is read once and the k rows are read back by the rest.
    Called eagerly: a gather.
    """
    N = A.shape[-2]
    if not torch.compiler.is_compiling() or N <= 8:  # inductor unrolls reductions this small
        return take_rows(A, I).to(cdt)
    onehot = (I.unsqueeze(-1) == torch.arange(N, device=I.device)).to(cdt)  # [..., k, N]
    return (onehot.unsqueeze(-1) * A.to(cdt).unsqueeze(-3)).sum(-2)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, I, slot):
        ctx.save_for_backward(slot)
        return take_rows(X, I)

    @staticmethod
    def backward(ctx, dXa):
        (slot,) = ctx.saved_tensors
        act = (slot >= 0).unsqueeze(-1)
        dX = torch.where(act, take_rows(dXa, slot.clamp_min(0)), torch.zeros((), dtype=dXa.dtype, device=dXa.device))
        return dX, None, None


def gather(X: torch.Tensor, I: torch.Tensor, slot: Optional[torch.Tensor] = None) -> torch.Tensor:
    """X_a = X[I] (``X`` ``[..., N, C]``, ``I`` ``[..., k]``) whose backward is a row-wise
    ``where`` over X (dX[i] = dX_a[slot[i]] or 0) instead of a ``scatter_add``, so under compile it
    fuses with X's other gradient terms.  ``slot``: :func:`inverse_slots` of I (computed if None)."""
    if slot is None:
        slot = inverse_slots(I, X.shape[-2])
    return _Gather.apply(X, I, slot)


# ------------------------------------------------------------------------------------------------
# write: new_j = Σ_q H[j,q] Xa_q + Σ_s P[j,s] V_s, optionally scattered into X at rows I
# ------------------------------------------------------------------------------------------------
def _index(I: torch.Tensor, C: int) -> torch.Tensor:
    return I.unsqueeze(-1).expand(*I.shape, C)


def write_reference(X, I, Xa, H, P, V, out_dtype=None):
    """The eager write (:func:`xhc.kernels.write` on ``eager``): the reference
    :func:`xhc.streams.write_streams` of the rows, scattered into X at ``I`` by
    :func:`xhc.streams.scatter_active` (autograd through einsum, gather-free scatter)."""
    if I is None:
        return write_streams(Xa, H, P, V, out_dtype or Xa.dtype)
    return scatter_active(X, I, write_streams(Xa, H, P, V, X.dtype)).to(out_dtype or X.dtype)


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


def _blocks_of(V) -> tuple:
    """The write components as blocks ``[..., K_b, C]``: a ``[..., K, C]`` tensor is one block, a
    sequence of ``[..., C]`` tensors one block per component (unsqueezed views, no copy)."""
    if isinstance(V, torch.Tensor):
        return (V,)
    return tuple(v.unsqueeze(-2) for v in V)


def _column_spans(blocks) -> list:
    spans, start = [], 0
    for b in blocks:
        spans.append((start, start + b.shape[-2]))
        start += b.shape[-2]
    return spans


def _branch(P, blocks, cdt):
    """Σ_s P[..., j, s]·V_s over the component blocks (P's columns in block order)."""
    out = None
    for (a, b), B in zip(_column_spans(blocks), blocks):
        term = _contract_rows(P[..., a:b], B, cdt)
        out = term if out is None else out + term
    return out


def _new_rows(Xa, H, P, blocks, cdt, rows: Optional[torch.Tensor] = None):
    """new[..., j, :] = Σ_q H[j, q]·Xa_q + Σ_s P[j, s]·V_s in ``cdt`` (``H`` None = identity);
    ``blocks``: the components V (:func:`_blocks_of`).

    ``rows`` (long ``[..., M]``, values in [0, k)): compute the rows ``rows`` of ``new`` instead,
    ``[..., M, C]`` — the xHC write evaluates new[slot[i]] for every state row i.
    """
    if rows is None:
        mixed = Xa.to(cdt) if H is None else _contract_rows(H, Xa, cdt)
        return mixed + _branch(P, blocks, cdt)
    if torch.compiler.is_compiling():
        # one loop over the state: each row reads its slot's coefficients and every component
        # (inductor counts a buffer once per kernel, so the components cost their own size once;
        # xhc.kernels.INDUCTOR_OPTIONS keeps this many reads in one loop)
        branch = _branch(take_rows(P, rows), blocks, cdt)
    else:  # eagerly: the k branch rows as batched GEMMs, then each state row takes its slot's
        branch = take_rows(_branch(P, blocks, cdt), rows)
    mixed = take_rows(Xa, rows).to(cdt) if H is None else _contract_rows(take_rows(H, rows), Xa, cdt)
    return mixed + branch


class _Write(torch.autograd.Function):
    """Mixing + branch write (+ scatter) as one op.  With ``I``: out[i] = new[slot[i]] for active
    rows and X[i] otherwise, evaluated row by row (a ``where``, no scatter), and dX = dout on
    inactive rows, 0 on active ones; the gradient of the active rows flows through X_a.
    The components come last, as blocks ``[..., K_b, C]`` (:func:`_blocks_of`)."""

    @staticmethod
    def forward(ctx, X, I, slot, Xa, H, P, out_dtype, *blocks):
        own = Xa is None  # X_a = X[I]: the mixing reads the active rows straight from X
        if own:
            Xa = take_rows(X, I)
        cdt = _cdt(Xa, H, P, *blocks)
        ctx.save_for_backward(I, slot, X if own else Xa, H, P, *blocks)
        ctx.has_H, ctx.has_I, ctx.own = H is not None, I is not None, own
        ctx.x_dtype = None if X is None else X.dtype
        if I is None:
            return _cast(_new_rows(Xa, H, P, blocks, cdt), out_dtype)
        act = (slot >= 0).unsqueeze(-1)
        new = _new_rows(Xa, H, P, blocks, cdt, rows=slot.clamp_min(0))
        return _cast(torch.where(act, _cast(new, X.dtype), X), out_dtype)

    @staticmethod
    def backward(ctx, dout):
        I, slot, Xa, H, P, *blocks = ctx.saved_tensors
        if ctx.own:
            Xa = take_rows(Xa, I)  # the saved tensor is X
        cdt = _cdt(Xa, H, P, *blocks)
        need = ctx.needs_input_grad
        dX = None
        dXa = dH = dP = None
        dVs = [None] * len(blocks)
        if ctx.has_I:
            # several consumers of dout[I] when the components come one by one (compiled MLP write)
            dnew = _gather_rows_stored(dout, I, cdt) if len(blocks) > 1 else take_rows(dout, I).to(cdt)
        else:
            dnew = dout.to(cdt)
        if need[3] or (ctx.own and need[0]):
            dXa = dnew if H is None else _contract_rows(H.transpose(-1, -2), dnew, cdt)
        if ctx.has_I and need[0]:
            act = (slot >= 0).unsqueeze(-1)
            into = take_rows(dXa, slot.clamp_min(0)).to(dout.dtype) if ctx.own else \
                torch.zeros((), dtype=dout.dtype, device=dout.device)
            dX = torch.where(act, into, dout).to(ctx.x_dtype)
        if ctx.own:
            dXa = None
        elif dXa is not None:
            dXa = _unbroadcast(dXa.to(Xa.dtype), Xa)
        if need[4] and H is not None:
            dH = _unbroadcast(_row_dots(dnew, Xa, cdt, split=not ctx.has_I).to(H.dtype), H)
        if need[5]:
            parts = []
            for B in blocks:
                if ctx.has_I:
                    parts.append(_row_dots(dnew, B, cdt))
                else:  # per row of dnew, in the loop shape of dH's rows (see _row_dots_widened)
                    parts.append(_row_dots_widened(dnew, B, cdt, Xa.shape[-2]))
            dP = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
            dP = _unbroadcast(dP.to(P.dtype), P)
        for i, ((a, b), B) in enumerate(zip(_column_spans(blocks), blocks)):
            if need[7 + i]:
                dVs[i] = _unbroadcast(_contract_rows(P[..., a:b].transpose(-1, -2), dnew, cdt).to(B.dtype), B)
        return (dX, None, None, dXa, dH, dP, None, *dVs)


def write(X, I, Xa, H, P, V, out_dtype=None, slot: Optional[torch.Tensor] = None):
    """One-op write (see :func:`xhc.kernels.write`); backward by hand, saves I, its slots, H, P, V
    and Xa (X itself when ``Xa`` is None).
    ``V``: ``[..., K, C]``, or a sequence of K ``[..., C]`` tensors (the components one by one,
    read by the op as they are, never stacked).
    ``slot``: :func:`inverse_slots` of I (computed if None).  ``Xa`` None (with ``I``): X_a = X[I],
    read from X inside the op (the xHC sublayer; a Flash window's carried X_a is its own tensor)."""
    if Xa is None and I is None:
        raise ValueError("write: Xa=None (X_a = X[I]) needs the active rows I")
    if out_dtype is None:
        out_dtype = X.dtype if I is not None else Xa.dtype
    if I is not None and slot is None:
        slot = inverse_slots(I, X.shape[-2])
    return _Write.apply(X, I, slot, Xa, H, P, out_dtype, *_blocks_of(V))


def gram_of_list(Vs) -> torch.Tensor:
    """M[..., a, b] = Σ_c V_a·V_b ``[..., K, K]`` for components given one by one (``[..., C]``
    each), fp32 (float64 if any is): the K(K+1)/2 dot products as reductions of one loop shape,
    which the compiler runs in one pass over what the components are computed from."""
    cdt = _cdt(*Vs)
    K = len(Vs)
    vals = {}
    for a in range(K):
        for b in range(a, K):
            vals[a, b] = (Vs[a].to(cdt) * Vs[b].to(cdt)).sum(-1)
    return torch.stack([torch.stack([vals[min(a, b), max(a, b)] for b in range(K)], -1) for a in range(K)], -2)


# ------------------------------------------------------------------------------------------------
# norm folded after the GEMM
# ------------------------------------------------------------------------------------------------
def norm_linear_reference(x, W, eps=1e-6, kind="rms", gain=None):
    """Normalise, then the GEMM (the reference order)."""
    xh = rms_norm_flat(x, eps) if kind == "rms" else layer_norm_flat(x, eps)
    if gain is not None:
        xh = xh * fp32(gain)
    return F.linear(xh, fp32(W))


def norm_linear(x, W, eps=1e-6, kind="rms", gain=None, moments=None):
    """The GEMM on the raw x, the norm applied to its d outputs (docs/math.md §1.5 reordering).
    ``moments``: (μ, ν) of x when already known (:func:`xhc.norms.moments_of_rows`)."""
    x = fp32(x)
    Wf = fp32(W) if gain is None else fp32(W) * fp32(gain)
    proj = F.linear(x, Wf)
    mu, nu = flat_moments(x) if moments is None else moments
    return norm_after(proj, Wf, mu, nu, eps, kind)


def norm_after(proj, Wf, mu, nu, eps=1e-6, kind="rms"):
    """The flat norm applied to the GEMM's outputs ``proj`` = x·Wfᵀ ``[..., d]``, from x's (μ, ν)
    ``[..., 1]`` (docs/math.md §1.5): RMSNorm(x)·Wfᵀ or LayerNorm(x)·Wfᵀ."""
    if kind == "rms":
        return proj * rms_scale(nu, eps)
    if kind == "layer":
        return (proj - mu * Wf.sum(-1)) * layer_scale(mu, nu, eps)
    raise ValueError(f"norm_linear kind={kind!r}: allowed values are rms, layer")
