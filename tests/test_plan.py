"""The run planner (training/plan/model.py, tools/plan.py): memory per rank against the real tensors, activations
against what autograd really saves, the CLI, the search and the start-up block."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest

from training.plan import Layout, param_specs, rank_tensors, state_bytes

pytestmark = pytest.mark.megatron  # the HC probe and the exactness worker build Megatron modules

DIST_LAYOUTS = {"dp2": dict(tp=1, pp=1, ep=1), "tp2sp": dict(tp=2, pp=1, ep=1, sp=True),
                "ep2": dict(tp=1, pp=1, ep=2), "pp2": dict(tp=1, pp=2, ep=1)}


def test_state_bytes_equal_the_real_tensors_on_every_rank(run_torchrun, tmp_path):
    """Weights, gradients and optimizer state of every tiny-moe variant, AdamW and Muon, DP = 2, TP = 2 + SP,
    EP = 2 and PP = 2 under gloo, and where DP = 2 both optimizers with their state sharded over DP (the owners
    of training.optim): the plan equals Σ numel·element_size of the real tensors on each rank (one torchrun
    launch for all 216 rank-cases, tests/dist/plan_worker.py)."""
    from models.zoo import load_preset

    out = tmp_path / "state.json"
    run_torchrun("tests/dist/plan_worker.py", nproc=2, args=(str(out),), timeout=300)
    rows = [row for r in (0, 1) for row in json.loads((tmp_path / f"state.json.rank{r}").read_text())]
    assert len(rows) == 2 * (len(DIST_LAYOUTS) + 2) * 9 * 2  # DP2 and EP2 (DP = 2) also sharded
    sharded = [r for r in rows if r["sharded"]]
    assert {r["dp_rank"] for r in sharded} == {0, 1}
    stages = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for row in rows:
            preset = load_preset(f"tiny-moe:{row['variant']}")
            lay = Layout(gpus=2, gpu=False, bf16=False, optimizer=row["optimizer"],
                         distributed_optimizer=row["sharded"], **DIST_LAYOUTS[row["layout"]])
            tensors = rank_tensors(param_specs(preset, 256), lay, row["stage"])
            planned = state_bytes(tensors, lay, dp_rank=row["dp_rank"])
            case = f"{row['layout']} {row['variant']} {row['optimizer']} sharded={row['sharded']} stage {row['stage']}"
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

    with open(os.path.join(trained_xhc, "stdout.log"), encoding="utf-8") as f:
        block = [line for line in f.read().splitlines() if line.startswith("[plan]")]
    assert len(block) >= 7
    assert main(["--gpu", "cpu", "--gpus", "1", *pretrain_args(trained_xhc)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    assert printed == block
    with open(os.path.join(trained_xhc, "metrics.jsonl"), encoding="utf-8") as f:
        first = next(json.loads(line) for line in f if '"kind": "train"' in line)
    assert first["step"] == 1 and first["measured_peak_source"].startswith("cpu")
    assert abs(first["plan_peak_gib"] / first["measured_peak_gib"] - 1) <= 0.10, first


# ------------------------------------------------------------------------------------------------
# Fast: the CLI, the search, one source of truth for FLOPs and bytes
# ------------------------------------------------------------------------------------------------
def _tiny(*overrides):
    from training.config import load_config

    return load_config(None, ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=256", *overrides])


@pytest.mark.parametrize("argv, fragment", [
    (["--gpus", "8", "--gpu", "v100"], "--gpu 'v100'"),
    (["--gpu", "h100"], "--gpus is required"),
    (["--gpus", "8", "parallel.tpp=2"], "parallel.tpp"),
    (["--gpus", "3", "parallel.tp=2"], "parallel"),
    (["--gpus", "8", "--eff", "gemm=fast"], "--eff"),
    (["--gpus", "8", "--gpu", "cpu", "--search"], "--gpu cpu"),
])
def test_bad_input_is_one_line_exit_2(argv, fragment, capsys):
    from tools.plan import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err


def test_flops_and_bytes_come_from_the_accounting(capsys):
    """The time model's FLOPs per token are training's MFU numerator (xhc.accounting via training.run.metrics),
    which is tools.zoo's column at the same sequence and vocabulary; its HC term is the accounted traffic."""
    import dataclasses

    from models.zoo import backbone_shape
    from training.plan import GPUS, Efficiencies, make_plan
    from xhc.accounting import memory_traffic_summary, training_flops_per_token, vanilla_flops_per_token

    cfg = _tiny("batch.micro_batch_size=2", "batch.global_batch_size=8", "batch.seq_length=64")
    eff = Efficiencies(gemm=0.5, hbm=0.5, link=0.5)
    plan = make_plan(cfg, 2, GPUS["h100"], eff)
    from training.plan import load_run_preset

    preset = load_run_preset(cfg)
    shape = dataclasses.replace(backbone_shape(preset), seq_len=64, vocab=256)
    want = vanilla_flops_per_token(shape, "megatron") + training_flops_per_token(preset.hc, 64, 4).f_hc
    assert plan.time.flops_per_token == pytest.approx(want, rel=1e-12)
    tokens = 8 * 64
    # the time model's GEMM inventory (shapes per rank, two ranks of DP) runs exactly the accounting's backbone
    # FLOPs: every term but the norms' 6·(2C·L + C + 2d·L for QK-norm), which are no GEMMs
    from training.plan.gpu_model import gemm_inventory, model_dims

    D = model_dims(preset)
    inv = gemm_inventory(D, plan.lay, list(range(4)), True, True, plan.lay.num_micro)
    norms = 6 * ((2 * 4 + 1) * preset.hidden_size + (2 * D.d * 4 if D.qk_norm else 0))
    assert sum(g.flops for g in inv) * 2 / tokens + norms + training_flops_per_token(preset.hc, 64, 4).f_hc == \
        pytest.approx(want, rel=1e-12)
    assert plan.time.gemm >= sum(g.flops for g in inv if g.kind == "gemm") / (989e12 * eff.gemm)
    traffic = memory_traffic_summary(preset.hc).total  # elements of C per sublayer, forward
    hbm = traffic * 64 * 2 * 3 * 2 * 4 * (tokens / 2) / (3.35e12 * 0.5)  # bf16, x3 training, 2 sublayers, 4 layers
    assert plan.time.hc_memory == pytest.approx(hbm, rel=1e-12)


