"""training.config: YAML + dotted overrides, typed parsing, and one error per validation rule family.

Every error must name the offending dotted key (``config key <section.key>: ...``).
"""

from __future__ import annotations

import os

import pytest

from training.config import (
    DEFAULT_CONFIG,
    ConfigError,
    PretrainConfig,
    config_to_dict,
    load_config,
    pad_vocab_size,
    parse_overrides,
    validate_runtime,
)

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_CONFIGS = os.path.join(REPO, "configs", "pretrain")


def _error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


# ------------------------------------------------------------------------------------------------
# Loading and typing
# ------------------------------------------------------------------------------------------------
def test_default_yaml_spells_out_the_builtin_defaults():
    assert config_to_dict(load_config(DEFAULT_CONFIG)) == config_to_dict(load_config(None))


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["optimizer.lr=1e-3", "parallel.tp=2", "parallel.sp=true", "run.train_steps=50",
                             "model.backbone.hidden_dropout=0.1", "optimizer.betas=[0.8, 0.9]",
                             "data.prefixes=/x/a", "tokenizer.type=none", "schedule.warmup_steps=5"])
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)  # PyYAML reads 1e-3 as a string
    assert cfg.parallel.tp == 2 and cfg.parallel.sp is True
    assert cfg.model.backbone == {"hidden_dropout": 0.1}
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.data.prefixes == ["/x/a"]  # a single prefix becomes a list
    # the schedule spans the run unless it says otherwise
    assert cfg.schedule.total_steps == 50


def test_explicit_schedule_length_is_kept():
    cfg = load_config(None, ["run.train_steps=50", "schedule.total_steps=80", "schedule.warmup_steps=5"])
    assert cfg.schedule.total_steps == 80


def test_parse_overrides_values_are_yaml():
    assert parse_overrides(["a.b=3", "a.c=[1, 2]", "a.d=null", "a.e=text"]) == [
        ("a.b", 3), ("a.c", [1, 2]), ("a.d", None), ("a.e", "text")]


def test_pad_vocab_size_is_megatrons_rule():
    assert pad_vocab_size(4096, 128, 1) == 4096
    assert pad_vocab_size(4097, 128, 2) == 4352  # next multiple of 256
    assert pad_vocab_size(151_665, 128, 1) == 151_680


@pytest.mark.parametrize("name", ["moe-18b-xhc", "moe-18b-xhc-muon", "moe-2p5b-nsweep", "moe-10b-xhc", "moe-28b-xhc"])
def test_gpu_configs_validate_for_their_layout(name):
    import re

    from models.zoo import load_preset

    path = os.path.join(PRETRAIN_CONFIGS, f"{name}.yaml")
    cfg = load_config(path)
    with open(path, encoding="utf-8") as f:
        world = int(re.search(r"^# cluster: (\d+) x ", f.read(), re.M).group(1))  # the recipe's cluster
    assert world == {"moe-2p5b-nsweep": 16, "moe-10b-xhc": 32, "moe-28b-xhc": 128}.get(name, 64)
    dp = validate_runtime(cfg, world, load_preset(cfg.model.preset), cuda=True)
    assert dp == world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    assert cfg.run.precision == "bf16" and cfg.batch.seq_length == 8192
    assert cfg.schedule.kind == "wsd" and cfg.schedule.warmup_steps == 500  # docs/math.md §6.4
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.eps == 1e-15 and cfg.optimizer.clip_grad == 1.0
    size = name.split("-")[1]  # the peak LR of each size ([xHC] App. A, docs/math.md §6.1)
    assert cfg.optimizer.lr == {"2p5b": 6.95e-4, "10b": 4.82e-4, "18b": 3.97e-4, "28b": 3.5e-4}[size]
    assert cfg.model.preset.startswith(f"moe-{size}:")
    if "muon" in name:
        assert cfg.optimizer.name == "muon" and load_preset(cfg.model.preset).hc.gram_schmidt is False


