"""HC recompute (models.hc_layer.HCRecompute): bit-identical gradients, and what it keeps for backward.

* Gradients with HC recompute equal those without it *bitwise* in fp32 (the autograd graph is the
  forward's own; only the saved tensors are regenerated), for every HC family, with hidden dropout
  and HC residual-logit dropout (RNG replay), alone and combined with Megatron's selective
  recompute of the norms and the MLP.
* Memory invariant: the tensors an HC layer keeps for backward, counted per storage through
  ``saved_tensors_hooks``, are at most 1.5 × the floor X + y = (N + 1)·C per token per sublayer
  (the HC ops alone, driven with fixed branch outputs so that the branch's own activations do not
  enter the count): exactly the entry states and the branch outputs; without recompute the same
  count is larger (so it can fail).
"""

from __future__ import annotations

import pytest
import torch

megatron = pytest.importorskip("megatron.core")

from bench.hc_kernels import SavedCounter  # noqa: E402
from models.hc_layer import HCRecompute, set_hc_recompute  # noqa: E402
from models.parallel import destroy_parallel, initialize_parallel  # noqa: E402
from tests.megatron_utils import build_tiny_hc_gpt, lm_loss, tiny_batch, tiny_moe_config  # noqa: E402
from xhc.config import HCConfig  # noqa: E402

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

XHC = dict(n=4, k=2, m=1)


def hc_config(variant: str, **kw) -> HCConfig:
    if variant == "mhc_dsv4":  # DeepSeek-V4's convention and learned head (docs/math.md §2.h)
        variant, kw = "mhc", {"convention": "deepseek_v4", "reduction": "learned", **kw}
    return HCConfig(variant=variant, **({**XHC, **kw} if variant.startswith("xhc") else {"n": 4, **kw}))


@pytest.fixture
def parallel():
    initialize_parallel(tp=1, pp=1, ep=1, seed=1234)
    yield
    destroy_parallel()


def _loss_and_grads(model, recompute: bool):
    from megatron.core import tensor_parallel

    set_hc_recompute(model, recompute)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    loss = lm_loss(model, *tiny_batch(2))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant,selective,kernels", [
    ("mhc", False, "eager"), ("mhc", True, "eager"), ("hc", False, "eager"), ("kromhc", False, "eager"),
    ("xhc", False, "eager"), ("xhc", True, "eager"), ("xhc_flash", False, "eager"), ("xhc_flash4", True, "eager"),
    ("mhc", False, "compile"), ("xhc", False, "compile"), ("xhc_flash4", False, "compile"),
    ("mhc_dsv4", False, "compile"),
])  # fmt: skip
def test_recompute_gives_bit_identical_grads(parallel, variant, selective, kernels):
    from megatron.core import tensor_parallel

    kw = dict(hidden_dropout=0.1, attention_dropout=0.1)
    if selective:
        kw.update(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])
    hc = hc_config(variant, **({"kernels": kernels} if "kernels" in HCConfig.__dataclass_fields__ else {}),
                   **({"res_logit_dropout": 0.2} if variant.startswith("mhc") else {}))
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_tiny_hc_gpt(tiny_moe_config(**kw), hc)
    model.train()
    l0, g0 = _loss_and_grads(model, False)
    l1, g1 = _loss_and_grads(model, True)
    assert set_hc_recompute(model, True) == len(model.decoder.layers)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_recompute_replays_only_the_hc_calls():
    """The region re-runs its recorded calls in backward and hands back what they saved."""
    calls = []
    W = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))

    def f(x):
        calls.append("f")
        return torch.tanh(x @ W)  # tanh saves its output: a tensor the region drops

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.autograd.grad(torch.tanh(x @ W).sum(), (x, W))
    rc = HCRecompute([W])
    rc.add_input(x)
    out = rc.call(f, x)
    assert calls == ["f"]
    got = torch.autograd.grad(out.sum(), (x, W))
    assert calls == ["f", "f"]  # one replay for the whole region
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Memory: what the HC ops keep for backward, per token per sublayer, in units of C
# ------------------------------------------------------------------------------------------------
def _unit(variant: str, C: int, kernels: str):
    """The HC calls of one sublayer (mHC, xHC) / layer (Flash) / window (Flash-4sub) as a driver
    of models.hc_layer, run on [s, b, N, C] with fixed branch outputs; returns (run, N, sublayers)."""
    from models import hc_layer
    from xhc.flash import Flash4FirstLayer, Flash4SecondLayer, XHCFlashLayer
    from xhc.hyper_connection import HyperConnection
    from xhc.xhc import XHCSublayer

    extra = {"kernels": kernels} if "kernels" in HCConfig.__dataclass_fields__ else {}
    if variant == "mhc":
        cfg = HCConfig(variant="mhc", n=4, **extra)
        mods = {"attn": HyperConnection(cfg, C, layer_index=0), "mlp": HyperConnection(cfg, C, layer_index=1)}
    elif variant == "xhc":
        cfg = HCConfig(variant="xhc", n=8, k=4, m=2, **extra)
        mods = {"attn": XHCSublayer(cfg, C, is_mlp=False, layer_index=0), "mlp": XHCSublayer(cfg, C, is_mlp=True, layer_index=1)}
    else:
        cfg = HCConfig(variant=variant, n=8, k=4, m=2, **extra)
    layers = []
    if variant in ("mhc", "xhc"):
        fake = type("L", (), {"self_attention_hyper_connection": mods["attn"], "mlp_hyper_connection": mods["mlp"]})
        layers = [(hc_layer._PairDriver(fake()), list(mods.values()))]
    elif variant == "xhc_flash":
        layers = [(XHCFlashLayer(cfg, C, layer_index=0), None)]
    else:
        layers = [(Flash4FirstLayer(cfg, C, layer_index=0), None), (Flash4SecondLayer(cfg, C, layer_index=1), None)]

    def drivers():
        out = []
        for i, (obj, _) in enumerate(layers):
            if isinstance(obj, hc_layer._PairDriver):
                out.append(obj)
                continue
            fake = type("L", (), {"self_attention_hyper_connection": obj, "config": cfg, "layer_number": i + 1})
            out.append(hc_layer._FlashDriver(fake()))
        return out

    def run(X, ys, recompute):
        it = iter(ys)
        for drv in drivers():
            st = drv.begin(X, recompute)
            for which in ("attn", "mlp"):
                drv.read(st, which)
                drv.write(st, which, next(it), None)
            X = drv.end(st)
        return X

    params = [p for obj, mods_ in layers for m in (mods_ or [obj]) for p in m.parameters()]
    return run, cfg.n, 2 * len(layers), params