def test_weights_sum_to_the_zoo_count():
    """Summed over the pipeline stages, the plan's parameters are tools.zoo's count of the real model."""
    import contextlib
    import io

    from models.parallel import initialize_parallel
    from tools.zoo import zoo_row
    from training.plan import Layout, param_specs, rank_tensors
    from models.zoo import load_preset

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        initialize_parallel(1, 1, 1)
        row = zoo_row("tiny-moe:xhc-flash4")
    preset = load_preset("tiny-moe:xhc-flash4")
    specs = param_specs(preset, preset.vocab_size)
    lay = Layout(gpus=2, pp=2)
    assert sum(math.prod(sh) for st in (0, 1) for _, sh in rank_tensors(specs, lay, st)) == row["total"]


def test_sharded_muon_uses_the_owner_assignment():
    """Sharded Muon (issue #44): every parameter's master + state on one DP rank, the ranks' loads summing to
    the replicated figure and the most loaded at most the even split plus the largest item."""
    from models.zoo import load_preset
    from training.plan import Layout, param_specs, rank_tensors, state_bytes

    preset = load_preset("tiny-moe:xhc")
    specs = param_specs(preset, 256)
    rep = Layout(gpus=4, optimizer="muon", distributed_optimizer=False)
    tensors = rank_tensors(specs, rep, 0)
    full = state_bytes(tensors, rep).optimizer
    sh = dataclasses.replace(rep, sharded_muon=True)
    # one DP group (no EP): the loads of the four ranks partition the replicated bytes
    loads = [state_bytes(tensors, sh, dp_rank=r).optimizer for r in range(4)]
    assert sum(loads) == full
    assert max(loads) == state_bytes(tensors, sh).optimizer < full / 2


@pytest.mark.slow
def test_search_returns_only_layouts_training_accepts():
    from training.config import validate_runtime
    from training.plan import GPUS, Efficiencies, load_run_preset
    from tools.plan import search

    cfg = _tiny("batch.micro_batch_size=1", "batch.global_batch_size=16", "batch.seq_length=64")
    rows = search(cfg, 4, GPUS["h100"], Efficiencies())
    assert 0 < len(rows) <= 10
    tps = [r[0] for r in rows]
    assert tps == sorted(tps, reverse=True)
    for _, key, plan, c in rows:
        assert validate_runtime(c, 4, load_run_preset(c), cuda=True) == plan.lay.dp
        assert plan.fits


