"""Scaling-law sweeps (the tools.sweep package): sweep files, SLURM arrays, collect, fit, and
a killed-then-rerun local sweep that does not redo finished arms."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tools.sweep import SweepError, collect, fit_sweep, load_sweep, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A very small backbone on Megatron's mock data: an arm of 3 steps trains in seconds.
MICRO = {
    "overrides": {
        "data": {"mock": True},
        "tokenizer": {"type": "none", "vocab_size": 128},
        "model": {"backbone": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
                               "kv_channels": 16, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 16,
                               "moe_shared_expert_intermediate_size": 16, "seq_length": 32}},
        "batch": {"micro_batch_size": 2, "global_batch_size": 2},
        "schedule": {"warmup_steps": 1},
        "run": {"eval_interval": 0, "eval_iters": 1},
        "logging": {"tensorboard": False, "plot": False, "hc_health_interval": 0},
        "checkpoint": {"interval": 2, "save_final": False, "checksum": "none"},
    },
    "executor": {"threads": 1},
}


def write_sweep(tmp_path, grid, **extra):
    spec = {"name": "t", "out_dir": str(tmp_path / "out"), **MICRO, "grid": grid, **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


# ------------------------------------------------------------------------------------------------
# Sweep files
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grid, extra, match", [
    ({"variants": {"v": {"preset": "tiny-moe:vanilla"}}, "steps": [3], "widths": [1]}, {}, "unknown grid axis 'widths'"),
    ({}, {}, "grid is missing or empty"),
    ({"variants": {}, "steps": [3]}, {}, "grid.variants is empty"),
    ({"variants": {"v": {"preset": "tiny-moe:vanilla"}}, "steps": []}, {}, "grid.steps must be a non-empty list"),
    ({"variants": {"x": {"preset": "tiny-moe:xhc", "n": 2, "k": 4}}, "steps": [3]}, {}, "arm x-3st: model preset tiny-moe:xhc"),
    ({"variants": {"x": {"preset": "tiny-moe:nope"}}, "steps": [3]}, {}, "has no variant 'nope'"),
    ({"variants": {"v": {"preset": "tiny-moe:vanilla", "lr": 1}}, "steps": [3]}, {}, "unknown key 'lr'"),
    ({"variants": {"v": {"preset": "tiny-moe:vanilla"}}, "steps": [3]}, {"fits": {}}, "unknown key 'fits'"),
    ({"variants": {"v": {"preset": "tiny-moe:vanilla"}}, "steps": [3]}, {"fit": {"baselines": ["mhc"]}},
     "fit.baselines names 'mhc'"),
])
def test_bad_sweep_files_fail_before_anything_starts(tmp_path, grid, extra, match):
    """One-line error naming the file and the key; no output directory is created."""
    path = write_sweep(tmp_path, grid, **extra)
    with pytest.raises(SweepError, match=match) as e:
        load_sweep(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"sweep file {path}")
    assert not (tmp_path / "out").exists()


def test_bad_pretrain_override_names_the_arm(tmp_path):
    path = write_sweep(tmp_path, {"variants": {"v": {"preset": "tiny-moe:vanilla",
                                                     "overrides": {"optimizer.lr": -1}}}, "steps": [3]})
    with pytest.raises(SweepError, match=r"arm v-3st: config key optimizer.lr"):
        load_sweep(path)


def test_cli_reports_one_line_error(tmp_path, capsys):
    from tools.sweep import main

    path = write_sweep(tmp_path, {"variants": {}, "steps": [3]})
    assert main(["run", "--config", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sweep file") and "\n" not in err


@pytest.mark.slow
def test_shipped_sweeps_resolve():
    """configs/sweeps/*.yaml: the grid of the issue, with the accounting of every arm."""
    tiny = load_sweep(os.path.join(REPO, "configs", "sweeps", "tiny-cpu.yaml"), out_dir="/nonexistent/t")
    assert {(a.family, a.n) for a in tiny.arms} == {("vanilla", 1), ("mhc", 4), ("xhc", 4), ("xhc", 16)}
    assert len({a.steps for a in tiny.arms}) == 3 and len(tiny.arms) == 36
    assert len({a.seed for a in tiny.arms}) >= 3  # seed noise is measured (issue #28)
    assert len({a.cell for a in tiny.arms}) == 12
    for a in tiny.arms:
        assert a.compute == a.flops_per_token * a.tokens
        assert a.tokens == a.steps * 8 * 128  # global batch 8, sequence 128
    # at equal steps, compute grows with N within a family (F_HC grows with N)
    x = sorted((a.n, a.compute) for a in tiny.arms if a.family == "xhc" and a.steps == 40 and a.seed == 1)
    assert [c for _, c in x] == sorted(c for _, c in x)
    paper = load_sweep(os.path.join(REPO, "configs", "sweeps", "paper-2p5b.yaml"), out_dir="/nonexistent/p")
    assert {a.n for a in paper.arms if a.family == "xhc"} == {2, 4, 8, 16}
    assert all(a.nproc == 16 for a in paper.arms)


# ------------------------------------------------------------------------------------------------
# SLURM
# ------------------------------------------------------------------------------------------------
def test_slurm_dry_run_is_one_array_with_one_arm_per_task(tmp_path, capsys):
    from tools.sweep import main

    path = write_sweep(tmp_path, {"variants": {"vanilla": {"preset": "tiny-moe:vanilla"},
                                               "mhc": {"preset": "tiny-moe:mhc", "n": 2}}, "steps": [3, 6]},
                       executor={"slurm": {"nodes": 2, "sbatch_args": ["--time=1:00:00"]}})
    assert main(["run", "--config", path, "--executor", "slurm", "--dry-run"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sbatch" in ln]
    assert len(lines) == 1
    line = lines[0]
    assert "--array 0-3 " in line and "--nodes 2" in line and "--time=1:00:00" in line
    assert line.rstrip().split()[-2].endswith("tools/slurm_pretrain.sh")
    arms_file = tmp_path / "out" / "slurm_arms.jsonl"
    assert f"XHC_SWEEP_ARMS={arms_file}" in line
    arms = [json.loads(x) for x in arms_file.read_text().splitlines()]
    sweep = load_sweep(path)
    assert [a["name"] for a in arms] == [a.name for a in sweep.arms]
    dirs = [next(o for o in a["overrides"] if o.startswith("run.dir=")) for a in arms]
    assert len(set(dirs)) == 4
    # the script's own extraction line gives task i exactly arm i's overrides
    src = open(os.path.join(REPO, "tools", "slurm_pretrain.sh")).read().splitlines()
    extract = next(ln for ln in src if "XHC_SWEEP_ARMS" in ln and "mapfile" in ln)
    script = extract + '\nprintf "%s\\n" "${arm_overrides[@]}"'
    out = subprocess.run(["bash", "-c", script], env={**os.environ, "XHC_SWEEP_ARMS": str(arms_file),
                                                      "SLURM_ARRAY_TASK_ID": "2"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == arms[2]["overrides"]
    # a finished arm drops out of the next array
    fin = sweep.arms[0].run_dir
    os.makedirs(fin)
    (tmp_path / "out" / "arms" / sweep.arms[0].name / "status.json").write_text(json.dumps({"finished": True}))
    assert main(["run", "--config", path, "--executor", "slurm", "--dry-run"]) == 0
    assert "--array 0-2 " in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Collect and fit on hand-made arm directories
# ------------------------------------------------------------------------------------------------
def _write_arm(arm, losses, valid=None, finished=True, state=None, resume_at=None, log_text=None):
    os.makedirs(arm.run_dir, exist_ok=True)
    recs = []
    t = 1000.0
    steps = list(range(1, len(losses) + 1))
    for s in steps:
        t += 1
        recs.append({"kind": "train", "step": s, "time": t, "loss": losses[s - 1], "step_time_s": 0.5})
    if resume_at is not None:  # a resume replays the steps after the checkpoint: stale values first
        recs = [dict(r, loss=99.0) if r["step"] > resume_at else r for r in recs]
        recs.append({"kind": "event", "event": "resume", "step": resume_at, "checkpoint": "ckpt"})
        recs += [{"kind": "train", "step": s, "time": t + s, "loss": losses[s - 1], "step_time_s": 0.5}
                 for s in steps if s > resume_at]
    if valid is not None:
        recs.append({"kind": "eval", "step": len(losses), "time": t + 100, "loss": valid})
    with open(os.path.join(arm.run_dir, "metrics.jsonl"), "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    if finished is not None:
        with open(os.path.join(arm.run_dir, "status.json"), "w") as f:
            json.dump({"finished": finished, "step": len(losses), "stopped_early": None if finished else "signal"}, f)
    if state:
        log = os.path.join(arm.run_dir, "train.log")
        with open(log, "w") as f:
            f.write(log_text or "error: boom\n")
        with open(os.path.join(arm.run_dir, "sweep_arm.json"), "w") as f:
            json.dump({"state": state, "returncode": 1, "log": log, "pid": None, "wall_s": 12.0}, f)


def test_read_metrics_keeps_the_last_occurrence_after_a_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"kind": "train", "step": s, "loss": 10.0 - s} for s in (1, 2, 3, 4)]
    rows.append({"kind": "event", "event": "resume", "step": 2, "checkpoint": "c"})
    rows += [{"kind": "train", "step": s, "loss": 20.0 + s} for s in (3, 4, 5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"kind\": \"tr")  # a line cut by a crash
    train, _ = read_metrics(str(path))
    assert sorted(train) == [1, 2, 3, 4, 5]
    assert [train[s]["loss"] for s in (1, 2, 3, 4, 5)] == [9.0, 8.0, 23.0, 24.0, 25.0]


@pytest.mark.slow
def test_collect_and_fit_handle_unfinished_and_crashed_arms(tmp_path, capsys):
    """Losses on known laws L = E + A·C^(−α) (shared E): the fit recovers the multiplier
    (A_b/A_x)^(1/α) of equal-α variants; unfinished and crashed arms are listed and excluded."""
    from tools.sweep import main

    path = write_sweep(tmp_path, {"variants": {"vanilla": {"preset": "tiny-moe:vanilla"},
                                               "mhc": {"preset": "tiny-moe:mhc", "n": 2},
                                               "bad": {"preset": "tiny-moe:mhc", "n": 4}},
                                  "steps": [10, 20, 40]},
                       fit={"E": "shared", "baselines": ["vanilla"], "bootstrap": 20, "loss": "valid"})
    sweep = load_sweep(path)
    E, alpha, A = 3.0, 0.3, {"vanilla": 200.0, "mhc": 150.0}
    for a in sweep.arms:
        n = a.steps
        if a.variant == "bad":
            if a.steps == 10:
                _write_arm(a, [5.0] * 4, finished=False)                       # unfinished (stopped at 4/10)
            elif a.steps == 20:
                _write_arm(a, [5.0] * 7, finished=None, state="failed",       # crashed
                           log_text="step 7\nerror: training aborted: 11 steps skipped\n")
            continue                                                            # 40: not started
        L = E + A[a.variant] * a.compute ** -alpha
        _write_arm(a, [L + 0.01] * n, valid=L, resume_at=n // 2 if a.steps == 20 else None)
    rows = {r["arm"]: r for r in collect(sweep)}
    assert rows["bad-10st"]["state"] == "unfinished" and "step 4/10" in rows["bad-10st"]["reason"]
    assert rows["bad-20st"]["state"] == "failed"
    assert "train.log" in rows["bad-20st"]["reason"] and "training aborted" in rows["bad-20st"]["reason"]
    assert rows["bad-40st"]["state"] == "not started"
    for r in rows.values():
        assert "\n" not in r["reason"]
    v = rows["vanilla-20st"]
    assert v["state"] == "finished"
    assert v["train_loss"] == pytest.approx(E + 200.0 * v["compute"] ** -alpha + 0.01)  # replayed 99s dropped
    assert v["tokens_per_s"] == pytest.approx(v["tokens"] / 20 / 0.5)
    assert v["params_hc"] == 0 and rows["mhc-20st"]["params_hc"] > 0

    assert main(["collect", "--config", path]) == 0
    out = capsys.readouterr().out
    assert "bad-20st: failed (exit 1)" in out and (tmp_path / "out" / "summary" / "arms.csv").exists()
    assert main(["fit", "--config", path]) == 0
    out = capsys.readouterr().out
    fit = json.loads((tmp_path / "out" / "summary" / "fit.json").read_text())
    assert set(fit["laws"]) == {"vanilla", "mhc"}
    assert set(fit["excluded"]) == {"bad-10st", "bad-20st", "bad-40st"}
    assert fit["laws"]["vanilla"]["E"] == pytest.approx(E, rel=1e-3)
    m = fit["multipliers"][0]
    assert (m["baseline"], m["variant"]) == ("vanilla", "mhc")
    assert m["multiplier"] == pytest.approx((200.0 / 150.0) ** (1 / alpha), rel=1e-3)
    assert m["interval"][0] <= m["multiplier"] * (1 + 1e-6) and m["interval"][1] >= m["multiplier"] * (1 - 1e-6)
    # L(N) at fixed compute: the baseline's largest compute by default, each variant's law there
    c_star = max(r["compute"] for r in rows.values() if r["variant"] == "vanilla")
    assert fit["loss_vs_n"]["compute"] == c_star
    pts = {p["variant"]: p for p in fit["loss_vs_n"]["points"]}
    assert (pts["vanilla"]["N"], pts["mhc"]["N"]) == (1, 2)
    for v in ("vanilla", "mhc"):
        assert pts[v]["loss"] == pytest.approx(E + A[v] * c_star ** -alpha, rel=1e-4)
    for name in ("frontier", "loss_vs_n", "multipliers"):
        assert os.path.getsize(fit["plots"][name]) > 1000
    assert "excluded bad-20st: failed" in out


# ------------------------------------------------------------------------------------------------
# Kill and rerun
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_sweep_resumes_without_redoing_finished_arms(tmp_path):
    """Start `tools.sweep run` on 3 arms, SIGKILL the runner once the first arm has finished, rerun:
    the sweep completes and the finished arm's files are untouched."""
    path = write_sweep(tmp_path, {"variants": {"vanilla": {"preset": "tiny-moe:vanilla"},
                                               "mhc": {"preset": "tiny-moe:mhc", "n": 2},
                                               "xhc": {"preset": "tiny-moe:xhc", "n": 4, "k": 2, "m": 1}},
                                  "steps": [3]})
    sweep = load_sweep(path)
    first = sweep.arms[0]
    status = os.path.join(first.run_dir, "status.json")
    cmd = [sys.executable, "-m", "tools.sweep", "run", "--config", path, "--parallel", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not os.path.exists(status) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert os.path.exists(status), proc.stdout.read().decode()[-2000:] if proc.poll() is not None else "timeout"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    before = {f: (os.stat(os.path.join(first.run_dir, f)).st_mtime_ns,
                  open(os.path.join(first.run_dir, f), "rb").read()) for f in ("status.json", "metrics.jsonl")}
    assert not all(os.path.exists(os.path.join(a.run_dir, "status.json")) for a in sweep.arms)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 already finished" in done.stdout
    after = {f: (os.stat(os.path.join(first.run_dir, f)).st_mtime_ns,
                 open(os.path.join(first.run_dir, f), "rb").read()) for f in ("status.json", "metrics.jsonl")}
    assert after == before
    assert json.load(open(os.path.join(first.run_dir, "sweep_arm.json")))["attempts"] == 1
    rows = collect(sweep)
    assert [r["state"] for r in rows] == ["finished"] * 3
    for r in rows:
        train, _ = read_metrics(os.path.join(tmp_path / "out" / "arms" / r["arm"], "metrics.jsonl"))
        assert sorted(train) == [1, 2, 3]


# ------------------------------------------------------------------------------------------------
# Seeds, noise and honest fits (issue #28)
# ------------------------------------------------------------------------------------------------
def test_fit_report_marks_no_true_difference_within_noise(tmp_path):
    """A synthetic sweep (3 budgets x 3 seeds, two variants of the same law plus one clearly better)
    through the sweep fit: the table has mean ± std per arm, the equal pair is marked within noise
    in fit.md and fit.json, the better one significant, and fit.json records the commit and the
    warnings (E shared on a law with E = 1.8 inside: none about E)."""
    from tools.sweep import Sweep, aggregate

    rng = np.random.default_rng(3)
    rows = []
    for variant, m in (("base", 1.0), ("same", 1.0), ("better", 3.0)):
        for steps, c in zip((40, 80, 160, 320), np.geomspace(1e10, 1e12, 4)):
            for seed in (1, 2, 3):
                loss = (1.8 + 400.0 / m ** 0.3 * c ** -0.3) * np.exp(0.004 * rng.standard_normal())
                rows.append({"arm": f"{variant}-{steps}st-seed{seed}", "cell": f"{variant}-{steps}st",
                             "variant": variant, "size": "base", "N": 1, "k": None, "steps": steps, "seed": seed,
                             "state": "finished", "compute": float(c), "tokens": steps * 1024,
                             "params_activated": 1000, "valid_loss": float(loss), "train_loss": float(loss),
                             "wall_s": 1.0, "cpu_s": 1.0, "commit": "abc123", "data": "d474d474d474", "reason": ""})
    cells = aggregate(rows)
    assert len(cells) == 12 and all(c["n_seeds"] == 3 and c["seeds"] == "3/3" for c in cells)
    c0 = [r["valid_loss"] for r in rows[:3]]
    assert cells[0]["valid_loss_mean"] == pytest.approx(np.mean(c0)) and \
        cells[0]["valid_loss_std"] == pytest.approx(np.std(c0, ddof=1))
    sweep = Sweep(name="syn", path="syn.yaml", base=None, out_dir=str(tmp_path), arms=[],
                  fit={"E": 1.8, "baselines": ["base"], "bootstrap": 20})
    res = fit_sweep(sweep, rows, log=lambda _m: None, plots=False)
    sig = {m["variant"]: m["significance"] for m in res["multipliers"]}
    assert sig == {"same": "within noise", "better": "significant"}
    dl = {p["variant"]: p.get("significance") for p in res["loss_vs_n"]["points"]}
    assert dl == {"base": None, "same": "within noise", "better": "significant"}
    saved = json.loads((tmp_path / "summary" / "fit.json").read_text())
    assert "commit" in saved and saved["arm_commits"] == ["abc123"] and saved["warnings"] == []
    assert saved["arm_data"] == ["d474d474d474"]  # one data set (training.run.run_record): no warning
    md = (tmp_path / "summary" / "fit.md").read_text()
    assert "| base | same |" in md and "within noise" in md.split("| base | same |")[1].splitlines()[0]
    assert "± " in md  # the arms over seeds table


def test_fit_report_carries_warnings(tmp_path):
    """A pure power law with E free on 3 budgets: the bound and underdetermination warnings are in
    the log, fit.json and fit.md, each with its remedy."""
    from tools.sweep import Sweep

    rows = [{"arm": f"v-{s}st", "cell": f"v-{s}st", "variant": "v", "size": "base", "N": 1, "k": None, "steps": s,
             "seed": 1, "state": "finished", "compute": float(c), "tokens": s, "params_activated": 1,
             "valid_loss": float(50.0 * c ** -0.2), "reason": ""}
            for s, c in zip((1, 2, 3), np.geomspace(1e8, 1e12, 3))]
    sweep = Sweep(name="w", path="w.yaml", base=None, out_dir=str(tmp_path), arms=[],
                  fit={"E": "free", "baselines": [], "bootstrap": 10})
    logs = []
    res = fit_sweep(sweep, rows, log=logs.append, plots=False)
    kinds = {w["kind"] for w in res["warnings"]}
    assert {"bound", "underdetermined"} <= kinds
    assert any(line.startswith("[fit] warning:") and "remedy:" in line for line in logs)
    md = (tmp_path / "summary" / "fit.md").read_text()
    assert "Warnings (the fit cannot tell)" in md and "Remedy: add budgets" in md


def test_print_gives_gpu_hours_per_arm_and_seeded_arm_names(tmp_path, capsys):
    """`print` names seeded arms <arm>-seed<S> with run.seed=S, and gives each arm's GPU-hours as
    compute / (peak x MFU), computed here independently from the arm's compute."""
    from tools.sweep import main

    path = write_sweep(tmp_path, {"variants": {"v": {"preset": "tiny-moe:vanilla"}}, "steps": [3, 6],
                                  "seeds": [1, 2]})
    sweep = load_sweep(path)
    assert [a.name for a in sweep.arms] == ["v-3st-seed1", "v-3st-seed2", "v-6st-seed1", "v-6st-seed2"]
    assert [a.seed for a in sweep.arms] == [1, 2, 1, 2] and {a.cell for a in sweep.arms} == {"v-3st", "v-6st"}
    assert main(["print", "--config", path, "--mfu", "0.5", "--peak-tflops", "100"]) == 0
    out = capsys.readouterr().out
    a = sweep.arms[0]
    row = next(ln for ln in out.splitlines() if ln.startswith(a.name))
    assert f"{a.compute / (100e12 * 0.5) / 3600:.4g}" in row.split()
    total = sum(x.compute for x in sweep.arms) / (100e12 * 0.5) / 3600
    assert f"{total:.4g} GPU-hours in all at MFU 0.5 of 100 TFLOP/s" in out
    bad = write_sweep(tmp_path, {"variants": {"v": {"preset": "tiny-moe:vanilla"}}, "steps": [3], "seeds": [1, 1]})
    with pytest.raises(SweepError, match="repeats a seed"):
        load_sweep(bad)
