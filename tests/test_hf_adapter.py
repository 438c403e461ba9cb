"""mHC adapter on frozen Hugging Face causal LMs ([PEFT], docs/math.md §2.g, §5.1).

Tiny random models are built from configs (``LlamaConfig``, ``Olmo2Config``, ...); nothing is
downloaded.  Expectations come from docs/math.md and the papers (identity at init, Table 1/2 parameter counts,
init values of App. C.3) or from an independent float64 re-implementation of the wrapped forward.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("transformers")

from models.hf.diagnostics import run_adapter_diagnostics  # noqa: E402
from models.hf.mhc_adapter import (  # noqa: E402
    UnsupportedModelError,
    adapter_config,
    adapter_named_parameters,
    adapter_param_groups,
    count_adapter_parameters,
    hc_disabled,
    hc_layers,
    is_wrapped,
    load_adapter,
    mark_adapter_trainable,
    peft_paper_config,
    read_adapter_config,
    record_routing,
    save_adapter,
    trainable_parameter_report,
    unwrap_mhc,
    wrap_with_mhc,
)
from models.hf.tiny import FAMILIES, olmo2_1b_config, olmo2_7b_config, tiny_causal_lm  # noqa: E402
from xhc.config import HCConfig, HCConfigError  # noqa: E402

IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(7))

# (label, kwargs of peft_paper_config) — every variant and ablation the adapter supports
VARIANTS = [
    ("static_mhc", dict(variant="mhc", dynamic=False)),
    ("static_lite", dict(variant="mhc_lite", dynamic=False)),
    ("static_krom", dict(variant="kromhc", dynamic=False)),
    ("dynamic_mhc", dict(variant="mhc", dynamic=True)),
    ("dynamic_lite", dict(variant="mhc_lite", dynamic=True)),
    ("dynamic_krom", dict(variant="kromhc", dynamic=True)),
    ("identity", dict(variant="identity", dynamic=True)),
    ("krom_no_pre", dict(variant="kromhc", dynamic=True, ablate_pre=True)),
    ("krom_no_res", dict(variant="kromhc", dynamic=True, ablate_res=True)),
    ("krom_no_post", dict(variant="kromhc", dynamic=True, ablate_post=True)),
    ("static_mhc_mean", dict(variant="mhc", dynamic=False, reduction="mean")),
    ("spec_preset_mhc", dict(variant="mhc", dynamic=True, preset="spec")),
]

_BACKBONE_LOGITS = {}


def backbone_logits(family: str) -> torch.Tensor:
    if family not in _BACKBONE_LOGITS:
        with torch.no_grad():
            _BACKBONE_LOGITS[family] = tiny_causal_lm(family)(IDS).logits
    return _BACKBONE_LOGITS[family]


def wrapped(family: str, **cfg_kwargs):
    kw = dict(variant="identity", n=4)
    kw.update(cfg_kwargs)
    m = tiny_causal_lm(family)
    return wrap_with_mhc(m, peft_paper_config(**kw))


# ================================================================================================
# Identity at initialisation (docs/math.md §1.6, §2.g #4; [PEFT] App. C.3)
# ================================================================================================
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("label,kw", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_logits_equal_backbone_at_init(family, label, kw):
    ref = backbone_logits(family)
    # noise off: exact identity, fp32 tolerance 1e-5 (docs/math.md §2.g #4)
    m = wrapped(family, init_noise=0.0, **kw)
    with torch.no_grad():
        out = m(IDS).logits
    assert out.shape == ref.shape
    assert (out - ref).abs().max() <= 1e-5
    # paper init noise 1e-4 on: within 1e-2 * max|logit| (docs/math.md §2.g #4), and not bit-equal
    m = wrapped(family, **kw)
    with torch.no_grad():
        out = m(IDS).logits
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_is_live_not_bypassed(family):
    """Perturbing one write coefficient changes the logits (the wrapper really runs the HC path)."""
    m = wrapped(family, init_noise=0.0)
    with torch.no_grad():
        hc_layers(m)[0].hc_mlp.b_post.add_(1.0)
        out = m(IDS).logits
    assert (out - backbone_logits(family)).abs().max() > 1e-3


# ================================================================================================
# Independent float64 reference of the wrapped forward (docs/math.md §1.3, §1.4, §2.0–§2.e, §2.g)
# ================================================================================================
def _ref_sinkhorn(Z, t_max=20, eps=1e-6):
    """docs/math.md §1.4 reference: row-max shift, initial row normalisation, t_max × (T_c, T_r), eps clamped."""
    M = torch.exp(Z - Z.amax(-1, keepdim=True))
    M = M / M.sum(-1, keepdim=True).clamp_min(eps)
    for _ in range(t_max):
        M = M / M.sum(-2, keepdim=True).clamp_min(eps)
        M = M / M.sum(-1, keepdim=True).clamp_min(eps)
    return M


def _ref_mixing(variant, z, n):
    """H_res from the residual logits z [..., R], written directly from docs/math.md tables."""
    if variant == "mhc":
        return _ref_sinkhorn(z.reshape(*z.shape[:-1], n, n))
    if variant == "mhc_lite":
        perms = list(itertools.permutations(range(n)))
        P = torch.zeros(len(perms), n, n, dtype=z.dtype)
        for r, pi in enumerate(perms):
            for i in range(n):
                P[r, i, pi[i]] = 1.0
        return torch.einsum("...r,rij->...ij", torch.softmax(z, -1), P)
    K = int(math.log2(n))
    S = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=z.dtype)
    I2 = torch.eye(2, dtype=z.dtype)
    flat = z.reshape(-1, 2 * K)
    out = []
    for row in flat:
        H = torch.ones(1, 1, dtype=z.dtype)
        for t in range(K):
            p, q = torch.softmax(row[2 * t:2 * t + 2], 0)
            H = torch.kron(H, p * I2 + q * S)
        out.append(H)
    return torch.stack(out).reshape(*z.shape[:-1], n, n)


def _ref_coefficients(hc, X, cfg):
    """(h_pre, h_post, H_res) per token for X [b, s, N, C] (float64), from the raw parameters."""
    n = cfg.n
    x = X.reshape(*X.shape[:-2], -1)
    xh = x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps)
    if cfg.dynamic and cfg.mapping_norm_affine:
        xh = xh * hc.norm_weight

    def z(group):
        b = getattr(hc, f"b_{group}")
        if b is None:
            return None
        if not cfg.dynamic:
            return b.expand(*X.shape[:-2], b.shape[0])
        return getattr(hc, f"alpha_{group}") * (xh @ getattr(hc, f"W_{group}").T) + b

    zp, zq, zr = z("pre"), z("post"), z("res")
    h_pre = torch.full(X.shape[:-1], 1.0 / n, dtype=X.dtype) if zp is None else torch.sigmoid(zp)
    h_post = torch.ones(X.shape[:-1], dtype=X.dtype) if zq is None else 2 * torch.sigmoid(zq)
    H = torch.eye(n, dtype=X.dtype).expand(*X.shape[:-2], n, n) if zr is None else _ref_mixing(cfg.variant, zr, n)
    return h_pre, h_post, H


def _reference_logits(m, ids, family):
    """Expand, per sublayer read -> F -> write (X' = H X + h_post ⊗ y), reduce, final norm, head."""
    cfg = adapter_config(m)
    n = cfg.n
    layers = hc_layers(m)
    dec = m.model
    e = dec.embed_tokens(ids)
    s = ids.shape[1]
    pos = torch.arange(s).unsqueeze(0)
    pe = dec.rotary_emb(e, pos)
    mask = torch.full((s, s), float("-inf"), dtype=e.dtype).triu(1)[None, None]
    X = e.unsqueeze(-2).repeat(1, 1, n, 1)
    for L in layers:
        orig = L._hc_backbone_layer
        pre_norm = hasattr(orig, "input_layernorm")

        def f_attn(u):
            if pre_norm:  # y = Attn(Norm(u))
                return orig.self_attn(hidden_states=orig.input_layernorm(u), attention_mask=mask,
                                      position_embeddings=pe)[0]
            return orig.post_attention_layernorm(  # OLMo-2: y = Norm_post(Attn(u))
                orig.self_attn(hidden_states=u, attention_mask=mask, position_embeddings=pe)[0])

        def f_mlp(u):
            if pre_norm:
                return orig.mlp(orig.post_attention_layernorm(u))
            return orig.post_feedforward_layernorm(orig.mlp(u))

        for hc, f in ((L.hc_attn, f_attn), (L.hc_mlp, f_mlp)):
            h_pre, h_post, H = _ref_coefficients(hc, X, cfg)
            u = (h_pre.unsqueeze(-1) * X).sum(-2)
            y = f(u)
            X = torch.einsum("...ij,...jc->...ic", H, X) + h_post.unsqueeze(-1) * y.unsqueeze(-2)
    if cfg.reduction == "softmax":
        w = torch.softmax(layers[-1].hc_readout.logits, 0)
        h = torch.einsum("n,...nc->...c", w, X)
    else:
        h = X.mean(-2)
    return m.lm_head(dec.norm(h))


@pytest.mark.parametrize("family", ["llama", "olmo2", "qwen3"])
@pytest.mark.parametrize("label,kw", [
    ("dynamic_mhc", dict(variant="mhc", dynamic=True)),
    ("dynamic_lite", dict(variant="mhc_lite", dynamic=True)),
    ("dynamic_krom", dict(variant="kromhc", dynamic=True)),
    ("static_mhc_softmax", dict(variant="mhc", dynamic=False)),
    ("identity_n2", dict(variant="identity", dynamic=True, n=2)),
    ("krom_no_pre", dict(variant="kromhc", dynamic=True, ablate_pre=True)),
    ("mhc_no_post", dict(variant="mhc", dynamic=True, ablate_post=True)),
])
def test_wrapped_forward_matches_float64_reference(family, label, kw):
    """With random (trained-looking) adapter parameters the wrapper equals the formula of docs/math.md."""
    # float64 throughout; the H_pre-ablated case runs in fp32 because xhc's HyperConnection.read
    # builds its uniform 1/N read in the default dtype (float64 input then fails in einsum)
    dtype = torch.float32 if kw.get("ablate_pre") else torch.float64
    m = wrapped(family, **kw).to(dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in adapter_named_parameters(m):
            leaf = name.rsplit(".", 1)[-1]
            if leaf.startswith("W_"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif leaf.startswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g, dtype=p.dtype))
            elif leaf == "norm_weight":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        out = m(IDS).logits
        ref = _reference_logits(m, IDS, family)
        base = m.lm_head(m.model.norm(m.model.embed_tokens(IDS)))  # scale for the tolerance
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    assert (out - ref).abs().max() <= tol * max(float(ref.abs().max()), float(base.abs().max()))
    with torch.no_grad(), hc_disabled(m):
        plain = m(IDS).logits
    if not (kw.get("ablate_post") and family != "olmo2"):
        # (with h_post = 1 the streams stay identical and a pre-norm branch ignores the read's scale)
        assert (out - plain).abs().max() > 1e-3  # the perturbed adapter changes the function


def test_only_h_res_cannot_change_the_function():
    """[PEFT] Table 6 'only H_res' keeps the base loss: with h_pre = 1/n and h_post = 1 the streams
    stay identical, and a row-stochastic H_res maps identical streams to themselves."""
    m = wrapped("olmo2", variant="kromhc", dynamic=True, ablate_pre=True, ablate_post=True, init_noise=0.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in adapter_named_parameters(m):
            p.copy_(2 * torch.randn(p.shape, generator=g))
        out = m(IDS).logits
        H = [r.H_res for r in _routing(m)]
    assert max(float((h - torch.eye(4)).abs().max()) for h in H) > 0.1  # H_res far from I
    assert (out - backbone_logits("olmo2")).abs().max() <= 1e-5


# ================================================================================================
# Supported / unsupported architectures
# ================================================================================================
def test_unsupported_model_error_names_class():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        wrap_with_mhc(gpt2, peft_paper_config())
    with pytest.raises(UnsupportedModelError, match="Linear"):
        wrap_with_mhc(torch.nn.Linear(2, 2), peft_paper_config())


def test_bad_adapter_configs_are_rejected():
    m = tiny_causal_lm("llama")
    with pytest.raises(HCConfigError, match="reduction"):
        wrap_with_mhc(m, HCConfig(variant="kromhc", n=4, reduction="sum"))
    with pytest.raises(HCConfigError, match="variant"):
        wrap_with_mhc(m, HCConfig(variant="xhc", n=4, reduction="mean"))
    wrap_with_mhc(m, peft_paper_config())
    with pytest.raises(ValueError, match="already wrapped"):
        wrap_with_mhc(m, peft_paper_config())


def test_bare_decoder_model_is_wrappable():
    """``LlamaModel`` (no LM head) wraps too; its last hidden state equals the backbone's at init."""
    from transformers import AutoModel

    from models.hf.tiny import tiny_config

    torch.manual_seed(0)
    base = AutoModel.from_config(tiny_config("llama")).eval()
    with torch.no_grad():
        ref = base(IDS).last_hidden_state
        wrap_with_mhc(base, peft_paper_config("kromhc", 4, init_noise=0.0))
        out = base(IDS).last_hidden_state
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5


def test_unwrap_restores_backbone_modules():
    m = tiny_causal_lm("olmo2")
    before = dict(m.state_dict())
    layers = list(m.model.layers)
    wrap_with_mhc(m, peft_paper_config("kromhc", 4))
    assert is_wrapped(m)
    # backbone state-dict keys are unchanged by wrapping (only hc_* keys are added)
    keys = set(m.state_dict())
    assert set(before) <= keys and all(".hc_" in k for k in keys - set(before))
    unwrap_mhc(m)
    assert not is_wrapped(m) and all(a is b for a, b in zip(m.model.layers, layers))
    assert set(m.state_dict()) == set(before)


# ================================================================================================
# Initialisation as the paper states ([PEFT] App. C.3, docs/math.md §2.g)
# ================================================================================================
def _routing(m):
    with torch.no_grad(), record_routing(m) as rec:
        m(IDS)
    return rec


@pytest.mark.parametrize("variant", ["mhc", "mhc_lite", "kromhc", "identity"])
def test_dynamic_init_one_hot_read_on_l_mod_n(variant):
    n = 4
    m = wrapped("llama", variant=variant, n=n, init_noise=0.0)
    for r in _routing(m):
        hot = r.sublayer % n  # k = l mod n over the 2L wrapped sublayers
        h = r.h_pre[0, 0].double()
        assert int(h.argmax()) == hot
        assert abs(float(h[hot]) - 1 / (1 + math.exp(-8))) < 1e-6  # +8 read-in logit
        assert abs(float(h.sum()) - 1) < 1e-6  # convex read: branch input = embedding at layer 0
        assert torch.equal(r.h_post, torch.ones_like(r.h_post))  # h_post = 2σ(0) = 1
    for name, p in adapter_named_parameters(m):
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("W_"):
            assert not p.any()  # zero projections
        if leaf.startswith("alpha"):
            assert torch.allclose(p, torch.tensor([1e-2]))  # gates 1e-2


@pytest.mark.parametrize("variant,diag", [
    ("mhc", None),  # Sinkhorn of +8 on the diagonal: diag = e^8 / (e^8 + n − 1) (already doubly stochastic)
    ("mhc_lite", None),  # identity permutation 0, the other n! − 1 at −12
    ("kromhc", None),  # [0, −12] per 2x2 factor
])
def test_residual_logit_bias_init(variant, diag):
    n = 4
    m = wrapped("llama", variant=variant, n=n, init_noise=0.0)
    expect = {
        "mhc": math.exp(8) / (math.exp(8) + n - 1),
        # H[i,i] sums the (n−1)! permutations fixing i: the identity (logit 0) and (n−1)! − 1 at −12
        "mhc_lite": (1 + (math.factorial(n - 1) - 1) * math.exp(-12)) / (1 + (math.factorial(n) - 1) * math.exp(-12)),
        "kromhc": (1 / (1 + math.exp(-12))) ** int(math.log2(n)),
    }[variant]
    for r in _routing(m):
        H = r.H_res[0, 0].double()
        assert torch.allclose(torch.diagonal(H), torch.full((n,), expect, dtype=torch.float64), atol=1e-6)
        assert torch.allclose(H.sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-6)


def test_static_sinkhorn_init_uniform_with_renormalised_noise():
    """Static Sinkhorn mHC: H_res = 11ᵀ/n, h_pre = 1/n plus σ = 1e-4 noise renormalised to Σ = 1."""
    n = 4
    m = wrapped("olmo2", variant="mhc", dynamic=False, n=n)
    rec = _routing(m)
    hs = torch.stack([r.h_pre[0, 0] for r in rec]).double()
    assert torch.allclose(hs.sum(-1), torch.ones(len(rec), dtype=torch.float64), atol=1e-6)
    assert (hs - 1 / n).abs().max() < 1e-3 and (hs - 1 / n).abs().max() > 0  # noise present, small
    for r in rec:
        assert (r.H_res[0, 0] - 1 / n).abs().max() < 1e-3
        assert (r.h_post[0, 0] - 1).abs().max() < 1e-3
    # the noise breaks the S_n symmetry: sublayers differ from each other
    assert not torch.equal(hs[0], hs[1])


def test_residual_logit_dropout_training_only():
    m = wrapped("llama", variant="mhc", dynamic=False, init_noise=0.0, res_logit_dropout=0.5)
    m.train()
    Hs = [torch.stack([r.H_res[0, 0] for r in _routing(m)]) for _ in range(3)]
    assert not (torch.equal(Hs[0], Hs[1]) and torch.equal(Hs[1], Hs[2]))  # random masks in training
    for H in Hs:
        assert torch.isfinite(H).all()
        assert torch.allclose(H.sum(-1), torch.ones_like(H.sum(-1)), atol=1e-5)
    m.eval()
    H1 = torch.stack([r.H_res[0, 0] for r in _routing(m)])
    H2 = torch.stack([r.H_res[0, 0] for r in _routing(m)])
    assert torch.equal(H1, H2)  # never at inference


# ================================================================================================
# Gradients, freezing, generate
# ================================================================================================
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_only_on_adapter(family):
    m = wrapped(family, variant="kromhc")
    m.train()
    m(IDS, labels=IDS).loss.backward()
    hc = {id(p) for _, p in adapter_named_parameters(m)}
    for name, p in m.named_parameters():
        if id(p) in hc:
            assert p.requires_grad
        else:
            assert not p.requires_grad and p.grad is None, name
    for name, p in adapter_named_parameters(m):
        if name.rsplit(".", 1)[-1] in ("b_pre", "b_post", "W_pre", "W_post"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_generate_with_kv_cache():
    m = wrapped("qwen2", variant="kromhc", init_noise=0.0)
    prompt = IDS[:1, :5]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with hc_disabled(m):
            plain = m.generate(prompt, **kw)
        at_init = m.generate(prompt, **kw)
        assert torch.equal(at_init, plain)  # identity at init, through generate
        g = torch.Generator().manual_seed(0)
        for _, p in adapter_named_parameters(m):
            p.add_(0.5 * torch.randn(p.shape, generator=g))
        cached = m.generate(prompt, use_cache=True, **kw)
        uncached = m.generate(prompt, use_cache=False, **kw)
        assert torch.equal(cached, uncached)
        # incremental decoding with the cache gives the full-sequence logits
        full = m(cached).logits
        out = m(cached[:, :-2], use_cache=True)
        # transformers >= 5.x names the cache `cache` (`past_key_values` is deprecated); older, `past_key_values`
        kv = {"cache": out.cache} if getattr(out, "cache", None) is not None else {"past_key_values": out.past_key_values}
        step = m(cached[:, -2:], use_cache=True, **kv).logits
    assert (step - full[:, -2:]).abs().max() < 1e-5


def test_bf16_backbone_keeps_fp32_adapter():
    """bf16 weights: adapter parameters and routing maths stay fp32 (docs/math.md §1.5); logits within the
    bf16 tolerance 1e-2 · max|logit| of the bf16 backbone (docs/math.md §2.g #4)."""
    m = tiny_causal_lm("olmo2").to(torch.bfloat16)
    with torch.no_grad():
        ref = m(IDS).logits.float()
    wrap_with_mhc(m, peft_paper_config("kromhc", 4))
    assert all(p.dtype == torch.float32 for _, p in adapter_named_parameters(m))
    with torch.no_grad(), record_routing(m) as rec:
        out = m(IDS).logits.float()
    assert rec[0].X.dtype == torch.bfloat16 and rec[0].H_res.dtype == torch.float32
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    m(IDS, labels=IDS).loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for n, p in adapter_named_parameters(m) if n.endswith(("b_pre", "W_post")))


def test_autocast_runs_routing_in_fp32():
    """Under bf16 autocast the branches run in bf16 but the HC coefficients and the residual state
    stay fp32 (the wrapper disables autocast around read/write)."""
    m = wrapped("llama", variant="mhc")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with hc_disabled(m):
            ref = m(IDS).logits.float()
        with record_routing(m) as rec:
            out = m(IDS).logits.float()
    assert all(r.X.dtype == torch.float32 and r.H_res.dtype == torch.float32 for r in rec)
    assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    # sublayer 0 sees the same input (the embedding) with and without autocast: with non-zero
    # projections its coefficients must be bit-identical, i.e. not computed from bf16 GEMMs
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in adapter_named_parameters(m):
            if n.rsplit(".", 1)[-1].startswith(("W_", "alpha")):
                p.copy_(torch.randn(p.shape, generator=g))
        with record_routing(m) as fp32_rec:
            m(IDS)
        with torch.autocast("cpu", dtype=torch.bfloat16), record_routing(m) as amp_rec:
            m(IDS)
    for key in ("h_pre", "h_post", "H_res"):
        assert torch.equal(getattr(fp32_rec[0], key), getattr(amp_rec[0], key)), key


def test_gradient_checkpointing_matches():
    m = wrapped("llama", variant="kromhc")
    m.train()
    m(IDS, labels=IDS).loss.backward()
    g1 = {n: p.grad.clone() for n, p in adapter_named_parameters(m)}
    m.zero_grad(set_to_none=True)
    # the newer name where transformers has it (gradient_checkpointing_enable is deprecated there)
    if hasattr(m, "activation_checkpointing_enable"):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m(IDS, labels=IDS).loss.backward()
    for n, p in adapter_named_parameters(m):
        assert torch.allclose(p.grad, g1[n], atol=1e-7, rtol=1e-5), n


# ================================================================================================
# Diagnostics ([PEFT] App. C.5, docs/math.md §2.g)
# ================================================================================================
@pytest.mark.parametrize("family,kw", [
    ("olmo2", dict(variant="kromhc")),
    ("olmo2", dict(variant="mhc", dynamic=False)),
    ("llama", dict(variant="identity")),
    ("mistral", dict(variant="mhc_lite", dynamic=False)),
    ("qwen3", dict(variant="mhc")),
])
@pytest.mark.slow
def test_diagnostics_pass_for_paper_inits(family, kw):
    m = wrapped(family, **kw)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    rep = run_adapter_diagnostics(m, IDS, overfit_steps=50)  # docs/math.md §2.g #5: a 50-step overfit
    assert rep.ok, rep.table()
    assert [c.name for c in rep.checks] == ["output_shape", "logits_identity", "routing", "frozen_backbone",
                                            "gradient_flow", "sublayer_identity", "stream_divergence"]
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())  # model restored
    assert all(p.grad is None for p in m.parameters())


def test_diagnostics_flag_symmetric_fixed_point():
    """Static Sinkhorn without init noise is S_n-symmetric: streams never separate ([PEFT] C.3)."""
    m = wrapped("llama", variant="mhc", dynamic=False, init_noise=0.0)
    rep = run_adapter_diagnostics(m, IDS, overfit_steps=8)
    assert not rep.ok
    assert not rep.get("stream_divergence").ok and rep.get("stream_divergence").value == 0.0
    assert not rep.get("gradient_flow").ok
    assert rep.get("logits_identity").ok and rep.get("routing").ok


def test_diagnostics_flag_broken_identity_and_unfrozen_backbone():
    m = wrapped("olmo2", variant="kromhc", init_noise=0.0)
    with torch.no_grad():
        hc_layers(m)[1].hc_attn.b_post.fill_(0.5)  # h_post = 2σ(0.5) ≠ 1
    m.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    rep = run_adapter_diagnostics(m, IDS, overfit_steps=4)
    assert not rep.get("logits_identity").ok
    assert not rep.get("sublayer_identity").ok and rep.get("sublayer_identity").value > 0.01
    assert not rep.get("frozen_backbone").ok
    assert "up_proj" in rep.get("frozen_backbone").detail


def test_diagnostics_flag_invalid_routing():
    m = wrapped("llama", variant="mhc", init_noise=0.0, sinkhorn_iters=0)  # row softmax only
    with torch.no_grad():
        hc_layers(m)[0].hc_mlp.b_res.copy_(torch.randn(16, generator=torch.Generator().manual_seed(1)) * 3)
    rep = run_adapter_diagnostics(m, IDS, overfit_steps=2)
    assert not rep.get("routing").ok and "column" in rep.get("routing").detail


def test_diagnose_tool_exit_codes(capsys):
    from tools.diagnose_adapter import main

    assert main(["--tiny", "olmo2", "--variant", "kromhc", "--overfit-steps", "5", "--seq-len", "8"]) == 0
    assert "ALL PASS" in capsys.readouterr().out
    assert main(["--tiny", "llama", "--variant", "mhc", "--static", "--no-noise", "--overfit-steps", "3",
                 "--seq-len", "8"]) == 1
    assert "FAILED" in capsys.readouterr().out


# ================================================================================================
# Save / load
# ================================================================================================
def test_adapter_save_load_round_trip(tmp_path):
    m = wrapped("olmo2", variant="kromhc")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in adapter_named_parameters(m):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        out = m(IDS).logits
    wpath, cpath = save_adapter(m, str(tmp_path / "ad"))
    from safetensors.torch import load_file

    tensors = load_file(wpath)
    assert sum(t.numel() for t in tensors.values()) == count_adapter_parameters(m)
    assert all(k.startswith(("layers.", "readout.")) for k in tensors)
    cfg, meta = read_adapter_config(str(tmp_path / "ad"))
    assert cfg == adapter_config(m) and meta["model_type"] == "olmo2" and meta["hidden_size"] == 64

    fresh = tiny_causal_lm("olmo2")  # the same backbone, unwrapped
    load_adapter(fresh, str(tmp_path / "ad"))
    with torch.no_grad():
        assert torch.equal(fresh(IDS).logits, out)
    # into an already wrapped model with the same config (fresh init) -> same function
    other = wrapped("olmo2", variant="kromhc")
    load_adapter(other, str(tmp_path / "ad"))
    with torch.no_grad():
        assert torch.equal(other(IDS).logits, out)


def test_adapter_load_errors(tmp_path):
    m = wrapped("llama", variant="identity")
    save_adapter(m, str(tmp_path / "ad"))
    with pytest.raises(ValueError, match="hidden_size"):
        load_adapter(tiny_causal_lm("llama", hidden_size=32), str(tmp_path / "ad"))
    with pytest.raises(ValueError, match="model_type"):
        load_adapter(tiny_causal_lm("qwen2"), str(tmp_path / "ad"))
    with pytest.raises(ValueError, match="different HCConfig"):
        load_adapter(wrapped("llama", variant="kromhc"), str(tmp_path / "ad"))
    with pytest.raises(FileNotFoundError, match="hc_adapter_config.json"):
        load_adapter(tiny_causal_lm("llama"), str(tmp_path / "nothing"))


# ================================================================================================
# peft composition (LoRA, VeRA)
# ================================================================================================
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_config(kind):
    from peft import LoraConfig, VeraConfig

    if kind == "lora":
        return LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    return VeraConfig(r=4, target_modules=TARGETS, projection_prng_key=343434, vera_dropout=0.0)


@pytest.mark.parametrize("kind", ["lora", "vera"])
@pytest.mark.parametrize("order", ["wrap_then_peft", "peft_then_wrap"])
def test_peft_combination(kind, order):
    pytest.importorskip("peft")
    from peft import get_peft_model

    m = tiny_causal_lm("llama")
    backbone = {n: p.detach().clone() for n, p in m.named_parameters()}
    ref = backbone_logits("llama")
    cfg = peft_paper_config("identity", 2, init_noise=0.0)
    if order == "wrap_then_peft":
        pm = mark_adapter_trainable(get_peft_model(wrap_with_mhc(m, cfg), _peft_config(kind)))
    else:
        pm = wrap_with_mhc(get_peft_model(m, _peft_config(kind)), cfg)
    with torch.no_grad():
        assert (pm(input_ids=IDS).logits - ref).abs().max() <= 1e-5  # LoRA B = 0 / VeRA λ_b = 0 and mHC identity
    rep = trainable_parameter_report(pm)
    per_sublayer = 2 * 64 * 2 * 2 + 2 * 64 + 2 * 2 + 2  # identity n=2: N·C·2N + N·C + 2N + 2 gates
    assert rep["hc"] == 4 * per_sublayer
    tag = "lora_" if kind == "lora" else "vera_lambda"
    peft_params = [(n, p) for n, p in pm.named_parameters() if tag in n]
    assert peft_params and rep["other_trainable"] == sum(p.numel() for _, p in peft_params)
    groups = adapter_param_groups(pm, hc_lr=1e-3, other_lr=1e-4)
    assert [(g["name"], g["lr"]) for g in groups] == [("mhc", 1e-3), ("peft", 1e-4)]
    before_hc = {n: p.detach().clone() for n, p in adapter_named_parameters(pm)}
    before_peft = {n: p.detach().clone() for n, p in peft_params}
    opt = torch.optim.AdamW(groups)
    pm.train()
    for _ in range(3):
        opt.zero_grad()
        pm(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
    assert any(not torch.equal(p, before_hc[n]) for n, p in adapter_named_parameters(pm))
    assert any(not torch.equal(p, before_peft[n]) for n, p in peft_params)
    # the backbone itself never moves
    base = pm.get_base_model()
    for n, p in base.named_parameters():
        key = n.replace(".base_layer", "")
        if key in backbone:
            assert torch.equal(p, backbone[key]), n


# ================================================================================================
# Parameter counts: [PEFT] Tables 1/2 on the OLMo-2-1B geometry, meta device (docs/math.md §5.1)
# ================================================================================================
@pytest.fixture(scope="module")
def olmo2_1b_meta():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(olmo2_1b_config())


def _reported(x: int) -> str:
    """Format like the paper: 3 significant digits with K/M (counts >= 10^4), else the integer."""
    if x < 10_000:
        return str(x)
    v, unit = (x / 1e6, "M") if x >= 1e6 else (x / 1e3, "K")
    return f"{v:.{max(0, 2 - int(math.floor(math.log10(v))))}f}{unit}"


PAPER_COUNTS = [  # (variant, n, dynamic, exact total docs/math.md §5.1, as reported in [PEFT] Table 1/2)
    ("mhc", 4, False, 772, "772"),
    ("mhc_lite", 4, False, 1024, "1024"),
    ("kromhc", 4, False, 384, "384"),
    ("mhc", 4, True, 6_554_464, "6.55M"),
    ("mhc_lite", 4, True, 8_651_872, "8.65M"),
    ("kromhc", 2, True, 917_792, "918K"),
    ("kromhc", 4, True, 3_408_352, "3.41M"),
    ("kromhc", 8, True, 12_059_424, "12.1M"),
    ("kromhc", 16, True, 42_992_992, "43.0M"),
    ("identity", 2, True, 655_552, "656K"),  # Table 2 prints 655K, Table 4 656K
    ("identity", 4, True, 2_359_616, "2.36M"),
    ("identity", 8, True, 8_913_472, "8.91M"),
    ("identity", 16, True, 34_604_096, "34.6M"),
    ("kromhc", 16, False, 1280, "1280"),  # the static KromHC n = 16 of the LoRA combination
]


@pytest.mark.parametrize("variant,n,dynamic,exact,reported", PAPER_COUNTS,
                         ids=[f"{'dyn' if d else 'static'}_{v}_n{n}" for v, n, d, _, _ in PAPER_COUNTS])
def test_paper_parameter_counts_olmo2_1b(olmo2_1b_meta, variant, n, dynamic, exact, reported):
    m = olmo2_1b_meta
    wrap_with_mhc(m, peft_paper_config(variant, n, dynamic))
    try:
        assert all(p.device.type == "meta" for _, p in adapter_named_parameters(m))
        total = count_adapter_parameters(m)
        assert total == sum(p.numel() for n_, p in m.named_parameters() if ".hc_" in n_)
        assert total == exact
        assert _reported(total) == reported
    finally:
        unwrap_mhc(m)


def test_identity_equals_krom_with_res_ablated(olmo2_1b_meta):
    """[PEFT]: mHC-identity is dynamic KromHC with H_res = I (its residual coefficients dropped)."""
    m = olmo2_1b_meta
    for n, expect in ((2, 655_552), (4, 2_359_616)):
        wrap_with_mhc(m, peft_paper_config("kromhc", n, True, ablate_res=True))
        try:
            assert count_adapter_parameters(m) == expect
        finally:
            unwrap_mhc(m)


def test_olmo2_1b_geometry_matches_paper(olmo2_1b_meta):
    """The backbone built from the config is the paper's: 384 params = 0.00002586 % (App. D.1), one
    layer = 67.1M (Table 4 'layer tuning'), 16 layers -> 32 wrapped sublayers (docs/math.md §2.g)."""
    m = olmo2_1b_meta
    total = sum(p.numel() for p in m.parameters())
    assert f"{100 * 384 / total:.8f}" == "0.00002586"
    assert f"{sum(p.numel() for p in m.model.layers[0].parameters()) / 1e6:.1f}" == "67.1"
    wrap_with_mhc(m, peft_paper_config("kromhc", 4, True))
    try:
        assert f"{100 * count_adapter_parameters(m) / total:.2f}" in ("0.22", "0.23")  # paper prints 0.22 %
        assert 2 * len(hc_layers(m)) == 32
    finally:
        unwrap_mhc(m)


def test_olmo2_7b_identity_counts():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(olmo2_7b_config())
    for n, exact, reported in ((2, 2_621_824, "2.62M"), (4, 9_437_824, "9.44M")):
        wrap_with_mhc(m, peft_paper_config("identity", n, True))
        try:
            assert count_adapter_parameters(m) == exact and _reported(exact) == reported
        finally:
            unwrap_mhc(m)


def test_counts_agree_with_accounting(olmo2_1b_meta):
    acc = pytest.importorskip("xhc.accounting")
    m = olmo2_1b_meta
    for variant, n, dynamic, exact, _ in PAPER_COUNTS:
        cfg = peft_paper_config(variant, n, dynamic)
        assert acc.hc_params_total(cfg, 2048, 16).total == exact
