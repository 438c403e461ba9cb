"""The fused mHC kernels (xhc/kernels/mhc_pre.py, mhc_post.py, mhc_grad.py; docs/kernels.md) against the
eager float64 reference, on CPU under ``TRITON_INTERPRET=1`` (natively on a GPU: ids contain ``cuda``).

* every output and gradient equals eager in float64 for N ∈ {2, 3, 4, 16} (padded group layouts),
  both Sinkhorn orders, the row clamp on and off, the norm gain on and off, DeepSeek-V4's
  convention (``convention: deepseek_v4``: σ + ε, its Sinkhorn, combᵀ); the state's gradient
  is written by one kernel (the write hands dX' over to the read's backward);
* a bf16 state: the fused path rounds once, within a bf16 ulp-derived bound of the fp32 reference;
* the backward is deterministic (the same bits twice) and the weights' gradient does not depend
  on how the tokens are split (the reduction has a fixed order);
* the launch counts of ``python -m bench.hc_kernels --launches`` meet the targets of docs/kernels.md.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from xhc.config import HCConfig  # noqa: E402
from xhc.hyper_connection import HyperConnection  # noqa: E402

F64 = torch.float64
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
T_S, T_B, C = 3, 2, 8

pytestmark = pytest.mark.interp


def _need_triton():
    pytest.importorskip("triton")
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")


def _module(cfg, dtype, device, seed=0):
    torch.manual_seed(seed)
    hc = HyperConnection(cfg, C, layer_index=1).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=F64).to(p))
    return hc


def _run(cfg, device, dtype=F64, pdtype=None, seed=0, spy=None):
    hc = _module(cfg, pdtype or dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 2)
    X = torch.randn(T_S, T_B, cfg.n, C, generator=g, dtype=F64).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randn(T_S, T_B, C, generator=g, dtype=F64).to(device=device, dtype=dtype).requires_grad_()
    Gu = torch.randn(T_S, T_B, C, generator=g, dtype=F64).to(device)
    Go = torch.randn(T_S, T_B, cfg.n, C, generator=g, dtype=F64).to(device)
    u, ctx = hc.read(X)
    out = hc.write(X, y * u, ctx)  # the branch output depends on u: du gets both paths
    loss = (u.double() * Gu).sum() + (out.double() * Go).sum()
    names = [n for n, _ in hc.named_parameters()]
    grads = torch.autograd.grad(loss, [X, y] + list(hc.parameters()))
    return [u, out], dict(zip(["X", "y"] + names, grads))


def _close(a, b, what, rtol=1e-9, atol=1e-11):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


CASES = [
    pytest.param(dict(n=2), id="N2"),
    pytest.param(dict(n=3, sinkhorn_order="col_last", row_sum_clamp=False), id="N3-col_last-noclamp"),
    pytest.param(dict(n=4, mapping_norm_affine=True, sinkhorn_iters=3), id="N4-gain"),
    pytest.param(dict(n=16, sinkhorn_iters=2), id="N16"),
    pytest.param(dict(n=4, convention="deepseek_v4", sinkhorn_iters=3), id="N4-deepseek_v4"),
    pytest.param(dict(n=3, convention="deepseek_v4", sinkhorn_iters=1), id="N3-deepseek_v4-1iter"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", CASES)
def test_fused_mhc_equals_eager_float64(monkeypatch, device, kw):
    _need_triton()
    from xhc.kernels import mhc_grad, mhc_post, mhc_pre

    calls = []
    sg = mhc_grad.state_grad
    monkeypatch.setattr(mhc_grad, "state_grad", lambda *a: (calls.append("dX"), sg(*a))[1])
    for mod, cls in ((mhc_pre, "MHCPre"), (mhc_post, "MHCPost")):
        orig = getattr(mod, cls).apply
        monkeypatch.setattr(getattr(mod, cls), "apply", (lambda o, c: lambda *a: (calls.append(c), o(*a))[1])(orig, cls))
    cfg = HCConfig(variant="mhc", **kw)
    outs_r, g_r = _run(cfg.replace(kernels="eager"), device)
    outs_f, g_f = _run(cfg.replace(kernels="triton"), device)
    assert calls == ["MHCPre", "MHCPost", "dX"], calls  # the fused path ran, dX written once
    for a, b, w in zip(outs_f, outs_r, ("u", "out")):
        _close(a, b, w)
    assert g_r.keys() == g_f.keys()
    for name in g_r:
        _close(g_f[name], g_r[name], f"d{name}")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_mhc_bf16_state(device):
    """bf16 X and y, fp32 parameters: u and X' are the fp32 values rounded once (≤ 1 bf16 ulp = 2⁻⁸
    relative, plus the fp32 coefficients' own rounding); gradients within a few bf16 ulps."""
    _need_triton()
    cfg = HCConfig(variant="mhc", n=4, sinkhorn_iters=4)
    outs_r, g_r = _run(cfg.replace(kernels="eager"), device, dtype=torch.bfloat16, pdtype=torch.float32)
    outs_f, g_f = _run(cfg.replace(kernels="triton"), device, dtype=torch.bfloat16, pdtype=torch.float32)
    for a, b, w in zip(outs_f, outs_r, ("u", "out")):
        assert a.dtype == torch.bfloat16
        _close(a, b, w, rtol=2 ** -7, atol=2 ** -7)
    for name in g_r:
        scale = g_r[name].abs().max().item() + 1e-6
        _close(g_f[name], g_r[name], f"d{name}", rtol=2 ** -5, atol=2 ** -5 * scale)


