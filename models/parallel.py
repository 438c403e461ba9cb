"""Process groups, RNG seeding and gradient synchronisation for Megatron-Core models.

- :func:`initialize_parallel` / :func:`destroy_parallel`: torch.distributed + Megatron
  ``parallel_state`` + Megatron's RNG tracker, on GPU (nccl) or CPU (gloo, via
  :mod:`models.cpu_compat`), under ``torchrun`` or in a plain single process (pytest).
- :func:`finalize_grads`: what Megatron's ``finalize_model_grads`` does after backward.  With a
  Megatron-DDP-wrapped model it *is* ``finalize_model_grads`` (grads in ``param.main_grad``);
  for a bare model it runs :func:`allreduce_data_parallel_grads`,
  :func:`allreduce_sequence_parallel_grads` and :func:`update_router_expert_bias` (grads in
  ``param.grad``), which reproduce the corresponding steps of Megatron 0.16.1
  (``distributed_data_parallel.py``, ``finalize_model_grads.py``; unchanged in what they compute
  through 0.19.0).  Both paths run on CPU: Megatron's DDP (default config, also
  ``overlap_grad_reduce`` / ``average_in_collective``) works under :mod:`models.cpu_compat` and
  gives bit-identical grads (tests/dist/stock_gpt_worker.py ``ddp``).  Megatron's *optimizer*
  wrappers and ``clip_grad_norm_fp32`` do not: they allocate ``device='cuda'`` tensors.

Not covered on the bare-model path: tied embeddings across pipeline stages (the zoo's models
untie them), per-token loss scaling (``calculate_per_token_loss``), and the global aux loss.
"""

from __future__ import annotations

import datetime
import os
import inspect
import random
import socket
from typing import Iterable, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from models.cpu_compat import enable_cpu_mode

__all__ = [
    "allreduce_data_parallel_grads",
    "allreduce_sequence_parallel_grads",
    "batch_on_this_cp_rank",
    "destroy_parallel",
    "finalize_grads",
    "free_port",
    "initialize_parallel",
    "launched_by_torchrun",
    "seed_rng",
    "update_router_expert_bias",
]

