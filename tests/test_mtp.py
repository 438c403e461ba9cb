"""Multi-token prediction through the streams (models/mtp.py), single process on CPU.

- λ = 0 (``mtp_loss_scaling_factor``): the main model is initialised, evaluated and differentiated
  exactly as without MTP, and the MTP parameters get zero gradient;
- λ > 0: every MTP parameter gets a finite, non-zero gradient, in every variant family (vanilla =
  Megatron-Core's own MTP layer, mHC with DeepSeek's learned head, xHC, Flash-4sub);
- the training loop: the λ = 0 loss / grad-norm trajectory equals the no-MTP run bit for bit, the
  per-depth ``mtp_loss`` is logged, and a resumed MTP run is bit-identical.

The TP = 2 + SP, EP = 2 and PP = 2 layouts run in tests/dist/pretrain_worker.py (test_pretrain_dist.py).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from models.parallel import destroy_parallel, initialize_parallel  # noqa: E402

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

SMALL = {"num_layers": 2, "first_dense_layers": 1, "hidden_size": 32, "kv_channels": 8, "ffn_hidden_size": 64,
         "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 16, "num_moe_experts": 4,
         "vocab_size": 64, "seq_length": 16}


@pytest.fixture
def parallel():
    initialize_parallel(tp=1, pp=1, ep=1, seed=1234)
    yield
    destroy_parallel()


def _build(preset_name, mtp=None, factor=0.1, hc=None, small=None):
    from megatron.core import tensor_parallel

    from models.zoo import build_model, build_transformer_config, load_preset

    bb = dict(SMALL if small is None else small)
    if mtp:
        bb.update(mtp_num_layers=mtp, mtp_loss_scaling_factor=factor)
    # eager HC kernels: the model-level checks need no inductor compile (the training-loop test runs the default)
    preset = load_preset(preset_name, backbone_overrides=bb, hc_overrides={"kernels": "eager", **(hc or {})})
    config = build_transformer_config(preset, cpu=True)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return build_model(preset, config, use_transformer_engine=False)


def _loss(model, seed=3):
    """The main loss (token mean) of one batch; the MTP losses enter the backward through Megatron's
    ``MTPLossAutoScaler`` (backward scale 1)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from models.mtp import mtp_tracker_prepare

    if model.config.mtp_num_layers:
        mtp_tracker_prepare(model.config.mtp_num_layers, "cpu")
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 64, (2, 16), generator=g)
    labels = torch.roll(toks, -1, 1)
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    return model(toks, pos, None, labels=labels).float().mean()


def _mtp(model):
    from models.mtp import mtp_parameters

    return dict(mtp_parameters(model))


@pytest.mark.parametrize("preset,hc", [
    ("tiny-moe:vanilla", None),
    ("tiny-moe:mhc", {"convention": "deepseek_v4", "reduction": "learned"}),
    ("tiny-moe:xhc", None),
    ("tiny-moe:xhc-flash4", {"reduction": "softmax"}),
])
def test_every_mtp_parameter_gets_a_finite_nonzero_gradient(parallel, preset, hc):
    model = _build(preset, mtp=2, factor=0.5, hc=hc)
    params = _mtp(model)
    assert len({n.split(".")[2] for n in params}) == 2  # mtp.layers.{0,1}.*
    if hc is not None and hc.get("reduction") == "learned":
        assert any(".hc_head." in n for n in params)
    if preset.endswith("flash4"):
        from xhc.flash import XHCFlashLayer

        assert all(type(m.transformer_layer.self_attention_hyper_connection) is XHCFlashLayer
                   for m in model.mtp.layers)  # one stand-alone Flash window per depth
    # Away from the initialisation: at init a gate α multiplies a zero projection (docs/math.md §2.0),
    # so its gradient is zero in the decoder as well; the check is that every parameter is connected.
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    _loss(model).backward()
    for name, p in params.items():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


@pytest.mark.parametrize("preset,hc", [("tiny-moe:vanilla", None),
                                       ("tiny-moe:mhc", {"convention": "deepseek_v4", "reduction": "learned"}),
                                       ("tiny-moe:xhc-flash", None)])
def test_lambda_zero_leaves_the_main_model_bit_identical(parallel, preset, hc):
    ref = _build(preset, hc=hc)
    model = _build(preset, mtp=1, factor=0.0, hc=hc)
    main = {n: p for n, p in model.named_parameters() if not n.startswith("mtp.")}
    ref_params = dict(ref.named_parameters())
    assert main.keys() == ref_params.keys()  # the main model's parameter names are unchanged
    for n, p in main.items():
        assert torch.equal(p, ref_params[n]), n  # same initialisation
    la, lb = _loss(ref), _loss(model)
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    for n, p in main.items():
        ga, gb = ref_params[n].grad, p.grad
        assert (ga is None) == (gb is None), n
        if ga is not None:
            assert torch.equal(ga, gb), n
    for n, p in _mtp(model).items():
        assert p.grad is None or not p.grad.any(), n


@pytest.mark.parametrize("preset,hc", [("tiny-moe:vanilla", None), ("tiny-moe:mhc", {"reduction": "learned"}),
                                       ("tiny-moe:xhc-flash4", {"reduction": "softmax"})])
