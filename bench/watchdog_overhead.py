"""The watchdog's cost per training step, side by side in one run.

Run::

    python -m bench.watchdog_overhead                      # one process (no peers, no store)
    torchrun --nproc_per_node 2 -m bench.watchdog_overhead  # 2 ranks: heartbeats in torchrun's store too

Builds the tiny xHC-MoE run once (mock data, one CPU thread per process) and times its training steps
in interleaved blocks, so that drift of a shared machine falls on every mode alike:

- ``off``: no watchdog thread (``reliability.watchdog=false``; the section marks stay: the straggler
  report reads them);
- ``on``: the thread at its default poll (a tenth of the shortest timeout, at most 5 s);
- ``on, poll 0.05 s``: the thread waking 20 times a second, heartbeating each time (a stress bound);
- ``off (again)``: a control, the same as ``off``: its difference to ``off`` is the noise floor of the
  measurement on this machine.

It prints each mode's median and mean step time and the difference to ``off``, and the cost of the
section marks themselves (one mark timed a million times, times the marks a step makes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from training.run import set_omp_wait_policy

set_omp_wait_policy()

TINY = ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=64", "batch.seq_length=16",
        "batch.micro_batch_size=2", "batch.global_batch_size=4", "run.num_threads=1", "run.train_steps=100000",
        "run.eval_interval=0", "run.eval_iters=0", "checkpoint.interval=0", "checkpoint.save_final=false",
        "logging.tensorboard=false", "logging.plot=false", "logging.hc_health_interval=0", "logging.jsonl=false",
        "reliability.straggler_interval=0", "reliability.timeout_warmup_steps=0"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.watchdog_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--rounds", type=int, default=4, help="blocks per mode (interleaved)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    args = p.parse_args(argv)

    from training.config import load_config
    from training.pretrain import Trainer

    with tempfile.TemporaryDirectory(prefix="xhc-wd-bench-") as tmp:
        run_dir = os.environ.get("XHC_BENCH_RUN_DIR") or os.path.join(tmp, "run")
        cfg = load_config(None, [*TINY, f"run.dir={run_dir}", "reliability.step_timeout_s=60"])
        trainer = Trainer(cfg)
        trainer.setup()
        try:
            its = trainer.train_iterators()
            wd = trainer.watchdog
            default_poll = wd.poll_s
            for _ in range(args.warmup):
                trainer.train_step(its)
            modes = {"off": None, f"on (poll {default_poll:g} s)": default_poll, "on (poll 0.05 s)": 0.05,
                     "off (again)": None}
            times = {m: [] for m in modes}
            for rnd in range(args.rounds):
                order = list(modes) if rnd % 2 == 0 else list(reversed(modes))
                for mode in order:
                    wd.stop()
                    if modes[mode] is not None:
                        wd.poll_s = modes[mode]
                        wd.start()
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        trainer.train_step(its)
                        times[mode].append(time.perf_counter() - t0)
            wd.stop()
            # the marks: how many a step makes, and what one costs
            count = [0]
            enter = wd.enter

            def counting(*a, **k):
                count[0] += 1
                return enter(*a, **k)

            wd.enter = counting
            trainer.train_step(its)
            del wd.enter
            n = 1_000_000
            t0 = time.perf_counter()
            for _ in range(n // 2):
                enter("forward_backward")
                enter("grad_sync")
            mark_ns = (time.perf_counter() - t0) / n * 1e9
        finally:
            trainer.close()
    if trainer.rank != 0:
        return 0
    off = statistics.median(times["off"])
    print(f"[bench] watchdog overhead: tiny-moe:xhc, {trainer.world} rank(s), CPU, {args.rounds} x {args.steps} "
          f"steps per mode, interleaved")
    print(f"{'mode':<22} {'median step (ms)':>17} {'mean (ms)':>10} {'median - off (ms)':>18} {'(%)':>7}")
    for mode, ts in times.items():
        med = statistics.median(ts)
        print(f"{mode:<22} {med * 1e3:17.3f} {statistics.mean(ts) * 1e3:10.3f} {(med - off) * 1e3:18.3f} "
              f"{(med - off) / off * 100:7.2f}")
    print(f"section marks: {count[0]} per step x {mark_ns:.0f} ns = {count[0] * mark_ns / 1e3:.2f} us per step "
          f"({count[0] * mark_ns * 1e-9 / off * 100:.4f} % of the median step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