def test_every_pretrain_yaml_loads():
    names = sorted(f for f in os.listdir(PRETRAIN_CONFIGS) if f.endswith(".yaml"))
    assert "default-tiny.yaml" in names and len(names) >= 4
    for f in names:
        assert isinstance(load_config(os.path.join(PRETRAIN_CONFIGS, f)), PretrainConfig)


# ------------------------------------------------------------------------------------------------
# One error per rule family; each names the key
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key, words", [
    # unknown keys and sections
    (["parallel.tpp=2"], "parallel.tpp", "unknown key"),
    (["foo.bar=1"], "foo.bar", "unknown section"),
    (["model.hc.kk=3"], "model.hc.kk", "unknown HCConfig field"),
    # types
    (["run.train_steps=abc"], "run.train_steps", "not an integer"),
    (["parallel.sp=maybe"], "parallel.sp", "not a boolean"),
    (["optimizer.betas=[0.9]"], "optimizer.betas", "2 entries"),
    # choices
    (["run.device=tpu"], "run.device", "not one of"),
    (["checkpoint.checksum=md5"], "checkpoint.checksum", "not one of"),
    # ranges
    (["batch.micro_batch_size=0"], "batch.micro_batch_size", "> 0"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last", "> 0"),
    # batch arithmetic
    (["batch.global_batch_size=12"], "batch.global_batch_size", "multiple"),
    # parallel consistency
    (["parallel.sp=true"], "parallel.sp", "tp > 1"),
    (["parallel.vpp=2"], "parallel.vpp", "pp > 1"),
    # data / tokenizer consistency
    (["data.mock=true", "data.prefixes=/x/a"], "data.mock", "exclusive"),
    (["data.prefixes=[/x/a, /x/b]", "data.weights=[1.0]", "tokenizer.path=/t.model"], "data.weights", "one per prefix"),
    (["data.prefixes=/x/a"], "tokenizer.path", "tokenizer"),
    (["tokenizer.type=none"], "tokenizer.type", "need data.mock or data.prefixes"),
    (["data.split=1,2,3,4"], "data.split", "split"),
    # optimizer / schedule (their own validation, relabelled)
    (["optimizer.lr=-1"], "optimizer.lr", "> 0"),
    (["optimizer.name=sgd"], "optimizer.name", "adamw"),
    (["schedule.warmup_steps=500"], "schedule.warmup_steps", "total_steps"),
    (["optimizer.name=muon", "parallel.overlap_param_gather=true"], "parallel.overlap_param_gather",
     "sharded Muon"),
    (["optimizer.use_distributed_optimizer=false", "parallel.overlap_param_gather=true"],
     "parallel.overlap_param_gather", "use_distributed_optimizer is false"),
    # checkpoint
    (["checkpoint.load=/no/such/dir"], "checkpoint.load", "does not exist"),
])
def test_error_names_the_key(overrides, key, words):
    msg = _error(overrides)
    assert msg.startswith(f"config key {key}"), msg
    assert words in msg, msg


