"""Optimisers (training/optim/core.py; docs/math.md §1.7, §3.1, §6.4, §8 #31).

Single process: param-group membership and weight decay on real zoo models (every HC variant),
the Megatron ``config_overrides`` mapping, Newton–Schulz against an SVD float64 reference and its
singular-value band, Muon against ``torch.optim.Muon``, the update RMS, decoupled weight decay,
grad norm / clipping / non-finite skip, bitwise resume.  TP=2 (+SP) and EP=2 steps against the
single-rank steps run in one torchrun launch (tests/dist/optim_worker.py).
"""

from __future__ import annotations

import io
import math
import re

import pytest
import torch

from models.parallel import destroy_parallel, initialize_parallel
from models.zoo import build_model, build_transformer_config, list_presets, load_preset
from training.optim import (
    NS_COEFFICIENTS,
    PAPER_ADAMW_EPS,
    Muon,
    OptimizerConfig,
    OptimizerConfigError,
    build_optimizer,
    classify_param,
    clip_grad_norm,
    grad_norm,
    hc_defaults_for_optimizer,
    newton_schulz,
    param_groups,
)
from training.optim import megatron_config_overrides, megatron_optimizer_config
from training.schedule import ScheduleConfig, build_scheduler
from xhc.config import HCConfig

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

SMALL = {"num_layers": 2}
TINY = {"num_layers": 2, "hidden_size": 32, "kv_channels": 8, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 16,
        "moe_shared_expert_intermediate_size": 16}
VOCAB, SEQ = 256, 16


@pytest.fixture(scope="module")
def parallel():
    initialize_parallel(tp=1, pp=1, ep=1, seed=1234)
    with torch._dynamo.config.patch(disable=True):  # skip compiling Megatron's router helpers
        yield
    destroy_parallel()


def zoo_model(name, backbone=SMALL, **hc):
    preset = load_preset(name, backbone_overrides=backbone, hc_overrides=hc)
    config = build_transformer_config(preset, cpu=True)
    return build_model(preset, config, vocab_size=VOCAB, seq_length=SEQ)


def group_of(groups):
    """param name -> list of group names holding it."""
    out = {}
    for g in groups:
        for n in g["param_names"]:
            out.setdefault(n, []).append(g["name"])
    return out


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
def test_defaults_follow_the_spec():
    """docs/math.md §6.4 / §8 #31: AdamW β = (0.9, 0.95), wd 0.1, clip 1.0; Muon momentum 0.95, Nesterov,
    5 quintic NS steps (3.4445, −4.7750, 2.0315), RMS 0.2.  ε defaults to 1e-8; the paper's 1e-15
    is a named setting."""
    c = OptimizerConfig()
    assert (c.name, c.betas, c.weight_decay, c.clip_grad) == ("adamw", (0.9, 0.95), 0.1, 1.0)
    assert (c.muon_momentum, c.muon_nesterov, c.muon_ns_steps, c.muon_rms) == (0.95, True, 5, 0.2)
    assert c.muon_ns_coefficients == (3.4445, -4.7750, 2.0315) == NS_COEFFICIENTS
    assert c.eps == 1e-8 and PAPER_ADAMW_EPS == 1e-15 and OptimizerConfig(eps=PAPER_ADAMW_EPS).eps == 1e-15


@pytest.mark.parametrize("kwargs, key", [
    (dict(name="sgd"), "name"),
    (dict(lr=0.0), "lr"),
    (dict(lr=1e-3, min_lr=2e-3), "min_lr"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=0.0), "eps"),
    (dict(clip_grad=-1.0), "clip_grad"),
    (dict(skip_nonfinite="yes"), "skip_nonfinite"),
    (dict(muon_momentum=1.0), "muon_momentum"),
    (dict(muon_ns_steps=0), "muon_ns_steps"),
    (dict(muon_ns_coefficients=(1.0, 2.0)), "muon_ns_coefficients"),
    (dict(muon_rms=0.0), "muon_rms"),
    (dict(muon_ns_dtype="float16"), "muon_ns_dtype"),
    (dict(use_distributed_optimizer="yes"), "use_distributed_optimizer"),
])
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(OptimizerConfigError) as e:
        OptimizerConfig(**kwargs)
    msg = str(e.value)
    assert msg.startswith(f"optimizer.{key}=") and "\n" not in msg


