"""bench/gpu_check.sh and bench/gpu_checks.py without a GPU (docs/gpu.md).

* The plan: six steps, most valuable first, limits summing to the budget, which with the device's
  start-up fits the 15 minutes of device time that docs/gpu.md's device command line asks for.
* Results that come back: with ``OUT`` set, every step's JSON and the summary exist from the start
  and after a SIGKILL in the middle of a step (the CPU smoke run), rows are written as they are
  printed, at most 8 files (what the device tool returns).
* Failures: a failing row makes the exit status 1; a training step failing on the default backend
  is rerun once with ``--hc-kernels compile`` (a stand-in interpreter plays the GPU machine);
  ``--nproc 2`` without two GPUs is refused at once, before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
bash = shutil.which("bash")
needs_bash = pytest.mark.skipif(bash is None, reason="needs bash")
STEPS = ["env", "kernels", "train", "resume", "throughput", "bench"]
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")  # what the device tool brings back


def run_script(*args, env=None, timeout=60):
    return subprocess.run([bash, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def device_command() -> dict:
    """The device-tool call documented in docs/gpu.md (a JSON block after 'device command line')."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    block = re.search(r"<!-- device-command -->\s*```json\n(.*?)\n```", text, re.S)
    assert block, "docs/gpu.md has no device command block"
    return json.loads(block.group(1))


@needs_bash
def test_script_parses():
    subprocess.run([bash, "-n", str(SCRIPT)], check=True)


@needs_bash
def test_dry_run_plan_fits_the_device_budget(tmp_path):
    r = run_script("--dry-run", env=dict(os.environ, OUT=str(tmp_path / "out")))
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^  step (\d+) (\S+) \(limit (\d+)s\)", r.stdout, re.M)
    assert [s[1] for s in steps] == STEPS and [int(s[0]) for s in steps] == list(range(6)), r.stdout
    limits = [int(s[2]) for s in steps]
    budget = int(re.search(r"budget (\d+)s", r.stdout).group(1))
    assert sum(limits) == budget == int(re.search(r"step limits sum (\d+)s", r.stdout).group(1))
    cmd = device_command()
    # the command's own limit covers the budget plus the summary; start-up (up to 4 min) + the
    # command fit the 15 minutes of device time, and one command may run 10 minutes at most
    assert budget + 10 <= cmd["timeout_s"] <= 600 and 4 * 60 + cmd["timeout_s"] <= 15 * 60, cmd
    assert ".whl" in cmd["carry"] and "bash bench/gpu_check.sh" in cmd["command"], cmd
    assert "tests/test_hc_kernels.py tests/test_hc_kernels_fused.py tests/test_liger_mhc.py -k 'cuda or liger_backend'" in r.stdout
    assert "--timeout 60" in r.stdout and " -x " not in r.stdout
    assert "--hc-kernels compile" in r.stdout  # the rerun of step train
    assert f"results {tmp_path / 'out'}" in r.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@needs_bash
def test_nproc2_is_refused_at_once_without_two_gpus(tmp_path):
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True
                                                     ).stdout.count("GPU ") >= 2:
        pytest.skip("two GPUs are visible here")
    t0 = time.monotonic()
    r = run_script("--nproc", "2", env=dict(os.environ, OUT=str(tmp_path / "out")))
    assert r.returncode == 2 and "--nproc 2 needs 2 GPUs" in r.stderr and "bench/gpu_check.sh (one GPU)" in r.stderr
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "out").exists()  # nothing written, nothing installed


