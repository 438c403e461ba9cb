"""One hyper-connection per wrapped sublayer: HC and the mHC family (docs/math.md §1.3, §1.6, §2.0–§2.e).

A framework wraps a branch F (attention or MLP, *including* its own norm) like this::

    u, ctx = hc.read(X)          # X: [..., N, C]  ->  u: [..., C]
    y = F(u)                     # the framework's own branch, on one stream's width
    X = hc.write(X, y, ctx)      # X': [..., N, C]

and, around the whole stack, ``X = expand_streams(e, N)`` after the embedding and
``h = reduce_streams(X, ...)`` (or :class:`StreamReadout`) before the final norm.

Equations (docs/math.md §1.3 and §2.0), per token, X ∈ R^{N×C}:

=================================  ============================================================
:func:`dynamic_logits`             z_g = α_g · (RMSNorm(vec X) W_g) + b_g     (static: z_g = b_g)
:func:`pre_weights`                h_pre  = σ(z_pre)                          ∈ (0, 1)^N
:func:`post_weights`               h_post = 2σ(z_post)                        ∈ (0, 2)^N
:meth:`HyperConnection.mixing`     H_res  = Φ(z_res)  (Sinkhorn / lite / Krom / I; §2.b–§2.e)
:func:`~xhc.streams.read_streams`  u   = Σ_j h_pre[j] · X_j                     (xhc/streams.py)
:func:`~xhc.streams.write_streams` X'_i = Σ_j H_res[i,j] · X_j + Σ_q h_post[i,q] · V_q  (xhc/streams.py)
:func:`hc_dynamic_coefficients`    HC tanh form ([HC] Alg. 2, §2.a)
=================================  ============================================================

``convention: deepseek_v4`` (DeepSeek-V4, docs/math.md §2.h; variants mhc and identity) changes three maps:

=================================  ============================================================
:func:`pre_weights_deepseek`       h_pre = σ(z_pre) + ε
:func:`~xhc.doubly_stochastic.sinkhorn_deepseek`  comb = Sinkhorn_DS(z_res)  (softmax + ε, column first)
:func:`mixing_from_comb`           H_res = combᵀ   (so X' = post ⊗ y + combᵀ · X)
=================================  ============================================================

The read and the write are computed by :func:`xhc.kernels.read` / :func:`xhc.kernels.write` on the
resolved kernel backend (``eager`` runs the reference functions above; docs/kernels.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from xhc import kernels
from xhc.config import MHC_FAMILY, HCConfig, HCConfigError
from xhc.doubly_stochastic import clamp_rows, kromhc_mix, mhc_lite_mix
from xhc.norms import fp32, layer_norm_streams
from xhc.streams import read_streams, write_streams  # noqa: F401  (the read and write equations, §1.3)

PEFT_READ_LOGIT = 8.0  # [PEFT] one-hot read-in bias (docs/math.md §2.g)
PEFT_PERM_LOGIT = -12.0  # [PEFT] lite/Krom non-identity logit
PEFT_DIAG_LOGIT = 8.0  # [PEFT] dynamic Sinkhorn diagonal bias


# ================================================================================================
# Equations (pure functions)
# ================================================================================================
def logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


def near_one_hot_read_bias(n: int, hot: int, delta: float = 0.01) -> torch.Tensor:
    """b_pre with σ(b)[hot] = 1 − (n−1)δ and δ elsewhere: Σ h_pre = 1 exactly (docs/math.md §2.0).  ``[n]``."""
    b = torch.full((n,), logit(delta), dtype=torch.float64)
    b[hot] = logit(1.0 - (n - 1) * delta)
    return b.float()


def uniform_read_bias(n: int) -> torch.Tensor:
    """b_pre = −ln(n−1): h_pre = 1/n on every stream (docs/math.md §3.4, §5.4).  ``[n]``."""
    return torch.full((n,), -math.log(n - 1) if n > 1 else 0.0)


def peft_read_bias(n: int, hot: int) -> torch.Tensor:
    """[PEFT] dynamic read-in: +8 on the hot stream, the rest sharing 1 − σ(8) (docs/math.md §2.g)."""
    rest = (1.0 - 1.0 / (1.0 + math.exp(-PEFT_READ_LOGIT))) / (n - 1)
    b = torch.full((n,), logit(rest), dtype=torch.float64)
    b[hot] = PEFT_READ_LOGIT
    return b.float()


def dynamic_logits(
    x_hat: torch.Tensor, W: torch.Tensor, alpha: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """z = α · (x̂ W) + b  (docs/math.md §2.0).

    ``x_hat``: ``[..., N·C]`` fp32;  ``W``: ``[d, N·C]`` (torch ``Linear`` layout);  ``alpha``: ``[1]``;
    ``b``: ``[d]``  ->  ``[..., d]`` fp32.
    """
    return alpha * F.linear(x_hat, fp32(W)) + b


def pre_weights(z_pre: torch.Tensor) -> torch.Tensor:
    """h_pre = σ(z_pre)  ([mHC] Eq. 8).  ``[..., N]``."""
    return torch.sigmoid(z_pre)


def pre_weights_deepseek(z_pre: torch.Tensor, eps: float) -> torch.Tensor:
    """h_pre = σ(z_pre) + ε  (DeepSeek-V4, docs/math.md §2.h; ε = ``sinkhorn_eps``).  ``[..., N]``."""
    return torch.sigmoid(z_pre) + eps


def mixing_from_comb(comb: torch.Tensor) -> torch.Tensor:
    """H_res = combᵀ: DeepSeek-V4 mixes out_k = Σ_j comb[j, k] · X_j (docs/math.md §2.h).  ``[..., N, N]``."""
    return comb.transpose(-1, -2)


def post_weights(z_post: torch.Tensor) -> torch.Tensor:
    """h_post = 2σ(z_post)  ([mHC] Eq. 8).  ``[..., N]``."""
    return 2.0 * torch.sigmoid(z_post)


def expand_streams(e: torch.Tensor, n: int) -> torch.Tensor:
    """Entry: X^(0)_i = e for every stream (docs/math.md §1.6).  ``[..., C]`` -> ``[..., N, C]``."""
    return e.unsqueeze(-2).expand(*e.shape[:-1], n, e.shape[-1]).contiguous()


def reduce_streams(X: torch.Tensor, mode: str = "sum", logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exit (docs/math.md §1.6): ``sum`` (default), ``mean``, or ``softmax`` readout with N ``logits``.

    ``X``: ``[..., N, C]`` -> ``[..., C]`` in X's dtype.
    """
    if mode == "sum":
        return X.sum(-2)
    if mode == "mean":
        return X.mean(-2)
    if mode == "softmax":
        if logits is None:
            raise ValueError("reduce_streams(mode='softmax') needs the readout logits")
        w = torch.softmax(fp32(logits), -1)
        return torch.einsum("n,...nc->...c", w, fp32(X)).to(X.dtype)
    raise ValueError(f"reduce_streams mode={mode!r}: allowed values are sum, mean, softmax")


