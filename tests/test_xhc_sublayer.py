"""XHCSublayer: routing, dense read, sparse write, scatter (docs/math.md §3.4, §3.5, §3.7, §1.6).

The ``ref_*`` functions below are a float64 reference written directly from docs/math.md equations,
per token and per stream with Python loops; they share no code with ``xhc/`` (the Sinkhorn,
causal conv and Gram–Schmidt references are re-derived here too).  ``tests/test_flash.py``
reuses them.
"""

import math

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from xhc.config import HCConfig, HCConfigError
from xhc.temporal import SequenceContext
from xhc.xhc import XHCSublayer, fused_entry_projections

EPS = 1e-6


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # random inits (router, convs) are drawn from the global generator


# ================================================================================================
# float64 reference from docs/math.md (per token, explicit loops)
# ================================================================================================
def ref_sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


def ref_layer_norm(x):
    """Flat LayerNorm without affine (§1.5)."""
    mu = sum(x.tolist()) / x.numel()
    var = sum((v - mu) ** 2 for v in x.tolist()) / x.numel()
    return (x - mu) / math.sqrt(var + EPS)


def ref_rms_norm(x):
    """Flat RMSNorm without gain (§1.5)."""
    ms = sum(v * v for v in x.tolist()) / x.numel()
    return x / math.sqrt(ms + EPS)


def ref_matvec(x, W_spec):
    """z = x W with W in the documented [in, out] layout, one output at a time."""
    return [float((x * W_spec[:, o]).sum()) for o in range(W_spec.shape[1])]


def ref_sinkhorn(Z, t_max=20, eps=1e-6):
    """docs/math.md §1.4 with explicit entry loops: exp(Z − rowmax), T_r, then t_max × (T_c, T_r)."""
    n = len(Z)
    M = [[math.exp(Z[i][j] - max(Z[i])) for j in range(n)] for i in range(n)]

    def rows(M):
        return [[M[i][j] / max(sum(M[i]), eps) for j in range(n)] for i in range(n)]

    def cols(M):
        cs = [max(sum(M[i][j] for i in range(n)), eps) for j in range(n)]
        return [[M[i][j] / cs[j] for j in range(n)] for i in range(n)]

    M = rows(M)
    for _ in range(t_max):
        M = rows(cols(M))
    return M


def ref_route(x, W_router_spec, N, k, m, router="sigmoid"):
    """Router of §3.4: scores, top-(k−m) of score[m:] with ties to the lower index, I and p."""
    z = ref_matvec(ref_layer_norm(x), W_router_spec)
    if router == "sigmoid":
        score = [ref_sigmoid(v) for v in z]
    else:  # softmax over the non-fixed logits (documented ablation)
        mx = max(z[m:]) if N > m else 0.0
        ex = [math.exp(v - mx) for v in z[m:]]
        score = [ref_sigmoid(v) for v in z[:m]] + [e / sum(ex) for e in ex]
    cands = sorted(range(m, N), key=lambda i: (-score[i], i))[: k - m]
    routed = sorted(cands)
    I = list(range(m)) + routed
    p = [1.0] * m + [score[i] for i in routed]
    return I, p, score


def ref_read_weights(x, W_spec, b, alpha):
    """h = σ(α · RMSNorm(x) W + b) (§3.4)."""
    proj = ref_matvec(ref_rms_norm(x), W_spec)
    return [ref_sigmoid(alpha * proj[i] + float(b[i])) for i in range(len(proj))]


def ref_res(xa, W_spec, b, alpha, k, t_max=20):
    """H_res = clamp_rows(sinkhorn(α·mat(x̂_a W_res) + mat(b_res))) (§3.4, §2.f)."""
    proj = ref_matvec(ref_rms_norm(xa), W_spec)
    Z = [[alpha * proj[i * k + j] + float(b[i * k + j]) for j in range(k)] for i in range(k)]
    H = ref_sinkhorn(Z, t_max)
    return [[H[i][j] / max(sum(H[i]), 1.0) for j in range(k)] for i in range(k)]


def ref_post(xa, W_spec, b, alpha, k, K):
    """H_post = 2σ(α·mat(x̂_a W_post) + mat(b_post)) (§3.4)."""
    proj = ref_matvec(ref_rms_norm(xa), W_spec)
    return [[2 * ref_sigmoid(alpha * proj[j * K + t] + float(b[j * K + t])) for t in range(K)] for j in range(k)]


