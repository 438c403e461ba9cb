"""The zoo's cluster recipes, laid out by the planner (issue 52; docs/planning.md, "The zoo's cluster recipes").

    python -m bench.plan_zoo --recipes     # each shipped recipe: its layout's plan beside the search's best
    python -m bench.plan_zoo               # the zoo table: 2.5B / 10B / 18B / 28B x vanilla, mHC, xHC, Flash-4sub
    python -m bench.plan_zoo --markdown    # the same, as docs/planning.md's tables
    python -m bench.plan_zoo --recipes --comment   # the '# planned' lines each recipe's comment carries

Every number comes from the planner: :func:`training.plan.make_plan` for a layout and
:func:`tools.plan.search` (what ``python -m tools.plan --search`` prints) for the best layout that fits.  A
recipe names its cluster in a ``# cluster: <GPUs> x <gpu kind>`` comment; its token budget is its own
(``run.train_steps`` x ``batch.global_batch_size`` x ``batch.seq_length``): [xHC] does not disclose its token
counts (docs/math.md §6.1), so the recipes choose about 40 tokens per activated parameter.  GPU-hours =
budget / tokens/s x GPUs / 3600.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import warnings
from typing import Iterator, List, Optional, Tuple

GIB = 2 ** 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("moe-2p5b-nsweep", "moe-10b-xhc", "moe-18b-xhc", "moe-18b-xhc-muon", "moe-28b-xhc")
"""The shipped GPU recipes (configs/pretrain/<name>.yaml), each laid out by the search on its cluster."""
ZOO = (("moe-2p5b", "moe-2p5b-nsweep"), ("moe-10b", "moe-10b-xhc"), ("moe-18b", "moe-18b-xhc"),
       ("moe-28b", "moe-28b-xhc"))
"""(size, the recipe whose cluster, batch and budget its zoo rows use)."""
ZOO_VARIANTS = ("vanilla", "mhc", "xhc", "xhc-flash4")
TOLERANCE = 0.05
"""A shipped layout stays within 5 % of the best tokens/s the planner finds for its config."""


def recipe_path(name: str) -> str:
    return os.path.join(REPO, "configs", "pretrain", f"{name}.yaml")


def cluster_of(path: str) -> Tuple[int, str]:
    """(GPUs, GPU kind) of a recipe's ``# cluster: <GPUs> x <kind>`` comment."""
    with open(path, encoding="utf-8") as f:
        m = re.search(r"^# cluster: (\d+) x (\w+)", f.read(), re.M)
    if not m:
        raise ValueError(f"{path}: no '# cluster: <GPUs> x <gpu kind>' comment")
    return int(m.group(1)), m.group(2)


def token_budget(cfg, preset=None) -> int:
    seq = cfg.batch.seq_length or preset.seq_length
    return int(cfg.run.train_steps) * int(cfg.batch.global_batch_size) * int(seq)


def gpu_hours(plan, tokens: int) -> float:
    return tokens / plan.tokens_per_s * plan.lay.gpus / 3600.0


def _plan(cfg, gpus: int, gpu):
    from training.plan import make_plan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(cfg, gpus, gpu)


def best(cfg, gpus: int, gpu):
    """(tokens/s, overrides, plan) of the best layout :func:`tools.plan.search` finds (None if none fits)."""
    from tools.plan import search

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = search(cfg, gpus, gpu, _efficiencies(), top=1)
    if not rows:
        return None
    tps, _key, plan, c = rows[0]
    return tps, shipped_overrides(c), plan


def _efficiencies():
    from training.plan import Efficiencies

    return Efficiencies()


def shipped_overrides(cfg) -> List[str]:
    """The layout keys of a config as ``key=value`` overrides (those a search row prints)."""
    p, b, m = cfg.parallel, cfg.batch, cfg.model
    out = [f"parallel.tp={p.tp}", f"parallel.sp={'true' if p.sp else 'false'}", f"parallel.pp={p.pp}"]
    if p.vpp:
        out.append(f"parallel.vpp={p.vpp}")
    if p.cp > 1:
        out.append(f"parallel.cp={p.cp}")
    out.append(f"parallel.ep={p.ep}")
    if p.etp:
        out.append(f"parallel.etp={p.etp}")
    out += [f"batch.micro_batch_size={b.micro_batch_size}", f"model.recompute={m.recompute}",
            f"model.hc_recompute={'true' if m.hc_recompute else 'false'}"]
    for k in ("tp_comm_overlap", "ep_overlap"):
        if hasattr(p, k):
            out.append(f"parallel.{k}={'true' if getattr(p, k) else 'false'}")
    return out