def hc_dynamic_coefficients(
    X: torch.Tensor,
    a_pre: torch.Tensor,
    S_res: torch.Tensor,
    a_post: torch.Tensor,
    w_pre: Optional[torch.Tensor],
    W_r: Optional[torch.Tensor],
    w_post: Optional[torch.Tensor],
    s_alpha: Optional[torch.Tensor],
    s_beta: Optional[torch.Tensor],
    use_tanh: bool = True,
    eps: float = 1e-6,
):
    """[HC] coefficients (docs/math.md §2.a).  A group is static when its dynamic weight is ``None``.

    h_pre[i]   = a_pre[i]   + s_α · tanh(X̄_i · w_pre)
    H_res[j,i] = S_res[j,i] + s_α · tanh(X̄_i · W_r[:, j])      (column i is predicted from stream i)
    h_post[i]  = a_post[i]  + s_β · tanh(X̄_i · w_post)

    ``X``: ``[..., N, C]``  ->  (h_pre ``[..., N]``, H_res ``[..., N, N]``, h_post ``[..., N]``), fp32.
    """
    h_pre, H_res, h_post = fp32(a_pre), fp32(S_res), fp32(a_post)
    if w_pre is None and W_r is None and w_post is None:
        return h_pre, H_res, h_post
    act = torch.tanh if use_tanh else (lambda t: t)
    Xbar = layer_norm_streams(X, eps)  # [..., N, C]
    if w_pre is not None:
        h_pre = h_pre + s_alpha * act(Xbar @ fp32(w_pre))  # [..., N]
    if W_r is not None:
        H_res = H_res + s_alpha * act(Xbar @ fp32(W_r)).transpose(-1, -2)  # [..., N(j), N(i)]
    if w_post is not None:
        h_post = h_post + s_beta * act(Xbar @ fp32(w_post))
    return h_pre, H_res, h_post


