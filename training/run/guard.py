"""The Trainer's side of the watchdog (docs/reliability.md, "Hangs"): start this rank's watchdog and
straggler report, report the stragglers, and record how a launch ended in ``attempts.jsonl``.

Functions of the run (the :class:`training.pretrain.Trainer`, whose ``run_dir``, ``rank``, ``world``,
``cfg``, ``log``, ``status_dict``, ``paths``, ``metrics`` and ``step`` they read), so that the Trainer
keeps only the recipe.
"""

from __future__ import annotations

import time

from training.run.faults import set_attempt
from training.run.straggler import StragglerMonitor
from training.run.watchdog import Watchdog, WatchdogSettings, append_attempt, count_attempts


def start_guard(run) -> None:
    """``run.attempt``, ``run.watchdog`` (started) and ``run.straggler``, once the process group and the
    run directory exist."""
    run.attempt = count_attempts(run.run_dir) + 1
    set_attempt(run.attempt)

    def remove_partial_saves() -> None:
        from training.checkpoint import remove_partial_saves as remove

        remove(run.paths["checkpoints"])

    run.watchdog = Watchdog(run.run_dir, run.rank, run.world, WatchdogSettings.from_config(run.cfg),
                            attempt=run.attempt, status_base=run.status_dict, cleanup=remove_partial_saves,
                            info=run.log)
    run.watchdog.start()
    r = run.cfg.reliability
    run.straggler = StragglerMonitor(r.straggler_interval, r.straggler_threshold, run.rank, run.world,
                                     run._all_reduce)


def report_stragglers(run) -> None:
    """All ranks: share the window's step and section times (one all-reduce); rank 0 records them."""
    rec = run.straggler.report(run.step)
    if rec is None or not run.is_main:
        return
    run.metrics.write("straggler", run.step, rec)
    if rec["straggler"] is not None:
        run.log(run.straggler.line(run.step, rec))


def record_attempt(run, code: int) -> None:
    """Rank 0: one line in ``<run.dir>/attempts.jsonl`` saying how this launch ended (not for a refused
    start; a hang writes its own line from the watchdog)."""
    if not getattr(run, "is_main", False) or run.failed or run.metrics is None:
        return
    finished = run.step >= run.cfg.run.train_steps
    ended = "error" if code else ("finished" if finished else "stopped")
    try:
        append_attempt(run.run_dir, {"attempt": run.attempt, "ended": ended, "exit_code": code, "step": run.step,
                                     "reason": getattr(run, "stopped_early", None),
                                     "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    except OSError:
        pass
