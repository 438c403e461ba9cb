"""Triton kernels for the fused hyper-connection ops (the ``triton`` backend, docs/kernels.md).

One program per token (per matrix for Sinkhorn, a block of matrices per program), a loop over
C in blocks, fp32 accumulation in registers (float64 inputs compute in float64, for tests):

=====================  =================================================================
:func:`sinkhorn`       forward: the reference iterations; backward: recompute keeping the
                       per-step denominators (a small scratch buffer), then the adjoint of
                       :func:`xhc.doubly_stochastic.sinkhorn_backward`
:func:`read`           u[t] = Σ_j h[t, j]·X_j;  backward: dX and dh in one pass over X
:func:`write`          new = H·Xa + P·V (+ scatter into X at rows I, the other rows copied in
                       the same pass);  backward: dXa, dH, dP, dV (and dX) in one pass
:func:`linear_stats`   vec(X)·Wᵀ with X's row sums and sums of squares in one pass;  backward: dX
                       (and every deferred term below) in one pass, dW in one pass
=====================  =================================================================

**One write of the state's gradient per sublayer.**  A sublayer reads its state X three times:
the coefficient GEMM (:func:`linear_stats`, the first), the read and the write.  Left to autograd,
each op writes its own N·C gradient of X and autograd adds them (two extra N·C tensors written and
read back).  Here the read and the write *defer* their X-gradient term to the sublayer's
:func:`linear_stats` op on the same X: in the forward they find it among the ancestors of their
coefficients (h for the read, H or P for the write; :func:`_claim`), in the backward they compute
only their coefficient gradients and hand (h, du) or (dout, H, I) to it, and its backward writes
dX = GEMM term + statistics terms + read term + write term in one pass
(:func:`_state_grad_kernel`).  The order is safe by construction: the coefficients are computed
from that op's outputs, so autograd runs its backward after theirs.  Where no such op is found (a
static mapping, coefficients computed elsewhere) the ops return their dX to autograd as before.

The kernels take contiguous ``[T, ...]`` tensors; the wrappers flatten the token dims and
expand broadcast inputs.  ``TRITON_INTERPRET=1`` runs them on CPU tensors (tests).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl


def _np2(x: int) -> int:
    return max(2, triton.next_power_of_2(int(x)))


def _cdt(*ts) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _tl(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def _cast(x, PTR):
    """x (fp32/fp64) in PTR's element type; bf16 rounds to nearest even explicitly (the Triton
    interpreter's float->bf16 conversion truncates; on GPUs this equals the native conversion)."""
    if PTR.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(PTR.dtype.element_ty)