@needs_bash
def test_bad_options_name_the_option_and_the_fix():
    for args, msg in ((["--nproc", "3"], "--nproc must be 1 or 2"), (["--frobnicate"], "unknown option --frobnicate"),
                      (["--budget", "9m"], "--budget must be whole seconds"),
                      (["--steps", "train,nope"], "--steps: unknown step 'nope'; steps are: env kernels")):
        r = run_script(*args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def _fake_python(tmp_path: Path) -> Path:
    """An interpreter stand-in for the GPU machine: imports succeed, the environment passes, the
    training checks fail unless run with --hc-kernels compile."""
    py = tmp_path / "fakepy"
    py.write_text("""#!/usr/bin/env bash
case "$*" in
  -c*) exit 0 ;;
  -\\ *) cat >/dev/null; echo "PASS environment: stand-in GPU machine" ;;
  *bench.gpu_checks*--hc-kernels\\ compile*) echo "PASS train_eval: losses fine on compile" ;;
  *bench.gpu_checks*) echo "FAIL train_eval: CompilationError (stand-in)"; exit 1 ;;
  *) echo "unexpected: $*"; exit 3 ;;
esac
""")
    py.chmod(0o755)
    return py


@needs_bash
@pytest.mark.slow
def test_a_training_failure_on_triton_is_rerun_on_compile_and_the_run_fails(tmp_path):
    out = tmp_path / "out"
    r = run_script("--python", str(_fake_python(tmp_path)), "--steps", "train", env=dict(os.environ, OUT=str(out)))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = json.loads((out / "summary.json").read_text())["lines"]
    assert lines == ["PASS environment: stand-in GPU machine", "FAIL train_eval: CompilationError (stand-in)",
                     "FAIL train on triton: the training checks failed with HC kernels triton; rerun on compile below",
                     "PASS train_eval: losses fine on compile"], lines
    step = json.loads((out / "step-2-train.json").read_text())
    assert step["status_triton"] == "FAIL" and step["status"] == "PASS" and step["attempt_label"] == "train-compile"
    assert "--hc-kernels compile" in r.stdout


@needs_bash
@pytest.mark.slow
def test_a_failing_row_makes_the_exit_status_non_zero(tmp_path):
    out = tmp_path / "out"
    r = run_script("--cpu-smoke", "--python", str(tmp_path / "no-such-python"), "--steps", "bench",
                   env=dict(os.environ, OUT=str(out), PATH="/usr/bin:/bin"))
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "done" and summary["failed"] >= 1
    assert summary["lines"][0].startswith("FAIL environment: no python with torch"), summary
    assert json.loads((out / "step-5-bench.json").read_text())["status"] == "skipped"


def _wait_for(path: Path, pred, timeout: float, proc) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, f"gpu_check.sh ended early ({proc.returncode})"
        try:
            d = json.loads(path.read_text())
            if pred(d):
                return d
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{path} never reached the expected state")


@needs_bash
@pytest.mark.slow
@pytest.mark.extended  # a whole CPU smoke run of the script (CONTRIBUTING.md, "Test tiers": the extended tier)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run is refused where CUDA exists")
def test_cpu_smoke_run_keeps_every_step_json_and_the_summary_through_a_kill(tmp_path):
    """Kill -9 the whole run in the middle of step train, after its first check printed its line."""
    out = tmp_path / "out"
    proc = subprocess.Popen([bash, str(SCRIPT), "--cpu-smoke", "--python", sys.executable], cwd=ROOT,
                            env=dict(os.environ, OUT=str(out)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        for i, s in enumerate(STEPS):  # every step's JSON exists from the start
            _wait_for(out / f"step-{i}-{s}.json", lambda d: "status" in d, 120, proc)
        _wait_for(out / "step-2-train.json", lambda d: d["status"] == "running" and d.get("rows"), 900, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    files = sorted(p.name for p in out.iterdir() if not p.name.endswith(".tmp"))
    assert files == sorted(["gpu_check.log", "summary.json"] + [f"step-{i}-{s}.json" for i, s in enumerate(STEPS)])
    assert len(files) <= 8 and all(NAME_OK.match(f) for f in files) and not any(p.is_dir() for p in out.iterdir())
    steps = [json.loads((out / f"step-{i}-{s}.json").read_text()) for i, s in enumerate(STEPS)]
    assert [d["status"] for d in steps] == ["PASS", "PASS", "running", "pending", "pending", "pending"], steps
    assert steps[1]["rows"][0]["status"] == "SKIP"  # kernel tests: not on a CPU smoke run
    assert steps[2]["rows"][0]["name"] == "train_eval" and steps[2]["rows"][0]["status"] == "PASS", steps[2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "running" and summary["current_step"] == "train", summary
    assert summary["lines"][0].startswith("PASS environment: python"), summary
    log = (out / "gpu_check.log").read_text()
    assert "PASS train_eval: " in log  # unbuffered: the line reached the log before the kill
    for path in ROOT.glob("runs/gpu_check-*/checks"):  # the killed run's scratch
        shutil.rmtree(path.parent, ignore_errors=True)


@needs_bash
@pytest.mark.slow
@pytest.mark.extended  # a whole CPU smoke run of the script (CONTRIBUTING.md, "Test tiers": the extended tier)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run is refused where CUDA exists")
def test_cpu_smoke_run_of_the_benchmark_step_completes(tmp_path):
    out = tmp_path / "out"
    r = run_script("--cpu-smoke", "--python", sys.executable, "--steps", "bench", env=dict(os.environ, OUT=str(out)),
                   timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "done" and summary["failed"] == 0, summary
    bench = json.loads((out / "step-5-bench.json").read_text())
    names = [row["name"] for row in bench["rows"]]
    assert names == ["bench vanilla eager", "bench mhc eager", "bench xhc-mlp eager", "bench flash4 eager"], names
    assert bench["status"] == "PASS" and bench["exit_code"] == 0 and "ms/sublayer" in bench["table"]
    assert all(row["data"]["ms_per_sublayer"] > 0 for row in bench["rows"])
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "step-0-env.json", "step-5-bench.json",
                                                     "summary.json"]


@pytest.mark.slow
def test_each_benchmark_row_has_its_own_try_and_is_written_at_once(tmp_path, monkeypatch):
    """One unit failing gives its FAIL row; the rows before and after it are measured and written."""
    import bench.hc_kernels as hk
    from bench import gpu_checks

    real = hk.build_unit

    def build_unit(variant, *a, **kw):
        if variant == "xhc-mlp":
            raise RuntimeError("simulated compile error")
        return real(variant, *a, **kw)

    monkeypatch.setattr(hk, "build_unit", build_unit)
    path = tmp_path / "step.json"
    ctx = gpu_checks.Ctx("cpu", True, str(tmp_path), json_path=str(path))
    gpu_checks.check_bench(ctx)
    rows = json.loads(path.read_text())["rows"]
    assert [(r["name"], r["status"]) for r in rows] == [("bench vanilla eager", "PASS"), ("bench mhc eager", "PASS"),
                                                        ("bench xhc-mlp eager", "FAIL"), ("bench flash4 eager", "PASS")]
    assert "simulated compile error" in rows[2]["text"]


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="run.device=cpu is refused where CUDA exists")
def test_python_checks_run_shrunk_on_cpu(tmp_path):
    """The Python half in its CPU smoke mode: train + eval, pipeline boundary, bf16/fp32 HC parity."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    js = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "bench.gpu_checks", "--device", "cpu", "--smoke", "--workdir",
                        str(tmp_path), "--json", str(js), "train_eval", "pipeline", "spec"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    lines = [line for line in r.stdout.splitlines() if re.match(r"^(PASS|FAIL|SKIP) ", line)]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    names = [line.split(":")[0] for line in lines]
    assert names == ["PASS train_eval", "PASS pipeline boundary", "PASS bf16 vs fp32 HC layers",
                     "SKIP TE spec vs local spec"], lines
    assert "HC kernels auto -> " in lines[0]
    rows = json.loads(js.read_text())["rows"]
    assert [f"{r['status']} {r['name']}" for r in rows] == names


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.extended  # two CPU ranks, ~30 s (CONTRIBUTING.md, "Test tiers": the extended tier)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke form (--device cpu)")
def test_multi_checks_run_shrunk_on_two_cpu_ranks(tmp_path, run_torchrun):
    """``--nproc 2``'s Python half on two CPU ranks: the layouts that run without CUDA, the overlapped
    save, and sharded Muon saved at DP = 2 and resumed at TP = 2 + SP (re-saved checkpoint equal)."""
    js = tmp_path / "rows.json"
    out = run_torchrun("bench/gpu_checks.py", nproc=2, timeout=600, args=[
        "--device", "cpu", "--smoke", "--workdir", str(tmp_path), "--json", str(js), "multi"]).stdout
    lines = [line for line in out.splitlines() if re.match(r"^(PASS|FAIL|SKIP) ", line)]
    assert [line.split(":")[0] for line in lines] == [
        "PASS multi tp2+sp", "PASS multi pp2", "SKIP multi pp2-vpp2", "PASS multi ep2", "SKIP multi cp2",
        "PASS multi dp2-muon", "PASS dp2 overlap_param_gather save", "PASS muon sharded dp2 -> tp2 resume"], lines
    assert re.search(r"muon sharded dp2 -> tp2 resume: resumed at step 2; \d+ tensors \(\d+ optimizer\) .* 0 differ",
                     out), lines


# ------------------------------------------------------------------------------------------------
# --perf (issue 35): the speed call
# ------------------------------------------------------------------------------------------------
PERF_STEPS = ["env", "roofline", "hc_perf", "autotune", "throughput", "table"]


def perf_device_command() -> dict:
    text = (ROOT / "docs" / "gpu.md").read_text()
    block = re.search(r"<!-- device-command-perf -->\s*```json\n(.*?)\n```", text, re.S)
    assert block, "docs/gpu.md has no --perf device command block"
    return json.loads(block.group(1))


@needs_bash
def test_perf_dry_run_plan_fits_nine_minutes_and_calls_the_kernel_cli(tmp_path):
    r = run_script("--perf", "--dry-run", env=dict(os.environ, OUT=str(tmp_path / "out")))
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^  step (\d+) (\S+) \(limit (\d+)s\)", r.stdout, re.M)
    assert [s[1] for s in steps] == PERF_STEPS and [int(s[0]) for s in steps] == list(range(6)), r.stdout
    budget = int(re.search(r"budget (\d+)s", r.stdout).group(1))
    assert sum(int(s[2]) for s in steps) == budget <= 9 * 60
    cmd = perf_device_command()
    assert cmd["command"] == "bash bench/gpu_check.sh --perf" and ".whl" in cmd["carry"], cmd
    assert budget + 10 <= cmd["timeout_s"] <= 600 and 4 * 60 + cmd["timeout_s"] <= 15 * 60, cmd
    out = tmp_path / "out"
    assert "bench.hc_kernels --perf --device cuda --out " in r.stdout and "--copy-gbps $COPY_GBPS" in r.stdout
    autotune = f"bench.hc_kernels --autotune --device cuda --hidden 2048 --tokens 8192 --out {out}/tuned_blocks.json"
    assert autotune in r.stdout
    assert "cp <files_at>/tuned_blocks.json xhc/kernels/tuned_blocks.json" in r.stdout
    assert f"bench.throughput --realistic --json {out}/throughput.json" in r.stdout
    assert not out.exists()  # a dry run writes nothing
    r = run_script("--perf", "--nproc", "2", "--dry-run")
    assert r.returncode == 2 and "--perf runs on one GPU" in r.stderr


def test_perf_table_verdicts_against_the_targets(tmp_path):
    """The last table: ratios and bandwidth shares read back from the run's files, each compared with
    its target from the issue (>= 0.93x, >= 0.80x, >= 50 %, >= 40 %)."""
    from bench.gpu_checks import bandwidth_fractions, perf_table

    roof = {"copy_gbps": 3000.0, "gemm_tflops": 800.0, "device": "GPU", "gemm_dtype": "bfloat16"}
    (tmp_path / "summary.json").write_text(json.dumps(
        {"steps": {"step-1-roofline": {"rows": [{"name": "roofline", "data": roof}]}}}))
    rows = [dict(variant="none", backend="-", ratio=1.0, tokens_per_s=1e5, mfu=0.2, layers=4, profile=None),
            dict(variant="mhc", backend="compile", ratio=0.94, tokens_per_s=9.4e4, mfu=0.19, layers=4,
                 profile={"hc_share": 0.05}),
            dict(variant="xhc", backend="compile", ratio=0.7, tokens_per_s=7e4, mfu=0.15, layers=4, profile=None),
            dict(variant="xhc_flash4", backend="compile", ratio=0.79, tokens_per_s=7.9e4, mfu=0.16, layers=4,
                 profile=None)]
    (tmp_path / "throughput.json").write_text(
        json.dumps({"rows": rows, "peak_tflops": 989.0, "tokens_per_step": 16384}))
    (tmp_path / "hc_perf.json").write_text(json.dumps({"perf.json": {"rows": [
        {"variant": "mhc", "scope": "sublayer", "fraction_of_copy": 0.55},
        {"variant": "mhc", "scope": "kernel", "fraction_of_copy": 0.9},  # a kernel, not the sublayer
        {"variant": "xhc-mlp", "scope": "sublayer", "fraction_of_copy": 0.39}]}}))
    lines = perf_table(str(tmp_path), "perf flash4 sublayer fwd+bwd 1.2 ms, 41.5% of copy bandwidth\n")
    verdict = {line.split("  ")[1].split(" (")[0].strip(): line.split()[-1]
               for line in lines[3:] if line.startswith("  ")}
    assert verdict["mHC / vanilla tokens/s"] == "MET" and verdict["Flash-4sub / vanilla tokens/s"] == "MISSED", lines
    assert verdict["xHC / vanilla tokens/s"] == "n/a"
    assert verdict["mHC N=4 sublayer fwd+bwd, share of copy bandwidth"] == "MET"
    assert verdict["xHC MLP sublayer fwd+bwd, share of copy bandwidth"] == "MISSED"
    assert verdict["Flash-4sub window fwd+bwd, share of copy bandwidth"] == "MET"  # from the printed line
    assert "3,000 GB/s" in lines[0] and any("20.0%" in x and "24.7% of GEMM" in x for x in lines), lines
    assert bandwidth_fractions({}) == {}


def test_throughput_profile_summary_counts_kernels_absent_from_vanilla():
    from bench.throughput import summarise_profile

    vanilla = {"gemm": (10, 600.0), "add": (5, 100.0)}
    hc = {"gemm": (10, 600.0), "add": (9, 200.0), "triton_red_fused_sinkhorn": (4, 150.0), "hc_write": (2, 50.0)}
    s = summarise_profile(hc, vanilla, top=2)
    assert s["hc_share"] == pytest.approx(200.0 / 1000.0) and s["hc_kernel_names"] == 2
    assert [k["name"] for k in s["top"]] == ["gemm", "add"] and s["top"][0]["share"] == pytest.approx(0.6)
    assert "hc_share" not in summarise_profile(vanilla, None)


@needs_bash
@pytest.mark.slow
@pytest.mark.extended  # a whole CPU smoke run of the script (CONTRIBUTING.md, "Test tiers": the extended tier)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run is refused where CUDA exists")
def test_perf_cpu_smoke_run_writes_its_files_and_prints_the_table_last(tmp_path):
    out = tmp_path / "out"
    r = run_script("--perf", "--cpu-smoke", "--python", sys.executable, env=dict(os.environ, OUT=str(out)), timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.log", "summary.json", "throughput.json"], files  # hc_perf / autotune: SKIP on CPU
    assert len(files) <= 8 and all(NAME_OK.match(f) for f in files)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "done" and summary["failed"] == 0, summary
    assert list(summary["steps"]) == [f"step-{i}-{s}" for i, s in enumerate(PERF_STEPS)]
    assert [ln.split(":")[0] for ln in summary["lines"]] == [
        "PASS environment", "PASS roofline", "SKIP hc_perf", "SKIP autotune", "PASS throughput", "PASS perf table"]
    tput = json.loads((out / "throughput.json").read_text())
    assert [row["variant"] for row in tput["rows"]] == ["none", "mhc", "xhc", "xhc_flash4"]
    for row in tput["rows"]:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["profile"]["top"], row
    assert all(0 < row["profile"]["hc_share"] < 1 for row in tput["rows"][1:])
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    start = max(i for i, ln in enumerate(lines) if ln.startswith("perf table: "))
    tail = lines[start:]
    assert lines[start - 1].startswith("[gpu_check] ALL PASSED"), lines[start - 3:start]  # after the summary
    assert len(tail) == 11 and tail[-1].strip().startswith("Flash-4sub window"), tail
