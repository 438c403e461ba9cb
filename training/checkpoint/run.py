"""The Trainer's checkpoints: what a run saves, when a background save is done, and how it resumes.

The :class:`~training.pretrain.Trainer` calls in at step boundaries (``run`` is the Trainer; its
methods ``save_checkpoint``, ``poll_checkpoint``, ``wait_for_checkpoint`` and ``load_checkpoint``
are these functions)::

    save          the finite check and the state, read inside the step runner's parameter sync;
                  written now, or in the background (checkpoint.async_save, interval saves only)
    poll          the background save in flight: finalized when every rank's write is done
    load          verify, check against the run (compat_info), load the weights, the optimizer, the
                  scheduler, the counters and the RNG; on another layout, reseed (reshard=auto)

The format (sharded state, manifest, checksums, the writer) is :mod:`training.checkpoint`'s.  Module
-level imports stay light: ``training.pretrain`` imports this module when a run saves or loads.
"""

from __future__ import annotations

import time
from typing import Optional

__all__ = ["compat_info", "load", "poll", "save", "trainer_state"]


def trainer_state(run) -> dict:
    """The step counters a checkpoint carries."""
    return {"step": run.step, "consumed_samples": run.consumed_samples, "skipped_steps": run.skipped_steps,
            "skipped_samples": run.skipped_samples}


def compat_info(run) -> dict:
    """What a checkpoint must share with the run that loads it (see checkpoint.check_compatible)."""
    import dataclasses
    import json

    from training.config import config_to_dict

    hc = json.loads(json.dumps(dataclasses.asdict(run.hc), default=str))  # as the manifest stores it
    return {"preset": run.cfg.model.preset, "hc": hc, "vocab_size": run.vocab_size,
            "world_size": run.world, "parallel": config_to_dict(run.cfg.parallel),
            "global_batch_size": run.cfg.batch.global_batch_size}


def save_run(run, reason: str) -> Optional[str]:
    """Save this step (all ranks); the path, or None for a save left writing in the background."""
    from training.checkpoint import checkpointer as checkpoint

    t0 = time.perf_counter()
    sharding = run.cfg.checkpoint.optimizer_sharding
    info = {"world_size": run.world, "reason": reason, "consumed_samples": run.consumed_samples,
            "optimizer_sharding": sharding,
            "optimizer_format": checkpoint.optimizer_checkpoint_format(run.optimizer),
            "optimizer_main_params": bool(getattr(run.optimizer, "has_main_params", False)),
            **compat_info(run), "run_record": getattr(run, "run_record", None)}  # training.run.run_record
    asynchronous = run.async_save and reason == "interval"  # a stop or the end would wait for it at once
    with run.runner.params_synced():  # overlap_param_gather: every shard at this step's values
        run.check_parameters(f"checkpoint at step {run.step} not saved")  # all ranks agree (before a snapshot)
        run.wait_for_checkpoint()  # at most one save in flight
        state = checkpoint.build_state(run.chunks, run.optimizer, run.scheduler, trainer_state(run),
                                       optimizer_sharding=sharding)
        if asynchronous:
            run.ckpt.save_async(run.step, state, info)
            run.pending_save = (run.step, reason)
            run.last_saved_step = run.step
            return None
        path = run.ckpt.save(run.step, state, info)
    run.last_saved_step = run.step
    run.last_good_checkpoint = path
    run.metrics.event(run.step, f"[xhc] checkpoint step {run.step} ({reason}) -> {path} "
                      f"in {time.perf_counter() - t0:.1f}s", checkpoint=path)
    return path


def poll_run_save(run, blocking: bool = False) -> None:
    """The asynchronous save in flight: finalized when every rank's write is done (``blocking``:
    wait for it); a failed write raises its one-line CheckpointError here, at a step boundary."""
    if run.ckpt is None or not run.ckpt.in_flight:
        return
    path = run.ckpt.poll(blocking=blocking)
    if path is None:
        return
    step, reason = run.pending_save
    run.pending_save = None
    run.last_good_checkpoint = path
    run.metrics.event(run.step, f"[xhc] checkpoint step {step} ({reason}, written in the background) -> "
                      f"{path} in {run.ckpt.last_save_seconds:.1f}s (training paused "
                      f"{run.ckpt.snapshot_seconds:.2f}s for the snapshot)", checkpoint=path)


