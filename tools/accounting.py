"""Print the hyper-connection cost accounting table (docs/math.md §5).

    python -m tools.accounting                          # paper sizes × paper arms
    python -m tools.accounting --sizes 18B 28B --rows   # plus the row-by-row traffic tables
    python -m tools.accounting --variant xhc --n 8 --k 2 --m 1 --hidden 2048 --layers 24
    python -m tools.accounting --size 18B --n 32 --k 8 --variant xhc   # paper backbone, custom HC
    python -m tools.accounting --json                   # machine-readable

For every (backbone, method) it prints: the coefficient of C per layer, HC parameters per layer
(full count) and for the model, F_HC per token (6·P·L, docs/math.md §5.2), the overhead over F_vanilla
under a *named* convention (``--convention``; the papers leave the denominator open, docs/math.md §8 #28), and
the traffic per sublayer (§5.3).  Where [xHC] prints a figure it is shown beside ours in
brackets; those figures live only in :data:`PAPER` and are used for display only.

The "conventions" block compares the paper's 18B / 28B / 10B percentages with every F_vanilla
convention and shows the F_vanilla each percentage implies.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

from xhc.accounting import (
    DEFAULT_FLOPS_CONVENTION, FLOPS_CONVENTIONS, PAPER_SIZES, AccountingError, BackboneShape,
    backbone_params, dominant_coeff_per_layer, hc_params_per_window, hc_params_total,
    memory_traffic_flash4_window, memory_traffic_flash_layer, memory_traffic_per_sublayer, memory_traffic_summary,
    training_flops_per_token, vanilla_flops_per_token, window_layers,
)
from xhc.config import HCConfig, HCConfigError

# ------------------------------------------------------------------------------------------------
# The paper's arms and its printed figures (display only; tests never read PAPER)
# ------------------------------------------------------------------------------------------------
ARMS: Dict[str, HCConfig] = {
    "vanilla": HCConfig(variant="none"),
    "mhc4": HCConfig(variant="mhc", n=4),
    "mhc16": HCConfig(variant="mhc", n=16),
    "xhc": HCConfig(variant="xhc", n=16, k=4, m=2),
    "flash": HCConfig(variant="xhc_flash", n=16, k=4, m=2),
    "flash4": HCConfig(variant="xhc_flash4", n=16, k=4, m=2),
}

PAPER = {
    # [xHC] as quoted in docs/math.md §5.1 (per-layer params), §5.2 / §7.1 (FLOPs overhead over vanilla),
    # §5.3 / §7.1 (traffic per sublayer, units of C), §6.1 (backbone total / activated).
    "params_per_layer": {("18B", "mhc4"): "405K", ("18B", "mhc16"): "19.5M", ("18B", "xhc"): "2.65M",
                         ("28B", "mhc4"): "492K", ("28B", "mhc16"): "23.6M", ("28B", "xhc"): "3.22M"},
    "overhead_pct": {("18B", "xhc"): 4.1, ("18B", "mhc4"): 0.7, ("18B", "mhc16"): 18.9,
                     ("28B", "xhc"): 3.0, ("28B", "mhc4"): 0.5, ("28B", "mhc16"): 22.3,
                     ("10B", "mhc4"): 0.6, ("10B", "mhc16"): 18.8, ("10B", "xhc"): 3.3},
    "traffic_C": {"vanilla": 3, "mhc4": 34, "mhc16": 130, "xhc": 73.5, "flash": 51, "flash4": 40},
    "backbone": {"2.5B": (2.5e9, 0.5e9), "10B": (10e9, 1.4e9), "18B": (18e9, 1.7e9), "28B": (28e9, 2.7e9)},
    "sweep_2p5b": "N=4→16 at 2.5B: mHC +32% FLOPs, xHC +4%",
}


def human(x: Optional[float], digits: int = 4) -> str:
    """1234567 -> '1.235M' (4 significant digits)."""
    if x is None:
        return "n/a"
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            v = x / div
            return f"{v:.{max(digits - len(str(int(abs(v)))), 0)}f}{unit}"
    return f"{x:g}"


# ------------------------------------------------------------------------------------------------
# Rows
# ------------------------------------------------------------------------------------------------
def account(shape: BackboneShape, name: str, cfg: HCConfig, convention: str) -> dict:
    """Every number of one (backbone, method) pair, as a flat dict."""
    C, L = shape.hidden, shape.num_layers
    total = hc_params_total(cfg, C, L)
    window = hc_params_per_window(cfg, C)
    flops = training_flops_per_token(cfg, C, L)
    row = {
        "size": shape.name, "method": name, "variant": cfg.variant, "n": cfg.n if cfg.enabled else None,
        "k": cfg.k if cfg.is_xhc else None, "C": C, "L": L,
        "coeff_C_per_layer": dominant_coeff_per_layer(cfg),
        "params_per_layer": window.total / window_layers(cfg),
        "params_per_layer_dominant": window.dominant / window_layers(cfg),
        "params_total": total.total,
        "f_hc_per_token": flops.f_hc,
        "f_extras_per_token": flops.extras,
        "f_breakdown": {"gemm": flops.gemm, "conv": flops.conv, "res_map": flops.res_map,
                        "mixing": flops.mixing, "norms": flops.norms, "gram_schmidt": flops.gram_schmidt},
        "convention": convention,
        "paper_params_per_layer": PAPER["params_per_layer"].get((shape.name, name)),
        "paper_overhead_pct": PAPER["overhead_pct"].get((shape.name, name)),
        "paper_traffic_C": PAPER["traffic_C"].get(name),
    }
    if backbone_complete(shape):
        f_v = vanilla_flops_per_token(shape, convention)
        row["f_vanilla_per_token"] = f_v
        row["overhead_pct"] = 100.0 * flops.f_hc / f_v
    else:
        row["f_vanilla_per_token"] = row["overhead_pct"] = None
    try:
        t = memory_traffic_summary(cfg)
        row["traffic_read_C"], row["traffic_write_C"], row["traffic_C"] = t.read, t.write, t.total
        row["traffic_note"] = t.note
    except AccountingError as e:
        row["traffic_read_C"] = row["traffic_write_C"] = row["traffic_C"] = None
        row["traffic_note"] = str(e)
    return row


def backbone_complete(shape: BackboneShape) -> bool:
    """A custom backbone without expert width (and with MoE layers) has no F_vanilla."""
    return shape.expert_ffn > 0 or shape.num_dense_layers >= shape.num_layers


def method_label(name: str, cfg: HCConfig) -> str:
    if name != "custom":
        return name
    label = f"{cfg.variant}(N={cfg.n}"
    if cfg.is_xhc:
        label += f",k={cfg.k},m={cfg.m}"
    label += "" if cfg.dynamic else ",static"
    label += ",deepseek_v4" if cfg.convention == "deepseek_v4" else ""
    return label + (",learned head" if cfg.reduction == "learned" else "") + ")"


def format_table(rows: List[dict]) -> str:
    ws = max([len(r["size"]) for r in rows] + [4]) + 2
    wm = max([len(r["method"]) for r in rows] + [6]) + 2
    head = (f"{'size':<{ws}}{'method':<{wm}}{'coef·C/layer':>13}{'HC params/layer':>24}{'HC params total':>17}"
            f"{'F_HC/token':>12}{'overhead %':>17}{'traffic/sublayer':>24}")
    out = [head, "-" * len(head)]
    prev = None
    for r in rows:
        if prev is not None and r["size"] != prev:
            out.append("")
        prev = r["size"]
        per_layer = human(r["params_per_layer"])
        if r["paper_params_per_layer"]:
            per_layer += f" [{r['paper_params_per_layer']}]"
        ov = "n/a" if r["overhead_pct"] is None else f"{r['overhead_pct']:.2f}"
        if r["paper_overhead_pct"] is not None:
            ov += f" [{r['paper_overhead_pct']:.1f}]"
        if r["traffic_C"] is None:
            tr = "n/a (no formula)"
        else:
            tr = f"{r['traffic_read_C']:g}+{r['traffic_write_C']:g}={r['traffic_C']:g}C"
            if r["paper_traffic_C"] is not None:
                tr += f" [{r['paper_traffic_C']:g}]"
        coef = r["coeff_C_per_layer"]
        out.append(f"{r['size']:<{ws}}{r['method']:<{wm}}{coef:>13g}{per_layer:>24}{human(r['params_total']):>17}"
                   f"{human(r['f_hc_per_token']):>12}{ov:>17}{tr:>24}")
    conv = rows[0]["convention"] if rows else DEFAULT_FLOPS_CONVENTION
    out += ["", "[...] = figure printed in [xHC] (display only).  coef·C/layer: GEMM + conv parameters / C "
                "(Flash-4sub: half its two-layer window).",
            "HC params include biases, gates, norm gains and readout (or learned head); "
            "F_HC = 6·(GEMM + conv params)·L (+ the learned head's GEMM once) "
            "(docs/math.md §5.2; Sinkhorn, mixing, norms, GS listed separately with --json).",
            f"overhead % = F_HC / F_vanilla with convention '{conv}': {FLOPS_CONVENTIONS[conv]}."]
    return "\n".join(out)


def backbone_table(shapes: List[BackboneShape], convention: str) -> str:
    lines = [f"{'size':<6}{'layers':>7}{'C':>6}{'total':>16}{'activated':>16}{'act. non-emb':>14}"
             f"{'F_vanilla/token':>17}"]
    for s in shapes:
        if not backbone_complete(s):
            lines.append(f"{s.name:<6}{s.num_layers:>7}{s.hidden:>6}   n/a: pass --expert-ffn (MoE) or "
                         f"--dense-layers {s.num_layers} --dense-ffn F (dense) for backbone counts")
            continue
        p = backbone_params(s)
        paper = PAPER["backbone"].get(s.name)
        tot = human(p.total) + (f" [{human(paper[0], 3)}]" if paper else "")
        act = human(p.activated) + (f" [{human(paper[1], 3)}]" if paper else "")
        fv = human(vanilla_flops_per_token(s, convention)) if backbone_complete(s) else "n/a"
        lines.append(f"{s.name:<6}{s.num_layers:>7}{s.hidden:>6}{tot:>16}{act:>16}"
                     f"{human(p.nonembedding_activated):>14}{fv:>17}")
    lines.append("activated = top-k + shared experts and every non-expert weight, input embedding and "
                 "LM head included; gaps per docs/math.md §8 #30.")
    return "\n".join(lines)


def conventions_report(shapes: List[BackboneShape]) -> str:
    """Overhead under every F_vanilla convention beside the paper's %, and the F_vanilla each
    printed % implies (F_HC / pct)."""
    conv_names = list(FLOPS_CONVENTIONS)
    lines = ["FLOPs overhead (%) under each F_vanilla convention, paper value in the last column;",
             "'implied F_v' = our F_HC / paper % (GFLOPs per token).",
             f"{'size':<6}{'method':<8}" + "".join(f"{c:>20}" for c in conv_names) + f"{'paper':>8}{'implied F_v':>13}"]
    for s in shapes:
        fv = {c: vanilla_flops_per_token(s, c) for c in conv_names}
        lines.append(f"{s.name:<6}{'F_v (G)':<8}" + "".join(f"{fv[c] / 1e9:>20.2f}" for c in conv_names))
        for name in ("mhc4", "mhc16", "xhc"):
            f = training_flops_per_token(ARMS[name], s.hidden, s.num_layers).f_hc
            paper = PAPER["overhead_pct"].get((s.name, name))
            implied = f"{f / (paper / 100) / 1e9:>13.2f}" if paper else f"{'':>13}"
            lines.append(f"{'':<6}{name:<8}" + "".join(f"{100 * f / fv[c]:>20.2f}" for c in conv_names)
                         + (f"{paper:>8.1f}" if paper else f"{'':>8}") + implied)
    sweep = [s for s in shapes if s.name == "2.5B"]
    for s in sweep:  # [xHC] Fig. 1: going from N=4 to N=16 at 2.5B
        f = lambda cfg: training_flops_per_token(cfg, s.hidden, s.num_layers).f_hc  # noqa: E731
        d_mhc = f(ARMS["mhc16"]) - f(ARMS["mhc4"])
        d_xhc = f(ARMS["xhc"]) - f(HCConfig(variant="xhc", n=4, k=2, m=1))
        cells = [f"{100 * d_mhc / fv:.1f} / {100 * d_xhc / fv:.1f}"
                 for fv in (vanilla_flops_per_token(s, c) for c in conv_names)]
        lines.append(f"{s.name:<6}{'N4→16':<8}" + "".join(f"{cell:>20}" for cell in cells)
                     + "   paper: mHC +32 / xHC +4 (ΔF_HC / F_v)")
    for c in conv_names:
        lines.append(f"  {c}: {FLOPS_CONVENTIONS[c]}")
    return "\n".join(lines)


def traffic_rows_report(methods: Dict[str, HCConfig]) -> str:
    blocks = []
    for name, cfg in methods.items():
        try:
            if cfg.variant == "xhc_flash":
                blocks.append(memory_traffic_flash_layer(cfg).format())
            elif cfg.variant == "xhc":
                blocks += [memory_traffic_per_sublayer(cfg, "attention").format(),
                           memory_traffic_per_sublayer(cfg, "mlp").format()]
            elif cfg.variant == "xhc_flash4":
                t = memory_traffic_summary(cfg)
                blocks.append(memory_traffic_flash4_window(cfg).format()
                              + f"\n  per sublayer: {t.read:g}C reads + {t.write:g}C writes ({t.note})")
            else:
                blocks.append(f"[{name}] " + memory_traffic_per_sublayer(cfg).format())
        except AccountingError as e:
            blocks.append(f"{name}: {e}")
    return "\n\n".join(blocks)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.accounting", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("backbone (default: the four paper sizes)")
    g.add_argument("--sizes", "--size", nargs="+", choices=PAPER_SIZES, help="paper backbones to use")
    g.add_argument("--hidden", type=int, help="C; with --layers builds a custom backbone (or overrides --size)")
    g.add_argument("--layers", type=int, help="number of transformer layers L")
    g.add_argument("--heads", type=int)
    g.add_argument("--kv-groups", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--expert-ffn", type=int)
    g.add_argument("--experts", type=int)
    g.add_argument("--top-k", type=int)
    g.add_argument("--shared-experts", type=int)
    g.add_argument("--dense-ffn", type=int)
    g.add_argument("--dense-layers", type=int)
    g.add_argument("--vocab", type=int)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--tied-embeddings", action="store_true")
    h = p.add_argument_group("hyper connections (default: vanilla, mHC N=4/16, xHC, Flash, Flash-4sub)")
    h.add_argument("--methods", nargs="+", choices=list(ARMS), help="subset of the paper arms")
    h.add_argument("--variant", help="custom HC variant (any HCConfig.variant)")
    h.add_argument("--n", type=int)
    h.add_argument("--k", type=int)
    h.add_argument("--m", type=int)
    h.add_argument("--kernels", type=int, nargs="*", help="temporal conv kernel sizes, e.g. 4 8 12")
    h.add_argument("--static", action="store_true", help="static (not dynamic) coefficients")
    h.add_argument("--hc-yaml", help="YAML file with HCConfig fields for the custom method")
    t = p.add_argument_group("multi-token prediction")
    t.add_argument("--mtp-layers", type=int, default=0, metavar="D",
                   help="also count D MTP depths per model (models.mtp.mtp_counts): parameters and training "
                        "FLOPs per token, and their share of the model's")
    o = p.add_argument_group("output")
    o.add_argument("--convention", default=DEFAULT_FLOPS_CONVENTION, choices=list(FLOPS_CONVENTIONS),
                   help="F_vanilla model for the overhead %% (default: %(default)s)")
    o.add_argument("--rows", action="store_true", help="also print the row-by-row traffic tables")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _shapes(a) -> List[BackboneShape]:
    overrides = {k: v for k, v in dict(
        hidden=a.hidden, num_layers=a.layers, num_heads=a.heads, num_kv_groups=a.kv_groups,
        head_dim=a.head_dim, expert_ffn=a.expert_ffn, num_experts=a.experts, top_k=a.top_k,
        num_shared_experts=a.shared_experts, dense_ffn=a.dense_ffn, num_dense_layers=a.dense_layers,
        vocab=a.vocab, seq_len=a.seq_len).items() if v is not None}
    if a.tied_embeddings:
        overrides["tied_embeddings"] = True
    if a.sizes:
        shapes = [BackboneShape.paper(s) for s in a.sizes]
        return [_replace_shape(s, overrides, f"{s.name}*") if overrides else s for s in shapes]
    if not overrides:
        return [BackboneShape.paper(s) for s in PAPER_SIZES]
    if "hidden" not in overrides or "num_layers" not in overrides:
        raise SystemExit("a custom backbone needs --hidden and --layers (or start from a paper one, "
                         "e.g. --size 18B); add --expert-ffn (or --dense-layers = --layers) for F_vanilla")
    C = overrides["hidden"]
    base = dict(name="custom", num_layers=overrides["num_layers"], hidden=C,
                num_heads=overrides.get("num_heads", max(C // 128, 1)),
                num_kv_groups=overrides.get("num_kv_groups", max(C // 256, 1)),
                expert_ffn=overrides.get("expert_ffn", 0))
    base.update(overrides)
    return [BackboneShape(**base)]


def _replace_shape(shape: BackboneShape, overrides: dict, name: str) -> BackboneShape:
    from dataclasses import replace
    return replace(shape, name=name, **overrides)


def _methods(a) -> Dict[str, HCConfig]:
    custom = {k: v for k, v in dict(variant=a.variant, n=a.n, k=a.k, m=a.m).items() if v is not None}
    if a.kernels is not None:
        custom["kernel_sizes"] = tuple(a.kernels)
    if a.static:
        custom["dynamic"] = False
    if a.hc_yaml:
        import yaml
        with open(a.hc_yaml, encoding="utf-8") as f:
            custom = {**(yaml.safe_load(f) or {}), **custom}
    methods = {name: ARMS[name] for name in (a.methods or (ARMS if not custom else ["vanilla"]))}
    if custom:
        try:
            cfg = HCConfig.from_dict({"variant": "xhc", **custom})
        except HCConfigError as e:
            raise SystemExit(str(e))
        methods["custom"] = cfg
    return methods


def mtp_rows(shapes: List[BackboneShape], methods: Dict[str, HCConfig], depths: int, convention: str) -> List[dict]:
    """One row per backbone × method: the MTP depths' parameters and training FLOPs per token
    (:func:`models.mtp.mtp_counts`) and their share of the main model's training FLOPs."""
    from models.mtp import mtp_counts

    rows = []
    for s in shapes:
        if not backbone_complete(s):
            continue
        for name, cfg in methods.items():
            m = mtp_counts(s, cfg, depths, convention)
            main = vanilla_flops_per_token(s, convention) + (
                training_flops_per_token(cfg, s.hidden, s.num_layers).f_hc if cfg.enabled else 0.0)
            f = m["flops_backbone"] + m["flops_hc"]
            rows.append({"size": s.name, "method": method_label(name, cfg), "depths": depths, **m,
                         "flops_per_token": f, "flops_share_pct": 100.0 * f / main})
    return rows


