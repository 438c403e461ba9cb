"""Compute scaling-law fit and compute multipliers (docs/math.md §6.5).

L(C) = A · C^(−α) + E with E fixed (0.72 in [xHC]).  With E fixed the fit is linear:
log(L − E) = log A − α · log C, solved by least squares.  The compute multiplier of a baseline b
relative to a method x is M_b = C_b / C_x(L_b), where C_x(L) = (A_x / (L − E))^(1/α_x) is the
compute x needs to reach loss L.

Pure Python + math (no numpy, no torch).  The robust fits used by sweeps (E free, shared or fixed;
Huber loss on log residuals; bootstrap intervals; Chinchilla's L(P, D)) live in
:mod:`tools.sweep.fit`, the plots (:func:`tools.sweep.plots.plot_fit`) in :mod:`tools.sweep.plots`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

__all__ = ["ScalingFit", "fit_scaling_law", "loss_at", "compute_to_reach", "compute_multiplier",
           "PAPER_FITS", "PAPER_E"]

PAPER_E = 0.72
"""The irreducible loss E fixed in [xHC]'s fit (§6.5)."""


@dataclass(frozen=True)
class ScalingFit:
    """L(C) = A · C^(−α) + E."""

    A: float
    alpha: float
    E: float = PAPER_E

    def loss(self, compute: float) -> float:
        return loss_at(self, compute)

    def compute_for(self, loss: float) -> float:
        return compute_to_reach(self, loss)


PAPER_FITS: Dict[str, ScalingFit] = {
    "vanilla": ScalingFit(109.303, 0.0936),
    "mhc": ScalingFit(99.139, 0.0920),
    "xhc": ScalingFit(97.703, 0.0919),
}
"""[xHC]'s fitted coefficients (docs/math.md §6.5 table; N=4 for mHC, N=16, k=4 for xHC)."""


def fit_scaling_law(compute: Sequence[float], loss: Sequence[float], E: float = PAPER_E) -> ScalingFit:
    """Least-squares fit of log(L − E) = log A − α·log C over the given runs (§6.5).

    ``compute``: training FLOPs of each run; ``loss``: its final loss.  Needs ≥ 2 runs with
    distinct compute and every loss > E.
    """
    if len(compute) != len(loss):
        raise ValueError(f"compute has {len(compute)} values but loss has {len(loss)}: pass one loss per run")
    if len(compute) < 2:
        raise ValueError("fit_scaling_law needs at least 2 runs (compute, loss)")
    if any(c <= 0 for c in compute):
        raise ValueError("compute values must be > 0 (training FLOPs)")
    if any(l <= E for l in loss):
        raise ValueError(f"every loss must exceed E = {E}: log(L − E) is undefined otherwise")
    xs = [math.log(c) for c in compute]
    ys = [math.log(l - E) for l in loss]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("compute values must not all be equal: the slope α is undefined")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return ScalingFit(A=math.exp(my - slope * mx), alpha=-slope, E=E)


def loss_at(fit: ScalingFit, compute: float) -> float:
    """L(C) = A · C^(−α) + E."""
    return fit.A * compute ** (-fit.alpha) + fit.E


def compute_to_reach(fit: ScalingFit, loss: float) -> float:
    """C(L) = (A / (L − E))^(1/α): the compute at which ``fit`` reaches ``loss``."""
    if loss <= fit.E:
        raise ValueError(f"loss {loss} is not above E = {fit.E}: the fit never reaches it")
    return (fit.A / (loss - fit.E)) ** (1.0 / fit.alpha)


def compute_multiplier(baseline: ScalingFit, method: ScalingFit, compute: float,
                       loss: Optional[float] = None) -> float:
    """M_b = C_b / C_x(L_b) (§6.5): how much more compute the baseline needs than ``method``.

    ``compute`` is C_b, the baseline's compute; ``loss`` its loss L_b — the measured loss of its
    largest run, or (default) the fitted L_b = baseline.loss(C_b).
    """
    L_b = baseline.loss(compute) if loss is None else loss
    return compute / method.compute_for(L_b)
