"""xhc-pretrain under the signals clusters send, kill -9, non-finite parameters and a shared run dir.

Every interrupted run is resumed and compared with an uninterrupted one, step by step, bitwise
(losses, gradient norms, learning rates, validation losses): the resumed run must be the same
computation.  Runs are the tiny xHC-MoE preset on Megatron's mock data (dropout on, so the RNG
restore matters), one CPU thread per process.

- single process, started in its own session: SIGTERM to the whole process group in the middle of
  a run and while a checkpoint is being written; ``kill -9`` mid-step and mid-save (then the group
  must empty: no writer process left behind);
- ``torchrun --nproc_per_node 2`` (about 40 s): SIGTERM to the torchrun parent, ``kill -9`` of it;
- non-finite parameters (injected): nothing is saved, the good checkpoints survive, exit 3 with a
  message; or a rollback with ``run.on_nonfinite=rollback``;
- the run-directory lock; the manifest compatibility check; the fallback from a corrupt latest
  checkpoint; the resume records in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.dist.launch import free_port
from training.checkpoint import list_checkpoints, verify_checkpoint
from training.run import dedupe_resumed, read_jsonl, read_metrics
from training.pretrain import Trainer, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=64", "batch.seq_length=16",
        "batch.micro_batch_size=2", "batch.global_batch_size=4", "schedule.warmup_steps=2", "run.num_threads=1",
        "logging.tensorboard=false", "logging.plot=false", "logging.interval=1", "logging.hc_health_interval=0",
        "model.backbone.hidden_dropout=0.1", "model.backbone.attention_dropout=0.1"]
STEPS = ["run.train_steps=12", "run.eval_interval=6", "run.eval_iters=1", "checkpoint.interval=4"]
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _launch(run_dir, extra=(), nproc=1):
    args = [*BASE, *STEPS, f"run.dir={run_dir}", *extra]
    if nproc == 1:
        cmd = [sys.executable, "-m", "training.pretrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", "tests/dist/pretrain_main.py", *args]
    log = open(os.path.join(os.path.dirname(run_dir), os.path.basename(run_dir) + ".log"), "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log.name
    return proc


def _output(proc) -> str:
    with open(proc.log_path) as f:
        return f.read()


def _wait_until(predicate, proc, timeout=600.0, poll=0.002):  # ends as soon as it holds: room for a loaded machine
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) too early:\n{_output(proc)[-3000:]}")
        time.sleep(poll)
    proc.kill()
    raise AssertionError(f"timed out waiting:\n{_output(proc)[-3000:]}")


def _finish(proc, timeout=600.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the run did not exit:\n{_output(proc)[-3000:]}") from None


def _trained_to(run_dir, step):
    path = os.path.join(run_dir, "metrics.jsonl")

    def check():
        if not os.path.exists(path):
            return False
        with open(path) as f:
            return any(f'"kind": "train", "step": {step},' in line for line in f)
    return check


def _group_gone(pgid, timeout=30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _curves(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    train = {r["step"]: (r["loss"], r["grad_norm"], r["lr"], r["consumed_samples"])
             for r in read_metrics(path, "train")}
    evals = {r["step"]: r["loss"] for r in read_metrics(path, "eval")}
    return train, evals


def _assert_same_run(reference, run_dir):
    ref_train, ref_eval = reference
    train, evals = _curves(run_dir)
    assert sorted(train) == list(range(1, 13))
    for s in sorted(ref_train):
        assert train[s] == ref_train[s], (s, train[s], ref_train[s])  # bitwise: JSON floats round-trip
    assert evals == ref_eval


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted single-process run (in this process)."""
    run = str(tmp_path_factory.mktemp("ref") / "run")
    assert main([*BASE, *STEPS, f"run.dir={run}"]) == 0
    train, evals = _curves(run)
    assert sorted(train) == list(range(1, 13)) and sorted(evals) == [0, 6, 12]
    return train, evals