def mtp_table(rows: List[dict]) -> str:
    out = [f"{'size':<6}{'method':<16}{'D':>3}{'MTP params':>14}{'activated':>14}{'HC':>12}{'F_MTP/token':>14}"
           f"{'of model':>10}"]
    for r in rows:
        out.append(f"{r['size']:<6}{r['method']:<16}{r['depths']:>3}{human(r['params_total']):>14}"
                   f"{human(r['params_activated']):>14}{human(r['params_hc']):>12}{human(r['flops_per_token']):>14}"
                   f"{r['flops_share_pct']:>9.1f}%")
    out.append("MTP depth: enorm, hnorm, h_proj + e_proj (vanilla: eh_proj), one layer of the decoder's last kind "
               "with its HC modules and head, final norm; FLOPs include the shared output layer's GEMM.")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    shapes, methods = _shapes(a), _methods(a)
    rows = [account(s, method_label(name, cfg), cfg, a.convention) for s in shapes for name, cfg in methods.items()]
    paper_shapes = [s for s in shapes if s.name in PAPER_SIZES]
    if a.json:
        payload = {"convention": a.convention, "conventions": FLOPS_CONVENTIONS, "rows": rows,
                   "backbones": [{"size": s.name, **backbone_params(s)._asdict(),
                                  "f_vanilla": {c: vanilla_flops_per_token(s, c) for c in FLOPS_CONVENTIONS}
                                  if backbone_complete(s) else None} for s in shapes],
                   "paper": {"overhead_pct": {f"{k[0]}/{k[1]}": v for k, v in PAPER["overhead_pct"].items()},
                             "traffic_C": PAPER["traffic_C"]}}
        if a.mtp_layers:
            payload["mtp"] = mtp_rows(shapes, methods, a.mtp_layers, a.convention)
        json.dump(payload, sys.stdout, indent=1)
        print()
        return 0
    print(format_table(rows))
    print()
    print(backbone_table(shapes, a.convention))
    if a.mtp_layers:
        print()
        print(mtp_table(mtp_rows(shapes, methods, a.mtp_layers, a.convention)))
    if paper_shapes and not any(n == "custom" for n in methods):
        print()
        print(conventions_report(paper_shapes))
    if a.rows:
        print()
        print(traffic_rows_report(methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