def test_override_syntax_errors():
    assert "section.key=value" in _error(["lr"])
    assert "dotted" in _error(["lr=3"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="file not found"):
        load_config("/no/such.yaml")


# ------------------------------------------------------------------------------------------------
# Runtime checks (world size, device, model preset)
# ------------------------------------------------------------------------------------------------
def _runtime_error(overrides, world, cuda=False):
    from models.zoo import load_preset

    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        validate_runtime(cfg, world, load_preset(cfg.model.preset), cuda=cuda)
    return str(e.value)


@pytest.mark.parametrize("overrides, world, key, words", [
    (["parallel.tp=2"], 3, "parallel", "not divisible"),
    (["parallel.dp=4"], 2, "parallel.dp", "world size"),
    (["parallel.ep=3", "batch.micro_batch_size=1", "batch.global_batch_size=6"], 3, "parallel.ep", "num_moe_experts=8"),
    (["parallel.tp=8"], 8, "parallel.tp", "num_attention_heads=4"),
    (["parallel.pp=3"], 3, "parallel.pp", "4 layers"),
    (["parallel.tp=2", "parallel.sp=true", "batch.seq_length=33"], 2, "batch.seq_length", "divisible"),
    (["batch.micro_batch_size=8", "batch.global_batch_size=8"], 2, "batch.global_batch_size", "dp"),
    (["run.precision=bf16"], 1, "run.precision", "CUDA"),
    (["parallel.cp=2"], 2, "parallel.cp", "CUDA"),
])
def test_runtime_error_names_the_key(overrides, world, key, words):
    msg = _runtime_error(overrides, world)
    assert msg.startswith(f"config key {key}"), msg
    assert words in msg, msg


def test_runtime_dp_is_world_over_model_parallel():
    from models.zoo import load_preset

    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=2", "batch.micro_batch_size=2", "batch.global_batch_size=8"])
    assert validate_runtime(cfg, 8, load_preset(cfg.model.preset), cuda=False) == 2


def test_cli_reports_config_errors(capsys):
    from training.pretrain import main

    assert main(["run.train_steps=abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config key run.train_steps")


def test_cli_print_config(capsys):
    import yaml

    from training.pretrain import main

    assert main(["--print-config", "optimizer.lr=5e-4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"]["lr"] == 5e-4 and printed["model"]["preset"] == "tiny-moe:xhc"


def test_reference_documents_every_key():
    import dataclasses

    from training.config import SECTION_TYPES, _field_docs, _section_type, config_reference

    ref = config_reference()
    for sec in SECTION_TYPES:
        cls = _section_type(sec)
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f"`{sec}.{f.name}`" in ref
            if sec not in ("optimizer", "schedule"):  # ours: every key says what it does
                assert docs.get(f.name), f"{sec}.{f.name} has no docstring"


def test_unset_warmup_scales_with_the_run_length_and_is_logged():
    """``run.train_steps=20`` alone is a valid run: the built-in warmup (20 of 300 updates) is
    scaled to the run, stays before the WSD decay, and the config says so for the log."""
    base = load_config(None)
    assert base.notes == []
    cfg = load_config(None, ["run.train_steps=20"])
    s = cfg.schedule
    assert s.total_steps == 20 and 1 <= s.warmup_steps <= s.total_steps - s.decay_steps
    assert s.warmup_steps == round(base.schedule.warmup_steps * 20 / base.schedule.total_steps)
    assert len(cfg.notes) == 1 and "schedule.warmup_steps" in cfg.notes[0]
    # a warmup the user sets is kept, and a bad one is still an error naming the key and the bound
    assert load_config(None, ["run.train_steps=40", "schedule.warmup_steps=3"]).schedule.warmup_steps == 3
    with pytest.raises(ConfigError, match=r"schedule\.warmup_steps=20 .*at most 16"):
        load_config(None, ["run.train_steps=20", "schedule.warmup_steps=20"])


def test_entry_points_do_not_switch_off_torch_compile_in_the_importing_process(monkeypatch, capsys):
    """training.pretrain / tools.convert_checkpoint switch dynamo off only while their main() runs
    (CPU start-up time); importing them, or calling main() in-process, leaves torch.compile on."""
    import os
    import subprocess
    import sys

    import training.run.process_defaults as pd

    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    r = subprocess.run([sys.executable, "-c", "import os, training.pretrain, tools.convert_checkpoint; "
                        "print(os.environ.get('TORCHDYNAMO_DISABLE'))"], env=env, capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.stdout.strip() == "None", r.stdout
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.setattr(pd, "on_cpu_machine", lambda: True)
    seen = {}
    with pd.cpu_entry_point():
        seen["inside"] = os.environ.get("TORCHDYNAMO_DISABLE")
    assert seen["inside"] == "1" and "TORCHDYNAMO_DISABLE" not in os.environ
    from training.pretrain import main

    assert main(["--print-config"]) == 0
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # the user's choice wins and is kept
    with pd.cpu_entry_point():
        assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
    assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
    # and a compiled function really compiles here
    import torch

    torch._dynamo.reset()
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    torch.compile(lambda a: a * 2, backend=backend)(torch.ones(3))
    assert len(calls) == 1