def ref_components(Y, convs, use_gs, pos_in_doc=None, gs_eps=1e-6):
    """V[t, b] = GS([y, g_1..g_r]) with g_j[t,c] = Σ_i w_j[i,c]·y[t−i,c] (§3.2, §3.3).

    ``Y``: [s, b, C] float64; ``convs``: list of [κ, C]; tap i at t only if t−i ≥ 0 and
    (with ``pos_in_doc``) pos_in_doc[t] ≥ i.  Returns a dict (t, b) -> list of K vectors.
    """
    s, B, C = Y.shape
    out = {}
    for t in range(s):
        for bb in range(B):
            comps = [Y[t, bb].clone()]
            for w in convs:
                g = torch.zeros(C, dtype=torch.float64)
                for i in range(w.shape[0]):
                    if t - i < 0 or (pos_in_doc is not None and int(pos_in_doc[t, bb]) < i):
                        continue
                    g = g + w[i] * Y[t - i, bb]
                comps.append(g)
            if use_gs:
                done = [comps[0]]
                for w in comps[1:]:
                    for v in done:
                        w = w - (float((w * v).mean()) / (float((v * v).mean()) + gs_eps)) * v
                    done.append(w)
                comps = done
            out[(t, bb)] = comps
    return out


def spec_params(hc):
    """Parameters of an XHCSublayer in the documented [in, out] layout, float64."""
    d = lambda t: t.detach().double()  # noqa: E731
    P = {"W_router": d(hc.router.weight).T if hc.router.weight is not None else None}
    for g in ("pre", "res", "post"):
        mod = getattr(hc, g)
        if mod is not None and mod.weight is not None:
            P[f"W_{g}"], P[f"b_{g}"], P[f"alpha_{g}"] = d(mod.weight).T, d(mod.bias), float(mod.alpha.detach())
    P["convs"] = [d(w) for w in hc.temporal.conv] if hc.temporal is not None else []
    return P


def ref_xhc_sublayer(X, branch, P, cfg, K, pos_in_doc=None):
    """One xHC sublayer (§3.4/§3.5) in float64 with per-token, per-stream loops.

    Returns (u [s,b,C], X' [s,b,N,C], list of per-token dicts with I, p, h_pre, H_res, H_post).
    """
    s, B, N, C = X.shape
    k, m = cfg.k, cfg.m
    U = torch.zeros(s, B, C, dtype=torch.float64)
    info = {}
    for t in range(s):
        for bb in range(B):
            x = X[t, bb].reshape(N * C)
            if P["W_router"] is None:
                I, p = list(range(k)), [1.0] * k
            else:
                I, p, _ = ref_route(x, P["W_router"], N, k, m, cfg.router)
            Xa = [X[t, bb, i] for i in I]
            xa = torch.cat(Xa)
            if cfg.dense_read:
                h = ref_read_weights(x, P["W_pre"], P["b_pre"], P["alpha_pre"])
                u = sum(h[i] * X[t, bb, i] for i in range(N))
            else:
                h = ref_read_weights(xa, P["W_pre"], P["b_pre"], P["alpha_pre"])
                u = sum(h[j] * Xa[j] for j in range(k))
            U[t, bb] = u
            H_res = ref_res(xa, P["W_res"], P["b_res"], P["alpha_res"], k, cfg.sinkhorn_iters)
            H_post = ref_post(xa, P["W_post"], P["b_post"], P["alpha_post"], k, K)
            info[(t, bb)] = dict(I=I, p=p, h=h, H_res=H_res, H_post=H_post, Xa=Xa)
    Y = branch(U)
    V = ref_components(Y, P["convs"], cfg.gram_schmidt, pos_in_doc, cfg.gs_eps)
    Xn = X.clone()
    for (t, bb), d in info.items():
        I, p, H_res, H_post, Xa = d["I"], d["p"], d["H_res"], d["H_post"], d["Xa"]
        for j in range(k):
            new = sum(H_res[j][q] * Xa[q] for q in range(k))
            new = new + p[j] * sum(H_post[j][tt] * V[(t, bb)][tt] for tt in range(K))
            Xn[t, bb, I[j]] = new
    return U, Xn, info


# ================================================================================================
# helpers
# ================================================================================================
def make_cfg(**kw):
    base = dict(variant="xhc", n=5, k=3, m=1, kernel_sizes=(2, 3), sinkhorn_iters=20)
    base.update(kw)
    return HCConfig(**base)