# ================================================================================================
# Sinkhorn
# ================================================================================================
@triton.jit
def _sk_load(Z, T, n, BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    mask = (t < T) & (i < n) & (j < n)
    offs = t * n * n + i * n + j
    z = tl.load(Z + offs, mask=mask, other=0.0).to(CDT)
    return z, mask, offs


@triton.jit
def _sinkhorn_fwd_kernel(Z, OUT, T, n, t_max, eps, ROW_LAST: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr,
                         CDT: tl.constexpr):
    z, mask, offs = _sk_load(Z, T, n, BT, NP, CDT)
    M = sinkhorn_tile(z, mask, t_max, eps, ROW_LAST, False)
    tl.store(OUT + offs, _cast(M, OUT), mask=mask)


@triton.jit
def _sk_row_fwd(M, S, base, k, eps, NS: tl.constexpr, NP: tl.constexpr):
    s = tl.sum(M, 2)  # [BT, NP] over i
    tl.store(S + base + k * NP + tl.arange(0, NP)[None, :], s)
    return M / tl.maximum(s, eps)[:, :, None]


@triton.jit
def _sk_col_fwd(M, S, base, k, eps, NS: tl.constexpr, NP: tl.constexpr):
    s = tl.sum(M, 1)  # [BT, NP] over j
    tl.store(S + base + k * NP + tl.arange(0, NP)[None, :], s)
    return M / tl.maximum(s, eps)[:, None, :]


@triton.jit
def _sk_row_bwd(G, M, S, base, k, eps, NP: tl.constexpr):
    s = tl.load(S + base + k * NP + tl.arange(0, NP)[None, :])[:, :, None]
    d = tl.maximum(s, eps)
    dot = tl.sum(G * M, 2)[:, :, None]
    G = (G - tl.where(s >= eps, dot, 0.0)) / d
    return G, M * d


@triton.jit
def _sk_col_bwd(G, M, S, base, k, eps, NP: tl.constexpr):
    s = tl.load(S + base + k * NP + tl.arange(0, NP)[None, :])[:, None, :]
    d = tl.maximum(s, eps)
    dot = tl.sum(G * M, 1)[:, None, :]
    G = (G - tl.where(s >= eps, dot, 0.0)) / d
    return G, M * d


@triton.jit
def _sk_start(z, mask):
    zm = tl.where(mask, z, float("-inf"))
    zmax = tl.max(zm, 2)[:, :, None]
    zmax = tl.where(zmax == float("-inf"), 0.0, zmax)
    return zmax, tl.where(mask, tl.exp(z - zmax), 0.0)


@triton.jit
def sinkhorn_tile(z, mask, t_max, sk_eps, ROW_LAST: tl.constexpr, CLAMP: tl.constexpr):
    """H = Sinkhorn(z) of a ``[BT, NP, NP]`` tile of logits in registers (row-max shift, ``t_max``
    iterations in either order, denominators clamped at ε), then the row-sum clamp when ``CLAMP``
    (docs/math.md §2.f: H[i, :] / max(Σ_j H[i, j], 1)); zero on the padding."""
    zmax, M = _sk_start(z, mask)
    if ROW_LAST:
        M = M / tl.maximum(tl.sum(M, 2), sk_eps)[:, :, None]
        for _ in range(t_max):
            M = M / tl.maximum(tl.sum(M, 1), sk_eps)[:, None, :]
            M = M / tl.maximum(tl.sum(M, 2), sk_eps)[:, :, None]
    else:
        for _ in range(t_max):
            M = M / tl.maximum(tl.sum(M, 2), sk_eps)[:, :, None]
            M = M / tl.maximum(tl.sum(M, 1), sk_eps)[:, None, :]
    if CLAMP:
        M = M / tl.maximum(tl.sum(M, 2), 1.0)[:, :, None]
    return M


@triton.jit
def sinkhorn_tile_bwd(z, mask, Gd, S, base, t_max, sk_eps, ROW_LAST: tl.constexpr, CLAMP: tl.constexpr,
                      NS: tl.constexpr, NP: tl.constexpr):
    """dz of :func:`sinkhorn_tile` from dH = ``Gd`` (xhc.doubly_stochastic.sinkhorn_backward): the
    forward is recomputed with its per-step sums in the scratch ``S`` at ``base``, then every step's
    adjoint in reverse; the padding is kept at 0 after each step (else it grows by 1/ε per step)."""
    zmax, M0 = _sk_start(z, mask)
    M = M0
    k = 0
    if ROW_LAST:
        M = _sk_row_fwd(M, S, base, k, sk_eps, NS, NP)
        k += 1
        for _ in range(t_max):
            M = _sk_col_fwd(M, S, base, k, sk_eps, NS, NP)
            M = _sk_row_fwd(M, S, base, k + 1, sk_eps, NS, NP)
            k += 2
    else:
        for _ in range(t_max):
            M = _sk_row_fwd(M, S, base, k, sk_eps, NS, NP)
            M = _sk_col_fwd(M, S, base, k + 1, sk_eps, NS, NP)
            k += 2
    if CLAMP:
        M = _sk_row_fwd(M, S, base, k, 1.0, NS, NP)
        Gd, M = _sk_row_bwd(Gd, M, S, base, k, 1.0, NP)
        Gd = tl.where(mask, Gd, 0.0)
    if ROW_LAST:
        for _ in range(t_max):
            Gd, M = _sk_row_bwd(Gd, M, S, base, k - 1, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            Gd, M = _sk_col_bwd(Gd, M, S, base, k - 2, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            k -= 2
        Gd, M = _sk_row_bwd(Gd, M, S, base, k - 1, sk_eps, NP)
        Gd = tl.where(mask, Gd, 0.0)
    else:
        for _ in range(t_max):
            Gd, M = _sk_col_bwd(Gd, M, S, base, k - 1, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            Gd, M = _sk_row_bwd(Gd, M, S, base, k - 2, sk_eps, NP)
            Gd = tl.where(mask, Gd, 0.0)
            k -= 2
    dz = Gd * M0
    at_max = tl.where(mask & (z == zmax), 1.0, 0.0).to(dz.dtype)
    cnt = tl.maximum(tl.sum(at_max, 2), 1.0)[:, :, None]
    return tl.where(mask, dz - at_max * (tl.sum(dz, 2)[:, :, None] / cnt), 0.0)


@triton.jit
def _sinkhorn_bwd_kernel(Z, DH, DZ, S, T, n, t_max, eps, ROW_LAST: tl.constexpr, NS: tl.constexpr,
                         BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    z, mask, offs = _sk_load(Z, T, n, BT, NP, CDT)
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)[:, None]
    base = t * NS * NP  # [BT, 1]; the scratch rows of padded tokens exist (S has BT-padded rows)
    G = tl.load(DH + offs, mask=mask, other=0.0).to(CDT)
    dZ = sinkhorn_tile_bwd(z, mask, G, S, base, t_max, eps, ROW_LAST, False, NS, NP)
    tl.store(DZ + offs, _cast(dZ, DZ), mask=mask)


def _sk_block(n: int) -> int:
    return max(1, 256 // (_np2(n) ** 2))


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Z, t_max, eps, order):
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        out = torch.empty_like(Zc)
        BT, NP = _sk_block(n), _np2(n)
        grid = (triton.cdiv(T, BT),)
        _sinkhorn_fwd_kernel[grid](Zc, out, T, n, t_max, eps, order == "row_last", BT=BT, NP=NP, CDT=_tl(Z.dtype))
        ctx.save_for_backward(Z)
        ctx.cfg = (t_max, eps, order)
        return out.view(Z.shape)

    @staticmethod
    def backward(ctx, dH):
        (Z,) = ctx.saved_tensors
        t_max, eps, order = ctx.cfg
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        BT, NP = _sk_block(n), _np2(n)
        NS = 2 * t_max + (1 if order == "row_last" else 0)
        grid = (triton.cdiv(T, BT),)
        S = torch.empty(grid[0] * BT, max(NS, 1), NP, dtype=Zc.dtype, device=Z.device)
        dZ = torch.empty_like(Zc)
        _sinkhorn_bwd_kernel[grid](Zc, dH.reshape(-1, n, n).to(Zc.dtype).contiguous(), dZ, S, T, n, t_max, eps,
                                   order == "row_last", NS=max(NS, 1), BT=BT, NP=NP, CDT=_tl(Z.dtype))
        return dZ.view(Z.shape), None, None, None


def sinkhorn(Z: torch.Tensor, t_max: int = 20, eps: float = 1e-6, order: str = "row_last") -> torch.Tensor:
    """Sinkhorn–Knopp ``[..., n, n]`` -> fp32 (float64 stays float64); saves only Z."""
    if order not in ("row_last", "col_last"):
        raise ValueError(f"sinkhorn order={order!r}: allowed values are ('row_last', 'col_last')")
    Z = Z if Z.dtype == torch.float64 else Z.float()
    return _Sinkhorn.apply(Z, t_max, eps, order)


# ================================================================================================
# One write of the state's gradient per sublayer (module docstring)
# ================================================================================================
_OWNER_SEARCH = 256  # autograd nodes visited at most when looking for the state's linear_stats op
OWNER_CLASSES: list = []
"""Further backward-node classes that own a state's gradient as :func:`linear_stats` does (the fused
xHC entry, :mod:`xhc.kernels.xhc_entry`): they carry ``_x_key``, ``_x_rows``, ``_claims``, ``_pending``
and ``_owner``, and write the whole dX with the handed-over terms."""


def _state_key(X: torch.Tensor):
    """What identifies a state across views of it: its memory, size, dtype and in-place version.
    None for a state that needs no gradient (inference tensors have no version counter at all)."""
    if not X.requires_grad or X.is_inference() or not X.is_contiguous():
        return None
    return (X.data_ptr(), X.numel(), X.dtype, X.device, X._version)


def _claim(X: Optional[torch.Tensor], slot: str, coefs) -> Optional[object]:
    """The backward node of the :func:`linear_stats` op that first read the state ``X`` (``[..., N, C]``)
    among the ancestors of ``coefs``, with its ``slot`` ("read" / "write") taken for this op; None when
    there is none (the op then writes its own dX).  Called in the forward of the deferring op."""
    if X is None or not X.requires_grad:  # (inside a Function's forward grad mode is always off)
        return None
    key = _state_key(X)
    if key is None:
        return None
    stop = {id(X.grad_fn)} if X.grad_fn is not None else set()  # the state's own history is not searched
    base = X._base
    if base is not None and base.grad_fn is not None:
        stop.add(id(base.grad_fn))
    owner_cls = (_LinearStats._backward_cls, *OWNER_CLASSES)
    queue = [t.grad_fn for t in coefs if t is not None and t.grad_fn is not None]
    seen, best, i = set(), None, 0
    while i < len(queue) and len(seen) < _OWNER_SEARCH:
        node = queue[i]
        i += 1
        if id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        if isinstance(node, owner_cls):  # a linear_stats op: the owner if it read this state
            if getattr(node, "_x_key", None) == key and (best is None or node._sequence_nr() < best._sequence_nr()):
                best = node
            continue
        queue.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    while best is not None and getattr(best, "_owner", None) is not None:
        best = best._owner  # that op hands its own term on to the first one
    if best is None or slot in best._claims:
        return None
    R, Co = best._x_rows
    if slot == "linear":  # another linear_stats op on the same state: its rows are 1 or the owner's R
        if X.shape[-2] not in (1, R):
            return None
        best._claims[slot] = None
        return best
    N, C = X.shape[-2:]
    if not (R == 1 or (R == N and Co == C)):
        return None
    best._claims[slot] = (N, C)
    return best


XA_OWNER_CLASSES: list = []
"""Backward-node classes that own a Flash window's carried X_a gradient (the fused active mappings,
:mod:`xhc.kernels.xhc_active`): they carry ``_xa_key``, ``_claims`` and ``_pending``, and add the
handed-over dX_a of the write that uses their P into the dX_a they write."""


def _claim_carried(Xa: Optional[torch.Tensor], P: Optional[torch.Tensor]) -> Optional[object]:
    """The backward node of the op that made ``P`` from the carried ``Xa`` (a Flash window write's
    mappings, :mod:`xhc.kernels.xhc_active`), with its "dxa" slot taken for the calling write; None
    when there is none (the write then returns its dX_a to autograd).  Called in the write's forward;
    the order is safe by construction: the write consumes P, so autograd runs that op's backward after
    the write's."""
    if Xa is None or P is None or not XA_OWNER_CLASSES:
        return None
    node = P.grad_fn
    for _ in range(2):  # through the wrappers' broadcast / reshape views of P (one input each)
        if node is None or isinstance(node, tuple(XA_OWNER_CLASSES)) or len(node.next_functions) != 1:
            break
        if type(node).__name__ not in ("ExpandBackward0", "ViewBackward0", "UnsafeViewBackward0"):
            break
        node = node.next_functions[0][0]
    key = _state_key(Xa)
    if key is None or not isinstance(node, tuple(XA_OWNER_CLASSES)) or getattr(node, "_xa_key", None) != key:
        return None
    if "dxa" in node._claims:
        return None
    node._claims["dxa"] = True
    return node


def _hand_over(owner, slot: str, terms) -> None:
    """In the deferring op's backward: give the owner the inputs of this op's dX term for this pass."""
    owner._pending[slot] = (torch._C._current_graph_task_id(), terms)


@triton.jit
def _state_grad_kernel(X, W, G, DS1, DS2, HR, DU, DOUT, HW, I, DXA, IA, DX, N, C, d, RR, k, ka,
                       HAS_W: tl.constexpr, STATS_PER_ROW: tl.constexpr, HAS_READ: tl.constexpr,
                       HAS_WRITE: tl.constexpr, WRITE_I: tl.constexpr, WRITE_H: tl.constexpr,
                       HAS_ROWS: tl.constexpr, WRITE_ZERO_ACTIVE: tl.constexpr, NP: tl.constexpr,
                       KP: tl.constexpr, KAP: tl.constexpr,
                       RP: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    """dX[t, j, c] = Σ_m G[t, m]·W[m, jC + c] + dS1[t, r] + 2·dS2[t, r]·X[t, j, c]   (linear_stats; r = j or 0)
                   + Σ_r HR[t, r, j]·DU[t, r, c]                                  (the read)
                   + Σ_i HW[t, i, q]·DOUT[t, I_i, c] on the row j = I_q, DOUT[t, j, c] elsewhere  (the write;
                     without I: Σ_i HW[t, i, j]·DOUT[t, i, c]; without HW: DOUT)
                   + DXA[t, q, c] on the row j = IA_q                             (the gather X_a = X[IA])
    in one pass over the state, one program per token."""
    t = tl.program_id(0).to(tl.int64)
    D = N * C
    jr = tl.arange(0, NP)[:, None]  # the state's rows
    rowm = jr < N
    if STATS_PER_ROW:
        ds1 = tl.load(DS1 + t * N + jr, mask=rowm, other=0.0).to(CDT)  # [NP, 1]
        ds2 = tl.load(DS2 + t * N + jr, mask=rowm, other=0.0).to(CDT)
    else:
        ds1 = tl.load(DS1 + t).to(CDT)
        ds2 = tl.load(DS2 + t).to(CDT)
    if HAS_READ:
        rr = tl.arange(0, RP)[:, None]
        nc = tl.arange(0, NP)[None, :]
        hr = tl.load(HR + t * RR * N + rr * N + nc, mask=(rr < RR) & (nc < N), other=0.0).to(CDT)  # [RP, NP]
    if HAS_WRITE:
        qr = tl.arange(0, KP)[:, None]
        qc = tl.arange(0, KP)[None, :]
        if WRITE_H:
            hw = tl.load(HW + t * k * k + qr * k + qc, mask=(qr < k) & (qc < k), other=0.0).to(CDT)  # [KP(i), KP(q)]
        if WRITE_I:
            rows = tl.load(I + t * k + qr, mask=qr < k, other=0)  # [KP, 1]: the row of slot i
            idx = tl.load(I + t * k + qc, mask=qc < k, other=-1)  # [1, KP]
            S = tl.where(jr == idx, 1.0, 0.0).to(CDT)  # [NP, KP]: row j holds slot q
            active = tl.sum(S, 1)[:, None] > 0  # [NP, 1]
        else:
            rows = qr
    if HAS_ROWS:
        ac = tl.arange(0, KAP)[None, :]
        ar = tl.arange(0, KAP)[:, None]
        aidx = tl.load(IA + t * ka + ac, mask=ac < ka, other=-1)  # [1, KAP]
        SA = tl.where(jr == aidx, 1.0, 0.0).to(CDT)  # [NP, KAP]: row j holds gathered slot q
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)[None, :]
        cm = c < C
        msk = rowm & cm
        x = tl.load(X + t * D + jr * C + c, mask=msk, other=0.0).to(CDT)  # [NP, BC]
        acc = ds1 + 2.0 * ds2 * x
        if HAS_W:  # BM outputs of the GEMM at a time: a [BM, NP, BC] tile stays in registers (no spills)
            for m0 in range(0, d, BM):
                m = m0 + tl.arange(0, BM)
                g = tl.load(G + t * d + m, mask=m < d, other=0.0).to(CDT)  # [BM]
                w = tl.load(W + m[:, None, None] * D + jr[None, :, :] * C + c[None, :, :],
                            mask=(m[:, None, None] < d) & msk[None, :, :], other=0.0).to(CDT)  # [BM, NP, BC]
                acc += tl.sum(g[:, None, None] * w, 0)
        if HAS_READ:
            du = tl.load(DU + t * RR * C + rr * C + c, mask=(rr < RR) & cm, other=0.0).to(CDT)  # [RP, BC]
            acc += tl.sum(hr[:, :, None] * du[:, None, :], 0)
        if HAS_WRITE and not WRITE_ZERO_ACTIVE:
            dna = tl.load(DOUT + t * D + rows * C + c, mask=(qr < k) & cm, other=0.0).to(CDT)  # [KP, BC]
            if WRITE_H:
                mixed = tl.sum(hw[:, :, None] * dna[:, None, :], 0)  # [KP(q), BC]
            else:
                mixed = dna
            if WRITE_I:
                acc += tl.sum(S[:, :, None] * mixed[None, :, :], 1)
                acc += tl.load(DOUT + t * D + jr * C + c, mask=msk & (active == 0), other=0.0).to(CDT)
            else:
                acc += mixed
        if HAS_WRITE and WRITE_ZERO_ACTIVE:  # X_a was a separate input: X's active rows were overwritten
            acc += tl.load(DOUT + t * D + jr * C + c, mask=msk & (active == 0), other=0.0).to(CDT)
        if HAS_ROWS:
            dxa = tl.load(DXA + t * ka * C + ar * C + c, mask=(ar < ka) & cm, other=0.0).to(CDT)  # [KAP, BC]
            acc += tl.sum(SA[:, :, None] * dxa[None, :, :], 1)
        tl.store(DX + t * D + jr * C + c, _cast(acc, DX), mask=msk)


def _state_grad(X, W, G, dS1, dS2, R, N, C, read, write, cdt, linear=None, rows=None) -> torch.Tensor:
    """Launch :func:`_state_grad_kernel` for the owner's X (``[T, R, D/R]``) seen as ``[T, N, C]``.
    ``linear``: another linear_stats op's (G, W, dS1, dS2) on the same state (its R: 1 or the owner's);
    ``rows``: a gather's (dX_a, I)."""
    T = X.shape[0]
    if linear is not None:  # one GEMM term over the concatenated weights, statistics added row-wise
        G2, W2, dS1b, dS2b = linear
        W = torch.cat([W.to(cdt), W2.to(cdt)], 0)
        G = torch.cat([G, G2], 1).contiguous()
        if dS1b.shape[1] != dS1.shape[1]:  # one per token and one per row: both per row
            rows_n = max(dS1b.shape[1], dS1.shape[1])
            dS1, dS2, dS1b, dS2b = (t.expand(T, rows_n) for t in (dS1, dS2, dS1b, dS2b))
            R = rows_n
        dS1, dS2 = (dS1 + dS1b).contiguous(), (dS2 + dS2b).contiguous()
    if R > 1 and R != N:  # the state's rows are the statistics' rows, or there is one statistic per token
        raise RuntimeError(f"state gradient: statistics over {R} rows of a state with {N} rows")
    d = W.shape[0]
    Xs = X.reshape(T, N, C)
    dX = torch.empty_like(Xs)
    NP = _np2(N)
    hr, du = read if read is not None else (None, None)
    RR = 1 if hr is None else hr.shape[1]
    dout, hw, Iw, k, zero_active = write if write is not None else (None, None, None, N, False)
    KP = NP if Iw is None else _np2(k)
    dxa, Ia = rows if rows is not None else (None, None)
    ka = 1 if Ia is None else Ia.shape[1]
    KAP = _np2(ka)
    RP = _np2(RR)
    DP = max(16, triton.next_power_of_2(int(d))) if d > 0 else 16
    # at most 8192 values per [·, NP, BC] tile (the GEMM term 4096, BM ≤ DP outputs at a time): no spills
    # on sm_90 at N = 16 with Flash-4sub's d (tools.triton_aot resources)
    BC = max(16, min(triton.next_power_of_2(C), 8192 // (min(DP, 64) * NP), 8192 // (NP * KP), 8192 // (RP * NP)))
    BM = max(16, min(DP, 4096 // (NP * BC)))  # 8192 spilled 8 bytes at N = 16, k = 8
    if T > 0:
        _state_grad_kernel[(T,)](Xs, W.to(cdt).contiguous() if d > 0 else None, G if d > 0 else None, dS1, dS2,
                                 hr, du, dout, hw, Iw, dxa, Ia, dX, N, C, d, RR, k, ka, HAS_W=d > 0,
                                 STATS_PER_ROW=R > 1, HAS_READ=hr is not None, HAS_WRITE=dout is not None,
                                 WRITE_I=Iw is not None, WRITE_H=hw is not None, HAS_ROWS=dxa is not None,
                                 WRITE_ZERO_ACTIVE=bool(zero_active),
                                 NP=NP, KP=KP, KAP=KAP, RP=RP, BM=BM, BC=BC, CDT=_tl(cdt))
    return dX


# ================================================================================================
# read: u[t, r, :] = Σ_j h[t, r, j] X[t, j, :]
# ================================================================================================
def _block_c(C: int, rows: int, inner: int) -> int:
    return max(16, min(triton.next_power_of_2(C), 8192 // (rows * inner)))


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
        tl.store(U + t * R * C + rr * C + c, _cast(u, U), mask=(rr < R) & (c < C))


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
            tl.store(DX + t * n * C + jr * C + c, _cast(dx, DX), mask=(jr < n) & (c < C))
    tl.store(DH + t * R * n + r * n + j, _cast(dh, DH), mask=hmask)


class _Read(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, X, out_dtype):
        n, C = X.shape[-2:]
        R = h.shape[-2]
        hc, Xc = h.reshape(-1, R, n).contiguous(), X.reshape(-1, n, C).contiguous()
        T = Xc.shape[0]
        U = torch.empty(T, R, C, dtype=out_dtype, device=X.device)
        RP, NP = _np2(R), _np2(n)
        if T > 0:
            _read_fwd_kernel[(T,)](hc, Xc, U, R, n, C, RP=RP, NP=NP, BC=_block_c(C, RP, NP), CDT=_tl(_cdt(h, X)))
        ctx.save_for_backward(h, X)
        ctx.owner = _claim(X, "read", (h,))
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
        RP, NP = _np2(R), _np2(n)
        if T > 0:
            _read_bwd_kernel[(T,)](hc, Xc, dUc, dh, dX, R, n, C, RP=RP, NP=NP, BC=_block_c(C, RP, NP),
                                   CDT=_tl(_cdt(h, X)), NEED_DX=not defer)
        if defer:  # dX[t, j] += Σ_r h[t, r, j]·du[t, r]: written by the state's linear_stats op
            _hand_over(ctx.owner, "read", (hc, dUc))
            return dh.view(h.shape), None, None
        return dh.view(h.shape), dX.view(X.shape), None


def read(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """u = Σ_j h[..., j]·X_j: ``h`` ``[..., n]`` or ``[..., T, n]``, ``X`` ``[..., n, C]``."""
    single = h.dim() == X.dim() - 1
    hh = h.unsqueeze(-2) if single else h
    hh = hh.expand(*X.shape[:-2], *hh.shape[-2:])
    u = _Read.apply(hh, X, out_dtype or _cdt(h, X))
    return u.squeeze(-2) if single else u


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
            tl.store(OUT + t * N * C + rows * C + c, _cast(new, OUT), mask=(jr < k) & cm)
            if COPY:
                x = tl.load(X + t * N * C + nr * C + c, mask=keep & cm, other=0.0)
                tl.store(OUT + t * N * C + nr * C + c, x, mask=keep & cm)
        else:
            tl.store(OUT + t * k * C + jr * C + c, _cast(new, OUT), mask=(jr < k) & cm)


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
                tl.store(DX + t * N * C + rows * C + c, _cast(dxa, DX), mask=(jr < k) & cm)
        elif NEED_DXA:
            tl.store(DXA + t * k * C + jr * C + c, _cast(dxa, DXA), mask=(jr < k) & cm)
        dv = tl.sum(p[:, :, None] * dn[:, None, :], 0)  # [SP, BC]
        tl.store(DV + t * K * C + sr * C + c, _cast(dv, DV), mask=(sr < K) & cm)
        dp += tl.sum(dn[:, None, :] * v[None, :, :], 2)
        if HAS_I:
            if NEED_DX:
                if XA_FROM_X:  # rows outside I only: the active ones hold dX_a
                    pas = (nr < N) & (active == 0) & cm
                    g = tl.load(DOUT + t * N * C + nr * C + c, mask=pas, other=0.0)
                    tl.store(DX + t * N * C + nr * C + c, _cast(g.to(CDT), DX), mask=pas)
                else:
                    g = tl.load(DOUT + t * N * C + nr * C + c, mask=(nr < N) & cm, other=0.0)
                    g = tl.where(active, 0.0, g.to(CDT))
                    tl.store(DX + t * N * C + nr * C + c, _cast(g, DX), mask=(nr < N) & cm)
    if HAS_H:
        tl.store(DH + t * k * k + jr * k + qc, _cast(dh, DH), mask=hmask)
    tl.store(DP + t * k * K + jr * K + sc, _cast(dp, DP), mask=pmask)


def _write_meta(N, k, K, C):
    NP, KP, SP = _np2(N), _np2(k), _np2(K)
    # a [NP, BC] tile at most 4096 values, [KP·SP, BC] at most 2048: no spills on sm_90 at N = 16 with k = 2
    # and with k = K = 4 (8 bytes spilled at BC = 256; tools.triton_aot resources --extra 16:1024:bfloat16)
    return NP, KP, SP, min(_block_c(C, KP, max(KP, SP, NP // KP if NP > KP else 1)), max(16, 4096 // NP),
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
        cdt = _tl(_cdt(X if own else Xa, H, P, V))
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
            ctx.owner = _claim(X if I is not None else Xa, "write", (H, P))
            if not own and (ctx.owner is None or ctx.defer_x):  # a window's carried X_a: its mappings' op adds dX_a
                ctx.xa_owner = _claim_carried(Xa, P)
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
                                    CDT=_tl(_cdt(XorXa, H, P, V)), NEED_DXA=dXa is not None)
        if defer:  # the state's term (Hᵀ·dout on the mixed rows, dout on the others): linear_stats writes it
            # (a separate Xa with I: X's active rows get nothing, X_a's gradient is dXa above)
            _hand_over(ctx.owner, "write", (doutc, Hc if own or I is None else None, Ic, k, not own and I is not None))
        if xa_defer:  # the carried X_a's term: added by the op that made P from it (xhc.kernels.xhc_active)
            _hand_over(ctx.xa_owner, "dxa", doutc if xa_as_dout else dXa)
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


# ================================================================================================
# linear_stats: proj = x·Wᵀ and the per-row sums Σ_c X[t, r, c], Σ_c X[t, r, c]² in one pass over X
# ================================================================================================
@triton.jit
def _linear_stats_fwd_kernel(X, W, PROJ, S1, S2, R, C, d, DP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    D = R * C
    m = tl.arange(0, DP)[:, None]  # output column
    acc = tl.zeros([DP], dtype=CDT)
    for r in range(0, R):
        s1 = tl.zeros([BC], dtype=CDT)
        s2 = tl.zeros([BC], dtype=CDT)
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            cm = c < C
            x = tl.load(X + t * D + r * C + c, mask=cm, other=0.0).to(CDT)  # [BC], read once
            w = tl.load(W + m * D + r * C + c[None, :], mask=(m < d) & cm[None, :], other=0.0).to(CDT)  # [DP, BC]
            acc += tl.sum(w * x[None, :], 1)
            s1 += x
            s2 += x * x
        tl.store(S1 + t * R + r, tl.sum(s1, 0))
        tl.store(S2 + t * R + r, tl.sum(s2, 0))
    mm = tl.arange(0, DP)
    tl.store(PROJ + t * d + mm, acc, mask=mm < d)


@triton.jit
def _linear_stats_dx_kernel(X, W, G, DS1, DS2, DX, R, C, d, DP: tl.constexpr, BC: tl.constexpr, CDT: tl.constexpr):
    """dX[t, r, c] = Σ_m G[t, m]·W[m, rC + c] + dS1[t, r] + 2·dS2[t, r]·X[t, r, c]."""
    t = tl.program_id(0).to(tl.int64)
    D = R * C
    m = tl.arange(0, DP)
    g = tl.load(G + t * d + m, mask=m < d, other=0.0).to(CDT)  # [DP]
    for r in range(0, R):
        ds1 = tl.load(DS1 + t * R + r).to(CDT)
        ds2 = tl.load(DS2 + t * R + r).to(CDT)
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            cm = c < C
            x = tl.load(X + t * D + r * C + c, mask=cm, other=0.0).to(CDT)
            w = tl.load(W + m[:, None] * D + r * C + c[None, :], mask=(m[:, None] < d) & cm[None, :],
                        other=0.0).to(CDT)  # [DP, BC]
            dx = tl.sum(g[:, None] * w, 0) + ds1 + 2.0 * ds2 * x
            tl.store(DX + t * D + r * C + c, _cast(dx, DX), mask=cm)


@triton.jit
def _linear_stats_dw_kernel(X, G, DW, T, D, d, DP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            USE_DOT: tl.constexpr, CDT: tl.constexpr):
    """dW[m, k] = Σ_t G[t, m]·X[t, k]: one program per block of k, a loop over the tokens."""
    k = tl.program_id(0).to(tl.int64) * BK + tl.arange(0, BK)
    km = k < D
    m = tl.arange(0, DP)
    acc = tl.zeros([DP, BK], dtype=CDT)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT).to(tl.int64)
        tm = t < T
        x = tl.load(X + t[:, None] * D + k[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(CDT)  # [BT, BK]
        g = tl.load(G + t[:, None] * d + m[None, :], mask=tm[:, None] & (m[None, :] < d), other=0.0).to(CDT)
        if USE_DOT:  # fp32 in, fp32 out, no TF32: the same precision as the elementwise form
            acc += tl.dot(tl.trans(g), x, input_precision="ieee")
        else:
            acc += tl.sum(g[:, :, None] * x[:, None, :], 0)
    tl.store(DW + m[:, None] * D + k[None, :], acc, mask=(m[:, None] < d) & km[None, :])


def _linear_stats_meta(C: int, d: int):
    DP = max(16, triton.next_power_of_2(int(d)))
    return DP, max(16, min(triton.next_power_of_2(C), 4096 // DP))


class _LinearStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, after):
        R, C = X.shape[-2:]
        d = W.shape[0]
        Xc = X.reshape(-1, R, C).contiguous()
        T = Xc.shape[0]
        cdt = _cdt(X, W)
        Wc = W.to(cdt).contiguous()
        proj = torch.empty(T, d, dtype=cdt, device=X.device)
        s1, s2 = torch.empty(T, R, dtype=cdt, device=X.device), torch.empty(T, R, dtype=cdt, device=X.device)
        DP, BC = _linear_stats_meta(C, d)
        if T > 0:
            _linear_stats_fwd_kernel[(T,)](Xc, Wc, proj, s1, s2, R, C, d, DP=DP, BC=BC, CDT=_tl(cdt))
        ctx.save_for_backward(X, W)
        # the owner of the state's gradient for the read and write that use these outputs (_claim)
        ctx._x_key, ctx._x_rows, ctx._claims, ctx._pending = _state_key(X), (R, C), {}, {}
        # ``after`` (computed from an earlier linear_stats op on the same state): hand dX on to that one
        ctx._owner = None if after is None else _claim(X, "linear", (after,))
        lead = X.shape[:-2]
        return proj.view(*lead, d), s1.view(*lead, R), s2.view(*lead, R)

    @staticmethod
    def backward(ctx, dproj, ds1, ds2):
        X, W = ctx.saved_tensors
        R, C = X.shape[-2:]
        d = W.shape[0]
        Xc = X.reshape(-1, R, C).contiguous()
        T = Xc.shape[0]
        cdt = _cdt(X, W)
        z = lambda *s: torch.zeros(*s, dtype=cdt, device=X.device)  # noqa: E731  (an unused output)
        G = z(T, d) if dproj is None else dproj.reshape(T, d).to(cdt).contiguous()
        dS1 = z(T, R) if ds1 is None else ds1.reshape(T, R).to(cdt).contiguous()
        dS2 = z(T, R) if ds2 is None else ds2.reshape(T, R).to(cdt).contiguous()
        DP, BC = _linear_stats_meta(C, d)
        dX = dW = None
        task = torch._C._current_graph_task_id()
        terms = {slot: v[1] for slot, v in ctx._pending.items() if v[0] == task}
        ctx._pending.clear()
        if ctx.needs_input_grad[0] and ctx._owner is not None:  # an earlier op on this state writes dX
            _hand_over(ctx._owner, "linear", (G, W, dS1, dS2))
        elif ctx.needs_input_grad[0] and ctx._claims:  # this op writes the sublayer's whole dX
            shapes = [v for v in ctx._claims.values() if v is not None]
            N, Cs = shapes[0] if shapes else (R, C)
            dX = _state_grad(Xc, W, G, dS1, dS2, R, N, Cs, terms.get("read"), terms.get("write"), cdt,
                             terms.get("linear"), terms.get("rows")).view(X.shape)
        elif ctx.needs_input_grad[0]:
            dX = torch.empty_like(Xc)
            if T > 0:
                _linear_stats_dx_kernel[(T,)](Xc, W.to(cdt).contiguous(), G, dS1, dS2, dX, R, C, d, DP=DP, BC=BC,
                                              CDT=_tl(cdt))
            dX = dX.view(X.shape)
        if ctx.needs_input_grad[1]:
            D = R * C
            dW = torch.zeros(d, D, dtype=cdt, device=X.device)
            use_dot = cdt == torch.float32
            # the fp32 (IEEE, no tensor-core) dot's working set grows as DP·BT·BK: at most 2¹⁶ per 4 warps
            # (BT first down to 16, then BK, then 8 warps): no spills on sm_90 at Flash-4sub's d = 64 and
            # 128 (DP·BT·BK = 2¹⁷ spilled 376 and 1928 bytes; tools.triton_aot resources)
            BT, BK = (32, 64) if use_dot else (1, 64)
            while DP * BT * BK > 65536 and BT > 16:
                BT //= 2
            while DP * BT * BK > 65536 and BK > 16:
                BK //= 2
            warps = 8 if DP * BT * BK > 65536 else 4
            if T > 0:
                _linear_stats_dw_kernel[(triton.cdiv(D, BK),)](Xc, G, dW, T, D, d, DP=DP, BT=BT, BK=BK,
                                                              USE_DOT=use_dot, CDT=_tl(cdt), num_warps=warps)
            dW = dW.to(W.dtype)
        return dX, dW, None


def linear_stats(X: torch.Tensor, W: torch.Tensor, after: Optional[torch.Tensor] = None):
    """(vec(X)·Wᵀ, Σ_c X_r, Σ_c X_r²) from one pass over ``X`` ``[..., R, C]`` (any float dtype, read as
    it is and accumulated in fp32; float64 stays float64); ``W`` ``[d, R·C]``  ->  ``[..., d]``,
    ``[..., R]``, ``[..., R]``.  Backward: dX in one pass (GEMM term + the statistics' terms), dW
    in one pass over X.  The norm statistics of vec X and of any row subset follow from the sums
    (:func:`xhc.norms.moments_of_rows`).  ``after``: a tensor computed from an earlier
    :func:`linear_stats` of the same state (its statistics): this op's dX term is then written by that
    op's backward (module docstring)."""
    return _LinearStats.apply(X, W, after)


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
        ctx.owner = None if after is None else _claim(X, "rows", (after,))
        return Xa

    @staticmethod
    def backward(ctx, dXa):
        (I,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if ctx.owner is not None:  # dX[I_q] += dX_a[q]: written by the state's linear_stats op
            N, C = ctx.x_shape[-2:]
            k = I.shape[-1]
            _hand_over(ctx.owner, "rows", (dXa.reshape(-1, k, C).contiguous(), I.reshape(-1, k).contiguous()))
            return None, None, None
        dX = torch.zeros(ctx.x_shape, dtype=dXa.dtype, device=dXa.device)
        return dX.scatter_(-2, I.unsqueeze(-1).expand(*I.shape, dX.shape[-1]), dXa), None, None


def gather(X: torch.Tensor, I: torch.Tensor, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """X_a = X[..., I, :] (``I``: k distinct rows per token).  ``after``: a tensor computed from the
    state's :func:`linear_stats` op (the routing weights): the gradient dX_a is then added to X's
    rows by that op's backward instead of a scatter into a zero N·C tensor."""
    return _Gather.apply(X, I, after)


# ================================================================================================
# DeepSeek-V4's Sinkhorn (docs/math.md §2.h): softmax + ε start, column first, + ε denominators
# ================================================================================================
@triton.jit
def _skd_start(Z, T, n, eps, BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    """p = softmax(Z, −1) and M_0 = p + ε on the real entries (0 on the padding)."""
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    mask = (t < T) & (i < n) & (j < n)
    offs = t * n * n + i * n + j
    z = tl.load(Z + offs, mask=mask, other=0.0).to(CDT)
    zm = tl.where(mask, z, float("-inf"))
    zmax = tl.max(zm, 2)[:, :, None]
    zmax = tl.where(zmax == float("-inf"), 0.0, zmax)
    e = tl.where(mask, tl.exp(z - zmax), 0.0)
    p = e / tl.maximum(tl.sum(e, 2), 1e-30)[:, :, None]
    return p, tl.where(mask, p + eps, 0.0), mask, offs


@triton.jit
def _sinkhorn_ds_fwd_kernel(Z, OUT, T, n, iters, eps, BT: tl.constexpr, NP: tl.constexpr, CDT: tl.constexpr):
    p, M, mask, offs = _skd_start(Z, T, n, eps, BT, NP, CDT)
    M = M / (tl.sum(M, 1) + eps)[:, None, :]
    for _ in range(iters - 1):
        M = M / (tl.sum(M, 2) + eps)[:, :, None]
        M = M / (tl.sum(M, 1) + eps)[:, None, :]
    tl.store(OUT + offs, _cast(M, OUT), mask=mask)


@triton.jit
def _skd_step_fwd(M, S, base, k, eps, AXIS: tl.constexpr, NP: tl.constexpr):
    s = tl.sum(M, AXIS)  # [BT, NP]
    tl.store(S + base + k * NP + tl.arange(0, NP)[None, :], s)
    if AXIS == 2:
        return M / (s + eps)[:, :, None]
    return M / (s + eps)[:, None, :]


@triton.jit
def _skd_step_bwd(G, M, S, base, k, eps, mask, AXIS: tl.constexpr, NP: tl.constexpr):
    s = tl.load(S + base + k * NP + tl.arange(0, NP)[None, :])
    if AXIS == 2:
        d = (s + eps)[:, :, None]
        dot = tl.sum(G * M, 2)[:, :, None]
    else:
        d = (s + eps)[:, None, :]
        dot = tl.sum(G * M, 1)[:, None, :]
    return tl.where(mask, (G - dot) / d, 0.0), M * d  # padding kept at 0 (its d is ε)


@triton.jit
def _sinkhorn_ds_bwd_kernel(Z, DH, DZ, S, T, n, iters, eps, NS: tl.constexpr, BT: tl.constexpr,
                            NP: tl.constexpr, CDT: tl.constexpr):
    p, M, mask, offs = _skd_start(Z, T, n, eps, BT, NP, CDT)
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)[:, None]
    base = t * NS * NP  # [BT, 1]
    M = _skd_step_fwd(M, S, base, 0, eps, 1, NP)
    k = 1
    for _ in range(iters - 1):
        M = _skd_step_fwd(M, S, base, k, eps, 2, NP)
        M = _skd_step_fwd(M, S, base, k + 1, eps, 1, NP)
        k += 2
    G = tl.load(DH + offs, mask=mask, other=0.0).to(CDT)
    for _ in range(iters - 1):
        G, M = _skd_step_bwd(G, M, S, base, k - 1, eps, mask, 1, NP)
        G, M = _skd_step_bwd(G, M, S, base, k - 2, eps, mask, 2, NP)
        k -= 2
    G, M = _skd_step_bwd(G, M, S, base, 0, eps, mask, 1, NP)
    dZ = p * (G - tl.sum(G * p, 2)[:, :, None])
    tl.store(DZ + offs, _cast(dZ, DZ), mask=mask)


class _SinkhornDeepseek(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Z, iters, eps):
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        out = torch.empty_like(Zc)
        BT, NP = _sk_block(n), _np2(n)
        grid = (triton.cdiv(T, BT),)
        _sinkhorn_ds_fwd_kernel[grid](Zc, out, T, n, iters, eps, BT=BT, NP=NP, CDT=_tl(Z.dtype))
        ctx.save_for_backward(Z)
        ctx.cfg = (iters, eps)
        return out.view(Z.shape)

    @staticmethod
    def backward(ctx, dH):
        (Z,) = ctx.saved_tensors
        iters, eps = ctx.cfg
        n = Z.shape[-1]
        Zc = Z.reshape(-1, n, n).contiguous()
        T = Zc.shape[0]
        BT, NP = _sk_block(n), _np2(n)
        NS = 2 * iters - 1
        grid = (triton.cdiv(T, BT),)
        S = torch.empty(grid[0] * BT, NS, NP, dtype=Zc.dtype, device=Z.device)
        dZ = torch.empty_like(Zc)
        _sinkhorn_ds_bwd_kernel[grid](Zc, dH.reshape(-1, n, n).to(Zc.dtype).contiguous(), dZ, S, T, n, iters, eps,
                                      NS=NS, BT=BT, NP=NP, CDT=_tl(Z.dtype))
        return dZ.view(Z.shape), None, None


def sinkhorn_deepseek(Z: torch.Tensor, iters: int = 20, eps: float = 1e-6) -> torch.Tensor:
    """DeepSeek-V4's Sinkhorn ``[..., n, n]`` -> fp32 (float64 stays float64); saves only Z
    (:func:`xhc.doubly_stochastic.sinkhorn_deepseek`, backward as its adjoint)."""
    if iters < 1:
        raise ValueError(f"sinkhorn_deepseek iters={iters}: must be >= 1")
    Z = Z if Z.dtype == torch.float64 else Z.float()
    return _SinkhornDeepseek.apply(Z, iters, eps)
