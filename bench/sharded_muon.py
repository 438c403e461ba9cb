"""Muon with its state sharded over data parallelism vs replicated: state bytes, Newton–Schulz time, step time.

Two parts (``training.optim``, ``use_distributed_optimizer``):

- ``bytes`` (one process, arithmetic on shapes): optimizer-state bytes per rank of ``moe-18b:xhc-muon``
  in the layout of ``configs/pretrain/moe-18b-xhc-muon.yaml`` (bf16 weights, so fp32 main copies
  (4 B) + Muon momentum (4 B) per matrix element, main + two moments (12 B) per AdamW element; the
  fp32 HC parameters have no main copy), replicated and sharded, per pipeline stage (TP rank 0): the
  planner's figures (:func:`training.plan.state_bytes`, the owners of ``training.optim``)::

      python -m bench.sharded_muon bytes
      python -m bench.sharded_muon bytes --tp 1 --pp 1   # another layout of the 64 GPUs

- ``time`` (torchrun, 2 ranks, gloo, CPU): one MoE layer of moe-18b with every width divided by
  ``--shrink`` (the router, the shared expert and 144/shrink routed experts), the attention and the
  norms, random gradients; ``--steps`` optimizer steps replicated and then sharded over DP = 2, both
  in this one run.  Prints, per rank, the Newton–Schulz seconds per step and the step seconds, and
  their ratios sharded / replicated::

      python -m torch.distributed.run --nproc_per_node 2 -m bench.sharded_muon time --shrink 4
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

from models.zoo import load_preset


def _backbone(preset="moe-18b:xhc-muon"):
    return load_preset(preset)


def _layer_params(bb, shrink=1, tp=1, ep=1, etp=1, dense=False):
    """``(name, shape, kind, expert)`` of one MoE (or ``dense``) layer's parameters on one rank (kind: muon | adamw)."""
    C = bb["hidden_size"] // shrink
    heads, groups, d = bb["num_attention_heads"], bb["num_query_groups"], bb["kv_channels"] // shrink
    F, E = bb["moe_ffn_hidden_size"] // shrink, bb["num_moe_experts"] // shrink
    Fs = bb["moe_shared_expert_intermediate_size"] // shrink
    out = [("self_attention.linear_qkv.weight", ((heads + 2 * groups) * d // tp, C), "muon", False),
           ("self_attention.linear_proj.weight", (C, heads * d // tp), "muon", False),
           ("mlp.router.weight", (bb["num_moe_experts"] // shrink, C), "muon", False),
           ("mlp.shared_experts.linear_fc1.weight", (2 * Fs // tp, C), "muon", False),
           ("mlp.shared_experts.linear_fc2.weight", (C, Fs // tp), "muon", False),
           ("input_layernorm.weight", (C,), "adamw", False), ("pre_mlp_layernorm.weight", (C,), "adamw", False)]
    if dense:
        Fd = bb["ffn_hidden_size"] // shrink
        return out[:2] + [("mlp.linear_fc1.weight", (2 * Fd // tp, C), "muon", False),
                          ("mlp.linear_fc2.weight", (C, Fd // tp), "muon", False)] + out[5:]
    for e in range(E // ep):
        out += [(f"mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * F // etp, C), "muon", True),
                (f"mlp.experts.local_experts.{e}.linear_fc2.weight", (C, F // etp), "muon", True)]
    return out


CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "pretrain",
                      "moe-18b-xhc-muon.yaml")


def state_bytes(overrides=(), world: int = 64) -> None:
    """Optimizer state per rank, replicated and sharded: :func:`training.plan.state_bytes` on the planner's
    tensor inventory, whose sharded figure takes the owners of :func:`training.optim.param_shards.shard_owner_ranks`
    (so ``tools.plan`` and this benchmark print the same bytes; tests/test_plan.py holds both to the
    real optimizer's tensors)."""
    import dataclasses
    import warnings

    from training.config import load_config
    from training.plan import (layout_from_config, load_run_preset, param_specs, planned_vocab, rank_tensors)
    from training.plan import state_bytes as plan_state_bytes

    warnings.filterwarnings("ignore")
    cfg = load_config(CONFIG, list(overrides))
    preset = load_run_preset(cfg)
    sh = layout_from_config(cfg, preset, world, gpu=True, sharded_muon=True)
    rep = dataclasses.replace(sh, sharded_muon=False, distributed_optimizer=False)  # every state on every rank
    specs = param_specs(preset, planned_vocab(cfg, preset, sh.tp))
    G = 1e9
    print(f"{cfg.model.preset}, {world} GPUs, {sh.describe()}: expert dp={sh.expert_dp}")
    print("optimizer state per rank (fp32 main + Muon momentum 8 B per bf16 matrix element, fp32 main + AdamW "
          "moments 12 B per bf16 element, moments only for the fp32 HC parameters):")
    for stage in range(sh.pp):
        tensors = rank_tensors(specs, sh, stage)
        full = plan_state_bytes(tensors, rep).optimizer
        per_rank = [plan_state_bytes(tensors, sh, dp_rank=r).optimizer for r in range(sh.dp)]
        big = max(tensors, key=lambda t: plan_state_bytes([t], rep).optimizer)
        print(f"  stage {stage} ({sum(math.prod(s) for _, s in tensors) / 1e9:.3f}B local parameters): replicated "
              f"{full / G:6.2f} GB; sharded {max(per_rank) / G:6.2f} GB on the fullest DP rank, "
              f"{min(per_rank) / G:6.2f} GB on the emptiest, {sum(per_rank) / len(per_rank) / G:6.2f} GB the mean "
              f"(fullest/replicated {max(per_rank) / full:.2f}); largest single parameter {big[0].name} "
              f"{tuple(big[1])}: {plan_state_bytes([big], rep).optimizer / G:.2f} GB (whole parameters are owned)")


def time_steps(shrink: int, steps: int) -> None:
    from training.optim import Muon, OptimizerConfig, build_optimizer

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    bb = dict(_backbone().backbone)
    bb["hidden_size"] = _backbone().hidden_size
    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    params = []
    for name, shape, kind, expert in _layer_params(bb, shrink=shrink):
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        if expert:
            p.allreduce = False
        module.register_parameter(name.replace(".", "_"), p)
        params.append((name, p))
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for _, p in params]
    named = dict(params)

    class Layer(torch.nn.Module):  # names as Megatron's (classify_param reads them)
        def named_parameters(self, *a, **k):
            return iter(named.items())

        def parameters(self, *a, **k):
            return iter(named.values())

    ns_time = [0.0, 0.0]  # wall, CPU (this process: robust on a shared machine)
    inner = Muon.newton_schulz

    def timed(*a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        out = inner(*a, **k)
        ns_time[0] += time.perf_counter() - t0
        ns_time[1] += time.process_time() - c0
        return out

    Muon.newton_schulz = staticmethod(timed)
    groups = {"dp": dist.group.WORLD, "expert_dp": dist.group.WORLD, "tp": None, "expert_tp": None}
    results = {}
    for sharded in (False, True):
        cfg = OptimizerConfig(name="muon", lr=1e-3, use_distributed_optimizer=sharded)
        opt = build_optimizer(Layer(), cfg, use_megatron=False, process_groups=groups)
        for (_, p), gr in zip(params, grads):  # warm-up step (allocates the state)
            p.grad = gr.clone()
        opt.step()
        ns_time[:] = [0.0, 0.0]
        calls0 = opt.ns_calls()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            for (_, p), gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()
        dist.barrier()
        results[sharded] = ((time.perf_counter() - t0) / steps, ns_time[0] / steps, (opt.ns_calls() - calls0) // steps,
                            opt.state_bytes(), ns_time[1] / steps, (time.process_time() - c0) / steps)
    Muon.newton_schulz = staticmethod(inner)
    rows = [None] * world
    dist.all_gather_object(rows, results)
    if rank == 0:
        n_m = sum(1 for _, p in params if p.dim() == 2)
        print(f"one moe-18b MoE layer / {shrink} ({n_m} Muon matrices, {sum(p.numel() for _, p in params) / 1e6:.2f}M "
              f"params), DP = {world} on CPU (gloo, 1 thread per rank), {steps} steps each:")
        print(f"{'rank':>4} {'':>10} {'NS s/step':>10} {'NS cpu s':>9} {'step s':>8} {'step cpu s':>10} "
              f"{'NS/step':>8} {'state MB':>9}")
        for r, res in enumerate(rows):
            for sharded in (False, True):
                step_s, ns_s, calls, nbytes, ns_cpu, step_cpu = res[sharded]
                print(f"{r:>4} {'sharded' if sharded else 'replicated':>10} {ns_s:>10.4f} {ns_cpu:>9.4f} {step_s:>8.4f} "
                      f"{step_cpu:>10.4f} {calls:>8} {nbytes / 1e6:>9.2f}")
        ratio = lambda i: max(res[True][i] for res in rows) / max(res[False][i] for res in rows)  # noqa: E731
        print(f"sharded / replicated (slowest rank): Newton–Schulz time {ratio(1):.2f}x wall, {ratio(4):.2f}x CPU; "
              f"step time {ratio(0):.2f}x wall, {ratio(5):.2f}x CPU")
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("bytes", "time"))
    ap.add_argument("--shrink", type=int, default=4, help="divide every width of the layer by this (time)")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant (time)")
    for key in ("tp", "pp", "ep"):
        ap.add_argument(f"--{key}", type=int, help=f"bytes: parallel.{key} instead of the config's")
    ap.add_argument("--world", type=int, default=64, help="bytes: GPUs (the config's layout is for 64)")
    args = ap.parse_args(argv)
    if args.what == "bytes":
        overrides = [f"parallel.{k}={getattr(args, k)}" for k in ("tp", "pp", "ep") if getattr(args, k) is not None]
        if args.tp == 1:  # sequence parallelism and TP communication overlap need TP > 1
            overrides += ["parallel.sp=false", "parallel.tp_comm_overlap=false"]
        state_bytes(overrides, args.world)
    else:
        time_steps(args.shrink, args.steps)


if __name__ == "__main__":
    main()
