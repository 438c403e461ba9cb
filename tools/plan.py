"""Plan a run before launching it: memory per GPU (the most loaded rank), fits or not, step time, tokens/s, MFU.

    python -m tools.plan --config configs/pretrain/moe-18b-xhc.yaml --gpus 64 --gpu h200
    python -m tools.plan --preset moe-18b:xhc --gpus 64 --gpu h100 parallel.tp=2 parallel.sp=true \\
        parallel.ep=8 parallel.pp=4 batch.seq_length=4096 batch.micro_batch_size=1 batch.global_batch_size=512
    python -m tools.plan --config ... --gpus 64 --gpu h200 --search        # the ten fastest layouts that fit
    python -m tools.plan --config configs/pretrain/moe-2p5b-nsweep.yaml --gpus 16 --n 2,4,8,16
    python -m tools.plan --sweep configs/sweeps/paper-2p5b.yaml --gpu h200
    xhc-plan ...                                                             # the same, as a console script

The config is training's (``--config`` YAML, ``key=value`` overrides, ``--preset`` for ``model.preset``); the
GPU comes from the table in docs/planning.md (``--gpu a100|h100|h200|b200``) or explicit numbers
(``--memory-gb``, ``--tflops``, ``--hbm-tbs``, ``--nvlink-gbs``, ``--network-gbs``).  The time model's
efficiencies are printed with every plan and can be set (``--eff gemm=0.7,attn=0.5,moe_layer_overhead_ms=0``;
docs/planning.md lists them and where each comes from; ``python -m bench.plan_public`` checks them on published
runs).  The same plan is
printed by training at start-up (training.plan.plan_block).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from typing import List, Optional, Sequence

from tools._cli import run_main


class PlanCliError(ValueError):
    """Bad command-line input (one line, naming the option)."""


def _gpu(args):
    from training.plan import GPUS

    if args.gpu == "cpu":  # training's CPU path: fp32, torch optimizers, GPipe; no capacity, no time
        return None
    if args.gpu not in GPUS:
        raise PlanCliError(f"--gpu {args.gpu!r} is not in the table; use one of {', '.join(GPUS)} (or give "
                           "--memory-gb/--tflops/... on top of one of them)")
    base = GPUS[args.gpu]
    fields = {"memory_gb": args.memory_gb, "bf16_tflops": args.tflops, "hbm_tbs": args.hbm_tbs,
              "nvlink_gbs": args.nvlink_gbs, "network_gbs": args.network_gbs, "per_node": args.per_node}
    fields = {k: v for k, v in fields.items() if v is not None}
    for k, v in fields.items():
        if v <= 0:
            raise PlanCliError(f"--{k.replace('_', '-')} {v!r} must be > 0")
    if "memory_gb" in fields:
        fields["memory_mib"] = None  # the given GB, not the table's driver figure
    return dataclasses.replace(base, name=base.name + ("*" if fields else ""), **fields) if fields else base


def _eff(text: Optional[str]):
    from training.plan import Efficiencies

    eff = Efficiencies()
    if not text:
        return eff
    names = {f.name for f in dataclasses.fields(Efficiencies)}
    kw = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in names:
            raise PlanCliError(f"--eff {item!r}: give name=value with a name from {', '.join(sorted(names))}")
        try:
            kw[key.strip()] = float(value)
        except ValueError:
            raise PlanCliError(f"--eff {item!r}: {value!r} is not a number") from None
    return dataclasses.replace(eff, **kw)


def _load(config: Optional[str], overrides: Sequence[str]):
    from training.config import load_config

    return load_config(config, list(overrides))


def search(cfg, gpus: int, gpu, eff, top: int = 10, sharded_muon: Optional[bool] = None) -> List:
    """Every layout of ``gpus`` GPUs that training's validation accepts (``validate_runtime``) and that fits,
    ranked by predicted tokens/s: tp (with SP), pp, vpp (every divisor of the layers per stage that validation
    accepts), cp, ep, etp, micro-batch, recompute, HC recompute, and the overlap options
    ``parallel.tp_comm_overlap`` and ``parallel.ep_overlap`` where valid.  A row is ``(tokens/s, key, plan,
    config)`` with ``key = (tp, sp, pp, vpp, cp, ep, etp, mbs, recompute, hc_recompute, tp_comm_overlap,
    ep_overlap)`` (:func:`_overrides_of` gives its ``key=value`` overrides).  The overlaps change no byte, so
    they are tried only on layouts that fit."""
    from training.config import ConfigError
    from training.plan import load_run_preset, make_plan

    preset = load_run_preset(cfg)
    b = preset.backbone
    L = preset.num_layers
    E = int(b.get("num_moe_experts") or 0)
    a2a = (b.get("moe_token_dispatcher_type") or "allgather") in ("alltoall", "flex")
    divisors = [d for d in (1, 2, 4, 8, 16, 32, 64) if gpus % d == 0]
    results = []
    seen = set()
    for tp in [d for d in divisors if d <= 8]:
        sp = tp > 1  # Megatron's advice: TP > 1 always with SP (same maths, less memory)
        for pp in [d for d in divisors if L % d == 0 and d <= 16]:
            vpps = [None] + ([v for v in range(2, L // pp + 1) if (L // pp) % v == 0] if pp > 1 else [])
            for vpp in vpps:
                for cp in (1, 2):
                    if tp * pp * cp > gpus:
                        continue
                    for ep in [d for d in divisors if (not E and d == 1) or (E and E % d == 0)]:
                        for etp in ((None, 1) if tp > 1 and E else (None,)):
                            for mbs in (1, 2, 4):
                                for rec in ("none", "selective", "full"):
                                    for hc_rec in ((False, True) if preset.hc.enabled else (False,)):
                                        base = (tp, sp, pp, vpp, cp, ep, etp, mbs, rec, hc_rec, False, False)
                                        if base in seen:
                                            continue
                                        seen.add(base)
                                        tps = (False, True) if tp > 1 else (False,)
                                        eps = (False, True) if (ep > 1 and a2a and rec != "full"
                                                                and (pp == 1 or vpp)) else (False,)
                                        for tp_ov in tps:
                                            for ep_ov in eps:
                                                key = base[:10] + (tp_ov, ep_ov)
                                                c = _with_layout(cfg, key)
                                                try:
                                                    plan = make_plan(c, gpus, gpu, eff, preset=preset,
                                                                     sharded_muon=sharded_muon)
                                                except (ConfigError, ValueError):
                                                    break
                                                if not plan.fits:
                                                    break
                                                results.append((plan.tokens_per_s, key, plan, c))
                                            else:
                                                continue
                                            break
    results.sort(key=lambda r: -r[0])
    return results[:top]


def _with_layout(cfg, key):
    tp, sp, pp, vpp, cp, ep, etp, mbs, rec, hc_rec = key[:10]
    tp_ov, ep_ov = (key[10], key[11]) if len(key) > 10 else (False, False)
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp, sp=sp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=None,
                                          tp_comm_overlap=tp_ov, ep_overlap=ep_ov),
        batch=dataclasses.replace(cfg.batch, micro_batch_size=mbs),
        model=dataclasses.replace(cfg.model, recompute=rec, hc_recompute=hc_rec))


CHANGES = (("model.hc_recompute", True), ("model.recompute", "selective"), ("model.recompute", "full"))


def cheapest_fix(cfg, gpus: int, gpu, eff):
    """The single change that makes a plan fit with the highest predicted tokens/s: HC recompute, selective or
    full recompute, a halved micro-batch, doubled PP or TP (with SP); None if none does."""
    from training.config import ConfigError
    from training.plan import make_plan

    p, b, m = cfg.parallel, cfg.batch, cfg.model
    cands = []
    if m.hc_recompute is not True:
        cands.append(("model.hc_recompute=true", dataclasses.replace(cfg, model=dataclasses.replace(m, hc_recompute=True))))
    for rec in ("selective", "full"):
        if m.recompute != rec:
            cands.append((f"model.recompute={rec}", dataclasses.replace(cfg, model=dataclasses.replace(m, recompute=rec))))
    if b.micro_batch_size > 1:
        mb = b.micro_batch_size // 2
        cands.append((f"batch.micro_batch_size={mb}", dataclasses.replace(cfg, batch=dataclasses.replace(b, micro_batch_size=mb))))
    cands.append((f"parallel.pp={2 * p.pp}", dataclasses.replace(cfg, parallel=dataclasses.replace(p, pp=2 * p.pp, dp=None))))
    cands.append((f"parallel.tp={2 * p.tp} parallel.sp=true",
                  dataclasses.replace(cfg, parallel=dataclasses.replace(p, tp=2 * p.tp, sp=True, dp=None))))
    from training.plan import load_run_preset

    preset = load_run_preset(cfg)
    best = None
    for text, c in cands:
        try:
            plan = make_plan(c, gpus, gpu, eff, preset=preset)
        except (ConfigError, ValueError):
            continue
        if plan.fits and (best is None or plan.tokens_per_s > best[1].tokens_per_s):
            best = (text, plan)
    return best


def _sweep_rows(args, gpu, eff):
    """(label, cfg, gpus) per N of ``--n`` or per variant of ``--sweep``."""
    rows = []
    if args.sweep:
        from tools.sweep import load_sweep

        sw = load_sweep(args.sweep)
        seen = set()
        for arm in sw.arms:
            if arm.cell.rsplit("-", 1)[0] in seen:
                continue
            seen.add(arm.cell.rsplit("-", 1)[0])
            over = [o for o in arm.overrides if not o.startswith(("run.", "checkpoint.", "logging."))]
            rows.append((arm.variant, _load(sw.base, over + list(args.overrides)), args.gpus or arm.nproc))
        return rows
    try:
        ns = [int(x) for x in args.n.split(",")]
    except ValueError:
        raise PlanCliError(f"--n {args.n!r}: give a comma-separated list of integers, e.g. 2,4,8,16") from None
    for n in ns:
        rows.append((f"N={n}", _load(args.config, [*args.overrides, f"model.hc.n={n}"]), args.gpus))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the training config")
    ap.add_argument("--config", default=None, help="training YAML (default: the embedded CPU default run)")
    ap.add_argument("--preset", default=None, help="shorthand for model.preset=<file>:<variant>")
    ap.add_argument("--gpus", type=int, default=None, help="number of GPUs (the world size)")
    ap.add_argument("--gpu", default="h100", help="GPU kind from the table: a100, h100, h200, b200 (default h100); cpu: the CPU path "
                    "training takes without CUDA (memory only)")
    ap.add_argument("--memory-gb", type=float, help="GPU memory in GB (1e9 bytes), instead of the table's")
    ap.add_argument("--tflops", type=float, help="dense bf16 peak TFLOP/s per GPU")
    ap.add_argument("--hbm-tbs", type=float, help="HBM bandwidth in TB/s")
    ap.add_argument("--nvlink-gbs", type=float, help="NVLink bandwidth per GPU and direction in GB/s")
    ap.add_argument("--network-gbs", type=float, help="network bandwidth per GPU in GB/s")
    ap.add_argument("--per-node", type=int, help="GPUs per node (default 8)")
    ap.add_argument("--eff", default=None, help="efficiencies, e.g. gemm=0.5,hbm=0.7,link=0.6 (docs/planning.md)")
    ap.add_argument("--hc-perf", default=None, help="hc_perf.json of `python -m bench.hc_kernels --perf` on this GPU "
                    "kind: the HC streams' HBM fraction measured there replaces eff.hbm")
    ap.add_argument("--sharded-muon", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU Muon's state sharded over DP (default: as training does, sharded unless "
                         "optimizer.use_distributed_optimizer=false); --no-sharded-muon plans it replicated")
    ap.add_argument("--search", action="store_true", help="rank every valid layout that fits (tp+sp, pp, every vpp "
                    "validation accepts, cp, ep, etp, micro-batch, recompute, HC recompute, tp_comm_overlap, ep_overlap) "
                    "by tokens/s; print the top ten")
    ap.add_argument("--sweep", default=None, help="a sweep file (configs/sweeps/*.yaml): one plan per variant")
    ap.add_argument("--n", default=None, help="comma-separated N values, e.g. 2,4,8,16: one plan per N")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)

    def body():
        from training.config import ConfigError
        from training.plan import PlanError, make_plan

        try:
            return _run(args, make_plan)
        except (ConfigError, PlanError) as e:
            raise PlanCliError(str(e)) from None

    return run_main(body, PlanCliError)


def _run(args, make_plan) -> int:
    if args.preset:
        args.overrides = [f"model.preset={args.preset}", *args.overrides]
    if args.gpus is not None and args.gpus < 1:
        raise PlanCliError(f"--gpus {args.gpus} must be >= 1")
    if args.sweep is None and args.gpus is None:
        raise PlanCliError("--gpus is required: the number of GPUs of the run (e.g. --gpus 64)")
    if args.sweep and args.n:
        raise PlanCliError("--sweep and --n are exclusive; give one")
    gpu, eff = _gpu(args), _eff(args.eff)
    if args.hc_perf:
        if gpu is None:
            raise PlanCliError("--hc-perf needs a GPU kind (the table's bandwidth is that GPU's), not --gpu cpu")
        try:
            with open(args.hc_perf, encoding="utf-8") as f:
                perf = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanCliError(f"--hc-perf {args.hc_perf}: cannot read it as JSON ({e}); give bench.hc_kernels "
                               "--perf's hc_perf.json") from None
        from training.plan import hbm_fraction_from_perf

        eff = dataclasses.replace(eff, hbm=hbm_fraction_from_perf(perf, gpu))
    if gpu is None and (args.search or args.sweep or args.n):
        raise PlanCliError("--search, --sweep and --n rank by time and capacity: give a GPU kind, not --gpu cpu")
    sharded = args.sharded_muon
    warnings.filterwarnings("ignore")
    if args.sweep or args.n:
        out = []
        for label, cfg, gpus in _sweep_rows(args, gpu, eff):
            plan = make_plan(cfg, gpus, gpu, eff, sharded_muon=sharded)
            row = {"label": label, **plan.to_dict()}
            if not plan.fits:
                fix = cheapest_fix(cfg, gpus, gpu, eff)
                row["fix"] = fix[0] if fix else None
                row["fix_tokens_per_s"] = fix[1].tokens_per_s if fix else None
            out.append(row)
        if args.json:
            print(json.dumps(out, indent=1))
            return 0
        print(f"{'arm':<14}{'GPUs':>5}{'peak GiB':>10}{'of':>7}{'fits':>6}{'tokens/s':>12}{'MFU':>7}  cheapest change if not")
        for r in out:
            fix = "" if r["fits"] else (f"{r['fix']} ({r['fix_tokens_per_s']:,.0f} tokens/s)" if r.get("fix")
                                        else "none of the single changes fits")
            print(f"{r['label']:<14}{r['gpus']:>5}{r['total_gib']:>10.2f}{r['capacity_gib']:>7.1f}"
                  f"{'yes' if r['fits'] else 'NO':>6}{r['tokens_per_s']:>12,.0f}{r['mfu']:>7.1%}  {fix}")
        return 0
    cfg = _load(args.config, args.overrides)
    if args.search:
        rows = search(cfg, args.gpus, gpu, eff, sharded_muon=sharded)
        if args.json:
            print(json.dumps([{"overrides": _overrides_of(key), **plan.to_dict()} for _, key, plan, _ in rows], indent=1))
            return 0
        if not rows:
            print(f"no valid layout of {args.gpus} GPUs fits a {gpu.name} ({gpu.memory_gb:g} GB)")
            return 1
        print(f"{'#':>2} {'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}  layout (key=value overrides)")
        for i, (tps, key, plan, _) in enumerate(rows, 1):
            print(f"{i:>2} {tps:>11,.0f}{plan.mfu:>7.1%}{plan.peak.total / 2 ** 30:>10.2f}  {' '.join(_overrides_of(key))}")
        return 0
    plan = make_plan(cfg, args.gpus, gpu, eff, sharded_muon=sharded)
    print(json.dumps(plan.to_dict(), indent=1) if args.json else plan.format())
    return 0 if plan.fits is not False else 1


def _overrides_of(key) -> List[str]:
    tp, sp, pp, vpp, cp, ep, etp, mbs, rec, hc_rec = key[:10]
    out = [f"parallel.tp={tp}", f"parallel.sp={'true' if sp else 'false'}", f"parallel.pp={pp}"]
    if vpp:
        out.append(f"parallel.vpp={vpp}")
    if cp > 1:
        out.append(f"parallel.cp={cp}")
    out.append(f"parallel.ep={ep}")
    if etp:
        out.append(f"parallel.etp={etp}")
    out += [f"batch.micro_batch_size={mbs}", f"model.recompute={rec}", f"model.hc_recompute={'true' if hc_rec else 'false'}"]
    if len(key) > 10:
        out += [f"parallel.tp_comm_overlap={'true' if key[10] else 'false'}",
                f"parallel.ep_overlap={'true' if key[11] else 'false'}"]
    return out


if __name__ == "__main__":
    sys.exit(main())
