"""Cost accounting for hyper connections: parameters, training FLOPs, memory traffic (docs/math.md §5).

Everything here is arithmetic on a :class:`~xhc.config.HCConfig` and the backbone width C.
Nothing builds a module or touches torch, so the numbers can be checked against docs/math.md and the
papers by hand.

=============================================  =================================================
function                                       what it counts (docs/math.md §)
=============================================  =================================================
:func:`hc_params_per_sublayer`                 HC / mHC family / xHC, one wrapped sublayer
                                               (§2.0, §2.a–§2.e, §3.1)
:func:`hc_params_per_layer`                    attention + MLP (Flash: one window, §4.1)
:func:`hc_params_per_window`                   one grouping window (Flash: 1 layer, 4sub: 2)
:func:`hc_params_flash4_layers`                the two layers of a Flash-4sub window (§4.2)
:func:`hc_params_total`                        a whole model, readout or learned head included (§1.6, §4.3)
:func:`dominant_coeff_per_window`              the coefficient of C (§5.1, §4.3)
:func:`dominant_params_per_layer`              that coefficient · C per layer
:func:`training_flops_per_token`               F_HC = 6·P·L plus the listed extra terms (§5.2)
:func:`memory_traffic_per_sublayer`            row-by-row traffic tables in units of C (§5.3)
:func:`memory_traffic_flash_layer`             the xHC-Flash per-layer table (§5.3)
:func:`memory_traffic_flash4_window`           the Flash-4sub per-window table (§5.3)
:func:`memory_traffic_summary`                 amortised traffic per sublayer for any variant
:class:`BackboneShape`, :func:`backbone_params`,  the vanilla backbone: parameters and F_vanilla
:func:`vanilla_flops_per_token`                (§6.1, §8 #30)
=============================================  =================================================

Counting conventions
--------------------
* A parameter count is split by role (:class:`ParamCount`): GEMM projection weights (``matrix``),
  temporal conv kernels (``conv``), mapping-norm gains (``norm_gain``), biases / static logits
  (``bias``), scalar gates (``gate``) and the softmax readout (``readout``).  ``matrix + conv`` is
  exactly the "dominant" count, the coefficient of C (§5.1); ``total`` equals the
  ``numel`` of the real modules.
* Training FLOPs follow [xHC] App. C: F_HC = 6 · (matrix + conv) · L per token (§5.2).  The
  Sinkhorn iterations, element-wise read / mix / write, norm statistics and Gram–Schmidt are
  derived here and listed separately; they are not part of F_HC.
* Memory traffic counts elements read and written per token in the forward pass to maintain the
  residual streams, amortised per sublayer; only C-proportional terms are summed (§5.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

from xhc.config import MHC_FAMILY, XHC_FAMILY, HCConfig

__all__ = [
    "ParamCount", "hc_params_per_sublayer", "hc_params_per_layer", "hc_params_per_window",
    "hc_params_total", "hc_params_flash4_layers", "readout_params", "head_params", "sinkhorn_deepseek_flops",
    "window_layers", "dominant_coeff_per_window",
    "dominant_coeff_per_layer", "dominant_params_per_layer",
    "FlopsBreakdown", "training_flops_per_token", "sinkhorn_flops",
    "TrafficRow", "TrafficTable", "TrafficSummary", "memory_traffic_per_sublayer",
    "memory_traffic_flash_layer", "memory_traffic_flash4_window", "memory_traffic_summary",
    "FLASH4_TRAFFIC_REPORTED",
    "BackboneShape", "BackboneParams", "backbone_params", "FLOPS_CONVENTIONS",
    "vanilla_flops_per_token", "AccountingError",
]


class AccountingError(ValueError):
    """The accounting has no formula for this configuration (message names the field)."""


# ================================================================================================
# Parameters (docs/math.md §2.0, §2.a, §3.1, §4.1–§4.3, §5.1)
# ================================================================================================
@dataclass(frozen=True)
class ParamCount:
    """Trainable hyper-connection parameters, split by role.

    ``matrix + conv`` is the dominant count (§5.1: "projection GEMMs plus conv kernels");
    ``total`` adds the small terms and equals the modules' ``numel``.
    """

    matrix: int = 0     # projection weights W (GEMM operands): the C-proportional GEMM terms
    conv: int = 0       # temporal depthwise conv kernels, Σκ·C per MLP sublayer (xHC)
    norm_gain: int = 0  # mapping RMSNorm gain γ ∈ R^{N·C} (mapping_norm_affine, [PEFT] parity)
    bias: int = 0       # biases b_g / static logits (mHC family), static coefficients (HC)
    gate: int = 0       # scalar gates α_g (HC: s_α, s_β)
    readout: int = 0    # softmax readout logits at the exit (reduction="softmax"), once per model

    def __add__(self, other: "ParamCount") -> "ParamCount":
        return ParamCount(*(a + b for a, b in zip(self._fields(), other._fields())))

    def scale(self, factor: int) -> "ParamCount":
        return ParamCount(*(factor * a for a in self._fields()))

    def _fields(self) -> Tuple[int, ...]:
        return (self.matrix, self.conv, self.norm_gain, self.bias, self.gate, self.readout)

    @property
    def dominant(self) -> int:
        """GEMM weights plus conv kernels: the count that F_HC = 6·P·L uses (§5.2)."""
        return self.matrix + self.conv

    @property
    def small(self) -> int:
        """Everything that is not a GEMM weight, a conv kernel or a norm gain."""
        return self.bias + self.gate + self.readout

    @property
    def total(self) -> int:
        return sum(self._fields())


_ZERO = ParamCount()


def _kernel_sizes(cfg: HCConfig) -> Tuple[int, ...]:
    return tuple(cfg.kernel_sizes)


def _xhc_components(cfg: HCConfig, is_mlp: bool) -> int:
    """K of a sublayer: r + 1 write-back components after MLPs (and after attention when
    ``attn_temporal``), 1 otherwise (§3.1, §3.2)."""
    if is_mlp or cfg.attn_temporal:
        return len(_kernel_sizes(cfg)) + 1
    return 1


def _hc_params(cfg: HCConfig, C: int) -> ParamCount:
    """[HC] per sublayer (§2.a).

    Static: a_pre (N), S_res (N²), a_post (N).  Dynamic adds w_pre ∈ R^C, W_r ∈ R^{C×N},
    w_post ∈ R^C and the gates s_α (shared by pre and res) and s_β (post):
    C·(N + 2) + N² + 2N + 2.  An ablated mapping drops its static part, its projection and,
    once no mapping uses it, its gate.  HC's per-stream LayerNorm has no affine, so
    ``mapping_norm_affine`` (a gain on the flat RMSNorm, §1.5) adds nothing here.
    """
    N = cfg.n
    pre, res, post = not cfg.ablate_pre, not cfg.ablate_res, not cfg.ablate_post
    bias = N * pre + N * N * res + N * post
    if not cfg.dynamic:
        return ParamCount(bias=bias)
    matrix = C * pre + C * N * res + C * post
    gate = int(pre or res) + int(post)
    return ParamCount(matrix=matrix, bias=bias, gate=gate)


def _mhc_family_params(cfg: HCConfig, C: int) -> ParamCount:
    """mHC / mHC-lite / KromHC / identity per sublayer (§2.0).

    Groups pre (N), post (N), res (R = ``cfg.num_res_logits``).  Static: 2N + R logits.
    Dynamic: N·C·(2N + R) + (2N + R) + G, G = one gate per group with logits (3, or 2 for
    identity), plus N·C with ``mapping_norm_affine``.  An ablated group drops its columns,
    bias and gate.
    """
    N, C_ = cfg.n, C
    dims = [d for d, off in ((N, cfg.ablate_pre), (N, cfg.ablate_post), (cfg.num_res_logits, False))
            if not off and d > 0]
    d_out = sum(dims)
    if not cfg.dynamic:
        return ParamCount(bias=d_out)
    norm_gain = N * C_ if cfg.mapping_norm_affine else 0
    return ParamCount(matrix=N * C_ * d_out, bias=d_out, gate=len(dims), norm_gain=norm_gain)


def _xhc_read_params(cfg: HCConfig, C: int) -> ParamCount:
    """Dense read h_pre (§3.4): W_pre ∈ R^{N·C×N}, b_pre ∈ R^N, α_pre.

    With ``dense_read=False`` (ablation, §7.1) the read sees only the k active streams:
    W_pre ∈ R^{k·C×k}, b_pre ∈ R^k, α_pre.  ``ablate_pre``: none.
    """
    if cfg.ablate_pre:  # h_pre ≡ 1/n, no parameters
        return _ZERO
    width = cfg.n if cfg.dense_read else cfg.k
    return ParamCount(matrix=width * C * width, bias=width, gate=1)


def _xhc_router_params(cfg: HCConfig, C: int) -> ParamCount:
    """Router W_router ∈ R^{N·C×N}, no bias, no gate (§3.1, §8 #16); absent when k = m (every
    active stream is fixed, nothing is routed)."""
    return ParamCount(matrix=cfg.n * C * cfg.n if cfg.k > cfg.m else 0)


def _xhc_res_params(cfg: HCConfig, C: int) -> ParamCount:
    """Active residual mixing: W_res ∈ R^{k·C×k²}, b_res ∈ R^{k²}, α_res (§3.1); none with
    ``ablate_res`` (H_res ≡ I_k)."""
    if cfg.ablate_res:
        return _ZERO
    k = cfg.k
    return ParamCount(matrix=k * C * k * k, bias=k * k, gate=1)


def _xhc_post_params(cfg: HCConfig, C: int, K: int) -> ParamCount:
    """Write-back: W_post ∈ R^{k·C×k·K}, b_post ∈ R^{k·K}, α_post (§3.1); none with
    ``ablate_post`` (H_post ≡ 1)."""
    if cfg.ablate_post:
        return _ZERO
    k = cfg.k
    return ParamCount(matrix=k * C * k * K, bias=k * K, gate=1)


def _conv_params(cfg: HCConfig, C: int) -> ParamCount:
    """Temporal convs: one κ_j × C kernel per j, no bias (§3.1, §3.2)."""
    return ParamCount(conv=sum(_kernel_sizes(cfg)) * C)


def _xhc_sublayer_params(cfg: HCConfig, C: int, is_mlp: bool) -> ParamCount:
    """Full xHC, one sublayer (§3.1 table): router + pre + res + post (+ convs)."""
    K = _xhc_components(cfg, is_mlp)
    p = _xhc_router_params(cfg, C) + _xhc_read_params(cfg, C) + _xhc_res_params(cfg, C) \
        + _xhc_post_params(cfg, C, K)
    if K > 1:
        p = p + _conv_params(cfg, C)
    return p


def _flash_sublayer_params(cfg: HCConfig, C: int, is_mlp: bool) -> ParamCount:
    """xHC-Flash attributed to sublayers (§4.1): the attention sublayer owns the shared router,
    its pre-mapping and H_post^A (no H_res); the MLP sublayer owns its pre-mapping (generated at
    window entry), H_res^M, H_post^M and the convs.  With ``attn_temporal`` the attention
    sublayer has K_A = r + 1 components and its own convs."""
    K = _xhc_components(cfg, is_mlp)
    p = _xhc_read_params(cfg, C) + _xhc_post_params(cfg, C, K) + (_conv_params(cfg, C) if K > 1 else _ZERO)
    if is_mlp:
        return p + _xhc_res_params(cfg, C)
    return p + _xhc_router_params(cfg, C)


def _flash4_layer_params(cfg: HCConfig, C: int, second: bool) -> ParamCount:
    """One layer of a Flash-4sub window (§4.2).

    First layer (2g): the window entry's router and four pre-mappings, H_post^{A1}, H_post^{M1}
    and M1's convs.  Second layer (2g+1): H_post^{A2}, H_res^{M2}, H_post^{M2} and M2's convs.
    """
    K_A, K_M = _xhc_components(cfg, False), _xhc_components(cfg, True)
    sublayers = _xhc_post_params(cfg, C, K_A) + _xhc_post_params(cfg, C, K_M) + _conv_params(cfg, C)
    if K_A > 1:
        sublayers = sublayers + _conv_params(cfg, C)
    if second:
        return sublayers + _xhc_res_params(cfg, C)
    return sublayers + _xhc_router_params(cfg, C) + _xhc_read_params(cfg, C).scale(4)


def hc_params_flash4_layers(cfg: HCConfig, C: int) -> Tuple[ParamCount, ParamCount]:
    """(first layer, second layer) of a Flash-4sub window; their sum is the window (§4.2)."""
    return _flash4_layer_params(cfg, C, False), _flash4_layer_params(cfg, C, True)


def _check_xhc(cfg: HCConfig) -> None:
    """xHC is dynamic only and has no mapping-norm gain (the modules reject these too)."""
    if cfg.is_xhc and not cfg.dynamic:
        raise AccountingError("HCConfig.dynamic=False is not defined for xHC; set dynamic: true")
    if cfg.is_xhc and cfg.mapping_norm_affine:
        raise AccountingError("HCConfig.mapping_norm_affine=True is an mHC-family option; set it to false for xHC")


def hc_params_per_sublayer(cfg: HCConfig, C: int, is_mlp: bool) -> ParamCount:
    """Trainable HC parameters of one wrapped sublayer (docs/math.md §2.0, §2.a, §3.1; Flash: §4.1).

    ``is_mlp`` matters for xHC (K_r components and convs after MLPs).  For ``xhc_flash`` the
    window's parameters are attributed as in :func:`_flash_sublayer_params`.  Flash-4sub has no
    per-sublayer split: use :func:`hc_params_per_window`.  Vanilla and ``disabled``: zero.
    """
    if not cfg.enabled:
        return _ZERO
    _check_xhc(cfg)
    if cfg.variant == "hc":
        return _hc_params(cfg, C)
    if cfg.variant in MHC_FAMILY:
        return _mhc_family_params(cfg, C)
    if cfg.variant == "xhc":
        return _xhc_sublayer_params(cfg, C, is_mlp)
    if cfg.variant == "xhc_flash":
        return _flash_sublayer_params(cfg, C, is_mlp)
    raise AccountingError(f"HCConfig.variant={cfg.variant!r} shares parameters across a two-layer "
                          "window; use hc_params_per_window(cfg, C)")


def window_layers(cfg: HCConfig) -> int:
    """Layers per grouping window: 2 for Flash-4sub (§4.2), 1 otherwise."""
    return 2 if (cfg.enabled and cfg.variant == "xhc_flash4") else 1


def hc_params_per_window(cfg: HCConfig, C: int) -> ParamCount:
    """Parameters of one grouping window (:func:`window_layers` layers; readout excluded)."""
    if not cfg.enabled:
        return _ZERO
    _check_xhc(cfg)
    if cfg.variant == "xhc_flash4":
        first, second = hc_params_flash4_layers(cfg, C)
        return first + second
    return hc_params_per_sublayer(cfg, C, False) + hc_params_per_sublayer(cfg, C, True)


def hc_params_per_layer(cfg: HCConfig, C: int) -> ParamCount:
    """Parameters of one transformer layer, attention + MLP (readout excluded).

    Flash-4sub windows span two layers and are not split: this raises for ``xhc_flash4``
    (use :func:`hc_params_per_window` or :func:`hc_params_total`).
    """
    if window_layers(cfg) != 1:
        raise AccountingError("HCConfig.variant='xhc_flash4' has two-layer windows; use "
                              "hc_params_per_window(cfg, C) or hc_params_total(cfg, C, num_layers)")
    return hc_params_per_window(cfg, C)


def readout_params(cfg: HCConfig) -> int:
    """Exit readout (§1.6): N logits for ``reduction="softmax"``, none for sum / mean."""
    return cfg.n if (cfg.enabled and cfg.reduction == "softmax") else 0


def head_params(cfg: HCConfig, C: int) -> ParamCount:
    """The learned head (``reduction="learned"``, §1.6, §2.h): ``hc_fn`` N·N·C (matrix), ``hc_base`` N
    (bias), ``hc_scale`` 1 (gate); once per model.  None for the other reductions."""
    if not (cfg.enabled and cfg.reduction == "learned"):
        return _ZERO
    return ParamCount(matrix=cfg.n * cfg.n * C, bias=cfg.n, gate=1)


def hc_params_total(cfg: HCConfig, C: int, num_layers: int) -> ParamCount:
    """All HC parameters of a model with ``num_layers`` layers, readout (or learned head) included.

    Flash-4sub groups layers (2g, 2g+1); an odd last layer falls back to a Flash window (§4.3).
    """
    if not cfg.enabled:
        return _ZERO
    if cfg.variant == "xhc_flash4":
        pairs, odd = divmod(num_layers, 2)
        body = hc_params_per_window(cfg, C).scale(pairs)
        if odd:
            body = body + hc_params_per_window(cfg.replace(variant="xhc_flash"), C)
    else:
        body = hc_params_per_layer(cfg, C).scale(num_layers)
    return body + ParamCount(readout=readout_params(cfg)) + head_params(cfg, C)


def dominant_coeff_per_window(cfg: HCConfig) -> int:
    """Coefficient of C in the GEMM + conv count of one window (§5.1, §4.3), in closed form.

    =============  ===========================================  =========================
    variant        coefficient                                  defaults
    =============  ===========================================  =========================
    mhc            2·N·(2N + N²) = 4N² + 2N³ per layer          192 (N=4), 9216 (N=16)
    xhc            4N² + 2k³ + k² + k²·K_r + Σκ per layer       1256 (N=16, k=4, K_r=4)
    xhc_flash      3N² + k³ + k²(1 + K_r) + Σκ per layer        936
    xhc_flash4     5N² + k³ + 2k²(1 + K_r) + 2Σκ per two layers  1552
    =============  ===========================================  =========================

    Other variants and shapes (HC, lite, Krom, identity, ablations, ``dense_read=False``,
    k = m without a router) use the itemised count divided by C.  Always equal to
    ``hc_params_per_window(cfg, C).dominant / C``.
    """
    if not cfg.enabled:
        return 0
    N, k = cfg.n, cfg.k
    K_r, sk = len(_kernel_sizes(cfg)) + 1, sum(_kernel_sizes(cfg))
    plain_xhc = (cfg.dense_read and not cfg.attn_temporal and cfg.k > cfg.m
                 and not (cfg.ablate_pre or cfg.ablate_res or cfg.ablate_post))
    if cfg.variant == "mhc" and cfg.dynamic and not (cfg.ablate_pre or cfg.ablate_post or cfg.ablate_res):
        return 4 * N ** 2 + 2 * N ** 3
    if cfg.variant == "xhc" and plain_xhc:
        return 4 * N ** 2 + 2 * k ** 3 + k ** 2 + k ** 2 * K_r + sk
    if cfg.variant == "xhc_flash" and plain_xhc:
        return 3 * N ** 2 + k ** 3 + k ** 2 * (1 + K_r) + sk
    if cfg.variant == "xhc_flash4" and plain_xhc:
        return 5 * N ** 2 + k ** 3 + 2 * k ** 2 * (1 + K_r) + 2 * sk
    per_c = hc_params_per_window(cfg, 1)  # every dominant term is linear in C
    return per_c.dominant


def dominant_coeff_per_layer(cfg: HCConfig) -> float:
    """Coefficient of C per layer (Flash-4sub: half its two-layer window)."""
    return dominant_coeff_per_window(cfg) / window_layers(cfg)


def dominant_params_per_layer(cfg: HCConfig, C: int) -> float:
    """Dominant (GEMM + conv) parameters per layer: coefficient · C (§5.1)."""
    return dominant_coeff_per_layer(cfg) * C


# ================================================================================================
# Training FLOPs (docs/math.md §5.2)
# ================================================================================================
TRAIN_MULT = 3
"""Training FLOPs of an element-wise or GEMM operation = 3 × forward (forward, then backward
w.r.t. both operands).  With 2 FLOPs per MAC this is the 6·P convention for GEMMs."""


def sinkhorn_flops(n: int, t_max: int) -> int:
    """Forward FLOPs of one n×n Sinkhorn (§1.4 reference loop).

    Row-max shift and exp: 2n²; initial row normalisation: n² sums + n² divides; each iteration
    normalises columns then rows: 4n².  Total (4 + 4·t_max)·n² (row maxima and clamps ignored).
    """
    return (4 + 4 * t_max) * n * n


def sinkhorn_deepseek_flops(n: int, iters: int) -> int:
    """Forward FLOPs of DeepSeek-V4's n×n Sinkhorn (§2.h): softmax (shift, exp, sums, divides: 4n²) and
    + ε (n²), then 2·iters − 1 normalisations of 2n² each.  Total (3 + 4·iters)·n²."""
    return (3 + 4 * iters) * n * n


def _res_map_flops(cfg: HCConfig, n: int) -> int:
    """Forward FLOPs of building H_res ∈ R^{n×n} from its logits (per sublayer, per token)."""
    if cfg.variant == "mhc" and cfg.convention == "deepseek_v4":
        return sinkhorn_deepseek_flops(n, cfg.sinkhorn_iters)
    if cfg.variant in ("mhc",) + XHC_FAMILY:
        return sinkhorn_flops(n, cfg.sinkhorn_iters)
    if cfg.variant == "mhc_lite":  # softmax over n! logits (≈3 each), then Σ_r a_r P_r (2n² each)
        return math.factorial(n) * (3 + 2 * n * n)
    if cfg.variant == "kromhc":    # K two-way softmaxes, then a Kronecker product of K 2×2 factors
        K = n.bit_length() - 1
        return 6 * K + n * n * (K - 1)
    return 0  # hc: the static part is added elementwise (negligible); identity: no map


def _res_map_mult(cfg: HCConfig) -> int:
    """Sinkhorn with recompute runs its forward once more in backward (§1.4)."""
    sinkhorn = cfg.variant in ("mhc",) + XHC_FAMILY
    return TRAIN_MULT + (1 if (sinkhorn and cfg.sinkhorn_recompute) else 0)


@dataclass(frozen=True)
class FlopsBreakdown:
    """Training FLOPs per token of all HC sublayers of a model.

    ``f_hc = gemm + conv`` is the [xHC] convention (6 · P · L, §5.2).  The other fields are
    derived forward counts × 3 (Sinkhorn with recompute × 4), listed separately and *not* part
    of F_HC:

    * ``res_map``: building H_res (Sinkhorn (4 + 4·t_max)·n², lite's permutation mixture,
      Krom's Kronecker product);
    * ``mixing``: dense read Σ h_pre·X (2NC), residual mixing (2n²C over the n mixed streams),
      write-back (2·K·n_w·C for K components into n_w streams, plus xHC's p scaling and add,
      2kC), Flash's MLP-input correction (2C);
    * ``norms``: mapping-norm statistics with the §1.5 reordering (RMS 2·d, LayerNorm 3·d over
      d inputs; HC's per-stream LayerNorm 3NC);
    * ``gram_schmidt``: MGS over K components, 3·K·(K−1)·C forward (dot, norm and update per
      pair).
    """

    gemm: float = 0.0
    conv: float = 0.0
    res_map: float = 0.0
    mixing: float = 0.0
    norms: float = 0.0
    gram_schmidt: float = 0.0

    @property
    def f_hc(self) -> float:
        """[xHC]'s F_HC = 6·(GEMM + conv params)·L (§5.2)."""
        return self.gemm + self.conv

    @property
    def extras(self) -> float:
        return self.res_map + self.mixing + self.norms + self.gram_schmidt

    @property
    def total(self) -> float:
        return self.f_hc + self.extras

    def __add__(self, o: "FlopsBreakdown") -> "FlopsBreakdown":
        return FlopsBreakdown(self.gemm + o.gemm, self.conv + o.conv, self.res_map + o.res_map,
                              self.mixing + o.mixing, self.norms + o.norms,
                              self.gram_schmidt + o.gram_schmidt)

    def scale(self, f: float) -> "FlopsBreakdown":
        return FlopsBreakdown(self.gemm * f, self.conv * f, self.res_map * f, self.mixing * f,
                              self.norms * f, self.gram_schmidt * f)


def _gs_flops(cfg: HCConfig, K: int, C: int) -> int:
    return 3 * K * (K - 1) * C if (cfg.gram_schmidt and K > 1) else 0


def _window_extras(cfg: HCConfig, C: int) -> FlopsBreakdown:
    """Forward FLOPs of the non-GEMM HC work in one window (see :class:`FlopsBreakdown`)."""
    N, k = cfg.n, cfg.k
    v = cfg.variant
    res_map = mixing = norms = gs = 0
    router_ln = 3 * N * C if k > cfg.m else 0   # no router when k = m
    if v == "hc" or v in MHC_FAMILY:
        mixes = not cfg.ablate_res and (v == "hc" or cfg.num_res_logits > 0)
        per = dict(
            res_map=_res_map_flops(cfg, N) if mixes else 0,
            mixing=2 * N * C + (2 * N * N * C if mixes else 0) + 2 * N * C,
            norms=(3 * N * C if v == "hc" else 2 * N * C) if cfg.dynamic else 0,
        )
        res_map, mixing, norms = 2 * per["res_map"], 2 * per["mixing"], 2 * per["norms"]
    elif v in XHC_FAMILY:
        K_A, K_M = _xhc_components(cfg, False), _xhc_components(cfg, True)
        mixes = not cfg.ablate_res
        sk = _res_map_flops(cfg, k) if mixes else 0

        def write(K: int, res: bool) -> int:  # [H_res·X_a] + H_post·V + p scaling and add
            return (2 * k * k * C if res else 0) + 2 * k * K * C + 2 * k * C

        if v == "xhc":
            read_w = N if cfg.dense_read else k
            for K in (K_A, K_M):
                res_map += sk
                mixing += 2 * read_w * C + write(K, mixes)
                norms += router_ln + (2 * N * C if cfg.dense_read else 0) + 2 * k * C
                gs += _gs_flops(cfg, K, C)
        elif v == "xhc_flash":
            res_map = sk
            mixing = (2 * 2 * N * C                    # two base readouts
                      + write(K_A, False)              # attention write-back, no H_res
                      + 2 * K_A * C                    # MLP-input correction inp_M + Σ_t β_t·V^A_t
                      + write(K_M, mixes))             # MLP mixing and write-back
            norms = router_ln + 2 * N * C + 2 * (2 * k * C)
            gs = _gs_flops(cfg, K_A, C) + _gs_flops(cfg, K_M, C)
        else:  # xhc_flash4
            res_map = sk
            mixing = (4 * 2 * N * C                    # four split reads (non-active base + active part)
                      + 2 * write(K_A, False)          # A1, A2
                      + write(K_M, False)              # M1 (no H_res)
                      + write(K_M, mixes))             # M2
            norms = router_ln + 2 * N * C + 4 * (2 * k * C)
            gs = 2 * (_gs_flops(cfg, K_A, C) + _gs_flops(cfg, K_M, C))
    return FlopsBreakdown(res_map=res_map, mixing=mixing, norms=norms, gram_schmidt=gs)


def _window_flops(cfg: HCConfig, C: int) -> FlopsBreakdown:
    p = hc_params_per_window(cfg, C)
    ex = _window_extras(cfg, C)
    return FlopsBreakdown(
        gemm=2 * TRAIN_MULT * p.matrix, conv=2 * TRAIN_MULT * p.conv,
        res_map=ex.res_map * _res_map_mult(cfg), mixing=ex.mixing * TRAIN_MULT,
        norms=ex.norms * TRAIN_MULT, gram_schmidt=ex.gram_schmidt * TRAIN_MULT)


def training_flops_per_token(cfg: HCConfig, C: int, num_layers: int) -> FlopsBreakdown:
    """HC training FLOPs per token for a model of ``num_layers`` layers (§5.2).

    ``.f_hc`` = 6 · P_layer · L, [xHC]'s convention (App. C).  Flash-4sub: an odd last
    layer is a Flash window (§4.3).  Vanilla / disabled: all zero.
    """
    if not cfg.enabled:
        return FlopsBreakdown()
    if cfg.variant == "xhc_flash4":
        pairs, odd = divmod(num_layers, 2)
        out = _window_flops(cfg, C).scale(pairs)
        if odd:
            out = out + _window_flops(cfg.replace(variant="xhc_flash"), C)
        return out + _head_flops(cfg, C)
    return _window_flops(cfg, C).scale(num_layers) + _head_flops(cfg, C)


def _head_flops(cfg: HCConfig, C: int) -> FlopsBreakdown:
    """The learned head, once per token (``reduction="learned"``): its GEMM (N outputs over N·C inputs,
    in ``gemm``: F_HC then is 6·(P_layer·L + N²C)), the RMS statistics (2NC) and the weighted sum
    (2NC); sigmoid and + ε (O(N)) ignored."""
    if not (cfg.enabled and cfg.reduction == "learned"):
        return FlopsBreakdown()
    N = cfg.n
    return FlopsBreakdown(gemm=2 * TRAIN_MULT * N * N * C, norms=2 * N * C * TRAIN_MULT,
                          mixing=2 * N * C * TRAIN_MULT)


# ================================================================================================
# Memory traffic (docs/math.md §5.3)
# ================================================================================================
@dataclass(frozen=True)
class TrafficRow:
    """One operation: elements read / written per token.  ``read`` and ``write`` are in units of
    C (summed); ``read_small`` / ``write_small`` are the O(N), O(k²) terms the table lists but
    does not sum (plain element counts)."""

    operation: str
    read: float
    write: float
    read_small: int = 0
    write_small: int = 0


@dataclass(frozen=True)
class TrafficTable:
    """A row-by-row traffic table for one unit (a sublayer, or a Flash layer)."""

    method: str
    unit: str                       # "attention sublayer", "MLP sublayer", "layer", ...
    rows: Tuple[TrafficRow, ...]
    sublayers: int = 1              # sublayers the table covers (Flash layer table: 2)

    @property
    def read(self) -> float:
        return sum(r.read for r in self.rows)

    @property
    def write(self) -> float:
        return sum(r.write for r in self.rows)

    @property
    def total(self) -> float:
        return self.read + self.write

    @property
    def read_small(self) -> int:
        return sum(r.read_small for r in self.rows)

    @property
    def write_small(self) -> int:
        return sum(r.write_small for r in self.rows)

    def format(self) -> str:
        lines = [f"{self.method}, {self.unit} (units of C; small terms in brackets)",
                 f"  {'operation':<44}{'read':>14}{'write':>14}"]
        for r in self.rows:
            rs = f"{r.read:g}C" + (f" +{r.read_small}" if r.read_small else "")
            ws = f"{r.write:g}C" + (f" +{r.write_small}" if r.write_small else "")
            lines.append(f"  {r.operation:<44}{rs:>14}{ws:>14}")
        lines.append(f"  {'total':<44}{self.read:>13g}C{self.write:>13g}C  = {self.total:g}C")
        return "\n".join(lines)


@dataclass(frozen=True)
class TrafficSummary:
    """Traffic per sublayer (mean over the sublayers of a layer / window), units of C."""

    method: str
    read: float
    write: float
    tables: Tuple[TrafficTable, ...] = ()
    note: str = ""

    @property
    def total(self) -> float:
        return self.read + self.write


FLASH4_TRAFFIC_REPORTED = {"n": 16, "k": 4, "read": 26.5, "write": 13.5}
"""Flash-4sub traffic per sublayer as [xHC] reports it (totals only, no breakdown), for comparison
with the derived :func:`memory_traffic_flash4_window` (docs/math.md §5.3, §8 #29)."""


def _vanilla_table() -> TrafficTable:
    """Vanilla residual add x + y: read x and y, write the sum (§5.3: 2C + C)."""
    return TrafficTable("vanilla", "sublayer", (TrafficRow("residual add x + y", 2, 1),))


def _mhc_table(cfg: HCConfig) -> TrafficTable:
    """mHC rows of the §5.3 table, used for the whole mHC family and HC.

    Derived adaptations (not in the papers): a static variant generates no mappings per token
    (row dropped); without residual mixing (identity, ``ablate_res``) the H_res row is dropped.
    Logit writes are N² + 2N for mHC and HC, R + 2N otherwise.
    """
    N = cfg.n
    mixes = not cfg.ablate_res and (cfg.variant == "hc" or cfg.num_res_logits > 0)
    n_logits = N * N + 2 * N if cfg.variant == "hc" else cfg.num_res_logits + 2 * N
    rows = []
    if cfg.dynamic:
        rows.append(TrafficRow("mapping generation", N, 0, 0, n_logits))
    rows.append(TrafficRow("dense read (H_pre)", N, 1, N, 0))
    if mixes:
        rows.append(TrafficRow("H_res mixing", N, N, N * N, 0))
    rows += [TrafficRow("H_post write-back", 1, N, N, 0), TrafficRow("merge", 2 * N, N)]
    return TrafficTable(cfg.variant, "sublayer", tuple(rows))


def _xhc_table(cfg: HCConfig, is_mlp: bool) -> TrafficTable:
    """xHC rows of the §5.3 table for one sublayer (K = K_r after MLPs, 1 after attention)."""
    N, k = cfg.n, cfg.k
    K = _xhc_components(cfg, is_mlp)
    r = K - 1
    read_w = N if cfg.dense_read else k
    rows = [
        TrafficRow("mapping generation (router + pre)", N, 0, 0, 2 * N),
        TrafficRow("dense read (H_pre)", read_w, 1, read_w, 0),
        TrafficRow("gather active", k, k),
        TrafficRow("active mapping generation", k, 0, 0, k * k + k * K),
        TrafficRow("H_res mixing", k, k, k * k, 0),
        TrafficRow("H_post write-back", K, k, k * K, 0),
        TrafficRow("merge & scatter", 2 * k, k),
    ]
    if cfg.ablate_res:  # H_res ≡ I_k: no mixing pass (derived, as for identity)
        rows = [row for row in rows if row.operation != "H_res mixing"]
    if r:
        rows.append(TrafficRow("temporal conv", 1, r))
    unit = "MLP sublayer" if is_mlp else "attention sublayer"
    return TrafficTable("xhc", unit, tuple(rows))


def memory_traffic_flash_layer(cfg: HCConfig) -> TrafficTable:
    """The xHC-Flash per-layer table of §5.3 (two sublayers; per sublayer = half).

    Reads (2N + 8k + K_r + 4)·C, writes (6k + 3 + r)·C per layer: 36C + 15C per sublayer at
    N=16, k=4.  Small terms (derived; the table writes O(N), O(k), O(k²)): entry writes N router
    scores + 2N pre-coefficients; attention H_post k values; MLP mappings k² + k·K_r; the reads
    of coefficients mirror the xHC table.
    """
    if cfg.attn_temporal:
        raise AccountingError("HCConfig.attn_temporal=True: the §5.3 Flash table assumes K=1 after "
                              "attention and has no row for attention-side convs; set attn_temporal: false")
    N, k = cfg.n, cfg.k
    K_r = _xhc_components(cfg, True)
    r = K_r - 1
    rows = (
        TrafficRow("entry mapping generation (router + 2 pre)", N, 0, 0, 3 * N),
        TrafficRow("two base readouts", N, 2, 2 * N, 0),
        TrafficRow("gather active", k, k),
        TrafficRow("attention H_post generation", k, 0, 0, k),
        TrafficRow("attention post write-back", 1, k, k, 0),
        TrafficRow("attention merge (no H_res)", 2 * k, k),
        TrafficRow("MLP-input correction", 2, 1),
        TrafficRow("MLP active mapping generation", k, 0, 0, k * k + k * K_r),
        TrafficRow("temporal conv", 1 if r else 0, r),
        TrafficRow("H_res mixing", k, k, k * k, 0),
        TrafficRow("MLP post write-back", K_r, k, k * K_r, 0),
        TrafficRow("merge & scatter", 2 * k, k),
    )
    return TrafficTable("xhc_flash", "layer (attention + MLP)", rows, sublayers=2)


def memory_traffic_flash4_window(cfg: HCConfig) -> TrafficTable:
    """Flash-4sub traffic of one window (two layers: A1, M1, A2, M2), derived row by row.

    The operations are those of docs/math.md §4.2, each costed like the same operation in the
    xHC and Flash tables: at window entry one full-state pass for the router and the four
    pre-mappings (NC), the four non-active base readouts over the N−k inactive streams, one
    gather of the k active streams; then per sublayer t a split read (base_t and the carried
    k·C active state), the mapping generation from the carried active state, the write-back of
    the K components and the merge into the carried buffer (K = K_r after MLPs, 1 after
    attention); M1 and M2 add the temporal conv, M2 alone has H_res mixing and ends with the
    scatter.  Per window (r > 0): reads (2N + 17k + 2K_r + 8)·C, writes (10k + 2r + 8)·C; per
    sublayer a quarter: 29C + 13.5C = 42.5C at N=16, k=4, K_r=4.  [xHC] reports 26.5C + 13.5C
    without a breakdown (:data:`FLASH4_TRAFFIC_REPORTED`): the writes agree; the reads it
    reports are 2.5C lower, which this row model cannot attribute to one operation.
    """
    if cfg.attn_temporal:
        raise AccountingError("HCConfig.attn_temporal=True: the Flash-4sub table assumes K=1 after "
                              "attention and has no row for attention-side convs; set attn_temporal: false")
    N, k = cfg.n, cfg.k
    K_r = _xhc_components(cfg, True)
    r = K_r - 1
    rows = [
        TrafficRow("entry mapping generation (router + 4 pre)", N, 0, 0, 5 * N),
        TrafficRow("four non-active base readouts", N - k, 4, 4 * (N - k), 0),
        TrafficRow("gather active", k, k),
    ]
    for name, is_mlp, mixes in (("A1", False, False), ("M1", True, False), ("A2", False, False), ("M2", True, True)):
        K = K_r if is_mlp else 1
        rows.append(TrafficRow(f"{name} split read (base + carried active)", k + 1, 1, k, 0))
        rows.append(TrafficRow(f"{name} active mapping generation", k, 0, 0, k * K + (k * k if mixes else 0)))
        if is_mlp and r:
            rows.append(TrafficRow(f"{name} temporal conv", 1, r))
        if mixes:
            rows.append(TrafficRow(f"{name} H_res mixing", k, k, k * k, 0))
        rows.append(TrafficRow(f"{name} post write-back", K, k, k * K, 0))
        rows.append(TrafficRow(f"{name} merge" + (" & scatter" if mixes else ""), 2 * k, k))
    return TrafficTable("xhc_flash4", "window (two layers: A1, M1, A2, M2)", tuple(rows), sublayers=4)


def memory_traffic_per_sublayer(cfg: HCConfig, sublayer: str = "mlp") -> TrafficTable:
    """Row-by-row traffic of one sublayer, units of C (§5.3).

    ``sublayer`` is ``"attention"`` or ``"mlp"`` (only xHC distinguishes them).  Vanilla: 3C;
    mHC: (5N+1)C reads + (3N+1)C writes.  Flash variants have per-layer / per-window tables
    (:func:`memory_traffic_flash_layer`, :func:`memory_traffic_flash4_window`); use
    :func:`memory_traffic_summary` for their per-sublayer means.
    """
    if sublayer not in ("attention", "mlp"):
        raise AccountingError(f"sublayer={sublayer!r} is invalid: use 'attention' or 'mlp'")
    if not cfg.enabled:
        return _vanilla_table()
    if cfg.variant == "hc" or cfg.variant in MHC_FAMILY:
        return _mhc_table(cfg)
    if cfg.variant == "xhc":
        return _xhc_table(cfg, sublayer == "mlp")
    raise AccountingError(f"HCConfig.variant={cfg.variant!r} has no per-sublayer table; use "
                          "memory_traffic_summary(cfg) (Flash tables are per layer)")


def memory_traffic_summary(cfg: HCConfig) -> TrafficSummary:
    """Traffic per sublayer amortised over the layer / window, units of C (§5.3 totals).

    vanilla 3C; mHC (8N+2)C; xHC (2N+5k+1+K_r/2)C + (4k+1+r/2)C; Flash
    (N+4k+K_r/2+2)C + (3k+(3+r)/2)C; Flash-4sub (2N+17k+2K_r+8)C/4 + (10k+2r+8)C/4.
    """
    if not cfg.enabled:
        t = _vanilla_table()
        return TrafficSummary("vanilla", t.read, t.write, (t,))
    if cfg.variant == "xhc":
        ta, tm = _xhc_table(cfg, False), _xhc_table(cfg, True)
        return TrafficSummary("xhc", (ta.read + tm.read) / 2, (ta.write + tm.write) / 2, (ta, tm))
    if cfg.variant == "xhc_flash":
        t = memory_traffic_flash_layer(cfg)
        return TrafficSummary("xhc_flash", t.read / 2, t.write / 2, (t,))
    if cfg.variant == "xhc_flash4":
        t = memory_traffic_flash4_window(cfg)
        rep = FLASH4_TRAFFIC_REPORTED
        note = "derived row by row (docs/math.md §5.3)"
        if (cfg.n, cfg.k) == (rep["n"], rep["k"]):
            note += f"; [xHC] reports {rep['read']:g}C + {rep['write']:g}C"
        return TrafficSummary("xhc_flash4", t.read / 4, t.write / 4, (t,), note)
    t = memory_traffic_per_sublayer(cfg)
    return TrafficSummary(cfg.variant, t.read, t.write, (t,))


# ================================================================================================
# Vanilla backbone (docs/math.md §6.1, §8 #30)
# ================================================================================================
@dataclass(frozen=True)
class BackboneShape:
    """Plain description of a DeepSeekMoE-style decoder (docs/math.md §6.1).

    Per layer: GQA attention (Q: C × heads·d, K and V: C × groups·d, O: heads·d × C, QK-norm
    gains of size d on q and k, no biases), then an MLP: the first ``num_dense_layers`` layers
    are dense SwiGLU (3·C·dense_ffn), the others MoE (router C × E, E routed experts and
    ``num_shared_experts`` shared experts, SwiGLU).  Two RMSNorm gains (C each) per layer, a final
    norm, input embedding and, if untied, an output layer (V × C each).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_groups: int
    expert_ffn: int
    head_dim: int = 128
    num_experts: int = 144
    top_k: int = 8
    num_shared_experts: int = 1
    shared_expert_ffn: Optional[int] = None   # default: expert_ffn (§8 #30)
    dense_ffn: Optional[int] = None           # default: 9 × expert_ffn (§8 #30)
    num_dense_layers: int = 1
    vocab: int = 152_064
    seq_len: int = 8192
    tied_embeddings: bool = False
    qk_norm: bool = True

    @property
    def shared_ffn(self) -> int:
        return self.expert_ffn if self.shared_expert_ffn is None else self.shared_expert_ffn

    @property
    def dense_ffn_width(self) -> int:
        return 9 * self.expert_ffn if self.dense_ffn is None else self.dense_ffn

    @classmethod
    def paper(cls, size: str) -> "BackboneShape":
        """One of the [xHC] App. A sizes: ``"2.5B"``, ``"10B"``, ``"18B"``, ``"28B"``."""
        makers = {"2.5B": cls.xhc_2p5b, "10B": cls.xhc_10b, "18B": cls.xhc_18b, "28B": cls.xhc_28b}
        if size not in makers:
            raise AccountingError(f"size={size!r} is not a paper size: use one of {', '.join(makers)}")
        return makers[size]()

    @classmethod
    def xhc_2p5b(cls) -> "BackboneShape":
        return cls("2.5B", num_layers=15, hidden=1024, num_heads=8, num_kv_groups=4, expert_ffn=320)

    @classmethod
    def xhc_10b(cls) -> "BackboneShape":
        return cls("10B", num_layers=15, hidden=2080, num_heads=16, num_kv_groups=8, expert_ffn=704)

    @classmethod
    def xhc_18b(cls) -> "BackboneShape":
        return cls("18B", num_layers=28, hidden=2112, num_heads=16, num_kv_groups=8, expert_ffn=672)

    @classmethod
    def xhc_28b(cls) -> "BackboneShape":
        return cls("28B", num_layers=32, hidden=2560, num_heads=20, num_kv_groups=10, expert_ffn=768)


PAPER_SIZES = ("2.5B", "10B", "18B", "28B")


class BackboneParams(NamedTuple):
    """``(total, activated)`` plus the pieces the FLOPs conventions need."""

    total: int
    activated: int             # everything a token touches: embeddings, output layer included
    embedding: int             # input embedding V × C
    output_layer: int          # V × C if untied, else 0
    nonembedding_activated: int  # activated minus embedding and output layer


def _attention_params(s: BackboneShape) -> int:
    C, d = s.hidden, s.head_dim
    qkvo = C * s.num_heads * d + 2 * C * s.num_kv_groups * d + s.num_heads * d * C
    return qkvo + (2 * d if s.qk_norm else 0)


def _swiglu(C: int, F: int) -> int:
    return 3 * C * F


def backbone_params(shape: BackboneShape) -> BackboneParams:
    """Total and activated backbone parameters, analytically (docs/math.md §6.1 shapes, §8 #30 gaps).

    Activated counts the top-k routed experts and the shared experts of each MoE layer and every
    non-expert weight, embeddings and output layer included.
    """
    s, C = shape, shape.hidden
    n_moe = s.num_layers - s.num_dense_layers
    norms = 2 * C * s.num_layers + C                         # input/pre-MLP norms + final norm
    attn = _attention_params(s) * s.num_layers
    dense = _swiglu(C, s.dense_ffn_width) * s.num_dense_layers
    router = C * s.num_experts * n_moe
    shared = _swiglu(C, s.shared_ffn) * s.num_shared_experts * n_moe
    routed_all = _swiglu(C, s.expert_ffn) * s.num_experts * n_moe
    routed_act = _swiglu(C, s.expert_ffn) * s.top_k * n_moe
    emb = s.vocab * C
    out = 0 if s.tied_embeddings else s.vocab * C
    common = norms + attn + dense + router + shared
    return BackboneParams(total=common + routed_all + emb + out,
                          activated=common + routed_act + emb + out,
                          embedding=emb, output_layer=out,
                          nonembedding_activated=common + routed_act)


def _causal_attention_flops(s: BackboneShape) -> float:
    """Training FLOPs per token of the attention scores QK^T and the weighted sum AV.

    Forward, per layer: 2 GEMMs of 2·(heads·d)·seq FLOPs each, halved by the causal mask, so
    2·heads·d·seq; training ×3 gives 6·heads·d·seq per layer.  This is Megatron-Core's
    ``num_floating_point_operations`` term ``6·(query_projection_size·seq/2·2)``.
    """
    return 6.0 * s.num_heads * s.head_dim * s.seq_len * s.num_layers


FLOPS_CONVENTIONS: Dict[str, str] = {
    "6N_nonemb": "6 × activated non-embedding parameters (no attention scores, no LM head)",
    "6N_active": "6 × activated parameters including input embedding and LM head",
    "6N_nonemb+head": "6 × (activated non-embedding parameters + LM head)",
    "megatron": "6 × (activated non-embedding parameters + LM head) + causal attention "
                "6·heads·d·seq per layer (Megatron-Core num_floating_point_operations)",
    "megatron_noncausal": "as 'megatron' with full (non-causal) attention 12·heads·d·seq per layer",
}
DEFAULT_FLOPS_CONVENTION = "megatron"


def vanilla_flops_per_token(shape: BackboneShape, convention: str = DEFAULT_FLOPS_CONVENTION) -> float:
    """F_vanilla, training FLOPs per token of the plain backbone under a named convention
    (see :data:`FLOPS_CONVENTIONS`).  The papers leave the denominator open (§5.2, §8 #28)."""
    if convention not in FLOPS_CONVENTIONS:
        raise AccountingError(f"convention={convention!r} is unknown: use one of "
                              f"{', '.join(FLOPS_CONVENTIONS)}")
    p = backbone_params(shape)
    head = shape.vocab * shape.hidden          # the LM-head GEMM runs whether or not it is tied
    attn = _causal_attention_flops(shape)
    return {
        "6N_nonemb": 6.0 * p.nonembedding_activated,
        "6N_active": 6.0 * p.activated,
        "6N_nonemb+head": 6.0 * (p.nonembedding_activated + head),
        "megatron": 6.0 * (p.nonembedding_activated + head) + attn,
        "megatron_noncausal": 6.0 * (p.nonembedding_activated + head) + 2 * attn,
    }[convention]
