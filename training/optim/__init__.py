"""The optimiser room: AdamW and Muon for the zoo's models, on the torch backend (any device) or
Megatron's (GPU), with the HC parameter groups of the papers.

Modules: ``core`` (the config, parameter classes and groups, Muon, gradient norm and clipping,
:class:`TrainOptimizer`: the types both backends share), ``megatron`` (the GPU backend on Megatron-Core's
optimizers), ``build`` (:func:`build_optimizer`, above both backends), ``param_shards`` and
``shard_owners`` (which rank owns which parameter when the state is sharded over DP).
"""

from __future__ import annotations

from training.rooms import lazy_exports

_EXPORTS = {
    "build_optimizer": "build",
    "classify_param": "core", "clip_grad_norm": "core", "grad_norm": "core",
    "hc_defaults_for_optimizer": "core", "Muon": "core", "newton_schulz": "core", "NS_COEFFICIENTS": "core",
    "OptimizerConfig": "core", "OptimizerConfigError": "core", "PAPER_ADAMW_EPS": "core",
    "param_groups": "core", "TrainOptimizer": "core",
    "megatron_config_overrides": "megatron", "megatron_optimizer_config": "megatron",
    "shard_owner_ranks": "param_shards",
    "assign_owners": "shard_owners", "newton_schulz_cost": "shard_owners",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
