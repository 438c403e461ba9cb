"""One write of the state's gradient per sublayer (docs/kernels.md): the registry of the ops that own
a state's gradient, the claim and hand-over protocol, and the one-pass dX kernel.

A sublayer reads its state X three times:
the coefficient GEMM (:func:`xhc.kernels.linear_stats.linear_stats`, the first), the read and the write.  Left to
autograd, each op writes its own N·C gradient of X and autograd adds them (two extra N·C tensors
written and read back).  Here the read and the write *defer* their X-gradient term to the sublayer's
owner op on the same X (a ``linear_stats`` op, or the fused xHC entry): in the forward they find it
among the ancestors of their coefficients (h for the read, H or P for the write; :func:`claim`), in
the backward they compute only their coefficient gradients and hand (h, du) or (dout, H, I) to it
(:func:`hand_over`), and its backward writes dX = GEMM term + statistics terms + read term + write term
in one pass (:func:`state_grad`).  The order is safe by construction: the coefficients are computed
from that op's outputs, so autograd runs its backward after theirs.  Where no such op is found (a
static mapping, coefficients computed elsewhere) the ops return their dX to autograd as before.

An owner registers its backward-node class in :data:`OWNER_CLASSES` (a Flash window's carried X_a:
:data:`XA_OWNER_CLASSES`) when its module is imported; this module imports none of them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xhc.kernels.common import cast, np2, tl_dtype


# ================================================================================================
# The owners and the claim
# ================================================================================================
_OWNER_SEARCH = 256  # autograd nodes visited at most when looking for the state's linear_stats op
OWNER_CLASSES: list = []
"""The backward-node classes that own a state's gradient (:mod:`xhc.kernels.linear_stats`, the fused
xHC entry :mod:`xhc.kernels.xhc_entry`): they carry ``_x_key``, ``_x_rows``, ``_claims``, ``_pending``
and ``_owner``, and write the whole dX with the handed-over terms."""


def state_key(X: torch.Tensor):
    """What identifies a state across views of it: its memory, size, dtype and in-place version.
    None for a state that needs no gradient (inference tensors have no version counter at all)."""
    if not X.requires_grad or X.is_inference() or not X.is_contiguous():
        return None
    return (X.data_ptr(), X.numel(), X.dtype, X.device, X._version)


def claim(X: Optional[torch.Tensor], slot: str, coefs) -> Optional[object]:
    """The backward node of the :func:`linear_stats` op that first read the state ``X`` (``[..., N, C]``)
    among the ancestors of ``coefs``, with its ``slot`` ("read" / "write") taken for this op; None when
    there is none (the op then writes its own dX).  Called in the forward of the deferring op."""
    if X is None or not X.requires_grad:  # (inside a Function's forward grad mode is always off)
        return None
    key = state_key(X)
    if key is None:
        return None
    stop = {id(X.grad_fn)} if X.grad_fn is not None else set()  # the state's own history is not searched
    base = X._base
    if base is not None and base.grad_fn is not None:
        stop.add(id(base.grad_fn))
    owner_cls = tuple(OWNER_CLASSES)
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


def claim_carried(Xa: Optional[torch.Tensor], P: Optional[torch.Tensor]) -> Optional[object]:
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
    key = state_key(Xa)
    if key is None or not isinstance(node, tuple(XA_OWNER_CLASSES)) or getattr(node, "_xa_key", None) != key:
        return None
    if "dxa" in node._claims:
        return None
    node._claims["dxa"] = True
    return node


def hand_over(owner, slot: str, terms) -> None:
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
        tl.store(DX + t * D + jr * C + c, cast(acc, DX), mask=msk)


def state_grad(X, W, G, dS1, dS2, R, N, C, read, write, cdt, linear=None, rows=None) -> torch.Tensor:
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
    NP = np2(N)
    hr, du = read if read is not None else (None, None)
    RR = 1 if hr is None else hr.shape[1]
    dout, hw, Iw, k, zero_active = write if write is not None else (None, None, None, N, False)
    KP = NP if Iw is None else np2(k)
    dxa, Ia = rows if rows is not None else (None, None)
    ka = 1 if Ia is None else Ia.shape[1]
    KAP = np2(ka)
    RP = np2(RR)
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
                                 NP=NP, KP=KP, KAP=KAP, RP=RP, BM=BM, BC=BC, CDT=tl_dtype(cdt))
    return dX