def _cluster(path):
    import re

    with open(path, encoding="utf-8") as f:
        m = re.search(r"^# cluster: (\d+) x (\w+)", f.read(), re.M)
    assert m, f"{path}: no '# cluster: <GPUs> x <gpu kind>' comment"
    return int(m.group(1)), m.group(2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe-18b-xhc", "moe-18b-xhc-muon", "moe-2p5b-nsweep"])
def test_shipped_configs_fit_their_clusters(name):
    """Each paper config names its cluster in a comment and fits it per the plan."""
    from configs import config_dir
    from training.config import load_config
    from training.plan import GPUS, make_plan

    path = str(config_dir("pretrain") / f"{name}.yaml")
    gpus, kind = _cluster(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(load_config(path), gpus, GPUS[kind])
    assert plan.fits, plan.format()


@pytest.mark.slow
def test_readme_multi_node_examples_use_a_layout_the_planner_accepts():
    """Every ``torchrun ... -m training.pretrain --config`` command of the README plans and fits on H100s."""
    import os
    import re
    import shlex

    from training.config import load_config
    from training.plan import GPUS, make_plan

    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md"), encoding="utf-8").read()
    cmds = [c for c in re.sub(r"\\\n\s*", " ", readme).splitlines() if "torchrun" in c and "--config" in c]
    assert cmds
    for cmd in cmds:
        words = shlex.split(cmd.split("#")[0])
        nodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words else 1
        per = int(words[words.index("--nproc_per_node") + 1])
        i = words.index("--config")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(load_config(words[i + 1], [w for w in words[i + 2:] if "=" in w]), nodes * per, GPUS["h100"])
        assert plan.fits, (cmd, plan.format())


def test_hbm_default_is_the_geometric_mean_of_the_measured_hc_units():
    """docs/planning.md: the default HBM fraction is calibrated on docs/gpu.md's compile-path HC units (mHC,
    xHC, Flash-4sub); the plain add's fraction is computed from its own bytes and time."""
    from bench.plan_calibration import hc_units
    from training.plan import Efficiencies

    rows = {r[0]: r for r in hc_units()}
    assert rows["plain residual add (3C)"][2] == 3 * 2048 * 8192 * 2 * 3
    hc = [rows[k][4] for k in ("mHC N=4 sublayer", "xHC MLP sublayer", "Flash-4sub window")]
    assert Efficiencies().hbm == pytest.approx(math.prod(hc) ** (1 / 3), abs=0.005)


@pytest.mark.slow
def test_sharded_muon_bench_prints_the_planners_bytes(capsys):
    """``python -m bench.sharded_muon bytes`` (moe-18b:xhc-muon on its 64 GPUs) prints, per stage, the
    planner's replicated and fullest-rank sharded optimizer bytes (one source of the figures)."""
    import dataclasses
    import re

    from bench.sharded_muon import CONFIG, state_bytes as bench_bytes
    from training.config import load_config
    from training.plan import layout_from_config, load_run_preset, param_specs, planned_vocab, rank_tensors, state_bytes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bench_bytes([], 64)
        cfg = load_config(CONFIG, [])
        preset = load_run_preset(cfg)
        sh = layout_from_config(cfg, preset, 64, gpu=True, sharded_muon=True)
        rep = dataclasses.replace(sh, sharded_muon=False, distributed_optimizer=False)
        specs = param_specs(preset, planned_vocab(cfg, preset, sh.tp))
        out = capsys.readouterr().out
        rows = re.findall(r"stage (\d) .*?replicated +([\d.]+) GB; sharded +([\d.]+) GB on the fullest", out)
        assert len(rows) == sh.pp, out  # one row per pipeline stage of the recipe's layout
        for stage, replicated, fullest in rows:
            tensors = rank_tensors(specs, sh, int(stage))
            assert float(replicated) == round(state_bytes(tensors, rep).optimizer / 1e9, 2)
            assert float(fullest) == round(state_bytes(tensors, sh).optimizer / 1e9, 2)
            assert float(fullest) < 0.6 * float(replicated)  # sharded over DP (and expert-DP): well under half
