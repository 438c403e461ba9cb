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


VARIANTS = ("vanilla", "hc", "mhc", "mhc-lite", "kromhc", "identity", "xhc", "xhc-flash", "xhc-flash4")


@pytest.fixture(scope="module")
def single_rank():
    import contextlib
    import io

    from models.parallel import destroy_parallel, initialize_parallel

    with contextlib.redirect_stdout(io.StringIO()):
        initialize_parallel(1, 1, 1)
    yield
    destroy_parallel()


def _measured_activations(variant, n, hc_recompute, seq, batch=2, vocab=256):
    import torch

    from models.zoo import build_model, build_transformer_config, load_preset
    from training.plan import SavedTensorMeter

    preset = load_preset(f"tiny-moe:{variant}", backbone_overrides={"hc_recompute": hc_recompute},
                         hc_overrides={"n": n} if variant != "vanilla" else None)
    model = build_model(preset, build_transformer_config(preset, cpu=True), vocab_size=vocab, seq_length=seq)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    pos = torch.arange(seq).expand(batch, seq)
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        model(tokens, pos, None, labels=tokens).float().mean()
    return preset, meter.bytes


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.parametrize("variant", VARIANTS)
def test_activations_within_ten_percent_of_what_backward_saves(single_rank, variant):
    """One micro-batch on CPU: the planned activations are within ±10 % of the bytes autograd saves (unique
    storages, parameters excluded), with and without HC recompute, at two sequence lengths and two N; the
    growth with N and with the sequence length matches within 10 % too."""
    from training.plan import Layout, activation_bytes

    ns = (8, 16) if variant.startswith("xhc") else (3, 4) if variant == "mhc-lite" else (4, 8)  # mHC-lite: n <= 6
    for rec in (False, True):
        got = {}
        for n in ns:
            for seq in (32, 64):
                preset, measured = _measured_activations(variant, n, rec, seq)
                lay = Layout(gpus=1, gpu=False, bf16=False, micro_batch=2, global_batch=2, seq=seq, hc_recompute=rec,
                             vocab=256)
                planned = activation_bytes(preset, lay, 0).total
                got[n, seq] = (planned, measured)
                assert abs(planned / measured - 1) <= 0.10, (variant, n, rec, seq, planned, measured)
        for (pa, ma), (pb, mb) in (((got[ns[0], 32]), got[ns[0], 64]), (got[ns[0], 64], got[ns[1], 64])):
            if mb != ma:
                assert abs((pb - pa) / (mb - ma) - 1) <= 0.10, (variant, rec, pa, pb, ma, mb)


@pytest.mark.slow
def test_startup_block_equals_the_tools_output_and_first_step_records_the_peak(trained_xhc, capsys):
    """The shared trained run (tests/trained_run.py) printed the plan at start-up: the same lines as
    ``python -m tools.plan --gpu cpu --gpus 1`` with the run's overrides; its first metrics record holds the
    planned and the measured peak memory, within 10 % of each other."""
    import os

    from tests.trained_run import pretrain_args
    from tools.plan import main

    with open(os.path.join(trained_xhc, "run", "stdout.log"), encoding="utf-8") as f:
        block = [line for line in f.read().splitlines() if line.startswith("[plan]")]
    assert len(block) >= 7
    assert main(["--gpu", "cpu", "--gpus", "1", *pretrain_args(os.path.join(trained_xhc, "run"))]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    assert printed == block
    with open(os.path.join(trained_xhc, "run", "metrics.jsonl"), encoding="utf-8") as f:
        first = next(json.loads(line) for line in f if '"kind": "train"' in line)
    assert first["step"] == 1 and first["measured_peak_source"].startswith("cpu")
    assert abs(first["plan_peak_gib"] / first["measured_peak_gib"] - 1) <= 0.10, first
