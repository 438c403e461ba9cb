"""The model zoo (models.zoo, configs/models/*.yaml, tools.zoo).

Every preset resolves to a valid Megatron ``TransformerConfig`` + ``HCConfig``; representative paper
presets build on the meta device and their parameter counts equal the independent analytic
formulas of :mod:`xhc.accounting` (docs/math.md §5.1, §6.1); bad names and keys give one-line errors that
name the preset/file and the key.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from contextlib import redirect_stdout

import pytest
import torch

pytest.importorskip("megatron.core")

from models.validation import validate_hc_transformer_config  # noqa: E402
from models.zoo import (  # noqa: E402
    CONFIG_DIR,
    ZooError,
    build_model,
    build_transformer_config,
    list_presets,
    load_preset,
    preset_files,
    transformer_config_kwargs,
)
from models.zoo import backbone_shape  # noqa: E402
from xhc.accounting import BackboneShape, backbone_params, hc_params_total  # noqa: E402

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

PAPER_FILES = {"moe-2p5b": "2.5B", "moe-10b": "10B", "moe-18b": "18B", "moe-28b": "28B"}


@pytest.fixture(scope="module")
def parallel():
    from models.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, 1)
    yield
    destroy_parallel()


# ------------------------------------------------------------------------------------------------
# Every preset
# ------------------------------------------------------------------------------------------------
def test_every_preset_loads_and_validates():
    names = list_presets()
    files = {p.stem for p in preset_files()}
    assert set(PAPER_FILES) | {"tiny-moe"} <= files
    assert {n.split(":")[0] for n in names} == files
    assert len(names) == len(set(names))
    for name in names:
        preset = load_preset(name)
        config = build_transformer_config(preset, cpu=True)
        validate_hc_transformer_config(config, preset.hc)
        b = preset.backbone
        assert (config.num_layers, config.hidden_size, config.num_attention_heads) == \
            (b["num_layers"], b["hidden_size"], b["num_attention_heads"]), name
        if b.get("num_moe_experts"):
            dense = b.get("first_dense_layers", 0)
            assert config.moe_layer_freq == [0] * dense + [1] * (b["num_layers"] - dense), name
        # CPU overrides are config only (docs/math.md §1.7: no TE, allgather dispatcher)
        assert config.use_cpu_initialization and config.moe_token_dispatcher_type == "allgather", name
        assert not config.fp32_residual_connection and not getattr(config, "fused_residual_rmsnorm", False)
    assert build_transformer_config(load_preset("tiny-moe:xhc"), cpu=False).moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("file,size", sorted(PAPER_FILES.items()))
def test_paper_backbones_match_the_spec_shapes(file, size):
    """The YAML backbones are docs/math.md §6.1 shapes that xhc.accounting encodes independently."""
    names = [n for n in list_presets() if n.startswith(f"{file}:")]
    assert f"{file}:vanilla" in names and f"{file}:xhc" in names
    got = backbone_shape(load_preset(f"{file}:vanilla"))
    want = BackboneShape.paper(size)
    diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(BackboneShape)
            if f.name != "name" and getattr(got, f.name) != getattr(want, f.name)
            and not (f.name == "shared_expert_ffn" and got.shared_ffn == want.shared_ffn)
            and not (f.name == "dense_ffn" and got.dense_ffn_width == want.dense_ffn_width)}  # fmt: skip
    assert not diff, diff


# ------------------------------------------------------------------------------------------------
# Meta-device builds: counts == analytic formulas
# ------------------------------------------------------------------------------------------------
def _build_meta(name):
    preset = load_preset(name)
    config = build_transformer_config(preset, cpu=True)
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = build_model(preset, config, use_transformer_engine=False)
    return preset, config, model


def _counts(model, preset):
    b = preset.backbone
    E, topk = int(b.get("num_moe_experts") or 0), int(b.get("moe_router_topk") or 0)
    hc = backbone = routed = 0
    for name, p in model.named_parameters():
        if getattr(p, "is_hyper_connection", False):
            hc += p.numel()
            continue
        backbone += p.numel()
        if ".experts." in name and "shared_experts" not in name:
            routed += p.numel()
    activated = backbone - routed + (routed * topk // E if E else 0)
    return hc, backbone, activated


@pytest.mark.parametrize("name", ["moe-2p5b:xhc", "moe-18b:mhc"])
@pytest.mark.slow
def test_paper_preset_builds_on_meta_and_matches_accounting(parallel, name):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from models.hc_layer import HyperConnectionTransformerLayer

    preset, config, model = _build_meta(name)
    layers = model.decoder.layers
    assert len(layers) == preset.num_layers
    assert all(isinstance(layer, HyperConnectionTransformerLayer) for layer in layers)
    dense = preset.backbone["first_dense_layers"]
    assert [isinstance(layer.mlp, MoELayer) for layer in layers] == [False] * dense + [True] * (len(layers) - dense)
    assert all(p.device.type == "meta" for p in model.parameters())
    hc, backbone, activated = _counts(model, preset)
    assert hc == hc_params_total(preset.hc, preset.hidden_size, preset.num_layers).total
    want = backbone_params(backbone_shape(preset))
    assert (backbone, activated) == (want.total, want.activated)


def test_every_tiny_variant_builds_and_counts(parallel):
    """All arms of the tiny preset (incl. Flash-4sub windows over 4 layers) on the meta device."""
    names = [n for n in list_presets() if n.startswith("tiny-moe:")]
    assert len(names) == 9
    want_backbone = None
    for name in names:
        preset, config, model = _build_meta(name)
        hc, backbone, activated = _counts(model, preset)
        assert hc == hc_params_total(preset.hc, preset.hidden_size, preset.num_layers).total, name
        assert (hc > 0) == preset.hc.enabled, name
        want_backbone = want_backbone or backbone_params(backbone_shape(preset))
        assert (backbone, activated) == (want_backbone.total, want_backbone.activated), name


def test_tools_zoo_list_prints_every_preset(parallel):
    from tools.zoo import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--list"]) == 0
    assert out.getvalue().split() == list_presets()


# ------------------------------------------------------------------------------------------------
# Errors: one line, naming the preset/file and the key
# ------------------------------------------------------------------------------------------------
def _one_line(err):
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_preset_names():
    with pytest.raises(ZooError) as e:
        load_preset("tiny-moe")
    assert "'tiny-moe' must be '<file>:<variant>'" in _one_line(e) and "--list" in _one_line(e)
    with pytest.raises(ZooError) as e:
        load_preset("moe-99b:xhc")
    assert "moe-99b.yaml does not exist" in _one_line(e)
    with pytest.raises(ZooError) as e:
        load_preset("tiny-moe:xhc-n3")
    msg = _one_line(e)
    assert "tiny-moe.yaml has no variant 'xhc-n3'" in msg and "xhc-flash4" in msg


def test_bad_keys_and_values():
    with pytest.raises(ZooError) as e:
        load_preset("tiny-moe:xhc", hc_overrides={"kk": 2})
    assert "tiny-moe:xhc" in _one_line(e) and "no field 'kk'" in _one_line(e)
    with pytest.raises(ZooError) as e:
        load_preset("tiny-moe:xhc", hc_overrides={"k": 99})
    assert "tiny-moe:xhc" in _one_line(e) and "HCConfig.k=99" in _one_line(e)
    with pytest.raises(ZooError) as e:
        build_transformer_config(load_preset("tiny-moe:mhc", backbone_overrides={"hiden_size": 64}), cpu=True)
    assert "tiny-moe:mhc" in _one_line(e) and "unknown backbone key(s) hiden_size" in _one_line(e)
    with pytest.raises(ZooError) as e:
        transformer_config_kwargs(load_preset("tiny-moe:mhc", backbone_overrides={"activation": "relu2"}))
    assert "backbone.activation='relu2'" in _one_line(e) and "silu" in _one_line(e)
    with pytest.raises(ZooError) as e:
        transformer_config_kwargs(load_preset("tiny-moe:mhc", backbone_overrides={"first_dense_layers": 9}))
    assert "backbone.first_dense_layers=9" in _one_line(e)
    with pytest.raises(ZooError) as e:
        build_transformer_config(load_preset("tiny-moe:mhc", backbone_overrides={"num_moe_experts": None}), cpu=True)
    msg = _one_line(e)
    assert "tiny-moe:mhc" in msg and "Megatron rejected the config" in msg and "moe_ffn_hidden_size" in msg


def test_bad_preset_files(tmp_path):
    missing = tmp_path / "nolayers.yaml"
    missing.write_text("backbone: {hidden_size: 8, num_attention_heads: 2}\nvariants: {v: {variant: none}}\n")
    with pytest.raises(ZooError) as e:
        load_preset(f"{missing}:v")
    assert "backbone.num_layers is missing" in _one_line(e)
    broken = tmp_path / "broken.yaml"
    broken.write_text("backbone: [unclosed\n")
    with pytest.raises(ZooError) as e:
        load_preset(f"{broken}:v")
    assert "broken.yaml is not valid YAML" in _one_line(e)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(ZooError) as e:
        load_preset(f"{scalar}:v")
    assert "must hold a mapping" in _one_line(e)
    assert CONFIG_DIR.is_dir()
