"""Multi-token prediction × mHC convention on the tiny preset: main-token validation loss, mean ± std over seeds.

Four arms, each trained ``--steps`` steps per seed by ``python -m training.pretrain`` on the embedded
default data (the same data and validation batches for every arm and seed; ``run.seed`` sets the
initialisation and the sample order):

=====================  ==================================================================
``paper``              ``tiny-moe:mhc`` as shipped (mHC paper's maps, ``reduction: sum``)
``paper+mtp1``         the same with ``model.backbone.mtp_num_layers=1``
``deepseek_v4``        ``model.hc.convention=deepseek_v4 model.hc.reduction=learned`` (DeepSeek-V4's maps and head)
``deepseek_v4+mtp1``   the same with one MTP depth
=====================  ==================================================================

The figure is the validation loss of the main tokens (the ``eval`` record of ``metrics.jsonl``;
MTP depths are a training loss only) after the last step.  Usage::

    python -m bench.mtp_compare --steps 60 --seeds 1 2 3 --out runs/mtp-compare

Finished arms are reused (delete the folder to rerun).  Writes ``<out>/results.json`` and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

ARMS: Dict[str, List[str]] = {
    "paper": [],
    "paper+mtp1": ["model.backbone.mtp_num_layers=1"],
    "deepseek_v4": ["model.hc.convention=deepseek_v4", "model.hc.reduction=learned"],
    "deepseek_v4+mtp1": ["model.hc.convention=deepseek_v4", "model.hc.reduction=learned",
                         "model.backbone.mtp_num_layers=1"],
}


def final_valid_loss(run_dir: str) -> Optional[float]:
    """The last evaluation's main-token loss of a finished run, or None."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            if not json.load(f).get("finished"):
                return None
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            evals = [r for r in map(json.loads, f) if r.get("kind") == "eval"]
    except (OSError, ValueError):
        return None
    return float(evals[-1]["loss"]) if evals else None


def run_arm(arm: str, seed: int, steps: int, out: str, extra: List[str]) -> float:
    run_dir = os.path.join(out, f"{arm}-seed{seed}")
    loss = final_valid_loss(run_dir)
    if loss is not None:
        return loss
    cmd = [sys.executable, "-m", "training.pretrain", "model.preset=tiny-moe:mhc", *ARMS[arm],
           f"run.seed={seed}", f"run.train_steps={steps}", f"run.eval_interval={steps}",
           f"schedule.warmup_steps={max(1, steps // 10)}", "checkpoint.interval=0", "checkpoint.save_final=false",
           "logging.tensorboard=false", "logging.plot=false", f"run.dir={run_dir}", *extra]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    loss = final_valid_loss(run_dir)
    if loss is None:
        raise SystemExit(f"{run_dir}: no final validation loss in metrics.jsonl")
    return loss


def table(results: Dict[str, Dict[int, float]]) -> str:
    rows = ["| arm | seeds | main-token validation loss (mean ± std) | per seed |", "|---|---|---|---|"]
    for arm, by_seed in results.items():
        vals = [by_seed[s] for s in sorted(by_seed)]
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        rows.append(f"| {arm} | {len(vals)} | {statistics.mean(vals):.4f} ± {sd:.4f} | "
                    + ", ".join(f"{v:.4f}" for v in vals) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300, the default run's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--out", default="runs/mtp-compare")
    p.add_argument("overrides", nargs="*", help="further key=value overrides for every run")
    a = p.parse_args(argv)
    results = {arm: {s: run_arm(arm, s, a.steps, a.out, a.overrides) for s in a.seeds} for arm in a.arms}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"steps": a.steps, "seeds": a.seeds, "arms": ARMS, "valid_loss": results}, f, indent=1)
    print(f"\ntiny-moe:mhc, {a.steps} steps, seeds {' '.join(map(str, a.seeds))}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
