"""The planner beside the measurements: docs/planning.md's calibration and zoo tables.

    python -m bench.plan_calibration                 # HC units, shrunk-run throughput, train_eval peak (H200)
    python -m bench.plan_calibration --table h100    # moe-2p5b/10b/18b x {vanilla, mhc, xhc, xhc-flash4}
    python -m bench.plan_calibration --activations   # planned vs measured activations, the tiny cases (CPU)

The measured numbers are docs/gpu.md's ("Results", 2026-12-04, one H200); the planned ones come from
:func:`training.plan.make_plan` with the default efficiencies (and ``layer_overhead_ms`` fitted to the
vanilla run where said).
"""

from __future__ import annotations

import argparse
import sys
import warnings

GIB = 2 ** 30
HC_UNITS = (  # (name, preset giving the HCConfig or None, sublayers, measured ms fwd+bwd, compile path)
    ("plain residual add (3C)", None, 1, 0.154), ("mHC N=4 sublayer", "moe-2p5b:mhc-n4", 1, 3.386),
    ("xHC MLP sublayer", "moe-2p5b:xhc-n16", 1, 9.949), ("Flash-4sub window", "moe-2p5b:xhc-flash4", 4, 4.670))
THROUGHPUT = {"vanilla": (25477, 0.014), "mhc": (21858, 0.012), "xhc-flash4": (16787, 0.010)}
SHRUNK = ["model.backbone.num_layers=4", "batch.seq_length=2048", "batch.micro_batch_size=4", "batch.global_batch_size=8",
          "data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=32768", "model.recompute=selective"]
CLUSTERS = (("moe-2p5b", "configs/pretrain/moe-2p5b-nsweep.yaml", 16), ("moe-10b", "configs/pretrain/moe-10b-xhc.yaml", 32),
            ("moe-18b", "configs/pretrain/moe-18b-xhc.yaml", 64), ("moe-28b", "configs/pretrain/moe-28b-xhc.yaml", 128))


def hc_units():
    """(name, traffic in units of C, bytes, measured ms, achieved HBM fraction, planned ms) per HC unit of
    docs/gpu.md's step 5 (C = 2048, 8192 tokens, bf16, the compile path)."""
    from models.zoo import load_preset
    from training.plan import GPUS, HC_TRAINING_TRAFFIC, Efficiencies
    from xhc.accounting import memory_traffic_summary

    gpu, eff = GPUS["h200"], Efficiencies()
    C, T = 2048, 8192
    rows = []
    for name, preset, subl, ms in HC_UNITS:
        if preset is None:
            per = 3.0
        else:
            s = memory_traffic_summary(load_preset(preset).hc)
            per = s.tables[1].read + s.tables[1].write if name.startswith("xHC MLP") else s.total
        nbytes = per * subl * C * T * 2 * HC_TRAINING_TRAFFIC
        rows.append((name, per * subl, nbytes, ms, nbytes / (ms * 1e-3) / (gpu.hbm_tbs * 1e12),
                     nbytes / (gpu.hbm_tbs * 1e12 * eff.hbm) * 1e3))
    return rows


def calibration() -> None:
    from training.config import load_config
    from training.plan import GPUS, HC_TRAINING_TRAFFIC, Efficiencies, make_plan

    gpu, eff = GPUS["h200"], Efficiencies()
    print(f"HC units (C=2048, 8192 tokens, bf16, fwd+bwd = accounted forward traffic x {HC_TRAINING_TRAFFIC:g}), "
          f"hbm={eff.hbm:g} of {gpu.hbm_tbs:g} TB/s:")
    for name, per, nbytes, ms, achieved, planned in hc_units():
        print(f"  {name}: {per:g}C, {nbytes / 1e9:.2f} GB; measured {ms} ms ({achieved:.3f} of HBM); planned "
              f"{planned:.2f} ms ({planned / ms - 1:+.0%})")
    print("Throughput, moe-2p5b cut to 4 layers, seq 2048, micro-batch 4 x 2, one H200:")
    for overhead in (0.0, 25.9):
        e = Efficiencies(layer_overhead_ms=overhead)
        for v, (tps, mfu) in THROUGHPUT.items():
            p = make_plan(load_config(None, [f"model.preset=moe-2p5b:{v}", *SHRUNK]), 1, gpu, e)
            print(f"  layer_overhead_ms={overhead:g} {v}: measured {tps:,} tok/s (MFU {mfu:.1%}); planned "
                  f"{p.tokens_per_s:,.0f} tok/s ({p.tokens_per_s / tps:.2f}x), MFU {p.mfu:.1%}, peak {p.peak.total / GIB:.2f} GiB")
    cfg = load_config(None, ["model.preset=tiny-moe:xhc", "batch.seq_length=128", "batch.micro_batch_size=4",
                             "batch.global_batch_size=8", "data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=1024"])
    p = make_plan(cfg, 1, gpu)
    print(f"train_eval (tiny-moe:xhc, bf16, seq 128, micro-batch 4): measured peak 0.10 GiB; planned "
          f"{p.peak.total / GIB:.3f} GiB")


