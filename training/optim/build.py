"""``build_optimizer``: the torch backend's optimiser here, Megatron's from :mod:`training.optim.megatron`
(imported on first use: it loads Megatron's optimizer package).  It sits above both backends, so
neither imports the other."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from training.optim.core import (Models, Muon, OptimizerConfigError, TrainOptimizer, _chunks, _muon_kwargs,
                                 named_trainable_parameters, optimizer_shards, param_groups, shards_state)


def build_optimizer(model: Models, cfg: OptimizerConfig, use_megatron: Optional[bool] = None,
                    process_groups: Optional[Mapping[str, Any]] = None) -> TrainOptimizer:
    """The optimiser for ``model`` (a module or a list of pipeline chunks).

    ``use_megatron``: None = Megatron's optimiser when CUDA is available and every chunk is
    wrapped in Megatron's DDP, else the torch backend (which works on any device).
    ``process_groups``: torch backend, Muon's ``{"tp": ..., "expert_tp": ...}`` (default:
    Megatron's parallel_state).
    """
    chunks = _chunks(model)
    wrapped = all(hasattr(c, "ddp_config") for c in chunks)
    if use_megatron is None:
        use_megatron = torch.cuda.is_available() and wrapped
    if use_megatron:
        if not wrapped:
            raise OptimizerConfigError("build_optimizer(use_megatron=True) needs Megatron-DDP-wrapped model chunks "
                                       "(megatron.core.distributed.DistributedDataParallel)")
        from training.optim.megatron import build_megatron  # (imports Megatron's optimizer package: slow)

        return build_megatron(chunks, cfg)
    groups = param_groups(chunks, cfg)
    params = [p for g in groups for p in g["params"]]
    shards = None
    if shards_state(cfg, "torch"):  # each rank's optimisers hold the parameters it owns (groups may be empty)
        shards = optimizer_shards(named_trainable_parameters(chunks), cfg, process_groups)
        for g in groups:
            keep = [i for i, p in enumerate(g["params"]) if shards.owns(p)]
            g["params"] = [g["params"][i] for i in keep]
            g["param_names"] = [g["param_names"][i] for i in keep]
    adamw_groups = [g for g in groups if g["optimizer"] == "adamw"]
    muon_groups = [g for g in groups if g["optimizer"] == "muon"]
    optimizers: Dict[str, torch.optim.Optimizer] = {}
    if adamw_groups:
        optimizers["adamw"] = torch.optim.AdamW(adamw_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                                weight_decay=cfg.weight_decay)
    if muon_groups:
        optimizers["muon"] = Muon(muon_groups, process_groups=process_groups, **_muon_kwargs(cfg))
    return TrainOptimizer(cfg, optimizers, params, backend="torch", chunks=chunks, shards=shards)