def load_run(run, path: str, body: Optional[dict] = None) -> None:
    """Resume ``run`` from the checkpoint at ``path`` (``body``: its verified manifest, if read already)."""
    from training.checkpoint.checkpointer import (build_state, check_compatible, is_megatron_optimizer, optimizer_checkpoint_format,
                                     restore_rng_state)

    ck = run.cfg.checkpoint
    if body is None:
        body = run.ckpt.verify(path)
    megatron_opt = is_megatron_optimizer(run.optimizer)
    resharding = check_compatible(path, body, compat_info(run), load_optimizer=ck.load_optimizer,
                                  sharded_optimizer=megatron_opt, reshard=ck.reshard,
                                  optimizer_format=optimizer_checkpoint_format(run.optimizer))
    load_rng = ck.load_rng and not resharding  # per-rank states: reseeded on another layout (below)
    t0 = time.perf_counter()
    template = build_state(run.chunks, run.optimizer if ck.load_optimizer else None,
                           run.scheduler if ck.load_optimizer else None, trainer_state(run),
                           rng=load_rng, is_loading=True,
                           optimizer_sharding=body.get("optimizer_sharding", ck.optimizer_sharding),
                           optimizer_format=body.get("optimizer_format", "megatron" if megatron_opt else "rank"),
                           optimizer_main_params=bool(body.get("optimizer_main_params", False)))
    loaded = run.ckpt.load(path, template, body)
    keys = ["model"] if len(run.chunks) == 1 else [f"model{i}" for i in range(len(run.chunks))]
    for key, chunk in zip(keys, run.chunks):
        missing, unexpected = run._unwrap(chunk).load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            from training.checkpoint.checkpointer import CheckpointError

            raise CheckpointError(f"checkpoint {path}: model keys do not match this model (missing "
                                  f"{missing[:3]}, unexpected {list(unexpected)[:3]}): is it the same preset?")
    if not ck.load_optimizer:
        run.optimizer.reload_model_params()  # fp32 main copies := the loaded weights
    if ck.load_optimizer:
        if "optimizer" in loaded:
            run.optimizer.load_state_dict(loaded["optimizer"])
        elif "optimizer_torch" in loaded:
            run.optimizer.load_torch_sharded_state_dict(loaded["optimizer_torch"])
        else:
            run.optimizer.load_state_dict(loaded["optimizer_rank"])
        run.scheduler.load_state_dict(loaded["scheduler"])
    t = loaded["trainer"]
    run.step, run.consumed_samples, run.skipped_steps = (int(t["step"]), int(t["consumed_samples"]),
                                                         int(t["skipped_steps"]))
    run.skipped_samples = int(t.get("skipped_samples", 0))
    if load_rng:
        restore_rng_state(loaded["rng"])
    elif resharding and ck.load_rng:
        from models.parallel import seed_rng

        seed_rng(run.cfg.run.seed + run.step)  # docs/parallelism-and-checkpoints.md, "Resuming on another layout"
    run.resumed_from = path
    run.load_seconds = time.perf_counter() - t0
    run.resume_layouts = None
    if resharding:
        from training.checkpoint.checkpointer import _LAYOUT_KEYS
        from training.config import config_to_dict

        now = config_to_dict(run.cfg.parallel)
        run.resume_layouts = {
            "saved": {"world_size": body.get("world_size"),
                      **{k: v for k, v in (body.get("parallel") or {}).items() if k in _LAYOUT_KEYS}},
            "now": {"world_size": run.world, **{k: v for k, v in now.items() if k in _LAYOUT_KEYS}}}
        run.log(f"[xhc] {resharding} (checkpoint.reshard=auto): weights"
                f"{', optimizer state, scheduler' if ck.load_optimizer else ''} and data position carried "
                f"over, RNG reseeded; {run.num_micro} micro-batch(es) per step now")
    run.log(f"[xhc] resumed from {path}: step {run.step}, {run.consumed_samples} samples consumed "
            f"({run.load_seconds:.1f} s)")
