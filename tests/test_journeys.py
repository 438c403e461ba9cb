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


def _check_body():
    from tests.journey import GENERATE_CHECK

    return GENERATE_CHECK.split("def main(")[0]


def test_marked_blocks_exist_and_parse():
    expected = {"default-run", "generate", "resume", "from-hf", "upcycle", "peft", "finetune", "sweep", "zoo", "mtp"}
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


def test_from_hf_and_continue(ws):
    """docs/conversion.md "Back to Megatron": from-hf of the default run, then more steps."""
    conv, cont = run_block(ws, "from-hf", steps=STEPS + 4)
    assert (ws.root / "runs" / "tiny-moe-xhc-back" / "preset.yaml").is_file()
    assert f"done: step {STEPS + 4}/{STEPS + 4}" in cont