def table(kind: str) -> None:
    from training.config import load_config
    from training.plan import GPUS, make_plan

    gpu = GPUS[kind]
    print("| preset:variant | GPUs | layout | weights | grads | optimizer | activations, HC recompute off | on | "
          "total (off) | tokens/s (off) | MFU (off) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size, path, g in CLUSTERS:
        for v in ("vanilla", "mhc", "xhc", "xhc-flash4"):
            p, q = (make_plan(load_config(path, [f"model.preset={size}:{v}", f"model.hc_recompute={r}"]), g, gpu)
                    for r in ("false", "true"))
            pk = p.peak
            print(f"| {size}:{v} | {g}x {gpu.name} | {p.lay.describe().rsplit(' recompute', 1)[0]} | "
                  f"{pk.state.weights / GIB:.2f} | {pk.state.grads / GIB:.2f} | {pk.state.optimizer / GIB:.2f} | "
                  f"{pk.act.total / GIB:.2f} | {q.peak.act.total / GIB:.2f} | {pk.total / GIB:.2f} | "
                  f"{p.tokens_per_s:,.0f} | {p.mfu:.1%} |", flush=True)


def activations() -> None:
    """Planned vs measured activations of one micro-batch on CPU for every tiny case of tests/test_plan.py."""
    import contextlib
    import io

    import torch

    from models.parallel import initialize_parallel
    from models.zoo import build_model, build_transformer_config, load_preset
    from training.plan import Layout, SavedTensorMeter, activation_bytes

    with contextlib.redirect_stdout(io.StringIO()):
        initialize_parallel(1, 1, 1)
    print("| variant | N | HC recompute | seq | measured (bytes) | planned (bytes) | error |")
    print("|---|---|---|---|---|---|---|")
    for v in ("vanilla", "hc", "mhc", "mhc-lite", "kromhc", "identity", "xhc", "xhc-flash", "xhc-flash4"):
        ns = (8, 16) if v.startswith("xhc") else (3, 4) if v == "mhc-lite" else (4, 8)
        for n in ns:
            for rec in (False, True):
                for seq in (32, 64):
                    preset = load_preset(f"tiny-moe:{v}", backbone_overrides={"hc_recompute": rec},
                                         hc_overrides={"n": n} if v != "vanilla" else None)
                    model = build_model(preset, build_transformer_config(preset, cpu=True), vocab_size=256, seq_length=seq)
                    g = torch.Generator().manual_seed(0)
                    tokens = torch.randint(0, 256, (2, seq), generator=g)
                    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
                        model(tokens, torch.arange(seq).expand(2, seq), None, labels=tokens).float().mean()
                    lay = Layout(gpus=1, gpu=False, bf16=False, micro_batch=2, global_batch=2, seq=seq,
                                 hc_recompute=rec, vocab=256)
                    planned = activation_bytes(preset, lay, 0).total
                    print(f"| {v} | {n if v != 'vanilla' else '-'} | {'on' if rec else 'off'} | {seq} | {meter.bytes:,} | "
                          f"{planned:,.0f} | {planned / meter.bytes - 1:+.1%} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default=None, help="print the zoo table on this GPU kind instead (e.g. h100)")
    ap.add_argument("--activations", action="store_true", help="planned vs measured activations, tiny cases (CPU)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.activations:
        activations()
    elif args.table:
        table(args.table)
    else:
        calibration()
    return 0


if __name__ == "__main__":
    sys.exit(main())
