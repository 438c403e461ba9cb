"""training.checkpoint: exact round trip, atomic saves, keep-last-K, corruption detection, SIGTERM save.

Single process (gloo) on the tiny xHC-MoE preset; the SIGTERM test runs ``python -m
training.pretrain`` in a subprocess and interrupts it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from training.checkpoint import (
    MANIFEST,
    CheckpointError,
    Checkpointer,
    build_state,
    capture_rng_state,
    list_checkpoints,
    restore_rng_state,
    verify_checkpoint,
)

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ = 64, 16


@pytest.fixture(scope="module")
def parallel():
    from models.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(seed=1234)
    yield
    destroy_parallel()


def _setup(seed: int):
    """Tiny xHC-MoE model, its optimizer (one real step, so there is state) and scheduler."""
    from models.zoo import build_model, build_transformer_config, load_preset
    from training.optim import OptimizerConfig, build_optimizer
    from training.schedule import ScheduleConfig, build_scheduler

    torch.manual_seed(seed)
    preset = load_preset("tiny-moe:xhc")
    config = build_transformer_config(preset, cpu=True)
    model = build_model(preset, config, vocab_size=VOCAB, seq_length=SEQ)
    ocfg = OptimizerConfig(lr=1e-2, eps=1e-8)
    opt = build_optimizer(model, ocfg)
    sched = build_scheduler(opt, ScheduleConfig(kind="wsd", total_steps=10, warmup_steps=2), ocfg)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(2, SEQ)
    model(tokens, pos, None, labels=tokens).mean().backward()
    assert opt.step().updated
    sched.step()
    return model, opt, sched


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _save(root, step, model, opt, sched, keep_last=3, checksum="all", trainer=None):
    ck = Checkpointer(root, keep_last=keep_last, checksum=checksum, log=lambda *_: None)
    state = build_state([model], opt, sched, trainer or {"step": step, "consumed_samples": 4 * step, "skipped_steps": 0})
    return ck, ck.save(step, state, {"world_size": 1})


# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_round_trip_restores_everything_exactly(parallel, tmp_path):
    model, opt, sched = _setup(seed=1)
    want_params = _params(model)
    want_opt = opt.state_dict()
    rng_before = capture_rng_state()
    ck, path = _save(str(tmp_path), 7, model, opt, sched, trainer={"step": 7, "consumed_samples": 28, "skipped_steps": 1})
    expected_draw = torch.rand(5)  # what the restored RNG must give next

    model2, opt2, sched2 = _setup(seed=2)  # different weights, moments and RNG position
    assert any(not torch.equal(v, _params(model2)[k]) for k, v in want_params.items())
    loaded = ck.load(path, build_state([model2], opt2, sched2, {"step": 0, "consumed_samples": 0, "skipped_steps": 0},
                                       is_loading=True))
    model2.load_state_dict(loaded["model"], strict=False)
    opt2.load_torch_sharded_state_dict(loaded["optimizer_torch"])  # moments as sharded tensors (elastic resume)
    sched2.load_state_dict(loaded["scheduler"])
    restore_rng_state(loaded["rng"])

    got = _params(model2)
    assert set(got) == set(want_params)
    for k, v in want_params.items():
        assert torch.equal(got[k], v), k  # bitwise, including the router expert bias buffers
    got_opt = opt2.state_dict()
    for name in want_opt:
        for pid, st in want_opt[name]["state"].items():
            for key, val in st.items():
                assert torch.equal(torch.as_tensor(got_opt[name]["state"][pid][key]), torch.as_tensor(val)), (name, key)
    assert sched2.num_steps == sched.num_steps == 1
    assert loaded["trainer"] == {"step": 7, "consumed_samples": 28, "skipped_steps": 1}
    assert torch.equal(torch.rand(5), expected_draw)
    assert torch.equal(loaded["rng"]["torch"], rng_before["torch"])


@pytest.mark.slow
def test_layout_manifest_and_latest(parallel, tmp_path):
    model, opt, sched = _setup(seed=1)
    ck, path = _save(str(tmp_path), 3, model, opt, sched)
    assert os.path.basename(path) == "step_00000003"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    with open(tmp_path / "latest") as f:
        assert f.read().strip() == "step_00000003"
    body = verify_checkpoint(path)
    files = body["files"]
    on_disk = sorted(os.path.relpath(os.path.join(b, n), path) for b, _, ns in os.walk(path) for n in ns)
    assert sorted(files) == [f for f in on_disk if f != MANIFEST]
    assert all(files[f]["size"] == os.path.getsize(os.path.join(path, f)) for f in files)
    assert all("sha256" in e for e in files.values())  # checksum=all
    assert body["step"] == 3 and body["world_size"] == 1


@pytest.mark.slow
def test_keep_last_k(parallel, tmp_path):
    model, opt, sched = _setup(seed=1)
    for step in (1, 2, 3, 4):
        ck, _ = _save(str(tmp_path), step, model, opt, sched, keep_last=2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3, 4]
    assert ck.resolve("auto").endswith("step_00000004")
    assert ck.resolve(str(tmp_path)).endswith("step_00000004")  # a root resolves to its newest
    assert ck.resolve("none") is None


def _largest_data_file(path):
    files = [(os.path.getsize(os.path.join(path, f)), f) for f in os.listdir(path) if f.endswith(".distcp")]
    return os.path.join(path, max(files)[1])


def _flip_byte(p):
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 7)


def _edit_manifest(path):
    mp = os.path.join(path, MANIFEST)
    with open(mp) as f:
        m = json.load(f)
    m["body"]["step"] = 99  # body no longer matches its sha256
    with open(mp, "w") as f:
        json.dump(m, f)


@pytest.mark.parametrize("corrupt, words", [
    (lambda path: _flip_byte(_largest_data_file(path)), "fails its sha256"),
    (lambda path: _truncate(_largest_data_file(path)), "bytes, the manifest says"),
    (lambda path: os.remove(os.path.join(path, ".metadata")), "is missing"),
    (lambda path: _flip_byte(os.path.join(path, "metadata.json")), "fails its sha256"),
    (lambda path: os.remove(os.path.join(path, MANIFEST)), "no manifest.json"),
    (_edit_manifest, "fails its own sha256"),
])
@pytest.mark.slow
def test_corrupt_checkpoint_is_never_loaded(parallel, tmp_path, corrupt, words):
    model, opt, sched = _setup(seed=1)
    ck, path = _save(str(tmp_path), 5, model, opt, sched)
    corrupt(path)
    model2, opt2, sched2 = _setup(seed=2)
    before = _params(model2)
    with pytest.raises(CheckpointError) as e:
        ck.load(ck.resolve("auto"), build_state([model2], opt2, sched2, {}, is_loading=True))
    assert words in str(e.value) and path in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in _params(model2).items())  # nothing was loaded


@pytest.mark.slow
def test_metadata_checksum_still_catches_size_changes(parallel, tmp_path):
    model, opt, sched = _setup(seed=1)
    _, path = _save(str(tmp_path), 5, model, opt, sched, checksum="metadata")
    body = verify_checkpoint(path)
    files = body["files"]
    assert "sha256" in files["metadata.json"] and "sha256" in files[".metadata"]
    if "common.pt" in files:  # megatron-core < 0.19 keeps the common state there
        assert "sha256" in files["common.pt"]
    assert not any("sha256" in e for f, e in files.items() if f.endswith(".distcp"))
    _truncate(_largest_data_file(path))
    with pytest.raises(CheckpointError, match="bytes"):
        verify_checkpoint(path)


def _object_keys(path):
    """The non-tensor entries of a torch_dist checkpoint, read independently of the manifest."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(path).read_metadata()
    return md, {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}


