"""``convention: deepseek_v4`` and ``reduction: learned`` against transformers' own DeepSeek-V4 modules
(docs/math.md §2.h).

An independent implementation is the reference: transformers' ``DeepseekV4HyperConnection`` (post,
comb, collapsed input) with the decoder layer's mixing ``post ⊗ y + combᵀ · X``, and
``DeepseekV4HyperHead``.  Weights are random and mapped explicitly (fn = [W_pre; W_post; W_res],
base = [b_pre; b_post; b_res], scale = [α_pre, α_post, α_res]; hc_fn/hc_base/hc_scale by name).
Forward values and gradients (autograd on both sides) must agree to 1e-6 relative in fp32 on every
backend (``triton`` in the interpreter on CPU); a transposed comb must not.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from xhc import doubly_stochastic as ds
from xhc.config import HCConfig, HCConfigError
from xhc.head import LearnedHead
from xhc.hyper_connection import HyperConnection, StreamReadout

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # the Triton kernels run in the interpreter on CPU tensors (set before importing them)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers has DeepSeek-V4 from 5.8.0 on (5.7.0 has no models/deepseek_v4): only the tests that
# compare with it skip on an older one (tests/skip_allowlist.txt)
try:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
except ImportError:
    dsv4 = DeepseekV4Config = None


def _needs_transformers_dsv4():
    if dsv4 is None:
        pytest.skip("transformers older than 5.8.0 has no DeepSeek-V4 modules")

C, B, S = 16, 2, 3
BOUND = 1e-6  # relative, fp32, forward and gradients


def _cases():
    """(N, backend): eager and compile for N = 2, 4, 8 (fast tier); triton (the interpreter on CPU)
    for every N and the compile ops traced whole by dynamo (fullgraph) at N = 8, in the slow tier."""
    out = [(n, b) for n in (2, 4, 8) for b in ("eager", "compile")]
    out.append(pytest.param(8, "compile+dynamo", marks=pytest.mark.inductor, id="8-compile+dynamo"))
    try:
        import triton  # noqa: F401

        out += [pytest.param(n, "triton", marks=pytest.mark.interp, id=f"{n}-triton") for n in (2, 4, 8)]
    except Exception:
        pass
    return out


def _kernels(backend):
    return backend.split("+")[0]


def _device(backend):
    return "cuda" if (backend == "triton" and HAS_CUDA) else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _pair(n: int, backend: str, seed: int = 0):
    """(transformers' DeepseekV4HyperConnection, our HyperConnection) with the same random weights."""
    _needs_transformers_dsv4()
    g = torch.Generator().manual_seed(seed)
    hf_cfg = DeepseekV4Config(hidden_size=C, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    ref = dsv4.DeepseekV4HyperConnection(hf_cfg)
    with torch.no_grad():
        ref.fn.copy_(0.3 * torch.randn(ref.fn.shape, generator=g))
        ref.base.copy_(torch.randn(ref.base.shape, generator=g))
        ref.scale.copy_(1.0 + 0.5 * torch.randn(3, generator=g))
    cfg = HCConfig(variant="mhc", n=n, convention="deepseek_v4", kernels=_kernels(backend), sinkhorn_iters=20,
                   sinkhorn_eps=hf_cfg.hc_eps, norm_eps=hf_cfg.rms_norm_eps)
    ours = HyperConnection(cfg, C)
    with torch.no_grad():  # fn rows [pre | post | comb] = [W_pre; W_post; W_res]; no transpose of comb's logits
        for name, rows in (("pre", slice(0, n)), ("post", slice(n, 2 * n)), ("res", slice(2 * n, None))):
            getattr(ours, f"W_{name}").copy_(ref.fn[rows])
            getattr(ours, f"b_{name}").copy_(ref.base[rows])
        for k, name in enumerate(("pre", "post", "res")):
            getattr(ours, f"alpha_{name}").copy_(ref.scale[k : k + 1])
    dev = _device(backend)
    return ref.to(dev), ours.to(dev)


def _inputs(n, dev, seed=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, S, n, C, generator=g).to(dev)
    y = torch.randn(B, S, C, generator=g).to(dev)
    return X, y


def _run_ref(ref, X, y):
    post, comb, collapsed = ref(X)
    mixed = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), X)  # the decoder layer's
    return {"post": post, "comb": comb, "collapsed": collapsed, "mixed": mixed}


