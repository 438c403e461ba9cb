"""The documented user paths that stand alone (resume, upcycling, PEFT, finetuning, sweeps, the zoo).

Same rules as tests/test_journeys.py (which runs the default-run chain: pre-train -> to-hf ->
generate / evaluate -> from-hf); a separate module so that the two run on different pytest-xdist
workers.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.journey import Workspace
from tests.test_journeys import STEPS, _check_body, _metrics, block, run_block  # noqa: F401

pytestmark = [pytest.mark.journey, pytest.mark.slow, pytest.mark.megatron]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("journey-more"))


@pytest.fixture(scope="module")
def later(ws, tmp_path_factory):
    """Where the commands after a journey's first one start: another working directory, which reaches
    the first one's ``runs/`` and ``hf/`` (and ``data/``, which a training resolves against its own
    working directory, as documented) through links."""
    return ws.elsewhere(tmp_path_factory.mktemp("journey-more-later"), links=("runs", "hf", "data"))


def test_resume(ws, later):
    """README "To resume": the same run.dir continues from its newest checkpoint (started from
    another working directory)."""
    first, second = run_block(ws, "resume", steps=[8, 12], later=later)
    assert "done: step 8/8" in first and "done: step 12/12" in second
    assert "resum" in second.lower()
    rows = _metrics(ws.root / "runs" / "my-run")
    resumes = [r for r in rows if r.get("kind") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 8, "the resume is marked in metrics.jsonl"
    steps = [r["step"] for r in rows if r.get("kind") == "train"]
    assert max(steps) == 12 and 9 in steps



def test_upcycle(ws, later):
    """docs/conversion.md "Upcycling": vanilla -> to-hf -> from-hf --to-variant xhc -> train on (the
    commands after the first from another working directory)."""
    outs = run_block(ws, "upcycle", steps=[STEPS, STEPS + 4], later=later)
    assert "Glm4MoeForCausalLM" in outs[1]
    assert f"done: step {STEPS + 4}/{STEPS + 4}" in outs[3]



def test_peft_snippet_and_generate(ws):
    """README "Finetuning": wrap, generate, save, load, generate again; then the cache check on
    the wrapped model in a fresh process (first call under no_grad)."""
    b = block("peft")
    out = ws.python(b.body).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("tensor(")]
    assert len(lines) == 2 and lines[0] == lines[1], out[-2000:]  # the loaded adapter generates the same
    assert (ws.root / "adapter" / "hc_adapter.safetensors").is_file()
    script = (
        "import torch\n"
        "from models.hf import wrap_with_mhc, peft_paper_config\n"
        "from models.hf.tiny import tiny_causal_lm\n"
        + "\n".join(ln for ln in _check_body().splitlines())
        + "\nm = wrap_with_mhc(tiny_causal_lm('llama'), peft_paper_config('mhc', n=4)).eval()\n"
        "for p in m.parameters():\n    p.data.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))\n"
        "r = check(m, m.config.vocab_size)\nassert r['generate'] == r['argmax_loop'], r\nprint('PEFT-OK', r['margin'])\n"
    )
    assert "PEFT-OK" in ws.python(script).stdout



def test_finetune_and_diagnose(ws, later):
    """README "Finetuning": the CPU smoke run on a chat file written here, and the diagnostics tool."""
    rows = []
    for i in range(200):
        rows.append({"messages": [{"role": "user", "content": f"what is {i} plus {i % 7}?"},
                                  {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."}],
                     "source": ["math", "chat", "code"][i % 3]})
    (ws.root / "my_chats.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ft, diag = run_block(ws, "finetune", later=later)
    assert re.search(r"validation loss\s*[:=]?\s*\d", ft, re.I), ft[-3000:]
    assert "Traceback" not in diag and re.search(r"pass|ok", diag, re.I), diag[-2000:]
    # the finetuned adapter on its backbone, in a fresh process: no_grad first, generate == argmax loop
    script = (
        "from training.finetune import FinetuneConfig, build_backbone\n"
        "from models.hf import load_adapter\n"
        + _check_body()
        + "\ncfg = FinetuneConfig.load('configs/finetune/tiny_cpu.yaml', ['data.path=my_chats.jsonl'])\n"
        "m = load_adapter(build_backbone(cfg.model, cfg.train.seed), cfg.train.out_dir + '/adapter').eval()\n"
        "r = check(m, m.config.vocab_size)\nassert r['generate'] == r['argmax_loop'], r\nprint('FINETUNED-OK')\n"
    )
    assert "FINETUNED-OK" in ws.python(script).stdout



def test_sweep_print_run_fit(ws, later):
    """docs/sweeps.md: print the tiny sweep, run the smoke sweep's arms, fit them (run and fit from
    another working directory than print's)."""
    printed, ran, fit = run_block(ws, "sweep", later=later)
    assert "36 arms" in printed  # configs/sweeps/tiny-cpu.yaml: 4 variants x 3 budgets x 3 seeds
    assert "4/4 arms finished, 0 failed" in ran
    fj = json.loads((ws.root / "runs" / "sweeps" / "smoke-cpu" / "summary" / "fit.json").read_text())
    assert fj and "mhc-n4" in json.dumps(fj)



def test_zoo_and_accounting(ws):
    """README "Model zoo": the preset list and the accounting tables."""
    listed, acc = run_block(ws, "zoo")
    for v in ("tiny-moe:xhc", "tiny-moe:mhc-lite", "moe-18b:xhc-flash4"):
        assert v in listed
    assert "1256" in acc.replace(",", "")  # per-layer xHC parameters per C, docs/math.md §5


def test_mtp_deepseek_v4_recipe(ws):
    """README "Multi-token prediction": tiny mHC with DeepSeek-V4's convention and head and one MTP depth."""
    (out,) = run_block(ws, "mtp")
    assert f"done: step {STEPS}/{STEPS}" in out
    rows = [r for r in _metrics(ws.root / "runs" / "tiny-mtp") if r.get("kind") == "train"]
    assert rows and all(len(r["mtp_loss"]) == 1 for r in rows)
    assert rows[-1]["mtp_loss"][0] < rows[0]["mtp_loss"][0]
