"""The figures of ``python -m tools.inspect`` (matplotlib, Agg): per run, per step, across runs.

Each function takes the records that :mod:`tools.inspect` measured and writes PNGs into ``out_dir``,
returning ``[{"file": ..., "caption": ...}]`` for the report.
"""

from __future__ import annotations

import os
from typing import List


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(count: int, cols: int = 8):
    c = max(1, min(cols, count))
    return (count + c - 1) // c, c


DPI = 80


def _save(fig, out_dir: str, name: str, figures: list, caption: str) -> None:
    """Write ``fig`` as an 8-bit palette PNG (a quarter of the size of RGBA, same look for line plots and
    heatmaps) and list it with its caption."""
    import io

    path = os.path.join(out_dir, name)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    _plt().close(fig)
    try:
        from PIL import Image

        buf.seek(0)
        Image.open(buf).convert("RGB").quantize(colors=256).save(path, optimize=True)
    except ImportError:  # pragma: no cover (pillow comes with matplotlib)
        with open(path, "wb") as f:
            f.write(buf.getvalue())
    figures.append({"file": name, "caption": caption})


def _heatmap_grid(plt, mats: List, titles: List[str], suptitle: str, vmin=None, vmax=None, cmap="viridis"):
    import numpy as np

    rows, cols = _grid(len(mats))
    fig, axes = plt.subplots(rows, cols, figsize=(1.9 * cols + 0.8, 1.9 * rows + 0.5), squeeze=False)
    im = None
    for ax in axes.flat:
        ax.axis("off")
    for ax, M, t in zip(axes.flat, mats, titles):
        im = ax.imshow(np.asarray(M), vmin=vmin, vmax=vmax, cmap=cmap)
        ax.set_title(t, fontsize=8)
    fig.suptitle(suptitle, fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    return fig


def _tame(ax) -> None:
    """No offset notation ("1e-8 + 1") on an axis whose values are all but equal: show ±1 % around them."""
    import numpy as np

    ys = np.concatenate([np.asarray(l.get_ydata(), dtype=float) for l in ax.lines] or [np.zeros(0)])
    ys = ys[np.isfinite(ys)]
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    if ys.size and ys.max() - ys.min() < 1e-3 * max(abs(ys).max(), 1e-12):
        c = float(ys.mean())
        ax.set_ylim(c - 0.01 * max(abs(c), 1e-12), c + 0.01 * max(abs(c), 1e-12))


def _sub_title(r: dict) -> str:
    return f"L{r['layer'] + 1} {'attn' if r['kind'] == 'attention' else 'mlp'}" + (
        f" {r['window_sublayer']}" if "window_sublayer" in r else "")


def figures_one(run: dict, m: dict, out_dir: str, prefix: str = "") -> list:
    """The figures of one inspection (one checkpoint of one SOURCE)."""
    import numpy as np

    plt = _plt()
    figs: list = []
    subs = m["sublayers"]
    titles = [_sub_title(r) for r in subs]
    x = [r["index"] for r in subs]
    tag = f"{run['label']} ({run['variant']}, N={run['n']}{', step ' + str(m['step']) if m.get('step') is not None else ''})"

    # 1. residual mixing
    fig = _heatmap_grid(plt, [r["H_mean"] for r in subs], titles, f"H_res, token mean (N×N effective mixing): {tag}",
                        vmin=0.0, vmax=1.0)
    _save(fig, out_dir, f"{prefix}mixing_mean.png", figs,
          "H_res of every sublayer, mean over the sampled tokens (xHC: the N×N mixing with identity on unwritten streams).")
    fig = _heatmap_grid(plt, [r["H_composite"] for r in subs], titles,
                        f"composite mapping H_ℓ ⋯ H_1 up to each sublayer: {tag}", vmin=0.0, vmax=1.0)
    _save(fig, out_dir, f"{prefix}mixing_composite.png", figs,
          "The product of the token-mean H_res from the first sublayer up to each sublayer: what depth does to the streams.")
    if run.get("dynamic"):
        fig = _heatmap_grid(plt, [r["H_spread"] for r in subs], titles, f"H_res spread (std over tokens): {tag}",
                            vmin=0.0)
        _save(fig, out_dir, f"{prefix}mixing_spread.png", figs,
              "Standard deviation of each H_res entry over the sampled tokens: how much the dynamic part varies.")
    fig = _heatmap_grid(plt, [r["H_static"] for r in subs], titles,
                        f"H_res static part (biases only{'; xHC: k×k active block' if 'H_static_note' in subs[0] else ''}): {tag}",
                        vmin=0.0, vmax=1.0)
    _save(fig, out_dir, f"{prefix}mixing_static.png", figs,
          "The token-independent part of H_res (Φ of the biases; HC: S_res), the matrix every token starts from.")

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    axes[0].plot(x, [r["dist_identity"] for r in subs], "o-", label="‖H̄ − I‖_F")
    axes[0].plot(x, [r["dist_identity_token_mean"] for r in subs], "s--", label="mean over tokens ‖H − I‖_F")
    axes[0].plot(x, [r["dist_permutation"] for r in subs], "^-", label="‖H̄ − P*‖_F (nearest permutation)")
    axes[0].set_xlabel("sublayer ℓ")
    axes[0].set_title("distance of H_res from I and from the permutations")
    axes[0].legend(fontsize=7)
    axes[1].semilogy(x, [max(r["row_sum_error"], 1e-17) for r in subs], "o-", label="max |row sum − 1|")
    axes[1].semilogy(x, [max(r["col_sum_error"], 1e-17) for r in subs], "s-", label="max |column sum − 1|")
    axes[1].set_xlabel("sublayer ℓ")
    axes[1].set_title("distance from the doubly stochastic set (H̄)")
    axes[1].legend(fontsize=7)
    fig.suptitle(tag, fontsize=9, y=1.03)
    _save(fig, out_dir, f"{prefix}mixing_distances.png", figs,
          "Per sublayer: distance of the mean H_res from the identity and from its nearest permutation; row/column-sum errors.")

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.35 * len(subs) + 1.8))
    for ax, key, name in ((axes[0], "h_pre", "h_pre (read weight per stream)"),
                          (axes[1], "h_post", "h_post (write weight of y per stream)")):
        im = ax.imshow(np.array([r[key] for r in subs]), aspect="auto", cmap="magma")
        ax.set_yticks(range(len(subs)))
        ax.set_yticklabels(titles, fontsize=7)
        ax.set_xlabel("stream")
        ax.set_title(name, fontsize=9)
        fig.colorbar(im, ax=ax)
    fig.suptitle(tag, fontsize=9, y=1.03)
    _save(fig, out_dir, f"{prefix}read_write.png", figs,
          "Token-mean read weights h_pre and write weights h_post (xHC: p_j·H_post[j, y] on the written streams), sublayer × stream.")

    # 2. signal propagation
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(x, m["gain"]["forward"], "o-", label="forward gain (max |row sum| of Π H)")
    ax.plot(x, m["gain"]["backward"], "s-", label="backward gain (max |column sum| of Π H)")
    ax.plot(x, [r["gain_single_fwd"] for r in subs], ":", color="gray", label="single sublayer, forward")
    ax.set_xlabel("depth (sublayer ℓ)")
    ax.set_ylabel("Amax gain")
    if max(m["gain"]["forward"] + m["gain"]["backward"]) > 10:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    if ax.get_yscale() == "linear":
        _tame(ax)
    ax.set_title(f"composite Amax gain over depth: {tag}", fontsize=9)
    _save(fig, out_dir, f"{prefix}gain.png", figs,
          "Composite forward and backward Amax gain of H_ℓ⋯H_1 over depth ([mHC] Fig. 3); 1 for doubly stochastic products.")

    rms = np.array(m["depth"]["stream_rms"])
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for j in range(rms.shape[1]):
        ax.plot(range(rms.shape[0]), rms[:, j], marker=".", label=f"stream {j}")
    ax.set_xticks(range(rms.shape[0]))
    ax.set_xticklabels(m["depth"]["labels"], rotation=30, fontsize=7)
    ax.set_ylabel("RMS of X_i")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(f"per-stream RMS over depth: {tag}", fontsize=9)
    _save(fig, out_dir, f"{prefix}stream_rms.png", figs,
          "RMS of each residual stream after every layer (embedding first): growth or decay of the signal per stream.")

    cos = m["depth"]["cosine"]
    keys = sorted(cos, key=int)
    fig = _heatmap_grid(plt, [cos[k] for k in keys], [m["depth"]["labels"][int(k)] for k in keys],
                        f"cosine similarity between streams: {tag}", vmin=-1.0, vmax=1.0, cmap="coolwarm")
    _save(fig, out_dir, f"{prefix}stream_cosine.png", figs,
          "Mean over tokens of cos(X_i, X_j) at a few depths: all-ones blocks mean the streams have collapsed.")

    # 3. xHC specifics
    if m["routing"]:
        R = m["routing"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 0.35 * len(R) + 1.8), gridspec_kw={"width_ratios": [3, 2]})
        im = axes[0].imshow(np.array([r["load"] for r in R]), aspect="auto", vmin=0, vmax=1, cmap="viridis")
        names = [f"{'window' if 'window' in r else 'sublayer'} {r.get('window', r['index'])}" for r in R]
        axes[0].set_yticks(range(len(R)))
        axes[0].set_yticklabels(names, fontsize=7)
        axes[0].set_xlabel("stream")
        axes[0].set_title(f"router load (fraction of tokens writing each stream; m={run['m']} fixed)", fontsize=8)
        fig.colorbar(im, ax=axes[0])
        ys = range(len(R))
        axes[1].barh(ys, [r["fixed_share"] for r in R], label="fixed share of route weight")
        axes[1].barh(ys, [r["routed_share"] for r in R], left=[r["fixed_share"] for r in R], label="routed share")
        ent = [r["entropy_normalised"] for r in R]
        if any(e is not None for e in ent):
            axes[1].plot([e if e is not None else np.nan for e in ent], list(ys), "ko-", label="routed entropy / log(N−m)")
        axes[1].set_yticks(list(ys))
        axes[1].set_yticklabels(names, fontsize=7)
        axes[1].set_xlim(0, 1.05)
        axes[1].invert_yaxis()
        axes[1].legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
        fig.suptitle(tag, fontsize=9, y=1.03)
        _save(fig, out_dir, f"{prefix}router.png", figs,
              "xHC router: load per stream per routing decision (sublayer, or window for Flash), fixed vs routed share, routed entropy.")
    head = m.get("head")
    if head:
        fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * run["n"]), 3.0))
        mean = np.asarray(head["weights_mean"])
        ax.bar(range(len(mean)), mean, yerr=[mean - np.asarray(head["weights_min"]),
                                             np.asarray(head["weights_max"]) - mean], capsize=3)
        ax.set_xlabel("stream i")
        ax.set_ylabel("w_i")
        ax.set_title(f"learned head: stream weights (mean, min–max over tokens): {tag}", fontsize=8)
        _save(fig, out_dir, f"{prefix}head.png", figs,
              "The learned head's weights w_i = σ(·) + ε over the streams (reduction: learned): mean over the "
              "sampled tokens, bars from the smallest to the largest.")
    conv = [r for r in subs if r.get("conv_kernels")]
    if conv:
        scales = len(conv[0]["conv_kernels"])
        fig, axes = plt.subplots(1, scales, figsize=(3.6 * scales, 3.2), squeeze=False)
        for j in range(scales):
            ax = axes[0, j]
            for r in conv:
                kj = r["conv_kernels"][j]
                ax.plot(range(kj["size"]), kj["rms"], marker=".", label=_sub_title(r))
            ax.set_xlabel("tap i (lag: multiplies y[t − i])")
            ax.set_title(f"κ = {conv[0]['conv_kernels'][j]['size']}: RMS over channels", fontsize=8)
        axes[0, 0].legend(fontsize=6)
        fig.suptitle(f"temporal convolution kernels: {tag}", fontsize=9)
        _save(fig, out_dir, f"{prefix}temporal_kernels.png", figs,
              "xHC temporal convolution kernels per scale: RMS over channels of each tap, one line per MLP sublayer.")
        K = len(conv[0]["gs_rms_before"])
        fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(conv) * K / 2), 3.4))
        width = 0.8 / (2 * K)
        for q in range(K):
            name = "y" if q == 0 else f"g{q}"
            xs = np.arange(len(conv))
            ax.bar(xs + (2 * q) * width, [r["gs_rms_before"][q] for r in conv], width, label=f"{name} before")
            ax.bar(xs + (2 * q + 1) * width, [r["gs_rms_after"][q] for r in conv], width, label=f"{name} after",
                   hatch="//", alpha=0.7)
        ax.set_xticks(np.arange(len(conv)) + 0.4 - width / 2)
        ax.set_xticklabels([_sub_title(r) for r in conv], fontsize=7)
        ax.set_ylabel("RMS")
        ax.legend(fontsize=6, ncol=K)
        ax.set_title(f"write-back components before / after Gram–Schmidt: {tag}", fontsize=9)
        _save(fig, out_dir, f"{prefix}gram_schmidt.png", figs,
              "RMS of the write-back components [y, g_1 … g_r] before and after Gram–Schmidt, per MLP sublayer.")
    return figs