def _run_ours(ours, X, y, transpose_comb=False, traced=False):
    if traced:  # dynamo traces the whole sublayer (no inductor: fast); a graph break is an error
        torch._dynamo.reset()
        fn = torch.compile(lambda X_, y_: _run_ours(ours, X_, y_, transpose_comb), backend="eager", fullgraph=True)
        return fn(X, y)
    u, ctx = ours.read(X)
    comb = ctx.H_res.transpose(-1, -2)  # H_res = combᵀ
    if transpose_comb:  # the deliberate orientation bug: H_res = comb
        from xhc.hyper_connection import HCContext

        ctx = HCContext(ctx.h_pre, ctx.h_post, comb)
    mixed = ours.write(X, y, ctx)
    return {"post": ctx.h_post, "comb": comb, "collapsed": u, "mixed": mixed}


def _grads(outs, leaves, seed=2):
    """Gradients of Σ_k ⟨R_k, out_k⟩ (fixed random R_k) with respect to ``leaves``."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((torch.randn(o.shape, generator=g).to(o.device) * o).sum() for o in outs.values())
    return torch.autograd.grad(loss, leaves)


def _errors(n, backend, transpose_comb=False):
    ref, ours = _pair(n, backend)
    dev = _device(backend)
    X, y = _inputs(n, dev)
    Xr, yr = X.clone().requires_grad_(), y.clone().requires_grad_()
    Xo, yo = X.clone().requires_grad_(), y.clone().requires_grad_()
    r = _run_ref(ref, Xr, yr)
    o = _run_ours(ours, Xo, yo, transpose_comb, traced=backend.endswith("+dynamo"))
    err = {k: _rel(o[k], r[k]) for k in r}
    # gradients only through the mixed output (and the collapsed input): post and comb enter it
    gr = _grads({"collapsed": r["collapsed"], "mixed": r["mixed"]}, [Xr, yr, ref.fn, ref.base, ref.scale])
    go = _grads({"collapsed": o["collapsed"], "mixed": o["mixed"]},
                [Xo, yo, ours.W_pre, ours.W_post, ours.W_res, ours.b_pre, ours.b_post, ours.b_res,
                 ours.alpha_pre, ours.alpha_post, ours.alpha_res])
    err["dX"], err["dy"] = _rel(go[0], gr[0]), _rel(go[1], gr[1])
    err["dparams"] = _rel(torch.cat([t.flatten() for t in go[2:]]), torch.cat([t.flatten() for t in gr[2:]]))
    info = {"dfn": _rel(torch.cat(go[2:5]), gr[2]), "dbase": _rel(torch.cat(go[5:8]), gr[3]),
            "dscale": _rel(torch.cat(go[8:11]), gr[4])}
    return err, info


@pytest.mark.parametrize("n, backend", _cases())
def test_sublayer_matches_transformers(n, backend):
    """post, comb, collapsed input, mixed output, dX, dy and the parameter gradient within 1e-6 relative (fp32).

    The parameter gradient is one vector, d[fn | base | scale] (transformers' three tensors): the
    three gates' gradients alone are sums over tokens whose last bits differ between the reference
    order (normalise, then project) and the fused backends' (project, then normalise: §1.5), by up
    to ~4e-6 of their value at these sizes, which is rounding, not a different map."""
    err, info = _errors(n, backend)
    print(f"PARITY sublayer N={n} {backend}: " + " ".join(f"{k}={v:.2e}" for k, v in {**err, **info}.items()))
    bad = {k: v for k, v in err.items() if not v <= BOUND}
    assert not bad, f"N={n} {backend}: relative errors above {BOUND}: {bad} (all: {err}, per tensor: {info})"
    if backend == "eager":  # the same operations in the same order
        assert max(info.values()) <= BOUND, info


@pytest.mark.parametrize("n", [4, 8])
def test_transposed_comb_fails(n):
    """The orientation bug (H_res = comb, Megatron-LM issue #4957) is caught: the mixed output and the
    gradients miss the reference by far more than the bound.  (N = 2 cannot show it: every 2×2 doubly
    stochastic matrix is symmetric, see below.)"""
    err, _ = _errors(n, "eager", transpose_comb=True)
    print(f"TRANSPOSED N={n}: " + " ".join(f"{k}={v:.2e}" for k, v in err.items()))
    assert err["comb"] <= BOUND  # the same comb ...
    assert err["mixed"] > 1e3 * BOUND and err["dX"] > 1e3 * BOUND, err  # ... applied the wrong way round


def test_orientation_is_moot_at_two_streams():
    """At N = 2 a converged comb is symmetric (rows and columns summing to 1 force [[a, 1−a], [1−a, a]]), so
    the transposed comb changes the mix only by what Sinkhorn left unconverged: why the test above starts at N = 4."""
    comb = ds.sinkhorn_deepseek(torch.randn(50, 2, 2, generator=torch.Generator().manual_seed(0)), 20, 1e-6)
    assert (comb - comb.transpose(-1, -2)).abs().max() < 1e-4


@pytest.mark.parametrize("n, backend", _cases())
def test_learned_head_matches_transformers(n, backend):
    _needs_transformers_dsv4()
    g = torch.Generator().manual_seed(3)
    hf_cfg = DeepseekV4Config(hidden_size=C, hc_mult=n, hc_eps=1e-6, rms_norm_eps=1e-6)
    ref = dsv4.DeepseekV4HyperHead(hf_cfg)
    with torch.no_grad():
        ref.hc_fn.copy_(0.3 * torch.randn(ref.hc_fn.shape, generator=g))
        ref.hc_base.copy_(torch.randn(n, generator=g))
        ref.hc_scale.copy_(1.0 + 0.5 * torch.randn(1, generator=g))
    ours = LearnedHead(HCConfig(variant="mhc", n=n, reduction="learned", kernels=_kernels(backend)), C)
    ours.load_state_dict(ref.state_dict())  # the same names: hc_fn, hc_base, hc_scale
    dev = _device(backend)
    ref, ours = ref.to(dev), ours.to(dev)
    X, _ = _inputs(n, dev)
    Xr, Xo = X.clone().requires_grad_(), X.clone().requires_grad_()
    hr = ref(Xr)
    if backend.endswith("+dynamo"):
        torch._dynamo.reset()
        ho = torch.compile(ours, backend="eager", fullgraph=True)(Xo)
    else:
        ho = ours(Xo)
    gr = _grads({"h": hr}, [Xr, ref.hc_fn, ref.hc_base, ref.hc_scale])
    go = _grads({"h": ho}, [Xo, ours.hc_fn, ours.hc_base, ours.hc_scale])
    info = {k: _rel(a, b) for k, a, b in zip(("dfn", "dbase", "dscale"), go[1:], gr[1:])}
    err = {"h": _rel(ho, hr), "dX": _rel(go[0], gr[0]),
           "dparams": _rel(torch.cat([t.flatten() for t in go[1:]]), torch.cat([t.flatten() for t in gr[1:]]))}
    print(f"PARITY head N={n} {backend}: " + " ".join(f"{k}={v:.2e}" for k, v in {**err, **info}.items()))
    assert all(v <= BOUND for v in err.values()), f"N={n} {backend}: {err} (per tensor: {info})"
    if backend == "eager":
        assert max(info.values()) <= BOUND, info


def test_sinkhorn_deepseek_adjoint_and_invariants():
    """The hand-written adjoint equals autograd through the loop (float64); columns sum to s/(s+ε) < 1."""
    Z = torch.randn(7, 4, 4, dtype=torch.float64, requires_grad=True)
    G = torch.randn(7, 4, 4, dtype=torch.float64)
    M = ds.sinkhorn_deepseek(Z, 20, 1e-6)
    (auto,) = torch.autograd.grad(M, Z, G)
    hand = ds.sinkhorn_deepseek_backward(Z.detach(), G, 20, 1e-6)
    torch.testing.assert_close(hand, auto, rtol=1e-12, atol=1e-12)
    cols = M.detach().sum(-2)
    assert (cols < 1).all() and torch.allclose(cols, torch.ones_like(cols), atol=1e-5)
    assert torch.allclose(M.detach().sum(-1), torch.ones(7, 4, dtype=torch.float64), atol=1e-5)


def test_learned_head_init_and_readout():
    cfg = HCConfig(variant="mhc", n=4, reduction="learned", kernels="eager")
    head = LearnedHead(cfg, C)
    X = torch.randn(B, S, 4, C)
    torch.testing.assert_close(head(X), (0.5 + cfg.sinkhorn_eps) * X.sum(-2))  # w = σ(0) + ε at init
    with pytest.raises(HCConfigError, match="LearnedHead"):
        StreamReadout(4, "learned")


def _upcycled_stack(compensate: bool, L: int = 12):
    """L DeepSeek-V4 mHC sublayers and the learned head in the upcycling state (tools.hf.conversion),
    driven by pre-norm branches y = tanh(RMSNorm(u) W_l), against the vanilla residual stack."""
    from tools.hf import upcycle_init, upcycle_overrides
    from xhc.hyper_connection import expand_streams

    cfg = HCConfig(variant="mhc", n=4, kernels="eager",
                   **{**upcycle_overrides("mhc"), "convention": "deepseek_v4", "reduction": "learned"})
    subs = torch.nn.ModuleList([HyperConnection(cfg, C, i) for i in range(L)]).double()  # float64: no round-off
    head = LearnedHead(cfg, C).double()
    if compensate:
        upcycle_init(torch.nn.ModuleList([subs, head]), cfg)
    g = torch.Generator().manual_seed(3)
    Ws = [torch.randn(C, C, generator=g, dtype=torch.float64) / C**0.5 for _ in range(L)]
    rms = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    x = torch.randn(B, S, C, generator=g, dtype=torch.float64)
    X, v = expand_streams(x, cfg.n), x
    with torch.no_grad():
        for hc, W in zip(subs, Ws):
            u, ctx = hc.read(X)
            X = hc.write(X, torch.tanh(rms(u) @ W), ctx)
            v = v + torch.tanh(rms(v) @ W)
        return rms(head(X)), rms(v)  # the final norm sees the head's output


def test_upcycling_state_computes_the_vanilla_stack():
    """tools.hf.conversion.upcycle_init: with DeepSeek-V4's + ε terms compensated (h_pre = 1/N, h_post =
    γ_0⋯γ_l, head weights 1/N) the normalised output equals the vanilla residual stack's in float64
    (up to the final norm's own eps acting on the stream's overall scale, ~1e-11); without it the
    ε terms shift it by ~L·ε (12 sublayers: ~1e-5)."""
    got, want = _upcycled_stack(True)
    assert (got - want).abs().max() <= 1e-9
    got, want = _upcycled_stack(False)
    assert (got - want).abs().max() > 1e-6


@pytest.mark.parametrize("bad, match", [
    (dict(variant="kromhc"), "convention"),
    (dict(variant="mhc_lite"), "convention"),
    (dict(variant="xhc"), "convention"),
    (dict(variant="hc"), "convention"),
    (dict(variant="mhc", mapping_norm_affine=True), "mapping_norm_affine"),
    (dict(variant="mhc", sinkhorn_iters=0), "sinkhorn_iters"),
    (dict(variant="mhc", kernels="liger"), "liger"),
])
def test_deepseek_v4_refusals(bad, match):
    with pytest.raises(HCConfigError, match=match) as e:
        HCConfig(convention="deepseek_v4", **bad)
    assert "\n" not in str(e.value)
    with pytest.raises(HCConfigError, match="convention"):
        HCConfig(convention="deepseek")


def test_identity_takes_the_pre_eps():
    """identity under deepseek_v4: only h_pre changes (σ + ε); H_res stays I."""
    paper = HyperConnection(HCConfig(variant="identity", n=4, kernels="eager"), C)
    dsk = HyperConnection(HCConfig(variant="identity", n=4, kernels="eager", convention="deepseek_v4"), C)
    dsk.load_state_dict(paper.state_dict())
    X = torch.randn(B, S, 4, C)
    (p0, q0, H0), (p1, q1, H1) = paper.coefficients(X), dsk.coefficients(X)
    assert H0 is None and H1 is None
    torch.testing.assert_close(p1, p0 + 1e-6, rtol=0, atol=1e-7)
    torch.testing.assert_close(q1, q0)


# ------------------------------------------------------------------------------------------------
# The Megatron model and its Hugging Face export (models/hf/export): the same logits
# ------------------------------------------------------------------------------------------------
@pytest.mark.megatron
@pytest.mark.train
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("variant, hc", [
    ("mhc", {"convention": "deepseek_v4", "reduction": "learned"}),
    ("xhc-flash", {"reduction": "learned"}),
])
def test_export_logits_equal_megatron(variant, hc, tmp_path):
    """A perturbed tiny model with DeepSeek's convention and head (and the head on an xHC variant)
    exports to HF remote code whose logits equal Megatron's (the conversion suite's tolerance),
    from-hf reads it back exactly, and xhc-inspect reports the head's weights (run and folder)."""
    from models.parallel import initialize_parallel
    from models.zoo import build_model, build_transformer_config, load_preset
    from tests.test_convert_hf import PARITY_TOL, _hf, _hf_logits
    from tests.tiny_zoo import SEQ, VOCAB, megatron_logits, perturb, tokens, write_run
    from tools.hf import conversion

    torch.set_num_threads(1)
    initialize_parallel()
    preset = load_preset(f"tiny-moe:{variant}", hc_overrides=hc)
    torch.manual_seed(0)
    model = build_model(preset, build_transformer_config(preset, cpu=True), use_transformer_engine=False,
                        vocab_size=VOCAB, seq_length=SEQ)
    head = [m for m in model.modules() if isinstance(m, LearnedHead)]
    assert len(head) == 1  # the last layer's
    perturb([model], torch.Generator().manual_seed(5))
    run = str(tmp_path / "run")
    write_run(run, f"tiny-moe:{variant}", model, hc=hc)
    conversion.to_hf(conversion.resolve_source(run=run), str(tmp_path / "hf"), dtype="fp32", progress=False,
                     log=lambda *_: None)

    exported_hc = json.load(open(tmp_path / "hf" / "config.json"))["hc"]
    assert {k: exported_hc[k] for k in hc} == hc  # the export runs the run's convention and head
    toks = tokens()
    ref = megatron_logits(model, toks)
    hf = _hf(str(tmp_path / "hf"))
    assert sum(isinstance(m, torch.nn.Module) and type(m).__name__ == "LearnedHead" for m in hf.modules()) == 1
    err = (_hf_logits(hf, toks) - ref).abs().max().item()
    print(f"PARITY {variant} {hc} {err:.3g}")
    assert err <= PARITY_TOL, f"{variant} {hc}: max |Δlogit| = {err:.3g}"

    # from-hf reads the folder back with the run's convention and head: every tensor bit for bit
    from tests.test_convert_hf import _load_megatron

    back = conversion.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"), progress=False)
    back_preset = load_preset(back["preset"])
    assert {k: getattr(back_preset.hc, k) for k in hc} == hc
    sd, got = model.state_dict(), _load_megatron(back["checkpoint"], back_preset, VOCAB, SEQ).state_dict()
    names = [k for k, v in sd.items() if torch.is_tensor(v) and "_extra_state" not in k]
    assert any(".hc_head." in k for k in names)
    assert all(torch.equal(got[k], sd[k]) for k in names), [k for k in names if not torch.equal(got[k], sd[k])][:3]

    # xhc-inspect on the run and on the folder: the head's weights, as a float64 recomputation from
    # the state the exported model's own forward hands its head (hook), on the inspector's tokens
    from tools.inspect import main as inspect_main

    heads = {}
    figures = [] if variant == "mhc" else ["--no-figures"]  # drawing costs seconds: one case draws
    for kind, src, extra in (("run", run, ["--no-figures"]), ("hf", str(tmp_path / "hf"), figures)):
        out = tmp_path / f"inspect-{kind}"
        assert inspect_main([src, "--output", str(out), "--tokens", str(SEQ), "--quiet", *extra]) == 0
        m = json.load(open(out / "inspect.json"))["runs"][0]["inspections"][0]
        assert m["tokens"]["from"].startswith("random token ids"), m["tokens"]
        heads[kind] = m["head"]
    assert (tmp_path / "inspect-hf" / "head.png").is_file() == (variant == "mhc")
    assert "learned head: stream weights" in (tmp_path / "inspect-hf" / "report.md").read_text()
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(0)).view(1, SEQ)
    seen = []
    last = hf.model.layers[-1]
    hook = last.hc_head.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        hf(ids)
    hook.remove()
    cfg, H = last.hc_head.cfg, last.hc_head
    x = seen[0].double().flatten(-2)  # [s, b, N·C]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    w = (torch.sigmoid(H.hc_scale.double() * (x @ H.hc_fn.double().T) + H.hc_base.double())
         + cfg.sinkhorn_eps).flatten(0, -2)
    want = {"weights_mean": w.mean(0), "weights_min": w.min(0).values, "weights_max": w.max(0).values,
            "sum_mean": w.sum(-1).mean()}
    for kind, head in heads.items():
        for key, v in want.items():
            torch.testing.assert_close(torch.tensor(head[key], dtype=torch.float64), v, rtol=1e-5, atol=0,
                                       msg=f"{kind} {key}")
    assert float(w.std(0).max()) > 1e-3  # perturbed weights: the head's weights vary over tokens


