"""Megatron's distributed optimizer (AdamW's default on GPU) across a change of the DP size, on CPU:
``distopt_reshard_worker.py MODE ROOT``.

``save`` (torchrun, 2 ranks, DP = 2): the bf16 model of tests/test_gpu_path.py (fp32 HC parameters,
Megatron DDP, distributed optimizer), 2 AdamW steps on the same batch on both ranks, then one
checkpoint per ``checkpoint.optimizer_sharding`` in ROOT/dp2-<sharding>.
``load`` (one process, DP = 1): 3 uninterrupted steps (parameters to ROOT/straight.pt); then per
sharding the same model, the checkpoint loaded, saved again at once in ROOT/dp1-<sharding> (the
state as the new layout holds it), one more step, parameters to ROOT/dp1-<sharding>.pt.
The CUDA-only corners of Megatron's optimizer run on CPU through the stand-ins of tests/test_optim.py
and tests/test_gpu_path.py (installed here with pytest's MonkeyPatch).
"""

import os
import sys

import pytest
import torch

from models.parallel import initialize_parallel
from tests.test_gpu_path import bf16_ddp_model, gpt, params, train_step
from tests.test_optim import torch_with_cuda_factories_on_cpu
from training.checkpoint import build_state
from training.optim import OptimizerConfig, build_optimizer


def _cpu_stand_ins(mp: pytest.MonkeyPatch) -> None:
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.utils as mutils

    shim = torch_with_cuda_factories_on_cpu()
    for module in (mopt, mclip, mutils):
        mp.setattr(module, "torch", shim)

    def clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(coeff)

    mp.setattr(mopt, "clip_grad_by_total_norm_fp32", clip_by_total_norm)
    original = torch.Tensor.type

    def cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and not self.is_cuda:
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    mp.setattr(torch.Tensor, "type", cuda_type_name)


SHARDINGS = ("fully_reshardable", "dp_reshardable")


def _model_and_optimizer():
    cfg = OptimizerConfig(name="adamw", lr=1e-2, clip_grad=0.5, use_distributed_optimizer=True)
    model = bf16_ddp_model(distributed_optimizer=True)
    return model, build_optimizer(model, cfg, use_megatron=True)


def _save(model, opt, sharding: str, directory: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(build_state([model], opt, None, None, rng=False, optimizer_sharding=sharding), directory)


def main(mode: str, root: str) -> None:
    from megatron.core import dist_checkpointing

    initialize_parallel(seed=1234)
    mp = pytest.MonkeyPatch()
    _cpu_stand_ins(mp)
    with torch._dynamo.config.patch(disable=True):
        if mode == "save":  # DP = 2
            model, opt = _model_and_optimizer()
            for step in range(2):
                train_step(model, opt, step)
            for sharding in SHARDINGS:
                _save(model, opt, sharding, os.path.join(root, f"dp2-{sharding}"))
        else:  # DP = 1: 3 straight steps; each checkpoint loaded, saved again at once, one more step
            model, opt = _model_and_optimizer()
            for step in range(3):
                train_step(model, opt, step)
            torch.save(params(model), os.path.join(root, "straight.pt"))
            for sharding in SHARDINGS:
                model, opt = _model_and_optimizer()
                template = build_state([model], opt, None, None, rng=False, is_loading=True,
                                       optimizer_sharding=sharding)
                loaded = dist_checkpointing.load(template, os.path.join(root, f"dp2-{sharding}"))
                missing, unexpected = gpt(model).load_state_dict(loaded["model"], strict=False)
                assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
                opt.load_state_dict(loaded["optimizer"])
                _save(model, opt, sharding, os.path.join(root, f"dp1-{sharding}"))
                train_step(model, opt, 2)
                torch.save(params(model), os.path.join(root, f"dp1-{sharding}.pt"))
    mp.undo()
    os.write(1, f"rank {os.environ.get('RANK', 0)} {mode} ok\n".encode())


if __name__ == "__main__":
    main(*sys.argv[1:3])
