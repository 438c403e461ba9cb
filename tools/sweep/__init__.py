"""xhc-sweep: scaling-law sweeps over N, from a grid to fitted laws, plots and compute multipliers.

    python -m tools.sweep run     --config configs/sweeps/tiny-cpu.yaml [--parallel 2]
    python -m tools.sweep collect --config configs/sweeps/tiny-cpu.yaml
    python -m tools.sweep fit     --config configs/sweeps/tiny-cpu.yaml
    python -m tools.sweep run     --config configs/sweeps/paper-2p5b.yaml --executor slurm --dry-run
    python -m tools.sweep print   --config configs/sweeps/paper-2p5b.yaml
    python -m tools.sweep fit     --config configs/sweeps/paper-2p5b.yaml --gpu h100 --gpus 16 [--laws paper]

``run`` trains every unfinished arm (one ``training.pretrain`` run each, in ``<out_dir>/arms/<arm>``;
rerunning skips finished arms and resumes the others from their checkpoints); ``collect`` writes
the per-arm table (console, ``summary/arms.csv``, ``summary/arms.json``); ``fit`` fits
L(C) = E + A·C^(−α) per variant (Huber on log residuals, L-BFGS from a grid, bootstrap intervals),
L(N) at fixed compute, L(P, D) where sizes and budgets both vary, the compute multipliers against
the baselines (with ``--gpu``/``--gpus`` also in GPU-hours on that cluster: :mod:`tools.sweep.gpu_time`),
and draws ``summary/frontier.png``, ``loss_vs_n.png``, ``multipliers.png``
(docs/sweeps.md, docs/math.md §6.5).

The package: :mod:`tools.sweep.spec` (sweep files -> arms), :mod:`tools.sweep.runner` (local and
SLURM executors), :mod:`tools.sweep.collect` (the per-arm table), :mod:`tools.sweep.fit` (the robust
scaling-law fits and the sweep fit), :mod:`tools.sweep.gpu_time` (time to loss: the multipliers in
GPU-hours) and :mod:`tools.sweep.plots`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from tools.sweep.collect import CELL_COLUMNS, COLUMNS, aggregate, collect, format_table, read_metrics, write_table
from tools.sweep.fit import FitError, fit_markdown, fit_sweep, significance
from tools.sweep.gpu_time import add_gpu_hours, gpu_time_markdown, paper_law_result, variant_times
from tools.sweep.runner import ARM_STATE, arm_finished, run_local, slurm_commands
from tools.sweep.spec import Arm, Sweep, SweepError, load_sweep

__all__ = ["main", "Arm", "Sweep", "SweepError", "load_sweep", "run_local", "slurm_commands", "collect",
           "read_metrics", "write_table", "format_table", "aggregate", "fit_sweep", "fit_markdown", "FitError", "COLUMNS",
           "variant_times", "add_gpu_hours", "paper_law_result",
           "ARM_STATE", "arm_finished"]

# The runner only launches and reads files: keep OpenMP from spinning on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="xhc-sweep", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("run", "train every unfinished arm"), ("collect", "table of every arm"),
                        ("fit", "fit the scaling laws, multipliers and plots"), ("print", "print the resolved arms")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--config", "-c", required=True, help="sweep file (configs/sweeps/*.yaml)")
        s.add_argument("--out-dir", help="override the sweep's out_dir")
        s.add_argument("overrides", nargs="*", metavar="key=value",
                       help="pre-training overrides for every arm (e.g. run.device=cpu)")
        if name == "print":
            s.add_argument("--mfu", type=float, default=0.4,
                           help="model FLOPs utilisation assumed for the GPU-hours column (default %(default)s)")
            s.add_argument("--peak-tflops", type=float, default=989.0,
                           help="per-GPU dense bf16 peak, TFLOP/s (default %(default)s: H100/H200, "
                                "training.run.metrics.GPU_PEAK_TFLOPS)")
        if name == "fit":
            s.add_argument("--no-plots", action="store_true",
                           help="fit.json and fit.md only (the plots need matplotlib: pip install 'xhc[plot]')")
            s.add_argument("--gpu", default=None,
                           help="also give the multipliers in GPU-hours on this GPU kind (the planner's table: "
                                "a100, h100, h200, b200), from each variant's planned step time or its measured "
                                "tokens/s where its arms logged that hardware")
            s.add_argument("--gpus", type=int, default=None,
                           help="GPUs of the cluster for --gpu (default: the sweep's executor.nproc)")
            s.add_argument("--laws", choices=("fit", "paper"), default="fit",
                           help="fit: fit the arms' losses (default); paper: [xHC]'s published L(C) for its "
                                "vanilla, mHC N=4 and xHC N=16 k=4 arms (docs/math.md §6.5), nothing fitted")
        if name == "run":
            s.add_argument("--executor", choices=("local", "slurm", "print"), default="local")
            s.add_argument("--parallel", type=int, default=None,
                           help="arms at a time (local; default: the sweep's executor.parallel or 1)")
            s.add_argument("--dry-run", action="store_true", help="slurm: print the sbatch line, submit nothing")
    return p.parse_args(argv)


def gpu_hours(compute: float, peak_tflops: float = 989.0, mfu: float = 0.4) -> float:
    """GPU-hours to train ``compute`` model FLOPs at ``mfu`` of a ``peak_tflops`` GPU."""
    return compute / (peak_tflops * 1e12 * mfu) / 3600.0


def _print_arms(sweep, mfu: float = 0.4, peak_tflops: float = 989.0) -> None:
    rows = [{"arm": a.name, "variant": a.variant, "N": a.n, "k": a.k, "steps": a.steps, "seed": a.seed,
             "params_activated": a.params_activated, "flops_per_token": a.flops_per_token, "tokens": a.tokens,
             "compute": a.compute, "gpu_hours": f"{gpu_hours(a.compute, peak_tflops, mfu):.4g}",
             "run_dir": a.run_dir} for a in sweep.arms]
    print(format_table(rows, ("arm", "variant", "N", "k", "steps", "seed", "params_activated", "flops_per_token",
                              "tokens", "compute", "gpu_hours", "run_dir")))
    total = sum(gpu_hours(a.compute, peak_tflops, mfu) for a in sweep.arms)
    print(f"\n{len(sweep.arms)} arms; base {sweep.base or '(built-in default)'}; FLOPs convention "
          f"{sweep.flops_convention}; {total:.4g} GPU-hours in all at MFU {mfu:g} of {peak_tflops:g} TFLOP/s "
          "(compute / (peak x MFU); --mfu, --peak-tflops)")
    for a in sweep.arms[:1]:
        print(f"arm command, e.g.: {shlex.join(a.command(sweep.base, python='python'))}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cmd == "fit" and args.gpus is not None and (args.gpus < 1 or not args.gpu):
        print(f"error: --gpus {args.gpus}: give a count >= 1 together with --gpu (e.g. --gpu h100 --gpus 16)",
              file=sys.stderr)
        return 2
    if args.cmd == "fit" and not args.no_plots and args.laws == "fit":
        from tools._cli import MissingExtra, require

        try:
            require("xhc-sweep fit (its plots; --no-plots writes fit.json and fit.md only)", "plot", "matplotlib")
        except MissingExtra as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        sweep = load_sweep(args.config, out_dir=args.out_dir, extra_overrides=args.overrides)
        if args.cmd == "print" or (args.cmd == "run" and args.executor == "print"):
            _print_arms(sweep, getattr(args, "mfu", 0.4), getattr(args, "peak_tflops", 989.0))
            return 0
        if args.cmd == "run":
            if args.executor == "slurm":
                lines = slurm_commands(sweep)
                if not lines:
                    print("[sweep] every arm is finished: nothing to submit")
                    return 0
                for line in lines:
                    print(line)
                if args.dry_run:
                    return 0
                import subprocess

                for line in lines:
                    rc = subprocess.call(line, shell=True)
                    if rc:
                        print(f"error: sbatch failed with exit code {rc}", file=sys.stderr)
                        return rc
                return 0
            parallel = args.parallel if args.parallel is not None else int(sweep.executor.get("parallel", 1))
            states = run_local(sweep, parallel=parallel)
            if any(s in ("running", "stopped") for s in states.values()):
                return 143
            return 1 if any(s == "failed" for s in states.values()) else 0
        rows = collect(sweep)
        if args.cmd == "collect":
            print(format_table(rows, [c for c in COLUMNS if c not in ("size", "steps", "reason", "commit", "data", "cpu_s")]))
            if any(r.get("cell") != r["arm"] for r in rows):
                print("\nper arm over seeds (mean ± sample standard deviation):")
                print(format_table(aggregate(rows), CELL_COLUMNS))
            for r in rows:
                if r["state"] != "finished":
                    print(f"[collect] {r['arm']}: {r['reason']}")
            paths = write_table(sweep, rows)
            print(f"[collect] table -> {paths['csv']}, {paths['json']}")
            return 0
        times = (variant_times(sweep, rows, args.gpu, args.gpus,
                               variants=None if args.laws == "fit" else list(paper_law_result(sweep)[0]))
                 if args.gpu else None)
        if args.laws == "paper":
            fits, result = paper_law_result(sweep)
            if times:
                add_gpu_hours(result, fits, times, significance)
            print(f"[fit] {result['law_source']}, mapped onto {', '.join(fits)}; nothing fitted")
            for m in result["multipliers"]:
                print(f"{m['baseline']} needs {m['multiplier']:.3f}x the compute of {m['variant']} at "
                      f"C_b = {m['at']['compute']:.3g} FLOPs")
            if times:
                print("\n" + gpu_time_markdown(result))
            return 0
        write_table(sweep, rows)
        result = fit_sweep(sweep, rows, plots=not args.no_plots, times=times)
        print(fit_markdown(result))
        print(f"\n[fit] -> {os.path.join(sweep.summary_dir, 'fit.json')}, fit.md"
              + "".join(f", {p}" for p in result.get("plots", {}).values()))
        return 0
    except (SweepError, FitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
