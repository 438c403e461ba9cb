"""The planner's check in every training run (training start-up and first step): the plan printed,
and planned vs measured peak memory in the first ``metrics.jsonl`` record (docs/planning.md)."""

from __future__ import annotations

from typing import Dict, List

from training.plan.model import GIB, SavedTensorMeter, _gpu_of, make_plan

class LiveSavedMeter:
    """The peak of the bytes autograd holds saved for backward inside the block (unique storages, parameters
    excluded): a storage counts from the first tensor that saves it until the last such tensor is freed."""

    def __init__(self, exclude=()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: Dict[int, List[int]] = {}
        self.current = 0
        self.peak = 0
        self._ctx = None

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def _pack(self, t):
        import weakref

        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or st.nbytes() == 0:
            return t
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [st.nbytes(), 1]
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._release, key)
        return t

    __enter__ = SavedTensorMeter.__enter__  # the same hooks around the block, with this class's _pack
    __exit__ = SavedTensorMeter.__exit__


def _tensor_bytes(tensors) -> int:
    import torch

    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


class PlanCheck:
    """Training's side of the planner: print the plan at start-up (:func:`plan_block`, the tool's output) and
    put the planned and measured peak memory of this rank into the first step's ``metrics.jsonl`` record
    (``plan_peak_gib``, ``measured_peak_gib``, ``measured_peak_source``).  GPU: ``torch.cuda.max_memory_allocated``;
    CPU: the parameters, gradients and optimizer state held after the step plus the peak of the activations
    autograd held saved during it (:class:`LiveSavedMeter`)."""

    def __init__(self, run):
        import torch
        from megatron.core import parallel_state as ps

        self.run = run
        name = torch.cuda.get_device_name() if run.cuda else None
        self.plan = None
        try:
            self.plan = make_plan(run.cfg, run.world, _gpu_of(name) if run.cuda else None)
            run.log(self.plan.format())
        except Exception as e:  # noqa: BLE001  the planner does not cover this run: say so, train anyway
            run.log(f"[plan] not planned: {type(e).__name__}: {e}")
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.meter = None
        if self.plan is not None and not run.cuda:
            params = [p for c in run.chunks for p in c.parameters()]
            self.meter = LiveSavedMeter(exclude=params).__enter__()

    def record(self, rec: dict) -> None:
        """Add the planned and measured peak to ``rec`` (the first step's record), once."""
        if self.plan is None:
            return
        run, plan = self.run, self.plan
        rec["plan_peak_gib"] = plan.stages[self.stage].total / GIB
        if run.cuda:
            import torch

            rec["measured_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            rec["measured_peak_source"] = "torch.cuda.max_memory_allocated"
        else:
            self.meter.__exit__(None, None, None)
            params = [p for c in run.chunks for p in c.parameters()]
            opt = getattr(run.optimizer, "optimizers", {}) or {}
            state = [t for o in opt.values() for st in o.state.values() for t in st.values()]
            held = _tensor_bytes(params) + _tensor_bytes([p.grad for p in params if p.grad is not None]) \
                + _tensor_bytes(state)
            # .grad is freed by zero_grad(set_to_none) after the step: count it as the step held it
            if not any(p.grad is not None for p in params):
                held += _tensor_bytes(params)
            rec["measured_peak_gib"] = (held + self.meter.peak) / GIB
            rec["measured_peak_source"] = "cpu: parameters + gradients + optimizer state + peak saved activations"
        self.plan = None
