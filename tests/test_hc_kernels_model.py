"""Model-level checks with the fused HC kernel backend selected (``model.hc_kernels: compile``).

* Two ranks (torchrun, gloo): TP=2+SP, EP=2 and PP=2 equal the single-rank reference with every HC
  module on the ``compile`` backend (tests/dist/hc_gpt_worker.py, ``XHC_TEST_HC_KERNELS``).
* xhc-pretrain resumes bit-identically with ``model.hc_kernels=compile`` and HC recompute on.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

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
@pytest.mark.slow
def test_two_rank_equivalence_with_fused_kernels(compiled_dist_run, mode):
    assert f"OK {mode}" in compiled_dist_run, f"mode {mode} did not pass:\n{compiled_dist_run[-6000:]}"


@pytest.mark.slow
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


@pytest.mark.slow
def test_pretrain_compile_hc_equals_the_uncompiled_run(tmp_path, capsys):
    """``model.compile_hc=true``: the HC modules really run under torch.compile inside xhc-pretrain
    (dynamo captures graphs even though the CPU entry point switches dynamo off for Megatron), and
    the losses equal the uncompiled fused run's to float32 rounding; the entry point leaves
    ``torch.compile`` as it found it."""
    from tests.test_pretrain import BASE, _by_step, _records
    from training.pretrain import main

    before = os.environ.get("TORCHDYNAMO_DISABLE")
    layers = 1  # compilation is per module: keep the model short
    steps = ["run.train_steps=3", "run.eval_interval=0", "checkpoint.interval=0", "model.hc_kernels=compile",
             f"model.backbone.num_layers={layers}", "model.preset=tiny-moe:mhc"]  # mHC: the cheapest to compile
    a, b = str(tmp_path / "eager"), str(tmp_path / "compiled")
    assert main([*BASE, *steps, f"run.dir={a}"]) == 0
    torch._dynamo.reset()
    assert main([*BASE, *steps, "model.compile_hc=true", f"run.dir={b}"]) == 0
    out = capsys.readouterr().out
    n = int(out.split("model.compile_hc: ")[1].split()[0])
    assert n == 2 * layers  # an attention and an MLP HC module per layer
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= n  # compiled, not silently eager
    assert os.environ.get("TORCHDYNAMO_DISABLE") == before
    ra, rb = _by_step(_records(a)), _by_step(_records(b))
    assert sorted(ra) == sorted(rb) == [1, 2, 3]
    for s in ra:
        assert rb[s]["loss"] == pytest.approx(ra[s]["loss"], rel=1e-5), s
        assert rb[s]["grad_norm"] == pytest.approx(ra[s]["grad_norm"], rel=1e-4), s


@pytest.mark.slow
def test_pretrain_with_liger_coefficients_equals_the_eager_run(tmp_path, capsys):
    """``model.hc_kernels=liger`` (mHC, col_last Sinkhorn): xhc-pretrain takes Liger-Kernel's fused
    coefficient op (on CPU under the Triton interpreter, with our Triton read/write) and its losses
    and gradient norms equal the eager run's to float32 rounding."""
    from xhc.kernels import liger

    if not (liger.liger_available() and liger.runnable(torch.device("cuda" if torch.cuda.is_available() else "cpu"))):
        pytest.skip("liger-kernel is not installed, or neither CUDA nor TRITON_INTERPRET=1")
    from tests.test_pretrain import BASE, _by_step, _records
    from training.pretrain import main

    steps = ["run.train_steps=3", "run.eval_interval=0", "checkpoint.interval=0", "model.backbone.num_layers=1",
             "model.preset=tiny-moe:mhc", "model.hc.sinkhorn_order=col_last",
             "model.hc.sinkhorn_iters=3",  # few iterations: the interpreter runs every one in Python
             "batch.global_batch_size=2", "batch.seq_length=8", "run.eval_iters=0"]  # 16 tokens a step, no eval
    a, b = str(tmp_path / "eager"), str(tmp_path / "liger")
    assert main([*BASE, *steps, "model.hc_kernels=eager", f"run.dir={a}"]) == 0
    assert main([*BASE, *steps, "model.hc_kernels=liger", f"run.dir={b}"]) == 0
    assert "mHC coefficients by Liger-Kernel's fused op" in capsys.readouterr().out
    ra, rb = _by_step(_records(a)), _by_step(_records(b))
    assert sorted(ra) == sorted(rb) == [1, 2, 3]
    for s in ra:
        assert rb[s]["loss"] == pytest.approx(ra[s]["loss"], rel=1e-5), s
        assert rb[s]["grad_norm"] == pytest.approx(ra[s]["grad_norm"], rel=1e-4), s