def mixing_sinkhorn(Z: torch.Tensor, cfg: HCConfig, backend: str) -> torch.Tensor:
    """Sinkhorn of the residual logits ``Z`` ``[..., n, n]`` with the config's settings (§1.4), by
    :func:`xhc.kernels.sinkhorn` (``eager`` follows ``cfg.sinkhorn_recompute``: unrolled autograd or
    the recompute op; the fused backends always use the one-op Sinkhorn).
    """
    return kernels.sinkhorn(Z, cfg.sinkhorn_iters, cfg.sinkhorn_eps, cfg.sinkhorn_order, backend=backend,
                            recompute=cfg.sinkhorn_recompute)


# ================================================================================================
# Module
# ================================================================================================
@dataclass
class HCContext:
    """What :meth:`HyperConnection.read` hands to :meth:`HyperConnection.write` (fp32 tensors)."""

    h_pre: Optional[torch.Tensor]  # [..., N] (None when ablated: uniform 1/N)
    h_post: Optional[torch.Tensor]  # [..., N] (None when ablated: ones)
    H_res: Optional[torch.Tensor]  # [..., N, N] (None: identity)


class HyperConnection(nn.Module):
    """Hyper-connection around one sublayer, for ``variant ∈ {hc, mhc, mhc_lite, kromhc, identity}``.

    Args:
        cfg: the model's :class:`~xhc.config.HCConfig`.
        hidden_size: C, the width of one stream.
        layer_index: ℓ, the global 0-based *sublayer* index (attention of layer i is 2i, its MLP
            2i+1); the near-one-hot read starts on stream ℓ mod N (docs/math.md §2.0, §8 #9).

    Parameters (all fp32; biases and gates 1-D so no-weight-decay rules catch them):

    ==============================  ====================  =========================================
    name                            shape                 present when
    ==============================  ====================  =========================================
    ``b_pre``, ``b_post``           ``[N]``               mHC family, group not ablated
    ``b_res``                       ``[R]``               mhc / mhc_lite / kromhc, not ablated
    ``W_pre``, ``W_post``           ``[N, N·C]``          dynamic, group not ablated
    ``W_res``                       ``[R, N·C]``          dynamic, R > 0
    ``alpha_pre/post/res``          ``[1]``               dynamic, group present
    ``norm_weight``                 ``[N·C]``             dynamic and ``mapping_norm_affine``
    ``a_pre``, ``a_post``           ``[N]``               hc
    ``S_res``                       ``[N, N]``            hc
    ``w_pre``, ``w_post``; ``W_r``  ``[C]``; ``[C, N]``   hc, dynamic
    ``s_alpha``, ``s_beta``         ``[1]``               hc, dynamic
    ==============================  ====================  =========================================
    """

    def __init__(self, cfg: HCConfig, hidden_size: int, layer_index: int = 0):
        super().__init__()
        if cfg.variant not in MHC_FAMILY + ("hc",):
            raise HCConfigError(
                f"HCConfig.variant={cfg.variant!r} is not handled by HyperConnection: "
                f"use one of hc, {', '.join(MHC_FAMILY)} (xHC variants use xhc.xhc.XHCSublayer)"
            )
        self.cfg = cfg
        self.n = cfg.n
        self.hidden_size = hidden_size
        self.layer_index = layer_index
        n, nc = cfg.n, cfg.n * hidden_size
        z = lambda *shape: nn.Parameter(torch.zeros(*shape))  # noqa: E731
        if cfg.variant == "hc":
            self.a_pre = None if cfg.ablate_pre else z(n)
            self.S_res = None if cfg.ablate_res else z(n, n)
            self.a_post = None if cfg.ablate_post else z(n)
            if cfg.dynamic:
                self.w_pre = None if cfg.ablate_pre else z(hidden_size)
                self.W_r = None if cfg.ablate_res else z(hidden_size, n)
                self.w_post = None if cfg.ablate_post else z(hidden_size)
                self.s_alpha = z(1) if not (cfg.ablate_pre and cfg.ablate_res) else None
                self.s_beta = None if cfg.ablate_post else z(1)
        else:
            R = cfg.num_res_logits
            self.R = R
            self.b_pre = None if cfg.ablate_pre else z(n)
            self.b_post = None if cfg.ablate_post else z(n)
            self.b_res = z(R) if R > 0 else None
            if cfg.dynamic:
                self.W_pre = None if cfg.ablate_pre else z(n, nc)
                self.W_post = None if cfg.ablate_post else z(n, nc)
                self.W_res = z(R, nc) if R > 0 else None
                self.alpha_pre = None if cfg.ablate_pre else z(1)
                self.alpha_post = None if cfg.ablate_post else z(1)
                self.alpha_res = z(1) if R > 0 else None
                self.norm_weight = nn.Parameter(torch.ones(nc)) if cfg.mapping_norm_affine else None
        kernels.check_available(cfg.kernels)  # kernels: liger needs Liger-Kernel
        self.reset_parameters()

    # --------------------------------------------------------------------------------------------
    @property
    def _read_hot(self) -> int:
        return self.layer_index % self.n

    def _read_init(self) -> str:
        mode = self.cfg.read_init
        return "one_hot" if mode == "auto" else mode

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise per docs/math.md §2.0 (``preset='spec'``) or [PEFT] (``preset='peft_paper'``, §2.g)."""
        cfg, n = self.cfg, self.n
        for p in self.parameters():
            p.zero_()
        if getattr(self, "norm_weight", None) is not None:
            self.norm_weight.fill_(1.0)
        if cfg.variant == "hc":
            return self._reset_hc()
        static_uniform = cfg.preset == "peft_paper" and cfg.variant == "mhc" and not cfg.dynamic
        if self.b_pre is not None:
            if static_uniform or self._read_init() == "uniform":
                self.b_pre.copy_(uniform_read_bias(n))
            elif cfg.preset == "peft_paper":
                self.b_pre.copy_(peft_read_bias(n, self._read_hot))
            else:
                self.b_pre.copy_(near_one_hot_read_bias(n, self._read_hot, cfg.read_delta))
        if self.b_res is not None:
            self.b_res.copy_(self._res_bias_init(static_uniform))
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            if getattr(self, name, None) is not None:
                getattr(self, name).fill_(cfg.gate_init)
        if cfg.init_noise > 0:
            self._add_init_noise(cfg.init_noise)

    def _res_bias_init(self, static_uniform: bool) -> torch.Tensor:
        cfg, n = self.cfg, self.n
        peft = cfg.preset == "peft_paper"
        if cfg.variant == "mhc":
            if static_uniform:
                return torch.zeros(n * n)  # H_res = 11ᵀ/n ([PEFT] static Sinkhorn)
            if peft:
                return (PEFT_DIAG_LOGIT * torch.eye(n)).flatten()  # ≡ −8 off-diagonal
            return (cfg.res_offdiag_init * (1 - torch.eye(n))).flatten()
        off = PEFT_PERM_LOGIT if peft else cfg.res_offdiag_init
        b = torch.full((self.R,), off)
        if cfg.variant == "mhc_lite":
            b[0] = 0.0  # r = 0 is the identity permutation
        else:  # kromhc: [identity, swap] per factor
            b[0::2] = 0.0
        return b

    def _add_init_noise(self, sigma: float) -> None:
        """[PEFT] static Sinkhorn: N(0, σ²) on every logit, then renormalise h_pre to sum 1."""
        g = torch.Generator().manual_seed(1234 + self.layer_index)
        for name in ("b_pre", "b_post", "b_res"):
            p = getattr(self, name, None)
            if p is not None:
                p.add_(sigma * torch.randn(p.shape, generator=g))
        if getattr(self, "b_pre", None) is not None:
            h = torch.sigmoid(self.b_pre.double())
            h = h / h.sum()
            self.b_pre.copy_((torch.log(h) - torch.log1p(-h)).float())

    def _reset_hc(self) -> None:
        cfg, n = self.cfg, self.n
        if self.a_pre is not None:
            if self._read_init() == "uniform":
                self.a_pre.fill_(1.0 / n)
            else:
                self.a_pre[self._read_hot] = 1.0  # e_{ℓ mod N}
        if self.S_res is not None:
            self.S_res.copy_(torch.eye(n))
        if self.a_post is not None:
            self.a_post.fill_(1.0)
        for name in ("s_alpha", "s_beta"):
            if getattr(self, name, None) is not None:
                getattr(self, name).fill_(cfg.gate_init)

    # --------------------------------------------------------------------------------------------
    def coefficients(self, X: torch.Tensor):
        """(h_pre, h_post, H_res) for the state ``X``: ``[..., N, C]``; ``None`` marks a neutral form."""
        cfg = self.cfg
        if cfg.variant == "hc":
            return self._hc_coefficients(X)
        if kernels.liger_runs(cfg.kernels, X.device):
            return self._liger_coefficients(X)
        z_pre, z_post, z_res = self._logits(X)
        if cfg.convention == "deepseek_v4":
            h_pre = None if z_pre is None else pre_weights_deepseek(z_pre, cfg.sinkhorn_eps)
            h_post = None if z_post is None else post_weights(z_post)
            H_res = None if z_res is None else self.mixing(z_res)
            return h_pre, h_post, H_res
        h_pre = None if z_pre is None else pre_weights(z_pre)
        h_post = None if z_post is None else post_weights(z_post)
        H_res = None if z_res is None else self.mixing(z_res)
        return h_pre, h_post, H_res

    def _liger_coefficients(self, X: torch.Tensor):
        """Dynamic mHC coefficients by Liger-Kernel's fused op (``kernels: liger``, xhc/kernels/liger.py):
        the same maps as :meth:`_logits` + :meth:`mixing` for the configurations HCConfig allows."""
        h_pre, h_post, H = kernels.mhc_coefficients(
            X, torch.cat([self.W_pre, self.W_post, self.W_res], 0), torch.cat([self.b_pre, self.b_post, self.b_res]),
            (self.alpha_pre, self.alpha_post, self.alpha_res), self.cfg.sinkhorn_iters, self.cfg.norm_eps,
            self.norm_weight)
        return h_pre, h_post, (clamp_rows(H) if self.cfg.row_sum_clamp else H)

    def _logits(self, X: torch.Tensor):
        """(z_pre, z_post, z_res) with shapes [..., N], [..., N], [..., R] (fp32)."""
        groups = [(self.b_pre, "pre"), (self.b_post, "post"), (self.b_res, "res")]
        if not self.cfg.dynamic:
            batch = X.shape[:-2]
            return [None if b is None else fp32(b).expand(*batch, b.shape[0]) for b, _ in groups]
        present = [(b, getattr(self, f"W_{g}"), getattr(self, f"alpha_{g}")) for b, g in groups if b is not None]
        W = torch.cat([w for _, w, _ in present], 0)
        # one GEMM for all groups, [..., d_total]; fused backends apply the norm after it (§1.5)
        proj = kernels.norm_linear(X.flatten(-2), W, self.cfg.norm_eps, "rms", self.norm_weight,
                                   backend=self.backend(X))
        out, start = [], 0
        it = iter(present)
        for b, _ in groups:
            if b is None:
                out.append(None)
                continue
            _, w, alpha = next(it)
            out.append(alpha * proj[..., start : start + w.shape[0]] + b)  # z_g = α_g·(x̂W_g) + b_g
            start += w.shape[0]
        return out

    def backend(self, X: torch.Tensor) -> str:
        """The resolved kernel backend for tensors like ``X`` (:func:`xhc.kernels.resolve_backend`)."""
        return kernels.resolve_backend(self.cfg, X.device)

    def mixing(self, z_res: torch.Tensor) -> torch.Tensor:
        """H_res = Φ(z_res) (docs/math.md §2.0 table), optional residual-logit dropout, optional row clamp."""
        cfg, n = self.cfg, self.n
        if self.training and cfg.res_logit_dropout > 0:
            z_res = _residual_logit_dropout(z_res, cfg.res_logit_dropout, cfg.variant, n)
        if cfg.variant == "mhc" and cfg.convention == "deepseek_v4":  # §2.h: no row clamp (rows of combᵀ < 1)
            return mixing_from_comb(self.comb(z_res))
        if cfg.variant == "mhc":
            H = mixing_sinkhorn(z_res.unflatten(-1, (n, n)), cfg, self.backend(z_res))
            return clamp_rows(H) if cfg.row_sum_clamp else H
        if cfg.variant == "mhc_lite":
            return mhc_lite_mix(z_res, n)
        return kromhc_mix(z_res, n)

    def comb(self, z_res: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4's comb ``[..., N, N]`` from the residual logits ``[..., N²]`` (§2.h; H_res = combᵀ)."""
        cfg, n = self.cfg, self.n
        return kernels.sinkhorn_deepseek(z_res.unflatten(-1, (n, n)), cfg.sinkhorn_iters, cfg.sinkhorn_eps,
                                         backend=self.backend(z_res), recompute=cfg.sinkhorn_recompute)

    def _hc_coefficients(self, X: torch.Tensor):
        n, batch = self.n, X.shape[:-2]
        dt = fp32(X).dtype
        a_pre = self.a_pre if self.a_pre is not None else torch.full((n,), 1.0 / n, dtype=dt, device=X.device)
        S_res = self.S_res if self.S_res is not None else torch.eye(n, dtype=dt, device=X.device)
        a_post = self.a_post if self.a_post is not None else torch.ones(n, dtype=dt, device=X.device)
        dyn = self.cfg.dynamic
        h_pre, H_res, h_post = hc_dynamic_coefficients(
            X, fp32(a_pre), fp32(S_res), fp32(a_post),
            getattr(self, "w_pre", None) if dyn else None,
            getattr(self, "W_r", None) if dyn else None,
            getattr(self, "w_post", None) if dyn else None,
            getattr(self, "s_alpha", None), getattr(self, "s_beta", None),
            use_tanh=self.cfg.hc_tanh, eps=self.cfg.norm_eps,
        )
        if self.cfg.ablate_res:  # ablated groups have no parameters: neutral constants above
            H_res = None
        if H_res is not None and H_res.dim() == 2:
            H_res = H_res.expand(*batch, n, n)
        if h_pre.dim() == 1:
            h_pre = h_pre.expand(*batch, n)
        if h_post.dim() == 1:
            h_post = h_post.expand(*batch, n)
        return h_pre, h_post, H_res

    # --------------------------------------------------------------------------------------------
    def _fused_mhc(self, X: torch.Tensor) -> bool:
        """Whether the read and write run as the fused mHC kernels (:mod:`xhc.kernels.mhc_pre`,
        :mod:`xhc.kernels.mhc_post`): the kernels room answers (:func:`xhc.kernels.mhc_fused`) for the
        configuration, tensors like ``X``, the training mode and whether every group has its parameters."""
        groups = all(getattr(self, b, None) is not None for b in ("b_pre", "b_post", "b_res"))  # static maps: none
        return kernels.mhc_fused(self.cfg, X, self.training, groups)

    def read(self, X: torch.Tensor):
        """``X``: ``[..., N, C]`` -> (u ``[..., C]`` in X's dtype, :class:`HCContext`)."""
        if self._fused_mhc(X):
            cfg = self.cfg
            u, h_pre, h_post, H_res = kernels.mhc_read(
                X, self.W_pre, self.W_post, self.W_res, self.b_pre, self.b_post, self.b_res, self.alpha_pre,
                self.alpha_post, self.alpha_res, self.norm_weight, cfg.norm_eps, cfg.sinkhorn_iters, cfg.sinkhorn_eps,
                cfg.sinkhorn_order, cfg.row_sum_clamp, cfg.convention)
            return u, HCContext(h_pre, h_post, H_res)
        h_pre, h_post, H_res = self.coefficients(X)
        h_read = h_pre if h_pre is not None else torch.full(X.shape[:-1], 1.0 / self.n, dtype=fp32(X).dtype, device=X.device)
        u = kernels.read(h_read, X, X.dtype, backend=self.backend(X))
        return u, HCContext(h_pre, h_post, H_res)

    def write(self, X: torch.Tensor, y: torch.Tensor, ctx: HCContext, seq=None) -> torch.Tensor:
        """``X``: ``[..., N, C]``, branch output ``y``: ``[..., C]`` -> X' ``[..., N, C]``.

        ``seq`` is accepted for interface parity with xHC (the mHC family is per token).
        """
        if ctx.h_post is not None and ctx.H_res is not None and self._fused_mhc(X):
            return kernels.mhc_write(X, ctx.H_res, ctx.h_post, y)
        h_post = ctx.h_post if ctx.h_post is not None else torch.ones(X.shape[:-1], dtype=fp32(X).dtype, device=X.device)
        return kernels.write(None, None, X, ctx.H_res, h_post.unsqueeze(-1), y.unsqueeze(-2), X.dtype,
                             backend=self.backend(X))

    def forward(self, X: torch.Tensor, branch) -> torch.Tensor:
        """Convenience: ``write(X, branch(u), ctx)`` with ``u, ctx = read(X)``."""
        u, ctx = self.read(X)
        return self.write(X, branch(u), ctx)

    def extra_repr(self) -> str:
        c = self.cfg
        conv = "" if c.convention == "paper" else f", convention={c.convention}"
        return (f"variant={c.variant}, n={c.n}, dynamic={c.dynamic}, C={self.hidden_size}, "
                f"layer_index={self.layer_index}{conv}")