def test_from_dict_and_round_trip():
    cfg = OptimizerConfig.from_dict({"name": "muon", "lr": 4e-4, "betas": [0.9, 0.95]})
    assert cfg.betas == (0.9, 0.95) and OptimizerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(OptimizerConfigError, match=r"^optimizer\.momentum is not an optimizer setting"):
        OptimizerConfig.from_dict({"momentum": 0.9})


def test_gram_schmidt_defaults_off_under_muon():
    """docs/math.md §3.1: Gram–Schmidt on under AdamW, off under Muon, unless the user set it."""
    hc = HCConfig(variant="xhc", n=8, k=4, m=2)
    assert hc.gram_schmidt is True
    assert hc_defaults_for_optimizer(hc, "muon").gram_schmidt is False
    assert hc_defaults_for_optimizer(hc, "adamw").gram_schmidt is True
    assert hc_defaults_for_optimizer(hc.replace(gram_schmidt=False), "adamw").gram_schmidt is True
    assert hc_defaults_for_optimizer(hc, "muon", explicit_keys={"gram_schmidt", "n"}).gram_schmidt is True
    off = hc.replace(gram_schmidt=False)
    assert hc_defaults_for_optimizer(off, "adamw", explicit_keys=["gram_schmidt"]).gram_schmidt is False
    with pytest.raises(OptimizerConfigError, match=r"^optimizer\.name="):
        hc_defaults_for_optimizer(hc, "lamb")


# ------------------------------------------------------------------------------------------------
# Parameter groups on real zoo models
# ------------------------------------------------------------------------------------------------
BACKBONE_MATRIX = re.compile(r"(linear_qkv|linear_proj|linear_fc1|linear_fc2|mlp\.router)\.weight$")


@pytest.mark.parametrize("variant", ["xhc", "mhc"])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_every_param_in_exactly_one_group(parallel, variant, opt_name):
    model = zoo_model(f"tiny-moe:{variant}", reduction="softmax")
    groups = param_groups(model, OptimizerConfig(name=opt_name))
    where = group_of(groups)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(where) == sorted(names)
    assert all(len(v) == 1 for v in where.values()), {n: v for n, v in where.items() if len(v) != 1}
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(names)

    params = dict(model.named_parameters())
    hc = [n for n, p in params.items() if getattr(p, "is_hyper_connection", False)]
    assert any(n.endswith("hc_readout_logits") for n in hc)
    assert all(where[n][0] in ("hc_decay", "hc_no_decay") for n in hc), "HC params are always AdamW"
    assert {where[n][0] for n in params if "embedding" in n or "output_layer" in n} == {"decay"}
    assert {where[n][0] for n in params if "norm" in n and n not in hc} == {"no_decay"}
    matrices = [n for n in params if BACKBONE_MATRIX.search(n) and n not in hc]
    assert any("mlp.router.weight" in n for n in matrices) and any(".local_experts." in n for n in matrices)
    for n in matrices:
        if opt_name == "muon":
            assert where[n][0] == ("muon_expert" if ".local_experts." in n else "muon"), n
        else:
            assert where[n][0] == "decay", n
    # Muon sees exactly the 2-D backbone matrices
    muon = {n for g in groups if g["optimizer"] == "muon" for n in g["param_names"]}
    assert muon == (set(matrices) if opt_name == "muon" else set())
    for g in groups:
        assert g["weight_decay"] == (0.1 if g["name"] in ("muon", "muon_expert", "decay", "hc_decay") else 0.0)


