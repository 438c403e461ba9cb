"""The optimiser on the Megatron backend (GPU): Megatron-Core's optimizers with xhc's rules.

:func:`training.optim.build_optimizer` calls :func:`build_megatron` when every model chunk is wrapped
in Megatron's DDP (the GPU path).  AdamW is Megatron's own (its distributed optimizer by default,
``checkpoint.optimizer_sharding`` layouts), with fp32 HC parameters beside bf16 weights kept in their
own ``FP32Optimizer`` and the index and step fixes below.  Muon is :class:`ShardedLayerWiseOptimizer`
(Megatron's ``LayerWiseDistributedOptimizer`` with xhc's owners, wrappers, exchange and checkpoint),
its state sharded over data parallelism or replicated.  Everything backend-neutral (parameter
classes and groups, Muon itself, the owners, :class:`training.optim.TrainOptimizer`) is in
:mod:`training.optim`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import torch

from training.optim.core import (OptimizerConfig, OptimizerConfigError, Muon, TrainOptimizer, _main_params,
                            _muon_init_state, _muon_kwargs, _zero_state,
                            optimizer_shards, classify_param, named_trainable_parameters, param_groups,
                            shards_state)

def megatron_optimizer_config(cfg: OptimizerConfig, model_config=None):
    """Megatron ``OptimizerConfig`` (0.16.1-0.19.0 field names) for ``cfg`` and the model's precision."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    bf16 = bool(getattr(model_config, "bf16", False))
    fp16 = bool(getattr(model_config, "fp16", False))
    # Megatron's distributed optimizer for AdamW; sharded Muon is layer-wise (:class:`ShardedLayerWiseOptimizer`)
    # and, like Megatron's own Muon, needs Megatron's distributed-optimizer options off.
    use_dist = shards_state(cfg, "megatron") and cfg.name == "adamw"
    return MegatronOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr if cfg.min_lr is not None else 0.0,
        weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
        decoupled_weight_decay=True, clip_grad=cfg.clip_grad, bf16=bf16, fp16=fp16,
        params_dtype=getattr(model_config, "params_dtype", torch.float32), use_distributed_optimizer=use_dist,
    )


def megatron_config_overrides(cfg: OptimizerConfig) -> Dict[Any, Any]:
    """``config_overrides`` for ``get_megatron_optimizer``: ``wd_mult = 0`` exactly for the
    parameters :func:`classify_param` does not decay (replaces Megatron's default 1-D rule)."""
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    no_decay = ParamWithNamePredicate(name="xhc_no_weight_decay",
                                      fn=lambda p, name: not classify_param(name, p, cfg.name).decay)
    return {ParamKey(with_name_predicate=no_decay): {"wd_mult": 0.0}}


def _megatron_adam(chunks: List[torch.nn.Module], mcfg, overrides, exclude: set,
                   drop_stubs: bool = False) -> List[Any]:
    """Megatron's own optimiser (``get_megatron_optimizer``) over every trainable parameter whose
    id is not in ``exclude``; returns its sub-optimisers (dense, expert), without the empty
    (stub) ones if ``drop_stubs``."""
    from megatron.core.optimizer import get_megatron_optimizer

    frozen = [p for _, p in named_trainable_parameters(chunks) if id(p) in exclude]
    for p in frozen:  # Megatron skips params without requires_grad when building its groups
        p.requires_grad_(False)
    try:
        opt = get_megatron_optimizer(mcfg, chunks, config_overrides=overrides)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    subs = list(getattr(opt, "chained_optimizers", [opt]))
    return [o for o in subs if not (drop_stubs and getattr(o, "is_stub_optimizer", False))]


def _fp32_params_beside_bf16(named, mcfg, exclude: set) -> set:
    """ids of the fp32 parameters (the HC parameters, docs/math.md §8 #13) of a bf16 model that a
    non-distributed Megatron optimiser would put into ``Float16OptimizerWithFloat16Params``.

    That wrapper numbers its checkpoint entries from its bf16 params only while torch's
    ``state_dict`` numbers all of them, so a mixed group fails at the first save (0.16.1: a
    ``KeyError`` on the first fp32 param's id).  These params get their own ``FP32Optimizer`` instead.
    The distributed optimizer shards fp32 params itself and needs nothing."""
    if not mcfg.bf16 or mcfg.use_distributed_optimizer:
        return set()
    return {id(p) for _, p in named if id(p) not in exclude and p.dtype == torch.float32}


