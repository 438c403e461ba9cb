"""Time to loss in the sweep (issue 52): ``tools.sweep fit --gpu KIND --gpus G`` gives each compute multiplier
also in GPU-hours, from each variant's planned step time (training.plan.make_plan, computed here on its own)
or from the tokens/s its arms logged on that hardware, which take precedence."""

import json
import os
import warnings

import pytest
import yaml

from tools.sweep import fit_sweep, load_sweep, variant_times
from tools.sweep.collect import read_hardware

GPUS = 2
# a tiny backbone whose layout (DP = 2, micro-batch 1) is valid on 2 GPUs
MICRO = {
    "data": {"mock": True},
    "tokenizer": {"type": "none", "vocab_size": 128},
    "model": {"backbone": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
                           "kv_channels": 16, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 16,
                           "moe_shared_expert_intermediate_size": 16, "seq_length": 32}},
    "batch": {"micro_batch_size": 1, "global_batch_size": 4},
}
H100 = {"device_name": "NVIDIA H100 80GB HBM3", "devices": GPUS}


def _sweep(tmp_path, variants, fit=None):
    spec = {"name": "t", "out_dir": str(tmp_path / "out"), "overrides": MICRO, "grid": {"variants": variants,
            "steps": [10, 20, 40]}, "fit": fit or {"E": 1.0, "baselines": ["vanilla"], "bootstrap": 8}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_sweep(str(path))


def _rows(sweep, A, alpha=0.3, E=1.0, hardware=None, tokens_per_s=None):
    """Finished arms on known laws L = E + A_v·C^(−α); ``hardware``/``tokens_per_s``: per variant, as logged."""
    return [{"arm": a.name, "cell": a.cell, "variant": a.variant, "size": a.size, "N": a.n, "k": a.k, "steps": a.steps,
             "seed": a.seed, "state": "finished", "compute": a.compute, "tokens": a.tokens,
             "flops_per_token": a.flops_per_token, "params_activated": a.params_activated,
             "valid_loss": E + A[a.variant] * a.compute ** -alpha, "train_loss": E + A[a.variant] * a.compute ** -alpha,
             "hardware": (hardware or {}).get(a.variant), "tokens_per_s": (tokens_per_s or {}).get(a.variant),
             "reason": ""} for a in sweep.arms]


def _planned_seconds_per_token(sweep, variant):
    """Wall seconds per token of the variant's largest arm on GPUS H100s: the planner's step time / tokens per
    step, planned here from the arm's own overrides."""
    from training.config import load_config
    from training.plan import GPUS as KINDS, make_plan

    arm = max((a for a in sweep.arms if a.variant == variant), key=lambda a: a.compute)
    cfg = load_config(None, [*arm.overrides, "run.device=auto"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(cfg, GPUS, KINDS["h100"])
    return plan.time.total / (arm.tokens / arm.steps), arm.flops_per_token


def test_gpu_hour_multiplier_follows_the_planned_step_times(tmp_path):
    """M_GPU-h = (tokens_b(L)·t_b) / (tokens_x(L)·t_x): the tokens each variant needs for the baseline's loss
    (fitted compute / FLOPs per token) times its planned seconds per token; GPU-hours = tokens·t·G / 3600."""
    sweep = _sweep(tmp_path, {"vanilla": {"preset": "tiny-moe:vanilla"}, "mhc": {"preset": "tiny-moe:mhc", "n": 4}})
    rows = _rows(sweep, {"vanilla": 200.0, "mhc": 150.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = variant_times(sweep, rows, "h100", GPUS)
    res = fit_sweep(sweep, rows, log=lambda _m: None, plots=False, times=times)
    (m,) = res["multipliers"]
    assert (m["baseline"], m["variant"]) == ("vanilla", "mhc")
    t_b, f_b = _planned_seconds_per_token(sweep, "vanilla")
    t_x, f_x = _planned_seconds_per_token(sweep, "mhc")
    law = res["laws"]
    c_b = m["at"]["compute"]
    L = law["vanilla"]["E"] + law["vanilla"]["A"] * c_b ** -law["vanilla"]["alpha"]
    c_x = (law["mhc"]["A"] / (L - law["mhc"]["E"])) ** (1 / law["mhc"]["alpha"])
    expected = (c_b / f_b * t_b) / (c_x / f_x * t_x)
    g = m["gpu_hours"]
    assert g["multiplier"] == pytest.approx(expected, rel=1e-9)
    assert g["baseline"] == pytest.approx(c_b / f_b * t_b * GPUS / 3600, rel=1e-9)
    assert g["variant"] == pytest.approx(c_x / f_x * t_x * GPUS / 3600, rel=1e-9)
    # the FLOP multiplier is unchanged, and the two variants' GPU time per FLOP differ, so GPU-hours do too
    assert m["multiplier"] == pytest.approx(c_b / c_x, rel=1e-6)
    assert g["multiplier"] != pytest.approx(m["multiplier"], rel=1e-3)
    assert g["interval"][0] <= g["multiplier"] <= g["interval"][1]
    assert {v["source"] for v in res["gpu_time"]["variants"].values()} == {"planned"}
    md = (tmp_path / "out" / "summary" / "fit.md").read_text()
    assert f"Time to loss on {GPUS}x h100" in md and "| vanilla | mhc |" in md.split("GPU-hour multiplier")[1]
    saved = json.loads((tmp_path / "out" / "summary" / "fit.json").read_text())
    assert saved["multipliers"][0]["gpu_hours"]["multiplier"] == pytest.approx(expected, rel=1e-9)


def test_measured_tokens_per_s_take_precedence_on_the_same_hardware(tmp_path):
    """Arms that logged tokens/s on GPUS H100s set their variant's time; arms on other hardware (an A100, or
    another GPU count) leave the plan in place."""
    sweep = _sweep(tmp_path, {"vanilla": {"preset": "tiny-moe:vanilla"}, "mhc": {"preset": "tiny-moe:mhc", "n": 4},
                              "mhc8": {"preset": "tiny-moe:mhc", "n": 8}})
    hw = {"vanilla": H100, "mhc": {"device_name": "NVIDIA A100-SXM4-80GB", "devices": GPUS},
          "mhc8": {"device_name": "NVIDIA H100 80GB HBM3", "devices": 4 * GPUS}}
    tps = {"vanilla": 12345.0, "mhc": 999.0, "mhc8": 999.0}
    rows = _rows(sweep, {"vanilla": 200.0, "mhc": 150.0, "mhc8": 150.0}, hardware=hw, tokens_per_s=tps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = variant_times(sweep, rows, "h100", GPUS)
    assert times["vanilla"].source == "measured" and times["vanilla"].measured_arms == 3
    assert times["vanilla"].tokens_per_s == pytest.approx(12345.0)
    assert times["vanilla"].planned_tokens_per_s != pytest.approx(12345.0)
    for v in ("mhc", "mhc8"):
        t, f = _planned_seconds_per_token(sweep, v)
        assert times[v].source == "planned" and times[v].tokens_per_s == pytest.approx(1 / t, rel=1e-12)
    res = fit_sweep(sweep, rows, log=lambda _m: None, plots=False, times=times)
    m = next(x for x in res["multipliers"] if x["variant"] == "mhc")
    t_x, f_x = _planned_seconds_per_token(sweep, "mhc")
    f_b = next(a.flops_per_token for a in sweep.arms if a.variant == "vanilla")
    # GPU-seconds per FLOP: G / (F · tokens/s) for both sides; the ratio scales the FLOP multiplier
    ratio = (GPUS / (f_b * 12345.0)) / (GPUS * t_x / f_x)
    assert m["gpu_hours"]["multiplier"] == pytest.approx(m["multiplier"] * ratio, rel=1e-9)


def test_collect_reads_the_logged_hardware(tmp_path):
    """collect's ``hardware`` comes from the ``setup`` records training writes at each start; starts on two
    machines give none (their tokens/s mix both)."""
    path = tmp_path / "metrics.jsonl"
    setup = {"kind": "setup", "step": 0, "devices": 16, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    path.write_text(json.dumps(setup) + "\n" + json.dumps({"kind": "train", "step": 1, "loss": 3.0}) + "\n")
    assert read_hardware(str(path)) == {"device_name": "NVIDIA H100 80GB HBM3", "devices": 16}
    with open(path, "a") as f:
        f.write(json.dumps(dict(setup, step=1)) + "\n")   # resumed on the same machine
    assert read_hardware(str(path)) == {"device_name": "NVIDIA H100 80GB HBM3", "devices": 16}
    with open(path, "a") as f:
        f.write(json.dumps(dict(setup, step=2, devices=8)) + "\n")
    assert read_hardware(str(path)) is None
    assert read_hardware(str(tmp_path / "absent.jsonl")) is None


def test_paper_laws_give_the_published_multipliers_and_their_gpu_hours(tmp_path, capsys):
    """``--laws paper``: [xHC]'s published L(C) on the sweep's vanilla, mHC N=4 and xHC N=16 k=4 arms give its
    multipliers 1.410 and 1.113 at 4.0e20 FLOPs (docs/math.md §6.5), each beside its GPU-hour multiplier."""
    from tools.sweep import main

    sweep = _sweep(tmp_path, {"vanilla": {"preset": "tiny-moe:vanilla"}, "mhc-n4": {"preset": "tiny-moe:mhc", "n": 4},
                              "xhc-n16": {"preset": "tiny-moe:xhc", "n": 16, "k": 4, "m": 2},
                              "mhc-n2": {"preset": "tiny-moe:mhc", "n": 2}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["fit", "--config", sweep.path, "--laws", "paper", "--gpu", "h100", "--gpus", str(GPUS)]) == 0
    out = capsys.readouterr().out
    assert "vanilla needs 1.410x the compute of xhc-n16" in out
    assert "mhc-n4 needs 1.113x the compute of xhc-n16" in out
    from xhc.scaling import PAPER_FITS, compute_multiplier

    t_x, f_x = _planned_seconds_per_token(sweep, "xhc-n16")
    for b, law, published in (("vanilla", "vanilla", 1.410), ("mhc-n4", "mhc", 1.113)):
        t_b, f_b = _planned_seconds_per_token(sweep, b)
        line = next(ln for ln in out.splitlines() if ln.startswith(f"| {b} | xhc-n16 |"))
        assert abs(float(line.split("|")[3]) - published) <= 5e-4
        exact = compute_multiplier(PAPER_FITS[law], PAPER_FITS["xhc"], 4.0e20)
        assert float(line.split("|")[4]) == pytest.approx(exact * (t_b / f_b) / (t_x / f_x), abs=6e-4)  # 3 decimals
    assert "mhc-n2" not in out.split("Time to loss")[1]  # no published law: not timed
    assert not os.path.exists(tmp_path / "out" / "summary" / "fit.json")  # nothing fitted, nothing written


def test_bad_gpu_options_fail_in_one_line(tmp_path, capsys):
    from tools.sweep import main

    sweep = _sweep(tmp_path, {"vanilla": {"preset": "tiny-moe:vanilla"}, "mhc": {"preset": "tiny-moe:mhc", "n": 4}})
    assert main(["fit", "--config", sweep.path, "--no-plots", "--gpu", "tpu9", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpu 'tpu9' is not in the planner's GPU table" in err
    # 3 GPUs: DP 3 does not divide the global batch of 4 -> the arm cannot be planned there
    assert main(["fit", "--config", sweep.path, "--no-plots", "--gpu", "h100", "--gpus", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be planned on 3x h100" in err and "batch.global_batch_size" in err
    assert main(["fit", "--config", sweep.path, "--no-plots", "--gpus", "3"]) == 2
    assert "together with --gpu" in capsys.readouterr().err


@pytest.mark.slow
def test_training_logs_the_hardware_it_ran_on(trained_xhc):
    """The shared trained run (one CPU process, tests/trained_run.py) wrote its ``setup`` record: what collect
    reads as the arm's hardware."""
    assert read_hardware(os.path.join(trained_xhc, "metrics.jsonl")) == {"device_name": "cpu", "devices": 1}
    with open(os.path.join(trained_xhc, "metrics.jsonl"), encoding="utf-8") as f:
        setup = next(r for r in map(json.loads, f) if r.get("kind") == "setup")
    assert setup["device"] == "cpu" and setup["precision"] == "fp32" and setup["tokens_per_step"] > 0
