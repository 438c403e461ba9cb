"""One real training run shared by the conversion and inspection tests (the ``trained_xhc`` fixture).

``tiny-moe:xhc`` pre-trained with ``python -m training.pretrain`` (a fresh interpreter, as a user
types it) for :data:`STEPS` AdamW steps on mock data: checkpoints at 100, 200 and 201, an evaluation
every 100 steps, HC health logged every step.  test_convert_hf exports step 200, converts it back
and checks that one more training step gives the run's own step-201 loss; test_inspect reads the
run, its last checkpoint and an export of it, and draws its curves and per-checkpoint figures.

Built once per test session, also under pytest-xdist: the first worker to ask trains it under a
file lock in the session's shared temporary folder, the others wait and read it.  Tests only read
it (they write into their own ``tmp_path``).
"""
from __future__ import annotations

import os
import subprocess
import sys

PRESET = "tiny-moe:xhc"
STEPS = 201            # checkpoints at CHECKPOINTS; step 201 is the "next step" after the export at 200
CHECKPOINTS = (100, 200, 201)
VOCAB, SEQ = 512, 32
_DONE = "trained-complete"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pretrain_args(run, preset: str = PRESET, steps: int = STEPS, interval: int = 100) -> list:
    """The command-line overrides of the shared run (also used by tests that train other variants)."""
    return [f"model.preset={preset}", "data.mock=true", f"run.train_steps={steps}", "batch.micro_batch_size=2",
            "batch.global_batch_size=2", f"batch.seq_length={SEQ}", f"run.eval_interval={interval}",
            "run.eval_iters=1", "logging.tensorboard=false", "logging.plot=false",
            f"checkpoint.interval={interval}", "checkpoint.keep_last=3", f"run.dir={run}", "run.num_threads=1",
            f"tokenizer.vocab_size={VOCAB}", "logging.interval=1"]


def checkpoint(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", f"step_{step:08d}")


def build(run: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "training.pretrain", *pretrain_args(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(os.path.join(run, "stdout.log"), "w", encoding="utf-8") as f:  # the start-up plan (test_plan)
        f.write(proc.stdout)
    found = sorted(int(d[5:]) for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
    assert found == list(CHECKPOINTS), found


def shared(tmp_path_factory) -> str:
    """The session's trained run directory: trained by the first (xdist) worker that asks."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by every worker of this session
    root = os.path.join(str(base), "trained-xhc")
    with FileLock(root + ".lock"):
        if not os.path.exists(os.path.join(root, _DONE)):
            build(os.path.join(root, "run"))
            open(os.path.join(root, _DONE), "w").close()
    return os.path.join(root, "run")
