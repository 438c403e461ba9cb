"""xhc-pretrain: pre-train a hyper-connection MoE transformer on Megatron-Core.

Run::

    python -m training.pretrain                                   # the embedded default (CPU, < 10 min)
    python -m training.pretrain --config configs/pretrain/moe-18b-xhc.yaml optimizer.lr=3e-4
    torchrun --nproc_per_node 8 -m training.pretrain --config ... parallel.tp=2 parallel.ep=4
    xhc-pretrain --config ...                                     # the same, as a console script

The flow (each step is one method of :class:`Trainer`)::

    config  -> parallel state -> data -> model -> optimizer, scheduler -> checkpointer (resume)
            -> loop: forward/backward over micro-batches, grad sync, step (skip if non-finite),
                     log, evaluate, checkpoint, react to SIGTERM / SIGINT / SIGUSR1

Reliability (``docs/reliability.md``): a lock on ``run.dir``, writable / free-space checks at
start-up, a signal sets a flag that all ranks agree on with the step's loss all-reduce, then one
verified checkpoint and exit 0; non-finite parameters are never saved (exit 3, or a rollback to the
last good checkpoint with ``run.on_nonfinite=rollback``); the manifest is checked against the run
before loading; a ``resume`` record in ``metrics.jsonl`` marks where a resumed run continues.

- **GPU**: Megatron's ``get_forward_backward_func()`` schedules (1F1B, interleaved), with the N·C
  pipeline p2p shapes of :func:`models.pipeline.install_hc_p2p_shapes`; Megatron DDP; Megatron's
  (distributed) optimizer through :func:`training.optim.build_optimizer`; bf16 (HC parameters
  kept in fp32, docs/math.md §8 #13).
- **CPU** (gloo, :mod:`models.cpu_compat`): fp32; forward and backward driven directly, with
  :func:`models.parallel.finalize_grads` for the DP / SP gradient all-reduces and the
  aux-loss-free expert-bias update; PP > 1 through :func:`models.pipeline.gpipe_forward_backward`.

The loss of a global batch is the token-weighted mean over its micro-batches (each micro-batch
contributes ``Σ loss·mask / Σ mask / num_microbatches`` to the gradient, Megatron's default).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

# Keep top-level imports light: dist_checkpointing's save starts a helper process that re-imports
# the main module.  CPU machines: passive OpenMP waits (before torch loads) and, while main() runs,
# no torch.compile (see training.process_defaults).
from training.process_defaults import cpu_entry_point, set_omp_wait_policy  # noqa: E402

set_omp_wait_policy()

from training.config import ConfigError, PretrainConfig, load_config  # noqa: E402

__all__ = ["Trainer", "TrainingAborted", "main", "parse_args"]


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


def _p(msg: str = "") -> None:
    print(msg, flush=True)


# ================================================================================================
# GPU-path helpers (module level so that the CPU tests reach them)
# ================================================================================================
def float16_module_keep_hc_fp32(config, chunk):
    """Megatron's ``Float16Module(config, chunk)`` with the HC parameters kept in fp32 *and at
    their fp32 values* (docs/math.md §8 #13): the wrap casts every parameter to bf16, so casting
    back afterwards would keep the bf16 rounding (N = 16's uniform read summed to 1.0046, a 0.01
    gate became 0.0100098).  The fp32 tensors are set aside before the wrap and put back after."""
    from megatron.core.transformer.module import Float16Module

    keep = {name: prm.data.detach().float().clone() for name, prm in chunk.named_parameters()
            if getattr(prm, "is_hyper_connection", False)}
    wrapped = Float16Module(config, chunk)
    for name, prm in chunk.named_parameters():
        if name in keep:
            prm.data = keep[name]
    return wrapped


@contextlib.contextmanager
def params_synced(chunks):
    """Every data-parallel rank holds the full, current parameters inside the block.

    With the distributed optimizer and ``overlap_param_gather`` each rank updates only its shard
    of the bf16 weights in ``step()``; the all-gather of the others is deferred to the next
    forward's pre-hooks.  A checkpoint (or an evaluation) right after ``step()`` would mix steps
    k and k - 1.  As Megatron's training loop does around saves and evaluations: remove the
    pre-hooks with a forced synchronous all-gather (``disable_forward_pre_hook(param_sync=True)``)
    and put them back afterwards.  Chunks without the hooks are left alone."""
    hooked = [c for c in chunks if getattr(c, "use_forward_hook", False)]
    for c in hooked:
        c.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for c in hooked:
            c.enable_forward_pre_hook()


# ================================================================================================
class Trainer:
    """One pre-training run of :class:`~training.config.PretrainConfig` (see the module docstring)."""

    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg
        self.t_start = time.time()
        self.stop_signal: Optional[str] = None
        self.paths: Dict[str, Optional[str]] = {}
        self.metrics = None
        self.history: List[dict] = []
        self.evals: List[dict] = []
        self.lock = None
        self.created_dirs: List[str] = []  # by this start-up (removed again, when empty, after a failed start)
        self.failed = False
        self._agreed_flags: Optional[List[float]] = None  # stop flags agreed with the last step's all-reduce
        self.rollbacks = 0

    # ----------------------------------------------------------------------------------------
    # Setup
    # ----------------------------------------------------------------------------------------
    def setup(self) -> None:
        import warnings

        # Megatron start-up notices that say nothing about this run (no apex on CPU, a deprecated
        # default it sets itself).
        warnings.filterwarnings("ignore", message="Apex is not installed")
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        self.setup_parallel()
        self.setup_run_dir()
        self.setup_data()
        self.setup_model()
        self.setup_optimizer()
        self.setup_checkpointing()
        self.setup_datasets()
        self.write_config()
        self.setup_logging()

    def setup_parallel(self) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from models.parallel import initialize_parallel
        from models.zoo import ZooError, load_preset
        from training.config import validate_runtime
        from training.reliability import exit_with_launcher

        cfg = self.cfg
        exit_with_launcher()  # under torchrun: SIGTERM (save, exit) when the launcher dies
        self.cuda = torch.cuda.is_available() and cfg.run.device != "cpu"
        if not self.cuda and cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        try:
            self.preset = load_preset(cfg.model.preset, backbone_overrides=cfg.model.backbone_overrides(),
                                      hc_overrides=cfg.model.hc_overrides())
        except ZooError as e:
            raise ConfigError(f"config key model.preset: {e}") from None
        p = cfg.parallel
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.dp = validate_runtime(cfg, world, self.preset, cuda=torch.cuda.is_available())
        initialize_parallel(tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, etp=p.etp, seed=cfg.run.seed,
                            timeout_minutes=cfg.run.dist_timeout_minutes)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.is_main = self.rank == 0
        self.dp_rank = ps.get_data_parallel_rank()
        self.first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.num_micro = cfg.batch.global_batch_size // (cfg.batch.micro_batch_size * self.dp)
        self.seq = cfg.batch.seq_length or self.preset.seq_length
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.log = _p if self.is_main else (lambda *_a, **_k: None)
        if self.preset.hc.enabled:
            from xhc.kernels import resolve_backend

            self.log(f"[xhc] HC kernels: {self.preset.hc.kernels} -> {resolve_backend(self.preset.hc, self.device)}"
                     + (" (fixed rule: triton on CUDA, compile elsewhere)" if self.preset.hc.kernels == "auto" else ""))
        if self.preset.hc.enabled and self.preset.hc.kernels == "liger":
            from xhc.kernels import liger

            where = ("Liger-Kernel's fused op" if liger.runnable(self.device) else
                     "the compiled ops (same maths; Liger's Triton kernels need CUDA or TRITON_INTERPRET=1)")
            self.log(f"[xhc] model.hc_kernels: liger: mHC coefficients by {where}")

    def setup_run_dir(self) -> None:
        cfg = self.cfg
        name = cfg.run.name or cfg.model.preset.replace(":", "-").replace("/", "-")
        run_dir = cfg.run.dir
        if not run_dir:
            run_dir = os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir = os.path.abspath(self._from_rank0(run_dir))  # one timestamp for every rank and node
        self.run_dir = run_dir
        self.paths["run_dir"] = run_dir
        self.paths["checkpoints"] = os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))
        error = None
        if self.is_main:  # pre-flight: writable, not in use (the others wait for the verdict)
            from training.reliability import RunLock, check_writable

            created = [d for d in (run_dir, self.paths["checkpoints"]) if not os.path.exists(d)]
            self.created_dirs = created
            try:
                check_writable(run_dir, "run.dir")
                lock = RunLock(run_dir, log=self.log)
                lock.acquire()
                self.lock = lock
                check_writable(self.paths["checkpoints"], "checkpoint.dir")
            except ConfigError as e:
                error = str(e)
            if error:  # leave the disk as it was
                if self.lock is not None:
                    self.lock.release()
                for d in reversed(created):
                    with contextlib.suppress(OSError):
                        os.rmdir(d)
        error = self._from_rank0(error)
        if error:
            raise ConfigError(error)
        self.paths["config"] = os.path.join(run_dir, "config.yaml")
        self.precheck_resume()

    def precheck_resume(self) -> None:
        """Compare the checkpoint a resume would load with this run's preset and layout before any
        data or model is built (the full check, with the HC config and vocabulary, runs before loading)."""
        import json

        from training.checkpoint import MANIFEST, Checkpointer, check_compatible
        from training.config import config_to_dict

        ck = self.cfg.checkpoint
        path = Checkpointer(self.paths["checkpoints"], log=self.log).resolve(ck.load)
        if path is None:
            return
        try:
            with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
                body = json.load(f)["body"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # missing or corrupt: the verification reports (or falls back) later
        check_compatible(path, body, {"preset": self.cfg.model.preset, "world_size": self.world,
                                      "parallel": config_to_dict(self.cfg.parallel)},
                         load_optimizer=ck.load_optimizer, load_rng=ck.load_rng, sharded_optimizer=self.cuda)

    def write_config(self) -> None:
        """``<run.dir>/config.yaml``, once the set-up has succeeded (a refused start changes nothing)."""
        if self.is_main:
            from training.config import config_to_dict
            import yaml

            tmp = self.paths["config"] + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                yaml.safe_dump(config_to_dict(self.cfg), f, sort_keys=False)
            os.replace(tmp, self.paths["config"])

    def setup_data(self) -> None:
        from training.config import pad_vocab_size
        from training.data import NullTokenizer, Tokenizer, prepare_default_data
        from training.data.default import default_paths
        from training.data.gpt import check_indexed_pair

        cfg, d, t = self.cfg, self.cfg.data, self.cfg.tokenizer
        t0 = time.perf_counter()
        prefixes, per_split = d.prefixes, d.per_split
        tok_path = t.path
        if cfg.uses_default_data:
            paths = default_paths(d.default_dir)
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one builder per node (the steps are atomic)
                kw = {} if d.default_target_mb is None else {"target_mb": d.default_target_mb}
                info = prepare_default_data(d.default_dir, vocab_size=t.vocab_size, seed=cfg.run.seed,
                                            progress=self.is_main, log=self.log if self.is_main else None, **kw)
                paths = info
            self._barrier()
            prefixes = [paths["data_prefix"]]
            self._default_prefix = paths["data_prefix"]
            tok_path = tok_path or paths["tokenizer"]
            self.paths["corpus"] = paths["corpus"]
        if not d.mock:  # pre-flight on every rank: each .idx against its .bin (one-line DataError)
            for prefix in prefixes or [p for v in (per_split or {}).values() for p in (v or [])]:
                check_indexed_pair(prefix)
        if t.type == "none" or (d.mock and not tok_path):
            self.tokenizer = NullTokenizer(t.vocab_size)
        else:
            self.tokenizer = Tokenizer.from_file(tok_path)
        self.paths["tokenizer"] = tok_path if t.type != "none" and tok_path else None
        self.paths["data"] = ", ".join(prefixes) if prefixes else ("mock" if d.mock else str(per_split))
        self.vocab_size = pad_vocab_size(self.tokenizer.vocab_size, t.make_vocab_size_divisible_by, cfg.parallel.tp)
        if t.padded_vocab_size is not None:
            if t.padded_vocab_size < self.tokenizer.vocab_size:
                raise ConfigError(f"config key tokenizer.padded_vocab_size: {t.padded_vocab_size} is smaller than the "
                                  f"tokenizer's {self.tokenizer.vocab_size} ids")
            self.vocab_size = t.padded_vocab_size
        self.data_seconds = time.perf_counter() - t0

    def setup_datasets(self) -> None:
        """Megatron's datasets (index caches under data.cache_dir), after the checkpoint checks."""
        from training.data import DataConfig, build_datasets

        cfg, d = self.cfg, self.cfg.data
        t0 = time.perf_counter()
        prefixes, per_split = d.prefixes, d.per_split
        if cfg.uses_default_data:
            prefixes = [self._default_prefix]
        dcfg = DataConfig(prefixes=prefixes, weights=d.weights, split=d.split, per_split=per_split, mock=d.mock,
                          cache_dir=d.cache_dir or os.path.join(self.run_dir, "data_cache"),
                          reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
                          eod_mask_loss=d.eod_mask_loss, create_attention_mask=d.reset_attention_mask)
        gbs = cfg.batch.global_batch_size
        n_train = cfg.run.train_steps * gbs
        n_valid = max(cfg.run.eval_iters, 1) * gbs
        # Megatron builds the index caches on rank 0 first, then the others read them.
        if self.is_main:
            self.train_ds, self.valid_ds, _ = build_datasets(dcfg, self.tokenizer, self.seq, cfg.run.seed,
                                                             (n_train, n_valid, None))
        self._barrier()
        if not self.is_main:
            self.train_ds, self.valid_ds, _ = build_datasets(dcfg, self.tokenizer, self.seq, cfg.run.seed,
                                                             (n_train, n_valid, None))
        self.data_seconds += time.perf_counter() - t0

    def setup_model(self) -> None:
        import torch
        from megatron.core import parallel_state as ps

        from models.pipeline import install_hc_p2p_shapes, p2p_shapes_installed, uninstall_hc_p2p_shapes
        from models.zoo import ZooError, build_model, build_transformer_config
        from training.optim import hc_defaults_for_optimizer

        cfg, p, m = self.cfg, self.cfg.parallel, self.cfg.model
        explicit = set(self._preset_variant_keys()) | set(m.hc)
        self.hc = hc_defaults_for_optimizer(self.preset.hc, cfg.optimizer.name, explicit)
        self.preset.hc = self.hc
        bf16 = self.cuda and cfg.run.precision in ("auto", "bf16")
        dtype = torch.bfloat16 if bf16 else torch.float32
        parallel = dict(tensor_model_parallel_size=p.tp, sequence_parallel=p.sp, expert_model_parallel_size=p.ep,
                        pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp)
        if p.etp is not None:
            parallel["expert_tensor_parallel_size"] = p.etp
        if p.vpp:
            parallel["virtual_pipeline_model_parallel_size"] = p.vpp
        extra: Dict[str, Any] = dict(bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype)
        if self.cuda:  # Megatron's schedules free each sent [s, b, N·C] stage output (16x an edge at N=16)
            extra["deallocate_pipeline_outputs"] = True
        if m.recompute == "selective":
            extra.update(recompute_granularity="selective")
        elif m.recompute == "full":
            extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if p.vpp and self.hc.enabled and self.hc.n > 1:
            extra["variable_seq_lengths"] = True  # the interleaved schedule sizes p2p buffers inline
        try:
            self.tf_config = build_transformer_config(self.preset, parallel=parallel, cpu=not self.cuda, **extra)
        except ZooError as e:
            raise ConfigError(f"config key model.backbone: {e}") from None
        te = m.use_transformer_engine if self.cuda else False
        chunks = []
        vp = p.vpp or 1
        if vp > 1 and hasattr(ps, "set_virtual_pipeline_model_parallel_world_size"):
            ps.set_virtual_pipeline_model_parallel_world_size(vp)  # models.parallel does not pass vpp to Megatron
        for i in range(vp):
            if vp > 1:
                ps.set_virtual_pipeline_model_parallel_rank(i)
            # chunk i of pipeline rank r holds virtual stage i·pp + r (Megatron's interleaving)
            pre = self.first_stage and i == 0
            post = self.last_stage and i == vp - 1
            chunk = build_model(self.preset, self.tf_config, pre_process=pre, post_process=post,
                                vp_stage=i if vp > 1 else None, use_transformer_engine=te,
                                vocab_size=self.vocab_size, seq_length=self.seq)
            if vp > 1:
                chunk.vp_stage = i
            chunks.append(chunk)
        if vp > 1:
            ps.set_virtual_pipeline_model_parallel_rank(0)
        from megatron.core import tensor_parallel

        for c in chunks:
            for prm in c.parameters():
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(prm)
        self.num_params_local = sum(prm.numel() for c in chunks for prm in c.parameters())
        self.num_hc_params_local = sum(prm.numel() for c in chunks for prm in c.parameters()
                                       if getattr(prm, "is_hyper_connection", False))
        if self.cfg.model.compile_hc:
            from models.hc_layer import compile_hc_modules

            n = sum(compile_hc_modules(c) for c in chunks)
            self.log(f"[xhc] model.compile_hc: {n} HC modules under torch.compile (inductor; the first "
                     f"steps include compilation)")
        if self.cuda:
            chunks = self._wrap_gpu(chunks, bf16)
        self.chunks = chunks
        if p.pp > 1 and self.hc.enabled and self.hc.n > 1:
            if p2p_shapes_installed():
                uninstall_hc_p2p_shapes()
            install_hc_p2p_shapes(self.hc.n, self.tf_config)  # every p2p edge carries [s, b, N·C]
        from training.hc_health import HCHealth

        self.health = HCHealth([self._unwrap(c) for c in chunks], self.hc)

    def _wrap_gpu(self, chunks, bf16: bool):
        """GPU: move to the device, bf16 (HC parameters stay fp32), Megatron DDP."""
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        for c in chunks:
            c.cuda(torch.cuda.current_device())
        if bf16:
            chunks = [float16_module_keep_hc_fp32(self.tf_config, c) for c in chunks]
        o, p = self.cfg.optimizer, self.cfg.parallel
        use_dist = o.use_distributed_optimizer
        if use_dist is None:
            use_dist = o.name == "adamw"
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather and use_dist, use_distributed_optimizer=use_dist,
            # interleaved schedule: every stage launches its param all-gathers from param_sync_func
            align_param_gather=p.overlap_param_gather and use_dist and len(chunks) > 1,
            bucket_size=None if not p.overlap_grad_reduce else max(40_000_000, 1_000_000 * self.dp))
        return [DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=c,
                                        disable_bucketing=i > 0) for i, c in enumerate(chunks)]

    def setup_optimizer(self) -> None:
        from training.optim import build_optimizer
        from training.schedule import build_scheduler

        self.optimizer = build_optimizer(self.chunks, self.cfg.optimizer, use_megatron=self.cuda)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.schedule, self.cfg.optimizer)
        if self.cuda:
            from megatron.core.distributed import finalize_model_grads

            c = self.tf_config
            c.finalize_model_grads_func = finalize_model_grads
            mopt = getattr(self.optimizer, "megatron_optimizer", None)
            c.grad_scale_func = mopt.scale_loss if mopt is not None else None
            c.no_sync_func = [m.no_sync for m in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
            if len(self.chunks) > 1 and self.chunks[0].ddp_config.align_param_gather:
                c.param_sync_func = [m.start_param_sync for m in self.chunks]

    def setup_checkpointing(self) -> None:
        from training.checkpoint import Checkpointer

        ck = self.cfg.checkpoint
        self.ckpt = Checkpointer(self.paths["checkpoints"], keep_last=ck.keep_last, checksum=ck.checksum,
                                 log=self.log)
        self.step = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.skipped_samples = 0
        self.resumed_from = None
        self.check_checkpoint_space()
        path, body = self.ckpt.select(ck.load)
        if path is not None:
            self.load_checkpoint(path, body)
        self.last_saved_step = self.step if self.resumed_from else None
        self.last_good_checkpoint = self.resumed_from

    def check_checkpoint_space(self) -> None:
        """Pre-flight: free space under checkpoint.dir for one checkpoint (estimate: 4 bytes per parameter
        for the weights + 8 for the optimizer moments, summed over ranks, + 10 %)."""
        from training.reliability import check_free_space

        n = self._all_reduce([float(self.num_params_local)])[0]
        needed = 1.1 * 12 * n
        self.checkpoint_bytes_estimate = needed
        error = None
        if self.is_main and (self.cfg.checkpoint.interval or self.cfg.checkpoint.save_final
                             or self.cfg.checkpoint.save_on_signal):
            try:
                check_free_space(self.paths["checkpoints"], needed, "checkpoint.dir")
            except ConfigError as e:
                error = str(e)
        error = self._from_rank0(error)
        if error:
            raise ConfigError(error)

    def setup_logging(self) -> None:
        from training.metrics import MetricsLogger, model_flops_per_token, peak_tflops

        cfg, lg = self.cfg, self.cfg.logging
        tb_dir = os.path.join(self.run_dir, "tensorboard") if lg.tensorboard else None
        wandb = None
        if lg.wandb:
            from training.config import config_to_dict

            wandb = {"project": lg.wandb_project, "entity": lg.wandb_entity,
                     "name": os.path.basename(self.run_dir), "config": config_to_dict(cfg), "dir": self.run_dir}
        self.metrics = MetricsLogger(self.run_dir, enabled=self.is_main, jsonl=lg.jsonl, tensorboard_dir=tb_dir,
                                     wandb=wandb, print_fn=_p)
        self.paths["metrics"] = self.metrics.jsonl_path
        self.paths["tensorboard"] = self.metrics.tensorboard_dir
        if self.resumed_from:  # consumers drop the records of steps after this one written before it
            self.metrics.write("resume", self.step, {"checkpoint": self.resumed_from,
                                                     "consumed_samples": self.consumed_samples})
        self.flops = model_flops_per_token(self.preset, self.seq, self.vocab_size, lg.flops_convention, self.hc)
        self.peak, self.peak_note = peak_tflops(lg.peak_tflops, self.cuda)
        self.tokens_per_step = cfg.batch.global_batch_size * self.seq
        self.print_setup()
        for note in self.metrics.notes:
            self.log(f"[xhc] note: {note}")

    # ----------------------------------------------------------------------------------------
    # Helpers
    # ----------------------------------------------------------------------------------------
    @staticmethod
    def _unwrap(chunk):
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module
        return chunk

    def _preset_variant_keys(self) -> List[str]:
        import yaml

        try:
            with open(self.preset.source, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
            return list((data.get("variants") or {}).get(self.preset.name.rsplit(":", 1)[1]) or {})
        except (OSError, TypeError, AttributeError):
            return []

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def _from_rank0(self, obj):
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _all_reduce(self, values: List[float], op: str = "sum", group=None) -> List[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return [float(x) for x in t.cpu()]

    def data_iterator(self, dataset, start_sample: int, cycle: bool):
        from training.data import make_data_iterator

        return make_data_iterator(dataset, self.cfg.batch.micro_batch_size, start_sample, self.dp_rank, self.dp, cycle)

    def _to_device(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        if not self.cuda:
            return batch
        return {k: v.cuda(non_blocking=True) if hasattr(v, "cuda") else v for k, v in batch.items()}

    def _cp_slice(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        if self.cfg.parallel.cp == 1:
            return batch
        from models.parallel import batch_on_this_cp_rank

        keys = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
        return batch_on_this_cp_rank({k: batch.get(k) for k in keys})

    def _sequence_context(self, batch):
        """Explicit document layout for the xHC temporal conv, when position ids carry it (§3.6, §8 #22)."""
        d, hc = self.cfg.data, self.hc
        if not hc.is_xhc or self.cfg.parallel.cp > 1 or batch.get("position_ids") is None:
            return contextlib.nullcontext()
        reset = hc.conv_doc_reset
        if reset == "never" or not d.reset_position_ids:
            return contextlib.nullcontext()
        if reset == "auto" and not d.reset_attention_mask:
            return contextlib.nullcontext()  # attention does not reset: neither does the conv
        from megatron.core import parallel_state as ps

        from models.hc_layer import sequence_context
        from xhc.temporal import SequenceContext, pos_in_doc_from_position_ids

        sp = self.cfg.parallel.tp if self.cfg.parallel.sp else 1
        rank = ps.get_tensor_model_parallel_rank() if sp > 1 else 0
        group = ps.get_tensor_model_parallel_group() if sp > 1 else None
        pos = pos_in_doc_from_position_ids(batch["position_ids"], rank, sp)
        return sequence_context(SequenceContext(pos_in_doc=pos, group=group))

    def _model_forward(self, model, batch):
        """Per-token loss ``[b, s]`` on the last stage, the hidden state elsewhere."""
        with self._sequence_context(batch):
            return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                         labels=batch["labels"] if self.last_stage else None)

    @staticmethod
    def _masked_sum(losses, loss_mask):
        mask = loss_mask.reshape(-1).float()
        return (losses.float().reshape(-1) * mask).sum(), mask.sum()

    # ----------------------------------------------------------------------------------------
    # Forward / backward
    # ----------------------------------------------------------------------------------------
    def forward_backward(self, iterators, forward_only: bool = False, num_micro: Optional[int] = None):
        """One global batch on this rank: returns (Σ loss·mask, Σ mask) of its last-stage micro-batches."""
        num_micro = num_micro or self.num_micro
        if self.cuda:
            import torch

            # Evaluation without autograd, as on CPU: Megatron's router counts tokens per expert
            # (the next expert-bias update) whenever gradients are enabled.
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                return self._forward_backward_megatron(iterators, forward_only, num_micro)
        return self._forward_backward_cpu(iterators[0], forward_only, num_micro)

    def _forward_backward_cpu(self, it, forward_only: bool, num_micro: int):
        import torch

        model = self.chunks[0]
        total, count = 0.0, 0.0
        batches = [self._cp_slice(next(it)) for _ in range(num_micro)]
        if self.cfg.parallel.pp > 1:
            from models.pipeline import gpipe_forward_backward

            stats = []

            def step_fn(i, m):
                out = self._model_forward(m, batches[i])
                if not self.last_stage:
                    return out
                s, n = self._masked_sum(out, batches[i]["loss_mask"])
                stats.append((float(s), float(n)))
                return s / n.clamp_min(1.0)

            ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
            with ctx:
                gpipe_forward_backward(model, step_fn, num_micro, seq_length=self.seq,
                                       micro_batch_size=self.cfg.batch.micro_batch_size, config=self.tf_config,
                                       forward_only=forward_only)
            for s, n in stats:
                total, count = total + s, count + n
            return total, count
        for batch in batches:
            if forward_only:
                with torch.no_grad():
                    s, n = self._masked_sum(self._model_forward(model, batch), batch["loss_mask"])
            else:
                s, n = self._masked_sum(self._model_forward(model, batch), batch["loss_mask"])
                (s / n.clamp_min(1.0) / num_micro).backward()
            total, count = total + float(s.detach()), count + float(n)
        return total, count

    def _forward_backward_megatron(self, iterators, forward_only: bool, num_micro: int):
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def loss_func(loss_mask, output_tensor):
            s, n = self._masked_sum(output_tensor, loss_mask)
            return s, n.to(torch.int), {"lm loss": torch.stack([s.detach(), n.detach()])}

        def forward_step(data_iterator, model):
            batch = self._cp_slice(self._to_device(next(data_iterator)))
            out = self._model_forward(model, batch)
            return out, (lambda t, _m=batch["loss_mask"]: loss_func(_m, t))

        fb = get_forward_backward_func()
        its = iterators if len(self.chunks) > 1 else iterators[0]
        model = self.chunks if len(self.chunks) > 1 else self.chunks[0]
        results = fb(forward_step_func=forward_step, data_iterator=its, model=model, num_microbatches=num_micro,
                     seq_length=self.seq, micro_batch_size=self.cfg.batch.micro_batch_size,
                     decoder_seq_length=self.seq, forward_only=forward_only)
        if not results:
            return 0.0, 0.0
        total, count = torch.stack([r["lm loss"].double() for r in results]).sum(0).tolist()  # one host sync
        return total, count

    def _global_loss(self, total: float, count: float) -> float:
        """Token-weighted mean over all ranks' last-stage micro-batches (nan if any is non-finite)."""
        s, n = self._all_reduce([total, count])
        return s / n if n > 0 else float("nan")

    # ----------------------------------------------------------------------------------------
    # Training step, evaluation
    # ----------------------------------------------------------------------------------------
    def train_step(self, iterators) -> dict:
        from models.parallel import finalize_grads

        t0 = time.perf_counter()
        if self.cuda:
            for c in self.chunks:
                c.zero_grad_buffer()
        self.optimizer.zero_grad()
        interval = self.cfg.logging.hc_health_every
        health_now = bool(interval) and (self.step + 1) % interval == 0 and self.health.num_wrapped > 0
        with self.health.recording() if health_now else contextlib.nullcontext():
            total, count = self.forward_backward(iterators)
        if not self.cuda:
            finalize_grads(self.chunks, self.tf_config)  # DP / SP all-reduce, expert-bias update
        s, n, *flags = self._all_reduce([total, count, *self._local_stop_flags()])
        self._agreed_flags = flags
        loss = s / n if n > 0 else float("nan")
        if not math.isfinite(loss):
            self.check_parameters(f"the loss of step {self.step + 1} is {loss}",
                                  self.consumed_samples + self.cfg.batch.global_batch_size)
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
        tokens_per_s = self.tokens_per_step / dt
        rec = {"loss": loss, "lr": lr, "grad_norm": gnorm, "step_time_s": dt, "tokens_per_s": tokens_per_s,
               "mfu": tokens_per_s * self.flops["total"] / (self.peak * 1e12 * self.world),
               "consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_samples * self.seq,
               "skipped_steps": self.skipped_steps}
        if health_now:
            rec["hc"] = self.health.summary()
        if not updated:
            self.skipped_steps += 1
            rec["skipped_steps"] = self.skipped_steps
            rec["skipped"] = True
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            self.metrics.event(self.step, f"[xhc] step {self.step}: non-finite {what} (loss {loss}, grad norm "
                               f"{gnorm}): update skipped ({self.skipped_steps} skipped so far, limit "
                               f"{self.cfg.run.max_skipped_steps})", skipped_steps=self.skipped_steps)
        return rec

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
    def _trainer_state(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "skipped_steps": self.skipped_steps,
                "skipped_samples": self.skipped_samples}

    def save_checkpoint(self, reason: str) -> str:
        from training.checkpoint import build_state

        t0 = time.perf_counter()
        sharding = self.cfg.checkpoint.optimizer_sharding
        info = {"world_size": self.world, "reason": reason, "consumed_samples": self.consumed_samples,
                "optimizer_sharding": sharding, **self._compat_info()}
        with params_synced(self.chunks):  # overlap_param_gather: every shard at this step's values
            self.check_parameters(f"checkpoint at step {self.step} not saved")  # all ranks agree
            state = build_state(self.chunks, self.optimizer, self.scheduler, self._trainer_state(),
                                optimizer_sharding=sharding)
            path = self.ckpt.save(self.step, state, info)
        self.last_saved_step = self.step
        self.last_good_checkpoint = path
        self.metrics.event(self.step, f"[xhc] checkpoint step {self.step} ({reason}) -> {path} "
                           f"in {time.perf_counter() - t0:.1f}s", checkpoint=path)
        return path

    def _compat_info(self) -> dict:
        """What a checkpoint must share with the run that loads it (see checkpoint.check_compatible)."""
        import dataclasses

        from training.config import config_to_dict

        import json

        hc = json.loads(json.dumps(dataclasses.asdict(self.hc), default=str))  # as the manifest stores it
        return {"preset": self.cfg.model.preset, "hc": hc, "vocab_size": self.vocab_size,
                "world_size": self.world, "parallel": config_to_dict(self.cfg.parallel)}

    def load_checkpoint(self, path: str, body: Optional[dict] = None) -> None:
        from training.checkpoint import build_state, check_compatible, is_megatron_optimizer, restore_rng_state

        ck = self.cfg.checkpoint
        if body is None:
            body = self.ckpt.verify(path)
        check_compatible(path, body, self._compat_info(), load_optimizer=ck.load_optimizer, load_rng=ck.load_rng,
                         sharded_optimizer=is_megatron_optimizer(self.optimizer))
        template = build_state(self.chunks, self.optimizer if ck.load_optimizer else None,
                               self.scheduler if ck.load_optimizer else None, self._trainer_state(),
                               rng=ck.load_rng, is_loading=True,
                               optimizer_sharding=body.get("optimizer_sharding", ck.optimizer_sharding))
        loaded = self.ckpt.load(path, template, body)
        keys = ["model"] if len(self.chunks) == 1 else [f"model{i}" for i in range(len(self.chunks))]
        for key, chunk in zip(keys, self.chunks):
            missing, unexpected = self._unwrap(chunk).load_state_dict(loaded[key], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                from training.checkpoint import CheckpointError

                raise CheckpointError(f"checkpoint {path}: model keys do not match this model (missing "
                                      f"{missing[:3]}, unexpected {list(unexpected)[:3]}): is it the same preset?")
        if not ck.load_optimizer:
            self.optimizer.reload_model_params()  # fp32 main copies := the loaded weights
        if ck.load_optimizer:
            if "optimizer" in loaded:
                self.optimizer.load_state_dict(loaded["optimizer"])
            else:
                self.optimizer.load_state_dict(loaded["optimizer_rank"])
            self.scheduler.load_state_dict(loaded["scheduler"])
        t = loaded["trainer"]
        self.step, self.consumed_samples, self.skipped_steps = (int(t["step"]), int(t["consumed_samples"]),
                                                                int(t["skipped_steps"]))
        self.skipped_samples = int(t.get("skipped_samples", 0))
        if ck.load_rng:
            restore_rng_state(loaded["rng"])
        self.resumed_from = path
        self.log(f"[xhc] resumed from {path}: step {self.step}, {self.consumed_samples} samples consumed")

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

    def _local_stop_flags(self) -> List[float]:
        r = self.cfg.run
        timed = r.exit_after_minutes is not None and (time.time() - self.t_start) / 60 >= r.exit_after_minutes
        return [1.0 if self.stop_signal else 0.0, 1.0 if timed else 0.0]

    def should_stop(self) -> Optional[str]:
        """A reason to save and stop now, agreed by all ranks.

        The flags ride on the step's loss all-reduce (no extra collective per step); after a save, an
        evaluation or before the first step they are agreed with one small all-reduce of their own.
        """
        r = self.cfg.run
        flags = self._agreed_flags
        if flags is None:
            flags = self._all_reduce(self._local_stop_flags())
        self._agreed_flags = None
        if flags[0]:
            return f"signal {self.stop_signal or 'on another rank'}"
        if flags[1]:
            return f"run.exit_after_minutes={r.exit_after_minutes}"
        if r.exit_at_step is not None and self.step >= r.exit_at_step and self.step < r.train_steps:
            return f"run.exit_at_step={r.exit_at_step}"
        return None

    # ----------------------------------------------------------------------------------------
    # The loop
    # ----------------------------------------------------------------------------------------
    def train(self) -> int:
        cfg = self.cfg
        r, ck, lg = cfg.run, cfg.checkpoint, cfg.logging
        self.install_signal_handlers()
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
                    self.stopped_early = stop_reason
                    return 0
                self.stopped_early = None
                if not self.evals or self.evals[-1]["step"] != self.step:
                    self.run_eval()
                if ck.save_final and self.last_saved_step != self.step:
                    self.save_checkpoint("final")
                return 0
            except NonFiniteState as e:
                self.roll_back(e)  # or TrainingAborted

    def _train_loop(self, t_loop: float) -> Optional[str]:
        """Steps until ``run.train_steps`` (None) or a stop reason; raises :class:`NonFiniteState`."""
        r, ck, lg = self.cfg.run, self.cfg.checkpoint, self.cfg.logging
        its = [self.data_iterator(self.train_ds, self.consumed_samples, cycle=self.skipped_samples > 0)
               for _ in self.chunks]
        while self.step < r.train_steps:
            stop_reason = self.should_stop()
            if stop_reason:
                return stop_reason
            rec = self.train_step(its)
            self.steps_this_run += 1
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
                self._agreed_flags = None  # a signal during it is seen before the next step
            if ck.interval and self.step % ck.interval == 0 and self.step < r.train_steps:
                self.save_checkpoint("interval")
                self._agreed_flags = None
        return None

    # ----------------------------------------------------------------------------------------
    # Non-finite state: never saved; abort, or roll back to the last good checkpoint
    # ----------------------------------------------------------------------------------------
    def _first_nonfinite_parameter(self) -> Optional[str]:
        import torch

        named = [(f"chunk {i}: {n}" if len(self.chunks) > 1 else n, p)
                 for i, c in enumerate(self.chunks) for n, p in self._unwrap(c).named_parameters()]
        if not named:
            return None
        finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named])
        if bool(finite.all()):  # one device sync
            return None
        return named[int((~finite).nonzero()[0])][0]

    def check_parameters(self, context: str, window_end: Optional[int] = None) -> None:
        """Raise :class:`NonFiniteState` on every rank when any rank holds a non-finite parameter."""
        bad = self._first_nonfinite_parameter()
        if self._all_reduce([1.0 if bad else 0.0])[0]:
            where = bad if bad else "on another rank"
            raise NonFiniteState(f"{context}: parameters are non-finite ({where})",
                                 self.consumed_samples if window_end is None else window_end)

    def roll_back(self, err: NonFiniteState) -> None:
        """``run.on_nonfinite=rollback``: reload the last good checkpoint, skip the data since it; else abort."""
        r = self.cfg.run
        good = self.last_good_checkpoint
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
        bad_step, window_end = self.step, max(err.window_end, self.consumed_samples)
        path, body = self.ckpt.select(good)
        self.load_checkpoint(path, body)
        skip = window_end - self.consumed_samples
        self.skipped_samples += skip
        self.consumed_samples = window_end
        self.rollbacks += 1
        self._agreed_flags = None
        self.metrics.write("resume", self.step, {"checkpoint": path, "consumed_samples": self.consumed_samples,
                                                 "rollback": True})
        self.metrics.event(self.step, f"[xhc] rollback {self.rollbacks}/{r.max_rollbacks}: {err} at step {bad_step}; "
                           f"reloaded {path} (step {self.step}) and skipped {skip} samples of data",
                           rollback=self.rollbacks, skipped_samples=self.skipped_samples)

    def run_eval(self) -> Optional[float]:
        t0 = time.perf_counter()
        with params_synced(self.chunks):  # overlap_param_gather: evaluate the weights of this step
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

    # ----------------------------------------------------------------------------------------
    # Reporting
    # ----------------------------------------------------------------------------------------
    def print_setup(self) -> None:
        cfg, p, b = self.cfg, self.cfg.parallel, self.cfg.batch
        hc = self.hc
        hc_desc = "vanilla residual" if not hc.enabled else (
            f"{hc.variant} N={hc.n}" + (f" k={hc.k} m={hc.m} GS={'on' if hc.gram_schmidt else 'off'}"
                                        if hc.is_xhc else ""))
        dev = (f"{self.world}x {self.device.type}" + (f" ({self._gpu_name()})" if self.cuda else "")
               + f", {'bf16' if self.tf_config.bf16 else 'fp32'}")
        self.log(f"[xhc] model      {cfg.model.preset}: {hc_desc}; {self.preset.num_layers} layers, "
                 f"C={self.preset.hidden_size}, vocab {self.vocab_size}, seq {self.seq}")
        self.log(f"[xhc] params     {self.num_params_local / 1e6:.3f}M on rank 0 (HC {self.num_hc_params_local / 1e3:.1f}k)")
        self.log(f"[xhc] parallel   {dev}: tp={p.tp}{'+sp' if p.sp else ''} pp={p.pp} ep={p.ep} cp={p.cp} dp={self.dp}")
        self.log(f"[xhc] batch      global {b.global_batch_size} = micro {b.micro_batch_size} x dp {self.dp} x "
                 f"accumulation {self.num_micro}; {self.tokens_per_step} tokens/step")
        self.log(f"[xhc] optimizer  {cfg.optimizer.name} lr {cfg.optimizer.lr:g}, {cfg.schedule.kind} schedule "
                 f"(warmup {cfg.schedule.warmup_steps}, {cfg.schedule.total_steps} steps), clip {cfg.optimizer.clip_grad:g}")
        for note in getattr(cfg, "notes", ()):
            self.log(f"[xhc] note       {note}")
        self.log(f"[xhc] data       {self.paths['data']} (train {len(self.train_ds)} samples"
                 f"{', valid %d' % len(self.valid_ds) if self.valid_ds is not None else ''}; ready in "
                 f"{self.data_seconds:.1f}s)")
        self.log(f"[xhc] flops      {self.flops['total'] / 1e6:.2f} MFLOP/token (backbone {self.flops['backbone'] / 1e6:.2f}, "
                 f"HC {self.flops['hc'] / 1e6:.3f}); MFU vs {self.peak:g} TFLOP/s/device ({self.peak_note})")
        self.log(f"[xhc] run dir    {self.run_dir}")

    def _gpu_name(self) -> str:
        import torch

        return torch.cuda.get_device_name()

    def finish(self) -> None:
        """Loss plot and the summary of where everything went (rank 0)."""
        from training.checkpoint import list_checkpoints
        from training.metrics import format_duration, plot_losses

        if self.metrics is None:
            return
        self.metrics.flush()
        plot = None
        if self.is_main and self.cfg.logging.plot and self.metrics.jsonl_path:
            plot = plot_losses(self.metrics.jsonl_path, os.path.join(self.run_dir, "loss.png"), self.cfg.model.preset)
        self.paths["plot"] = plot
        if not self.is_main:
            return
        self.write_status()
        losses = [h["loss"] for h in self.history if math.isfinite(h["loss"])]
        total = time.time() - self.t_start
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

    def write_status(self) -> None:
        """``<run.dir>/status.json``: where the run stands (tools/slurm_pretrain.sh requeues unfinished runs)."""
        import json

        from training.checkpoint import list_checkpoints

        found = list_checkpoints(self.paths["checkpoints"])
        status = {"step": self.step, "train_steps": self.cfg.run.train_steps,
                  "finished": self.step >= self.cfg.run.train_steps,
                  "stopped_early": getattr(self, "stopped_early", None),
                  "latest_checkpoint": found[-1][1] if found else None,
                  "last_train_loss": self.history[-1]["loss"] if self.history else None,
                  "last_valid_loss": self.evals[-1]["loss"] if self.evals else None}
        tmp = os.path.join(self.run_dir, "status.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(status, f, indent=1)
        os.replace(tmp, os.path.join(self.run_dir, "status.json"))

    def close(self, destroy_process_group: bool = True) -> None:
        """Close the loggers and tear down Megatron's parallel state (and the process group)."""
        from models.parallel import destroy_parallel
        from models.pipeline import uninstall_hc_p2p_shapes

        if self.metrics is not None:
            self.metrics.close()
        if self.lock is not None:
            self.lock.release()
        if self.failed:  # a refused start leaves no empty directories behind
            for d in reversed(self.created_dirs):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        uninstall_hc_p2p_shapes()
        destroy_parallel(destroy_process_group=destroy_process_group)


# ================================================================================================
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

        if not isinstance(e, (CheckpointError, DataError)):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
        trainer.failed = trainer.metrics is None
    finally:
        trainer.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
