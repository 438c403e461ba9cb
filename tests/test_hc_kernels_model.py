"""Model-level checks with the fused HC kernel backend selected (``model.hc_kernels: compile``).

* Two ranks (torchrun, gloo): TP=2+SP, EP=2 and PP=2 equal the single-rank reference with every HC
  module on the ``compile`` backend (tests/dist/hc_gpt_worker.py, ``XHC_TEST_HC_KERNELS``).
* xhc-pretrain resumes bit-identically with ``model.hc_kernels=compile`` and HC recompute on.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the CPU/gloo path")
MODES = ("tp_sp", "ep", "pp")


@pytest.fixture(scope="module")
def compiled_dist_run(run_torchrun):
    old = os.environ.get("XHC_TEST_HC_KERNELS")
    os.environ["XHC_TEST_HC_KERNELS"] = "compile"
    try:
        proc = run_torchrun("tests/dist/hc_gpt_worker.py", nproc=2, args=list(MODES), check=False, timeout=900)
    finally:
        if old is None:
            os.environ.pop("XHC_TEST_HC_KERNELS")
        else:
            os.environ["XHC_TEST_HC_KERNELS"] = old
    return proc.stdout


@cpu_only
@pytest.mark.parametrize("mode", MODES)
def test_two_rank_equivalence_with_fused_kernels(compiled_dist_run, mode):
    assert f"OK {mode}" in compiled_dist_run, f"mode {mode} did not pass:\n{compiled_dist_run[-6000:]}"


def test_resume_is_bit_identical_with_fused_kernels_and_hc_recompute(tmp_path):
    from tests.test_pretrain import BASE, DROPOUT, _by_step, _records
    from training.pretrain import main

    steps = ["run.train_steps=4", "run.eval_interval=0", "checkpoint.interval=0", *DROPOUT,
             "model.hc_kernels=compile", "model.hc_recompute=true"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main([*BASE, *steps, f"run.dir={a}"]) == 0
    assert main([*BASE, *steps, f"run.dir={b}", "run.exit_at_step=2"]) == 0
    assert main([*BASE, *steps, f"run.dir={b}"]) == 0
    ra, rb = _by_step(_records(a)), _by_step(_records(b))
    assert sorted(ra) == sorted(rb) == [1, 2, 3, 4]
    for s in ra:
        for key in ("loss", "grad_norm"):
            assert ra[s][key] == rb[s][key], (s, key)