Models = Union[torch.nn.Module, Iterable[torch.nn.Module]]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    """True when the env:// rendezvous variables that torchrun sets are present."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def initialize_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    etp: Optional[int] = None,
    backend: Optional[str] = None,
    seed: int = 1234,
    timeout_minutes: float = 30.0,
) -> None:
    """Set up torch.distributed, Megatron's model-parallel groups and its RNG tracker.

    ``tp, pp, ep, cp``: tensor / pipeline / expert / context parallel sizes; ``etp``: expert
    tensor-parallel size (Megatron's default, ``None``, means ``tp``).  The data-parallel size is
    ``world_size / (tp·pp·cp)``.  ``backend``: ``"nccl"`` if CUDA is available else ``"gloo"``.

    torch.distributed is initialised once per process: from ``env://`` under torchrun, otherwise
    as a single-process group on a free local port.  Megatron's groups are rebuilt on every call
    (an existing set is destroyed first), so tests may call this repeatedly with different layouts.

    Seeding follows Megatron's ``_set_random_seed``: python/numpy/torch get ``seed + 100·pp_rank``
    (identical across TP/DP ranks, which ``use_cpu_initialization`` relies on to build identical
    master weights), then ``model_parallel_cuda_manual_seed(seed + 100·pp_rank)`` adds the
    tensor-/expert-parallel streams (CPU generator states on CPU, see :mod:`models.cpu_compat`).
    ``timeout_minutes`` bounds every collective (default and Megatron's groups); tests use a
    short one so that a rank that fails mid-collective does not hang its peers.
    """
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if not cuda:
        enable_cpu_mode()
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if launched_by_torchrun():
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timeout
            )
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"initialize_parallel: world size {world} is not divisible by tp*pp*cp = {tp * pp * cp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    seed_rng(seed)


def seed_rng(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's RNG tracker as Megatron's ``_set_random_seed`` does
    (``seed + 100·pp_rank``; the tracker adds the tensor-/expert-parallel streams).  Called at start-up,
    and by a resume on another parallel layout, whose per-rank RNG states cannot be carried over."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Destroy Megatron's model-parallel groups (and optionally the default process group)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()


def batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """This context-parallel rank's rows of ``batch`` (Megatron's ``get_batch_on_this_cp_rank``).

    Megatron's load-balanced split: the sequence is cut into 2·cp chunks and CP rank r keeps
    chunks r and 2·cp−1−r.  ``cp_group`` defaults to Megatron's context-parallel group.  The
    function's signature changed in megatron-core 0.18 (``(batch, cp_group=None)`` became
    ``(batch, is_hybrid_cp, cp_group=None, ...)``, and a ``None`` group now means the whole
    world), so the group is always passed explicitly and ``is_hybrid_cp=False`` only where the
    signature has it (feature detection: the installed function's parameters are inspected).
    """
    import inspect

    from megatron.core import utils as mutils

    fn = mutils.get_batch_on_this_cp_rank
    if cp_group is None:
        cp_group = ps.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(fn).parameters:
        return fn(batch, is_hybrid_cp=False, cp_group=cp_group)
    return fn(batch, cp_group=cp_group)


def _chunks(model: Models) -> List[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def _named_params(model: Models):
    for chunk in _chunks(model):
        yield from chunk.named_parameters()


def _allreduce_coalesced(grads: List[torch.Tensor], group, op=dist.ReduceOp.SUM) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=op, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def allreduce_sequence_parallel_grads(model: Models, config=None) -> None:
    """All-reduce across TP the grads of parameters that are replicated over TP but see only part
    of the computation, as Megatron's ``_allreduce_non_tensor_model_parallel_grads`` does:

    - SUM for ``param.sequence_parallel`` params when ``config.sequence_parallel`` (norms, router,
      HC parameters: each TP rank holds a different slice of the sequence);
    - SUM for ``q_layernorm`` / ``k_layernorm`` params when ``config.qk_layernorm`` (each TP rank
      holds different heads), with or without SP;
    - AVG for params marked ``average_gradients_across_tp_domain``.

    ``config`` defaults to the first chunk's ``.config``.  Call after backward, before the step.
    """
    chunks = _chunks(model)
    config = config if config is not None else chunks[0].config
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    grads_sum, grads_avg = [], []
    for name, p in _named_params(chunks):
        if not p.requires_grad or p.grad is None:
            continue
        if getattr(p, "average_gradients_across_tp_domain", False):
            grads_avg.append(p.grad.data)
        elif (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
            config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
        ):
            grads_sum.append(p.grad.data)
    _allreduce_coalesced(grads_sum, group, dist.ReduceOp.SUM)
    _allreduce_coalesced(grads_avg, group, dist.ReduceOp.AVG)


def allreduce_data_parallel_grads(model: Models) -> None:
    """Average grads over data-parallel replicas, as Megatron's DDP does (0.16.1 defaults).

    Every grad is scaled by ``1 / |DP×CP group|`` and summed over its replica group: the DP×CP
    group for dense params, the expert-data-parallel group for expert params
    (``param.allreduce == False``).  For a per-rank mean loss this yields the gradient of the mean
    over all ranks' micro-batches, including for experts that receive tokens from several ranks.
    """
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    expt_dp = ps.get_expert_data_parallel_group()
    scale = 1.0 / dist.get_world_size(dp_cp)
    dense, expert = [], []
    for _, p in _named_params(model):
        if p.requires_grad and p.grad is not None:
            (dense if getattr(p, "allreduce", True) else expert).append(p.grad.data)
    for grads, group in ((dense, dp_cp), (expert, expt_dp)):
        if scale != 1.0:
            for g in grads:
                g.mul_(scale)
        _allreduce_coalesced(grads, group)


def update_router_expert_bias(model: Models, config=None) -> None:
    """Aux-loss-free balancing step (Megatron ``_update_router_expert_bias`` + reset).

    For every router with ``expert_bias``: all-reduce ``local_tokens_per_expert`` over TP×CP×DP,
    move the bias by ``±moe_router_bias_update_rate`` towards balance, and zero the counts.
    No-op unless ``config.moe_router_enable_expert_bias``.  Call once per global batch.
    """
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    chunks = _chunks(model)
    config = config if config is not None else chunks[0].config
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return
    routers = [m for c in chunks for m in c.modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    counts = torch.stack([m.local_tokens_per_expert for m in routers])
    biases = torch.stack([m.expert_bias for m in routers])
    updated = get_updated_expert_bias(counts, biases, config.moe_router_bias_update_rate)
    with torch.no_grad():
        for m, b in zip(routers, updated):
            m.expert_bias.copy_(b)
            m.local_tokens_per_expert.zero_()


def finalize_grads(model: Models, config=None) -> None:
    """Post-backward gradient synchronisation.

    Megatron-DDP-wrapped chunks (GPU): ``megatron.core.distributed.finalize_model_grads``.
    Bare chunks (CPU): DP average, SP/QK-norm TP all-reduce, then the expert-bias update.
    """
    chunks = _chunks(model)
    if all(hasattr(c, "finish_grad_sync") for c in chunks):
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(chunks)
        return
    allreduce_data_parallel_grads(chunks)
    allreduce_sequence_parallel_grads(chunks, config)
    allreduce_mtp_embedding_grads(chunks, config)
    update_router_expert_bias(chunks, config)


def allreduce_mtp_embedding_grads(chunks, config=None) -> None:
    """Multi-token prediction under PP: the last stage holds a copy of the word embedding (the MTP
    depths embed the shifted tokens); the two copies' gradients are summed over Megatron's embedding
    group (first and last stage), as ``finalize_model_grads`` does on the DDP path."""
    cfg = config or getattr(chunks[0], "config", None)
    if not getattr(cfg, "mtp_num_layers", None) or ps.get_pipeline_model_parallel_world_size() == 1:
        return
    group = ps.get_embedding_group(check_initialized=False) if "check_initialized" in \
        inspect.signature(ps.get_embedding_group).parameters else ps.get_embedding_group()
    if group is None or dist.get_world_size(group) == 1 or dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    chunk = chunks[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else chunks[-1]
    emb = getattr(chunk, "embedding", None)
    w = emb.word_embeddings.weight if emb is not None else None
    g = getattr(w, "main_grad", None) if w is not None else None
    g = g if g is not None else (w.grad if w is not None else None)
    if g is not None:
        dist.all_reduce(g, group=group)