@pytest.mark.parametrize("variant, decayed, not_decayed", [
    ("mhc", {"W_pre", "W_post", "W_res"}, {"b_pre", "b_post", "b_res", "alpha_pre", "alpha_post", "alpha_res"}),
    ("xhc", {"router.weight", "pre.weight", "res.weight", "post.weight", "conv.0", "conv.1", "conv.2"},
     {"pre.bias", "res.bias", "post.bias", "pre.alpha", "res.alpha", "post.alpha"}),
    ("hc", {"W_r", "w_pre", "w_post"}, {"a_pre", "a_post", "S_res", "s_alpha", "s_beta"}),
])
def test_weight_decay_by_name(parallel, variant, decayed, not_decayed):
    """docs/math.md §6.4 / §8 #12: HC projections and conv kernels get the backbone wd; biases, gates and
    static logits get none.  Backbone: matrices (incl. the MoE router) decayed, norms not."""
    model = zoo_model(f"tiny-moe:{variant}", reduction="softmax")
    seen = {}
    for name, p in model.named_parameters():
        info = classify_param(name, p)
        if "hyper_connection." in name:
            leaf = name.split("hyper_connection.", 1)[1].replace("temporal.", "")
            seen.setdefault(leaf, set()).add(info.decay)
        elif name.endswith("hc_readout_logits"):
            assert info.decay is False and info.kind == "hc_static"
        elif "norm" in name:
            assert info.decay is False, name
        else:
            assert info.decay is True, name  # embeddings, output, QKV/proj/fc1/fc2, mlp.router
    assert set(seen) == decayed | not_decayed
    assert all(seen[k] == {True} for k in decayed) and all(seen[k] == {False} for k in not_decayed)


def test_every_zoo_hc_parameter_has_a_named_kind(parallel):
    """No HC parameter of any tiny-moe variant (static and dynamic, with mapping-norm gains) falls
    back to the unnamed rule, and only projections and conv kernels are decayed."""
    variants = [v for v in list_presets() if v.startswith("tiny-moe:")]
    assert len(variants) >= 9
    kinds = set()
    for v in variants:
        family = v.split(":")[1]
        extras = [{}]
        if family in ("mhc", "mhc-lite", "kromhc", "identity"):
            extras += [{"dynamic": False}, {"mapping_norm_affine": True, "reduction": "softmax"}]
        elif family == "hc":
            extras += [{"dynamic": False}]
        elif family.startswith("xhc"):  # no static form, no mapping-norm gain
            extras += [{"reduction": "softmax"}]
        for extra in extras:
            model = zoo_model(v, **extra)
            for name, p in model.named_parameters():
                info = classify_param(name, p, "muon")
                hc = getattr(p, "is_hyper_connection", False)
                assert (info.kind.startswith("hc_")) == hc, name
                if hc:
                    assert info.kind != "hc_other", f"{v} {extra}: {name} has no named rule"
                    assert info.optimizer == "adamw" and info.decay == (info.kind in ("hc_projection", "hc_conv"))
                    kinds.add(info.kind)
    assert kinds == {"hc_projection", "hc_conv", "hc_bias", "hc_gate", "hc_static", "hc_norm"}


def test_megatron_param_groups_get_the_same_weight_decay(parallel):
    """Megatron's own grouping (``_get_param_groups`` with our ``config_overrides``) gives
    ``wd_mult = 0`` to exactly the parameters we do not decay; the OptimizerConfig maps 1:1."""
    from megatron.core.optimizer import _get_param_groups

    model = zoo_model("tiny-moe:xhc", reduction="softmax")
    for name in ("adamw", "muon"):
        cfg = OptimizerConfig(name=name, lr=5e-4, min_lr=5e-5, eps=1e-15, clip_grad=0.7, weight_decay=0.05)
        mcfg = megatron_optimizer_config(cfg, model.config)
        assert (mcfg.optimizer, mcfg.lr, mcfg.min_lr, mcfg.weight_decay) == ("adam", 5e-4, 5e-5, 0.05)
        assert (mcfg.adam_beta1, mcfg.adam_beta2, mcfg.adam_eps, mcfg.clip_grad) == (0.9, 0.95, 1e-15, 0.7)
        assert mcfg.decoupled_weight_decay and mcfg.use_distributed_optimizer == (name == "adamw")
        groups = _get_param_groups([model], mcfg, megatron_config_overrides(cfg))
        no_wd = {id(p) for g in groups if g["wd_mult"] == 0.0 for p in g["params"]}
        assert all(g["wd_mult"] in (0.0, 1.0) for g in groups)
        ours = {id(p) for n, p in model.named_parameters() if not classify_param(n, p, name).decay}
        assert no_wd == ours and len(ours) > 0


# ------------------------------------------------------------------------------------------------
# Newton–Schulz and Muon
# ------------------------------------------------------------------------------------------------
def _with_spectrum(m, n, s, seed):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    k = min(m, n)
    return U[:, :k] @ torch.diag(s) @ V[:, :k].T


