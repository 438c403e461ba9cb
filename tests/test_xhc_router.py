"""xHC stream router (docs/math.md §3.4 router, §8 #14–#16): selection, ties, route weights, gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xhc.router import (
    StreamRouter,
    effective_mixing,
    route,
    router_load,
    router_logits,
    router_scores,
    topk_stable,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def brute_route(score, k, m):
    """The §3.4 rule for one token, by sorting (−score, index): ties go to the lower index."""
    N = len(score)
    routed = sorted(sorted(range(m, N), key=lambda i: (-score[i], i))[: k - m])
    return list(range(m)) + routed, [1.0] * m + [score[i] for i in routed]


# ------------------------------------------------------------------------------------------------
# selection
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,k,m", [(16, 4, 2), (8, 3, 0), (6, 6, 1), (5, 2, 2), (2, 1, 0), (16, 8, 2)])
def test_route_matches_rule(N, k, m):
    score = torch.rand(50, 3, N)
    I, p = route(score, k, m)
    assert I.shape == (50, 3, k) and p.shape == (50, 3, k)
    for t in range(50):
        for b in range(3):
            eI, ep = brute_route(score[t, b].tolist(), k, m)
            assert I[t, b].tolist() == eI
            assert p[t, b].tolist() == pytest.approx(ep, abs=0)
    assert (I.sort(-1).values.diff(dim=-1) > 0).all()  # distinct


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=12), st.data())
@pytest.mark.slow
def test_ties_go_to_the_lower_index(levels, data):
    """Scores with many exact ties (values from a 4-level set): selection follows (−score, index)."""
    N = len(levels)
    k = data.draw(st.integers(1, N))
    m = data.draw(st.integers(0, k))
    score = torch.tensor(levels, dtype=torch.float32) / 4
    I, p = route(score, k, m)
    eI, ep = brute_route(score.tolist(), k, m)
    assert I.tolist() == eI and p.tolist() == ep


def test_all_equal_scores_select_the_lowest_routed_indices():
    score = torch.full((7, 10), 0.5)
    I, _ = route(score, 5, 2)
    assert (I == torch.tensor([0, 1, 2, 3, 4])).all()


def test_topk_stable_large_batch_with_ties():
    """Equal scores anywhere in a long batch (torch.topk gives no tie guarantee; the stable sort does)."""
    score = torch.randint(0, 3, (4096, 16)).float()
    idx = topk_stable(score, 5)
    for row, sel in zip(score.tolist()[:300], idx.tolist()[:300]):
        assert sel == sorted(sorted(range(16), key=lambda i: (-row[i], i))[:5])


# ------------------------------------------------------------------------------------------------
# scores
# ------------------------------------------------------------------------------------------------
def test_router_logits_are_layer_norm_projection():
    N, C = 4, 6
    x = torch.randn(3, N * C, dtype=torch.float64) * 2 + 1.5
    W = torch.randn(N, N * C, dtype=torch.float64)
    z = router_logits(x, W)
    for t in range(3):
        v = x[t]
        mu = v.mean()
        xt = (v - mu) / torch.sqrt(((v - mu) ** 2).mean() + 1e-6)
        for n in range(N):
            assert float(z[t, n]) == pytest.approx(float((xt * W[n]).sum()), abs=1e-12)


def test_softmax_scores():
    z = torch.randn(10, 7)
    s = router_scores(z, 2, "softmax")
    assert torch.allclose(s[:, 2:].sum(-1), torch.ones(10))
    assert torch.allclose(s[:, 2:], torch.softmax(z[:, 2:], -1))
    assert torch.allclose(router_scores(z, 2, "sigmoid"), torch.sigmoid(z))
    with pytest.raises(ValueError, match="router kind"):
        router_scores(z, 2, "relu")


def test_router_init_gives_unit_logit_std():
    """§3.4 init W ~ N(0, 1/(N·C)): logits on a random state have std ≈ 1 (not zero: no ties)."""
    N, C = 16, 64
    r = StreamRouter(N, C, 4, 2)
    assert r.weight.shape == (N, N * C) and r.weight.dtype == torch.float32
    assert abs(float(r.weight.detach().std()) * math.sqrt(N * C) - 1) < 0.03
    x = torch.randn(512, N * C)
    z = router_logits(x, r.weight.detach())
    assert 0.85 < float(z.std()) < 1.15


def test_router_module_k_equals_m_has_no_parameter():
    r = StreamRouter(6, 4, 3, 3)
    assert r.weight is None and len(list(r.parameters())) == 0
    out = r(torch.randn(5, 24))
    assert (out.I == torch.arange(3)).all() and (out.p == 1).all()


def test_router_module_rejects_bad_sizes():
    with pytest.raises(ValueError, match="m <= k <= n"):
        StreamRouter(4, 8, 5, 1)
    with pytest.raises(ValueError, match="kind"):
        StreamRouter(4, 8, 2, 1, kind="relu")


# ------------------------------------------------------------------------------------------------
# gradient path
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sigmoid", "softmax"])
def test_gradient_reaches_router_only_through_routed_weights(kind):
    """Single token: W_router rows (the documented columns) of fixed and unselected streams get exactly
    zero gradient under sigmoid; under softmax every non-fixed row is coupled through the
    normaliser, but the fixed rows stay at zero."""
    N, C, k, m = 7, 5, 4, 2
    r = StreamRouter(N, C, k, m, kind)
    x = torch.randn(1, N * C)
    out = r(x)
    (out.p * torch.arange(1.0, k + 1)).sum().backward()
    g = r.weight.grad
    routed = set(out.I[0, m:].tolist())
    assert all((g[i] == 0).all() for i in range(m))
    for i in range(m, N):
        if i in routed:
            assert g[i].abs().sum() > 0
        elif kind == "sigmoid":
            assert (g[i] == 0).all()
    # the selection itself carries no gradient: a loss on the indices alone cannot reach W
    assert not out.I.requires_grad


# ------------------------------------------------------------------------------------------------
# diagnostics
# ------------------------------------------------------------------------------------------------
def test_router_load():
    I = torch.tensor([[0, 1, 3], [0, 1, 2], [0, 1, 3], [0, 1, 5]])
    load = router_load(I, 6)
    assert load.tolist() == [1.0, 1.0, 0.25, 0.5, 0.0, 0.25]


def test_effective_mixing_matches_explicit_construction():
    N, k = 6, 3
    I = torch.tensor([[0, 2, 5], [0, 3, 4]])
    H = torch.rand(2, k, k)
    H = H / H.sum(-1, keepdim=True)
    Hhat = effective_mixing(I, H, N)
    for t in range(2):
        E = torch.eye(N)
        for j in range(k):
            E[I[t, j]] = 0
            for q in range(k):
                E[I[t, j], I[t, q]] = H[t, j, q]
        assert torch.equal(Hhat[t], E)
    assert torch.allclose(Hhat.sum(-1), torch.ones(2, N))
    X = torch.randn(2, N, 4)
    Xa = X.gather(1, I[..., None].expand(2, k, 4))
    mixed = X.scatter(1, I[..., None].expand(2, k, 4), H @ Xa)  # sparse mixing, scattered
    assert torch.allclose(Hhat @ X, mixed, atol=1e-6)
