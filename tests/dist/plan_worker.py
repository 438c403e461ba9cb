"""torchrun worker: the bytes each rank's model and optimizer really hold, for the planner's exactness test.

Run (2 ranks, gloo, CPU)::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/plan_worker.py OUT.json [variant ...]

One launch loops over the layouts (DP = 2, TP = 2 + SP, EP = 2, PP = 2), every ``tiny-moe`` variant and
both optimizers, re-initialising Megatron's parallel state in-process.  For each case it builds this rank's
model chunk (the stage's layers), the torch-backend optimizer (replicated, and where DP > 1 also with its
state sharded over DP: ``use_distributed_optimizer=true``), gives every parameter a zero gradient and
steps once (torch creates the optimizer state at the first step), then sums ``numel · element_size`` over
the unique storages of the parameters, of their ``.grad`` and of the optimizer state.  Each rank writes
``OUT.json.rank<r>``: a list of ``{layout, variant, optimizer, stage, weights, grads, optimizer}``; the test
(``tests/test_plan.py``) compares them with :func:`training.plan.state_bytes`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import warnings

if __name__ in ("__main__", "__mp_main__"):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VOCAB, SEQ = 256, 16
LAYOUTS = {"dp2": dict(tp=1, pp=1, ep=1), "tp2sp": dict(tp=2, pp=1, ep=1, sp=True), "ep2": dict(tp=1, pp=1, ep=2),
           "pp2": dict(tp=1, pp=2, ep=1)}
VARIANTS = ("vanilla", "hc", "mhc", "mhc-lite", "kromhc", "identity", "xhc", "xhc-flash", "xhc-flash4")


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def measure(layout: str, variant: str) -> list:
    """Both optimizers on one build of this rank's chunk (Gram–Schmidt's default differs by optimizer but
    holds no parameters)."""
    from megatron.core import parallel_state as ps

    from models.zoo import build_model, build_transformer_config, load_preset
    from training.optim import OptimizerConfig, build_optimizer

    kw = LAYOUTS[layout]
    preset = load_preset(f"tiny-moe:{variant}")
    parallel = dict(tensor_model_parallel_size=kw["tp"], sequence_parallel=kw.get("sp", False),
                    expert_model_parallel_size=kw["ep"], pipeline_model_parallel_size=kw["pp"])
    config = build_transformer_config(preset, parallel=parallel, cpu=True, pipeline_dtype=torch.float32)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = build_model(preset, config, pre_process=first, post_process=last, vocab_size=VOCAB, seq_length=SEQ)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    cases = [("adamw", False), ("muon", False)]
    if ps.get_data_parallel_world_size() > 1:  # the state sharded over DP (issue #44, torch backend)
        cases += [("adamw", True), ("muon", True)]
    for optimizer, sharded in cases:
        opt = build_optimizer(model, OptimizerConfig(name=optimizer, lr=1e-3, use_distributed_optimizer=sharded))
        for p in params:
            p.grad = torch.zeros_like(p)
        result = opt.step()
        assert result.updated, f"{layout} {variant} {optimizer}: the step was skipped"
        state = [t for o in opt.optimizers.values() for st in o.state.values() for t in st.values()]
        rows.append({"layout": layout, "variant": variant, "optimizer": optimizer, "sharded": sharded,
                     "dp_rank": ps.get_data_parallel_rank(),
                     "stage": ps.get_pipeline_model_parallel_rank(), "weights": _storage_bytes(params),
                     "grads": _storage_bytes(p.grad for p in params), "optimizer_bytes": _storage_bytes(state),
                     "tensors": len(params)})
    return rows


def main(argv) -> int:
    out, variants = argv[0], argv[1:] or list(VARIANTS)
    warnings.simplefilter("ignore")
    from models.parallel import initialize_parallel

    rows = []
    for layout, kw in LAYOUTS.items():
        with contextlib.redirect_stdout(io.StringIO()):
            initialize_parallel(tp=kw["tp"], pp=kw["pp"], ep=kw["ep"], seed=1234, timeout_minutes=2.0)
            for variant in variants:
                rows += measure(layout, variant)
    rank = dist.get_rank()
    with open(f"{out}.rank{rank}", "w", encoding="utf-8") as f:
        json.dump(rows, f)
    dist.barrier()
    print(f"OK rank {rank}: {len(rows)} cases", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