def figures_steps(run: dict, out_dir: str) -> list:
    """Small multiples over the kept checkpoints of one run (``--steps``)."""
    plt = _plt()
    figs: list = []
    ins = run["inspections"]
    rows, cols = _grid(len(ins), 4)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for ax in axes.flat:
        ax.axis("off")
    for ax, m in zip(axes.flat, ins):
        ax.axis("on")
        x = [r["index"] for r in m["sublayers"]]
        ax.plot(x, [r["dist_identity"] for r in m["sublayers"]], "o-", label="‖H̄ − I‖_F")
        ax.plot(x, [r["dist_permutation"] for r in m["sublayers"]], "^-", label="‖H̄ − P*‖_F")
        ax.plot(x, m["gain"]["forward"], "s--", label="forward gain")
        ax.set_title(f"step {m['step']}", fontsize=8)
        ax.set_xlabel("sublayer ℓ", fontsize=7)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(f"over training: {run['label']} ({run['variant']})", fontsize=9)
    _save(fig, out_dir, "steps_mixing.png", figs,
          "One panel per kept checkpoint: distance of H_res from I and from the permutations, and the forward gain, per sublayer.")
    import numpy as np

    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for ax in axes.flat:
        ax.axis("off")
    for ax, m in zip(axes.flat, ins):
        ax.axis("on")
        rms = np.array(m["depth"]["stream_rms"])
        for j in range(rms.shape[1]):
            ax.plot(range(rms.shape[0]), rms[:, j], lw=1)
        ax.set_title(f"step {m['step']}", fontsize=8)
        ax.set_xlabel("depth (layers)", fontsize=7)
    fig.suptitle(f"per-stream RMS over depth, over training: {run['label']}", fontsize=9)
    _save(fig, out_dir, "steps_stream_rms.png", figs,
          "One panel per kept checkpoint: the RMS of every stream over depth.")
    return figs


