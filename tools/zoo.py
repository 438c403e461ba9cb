"""Print the model zoo table: every preset built on the meta device (no weights allocated).

    python -m tools.zoo                      # the paper backbones x {vanilla, mHC, xHC, Flash, Flash-4sub}
    python -m tools.zoo --list               # every preset name
    python -m tools.zoo moe-2p5b:xhc-n8 tiny-moe:mhc
    python -m tools.zoo --json

Columns: total parameters and activated parameters (routed experts counted top-k/E; embeddings
and output layer included) counted from the real Megatron ``GPTModel``; hyper-connection
parameters (``numel`` of the tagged HC tensors); training FLOPs per token (Megatron's
convention for the backbone, see ``xhc.accounting.FLOPS_CONVENTIONS``, plus F_HC = 6·P_HC,
docs/math.md §5.2); memory traffic per sublayer in units of C (docs/math.md §5.3).  The paper's total/activated
figures are shown beside the backbones, with the relative difference.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
import warnings

import torch

from models.zoo import backbone_shape, count_model  # noqa: F401  (moved to models/zoo.py; re-exported)

warnings.filterwarnings("ignore", message=".*Apex.*")
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

PAPER_BACKBONE = {"moe-2p5b": (2.5e9, 0.5e9), "moe-10b": (10e9, 1.4e9), "moe-18b": (18e9, 1.7e9),
                  "moe-28b": (28e9, 2.7e9)}
DEFAULT = [f"{size}:{v}" for size in ("moe-2p5b", "moe-10b", "moe-18b", "moe-28b")
           for v in ("vanilla", "mhc", "xhc", "xhc-flash", "xhc-flash4")]


def zoo_row(name: str) -> dict:
    """Build one preset on the meta device and account for it."""
    from models.zoo import build_model, build_transformer_config, load_preset
    from xhc.accounting import memory_traffic_summary, training_flops_per_token, vanilla_flops_per_token

    preset = load_preset(name)
    cfg = build_transformer_config(preset, cpu=True)
    t0 = time.time()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = build_model(preset, cfg, use_transformer_engine=False)
    b = preset.backbone
    counts = count_model(model, int(b.get("moe_router_topk") or 0), int(b.get("num_moe_experts") or 0))
    shape = backbone_shape(preset)
    f_vanilla = vanilla_flops_per_token(shape, "megatron")
    f_hc = training_flops_per_token(preset.hc, preset.hidden_size, preset.num_layers).f_hc if preset.hc.enabled else 0
    try:
        traffic = memory_traffic_summary(preset.hc)
        traffic_txt, traffic_c = f"{traffic.read:g}+{traffic.write:g}={traffic.total:g}C", traffic.total
    except Exception as e:  # e.g. Flash-4sub outside N=16,k=4 has no published formula
        traffic_txt, traffic_c = f"n/a ({type(e).__name__})", None
    file = name.split(":")[0]
    paper = PAPER_BACKBONE.get(file)
    return {"preset": name, **counts, "flops_per_token": f_vanilla + f_hc, "f_hc": f_hc,
            "f_vanilla": f_vanilla, "traffic_per_sublayer": traffic_txt, "traffic_C": traffic_c,
            "paper_total": paper[0] if paper else None, "paper_activated": paper[1] if paper else None,
            "build_s": round(time.time() - t0, 1)}


def _h(x):
    if x is None:
        return "-"
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:g}"


def _rel(ours, paper):
    return "" if not paper else f" ({(ours - paper) / paper * 100:+.0f}%)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="*", help="preset names (default: the paper backbones x 5 arms)")
    ap.add_argument("--list", action="store_true", help="list every preset and exit")
    ap.add_argument("--json", action="store_true", help="print JSON rows")
    args = ap.parse_args(argv)

    from models.parallel import initialize_parallel
    from models.zoo import list_presets

    if args.list:
        print("\n".join(list_presets()))
        return 0
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        initialize_parallel(1, 1, 1)
    rows = []
    names = args.presets or DEFAULT
    for i, name in enumerate(names):
        print(f"[zoo] building {name} on the meta device ({i + 1}/{len(names)})", file=sys.stderr, flush=True)
        rows.append(zoo_row(name))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    hdr = f"{'preset':<22}{'total [paper]':>22}{'activated [paper]':>24}{'HC params':>11}{'FLOPs/token':>13}{'F_HC':>9}  traffic/sublayer"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        tot = _h(r["total"]) + (f" [{_h(r['paper_total'])}]" if r["paper_total"] else "") + _rel(r["total"], r["paper_total"])
        act = _h(r["activated"]) + (f" [{_h(r['paper_activated'])}]" if r["paper_activated"] else "") + \
            _rel(r["activated"], r["paper_activated"])
        print(f"{r['preset']:<22}{tot:>22}{act:>24}{_h(r['hc']):>11}{_h(r['flops_per_token']):>13}"
              f"{_h(r['f_hc']):>9}  {r['traffic_per_sublayer']}")
    print("\nFLOPs/token: Megatron-Core's formula for the backbone (6 x activated non-embedding params + LM head "
          "+ causal attention at the preset's sequence length) + F_HC = 6 x HC GEMM/conv params (docs/math.md §5.2).")
    print("Activated counts top-k/E of the routed experts and every other weight, embeddings and output layer "
          "included. Where the paper differs by >10% see docs/reproducing.md ('Model zoo') for why.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
