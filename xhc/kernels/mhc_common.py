"""Shared pieces of the fused mHC kernels (:mod:`.mhc_pre`, :mod:`.mhc_post`, :mod:`.mhc_grad`).

Column layout of the coefficient GEMM in the fused kernels: two groups, each a power of two wide so
that ``tl.dot`` and ``tl.reshape`` apply for every N from 2 to 16 —

* **res**, ``RP = NP²`` columns: column ``i·NP + j`` is the logit of H_res[i, j] (row ``i·N + j`` of
  ``W_res``); padded rows/columns (i or j ≥ N) are zero;
* **pp**, ``PP = max(16, 2·NP)`` columns: column ``j`` is the pre logit j, column ``NP + j`` the post
  logit j.

``NP`` = next power of two ≥ max(N, 4) (so RP ≥ 16).  The per-token buffers the kernels hand each
other (``DP`` the GEMM's gradient, ``DZ`` the logits' gradient) use the same ``[T, RP + PP]`` layout.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from xhc.kernels.runtime import interpreting


def covers(cfg, training: bool, groups: bool) -> bool:
    """Whether the fused mHC read and write (:mod:`.mhc_pre`, :mod:`.mhc_post`) cover ``cfg``: dynamic
    ``mhc`` with every mapping group (``groups``), without the option they leave out (residual-logit
    dropout while ``training``)."""
    return (cfg.variant == "mhc" and cfg.dynamic and groups
            and not (training and cfg.res_logit_dropout > 0))


def np_of(n: int) -> int:
    return max(4, triton.next_power_of_2(int(n)))


def groups(n: int):
    """(NP, RP, PP) for N = n."""
    NP = np_of(n)
    return NP, NP * NP, max(16, 2 * NP)


def dot_ok(cdt: torch.dtype) -> bool:
    """``tl.dot`` for fp32 compute (float64 reference tests use broadcast sums)."""
    return cdt == torch.float32


def dot_precision() -> str:
    """fp32 products on tensor cores with three TF32 passes (about fp32 accuracy) on the GPU; exact
    fp32 in the interpreter."""
    return "ieee" if interpreting() else "tf32x3"


TUNED_FILE = os.path.join(os.path.dirname(__file__), "tuned_blocks.json")

DEFAULT_BLOCKS = {
    # kernel -> block sizes; a shape key "N<n>_C<c>" in tuned_blocks.json overrides them
    "mhc_pre_fwd": {"BT": 16, "BK": 32},
    "mhc_pre_bwd": {"BT": 16},
    "mhc_post_fwd": {"BT": 16},
    "mhc_post_bwd": {"BT": 16},
    "mhc_dx": {"BT": 16},
    "mhc_dw": {"BT": 32, "BK": 64, "S": 8},
    "mhc_dw_reduce": {"BK": 64},
    "xhc_entry_fwd": {"BT": 16, "BK": 32},
    "xhc_entry_bwd": {"BT": 16},
    "xhc_dx": {"BT": 16},
    "xhc_dw": {"BT": 32, "BK": 64, "S": 8},
    "xhc_dw_reduce": {"BK": 64},
    "xhc_active": {"BT": 16},
}


OVERRIDE: dict = {}
"""kernel -> block sizes that win over everything else (``bench.hc_kernels --autotune`` sets it while it times)."""

# the grid ``bench.hc_kernels --autotune`` times, per kernel
TUNE_GRID = {
    "mhc_pre_fwd": [{"BT": 16, "BK": 32}, {"BT": 16, "BK": 64}, {"BT": 32, "BK": 32}, {"BT": 32, "BK": 64}],
    "mhc_pre_bwd": [{"BT": 4}, {"BT": 8}, {"BT": 16}, {"BT": 32}],
    "mhc_post_fwd": [{"BT": 2}, {"BT": 4}, {"BT": 8}, {"BT": 16}],
    "mhc_post_bwd": [{"BT": 2}, {"BT": 4}, {"BT": 8}, {"BT": 16}],
    "mhc_dx": [{"BT": 16}, {"BT": 32}, {"BT": 64}],
    "mhc_dw": [{"BT": 32, "BK": 64, "S": 8}, {"BT": 64, "BK": 64, "S": 8}, {"BT": 32, "BK": 32, "S": 16},
               {"BT": 32, "BK": 64, "S": 32}],
    "mhc_dw_reduce": [{"BK": 32}, {"BK": 64}, {"BK": 128}],
    # the fused xHC sublayer (xhc_entry, xhc_grad); xhc_dw's BK and BT are clamped to its register budget
    "xhc_entry_fwd": [{"BT": 16, "BK": 32}, {"BT": 16, "BK": 64}, {"BT": 8, "BK": 32}, {"BT": 32, "BK": 32}],
    "xhc_entry_bwd": [{"BT": 8}, {"BT": 16}, {"BT": 32}],
    "xhc_dx": [{"BT": 8}, {"BT": 16}, {"BT": 32}],
    "xhc_dw": [{"BT": 32, "BK": 64, "S": 8}, {"BT": 32, "BK": 64, "S": 16}, {"BT": 32, "BK": 32, "S": 32}],
    "xhc_dw_reduce": [{"BK": 32}, {"BK": 64}, {"BK": 128}],
    "xhc_active": [{"BT": 8}, {"BT": 16}, {"BT": 32}],  # a Flash write's mappings (xhc_active; its BC is bounded)
}
KERNEL_OF = {  # tuning key -> the Triton kernel it sizes
    "mhc_pre_fwd": "_mhc_pre_fwd_kernel", "mhc_pre_bwd": "_mhc_pre_bwd_kernel",
    "mhc_post_fwd": "_mhc_post_fwd_kernel", "mhc_post_bwd": "_mhc_post_bwd_kernel", "mhc_dx": "_mhc_dx_kernel",
    "mhc_dw": "_mhc_dw_kernel", "mhc_dw_reduce": "_mhc_dw_reduce_kernel",
    "xhc_entry_fwd": "_xhc_entry_fwd_kernel", "xhc_entry_bwd": "_xhc_entry_bwd_kernel", "xhc_dx": "_xhc_dx_kernel",
    "xhc_dw": "_xhc_dw_kernel", "xhc_dw_reduce": "_xhc_dw_reduce_kernel",
    "xhc_active": "_xhc_active_fwd_kernel",
}


@lru_cache(maxsize=None)
def _tuned() -> dict:
    try:
        with open(TUNED_FILE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def blocks(kernel: str, n: int, C: int, override: dict = None) -> dict:
    """Block sizes of ``kernel`` at (N, C): :data:`DEFAULT_BLOCKS`, then the committed
    ``tuned_blocks.json`` entry for the shape when there is one, then ``override`` (autotuning)."""
    out = dict(DEFAULT_BLOCKS[kernel])
    RP = np_of(n) ** 2
    if kernel == "mhc_dw":  # two [RP + PP, BK] fp32 accumulators: keep them in registers (sm_90: no spills)
        out["BK"] = min(out["BK"], max(16, 2048 // RP))
        out["BT"] = min(out["BT"], max(16, 4096 // RP))
    if kernel == "mhc_pre_bwd":  # several [BT, NP, NP] tensors live through the Sinkhorn adjoint
        out["BT"] = min(out["BT"], max(2, 1024 // RP))
    out.update(_tuned().get(kernel, {}).get(f"N{n}_C{C}", {}))
    out.update(OVERRIDE.get(kernel, {}))
    if override:
        out.update(override.get(kernel, {}))
    return out


def block_c(BT: int, NP: int, C: int, budget: int = 4096) -> int:
    """Width of a C block so that a ``[BT, NP, BC]`` tile holds about ``budget`` elements."""
    return max(16, min(triton.next_power_of_2(int(C)), budget // (BT * NP)))


# ------------------------------------------------------------------------------------------------
@triton.jit
def w_res_tile(WRES, G, k, kmask, N, D, NP: tl.constexpr, RP: tl.constexpr, HAS_G: tl.constexpr, CDT: tl.constexpr):
    """W'_res = W_res ⊙ g as ``[RP, BK]`` in the res-group layout, columns ``k`` (``[BK]``) of the flat state."""
    mr = tl.arange(0, RP)[:, None]
    i = mr // NP
    j = mr % NP
    m = (i < N) & (j < N)
    w = tl.load(WRES + (i * N + j).to(tl.int64) * D + k[None, :], mask=m & kmask[None, :], other=0.0).to(CDT)
    if HAS_G:
        w = w * tl.load(G + k, mask=kmask, other=0.0).to(CDT)[None, :]
    return w


