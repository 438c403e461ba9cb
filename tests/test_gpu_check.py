"""bench/gpu_check.sh and bench/gpu_checks.py without a GPU: the script parses, its plan covers
the six steps (and the 2-GPU variant) with the exact kernel-test and benchmark commands, a
missing kernel file gives a SKIP (not present) line, and the Python checks run shrunk on CPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
bash = shutil.which("bash")
needs_bash = pytest.mark.skipif(bash is None, reason="needs bash")


def run_script(*args, **kw):
    return subprocess.run([bash, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60, **kw)


@needs_bash
def test_script_parses():
    subprocess.run([bash, "-n", str(SCRIPT)], check=True)


@needs_bash
def test_dry_run_plans_the_six_steps_with_the_exact_kernel_commands():
    r = run_script("--dry-run")
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^  step (\S+)", r.stdout, re.M)
    assert steps == ["1+4+5", "2", "3", "6a", "6b", "6c"], r.stdout
    assert "tests/test_hc_kernels.py -k cuda" in r.stdout
    assert "-m bench.hc_kernels --device cuda --dtype bf16 --hidden 2048 --tokens 8192" in r.stdout
    for check in ("train_eval pipeline spec", "variants", "resume", "throughput"):
        assert f"-m bench.gpu_checks --workdir runs/gpu_check-" in r.stdout and check in r.stdout
    limits = [int(x) for x in re.findall(r"\(limit (\d+)s\)", r.stdout)]
    assert limits and max(limits) <= 480
    assert not list((ROOT / "runs").glob("gpu_check-*/"))  # a dry run creates no work dir


@needs_bash
def test_two_gpu_plan_and_bad_options():
    r = run_script("--dry-run", "--nproc", "2")
    assert r.returncode == 0 and "--nproc_per_node 2" in r.stdout and " multi" in r.stdout, r.stdout
    bad = run_script("--nproc", "3")
    assert bad.returncode == 2 and "--nproc must be 1 or 2" in bad.stderr
    bad = run_script("--frobnicate")
    assert bad.returncode == 2 and "unknown option --frobnicate" in bad.stderr


@needs_bash
def test_missing_kernel_files_give_skip_not_present(tmp_path):
    """The 6a/6b commands of the plan, run where neither file exists."""
    plan = run_script("--dry-run").stdout
    for step in ("6a", "6b"):
        cmd = re.search(rf"^  step {step} .*?\(limit \d+s\): (.*)$", plan, re.M).group(1)
        out = subprocess.run([bash, "-c", cmd.replace("$PY", sys.executable)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0 and out.stdout.startswith("SKIP (not present) "), (step, out.stdout, out.stderr)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="run.device=cpu is refused where CUDA exists")
def test_python_checks_run_shrunk_on_cpu(tmp_path):
    """The Python half in its CPU smoke mode: train + eval, pipeline boundary, bf16/fp32 HC parity."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "bench.gpu_checks", "--device", "cpu", "--smoke", "--workdir",
                        str(tmp_path), "train_eval", "pipeline", "spec"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    lines = [line for line in r.stdout.splitlines() if re.match(r"^(PASS|FAIL|SKIP) ", line)]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    names = [line.split(":")[0] for line in lines]
    assert names == ["PASS train_eval", "PASS pipeline boundary", "PASS bf16 vs fp32 HC layers",
                     "SKIP TE spec vs local spec"], lines
