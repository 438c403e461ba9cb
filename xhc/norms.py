"""Mapping norms used to generate hyper-connection coefficients (docs/math.md §1.5).

All functions take the *flattened* state ``x = vec(X)`` of shape ``[..., N*C]`` (stream-major,
docs/math.md §1.2) and compute in fp32, whatever the input dtype.

- :func:`rms_norm_flat`   x̂ = x · rsqrt(mean(x²) + ε)                       (mHC, xHC pre/res/post)
- :func:`layer_norm_flat` x̃ = (x − μ) · rsqrt(mean((x − μ)²) + ε)           (xHC router)
- :func:`layer_norm_streams` per-stream LayerNorm over C, no affine            (dynamic HC, §2.a)
"""

from __future__ import annotations

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