# ------------------------------------------------------------------------------------------------
# SIGTERM to the process group, kill -9: single process
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_group_signal_mid_run_saves_once_exits_0_and_resumes_exactly(reference, tmp_path, sig):
    run = str(tmp_path / "run")
    proc = _launch(run)
    _wait_until(_trained_to(run, 6), proc)
    os.killpg(proc.pid, getattr(signal, sig))  # SIGTERM: what SLURM and torchrun's shutdown deliver; SIGINT: Ctrl-C
    assert _finish(proc) == 0, _output(proc)[-3000:]
    out = _output(proc)
    assert "Traceback" not in out and "stopping at step" in out
    with open(os.path.join(run, "status.json")) as f:
        status = json.load(f)
    stopped = status["step"]
    assert sig in status["stopped_early"] and 6 <= stopped < 12
    step, path = list_checkpoints(os.path.join(run, "checkpoints"))[-1]
    body = verify_checkpoint(path)
    assert step == stopped == body["step"]
    assert max(_curves(run)[0]) == stopped  # it stopped at the step it saved
    assert _group_gone(proc.pid, timeout=5)
    resumed = _launch(run)
    assert _finish(resumed) == 0, _output(resumed)[-3000:]
    assert f"resumed from {path}" in _output(resumed)
    _assert_same_run(reference, run)


@pytest.mark.slow
def test_group_sigterm_during_a_save_finishes_that_save_and_exits_0(reference, tmp_path):
    run = str(tmp_path / "run")
    proc = _launch(run)
    tmp8 = os.path.join(run, "checkpoints", ".step_00000008.tmp")
    _wait_until(lambda: os.path.isdir(tmp8), proc)
    os.killpg(proc.pid, signal.SIGTERM)  # the trainer and the save's writer processes
    assert _finish(proc) == 0, _output(proc)[-3000:]
    out = _output(proc)
    assert "Traceback" not in out and "BrokenPipe" not in out
    found = list_checkpoints(os.path.join(run, "checkpoints"))
    assert [s for s, _ in found] == [4, 8]
    body = verify_checkpoint(found[-1][1])
    assert body["reason"] == "interval"  # the save under way completed, and no second save was needed
    assert max(_curves(run)[0]) == 8 and not os.path.exists(tmp8)
    assert _group_gone(proc.pid, timeout=5)
    resumed = _launch(run)
    assert _finish(resumed) == 0, _output(resumed)[-3000:]
    _assert_same_run(reference, run)


@pytest.mark.parametrize("where", ["mid-step", "mid-save"])
@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical(reference, tmp_path, where):
    run = str(tmp_path / "run")
    proc = _launch(run)
    if where == "mid-step":
        _wait_until(_trained_to(run, 6), proc)
    else:
        _wait_until(lambda: os.path.isdir(os.path.join(run, "checkpoints", ".step_00000008.tmp")), proc)
    os.kill(proc.pid, signal.SIGKILL)  # the trainer only: its helpers must not outlive it
    proc.wait(timeout=30)
    assert _group_gone(proc.pid), "a process of the killed run is still alive"
    good = [s for s, p in list_checkpoints(os.path.join(run, "checkpoints"))]
    assert good and good[-1] in (4, 8)
    for s, p in list_checkpoints(os.path.join(run, "checkpoints")):
        verify_checkpoint(p)  # only finished checkpoints are visible
    # the lock of the killed run is stale: the rerun takes it over
    resumed = _launch(run)
    assert _finish(resumed) == 0, _output(resumed)[-3000:]
    out = _output(resumed)
    assert "stale lock" in out and f"resumed from {os.path.join(run, 'checkpoints', f'step_{good[-1]:08d}')}" in out
    _assert_same_run(reference, run)
    resumes = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "resume"]
    assert [r["step"] for r in resumes] == [good[-1]]


# ------------------------------------------------------------------------------------------------
# torchrun --nproc_per_node 2
# ------------------------------------------------------------------------------------------------
def _rank_exits(out):
    import re

    return sorted([r, c] for r, c in re.findall(r"rank (\d+) exit (-?\d+)", out))