@pytest.mark.slow
def test_metadata_checksum_covers_every_non_tensor_object(parallel, tmp_path):
    """Step, scheduler, RNG and the optimizer's step counts are hashed in ``metadata`` mode wherever
    Megatron stores them: in common.pt (< 0.19) or inside the .distcp files (0.19+).  (The CPU
    optimizer's moments are sharded tensors that follow their parameters, like the weights.)"""
    model, opt, sched = _setup(seed=1)
    _, path = _save(str(tmp_path), 5, model, opt, sched, checksum="metadata")
    md, objects = _object_keys(path)
    assert any("rng" in k for k in objects), sorted(objects)
    assert any(k.startswith("optimizer.adamw.exp_avg.") for k in md.state_dict_metadata)
    located = [(i.fqn, info) for i, info in md.storage_data.items() if i.fqn in objects]
    assert located
    for fqn, info in located:  # flipping a byte of any one object is caught, then undone
        p = os.path.join(path, info.relative_path)
        where = info.offset + info.length // 2
        with open(p, "r+b") as f:
            f.seek(where)
            b = f.read(1)
            f.seek(where)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(CheckpointError, match="fails its sha256"):
            verify_checkpoint(path)
        with open(p, "r+b") as f:
            f.seek(where)
            f.write(b)
        verify_checkpoint(path)