def ns_reference(G: torch.Tensor, steps=5, coeffs=NS_COEFFICIENTS) -> torch.Tensor:
    """Independent float64 reference: NS acts on the singular values only,
    ``NS(G) = U · p⁽ˢᵗᵉᵖˢ⁾(σ / ‖G‖_F) · Vᵀ`` with ``p(x) = a x + b x³ + c x⁵``."""
    a, b, c = coeffs
    U, s, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    x = s / torch.linalg.norm(G.double())
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return U @ torch.diag(x) @ Vh


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_newton_schulz_matches_float64_reference(shape):
    m, n = shape
    s = torch.logspace(0, -2, min(m, n), dtype=torch.float64)
    G = _with_spectrum(m, n, s, seed=m + n)
    want = ns_reference(G)
    got64 = newton_schulz(G, dtype=torch.float64)
    assert got64.dtype == torch.float64 and got64.shape == G.shape
    torch.testing.assert_close(got64, want, rtol=0, atol=1e-12)
    got32 = newton_schulz(G.float())
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=0, atol=2e-5)
    # other step counts / coefficients follow the same formula
    torch.testing.assert_close(newton_schulz(G, steps=3, coefficients=(2.0, -1.5, 0.5), dtype=torch.float64),
                               ns_reference(G, steps=3, coeffs=(2.0, -1.5, 0.5)), rtol=0, atol=1e-12)


def test_newton_schulz_singular_values_in_the_quintic_band():
    """Five quintic steps map every σ/‖G‖_F in [3e-3, 1] into ≈ [0.68, 1.20] (the scalar map's
    band), so the update is near-orthogonal rather than exactly orthogonal."""
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(64, 256, generator=g), torch.randn(256, 64, generator=g), torch.randn(96, 32, generator=g)]
    for cond in (10.0, 100.0):
        cases.append(_with_spectrum(64, 32, torch.logspace(0, -math.log10(cond), 32, dtype=torch.float64), 1).float())
    for G in cases:
        sv = torch.linalg.svdvals(G)
        assert sv.min() / sv.norm() >= 3e-3
        out = torch.linalg.svdvals(newton_schulz(G))
        assert out.min() >= 0.67 and out.max() <= 1.21, (tuple(G.shape), out.min().item(), out.max().item())
    # a rank-deficient direction stays zero: NS is odd in each singular value
    G = _with_spectrum(32, 16, torch.cat([torch.ones(15), torch.zeros(1)]).double(), 3)
    assert torch.linalg.svdvals(newton_schulz(G, dtype=torch.float64)).min() < 1e-12


def test_muon_matches_torch_muon():
    """Same update as ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` (an independent
    implementation whose NS runs in bf16) over three steps with momentum and weight decay."""
    g = torch.Generator().manual_seed(1)
    shapes = [(48, 16), (16, 40)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    a = Muon(ours, lr=0.02, weight_decay=0.1, ns_dtype="bfloat16", tp="none")
    b = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in grads:
        for p, q, gr in zip(ours, ref, step):
            p.grad, q.grad = gr.clone(), gr.clone()
        a.step()
        b.step()
    for p, q, p0 in zip(ours, ref, init):
        assert torch.equal(p, q)  # same operations in the same order: bit for bit
        assert (p - p0).abs().max() > 1e-2


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96)])
def test_muon_update_rms(shape):
    """One step, no weight decay: Δ = −lr · 0.2·√max(m, n) · NS(U).  Its RMS is 0.2·lr times the
    RMS of NS's singular values (exactly 0.2·lr for an exactly orthogonal update); with the
    quintic band that is within 20 % of 0.2·lr."""
    g = torch.Generator().manual_seed(sum(shape))
    lr = 0.01
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.randn(shape, generator=g)
    Muon([p], lr=lr, weight_decay=0.0, tp="none").step()
    rms = p.detach().pow(2).mean().sqrt().item()
    sv = torch.linalg.svdvals(newton_schulz(p.grad))  # Nesterov update ∝ grad on the first step
    assert rms == pytest.approx(0.2 * lr * sv.pow(2).mean().sqrt().item(), rel=1e-4)
    assert rms == pytest.approx(0.2 * lr, rel=0.2)


