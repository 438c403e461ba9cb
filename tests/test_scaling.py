"""Scaling-law fit and compute multipliers (docs/math.md §5.4, §6.5)."""

import math
import random
import sys
import types

import pytest

from xhc.scaling import (
    PAPER_FITS, ScalingFit, compute_multiplier, compute_to_reach, fit_scaling_law, loss_at, plot_fit,
)


def test_fit_recovers_known_coefficients_exactly():
    """Noise-free data from L = A·C^(−α) + E recovers (A, α) to float rounding."""
    A, alpha, E = 97.703, 0.0919, 0.72
    compute = [1.7e19, 5.0e19, 1.3e20, 4.0e20]
    loss = [A * c ** (-alpha) + E for c in compute]
    fit = fit_scaling_law(compute, loss, E=E)
    assert fit.A == pytest.approx(A, rel=1e-9)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)


def test_fit_with_noise_is_close():
    """Multiplicative noise of 0.1% on L − E (seeded) keeps α within 2% over 2.5 decades."""
    rng = random.Random(0)
    A, alpha, E = 50.0, 0.1, 1.0
    compute = [10 ** (18 + 0.25 * i) for i in range(11)]
    loss = [A * c ** (-alpha) * (1 + 1e-3 * rng.gauss(0, 1)) + E for c in compute]
    fit = fit_scaling_law(compute, loss, E=E)
    assert fit.alpha == pytest.approx(alpha, rel=0.02)
    # least squares minimises the log residual: perturbing the fit increases it
    def sse(a, al):
        return sum((math.log(l - E) - (math.log(a) - al * math.log(c))) ** 2 for c, l in zip(compute, loss))
    best = sse(fit.A, fit.alpha)
    for da, dal in ((1.01, 0), (0.99, 0), (1, 1.001), (1, 0.999)):
        assert sse(fit.A * da, fit.alpha * dal) > best


def test_paper_multipliers():
    """Fitted L_b at C_b = 4.0e20 gives 1.410× (vanilla) and 1.113× (mHC) relative to xHC (§6.5)."""
    x = PAPER_FITS["xhc"]
    assert round(compute_multiplier(PAPER_FITS["vanilla"], x, 4.0e20), 3) == 1.410
    assert round(compute_multiplier(PAPER_FITS["mhc"], x, 4.0e20), 3) == 1.113


def test_multiplier_definition():
    """M_b = C_b / C_x(L_b) with C_x(L) = (A_x/(L − E))^(1/α_x); a measured loss overrides L_b."""
    b, x = ScalingFit(100.0, 0.1), ScalingFit(90.0, 0.1)
    # same α: C_x(L) = C_b·(A_x/A_b)^(1/α)  ->  M = (A_b/A_x)^(1/α)
    assert compute_multiplier(b, x, 1e20) == pytest.approx((100 / 90) ** 10, rel=1e-9)
    L = 2.0
    assert compute_multiplier(b, x, 1e20, loss=L) == pytest.approx(1e20 / ((90 / (L - 0.72)) ** 10), rel=1e-9)
    # compute_to_reach inverts loss_at
    assert compute_to_reach(x, loss_at(x, 3.3e19)) == pytest.approx(3.3e19, rel=1e-9)


def test_fit_errors():
    with pytest.raises(ValueError, match="at least 2"):
        fit_scaling_law([1e20], [2.0])
    with pytest.raises(ValueError, match="exceed E"):
        fit_scaling_law([1e19, 1e20], [2.0, 0.5])
    with pytest.raises(ValueError, match="one loss per run"):
        fit_scaling_law([1e19, 1e20], [2.0])
    with pytest.raises(ValueError, match="not above E"):
        compute_to_reach(PAPER_FITS["xhc"], 0.7)


def test_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    """No matplotlib: the plot is skipped with a message, nothing is written."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "fit.png"
    assert plot_fit({"xhc": ([1e19, 1e20], [2.2, 2.0])}, PAPER_FITS, str(out)) is None
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not out.exists()


def test_plot_draws_fitted_curves(monkeypatch, tmp_path):
    """With a (recording) matplotlib, each fit is drawn as L(C) on the compute grid and saved."""
    calls = []

    class Axes:
        def plot(self, xs, ys, fmt, **kw):
            calls.append((list(xs), list(ys), fmt, kw))
            line = types.SimpleNamespace(get_color=lambda: "C0")
            return (line,)

        def __getattr__(self, name):  # set_xscale, set_xlabel, legend, ...
            return lambda *a, **k: None

    class Fig:
        def tight_layout(self):
            pass

        def savefig(self, path, dpi=None):
            open(path, "wb").write(b"PNG")

    plt = types.SimpleNamespace(subplots=lambda **kw: (Fig(), Axes()), close=lambda fig: None)
    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda backend: None
    mpl.pyplot = plt
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)

    out = tmp_path / "fit.png"
    runs = {"xhc": ([1e19, 1e20], [2.2, 2.0])}
    assert plot_fit(runs, {"xhc": PAPER_FITS["xhc"]}, str(out)) == str(out)
    assert out.read_bytes() == b"PNG"
    points = [c for c in calls if c[2] == "o"]
    curves = [c for c in calls if c[2] == "-"]
    assert points[0][:2] == ([1e19, 1e20], [2.2, 2.0])
    xs, ys = curves[0][:2]
    assert all(y == pytest.approx(PAPER_FITS["xhc"].loss(x)) for x, y in zip(xs, ys))
