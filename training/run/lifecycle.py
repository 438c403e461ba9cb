"""The lifecycle of one pre-training run: what starts, stops and guards it, apart from the maths.

- **Start-up**: :meth:`Lifecycle.claim_run_dir` (rank 0: ``run.dir`` and ``checkpoint.dir`` writable,
  the ``<run.dir>/.lock`` taken; a refused start removes the directories it created);
- **stop flags**: SIGTERM / SIGUSR1 / SIGINT (:meth:`Lifecycle.install_signal_handlers`) and
  ``run.exit_after_minutes`` set local flags that every rank agrees on, riding on the step's loss
  all-reduce (:meth:`Lifecycle.local_stop_flags`, :meth:`Lifecycle.should_stop`);
- **non-finite state**: :class:`NonFiniteState` (parameters or the validation loss), the finite check
  (:func:`first_nonfinite_parameter`) and the rollback policy (:meth:`Lifecycle.rollback_allowed`:
  ``run.on_nonfinite``, ``run.max_rollbacks``); :class:`TrainingAborted` otherwise;
- **the end**: ``<run.dir>/status.json`` (:func:`write_status`) and :meth:`Lifecycle.release` (the
  lock, and the empty directories of a refused start).

No model, optimizer or data here: the :class:`~training.pretrain.Trainer` calls in at the step
boundaries.  Module-level imports stay light (no torch): ``training.pretrain`` imports this module
at the top, and dist_checkpointing's save re-imports that module in a helper process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Callable, List, Optional, Sequence, Tuple

from training.config import ConfigError, PretrainConfig
from training.run.reliability import RunLock, check_writable

__all__ = ["Lifecycle", "NonFiniteState", "TrainingAborted", "first_nonfinite_parameter", "write_status"]


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (too many skipped steps, ...); the message says why."""


class NonFiniteState(TrainingAborted):
    """The parameters or the validation loss became non-finite (``run.on_nonfinite`` decides what next).

    ``window_end``: consumed samples up to the step that revealed it (the end of the data window a
    rollback skips).
    """

    def __init__(self, message: str, window_end: int):
        super().__init__(message)
        self.window_end = window_end


def first_nonfinite_parameter(named: Sequence[Tuple[str, object]]) -> Optional[str]:
    """The name of the first parameter holding a NaN / inf, None when all are finite (one device sync)."""
    import torch  # light module top (see the module docstring)

    if not named:
        return None
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named])
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def write_status(run_dir: str, status: dict) -> None:
    """``<run.dir>/status.json``, atomically (tools/slurm_pretrain.sh requeues unfinished runs)."""
    tmp = os.path.join(run_dir, "status.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(status, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, "status.json"))


class Lifecycle:
    """Signals, stop flags, the rollback budget, the run-directory lock of one run.

    ``all_reduce(values) -> values``: the sum over ranks (the Trainer's, on its device).
    """

    def __init__(self, cfg: PretrainConfig, all_reduce: Callable[[List[float]], List[float]]):
        self.cfg = cfg
        self.all_reduce = all_reduce
        self.t_start = time.time()
        self.stop_signal: Optional[str] = None
        self.agreed_flags: Optional[List[float]] = None  # stop flags agreed with the last step's all-reduce
        self.rollbacks = 0
        self.lock: Optional[RunLock] = None
        self.created_dirs: List[str] = []  # by this start-up (removed again, when empty, after a failed start)

    # ----------------------------------------------------------------------------------------
    # Start-up
    # ----------------------------------------------------------------------------------------
    def claim_run_dir(self, run_dir: str, checkpoint_dir: str, log: Callable[..., None]) -> Optional[str]:
        """Rank 0's pre-flight: both directories writable and the run's lock taken; the error (one
        line) or None.  A refusal leaves the disk as it was."""
        created = [d for d in (run_dir, checkpoint_dir) if not os.path.exists(d)]
        self.created_dirs = created
        error = None
        try:
            check_writable(run_dir, "run.dir")
            lock = RunLock(run_dir, log=log)
            lock.acquire()
            self.lock = lock
            check_writable(checkpoint_dir, "checkpoint.dir")
        except ConfigError as e:
            error = str(e)
        if error:  # leave the disk as it was
            if self.lock is not None:
                self.lock.release()
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        return error

    def release(self, failed: bool) -> None:
        """The lock; after a refused start (``failed``) also the directories it created, when empty."""
        if self.lock is not None:
            self.lock.release()
        if failed:  # a refused start leaves no empty directories behind
            for d in reversed(self.created_dirs):
                with contextlib.suppress(OSError):
                    os.rmdir(d)

    # ----------------------------------------------------------------------------------------
    # Stop conditions
    # ----------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGTERM (SLURM, torchrun shutdown), SIGUSR1 (SLURM ``--signal``), SIGINT (Ctrl-C): save at the
        next step boundary and exit 0.  A second SIGINT interrupts at once (KeyboardInterrupt)."""
        if not self.cfg.checkpoint.save_on_signal:
            return

        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if name == "SIGINT" and self.stop_signal == "SIGINT":
                raise KeyboardInterrupt
            self.stop_signal = self.stop_signal or name

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass

    def local_stop_flags(self) -> List[float]:
        """[a signal arrived, run.exit_after_minutes is up] on this rank (summed over ranks by the step)."""
        r = self.cfg.run
        timed = r.exit_after_minutes is not None and (time.time() - self.t_start) / 60 >= r.exit_after_minutes
        return [1.0 if self.stop_signal else 0.0, 1.0 if timed else 0.0]

    def should_stop(self, step: int) -> Optional[str]:
        """A reason to save and stop now, agreed by all ranks.

        The flags ride on the step's loss all-reduce (no extra collective per step); after a save, an
        evaluation or before the first step they are agreed with one small all-reduce of their own.
        """
        r = self.cfg.run
        flags = self.agreed_flags
        if flags is None:
            flags = self.all_reduce(self.local_stop_flags())
        self.agreed_flags = None
        if flags[0]:
            return f"signal {self.stop_signal or 'on another rank'}"
        if flags[1]:
            return f"run.exit_after_minutes={r.exit_after_minutes}"
        if r.exit_at_step is not None and step >= r.exit_at_step and step < r.train_steps:
            return f"run.exit_at_step={r.exit_at_step}"
        return None

    # ----------------------------------------------------------------------------------------
    # Non-finite state
    # ----------------------------------------------------------------------------------------
    def check_rollback(self, err: NonFiniteState, good: Optional[str]) -> None:
        """Raise :class:`TrainingAborted` unless ``run.on_nonfinite=rollback`` may reload ``good`` (the
        last good checkpoint) once more; the message says what was kept and what to change."""
        r = self.cfg.run
        kept = f"the last good checkpoint {good} is kept" if good else "no checkpoint was saved before it"
        if r.on_nonfinite != "rollback" or good is None or self.rollbacks >= r.max_rollbacks:
            hint = "lower optimizer.lr or check the data"
            if r.on_nonfinite != "rollback":
                why = ""
                hint += "; run.on_nonfinite=rollback reloads the last good checkpoint and skips this data window"
            elif good is None:
                why = " (no checkpoint to roll back to)"
            else:
                why = f" ({self.rollbacks} rollbacks, run.max_rollbacks={r.max_rollbacks})"
            raise TrainingAborted(f"{err}{why}; nothing was saved, {kept}: {hint}")
