"""The learned stream head: DeepSeek-V4's final collapse of the N streams (docs/math.md §1.6, §2.h).

``HCConfig.reduction: learned``.  Per token, X ∈ R^{N×C}, before the model's final norm:

=============================  =============================================================
:func:`learned_head_weights`   w = σ(α · (RMSNorm(vec X) · W_headᵀ) + b) + ε       ∈ (ε, 1 + ε)^N
:func:`learned_head_collapse`  h = Σ_i w_i · X_i                                   ∈ R^C
=============================  =============================================================

RMSNorm is the unweighted flat norm of §1.5 (``norm_eps``), ε is ``sinkhorn_eps`` (DeepSeek's
``hc_eps``).  Parameters (fp32): ``hc_fn`` W_head [N, N·C], ``hc_base`` b [N], ``hc_scale`` α [1]:
the names of transformers' ``DeepseekV4HyperHead`` (Megatron-LM: ``decoder.hc_head_fn``,
``hc_head_base``, ``hc_head_scale``; docs/math.md §2.h table).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from xhc import kernels
from xhc.config import HCConfig
from xhc.norms import fp32


def learned_head_weights(X: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor,
                         norm_eps: float = 1e-6, eps: float = 1e-6, backend: str = "eager") -> torch.Tensor:
    """w = σ(α · (RMSNorm(vec X) · W_headᵀ) + b) + ε  (docs/math.md §2.h).

    ``X``: ``[..., N, C]``; ``hc_fn``: ``[N, N·C]``; ``hc_base``: ``[N]``; ``hc_scale``: ``[1]``
    -> fp32 ``[..., N]``.  ``backend``: the norm + GEMM by :func:`xhc.kernels.norm_linear`.
    """
    proj = kernels.norm_linear(X.flatten(-2), hc_fn, norm_eps, "rms", None, backend=backend)
    return torch.sigmoid(proj * fp32(hc_scale) + fp32(hc_base)) + eps


def learned_head_collapse(w: torch.Tensor, X: torch.Tensor, backend: str = "eager") -> torch.Tensor:
    """h = Σ_i w_i · X_i (fp32 accumulation) in X's dtype.

    ``w`` ``[..., N]``, ``X`` ``[..., N, C]`` -> ``[..., C]``."""
    return kernels.read(w, X, X.dtype, backend=backend)


class LearnedHead(nn.Module):
    """DeepSeek-V4's head over the streams (``reduction: learned``): ``[..., N, C]`` -> ``[..., C]``.

    Init: ``hc_fn`` = 0, ``hc_base`` = 0, ``hc_scale`` = ``gate_init``: w = ½ + ε on every stream
    (a scaled sum; the final norm removes the scale), and the gradient reaches ``hc_fn`` through α
    as for the sublayers' projections (§2.0).  (transformers initialises ``hc_fn`` ~ N(0, σ²) and
    α = 1; the two agree after loading a checkpoint.)
    """

    def __init__(self, cfg: HCConfig, hidden_size: int):
        super().__init__()
        n = cfg.n
        self.cfg, self.n, self.hidden_size = cfg, n, hidden_size
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.zeros(1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.hc_fn.zero_()
        self.hc_base.zero_()
        self.hc_scale.fill_(self.cfg.gate_init)

    def weights(self, X: torch.Tensor) -> torch.Tensor:
        """Per-token stream weights ``[..., N]`` (fp32)."""
        return learned_head_weights(X, self.hc_fn, self.hc_base, self.hc_scale, self.cfg.norm_eps,
                                    self.cfg.sinkhorn_eps, kernels.resolve_backend(self.cfg.kernels, X.device))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return learned_head_collapse(self.weights(X), X, kernels.resolve_backend(self.cfg.kernels, X.device))

    def extra_repr(self) -> str:
        return f"n={self.n}, C={self.hidden_size}"