def _residual_logit_dropout(z: torch.Tensor, p: float, variant: str, n: int) -> torch.Tensor:
    """[PEFT] App. C.3: set random residual logits to −inf before Φ (training only).

    Identity entries are never dropped (mHC diagonal, lite permutation 0, Krom 'identity' logit),
    so no row or column can be fully masked.
    """
    drop = torch.rand_like(z) < p
    keep = torch.zeros(z.shape[-1], dtype=torch.bool, device=z.device)
    if variant == "mhc":
        keep.view(n, n).fill_diagonal_(True)
    elif variant == "mhc_lite":
        keep[0] = True
    else:
        keep[0::2] = True
    return z.masked_fill(drop & ~keep, float("-inf"))


class StreamReadout(nn.Module):
    """Exit reduction (docs/math.md §1.6): ``sum``, ``mean`` or a learned ``softmax`` readout (N logits, init 0).

    ``reduction: learned`` is :class:`xhc.head.LearnedHead` (per-token weights; it needs C)."""

    def __init__(self, n: int, mode: str = "sum"):
        super().__init__()
        if mode not in ("sum", "mean", "softmax"):
            raise HCConfigError(f"HCConfig.reduction={mode!r} is invalid here: allowed values are sum, mean, softmax "
                                f"(reduction 'learned' is xhc.head.LearnedHead)")
        self.n, self.mode = n, mode
        self.logits = nn.Parameter(torch.zeros(n)) if mode == "softmax" else None

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        """``X``: ``[..., N, C]`` -> ``[..., C]``."""
        return reduce_streams(X, self.mode, self.logits)
