"""The accounted parameter count equals the real modules' numel, for every variant (docs/math.md §5).

Builds :class:`xhc.hyper_connection.HyperConnection`, :class:`xhc.xhc.XHCSublayer` and the Flash
modules of :mod:`xhc.flash`, and compares ``sum(p.numel())`` with :mod:`xhc.accounting`.  The
paper-size checks (C = 2112) also tie the modules to the documented printed integers.
"""

import pytest
import torch

from xhc.accounting import (
    hc_params_flash4_layers, hc_params_per_layer, hc_params_per_sublayer, hc_params_per_window,
    hc_params_total, readout_params,
)
from xhc.config import HCConfig
from xhc.flash import Flash4FirstLayer, Flash4SecondLayer, Flash4Window, XHCFlashLayer
from xhc.hyper_connection import HyperConnection, StreamReadout
from xhc.xhc import XHCSublayer


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


C = 24  # small width: every count is exact in C, so small modules test the formulas

MHC_CASES = [
    dict(variant=v, n=n, dynamic=d, mapping_norm_affine=a)
    for v, ns in (("mhc", (2, 4, 8)), ("mhc_lite", (2, 3, 4)), ("kromhc", (2, 4, 16)), ("identity", (2, 4)))
    for n in ns for d in (True, False) for a in (False, True)
] + [
    dict(variant="hc", n=n, dynamic=d, hc_tanh=t) for n in (1, 2, 4) for d in (True, False) for t in (True, False)
] + [
    dict(variant=v, n=4, dynamic=d, **{ab: True})
    for v in ("hc", "mhc", "kromhc", "identity") for d in (True, False)
    for ab in ("ablate_pre", "ablate_res", "ablate_post")
] + [
    dict(variant="hc", n=4, ablate_pre=True, ablate_res=True),
    dict(variant="hc", n=4, mapping_norm_affine=True),   # HC's per-stream LayerNorm has no gain
    dict(variant="mhc", n=4, ablate_pre=True, ablate_post=True, mapping_norm_affine=True),
    dict(variant="mhc", n=4, preset="peft_paper", mapping_norm_affine=True),
]


@pytest.mark.parametrize("fields", MHC_CASES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_hyper_connection_numel(fields):
    cfg = HCConfig(**fields)
    for ell, is_mlp in ((0, False), (1, True)):
        assert numel(HyperConnection(cfg, C, layer_index=ell)) == hc_params_per_sublayer(cfg, C, is_mlp).total


@pytest.mark.parametrize("reduction", ["sum", "mean", "softmax"])
def test_readout_numel(reduction):
    cfg = HCConfig(variant="mhc", n=4, reduction=reduction)
    assert numel(StreamReadout(cfg.n, cfg.reduction)) == readout_params(cfg)


def test_mhc_model_total_with_readout():
    """A 3-layer static mHC stack with softmax readout: 6 sublayers + N logits."""
    cfg = HCConfig(variant="mhc", n=4, dynamic=False, reduction="softmax")
    mods = [HyperConnection(cfg, C, ell) for ell in range(6)] + [StreamReadout(4, "softmax")]
    assert sum(numel(m) for m in mods) == hc_params_total(cfg, C, 3).total


XHC_CASES = [
    dict(),
    dict(n=4, k=2, m=1),
    dict(n=2, k=1, m=0),
    dict(n=8, k=4, m=4),                     # k = m: no router
    dict(n=16, k=8, m=2, kernel_sizes=(3, 5)),
    dict(kernel_sizes=()),                   # no temporal augmentation
    dict(dense_read=False),
    dict(attn_temporal=True),
    dict(ablate_pre=True), dict(ablate_res=True), dict(ablate_post=True),
    dict(router="softmax", gram_schmidt=False, read_init="one_hot"),
]
XHC_BASE = dict(n=16, k=4, m=2)


def _xhc(variant, fields):
    f = {**XHC_BASE, **fields}
    if variant != "xhc":
        f.pop("dense_read", None)  # Flash variants require the dense read
    return HCConfig(variant=variant, **f)


@pytest.mark.parametrize("fields", XHC_CASES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "default")
def test_xhc_sublayer_numel(fields):
    cfg = _xhc("xhc", fields)
    for ell, is_mlp in ((0, False), (1, True)):
        assert numel(XHCSublayer(cfg, C, is_mlp, ell)) == hc_params_per_sublayer(cfg, C, is_mlp).total


@pytest.mark.parametrize("fields", [f for f in XHC_CASES if "dense_read" not in f],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "default")
def test_flash_numel(fields):
    cfg = _xhc("xhc_flash", fields)
    assert numel(XHCFlashLayer(cfg, C, 0)) == hc_params_per_layer(cfg, C).total
    cfg4 = _xhc("xhc_flash4", fields)
    first, second = hc_params_flash4_layers(cfg4, C)
    assert numel(Flash4FirstLayer(cfg4, C, 0)) == first.total
    assert numel(Flash4SecondLayer(cfg4, C, 1)) == second.total
    assert numel(Flash4Window(cfg4, C, 0)) == hc_params_per_window(cfg4, C).total


def test_flash4_model_with_odd_layer_count():
    """5 layers = two 4sub windows + one Flash layer (§4.3)."""
    cfg = HCConfig(variant="xhc_flash4", n=4, k=2, m=1, reduction="softmax")
    mods = [Flash4Window(cfg, C, 0), Flash4Window(cfg, C, 2), XHCFlashLayer(cfg, C, 4), StreamReadout(4, "softmax")]
    assert sum(numel(m) for m in mods) == hc_params_total(cfg, C, 5).total


def test_paper_size_modules_match_spec_integers():
    """At C = 2112 (18B) the modules hold the documented counts: xHC 2,652,672 + 90 per layer
    (§5.1, §3.1), mHC N=4 405,504 + 2·27 per layer (§2.b small terms: N² + 2N + 3 per sublayer)."""
    Cp = 2112
    x = HCConfig(variant="xhc", n=16, k=4, m=2)
    assert numel(XHCSublayer(x, Cp, False, 0)) + numel(XHCSublayer(x, Cp, True, 1)) == 2_652_672 + 90
    m = HCConfig(variant="mhc", n=4)
    assert numel(HyperConnection(m, Cp, 0)) + numel(HyperConnection(m, Cp, 1)) == 405_504 + 2 * (16 + 8 + 3)
    # Flash 936·C and 4sub 1552·C dominant terms (§4.3), from the real modules
    f = HCConfig(variant="xhc_flash", n=16, k=4, m=2)
    assert hc_params_per_layer(f, Cp).dominant == 936 * Cp
    assert numel(XHCFlashLayer(f, Cp, 0)) == hc_params_per_layer(f, Cp).total
    f4 = HCConfig(variant="xhc_flash4", n=16, k=4, m=2)
    assert numel(Flash4Window(f4, Cp, 0)) == hc_params_per_window(f4, Cp).total
    assert hc_params_per_window(f4, Cp).dominant == 1552 * Cp