def single_changes(cfg, gpus: int) -> Iterator[Tuple[str, object]]:
    """Every config one layout key away from ``cfg`` (tp with SP, pp, vpp, cp, ep, etp, micro-batch,
    recompute, HC recompute, the overlaps): what the recipe test plans to see that no single change beats
    the shipped layout by more than :data:`TOLERANCE`."""
    p, b, m = cfg.parallel, cfg.batch, cfg.model
    divisors = [d for d in (1, 2, 4, 8, 16, 32, 64) if gpus % d == 0]

    def par(**kw):
        return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=None, **kw))

    for tp in divisors:
        if tp <= 8 and tp != p.tp:
            yield f"parallel.tp={tp}", par(tp=tp, sp=tp > 1, tp_comm_overlap=False if tp == 1 else p.tp_comm_overlap)
    for pp in divisors:
        if pp <= 16 and pp != p.pp:
            yield f"parallel.pp={pp}", par(pp=pp, vpp=None)
    for vpp in [None] + list(range(2, 9)):
        if vpp != p.vpp and p.pp > 1:
            yield f"parallel.vpp={vpp}", par(vpp=vpp)
    for cp in (1, 2):
        if cp != p.cp:
            yield f"parallel.cp={cp}", par(cp=cp)
    for ep in divisors:
        if ep != p.ep:
            yield f"parallel.ep={ep}", par(ep=ep, ep_overlap=p.ep_overlap and ep > 1)
    for etp in (None, 1):
        if etp != p.etp and p.tp > 1:
            yield f"parallel.etp={etp}", par(etp=etp)
    for ov in ("tp_comm_overlap", "ep_overlap"):
        yield f"parallel.{ov}={not getattr(p, ov)}", par(**{ov: not getattr(p, ov)})
    for mbs in (1, 2, 4):
        if mbs != b.micro_batch_size:
            yield f"batch.micro_batch_size={mbs}", dataclasses.replace(cfg, batch=dataclasses.replace(b, micro_batch_size=mbs))
    for rec in ("none", "selective", "full"):
        if rec != m.recompute:
            yield f"model.recompute={rec}", dataclasses.replace(cfg, model=dataclasses.replace(m, recompute=rec))
    yield (f"model.hc_recompute={not m.hc_recompute}",
           dataclasses.replace(cfg, model=dataclasses.replace(m, hc_recompute=not m.hc_recompute)))


def best_single_change(cfg, gpus: int, gpu):
    """(label, plan) of the fastest valid config one key away from ``cfg`` that fits (None if none does)."""
    from training.config import ConfigError, validate_config
    from training.plan import PlanError

    top = None
    for label, c in single_changes(cfg, gpus):
        try:
            validate_config(c)  # what load_config refuses (e.g. TP comm overlap without TP), then the runtime checks
            plan = _plan(c, gpus, gpu)
        except (ConfigError, PlanError, ValueError):
            continue
        if plan.fits and (top is None or plan.tokens_per_s > top[1].tokens_per_s):
            top = (label, plan)
    return top


def recipe_row(name: str, search: bool = True) -> dict:
    """A recipe's plan on its cluster, its token budget's GPU-hours, and (``search``) the search's best."""
    from training.config import load_config
    from training.plan import GPUS, load_run_preset

    path = recipe_path(name)
    gpus, kind = cluster_of(path)
    cfg = load_config(path)
    plan = _plan(cfg, gpus, GPUS[kind])
    tokens = token_budget(cfg, load_run_preset(cfg))
    row = {"recipe": name, "gpus": gpus, "gpu": kind, "preset": cfg.model.preset, "layout": plan.lay.describe(),
           "overrides": shipped_overrides(cfg), "peak_gib": plan.peak.total / GIB,
           "capacity_gib": plan.capacity / GIB, "headroom_gib": (plan.capacity - plan.peak.total) / GIB,
           "fits": plan.fits, "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu, "tokens": tokens,
           "gpu_hours": gpu_hours(plan, tokens)}
    if search:
        b = best(cfg, gpus, GPUS[kind])
        row["best_tokens_per_s"], row["best_overrides"] = (b[0], b[1]) if b else (None, None)
        row["ratio"] = plan.tokens_per_s / b[0] if b else None
    return row


def zoo_rows() -> List[dict]:
    """Each size x variant on its recipe's cluster, batch and budget, laid out by the search."""
    from training.config import load_config
    from training.plan import GPUS, load_run_preset

    rows = []
    for size, recipe in ZOO:
        path = recipe_path(recipe)
        gpus, kind = cluster_of(path)
        for v in ZOO_VARIANTS:
            cfg = load_config(path, [f"model.preset={size}:{v}"])
            tokens = token_budget(cfg, load_run_preset(cfg))
            b = best(cfg, gpus, GPUS[kind])
            row = {"preset": f"{size}:{v}", "recipe": recipe, "gpus": gpus, "gpu": kind, "tokens": tokens}
            if b is None:
                row.update(layout=None)
            else:
                tps, ov, plan = b
                row.update(layout=plan.lay.describe(), overrides=ov, peak_gib=plan.peak.total / GIB,
                           tokens_per_s=tps, mfu=plan.mfu, gpu_hours=gpu_hours(plan, tokens))
            rows.append(row)
    return rows


