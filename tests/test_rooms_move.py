"""The rooms move (issue 51) changed where code lives, not what it computes.

The tree of commit ``MOVE_BASE`` (main just before the move: flat ``training/`` and ``tools/``) is
extracted from the git history (``git archive``) and run beside today's, both as the Quickstart's
default run (``python -m training.pretrain``, its embedded config; one thread each, the same for both) for its
first 20 steps with an evaluation every 10 (steps 0, 10 and 20), stopping at step 20 with a
checkpoint (``run.exit_at_step``; the schedule stays the 300-step run's).  Then:

- the two runs log the same loss, gradient norm and learning rate at every step and the same
  validation losses, to the last bit;
- the two checkpoints hold the same bytes, file by file (torch's ``.metadata`` and the manifest name
  the save itself: its directory, a random id, the time; their other contents are equal);
- today's code resumes the old code's checkpoint (steps 21..22) exactly as the old code continues its
  own run, and converts it to Hugging Face, with the same tensors as the conversion of its own
  checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from tests.test_old_checkpoint import REPO, _extract_old_tree

pytestmark = [pytest.mark.train, pytest.mark.megatron]

MOVE_BASE = "3474d54"  # main before the rooms move (issue 51)
STEPS = ["run.exit_at_step=20", "run.eval_interval=10", "logging.plot=false", "logging.tensorboard=false"]


def _run(code_root: str, cwd: str, *args: str, module: str = "training.pretrain") -> str:
    env = dict(os.environ, PYTHONPATH=code_root, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def _records(run_dir: str):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in records if r["kind"] == "train"}
    evals = {r["step"]: r["loss"] for r in records if r["kind"] == "eval"}
    return records, train, evals


def _files(checkpoint: str):
    out = {}
    for d, _, names in os.walk(checkpoint):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, checkpoint)] = f.read()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rooms-move")
    old = _extract_old_tree(str(root / "old"), MOVE_BASE)
    assert os.path.isfile(os.path.join(old, "training", "optim_megatron.py"))  # really the flat layout
    data = f"data.default_dir={root / 'data'}"  # built once, by the first run, used by both
    _run(old, str(root), *STEPS, data, f"run.dir={root / 'old-run'}")
    _run(REPO, str(root), *STEPS, data, f"run.dir={root / 'new-run'}")
    return root, old, data


def test_the_default_runs_first_20_steps_are_bit_identical(runs):
    root, _, _ = runs
    _, train_old, eval_old = _records(str(root / "old-run"))
    _, train_new, eval_new = _records(str(root / "new-run"))
    assert sorted(train_old) == list(range(1, 21)) and sorted(eval_old) == [0, 10, 20]
    assert train_new == train_old  # exact float equality (JSON round-trips a float exactly)
    assert eval_new == eval_old


def _within(old, new, where="manifest"):
    """Every entry of ``old`` is in ``new`` with the same value (dicts recursively): options added to
    the config since (later issues) may appear in ``new`` only."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k, v in old.items():
            assert k in new, f"{where}.{k} is gone"
            _within(v, new[k], f"{where}.{k}")
    else:
        assert old == new, f"{where}: {old!r} != {new!r}"


def test_the_checkpoints_hold_the_same_bytes(runs):
    """Every data file byte for byte.  Two files name the save itself: torch's ``.metadata`` pickles
    the save's directory and a random save id (``StorageMeta``) beside the index, which must be
    equal; the manifest holds the save's time and the files' hashes (equal but for ``.metadata``)."""
    import pickle

    root, _, _ = runs
    old = _files(str(root / "old-run" / "checkpoints" / "step_00000020"))
    new = _files(str(root / "new-run" / "checkpoints" / "step_00000020"))
    assert sorted(old) == sorted(new) and {"common.pt", "metadata.json", ".metadata", "manifest.json"} <= set(old)
    for name in old:
        if name == ".metadata":
            a, b = pickle.loads(old[name]), pickle.loads(new[name])
            assert a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data
            assert a.planner_data == b.planner_data
        elif name == "manifest.json":
            a, b = json.loads(old[name])["body"], json.loads(new[name])["body"]
            for body in (a, b):
                body.pop("saved_at")
                body["files"].pop(".metadata")
            _within(a, b)
        else:
            assert hashlib.sha256(old[name]).digest() == hashlib.sha256(new[name]).digest(), name
    # No class of the product is pickled in a saved state (torch's and the standard library's only), so
    # moving a module cannot break a load: the pickles name no module of training, tools, models or xhc.
    import io
    import pickletools
    import zipfile

    pickles = {".metadata": old[".metadata"]}
    with zipfile.ZipFile(io.BytesIO(old["common.pt"])) as z:
        pickles.update({n: z.read(n) for n in z.namelist() if n.endswith(".pkl")})
    assert len(pickles) == 2
    seen = []
    for name, data in pickles.items():
        text = io.StringIO()
        pickletools.dis(data, out=text)  # a class path is a GLOBAL, or two strings before a STACK_GLOBAL
        seen += [(name, line) for line in text.getvalue().splitlines() if "GLOBAL" in line or "UNICODE" in line]
    assert any("torch.distributed.checkpoint.metadata" in line for _, line in seen)  # the scan sees class paths
    assert not [x for x in seen if re.search(r"'((training|tools|models)(\.[\w.]*)?|xhc\.[\w.]+)'", x[1])], seen


def test_todays_code_resumes_and_converts_the_old_checkpoint(runs):
    root, old, data = runs
    import shutil

    shutil.copytree(root / "old-run", root / "resumed")
    more = ["run.exit_at_step=22", "run.eval_interval=10", "logging.plot=false", "logging.tensorboard=false", data]
    _run(REPO, str(root), *more, f"run.dir={root / 'resumed'}")  # today's code resumes the old checkpoint
    _run(old, str(root), *more, f"run.dir={root / 'old-run'}")  # the reference: the old code continues
    records, train, _ = _records(str(root / "resumed"))
    _, train_ref, _ = _records(str(root / "old-run"))
    resume = [r for r in records if r["kind"] == "resume"]
    assert resume and resume[-1]["step"] == 20
    assert {s: train[s] for s in (21, 22)} == {s: train_ref[s] for s in (21, 22)}
    from safetensors.torch import load_file

    tensors = []
    for run in ("old-run", "new-run"):
        hf = root / f"hf-{run}"
        _run(REPO, str(root), "to-hf", "--checkpoint", str(root / run / "checkpoints" / "step_00000020"),
             "--output", str(hf), "--dtype", "fp32", "--quiet", module="tools.convert_checkpoint")
        got = {}
        for name in sorted(os.listdir(hf)):
            if name.endswith(".safetensors"):
                got.update(load_file(str(hf / name)))
        tensors.append(got)
    import torch

    assert tensors[0] and tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
