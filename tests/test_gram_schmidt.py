"""Gram–Schmidt over the write-back components (docs/math.md §3.3, §8 #20).

References are plain-Python loops over components and channels (float64 Python floats), written
from docs/math.md: the MGS pseudo-code with its mean-based ε, and the classical form.
"""

from __future__ import annotations

import pytest
import torch

from xhc.gram_schmidt import gram_schmidt

F64 = torch.float64


def _mean(a, b):
    return sum(x * y for x, y in zip(a, b)) / len(a)


def ref_mgs(V, eps):
    """docs/math.md §3.3 pseudo-code, one token: V is a list of K lists of C floats."""
    out = [list(V[0])]
    for j in range(1, len(V)):
        w = list(V[j])
        for v in out:
            a = _mean(w, v) / (_mean(v, v) + eps)
            w = [wi - a * vi for wi, vi in zip(w, v)]
        out.append(w)
    return out


def ref_classical(V):
    """v_{j+1} = g_j − Σ_i (⟨g_j, v_i⟩/⟨v_i, v_i⟩)·v_i (exact-arithmetic form, no ε)."""
    out = [list(V[0])]
    for j in range(1, len(V)):
        g = V[j]
        coefs = [_mean(g, v) / _mean(v, v) for v in out]
        out.append([g[c] - sum(a * v[c] for a, v in zip(coefs, out)) for c in range(len(g))])
    return out


def _per_token(ref, V, *args):
    tokens = V.reshape(-1, *V.shape[-2:]).tolist()
    return torch.tensor([ref(t, *args) for t in tokens], dtype=F64).view(V.shape)


def _cos(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def test_matches_spec_loop_reference():
    torch.manual_seed(0)
    V = torch.randn(5, 3, 4, 16, dtype=F64)  # [s, b, K, C]
    out = gram_schmidt(V)
    assert out.shape == V.shape and out.dtype == F64
    torch.testing.assert_close(out, _per_token(ref_mgs, V, 1e-6), rtol=0, atol=1e-12)


def test_first_component_is_y_bitwise():
    torch.manual_seed(1)
    V = torch.randn(7, 2, 4, 32)
    assert torch.equal(gram_schmidt(V)[..., 0, :], V[..., 0, :])
    Vb = V.bfloat16()
    out = gram_schmidt(Vb)
    assert out.dtype == torch.float32  # fp32 maths (§1.5) for low-precision inputs
    assert torch.equal(out[..., 0, :], Vb[..., 0, :].float())
    assert torch.equal(out, gram_schmidt(Vb.float()))


def test_eps_zero_orthogonal_float64():
    torch.manual_seed(2)
    V = torch.randn(200, 4, 64, dtype=F64) * torch.logspace(-3, 3, 200, dtype=F64)[:, None, None]
    out = gram_schmidt(V, eps=0.0)
    for i in range(4):
        for j in range(i + 1, 4):
            assert _cos(out[:, i], out[:, j]).abs().max() <= 1e-10


def test_equals_classical_gram_schmidt_float64():
    torch.manual_seed(3)
    V = torch.randn(30, 4, 24, dtype=F64)
    V[:, 2] += 0.9 * V[:, 1]  # correlated components, as conv outputs of the same y are
    V[:, 3] += 0.5 * V[:, 0] - 0.7 * V[:, 2]
    torch.testing.assert_close(gram_schmidt(V, eps=0.0), _per_token(ref_classical, V), rtol=1e-10, atol=1e-12)


def test_default_eps_leftover_bound():
    """One projection leaves mean(w'·v) = mean(w·v)·ε/(mean(v²)+ε); overall |cos| ≤ ε/mean(v_i²)."""
    torch.manual_seed(4)
    eps = 1e-6
    # K = 2, exact identity of the leftover
    V = torch.randn(100, 2, 64, dtype=F64) * 1e-2
    out = gram_schmidt(V, eps)
    y, g = V[:, 0], V[:, 1]
    expected = (g * y).mean(-1) * eps / ((y * y).mean(-1) + eps)
    torch.testing.assert_close((out[:, 1] * out[:, 0]).mean(-1), expected, rtol=1e-9, atol=0)
    # K = 4 at a small scale, where the guard is visible (mean(v²) ≈ 1e-4)
    V = torch.randn(300, 4, 64, dtype=F64) * 1e-2
    out = gram_schmidt(V, eps)
    worst = 0.0
    for i in range(4):
        bound = eps / out[:, i].pow(2).mean(-1)
        for j in range(i + 1, 4):
            cos = _cos(out[:, i], out[:, j]).abs()
            assert (cos <= bound).all()
            worst = max(worst, cos.max().item())
    assert worst > 1e-5  # the guard really leaves a measurable overlap at this scale


def test_zero_component_gets_coefficient_zero():
    torch.manual_seed(5)
    V = torch.randn(6, 4, 16)
    V[0, 0] = 0.0  # y = 0: every later component passes unchanged
    V[1, 2] = 0.0  # a zero conv output stays zero and does not disturb the next one
    out = gram_schmidt(V)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 1], V[0, 1])
    assert torch.equal(out[1, 2], torch.zeros(16))
    without = gram_schmidt(V[1, [0, 1, 3]])
    assert torch.equal(out[1, 3], without[2])


def test_gradcheck_float64():
    torch.manual_seed(6)
    V = torch.randn(3, 4, 6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda V: gram_schmidt(V), (V,))
    assert torch.autograd.gradcheck(lambda V: gram_schmidt(V, eps=0.0), (V,))
    Vs = (torch.randn(2, 3, 5, dtype=F64) * 1e-3).requires_grad_(True)  # ε-dominated regime
    assert torch.autograd.gradcheck(lambda V: gram_schmidt(V), (Vs,))


def test_single_component_and_errors():
    V = torch.randn(3, 1, 8)
    assert torch.equal(gram_schmidt(V), V)
    with pytest.raises(ValueError, match=r"gram_schmidt V has shape \(8,\): expected \[\.\.\., K, C\]"):
        gram_schmidt(torch.randn(8))
    with pytest.raises(ValueError, match="gram_schmidt eps=-1.0: must be >= 0"):
        gram_schmidt(V, eps=-1.0)