def _fix_param_group_index_map(opt) -> None:
    """Megatron's ``DistributedOptimizer`` indexes a model parameter's state by its position in
    the parameter group it was given, but rebuilds each group as ``[fp32 shards, fp32 copies of
    the bf16 shards]`` (megatron-core 0.16 and 0.19, ``_build_model_and_main_param_groups``).  In a
    group that mixes the two (our bf16 backbone with fp32 HC parameters, docs/math.md §8 #13) the
    positions then point at other parameters' state: the checkpoint (and ``state_dict``) would
    pair moments with the wrong parameters, or fail on a size mismatch.  Re-index each group in
    the order it really has; a group without fp32 parameters is unchanged."""
    fp32_groups, float16_groups = getattr(opt, "model_fp32_groups", None), getattr(opt, "model_float16_groups", None)
    if fp32_groups is None or float16_groups is None or not hasattr(opt, "model_param_group_index_map"):
        return
    for group_index, (fp32, float16) in enumerate(zip(fp32_groups, float16_groups)):
        for order, param in enumerate([*fp32, *float16]):
            opt.model_param_group_index_map[param] = (group_index, order)


def _keep_step_on_reshardable_load(opt) -> None:
    """With torch's Adam (no Transformer Engine or Apex) each parameter's state holds a ``step``
    tensor, which the ``fully_reshardable`` checkpoint format does not store (the step count
    travels in the param groups and is restored before the per-parameter states); megatron-core
    0.16 and 0.19 then fail with ``KeyError: 'step'`` copying the states back.  Keep the step the
    load already set."""
    inner = getattr(opt, "_set_main_param_and_optimizer_states", None)
    if inner is None or not hasattr(opt, "model_param_group_index_map"):
        return

    def set_states(model_param, tensors):
        group_index, order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        return inner(model_param, tensors)

    opt._set_main_param_and_optimizer_states = set_states


_LAYER_WISE_CLASS = None


