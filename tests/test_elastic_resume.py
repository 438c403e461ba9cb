"""Elastic resume: a checkpoint saved on one parallel layout continues on another, optimizer state
included (``checkpoint.reshard=auto``, docs/parallelism-and-checkpoints.md).

Each transition trains 4 steps at layout A (the uninterrupted run A goes on to 8 and saves at 4),
resumes at layout B for 4 more steps, and is compared with run A.  The tolerance is measured, not
guessed: a second uninterrupted run, at layout B from run A's initial weights (layouts initialise
expert and pipeline-stage weights from different RNG streams), gives the largest loss difference
the two layouts' arithmetic makes over 8 steps; the resumed run may differ from A by twice that,
and by at least 1e-5 (about 20 float32 roundings of these losses) where the two runs agree to the bit.  Right after the
load, the resumed run saves a checkpoint before its first step; every tensor of it (weights,
AdamW moments, Muon momentum), read back whole by torch's own checkpoint reader, equals the one
layout A saved, and the step counts, scheduler and trainer counters equal too.

All runs go through three processes: one process, one torchrun launch of two, one process again
(``tests/dist/elastic_worker.py`` runs its jobs one after another).  The fast tests at the end
check the compatibility rules on manifests alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from training.checkpoint import CheckpointError, check_compatible

pytestmark = [pytest.mark.megatron]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join("tests", "dist", "elastic_worker.py")
SAVE, STEPS = 4, 8  # A saves at SAVE (and at 0, STEPS); R resumes from SAVE and runs to STEPS
BASE = ["data.mock=true", "batch.micro_batch_size=2", "batch.global_batch_size=4", "batch.seq_length=32",
        "run.eval_interval=0", "logging.tensorboard=false", "logging.plot=false", "run.num_threads=1",
        "tokenizer.vocab_size=512", "logging.interval=10", "logging.sample_ids=true", "checkpoint.keep_last=5",
        f"checkpoint.interval={SAVE}"]
LAYOUTS = {"1": [], "ep2": ["parallel.ep=2"], "tp2sp": ["parallel.tp=2", "parallel.sp=true"],
           "pp2": ["parallel.pp=2"], "dp2": [],
           "dp2s": ["optimizer.use_distributed_optimizer=true"]}  # DP = 2, the optimizer state sharded over it
WORLD = {"1": 1, "ep2": 2, "tp2sp": 2, "pp2": 2, "dp2": 2, "dp2s": 2}
# (preset variant, optimizer, layout A, layout B): every pair the issue names, AdamW and Muon, xHC, mHC, vanilla;
# mhc-dsv4: mHC with DeepSeek-V4's convention and learned head (docs/math.md §2.h), the head on TP=2+SP
TRANSITIONS = [("xhc", "adamw", "ep2", "1"), ("xhc", "muon", "1", "ep2"), ("mhc-dsv4", "muon", "tp2sp", "1"),
               ("mhc", "adamw", "1", "tp2sp"), ("vanilla", "adamw", "pp2", "1"),
               # Muon's state sharded over DP = 2 -> replicated at DP = 1, and replicated at DP = 1 -> sharded at DP = 2
               ("vanilla", "muon", "dp2s", "1"), ("xhc", "muon", "1", "dp2s")]
IDS = [f"{a}-to-{b}-{v}-{o}" for v, o, a, b in TRANSITIONS]
VARIANT_ARGS = {"mhc-dsv4": ["model.preset=tiny-moe:mhc", "model.hc.convention=deepseek_v4",
                             "model.hc.reduction=learned"]}


def _args(root, name, variant, opt, layout, steps, load=None):
    args = [*BASE, *VARIANT_ARGS.get(variant, [f"model.preset=tiny-moe:{variant}"]), f"optimizer.name={opt}",
            *LAYOUTS[layout], f"run.train_steps={steps}", f"run.dir={os.path.join(root, name)}"]
    return args + ([f"checkpoint.load={load}"] if load else [])


def _one_process(root, jobs, label):
    path = os.path.join(root, f"{label}.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, WORKER, path], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _losses(run):
    out = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") in ("train", "resume"):
                out.setdefault(r["kind"], {})[r["step"]] = r
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_torchrun):
    root = str(tmp_path_factory.mktemp("elastic"))
    ckpt = lambda name, step: os.path.join(root, name, "checkpoints", f"step_{step:08d}")  # noqa: E731
    first, launch, last = [], [], []
    for (v, o, a, b), tid in zip(TRANSITIONS, IDS):
        # A: uninterrupted at layout A (saves its initial state, SAVE and STEPS); B: uninterrupted at
        # layout B from A's initial weights; R: A's step SAVE resumed at layout B
        # (A writes its step-SAVE checkpoint in the background: the resume on another layout reads an async save)
        A = {"args": [*_args(root, f"{tid}-A", v, o, a, STEPS), "checkpoint.async_save=true"], "save_at_start": True}
        B = {"args": _args(root, f"{tid}-B", v, o, b, STEPS, load=ckpt(f"{tid}-A", 0))}
        R = {"args": _args(root, f"{tid}-R", v, o, b, STEPS, load=ckpt(f"{tid}-A", SAVE)), "resave": True}
        (first if WORLD[a] == 1 else launch).append(A)
        for job in (B, R):
            (last if WORLD[b] == 1 else launch).append(job)
    launch.sort(key=lambda job: "save_at_start" not in job)  # runs A of two processes first
    logs = _one_process(root, first, "first")
    path = os.path.join(root, "launch.json")
    with open(path, "w") as f:
        json.dump(launch, f)
    logs += run_torchrun(WORKER, nproc=2, args=[path], timeout=1200).stdout
    logs += _one_process(root, last, "last")
    return root, logs


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.train
@pytest.mark.cpu_gloo  # the torch-backend optimizer state (with CUDA: a child pytest with CUDA hidden)
@pytest.mark.parametrize("transition", TRANSITIONS, ids=IDS)
def test_resume_on_another_layout(runs, transition):
    from megatron.core import dist_checkpointing

    root, logs = runs
    v, o, a, b = transition
    tid = IDS[TRANSITIONS.index(transition)]
    A, B, R = (_losses(os.path.join(root, f"{tid}-{k}")) for k in "ABR")

    # the resume record and the log line name both layouts
    rec = R["resume"][SAVE]
    assert rec["layout"]["saved"]["world_size"] == WORLD[a] and rec["layout"]["now"]["world_size"] == WORLD[b]
    assert f"resharding checkpoint {os.path.join(root, f'{tid}-A', 'checkpoints', f'step_{SAVE:08d}')} from world size {WORLD[a]}" in logs

    # right after the load: every tensor equals what layout A saved (read whole, with torch's reader)
    saved = os.path.join(root, f"{tid}-A", "checkpoints", f"step_{SAVE:08d}")
    loaded = os.path.join(root, f"{tid}-R", "checkpoints", f"step_{SAVE:08d}")
    ta, tr = _whole(saved), _whole(loaded)
    moments = "exp_avg" if o == "adamw" else "momentum_buffer"
    assert sum(k.startswith(f"optimizer.{o}.{moments}.") for k in ta) >= 10, sorted(ta)[:5]
    assert set(ta) == set(tr)
    if v == "mhc-dsv4":  # the learned head (last layer, an SP parameter at TP=2) and its AdamW moments
        head = [k for k in ta if ".hc_head." in k]
        assert any(k.startswith("optimizer.adamw.exp_avg") for k in head) and \
            any(not k.startswith("optimizer.") for k in head), sorted(head)
    unequal = [k for k in ta if not torch.equal(ta[k], tr[k])]
    assert not unequal, unequal[:5]
    ca, cr = dist_checkpointing.load_common_state_dict(saved), dist_checkpointing.load_common_state_dict(loaded)
    assert ca["optimizer_torch"]["steps"] == cr["optimizer_torch"]["steps"]
    steps = ca["optimizer_torch"]["steps"]
    assert {v for k, v in steps.items() if k.startswith("adamw.")} == {float(SAVE)}  # AdamW (also Muon's 1-D/embeddings)
    assert (o == "muon") == any(k.startswith("muon.") for k in steps)
    assert ca["scheduler"] == cr["scheduler"] and ca["trainer"] == cr["trainer"]

    # the data continues exactly: the same sample indices, step by step
    for step in range(SAVE + 1, STEPS + 1):
        assert R["train"][step]["sample_ids"] == A["train"][step]["sample_ids"], step
    assert R["train"][SAVE + 1]["sample_ids"] == list(range(4 * SAVE, 4 * SAVE + 4))  # global batch 4

    # losses within the measured layout noise
    assert B["resume"][0]["layout"]["now"]["world_size"] == WORLD[b]  # B: A's initial weights, layout B
    noise = max(abs(A["train"][s]["loss"] - B["train"][s]["loss"]) for s in range(1, STEPS + 1))
    tol = max(2 * noise, 1e-5)
    worst = max(abs(R["train"][s]["loss"] - A["train"][s]["loss"]) for s in range(SAVE + 1, STEPS + 1))
    print(f"ELASTIC {tid}: max |dloss| over {STEPS - SAVE} steps {worst:.3g} (tolerance {tol:.3g}: two uninterrupted "
          f"layouts differ by up to {noise:.3g}); load {rec['load_time_s']:.2f} s")
    assert worst <= tol, (worst, noise)


def _whole(directory):
    """Every tensor of a ``torch_dist`` checkpoint, read whole with torch's own checkpoint reader."""
    from training.checkpoint import read_whole_tensors

    return read_whole_tensors(directory)