# ------------------------------------------------------------------------------------------------
# Accounting (xhc/accounting.py, tools.accounting)
# ------------------------------------------------------------------------------------------------
def test_accounting_of_the_head_and_the_deepseek_sinkhorn():
    from xhc import accounting as A

    cfg = HCConfig(variant="mhc", n=4, reduction="learned", convention="deepseek_v4")
    head = LearnedHead(cfg, C)
    assert sum(p.numel() for p in head.parameters()) == A.head_params(cfg, C).total
    plain = cfg.replace(reduction="sum")
    assert A.hc_params_total(cfg, C, 3).total - A.hc_params_total(plain, C, 3).total == A.head_params(cfg, C).total
    assert A.head_params(plain, C).total == 0
    df = A.training_flops_per_token(cfg, C, 3).gemm - A.training_flops_per_token(plain, C, 3).gemm
    assert df == 6 * head.hc_fn.numel()  # the head's GEMM, once per token (2 FLOPs per MAC, × 3 for training)
    steps = len(ds._sinkhorn_deepseek_steps(cfg.sinkhorn_iters))  # normalisations of 2n² each
    assert A.sinkhorn_deepseek_flops(4, cfg.sinkhorn_iters) == (5 + 2 * steps) * 16  # softmax 4n², + ε n²


