"""The planner room: memory and time per GPU of a run, before it starts (``python -m tools.plan``).

Modules: ``layout`` (GPU kinds, efficiencies, a run's layout), ``model`` (the plan: bytes per rank,
activations, step time), ``gpu_model`` (the GPU path:
what Megatron-Core and Transformer Engine keep, GEMM shapes, the EP domain, the overlaps), ``check`` (the
start-up block of a run: the plan beside what the run measures).
"""

from __future__ import annotations

from training.rooms import lazy_exports

_EXPORTS = {
    "PlanCheck": "check",
    "activation_bytes": "model", "Efficiencies": "layout", "GPUS": "layout", "HC_TRAINING_TRAFFIC": "model",
    "Layout": "layout", "layout_from_config": "model", "load_run_preset": "model", "make_plan": "model",
    "param_specs": "model", "PlanError": "model", "planned_vocab": "model", "rank_tensors": "model",
    "SavedTensorMeter": "model", "state_bytes": "model",
    "ModelNotPlaceable": "gpu_model", "gemm_efficiency": "gpu_model", "hbm_fraction_from_perf": "model",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