class _Toy(torch.nn.Module):
    """Names follow Megatron's: a backbone matrix, a norm, an HC projection and an HC gate."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.linear_fc1 = torch.nn.Linear(12, 8, bias=False)
        with torch.no_grad():
            self.linear_fc1.weight.copy_(torch.randn(8, 12, generator=g) / 4)
        self.layernorm = torch.nn.LayerNorm(8)
        self.hc = torch.nn.Module()
        self.hc.W_pre = torch.nn.Parameter(torch.randn(4, 16, generator=g))
        self.hc.alpha_pre = torch.nn.Parameter(torch.full((1,), 0.5))
        for p in self.hc.parameters():
            p.is_hyper_connection = True
        with torch.no_grad():
            self.layernorm.weight.add_(0.3)
            self.layernorm.bias.add_(0.2)


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_weight_decay_is_decoupled(opt_name):
    """p₁(wd) − p₁(0) = −lr·wd·p₀ for decayed params, 0 for the others, with any gradient; with
    zero gradients the step is exactly p₀·(1 − lr·wd)."""
    lr, wd = 0.05, 0.1
    g = torch.Generator().manual_seed(4)
    base = _Toy()
    grads = {n: torch.randn(p.shape, generator=g) for n, p in base.named_parameters()}
    decayed = {"linear_fc1.weight", "hc.W_pre"}

    def one_step(weight_decay, zero_grads=False):
        model = _Toy()
        for n, p in model.named_parameters():
            p.grad = torch.zeros_like(p) if zero_grads else grads[n].clone()
        opt = build_optimizer(model, OptimizerConfig(name=opt_name, lr=lr, weight_decay=weight_decay, clip_grad=0.0))
        assert opt.backend == "torch" and ("muon" in opt.optimizers) == (opt_name == "muon")
        assert opt.step().updated
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    p0 = {n: p.detach() for n, p in base.named_parameters()}
    with_wd, without = one_step(wd), one_step(0.0)
    for n in p0:
        want = -lr * wd * p0[n] if n in decayed else torch.zeros_like(p0[n])
        torch.testing.assert_close(with_wd[n] - without[n], want, rtol=0, atol=5e-7)  # a few ulp of p
        assert not torch.equal(without[n], p0[n]), f"{n} did not move"
    zero = one_step(wd, zero_grads=True)
    for n in p0:
        assert torch.equal(zero[n], p0[n] * (1 - lr * wd) if n in decayed else p0[n]), n


# ------------------------------------------------------------------------------------------------
# Grad norm, clipping, non-finite skip
# ------------------------------------------------------------------------------------------------
def test_grad_norm_and_clipping():
    model = _Toy()
    g = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.grad = 3 * torch.randn(p.shape, generator=g)
    want = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert grad_norm(model) == pytest.approx(want, rel=1e-6)
    before = [p.grad.clone() for p in model.parameters()]
    assert clip_grad_norm(model, max_norm=2 * want) == pytest.approx(want, rel=1e-6)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters())), "below the threshold: untouched"
    assert clip_grad_norm(model, max_norm=1.0) == pytest.approx(want, rel=1e-6)
    assert grad_norm(model) == pytest.approx(1.0, rel=1e-5)
    for a, p in zip(before, model.parameters()):
        torch.testing.assert_close(p.grad, a / want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_nonfinite_grad_norm_skips_the_update(opt_name, bad):
    model = _Toy()
    opt = build_optimizer(model, OptimizerConfig(name=opt_name, lr=0.1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert opt.step().updated  # builds optimiser state
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = io.BytesIO()
    torch.save(opt.state_dict(), state)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.linear_fc1.weight.grad[0, 0] = bad
    res = opt.step()
    assert res.updated is False and not math.isfinite(res.grad_norm)
    assert math.isnan(res.grad_norm) == math.isnan(bad)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    state.seek(0)
    assert _equal_nested(opt.state_dict(), torch.load(state))
    assert not math.isfinite(clip_grad_norm(model, 1.0))
    assert torch.equal(model.layernorm.weight.grad, torch.ones_like(model.layernorm.weight)), "grads untouched"


def _equal_nested(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_nested(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# ------------------------------------------------------------------------------------------------
# Bitwise resume
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_name, hc", [("adamw", {}), ("muon", {}),
                                         ("muon", {"convention": "deepseek_v4", "reduction": "learned"})],
                         ids=["adamw", "muon", "muon-deepseek_v4-learned"])  # fmt: skip
def test_resume_is_bitwise(parallel, opt_name, hc):
    """N steps straight == k steps, save (model, optimiser, scheduler) to bytes, rebuild
    everything, load, N − k steps — bit for bit, including Muon momentum and AdamW moments (and
    DeepSeek-V4's convention with the learned head, whose parameters AdamW updates under Muon)."""
    n_steps, k = 3, 2
    ocfg = OptimizerConfig(name=opt_name, lr=3e-3, clip_grad=0.5)
    scfg = ScheduleConfig(kind="wsd", total_steps=n_steps, warmup_steps=1, decay_fraction=0.34)

    def batch(step):
        g = torch.Generator().manual_seed(50 + step)
        t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        return t[:, :-1], t[:, 1:], torch.arange(SEQ).expand(2, SEQ)

    def fresh():
        torch.manual_seed(0)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = zoo_model("tiny-moe:mhc", backbone=TINY, **hc)
        opt = build_optimizer(model, ocfg)
        return model, opt, build_scheduler(opt, scfg, ocfg)

    def run(model, opt, sched, steps):
        for s in steps:
            opt.zero_grad()
            x, y, pos = batch(s)
            model(x, pos, None, labels=y).float().mean().backward()
            assert opt.step().updated
            sched.step()

    straight = fresh()
    init = {k_: v.clone() for k_, v in straight[0].state_dict().items() if torch.is_tensor(v)}
    run(*straight, range(n_steps))

    first = fresh()
    first[0].load_state_dict(init, strict=False)
    run(*first, range(k))
    buf = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[1].state_dict(), "sched": first[2].state_dict()}, buf)
    del first
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    second = fresh()
    second[0].load_state_dict(saved["model"], strict=False)
    second[1].load_state_dict(saved["opt"])
    second[2].load_state_dict(saved["sched"])
    assert second[1].param_groups[0]["lr"] == pytest.approx(0.1 * 3e-3)  # update 2 is the decay: 0.1 × peak
    run(*second, range(k, n_steps))

    for (n, a), (_, b) in zip(straight[0].named_parameters(), second[0].named_parameters()):
        assert torch.equal(a, b), f"{n} differs after resume"
    head = [n for n, _ in straight[0].named_parameters() if ".hc_head." in n]
    assert len(head) == (3 if hc else 0)  # hc_fn, hc_base, hc_scale of the last layer
    assert all(not torch.equal(straight[0].state_dict()[n], init[n]) for n in head)  # the head trained
    assert _equal_nested(straight[1].state_dict(), second[1].state_dict())
    if opt_name == "muon":
        bufs = [s["momentum_buffer"] for s in second[1].optimizers["muon"].state.values()]
        assert bufs and all(b.abs().sum() > 0 for b in bufs)