@triton.jit
def w_pp_tile(WPRE, WPOST, G, k, kmask, N, D, NP: tl.constexpr, PP: tl.constexpr, HAS_G: tl.constexpr,
              CDT: tl.constexpr):
    """W'_pre and W'_post as ``[PP, BK]`` in the pp-group layout."""
    mr = tl.arange(0, PP)[:, None]
    km = kmask[None, :]
    kk = k[None, :]
    wa = tl.load(WPRE + mr.to(tl.int64) * D + kk, mask=(mr < N) & km, other=0.0).to(CDT)
    mp = mr - NP
    wb = tl.load(WPOST + mp.to(tl.int64) * D + kk, mask=(mp >= 0) & (mp < N) & km, other=0.0).to(CDT)
    w = wa + wb
    if HAS_G:
        w = w * tl.load(G + k, mask=kmask, other=0.0).to(CDT)[None, :]
    return w


@triton.jit
def sig(z):
    """σ(z) = 1 / (1 + e^−z)."""
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def mm(a, b, USE_DOT: tl.constexpr, PREC: tl.constexpr):
    """a ``[M, K]`` @ b ``[K, N]``: ``tl.dot`` (fp32 accumulate) or a broadcast sum (float64)."""
    if USE_DOT:
        return tl.dot(a, b, input_precision=PREC)
    else:
        return tl.sum(a[:, :, None] * b[None, :, :], 1)


