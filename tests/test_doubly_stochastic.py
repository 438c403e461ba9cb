"""Doubly-stochastic maps (docs/math.md §1.4, §2.c, §2.d, §2.f, §5.4)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xhc.doubly_stochastic import (
    clamp_rows,
    identity_mix,
    kromhc_factors,
    kromhc_mix,
    mhc_lite_mix,
    permutation_matrices,
    sinkhorn,
)

# ---------------------------------------------------------------------------------------------
# float64 reference written directly from the documented code block (§1.4), independent loop
# ---------------------------------------------------------------------------------------------


def sinkhorn_ref(Z, t_max=20, eps=1e-6):
    Z = Z.double()
    M = torch.exp(Z - Z.amax(-1, keepdim=True))
    M = M / M.sum(-1, keepdim=True).clamp_min(eps)
    for _ in range(t_max):
        M = M / M.sum(-2, keepdim=True).clamp_min(eps)
        M = M / M.sum(-1, keepdim=True).clamp_min(eps)
    return M


def sinkhorn_scalar_loop(Z, t_max):
    """Entry-by-entry Python loop, float64, one matrix."""
    n = len(Z)
    M = [[math.exp(Z[i][j] - max(Z[i])) for j in range(n)] for i in range(n)]
    M = [[v / sum(row) for v in row] for row in M]
    for _ in range(t_max):
        cs = [sum(M[i][j] for i in range(n)) for j in range(n)]
        M = [[M[i][j] / cs[j] for j in range(n)] for i in range(n)]
        M = [[v / sum(row) for v in row] for row in M]
    return torch.tensor(M, dtype=torch.float64)


finite_logits = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False)


@st.composite
def logit_matrices(draw, max_n=6):
    n = draw(st.integers(1, max_n))
    vals = draw(st.lists(finite_logits, min_size=n * n, max_size=n * n))
    return torch.tensor(vals, dtype=torch.float32).view(n, n)


class TestSinkhorn:
    def test_matches_scalar_loop_float64(self):
        torch.manual_seed(0)
        for n in (1, 2, 3, 4, 8):
            Z = torch.randn(n, n, dtype=torch.float64) * 2
            for t in (0, 1, 5, 20):
                torch.testing.assert_close(sinkhorn(Z, t), sinkhorn_scalar_loop(Z.tolist(), t), rtol=1e-12, atol=1e-14)

    @settings(max_examples=200, deadline=None)
    @given(logit_matrices())
    def test_extreme_logits_fp32(self, Z):
        """Finite, ≥ 0, rows within 1e-6 for any logits in ±1e4 (docs/math.md §1.4 tests)."""
        H = sinkhorn(Z)
        assert H.dtype == torch.float32
        assert torch.isfinite(H).all()
        assert (H >= 0).all()
        assert (H.sum(-1) - 1).abs().max() <= 1e-6

    @settings(max_examples=100, deadline=None)
    @given(logit_matrices())
    def test_bf16_input_fp32_inside(self, Z):
        Zb = Z.to(torch.bfloat16)
        H = sinkhorn(Zb)
        assert H.dtype == torch.float32
        assert torch.isfinite(H).all() and (H >= 0).all()
        assert (H.sum(-1) - 1).abs().max() <= 1e-6
        torch.testing.assert_close(H, sinkhorn(Zb.float()))

    def test_columns_in_converging_regime(self):
        """i.i.d. std 0.5 at n ≤ 4 and std 1 at n ≥ 8: column error ≤ 1e-3 (docs/math.md §1.4)."""
        g = torch.Generator().manual_seed(0)
        for n, std in ((2, 0.5), (3, 0.5), (4, 0.5), (8, 1.0), (16, 1.0)):
            H = sinkhorn(torch.randn(1000, n, n, generator=g) * std)
            assert (H.sum(-2) - 1).abs().max() <= 1e-3, (n, std)

    def test_columns_converge_with_many_iterations(self):
        g = torch.Generator().manual_seed(1)
        Z = torch.randn(200, 5, 5, generator=g, dtype=torch.float64) * 3
        H = sinkhorn(Z, t_max=2000)
        assert (H.sum(-2) - 1).abs().max() <= 1e-8

    def test_slow_2x2_example_from_spec(self):
        """Z = [[1.5, −1.5], [−2, 2]] keeps a column error ≈ 2.5e-3 after 20 iterations (docs/math.md §1.4)."""
        H = sinkhorn(torch.tensor([[1.5, -1.5], [-2.0, 2.0]], dtype=torch.float64))
        err = float((H.sum(-2) - 1).abs().max())
        assert 1e-3 < err < 5e-3

    def test_init_constants(self):
        """−8 off-diagonal logits: N=4 diag 0.998995 / off 3.351e-4; N=16 diag 0.994993 (docs/math.md §5.4)."""
        for n, diag, off in ((4, 0.998995, 3.351e-4), (16, 0.994993, 3.338e-4)):
            H = sinkhorn(-8.0 * (1 - torch.eye(n, dtype=torch.float64)))
            assert abs(float(H[0, 0]) - diag) < 5e-7
            assert abs(float(H[0, 1]) - off) < 5e-7

    def test_t_max_zero_is_row_softmax_and_n1(self):
        Z = torch.randn(3, 4, 4)
        torch.testing.assert_close(sinkhorn(Z, 0), torch.softmax(Z, -1))
        assert sinkhorn(torch.tensor([[123.0]])).item() == 1.0

    def test_recompute_backward_matches_reference(self):
        """Recompute-in-backward autograd function within 1e-6 relative (fp32; docs/math.md §1.4)."""
        torch.manual_seed(0)
        Z = (torch.randn(64, 4, 4) * 2).requires_grad_(True)
        G = torch.randn(64, 4, 4)
        (g_ref,) = torch.autograd.grad(sinkhorn(Z, recompute=False), Z, G)
        (g_rec,) = torch.autograd.grad(sinkhorn(Z, recompute=True), Z, G)
        assert ((g_rec - g_ref).abs().max() / g_ref.abs().max()) <= 1e-6

    def test_gradcheck_float64(self):
        torch.manual_seed(0)
        for rec in (False, True):
            Z = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
            assert torch.autograd.gradcheck(lambda z: sinkhorn(z, 20, recompute=rec), (Z,))

    def test_eps_clamps_underflowed_column(self):
        """A column that underflows stays 0 instead of NaN (clamped, not added)."""
        Z = torch.tensor([[0.0, -1e4], [0.0, -1e4]])
        H = sinkhorn(Z)
        assert torch.isfinite(H).all()
        assert (H.sum(-1) - 1).abs().max() <= 1e-6

    def test_col_last_parity_option(self):
        torch.manual_seed(0)
        Z = torch.randn(100, 4, 4, dtype=torch.float64)
        H = sinkhorn(Z, order="col_last")
        # reference: exp(Z − rowmax), then t_max × (T_r, T_c), no initial T_r
        M = torch.exp(Z - Z.amax(-1, keepdim=True))
        for _ in range(20):
            M = M / M.sum(-1, keepdim=True)
            M = M / M.sum(-2, keepdim=True)
        torch.testing.assert_close(H, M)
        assert (H.sum(-2) - 1).abs().max() < 1e-12  # columns exact, rows approximate

    def test_bad_order(self):
        with pytest.raises(ValueError, match="order"):
            sinkhorn(torch.zeros(2, 2), order="cols")


class TestRowClamp:
    def test_col_last_rows_bounded(self):
        """With col_last the clamp binds: rows ≤ 1 + n·2⁻²³ (fp32), ≤ 1 + 1e-12 (float64) (docs/math.md §2.f)."""
        g = torch.Generator().manual_seed(0)
        Z = torch.randn(2000, 4, 4, generator=g) * 3
        H = sinkhorn(Z, order="col_last")
        assert (H.sum(-1) > 1 + 1e-4).any()  # the clamp is live in this regime
        Hc = clamp_rows(H)
        assert Hc.sum(-1).max() <= 1 + 4 * 2**-23
        Hd = clamp_rows(sinkhorn(Z.double(), order="col_last"))
        assert Hd.sum(-1).max() <= 1 + 1e-12

    def test_noop_under_row_last_to_rounding(self):
        Z = torch.randn(500, 4, 4) * 2
        H = sinkhorn(Z)
        torch.testing.assert_close(clamp_rows(H), H, rtol=0, atol=4e-7)

    def test_rows_below_one_untouched(self):
        H = torch.tensor([[0.2, 0.3], [0.9, 0.6]])
        out = clamp_rows(H)
        assert torch.equal(out[0], H[0])
        torch.testing.assert_close(out[1], H[1] / 1.5)


class TestMhcLite:
    def test_permutations_lexicographic_and_convention(self):
        P = permutation_matrices(3)
        perms = list(itertools.permutations(range(3)))
        assert P.shape == (6, 3, 3)
        assert torch.equal(P[0], torch.eye(3))
        X = torch.arange(3.0).view(3, 1) * 10 + 1
        for r, pi in enumerate(perms):
            assert torch.equal((P[r] @ X).flatten(), X.flatten()[list(pi)])  # (P_r X)_i = X_{π_r(i)}

    @settings(max_examples=100, deadline=None)
    @given(st.integers(2, 5), st.data())
    def test_exactly_doubly_stochastic(self, n, data):
        vals = data.draw(st.lists(finite_logits, min_size=math.factorial(n), max_size=math.factorial(n)))
        H = mhc_lite_mix(torch.tensor(vals), n)
        assert torch.isfinite(H).all() and (H >= 0).all()
        assert (H.sum(-1) - 1).abs().max() <= 1e-6
        assert (H.sum(-2) - 1).abs().max() <= 1e-6

    def test_init_constants(self):
        """Identity logit 0, others −8, N=4: diag 0.994008, off 0.001997 (docs/math.md §2.0, §5.4)."""
        z = torch.full((24,), -8.0, dtype=torch.float64)
        z[0] = 0
        H = mhc_lite_mix(z, 4)
        assert abs(float(H[0, 0]) - 0.994008) < 5e-7
        assert abs(float(H[0, 1]) - 0.001997) < 5e-7

    def test_refuses_large_n(self):
        with pytest.raises(ValueError, match="n <= 6"):
            permutation_matrices(7)


class TestKromHC:
    def test_matches_torch_kron_and_bit_formula(self):
        g = torch.Generator().manual_seed(0)
        for n in (2, 4, 8, 16):
            K = n.bit_length() - 1
            z = torch.randn(2 * K, generator=g, dtype=torch.float64) * 2
            H = kromhc_mix(z, n)
            U = kromhc_factors(z)
            ref = U[0]
            for t in range(1, K):
                ref = torch.kron(ref, U[t])
            torch.testing.assert_close(H, ref)
            # H[i,j] = Π_t U_t[bit_t(i), bit_t(j)], U_0 on the most significant bit (docs/math.md §2.d)
            for i in range(n):
                for j in range(n):
                    v = 1.0
                    for t in range(K):
                        v *= float(U[t, (i >> (K - 1 - t)) & 1, (j >> (K - 1 - t)) & 1])
                    assert abs(float(H[i, j]) - v) < 1e-14

    @settings(max_examples=100, deadline=None)
    @given(st.sampled_from([2, 4, 8, 16]), st.data())
    def test_exactly_doubly_stochastic_and_symmetric(self, n, data):
        K = n.bit_length() - 1
        vals = data.draw(st.lists(finite_logits, min_size=2 * K, max_size=2 * K))
        H = kromhc_mix(torch.tensor(vals), n)
        assert torch.isfinite(H).all() and (H >= 0).all()
        assert (H.sum(-1) - 1).abs().max() <= 1e-5
        assert (H.sum(-2) - 1).abs().max() <= 1e-5
        torch.testing.assert_close(H, H.transpose(-1, -2))

    def test_init_constant(self):
        """[0, −8] per factor: p = 0.999665, diag p² = 0.999329 at N=4 (docs/math.md §2.0)."""
        H = kromhc_mix(torch.tensor([0.0, -8.0, 0.0, -8.0], dtype=torch.float64), 4)
        assert abs(float(H[0, 0]) - 0.999329) < 5e-7

    def test_batched(self):
        z = torch.randn(5, 3, 6)
        H = kromhc_mix(z, 8)
        assert H.shape == (5, 3, 8, 8)
        torch.testing.assert_close(H[2, 1], kromhc_mix(z[2, 1], 8))

    @pytest.mark.parametrize("n", [1, 3, 6, 12])
    def test_refuses_non_power_of_two(self, n):
        with pytest.raises(ValueError, match="power of two"):
            kromhc_mix(torch.zeros(4), n)


def test_identity_mix():
    H = identity_mix(4, (2, 3))
    assert H.shape == (2, 3, 4, 4)
    assert torch.equal(H[1, 2], torch.eye(4))