def _one_process_worker(worker: str, *args: str) -> None:
    """Run a tests/dist worker as one plain process (world size 1) and require exit 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, worker, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.cpu_gloo  # CPU stand-ins for Megatron's CUDA-only corners (with CUDA: a child pytest with CUDA hidden)
def test_distributed_optimizer_dp2_to_1(tmp_path, run_torchrun):
    """Megatron's distributed optimizer (GPU AdamW), on CPU: 2 steps at DP = 2, the checkpoint loaded
    at DP = 1, one more step == 3 steps at DP = 1, bit for bit, with either optimizer_sharding (both
    reshard across DP).  ``fully_reshardable`` holds one tensor per parameter and state: saved again
    right after the load at DP = 1, every one equals the DP = 2 save."""
    root = str(tmp_path)
    worker = os.path.join("tests", "dist", "distopt_reshard_worker.py")
    run_torchrun(worker, nproc=2, args=["save", root], timeout=600)
    _one_process_worker(worker, "load", root)
    straight = torch.load(os.path.join(root, "straight.pt"))
    for sharding in ("fully_reshardable", "dp_reshardable"):
        resumed = torch.load(os.path.join(root, f"dp1-{sharding}.pt"))
        assert straight.keys() == resumed.keys()
        differ = [k for k in straight if not torch.equal(straight[k], resumed[k])]
        assert not differ, (sharding, differ[:5])
    saved, again = _whole(os.path.join(root, "dp2-fully_reshardable")), _whole(os.path.join(root, "dp1-fully_reshardable"))
    assert set(saved) == set(again) and sum(k.startswith("optimizer.") for k in saved) >= 50
    assert not [k for k in saved if not torch.equal(saved[k], again[k])]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.cpu_gloo  # CPU stand-ins for Megatron's CUDA-only corners
def test_gpu_muon_state_reshards_and_converts(tmp_path, run_torchrun):
    """Muon on the GPU path (training.optim.megatron.ShardedLayerWiseOptimizer, bf16 weights with fp32
    main copies), on CPU (tests/dist/muon_reshard_worker.py): sharded and replicated states train bit for
    bit alike and resume each other's checkpoints bit for bit at DP = 2; each DP = 2 checkpoint loaded at
    TP = 2 + SP (DP = 1), and that one loaded back at DP = 2, save again at once a checkpoint whose
    every tensor (weights, fp32 main copies, momentum, moments), read back whole, equals the one loaded;
    back at DP = 2 one step equals the uninterrupted run bit for bit."""
    root = str(tmp_path)
    worker = os.path.join("tests", "dist", "muon_reshard_worker.py")
    run_torchrun(worker, nproc=2, args=["save", root], timeout=600)
    run_torchrun(worker, nproc=2, args=["grow", root], timeout=600)
    saved = _whole(os.path.join(root, "dp2-sharded"))
    kinds = {".".join(k.split(".")[1:3]) for k in saved if k.startswith("optimizer.")}
    assert kinds == {"muon.momentum_buffer", "muon.fp32_param", "adamw.exp_avg", "adamw.exp_avg_sq",
                     "adamw.fp32_param"}
    for again in ("dp2-replicated", "tp2-sharded", "tp2-replicated", "dp2-again"):
        other = _whole(os.path.join(root, again))
        assert set(other) == set(saved), again
        assert not [k for k in saved if not torch.equal(saved[k], other[k])], again


# ------------------------------------------------------------------------------------------------
# The rules, on manifests alone (fast)
# ------------------------------------------------------------------------------------------------
ONE = {"world_size": 1, "parallel": {"tp": 1, "pp": 1, "ep": 1, "cp": 1}}
TWO_EP = {"world_size": 2, "parallel": {"tp": 1, "pp": 1, "ep": 2, "cp": 1}}
TWO_DP = {"world_size": 2, "parallel": {"tp": 1, "pp": 1, "ep": 1, "cp": 1}}
TWO_TP = {"world_size": 2, "parallel": {"tp": 2, "pp": 1, "ep": 1, "cp": 1}}


def _refused(body, now, **kw):
    with pytest.raises(CheckpointError) as e:
        check_compatible("ck", body, now, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("checkpoint ck ")
    return msg


def test_same_layout_needs_no_resharding():
    assert check_compatible("ck", {**TWO_EP, "optimizer_format": "rank"}, TWO_EP) is None


def test_torch_sharded_state_reshards_any_layout():
    for saved, now in ((TWO_EP, ONE), (ONE, TWO_TP), (TWO_DP, ONE)):
        line = check_compatible("ck", {**saved, "optimizer_format": "torch-sharded"}, now)
        assert line.startswith("resharding checkpoint ck from world size") and "to world size" in line


def test_reshard_never_refuses_a_changed_layout():
    msg = _refused({**TWO_EP, "optimizer_format": "torch-sharded"}, ONE, reshard="never")
    assert "checkpoint.reshard=never" in msg and "world size 2" in msg and "world size 1" in msg


def test_per_rank_optimizer_state_of_older_checkpoints_is_refused_on_another_layout():
    msg = _refused(dict(TWO_EP), ONE)  # no optimizer_format: written before resharding existed
    assert "one object per rank" in msg and "checkpoint.load_optimizer=false" in msg
    # weights only: allowed
    assert check_compatible("ck", dict(TWO_EP), ONE, load_optimizer=False).startswith("resharding")


def test_distributed_optimizer_dp_reshardable_changes_dp_only():
    dp = {**TWO_DP, "optimizer_format": "megatron", "optimizer_sharding": "dp_reshardable"}
    assert check_compatible("ck", dp, ONE, sharded_optimizer=True).startswith("resharding")
    msg = _refused({**TWO_TP, "optimizer_format": "megatron", "optimizer_sharding": "dp_reshardable"}, ONE,
                   sharded_optimizer=True)
    assert "changes tp" in msg and "fully_reshardable" in msg
    full = {**TWO_TP, "optimizer_format": "megatron", "optimizer_sharding": "fully_reshardable"}
    assert check_compatible("ck", full, ONE, sharded_optimizer=True).startswith("resharding")


def test_what_makes_another_run_is_refused_whatever_the_layout():
    body = {**TWO_EP, "optimizer_format": "torch-sharded", "global_batch_size": 16, "preset": "tiny-moe:xhc"}
    msg = _refused(body, {**ONE, "global_batch_size": 32})
    assert "batch.global_batch_size=16" in msg
    msg = _refused(body, {**TWO_EP, "global_batch_size": 16, "preset": "tiny-moe:mhc"})
    assert "model.preset=tiny-moe:xhc" in msg


def test_layer_wise_sharded_muon_state_resumes_on_its_own_layout_only():
    """Megatron's own layer-wise format (written by one earlier version): same DP layout only."""
    body = {**TWO_DP, "optimizer_format": "megatron", "optimizer_sharding": "layer_wise"}
    assert check_compatible("ck", body, TWO_DP, sharded_optimizer=True) is None
    msg = _refused(body, ONE, sharded_optimizer=True)
    assert "layer-wise" in msg and "checkpoint.load_optimizer=false" in msg
    assert check_compatible("ck", body, ONE, load_optimizer=False, sharded_optimizer=True).startswith("resharding")


def test_an_optimizer_state_of_the_other_format_is_refused():
    """GPU Muon (and the CPU backend) keep one entry per parameter; GPU AdamW keeps Megatron's format."""
    muon_gpu = {**TWO_DP, "optimizer_format": "torch-sharded", "optimizer_main_params": True}
    assert check_compatible("ck", muon_gpu, ONE, optimizer_format="torch-sharded").startswith("resharding")
    msg = _refused(muon_gpu, TWO_DP, optimizer_format="megatron")
    assert "torch-sharded format" in msg and "checkpoint.load_optimizer=false" in msg
    msg = _refused({**TWO_DP, "optimizer_format": "megatron"}, TWO_DP, optimizer_format="torch-sharded")
    assert "megatron format" in msg and "AdamW on GPU" in msg
    assert check_compatible("ck", muon_gpu, TWO_DP, load_optimizer=False, optimizer_format="megatron") is None