@pytest.mark.slow
def test_torchrun_sigterm_to_the_launcher_then_exact_resume(tmp_path):
    """SIGTERM to the torchrun parent: both ranks stop at the same step, one verified checkpoint,
    exit 0; the resumed 2-rank run equals an uninterrupted one.  (Heavy: three 2-rank runs.)"""
    ref = str(tmp_path / "ref")
    p = _launch(ref, nproc=2)
    assert _finish(p, 240) == 0, _output(p)[-3000:]
    reference = _curves(ref)

    run = str(tmp_path / "run")
    p = _launch(run, nproc=2)
    _wait_until(_trained_to(run, 5), p, timeout=240)
    p.send_signal(signal.SIGTERM)  # the launcher only; it forwards SIGTERM to the workers
    _finish(p, 120)  # torchrun itself exits non-zero after a signal (its own SignalException)
    out = _output(p)
    assert _rank_exits(out) == [["0", "0"], ["1", "0"]], out[-3000:]
    assert "BrokenPipe" not in out and "[rank0]" not in out and "[rank1]" not in out
    step, path = list_checkpoints(os.path.join(run, "checkpoints"))[-1]
    body = verify_checkpoint(path)
    assert body["world_size"] == 2 and step == max(_curves(run)[0]) >= 5
    p = _launch(run, nproc=2)
    assert _finish(p, 240) == 0, _output(p)[-3000:]
    _assert_same_run(reference, run)