def _layer_wise_optimizer_class():
    """:class:`ShardedLayerWiseOptimizer`: Megatron's ``LayerWiseDistributedOptimizer`` with this
    module's owner rule (built on first use: importing Megatron's optimizer package is slow)."""
    global _LAYER_WISE_CLASS
    if _LAYER_WISE_CLASS is not None:
        return _LAYER_WISE_CLASS
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    class ShardedLayerWiseOptimizer(LayerWiseDistributedOptimizer):
        """Megatron-Core's layer-wise distributed optimizer (each DP rank owns whole parameters, a
        chained optimizer over Muon and AdamW, one global grad norm) with five changes:

        - the owners: :func:`training.optim.param_shards.shard_owner_ranks` (Newton–Schulz cost for the Muon matrices, element
          count for the AdamW ones, per DP / expert-DP group) instead of Megatron's ping-pong by
          element count, which balances neither the Newton–Schulz FLOPs nor, per optimizer, the state;
        - the wrappers: each sub-optimizer is wrapped after sharding by ``wrap(index, optimizer)``
          (bf16 parameters in ``Float16OptimizerWithFloat16Params``, the fp32 HC parameters in their own
          ``FP32Optimizer``), so fp32 main copies exist for the owned parameters only and no bf16
          wrapper holds an fp32 parameter (which it cannot checkpoint);
        - the exchange: :meth:`training.optim.param_shards.ParamShards.sync` (per dtype, per owner), since Megatron's flattened
          all-gather assumes one dtype for all parameters (bf16 weights beside fp32 HC parameters), run by
          ``step_with_ready_grads`` on 0.16.1 (whose base class gathers in ``step``) and 0.19 alike;
        - the checkpoint: one entry per parameter (:attr:`per_param_checkpoint`), which reshards, instead
          of Megatron's per-rank sub-optimizer states, which load at the same DP size only;
        - the replicated mode (``replicated``): every rank owns every parameter, for
          ``optimizer.use_distributed_optimizer=false``, so that both states share one code path and
          one checkpoint format.

        Written against 0.16.1 and read against 0.19.2 (whose ``__init__`` passes DDP buffer layouts to
        ``shard_params`` and gathers in ``step_with_ready_grads``; this class uses neither layout).
        """

        per_param_checkpoint = True
        """Checkpointed by :meth:`TrainOptimizer.torch_sharded_state_dict` (one entry per parameter, reshardable),
        not by Megatron's layer-wise format, which resumes at the same DP size only."""

        def __init__(self, optimizers, config, kinds, shard_args, wrap, order, replicated=False):
            self.kinds, self._shard_args, self._wrap, self._order = list(kinds), shard_args, wrap, order
            self.replicated = replicated
            """Every rank updates every parameter (``optimizer.use_distributed_optimizer=false``): the
            same optimizers and checkpoint entries, no exchange; the grad norm still sums each
            parameter's square on its would-be owner, so both modes clip by the same bits."""
            super().__init__(optimizers, dataclasses.replace(config, bf16=False), pg_collection=None)

        def shard_params(self, optimizers, full_param_layouts=None):  # (0.19: DDP buffer layouts, unused here)
            items = [(p, kind) for opt, kind in zip(optimizers, self.kinds) for g in opt.param_groups
                     for p in g["params"]]
            items.sort(key=lambda item: self._order[id(item[0])])  # the model's order, as the torch backend
            named = [(str(i), p) for i, (p, _) in enumerate(items)]
            shards = optimizer_shards(named, **self._shard_args, kinds=[k for _, k in items])
            self.param_shards = None if self.replicated else shards
            self.norm_owned = shards.owned if self.replicated else None
            for opt in optimizers if not self.replicated else ():
                for g in opt.param_groups:
                    g["params"] = [p for p in g["params"] if shards.owns(p)]
            for i, opt in enumerate(optimizers):  # LayerWiseDistributedOptimizer chains this list after
                optimizers[i] = self._wrap(i, opt)
            self.dp_cp_params_list = self.expt_dp_params_list = None

        @torch.no_grad()
        def allgather_params(self) -> None:
            if self.param_shards is not None:
                self.param_shards.sync()

        @torch.no_grad()
        def get_grad_norm(self):
            if self.norm_owned is None:  # sharded: the base class's global norm over the owned parameters
                return super().get_grad_norm()
            from megatron.core import tensor_parallel
            from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
            from megatron.core.transformer.module import param_is_not_shared

            grads = [main.grad for opt in self.chained_optimizers for model, main in _main_params(opt)
                     if id(model) in self.norm_owned and main.grad is not None and param_is_not_shared(main)
                     and tensor_parallel.param_is_not_tensor_parallel_duplicate(main)]
            return get_grad_norm_fp32(grads, grad_stats_parallel_group=None)

        @torch.no_grad()
        def step_with_ready_grads(self) -> bool:
            # the exchange after the owners' update, here on every version (0.16.1 does it in step(),
            # which TrainOptimizer does not call; 0.19 here); a skipped update exchanges unchanged values
            from megatron.core.optimizer.optimizer import ChainedOptimizer

            success = ChainedOptimizer.step_with_ready_grads(self)
            self.allgather_params()
            return success

    _LAYER_WISE_CLASS = ShardedLayerWiseOptimizer
    return ShardedLayerWiseOptimizer


