"""xhc-pretrain: pre-train a hyper-connection MoE transformer on Megatron-Core.

Run::

    python -m training.pretrain                                   # the embedded default (CPU, < 10 min)
    python -m training.pretrain --config configs/pretrain/moe-18b-xhc.yaml optimizer.lr=3e-4
    torchrun --nproc_per_node 8 -m training.pretrain --config ... parallel.tp=2 parallel.ep=4
    xhc-pretrain --config ...                                     # the same, as a console script

The recipe (:class:`Trainer`; ``setup()``, ``train()``, ``finish()``)::

    build         config -> parallel state -> run dir -> data -> model -> optimizer, scheduler
                  -> checkpointer (training.builder.Builder)
    maybe resume  the newest verified checkpoint of run.dir (checkpoint.load=auto)
    until done    step (the step runner: forward/backward over micro-batches, grad sync; then the
                  optimizer step, skipped if non-finite), log, evaluate, save; stop on a signal

Where the rest lives:

- :mod:`training.builder`: config -> the run's state (process groups, data, model chunks, optimizer,
  scheduler, checkpointer, logger).
- :mod:`training.run.step_runner`: one global batch's forward and backward, chosen once at start-up:
  ``MegatronStepRunner`` (GPU: Megatron's pipeline schedules, DDP, the distributed optimizer, bf16
  with the HC parameters in fp32) or ``CpuStepRunner`` (gloo, fp32, GPipe for PP > 1).
- :mod:`training.run.lifecycle`: signals and stop flags, non-finite handling and the rollback policy,
  ``status.json``, the run-directory lock.
- :mod:`training.checkpoint.run`: the run's checkpoints: save (now, or in the background), the
  save in flight, load and resume.

Reliability (``docs/reliability.md``): a lock on ``run.dir``, writable / free-space checks at
start-up, a signal sets a flag that all ranks agree on with the step's loss all-reduce, then one
verified checkpoint and exit 0; non-finite parameters are never saved (exit 3, or a rollback to the
last good checkpoint with ``run.on_nonfinite=rollback``); the manifest is checked against the run
before loading; a ``resume`` record in ``metrics.jsonl`` marks where a resumed run continues.

The loss of a global batch is the token-weighted mean over its micro-batches (each micro-batch
contributes ``Σ loss·mask / Σ mask / num_microbatches`` to the gradient, Megatron's default).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from typing import Dict, List, Optional

# Keep top-level imports light: dist_checkpointing's save starts a helper process that re-imports
# the main module.  CPU machines: passive OpenMP waits (before torch loads) and, while main() runs,
# no torch.compile (see training.run.process_defaults).
from training.run import cpu_entry_point, set_omp_wait_policy  # noqa: E402

set_omp_wait_policy()

from training.config import ConfigError, PretrainConfig, load_config  # noqa: E402
from training.run import (Lifecycle, NonFiniteState, TrainingAborted,  # noqa: E402,F401
                                first_nonfinite_parameter, write_status)
from training.run import Watchdog, WatchdogSettings, fault_point, faults_active  # noqa: E402  (stdlib only)

__all__ = ["Trainer", "TrainingAborted", "main", "parse_args"]


def __getattr__(name: str):
    """``float16_module_keep_hc_fp32`` and ``params_synced`` live in :mod:`training.run.step_runner`
    (imported on first use: this module's top stays light)."""
    if name in ("float16_module_keep_hc_fp32", "params_synced"):
        import training.run

        return getattr(training.run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ================================================================================================
class Trainer:
    """One pre-training run of :class:`~training.config.PretrainConfig` (see the module docstring)."""

    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg
        self.life = Lifecycle(cfg, all_reduce=lambda values: self._all_reduce(values))
        self.paths: Dict[str, Optional[str]] = {}
        self.metrics = None
        self.history: List[dict] = []
        self.evals: List[dict] = []
        self.failed = False  # a refused start (close() removes the directories it created)
        self.ckpt = None
        self.plan_check = None
        self.async_save = False  # checkpoint.async_save, resolved for this device (training.builder)
        self.pending_save = None  # (step, reason) of the asynchronous save in flight
        # the rank's watchdog (training.run.watchdog): marks only until setup() starts the real one
        self.watchdog = Watchdog("", 0, 1, WatchdogSettings(enabled=False))
        self.straggler = None  # training.run.StragglerMonitor, from setup()
        self.attempt = 1  # this launch's number in <run.dir>/attempts.jsonl

    # ----------------------------------------------------------------------------------------
    # The recipe: build, maybe resume, then step, log, evaluate and save until done
    # ----------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the run's state (:class:`training.builder.Builder`), resuming where a checkpoint says."""
        import warnings

        # Megatron start-up notices that say nothing about this run (no apex on CPU, a deprecated
        # default it sets itself).
        warnings.filterwarnings("ignore", message="Apex is not installed")
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from training.builder import Builder
        from training.run import start_guard

        build = Builder(self)
        build.parallel()
        build.run_dir()
        start_guard(self)  # this rank's watchdog and straggler report (training.run.guard)
        build.data()
        build.model()
        build.optimizer()
        build.checkpointer()
        if faults_active():  # XHC_FAULT_INJECT: the save's fault point is where this rank writes its files
            self.ckpt.write_hook = lambda step: fault_point("checkpoint_save", step)
        self.maybe_resume()
        build.datasets()  # after the checkpoint checks: a refused resume builds no index caches
        build.write_config()
        build.logging()
        from training.plan import PlanCheck  # the plan, printed; checked against the first step (docs/planning.md)
        self.plan_check = PlanCheck(self)
        fault_point("startup", self.step)

    def train_iterators(self) -> list:
        """The training data iterators from the current data position, one per model chunk; each fetch
        is the watchdog's ``data`` section (and its fault point, once per step)."""
        return [_DataSection(self.data_iterator(self.train_ds, self.consumed_samples, cycle=self.skipped_samples > 0),
                             self) for _ in self.chunks]

    def maybe_resume(self) -> None:
        """Load the checkpoint ``checkpoint.load`` selects (``auto``: the newest verified one in
        ``checkpoint.dir``), if any."""
        path, body = self.ckpt.select(self.cfg.checkpoint.load)
        if path is not None:
            self.load_checkpoint(path, body)
        self.last_saved_step = self.step if self.resumed_from else None
        self.last_good_checkpoint = self.resumed_from

    def train(self) -> int:
        """Step, log, evaluate and save until ``run.train_steps`` or a stop reason (then save); 0."""
        r, ck = self.cfg.run, self.cfg.checkpoint
        self.life.install_signal_handlers()
        for c in self.chunks:
            c.train()
        t_loop = time.perf_counter()
        self.steps_this_run = 0
        if self.step == 0 and r.eval_interval:
            self.run_eval()  # the starting point of the validation curve
        while True:
            try:
                stop_reason = self._train_loop(t_loop)
                self.train_seconds = time.perf_counter() - t_loop
                if stop_reason:
                    self.log(f"[xhc] stopping at step {self.step}: {stop_reason}")
                    if self.last_saved_step != self.step:
                        self.save_checkpoint(stop_reason)
                    self.wait_for_checkpoint()
                    self.stopped_early = stop_reason
                    return 0
                self.stopped_early = None
                if not self.evals or self.evals[-1]["step"] != self.step:
                    self.run_eval()
                self.wait_for_checkpoint()
                if ck.save_final and self.last_saved_step != self.step:
                    self.save_checkpoint("final")
                return 0
            except NonFiniteState as e:
                self.wait_for_checkpoint()  # its state was checked finite before the snapshot
                self.roll_back(e)  # or TrainingAborted

    def _train_loop(self, t_loop: float) -> Optional[str]:
        """Steps until ``run.train_steps`` (None) or a stop reason; raises :class:`NonFiniteState`."""
        from training.run import report_stragglers

        r, ck, lg = self.cfg.run, self.cfg.checkpoint, self.cfg.logging
        its = self.train_iterators()
        while self.step < r.train_steps:
            stop_reason = self.life.should_stop(self.step)
            if stop_reason:
                return stop_reason
            rec = self.train_step(its)
            self.steps_this_run += 1
            if self.straggler is not None and self.straggler.due(self.step):
                report_stragglers(self)
            self.poll_checkpoint()
            self.history.append({"step": self.step, "loss": rec["loss"]})
            self.metrics.write("train", self.step, rec)
            if self.step % lg.interval == 0 or self.step == 1 or self.step == r.train_steps:
                elapsed = time.perf_counter() - t_loop
                eta = elapsed / self.steps_this_run * (r.train_steps - self.step)
                self.log(self.metrics.train_line(self.step, r.train_steps, rec, eta))
            if self.skipped_steps > r.max_skipped_steps:
                raise TrainingAborted(
                    f"{self.skipped_steps} steps skipped for non-finite loss/gradients (run.max_skipped_steps="
                    f"{r.max_skipped_steps}); lower optimizer.lr, check the data, or raise the limit")
            if r.eval_interval and self.step % r.eval_interval == 0 and self.step < r.train_steps:
                self.run_eval()
                self.life.agreed_flags = None  # a signal during it is seen before the next step
            if ck.interval and self.step % ck.interval == 0 and self.step < r.train_steps:
                self.save_checkpoint("interval")
                self.life.agreed_flags = None
        return None

    # ----------------------------------------------------------------------------------------
    # One step (the step runner does the forward and backward)
    # ----------------------------------------------------------------------------------------
    def train_step(self, iterators) -> dict:
        t0 = time.perf_counter()
        wd = self.watchdog
        wd.enter("forward_backward", self.step + 1)
        fault_point("forward_backward", self.step + 1)
        self.runner.zero_grad_buffers()
        self.optimizer.zero_grad()
        interval = self.cfg.logging.hc_health_every
        health_now = bool(interval) and (self.step + 1) % interval == 0 and self.health.num_wrapped > 0
        with self.health.recording() if health_now else contextlib.nullcontext():
            total, count = self.forward_backward(iterators)
        wd.enter("grad_sync")
        self.runner.finalize_grads()  # CPU: DP / SP all-reduce, expert-bias update (GPU: in the schedule)
        mtp = self.runner.mtp_stats()  # [Σ loss_k per depth..., micro-batches], empty without MTP
        s, n, *rest = self._all_reduce([total, count, *mtp, *self.life.local_stop_flags()])
        mtp, flags = rest[:len(mtp)], rest[len(mtp):]
        self.life.agreed_flags = flags
        loss = s / n if n > 0 else float("nan")
        if not math.isfinite(loss):
            self.check_parameters(f"the loss of step {self.step + 1} is {loss}",
                                  self.consumed_samples + self.cfg.batch.global_batch_size)
        wd.enter("optimizer")
        fault_point("optimizer", self.step + 1)
        if math.isfinite(loss):
            result = self.optimizer.step()
            updated, gnorm = result.updated, result.grad_norm
        else:
            updated, gnorm = False, float("nan")
        lr = self.scheduler.get_last_lr()[0] if self.optimizer.param_groups else float("nan")
        if updated:
            self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        self.consumed_samples += self.cfg.batch.global_batch_size
        dt = time.perf_counter() - t0
        wd.enter("step_boundary")
        wd.step_done(dt)
        if self.straggler is not None:
            self.straggler.record(self.step, dt, wd.take_section_times())
        tokens_per_s = self.tokens_per_step / dt
        rec = {"loss": loss, "lr": lr, "grad_norm": gnorm, "step_time_s": dt, "tokens_per_s": tokens_per_s,
               "mfu": tokens_per_s * self.flops["total"] / (self.peak * 1e12 * self.world),
               "consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_samples * self.seq,
               "skipped_steps": self.skipped_steps}
        self.plan_check = self.plan_check and self.plan_check.record(rec)  # planned vs measured peak, first step
        if mtp:  # per-depth MTP loss: the mean over ranks and micro-batches of each micro-batch's token mean
            rec["mtp_loss"] = [v / mtp[-1] if mtp[-1] > 0 else float("nan") for v in mtp[:-1]]
        if health_now:
            rec["hc"] = self.health.summary()
        if self.cfg.logging.sample_ids:
            rec["sample_ids"] = self._gathered_sample_ids(iterators)
        if not updated:
            self.skipped_steps += 1
            rec["skipped_steps"] = self.skipped_steps
            rec["skipped"] = True
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            self.metrics.event(self.step, f"[xhc] step {self.step}: non-finite {what} (loss {loss}, grad norm "
                               f"{gnorm}): update skipped ({self.skipped_steps} skipped so far, limit "
                               f"{self.cfg.run.max_skipped_steps})", skipped_steps=self.skipped_steps)
        return rec

    def forward_backward(self, iterators, forward_only: bool = False, num_micro: Optional[int] = None):
        """One global batch on this rank: returns (Σ loss·mask, Σ mask) of its last-stage micro-batches."""
        return self.runner.forward_backward(iterators, forward_only, num_micro)

    def data_iterator(self, dataset, start_sample: int, cycle: bool):
        from training.data import make_data_iterator

        return make_data_iterator(dataset, self.cfg.batch.micro_batch_size, start_sample, self.dp_rank, self.dp, cycle)

    def _global_loss(self, total: float, count: float) -> float:
        """Token-weighted mean over all ranks' last-stage micro-batches (nan if any is non-finite)."""
        s, n = self._all_reduce([total, count])
        return s / n if n > 0 else float("nan")

    @staticmethod
    def _gathered_sample_ids(iterators) -> List[int]:
        """The sample indices this step read on every rank (``logging.sample_ids``), sorted."""
        import torch.distributed as dist

        mine = sorted({i for it in iterators for i in getattr(it, "drawn", ())})
        for it in iterators:
            if hasattr(it, "drawn"):
                it.drawn.clear()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        parts: List[Optional[List[int]]] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        return sorted({i for part in parts for i in part or ()})

    # ----------------------------------------------------------------------------------------
    # Evaluation
    # ----------------------------------------------------------------------------------------
    def run_eval(self) -> Optional[float]:
        with self.watchdog.during("evaluation", self.step):
            return self._run_eval()

    def _run_eval(self) -> Optional[float]:
        t0 = time.perf_counter()
        with self.runner.params_synced():  # overlap_param_gather: evaluate the weights of this step
            loss = self.evaluate()
        if loss is None:
            return None
        if not math.isfinite(loss):
            self.check_parameters(f"validation loss at step {self.step} is {loss}")
            raise NonFiniteState(f"validation loss at step {self.step} is {loss} (the parameters are finite)",
                                 self.consumed_samples)
        self.evals.append({"step": self.step, "loss": loss})
        ppl = math.exp(loss) if loss < 50 else float("inf")
        self.metrics.write("eval", self.step, {"loss": loss, "ppl": ppl, "eval_time_s": time.perf_counter() - t0})
        self.log(f"[xhc] validation at step {self.step}: loss {loss:.4f} (ppl {ppl:.1f}) over "
                 f"{self.cfg.run.eval_iters * self.cfg.batch.global_batch_size} sequences")
        return loss

    def evaluate(self) -> Optional[float]:
        """Validation loss over ``run.eval_iters`` global batches (the same batches every time)."""
        if self.cfg.run.eval_iters == 0 or self.valid_ds is None:
            return None
        for c in self.chunks:
            c.eval()
        try:
            it = self.data_iterator(self.valid_ds, 0, cycle=True)
            its = [it] + [self.data_iterator(self.valid_ds, 0, cycle=True) for _ in self.chunks[1:]]
            total, count = 0.0, 0.0
            for _ in range(self.cfg.run.eval_iters):
                s, n = self.forward_backward(its, forward_only=True)
                total, count = total + s, count + n
        finally:
            for c in self.chunks:
                c.train()
        return self._global_loss(total, count)

    # ----------------------------------------------------------------------------------------
    # Checkpoints
    # ----------------------------------------------------------------------------------------
    def save_checkpoint(self, reason: str) -> Optional[str]:
        """Save this step: the path, or None when it writes in the background (:mod:`training.checkpoint.run`)."""
        from training.checkpoint import save_run

        with self.watchdog.during("checkpoint_save", self.step, fault=False):  # its fault point: in the writer
            return save_run(self, reason)

    def poll_checkpoint(self, blocking: bool = False) -> None:
        """Finalize the asynchronous save in flight once every rank's write is done (``blocking``: wait)."""
        from training.checkpoint import poll_run_save

        if self.ckpt is None or not self.ckpt.in_flight:
            return
        with self.watchdog.during("checkpoint_save", fault=False):  # finalizing (or waiting for) a background save
            poll_run_save(self, blocking)

    def wait_for_checkpoint(self) -> None:
        """Finish the asynchronous save in flight, if any."""
        self.poll_checkpoint(blocking=True)

    def load_checkpoint(self, path: str, body: Optional[dict] = None) -> None:
        """Resume from the checkpoint at ``path`` (:func:`training.checkpoint.run.load`)."""
        import re

        from training.checkpoint import load_run

        m = re.search(r"step_(\d+)$", os.path.normpath(path))
        step = int(m.group(1)) if m else self.step
        with self.watchdog.during("checkpoint_load", step):
            load_run(self, path, body)

    # ----------------------------------------------------------------------------------------
    # Non-finite state: never saved; abort, or roll back (the policy: training.run.lifecycle)
    # ----------------------------------------------------------------------------------------
    def check_parameters(self, context: str, window_end: Optional[int] = None) -> None:
        """Raise :class:`NonFiniteState` on every rank when any rank holds a non-finite parameter."""
        bad = self._first_nonfinite_parameter()
        if self._all_reduce([1.0 if bad else 0.0])[0]:
            where = bad if bad else "on another rank"
            raise NonFiniteState(f"{context}: parameters are non-finite ({where})",
                                 self.consumed_samples if window_end is None else window_end)

    def _first_nonfinite_parameter(self) -> Optional[str]:
        return first_nonfinite_parameter([(f"chunk {i}: {n}" if len(self.chunks) > 1 else n, p)
                                          for i, c in enumerate(self.chunks)
                                          for n, p in self._unwrap(c).named_parameters()])

    def roll_back(self, err: NonFiniteState) -> None:
        """``run.on_nonfinite=rollback``: reload the last good checkpoint, skip the data since it; else abort."""
        r = self.cfg.run
        good = self.last_good_checkpoint
        self.life.check_rollback(err, good)  # or TrainingAborted
        bad_step, window_end = self.step, max(err.window_end, self.consumed_samples)
        path, body = self.ckpt.select(good)
        self.load_checkpoint(path, body)
        skip = window_end - self.consumed_samples
        self.skipped_samples += skip
        self.consumed_samples = window_end
        self.life.rollbacks += 1
        self.life.agreed_flags = None
        self.metrics.write("resume", self.step, {"checkpoint": path, "consumed_samples": self.consumed_samples,
                                                 "rollback": True})
        self.metrics.event(self.step, f"[xhc] rollback {self.life.rollbacks}/{r.max_rollbacks}: {err} at step "
                           f"{bad_step}; reloaded {path} (step {self.step}) and skipped {skip} samples of data",
                           rollback=self.life.rollbacks, skipped_samples=self.skipped_samples)

    # ----------------------------------------------------------------------------------------
    # The end
    # ----------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Loss plot and the summary of where everything went (rank 0)."""
        from training.checkpoint import list_checkpoints
        from training.run import format_duration, plot_losses

        if self.metrics is None:
            return
        self.watchdog.enter("finish")
        self.metrics.flush()
        plot = None
        if self.is_main and self.cfg.logging.plot and self.metrics.jsonl_path:
            from training.run import plot_rank_times, read_jsonl

            plot = plot_losses(self.metrics.jsonl_path, os.path.join(self.run_dir, "loss.png"), self.cfg.model.preset)
            self.paths["rank_times"] = plot_rank_times(read_jsonl(self.metrics.jsonl_path),  # straggler reports
                                                       os.path.join(self.run_dir, "rank_times.png"))
        self.paths["plot"] = plot
        if not self.is_main:
            return
        self.write_status()
        losses = [h["loss"] for h in self.history if math.isfinite(h["loss"])]
        total = time.time() - self.life.t_start
        self.log("")
        verb = f"stopped early ({self.stopped_early})" if getattr(self, "stopped_early", None) else "done"
        self.log(f"[xhc] {verb}: step {self.step}/{self.cfg.run.train_steps}, {self.steps_this_run} steps this run in "
                 f"{format_duration(self.train_seconds)} (total wall time {format_duration(total)})")
        if losses:
            tail = losses[-min(10, len(losses)):]
            self.log(f"[xhc] train loss first {losses[0]:.4f} -> last {losses[-1]:.4f} "
                     f"(mean of last {len(tail)}: {sum(tail) / len(tail):.4f})")
        if self.evals:
            self.log("[xhc] validation " + ", ".join(f"step {e['step']}: {e['loss']:.4f}" for e in self.evals))
        found = list_checkpoints(self.paths["checkpoints"])
        rows = [("run dir", self.run_dir), ("config", self.paths["config"]),
                ("data", self.paths["data"] + (f" (corpus {self.paths['corpus']})" if self.paths.get("corpus") else "")),
                ("tokenizer", self.paths.get("tokenizer") or "none (raw token ids)"),
                ("checkpoints", f"{self.paths['checkpoints']}" + (f" (latest {os.path.basename(found[-1][1])})"
                                                                   if found else " (none)")),
                ("metrics", self.paths.get("metrics") or "off"),
                ("tensorboard", f"{self.paths['tensorboard']}  (tensorboard --logdir {self.paths['tensorboard']})"
                 if self.paths.get("tensorboard") else "off"),
                ("loss plot", plot or ("off" if not self.cfg.logging.plot else
                                       "not drawn: matplotlib is not installed (pip install matplotlib)"))]
        for k, v in rows:
            self.log(f"[xhc] {k:<12} {v}")
        if getattr(self, "stopped_early", None):
            self.log(f"[xhc] to resume, run the same command with run.dir={self.run_dir} (checkpoint.load=auto)")

    def write_status(self, failed: Optional[dict] = None) -> None:
        """``<run.dir>/status.json``: where the run stands (tools/slurm_pretrain.sh requeues unfinished runs)."""
        write_status(self.run_dir, self.status_dict(failed))

    def status_dict(self, failed: Optional[dict] = None) -> dict:
        """What ``status.json`` says now (also what the watchdog records a hang into)."""
        from training.checkpoint import list_checkpoints

        found = list_checkpoints(self.paths["checkpoints"])
        return {"step": self.step, "train_steps": self.cfg.run.train_steps,
                "finished": self.step >= self.cfg.run.train_steps,
                "stopped_early": getattr(self, "stopped_early", None),
                "latest_checkpoint": found[-1][1] if found else None,
                "last_train_loss": self.history[-1]["loss"] if self.history else None,
                "last_valid_loss": self.evals[-1]["loss"] if self.evals else None,
                "failed": failed}

    def abandon_checkpoint(self) -> None:
        """A failing run: the asynchronous save in flight is never finalized; its partial directory is
        removed (the previous verified checkpoint stays the newest)."""
        if self.ckpt is not None and self.ckpt.in_flight:
            self.ckpt.abandon()

    def record_failure(self, message: str, code: int) -> None:
        """``status.json`` after a failed save: where the run stands, the error line and the exit code."""
        if not self.is_main or self.metrics is None:
            return
        try:
            self.write_status(failed={"error": message, "exit_code": code})
        except OSError:  # the disk that failed the save may refuse this too: the stderr line stays
            pass

    def close(self, destroy_process_group: bool = True) -> None:
        """Close the loggers and tear down Megatron's parallel state (and the process group)."""
        from models.parallel import destroy_parallel
        from models.pipeline import uninstall_hc_p2p_shapes

        self.watchdog.stop()
        if self.metrics is not None:
            self.metrics.close()
        self.life.release(self.failed)
        uninstall_hc_p2p_shapes()
        destroy_parallel(destroy_process_group=destroy_process_group)

    # ----------------------------------------------------------------------------------------
    # Helpers
    # ----------------------------------------------------------------------------------------
    def _all_reduce(self, values: List[float], op: str = "sum", group=None) -> List[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return [float(x) for x in t.cpu()]

    @staticmethod
    def _unwrap(chunk):
        """The GPT model inside a chunk's wrappers (:func:`training.run.step_runner.unwrap`)."""
        from training.run import unwrap

        return unwrap(chunk)


# ================================================================================================
class _DataSection:
    """A training data iterator whose fetches are the watchdog's ``data`` section (and the ``data`` fault
    point, at the first fetch of each step); other attributes (``drawn``) are the iterator's."""

    def __init__(self, it, trainer: "Trainer"):
        self.it, self.trainer, self.fired = it, trainer, None

    def __iter__(self):
        return self

    def __next__(self):
        t = self.trainer
        prev = t.watchdog.enter("data")
        try:
            if self.fired != t.step + 1:
                self.fired = t.step + 1
                fault_point("data", t.step + 1)
            return next(self.it)
        finally:
            t.watchdog.enter(prev)

    def __getattr__(self, name):
        return getattr(self.it, name)


# ================================================================================================
SAVE_FAILED = 4
"""Exit code of a run stopped by a failed checkpoint save (no space, an unwritable disk, a writer
error): the partial save is removed, the previous checkpoint kept; ``status.json`` has the line."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="xhc-pretrain",
        description="Pre-train a hyper-connection MoE transformer on Megatron-Core. With no arguments: build the "
                    "embedded default corpus and tokenizer, and pre-train the tiny xHC-MoE model on CPU.",
        epilog="Overrides: dotted keys, values parsed as YAML, e.g. optimizer.lr=1e-3 parallel.tp=2 "
               "run.train_steps=50 model.backbone.hidden_dropout=0.1.  See configs/pretrain/ and the README.")
    p.add_argument("--config", "-c", help="YAML config (default: the built-in tiny CPU run, "
                                          "configs/pretrain/default-tiny.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def main(argv=None) -> int:
    with cpu_entry_point() as entry:
        return _main(argv, entry)


def _main(argv=None, entry=None) -> int:
    args = parse_args(argv)
    if args.help_config:
        from training.config import config_reference

        print(config_reference(markdown=False))
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        from training.config import config_to_dict

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    if cfg.model.compile_hc and entry is not None:
        entry.allow_compile()
    trainer = Trainer(cfg)
    code = 0
    try:
        trainer.setup()
        code = trainer.train()
        trainer.finish()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
        trainer.failed = trainer.metrics is None
    except TrainingAborted as e:
        print(f"error: training aborted: {e}", file=sys.stderr, flush=True)
        code = 3
    except Exception as e:
        from training.checkpoint import CheckpointError
        from training.data import DataError

        trainer.watchdog.absorb_failure(e)  # a hang announced by a rank broke a collective: exit 86 instead
        if not isinstance(e, (CheckpointError, DataError)):
            code = 1
            trainer.abandon_checkpoint()
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        trainer.failed = trainer.metrics is None
        code = 2 if trainer.failed or not isinstance(e, CheckpointError) else SAVE_FAILED
        if code == SAVE_FAILED:
            trainer.record_failure(str(e), code)
    finally:
        from training.run import record_attempt  # how this launch ended: attempts.jsonl

        trainer.abandon_checkpoint()
        record_attempt(trainer, code)
        trainer.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