@pytest.mark.slow
def test_torchrun_workers_save_and_exit_when_the_launcher_is_killed(tmp_path):
    """``kill -9`` of torchrun: the workers (armed with PR_SET_PDEATHSIG) save and exit 0 instead of
    training on as orphans; with ``checkpoint.reshard=never`` their 2-rank checkpoint on 1 rank is
    refused in one line (``auto`` reshards it: tests/test_elastic_resume.py)."""
    orphan = str(tmp_path / "orphan")
    p = _launch(orphan, nproc=2, extra=["run.train_steps=100000"])
    _wait_until(_trained_to(orphan, 3), p, timeout=240)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    deadline = time.time() + 90
    while time.time() < deadline and len(_rank_exits(_output(p))) < 2:
        time.sleep(0.2)
    assert _rank_exits(_output(p)) == [["0", "0"], ["1", "0"]], _output(p)[-3000:]
    with open(os.path.join(orphan, "status.json")) as f:
        status = json.load(f)
    assert "SIGTERM" in status["stopped_early"]
    step, path = list_checkpoints(os.path.join(orphan, "checkpoints"))[-1]
    assert step == status["step"] and verify_checkpoint(path)["world_size"] == 2

    r = subprocess.run([sys.executable, "-m", "training.pretrain", *BASE, *STEPS, f"run.dir={tmp_path / 'one'}",
                        f"checkpoint.load={path}", "checkpoint.reshard=never"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert "\n" not in err and "world size 2" in err and "world size 1" in err and "checkpoint.reshard=never" in err


# ------------------------------------------------------------------------------------------------
# non-finite parameters: never saved; abort or roll back
# ------------------------------------------------------------------------------------------------
def _poison_after(monkeypatch, step, times=1):
    """After the optimizer update of ``step``, set the first weight (the embedding) to NaN; the loss of that
    step is finite, the next one is NaN."""
    original = Trainer.train_step
    left = [times]

    def poisoned(self, iterators):
        rec = original(self, iterators)
        if self.step == step and left[0] > 0:
            left[0] -= 1
            import torch

            with torch.no_grad():
                next(iter(self._unwrap(self.chunks[0]).parameters())).fill_(float("nan"))
        return rec

    monkeypatch.setattr(Trainer, "train_step", poisoned)


def _tree(root):
    out = {}
    for base, _dirs, files in os.walk(root):
        for n in files:
            p = os.path.join(base, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hash(f.read())
    return out


@pytest.mark.parametrize("poison_step, caught_at", [(5, "loss of step 6"), (8, "checkpoint at step 8 not saved")])
@pytest.mark.slow
def test_nonfinite_parameters_are_never_saved(tmp_path, monkeypatch, capsys, poison_step, caught_at):
    run = str(tmp_path / "run")
    ckdir = os.path.join(run, "checkpoints")
    _poison_after(monkeypatch, poison_step)
    # poisoned after step 5: step 6's loss is NaN -> abort at once (not 10 skipped steps later);
    # poisoned after step 8: the loss of step 8 was finite, the save at step 8 catches it
    code = main([*BASE, *STEPS, "checkpoint.interval=4", "run.eval_interval=0", f"run.dir={run}"])
    assert code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    msg = err[0]
    assert caught_at in msg and "parameters are non-finite" in msg and "nothing was saved" in msg
    assert os.path.join(ckdir, "step_00000004") in msg and "run.on_nonfinite=rollback" in msg
    assert [s for s, _ in list_checkpoints(ckdir)] == [4]
    verify_checkpoint(os.path.join(ckdir, "step_00000004"))
    trained = _curves(run)[0]
    assert max(trained) == poison_step and all(math.isfinite(trained[s][0]) for s in trained)


@pytest.mark.slow
def test_good_checkpoints_survive_a_later_nonfinite_run(tmp_path, monkeypatch, capsys):
    """A good run, then a resumed run that breaks: the good checkpoints are byte-for-byte unchanged."""
    run = str(tmp_path / "run")
    ckdir = os.path.join(run, "checkpoints")
    assert main([*BASE, "run.train_steps=4", "run.eval_iters=0", "checkpoint.interval=2", f"run.dir={run}"]) == 0
    before = _tree(ckdir)
    _poison_after(monkeypatch, 5)
    assert main([*BASE, "run.train_steps=12", "run.eval_iters=0", "checkpoint.interval=2", f"run.dir={run}"]) == 3
    assert "parameters are non-finite" in capsys.readouterr().err
    after = _tree(ckdir)
    assert {k: v for k, v in after.items() if k.startswith("step_00000004")} == \
        {k: v for k, v in before.items() if k.startswith("step_00000004")}
    assert [s for s, _ in list_checkpoints(ckdir)] == [2, 4]


@pytest.mark.slow
def test_nonfinite_validation_is_a_nonzero_exit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Trainer, "evaluate", lambda self: float("nan"))
    run = str(tmp_path / "run")
    assert main([*BASE, "run.train_steps=5", "run.eval_interval=0", "run.eval_iters=1", f"run.dir={run}"]) == 3
    msg = capsys.readouterr().err.strip()
    assert "\n" not in msg and "validation loss at step 5 is nan" in msg and "parameters are finite" in msg
    assert list_checkpoints(os.path.join(run, "checkpoints")) == []  # nothing saved after it


@pytest.mark.slow
def test_rollback_reloads_the_last_good_checkpoint_and_skips_the_window(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    _poison_after(monkeypatch, 6)  # caught by the loss of step 7; the last good checkpoint is step 4
    assert main([*BASE, *STEPS, "run.eval_interval=0", "run.on_nonfinite=rollback", f"run.dir={run}"]) == 0
    records = read_jsonl(os.path.join(run, "metrics.jsonl"))
    back = [r for r in records if r["kind"] == "resume"]
    assert len(back) == 1 and back[0]["step"] == 4 and back[0]["rollback"] is True
    assert back[0]["consumed_samples"] == 7 * 4  # steps 5..7's data are skipped
    train = {r["step"]: r for r in read_metrics(os.path.join(run, "metrics.jsonl"), "train")}
    assert sorted(train) == list(range(1, 13)) and all(math.isfinite(r["loss"]) for r in train.values())
    assert train[5]["consumed_samples"] == 8 * 4 and train[12]["consumed_samples"] == 15 * 4
    # the schedule continues from the checkpoint's step: step 5 again gets step 5's learning rate
    first5 = next(r for r in records if r["kind"] == "train" and r["step"] == 5)
    assert train[5]["lr"] == first5["lr"]
    step, path = list_checkpoints(os.path.join(run, "checkpoints"))[-1]
    assert step == 12 and verify_checkpoint(path)


# ------------------------------------------------------------------------------------------------
# lock, compatibility, corrupt latest
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path, capsys):
    import socket

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "since": "x"}))
        before = _tree(str(run))
        assert main([*BASE, "run.train_steps=5", "run.eval_iters=0", f"run.dir={run}"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"in use by PID {holder.pid}" in err and str(run) in err
        assert _tree(str(run)) == before  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: stale, taken over (and released at the end)
    assert main([*BASE, "run.train_steps=5", "run.eval_iters=0", f"run.dir={run}"]) == 0
    assert f"stale lock {run / '.lock'} of PID {holder.pid}" in capsys.readouterr().out
    assert not (run / ".lock").exists()


@pytest.mark.slow
def test_checkpoint_of_another_preset_is_refused_in_one_line(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert main([*BASE, "run.train_steps=5", "run.eval_iters=0", f"run.dir={run}"]) == 0
    capsys.readouterr()
    before = _tree(run)
    assert main([*BASE, "model.preset=tiny-moe:mhc", "run.train_steps=6", "run.eval_iters=0", f"run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.preset=tiny-moe:xhc" in err and "model.preset=tiny-moe:mhc" in err
    assert "checkpoint.load=none" in err
    assert _tree(run) == before  # not even config.yaml


@pytest.mark.slow
def test_corrupt_latest_falls_back_to_the_previous_good_checkpoint(reference, tmp_path, capsys):
    run = str(tmp_path / "run")
    ckdir = os.path.join(run, "checkpoints")
    assert main([*BASE, *STEPS, f"run.dir={run}", "run.exit_at_step=8"]) == 0
    latest = os.path.join(ckdir, "step_00000008")
    data = max((os.path.join(latest, f) for f in os.listdir(latest) if f.endswith(".distcp")), key=os.path.getsize)
    with open(data, "r+b") as f:  # flip one byte
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    capsys.readouterr()
    assert main([*BASE, *STEPS, f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "warning" in out and "sha256" in out and f"{latest}.corrupt" in out
    assert f"resumed from {os.path.join(ckdir, 'step_00000004')}" in out
    assert os.path.isdir(latest + ".corrupt")  # set aside, not deleted
    _assert_same_run(reference, run)


def test_dedupe_resumed_keeps_one_timeline():
    recs = [{"kind": "train", "step": s, "loss": float(s)} for s in range(1, 8)]
    recs += [{"kind": "eval", "step": 6, "loss": 60.0}]
    recs += [{"kind": "resume", "step": 4}]
    recs += [{"kind": "train", "step": s, "loss": 10.0 + s} for s in range(5, 7)]
    out = dedupe_resumed(recs)
    train = [(r["step"], r["loss"]) for r in out if r["kind"] == "train"]
    assert train == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 15.0), (6, 16.0)]  # old 5..7 dropped
    assert not [r for r in out if r["kind"] == "eval"]  # the eval at 6 belonged to the abandoned timeline


def test_lock_reused_pid_is_stale_and_another_host_is_not(tmp_path):
    import socket

    from training.run import RunLock, RunLocked

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = tmp_path / ".lock"
        # a live PID whose start time differs from the recorded one: the PID was reused, the lock is stale
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "start_time": "1"}))
        seen = []
        RunLock(str(tmp_path), log=seen.append).acquire()
        assert seen and "stale lock" in seen[0] and json.loads(lock.read_text())["pid"] == os.getpid()
        # a lock from another host cannot be checked from here: refused, naming the host
        lock.write_text(json.dumps({"host": "elsewhere", "pid": holder.pid, "since": "t"}))
        with pytest.raises(RunLocked, match=f"PID {holder.pid} on host elsewhere"):
            RunLock(str(tmp_path), log=seen.append).acquire()
        assert json.loads(lock.read_text())["host"] == "elsewhere"  # untouched
    finally:
        holder.kill()
        holder.wait()