def _adamw_init_state(opt, config=None) -> None:
    """Megatron ``init_state_fn`` of a torch AdamW (zeros, step 0: what its first update creates)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p].update(_zero_state("adamw", p.detach()))


def _build_megatron_muon(chunks, cfg: OptimizerConfig, mcfg, named, replicated: bool) -> TrainOptimizer:
    """Muon on the Megatron backend (:class:`ShardedLayerWiseOptimizer`): sub-optimisers Muon (dense),
    Muon (routed experts), AdamW on the bf16 rest and AdamW on the fp32 (HC) parameters, each over the
    parameters this rank owns (its state sharded over data parallelism), or over all of them
    (``replicated``: ``optimizer.use_distributed_optimizer=false``)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    def meta(g):  # the keys Megatron's wrappers read (as _build_megatron's Muon groups)
        return {"lr_mult": 1.0, "max_lr": cfg.lr, "is_decoupled_lr": False,
                "is_expert_parallel": g.get("tp") == "expert_tp"}

    groups = param_groups(chunks, cfg)
    bf16 = bool(mcfg.bf16)
    subs, kinds, inits = [], [], []
    for gname in ("muon", "muon_expert"):
        for g in [g for g in groups if g["name"] == gname]:
            subs.append(Muon([{**g, **meta(g)}], **_muon_kwargs(cfg)))
            kinds.append("muon")
            inits.append(_muon_init_state)
    for fp32 in (False, True):
        adam = []
        for g in groups:
            if g["optimizer"] != "adamw":
                continue
            keep = [i for i, p in enumerate(g["params"]) if (p.dtype == torch.float32 or not bf16) == fp32]
            if keep:
                adam.append({**g, **meta(g), "params": [g["params"][i] for i in keep],
                             "param_names": [g["param_names"][i] for i in keep]})
        if adam:
            subs.append(torch.optim.AdamW(adam, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                          weight_decay=cfg.weight_decay))
            kinds.append("adamw")
            inits.append(_adamw_init_state)

    class NestedFP32Optimizer(FP32Optimizer):
        """``FP32Optimizer`` whose (sharded) state dict nests the torch one under ``optimizer``, as
        ``Float16OptimizerWithFloat16Params`` does: ``LayerWiseDistributedOptimizer`` (0.16.1) edits
        ``sd["optimizer"]`` of every member it chains."""

        def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
            return {"optimizer": super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)}

        def load_state_dict(self, state_dict):
            nested = "optimizer" in state_dict and "state" not in state_dict
            super().load_state_dict(state_dict["optimizer"] if nested else state_dict)

    def wrap(i, opt):  # bf16 weights: fp32 main copies; fp32 (HC) parameters: their own optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if bf16 and kinds[i] == "muon" or bf16 and any(p.dtype != torch.float32 for p in params):
            return Float16OptimizerWithFloat16Params(opt, mcfg, None, inits[i])
        return NestedFP32Optimizer(opt, mcfg, inits[i])

    cls = _layer_wise_optimizer_class()
    opt = cls(subs, mcfg, kinds, {"cfg": cfg}, wrap, {id(p): i for i, (_, p) in enumerate(named)}, replicated)
    params = [p for _, p in named]
    return TrainOptimizer(cfg, {}, params, backend="megatron", megatron_optimizer=opt, chunks=chunks,
                          shards=opt.param_shards)


def build_megatron(chunks: List[torch.nn.Module], cfg: OptimizerConfig) -> TrainOptimizer:
    """The :class:`training.optim.TrainOptimizer` over Megatron-DDP-wrapped ``chunks`` (the GPU path)."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    from megatron.core.utils import get_model_config

    model_config = get_model_config(chunks[0])
    mcfg = megatron_optimizer_config(cfg, model_config)
    overrides = megatron_config_overrides(cfg)
    named = named_trainable_parameters(chunks)
    params = [p for _, p in named]
    if cfg.name == "muon" and getattr(model_config, "fp16", False):
        raise OptimizerConfigError("optimizer.name='muon' does not support fp16 (the model is fp16); use bf16")
    if cfg.name == "muon":  # sharded over data parallelism or not: one optimizer, one checkpoint format
        return _build_megatron_muon(chunks, cfg, mcfg, named, replicated=not shards_state(cfg, "megatron"))

    fp32_ids = _fp32_params_beside_bf16(named, mcfg, set())
    parts = _megatron_adam(chunks, mcfg, overrides, fp32_ids)
    if fp32_ids:
        # Megatron builds an FP32Optimizer for a bf16=False config; ChainedOptimizer requires one
        # config for all its members, and FP32Optimizer reads none of the precision fields.
        fp32_parts = _megatron_adam(chunks, dataclasses.replace(mcfg, bf16=False), overrides,
                                    {id(p) for p in params} - fp32_ids, drop_stubs=True)
        for o in fp32_parts:
            o.config = mcfg
        parts += fp32_parts
    for part in parts:
        _fix_param_group_index_map(part)
        _keep_step_on_reshardable_load(part)
    opt = ChainedOptimizer(parts)
    return TrainOptimizer(cfg, {}, params, backend="megatron", megatron_optimizer=opt, chunks=chunks)
