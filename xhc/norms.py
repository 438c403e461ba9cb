"""Mapping norms used to generate hyper-connection coefficients (docs/math.md §1.5).

All functions take the *flattened* state ``x = vec(X)`` of shape ``[..., N*C]`` (stream-major,
docs/math.md §1.2) and compute in fp32, whatever the input dtype.

- :func:`rms_norm_flat`   x̂ = x · rsqrt(mean(x²) + ε)                       (mHC, xHC pre/res/post)
- :func:`layer_norm_flat` x̃ = (x − μ) · rsqrt(mean((x − μ)²) + ε)           (xHC router)
- :func:`layer_norm_streams` per-stream LayerNorm over C, no affine            (dynamic HC, §2.a)

The statistics and scales of the same norms when they are applied *after* the GEMM (docs/math.md
§1.5 reordering; used by the maths modules and by every kernel backend):

- :func:`flat_moments`    (μ, ν) = (mean(x), mean(x²)) of a flat state
- :func:`stream_moments`  per-row (Σ X, Σ X²) of ``[..., n, C]``, one pass
- :func:`moments_of_rows` (μ, ν) of vec(X) or of vec(X[I]) from :func:`stream_moments`
- :func:`rms_scale`       rsqrt(ν + ε)
- :func:`layer_scale`     rsqrt(ν − μ² + ε)
"""

from __future__ import annotations

from typing import Optional

import torch

DEFAULT_EPS = 1e-6


def fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to fp32 for coefficient maths; float64 stays float64 (reference tests, gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm_flat(x: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Flat RMSNorm without gain.  ``x``: ``[..., D]`` -> fp32 ``[..., D]``."""
    x = fp32(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def layer_norm_flat(x: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Flat LayerNorm without affine.  ``x``: ``[..., D]`` -> fp32 ``[..., D]``."""
    x = fp32(x)
    mu = x.mean(-1, keepdim=True)
    xc = x - mu
    return xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)


def layer_norm_streams(X: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Per-stream LayerNorm over C, no affine.  ``X``: ``[..., N, C]`` -> fp32 ``[..., N, C]``."""
    return layer_norm_flat(X, eps)


# ------------------------------------------------------------------------------------------------
# Norm statistics and scales for the norm applied after the GEMM (docs/math.md §1.5)
# ------------------------------------------------------------------------------------------------
def flat_moments(x: torch.Tensor):
    """(μ, ν) = (mean(x), mean(x²)) over the last dim, fp32, keepdim: the statistics of every
    flat norm of ``x`` (docs/math.md §1.5), computed once per token."""
    x = fp32(x)
    return x.mean(-1, keepdim=True), x.pow(2).mean(-1, keepdim=True)


def stream_moments(X: torch.Tensor):
    """Per-row sums (Σ_c X[..., i, c], Σ_c X[..., i, c]²), fp32 ``[..., n]`` each: one pass over the
    state from which the flat-norm statistics of vec(X) and of any row subset vec(X[I]) follow
    without reading X again (:func:`moments_of_rows`; docs/math.md §1.5)."""
    x = fp32(X)
    return x.sum(-1), x.pow(2).sum(-1)


def moments_of_rows(sums: torch.Tensor, sq_sums: torch.Tensor, C: int, I: Optional[torch.Tensor] = None):
    """(μ, ν) of vec(X) (``I`` None) or of vec(X[I]) from :func:`stream_moments`, keepdim ``[..., 1]``."""
    if I is not None:
        sums, sq_sums = sums.gather(-1, I), sq_sums.gather(-1, I)
    D = sums.shape[-1] * C
    return sums.sum(-1, keepdim=True) / D, sq_sums.sum(-1, keepdim=True) / D


def rms_scale(nu: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(ν + ε): the RMSNorm factor applied after the GEMM."""
    return torch.rsqrt(nu + eps)


def layer_scale(mu: torch.Tensor, nu: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(ν − μ² + ε) (variance clamped at 0): the LayerNorm factor applied after the GEMM."""
    return torch.rsqrt((nu - mu * mu).clamp_min(0.0) + eps)
