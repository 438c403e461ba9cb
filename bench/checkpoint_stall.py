"""The stall per checkpoint save, synchronous vs asynchronous (``checkpoint.async_save``).

    python -m bench.checkpoint_stall                       # tiny-moe:xhc and a shrunk moe-2p5b:xhc (>=100M)
    python -m bench.checkpoint_stall --models tiny --saves 3

Each model trains twice in this process, once per mode, with a save every ``--interval`` steps
(``--saves`` saves, no final save).  The time of every step is taken from one step's start to the
next one's (so it holds the save and, for async saves, the snapshot and the check whether the
write finished).  The stall of a save is the time of the step that saves minus the median of the
steps that save nothing; for async saves the table also gives the extra time of the steps that run
while the write goes on (the writer thread competes for the same cores) and how long the write took.
Prints a Markdown table (docs/reliability.md, "Asynchronous saves").
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Dict, List

MODELS = {
    "tiny": ["model.preset=tiny-moe:xhc", "tokenizer.vocab_size=64", "batch.seq_length=16",
             "batch.micro_batch_size=2", "batch.global_batch_size=4"],
    # The paper's 2.5B backbone (C=1024, GQA 8/4 heads, 320-wide experts) with 2 layers and 32 experts:
    # 113M parameters, most of them in the 32000-id embedding and output layer.
    "shrunk-2p5b": ["model.preset=moe-2p5b:xhc", "model.backbone.num_layers=2", "model.backbone.num_moe_experts=32",
                    "tokenizer.vocab_size=32000", "batch.seq_length=32", "batch.micro_batch_size=1",
                    "batch.global_batch_size=1"],
}
COMMON = ["data.mock=true", "tokenizer.type=none", "schedule.warmup_steps=1", "run.eval_interval=0",
          "run.eval_iters=1", "checkpoint.save_final=false", "checkpoint.keep_last=1", "logging.tensorboard=false",
          "logging.plot=false", "logging.interval=1000", "logging.hc_health_interval=0", "model.hc_kernels=eager"]


def measure(model: str, asynchronous: bool, saves: int, interval: int, root: str) -> Dict[str, float]:
    """Train ``model`` with ``saves`` saves; the per-save stall and the sync save time (seconds)."""
    from training import pretrain

    starts: List[float] = []
    saved_at: List[int] = []
    finished: Dict[int, float] = {}
    trainer_box = {}
    orig_step, orig_save, orig_poll = pretrain.Trainer.train_step, pretrain.Trainer.save_checkpoint, \
        pretrain.Trainer.poll_checkpoint

    def train_step(self, its):
        trainer_box["t"] = self
        starts.append(time.perf_counter())
        return orig_step(self, its)

    def save_checkpoint(self, reason):
        saved_at.append(self.step)
        return orig_save(self, reason)

    def poll_checkpoint(self, blocking=False):
        pending = self.pending_save
        orig_poll(self, blocking)
        if pending is not None and self.pending_save is None:
            finished[pending[0]] = self.ckpt.last_save_seconds

    steps = interval * saves + interval  # the last save is followed by `interval` steps
    run_dir = os.path.join(root, f"{model}-{'async' if asynchronous else 'sync'}")
    pretrain.Trainer.train_step, pretrain.Trainer.save_checkpoint = train_step, save_checkpoint
    pretrain.Trainer.poll_checkpoint = poll_checkpoint
    try:
        code = pretrain.main([*COMMON, *MODELS[model], f"run.train_steps={steps}", f"checkpoint.interval={interval}",
                              f"checkpoint.async_save={str(asynchronous).lower()}", f"run.dir={run_dir}",
                              "run.num_threads=1"])
    finally:
        pretrain.Trainer.train_step, pretrain.Trainer.save_checkpoint = orig_step, orig_save
        pretrain.Trainer.poll_checkpoint = orig_poll
        shutil.rmtree(run_dir, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"{model}: the run failed (exit {code})")
    durations = {i + 1: b - a for i, (a, b) in enumerate(zip(starts, starts[1:]))}  # step i+1 incl. its save
    # the steps before the first save (but the first, which warms up) save nothing and overlap no write
    quiet = [d for s, d in durations.items() if 1 < s < min(saved_at)]
    median = statistics.median(quiet)
    stalls = [durations[s] - median for s in saved_at if s in durations]
    overlap = [sum(durations.get(s + j, median) - median for j in range(1, interval)) for s in saved_at]
    t = trainer_box["t"]
    n_params = int(getattr(t, "num_params_local", 0))
    out = {"params": n_params, "median_step": median, "stalls": stalls, "overlap": overlap,
           "write": [finished[s] for s in saved_at if s in finished]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,shrunk-2p5b", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--interval", type=int, default=6,
                   help="steps between saves (the steps before the first one give the median step)")
    p.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="xhc-ckpt-stall-")
    rows = []
    try:
        for model in args.models.split(","):
            sync = measure(model, False, args.saves, args.interval, root)
            asyn = measure(model, True, args.saves, args.interval, root)
            rows.append((model, sync, asyn))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    def fmt(xs):
        return ", ".join(f"{x:.2f}" for x in xs)

    print("| model | params | median step (s) | sync stall per save (s) | async stall per save (s) | async/sync "
          "| async: extra time of the steps during the write (s) | async: write time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for model, s, a in rows:
        ratio = statistics.mean(a["stalls"]) / statistics.mean(s["stalls"]) if statistics.mean(s["stalls"]) > 0 else float("nan")
        print(f"| {model} | {s['params'] / 1e6:.1f}M | {s['median_step']:.3f} / {a['median_step']:.3f} | "
              f"{fmt(s['stalls'])} | {fmt(a['stalls'])} | {ratio:.0%} | {fmt(a['overlap'])} | {fmt(a['write'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
