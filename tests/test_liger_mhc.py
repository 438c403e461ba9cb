"""Liger-Kernel's fused mHC against our mHC maths (docs/kernels-bench.md, "Liger-Kernel").

Liger-Kernel (``pip install liger-kernel``, optional, not a dependency) ships Triton kernels for
mHC coefficients.  This runs them on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, in a subprocess so the flag is set before Triton is imported) and compares
with float64 evaluations of our definitions (docs/math.md §1.4, §1.5, §2.0):

* h_pre = σ(α_pre·x̂W_pre + b_pre), h_post = 2σ(α_post·x̂W_post + b_post), x̂ = RMSNorm(vec X)
  without gain: equal (fp32 rounding);
* H_res: Liger's Sinkhorn ends on a column normalisation and adds ε to the entries and to every
  denominator.  With ε = 0 it equals our ``sinkhorn_order: col_last`` (up to fp32 rounding) and not
  our default ``row_last`` (rows exact) when the iterations have not converged — why Liger is not
  our default mHC backend.

Skipped unless both ``liger_kernel`` and ``triton`` import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xhc.config import HCConfig, HCConfigError
from xhc.hyper_connection import HyperConnection
from xhc.kernels import liger as liger_op

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, torch
from liger_kernel.transformers.functional import liger_mhc_coeffs
from xhc.doubly_stochastic import sinkhorn
torch.manual_seed(0)
n, C, T = 4, 32, 6
x = torch.randn(T, n, C)
phi = torch.randn(n * C, n * n + 2 * n) * 0.3          # Liger layout: [n·C, n² + 2n], columns pre | post | res
b = torch.randn(n * n + 2 * n)
alpha = [torch.tensor(1.3), torch.tensor(0.7), torch.tensor(1.9)]
xd = x.double().flatten(-2)
mix = (xd @ phi.double()) * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
pre = torch.sigmoid(alpha[0].double() * mix[:, :n] + b[:n].double())
post = 2 * torch.sigmoid(alpha[1].double() * mix[:, n:2 * n] + b[n:2 * n].double())
z = (alpha[2].double() * mix[:, 2 * n:] + b[2 * n:].double()).unflatten(-1, (n, n))
out = {}
for t_max in (2, 20):
    h_pre, h_post, H = liger_mhc_coeffs(x, phi, b, *alpha, allow_fp32=True, tmax=t_max, rms_eps=1e-6,
                                        pre_eps=0.0, sinkhorn_eps=0.0, post_mult=2.0)
    out[t_max] = {
        "pre": (h_pre.double() - pre).abs().max().item(),
        "post": (h_post.double() - post).abs().max().item(),
        "col_last": (H.double() - sinkhorn(z, t_max, 1e-6, "col_last", recompute=False)).abs().max().item(),
        "row_last": (H.double() - sinkhorn(z, t_max, 1e-6, "row_last", recompute=False)).abs().max().item(),
    }
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow
def test_liger_mhc_coefficients_against_ours():
    pytest.importorskip("liger_kernel")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, f"Liger's kernels did not run under the Triton interpreter: {proc.stderr[-800:]}"
    res = {int(k): v for k, v in json.loads(line[0][7:]).items()}
    tol = 1e-5  # fp32 GEMM over n·C = 128 terms, sigmoid and 2–20 Sinkhorn steps of O(1) values
    for t_max, r in res.items():
        assert r["pre"] < tol and r["post"] < tol, (t_max, r)
        assert r["col_last"] < tol, (t_max, r)          # same maths as our col_last order
    assert res[2]["row_last"] > 100 * tol, res           # not our default order before convergence


# ------------------------------------------------------------------------------------------------
# The ``liger`` backend (xhc/kernels/liger.py): HyperConnection with Liger's coefficient op
# ------------------------------------------------------------------------------------------------
needs_liger = pytest.mark.skipif(not liger_op.liger_available(), reason="liger-kernel is not installed")
# the interpreter computes masked-off lanes too (0/0 there; the results are discarded)
quiet_interpreter = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # CPU: TRITON_INTERPRET=1


def _pair(cfg: HCConfig, C: int, seed: int = 0):
    """(Liger module on DEV, float64 eager reference) with the same perturbed parameters."""
    torch.manual_seed(seed)
    lig = HyperConnection(cfg, C, layer_index=1).to(DEV)
    ref = HyperConnection(cfg.replace(kernels="eager"), C, layer_index=1).double()
    with torch.no_grad():
        for p in lig.parameters():
            p.add_(0.3 * torch.randn_like(p))  # away from the init, where every map is near-trivial
        for p, q in zip(lig.parameters(), ref.parameters()):
            q.copy_(p)
    return lig, ref


def _fp32_tolerance() -> float:
    """fp32: a GEMM over n·C = 128 terms, sigmoids and up to 20 Sinkhorn steps, relative to the
    largest value: 2e-5.  On a GPU, Liger's ``tl.dot`` on fp32 operands runs in TF32 (Triton's
    default there; operands rounded to 10 mantissa bits, unit roundoff 2**-11 = 4.9e-4), and the
    weight gradients are such GEMMs summed over tokens, where terms cancel: 1e-2, 20 units.
    Measured on the H200 (docs/gpu.md): forward 0.9e-4 to 1.1e-4, W_res gradient up to 2.9e-3;
    with ``TRITON_F32_DEFAULT=ieee`` (full fp32) everything within 2e-5, and that bound applies."""
    if DEV.type == "cuda" and os.environ.get("TRITON_F32_DEFAULT", "").lower() != "ieee":
        return 1e-2
    return 2e-5


def _branch(u):
    return 1.7 * torch.tanh(u)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


@needs_liger
@quiet_interpreter
@pytest.mark.parametrize("affine,clamp,iters", [(False, True, 20), (False, False, 3), (True, True, 3)])
@pytest.mark.slow
def test_liger_backend_equals_eager(affine, clamp, iters):
    """kernels: liger (Liger's fused coefficients + our Triton read/write) equals the float64 eager
    path in the forward and in every gradient, to fp32 rounding; Liger's op really ran."""
    n, C = 4, 32
    cfg = HCConfig(variant="mhc", n=n, sinkhorn_order="col_last", kernels="liger", sinkhorn_iters=iters,
                   mapping_norm_affine=affine, row_sum_clamp=clamp)
    lig, ref = _pair(cfg, C)
    X = torch.randn(2, 6, n, C)
    Xl, Xr = X.clone().to(DEV).requires_grad_(), X.double().requires_grad_()
    calls = []
    orig = liger_op.mhc_coefficients
    liger_op.mhc_coefficients = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        out_l = lig(Xl, _branch)
    finally:
        liger_op.mhc_coefficients = orig
    assert calls, "Liger's op was not used"
    out_r = ref(Xr, _branch)
    w = torch.randn(out_r.shape, dtype=torch.float64)
    (out_l.double().cpu() * w).sum().backward()
    (out_r * w).sum().backward()
    tol = _fp32_tolerance()
    assert _rel(out_l, out_r) < tol
    assert _rel(Xl.grad, Xr.grad) < tol
    for (name, p), q in zip(lig.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < tol, name


@needs_liger
@quiet_interpreter
@pytest.mark.slow
def test_liger_backend_bf16_state():
    """A bf16 state (fp32 parameters): Liger's path stays within bf16 rounding of the float64
    reference — tolerance 2e-2 of the largest value (bf16 keeps 8 bits; the state and u are bf16)."""
    n, C = 4, 32
    cfg = HCConfig(variant="mhc", n=n, sinkhorn_order="col_last", kernels="liger", sinkhorn_iters=3)
    lig, ref = _pair(cfg, C, seed=1)
    X = torch.randn(12, n, C).bfloat16()
    Xl, Xr = X.clone().to(DEV).requires_grad_(), X.double().requires_grad_()
    out_l = lig(Xl, _branch)
    assert out_l.dtype == torch.bfloat16
    out_r = ref(Xr, _branch)
    w = torch.randn(out_r.shape, dtype=torch.float64)
    (out_l.double().cpu() * w).sum().backward()
    (out_r * w).sum().backward()
    assert Xl.grad.dtype == torch.bfloat16
    assert _rel(out_l, out_r) < 2e-2
    assert _rel(Xl.grad, Xr.grad) < 2e-2
    for (name, p), q in zip(lig.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < 2e-2, name


@needs_liger
def test_liger_backend_without_a_triton_device_runs_the_same_maths(monkeypatch):
    """CPU tensors without the interpreter: Liger cannot run, the compiled ops (same maths) do."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not liger_op.runnable(torch.device("cpu"))
    n, C = 4, 16
    cfg = HCConfig(variant="mhc", n=n, sinkhorn_order="col_last", kernels="liger", sinkhorn_iters=5)
    torch.manual_seed(3)
    lig = HyperConnection(cfg, C).double()
    ref = HyperConnection(cfg.replace(kernels="eager"), C).double()
    with torch.no_grad():
        for p, q in zip(lig.parameters(), ref.parameters()):
            p.add_(0.3 * torch.randn_like(p))
            q.copy_(p)
    X = torch.randn(5, n, C, dtype=torch.float64)
    assert _rel(lig(X, _branch), ref(X, _branch)) < 1e-12


@needs_liger
def test_liger_backend_has_no_graph_breaks():
    """Under torch.compile the liger backend traces the compiled ops: zero graph breaks."""
    cfg = HCConfig(variant="mhc", n=4, sinkhorn_order="col_last", kernels="liger", sinkhorn_iters=3)
    hc = HyperConnection(cfg, 16)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(hc)(torch.randn(3, 4, 16), _branch)
    assert explained.graph_count >= 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("change,field", [
    (dict(sinkhorn_order="row_last"), "sinkhorn_order"),
    (dict(variant="kromhc"), "kernels"),
    (dict(variant="xhc", n=16), "kernels"),
    (dict(dynamic=False), "dynamic"),
    (dict(ablate_res=True), "ablate_res"),
    (dict(res_logit_dropout=0.1), "res_logit_dropout"),
    (dict(sinkhorn_iters=0), "sinkhorn_iters"),
])
def test_liger_backend_refuses_configs_where_its_maths_differs(change, field):
    base = dict(variant="mhc", n=4, sinkhorn_order="col_last", kernels="liger")
    with pytest.raises(HCConfigError, match=rf"^HCConfig\.{field}=.*(col_last|auto|>= 1|set it to 0)"):
        HCConfig(**{**base, **change})
    HCConfig(**base)  # the base configuration is accepted


def test_liger_backend_names_the_missing_package(monkeypatch):
    monkeypatch.setattr(liger_op, "_LIGER_OK", False)
    cfg = HCConfig(variant="mhc", n=4, sinkhorn_order="col_last", kernels="liger")
    with pytest.raises(HCConfigError, match="pip install liger-kernel"):
        HyperConnection(cfg, 16)
