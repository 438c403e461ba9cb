"""Liger-Kernel's fused mHC coefficient op as the ``liger`` backend (docs/kernels.md, "Liger-Kernel").

`liger-kernel <https://github.com/linkedin/Liger-Kernel>`_ (optional: ``pip install liger-kernel``,
in the ``kernels`` extra) fuses the whole mHC coefficient generation in Triton: the ``x·φ`` GEMM with
the flat RMS statistic applied after it, the split into pre / post / residual logits, the sigmoids
and Sinkhorn, with a hand-written backward.  Its maths equals ours (docs/math.md §1.4, §1.5, §2.0)
only for part of the configuration space, which :meth:`xhc.config.HCConfig.validate` enforces
for ``kernels: liger``:

* ``variant: mhc``, ``dynamic: true``, no ablated group (Liger always emits all three maps);
* ``sinkhorn_order: col_last`` (Liger's Sinkhorn ends on a column normalisation), ``sinkhorn_iters
  >= 1``;
* ``res_logit_dropout: 0`` (the dropout acts on the logits, inside Liger's op).

Liger is called with ``pre_eps = sinkhorn_eps = 0`` and ``post_mult = 2``, which gives
h_pre = σ(z_pre), h_post = 2σ(z_post) and H_res = t_max × (row, column) normalisations of
exp(z_res), as ours; the one remaining difference is that our Sinkhorn clamps a row or column sum
below ``sinkhorn_eps`` (1e-6) and Liger's does not, which matters only for logits ≈ 14 apart.
The mapping-norm gain (``mapping_norm_affine``) is folded into φ = (W diag g)ᵀ, and the row clamp
(``row_sum_clamp``) is applied after Liger's op, so both stay available.

Only the coefficients come from Liger: its pre-mix and post + residual kernels return fp32 copies
of the state that are then cast (and cast the state's gradient to fp32), which the fused read and
write of :mod:`xhc.kernels` avoid; read and write therefore use the ``triton`` backend.  Where
Liger's kernels cannot run (CPU tensors without ``TRITON_INTERPRET=1``, or while ``torch.compile``
traces) the coefficients come from our fused ops with the configured ``col_last`` Sinkhorn: the same
maths.

Two properties of Liger's op that are not ours, and why ``auto`` never picks it: on a GPU its
``tl.dot`` on fp32 operands runs in TF32 by default (10-bit mantissa for the projection's inputs;
ours is a full fp32 GEMM), and with gradients it saves the Sinkhorn history, t_max·n² fp32 per
token (1.25 KiB at n = 4, t_max = 20), where our one-op Sinkhorn recomputes it from the logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from xhc.config import HCConfigError
from xhc.norms import fp32

_LIGER_OK: Optional[bool] = None

INSTALL_HINT = "install it with `pip install liger-kernel` (or the `kernels` extra: pip install -e .[kernels])"


def liger_available() -> bool:
    """True when Liger-Kernel's mHC op imports (checked once; never raises)."""
    global _LIGER_OK
    if _LIGER_OK is None:
        try:
            from liger_kernel.transformers.functional import liger_mhc_coeffs  # noqa: F401

            _LIGER_OK = True
        except Exception:  # ImportError, no Triton, or a broken install
            _LIGER_OK = False
    return _LIGER_OK


def require() -> None:
    """Raise :class:`~xhc.config.HCConfigError` when ``kernels: liger`` is chosen and Liger-Kernel does not
    import.  (Which configurations Liger's maths covers is checked by :meth:`xhc.config.HCConfig.validate`.)"""
    if not liger_available():
        raise HCConfigError(f"HCConfig.kernels='liger' needs Liger-Kernel, which does not import: {INSTALL_HINT}")


def runnable(device: torch.device) -> bool:
    """Liger's Triton kernels run for tensors on ``device``: CUDA, or CPU under ``TRITON_INTERPRET=1``;
    never while ``torch.compile`` traces (there the compiled ops, same maths, are used)."""
    if torch.compiler.is_compiling() or not liger_available():
        return False
    from xhc.kernels.runtime import interpreting

    return device.type == "cuda" or interpreting()


def mhc_coefficients(X: torch.Tensor, W: torch.Tensor, b: torch.Tensor, alphas, t_max: int, norm_eps: float,
                     gain: Optional[torch.Tensor] = None):
    """(h_pre, h_post, H_res) of dynamic mHC by Liger-Kernel's fused op (docs/math.md §2.0).

    ``X``: ``[..., n, C]`` (fp32 or bf16/fp16; read in its dtype, accumulated in fp32);
    ``W``: ``[n² + 2n, n·C]``, the pre | post | res rows of the projection (torch ``Linear`` layout);
    ``b``: ``[n² + 2n]``; ``alphas``: (α_pre, α_post, α_res), each ``[1]``; ``gain``: the mapping-norm
    gain ``[n·C]`` or None  ->  fp32 ``[..., n]``, ``[..., n]``, ``[..., n, n]``.
    """
    from liger_kernel.transformers.functional import liger_mhc_coeffs

    if X.dtype == torch.float64:
        raise TypeError("Liger-Kernel's mHC op takes fp32/bf16/fp16 states, not float64; use kernels: eager "
                        "or compile for float64")
    W = fp32(W)
    phi = (W if gain is None else W * fp32(gain)).t().contiguous()  # [n·C, M]: x̂W = (x φ)·rsqrt(...)
    a_pre, a_post, a_res = (a.reshape(()) for a in alphas)
    return liger_mhc_coeffs(X.contiguous(), phi, fp32(b).contiguous(), a_pre, a_post, a_res,
                            allow_fp32=True, tmax=int(t_max), rms_eps=float(norm_eps), pre_eps=0.0,
                            sinkhorn_eps=0.0, post_mult=2.0)