def test_fused_mhc_backward_is_deterministic_and_split_free(monkeypatch):
    """Two backwards give the same bits; the weights' gradient with 1 token split equals the one with
    several (a fixed-order reduction, no atomics) to fp64 rounding."""
    _need_triton()
    from xhc.kernels import mhc_common

    cfg = HCConfig(variant="mhc", n=4, sinkhorn_iters=2, kernels="triton")
    split = lambda S: monkeypatch.setattr(  # noqa: E731  (BT = 2: float64 runs without tl.dot)
        mhc_common, "DEFAULT_BLOCKS", dict(mhc_common.DEFAULT_BLOCKS, mhc_dw={"BT": 2, "BK": 32, "S": S}))
    split(3)  # 6 tokens in 3 splits
    _, g1 = _run(cfg, "cpu")
    _, g2 = _run(cfg, "cpu")
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
    split(1)
    _, g3 = _run(cfg, "cpu")
    for name in ("W_pre", "W_res", "b_res", "alpha_res"):
        _close(g3[name], g1[name], name)


def test_launch_counts_meet_targets():
    """``bench.hc_kernels --launches`` for mHC: ≤ 5 forward and ≤ 6 backward per sublayer (Triton
    launches plus kernel-launching ATen ops), the targets of docs/kernels.md."""
    _need_triton()
    from bench.hc_kernels import count_launches

    fwd, bwd, fnames, bnames = count_launches("mhc", "triton", C=16, tokens=4)
    assert fwd <= 5 and bwd <= 6, (fwd, bwd, fnames, bnames)
    assert all(k.startswith("triton:") for k in list(fnames) + list(bnames)), (fnames, bnames)


@pytest.mark.parametrize("conv", ["paper", "deepseek_v4"])
def test_fused_mhc_fp32_padded_streams_many_iterations(conv):
    """fp32, N = 2 (padded to 4 in the kernels), 20 Sinkhorn iterations: the adjoint keeps the padding at
    zero (a padded column's denominator is ε, so a stray term would grow by 1/ε per step and overflow)."""
    _need_triton()
    cfg = HCConfig(variant="mhc", n=2, convention=conv, sinkhorn_iters=20)
    outs_r, g_r = _run(cfg.replace(kernels="eager"), "cpu", dtype=torch.float32)
    outs_f, g_f = _run(cfg.replace(kernels="triton"), "cpu", dtype=torch.float32)
    for a, b, w in zip(outs_f, outs_r, ("u", "out")):
        _close(a, b, w, rtol=1e-5, atol=1e-5)
    for name in g_r:
        assert torch.isfinite(g_f[name]).all(), name
        _close(g_f[name], g_r[name], f"d{name}", rtol=1e-4, atol=1e-4 * (g_r[name].abs().max().item() + 1e-6))