def figures_curves(runs: List[dict], out_dir: str) -> list:
    """Loss curves beside the logged HC health scalars (metrics.jsonl) of every run that has them."""
    runs = [r for r in runs if r.get("curves")]
    if not runs:
        return []
    plt = _plt()
    figs: list = []
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
    for r in runs:
        c = r["curves"]
        if c["train"]["step"]:
            axes[0].plot(c["train"]["step"], c["train"]["loss"], label=f"{r['label']} train")
        if c["eval"]["step"]:
            axes[0].plot(c["eval"]["step"], c["eval"]["loss"], "o--", label=f"{r['label']} validation")
        for key, ax in (("h_res_identity_distance", axes[1]), ("amax_gain_fwd", axes[2]), ("amax_gain_bwd", axes[2])):
            if key in c["hc"]:
                ax.plot(c["hc"][key]["step"], c["hc"][key]["value"], ".-", label=f"{r['label']} {key}")
    axes[0].set_title("loss", fontsize=9)
    axes[1].set_title("‖H_res − I‖_F (logged, mean over sublayers)", fontsize=9)
    axes[2].set_title("composite Amax gain (logged)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=6)
    _save(fig, out_dir, "training_curves.png", figs,
          "From metrics.jsonl: the loss curves beside the HC health scalars logged during training.")
    return figs


def figures_compare(runs: List[dict], out_dir: str) -> list:
    """Several SOURCEs on the same axes (their last inspected checkpoint)."""
    runs = [r for r in runs if r.get("hc") and r["inspections"]]
    if len(runs) < 2:
        return []
    plt = _plt()
    figs: list = []
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.6))
    for r in runs:
        m = r["inspections"][-1]
        x = [s["index"] for s in m["sublayers"]]
        lab = f"{r['label']} ({r['variant']})"
        axes[0].plot(x, [s["dist_identity"] for s in m["sublayers"]], "o-", label=lab)
        axes[1].plot(x, m["gain"]["forward"], "o-", label=lab)
        axes[2].plot(x, m["gain"]["backward"], "o-", label=lab)
        rms = m["depth"]["stream_rms"]
        axes[3].plot(range(len(rms)), [max(v) / max(min(v), 1e-30) for v in rms], "o-", label=lab)
    for ax, t in zip(axes, ("‖H̄_res − I‖_F per sublayer", "forward Amax gain over depth", "backward Amax gain over depth",
                            "max / min stream RMS over depth (layers)")):
        ax.set_title(t, fontsize=9)
        ax.legend(fontsize=6)
        _tame(ax)
    _save(fig, out_dir, "compare.png", figs,
          "The SOURCEs side by side: distance from the identity, forward and backward gain, and the spread of stream RMS.")
    return figs