@pytest.mark.parametrize("variant", ["mhc", "xhc", "xhc_flash", "xhc_flash4"])
@pytest.mark.parametrize("kernels", ["eager", "compile"])
def test_recompute_keeps_at_most_one_and_a_half_floor(variant, kernels):
    C, s, b = 32, 8, 2
    run, N, sublayers, params = _unit(variant, C, kernels)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(s, b, N, C, generator=g).requires_grad_()
    ys = [torch.randn(s, b, C, generator=g).requires_grad_() for _ in range(sublayers)]
    per = s * b * sublayers * C * X.element_size()  # bytes of C elements per token per sublayer
    floor = N + 1                                    # X + y in units of C
    saved = {}
    for rc in (False, True):
        counter = SavedCounter(exclude=params)
        with counter:
            out = run(X, ys, rc)
        saved[rc] = counter.bytes / per
        # the kept tensors are enough for backward (and the region gives the same gradient)
        out.backward(torch.ones_like(out))
    regions = sublayers if variant in ("mhc", "xhc") else 1  # Flash: one region per window
    exact = (regions * N + sublayers) / sublayers             # the region inputs: entry states + every y
    assert saved[True] == pytest.approx(exact, rel=1e-12), saved
    assert saved[True] <= 1.5 * floor, saved
    assert saved[False] > saved[True], saved  # without recompute the HC ops keep more: the count is live


def test_health_is_recorded_once_per_forward_under_recompute(parallel):
    """HC health wraps the HC reads; the recompute replay in backward must not record again, and the
    statistics equal those without recompute.  Records stay tensors until the summary (no host sync)."""
    from megatron.core import tensor_parallel

    from training.run import HCHealth

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_tiny_hc_gpt(tiny_moe_config(), hc_config("xhc"))
    health = HCHealth([model], model.decoder.layers[0].hc_config)
    out = {}
    for rc in (False, True):
        set_hc_recompute(model, rc)
        with health.recording():
            lm_loss(model, *tiny_batch(2)).backward()
        assert all(a.count == 1 and a.load_count == 1 for a in health.acc.values()), rc
        assert all(isinstance(a.dist, torch.Tensor) for a in health.acc.values())
        out[rc] = health.summary()
    assert out[True] == out[False]
    with torch.no_grad():  # outside recording(): nothing is recorded
        lm_loss(model, *tiny_batch(2))
    assert health.acc == {}
