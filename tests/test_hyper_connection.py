"""HyperConnection (HC, mHC, mHC-lite, KromHC, identity): docs/math.md §1.3, §1.6, §2.0–§2.e."""

import itertools
import math

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from xhc.config import HCConfig, HCConfigError
from xhc.hyper_connection import (
    HyperConnection,
    StreamReadout,
    expand_streams,
    near_one_hot_read_bias,
    reduce_streams,
    uniform_read_bias,
)

MHC = ["mhc", "mhc_lite", "kromhc", "identity"]
ALL = ["hc"] + MHC


def prenorm_branch(C, seed=0, dtype=torch.float32):
    """A pre-norm branch F(u) = Linear(GELU(Linear(RMSNorm(u))))."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.RMSNorm(C, eps=1e-6), nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C)).to(dtype)


def postnorm_branch(C, seed=0, dtype=torch.float32):
    """OLMo-2 style F(u) = RMSNorm(Sublayer(u)): no input norm, so Σ h_pre = 1 is required."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C), nn.RMSNorm(C, eps=1e-6)).to(dtype)


def expected_numel(cfg, C):
    """Parameter formulas of docs/math.md §2.0 / §2.a written independently of the module."""
    N = cfg.n
    if cfg.variant == "hc":
        return N * N + 2 * N if not cfg.dynamic else C * (N + 2) + N * N + 2 * N + 2
    R = {"mhc": N * N, "mhc_lite": math.factorial(N), "kromhc": 2 * int(math.log2(N)), "identity": 0}[cfg.variant]
    if cfg.ablate_res:
        R = 0
    groups = (0 if cfg.ablate_pre else N) + (0 if cfg.ablate_post else N) + R
    if not cfg.dynamic:
        return groups
    gates = (0 if cfg.ablate_pre else 1) + (0 if cfg.ablate_post else 1) + (1 if R else 0)
    return N * C * groups + groups + gates + (N * C if cfg.mapping_norm_affine else 0)


