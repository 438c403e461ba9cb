"""Hyper-connection configuration: one validated dataclass for every variant.

Every invalid value raises :class:`HCConfigError` with a one-line message that names the
field, the value given and the allowed values.

Variants (docs/math.md §2–§4):

=============  =====================================================================
``none``       stock residual (vanilla); every HC code path is bypassed
``hc``         Hyper-Connections, unconstrained (static, or dynamic tanh form)   §2.a
``mhc``        Sinkhorn-projected H_res                                          §2.b
``mhc_lite``   convex mixture of the n! permutation matrices                     §2.c
``kromhc``     Kronecker product of log2(n) 2×2 doubly stochastic factors        §2.d
``identity``   H_res = I; only the read and the write are learned               §2.e
``xhc``        sparse k-of-N streams, temporal write-back, Gram–Schmidt         §3
``xhc_flash``  xHC with routing shared inside one attention+MLP layer            §4.1
``xhc_flash4`` xHC with routing shared across two layers (Flash-4sub)            §4.2
=============  =====================================================================
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Tuple

from xhc.config_base import ConfigBase

class HCConfigWarning(UserWarning):
    """A valid but costly hyper-connection setting (shown once per process and setting)."""


def _warn_mhc_lite_growth(n: int) -> None:
    """mHC-lite mixes all n! permutation matrices: its residual logits (and, when dynamic, the
    N·C × n! projection) grow factorially, so [lite] recommends small n (docs/math.md §2.c)."""
    warnings.warn(
        f"HCConfig: variant 'mhc_lite' with n={n} mixes n! = {math.factorial(n)} permutation matrices "
        f"(n=4: 24); its residual projection grows factorially: consider n=4 or variant 'kromhc'",
        HCConfigWarning, stacklevel=5)


# The one definition of the variant names (everything else imports these) ...
VARIANTS = ("none", "hc", "mhc", "mhc_lite", "kromhc", "identity", "xhc", "xhc_flash", "xhc_flash4")
MHC_FAMILY = ("mhc", "mhc_lite", "kromhc", "identity")
XHC_FAMILY = ("xhc", "xhc_flash", "xhc_flash4")
FLASH_FAMILY = ("xhc_flash", "xhc_flash4")  # routing shared by a window of sublayers (§4)
REDUCTIONS = ("sum", "mean", "softmax", "learned")
CONVENTIONS = ("paper", "deepseek_v4")
DEEPSEEK_V4_VARIANTS = ("mhc", "identity")  # the variants that take ``convention: deepseek_v4`` (docs/math.md §2.h)
READ_INITS = ("auto", "one_hot", "uniform")
PRESETS = ("spec", "peft_paper")
ROUTERS = ("sigmoid", "softmax")
SINKHORN_ORDERS = ("row_last", "col_last")
CONV_DOC_RESET = ("auto", "always", "never")
# ... and of the kernel backend names: the implementations of the fused HC ops (xhc/kernels/), and
# the choices of ``HCConfig.kernels`` (``auto``: resolved per device; ``liger``: Liger-Kernel's mHC
# coefficient op with the ``triton`` read and write).
OP_BACKENDS = ("eager", "compile", "triton")
KERNEL_BACKENDS = ("auto",) + OP_BACKENDS + ("liger",)


class HCConfigError(ValueError):
    """A hyper-connection configuration value is invalid (message names the field)."""


def _err(field_name: str, value, allowed: str) -> HCConfigError:
    return HCConfigError(f"HCConfig.{field_name}={value!r} is invalid: {allowed}")


@dataclass
class HCConfig(ConfigBase):
    """Configuration of the hyper-connections of one model (all sublayers share it).

    Fields are grouped as in docs/math.md; defaults are the documented recommendations.
    """

    # ---- family ---------------------------------------------------------------------------
    variant: str = "mhc"
    """One of :data:`VARIANTS`."""
    n: int = 4
    """Number of residual streams N (papers also write n)."""
    dynamic: bool = True
    """Dynamic (input-dependent) coefficients; ``False`` learns per-sublayer constants."""
    disabled: bool = False
    """Bypass every HC code path (bitwise equal to the backbone), whatever the variant."""

    # ---- Sinkhorn (§1.4) --------------------------------------------------------------------
    sinkhorn_iters: int = 20
    sinkhorn_eps: float = 1e-6
    sinkhorn_order: str = "row_last"
    sinkhorn_recompute: bool = True
    """Save only the logits and recompute the iterations in backward."""
    row_sum_clamp: bool = True
    """Rescale rows with sum > 1 (§2.f).  Always on for xHC."""

    # ---- coefficient generation (§1.5, §2.0) ------------------------------------------------
    norm_eps: float = 1e-6
    mapping_norm_affine: bool = False
    """Learnable N·C gain on the mapping RMSNorm ([PEFT] parameter parity)."""
    gate_init: float = 0.01
    """Initial value of the scalar gates α (HC: s_α, s_β)."""
    read_init: str = "auto"
    """``one_hot``: near-one-hot read on stream ℓ mod N; ``uniform``: h_pre = 1/N;
    ``auto``: one_hot for HC and the mHC family, uniform for xHC (docs/math.md §2.0, §3.4)."""
    read_delta: float = 0.01
    """δ of the near-one-hot read: the other streams get h_pre = δ."""
    res_offdiag_init: float = -8.0
    """Residual-logit bias away from the identity (mHC off-diagonal, lite/Krom non-identity)."""
    init_noise: float = 0.0
    """σ of Gaussian noise on static logits (read renormalised to sum 1), [PEFT] static Sinkhorn."""
    res_logit_dropout: float = 0.0
    """Dropout probability on the residual logits during training ([PEFT], off by default)."""
    preset: str = "spec"
    """``spec`` (this documented inits) or ``peft_paper`` ([PEFT] inits, §2.g)."""
    hc_tanh: bool = True
    """HC dynamic form uses tanh ([HC] Table 1 'w/o tanh' sets this to False)."""

    # ---- ablations: replace a mapping by its neutral form ---------------------------------
    ablate_pre: bool = False
    """h_pre ≡ 1/N (uniform read), no parameters."""
    ablate_res: bool = False
    """H_res ≡ I, no parameters."""
    ablate_post: bool = False
    """h_post ≡ 1, no parameters."""

    # ---- convention (§2.h) --------------------------------------------------------------------
    convention: str = "paper"
    """``paper``: the mHC paper's maps (the sections above); ``deepseek_v4``: DeepSeek-V4's (as in
    transformers' ``DeepseekV4HyperConnection``): h_pre = σ(·) + ε, the residual map from
    softmax + ε and a column-first Sinkhorn with ``+ ε`` denominators (``sinkhorn_eps`` is ε,
    ``sinkhorn_order`` and ``row_sum_clamp`` are not used), applied transposed.  Variants
    :data:`DEEPSEEK_V4_VARIANTS` only (docs/math.md §2.h)."""

    # ---- entry / exit (§1.6) -----------------------------------------------------------------
    reduction: str = "sum"
    """``sum`` | ``mean`` | ``softmax`` (N learned logits) | ``learned`` (DeepSeek-V4's head: per-token
    weights σ(α·RMSNorm(vec X)·W + b) + ε, :class:`xhc.head.LearnedHead`; §1.6)."""

    # ---- xHC (§3) ----------------------------------------------------------------------------
    k: int = 4
    """Active streams written per sublayer."""
    m: int = 2
    """Always-active (fixed) streams 0..m−1."""
    kernel_sizes: Tuple[int, ...] = (4, 8, 12)
    """Temporal conv kernel sizes κ_1..κ_r (MLP sublayers); ``()`` disables augmentation."""
    gram_schmidt: bool = True
    gs_eps: float = 1e-6
    router: str = "sigmoid"
    dense_read: bool = True
    """Read all N streams; ``False`` reads only the k active streams (ablation)."""
    conv_doc_reset: str = "auto"
    attn_temporal: bool = False
    """Temporal augmentation after attention too (ablation; the paper found it hurts)."""

    # ---- kernels (docs/kernels.md) ----------------------------------------------------------
    kernels: str = "auto"
    """Backend of the fused HC ops: ``eager`` (readable torch reference), ``compile`` (the same
    fused functions, meant to run under ``torch.compile``), ``triton`` (GPU kernels), ``auto``
    (triton on CUDA when Triton imports, else compile), or ``liger`` (Liger-Kernel's fused mHC
    coefficient op with the ``triton`` read and write; only ``variant: mhc`` with
    ``sinkhorn_order: col_last``, where its maths equals ours: xhc/kernels/liger.py).  Resolved per
    device by :func:`xhc.kernels.resolve_backend`."""

    def __post_init__(self):
        if isinstance(self.kernel_sizes, list):
            self.kernel_sizes = tuple(self.kernel_sizes)
        self.validate()

    # ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`HCConfigError` on the first invalid field."""
        if self.variant not in VARIANTS:
            raise _err("variant", self.variant, f"allowed values are {', '.join(VARIANTS)}")
        for name in ("dynamic", "disabled", "sinkhorn_recompute", "row_sum_clamp", "mapping_norm_affine",
                     "hc_tanh", "ablate_pre", "ablate_res", "ablate_post", "gram_schmidt", "dense_read",
                     "attn_temporal"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, getattr(self, name), "must be true or false")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise _err("n", self.n, "must be an integer >= 1")
        if self.variant in MHC_FAMILY + XHC_FAMILY and self.n < 2 and not self.disabled:
            raise _err("n", self.n, f"variant {self.variant!r} needs n >= 2 (n = 1 is only valid for 'hc')")
        if self.variant == "mhc_lite" and self.n > 6:
            raise _err("n", self.n, "mhc_lite needs n <= 6 (n! permutations); use variant 'kromhc' for larger n")
        if self.variant == "mhc_lite" and self.n > 4 and not self.disabled:
            _warn_mhc_lite_growth(self.n)
        if self.variant == "kromhc" and (self.n & (self.n - 1)) != 0:
            raise _err("n", self.n, "kromhc needs n to be a power of two (2, 4, 8, 16, ...)")
        if not isinstance(self.sinkhorn_iters, int) or self.sinkhorn_iters < 0:
            raise _err("sinkhorn_iters", self.sinkhorn_iters, "must be an integer >= 0")
        for name in ("sinkhorn_eps", "norm_eps", "gs_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
                raise _err(name, v, "must be a finite number > 0")
        if self.sinkhorn_order not in SINKHORN_ORDERS:
            raise _err("sinkhorn_order", self.sinkhorn_order, f"allowed values are {', '.join(SINKHORN_ORDERS)}")
        if not isinstance(self.gate_init, (int, float)) or not math.isfinite(self.gate_init):
            raise _err("gate_init", self.gate_init, "must be a finite number")
        if self.read_init not in READ_INITS:
            raise _err("read_init", self.read_init, f"allowed values are {', '.join(READ_INITS)}")
        if not isinstance(self.read_delta, (int, float)) or not (0 < self.read_delta < 1.0 / max(self.n, 2)):
            raise _err("read_delta", self.read_delta, f"must lie in (0, 1/n) = (0, {1.0 / max(self.n, 2):.4g})")
        if not isinstance(self.res_offdiag_init, (int, float)) or not math.isfinite(self.res_offdiag_init) \
                or self.res_offdiag_init > 0:
            raise _err("res_offdiag_init", self.res_offdiag_init, "must be a finite number <= 0")
        if not isinstance(self.init_noise, (int, float)) or self.init_noise < 0:
            raise _err("init_noise", self.init_noise, "must be a number >= 0")
        if not isinstance(self.res_logit_dropout, (int, float)) or not 0 <= self.res_logit_dropout < 1:
            raise _err("res_logit_dropout", self.res_logit_dropout, "must lie in [0, 1)")
        if self.preset not in PRESETS:
            raise _err("preset", self.preset, f"allowed values are {', '.join(PRESETS)}")
        if self.kernels not in KERNEL_BACKENDS:
            raise _err("kernels", self.kernels, f"allowed values are {', '.join(KERNEL_BACKENDS)}")
        if self.reduction not in REDUCTIONS:
            raise _err("reduction", self.reduction, f"allowed values are {', '.join(REDUCTIONS)}")
        if self.convention not in CONVENTIONS:
            raise _err("convention", self.convention, f"allowed values are {', '.join(CONVENTIONS)}")
        if self.kernels == "liger" and self.enabled:
            self._validate_liger()
        if self.convention == "deepseek_v4" and self.enabled:
            self._validate_deepseek_v4()
        if self.variant in XHC_FAMILY:
            self._validate_xhc()

    def _validate_liger(self) -> None:
        """``kernels: liger`` only where Liger-Kernel's fused mHC op equals our maths (xhc/kernels/liger.py)."""
        if self.variant != "mhc":
            raise _err("kernels", "liger", f"Liger-Kernel has only the Sinkhorn mHC map, not variant "
                       f"{self.variant!r}; use kernels: auto")
        if not self.dynamic:
            raise _err("dynamic", False, "kernels: liger fuses the dynamic projection; set dynamic: true "
                       "or use kernels: auto")
        for name in ("ablate_pre", "ablate_res", "ablate_post"):
            if getattr(self, name):
                raise _err(name, True, "kernels: liger always computes all three maps; use kernels: auto")
        if self.sinkhorn_order != "col_last":
            raise _err("sinkhorn_order", self.sinkhorn_order, "Liger-Kernel's Sinkhorn ends on the columns: "
                       "set sinkhorn_order: col_last with kernels: liger, or use kernels: auto")
        if self.sinkhorn_iters < 1:
            raise _err("sinkhorn_iters", self.sinkhorn_iters, "kernels: liger runs at least one Sinkhorn "
                       "iteration; set sinkhorn_iters >= 1")
        if self.res_logit_dropout > 0:
            raise _err("res_logit_dropout", self.res_logit_dropout, "kernels: liger has no dropout on the "
                       "residual logits; set it to 0 or use kernels: auto")

    def _validate_deepseek_v4(self) -> None:
        """``convention: deepseek_v4`` where DeepSeek-V4's maps are defined (docs/math.md §2.h)."""
        if self.variant not in DEEPSEEK_V4_VARIANTS:
            raise _err("convention", "deepseek_v4", f"defined for variants {', '.join(DEEPSEEK_V4_VARIANTS)} "
                       f"only, not {self.variant!r}; use convention: paper")
        if self.sinkhorn_iters < 1 and self.variant == "mhc" and not self.ablate_res:
            raise _err("sinkhorn_iters", self.sinkhorn_iters, "convention: deepseek_v4 runs at least one "
                       "(column) normalisation; set sinkhorn_iters >= 1")
        if self.mapping_norm_affine:
            raise _err("mapping_norm_affine", True, "convention: deepseek_v4 uses an unweighted RMSNorm; "
                       "set mapping_norm_affine: false")
        if self.kernels == "liger":
            raise _err("kernels", "liger", "Liger-Kernel has no deepseek_v4 convention; use kernels: auto")

    def _validate_xhc(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= self.n:
            raise _err("k", self.k, f"must be an integer with 1 <= k <= n = {self.n}")
        if not isinstance(self.m, int) or not 0 <= self.m <= self.k:
            raise _err("m", self.m, f"must be an integer with 0 <= m <= k = {self.k}")
        if not all(isinstance(x, int) and x >= 1 for x in self.kernel_sizes):
            raise _err("kernel_sizes", self.kernel_sizes, "must be a list of integers >= 1, e.g. [4, 8, 12]")
        if self.router not in ROUTERS:
            raise _err("router", self.router, f"allowed values are {', '.join(ROUTERS)}")
        if self.conv_doc_reset not in CONV_DOC_RESET:
            raise _err("conv_doc_reset", self.conv_doc_reset, f"allowed values are {', '.join(CONV_DOC_RESET)}")
        if self.variant in FLASH_FAMILY and not self.dense_read:
            raise _err("dense_read", self.dense_read, "Flash variants share one dense read; set dense_read: true")

    # ------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """True when hyper-connections are active (not vanilla, not disabled)."""
        return self.variant != "none" and not self.disabled

    @property
    def is_xhc(self) -> bool:
        return self.variant in XHC_FAMILY

    @property
    def num_res_logits(self) -> int:
        """R, the number of residual logits of the mHC family (§2.0 table)."""
        if self.ablate_res or self.variant == "identity":
            return 0
        if self.variant == "mhc":
            return self.n * self.n
        if self.variant == "mhc_lite":
            return math.factorial(self.n)
        if self.variant == "kromhc":
            return 2 * (self.n.bit_length() - 1)
        raise HCConfigError(f"HCConfig.variant={self.variant!r} has no mHC-family residual logits")

    # from_dict (unknown keys are an error naming the key), to_dict, replace (validated): ConfigBase
    config_error: ClassVar[type] = HCConfigError
    key_format: ClassVar[str] = "HCConfig.{key}: {msg}"
    unknown_key_format: ClassVar[str] = "HCConfig has no field {name!r}; known fields: {known}"
