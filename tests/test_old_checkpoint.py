"""Old artifacts keep loading: a checkpoint written by the code before the renovations (commit
``e30daa9``, pinned: before the Trainer split, the config base and the moves of the conversion
code) resumes under today's code bit-identically, and a Hugging Face folder that code exported
still loads: in ``transformers`` with the same logits as today's export, and back into a
checkpoint with today's ``from-hf``.  That checkpoint has no run record (training.run.run_record):
today's to-hf and inspect read it through the earlier lookup and say so in one note.

The old code is extracted from the git history (``git archive``) and run in a subprocess with
``PYTHONPATH`` on the extracted tree: it trains to step 3 and stops (``run.exit_at_step``), writing
its checkpoint.  That run directory is copied; the old code continues the original to step 6 (the
reference), today's code continues the copy.  Steps 4..6 must log the same loss, gradient norm and
learning rate to the last bit, and the same validation losses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.train, pytest.mark.megatron]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_COMMIT = "e30daa9"  # main before the Trainer split (issue 24): training/pretrain.py holds everything
BASE = ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=64", "batch.seq_length=16",
        "batch.micro_batch_size=2", "batch.global_batch_size=4", "schedule.warmup_steps=2",
        "logging.tensorboard=false", "logging.plot=false", "logging.interval=1", "logging.hc_health_interval=2",
        "run.train_steps=6", "run.eval_interval=3", "run.eval_iters=1", "checkpoint.interval=0",
        "model.backbone.hidden_dropout=0.1", "model.backbone.attention_dropout=0.1"]  # dropout: the RNG state matters


def _extract_old_tree(dest: str, commit: str = OLD_COMMIT) -> str:
    """The pinned commit's files under ``dest``; a clear failure where the git history is missing."""
    def git(*args, **kw):
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, **kw)

    try:
        found = git("cat-file", "-e", f"{commit}^{{commit}}")
    except FileNotFoundError:
        pytest.fail(f"git is not installed: this test extracts commit {commit} from the history (install git)")
    if found.returncode != 0:
        pytest.fail(f"commit {commit} is not in the git history of {REPO}: run the tests from a full git clone "
                    f"(git fetch --unshallow)")
    archive = git("archive", "--format=tar", commit)
    assert archive.returncode == 0, archive.stderr.decode()
    os.makedirs(dest)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def _pretrain(code_root: str, run_dir: str, *extra: str) -> None:
    env = dict(os.environ, PYTHONPATH=code_root, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    probe = subprocess.run([sys.executable, "-c", "import training.pretrain as p; print(p.__file__)"],
                           cwd=code_root, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == os.path.join(code_root, "training", "pretrain.py"), probe.stdout + probe.stderr
    r = subprocess.run([sys.executable, "-m", "training.pretrain", *BASE, f"run.dir={run_dir}", *extra],
                       cwd=code_root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _after_resume(run_dir: str):
    """(train records by step, eval losses by step) written after the last ``resume`` record."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    start = max(i for i, r in enumerate(records) if r["kind"] == "resume")
    train = {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in records[start:] if r["kind"] == "train"}
    evals = {r["step"]: r["loss"] for r in records[start:] if r["kind"] == "eval"}
    return records[start], train, evals


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("old")
    old = _extract_old_tree(str(root / "old"))
    assert not os.path.exists(os.path.join(old, "training", "step_runner.py"))  # really the old layout
    ref, new = str(root / "ref"), str(root / "new")
    _pretrain(old, ref, "run.exit_at_step=3")  # old code: steps 1..3, checkpoint step_00000003
    assert [n for n in sorted(os.listdir(os.path.join(ref, "checkpoints"))) if "step" in n] == ["step_00000003"]
    shutil.copytree(ref, new)
    _pretrain(old, ref)  # the reference: the old code continues its own run to step 6
    _pretrain(REPO, new)  # today's code continues the copy
    return root, old, ref, new


def test_checkpoint_of_the_pre_split_code_resumes_bit_identically(runs):
    _, _, ref, new = runs
    resume_ref, train_ref, eval_ref = _after_resume(ref)
    resume_new, train_new, eval_new = _after_resume(new)
    assert resume_new["step"] == resume_ref["step"] == 3
    assert resume_new["consumed_samples"] == resume_ref["consumed_samples"] == 12
    assert sorted(train_ref) == sorted(train_new) == [4, 5, 6]
    for step in (4, 5, 6):  # exact float equality (JSON round-trips a float exactly)
        assert train_new[step] == train_ref[step], f"step {step}: {train_new[step]} != {train_ref[step]}"
    assert eval_ref and eval_new == eval_ref


def _convert(code_root: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=code_root, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", *args, "--quiet"], cwd=code_root, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_checkpoint_of_the_old_code_inspects_with_a_note(runs):
    root, _, ref, _ = runs
    checkpoint = os.path.join(ref, "checkpoints", "step_00000006")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "tools.inspect", checkpoint, "--output", str(root / "inspected"),
                        "--no-figures", "--tokens", "16"], cwd=str(root), env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (f"note: {checkpoint} has no run record (made before run records): validation data none by its "
            f"config.yaml (mock data)") in r.stderr
    assert os.path.isfile(root / "inspected" / "inspect.json")


def test_hugging_face_folder_of_the_old_code_still_loads(runs):
    import torch
    from transformers import AutoModelForCausalLM

    root, old, ref, _ = runs
    checkpoint = os.path.join(ref, "checkpoints", "step_00000006")
    old_hf, new_hf, back = str(root / "old-hf"), str(root / "new-hf"), str(root / "back")
    _convert(old, "to-hf", "--checkpoint", checkpoint, "--output", old_hf, "--dtype", "fp32")
    out = _convert(REPO, "to-hf", "--checkpoint", checkpoint, "--output", new_hf, "--dtype", "fp32")
    # made before run records: today's lookup, and one note saying so (training.run.run_record)
    assert f"note: {checkpoint} has no run record (made before run records): tokenizer none by its config.yaml" in out
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (old_hf, new_hf):
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert logits[0].shape[:2] == (2, 16) and logits[0].shape[2] >= 64  # the padded vocabulary
    assert torch.equal(logits[0], logits[1])
    # today's from-hf reads the old folder back into a checkpoint holding the same weights
    _convert(REPO, "from-hf", "--hf", old_hf, "--output", back)
    from safetensors.torch import load_file

    exported = {}
    for name in sorted(os.listdir(old_hf)):
        if name.endswith(".safetensors"):
            exported.update(load_file(os.path.join(old_hf, name)))
    assert exported and os.path.isdir(os.path.join(back, "checkpoints"))
    _convert(REPO, "to-hf", "--run", back, "--output", str(root / "again"), "--dtype", "fp32")
    again = {}
    for name in sorted(os.listdir(root / "again")):
        if name.endswith(".safetensors"):
            again.update(load_file(os.path.join(root / "again", name)))
    assert again.keys() == exported.keys()
    assert all(torch.equal(again[k], exported[k]) for k in exported)
