"""The xHC kernels' shared layouts and weight tiles, and the configurations they cover: the fused entry
(:mod:`.xhc_entry`), its backward (:mod:`.xhc_grad`) and a Flash window's mappings (:mod:`.xhc_active`)
lay out the router, pre, res and post GEMM columns the same way (:func:`layout`).

Column layouts (powers of two, so ``tl.dot`` and ``tl.reshape`` apply for N ≤ :data:`MAX_N`, k ≤
:data:`MAX_K`, K ≤ :data:`MAX_COMPONENTS`): entry ``EW = max(16, next power of two ≥ (1 + TM)·NP)``
columns in groups of NP, router logit i at i, pre-map t's logit i at (1 + t)·NP + i (NP = next power of
two ≥ max(N, 4)); active: res ``RA = KP²`` columns (i·KP + q is H_res[i, q], row i·k + q of W_res) then
post ``PA = KP·SP`` columns (j·SP + s is H_post[j, s], row j·K + s of W_post), KP = next power of two
≥ max(k, 4), SP = next power of two ≥ max(K, 4).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xhc.kernels import mhc_common as cm
from xhc.kernels.mhc_common import sig

# The sizes the layouts cover: the fused xHC kernels' limits (larger configurations keep the separate ops)
MAX_N = 16  # streams N (the entry's router and pre-map columns)
MAX_K = 16  # active streams k (the [BT, KP, KP] Sinkhorn and [BT, KP, NP] routing tiles)
MAX_COMPONENTS = 8  # write components K = r + 1 (the post columns)


def entry_covers(cfg, mappings, K=None) -> bool:
    """Whether the fused entry (:mod:`.xhc_entry`) covers ``cfg``: the sigmoid router, N ≤ :data:`MAX_N`,
    k ≤ :data:`MAX_K`, every mapping of ``mappings`` present (None: ablated).  With ``K`` (an xHC
    sublayer's entry, which also makes H_res and H_post): the dense read and K ≤ :data:`MAX_COMPONENTS`;
    without (a Flash window's entry, pre-maps only) no more."""
    covered = (cfg.router == "sigmoid" and cfg.n <= MAX_N and cfg.k <= MAX_K
               and all(w is not None for w in mappings))
    return covered if K is None else covered and cfg.dense_read and K <= MAX_COMPONENTS


def mappings_cover(k: int, K: int) -> bool:
    """Whether a Flash window write's fused mappings (:mod:`.xhc_active`) cover k active streams and K
    components: k ≤ :data:`MAX_K`, K ≤ :data:`MAX_COMPONENTS`."""
    return k <= MAX_K and K <= MAX_COMPONENTS


def layout(n: int, k: int, K: int, TM: int = 1):
    """(NP, EW, KP, SP, RA, PA) for N = n streams, k active, K write components and TM pre-maps (a Flash
    window's entry: 2 or 4, :mod:`.xhc_window`)."""
    NP = cm.np_of(n)
    KP = max(4, triton.next_power_of_2(int(k)))
    SP = max(4, triton.next_power_of_2(int(K)))
    return NP, max(16, triton.next_power_of_2((1 + int(TM)) * NP)), KP, SP, KP * KP, KP * SP


def warps(KP: int) -> int:
    """8 warps from k > 4 on: the [BT, KP, KP] Sinkhorn tiles and [BT, KP, NP] routing tiles then fit
    the registers without spills on sm_90 (``tools.triton_aot resources``)."""
    return 8 if KP >= 8 else 4


# ------------------------------------------------------------------------------------------------
@triton.jit
def _pre_rows(W, mp, kk, km, N, D, CDT: tl.constexpr):
    return tl.load(W + mp.to(tl.int64) * D + kk[None, :], mask=(mp >= 0) & (mp < N) & km, other=0.0).to(CDT)


@triton.jit
def w_entry_tile(WR, WP0, WP1, WP2, WP3, kk, kmask, N, D, NP: tl.constexpr, EW: tl.constexpr, HAS_R: tl.constexpr,
                 TM: tl.constexpr, CDT: tl.constexpr):
    """[W_router; W_pre,0; …; W_pre,TM−1] as ``[EW, BK]`` in the entry layout (pre-map t at rows
    (1 + t)·NP + i), columns ``kk`` of vec X."""
    mr = tl.arange(0, EW)[:, None]
    km = kmask[None, :]
    w = _pre_rows(WP0, mr - NP, kk, km, N, D, CDT)
    if TM > 1:
        w += _pre_rows(WP1, mr - 2 * NP, kk, km, N, D, CDT)
    if TM > 2:
        w += _pre_rows(WP2, mr - 3 * NP, kk, km, N, D, CDT)
    if TM > 3:
        w += _pre_rows(WP3, mr - 4 * NP, kk, km, N, D, CDT)
    if HAS_R:
        w += tl.load(WR + mr.to(tl.int64) * D + kk[None, :], mask=(mr < N) & km, other=0.0).to(CDT)
    return w


@triton.jit
def w_res_act_tile(WRES, j, c, cmask, k, C, KP: tl.constexpr, RA: tl.constexpr, CDT: tl.constexpr):
    """W_res columns of slot ``j`` (``j·C + c``) as ``[RA, BC]`` in the res layout."""
    r = tl.arange(0, RA)[:, None]
    i = r // KP
    q = r % KP
    return tl.load(WRES + (i * k + q).to(tl.int64) * (k * C) + (j * C + c)[None, :],
                   mask=(i < k) & (q < k) & cmask[None, :], other=0.0).to(CDT)


@triton.jit
def w_post_act_tile(WPOST, j, c, cmask, k, K, C, SP: tl.constexpr, PA: tl.constexpr, CDT: tl.constexpr):
    """W_post columns of slot ``j`` as ``[PA, BC]`` in the post layout."""
    r = tl.arange(0, PA)[:, None]
    jj = r // SP
    s = r % SP
    return tl.load(WPOST + (jj * K + s).to(tl.int64) * (k * C) + (j * C + c)[None, :],
                   mask=(jj < k) & (s < K) & cmask[None, :], other=0.0).to(CDT)


@triton.jit
def active_logits(accr, accp, ra, BRES, ARES, BPOST, APOST, tm, k, K, BT: tl.constexpr, KP: tl.constexpr,
                   SP: tl.constexpr, CDT: tl.constexpr):
    """(z_res [BT, KP, KP], mask3, z_post [BT, KP, SP], pmask3) from the active GEMM's outputs."""
    i3 = tl.arange(0, KP)[None, :, None]
    q3 = tl.arange(0, KP)[None, None, :]
    s3 = tl.arange(0, SP)[None, None, :]
    mask3 = tm[:, None, None] & (i3 < k) & (q3 < k)
    pmask3 = tm[:, None, None] & (i3 < k) & (s3 < K)
    ares = tl.load(ARES).to(CDT)
    apost = tl.load(APOST).to(CDT)
    bres = tl.load(BRES + i3 * k + q3, mask=(i3 < k) & (q3 < k), other=0.0).to(CDT)
    bpost = tl.load(BPOST + i3 * K + s3, mask=(i3 < k) & (s3 < K), other=0.0).to(CDT)
    zres = ares * ra[:, None, None] * tl.reshape(accr, [BT, KP, KP]) + bres
    zpost = apost * ra[:, None, None] * tl.reshape(accp, [BT, KP, SP]) + bpost
    return zres, mask3, zpost, pmask3


@triton.jit
def post_adjoint(zpost, pmask3, p, DHPOST, DPW, t, k, K, HAS_DHPOST: tl.constexpr, HAS_DPW: tl.constexpr,
                 BT: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, CDT: tl.constexpr):
    """(dz_post ``[BT, KP, SP]``, dp ``[BT, KP]``) of H_post = 2σ(z_post) and P = diag(p)·H_post, from the
    gradients dH_post and dP (each optional)."""
    i3 = tl.arange(0, KP)[None, :, None]
    s3 = tl.arange(0, SP)[None, None, :]
    sp = sig(zpost)
    dhpost = tl.zeros([BT, KP, SP], dtype=CDT)
    dp = tl.zeros([BT, KP], dtype=CDT)
    if HAS_DHPOST:
        dhpost += tl.load(DHPOST + t[:, None, None] * k * K + i3 * K + s3, mask=pmask3, other=0.0).to(CDT)
    if HAS_DPW:  # P = diag(p)·H_post
        dpw = tl.load(DPW + t[:, None, None] * k * K + i3 * K + s3, mask=pmask3, other=0.0).to(CDT)
        dhpost += p[:, :, None] * dpw
        dp += tl.sum(dpw * 2.0 * sp, 2)
    return tl.where(pmask3, dhpost * 2.0 * sp * (1.0 - sp), 0.0), dp