def randomize(hc, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


# ------------------------------------------------------------------------------------------------
# float64 references written from docs/math.md equations (per token, explicit loops)
# ------------------------------------------------------------------------------------------------
def mhc_reference_token(X, hc):
    """Dynamic mHC, docs/math.md §2.b, one token: X [N, C] float64 -> (u, X')."""
    N, C = X.shape
    x = X.reshape(N * C)
    xh = x / torch.sqrt((x * x).mean() + 1e-6)
    z_pre = hc.alpha_pre.double() * (xh @ hc.W_pre.double().T) + hc.b_pre.double()
    z_post = hc.alpha_post.double() * (xh @ hc.W_post.double().T) + hc.b_post.double()
    z_res = hc.alpha_res.double() * (xh @ hc.W_res.double().T) + hc.b_res.double()
    h_pre = 1 / (1 + torch.exp(-z_pre))
    h_post = 2 / (1 + torch.exp(-z_post))
    Z = z_res.view(N, N)
    M = torch.exp(Z - Z.max(dim=1, keepdim=True).values)
    M = M / M.sum(1, keepdim=True)
    for _ in range(20):
        M = M / M.sum(0, keepdim=True)
        M = M / M.sum(1, keepdim=True)
    u = sum(h_pre[j] * X[j] for j in range(N))
    return u, h_post, M


class TestInterface:
    @pytest.mark.parametrize("variant", ALL)
    @pytest.mark.parametrize("dynamic", [False, True])
    def test_shapes_and_numel(self, variant, dynamic):
        cfg = HCConfig(variant=variant, n=4, dynamic=dynamic)
        hc = HyperConnection(cfg, 16, layer_index=5)
        assert sum(p.numel() for p in hc.parameters()) == expected_numel(cfg, 16)
        assert all(p.dtype == torch.float32 for p in hc.parameters())
        assert all(p.dim() >= 1 for p in hc.parameters())
        X = torch.randn(7, 3, 4, 16)
        u, ctx = hc.read(X)
        assert u.shape == (7, 3, 16)
        assert hc.write(X, u, ctx).shape == X.shape

    def test_bf16_state_fp32_coefficients(self):
        hc = HyperConnection(HCConfig(variant="mhc", n=4), 16)
        randomize(hc)
        X = torch.randn(5, 2, 4, 16).bfloat16()
        u, ctx = hc.read(X)
        assert u.dtype == torch.bfloat16
        assert ctx.h_pre.dtype == ctx.h_post.dtype == ctx.H_res.dtype == torch.float32
        assert hc.write(X, u, ctx).dtype == torch.bfloat16
        # fp32 accumulation then one cast: equals the fp32 computation rounded once
        u32, _ = hc.read(X.float())
        torch.testing.assert_close(u.float(), u32.bfloat16().float(), rtol=0, atol=0)

    @pytest.mark.parametrize("n,nc", [(4, 6), (16, 3)])
    def test_mapping_norm_affine_count(self, n, nc):
        cfg = HCConfig(variant="kromhc", n=n, mapping_norm_affine=True)
        hc = HyperConnection(cfg, nc)
        assert hc.norm_weight.shape == (n * nc,)
        assert sum(p.numel() for p in hc.parameters()) == expected_numel(cfg, nc)

    def test_xhc_variant_rejected(self):
        with pytest.raises(HCConfigError, match="XHCSublayer"):
            HyperConnection(HCConfig(variant="xhc", n=16), 8)


class TestReference:
    def test_dynamic_mhc_matches_float64_reference(self):
        torch.manual_seed(0)
        N, C = 4, 6
        hc = HyperConnection(HCConfig(variant="mhc", n=N, sinkhorn_recompute=False), C).double()
        randomize(hc, 0.5)
        X = torch.randn(3, N, C, dtype=torch.float64)
        y = torch.randn(3, C, dtype=torch.float64)
        u, ctx = hc.read(X)
        Xn = hc.write(X, y, ctx)
        for t in range(3):
            u_ref, h_post, H = mhc_reference_token(X[t], hc)
            torch.testing.assert_close(u[t], u_ref, rtol=1e-12, atol=1e-12)
            for i in range(N):
                ref_i = sum(H[i, j] * X[t, j] for j in range(N)) + h_post[i] * y[t]
                torch.testing.assert_close(Xn[t, i], ref_i, rtol=1e-12, atol=1e-12)

    def test_lite_and_krom_dynamic_match_reference(self):
        torch.manual_seed(1)
        N, C = 4, 5
        X = torch.randn(2, N, C, dtype=torch.float64)
        for variant in ("mhc_lite", "kromhc"):
            hc = HyperConnection(HCConfig(variant=variant, n=N), C).double()
            randomize(hc, 0.5)
            _, ctx = hc.read(X)
            x = X.reshape(2, N * C)
            xh = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
            z = hc.alpha_res.double() * (xh @ hc.W_res.double().T) + hc.b_res.double()
            if variant == "mhc_lite":
                a = torch.softmax(z, -1)
                perms = list(itertools.permutations(range(N)))
                H = torch.zeros(2, N, N, dtype=torch.float64)
                for r, pi in enumerate(perms):
                    for i in range(N):
                        H[:, i, pi[i]] += a[:, r]
            else:
                U = [torch.softmax(z[:, 2 * t : 2 * t + 2], -1) for t in range(2)]
                H = torch.zeros(2, N, N, dtype=torch.float64)
                for i in range(N):
                    for j in range(N):
                        v = 1.0
                        for t in range(2):
                            bi, bj = (i >> (1 - t)) & 1, (j >> (1 - t)) & 1
                            v = v * U[t][:, 0 if bi == bj else 1]
                        H[:, i, j] = v
            torch.testing.assert_close(ctx.H_res, H, rtol=1e-12, atol=1e-12)

    def test_hc_dynamic_matches_reference(self):
        """[HC] tanh form (docs/math.md §2.a): H_res[j,i] uses stream i's normalised state."""
        torch.manual_seed(2)
        N, C = 3, 5
        hc = HyperConnection(HCConfig(variant="hc", n=N), C).double()
        randomize(hc, 0.5)
        X = torch.randn(N, C, dtype=torch.float64)
        h_pre, h_post, H = hc.coefficients(X)
        Xb = (X - X.mean(-1, keepdim=True)) / torch.sqrt(X.var(-1, unbiased=False, keepdim=True) + 1e-6)
        for i in range(N):
            assert abs(h_pre[i] - (hc.a_pre[i] + hc.s_alpha * torch.tanh(Xb[i] @ hc.w_pre))) < 1e-12
            assert abs(h_post[i] - (hc.a_post[i] + hc.s_beta * torch.tanh(Xb[i] @ hc.w_post))) < 1e-12
            for j in range(N):
                assert abs(H[j, i] - (hc.S_res[j, i] + hc.s_alpha * torch.tanh(Xb[i] @ hc.W_r[:, j]))) < 1e-12

    @pytest.mark.parametrize("variant", ALL)
    def test_gradcheck_full_read_write(self, variant):
        """float64 gradcheck through read -> branch -> write, w.r.t. the state and every HC parameter."""
        torch.manual_seed(3)
        N, C = 4, 3
        hc = HyperConnection(HCConfig(variant=variant, n=N, sinkhorn_iters=5), C).double()
        randomize(hc, 0.5)
        lin = nn.Linear(C, C).double()
        names = [n for n, _ in hc.named_parameters()]
        ps = tuple(p.detach().clone().requires_grad_(True) for _, p in hc.named_parameters())
        X = torch.randn(2, N, C, dtype=torch.float64, requires_grad=True)

        def f(X, *ps):
            return functional_call(hc, dict(zip(names, ps)), (X, lambda u: torch.tanh(lin(u))))

        assert torch.autograd.gradcheck(f, (X, *ps), eps=1e-6, atol=1e-6)


class TestIdentityAtInit:
    """docs/math.md §1.6: with the pre-norm-equivalent init, a wrapped sublayer equals x + F(x)."""

    @pytest.mark.parametrize("variant", ALL)
    @pytest.mark.parametrize("dynamic", [False, True])
    @pytest.mark.parametrize("n", [2, 4])
    def test_sublayer_prenorm_and_postnorm(self, variant, dynamic, n):
        C = 16
        x = torch.randn(6, 3, C)
        for layer_index in range(3):
            hc = HyperConnection(HCConfig(variant=variant, n=n, dynamic=dynamic), C, layer_index)
            for F in (prenorm_branch(C), postnorm_branch(C)):
                X = expand_streams(x, n)
                u, ctx = hc.read(X)
                torch.testing.assert_close(u, x, rtol=0, atol=2e-6)  # Σ h_pre = 1 exactly
                out = hc.write(X, F(u), ctx)
                ref = (x + F(x)).unsqueeze(-2).expand_as(out)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("variant", ALL)
    def test_stack_equals_residual_stack(self, variant):
        """8 sublayers: mean-reduced wrapped stack = plain pre-norm residual stack (fp32 round-off)."""
        C, n = 16, 4
        branches = [prenorm_branch(C, seed=s) for s in range(8)]
        hcs = [HyperConnection(HCConfig(variant=variant, n=n), C, layer_index=l) for l in range(8)]
        x = torch.randn(5, 2, C)
        h = x
        for F in branches:
            h = h + F(h)
        X = expand_streams(x, n)
        for hc, F in zip(hcs, branches):
            u, ctx = hc.read(X)
            X = hc.write(X, F(u), ctx)
        torch.testing.assert_close(reduce_streams(X, "mean"), h, rtol=1e-5, atol=1e-5)
        # sum, then the (scale-invariant) final norm: equal up to the norm's ε
        norm = nn.RMSNorm(C, eps=1e-12)
        torch.testing.assert_close(norm(reduce_streams(X, "sum")), norm(h), rtol=1e-5, atol=1e-5)

    def test_hc_n1_is_exact_residual(self):
        """N = 1 with static HC is exactly a residual connection (docs/math.md §1.6)."""
        C = 8
        hc = HyperConnection(HCConfig(variant="hc", n=1, dynamic=False), C)
        F = prenorm_branch(C)
        x = torch.randn(4, C)
        X = expand_streams(x, 1)
        u, ctx = hc.read(X)
        assert torch.equal(u, x)
        torch.testing.assert_close(hc.write(X, F(u), ctx)[:, 0], x + F(x), rtol=0, atol=1e-6)


class TestInitialisation:
    def test_near_one_hot_constants(self):
        """docs/math.md §2.0: N=4 3.476099 / −4.595120; N=16 1.734601 / −4.595120; Σ σ(b) = 1."""
        for n, hot, other in ((4, 3.476099, -4.595120), (16, 1.734601, -4.595120)):
            b = near_one_hot_read_bias(n, 1, 0.01)
            assert abs(float(b[1]) - hot) < 1e-5
            assert abs(float(b[0]) - other) < 1e-5
            assert abs(float(torch.sigmoid(b.double()).sum()) - 1) < 1e-6

    def test_uniform_read_constants(self):
        """docs/math.md §5.4: −ln(N−1) = 0 / −1.098612 / −1.945910 / −2.708050 for N = 2/4/8/16."""
        for n, v in ((2, 0.0), (4, -1.098612), (8, -1.945910), (16, -2.708050)):
            assert abs(float(uniform_read_bias(n)[0]) - v) < 1e-6

    @pytest.mark.parametrize("variant", MHC)
    def test_hot_stream_follows_sublayer_index(self, variant):
        n = 4
        for l in range(9):
            hc = HyperConnection(HCConfig(variant=variant, n=n), 8, layer_index=l)
            assert int(hc.b_pre.argmax()) == l % n
            assert torch.equal(hc.b_post, torch.zeros(n))  # h_post = 2σ(0) = 1
            assert torch.allclose(hc.alpha_pre, torch.tensor(0.01))
            assert hc.W_pre.abs().sum() == 0

    def test_res_bias_init_values(self):
        """mHC H_res diag 0.998995 (N=4); lite diag 0.994008; Krom diag 0.999329 (docs/math.md §2.0)."""
        X = torch.randn(4, 2)
        for variant, diag in (("mhc", 0.998995), ("mhc_lite", 0.994008), ("kromhc", 0.999329)):
            hc = HyperConnection(HCConfig(variant=variant, n=4), 2)
            _, _, H = hc.coefficients(X)
            assert abs(float(H[0, 0].detach()) - diag) < 1e-6, variant

    def test_peft_preset(self):
        """[PEFT] (docs/math.md §2.g): +8 read, mHC diag +8, lite/Krom −12, static Sinkhorn uniform + noise."""
        n = 4
        hc = HyperConnection(HCConfig(variant="mhc", n=n, preset="peft_paper"), 8, layer_index=6)
        assert float(hc.b_pre[2]) == 8.0
        assert abs(float(torch.sigmoid(hc.b_pre.double()).sum()) - 1) < 1e-6
        assert torch.equal(hc.b_res.view(n, n), 8.0 * torch.eye(n))
        lite = HyperConnection(HCConfig(variant="mhc_lite", n=n, preset="peft_paper"), 8)
        assert float(lite.b_res[0]) == 0 and bool((lite.b_res[1:] == -12).all())
        krom = HyperConnection(HCConfig(variant="kromhc", n=n, preset="peft_paper"), 8)
        assert krom.b_res.tolist() == [0.0, -12.0, 0.0, -12.0]
        st = HyperConnection(HCConfig(variant="mhc", n=n, dynamic=False, preset="peft_paper", init_noise=1e-4), 8, 3)
        h = torch.sigmoid(st.b_pre.double())
        assert abs(float(h.sum()) - 1) < 1e-6  # renormalised after noise
        assert 0 < float((h - 0.25).abs().max()) < 1e-3  # noise broke the symmetry, slightly
        assert float(st.b_res.abs().max()) < 1e-3  # logits ≈ 0: H_res ≈ 11ᵀ/n
        _, _, H = st.coefficients(torch.zeros(n, 8))
        torch.testing.assert_close(H, torch.full((n, n), 1 / n), rtol=0, atol=1e-3)

    def test_reset_parameters_restores_init(self):
        hc = HyperConnection(HCConfig(variant="mhc", n=4), 8, 1)
        ref = {k: v.clone() for k, v in hc.state_dict().items()}
        randomize(hc)
        hc.reset_parameters()
        for k, v in hc.state_dict().items():
            assert torch.equal(v, ref[k]), k


class TestAblations:
    @pytest.mark.parametrize("variant", ["mhc", "kromhc", "hc"])
    def test_neutral_forms(self, variant):
        C, n = 8, 4
        X = torch.randn(5, n, C)
        y = torch.randn(5, C)
        base = HyperConnection(HCConfig(variant=variant, n=n), C)
        randomize(base, 0.5)
        for flag in ("ablate_pre", "ablate_res", "ablate_post"):
            cfg = HCConfig(variant=variant, n=n, **{flag: True})
            hc = HyperConnection(cfg, C)
            hc.load_state_dict({k: v for k, v in base.state_dict().items() if k in hc.state_dict()})
            assert sum(p.numel() for p in hc.parameters()) == expected_numel(cfg, C) if variant != "hc" else True
            u, ctx = hc.read(X)
            out = hc.write(X, y, ctx)
            h_pre, h_post, H = base.coefficients(X)
            if flag == "ablate_pre":
                torch.testing.assert_close(u, X.mean(-2))
                torch.testing.assert_close(out, torch.einsum("tij,tjc->tic", H, X) + h_post[..., None] * y[:, None])
            elif flag == "ablate_res":
                torch.testing.assert_close(out, X + h_post[..., None] * y[:, None])
            else:
                torch.testing.assert_close(out, torch.einsum("tij,tjc->tic", H, X) + y[:, None])


class TestDropoutAndReadout:
    @pytest.mark.parametrize("variant", ["mhc", "mhc_lite", "kromhc"])
    def test_residual_logit_dropout(self, variant):
        hc = HyperConnection(HCConfig(variant=variant, n=4, res_logit_dropout=0.5), 8)
        randomize(hc, 1.0)
        X = torch.randn(200, 4, 8)
        hc.eval()
        _, _, H_eval = hc.coefficients(X)
        _, _, H_eval2 = hc.coefficients(X)
        assert torch.equal(H_eval, H_eval2)  # never applied at inference
        hc.train()
        torch.manual_seed(0)
        _, _, H = hc.coefficients(X)
        assert not torch.allclose(H, H_eval)
        assert torch.isfinite(H).all() and (H >= 0).all()
        assert (H.sum(-1) - 1).abs().max() < 1e-5  # no fully masked row

    def test_softmax_readout_starts_at_mean(self):
        X = torch.randn(3, 2, 4, 8)
        ro = StreamReadout(4, "softmax")
        assert ro.logits.shape == (4,)
        torch.testing.assert_close(ro(X), X.mean(-2))
        with torch.no_grad():
            ro.logits.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
        w = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), 0)
        torch.testing.assert_close(ro(X), sum(w[i] * X[..., i, :] for i in range(4)))
        assert StreamReadout(4, "sum")(X).shape == (3, 2, 8)
        with pytest.raises(HCConfigError, match="reduction"):
            StreamReadout(4, "max")


@pytest.mark.parametrize("variant", ["mhc", "hc"])
def test_ablated_neutral_forms_keep_float64(variant):
    """Neutral read/write weights follow the state's precision (float64 reference tests)."""
    hc = HyperConnection(HCConfig(variant=variant, n=4, ablate_pre=True, ablate_post=True), 6).double()
    X = torch.randn(3, 4, 6, dtype=torch.float64)
    u, ctx = hc.read(X)
    assert u.dtype == torch.float64
    torch.testing.assert_close(u, X.mean(-2), rtol=1e-15, atol=1e-15)
    assert hc.write(X, u, ctx).dtype == torch.float64
