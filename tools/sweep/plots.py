"""Sweep plots: the frontier, L(N) at fixed compute and the multipliers of a fitted sweep
(:func:`plot_sweep`), and a quick log-log plot of runs and :class:`xhc.scaling.ScalingFit` curves
(:func:`plot_fit`).  matplotlib is optional: without it the plots are skipped with a message."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from xhc.scaling import ScalingFit

from tools.sweep.collect import _finite
from tools.sweep.spec import Sweep

__all__ = ["plot_sweep", "plot_fit"]


def plot_sweep(sweep: Sweep, used: List[dict], fits, result: dict) -> Dict[str, str]:
    """``frontier.png`` (loss vs compute, fitted frontiers with bootstrap bands), ``loss_vs_n.png``
    and ``multipliers.png`` under ``<out_dir>/summary``; {} without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[fit] matplotlib is not installed: no plots (pip install 'xhc[plot]')")
        return {}
    import numpy as np

    d = sweep.summary_dir
    paths = {}
    col = result["loss"]
    cs = [r["compute"] for r in used]
    grid = np.geomspace(min(cs) / 1.3, max(cs) * 1.3, 100)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for v, fit in fits.items():
        pts = [(r["compute"], r[col]) for r in used if r["variant"] == v]
        (line,) = ax.plot(grid, [fit.loss(c) for c in grid], "-", lw=1.2,
                          label=f"{v}: A={fit.A:.3g}, α={fit.alpha:.3f}, E={fit.E:.3f}")
        ax.plot(*zip(*pts), "o", color=line.get_color(), ms=4)
        if fit.replicates:
            curves = np.array([[r.loss(c) for c in grid] for r in fit.replicates])
            q = 100 * (1 - fit.level) / 2
            lo, hi = np.nanpercentile(curves, [q, 100 - q], axis=0)
            ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"training compute C (FLOPs, {sweep.flops_convention})")
    ax.set_ylabel(col.replace("_", " "))
    ax.set_title(f"{sweep.name}: L(C) = E + A·C^(−α), {int(100 * result['level'])}% bootstrap bands")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths["frontier"] = os.path.join(d, "frontier.png")
    fig.savefig(paths["frontier"])
    plt.close(fig)

    ln = result["loss_vs_n"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    fams: Dict[str, list] = {}
    for p in ln["points"]:
        fams.setdefault(p["family"], []).append(p)
    for fam, pts in fams.items():
        pts.sort(key=lambda p: p["N"])
        xs, ys = [p["N"] for p in pts], [p["loss"] for p in pts]
        err = np.array([[max(0.0, p["loss"] - p["interval"][0]) if _finite(p["interval"][0]) else 0.0 for p in pts],
                        [max(0.0, p["interval"][1] - p["loss"]) if _finite(p["interval"][1]) else 0.0 for p in pts]])
        if fam == "vanilla":
            ax.axhline(ys[0], ls="--", color="gray", lw=1, label="vanilla (N=1)")
            continue
        line = ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=fam)[0]
        for p, x, y in zip(pts, xs, ys):
            noise = p.get("significance") == "within noise"
            if noise:  # hollow marker: not distinguishable from the reference at this level
                ax.plot([x], [y], "o", mfc="white", mec=line.get_color(), ms=7, zorder=3)
            ax.annotate(f"N={x}" + (" (within noise)" if noise else ""), (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("streams N")
    ax.set_ylabel(f"fitted {col.replace('_', ' ')} at C = {ln['compute']:.3g}")
    ax.set_title("loss vs N at fixed compute" + (f" (hollow: within noise of {ln['reference']})"
                                                  if ln.get("reference") else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths["loss_vs_n"] = os.path.join(d, "loss_vs_n.png")
    fig.savefig(paths["loss_vs_n"])
    plt.close(fig)

    if result["multipliers"]:
        ms = result["multipliers"]
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(ms) + 1.5), dpi=110)
        labels = [f"{m['baseline']} / {m['variant']}" + (" (within noise)" if m.get("significance") == "within noise"
                                                          else "") for m in ms]
        vals = [m["multiplier"] for m in ms]
        lo = [max(0.0, m["multiplier"] - m["interval"][0]) if _finite(m["interval"][0]) else 0.0 for m in ms]
        hi = [max(0.0, m["interval"][1] - m["multiplier"]) if _finite(m["interval"][1]) else 0.0 for m in ms]
        colors = ["0.7" if m.get("significance") == "within noise" else "C0" for m in ms]
        ax.barh(range(len(ms)), vals, xerr=[lo, hi], capsize=3, color=colors, alpha=0.8)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(range(len(ms)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("compute multiplier (baseline compute / variant compute at equal loss)")
        ax.set_title("compute multipliers with bootstrap intervals (grey: within noise, covers 1)", fontsize=9)
        fig.tight_layout()
        paths["multipliers"] = os.path.join(d, "multipliers.png")
        fig.savefig(paths["multipliers"])
        plt.close(fig)
    return paths


def plot_fit(runs: Dict[str, tuple], fits: Dict[str, ScalingFit], path: str,
             title: str = "Scaling-law fit  L(C) = A·C^(−α) + E") -> Optional[str]:
    """Save a log-log PNG of the runs and their fitted curves; returns the path.

    ``runs``: name → (compute list, loss list); ``fits``: name → :class:`ScalingFit`.  If
    matplotlib is not installed, prints a message and returns ``None`` (the fit itself does not
    need it).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path} (pip install 'xhc[plot]')")
        return None
    all_c = [c for cs, _ in runs.values() for c in cs] or [1e19, 1e21]
    lo, hi = min(all_c) / 1.5, max(all_c) * 1.5
    grid = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted(set(runs) | set(fits)):
        color = None
        if name in runs:
            (pts,) = ax.plot(runs[name][0], runs[name][1], "o", label=f"{name} runs")
            color = pts.get_color()
        if name in fits:
            f = fits[name]
            ax.plot(grid, [f.loss(c) for c in grid], "-", color=color,
                    label=f"{name}: A={f.A:.4g}, α={f.alpha:.4g}")
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