# ------------------------------------------------------------------------------------------------
# Megatron backend (the GPU path) on CPU
# ------------------------------------------------------------------------------------------------
def torch_with_cuda_factories_on_cpu():
    """A stand-in for the ``torch`` module whose tensor factories (``tensor``, ``zeros``, ...)
    turn ``device='cuda'`` into ``device='cpu'``; install it as a Megatron module's ``torch``."""
    import types

    def on_cpu(fn):
        def wrapped(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)
        return wrapped

    shim = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    for n in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(shim, n, on_cpu(getattr(torch, n)))
    return shim


@pytest.fixture
def megatron_scalars_on_cpu(monkeypatch):
    """Megatron's FP32Optimizer, grad-norm and clip helpers allocate a few ``device='cuda'``
    scalars (and assert ``torch.cuda.FloatTensor`` grads); redirect exactly those to the CPU so the
    optimiser logic itself (Megatron's param groups, AdamW, ChainedOptimizer, our Muon inside
    FP32Optimizer, our step/skip glue) runs here.  Test-only; restored afterwards."""
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.utils as mutils

    shim = torch_with_cuda_factories_on_cpu()
    for module in (mopt, mclip, mutils):
        monkeypatch.setattr(module, "torch", shim)

    def clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
        coeff = max_norm / (total_norm + 1.0e-6)  # Megatron's rule, without the CUDA-type assert
        if coeff < 1.0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(coeff)

    monkeypatch.setattr(mopt, "clip_grad_by_total_norm_fp32", clip_by_total_norm)