def _short(overrides: Optional[List[str]]) -> str:
    """A search row's overrides, shortened for a table (parallel./batch./model. prefixes, false flags off)."""
    if not overrides:
        return "-"
    out = []
    for o in overrides:
        k, v = o.split("=", 1)
        k = k.split(".", 1)[1]
        if v == "false" and k in ("sp", "hc_recompute", "tp_comm_overlap", "ep_overlap"):
            continue
        out.append(k if v == "true" else f"{k}={v}".replace("micro_batch_size", "mbs"))
    return " ".join(out)


def comment_lines(r: dict) -> List[str]:
    """The ``# planned (...)`` lines a recipe's comment carries (``--comment``; tests/test_recipes_planned.py
    holds each recipe to them)."""
    cmd = (f"python -m bench.plan_zoo --recipes, python -m tools.plan --config configs/pretrain/{r['recipe']}.yaml "
           f"--gpus {r['gpus']} --gpu {r['gpu']}")
    out = [f"# planned ({cmd}):",
           f"#   {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%, {r['peak_gib']:.1f} GiB of "
           f"{r['capacity_gib']:.1f} (headroom {r['headroom_gib']:.1f} GiB, {r['headroom_gib'] / r['capacity_gib']:.0%}); "
           f"{r['tokens'] / 1e9:.1f}B tokens = {r['gpu_hours']:,.0f} GPU-hours ({r['gpu_hours'] / r['gpus']:,.1f} h on "
           f"{r['gpus']} GPUs)."]
    if r.get("ratio") is not None:
        out.append(f"# Layout: the best that python -m tools.plan --search finds on this cluster (shipped / best = "
                   f"{r['ratio']:.3f}): {_short(r['overrides'])}.")
    return out


def print_recipes(markdown: bool, comment: bool = False) -> None:
    rows = [recipe_row(n) for n in RECIPES]
    if comment:
        for r in rows:
            print(f"configs/pretrain/{r['recipe']}.yaml:")
            print("\n".join(comment_lines(r)))
        return
    if markdown:
        print("| recipe | cluster | layout (shipped) | GiB / capacity | tokens/s | MFU | GPU-hours (tokens) | "
              "search's best tokens/s | shipped / best |")
        print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if markdown:
            print(f"| `{r['recipe']}` | {r['gpus']}x {r['gpu']} | {_short(r['overrides'])} | {r['peak_gib']:.1f} / "
                  f"{r['capacity_gib']:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['gpu_hours']:,.0f} "
                  f"({r['tokens'] / 1e9:.1f}B) | {r['best_tokens_per_s']:,.0f} | {r['ratio']:.3f} |")
        else:
            print(f"{r['recipe']} ({r['preset']}) on {r['gpus']}x {r['gpu']}: {r['layout']}")
            print(f"  planned {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}, {r['peak_gib']:.1f} GiB of "
                  f"{r['capacity_gib']:.1f} (headroom {r['headroom_gib']:.1f} GiB, "
                  f"{r['headroom_gib'] / r['capacity_gib']:.0%}); {r['tokens'] / 1e9:.1f}B tokens = "
                  f"{r['gpu_hours']:,.0f} GPU-hours ({r['gpu_hours'] / r['gpus']:,.1f} h on {r['gpus']} GPUs)")
            print(f"  search's best: {r['best_tokens_per_s']:,.0f} tokens/s ({' '.join(r['best_overrides'] or [])}); "
                  f"shipped / best = {r['ratio']:.3f}")


def print_zoo(markdown: bool) -> None:
    rows = zoo_rows()
    print("| preset:variant | cluster | layout chosen by the search | GiB per GPU | tokens/s | MFU | GPU-hours "
          "(budget) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["layout"] is None:
            print(f"| {r['preset']} | {r['gpus']}x {r['gpu']} | no layout fits | - | - | - | - |")
            continue
        print(f"| {r['preset']} | {r['gpus']}x {r['gpu']} | {_short(r['overrides'])} | {r['peak_gib']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['gpu_hours']:,.0f} ({r['tokens'] / 1e9:.1f}B) |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", action="store_true", help="each shipped recipe beside the search's best")
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    ap.add_argument("--comment", action="store_true", help="with --recipes: the '# planned' lines of each recipe")
    args = ap.parse_args(argv)
    if args.recipes:
        print_recipes(args.markdown, args.comment)
    else:
        print_zoo(args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
