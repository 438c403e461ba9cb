"""xHC-Flash and Flash-4sub (docs/math.md §4.1, §4.2, §4.3, §8 #24–#25).

The reference below runs a window the slow, explicit way in float64: it keeps the FULL N-stream
state, reads every sublayer input by an explicit dense read Σ_i h_i X_i of the current full state,
and scatters after every write.  Flash's correction formula and Flash-4sub's split read must
reproduce those dense reads to 1e-10 (the exactness claims of §4.1/§4.2).
"""

import dataclasses

import pytest
import torch

from tests.test_xhc_sublayer import (
    branch_fn,
    call_method,
    rand_state,
    randomize,
    ref_components,
    ref_post,
    ref_read_weights,
    ref_res,
    ref_route,
)
from xhc.config import HCConfig
from xhc.flash import (
    Flash4FirstLayer,
    Flash4SecondLayer,
    Flash4State,
    Flash4Window,
    XHCFlashLayer,
    flash4_read,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_cfg(variant="xhc_flash", **kw):
    base = dict(variant=variant, n=5, k=3, m=1, kernel_sizes=(2, 3))
    base.update(kw)
    return HCConfig(**base)


def spec_map(mod):
    """(W in the documented [in, out] layout, b, α) of a Read/Post/ResMapping, float64."""
    return mod.weight.detach().double().T, mod.bias.detach().double(), float(mod.alpha.detach())


def convs(temporal):
    return [w.detach().double() for w in temporal.conv] if temporal is not None else []


def ref_window(X0, branches, router_W, pre_maps, sublayers, cfg):
    """Explicit float64 window (§4.1/§4.2 definitions).

    ``sublayers``: list of dicts with ``post`` (W, b, α), ``K``, ``convs``, ``res`` (W, b, α) or None.
    Returns (list of u_t [s,b,C], exit state X [s,b,N,C]).
    """
    s, B, N, C = X0.shape
    k, m = cfg.k, cfg.m
    tokens = [(t, b) for t in range(s) for b in range(B)]
    route, h = {}, {}
    for t, b in tokens:  # window entry: one routing decision, every pre-map from X^(0)
        x = X0[t, b].reshape(N * C)
        route[(t, b)] = (list(range(k)), [1.0] * k) if router_W is None else ref_route(x, router_W, N, k, m, cfg.router)[:2]
        h[(t, b)] = [ref_read_weights(x, *pm) for pm in pre_maps]
    X = X0.clone()
    us = []
    for si, sub in enumerate(sublayers):
        U = torch.zeros(s, B, C, dtype=torch.float64)
        for t, b in tokens:  # explicit dense read of the CURRENT full state
            U[t, b] = sum(h[(t, b)][si][i] * X[t, b, i] for i in range(N))
        us.append(U)
        Y = branches[si](U)
        V = ref_components(Y, sub["convs"], cfg.gram_schmidt) if sub["convs"] else {
            tb: [Y[tb]] for tb in tokens}
        Xn = X.clone()
        for t, b in tokens:
            I, p = route[(t, b)]
            Xa = [X[t, b, i] for i in I]
            xa = torch.cat(Xa)
            H_post = ref_post(xa, *sub["post"], k, sub["K"])
            H_res = ref_res(xa, *sub["res"], k, cfg.sinkhorn_iters) if sub["res"] is not None else None
            for j in range(k):
                mixed = Xa[j] if H_res is None else sum(H_res[j][q] * Xa[q] for q in range(k))
                Xn[t, b, I[j]] = mixed + p[j] * sum(H_post[j][q] * V[(t, b)][q] for q in range(sub["K"]))
        X = Xn  # explicit scatter after every sublayer
    return us, X


def flash_ref_args(f):
    subs = [
        dict(post=spec_map(f.post_A), K=f.K_A, convs=convs(f.temporal_A), res=None),
        dict(post=spec_map(f.post_M), K=f.K_M, convs=convs(f.temporal_M),
             res=spec_map(f.res_M) if f.res_M is not None else None),
    ]
    W = f.router.weight.detach().double().T if f.router.weight is not None else None
    return W, [spec_map(f.pre_A), spec_map(f.pre_M)], subs


def flash4_ref_args(w):
    a, b = w.first, w.second
    subs = [
        dict(post=spec_map(a.post_A1), K=a.K_A, convs=convs(a.temporal_A1), res=None),
        dict(post=spec_map(a.post_M1), K=a.K_M, convs=convs(a.temporal_M1), res=None),
        dict(post=spec_map(b.post_A2), K=b.K_A, convs=convs(b.temporal_A2), res=None),
        dict(post=spec_map(b.post_M2), K=b.K_M, convs=convs(b.temporal_M2), res=spec_map(b.res_M2)),
    ]
    W = a.router.weight.detach().double().T if a.router.weight is not None else None
    return W, [spec_map(getattr(a, f"pre_{n}")) for n in ("A1", "M1", "A2", "M2")], subs


def scatter(X0, I, Xa):
    return X0.scatter(-2, I[..., None].expand(*I.shape, X0.shape[-1]), Xa.to(X0.dtype))


# ================================================================================================
# xHC-Flash (§4.1)
# ================================================================================================
FLASH_CASES = {
    "default": dict(),
    "m0": dict(m=0),
    "k_eq_m": dict(k=2, m=2),
    "softmax_router": dict(router="softmax"),
    "attn_temporal": dict(attn_temporal=True),
    "no_gs": dict(gram_schmidt=False),
    "ablate_res": dict(ablate_res=True),
}


@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_flash_matches_explicit_dense_reads(case):
    cfg = make_cfg(**FLASH_CASES[case])
    C, s, b = 6, 6, 2
    f = XHCFlashLayer(cfg, C).double()
    randomize(f)
    X0 = rand_state(s, b, cfg.n, C, seed=1)
    FA, FM = branch_fn(C, 1), branch_fn(C, 2)
    st = f.begin(X0)
    u_A = f.attn_read(st)
    st = f.attn_write(st, FA(u_A))
    u_M = f.mlp_read(st)
    X1 = f.mlp_write(st, FM(u_M))
    (uA_ref, uM_ref), X1_ref = ref_window(X0, [FA, FM], *flash_ref_args(f), cfg)
    assert (u_A - uA_ref).abs().max() <= 1e-10
    assert (u_M - uM_ref).abs().max() <= 1e-10  # exact correction == dense read of X^(A)
    assert (X1 - X1_ref).abs().max() <= 1e-10


def test_flash_correction_equals_dense_read_of_intermediate_state():
    """§4.1 exactness, directly: inp_M + β·y_A == Σ_i h^M_i X^(A)_i with X^(A) = scatter(X^(0), I, X_a^(A))
    and h^M generated from X^(0) (re-derived here from docs/math.md formula)."""
    cfg = make_cfg(n=8, k=4, m=2)
    C = 5
    f = XHCFlashLayer(cfg, C).double()
    randomize(f, seed=4)
    X0 = rand_state(5, 3, cfg.n, C, seed=5)
    st = f.begin(X0)
    st = f.attn_write(st, torch.randn(5, 3, C, dtype=torch.float64))
    XA = scatter(X0, st.I, st.Xa)
    W, b, a = spec_map(f.pre_M)
    for t in range(5):
        for bb in range(3):
            h = ref_read_weights(X0[t, bb].reshape(-1), W, b, a)
            dense = sum(h[i] * XA[t, bb, i] for i in range(cfg.n))
            assert (f.mlp_read(st)[t, bb] - dense).abs().max() <= 1e-10
    # and the attention write touched only the active streams
    inactive = torch.ones(5, 3, cfg.n, dtype=torch.bool).scatter(-1, st.I, False)
    assert torch.equal(XA[inactive], X0[inactive])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_inactive_streams_bitwise_and_dtype(dtype):
    cfg = make_cfg(n=8, k=3, m=1)
    f = XHCFlashLayer(cfg, 8)
    randomize(f)
    X0 = rand_state(6, 2, 8, 8, seed=6, dtype=dtype)
    st = f.begin(X0)
    assert f.attn_read(st).dtype == dtype
    X1 = f(X0, torch.tanh, torch.tanh)
    assert X1.dtype == dtype
    active = torch.zeros(6, 2, 8, dtype=torch.bool).scatter(-1, st.I, True)
    assert torch.equal(X1[~active], X0[~active])
    assert (X1[active] != X0[active]).any()


def test_flash_init_reads_embedding():
    cfg = make_cfg(variant="xhc_flash", n=16, k=4, m=2)
    C = 8
    f = XHCFlashLayer(cfg, C)
    e = torch.randn(4, 2, C)
    X0 = e.unsqueeze(-2).expand(4, 2, 16, C).contiguous()
    st = f.begin(X0)
    assert (st.h_pre.sum(-1) - 1).abs().max() <= 1e-6
    assert torch.allclose(f.attn_read(st), e, atol=1e-6)


def test_flash_state_survives_separate_calls():
    """begin + attention in one call, the MLP in another (as two Megatron sublayer calls would do)."""
    cfg = make_cfg()
    f = XHCFlashLayer(cfg, 6).double()
    randomize(f)
    X0 = rand_state(5, 2, cfg.n, 6, seed=7)
    FA, FM = branch_fn(6, 1), branch_fn(6, 2)

    def attention_call(X):
        st = f.begin(X)
        return f.attn_write(st, FA(f.attn_read(st)))

    def mlp_call(st):
        return f.mlp_write(st, FM(f.mlp_read(st)))

    st = attention_call(X0)
    snapshot = dataclasses.replace(st)
    X1 = mlp_call(st)
    assert torch.equal(X1, f(X0, FA, FM))
    assert torch.equal(mlp_call(st), X1)  # re-running from the same state (recompute) is identical
    assert all(getattr(st, k.name) is getattr(snapshot, k.name) for k in dataclasses.fields(st))


def test_flash_stage_errors():
    f = XHCFlashLayer(make_cfg(), 4)
    st = f.begin(torch.randn(3, 1, 5, 4))
    with pytest.raises(RuntimeError, match="stage"):
        f.mlp_read(st)
    st = f.attn_write(st, torch.randn(3, 1, 4))
    with pytest.raises(RuntimeError, match="stage"):
        f.attn_write(st, torch.randn(3, 1, 4))


def test_flash_gradcheck_float64():
    cfg = make_cfg(n=4, k=2, m=1, kernel_sizes=(2,))
    C, s = 4, 8
    f = XHCFlashLayer(cfg, C).double()
    randomize(f, seed=8)
    X0 = rand_state(s, 1, cfg.n, C, seed=11).requires_grad_(True)
    with torch.no_grad():
        top = f.begin(X0).score[..., 1:].sort(-1, descending=True).values
        assert (top[..., 0] - top[..., 1]).min() > 1e-4  # selection stable under the perturbations
    names = [n for n, _ in f.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in f.named_parameters()]
    FA, FM = branch_fn(C, 1), branch_fn(C, 2)

    def fn(X0, *ps):
        return call_method(f, dict(zip(names, ps)), "forward", X0, FA, FM)

    assert torch.autograd.gradcheck(fn, (X0, *params), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_flash_fused_entry_matches():
    cfg = make_cfg(n=6, k=3, m=1)
    a, b = XHCFlashLayer(cfg, 8, fused=False), XHCFlashLayer(cfg, 8, fused=True)  # reference: unfused maps
    randomize(a)
    b.load_state_dict(a.state_dict())
    X0 = rand_state(6, 2, 6, 8, seed=10, dtype=torch.float32) + 0.2
    Xa_, Xb_ = a(X0, torch.tanh, torch.tanh), b(X0, torch.tanh, torch.tanh)
    assert ((Xa_ - Xb_).abs().max() / Xa_.abs().max()) <= 1e-5


def test_flash_parameter_count():
    """§4.3: dominant (3N² + k³ + k²(1 + K_r) + Σκ)·C = 936·C at N=16, k=4, K_r=4, κ=(4,8,12);
    the C-free part follows the §3.1 shapes: 2(N+1) + (k+1) + (k²+1) + (k·K_r+1)."""
    cfg = HCConfig(variant="xhc_flash", n=16, k=4, m=2, kernel_sizes=(4, 8, 12))
    n8, n9 = XHCFlashLayer(cfg, 8).hc_parameter_count(), XHCFlashLayer(cfg, 9).hc_parameter_count()
    assert n9 - n8 == 936
    assert n8 - 936 * 8 == 2 * 17 + 5 + 17 + 17


def test_flash_accepts_flash4_fallback_and_diagnostics():
    cfg = make_cfg(variant="xhc_flash4")
    f = XHCFlashLayer(cfg, 4, layer_index=7)  # odd last layer of a Flash-4sub model (§4.3)
    st = f.begin(torch.randn(6, 2, 5, 4))
    st = f.attn_write(st, torch.randn(6, 2, 4))
    d = f.diagnostics(st)
    assert abs(float(d["router_load"].sum()) - 3) < 1e-6 and float(d["router_load"][0]) == 1.0
    assert d["h_res_mean"].shape == (3, 3)


# ================================================================================================
# Flash-4sub (§4.2)
# ================================================================================================
FLASH4_CASES = {
    "default": dict(),
    "m0": dict(m=0),
    "softmax_router": dict(router="softmax"),
    "attn_temporal": dict(attn_temporal=True),
}


def drive_flash4(w, X0, branches):
    """Run the window one sublayer at a time; also return the explicit full state after each write."""
    st = w.first.begin(X0)
    us, states = [], []
    for part, (fa, fm) in ((w.first, branches[:2]), (w.second, branches[2:])):
        u = part.attn_read(st)
        us.append(u)
        st = part.attn_write(st, fa(u))
        states.append(scatter(st.X0, st.I, st.Xa))
        u = part.mlp_read(st)
        us.append(u)
        out = part.mlp_write(st, fm(u))
        if isinstance(out, Flash4State):
            st = out
            states.append(scatter(st.X0, st.I, st.Xa))
        else:
            states.append(out)
    return us, states, out


@pytest.mark.parametrize("case", list(FLASH4_CASES))
def test_flash4_matches_explicit_dense_reads(case):
    cfg = make_cfg("xhc_flash4", **FLASH4_CASES[case])
    C, s, b = 5, 6, 2
    w = Flash4Window(cfg, C).double()
    randomize(w)
    X0 = rand_state(s, b, cfg.n, C, seed=2)
    branches = [branch_fn(C, i) for i in range(4)]
    us, _, X2 = drive_flash4(w, X0, branches)
    us_ref, X2_ref = ref_window(X0, branches, *flash4_ref_args(w), cfg)
    for u, ur in zip(us, us_ref):  # split read == dense read of the intermediate state, every sublayer
        assert (u - ur).abs().max() <= 1e-10
    assert (X2 - X2_ref).abs().max() <= 1e-10
    assert torch.equal(w(X0, branches), X2)


def test_flash4_split_read_equals_full_dense_read():
    """base_t + Σ_j h^t[I_j] X_a[j] == Σ_i h^t_i X_i of the explicit full state, with h^t from X^(0)."""
    cfg = make_cfg("xhc_flash4", n=8, k=4, m=2)
    C = 4
    w = Flash4Window(cfg, C).double()
    randomize(w, seed=3)
    X0 = rand_state(4, 2, cfg.n, C, seed=4)
    _, states, _ = drive_flash4(w, X0, [branch_fn(C, i) for i in range(4)])
    st = w.first.begin(X0)
    h = st.h_pre  # [s, b, 4, N]
    for t, name in enumerate(("A1", "M1", "A2", "M2")):
        W, b, a = spec_map(getattr(w.first, f"pre_{name}"))
        for tt in range(4):  # h^t re-derived from docs/math.md formula
            ref = torch.tensor(ref_read_weights(X0[tt, 0].reshape(-1), W, b, a), dtype=torch.float64)
            assert (h[tt, 0, t] - ref).abs().max() <= 1e-12
    full_states = [X0] + states[:3]
    st = w.first.begin(X0)
    for t in range(4):
        X_full = full_states[t]
        dense = torch.einsum("sbn,sbnc->sbc", h[..., t, :], X_full)
        st_t = dataclasses.replace(st, Xa=X_full.gather(-2, st.I[..., None].expand(*st.I.shape, C)), step=t)
        assert (flash4_read(st_t, t) - dense).abs().max() <= 1e-10
    assert (states[3].sum() != X0.sum())  # the window did write


def test_flash4_state_carried_across_two_layer_calls():
    """Layer 2g and layer 2g+1 are separate module calls; the state object passes between them."""
    cfg = make_cfg("xhc_flash4")
    C = 5
    first, second = Flash4FirstLayer(cfg, C, layer_index=2).double(), Flash4SecondLayer(cfg, C, 3).double()
    randomize(first, seed=5)
    randomize(second, seed=6)
    X0 = rand_state(6, 2, cfg.n, C, seed=7).requires_grad_(True)
    fa1, fm1, fa2, fm2 = [branch_fn(C, i) for i in range(4)]

    def layer_2g(X):  # what the Megatron layer 2g does
        return first(X, fa1, fm1)

    def layer_2g1(state):  # what the Megatron layer 2g+1 does
        return second(state, fa2, fm2)

    st = layer_2g(X0)
    assert isinstance(st, Flash4State) and st.step == 2 and st.stage == "A2"
    fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    X2 = layer_2g1(st)
    assert all(getattr(st, k) is v for k, v in fields.items())  # not mutated by layer 2g+1
    assert torch.equal(layer_2g1(st), X2)  # recompute from the carried state is identical
    rebuilt = Flash4State(*[v.clone() if torch.is_tensor(v) else v for v in fields.values()])
    assert torch.equal(layer_2g1(rebuilt), X2)  # a plain bag of tensors: rebuilding it is enough

    w = Flash4Window(cfg, C).double()
    w.first.load_state_dict(first.state_dict())
    w.second.load_state_dict(second.state_dict())
    assert torch.equal(w(X0, [fa1, fm1, fa2, fm2]), X2)

    X2.square().sum().backward()
    assert X0.grad is not None and X0.grad.abs().sum() > 0
    for name in ("router.weight", "pre_A2.weight", "pre_M2.weight", "post_A1.weight", "post_M1.weight"):
        assert first.get_parameter(name).grad.abs().sum() > 0, name
    for name in ("post_A2.weight", "res_M2.weight", "post_M2.weight"):
        assert second.get_parameter(name).grad.abs().sum() > 0, name


def test_flash4_order_errors():
    cfg = make_cfg("xhc_flash4")
    w = Flash4Window(cfg, 4)
    st = w.first.begin(torch.randn(3, 1, 5, 4))
    with pytest.raises(RuntimeError, match="A1"):
        w.second.attn_read(st)
    with pytest.raises(RuntimeError, match="M1"):
        w.first.mlp_write(st, torch.randn(3, 1, 4))


def test_flash4_inactive_streams_bitwise():
    cfg = make_cfg("xhc_flash4", n=8, k=3, m=1)
    w = Flash4Window(cfg, 8)
    randomize(w)
    X0 = rand_state(6, 2, 8, 8, seed=8, dtype=torch.bfloat16)
    st = w.first.begin(X0)
    X2 = w(X0, [torch.tanh] * 4)
    assert X2.dtype == torch.bfloat16
    active = torch.zeros(6, 2, 8, dtype=torch.bool).scatter(-1, st.I, True)
    assert torch.equal(X2[~active], X0[~active])


def test_flash4_gradcheck_float64():
    cfg = make_cfg("xhc_flash4", n=4, k=2, m=1, kernel_sizes=(2,))
    C, s = 4, 6
    w = Flash4Window(cfg, C).double()
    randomize(w, seed=9)
    X0 = rand_state(s, 1, cfg.n, C, seed=10).requires_grad_(True)
    with torch.no_grad():
        top = w.first.begin(X0).score[..., 1:].sort(-1, descending=True).values
        assert (top[..., 0] - top[..., 1]).min() > 1e-4
    names = [n for n, _ in w.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in w.named_parameters()]
    branches = [branch_fn(C, i) for i in range(4)]

    def fn(X0, *ps):
        return call_method(w, dict(zip(names, ps)), "forward", X0, branches)

    assert torch.autograd.gradcheck(fn, (X0, *params), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_flash4_parameter_count_and_split():
    """§4.3: (5N² + k³ + 2k²(1 + K_r) + 2Σκ)·C = 1552·C per two layers at the defaults."""
    cfg = HCConfig(variant="xhc_flash4", n=16, k=4, m=2, kernel_sizes=(4, 8, 12))
    n8, n9 = Flash4Window(cfg, 8).hc_parameter_count(), Flash4Window(cfg, 9).hc_parameter_count()
    assert n9 - n8 == 1552
    assert n8 - 1552 * 8 == 4 * 17 + 2 * 5 + 17 + 2 * 17
    w = Flash4Window(cfg, 8)
    first = {n for n, _ in w.first.named_parameters()}
    second = {n for n, _ in w.second.named_parameters()}
    assert "router.weight" in first and {"pre_A2.weight", "pre_M2.weight"} <= first
    assert {"post_A2.weight", "res_M2.weight", "post_M2.weight"} <= second and "router.weight" not in second
    assert w.first.hc_parameter_count() + w.second.hc_parameter_count() == n8


def test_flash4_fused_entry_and_diagnostics():
    cfg = make_cfg("xhc_flash4", n=6, k=3, m=1)
    a, b = Flash4Window(cfg, 8), Flash4Window(cfg, 8, fused=True)
    randomize(a)
    b.load_state_dict(a.state_dict())
    X0 = rand_state(6, 2, 6, 8, seed=11, dtype=torch.float32) + 0.2
    Xa_, Xb_ = a(X0, [torch.tanh] * 4), b(X0, [torch.tanh] * 4)
    assert ((Xa_ - Xb_).abs().max() / Xa_.abs().max()) <= 1e-5
    st = a.first(X0, torch.tanh, torch.tanh)
    st = a.second.attn_write(st, torch.tanh(a.second.attn_read(st)))
    d = a.second.diagnostics(st)
    assert d["h_res_mean"].shape == (3, 3) and abs(float(d["router_load"].sum()) - 3) < 1e-6
