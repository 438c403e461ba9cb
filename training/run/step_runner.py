"""The step runners: one global batch's forward and backward on this rank, by one of two engines.

:func:`make_step_runner` chooses once, at start-up; the training loop then calls the same methods
whatever the device (:class:`StepRunner`):

- :class:`MegatronStepRunner` (**GPU**): Megatron's ``get_forward_backward_func()`` schedules (1F1B,
  interleaved), with the N·C pipeline p2p shapes of :func:`models.pipeline.install_hc_p2p_shapes`;
  the chunks wrapped in Megatron DDP (:meth:`~MegatronStepRunner.wrap`, bf16 with the HC parameters
  kept in fp32, docs/math.md §8 #13); Megatron's (distributed) optimizer through
  :func:`training.optim.build_optimizer`, its grad finalisation and loss scaling hooked into the
  transformer config (:meth:`~MegatronStepRunner.attach`).
- :class:`CpuStepRunner` (**CPU**, gloo, :mod:`models.cpu_compat`): fp32; forward and backward driven
  directly, with :func:`models.parallel.finalize_grads` for the DP / SP gradient all-reduces and the
  aux-loss-free expert-bias update; PP > 1 through :func:`models.pipeline.gpipe_forward_backward`.

The loss of a global batch is the token-weighted mean over its micro-batches (each micro-batch
contributes ``Σ loss·mask / Σ mask / num_microbatches`` to the gradient, Megatron's default); a
runner returns this rank's ``(Σ loss·mask, Σ mask)`` and the Trainer all-reduces it.

Imports: torch, Megatron-Core, ``models`` and ``xhc`` (no other ``training`` module).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from models.hc_layer import sequence_context
from models.parallel import batch_on_this_cp_rank, finalize_grads
from models.pipeline import gpipe_forward_backward
from xhc.temporal import SequenceContext, pos_in_doc_from_position_ids

__all__ = ["CpuStepRunner", "MegatronStepRunner", "StepRunner", "float16_module_keep_hc_fp32", "make_step_runner",
           "params_synced", "unwrap"]


# ================================================================================================
# GPU-path helpers (module level so that the CPU tests reach them)
# ================================================================================================
def float16_module_keep_hc_fp32(config, chunk):
    """Megatron's ``Float16Module(config, chunk)`` with the HC parameters kept in fp32 *and at
    their fp32 values* (docs/math.md §8 #13): the wrap casts every parameter to bf16, so casting
    back afterwards would keep the bf16 rounding (N = 16's uniform read summed to 1.0046, a 0.01
    gate became 0.0100098).  The fp32 tensors are set aside before the wrap and put back after."""
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


def unwrap(chunk):
    """The GPT model inside a chunk's wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


# ================================================================================================
class StepRunner:
    """What both engines share: the micro-batch view (CP slice, document layout), the masked loss.

    Set at start-up: ``cfg`` (the run's :class:`~training.config.PretrainConfig`), ``dp``, ``seq``,
    ``last_stage`` and ``num_micro`` (micro-batches per global batch on this rank); once the model
    exists: ``tf_config``, ``hc`` and ``chunks`` (the wrapped model chunks, see :meth:`wrap`).
    """

    name = ""
    uses_megatron = False  # Megatron DDP and Megatron's (distributed) optimizer
    bf16 = False

    def __init__(self, cfg, *, dp: int = 1, seq: int = 0, last_stage: bool = True, num_micro: int = 1):
        self.cfg = cfg
        self.dp, self.seq, self.last_stage, self.num_micro = dp, seq, last_stage, num_micro
        self.tf_config = None
        self.hc = None
        self.chunks: List[Any] = []

    # -- start-up ---------------------------------------------------------------------------------
    def transformer_config_options(self) -> Dict[str, Any]:
        """Engine-specific keyword arguments of :func:`models.zoo.build_transformer_config`."""
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        return dict(bf16=self.bf16, params_dtype=dtype, pipeline_dtype=dtype)

    def wrap(self, chunks: List[Any], bf16: bool) -> List[Any]:
        """The model chunks as the engine trains them."""
        return chunks

    def attach(self, optimizer) -> None:
        """Hook the optimizer into the engine (after :meth:`wrap`)."""

    # -- one step ---------------------------------------------------------------------------------
    def zero_grad_buffers(self) -> None:
        """Clear the engine's own gradient buffers before a step (the optimizer clears ``.grad``)."""

    def forward_backward(self, iterators, forward_only: bool = False,
                         num_micro: Optional[int] = None) -> Tuple[float, float]:
        """One global batch on this rank: (Σ loss·mask, Σ mask) of its last-stage micro-batches."""
        raise NotImplementedError

    def finalize_grads(self) -> None:
        """After the backward: the gradient all-reduces the schedule did not do."""

    def params_synced(self):
        """Every rank holds the current parameters inside the block (see :func:`params_synced`)."""
        return params_synced(self.chunks)

    def to_device(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        return batch

    # -- multi-token prediction (models/mtp.py) -----------------------------------------------------
    @property
    def mtp_layers(self) -> int:
        """D, the MTP depths of the model (0 without MTP)."""
        return int(getattr(self.tf_config, "mtp_num_layers", None) or 0)

    def _mtp_begin(self, num_micro: int, scale_backward: bool) -> None:
        """Before a step: zero the per-depth loss buffer; on CPU also give Megatron's ``MTPLossAutoScaler``
        the main loss's backward scale (1 / micro-batches; Megatron's schedules set it on GPU)."""
        if not self.mtp_layers:
            return
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        from models.mtp import mtp_tracker_prepare

        dev = torch.device("cuda", torch.cuda.current_device()) if self.uses_megatron else torch.device("cpu")
        mtp_tracker_prepare(self.mtp_layers, dev)
        if scale_backward:
            MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / num_micro))
        self.last_mtp = [0.0] * self.mtp_layers

    def _mtp_end(self, num_micro: int) -> None:
        """After a step: this rank's per-depth MTP losses summed over its micro-batches (``last_mtp``)."""
        if not self.mtp_layers:
            return
        from models.mtp import mtp_tracker_take

        self.last_mtp = mtp_tracker_take(self.mtp_layers)

    def mtp_stats(self) -> List[float]:
        """[Σ loss_1, ..., Σ loss_D, micro-batches]: this rank's share of the step's per-depth MTP losses
        (token means per micro-batch, summed; zeros off the last stage).  Empty without MTP."""
        if not self.mtp_layers:
            return []
        last = getattr(self, "last_mtp", None) or [0.0] * self.mtp_layers
        return [*last, float(self.num_micro if self.last_stage and any(last) else 0)]

    # -- shared helpers ---------------------------------------------------------------------------
    def _cp_slice(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        if self.cfg.parallel.cp == 1:
            return batch
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


# ================================================================================================
class CpuStepRunner(StepRunner):
    """CPU / gloo: fp32, forward and backward driven directly (GPipe for PP > 1)."""

    name = "cpu"

    def forward_backward(self, iterators, forward_only: bool = False,
                         num_micro: Optional[int] = None) -> Tuple[float, float]:
        num_micro = num_micro or self.num_micro
        self._mtp_begin(num_micro, scale_backward=True)
        try:
            return self._cpu_forward_backward(iterators, forward_only, num_micro)
        finally:
            self._mtp_end(num_micro)

    def _cpu_forward_backward(self, iterators, forward_only: bool, num_micro: int) -> Tuple[float, float]:
        it = iterators[0]
        model = self.chunks[0]
        total, count = 0.0, 0.0
        batches = [self._cp_slice(next(it)) for _ in range(num_micro)]
        if self.cfg.parallel.pp > 1:
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

    def finalize_grads(self) -> None:
        finalize_grads(self.chunks, self.tf_config)  # DP / SP all-reduce, expert-bias update


# ================================================================================================
class MegatronStepRunner(StepRunner):
    """GPU: Megatron's pipeline schedules, DDP and (distributed) optimizer; bf16 unless run.precision=fp32."""

    name = "megatron"
    uses_megatron = True

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.bf16 = cfg.run.precision in ("auto", "bf16")

    def transformer_config_options(self) -> Dict[str, Any]:
        # Megatron's schedules free each sent [s, b, N·C] stage output (16x an edge at N=16)
        return dict(super().transformer_config_options(), deallocate_pipeline_outputs=True)

    def wrap(self, chunks: List[Any], bf16: bool) -> List[Any]:
        """Move to the device, bf16 (HC parameters stay fp32), Megatron DDP."""
        for c in chunks:
            c.cuda(torch.cuda.current_device())
        if bf16:
            chunks = [float16_module_keep_hc_fp32(self.tf_config, c) for c in chunks]
        o, p = self.cfg.optimizer, self.cfg.parallel
        # Megatron's distributed optimizer (AdamW, on unless turned off); sharded Muon is layer-wise
        # (training.optim), which reduces full gradients and needs DDP's distributed-optimizer options off
        use_dist = o.name == "adamw" and o.use_distributed_optimizer is not False
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=p.grad_reduce_in_fp32, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather and use_dist, use_distributed_optimizer=use_dist,
            # interleaved schedule: every stage launches its param all-gathers from param_sync_func
            align_param_gather=p.overlap_param_gather and use_dist and len(chunks) > 1,
            bucket_size=None if not p.overlap_grad_reduce else max(40_000_000, 1_000_000 * self.dp))
        return [DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=c,
                                        disable_bucketing=i > 0) for i, c in enumerate(chunks)]

    def attach(self, optimizer) -> None:
        c = self.tf_config
        c.finalize_model_grads_func = finalize_model_grads
        mopt = getattr(optimizer, "megatron_optimizer", None)
        c.grad_scale_func = mopt.scale_loss if mopt is not None else None
        c.no_sync_func = [m.no_sync for m in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        if len(self.chunks) > 1 and self.chunks[0].ddp_config.align_param_gather:
            c.param_sync_func = [m.start_param_sync for m in self.chunks]

    def zero_grad_buffers(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def to_device(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v.cuda(non_blocking=True) if hasattr(v, "cuda") else v for k, v in batch.items()}

    def forward_backward(self, iterators, forward_only: bool = False,
                         num_micro: Optional[int] = None) -> Tuple[float, float]:
        num_micro = num_micro or self.num_micro
        # Evaluation without autograd, as on CPU: Megatron's router counts tokens per expert
        # (the next expert-bias update) whenever gradients are enabled.
        self._mtp_begin(num_micro, scale_backward=False)
        try:
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                return self._schedule(iterators, forward_only, num_micro)
        finally:
            self._mtp_end(num_micro)

    def _schedule(self, iterators, forward_only: bool, num_micro: int) -> Tuple[float, float]:
        def loss_func(loss_mask, output_tensor):
            s, n = self._masked_sum(output_tensor, loss_mask)
            return s, n.to(torch.int), {"lm loss": torch.stack([s.detach(), n.detach()])}

        def forward_step(data_iterator, model):
            batch = self._cp_slice(self.to_device(next(data_iterator)))
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


def make_step_runner(cfg, cuda: bool, **kw) -> StepRunner:
    """The engine of this run, chosen once: Megatron's on CUDA, the CPU one elsewhere."""
    return (MegatronStepRunner if cuda else CpuStepRunner)(cfg, **kw)
