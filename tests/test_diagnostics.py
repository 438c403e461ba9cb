"""Diagnostics (docs/math.md §2.g, [PEFT] App. C.5, [mHC] Amax gain)."""

import pytest
import torch
import torch.nn as nn

from xhc.config import HCConfig
from xhc.diagnostics import (
    DiagnosticError,
    amax_gain,
    check_doubly_stochastic,
    check_gradient_flow,
    check_stack_identity,
    check_sublayer_identity,
    identity_distance,
    stream_divergence,
)
from xhc.doubly_stochastic import sinkhorn
from xhc.hyper_connection import HyperConnection, expand_streams


def test_doubly_stochastic_accepts_sinkhorn_and_rejects_bad():
    H = sinkhorn(torch.randn(10, 4, 4) * 0.5)
    assert check_doubly_stochastic(H).ok
    bad = {
        "non-finite": torch.tensor([[float("nan"), 1.0], [0.5, 0.5]]),
        "negative": torch.tensor([[1.5, -0.5], [-0.5, 1.5]]),
        "not square": torch.ones(2, 3) / 3,
        "row sums": torch.tensor([[0.6, 0.6], [0.4, 0.4]]),
        "column sums": torch.tensor([[0.5, 0.5], [0.9, 0.1]]),
    }
    for what, M in bad.items():
        with pytest.raises(DiagnosticError, match=what):
            check_doubly_stochastic(M)
        assert not check_doubly_stochastic(M, strict=False).ok


def test_gradient_flow_detects_frozen_and_missing():
    torch.manual_seed(0)
    hc = HyperConnection(HCConfig(variant="mhc", n=4), 8)
    backbone = nn.Linear(8, 8)
    backbone.requires_grad_(False)
    model = nn.ModuleDict({"hc": hc, "backbone": backbone})
    X = torch.randn(6, 4, 8)
    u, ctx = hc.read(X)
    hc.write(X, backbone(u), ctx).pow(2).sum().backward()
    # H_res gets exactly zero gradient at step 0 on identical streams; here streams differ, and the
    # gates α are zero-gradient because W = 0 (docs/math.md §2.g #3)
    rep = check_gradient_flow(model, lambda n, p: n.startswith("hc."), allow_zero=("alpha",))
    assert rep.ok and "hc.W_pre" in rep.with_grad and not rep.unexpected
    # a frozen parameter that receives a gradient is reported
    backbone.weight.grad = torch.ones_like(backbone.weight)
    with pytest.raises(DiagnosticError, match="frozen/unintended"):
        check_gradient_flow(model, lambda n, p: n.startswith("hc."), allow_zero=("alpha",))
    # an intended parameter without gradient is reported
    backbone.weight.grad = None
    hc.W_res.grad = None
    with pytest.raises(DiagnosticError, match="no gradient on 1 intended"):
        check_gradient_flow(model, lambda n, p: n.startswith("hc."), allow_zero=("alpha",))


def test_identity_checks_pass_at_init_and_fail_when_perturbed():
    torch.manual_seed(0)
    C = 16
    branches = [nn.Sequential(nn.RMSNorm(C), nn.Linear(C, C)) for _ in range(4)]
    hcs = [HyperConnection(HCConfig(variant="kromhc", n=4), C, l) for l in range(4)]
    x = torch.randn(5, C)
    assert check_sublayer_identity(hcs[0], branches[0], x) < 1e-5
    assert check_stack_identity(hcs, branches, x, 4) < 1e-5
    with torch.no_grad():
        hcs[1].b_post.add_(1.0)  # h_post ≠ 1 breaks identity
    with pytest.raises(DiagnosticError, match="x \\+ f\\(x\\)"):
        check_sublayer_identity(hcs[1], branches[1], x)
    with pytest.raises(DiagnosticError, match="residual stack"):
        check_stack_identity(hcs, branches, x, 4)


def test_amax_gain():
    """Doubly stochastic products keep gain 1; an unconstrained product grows (HC ≈ 3000 in [mHC])."""
    g = torch.Generator().manual_seed(0)
    Hs = [sinkhorn(torch.randn(4, 4, generator=g, dtype=torch.float64), t_max=500) for _ in range(60)]
    gain = amax_gain(Hs)
    assert abs(gain.forward - 1) < 1e-9 and abs(gain.backward - 1) < 1e-6
    A = torch.eye(3, dtype=torch.float64) * 1.1
    assert abs(amax_gain([A] * 10).forward - 1.1**10) < 1e-9
    # order matters: composite = H_L ⋯ H_1; row sums of P, column sums of P
    H1 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    H2 = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    P = H2 @ H1
    gain = amax_gain([H1, H2])
    assert gain.forward == float(P.abs().sum(-1).max()) and gain.backward == float(P.abs().sum(-2).max())


def test_identity_distance_and_divergence():
    assert identity_distance(torch.eye(4).expand(3, 4, 4)) == 0
    assert abs(identity_distance(torch.zeros(4, 4)) - 2.0) < 1e-12
    x = torch.randn(5, 8)
    assert stream_divergence(expand_streams(x, 4)) == 0
    X = expand_streams(x, 4).clone()
    X[:, 1] += 0.1
    assert stream_divergence(X) > 0
