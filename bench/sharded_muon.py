"""Muon with its state sharded over data parallelism vs replicated: state bytes, Newton–Schulz time, step time.

Two parts (``training.optim``, ``use_distributed_optimizer``):

- ``bytes`` (one process, arithmetic on shapes): optimizer-state bytes per rank of ``moe-18b:xhc-muon``
  in the layout of ``configs/pretrain/moe-18b-xhc-muon.yaml`` (bf16 weights, so fp32 main copies
  (4 B) + Muon momentum (4 B) per matrix element, main + two moments (12 B) per AdamW element),
  replicated and sharded with :func:`training.optim.shard_owner_ranks`, for the largest pipeline stage's
  TP rank 0.  Each HC parameter set of a layer is counted as one AdamW tensor (an upper bound on the
  imbalance it adds)::

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


def state_bytes(layout=None, world: int = 64) -> None:
    import yaml

    from training.optim import shard_owner_ranks
    from xhc.accounting import hc_params_per_layer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "configs", "pretrain", "moe-18b-xhc-muon.yaml")) as f:
        run = yaml.safe_load(f)
    par = dict(run["parallel"], **(layout or {}))
    preset = _backbone(run["model"]["preset"])
    bb = dict(preset.backbone, hidden_size=preset.hidden_size)
    tp, pp, ep, etp = par["tp"], par["pp"], par["ep"], par.get("etp") or par["tp"]
    dp, edp = world // (tp * pp), world // (pp * ep * etp)
    C, L = bb["hidden_size"], preset.num_layers
    hc = int(getattr(hc_params_per_layer(preset.hc, C), "total", 0) or 0)
    vocab = run["tokenizer"]["padded_vocab_size"]
    # the last stage: L/pp MoE layers and the output layer (the first stage has the dense layer and the
    # embedding instead: as large); with pp = 1 the one stage has both
    items = []
    for layer in range(L // pp):
        dense = pp == 1 and layer < bb.get("first_dense_layers", 0)
        for name, shape, kind, expert in _layer_params(bb, tp=tp, ep=ep, etp=etp, dense=dense):
            items.append((f"{layer}.{name}", shape, kind, expert))
        items.append((f"{layer}.hyper_connection", (hc,), "adamw", False))
    items.append(("output_layer.weight", (vocab // tp, C), "adamw", False))
    if pp == 1:
        items.append(("embedding.word_embeddings.weight", (vocab // tp, C), "adamw", False))
    per_elem = {"muon": 8, "adamw": 12}
    fake = []
    for name, shape, kind, expert in items:
        p = torch.empty(shape, device="meta")
        if expert:
            p.allreduce = False
        if kind == "muon" and len(shape) == 2 and not name.endswith("router.weight"):
            p.tensor_model_parallel, p.partition_dim = True, 0 if "fc1" in name or "qkv" in name else 1
        fake.append((p, kind))
    owners = shard_owner_ranks(fake, dp, edp, tp_size=tp, expert_tp_size=etp)
    full = sum(p.numel() * per_elem[k] for p, k in fake)
    loads_d, loads_e = [0] * dp, [0] * edp
    for (p, k), o in zip(fake, owners):
        b = p.numel() * per_elem[k]
        if getattr(p, "allreduce", True) is False:
            loads_e[o] += b
        else:
            loads_d[o] += b
    # dense DP rank r is global rank tp·r of the stage (TP rank 0); Megatron orders the expert groups
    # etp-ep-dp, so that rank is expert-DP rank (tp·r) // (etp·ep)
    per_rank = [loads_d[r] + loads_e[(tp * r) // (etp * ep)] for r in range(dp)]
    G = 1e9
    print(f"moe-18b:xhc-muon, {world} GPUs, tp={tp} pp={pp} ep={ep} etp={etp}: dp={dp}, expert dp={edp}; "
          f"{'last stage' if pp > 1 else 'the one stage'}, tp rank 0: {sum(p.numel() for p, _ in fake) / 1e9:.3f}B local parameters")
    print(f"optimizer state per rank (fp32 main + Muon momentum 8 B, fp32 main + AdamW moments 12 B per element):")
    print(f"  replicated  {full / G:6.2f} GB on every rank")
    print(f"  sharded     {max(per_rank) / G:6.2f} GB on the fullest rank, {min(per_rank) / G:6.2f} GB on the "
          f"emptiest, {sum(loads_d) / dp / G + sum(loads_e) / edp / G:6.2f} GB an even split  "
          f"(ratio fullest/replicated {max(per_rank) / full:.2f})")
    big = max(fake, key=lambda t: t[0].numel() * per_elem[t[1]])
    print(f"  largest single parameter: {tuple(big[0].shape)} {big[1]}, {big[0].numel() * per_elem[big[1]] / G:.2f} GB "
          "(whole parameters are owned: its owner holds all of it)")


def time_steps(shrink: int, steps: int) -> None:
    import training.optim as optim

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
    inner = optim.newton_schulz

    def timed(*a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        out = inner(*a, **k)
        ns_time[0] += time.perf_counter() - t0
        ns_time[1] += time.process_time() - c0
        return out

    optim.newton_schulz = timed
    groups = {"dp": dist.group.WORLD, "expert_dp": dist.group.WORLD, "tp": None, "expert_tp": None}
    results = {}
    for sharded in (False, True):
        cfg = optim.OptimizerConfig(name="muon", lr=1e-3, use_distributed_optimizer=sharded)
        opt = optim.build_optimizer(Layer(), cfg, use_megatron=False, process_groups=groups)
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
    optim.newton_schulz = inner
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
        layout = {k: getattr(args, k) for k in ("tp", "pp", "ep") if getattr(args, k) is not None}
        if "tp" in layout:
            layout["etp"] = layout["tp"]
        state_bytes(layout, args.world)
    else:
        time_steps(args.shrink, args.steps)


if __name__ == "__main__":
    main()
