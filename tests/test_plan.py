"""The run planner (training/plan.py, tools/plan.py): memory per rank against the real tensors, activations
against what autograd really saves, the CLI, the search and the start-up block."""

from __future__ import annotations

import json
import warnings

import pytest

from training.plan import Layout, param_specs, rank_tensors, state_bytes

DIST_LAYOUTS = {"dp2": dict(tp=1, pp=1, ep=1), "tp2sp": dict(tp=2, pp=1, ep=1, sp=True),
                "ep2": dict(tp=1, pp=1, ep=2), "pp2": dict(tp=1, pp=2, ep=1)}


@pytest.mark.megatron
def test_state_bytes_equal_the_real_tensors_on_every_rank(run_torchrun, tmp_path):
    """Weights, gradients and optimizer state of every tiny-moe variant, AdamW and Muon, DP = 2, TP = 2 + SP,
    EP = 2 and PP = 2 under gloo: the plan equals Σ numel·element_size of the real tensors on each rank
    (one torchrun launch for all 144 rank-cases, tests/dist/plan_worker.py)."""
    from models.zoo import load_preset

    out = tmp_path / "state.json"
    run_torchrun("tests/dist/plan_worker.py", nproc=2, args=(str(out),), timeout=300)
    rows = [row for r in (0, 1) for row in json.loads((tmp_path / f"state.json.rank{r}").read_text())]
    assert len(rows) == 2 * len(DIST_LAYOUTS) * 9 * 2
    stages = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for row in rows:
            preset = load_preset(f"tiny-moe:{row['variant']}")
            lay = Layout(gpus=2, gpu=False, bf16=False, optimizer=row["optimizer"], **DIST_LAYOUTS[row["layout"]])
            tensors = rank_tensors(param_specs(preset, 256), lay, row["stage"])
            planned = state_bytes(tensors, lay)
            case = f"{row['layout']} {row['variant']} {row['optimizer']} stage {row['stage']}"
            assert (planned.weights, planned.grads, planned.optimizer, len(tensors)) == \
                (row["weights"], row["grads"], row["optimizer_bytes"], row["tensors"]), case
            stages.add((row["layout"], row["stage"]))
    assert ("pp2", 0) in stages and ("pp2", 1) in stages
