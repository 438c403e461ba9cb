"""The documented user paths, run as a user types them (``tests/journey.py`` explains the rules).

Each test runs the marked fenced blocks of the README and docs/ in fresh subprocesses from an empty
working directory with a clean environment, then checks what the user would look at: the exit
status, the printed summary, the files written.  The journeys that build on one another (pre-train
-> resume, -> to-hf -> generate / evaluate -> from-hf) share one workspace, in file order.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.journey import Workspace, doc_blocks, generate_check, is_pretrain, shorten

pytestmark = [pytest.mark.journey, pytest.mark.slow, pytest.mark.megatron]

BLOCKS = doc_blocks()
STEPS = 12  # the shortened length of every documented pre-training run


def block(name):
    assert name in BLOCKS, f"the docs lost the journey block {name!r} (marked runnable blocks: {sorted(BLOCKS)})"
    return BLOCKS[name]


def run_block(ws: Workspace, name: str, steps=STEPS):
    """Run every command of a bash block in order; ``steps``: an int, or one per pre-training line."""
    outs, k = [], 0
    for argv in block(name).commands():
        n = steps
        if is_pretrain(argv) and isinstance(steps, (list, tuple)):
            n, k = steps[k], k + 1
        outs.append(ws.run(argv, shorten(argv, n)).stdout)
    return outs


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("journey"))


def _metrics(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_marked_blocks_exist_and_parse():
    expected = {"default-run", "generate", "resume", "from-hf", "upcycle", "peft", "finetune", "sweep", "zoo"}
    assert expected <= set(BLOCKS)
    for b in BLOCKS.values():
        assert b.lang in ("bash", "python"), b.where
        if b.lang == "bash":
            assert b.commands(), b.where


# ------------------------------------------------------------------------------------------------
def test_default_run_to_hf_and_evaluate(ws):
    """docs/conversion.md "The default run": pre-train (the default, shortened), to-hf, tools.evaluate."""
    pre, conv, ev = run_block(ws, "default-run")
    assert f"done: step {STEPS}/{STEPS}" in pre
    assert re.search(r"HC kernels: auto -> compile", pre), "the run says which HC backend `auto` chose"
    runs = list((ws.root / "runs").glob("tiny-moe-xhc-*"))
    assert len(runs) == 1 and (runs[0] / "checkpoints").is_dir()
    hf = ws.root / "hf" / "tiny-moe-xhc"
    assert (hf / "config.json").is_file() and "XHCMoeForCausalLM" in conv
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["hc"]["kernels"] == "eager"  # the exported model runs the plain reference path
    shipped = {p.name for p in hf.glob("*.py")}
    assert not {"kernels_triton_ops.py", "kernels_liger.py", "kernels_autoselect.py"} & shipped, shipped
    tok = json.loads((hf / "tokenizer_config.json").read_text())
    assert tok["model_max_length"] == 128 and tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    card = (hf / "README.md").read_text()
    assert "eager" in card and re.search(r"\| eager \(this folder\) \| \d+\.\d+ \|", card)
    m = re.search(r"bits_per_byte (\d+\.\d+)", ev)
    assert m and 0.0 < float(m.group(1)) < 20.0, ev[-2000:]


def test_generate_snippet(ws):
    """The Python snippet of docs/conversion.md, as written (no trust_remote_code for the tokenizer:
    it must not ask a question; stdin is closed, so a prompt would fail), then the cache check."""
    b = block("generate")
    assert b.lang == "python"
    out = ws.python(b.body).stdout
    assert out.strip(), "generate printed nothing"
    res = generate_check(ws, [ws.root / "hf" / "tiny-moe-xhc"])
    for r in res.values():
        assert r["generate"] == r["argmax_loop"]


def test_resume(ws):
    """README "To resume": the same run.dir continues from its newest checkpoint."""
    first, second = run_block(ws, "resume", steps=[8, 12])
    assert "done: step 8/8" in first and "done: step 12/12" in second
    assert "resum" in second.lower()
    rows = _metrics(ws.root / "runs" / "my-run")
    resumes = [r for r in rows if r.get("kind") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 8, "the resume is marked in metrics.jsonl"
    steps = [r["step"] for r in rows if r.get("kind") == "train"]
    assert max(steps) == 12 and 9 in steps


def test_from_hf_and_continue(ws):
    """docs/conversion.md "Back to Megatron": from-hf of the default run, then more steps."""
    conv, cont = run_block(ws, "from-hf", steps=STEPS + 4)
    assert (ws.root / "runs" / "tiny-moe-xhc-back" / "preset.yaml").is_file()
    assert f"done: step {STEPS + 4}/{STEPS + 4}" in cont


def test_upcycle(ws):
    """docs/conversion.md "Upcycling": vanilla -> to-hf -> from-hf --to-variant xhc -> train on."""
    outs = run_block(ws, "upcycle", steps=[STEPS, STEPS + 4])
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


def _check_body():
    from tests.journey import GENERATE_CHECK

    return GENERATE_CHECK.split("def main(")[0]


def test_finetune_and_diagnose(ws):
    """README "Finetuning": the CPU smoke run on a chat file written here, and the diagnostics tool."""
    rows = []
    for i in range(200):
        rows.append({"messages": [{"role": "user", "content": f"what is {i} plus {i % 7}?"},
                                  {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."}],
                     "source": ["math", "chat", "code"][i % 3]})
    (ws.root / "my_chats.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ft, diag = run_block(ws, "finetune")
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


def test_sweep_print_run_fit(ws):
    """docs/sweeps.md: print the tiny sweep, run the smoke sweep's arms, fit them."""
    printed, ran, fit = run_block(ws, "sweep")
    assert "18 arms" in printed
    assert "4/4 arms finished, 0 failed" in ran
    fj = json.loads((ws.root / "runs" / "sweeps" / "smoke-cpu" / "summary" / "fit.json").read_text())
    assert fj and "mhc-n4" in json.dumps(fj)


def test_zoo_and_accounting(ws):
    """README "Model zoo": the preset list and the accounting tables."""
    listed, acc = run_block(ws, "zoo")
    for v in ("tiny-moe:xhc", "tiny-moe:mhc-lite", "moe-18b:xhc-flash4"):
        assert v in listed
    assert "1256" in acc.replace(",", "")  # per-layer xHC parameters per C, docs/math.md §5