def test_tools_accounting_custom_yaml_counts_the_head(tmp_path, capsys):
    from tools import accounting as T

    (tmp_path / "hc.yaml").write_text("variant: mhc\nn: 4\nconvention: deepseek_v4\nreduction: learned\n")
    T.main(["--hidden", "64", "--layers", "2", "--hc-yaml", str(tmp_path / "hc.yaml"), "--json"])
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["variant"] == "mhc"]
    plain = HCConfig(variant="mhc", n=4, convention="deepseek_v4")
    from xhc.accounting import hc_params_total

    assert rows[0]["params_total"] == hc_params_total(plain, 64, 2).total + 4 * 4 * 64 + 4 + 1


@pytest.mark.interp
@pytest.mark.parametrize("n", [3, 5])
def test_triton_sinkhorn_deepseek_with_padding(n):
    """n not a power of two (the kernels pad to the next one): values and gradients of the float64
    reference (the padding must stay out of every sum, in both passes)."""
    pytest.importorskip("triton")
    from xhc.kernels import sinkhorn_ops as triton_ops

    dev = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(7)
    Z = torch.randn(6, n, n, generator=g, dtype=torch.float64).to(dev).requires_grad_()
    G = torch.randn(6, n, n, generator=g, dtype=torch.float64).to(dev)
    ref = ds.sinkhorn_deepseek(Z, 20, 1e-6)
    got = triton_ops.sinkhorn_deepseek(Z, 20, 1e-6)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got, Z, G)[0], torch.autograd.grad(ref, Z, G)[0],
                               rtol=1e-10, atol=1e-12)
