"""Finetuning script (training/finetune.py): data split, packing, schedule, configs, end-to-end CPU run.

The chat data is generated here (messages with a ``source`` field); the model is a tiny random
Llama with the built-in character tokenizer; nothing is downloaded.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from training.finetune import (  # noqa: E402
    FinetuneConfig,
    FinetuneConfigError,
    cosine_lambda,
    evaluate,
    main,
    pack,
    proportional_budgets,
    run,
    stratified_split,
    tokenize_chats,
)

SOURCES = {"arith": 60, "greet": 30, "code": 10}  # imbalanced, as Tulu's 18 sources are


def make_rows(seed: int = 0):
    r = random.Random(seed)
    rows = []
    for src, count in SOURCES.items():
        for _ in range(count):
            a, b = r.randint(0, 99), r.randint(0, 99)
            if src == "arith":
                msgs = [{"role": "user", "content": f"What is {a} plus {b}?"},
                        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
            elif src == "greet":
                msgs = [{"role": "user", "content": f"Greet guest number {a}."},
                        {"role": "assistant", "content": f"Welcome, guest {a}! Nice to see you."}]
            else:
                msgs = [{"role": "system", "content": "You write Python."},
                        {"role": "user", "content": f"Set x to {a}."},
                        {"role": "assistant", "content": f"x = {a}"}]
            rows.append({"messages": msgs, "source": src, "id": len(rows)})
    r.shuffle(rows)
    return rows


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    path = d / "chat.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in make_rows():
            f.write(json.dumps(row) + "\n")
    return str(path)


# ================================================================================================
# Stratified split ([PEFT] App. C.4)
# ================================================================================================
def test_proportional_budgets_largest_remainder():
    # n = 7 over 50/30/20: exact 3.5 / 2.1 / 1.4 -> floors 3/2/1, the one left goes to the .5
    assert proportional_budgets({"a": 50, "b": 30, "c": 20}, 7) == {"a": 4, "b": 2, "c": 1}
    # n = 10 over 1/1/1: 3.33 each -> 3/3/3 + 1 to a tie (larger source first, then name)
    assert proportional_budgets({"x": 1000, "y": 1000, "z": 1000}, 10) == {"x": 4, "y": 3, "z": 3}
    with pytest.raises(FinetuneConfigError, match="only"):
        proportional_budgets({"a": 2}, 3)


def test_stratified_split_properties():
    sources = [row["source"] for row in make_rows()]
    sizes = {"validation": 10, "test": 10, "train": None}
    sp = stratified_split(sources, sizes, seed=343434)
    all_idx = sp["validation"] + sp["test"] + sp["train"]
    assert sorted(all_idx) == list(range(len(sources)))  # disjoint and complete
    for name in ("validation", "test"):
        counts = {s: sum(sources[i] == s for i in sp[name]) for s in SOURCES}
        assert counts == {"arith": 6, "greet": 3, "code": 1}  # 10 · N_s / N exactly
    assert stratified_split(sources, sizes, seed=343434) == sp  # fixed seed -> same split
    assert stratified_split(sources, sizes, seed=1)["test"] != sp["test"]
    with pytest.raises(FinetuneConfigError, match="remain"):
        stratified_split(sources, {"validation": 60, "test": 60}, seed=0)


def test_stratified_split_caps_small_sources():
    """A source too small for its share in a later split gives its shortfall to the others."""
    sources = ["big"] * 97 + ["tiny"] * 3
    sp = stratified_split(sources, {"validation": 50, "test": 48, "train": None}, seed=0)
    assert len(sp["validation"]) == 50 and len(sp["test"]) == 48 and len(sp["train"]) == 2
    assert sorted(sp["validation"] + sp["test"] + sp["train"]) == list(range(100))


# ================================================================================================
# Tokenisation and packing
# ================================================================================================
def test_chat_template_tokenisation():
    import datasets

    from models.hf.tiny import char_tokenizer

    tok = char_tokenizer()
    rows = make_rows()[:3]
    ds = datasets.Dataset.from_list(rows)
    seqs = tokenize_chats(ds, tok)
    for row, ids in zip(rows, seqs):
        expected = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in row["messages"])
        assert tok.decode(ids) == expected
        assert ids.count(tok.eos_token_id) == len(row["messages"])
    with pytest.raises(FinetuneConfigError, match="conversations"):
        tokenize_chats(ds, tok, messages_field="conversations")


def test_prepared_data_cache(chat_jsonl, tmp_path):
    from models.hf.tiny import char_tokenizer
    from training.finetune import DataArgs, prepare_data

    tok = char_tokenizer()
    args = DataArgs(path=chat_jsonl, validation_size=10, test_size=10, max_length=64, cache_dir=str(tmp_path))
    a = prepare_data(args, tok)
    files = glob.glob(str(tmp_path / "packed-*.pt"))
    assert len(files) == 1
    b = prepare_data(args, tok)  # from the cache
    assert all(torch.equal(x, y) for s in ("train", "validation", "test")
               for x, y in zip(getattr(a, s), getattr(b, s)))
    assert a.source_counts == b.source_counts
    prepare_data(DataArgs(path=chat_jsonl, validation_size=10, test_size=10, max_length=64,
                          cache_dir=str(tmp_path), split_seed=1), tok)
    assert len(glob.glob(str(tmp_path / "packed-*.pt"))) == 2  # another split -> another cache entry


def test_pack_blocks_and_tail():
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    ids, labels = pack(seqs, 4, keep_tail=False, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]] and torch.equal(ids, labels)
    ids, labels = pack(seqs, 4, keep_tail=True, pad_id=0)
    assert ids.tolist()[-1] == [9, 10, 0, 0] and labels.tolist()[-1] == [9, 10, -100, -100]


def test_cosine_schedule_with_warmup():
    total = 1000
    warm = math.ceil(0.03 * total)  # 3 % warmup
    f = cosine_lambda(warm, total)
    assert f(0) == pytest.approx(1 / warm)
    assert f(warm - 1) == pytest.approx(1.0)
    assert f(warm) == pytest.approx(1.0, abs=1e-4)  # first cosine step: 0.5·(1 + cos(π/970))
    assert f(warm + (total - warm) // 2) == pytest.approx(0.5, abs=2e-3)
    assert f(total - 1) == pytest.approx(0.0, abs=1e-12)  # the last update runs at the floor
    assert all(f(s) >= f(s + 1) for s in range(warm, total))


# ================================================================================================
# Configuration
# ================================================================================================
def test_config_overrides_and_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {tiny: {family: llama}}\nhc: {variant: kromhc, n: 4, dynamic: false}\n")
    cfg = FinetuneConfig.load(str(p), ["train.max_steps=7", "hc.n=2", "peft.method=lora"])
    assert cfg.train.max_steps == 7 and cfg.peft.method == "lora"
    hc = cfg.hc_config()
    assert (hc.variant, hc.n, hc.dynamic, hc.preset, hc.init_noise, hc.reduction) == \
        ("kromhc", 2, False, "peft_paper", 1e-4, "mean")
    assert cfg.train.lr == 1e-3 and cfg.train.warmup_ratio == 0.03 and cfg.train.seed == 34  # [PEFT] defaults
    with pytest.raises(FinetuneConfigError, match="train.max_stepz"):
        FinetuneConfig.load(str(p), ["train.max_stepz=3"])
    with pytest.raises(FinetuneConfigError, match="peft.method"):
        FinetuneConfig.load(str(p), ["peft.method=adapterx"])
    with pytest.raises(Exception, match="variant"):
        FinetuneConfig.load(str(p), ["hc.variant=foo"])
    with pytest.raises(FinetuneConfigError, match="not found"):
        FinetuneConfig.load(str(tmp_path / "missing.yaml"))
    assert main(["--config", str(p), "train.max_steps=0"]) == 2


CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs", "finetune")
# config file -> [PEFT] trainable parameters it must produce on OLMo-2-0425-1B (Tables 1, 2, 13)
PAPER_CONFIGS = {
    "olmo2_1b_static_mhc_n4.yaml": 772,
    "olmo2_1b_static_mhc_lite_n4.yaml": 1024,
    "olmo2_1b_static_kromhc_n4.yaml": 384,
    "olmo2_1b_dynamic_mhc_n4.yaml": 6_554_464,
    "olmo2_1b_dynamic_mhc_lite_n4.yaml": 8_651_872,
    "olmo2_1b_dynamic_kromhc_n4.yaml": 3_408_352,
    "olmo2_1b_identity_n4.yaml": 2_359_616,
    "olmo2_1b_identity_n2_vera.yaml": 655_552,
    "olmo2_1b_static_kromhc_n16_lora_r8.yaml": 1280,
}


def test_every_shipped_config_loads():
    files = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.yaml")))
    assert len(files) >= len(PAPER_CONFIGS) + 1
    for f in files:
        FinetuneConfig.load(f)


@pytest.mark.slow
def test_paper_configs_reproduce_paper_counts():
    from transformers import AutoModelForCausalLM

    from models.hf.mhc_adapter import count_adapter_parameters, unwrap_mhc, wrap_with_mhc
    from models.hf.tiny import olmo2_1b_config

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(olmo2_1b_config())
    for name, expect in PAPER_CONFIGS.items():
        cfg = FinetuneConfig.load(os.path.join(CONFIG_DIR, name))
        assert cfg.model.name_or_path == "allenai/OLMo-2-0425-1B"
        lr = cfg.train.lr
        hc = cfg.hc_config()
        # Table 12 learning rates: 1e-4 for dynamic Sinkhorn mHC and dynamic mHC-lite, else 1e-3
        assert lr == (1e-4 if hc.dynamic and hc.variant in ("mhc", "mhc_lite") else 1e-3), name
        wrap_with_mhc(m, hc)
        try:
            assert count_adapter_parameters(m) == expect, name
        finally:
            unwrap_mhc(m)


# ================================================================================================
# End-to-end CPU runs
# ================================================================================================
def _tiny_cfg(data_path, out_dir, **over):
    d = {
        "model": {"tiny": {"family": "llama", "vocab_size": 128, "hidden_size": 32, "num_layers": 2,
                           "intermediate_size": 64}, "tokenizer": "char"},
        "hc": {"variant": "identity", "n": 4},
        "data": {"path": data_path, "validation_size": 10, "test_size": 10, "max_length": 64},
        "train": {"max_steps": 16, "batch_size": 4, "grad_accum": 2, "log_interval": 4, "eval_interval": 8,
                  "out_dir": out_dir, "diagnostics_steps": 10, "device": "cpu", "lr": 1e-2},
    }
    for k, v in over.items():
        section, key = k.split(".", 1)
        d.setdefault(section, {})[key] = v
    return FinetuneConfig.from_dict(d)


def _events(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_end_to_end_identity_jsonl(chat_jsonl, tmp_path, capsys):
    out = str(tmp_path / "run")
    summary = run(_tiny_cfg(chat_jsonl, out))
    text = capsys.readouterr().out
    assert "diagnostics:" in text and "FAIL" not in text
    assert "trainable parameters: mHC" in text and "step 16/16" in text and "test loss" in text
    ev = _events(out)
    kinds = [e["kind"] for e in ev]
    assert kinds.count("train") == 4 and kinds.count("validation") == 3 and kinds.count("test") == 1
    data = next(e for e in ev if e["kind"] == "data")
    # the stratified split keeps the 60/30/10 source mix in the held-out splits
    assert data["sources"]["validation"] == {"arith": 6, "greet": 3, "code": 1}
    assert data["sources"]["test"] == {"arith": 6, "greet": 3, "code": 1}
    params = next(e for e in ev if e["kind"] == "params")
    per_sublayer = 4 * 32 * 8 + 4 * 32 + 8 + 2  # identity: N·C·2N + N·C (norm gain) + 2N + 2 gates
    assert params["hc"] == 4 * per_sublayer and params["other_trainable"] == 0
    assert glob.glob(os.path.join(out, "tb", "events.out.tfevents.*"))
    assert summary["validation_loss"] < summary["validation_loss_init"]  # the adapter learns
    assert summary["test_ppl"] == pytest.approx(math.exp(summary["test_loss"]))
    # warmup 3 % of 16 steps = 1 step, then cosine to 0
    lrs = [e["lr_mhc"] for e in ev if e["kind"] == "train"]
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12) and lrs[0] < 1e-2

    # the saved adapter reproduces the test loss on a fresh copy of the backbone
    from models.hf.mhc_adapter import load_adapter
    from training.finetune import build_backbone, build_tokenizer, prepare_data

    cfg = _tiny_cfg(chat_jsonl, out)
    fresh = build_backbone(cfg.model, cfg.train.seed)
    load_adapter(fresh, summary["adapter_dir"])
    splits = prepare_data(cfg.data, build_tokenizer(cfg.model))
    again = evaluate(fresh, splits.test, cfg.train.batch_size, torch.device("cpu"), False)
    assert again["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)


@pytest.mark.slow
def test_end_to_end_kromhc_lora_parquet(tmp_path, capsys):
    pytest.importorskip("peft")
    import datasets

    pq = str(tmp_path / "chat.parquet")
    datasets.Dataset.from_list(make_rows(1)).to_parquet(pq)
    out = str(tmp_path / "run")
    cfg = _tiny_cfg(pq, out, **{"peft.method": "lora", "peft.r": 2, "train.diagnostics": False,
                                "train.max_steps": 6, "train.eval_interval": 6, "train.log_interval": 2,
                                "data.packing": False, "data.max_length": 96,
                                "train.bf16": True})  # the GPU code path (bf16 autocast), here on CPU
    cfg.hc = {"variant": "kromhc", "n": 2, "dynamic": True}
    summary = run(cfg)
    assert "bf16_autocast=True" in capsys.readouterr().out
    ev = _events(out)
    train = [e for e in ev if e["kind"] == "train"]
    assert {"lr_mhc", "lr_peft"} <= set(train[0])
    assert train[0]["lr_peft"] == pytest.approx(train[0]["lr_mhc"] * 1e-4 / 1e-2)  # separate groups
    assert summary["params"]["other_trainable"] > 0 and summary["params"]["hc"] > 0
    assert os.path.isfile(os.path.join(out, "peft_adapter", "adapter_config.json"))
    assert os.path.isfile(os.path.join(out, "adapter", "hc_adapter.safetensors"))
    assert math.isfinite(summary["test_loss"])
