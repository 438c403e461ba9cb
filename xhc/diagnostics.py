"""Pre-training diagnostics for hyper-connections ([PEFT] App. C.5, docs/math.md §2.g, [mHC] §4).

Each check returns a small report object and, with ``strict=True`` (default), raises
:class:`DiagnosticError` with a one-line message naming what failed.

- :func:`check_doubly_stochastic`  H_res finite, ≥ 0, square, rows/columns sum to 1 within tolerance
- :func:`check_gradient_flow`      after one backward, gradients reach exactly the intended parameters
- :func:`check_sublayer_identity`  a wrapped sublayer equals ``x + f(x)`` at initialisation
- :func:`check_stack_identity`     a wrapped stack equals the plain residual stack at initialisation
- :func:`amax_gain`                composite "Amax gain": max |row sum| and |column sum| of Π_ℓ H_res
- :func:`stream_divergence`        max_{i,j} ‖X_i − X_j‖ / ‖X‖ (streams separate once training starts)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn

from xhc.hyper_connection import expand_streams, reduce_streams


class DiagnosticError(AssertionError):
    """A hyper-connection diagnostic failed."""


@dataclass
class StochasticReport:
    ok: bool
    finite: bool
    nonnegative: bool
    square: bool
    max_row_error: float
    max_col_error: float
    message: str = ""


def check_doubly_stochastic(
    H: torch.Tensor, row_tol: float = 1e-5, col_tol: float = 1e-3, strict: bool = True, name: str = "H_res"
) -> StochasticReport:
    """Validate ``H``: ``[..., n, n]`` (rows 1 ± ``row_tol``, columns 1 ± ``col_tol``; docs/math.md §2.g #2)."""
    square = H.dim() >= 2 and H.shape[-1] == H.shape[-2]
    finite = bool(torch.isfinite(H).all())
    nonneg = bool((H >= 0).all()) if finite else False
    row_err = float((H.sum(-1) - 1).abs().max()) if square and finite and H.numel() else float("inf")
    col_err = float((H.sum(-2) - 1).abs().max()) if square and finite and H.numel() else float("inf")
    problems = []
    if not square:
        problems.append(f"not square (shape {tuple(H.shape)})")
    if not finite:
        problems.append("has non-finite entries")
    if finite and not nonneg:
        problems.append(f"has negative entries (min {float(H.min()):.3g})")
    if row_err > row_tol:
        problems.append(f"row sums off by {row_err:.3g} > {row_tol:g}")
    if col_err > col_tol:
        problems.append(f"column sums off by {col_err:.3g} > {col_tol:g}")
    msg = f"{name} " + "; ".join(problems) if problems else f"{name} ok"
    report = StochasticReport(not problems, finite, nonneg, square, row_err, col_err, msg)
    if strict and problems:
        raise DiagnosticError(msg)
    return report


@dataclass
class GradientReport:
    ok: bool
    with_grad: list = field(default_factory=list)
    missing: list = field(default_factory=list)  # intended, but no (or all-zero) gradient
    unexpected: list = field(default_factory=list)  # not intended, but got a gradient
    message: str = ""


def check_gradient_flow(
    model: nn.Module,
    intended: Callable[[str, nn.Parameter], bool],
    allow_zero: Iterable[str] = (),
    strict: bool = True,
) -> GradientReport:
    """After a backward pass: every ``intended(name, p)`` parameter has a non-zero gradient (except
    names containing a substring in ``allow_zero``, e.g. gates α, which are exactly 0 at step 0
    when W = 0) and no other parameter has a gradient at all."""
    allow_zero = tuple(allow_zero)
    rep = GradientReport(True)
    for name, p in model.named_parameters():
        has = p.grad is not None and bool(p.grad.abs().sum() > 0)
        if intended(name, p):
            if has:
                rep.with_grad.append(name)
            elif not any(a in name for a in allow_zero):
                rep.missing.append(name)
        elif p.grad is not None and bool(p.grad.abs().sum() > 0):
            rep.unexpected.append(name)
    rep.ok = not rep.missing and not rep.unexpected
    parts = []
    if rep.missing:
        parts.append(f"no gradient on {len(rep.missing)} intended parameter(s), e.g. {rep.missing[0]}")
    if rep.unexpected:
        parts.append(f"gradient on {len(rep.unexpected)} frozen/unintended parameter(s), e.g. {rep.unexpected[0]}")
    rep.message = "; ".join(parts) if parts else f"gradients reach exactly the {len(rep.with_grad)} intended parameters"
    if strict and not rep.ok:
        raise DiagnosticError(rep.message)
    return rep


def check_sublayer_identity(
    hc: nn.Module, branch: Callable, x: torch.Tensor, rel_tol: float = 1e-2, strict: bool = True
) -> float:
    """At init, ``hc`` around ``branch`` on identical streams equals ``x + branch(x)`` (docs/math.md §1.6).

    ``x``: ``[..., C]``.  Returns max |X'_i − (x + f(x))| / max |x + f(x)| over all streams.
    """
    X = expand_streams(x, hc.n)
    u, ctx = hc.read(X)
    out = hc.write(X, branch(u), ctx)
    ref = (x + branch(x)).unsqueeze(-2)
    rel = float(((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).detach())
    if strict and rel > rel_tol:
        raise DiagnosticError(f"wrapped sublayer differs from x + f(x) by {rel:.3g} (relative) > {rel_tol:g}")
    return rel


def check_stack_identity(
    hcs: Sequence[nn.Module], branches: Sequence[Callable], x: torch.Tensor, n: int,
    reduction: str = "mean", rel_tol: float = 1e-5, strict: bool = True,
) -> float:
    """At init, a wrapped stack (expand, sublayers, reduce) equals the plain residual stack.

    ``reduction='mean'`` compares directly; with ``'sum'`` the output is divided by N first.
    Returns the max relative difference.
    """
    h = x
    for f in branches:
        h = h + f(h)
    X = expand_streams(x, n)
    for hc, f in zip(hcs, branches):
        u, ctx = hc.read(X)
        X = hc.write(X, f(u), ctx)
    out = reduce_streams(X, "mean" if reduction in ("mean", "sum") else reduction)
    rel = float(((out - h).abs().max() / h.abs().max().clamp_min(1e-30)).detach())
    if strict and rel > rel_tol:
        raise DiagnosticError(f"wrapped stack differs from the residual stack by {rel:.3g} (relative) > {rel_tol:g}")
    return rel


@dataclass
class AmaxGain:
    forward: float  # max absolute row sum of the composite (signal gain)
    backward: float  # max absolute column sum (gradient gain)


def amax_gain(H_list: Sequence[torch.Tensor]) -> AmaxGain:
    """Composite Amax gain over depth ([mHC] §4, Fig. 3): P = H_L ⋯ H_2 H_1 (X' = H X, left product).

    Each H: ``[n, n]`` or ``[..., n, n]`` (batched: the maximum over the batch is reported).
    """
    P = None
    for H in H_list:
        H = H.double()
        P = H if P is None else H @ P
    if P is None:
        return AmaxGain(1.0, 1.0)
    return AmaxGain(float(P.abs().sum(-1).max()), float(P.abs().sum(-2).max()))


def identity_distance_tensor(H: torch.Tensor) -> torch.Tensor:
    """Mean Frobenius distance ‖H − I‖_F over the batch, as a 0-d tensor on H's device (no host sync)."""
    eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
    return (H - eye).pow(2).sum((-1, -2)).sqrt().mean()


def identity_distance(H: torch.Tensor) -> float:
    """Mean Frobenius distance ‖H − I‖_F over the batch (logging: how far mixing is from identity)."""
    return float(identity_distance_tensor(H))


def stream_divergence(X: torch.Tensor) -> float:
    """max over tokens of max_{i,j} ‖X_i − X_j‖ / ‖X‖ for ``X``: ``[..., N, C]`` (docs/math.md §2.g #5)."""
    Xf = X.detach().double().reshape(-1, *X.shape[-2:])  # [T, N, C]
    diffs = (Xf.unsqueeze(-2) - Xf.unsqueeze(-3)).norm(dim=-1).amax((-1, -2))  # [T]
    return float((diffs / Xf.norm(dim=(-1, -2)).clamp_min(1e-30)).max())
