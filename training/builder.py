"""The builder: a :class:`~training.config.PretrainConfig` becomes the run's state.

:class:`Builder` fills in the :class:`~training.pretrain.Trainer` (``run``), one part per method, in
the order :meth:`Trainer.setup <training.pretrain.Trainer.setup>` calls them::

    parallel      Megatron's parallel state, this rank's place in it, the step runner (chosen once)
    run_dir       run.dir, the lifecycle's pre-flight (writable, lock) and the resume pre-check
    data          the default data (built once per node), the tokenizer, the padded vocabulary
    model         the model chunks, wrapped by the step runner (GPU: bf16 + Megatron DDP)
    optimizer     optimizer and LR scheduler (hooked into the step runner)
    checkpointer  the checkpointer, the step counters, the free-space pre-flight
                  (then the Trainer's maybe_resume)
    datasets      Megatron's datasets (after the checkpoint checks)
    write_config  <run.dir>/config.yaml
    logging       the metrics logger, the FLOP count, the set-up banner

What ``run`` holds afterwards: ``cuda``, ``preset``, ``hc``, ``dp``, ``rank``, ``world``, ``is_main``,
``dp_rank``, ``first_stage``, ``last_stage``, ``num_micro``, ``seq``, ``device``, ``log``, ``runner``,
``run_dir``, ``paths``, ``tokenizer``, ``vocab_size``, ``tf_config``, ``chunks``, ``health``,
``optimizer``, ``scheduler``, ``ckpt``, the step counters, ``train_ds``, ``valid_ds``, ``metrics``,
``flops``, ``peak``, ``tokens_per_step``.  The Trainer provides ``cfg``, ``life``, ``paths`` and
``_all_reduce``.

Imports: ``models``, ``xhc`` and the ``training`` modules it assembles (never ``training.pretrain``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import yaml
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from models.hc_layer import compile_hc_modules
from models.parallel import initialize_parallel
from models.pipeline import install_hc_p2p_shapes, p2p_shapes_installed, uninstall_hc_p2p_shapes
from models.zoo import ZooError, build_model, build_transformer_config, load_preset
from training.checkpoint import MANIFEST, Checkpointer, check_compatible, remove_partial_saves
from training.config import ConfigError, config_to_dict, pad_vocab_size, validate_runtime
from training.data import DataConfig, NullTokenizer, Tokenizer, build_datasets, prepare_default_data
from training.data import default_paths
from training.data import check_indexed_pair
from training.run import HCHealth
from training.run import MetricsLogger, model_flops_per_token, peak_tflops
from training.optim import build_optimizer, hc_defaults_for_optimizer
from training.run import check_free_space, exit_with_launcher, human_mb
from training.run import write_run_record
from training.schedule import build_scheduler
from training.run import make_step_runner, unwrap
from xhc.kernels import backend_reason, liger_note

__all__ = ["Builder", "barrier", "from_rank0"]


def _p(msg: str = "") -> None:
    print(msg, flush=True)


def barrier() -> None:
    """All ranks meet (a no-op on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank (pickled; one process: ``obj``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Builder:
    """Builds the state of ``run`` (the Trainer) from ``run.cfg``; see the module docstring."""

    def __init__(self, run):
        self.run = run
        self.default_prefix = None  # the default data's prefix, between data() and datasets()

    def parallel(self) -> None:
        """Megatron's parallel state, this rank's place in it and the step runner (the engine, chosen once)."""
        run = self.run
        cfg = run.cfg
        exit_with_launcher()  # under torchrun: SIGTERM (save, exit) when the launcher dies
        run.cuda = torch.cuda.is_available() and cfg.run.device != "cpu"
        if not run.cuda and cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        try:
            run.preset = load_preset(cfg.model.preset, backbone_overrides=cfg.model.backbone_overrides(),
                                     hc_overrides=cfg.model.hc_overrides())
        except ZooError as e:
            raise ConfigError(f"config key model.preset: {e}") from None
        p = cfg.parallel
        world = int(os.environ.get("WORLD_SIZE", "1"))
        run.dp = validate_runtime(cfg, world, run.preset, cuda=torch.cuda.is_available())
        initialize_parallel(tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, etp=p.etp, seed=cfg.run.seed,
                            timeout_minutes=cfg.run.dist_timeout_minutes)
        run.rank = dist.get_rank()
        run.world = dist.get_world_size()
        run.is_main = run.rank == 0
        run.dp_rank = ps.get_data_parallel_rank()
        run.first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
        run.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        run.num_micro = cfg.batch.global_batch_size // (cfg.batch.micro_batch_size * run.dp)
        run.seq = cfg.batch.seq_length or run.preset.seq_length
        run.device = torch.device("cuda", torch.cuda.current_device()) if run.cuda else torch.device("cpu")
        run.log = _p if run.is_main else (lambda *_a, **_k: None)

        run.runner = make_step_runner(cfg, run.cuda, dp=run.dp, seq=run.seq, last_stage=run.last_stage,
                                      num_micro=run.num_micro)  # the engine, chosen once
        if run.preset.hc.enabled:
            run.log(f"[xhc] {backend_reason(run.preset.hc, run.device)}")
        note = liger_note(run.preset.hc.kernels, run.device) if run.preset.hc.enabled else None
        if note:
            run.log(f"[xhc] {note}")

    def run_dir(self) -> None:
        """``run.dir`` (one timestamp for every rank), the lifecycle's pre-flight and lock."""
        run = self.run
        cfg = run.cfg
        name = cfg.run.name or cfg.model.preset.replace(":", "-").replace("/", "-")
        run_dir = cfg.run.dir
        if not run_dir:
            run_dir = os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir = os.path.abspath(from_rank0(run_dir))  # one timestamp for every rank and node
        run.run_dir = run_dir
        run.paths["run_dir"] = run_dir
        run.paths["checkpoints"] = os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))
        error = None
        if run.is_main:  # pre-flight: writable, not in use (the others wait for the verdict)
            error = run.life.claim_run_dir(run_dir, run.paths["checkpoints"], run.log)
        error = from_rank0(error)
        if error:
            raise ConfigError(error)
        run.paths["config"] = os.path.join(run_dir, "config.yaml")
        self.precheck_resume()

    def precheck_resume(self) -> None:
        """Compare the checkpoint a resume would load with this run's preset and layout before any
        data or model is built (the full check, with the HC config and vocabulary, runs before loading)."""
        run = self.run
        ck = run.cfg.checkpoint
        path = Checkpointer(run.paths["checkpoints"], log=run.log).resolve(ck.load)
        if path is None:
            return
        try:
            with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
                body = json.load(f)["body"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # missing or corrupt: the verification reports (or falls back) later
        check_compatible(path, body, {"preset": run.cfg.model.preset, "world_size": run.world,
                                      "parallel": config_to_dict(run.cfg.parallel),
                                      "global_batch_size": run.cfg.batch.global_batch_size},
                         load_optimizer=ck.load_optimizer, sharded_optimizer=run.runner.uses_megatron,
                         reshard=ck.reshard)

    def data(self) -> None:
        """The default data (built once per node), the .idx/.bin pre-flight, the tokenizer and vocabulary."""
        run = self.run
        cfg, d, t = run.cfg, run.cfg.data, run.cfg.tokenizer
        t0 = time.perf_counter()
        prefixes, per_split = d.prefixes, d.per_split
        tok_path = t.path
        if cfg.uses_default_data:
            paths = default_paths(d.default_dir)
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one builder per node (the steps are atomic)
                kw = {} if d.default_target_mb is None else {"target_mb": d.default_target_mb}
                info = prepare_default_data(d.default_dir, vocab_size=t.vocab_size, seed=d.seed,
                                            progress=run.is_main, log=run.log if run.is_main else None, **kw)
                paths = info
            barrier()
            prefixes = [paths["data_prefix"]]
            self.default_prefix = paths["data_prefix"]
            tok_path = tok_path or paths["tokenizer"]
            run.paths["corpus"] = paths["corpus"]
        if not d.mock:  # pre-flight on every rank: each .idx against its .bin (one-line DataError)
            for prefix in prefixes or [p for v in (per_split or {}).values() for p in (v or [])]:
                check_indexed_pair(prefix)
        if t.type == "none" or (d.mock and not tok_path):
            run.tokenizer = NullTokenizer(t.vocab_size)
        else:
            run.tokenizer = Tokenizer.from_file(tok_path)
        run.paths["tokenizer"] = tok_path if t.type != "none" and tok_path else None
        run.paths["data"] = ", ".join(prefixes) if prefixes else ("mock" if d.mock else str(per_split))
        run.vocab_size = pad_vocab_size(run.tokenizer.vocab_size, t.make_vocab_size_divisible_by, cfg.parallel.tp)
        if t.padded_vocab_size is not None:
            if t.padded_vocab_size < run.tokenizer.vocab_size:
                raise ConfigError(f"config key tokenizer.padded_vocab_size: {t.padded_vocab_size} is smaller than the "
                                  f"tokenizer's {run.tokenizer.vocab_size} ids")
            run.vocab_size = t.padded_vocab_size
        run.data_seconds = time.perf_counter() - t0

    def model(self) -> None:
        """The model chunks (virtual pipeline stages), wrapped by the step runner; the HC health probe."""
        run = self.run
        cfg, p, m = run.cfg, run.cfg.parallel, run.cfg.model
        explicit = set(self._preset_variant_keys()) | set(m.hc)
        run.hc = hc_defaults_for_optimizer(run.preset.hc, cfg.optimizer.name, explicit)
        run.preset.hc = run.hc
        bf16 = run.runner.bf16
        parallel = dict(tensor_model_parallel_size=p.tp, sequence_parallel=p.sp, expert_model_parallel_size=p.ep,
                        pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp)
        if p.etp is not None:
            parallel["expert_tensor_parallel_size"] = p.etp
        if p.vpp:
            parallel["virtual_pipeline_model_parallel_size"] = p.vpp
        extra: Dict[str, Any] = run.runner.transformer_config_options()
        if m.recompute == "selective":
            extra.update(recompute_granularity="selective")
        elif m.recompute == "full":
            extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if p.vpp and run.hc.enabled and run.hc.n > 1:
            extra["variable_seq_lengths"] = True  # the interleaved schedule sizes p2p buffers inline
        if p.tp_comm_overlap:  # TE userbuffers for the TP collectives of every [s·b/cp, C] GEMM input
            extra["tp_comm_overlap"] = True
            if run.cuda:
                import transformer_engine.pytorch as te

                te.module.base.initialize_ub(shape=[run.seq * cfg.batch.micro_batch_size // p.cp,
                                                    run.preset.hidden_size], tp_size=p.tp, use_fp8=False,
                                             dtype=torch.bfloat16 if bf16 else torch.float32)
        if p.ep_overlap:  # the 1F1B all-to-all overlap of the expert dispatch / combine
            extra["overlap_moe_expert_parallel_comm"] = True
        try:
            run.tf_config = build_transformer_config(run.preset, parallel=parallel, cpu=not run.cuda, **extra)
        except ZooError as e:
            raise ConfigError(f"config key model.backbone: {e}") from None
        te = m.use_transformer_engine if run.cuda else False
        chunks = []
        vp = p.vpp or 1
        if vp > 1 and hasattr(ps, "set_virtual_pipeline_model_parallel_world_size"):
            ps.set_virtual_pipeline_model_parallel_world_size(vp)  # models.parallel does not pass vpp to Megatron
        for i in range(vp):
            if vp > 1:
                ps.set_virtual_pipeline_model_parallel_rank(i)
            # chunk i of pipeline rank r holds virtual stage i·pp + r (Megatron's interleaving)
            pre = run.first_stage and i == 0
            post = run.last_stage and i == vp - 1
            chunk = build_model(run.preset, run.tf_config, pre_process=pre, post_process=post,
                                vp_stage=i if vp > 1 else None, use_transformer_engine=te,
                                vocab_size=run.vocab_size, seq_length=run.seq)
            if vp > 1:
                chunk.vp_stage = i
            chunks.append(chunk)
        if vp > 1:
            ps.set_virtual_pipeline_model_parallel_rank(0)

        for c in chunks:
            for prm in c.parameters():
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(prm)
        run.num_params_local = sum(prm.numel() for c in chunks for prm in c.parameters())
        run.num_hc_params_local = sum(prm.numel() for c in chunks for prm in c.parameters()
                                      if getattr(prm, "is_hyper_connection", False))
        from megatron.core.transformer.moe.moe_layer import MoELayer

        experts = sorted({type(m.experts).__name__ for c in chunks for m in c.modules() if isinstance(m, MoELayer)})
        if experts:  # model.backbone.moe_grouped_gemm (null: grouped on CUDA), docs/architecture.md
            run.log(f"[xhc] routed experts: {', '.join(experts)}"
                    + (" (grouped GEMMs, models.grouped_experts)" if "GroupedExperts" in experts else ""))
        if run.cfg.model.compile_hc:
            n = sum(compile_hc_modules(c) for c in chunks)
            run.log(f"[xhc] model.compile_hc: {n} HC modules under torch.compile (inductor; the first "
                    f"steps include compilation)")
        run.runner.tf_config, run.runner.hc = run.tf_config, run.hc
        chunks = run.runner.wrap(chunks, bf16)
        run.chunks = run.runner.chunks = chunks
        if p.pp > 1 and run.hc.enabled and run.hc.n > 1:
            if p2p_shapes_installed():
                uninstall_hc_p2p_shapes()
            install_hc_p2p_shapes(run.hc.n, run.tf_config)  # every p2p edge carries [s, b, N·C]

        run.health = HCHealth([unwrap(c) for c in chunks], run.hc)

    def optimizer(self) -> None:
        """Optimizer and LR scheduler, hooked into the step runner."""
        run = self.run
        run.optimizer = build_optimizer(run.chunks, run.cfg.optimizer, use_megatron=run.runner.uses_megatron)
        run.scheduler = build_scheduler(run.optimizer, run.cfg.schedule, run.cfg.optimizer)
        run.runner.attach(run.optimizer)

    def checkpointer(self) -> None:
        """The checkpointer, the step counters at zero and the free-space pre-flight (no loading: see
        :meth:`training.pretrain.Trainer.maybe_resume`)."""
        run = self.run
        ck = run.cfg.checkpoint
        run.ckpt = Checkpointer(run.paths["checkpoints"], keep_last=ck.keep_last, checksum=ck.checksum,
                                log=run.log)
        run.async_save = bool(ck.async_save)
        run.step = 0
        run.consumed_samples = 0
        run.skipped_steps = 0
        run.skipped_samples = 0
        run.resumed_from = None
        self.check_checkpoint_space()

    def check_checkpoint_space(self) -> None:
        """Pre-flight: free space under checkpoint.dir for one checkpoint (estimate: 4 bytes per parameter
        for the weights + 8 for the optimizer moments, summed over ranks, + 10 %)."""
        run = self.run
        n = run._all_reduce([float(run.num_params_local)])[0]
        needed = 1.1 * 12 * n
        run.checkpoint_bytes_estimate = needed
        error = None
        if run.is_main and (run.cfg.checkpoint.interval or run.cfg.checkpoint.save_final
                            or run.cfg.checkpoint.save_on_signal):
            freed = remove_partial_saves(run.paths["checkpoints"])  # crashed / failed saves: their space counts
            if freed:
                run.log(f"[xhc] removed the partial saves of an earlier run under {run.paths['checkpoints']} "
                        f"({human_mb(freed)})")
            try:
                check_free_space(run.paths["checkpoints"], needed, "checkpoint.dir")
            except ConfigError as e:
                error = str(e)
        error = from_rank0(error)
        if error:
            raise ConfigError(error)

    def datasets(self) -> None:
        """Megatron's datasets (index caches under data.cache_dir), after the checkpoint checks."""
        run = self.run
        cfg, d = run.cfg, run.cfg.data
        t0 = time.perf_counter()
        prefixes, per_split = d.prefixes, d.per_split
        if cfg.uses_default_data:
            prefixes = [self.default_prefix]
        dcfg = DataConfig(prefixes=prefixes, weights=d.weights, split=d.split, per_split=per_split, mock=d.mock,
                          cache_dir=d.cache_dir or os.path.join(run.run_dir, "data_cache"),
                          reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
                          eod_mask_loss=d.eod_mask_loss, create_attention_mask=d.reset_attention_mask)
        gbs = cfg.batch.global_batch_size
        n_train = cfg.run.train_steps * gbs
        n_valid = max(cfg.run.eval_iters, 1) * gbs
        # Megatron builds the index caches on rank 0 first, then the others read them.  The training
        # order follows run.seed; the validation samples follow data.seed, so every run seed is
        # evaluated on the same batches (with run.seed == data.seed one build serves both).
        def build():
            train, valid, _ = build_datasets(dcfg, run.tokenizer, run.seq, cfg.run.seed, (n_train, n_valid, None))
            if d.seed != cfg.run.seed:
                _, valid, _ = build_datasets(dcfg, run.tokenizer, run.seq, d.seed, (1, n_valid, None))
            return train, valid

        if run.is_main:
            run.train_ds, run.valid_ds = build()
        barrier()
        if not run.is_main:
            run.train_ds, run.valid_ds = build()
        run.data_seconds += time.perf_counter() - t0

    def write_config(self) -> None:
        """``<run.dir>/config.yaml`` and ``run_record.json`` (what the run trains on, resolved:
        training.run.run_record; every checkpoint carries it), once the set-up has succeeded (a refused
        start changes nothing)."""
        run = self.run
        if run.is_main:
            tmp = run.paths["config"] + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                yaml.safe_dump(config_to_dict(run.cfg), f, sort_keys=False)
            os.replace(tmp, run.paths["config"])
        run.run_record = write_run_record(run)

    def logging(self) -> None:
        """The metrics logger (JSONL, TensorBoard, wandb), the FLOP count and the set-up banner."""
        run = self.run
        cfg, lg = run.cfg, run.cfg.logging
        tb_dir = os.path.join(run.run_dir, "tensorboard") if lg.tensorboard else None
        wandb = None
        if lg.wandb:
            wandb = {"project": lg.wandb_project, "entity": lg.wandb_entity,
                     "name": os.path.basename(run.run_dir), "config": config_to_dict(cfg), "dir": run.run_dir}
        run.metrics = MetricsLogger(run.run_dir, enabled=run.is_main, jsonl=lg.jsonl, tensorboard_dir=tb_dir,
                                    wandb=wandb, print_fn=_p)
        run.paths["metrics"] = run.metrics.jsonl_path
        run.paths["tensorboard"] = run.metrics.tensorboard_dir
        if run.resumed_from:  # consumers drop the records of steps after this one written before it
            record = {"checkpoint": run.resumed_from, "consumed_samples": run.consumed_samples,
                      "load_time_s": round(run.load_seconds, 3)}
            if run.resume_layouts:
                record["layout"] = run.resume_layouts
            run.metrics.write("resume", run.step, record)
        run.flops = model_flops_per_token(run.preset, run.seq, run.vocab_size, lg.flops_convention, run.hc)
        run.peak, run.peak_note = peak_tflops(lg.peak_tflops, run.cuda)
        run.tokens_per_step = cfg.batch.global_batch_size * run.seq
        self.print_setup()
        for note in run.metrics.notes:
            run.log(f"[xhc] note: {note}")

    def print_setup(self) -> None:
        run = self.run
        cfg, p, b = run.cfg, run.cfg.parallel, run.cfg.batch
        hc = run.hc
        hc_desc = "vanilla residual" if not hc.enabled else (
            f"{hc.variant} N={hc.n}" + (f" k={hc.k} m={hc.m} GS={'on' if hc.gram_schmidt else 'off'}"
                                        if hc.is_xhc else ""))
        dev = (f"{run.world}x {run.device.type}" + (f" ({torch.cuda.get_device_name()})" if run.cuda else "")
               + f", {'bf16' if run.tf_config.bf16 else 'fp32'}")
        run.log(f"[xhc] model      {cfg.model.preset}: {hc_desc}; {run.preset.num_layers} layers, "
                f"C={run.preset.hidden_size}, vocab {run.vocab_size}, seq {run.seq}")
        run.log(f"[xhc] params     {run.num_params_local / 1e6:.3f}M on rank 0 (HC {run.num_hc_params_local / 1e3:.1f}k)")
        run.log(f"[xhc] parallel   {dev}: tp={p.tp}{'+sp' if p.sp else ''} pp={p.pp} ep={p.ep} cp={p.cp} dp={run.dp}")
        run.log(f"[xhc] batch      global {b.global_batch_size} = micro {b.micro_batch_size} x dp {run.dp} x "
                f"accumulation {run.num_micro}; {run.tokens_per_step} tokens/step")
        run.log(f"[xhc] optimizer  {cfg.optimizer.name} lr {cfg.optimizer.lr:g}, {cfg.schedule.kind} schedule "
                f"(warmup {cfg.schedule.warmup_steps}, {cfg.schedule.total_steps} steps), clip {cfg.optimizer.clip_grad:g}"
                + (f"; state sharded over dp={run.dp}" if getattr(run.optimizer, "shards", None) is not None else ""))
        for note in getattr(cfg, "notes", ()):
            run.log(f"[xhc] note       {note}")
        run.log(f"[xhc] data       {run.paths['data']} (train {len(run.train_ds)} samples"
                f"{', valid %d' % len(run.valid_ds) if run.valid_ds is not None else ''}; ready in "
                f"{run.data_seconds:.1f}s)")
        run.log(f"[xhc] flops      {run.flops['total'] / 1e6:.2f} MFLOP/token (backbone {run.flops['backbone'] / 1e6:.2f}, "
                f"HC {run.flops['hc'] / 1e6:.3f}); MFU vs {run.peak:g} TFLOP/s/device ({run.peak_note})")
        run.log(f"[xhc] run dir    {run.run_dir}")
        # the hardware, once per start (a resume adds one): tools.sweep's time to loss uses the logged tokens/s
        # of runs on the GPU kind and count it is asked about
        run.metrics.write("setup", run.step, {"devices": run.world, "device": run.device.type,
                                              "device_name": torch.cuda.get_device_name() if run.cuda else "cpu",
                                              "precision": "bf16" if run.tf_config.bf16 else "fp32",
                                              "tokens_per_step": run.tokens_per_step})

    def _preset_variant_keys(self) -> List[str]:
        run = self.run
        try:
            with open(run.preset.source, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
            return list((data.get("variants") or {}).get(run.preset.name.rsplit(":", 1)[1]) or {})
        except (OSError, TypeError, AttributeError):
            return []

