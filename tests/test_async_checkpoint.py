"""Asynchronous checkpoints (``checkpoint.async_save``) and storage faults, sync and async.

- a run that saves in the background trains bit for bit like one that saves synchronously, and a
  resume from a checkpoint written in the background continues it bit for bit;
- a write that fails in the background is reported at the next step boundary, in the one line a
  synchronous failure gives (exit 4, ``status.json`` records it, the partial save removed, the
  previous checkpoint kept);
- a disk that fills up during a save: a real small filesystem (a tmpfs, where this machine lets
  the test mount one) or, elsewhere, the writer's ENOSPC; and the other shape a full disk takes
  (torch's ``inline_container ... unexpected pos``).  The rerun removes the stale partial save
  before its space check (counting the space it held) and resumes from the previous checkpoint;
- ``kill -9`` during a background write: the rerun loads the previous verified checkpoint.

Runs are the tiny xHC-MoE preset on mock data, in this process (the kill -9 one in a subprocess).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from training.checkpoint import list_checkpoints, verify_checkpoint
from training.run import read_metrics
from training.pretrain import SAVE_FAILED, main

pytestmark = [pytest.mark.megatron, pytest.mark.train]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=64", "batch.seq_length=16",
        "batch.micro_batch_size=2", "batch.global_batch_size=4", "schedule.warmup_steps=2", "run.num_threads=1",
        "logging.tensorboard=false", "logging.plot=false", "logging.interval=1", "logging.hc_health_interval=0",
        "run.eval_interval=0", "model.backbone.hidden_dropout=0.1"]


def _losses(run_dir):
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"), "train")}


def _status(run_dir):
    with open(os.path.join(run_dir, "status.json")) as f:
        return json.load(f)


def _tail(path, n=3000):
    with open(path) as f:
        return f.read()[-n:]


def _error_lines(err: str):
    return [line for line in err.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------------------------------------
def test_async_saves_train_like_sync_saves_and_resume_bit_exactly(tmp_path):
    steps = ["run.train_steps=8", "checkpoint.interval=3", "checkpoint.keep_last=3"]
    sync, asyn, resumed = (str(tmp_path / n) for n in ("sync", "async", "resumed"))
    assert main([*BASE, *steps, "checkpoint.async_save=false", f"run.dir={sync}"]) == 0
    assert main([*BASE, *steps, "checkpoint.async_save=true", f"run.dir={asyn}"]) == 0
    ref = _losses(sync)
    assert sorted(ref) == list(range(1, 9))
    assert _losses(asyn) == ref  # bitwise: JSON floats round-trip
    saved = [s for s, _ in list_checkpoints(os.path.join(asyn, "checkpoints"))]
    assert saved == [3, 6, 8]
    events = [r for r in read_metrics(os.path.join(asyn, "metrics.jsonl"), "event") if r.get("checkpoint")]
    assert any("background" in r.get("message", "") for r in events), events
    # resume from the step-6 checkpoint written in the background
    ck6 = os.path.join(asyn, "checkpoints", "step_00000006")
    verify_checkpoint(ck6)
    assert main([*BASE, *steps, "checkpoint.async_save=true", f"run.dir={resumed}", f"checkpoint.load={ck6}"]) == 0
    got = _losses(resumed)
    assert sorted(got) == [7, 8]
    assert {s: got[s] for s in (7, 8)} == {s: ref[s] for s in (7, 8)}


# ------------------------------------------------------------------------------------------------
# A full disk during a save, sync and async
# ------------------------------------------------------------------------------------------------
def _mount_tmpfs(path, mib) -> bool:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _fill(directory, leave_bytes):
    """Write a ballast file that leaves ``leave_bytes`` free on the disk holding ``directory``."""
    free = shutil.disk_usage(directory).free
    path = os.path.join(directory, "ballast")
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return path


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("shape", ["disk_full", "inline_container"])
def test_no_space_during_a_save_leaves_a_clean_state_and_the_rerun_resumes(tmp_path, monkeypatch, capsys, mode,
                                                                           shape):
    """The second save (step 10) fails: one line naming the disk, its free space and the kept step-5
    checkpoint; exit 4; no partial left; status.json records it.  The rerun (the same command) after a
    kill -9 left another partial that fills the disk removes it, counts its space, and resumes at step 5."""
    import training.checkpoint.checkpointer as tc
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    disk = tmp_path / "disk"
    real_disk = shape == "disk_full" and _mount_tmpfs(disk, 24)
    request_unmount = str(disk) if real_disk else None
    ckpt = disk / "ckpt"
    run = str(tmp_path / "run")
    cmd = [*BASE, "run.train_steps=12", "checkpoint.interval=5", f"checkpoint.async_save={mode == 'async'}",
           f"run.dir={run}", f"checkpoint.dir={ckpt}"]
    publish = tc.Checkpointer._publish
    write = FileSystemWriterAsync.write_preloaded_data

    def publish_then_fill(self, step, *a, **k):  # the disk fills up after the first checkpoint
        error = publish(self, step, *a, **k)
        if step == 5 and real_disk:
            _fill(str(disk), 1 << 20)
        return error

    def failing_write(*a, **k):  # what the writer reports where no small disk can be made
        raise OSError(errno.ENOSPC, "No space left on device") if shape == "disk_full" else RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    try:
        monkeypatch.setattr(tc.Checkpointer, "_publish", publish_then_fill)
        if not real_disk:
            def write_or_fail(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync,
                              **k):  # Megatron's parameter names: its writer passes them by keyword
                if ".step_00000010.tmp" not in write_bucket[0]:
                    return write(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync,
                                 **k)
                try:  # as the real writer does: the exception goes to the results queue
                    failing_write()
                except Exception as e:  # noqa: BLE001
                    results_queue.put((local_proc_idx, e))
                count_queue.get()
                count_queue.task_done()

            monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(write_or_fail))
        capsys.readouterr()
        assert main(cmd) == SAVE_FAILED
        err = capsys.readouterr().err
        lines = _error_lines(err)
        assert len(lines) == 1, err[-3000:]
        line = lines[0]
        assert "step_00000010" in line and "no space left on device" in line, line
        assert f"the previous checkpoint {ckpt / 'step_00000005'} is kept" in line, line
        assert "MiB free of" in line and "rerun the same command" in line, line
        assert sorted(os.listdir(ckpt)) == ["latest", "step_00000005"]  # the partial is gone
        verify_checkpoint(str(ckpt / "step_00000005"))
        status = _status(run)
        assert status["failed"]["exit_code"] == SAVE_FAILED and status["failed"]["error"] in line
        assert status["latest_checkpoint"] == str(ckpt / "step_00000005")
        if mode == "async":
            assert 10 < status["step"] < 12  # reported at the step boundary after the save
        else:
            assert status["step"] == 10
        monkeypatch.undo()
        # a kill -9 mid-save left a partial that holds (nearly) all the free space
        partial = ckpt / ".step_00000010.tmp"
        os.makedirs(partial)
        if real_disk:
            os.replace(disk / "ballast", partial / "ballast")
            assert shutil.disk_usage(str(disk)).free < 2 << 20
        assert main(cmd) == 0
        out = capsys.readouterr().out
        assert f"resumed from {ckpt / 'step_00000005'}" in out
        assert not partial.exists()
        assert [s for s, _ in list_checkpoints(str(ckpt))] == [10, 12]
        assert _status(run)["failed"] is None and _status(run)["finished"]
    finally:
        if request_unmount:
            subprocess.run(["umount", "-l", request_unmount], check=False)


# ------------------------------------------------------------------------------------------------
def test_kill_9_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    """The writer thread is slowed down so that the kill lands mid-write, with step 3 verified and
    step 6's files half written: the rerun loads step 3, never the partial."""
    run = str(tmp_path / "run")
    slow_writer = (  # the step-6 file's writer marks that it started, then hangs
        "import runpy, sys, time\n"
        "from megatron.core.dist_checkpointing.strategies import filesystem_async as fa\n"
        "_w = fa.FileSystemWriterAsync.write_preloaded_data\n"
        "def slow(*a, **k):\n"
        "    if '.step_00000006.tmp' in a[2][0]:\n"
        "        open(a[2][0] + '.started', 'w').close()\n"
        "        time.sleep(600)\n"
        "    return _w(*a, **k)\n"
        "fa.FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)\n"
        "sys.argv[0] = 'xhc-pretrain'\n"
        "runpy.run_module('training.pretrain', run_name='__main__')\n")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    args = [*BASE, "model.hc_kernels=eager", "run.train_steps=30", "checkpoint.interval=3", "checkpoint.async_save=true",
            f"run.dir={run}"]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", slow_writer, *args], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    partial = os.path.join(run, "checkpoints", ".step_00000006.tmp")
    deadline = time.time() + 120
    try:
        while not (os.path.isdir(partial) and any(n.endswith(".started") for n in os.listdir(partial))):
            assert proc.poll() is None, f"the run ended before the write started:\n{_tail(tmp_path / 'run.log')}"
            assert time.time() < deadline, f"the write did not start:\n{_tail(tmp_path / 'run.log')}"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    assert [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))] == [3]
    r = subprocess.run([sys.executable, "-m", "training.pretrain", *args, "run.train_steps=4", "checkpoint.interval=0"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {os.path.join(run, 'checkpoints', 'step_00000003')}" in r.stdout
    assert not os.path.exists(partial)


def test_unwritable_checkpoint_dir_is_one_line_at_start_up(tmp_path, monkeypatch, capsys):
    """Root writes anywhere, so the refusal of a read-only disk is simulated: the probe file in
    checkpoint.dir raises PermissionError, as it does for a user without write access."""
    import tempfile

    ckpt = str(tmp_path / "ck")
    real = tempfile.mkstemp

    def mkstemp(*a, **k):
        if k.get("dir") == ckpt:
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(ckpt, ".xhc-write-probe-x"))
        return real(*a, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    capsys.readouterr()
    assert main([*BASE, "run.train_steps=12", f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={ckpt}"]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"checkpoint.dir {ckpt}: not writable (Permission denied" in lines[0], lines
    assert "choose a writable checkpoint.dir" in lines[0]
    assert not os.path.exists(tmp_path / "run")  # a refused start leaves the disk as it was