def randomize(module, scale=0.5, seed=0, alpha=0.7):
    """Move every HC parameter away from its init so every path carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("alpha"):
                p.fill_(alpha)
            elif "router" in name:
                p.mul_(3.0)  # well-separated scores
            else:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def branch_fn(C, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(C, C, generator=g, dtype=torch.float64) / math.sqrt(C)
    return lambda u: torch.tanh(u @ A.to(u.dtype))


def rand_state(s, b, N, C, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, N, C, generator=g, dtype=torch.float64).to(dtype)


# ================================================================================================
# 1. loop reference (§3.7 #6)
# ================================================================================================
CASES = {
    "attention": (dict(), False),
    "mlp": (dict(), True),
    "mlp_no_gs": (dict(gram_schmidt=False), True),
    "m0": (dict(m=0), True),
    "k_eq_m": (dict(k=2, m=2), True),
    "k_eq_n": (dict(k=5, m=1), False),
    "softmax_router": (dict(router="softmax"), True),
    "no_dense_read": (dict(dense_read=False), True),
    "attn_temporal": (dict(attn_temporal=True), False),
    "no_kernels": (dict(kernel_sizes=()), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_loop_reference(case):
    kw, is_mlp = CASES[case]
    cfg = make_cfg(**kw)
    C, s, b = 6, 7, 2
    hc = XHCSublayer(cfg, C, is_mlp, layer_index=1).double()
    randomize(hc)
    X = rand_state(s, b, cfg.n, C, seed=1)
    F = branch_fn(C)
    u, ctx = hc.read(X)
    Xn = hc.write(X, F(u), ctx)
    U_ref, X_ref, info = ref_xhc_sublayer(X, F, spec_params(hc), cfg, hc.K)
    assert (u - U_ref).abs().max() <= 1e-12
    assert (Xn - X_ref).abs().max() <= 1e-12
    for (t, bb), d in info.items():
        assert ctx.I[t, bb].tolist() == d["I"]
        assert torch.allclose(ctx.p[t, bb], torch.tensor(d["p"], dtype=torch.float64), atol=1e-14)


def test_matches_loop_reference_with_document_resets():
    cfg = make_cfg(kernel_sizes=(3, 4))
    C, s, b = 4, 9, 2
    hc = XHCSublayer(cfg, C, True).double()
    randomize(hc, seed=3)
    X = rand_state(s, b, cfg.n, C, seed=4)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]]).T.contiguous()
    F = branch_fn(C, 2)
    u, ctx = hc.read(X)
    Xn = hc.write(X, F(u), ctx, SequenceContext(pos_in_doc=pos))
    _, X_ref, _ = ref_xhc_sublayer(X, F, spec_params(hc), cfg, hc.K, pos_in_doc=pos)
    assert torch.allclose(Xn, X_ref, atol=1e-12, rtol=0)
    _, X_noreset, _ = ref_xhc_sublayer(X, F, spec_params(hc), cfg, hc.K)
    assert not torch.allclose(Xn, X_noreset, atol=1e-6)  # the resets are live in this test


# ================================================================================================
# 2. invariants (§3.7 #1–#3, §1.6)
# ================================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_inactive_streams_bitwise_unchanged(dtype):
    cfg = make_cfg(n=8, k=3, m=1)
    C, s, b = 8, 6, 3
    hc = XHCSublayer(cfg, C, True)
    randomize(hc)
    if dtype == torch.float64:
        hc = hc.double()
    X = rand_state(s, b, cfg.n, C, seed=2, dtype=dtype)
    u, ctx = hc.read(X)
    assert u.dtype == dtype
    Xn = hc.write(X, torch.tanh(u), ctx)
    assert Xn.dtype == dtype
    active = torch.zeros(s, b, cfg.n, dtype=torch.bool).scatter(-1, ctx.I, True)
    assert torch.equal(Xn[~active], X[~active])  # bitwise
    assert (Xn[active] != X[active]).any()


def test_active_indices_and_route_weights():
    cfg = make_cfg(n=9, k=4, m=2)
    C = 4
    hc = XHCSublayer(cfg, C, False)
    X = rand_state(40, 2, cfg.n, C, seed=5, dtype=torch.float32)
    _, ctx = hc.read(X)
    I, p, score = ctx.I, ctx.p, ctx.score
    assert I.shape == (40, 2, 4) and I.dtype == torch.long
    assert (I[..., :2] == torch.tensor([0, 1])).all()  # fixed streams first
    assert (I[..., 2:].diff(dim=-1) > 0).all() and (I[..., 2:] >= 2).all()  # routed: distinct, ascending
    assert (p[..., :2] == 1).all()
    assert torch.equal(p[..., 2:], score.gather(-1, I[..., 2:]))
    # the routed streams are the top-2 of score[2:]
    thresh = score[..., 2:].sort(-1, descending=True).values[..., 1:2]
    assert (score.gather(-1, I[..., 2:]) >= thresh).all()


@pytest.mark.parametrize("extreme", [False, True])
def test_mapping_ranges(extreme):
    """H_res ≥ 0 with rows within 1e-6 of 1; H_post ∈ (0, 2) (closed [0, 2] once fp32 sigmoids
    saturate on extreme logits); h_pre ∈ (0, 1)."""
    cfg = make_cfg(n=6, k=4, m=1)
    hc = XHCSublayer(cfg, 8, True)
    randomize(hc, scale=3.0 if extreme else 0.5, alpha=3.0 if extreme else 1.0)
    X = rand_state(16, 2, cfg.n, 8, seed=6, dtype=torch.float32)
    _, ctx = hc.read(X)
    H = ctx.H_res
    assert (H >= 0).all() and torch.isfinite(H).all()
    assert (H.sum(-1) - 1).abs().max() <= 1e-6
    if extreme:
        assert ((ctx.H_post >= 0) & (ctx.H_post <= 2)).all()
    else:
        assert ((ctx.H_post > 0) & (ctx.H_post < 2)).all()
        assert ((ctx.h_pre > 0) & (ctx.h_pre < 1)).all()
    Hhat = hc.effective_mixing(ctx)  # global N×N view: unit rows, identity off the active block
    assert (Hhat.sum(-1) - 1).abs().max() <= 1e-6
    inactive = torch.ones(16, 2, cfg.n, dtype=torch.bool).scatter(-1, ctx.I, False)
    eye = torch.eye(cfg.n).expand(16, 2, cfg.n, cfg.n)
    assert torch.equal(Hhat[inactive], eye[inactive])


def test_init_values():
    """§3.4 init: uniform read (b_pre = −ln(N−1), §5.4 constants), H_res ≈ I_k (diag 0.998995 at
    k = 4, §2.0/§5.4), H_post = 1 exactly, W_router std 1/√(N·C)."""
    C = 32
    cfg = make_cfg(n=16, k=4, m=2, kernel_sizes=(4, 8, 12))
    hc = XHCSublayer(cfg, C, True)
    assert torch.allclose(hc.pre.bias, torch.full((16,), -2.708050), atol=1e-6)
    assert torch.allclose(XHCSublayer(make_cfg(n=4, k=2), C, False).pre.bias, torch.full((4,), -1.098612), atol=1e-6)
    assert (hc.pre.weight == 0).all() and (hc.res.weight == 0).all() and (hc.post.weight == 0).all()
    for mod in (hc.pre, hc.res, hc.post):
        assert torch.equal(mod.alpha.detach(), torch.tensor([0.01]))
    std = float(hc.router.weight.detach().std()) * math.sqrt(16 * C)
    assert abs(std - 1) < 0.05
    X = rand_state(4, 2, 16, C, seed=7, dtype=torch.float32)
    _, ctx = hc.read(X)
    diag = ctx.H_res.diagonal(dim1=-2, dim2=-1)
    assert torch.allclose(diag, torch.full_like(diag, 0.998995), atol=2e-6)
    assert (ctx.H_post == 1).all()


@pytest.mark.parametrize("dense_read", [True, False])
def test_first_sublayer_input_is_embedding(dense_read):
    """§3.7 #3: at init Σ h_pre = 1 and, with every stream equal to e, u = e."""
    cfg = make_cfg(n=16, k=4, m=2, dense_read=dense_read)
    C = 16
    hc = XHCSublayer(cfg, C, False)
    e = torch.randn(5, 3, C)
    X = e.unsqueeze(-2).expand(5, 3, 16, C).contiguous()
    u, ctx = hc.read(X)
    assert (ctx.h_pre.sum(-1) - 1).abs().max() <= 1e-6
    assert torch.allclose(u, e, rtol=1e-6, atol=1e-6)


