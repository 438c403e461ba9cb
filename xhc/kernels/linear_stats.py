"""The coefficient GEMM with the state's statistics (the ``triton`` backend's
:func:`xhc.kernels.norm_linear`, :func:`xhc.kernels.linear_moment`, :func:`xhc.kernels.stream_moments`;
docs/kernels.md): vec(X)·Wᵀ with X's row sums and sums of squares in one pass;  backward: dX (and
every term deferred to it, :mod:`.state_grad`) in one pass, dW in one pass.  Its op owns the state's
gradient: it registers in :data:`xhc.kernels.state_grad.OWNER_CLASSES`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from xhc.kernels import state_grad as sg
from xhc.kernels.common import cast, compute_dtype, tl_dtype


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
            tl.store(DX + t * D + r * C + c, cast(dx, DX), mask=cm)


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
        cdt = compute_dtype(X, W)
        Wc = W.to(cdt).contiguous()
        proj = torch.empty(T, d, dtype=cdt, device=X.device)
        s1, s2 = torch.empty(T, R, dtype=cdt, device=X.device), torch.empty(T, R, dtype=cdt, device=X.device)
        DP, BC = _linear_stats_meta(C, d)
        if T > 0:
            _linear_stats_fwd_kernel[(T,)](Xc, Wc, proj, s1, s2, R, C, d, DP=DP, BC=BC, CDT=tl_dtype(cdt))
        ctx.save_for_backward(X, W)
        # the owner of the state's gradient for the read and write that use these outputs (_claim)
        ctx._x_key, ctx._x_rows, ctx._claims, ctx._pending = sg.state_key(X), (R, C), {}, {}
        # ``after`` (computed from an earlier linear_stats op on the same state): hand dX on to that one
        ctx._owner = None if after is None else sg.claim(X, "linear", (after,))
        lead = X.shape[:-2]
        return proj.view(*lead, d), s1.view(*lead, R), s2.view(*lead, R)

    @staticmethod
    def backward(ctx, dproj, ds1, ds2):
        X, W = ctx.saved_tensors
        R, C = X.shape[-2:]
        d = W.shape[0]
        Xc = X.reshape(-1, R, C).contiguous()
        T = Xc.shape[0]
        cdt = compute_dtype(X, W)
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
            sg.hand_over(ctx._owner, "linear", (G, W, dS1, dS2))
        elif ctx.needs_input_grad[0] and ctx._claims:  # this op writes the sublayer's whole dX
            shapes = [v for v in ctx._claims.values() if v is not None]
            N, Cs = shapes[0] if shapes else (R, C)
            dX = sg.state_grad(Xc, W, G, dS1, dS2, R, N, Cs, terms.get("read"), terms.get("write"), cdt,
                             terms.get("linear"), terms.get("rows")).view(X.shape)
        elif ctx.needs_input_grad[0]:
            dX = torch.empty_like(Xc)
            if T > 0:
                _linear_stats_dx_kernel[(T,)](Xc, W.to(cdt).contiguous(), G, dS1, dS2, dX, R, C, d, DP=DP, BC=BC,
                                              CDT=tl_dtype(cdt))
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
                                                              USE_DOT=use_dot, CDT=tl_dtype(cdt), num_warps=warps)
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




sg.OWNER_CLASSES.append(_LinearStats._backward_cls)