@triton.jit
def pick(v, col, NP: tl.constexpr, OFF: tl.constexpr):
    """``v[:, OFF + j]`` for j < NP as ``[BT, NP]`` (v ``[BT, PP]``, col its column index ``[PP]``)."""
    jj = tl.arange(0, NP)
    sel = col[None, None, :] == (OFF + jj)[None, :, None]
    return tl.sum(tl.where(sel, v[:, None, :], 0.0), 2)


@triton.jit
def pick_group(v, g: tl.constexpr, G: tl.constexpr, NP: tl.constexpr):
    """``v[:, g·NP + j]`` for j < NP as ``[B, NP]`` (v ``[B, G·NP]``): :func:`pick` of an aligned group through a
    ``[B, G, NP]`` view, G times fewer values than pick's ``[B, NP, G·NP]`` tile."""
    v3 = tl.reshape(v, [v.shape[0], G, NP])
    return tl.sum(tl.where(tl.arange(0, G)[None, :, None] == g, v3, 0.0), 1)


@triton.jit
def place_group(a, g: tl.constexpr, G: tl.constexpr, NP: tl.constexpr):
    """``[B, G·NP]`` with ``a`` ``[B, NP]`` at columns g·NP + j, zero elsewhere: the inverse of :func:`pick_group`."""
    a3 = tl.where(tl.arange(0, G)[None, :, None] == g, a[:, None, :], 0.0)
    return tl.reshape(a3, [a.shape[0], G * NP])


@triton.jit
def place(a, col, NP: tl.constexpr, OFF: tl.constexpr):
    """``[BT, PP]`` with ``a`` ``[BT, NP]`` at columns ``OFF + j`` (zero elsewhere): the inverse of :func:`pick`."""
    jj = tl.arange(0, NP)
    sel = col[None, None, :] == (OFF + jj)[None, :, None]
    return tl.sum(tl.where(sel, a[:, :, None], 0.0), 1)


# ------------------------------------------------------------------------------------------------
# Split dW of two column groups (the mHC backward's res | pre-post, the xHC entry's res | post): token
# splits accumulate partials, one reduction sums them in a fixed order (deterministic, no atomics)
# ------------------------------------------------------------------------------------------------
@triton.jit
def dw_pair_add(G, W, t, tm, x, acc_a, acc_b, A: tl.constexpr, B: tl.constexpr, USE_DOT: tl.constexpr,
                PREC: tl.constexpr, CDT: tl.constexpr):
    """One token block: acc_a += G[t, :A]ᵀ·x, acc_b += G[t, A:A + B]ᵀ·x (``G`` ``[T, W]``, ``x`` ``[BT, BK]``)."""
    ca = tl.arange(0, A)
    cb = tl.arange(0, B)
    ga = tl.load(G + t[:, None] * W + ca[None, :], mask=tm[:, None], other=0.0).to(CDT)
    gb = tl.load(G + t[:, None] * W + A + cb[None, :], mask=tm[:, None], other=0.0).to(CDT)
    acc_a += mm(tl.trans(ga), x, USE_DOT, PREC)
    acc_b += mm(tl.trans(gb), x, USE_DOT, PREC)
    return acc_a, acc_b


@triton.jit
def dw_pair_store(base, acc_a, acc_b, kk, km, L, A: tl.constexpr, B: tl.constexpr):
    """A split's partial ``[A + B, L]`` at ``base``, columns ``kk``."""
    ca = tl.arange(0, A)
    cb = tl.arange(0, B)
    tl.store(base + ca[:, None] * L + kk[None, :], acc_a, mask=km[None, :])
    tl.store(base + (A + cb[:, None]) * L + kk[None, :], acc_b, mask=km[None, :])


@triton.jit
def dw_pair_sum(PART, S, kk, km, L, A: tl.constexpr, B: tl.constexpr, BK: tl.constexpr, CDT: tl.constexpr):
    """(dW_a ``[A, BK]``, dW_b ``[B, BK]``): the S splits' partials summed in a fixed order."""
    ca = tl.arange(0, A)
    cb = tl.arange(0, B)
    acc_a = tl.zeros([A, BK], dtype=CDT)
    acc_b = tl.zeros([B, BK], dtype=CDT)
    for s in range(0, S):
        base = PART + s * (A + B) * L
        acc_a += tl.load(base + ca[:, None] * L + kk[None, :], mask=km[None, :], other=0.0).to(CDT)
        acc_b += tl.load(base + (A + cb[:, None]) * L + kk[None, :], mask=km[None, :], other=0.0).to(CDT)
    return acc_a, acc_b