# ================================================================================================
# 3. gradients (§3.7 #5, #6)
# ================================================================================================
@pytest.mark.parametrize("m", [0, 1, 2])
def test_router_gradient_only_on_selected_routed_columns(m):
    cfg = make_cfg(n=6, k=3, m=m)
    C = 4
    hc = XHCSublayer(cfg, C, True)
    randomize(hc)
    X = rand_state(1, 1, cfg.n, C, seed=8, dtype=torch.float32)  # single token
    u, ctx = hc.read(X)
    Xn = hc.write(X, torch.tanh(u), ctx)
    (Xn * torch.randn_like(Xn)).sum().backward()
    g = hc.router.weight.grad  # [N, N·C]: row n is the documented column n
    routed = set(ctx.I[0, 0, m:].tolist())
    for n in range(cfg.n):
        if n in routed:
            assert g[n].abs().sum() > 0, n
        else:
            assert (g[n] == 0).all(), n


def test_gradcheck_float64():
    """§3.7 #6: gradcheck on N=4, k=2, m=1, C=8, s=16 through every input and parameter."""
    cfg = make_cfg(n=4, k=2, m=1, kernel_sizes=(2, 3))
    C, s = 8, 16
    hc = XHCSublayer(cfg, C, True).double()
    randomize(hc, seed=11)
    X = rand_state(s, 1, cfg.n, C, seed=12).requires_grad_(True)
    Y = rand_state(s, 1, 1, C, seed=13)[:, :, 0].requires_grad_(True)
    names = [n for n, _ in hc.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in hc.named_parameters()]

    # precondition: the selection is stable under the finite-difference perturbations
    with torch.no_grad():
        _, ctx = hc.read(X)
        top = ctx.score[..., 1:].sort(-1, descending=True).values
        assert (top[..., 0] - top[..., 1]).min() > 1e-4

    def f(X, Y, *ps):
        state = dict(zip(names, ps))
        u, ctx = call_method(hc, state, "read", X)
        return u, call_method(hc, state, "write", X, torch.tanh(u) + Y, ctx)

    assert torch.autograd.gradcheck(f, (X, Y, *params), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def call_method(module, state, method, *args):
    """``module.<method>(*args)`` with its parameters replaced by ``state`` (torch.func.functional_call)."""

    class _Method(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *a):
            return getattr(self.inner, method)(*a)

    return functional_call(_Method(module), {f"inner.{k}": v for k, v in state.items()}, args)


# ================================================================================================
# 4. ablations behave as documented (§7.1 switches)
# ================================================================================================
def test_k_equals_m_has_no_routing():
    cfg = make_cfg(n=6, k=3, m=3)
    hc = XHCSublayer(cfg, 4, True)
    assert hc.router.weight is None
    X = rand_state(5, 2, 6, 4, seed=14, dtype=torch.float32)
    u, ctx = hc.read(X)
    assert (ctx.I == torch.arange(3)).all() and (ctx.p == 1).all()
    Xn = hc.write(X, torch.tanh(u), ctx)
    assert torch.equal(Xn[..., 3:, :], X[..., 3:, :])  # streams 3..5 are never written


def test_m0_routes_every_stream():
    cfg = make_cfg(n=6, k=2, m=0)
    hc = XHCSublayer(cfg, 4, False)
    X = rand_state(64, 1, 6, 4, seed=15, dtype=torch.float32)
    _, ctx = hc.read(X)
    assert torch.equal(ctx.p, ctx.score.gather(-1, ctx.I))  # no slot has the fixed weight 1
    assert (ctx.I != 0).all(-1).any()  # stream 0 is not always active
    assert (ctx.p < 1).all()


def test_softmax_router():
    cfg_sm, cfg_sg = make_cfg(n=7, k=3, m=1, router="softmax"), make_cfg(n=7, k=3, m=1)
    hs, hg = XHCSublayer(cfg_sm, 4, False), XHCSublayer(cfg_sg, 4, False)
    hs.load_state_dict(hg.state_dict())
    X = rand_state(32, 2, 7, 4, seed=16, dtype=torch.float32)
    _, cs = hs.read(X)
    _, cg = hg.read(X)
    assert torch.allclose(cs.score[..., 1:].sum(-1), torch.ones(32, 2))  # softmax over the non-fixed scores
    assert torch.equal(cs.I, cg.I)  # softmax and sigmoid are monotone in the logits: same selection
    assert not torch.allclose(cs.p[..., 1:], cg.p[..., 1:])  # but different route weights
    assert (cs.p[..., 1:].sum(-1) <= 1).all()  # not renormalised over the selected streams


def test_no_dense_read_reads_only_active_streams():
    """dense_read=False: h_pre over the k active streams (uniform 1/k at init), u = Σ_j h_j X_a[j]."""
    cfg = make_cfg(n=6, k=3, m=1, dense_read=False)
    hc = XHCSublayer(cfg, 4, False)
    assert hc.pre.weight.shape == (3, 3 * 4)
    X = rand_state(8, 2, 6, 4, seed=17, dtype=torch.float32)
    u, ctx = hc.read(X)
    assert ctx.h_pre.shape == (8, 2, 3)
    Xa = X.gather(-2, ctx.I[..., None].expand(8, 2, 3, 4))
    assert torch.allclose(u, Xa.mean(-2), atol=1e-6)
    u_dense, _ = XHCSublayer(make_cfg(n=6, k=3, m=1), 4, False).read(X)
    assert torch.allclose(u_dense, X.mean(-2), atol=1e-6)  # the dense read averages all N streams
    assert not torch.allclose(u, u_dense, atol=1e-3)


def test_mhc_style_ablations():
    cfg = make_cfg(ablate_pre=True, ablate_res=True, ablate_post=True)
    hc = XHCSublayer(cfg, 4, True)
    assert hc.pre.weight is None and hc.res is None and hc.post.weight is None
    X = rand_state(6, 1, cfg.n, 4, seed=18, dtype=torch.float32)
    u, ctx = hc.read(X)
    assert torch.allclose(u, X.mean(-2), atol=1e-6)
    y = torch.randn(6, 1, 4)
    Xn = hc.write(X, y, ctx)
    V = hc.components(y)
    Xa = X.gather(-2, ctx.I[..., None].expand(6, 1, cfg.k, 4))
    expect = Xa + ctx.p[..., None] * V.sum(-2, keepdim=True)  # H_res = I, H_post = 1
    assert torch.allclose(Xn.gather(-2, ctx.I[..., None].expand(6, 1, cfg.k, 4)), expect, atol=1e-6)


# ================================================================================================
# 5. exit-sum identity (§1.6), fused path, counts, config errors
# ================================================================================================
def test_exit_sum_identity():
    """Σ_i X'_i − Σ_i X_i = Σ_q (c_q − 1)·X_a[q] + Σ_t w_t·V_t,  c_q = Σ_j H_res[j,q], w_t = Σ_j p_j H_post[j,t]."""
    cfg = make_cfg(n=7, k=4, m=2)
    hc = XHCSublayer(cfg, 6, True).double()
    randomize(hc, seed=19)
    X = rand_state(9, 2, 7, 6, seed=20)
    u, ctx = hc.read(X)
    y = torch.tanh(u)
    Xn = hc.write(X, y, ctx)
    V = hc.components(y)
    c = ctx.H_res.sum(-2)  # [s, b, k] column sums
    w = (ctx.p[..., None] * ctx.H_post).sum(-2)  # [s, b, K]
    rhs = ((c - 1)[..., None] * ctx.Xa).sum(-2) + (w[..., None] * V).sum(-2)
    assert torch.allclose(Xn.sum(-2) - X.sum(-2), rhs, atol=1e-12, rtol=0)
    assert (c - 1).abs().max() > 1e-8  # columns are not exactly 1 off init: the first term is live


def test_exit_sum_identity_at_init_columns_are_unit():
    cfg = make_cfg(n=7, k=4, m=2)
    hc = XHCSublayer(cfg, 6, False).double()
    X = rand_state(5, 1, 7, 6, seed=21)
    _, ctx = hc.read(X)
    assert (ctx.H_res.sum(-2) - 1).abs().max() <= 1e-12  # symmetric init: exactly doubly stochastic


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_projections_match_reference(dtype, tol):
    cfg = make_cfg(n=6, k=3, m=1)
    ref = XHCSublayer(cfg, 8, True).to(dtype)
    randomize(ref, seed=22)
    fused = XHCSublayer(cfg, 8, True, fused=True).to(dtype)
    fused.load_state_dict(ref.state_dict())
    X = (rand_state(10, 2, 6, 8, seed=23) + 0.3).to(dtype)  # non-zero mean: exercises the LN correction
    u_r, c_r = ref.read(X)
    u_f, c_f = fused.read(X)
    assert torch.equal(c_r.I, c_f.I)
    y = torch.tanh(u_r)
    Xr, Xf = ref.write(X, y, c_r), fused.write(X, y, c_f)
    assert ((Xr - Xf).abs().max() / Xr.abs().max()) <= tol
    assert ((u_r - u_f).abs().max() / u_r.abs().max()) <= tol
    z, _ = fused_entry_projections(X.flatten(-2), ref.router.weight, [ref.pre.weight])
    z_ref = ref_matvec(ref_layer_norm(X[0, 0].flatten().double()), ref.router.weight.detach().double().T)
    assert torch.allclose(z[0, 0].double(), torch.tensor(z_ref, dtype=torch.float64), atol=10 * tol)


def test_parameter_count_matches_spec():
    """§3.1: per layer (4N² + 2k³ + k² + k²·K_r + Σκ)·C + (2N + 2k² + k + k·K_r + 6) = 1256·C + 90."""
    for C in (8, 12):
        cfg = HCConfig(variant="xhc", n=16, k=4, m=2, kernel_sizes=(4, 8, 12))  # docs/math.md §3.1 defaults
        n = XHCSublayer(cfg, C, False).hc_parameter_count() + XHCSublayer(cfg, C, True).hc_parameter_count()
        assert n == 1256 * C + 90
        cfg = HCConfig(variant="xhc", n=4, k=2, m=1, kernel_sizes=(4, 8, 12))  # §5.1 table: 124·C
        n = XHCSublayer(cfg, C, False).hc_parameter_count() + XHCSublayer(cfg, C, True).hc_parameter_count()
        assert n == 124 * C + (2 * 4 + 2 * 4 + 2 + 2 * 4 + 6)


def test_parameter_layout_and_reset():
    cfg = make_cfg(n=6, k=3, m=1)
    hc = XHCSublayer(cfg, 4, True)
    shapes = {n: tuple(p.shape) for n, p in hc.named_parameters()}
    assert shapes["router.weight"] == (6, 24)
    assert shapes["pre.weight"] == (6, 24) and shapes["pre.bias"] == (6,) and shapes["pre.alpha"] == (1,)
    assert shapes["res.weight"] == (9, 12) and shapes["res.bias"] == (9,) and shapes["res.alpha"] == (1,)
    assert shapes["post.weight"] == (9, 12) and shapes["post.bias"] == (9,)  # k·K = 3·3
    assert all(p.dtype == torch.float32 for p in hc.parameters())
    before = {n: p.detach().clone() for n, p in hc.named_parameters()}
    randomize(hc)
    hc.reset_parameters()
    for n, p in hc.named_parameters():
        if "router" in n or "temporal" in n:  # random inits: redrawn
            assert p.shape == before[n].shape
        else:
            assert torch.equal(p, before[n]), n


def test_config_errors_name_the_field():
    with pytest.raises(HCConfigError, match="variant"):
        XHCSublayer(HCConfig(variant="mhc"), 4, False)
    with pytest.raises(HCConfigError, match="dynamic"):
        XHCSublayer(make_cfg(dynamic=False), 4, False)
    with pytest.raises(HCConfigError, match="mapping_norm_affine"):
        XHCSublayer(make_cfg(mapping_norm_affine=True), 4, False)


def test_diagnostics():
    cfg = make_cfg(n=6, k=3, m=1)
    hc = XHCSublayer(cfg, 4, False)
    X = rand_state(20, 3, 6, 4, seed=24, dtype=torch.float32)
    _, ctx = hc.read(X)
    d = hc.diagnostics(ctx)
    load = d["router_load"]
    assert load.shape == (6,) and float(load[0]) == 1.0
    assert abs(float(load.sum()) - 3) < 1e-6
    counts = torch.zeros(6)
    for row in ctx.I.reshape(-1, 3).tolist():
        for i in row:
            counts[i] += 1
    assert torch.allclose(load, counts / 60)
    assert d["h_res_mean"].shape == (3, 3)
    e = math.exp(-8.0)  # init: row softmax of b_res (0 diagonal, −8 off) is already doubly stochastic
    diag, off = 1 / (1 + 2 * e), e / (1 + 2 * e)
    expect = math.sqrt(3 * (1 - diag) ** 2 + 6 * off ** 2)
    assert abs(float(d["h_res_identity_distance"]) - expect) < 1e-6
