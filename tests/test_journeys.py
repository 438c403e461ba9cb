"""The documented user paths, run as a user types them (``tests/journey.py`` explains the rules).

Each test runs the marked fenced blocks of the README and docs/ in fresh subprocesses from an empty
working directory with a clean environment, then checks what the user would look at: the exit
status, the printed summary, the files written.  The journeys that build on one another (pre-train
-> resume, -> to-hf -> generate / evaluate -> from-hf) share one workspace, in file order.
"""

from __future__ import annotations

import json
import os
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


def run_block(ws: Workspace, name: str, steps=STEPS, later: Workspace = None):
    """Run every command of a bash block in order; ``steps``: an int, or one per pre-training line;
    ``later``: where the commands after the first one start (another working directory)."""
    outs, k = [], 0
    for i, argv in enumerate(block(name).commands()):
        n = steps
        if is_pretrain(argv) and isinstance(steps, (list, tuple)):
            n, k = steps[k], k + 1
        outs.append((later if later is not None and i > 0 else ws).run(argv, shorten(argv, n)).stdout)
    return outs


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("journey"))


@pytest.fixture(scope="module")
def later(ws, tmp_path_factory):
    """Where the commands after training start: another directory, which reaches ``runs/`` and
    ``hf/`` through links but not the ``data/`` training built (tools find it through the run record)."""
    return ws.elsewhere(tmp_path_factory.mktemp("journey-later"))


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
SAMPLE = "def main(argv=None):\n    return sorted(set(argv or []))  # héllo"


def _same_ids_as_training(hf: Path, tokenizer_model: Path) -> None:
    """The export's tokenizer (as documented: no model code) encodes as training's SentencePiece model."""
    from transformers import AutoTokenizer

    from training.data import Tokenizer

    exported = AutoTokenizer.from_pretrained(str(hf), trust_remote_code=False)
    ids = Tokenizer.from_file(str(tokenizer_model)).tokenize(SAMPLE)
    assert len(ids) > 5 and exported(SAMPLE, add_special_tokens=False)["input_ids"] == ids


def test_default_run_to_hf_and_evaluate(ws, later):
    """docs/conversion.md "The default run": pre-train (the default, shortened) in one directory; to-hf
    and tools.evaluate from another one, where nothing next to the run holds the data it trained on."""
    (pre_argv, conv_argv, ev_argv) = block("default-run").commands()
    pre = ws.run(pre_argv, shorten(pre_argv, STEPS)).stdout
    conv = later.run(conv_argv, shorten(conv_argv)).stdout
    ev = later.run(ev_argv, shorten(ev_argv)).stdout
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
    assert "note" not in conv and "no run record" not in ev  # found through the record, not a lookup
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "run_record.json"} <= {
        p.name for p in hf.iterdir()}
    _same_ids_as_training(hf, ws.root / "data" / "default" / "tokenizer.model")


def test_a_moved_run_and_missing_or_changed_files(ws, later, tmp_path):
    """The run directory moved (mv) elsewhere: to-hf still finds the tokenizer through the record.
    The tokenizer deleted, the corpus changed: one line naming the recorded path, exit status 2."""
    import shutil

    (run,) = (ws.root / "runs").glob("tiny-moe-xhc-*")
    moved = tmp_path / "moved" / "run"
    moved.parent.mkdir()
    shutil.move(str(run), str(moved))
    later.run(["python", "-m", "tools.convert_checkpoint", "to-hf", "--run", str(moved), "--output",
               str(tmp_path / "hf"), "--quiet"])
    data = ws.root / "data" / "default"
    _same_ids_as_training(tmp_path / "hf", data / "tokenizer.model")
    hidden = tmp_path / "tokenizer.model.away"
    os.rename(data / "tokenizer.model", hidden)
    try:
        out = later.run(["python", "-m", "tools.convert_checkpoint", "to-hf", "--run", str(moved), "--output",
                         str(tmp_path / "hf2"), "--quiet"], check=False)
    finally:
        os.rename(hidden, data / "tokenizer.model")
    err = [ln for ln in out.stdout.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(err) == 1 and "Traceback" not in out.stdout, out.stdout[-3000:]
    assert f"tokenizer {data / 'tokenizer.model'} is missing; pass --tokenizer PATH" in err[0], err
    corpus = data / "corpus.jsonl"
    saved = corpus.read_bytes()
    try:
        corpus.write_bytes(saved + b'{"text": "one more document"}\n')
        out = later.run(["python", "-m", "tools.evaluate", str(tmp_path / "hf"), "--limit", "1"], check=False)
    finally:
        corpus.write_bytes(saved)
    err = [ln for ln in out.stdout.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(err) == 1, out.stdout[-3000:]
    assert f"corpus {corpus} has changed since training" in err[0] and "--corpus FILE" in err[0], err


def test_generate_snippet(later):
    """The Python snippet of docs/conversion.md, as written, from another directory than training's,
    with a terminal as standard input: the tokenizer must load without asking whether to run the
    model's code; then the cache check."""
    b = block("generate")
    assert b.lang == "python"
    out = later.python(b.body, tty=True).stdout
    assert out.strip(), "generate printed nothing"
    assert "[y/N]" not in out and "custom code" not in out, out[-2000:]
    res = generate_check(later, [later.root / "hf" / "tiny-moe-xhc"])
    for r in res.values():
        assert r["generate"] == r["argmax_loop"]


def test_from_hf_and_continue(ws):
    """docs/conversion.md "Back to Megatron": from-hf of the default run, then more steps."""
    conv, cont = run_block(ws, "from-hf", steps=STEPS + 4)
    assert (ws.root / "runs" / "tiny-moe-xhc-back" / "preset.yaml").is_file()
    assert f"done: step {STEPS + 4}/{STEPS + 4}" in cont


