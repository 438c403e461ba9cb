"""The GPU path's Muon checkpoint across layouts and between its sharded and replicated state, on CPU:
``muon_reshard_worker.py PHASE ROOT`` under torchrun with 2 ranks (PHASE ``save``, then ``grow``).

The model is tests/test_gpu_path.py's (bf16 weights, fp32 HC parameters, Megatron DDP) and the
optimizer ``training.optim.megatron``'s ``ShardedLayerWiseOptimizer``, sharded over data parallelism
(``optimizer.use_distributed_optimizer=true``, GPU's default) or replicated (``false``); every step
reads the same batch on every rank, clipping active.  The CUDA-only corners of Megatron's optimizer
run through the CPU stand-ins of tests/dist/distopt_reshard_worker.py.

- ``save`` (DP = 2): per state (sharded, replicated) 3 steps, checkpoint after step 2 in
  ROOT/dp2-<state>.  Sharded and replicated end bit-identical (the replicated state sums the grad
  norm over the same owners).  Each checkpoint loaded into the other state and stepped once equals
  the 3 steps bit for bit (sharded → replicated and back).  Parameters after 3 steps: ROOT/dp2.pt.
- ``grow`` (2 ranks): TP = 2 + SP (so DP = 1) loads each DP = 2 checkpoint and saves it again at once
  in ROOT/tp2-<state>; then DP = 2 (TP = 1) loads ROOT/tp2-sharded, saves it again in ROOT/dp2-again,
  and one step equals the uninterrupted 3 steps (ROOT/dp2.pt) bit for bit.

The test (tests/test_elastic_resume.py) reads every re-saved checkpoint whole and compares it with
the one it was loaded from.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from models.parallel import destroy_parallel, initialize_parallel
from tests.dist.distopt_reshard_worker import _cpu_stand_ins
from tests.test_gpu_path import bf16_ddp_model, gpt, params, train_step
from training.checkpoint import build_state
from training.optim import OptimizerConfig, build_optimizer

STATES = ("sharded", "replicated")


def make(state: str, parallel=None):
    model = bf16_ddp_model(parallel=parallel)
    cfg = OptimizerConfig(name="muon", lr=1e-2, clip_grad=0.5, use_distributed_optimizer=state == "sharded")
    opt = build_optimizer(model, cfg, use_megatron=True)
    assert opt.checkpoint_format == "torch-sharded" and opt.has_main_params
    assert (opt.shards is not None) == (state == "sharded")
    for g in opt.param_groups:  # what the LR scheduler sets (Megatron's groups start at the config's decay)
        g["weight_decay"] = cfg.weight_decay * g["wd_mult"]
    return model, opt


def save(model, opt, directory: str) -> None:
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(build_state([model], opt, None, None, rng=False), directory)


def load(state: str, directory: str, parallel=None):
    """A fresh model and optimizer of ``state`` with the checkpoint in ``directory`` loaded."""
    from megatron.core import dist_checkpointing

    model, opt = make(state, parallel)
    template = build_state([model], opt, None, None, rng=False, is_loading=True, optimizer_main_params=True)
    loaded = dist_checkpointing.load(template, directory)
    missing, unexpected = gpt(model).load_state_dict(loaded["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    opt.load_torch_sharded_state_dict(loaded["optimizer_torch"])
    return model, opt


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, f"{what}: {differ[:5]} differ"


def main(phase: str, root: str) -> None:
    if phase == "grow":
        initialize_parallel(tp=2, seed=1234)
    else:
        initialize_parallel(seed=1234)
    mp = pytest.MonkeyPatch()
    _cpu_stand_ins(mp)
    rank = dist.get_rank()
    try:
        if phase == "save":
            ends = {}
            for state in STATES:
                model, opt = make(state)
                for step in range(2):
                    train_step(model, opt, step)
                mains = sum(p.numel() for o in opt.megatron_optimizer.chained_optimizers for p in o.get_parameters())
                total = sum(p.numel() for p in model.parameters())
                assert 0 < mains < total if state == "sharded" else mains == total, (state, mains, total)
                save(model, opt, os.path.join(root, f"dp2-{state}"))
                train_step(model, opt, 2)
                ends[state] = params(model)
            _equal(ends["sharded"], ends["replicated"], "sharded vs replicated Muon after 3 steps")
            for src, dst in (("sharded", "replicated"), ("replicated", "sharded")):  # (each state's own resume:
                # tests/test_gpu_path.py::test_bf16_megatron_optimizer_checkpoint_round_trip)
                model, opt = load(dst, os.path.join(root, f"dp2-{src}"))
                train_step(model, opt, 2)
                _equal(params(model), ends["sharded"], f"{src} checkpoint resumed {dst}")
            if rank == 0:
                torch.save(ends["sharded"], os.path.join(root, "dp2.pt"))
        else:  # grow: TP = 2 + SP (DP = 1) loads each DP = 2 checkpoint; DP = 2 loads the TP = 2 re-save
            for state in STATES:
                model, opt = load("sharded", os.path.join(root, f"dp2-{state}"), {"tensor_model_parallel_size": 2,
                                                                                 "sequence_parallel": True})
                save(model, opt, os.path.join(root, f"tp2-{state}"))  # (no step: the tiny model's 16 tokens are
                # too few for xHC's sequence-parallel halo at SP = 2)
            destroy_parallel()
            initialize_parallel(seed=1234)
            model, opt = load("sharded", os.path.join(root, "tp2-sharded"))
            save(model, opt, os.path.join(root, "dp2-again"))
            train_step(model, opt, 2)  # back on the layout of the save: the uninterrupted run, bit for bit
            _equal(params(model), torch.load(os.path.join(root, "dp2.pt")), "DP 2 -> TP 2 -> DP 2, one step")
    finally:
        mp.undo()
    os.write(1, f"rank {rank} {phase} ok\n".encode())


if __name__ == "__main__":
    with torch._dynamo.config.patch(disable=True):
        main(*sys.argv[1:3])
