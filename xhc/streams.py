"""The stream equations every hyper-connection variant shares: read, write, gather, scatter (docs/math.md
§1.3, §3.4, §4.1–§4.2).

These are the *reference* definitions, one function per equation.  They are what the ``eager``
kernel backend runs (:mod:`xhc.kernels` routes ``eager`` here) and what every fused backend is
tested against in float64 (tests/test_hc_kernels.py).  The maths modules never call them directly:
they call :func:`xhc.kernels.read` / :func:`~xhc.kernels.write` / :func:`~xhc.kernels.gather`,
which dispatch on the resolved backend.  This module imports nothing but torch and
:mod:`xhc.norms`, so :mod:`xhc.kernels` can import it without a cycle.

=================================  ==================================================================
:func:`read_streams`               u_t = Σ_j h[t, j] · X_j       (mHC read §1.3, xHC dense read §3.4,
                                                                  Flash base readouts §4.1, split read §4.2)
:func:`write_streams`              X'_j = Σ_q H[j, q] · X_q + Σ_s P[j, s] · V_s   (H ``None`` = I)
                                   (mHC: P = h_post, V = [y]; xHC: X = X_a, P = diag(p)·H_post, §3.4)
:func:`gather_active`              X_a = X[I]                                             (§3.4)
:func:`scatter_active`             X'[I_j] = X_a'[j];  X'[i] = X[i] for i ∉ I             (§3.4, §3.5)
=================================  ==================================================================

Compute dtype: fp32, or float64 when any input is float64; results are cast once.
"""

from __future__ import annotations

from typing import Optional

import torch


def compute_dtype(*ts) -> torch.dtype:
    """float64 when any of ``ts`` is float64 (reference tests, gradcheck), else fp32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def read_streams(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """u_t = Σ_j h[..., t, j] · X[..., j, :]  (docs/math.md §1.3, §3.4, §4.1, §4.2).

    ``h``: ``[..., n]`` (one read) or ``[..., T, n]`` (T reads of the same state);  ``X``: ``[..., n, C]``
    ->  ``[..., C]`` or ``[..., T, C]``, accumulated in fp32 (float64 stays float64) and cast once to
    ``out_dtype`` (default: the compute dtype).
    """
    cdt = compute_dtype(h, X)
    if h.dim() == X.dim() - 1:
        u = torch.einsum("...n,...nc->...c", h.to(cdt), X.to(cdt))
    else:
        u = torch.einsum("...tn,...nc->...tc", h.to(cdt), X.to(cdt))
    return u if out_dtype is None else u.to(out_dtype)


def write_streams(X: torch.Tensor, H: Optional[torch.Tensor], P: torch.Tensor, V: torch.Tensor,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """X'_j = Σ_q H[j, q] · X_q + Σ_s P[j, s] · V_s  (docs/math.md §1.3; H multiplies from the left).

    ``X``: ``[..., k, C]`` (the whole state for the mHC family, the active rows X_a for xHC);
    ``H``: ``[..., k, k]`` or ``None`` (= I);  ``P``: ``[..., k, K]`` (mHC: h_post; xHC: diag(p)·H_post);
    ``V``: ``[..., K, C]``  ->  ``[..., k, C]`` in ``out_dtype`` (default X's dtype), one rounding.
    """
    cdt = compute_dtype(X, H, P, V)
    Xf = X.to(cdt)
    mixed = Xf if H is None else torch.einsum("...jq,...qc->...jc", H.to(cdt), Xf)
    new = mixed + torch.einsum("...js,...sc->...jc", P.to(cdt), V.to(cdt))
    return new.to(out_dtype or X.dtype)


def gather_active(X: torch.Tensor, I: torch.Tensor) -> torch.Tensor:
    """X_a = X[I]: the active streams in slot order (docs/math.md §3.4 sparse write, line 1).

    ``X``: ``[..., N, C]``;  ``I``: long ``[..., k]``  ->  ``[..., k, C]`` in X's dtype.
    """
    idx = I.unsqueeze(-1).expand(*I.shape, X.shape[-1])
    return X.gather(-2, idx)


def scatter_active(X: torch.Tensor, I: torch.Tensor, Xa_new: torch.Tensor) -> torch.Tensor:
    """X'[I_j] = X_a'[j], X'[i] = X[i] for i ∉ I  (docs/math.md §3.4 scatter, §3.5 step 5).

    Out-of-place ``scatter``: inactive streams are copied bit-exactly, and autograd sends no
    identity-path gradient to the replaced rows (their gradient flows through the gather).
    ``X``: ``[..., N, C]``;  ``I``: ``[..., k]``;  ``Xa_new``: ``[..., k, C]``  ->  ``[..., N, C]``, X's dtype.
    """
    idx = I.unsqueeze(-1).expand(*I.shape, X.shape[-1])
    return X.scatter(-2, idx, Xa_new.to(X.dtype))