@pytest.mark.cpu_gloo  # CPU stand-in for the CUDA scalars (with CUDA: a CUDA-hidden child pytest)
@pytest.mark.parametrize("opt_name", ["adamw", "muon", "muon-sharded"])
def test_megatron_backend_matches_torch_backend(parallel, megatron_scalars_on_cpu, opt_name):
    """Megatron DDP + ``build_optimizer(use_megatron=True)`` (Megatron's AdamW with our wd
    overrides; for Muon our Muon in Megatron's FP32Optimizer chained with Megatron's AdamW) takes
    the same steps as the torch backend on the bare model: grad norms, clipping, the scheduler's
    per-group LR and ``wd_mult``; a non-finite grad skips the update."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from models.parallel import finalize_grads

    sharded = opt_name == "muon-sharded"  # (one rank: the layer-wise optimizer owns everything here)
    cfg = OptimizerConfig(name=opt_name.removesuffix("-sharded"), lr=1e-2, clip_grad=0.5,
                          use_distributed_optimizer=sharded)
    scfg = ScheduleConfig(kind="cosine", total_steps=3, warmup_steps=1)

    def batch(step):
        g = torch.Generator().manual_seed(70 + step)
        t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        return t[:, :-1], t[:, 1:], torch.arange(SEQ).expand(2, SEQ)

    runs = {}
    for backend in ("torch", "megatron"):
        torch.manual_seed(0)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
        preset = load_preset("tiny-moe:mhc", backbone_overrides=TINY)
        config = build_transformer_config(preset, cpu=True)
        model = build_model(preset, config, vocab_size=VOCAB, seq_length=SEQ)
        if backend == "megatron":
            model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        opt = build_optimizer(model, cfg, use_megatron=backend == "megatron")
        assert opt.backend == backend
        sched = build_scheduler(opt, scfg, cfg)
        norms = []
        for step in range(3):
            opt.zero_grad()
            x, y, pos = batch(step)
            model(x, pos, None, labels=y).float().mean().backward()
            if backend == "megatron":
                finalize_model_grads([model])
            else:
                finalize_grads(model)
            result = opt.step()
            assert result.updated
            norms.append(result.grad_norm)
            sched.step()
        runs[backend] = (norms, {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()})
        if backend == "megatron":
            layer_wise = type(opt.megatron_optimizer).__name__ == "ShardedLayerWiseOptimizer"
            assert layer_wise is (cfg.name == "muon")  # Muon's state sharded or replicated; AdamW: Megatron's
            assert (opt.shards is not None) is sharded
            groups = opt.param_groups
            assert {g["wd_mult"] for g in groups} == {0.0, 1.0}
            assert all(g["weight_decay"] == 0.1 * g["wd_mult"] for g in groups)
            # non-finite grad: skipped, nothing moves
            opt.zero_grad()
            x, y, pos = batch(0)
            model(x, pos, None, labels=y).float().mean().backward()
            finalize_model_grads([model])
            model.module.output_layer.weight.main_grad[0, 0] = float("nan")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            result = opt.step()
            assert result.updated is False and math.isnan(result.grad_norm)
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    (n_torch, p_torch), (n_mega, p_mega) = runs["torch"], runs["megatron"]
    assert n_mega == pytest.approx(n_torch, rel=1e-6)
    assert n_torch[0] > cfg.clip_grad  # clipping is active
    for n, p in p_torch.items():
        torch.testing.assert_close(p_mega[n], p, rtol=0, atol=1e-2 * cfg.lr, msg=n)


# ------------------------------------------------------------------------------------------------
# Tensor and expert parallelism (2-rank torchrun)
# ------------------------------------------------------------------------------------------------
@pytest.mark.cpu_gloo
@pytest.mark.slow
def test_tp_and_ep_steps_equal_single_rank_steps(run_torchrun):
    """TP=2+SP (Muon gathers full matrices over TP and expert-TP) and EP=2: grad norms per step
    and the parameters after two AdamW / Muon steps equal the single-rank run; per-shard Muon
    does not (see tests/dist/optim_worker.py)."""
    out = run_torchrun("tests/dist/optim_worker.py", nproc=2, args=("tp", "ep"), timeout=300).stdout
    for mode in ("tp", "ep"):
        assert re.search(rf"^OK {mode}:", out, re.M), out[-3000:]


# ------------------------------------------------------------------------------------------------
# Optimizer state sharded over data parallelism: owners (pure) and the DP runs (torchrun)
# ------------------------------------------------------------------------------------------------
def _fake(shape, tp_dim=None, expert=False):
    p = torch.nn.Parameter(torch.zeros(shape))
    if tp_dim is not None:
        p.tensor_model_parallel, p.partition_dim = True, tp_dim
    if expert:
        p.allreduce = False
    return p


def test_shard_owners_balance_newton_schulz_on_the_full_matrix_and_adamw_by_numel_per_group():
    from training.optim import shard_owner_ranks
    from training.optim import newton_schulz_cost

    # a TP-sharded matrix whose full matrix (32 x 64 at TP = 4) costs more than the unsplit 16 x 64 one,
    # though its local 8 x 64 shard costs less: the full matrix is what Newton–Schulz runs on
    split, whole = _fake((8, 64), tp_dim=0), _fake((16, 64))
    assert newton_schulz_cost((32, 64)) > newton_schulz_cost((16, 64)) > newton_schulz_cost((8, 64))
    owners = shard_owner_ranks([(whole, "muon"), (split, "muon")], dp_size=2, expert_dp_size=1, tp_size=4)
    assert owners == [1, 0]  # largest first onto rank 0
    # AdamW is its own pass (by element count), experts their own group (the expert-DP group)
    items = [(_fake((64, 64)), "muon"), (_fake((4096,)), "adamw"), (_fake((10,)), "adamw"),
             (_fake((64, 64), expert=True), "muon"), (_fake((64, 64), expert=True), "muon"),
             (_fake((32, 64), expert=True), "muon"), (_fake((7,), expert=True), "adamw")]
    owners = shard_owner_ranks(items, dp_size=4, expert_dp_size=2)
    assert owners[:3] == [0, 0, 1]  # the biggest AdamW tensor goes to rank 0 although it owns the matrix
    assert owners[3:] == [0, 1, 0, 0]  # experts over 2 ranks: equal costs alternate, then least loaded
    assert owners == shard_owner_ranks(list(items), dp_size=4, expert_dp_size=2)  # deterministic


def test_sharded_state_on_one_rank_owns_everything(parallel):
    """Without data parallelism the sharded optimizer is the replicated one (no silent change of maths)."""
    model = zoo_model("tiny-moe:xhc", TINY)
    opt = build_optimizer(model, OptimizerConfig(name="muon", use_distributed_optimizer=True), use_megatron=False)
    assert opt.shards is not None and all(opt.shards.owns(p) for p in model.parameters())
    assert not opt.shards.groups  # nothing to exchange
    assert build_optimizer(model, OptimizerConfig(name="muon"), use_megatron=False).shards is None  # torch default


@pytest.mark.cpu_gloo
@pytest.mark.slow
@pytest.mark.parametrize("nproc, modes", [(2, ("dp", "ckpt")), (4, ("tp_dp", "ep_dp"))])
def test_sharded_muon_equals_replicated_and_the_single_rank_run(run_torchrun, nproc, modes):
    """Muon with its state sharded over DP (tests/dist/sharded_muon_worker.py): DP = 2 (tiny-moe:mhc and
    :xhc), TP = 2 + SP × DP = 2 and EP = 2 × DP = 2 equal the replicated run bit for bit and the
    single-rank run within tolerance; one Newton–Schulz per matrix across the group; state bytes per
    rank at most an even split plus the largest parameter's; checkpoint round trips continue bit for bit
    (the GPU path's optimizer: tests/test_elastic_resume.py::test_gpu_muon_state_reshards_and_converts)."""
    out = run_torchrun("tests/dist/sharded_muon_worker.py", nproc=nproc, args=modes, timeout=600).stdout
    for mode in modes:
        assert re.search(rf"^OK {mode} ", out, re.M), out[-3000:]
