"""HCConfig validation: one error-message test per rule (each names the field and the allowed values)."""

import pytest

from xhc.config import HCConfig, HCConfigError

CASES = [
    # (kwargs, field named in the message, fragment of the allowed values)
    (dict(variant="mhx"), "variant", "allowed values are none, hc, mhc"),
    (dict(dynamic="yes"), "dynamic", "true or false"),
    (dict(gram_schmidt=1), "gram_schmidt", "true or false"),
    (dict(n=0), "n", "integer >= 1"),
    (dict(n=2.5), "n", "integer >= 1"),
    (dict(variant="mhc", n=1), "n", "n >= 2"),
    (dict(variant="mhc_lite", n=7), "n", "n <= 6"),
    (dict(variant="kromhc", n=6), "n", "power of two"),
    (dict(sinkhorn_iters=-1), "sinkhorn_iters", ">= 0"),
    (dict(sinkhorn_eps=0.0), "sinkhorn_eps", "> 0"),
    (dict(norm_eps=float("nan")), "norm_eps", "> 0"),
    (dict(gs_eps=-1e-6), "gs_eps", "> 0"),
    (dict(sinkhorn_order="cols"), "sinkhorn_order", "row_last, col_last"),
    (dict(gate_init=float("inf")), "gate_init", "finite"),
    (dict(read_init="onehot"), "read_init", "auto, one_hot, uniform"),
    (dict(n=4, read_delta=0.3), "read_delta", "(0, 1/n)"),
    (dict(res_offdiag_init=3.0), "res_offdiag_init", "<= 0"),
    (dict(init_noise=-1.0), "init_noise", ">= 0"),
    (dict(res_logit_dropout=1.0), "res_logit_dropout", "[0, 1)"),
    (dict(preset="paper"), "preset", "spec, peft_paper"),
    (dict(reduction="max"), "reduction", "sum, mean, softmax"),
    (dict(variant="xhc", n=16, k=17), "k", "1 <= k <= n"),
    (dict(variant="xhc", n=16, k=4, m=5), "m", "0 <= m <= k"),
    (dict(variant="xhc", n=16, kernel_sizes=(4, 0)), "kernel_sizes", "integers >= 1"),
    (dict(variant="xhc", n=16, router="topk"), "router", "sigmoid, softmax"),
    (dict(variant="xhc", n=16, conv_doc_reset="sometimes"), "conv_doc_reset", "auto, always, never"),
    (dict(variant="xhc_flash", n=16, dense_read=False), "dense_read", "Flash"),
]


@pytest.mark.parametrize("kwargs,field,allowed", CASES, ids=[c[1] + "-" + str(i) for i, c in enumerate(CASES)])
def test_validation_message(kwargs, field, allowed):
    with pytest.raises(HCConfigError) as exc:
        HCConfig(**kwargs)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"HCConfig.{field}=")
    assert allowed in msg


def test_from_dict_unknown_key():
    with pytest.raises(HCConfigError, match="no field 'nn'"):
        HCConfig.from_dict({"nn": 4})


def test_valid_defaults_and_round_trip():
    for v in ("none", "hc", "mhc", "mhc_lite", "kromhc", "identity"):
        HCConfig(variant=v)
    x = HCConfig(variant="xhc", n=16, k=4, m=2, kernel_sizes=[4, 8, 12])
    assert x.kernel_sizes == (4, 8, 12)
    assert HCConfig.from_dict(x.to_dict()) == x
    assert HCConfig(variant="hc", n=1).n == 1  # N = 1 is valid for HC only (docs/math.md §8 #34)
    assert not HCConfig(variant="none").enabled and not HCConfig(variant="mhc", disabled=True).enabled


def test_replace_validates():
    with pytest.raises(HCConfigError, match="HCConfig.n="):
        HCConfig(variant="kromhc", n=4).replace(n=3)


def test_num_res_logits():
    assert HCConfig(variant="mhc", n=4).num_res_logits == 16
    assert HCConfig(variant="mhc_lite", n=4).num_res_logits == 24
    assert HCConfig(variant="kromhc", n=16).num_res_logits == 8
    assert HCConfig(variant="identity", n=4).num_res_logits == 0
    assert HCConfig(variant="mhc", n=4, ablate_res=True).num_res_logits == 0


@pytest.mark.parametrize("n", [5, 6])
def test_mhc_lite_beyond_four_streams_warns(n):
    """n! mixing matrices grow fast: mHC-lite warns above n = 4 and errors above 6."""
    import math
    import warnings

    from xhc.config import HCConfigWarning

    with pytest.warns(HCConfigWarning, match=f"n={n} mixes n! = {math.factorial(n)}"):
        HCConfig(variant="mhc_lite", n=n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HCConfig(variant="mhc_lite", n=4)  # the default size is silent
        HCConfig(variant="kromhc", n=8)