@pytest.mark.slow
def test_crashed_save_leaves_previous_checkpoint_and_is_cleaned_up(parallel, tmp_path, monkeypatch):
    import errno

    import training.checkpoint.checkpointer as tc

    model, opt, sched = _setup(seed=1)
    ck, first = _save(str(tmp_path), 1, model, opt, sched)
    before = {f: os.path.getsize(os.path.join(first, f)) for f in os.listdir(first)}

    def crash(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tc, "write_manifest", crash)
    with pytest.raises(CheckpointError) as err:
        _save(str(tmp_path), 2, model, opt, sched)
    msg = str(err.value)
    assert "no space left on device" in msg and "step_00000002" in msg and "kept" in msg and "\n" not in msg
    assert ck.latest() == first  # the partial save is invisible ...
    assert not os.path.exists(tmp_path / ".step_00000002.tmp")  # ... and removed (its space freed)
    assert {f: os.path.getsize(os.path.join(first, f)) for f in os.listdir(first)} == before
    verify_checkpoint(first)
    monkeypatch.undo()
    # a crash that leaves a .tmp behind (kill -9) is cleaned by the next save
    os.makedirs(tmp_path / ".step_00000002.tmp")
    _, third = _save(str(tmp_path), 3, model, opt, sched)
    assert not os.path.exists(tmp_path / ".step_00000002.tmp")
    assert ck.latest() == third


# ------------------------------------------------------------------------------------------------
# SIGTERM: the run saves at the next step boundary and exits cleanly
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "training.pretrain", "data.mock=true", "tokenizer.type=none",
           "tokenizer.vocab_size=64", "batch.seq_length=16", "batch.micro_batch_size=2", "batch.global_batch_size=2",
           "run.train_steps=100000", "schedule.warmup_steps=1", "run.eval_iters=0", "checkpoint.interval=0",
           "logging.tensorboard=false", "logging.hc_health_interval=0", "logging.interval=1", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    try:
        while time.time() < deadline:  # wait until it is training
            if metrics.exists() and sum(1 for line in open(metrics) if '"kind": "train"' in line) >= 2:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        else:
            raise AssertionError("the run did not start training in time")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "stopping at step" in out and "signal SIGTERM" in out
    found = list_checkpoints(str(run_dir / "checkpoints"))
    assert len(found) == 1
    step, path = found[0]
    body = verify_checkpoint(path)
    assert body["step"] == step >= 2 and "SIGTERM" in body["reason"]
    trained = [json.loads(line) for line in open(metrics) if '"kind": "train"' in line]
    assert trained[-1]["step"] == step  # saved at the step boundary where it stopped


def test_compatibility_ignores_how_the_maths_runs_but_not_what_it_is():
    """A run may resume with another kernel backend or Sinkhorn backward, not another HC config."""
    import dataclasses

    from training.checkpoint import CheckpointError, check_compatible
    from xhc.config import HCConfig

    saved = dataclasses.asdict(HCConfig(variant="xhc", n=16, kernels="eager", sinkhorn_recompute=False))
    now = dataclasses.asdict(HCConfig(variant="xhc", n=16, kernels="compile", sinkhorn_recompute=True))
    check_compatible("ck", {"hc": saved}, {"hc": now})  # no error
    other = dataclasses.asdict(HCConfig(variant="xhc", n=16, k=8, kernels="compile"))
    with pytest.raises(CheckpointError, match=r"model\.hc\.k: saved 4, now 8"):
        check_compatible("ck", {"hc": saved}, {"hc": other})


def test_file_preset_compares_by_real_path(tmp_path, monkeypatch):
    """A run that recorded ``/abs/runs/X/preset.yaml:xhc`` resumes under the documented relative
    ``runs/X/preset.yaml:xhc`` (the journey docs/conversion.md "Back to Megatron" found this)."""
    from training.checkpoint import CheckpointError, check_compatible

    (tmp_path / "runs" / "X").mkdir(parents=True)
    (tmp_path / "runs" / "X" / "preset.yaml").write_text("name: x\n")
    (tmp_path / "runs" / "Y").mkdir(parents=True)
    (tmp_path / "runs" / "Y" / "preset.yaml").write_text("name: y\n")
    monkeypatch.chdir(tmp_path)
    saved = {"preset": f"{tmp_path}/runs/X/preset.yaml:xhc"}
    check_compatible("ck", saved, {"preset": "runs/X/preset.yaml:xhc"})  # the same file: no error
    for other in ("runs/Y/preset.yaml:xhc", "runs/X/preset.yaml:mhc", "tiny-moe:xhc"):
        with pytest.raises(CheckpointError, match="holds model.preset="):
            check_compatible("ck", saved, {"preset": other})
