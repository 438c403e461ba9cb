"""Robust scaling-law fits with bootstrap intervals (docs/math.md §6.5).

The fits follow the recipe the scaling-law literature now recommends (Hoffmann et al. 2022,
"Chinchilla"; Besiroglu et al. 2024, "Chinchilla scaling: a replication attempt"):

* the model is written in log space with log-sum-exp,
  ``log L̂ = LSE(a − α·log C, e)`` for ``L(C) = E + A·C^(−α)`` (``A = exp(a)``, ``E = exp(e)``), and
  ``log L̂ = LSE(a − α·log P, b − β·log D, e)`` for Chinchilla's ``L(P, D) = E + A/P^α + B/D^β``;
* the objective is the Huber loss (δ = 1e-3) of the residuals ``log L̂ − log L``;
* it is minimised with L-BFGS (scipy) from a grid of initial points, keeping the best;
* E is either free (one per variant), ``shared`` (one E for all variants, fitted jointly: the
  irreducible loss is a property of the data, not of the architecture) or fixed (the paper fixes
  E = 0.72);
* confidence intervals come from a bootstrap over arms and seeds: each replicate resamples the
  arms (distinct budgets) of every variant with replacement and, within each drawn arm, its seeds
  with replacement, and refits, starting from the full-data optimum (and, when E is
  fitted, also from E = half the smallest loss).

Compute multipliers (§6.5) and their intervals are evaluated replicate by replicate.  The maths
works on plain floats; :mod:`xhc.scaling` keeps the closed-form E-fixed fit and the paper's
constants.  :func:`fit_sweep` applies it to a collected sweep and writes ``fit.json`` / ``fit.md``.
(This module needs numpy and scipy, so it lives on the tools floor, not in ``xhc``.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from xhc.scaling import ScalingFit

from tools.sweep.collect import _finite
from tools.sweep.gpu_time import add_gpu_hours, gpu_time_markdown
from tools.sweep.plots import plot_sweep
from tools.sweep.runner import _write_json
from tools.sweep.spec import Sweep, SweepError

__all__ = ["FitError", "PowerLawFit", "ChinchillaFit", "fit_power_laws", "fit_power_law", "fit_chinchilla",
           "multiplier_interval", "loss_at_interval", "loss_difference_interval", "fit_warnings", "significance",
           "HUBER_DELTA", "fit_sweep", "fit_markdown"]

HUBER_DELTA = 1e-3
"""δ of the Huber loss on log-space residuals (Hoffmann et al. 2022)."""

_ALPHA_BOUNDS = (1e-4, 5.0)
_ALPHA_GRID = (0.05, 0.15, 0.4, 1.0)
_E_FRACTIONS = (0.2, 0.5, 0.8)  # initial E as a fraction of the smallest loss


class FitError(ValueError):
    """The points cannot determine the requested law (too few, non-positive, ...)."""


def _huber(r: np.ndarray, delta: float) -> Tuple[np.ndarray, np.ndarray]:
    """Huber loss and its derivative, both divided by δ² (so the objective is O(1) near the optimum
    and L-BFGS's relative stopping rule is meaningful for δ = 1e-3)."""
    a = np.abs(r)
    quad = a <= delta
    val = np.where(quad, 0.5 * r * r, delta * (a - 0.5 * delta)) / delta ** 2
    grad = np.clip(r, -delta, delta) / delta ** 2
    return val, grad


def _minimize(fun, x0s: Sequence[np.ndarray], bounds) -> Tuple[np.ndarray, float]:
    from scipy.optimize import minimize

    best_x, best_f = None, math.inf
    for x0 in x0s:
        res = minimize(fun, np.asarray(x0, float), jac=True, method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": 2000, "ftol": 1e-12, "gtol": 1e-9})
        if np.all(np.isfinite(res.x)) and res.fun < best_f:
            best_x, best_f = res.x, float(res.fun)
    if best_x is None:
        raise FitError("L-BFGS found no finite optimum from any initial point")
    return best_x, best_f


def arm_cells(keys: Sequence) -> List[np.ndarray]:
    """Indices of the runs grouped by arm: runs with the same key (the same compute, or the same
    (size, tokens)) are seeds of one arm."""
    order: Dict[object, List[int]] = {}
    for i, k in enumerate(keys):
        order.setdefault(k, []).append(i)
    return [np.asarray(v) for v in order.values()]


def resample_arms(cells: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """One bootstrap resample of a sweep: the arms with replacement and, within each drawn arm, its
    seeds with replacement (so an interval carries seed noise as well as the spread between arms)."""
    gi = rng.integers(0, len(cells), len(cells))
    if all(len(c) == 1 for c in cells):  # one seed per arm: nothing to draw within
        return np.array([cells[g][0] for g in gi])
    return np.concatenate([cells[g][rng.integers(0, len(cells[g]), len(cells[g]))] for g in gi])


def _percentile_interval(values: Sequence[float], level: float) -> Tuple[float, float]:
    v = np.asarray([x for x in values if np.isfinite(x)], float)
    if v.size == 0:
        return (math.nan, math.nan)
    q = 100 * (1 - level) / 2
    lo, hi = np.percentile(v, [q, 100 - q])
    return float(lo), float(hi)


# ================================================================================================
# L(C) = E + A·C^(−α), one or several variants
# ================================================================================================
@dataclass
class PowerLawFit:
    """L(C) = E + A·C^(−α) for one variant, with bootstrap replicates and intervals."""

    name: str
    fit: ScalingFit
    E_mode: str                      # "free", "shared" or "fixed"
    n_points: int
    objective: float
    replicates: List[ScalingFit] = field(default_factory=list)
    level: float = 0.95
    n_budgets: int = 0               # distinct compute values (arms); n_points counts seeds too
    min_loss: float = math.nan
    kept_draws: int = 0              # replicates that could not resample (too few distinct arms)

    @property
    def A(self) -> float:
        return self.fit.A

    @property
    def alpha(self) -> float:
        return self.fit.alpha

    @property
    def E(self) -> float:
        return self.fit.E

    def interval(self, param: str) -> Tuple[float, float]:
        """Percentile bootstrap interval of ``A``, ``alpha`` or ``E`` (a point when E is fixed)."""
        if not self.replicates:
            return (math.nan, math.nan)
        return _percentile_interval([getattr(r, param) for r in self.replicates], self.level)

    def loss(self, compute: float) -> float:
        return self.fit.loss(compute)

    def as_dict(self) -> dict:
        out = {"name": self.name, "E_mode": self.E_mode, "n_points": self.n_points, "n_budgets": self.n_budgets,
               "bootstrap": len(self.replicates), "level": self.level}
        for p in ("E", "A", "alpha"):
            out[p] = getattr(self.fit, p)
            out[f"{p}_interval"] = list(self.interval(p))
        return out


def _group_objective(theta: np.ndarray, groups, e_fixed: Optional[float], delta: float):
    """Huber objective of the shared-E / fixed-E model; ``groups`` = (x − x0, y, group index, count)."""
    x, y, gi, ng = groups
    off = 0 if e_fixed is not None else 1
    e = e_fixed if e_fixed is not None else theta[0]
    a, al = theta[off::2][:ng], theta[off + 1::2][:ng]
    u1 = a[gi] - al[gi] * x
    m = np.logaddexp(u1, e)
    w = np.exp(u1 - m)
    val, dr = _huber(m - y, delta)
    g = np.empty_like(theta)
    g[off::2] = np.bincount(gi, dr * w, ng)
    g[off + 1::2] = np.bincount(gi, -dr * w * x, ng)
    if off:
        g[0] = float((dr * (1 - w)).sum())
    return float(val.sum()), g


def _fit_groups(groups_xy, x0: float, e_fixed: Optional[float], delta: float,
                starts: Optional[List[np.ndarray]] = None):
    """Best ``theta`` (centred intercepts) of the grouped model and its objective."""
    off = 0 if e_fixed is not None else 1
    bounds = ([(None, None)] if off else []) + [(None, None), _ALPHA_BOUNDS] * len(groups_xy)
    centred = [(x - x0, y) for x, y in groups_xy]
    packed = (np.concatenate([x for x, _ in centred]), np.concatenate([y for _, y in centred]),
              np.concatenate([np.full(len(x), j) for j, (x, _) in enumerate(centred)]), len(centred))
    if starts is None:
        lmin = min(float(np.exp(y).min()) for _, y in groups_xy)
        e_grid = [e_fixed] if e_fixed is not None else [math.log(f * lmin) for f in _E_FRACTIONS]
        starts = []
        for e0 in e_grid:
            for al0 in _ALPHA_GRID:
                th = [e0] if off else []
                for x, y in centred:
                    gap = max(float(np.exp(y).mean()) - math.exp(e0), 1e-3 * float(np.exp(y).mean()))
                    th += [math.log(gap) + al0 * float(x.mean()), al0]
                starts.append(np.array(th, float))
    return _minimize(lambda th: _group_objective(th, packed, e_fixed, delta), starts, bounds)


def _unpack(theta: np.ndarray, n_groups: int, x0: float, e_fixed: Optional[float]) -> List[ScalingFit]:
    off = 0 if e_fixed is not None else 1
    E = math.exp(e_fixed) if e_fixed is not None else math.exp(theta[0])
    out = []
    for j in range(n_groups):
        a_c, al = float(theta[off + 2 * j]), float(theta[off + 2 * j + 1])
        out.append(ScalingFit(A=math.exp(a_c + al * x0), alpha=al, E=E))
    return out


def _check_points(name: str, compute: Sequence[float], loss: Sequence[float], n_params: int, what: str) -> None:
    if len(compute) != len(loss):
        raise FitError(f"{name}: {len(compute)} compute values but {len(loss)} losses; pass one loss per run")
    bad = [(c, l) for c, l in zip(compute, loss) if not (c > 0 and l > 0 and math.isfinite(c) and math.isfinite(l))]
    if bad:
        raise FitError(f"{name}: compute and loss must be finite and > 0, got {bad[0]}")
    distinct = len(set(compute))
    if distinct < n_params:
        raise FitError(f"{name}: fitting {what} needs at least {n_params} runs with distinct compute, got {distinct}; "
                       "add budgets to the sweep or fix E (fit.E: <value>)")


def fit_power_laws(data: Mapping[str, Tuple[Sequence[float], Sequence[float]]],
                   E: Union[str, float] = "free", delta: float = HUBER_DELTA, bootstrap: int = 200,
                   seed: int = 0, level: float = 0.95) -> Dict[str, PowerLawFit]:
    """Fit L(C) = E + A·C^(−α) to every variant of ``data`` (name → (compute list, loss list)).

    ``E``: ``"free"`` (each variant its own E: 3 parameters, needs ≥ 3 distinct budgets),
    ``"shared"`` (one E for all variants, fitted jointly: each variant needs ≥ 2 budgets and all
    together more runs than 1 + 2·variants parameters), or a number (fixed, 2 parameters each).
    ``bootstrap``: replicates (0: none) resampling each variant's runs with replacement.
    """
    if not data:
        raise FitError("no variants to fit")
    if isinstance(E, str) and E not in ("free", "shared"):
        raise FitError(f"E={E!r}: use 'free', 'shared' or a number")
    if not isinstance(E, str) and not (E > 0):
        raise FitError(f"E={E!r}: a fixed E must be > 0")
    names = list(data)
    cols = {n: (np.asarray(data[n][0], float), np.asarray(data[n][1], float)) for n in names}
    if E == "shared":
        for n in names:
            _check_points(n, data[n][0], data[n][1], 2, "L(C) with a shared E (per variant A, α)")
        total = sum(len(cols[n][0]) for n in names)
        if total < 1 + 2 * len(names):
            raise FitError(f"a shared-E fit of {len(names)} variants has {1 + 2 * len(names)} parameters but only "
                           f"{total} runs; add budgets or fix E")
    elif E == "free":
        for n in names:
            _check_points(n, data[n][0], data[n][1], 3, "L(C) = E + A·C^(−α) with E free")
    else:
        for n in names:
            _check_points(n, data[n][0], data[n][1], 2, f"L(C) with E fixed at {E}")
            if np.any(cols[n][1] <= E):
                raise FitError(f"{n}: every loss must exceed the fixed E = {E}")
    e_fixed = math.log(E) if not isinstance(E, str) else None
    mode = E if isinstance(E, str) else "fixed"
    x0 = float(np.mean(np.concatenate([np.log(cols[n][0]) for n in names])))
    logs = {n: (np.log(cols[n][0]), np.log(cols[n][1])) for n in names}
    rng = np.random.default_rng(seed)
    # Runs at the same compute are seeds of one arm: a replicate resamples the arms with replacement
    # and, within each drawn arm, its seeds with replacement (so the intervals carry seed noise too).
    cells = {n: arm_cells(cols[n][0].tolist()) for n in names}
    kept: Dict[str, int] = {n: 0 for n in names}

    def draw(n: str, need: int):
        x, y = logs[n]
        for _ in range(100):
            idx = resample_arms(cells[n], rng)
            if len(set(x[idx].tolist())) >= need:
                return x[idx], y[idx]
        kept[n] += 1
        return x, y  # too few distinct points to resample: keep the data (a degenerate replicate)

    def rep_starts(theta, ys):
        """Replicates start from the full-data optimum and, when E is fitted, also from E = half the
        smallest loss (an optimum with E → 0 has no gradient in E and would pin every replicate there)."""
        if e_fixed is not None:
            return [theta]
        alt = np.array(theta, float)
        alt[0] = math.log(0.5 * min(float(np.exp(y).min()) for y in ys))
        return [theta, alt]

    if mode == "shared":
        theta, obj = _fit_groups([logs[n] for n in names], x0, None, delta)
        fits = _unpack(theta, len(names), x0, None)
        reps: List[List[ScalingFit]] = []
        for _ in range(bootstrap):
            th, _ = _fit_groups([draw(n, 2) for n in names], x0, None, delta,
                                starts=rep_starts(theta, [logs[n][1] for n in names]))
            reps.append(_unpack(th, len(names), x0, None))
        return {n: PowerLawFit(n, fits[i], mode, len(cols[n][0]), obj, [r[i] for r in reps], level,
                               n_budgets=len(cells[n]), min_loss=float(cols[n][1].min()), kept_draws=kept[n])
                for i, n in enumerate(names)}
    out = {}
    need = 3 if mode == "free" else 2
    for n in names:
        theta, obj = _fit_groups([logs[n]], x0, e_fixed, delta)
        fit = _unpack(theta, 1, x0, e_fixed)[0]
        reps = []
        for _ in range(bootstrap):
            th, _ = _fit_groups([draw(n, need)], x0, e_fixed, delta, starts=rep_starts(theta, [logs[n][1]]))
            reps.append(_unpack(th, 1, x0, e_fixed)[0])
        out[n] = PowerLawFit(n, fit, mode, len(cols[n][0]), obj, reps, level, n_budgets=len(cells[n]),
                             min_loss=float(cols[n][1].min()), kept_draws=kept[n])
    return out


def fit_power_law(compute: Sequence[float], loss: Sequence[float], E: Union[str, float] = "free",
                  name: str = "runs", **kw) -> PowerLawFit:
    """:func:`fit_power_laws` for one variant."""
    if E == "shared":
        raise FitError("E='shared' needs several variants: use fit_power_laws")
    return fit_power_laws({name: (compute, loss)}, E=E, **kw)[name]


# ================================================================================================
# Warnings: when the fit cannot tell
# ================================================================================================
E_LOW = 1e-6
"""E below this fraction of the smallest loss is on its lower bound (E → 0: a pure power law)."""
E_HIGH = 0.999
"""E above this fraction of the smallest loss is on its upper limit (the curve is flat)."""
DEGENERATE_SHARE = 0.5
"""A bootstrap distribution with at least this share of replicates on a bound is degenerate."""

REMEDY_E = ("fix E (fit.E: <value>, e.g. a published irreducible loss), share it across variants "
            "(fit.E: shared), or add budgets (grid.steps) large enough for the curve to bend")
REMEDY_E_SHARED = ("fix E (fit.E: <value>, e.g. a published irreducible loss), or add budgets (grid.steps) large "
                   "enough for the curve to bend")
REMEDY_POINTS = "add budgets (grid.steps), share E (fit.E: shared) or fix E (fit.E: <value>)"
REMEDY_BOOT = "add budgets (grid.steps) or seeds (grid.seeds), or fix E (fit.E: <value>)"


def _on_bound(param: str, value: float, min_loss: float) -> Optional[str]:
    if param == "E":
        if value < E_LOW * min_loss:
            return f"lower bound (E = {value:.3g} → 0: the fit prefers a pure power law)"
        if value > E_HIGH * min_loss:
            return f"upper limit (E = {value:.4g}, at the smallest loss {min_loss:.4g}: the curve is flat)"
        return None
    lo, hi = _ALPHA_BOUNDS
    if value <= lo * (1 + 1e-3):
        return f"lower bound (α = {value:.3g}, bound {lo:g})"
    if value >= hi * (1 - 1e-3):
        return f"upper bound (α = {value:.3g}, bound {hi:g})"
    return None


def fit_warnings(fits: Mapping[str, PowerLawFit]) -> List[dict]:
    """What the fits cannot tell, each ``{"variant", "kind", "param", "message", "remedy"}``:

    * ``bound``: a fitted parameter sits on its bound (E → 0 or E at the smallest loss, α at a limit
      of its range): the data do not determine it;
    * ``underdetermined``: a variant has no more arms (distinct budgets; seeds do not count) than
      the parameters its curve needs (E free: 3; shared or fixed E: 2), or a shared-E fit has no more
      arms in all than parameters (1 + 2 per variant): the curve interpolates, its residuals are 0;
    * ``degenerate_bootstrap``: at least half the replicates of a parameter sit on a bound, the
      interval has zero width, or replicates could not be resampled: the interval is no
      confidence interval.

    Silent on a well-posed fit.  A shared E is reported once (variant ``*``)."""
    out: List[dict] = []
    if not fits:
        return out
    mode = next(iter(fits.values())).E_mode
    per_variant = 3 if mode == "free" else 2
    shared_done = False
    for n, f in fits.items():
        params = ["A", "alpha"] + (["E"] if mode != "fixed" else [])
        for p in params:
            if p == "A":
                continue
            if p == "E" and mode == "shared":
                if shared_done:
                    continue
                who = "*"
                min_loss = min(g.min_loss for g in fits.values())
            else:
                who, min_loss = n, f.min_loss
            b = _on_bound(p, getattr(f, p), min_loss)
            if b:
                out.append({"variant": who, "kind": "bound", "param": p,
                            "message": f"{'shared E' if who == '*' else n + ': ' + p} sits on its {b}",
                            "remedy": (REMEDY_E_SHARED if mode == "shared" else REMEDY_E) if p == "E"
                            else "add budgets spanning more compute, or fix E (fit.E: <value>)"})
            reps = [getattr(r, p) for r in f.replicates]
            if reps:
                share = sum(1 for v in reps if _on_bound(p, v, min_loss)) / len(reps)
                lo, hi = f.interval(p)
                if share >= DEGENERATE_SHARE or (math.isfinite(lo) and math.isfinite(hi)
                                                 and hi - lo <= 1e-9 * max(abs(getattr(f, p)), 1e-300)):
                    what = (f"{share:.0%} of the bootstrap replicates sit on a bound" if share >= DEGENERATE_SHARE
                            else "the bootstrap interval has zero width")
                    out.append({"variant": who, "kind": "degenerate_bootstrap", "param": p,
                                "message": f"{'shared E' if who == '*' else n + ': ' + p}: {what}; its interval is "
                                           "not a confidence interval",
                                "remedy": REMEDY_BOOT})
            if p == "E" and mode == "shared":
                shared_done = True
        if f.n_budgets <= per_variant:
            out.append({"variant": n, "kind": "underdetermined", "param": None,
                        "message": f"{n}: {f.n_budgets} budgets for {per_variant} parameters of its curve "
                                   f"(E {mode}): the fit interpolates and cannot show misfit",
                        "remedy": REMEDY_POINTS})
        if f.replicates and f.kept_draws:
            out.append({"variant": n, "kind": "degenerate_bootstrap", "param": None,
                        "message": f"{n}: {f.kept_draws} of {len(f.replicates)} replicates could not resample "
                                   "(too few distinct budgets)",
                        "remedy": REMEDY_BOOT})
    if mode == "shared":
        total = sum(f.n_budgets for f in fits.values())
        k = 1 + 2 * len(fits)
        if total <= k:
            out.append({"variant": "*", "kind": "underdetermined", "param": None,
                        "message": f"shared-E fit: {total} arms for {k} parameters", "remedy": REMEDY_POINTS})
    return out


def significance(lo: float, hi: float, null: float) -> str:
    """``"within noise"`` when the interval [lo, hi] covers the no-difference value ``null`` (1 for a
    multiplier, 0 for a loss difference), ``"significant"`` when it excludes it, ``"undetermined"``
    without an interval."""
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and math.isfinite(lo)
            and math.isfinite(hi)):
        return "undetermined"
    return "within noise" if lo <= null <= hi else "significant"


# ================================================================================================
# Derived quantities with intervals
# ================================================================================================
def _paired(a: PowerLawFit, b: PowerLawFit):
    n = min(len(a.replicates), len(b.replicates))
    return list(zip(a.replicates[:n], b.replicates[:n]))


def _multiplier(base: ScalingFit, method: ScalingFit, compute: Optional[float], loss: Optional[float]) -> float:
    """C_b(L) / C_x(L); L = ``loss`` or the baseline's fitted loss at ``compute``."""
    L = base.loss(compute) if loss is None else loss
    if L <= base.E or L <= method.E:
        return math.nan
    def log_c(f: ScalingFit) -> float:  # log C_f(L), in log space: 1/α can be large in a bootstrap replicate
        return (math.log(f.A) - math.log(L - f.E)) / f.alpha

    log_m = (math.log(compute) if loss is None else log_c(base)) - log_c(method)
    return math.exp(min(log_m, 700.0)) if log_m > -745.0 else 0.0


def multiplier_interval(baseline: PowerLawFit, method: PowerLawFit, compute: Optional[float] = None,
                        loss: Optional[float] = None) -> Tuple[float, float, float]:
    """(M, lo, hi): how much more compute ``baseline`` needs than ``method`` for the same loss (§6.5).

    At a chosen ``compute`` C_b: M = C_b / C_x(L_b(C_b)) with the baseline's fitted loss; at a chosen
    ``loss`` L: M = C_b(L) / C_x(L).  The interval pairs the two fits' bootstrap replicates (the
    same resample when E is shared).  NaN where a fit never reaches the loss (L ≤ E).
    """
    if (compute is None) == (loss is None):
        raise FitError("give exactly one of compute= or loss= for a compute multiplier")
    m = _multiplier(baseline.fit, method.fit, compute, loss)
    vals = [_multiplier(b, x, compute, loss) for b, x in _paired(baseline, method)]
    lo, hi = _percentile_interval(vals, baseline.level)
    return m, lo, hi


def loss_difference_interval(base: PowerLawFit, other: PowerLawFit, compute: float) -> Tuple[float, float, float]:
    """(ΔL, lo, hi) with ΔL = L_other(C) − L_base(C), the interval from paired bootstrap replicates."""
    d = other.loss(compute) - base.loss(compute)
    lo, hi = _percentile_interval([x.loss(compute) - b.loss(compute) for b, x in _paired(base, other)], base.level)
    return d, lo, hi


def loss_at_interval(fit: PowerLawFit, compute: float) -> Tuple[float, float, float]:
    """(L(C), lo, hi) from the fit and its bootstrap replicates."""
    lo, hi = _percentile_interval([r.loss(compute) for r in fit.replicates], fit.level)
    return fit.loss(compute), lo, hi


# ================================================================================================
# Chinchilla L(P, D) = E + A/P^α + B/D^β
# ================================================================================================
@dataclass
class ChinchillaFit:
    """L(P, D) = E + A/P^α + B/D^β with bootstrap intervals."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    n_points: int
    objective: float
    replicates: List[Tuple[float, float, float, float, float]] = field(default_factory=list)
    level: float = 0.95

    PARAMS = ("E", "A", "alpha", "B", "beta")

    def loss(self, params: float, tokens: float) -> float:
        return self.E + self.A / params ** self.alpha + self.B / tokens ** self.beta

    def interval(self, param: str) -> Tuple[float, float]:
        i = self.PARAMS.index(param)
        return _percentile_interval([r[i] for r in self.replicates], self.level)

    def as_dict(self) -> dict:
        out = {"n_points": self.n_points, "bootstrap": len(self.replicates), "level": self.level}
        for p in self.PARAMS:
            out[p] = getattr(self, p)
            out[f"{p}_interval"] = list(self.interval(p))
        return out


def _chinchilla_objective(th, lp, ld, y, delta):
    e, a, al, b, be = th
    u1, u2 = a - al * lp, b - be * ld
    m = np.logaddexp(np.logaddexp(u1, u2), e)
    w1, w2, w0 = np.exp(u1 - m), np.exp(u2 - m), np.exp(e - m)
    val, dr = _huber(m - y, delta)
    g = np.array([(dr * w0).sum(), (dr * w1).sum(), (-dr * w1 * lp).sum(), (dr * w2).sum(), (-dr * w2 * ld).sum()])
    return float(val.sum()), g


def fit_chinchilla(params: Sequence[float], tokens: Sequence[float], loss: Sequence[float],
                   delta: float = HUBER_DELTA, bootstrap: int = 200, seed: int = 0,
                   level: float = 0.95) -> ChinchillaFit:
    """Fit Chinchilla's L(P, D) = E + A/P^α + B/D^β (5 parameters) over runs of several sizes and budgets.

    Runs with the same (P, D) are seeds of one arm: the bootstrap resamples arms, then seeds within
    them (:func:`resample_arms`), as the L(C) fits do."""
    n = len(loss)
    if not (len(params) == len(tokens) == n):
        raise FitError(f"L(P, D): {len(params)} sizes, {len(tokens)} token counts and {n} losses; pass one of each per run")
    if len(set(zip(params, tokens))) < 5:
        raise FitError(f"L(P, D) = E + A/P^α + B/D^β has 5 parameters but only {len(set(zip(params, tokens)))} "
                       "distinct (size, tokens) runs; sweep more sizes and budgets")
    if len(set(params)) < 2 or len(set(tokens)) < 2:
        raise FitError("L(P, D) needs at least 2 model sizes and 2 token budgets")
    P, D, L = (np.asarray(v, float) for v in (params, tokens, loss))
    if np.any(P <= 0) or np.any(D <= 0) or np.any(L <= 0):
        raise FitError("L(P, D): sizes, tokens and losses must be > 0")
    p0, d0 = float(np.log(P).mean()), float(np.log(D).mean())
    lp, ld, y = np.log(P) - p0, np.log(D) - d0, np.log(L)
    bounds = [(None, None), (None, None), _ALPHA_BOUNDS, (None, None), _ALPHA_BOUNDS]

    def solve(lp_, ld_, y_, starts):
        return _minimize(lambda th: _chinchilla_objective(th, lp_, ld_, y_, delta), starts, bounds)

    lmean, lmin = float(L.mean()), float(L.min())
    starts = []
    for f in (0.2, 0.5, 0.8):
        gap = max(lmean - f * lmin, 1e-3 * lmean) / 2
        for al0 in (0.1, 0.3, 0.6):
            for be0 in (0.1, 0.3, 0.6):
                starts.append(np.array([math.log(f * lmin), math.log(gap), al0, math.log(gap), be0]))
    theta, obj = solve(lp, ld, y, starts)

    def unpack(th):
        e, a, al, b, be = (float(t) for t in th)
        return (math.exp(e), math.exp(a + al * p0), al, math.exp(b + be * d0), be)

    rng = np.random.default_rng(seed)
    cells = arm_cells(list(zip(P.tolist(), D.tolist())))  # runs of the same (size, tokens): seeds of one arm
    reps = []
    for _ in range(bootstrap):
        for _try in range(100):
            idx = resample_arms(cells, rng)
            if len(set(zip(P[idx].tolist(), D[idx].tolist()))) >= 5 and len(set(P[idx].tolist())) >= 2 \
                    and len(set(D[idx].tolist())) >= 2:
                break
        th, _ = solve(lp[idx], ld[idx], y[idx], [theta])
        reps.append(unpack(th))
    return ChinchillaFit(*unpack(theta), n_points=n, objective=obj, replicates=reps, level=level)


# ================================================================================================
# Fit
# ================================================================================================
def fit_sweep(sweep: Sweep, rows: List[dict], log=print, plots: bool = True, times: Optional[Mapping] = None) -> dict:
    """Fit L(C) per variant, L(N) at a fixed compute, L(P, D) when sizes and budgets both vary, and the
    compute multipliers against the baselines; write ``fit.json``, ``fit.md`` and the plots.

    ``times``: :func:`tools.sweep.gpu_time.variant_times` of the sweep on a GPU cluster: each multiplier
    then also comes in GPU-hours (:func:`tools.sweep.gpu_time.add_gpu_hours`).

    Every finished run is a point (seeds of one arm share its compute); the bootstrap resamples arms
    and, within them, seeds.  Multipliers whose interval covers 1 and loss differences whose interval
    covers 0 are marked ``within noise``; :func:`fit_warnings` says where the fit cannot tell."""
    from tools.sweep.collect import aggregate
    from tools.sweep.runner import git_commit

    f = sweep.fit
    which = f.get("loss", "valid")
    if which not in ("valid", "train"):
        raise SweepError(f"sweep file {sweep.path}: fit.loss must be valid or train, got {which!r}")
    col = f"{which}_loss"
    used = [r for r in rows if r["state"] == "finished" and _finite(r.get(col))]
    excluded = [r for r in rows if r not in used]
    for r in excluded:
        log(f"[fit] excluded {r['arm']}: {r['reason'] or f'no {col}'}")
    by_var: Dict[str, tuple] = {}
    for r in used:
        c, l = by_var.setdefault(r["variant"], ([], []))
        c.append(r["compute"])
        l.append(r[col])
    if not by_var:
        raise SweepError("no finished arms with a loss to fit: run the sweep first (`tools.sweep run`)")
    E = f.get("E", "free")
    boot = int(f.get("bootstrap", 200))
    level = float(f.get("level", 0.95))
    fits = fit_power_laws(by_var, E=E, bootstrap=boot, seed=int(f.get("seed", 0)), level=level)
    meta = {r["variant"]: r for r in used}
    warnings = fit_warnings(fits)
    for w in warnings:
        log(f"[fit] warning: {w['message']}; remedy: {w['remedy']}")
    arm_commits = sorted({r["commit"] for r in used if r.get("commit")})
    arm_data = sorted({r["data"] for r in used if r.get("data")})  # training.run.run_record fingerprints
    if len(arm_data) > 1:
        warnings.append({"variant": None, "kind": "data", "param": None,
                         "message": f"the fitted arms trained on {len(arm_data)} different data/tokenizers "
                                    f"({', '.join(arm_data)}: the `data` column of the table)",
                         "remedy": "rerun the odd arms on the sweep's data, or fit each data set on its own"})
        log(f"[fit] warning: {warnings[-1]['message']}; remedy: {warnings[-1]['remedy']}")
    result: Dict[str, Any] = {"sweep": sweep.name, "commit": git_commit(), "arm_commits": arm_commits,
                              "arm_data": arm_data,
                              "loss": col, "E_mode": fits[next(iter(fits))].E_mode,
                              "flops_convention": sweep.flops_convention, "level": level, "bootstrap": boot,
                              "bootstrap_unit": "arms, and seeds within each drawn arm",
                              "excluded": {r["arm"]: r["reason"] or f"no {col}" for r in excluded},
                              "arms_over_seeds": [{k: v for k, v in c.items() if k not in ("train_loss", "valid_loss")}
                                                  for c in aggregate(rows)],
                              "laws": {v: fits[v].as_dict() for v in fits}, "warnings": warnings}
    baselines = [b for b in f.get("baselines", ["vanilla"]) if b in fits]
    c_ref = f.get("compute")
    target = f.get("target_loss")
    mults = []
    for b in baselines:
        cb = float(c_ref) if c_ref is not None else max(by_var[b][0])
        for v in fits:
            if v == b:
                continue
            kw = {"loss": float(target)} if target is not None else {"compute": cb}
            m, lo, hi = multiplier_interval(fits[b], fits[v], **kw)
            mults.append({"baseline": b, "variant": v, "at": kw, "multiplier": m, "interval": [lo, hi],
                          "significance": significance(lo, hi, 1.0)})
    result["multipliers"] = mults
    if times:
        add_gpu_hours(result, fits, times, significance)
    # L(N) at a fixed compute
    c_n = float(c_ref) if c_ref is not None else (max(by_var[baselines[0]][0]) if baselines else
                                                   math.exp(sum(math.log(r["compute"]) for r in used) / len(used)))
    ln = []
    ref = baselines[0] if baselines else None
    for v, fit in fits.items():
        L, lo, hi = loss_at_interval(fit, c_n)
        p = {"variant": v, "family": _family(sweep, v), "N": meta[v]["N"], "k": meta[v]["k"],
             "loss": L, "interval": [lo, hi]}
        if ref is not None and v != ref:
            d, dlo, dhi = loss_difference_interval(fits[ref], fit, c_n)
            p.update({"delta": d, "delta_interval": [dlo, dhi], "significance": significance(dlo, dhi, 0.0)})
        ln.append(p)
    result["loss_vs_n"] = {"compute": c_n, "reference": ref, "points": ln}
    # Chinchilla L(P, D) per variant where sizes and budgets both vary
    ch = {}
    for v in fits:
        rv = [r for r in used if r["variant"] == v]
        if len({r["size"] for r in rv}) > 1 and len({r["tokens"] for r in rv}) > 1:
            try:
                cf = fit_chinchilla([r["params_activated"] for r in rv], [r["tokens"] for r in rv],
                                    [r[col] for r in rv], bootstrap=boot, seed=int(f.get("seed", 0)), level=level)
                ch[v] = cf.as_dict()
            except FitError as e:
                ch[v] = {"error": str(e)}
    if ch:
        result["chinchilla"] = ch
    os.makedirs(sweep.summary_dir, exist_ok=True)
    _write_json(os.path.join(sweep.summary_dir, "fit.json"), result)
    md = fit_markdown(result)
    with open(os.path.join(sweep.summary_dir, "fit.md"), "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    result["plots"] = plot_sweep(sweep, used, fits, result) if plots else {}
    _write_json(os.path.join(sweep.summary_dir, "fit.json"), result)
    return result


def _family(sweep: Sweep, variant: str) -> str:
    for a in sweep.arms:
        if a.variant == variant:
            return a.family
    return variant


def _iv(x, lo, hi, fmt="{:.4g}") -> str:
    if not (_finite(lo) and _finite(hi)):
        return fmt.format(x)
    return f"{fmt.format(x)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _mark(s: Optional[str]) -> str:
    return {"within noise": "within noise", "significant": "**significant**"}.get(s or "", s or "-")


def fit_markdown(result: dict) -> str:
    lvl = int(round(100 * result["level"]))
    out = [f"L(C) = E + A·C^(−α) on {result['loss']}, E {result['E_mode']}, Huber δ=1e-3 on log residuals, "
           f"{result['bootstrap']} bootstrap replicates ({lvl}% intervals; "
           f"{result.get('bootstrap_unit', 'arms')}), FLOPs convention `{result['flops_convention']}`"
           + (f", commit `{result['commit']}`" if result.get("commit") else "")
           + (f", arms run at `{', '.join(c[:12] for c in result['arm_commits'])}`" if result.get("arm_commits")
              else ""), ""]
    cells = result.get("arms_over_seeds") or []
    if cells and any(c.get("n_seeds", 1) > 1 for c in cells):
        col = result["loss"]
        out += [f"Arms over seeds ({col}, train_loss: mean ± sample standard deviation over the finished seeds):", "",
                "| arm | N | k | steps | compute | seeds | train_loss | valid_loss |", "|---|---|---|---|---|---|---|---|"]
        for c in cells:
            def ms(k):
                m, s = c.get(f"{k}_mean"), c.get(f"{k}_std")
                return "-" if m is None else f"{m:.4f}" + (f" ± {s:.4f}" if s is not None else "")
            out.append(f"| {c['arm']} | {c['N']} | {c['k'] if c['k'] is not None else '-'} | {c['steps']} | "
                       f"{c['compute']:.3g} | {c['seeds']} | {ms('train_loss')} | {ms('valid_loss')} |")
        out.append("")
    out += ["| variant | E | A | α | runs (arms) |", "|---|---|---|---|---|"]
    for v, d in result["laws"].items():
        out.append(f"| {v} | {_iv(d['E'], *d['E_interval'])} | {_iv(d['A'], *d['A_interval'])} | "
                   f"{_iv(d['alpha'], *d['alpha_interval'])} | {d['n_points']} ({d.get('n_budgets', d['n_points'])}) |")
    if result.get("warnings"):
        out += ["", "Warnings (the fit cannot tell):", ""]
        for w in result["warnings"]:
            out.append(f"- {w['message']}. Remedy: {w['remedy']}.")
    if result["multipliers"]:
        out += ["", "Compute multipliers (compute the baseline needs / compute the variant needs for the same loss; "
                "*within noise*: the interval covers 1):",
                "", "| baseline | variant | at | multiplier | difference |", "|---|---|---|---|---|"]
        for m in result["multipliers"]:
            at = ", ".join(f"{k}={v:.3g}" for k, v in m["at"].items())
            out.append(f"| {m['baseline']} | {m['variant']} | {at} | {_iv(m['multiplier'], *m['interval'], '{:.3f}')} "
                       f"| {_mark(m.get('significance'))} |")
    if result.get("gpu_time"):
        out += ["", gpu_time_markdown(result)]
    ln = result["loss_vs_n"]
    ref = ln.get("reference")
    out += ["", f"L(N) at fixed compute C = {ln['compute']:.3g} (fitted)"
            + (f"; ΔL against {ref} (*within noise*: the interval covers 0)" if ref else "") + ":", "",
            "| variant | family | N | k | loss | ΔL | difference |", "|---|---|---|---|---|---|---|"]
    for p in ln["points"]:
        dl = _iv(p["delta"], *p["delta_interval"], "{:+.4f}") if "delta" in p else "-"
        out.append(f"| {p['variant']} | {p['family']} | {p['N']} | {p['k'] if p['k'] is not None else '-'} | "
                   f"{_iv(p['loss'], *p['interval'], '{:.4f}')} | {dl} | "
                   f"{_mark(p.get('significance')) if 'delta' in p else 'reference' if p['variant'] == ref else '-'} |")
    if result.get("chinchilla"):
        out += ["", "L(P, D) = E + A/P^α + B/D^β (P activated parameters, D tokens):", "",
                "| variant | E | A | α | B | β |", "|---|---|---|---|---|---|"]
        for v, d in result["chinchilla"].items():
            if "error" in d:
                out.append(f"| {v} | {d['error']} | | | | |")
            else:
                out.append(f"| {v} | " + " | ".join(_iv(d[p], *d[f'{p}_interval']) for p in
                                                   ("E", "A", "alpha", "B", "beta")) + " |")
    if result["excluded"]:
        out += ["", "Excluded arms: " + "; ".join(f"{k}: {v}" for k, v in result["excluded"].items())]
    return "\n".join(out)