def test_analytic_counts_match_the_built_depths(parallel, preset, hc):
    """models.mtp.mtp_counts (tools.accounting, the FLOPs of MFU and of the sweep) counts the
    parameters that the built depths hold: total, and the HC share."""
    from models.mtp import mtp_counts
    from models.zoo import backbone_shape, load_preset

    model = _build(preset, mtp=2, hc=hc)
    params = _mtp(model)
    counts = mtp_counts(backbone_shape(load_preset(preset, SMALL, hc)), load_preset(preset, SMALL, hc).hc, 2)
    assert counts["params_total"] == sum(p.numel() for p in params.values())
    assert counts["params_hc"] == sum(p.numel() for p in params.values() if getattr(p, "is_hyper_connection", False))
    assert counts["flops_backbone"] > 6 * counts["params_activated"] - 6 * counts["params_hc"]  # + head GEMM
    # the training FLOPs of MFU and of the sweep's compute include the depths
    from training.run import model_flops_per_token

    with_mtp = load_preset(preset, {**SMALL, "mtp_num_layers": 2}, hc)
    f0 = model_flops_per_token(load_preset(preset, SMALL, hc), 16, 64)
    f2 = model_flops_per_token(with_mtp, 16, 64)
    assert f2["total"] == pytest.approx(f0["total"] + f2["mtp"], rel=1e-12) and f2["mtp"] > 0


# ------------------------------------------------------------------------------------------------
# The training loop: trajectory, logging, resume
# ------------------------------------------------------------------------------------------------
BASE = ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=64", "batch.seq_length=16",
        "batch.micro_batch_size=2", "batch.global_batch_size=4", "schedule.warmup_steps=2",
        "logging.tensorboard=false", "logging.interval=1", "run.eval_iters=0", "checkpoint.interval=0",
        "model.preset=tiny-moe:mhc", "model.hc.convention=deepseek_v4", "model.hc.reduction=learned",
        "run.train_steps=4"]


def _train(run_dir, *extra):
    from training.pretrain import main

    assert main([*BASE, *extra, f"run.dir={run_dir}"]) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if r["kind"] == "train"]
    return {r["step"]: r for r in recs}


@pytest.mark.train
def test_training_loop_lambda_zero_trajectory_logging_and_resume(tmp_path):
    a = _train(tmp_path / "a")                                                            # no MTP
    b = _train(tmp_path / "b", "model.backbone.mtp_num_layers=2", "model.backbone.mtp_loss_scaling_factor=0")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert "mtp_loss" not in a[s]
        assert (a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"]), s  # bit for bit
        assert len(b[s]["mtp_loss"]) == 2 and all(math.isfinite(v) and v > 0 for v in b[s]["mtp_loss"])
    # λ > 0 trains the depths (and changes the main trajectory); a resumed run is bit-identical
    mtp = ["model.backbone.mtp_num_layers=1", "model.backbone.mtp_loss_scaling_factor=0.3"]
    c = _train(tmp_path / "c", *mtp)
    assert c[4]["mtp_loss"][0] < c[1]["mtp_loss"][0]
    assert c[2]["loss"] != a[2]["loss"]
    # tools.inspect draws the depth's layer as it draws the decoder's (mtp_*.png); mHC's H_res stays
    # doubly stochastic there too
    from tools.inspect import main as inspect_main

    assert inspect_main([str(tmp_path / "c"), "--output", str(tmp_path / "insp"), "--tokens", "32"]) == 0
    with open(tmp_path / "insp" / "inspect.json") as f:
        m = json.load(f)["runs"][0]["inspections"][-1]
    mtp_subs = m["mtp"]["sublayers"]
    assert m["mtp"]["depths"] == 1 and [r["kind"] for r in mtp_subs] == ["attention", "mlp"]
    for r in mtp_subs:
        H = torch.tensor(r["H_mean"], dtype=torch.float64)
        assert torch.allclose(H.sum(0), torch.ones(4, dtype=torch.float64), atol=1e-3)
        assert torch.allclose(H.sum(1), torch.ones(4, dtype=torch.float64), atol=1e-3)
    assert (tmp_path / "insp" / "mtp_mixing_mean.png").is_file()
    _train(tmp_path / "d", *mtp, "run.exit_at_step=2")
    d = _train(tmp_path / "d", *mtp)                                                      # resumes at step 2
    for s in (3, 4):
        assert (d[s]["loss"], d[s]["grad_norm"], d[s]["mtp_loss"]) == (c[s]["loss"], c[s]["grad_norm"],
                                                                       c[s]["mtp_loss"]), s


def test_accounting_cli_counts_the_depths(capsys):
    """``python -m tools.accounting --mtp-layers D``: one row per backbone × method, linear in D."""
    from tools.accounting import main

    rows = {}
    for d in (1, 2):
        assert main(["--sizes", "2.5B", "--methods", "vanilla", "mhc4", "--mtp-layers", str(d), "--json"]) == 0
        rows[d] = json.loads(capsys.readouterr().out)["mtp"]
    assert [r["method"] for r in rows[1]] == [r["method"] for r in rows[2]] and len(rows[1]) == 2
    for r1, r2 in zip(rows[1], rows[2]):
        assert r2["params_total"] == 2 * r1["params_total"] and r2["flops_per_token"] == 2 * r1["flops_per_token"]
        assert 0 < r1["flops_share_pct"] < 100
    assert rows[1][0]["params_hc"] == 0 < rows[1][1]["params_hc"]


@pytest.mark.parametrize("override,key", [("model.backbone.mtp_num_layers=0", "mtp_num_layers"),
                                          ("model.backbone.mtp_num_layers=1.5", "mtp_num_layers"),
                                          ("model.backbone.mtp_loss_scaling_factor=-0.1", "mtp_loss_scaling_factor")])
def test_bad_mtp_settings_name_the_key(override, key):
    from training.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.preset=tiny-moe:mhc", override])
    msg = str(err.value)
    assert f"model.backbone.{key}" in msg and "\n" not in msg, msg
